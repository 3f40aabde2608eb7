// Instantiates the DFlash 2 CUDA launchers for fp32, bf16 and fp16.
#include "flashspark/cuda/dflash2.cuh"

namespace flashspark::cuda {

#define FS_INSTANTIATE(T)                                                            \
  template cudaError_t launch_two_tap_conv<T>(const TwoTapParams<T>&, cudaStream_t); \
  template cudaError_t launch_topk_select<T>(const TopKParams<T>&, cudaStream_t);    \
  template cudaError_t launch_path_select<T>(const PathParams<T>&, cudaStream_t);
FS_INSTANTIATE(float)
FS_INSTANTIATE(bfloat16_t)
FS_INSTANTIATE(float16_t)
#undef FS_INSTANTIATE

}  // namespace flashspark::cuda
