// Instantiates the `tree_verify` CUDA launcher for the supported logit dtypes.
#include "flashspark/cuda/tree_verify.cuh"

namespace flashspark::cuda {

template cudaError_t launch_tree_verify<float>(const TreeVerifyParams<float>&, cudaStream_t, int64_t);
template cudaError_t launch_tree_verify<bfloat16_t>(const TreeVerifyParams<bfloat16_t>&, cudaStream_t, int64_t);
template cudaError_t launch_tree_verify<float16_t>(const TreeVerifyParams<float16_t>&, cudaStream_t, int64_t);

}  // namespace flashspark::cuda
