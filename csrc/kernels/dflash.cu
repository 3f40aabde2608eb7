// Instantiates the DFlash CUDA launchers for fp32, bf16 and fp16.
#include "flashspark/cuda/dflash.cuh"

namespace flashspark::cuda {

#define FS_INSTANTIATE(T)                                                                 \
  template cudaError_t launch_inject_context_kv<T>(const InjectParams<T>&, cudaStream_t); \
  template cudaError_t launch_block_diffusion_attention<T>(const BlockAttnParams<T>&, cudaStream_t);
FS_INSTANTIATE(float)
FS_INSTANTIATE(bfloat16_t)
FS_INSTANTIATE(float16_t)
#undef FS_INSTANTIATE

}  // namespace flashspark::cuda
