// Instantiates the `verify` CUDA launcher for the supported logit dtypes.
#include "flashspark/cuda/verify.cuh"

namespace flashspark::cuda {

template cudaError_t launch_verify<float>(const VerifyParams<float>&, int32_t, cudaStream_t, int64_t);
template cudaError_t launch_verify<bfloat16_t>(const VerifyParams<bfloat16_t>&, int32_t, cudaStream_t, int64_t);
template cudaError_t launch_verify<float16_t>(const VerifyParams<float16_t>&, int32_t, cudaStream_t, int64_t);

}  // namespace flashspark::cuda
