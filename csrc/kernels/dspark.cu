// Instantiates the DSpark CUDA launcher for fp32, bf16 and fp16.
#include "flashspark/cuda/dspark.cuh"

namespace flashspark::cuda {

template cudaError_t launch_markov_step<float>(const MarkovParams<float>&, cudaStream_t);
template cudaError_t launch_markov_step<bfloat16_t>(const MarkovParams<bfloat16_t>&, cudaStream_t);
template cudaError_t launch_markov_step<float16_t>(const MarkovParams<float16_t>&, cudaStream_t);

int32_t markov_num_partials(int64_t vocab) { return markov_num_blocks_cuda(vocab) * kMarkovWarps; }

}  // namespace flashspark::cuda
