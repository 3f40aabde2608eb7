// Host-side declarations of the CUDA launchers. Includable from plain C++
// (the torch binding layer is compiled by the host compiler); the kernels
// themselves are instantiated in csrc/kernels/*.cu by nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include "flashspark/dflash.h"
#include "flashspark/dflash2.h"
#include "flashspark/dspark.h"
#include "flashspark/tree_verify.h"
#include "flashspark/verify.h"

namespace flashspark::cuda {

// max_grid_y: at most this many blocks along the batch (the hardware's 65535 by default; smaller
// makes blocks loop over several rows or requests, as the largest batches do).
template <class T>
cudaError_t launch_verify(const VerifyParams<T>& p, int32_t num_tokens, cudaStream_t stream,
                          int64_t max_grid_y = 65535);

template <class T>
cudaError_t launch_tree_verify(const TreeVerifyParams<T>& p, cudaStream_t stream, int64_t max_grid_y = 65535);

template <class T>
cudaError_t launch_inject_context_kv(const InjectParams<T>& p, cudaStream_t stream);

template <class T>
cudaError_t launch_block_diffusion_attention(const BlockAttnParams<T>& p, cudaStream_t stream);

template <class T>
cudaError_t launch_two_tap_conv(const TwoTapParams<T>& p, cudaStream_t stream);

template <class T>
cudaError_t launch_topk_select(const TopKParams<T>& p, cudaStream_t stream);

template <class T>
cudaError_t launch_path_select(const PathParams<T>& p, cudaStream_t stream);

template <class T>
cudaError_t launch_markov_step(const MarkovParams<T>& p, cudaStream_t stream);

// Number of per-request partials markov_step's CUDA kernel leaves (workspace rows).
int32_t markov_num_partials(int64_t vocab);

}  // namespace flashspark::cuda
