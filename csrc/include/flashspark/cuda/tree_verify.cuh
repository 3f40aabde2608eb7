// CUDA kernel of `tree_verify`: verify's four launches with the tree's walk (sizes only decide
// every shape: CUDA-graph safe; nothing synchronizes with the host).
//   1. verify_tiles_kernel      grid (chunks, N): every node row's tiles at once (its softmax
//                               partials, or its argmax when greedy), as verify's rows.
//   2. tree_walk_kernel         a warp per request: its checks (lane 0), then the walk over the
//                               merged partials (tree_walk, as on the CPU).
//   3. verify_race_kernel       grid (chunks, B): the race over each stop row's chunks (race_stop).
//   4. verify_finish_kernel     a warp per request: merges the race partials, writes the outputs.
// Bytes read: every node row once, plus each stop row again.
#pragma once

#include "flashspark/cuda/verify.cuh"
#include "flashspark/tree_verify.h"

namespace flashspark::cuda {

// 2. ---------------------------------------------------------------------------------------

template <class T>
__global__ void __launch_bounds__(32 * kVerifyWalkWarps) tree_walk_kernel(TreeVerifyParams<T> p) {
  const int32_t b = int32_t(blockIdx.x) * kVerifyWalkWarps + int32_t(threadIdx.x / 32);
  if (b >= p.batch) return;  // warp-uniform
  const int32_t lane = int32_t(threadIdx.x % 32);
  const TreeVerifyWorkspace ws = tree_verify_workspace(p);
  const int32_t chunks = verify_chunks(p.vocab);
  // The checks write the request's depths: lane 0 alone, its verdict shared. Bad input fails
  // this request alone (status, -1 outputs); the kernel never traps.
  int32_t checked = 0;
  if (lane == 0) checked = int32_t(tree_check_request(p, b));
  checked = __shfl_sync(0xffffffffu, checked, 0);
  const int64_t width = p.max_depth + 1;
  int32_t* nodes = p.out_nodes + int64_t(b) * width;
  int32_t* tokens = p.out_tokens + int64_t(b) * width;
  for (int64_t i = lane; i < width; i += 32) nodes[i] = tokens[i] = -1;
  __syncwarp();
  // a request that failed its checks never reads cu beyond its own two entries
  const int64_t first = Status(checked) == Status::kOk ? p.cu_num_nodes[b] : 0;
  VerifyMergedBackend<T> be{ws.rows + first * chunks, chunks, lane};
  const TreeWalk w = tree_walk(p, b, Status(checked), be);
  if (lane == 0) ws.walks[b] = w;
  if (w.status != Status::kOk || !w.race) tree_finish(p, b, w, race_identity(), lane == 0);
}

// p.workspace: tree_verify_workspace_bytes(...) bytes; the depths and child lists live there.
template <class T>
cudaError_t launch_tree_verify(const TreeVerifyParams<T>& params, cudaStream_t stream, int64_t max_grid_y) {
  TreeVerifyParams<T> p = params;
  p.scratch = tree_verify_workspace(p).scratch;
  max_grid_y = std::max<int64_t>(1, std::min(max_grid_y, kMaxGridY));
  if (p.batch == 0) return cudaSuccess;
  const int64_t chunks = verify_chunks(p.vocab);
  const int64_t num_rows = p.num_nodes;
  const unsigned requests = unsigned(ceil_div(p.batch, kVerifyWalkWarps));
  if (num_rows > 0)
    verify_tiles_kernel<TreeVerifyParams<T>, kVerifyThreads>
        <<<dim3(unsigned(chunks), unsigned(std::min(num_rows, max_grid_y))), kVerifyThreads, 0, stream>>>(p, num_rows);
  tree_walk_kernel<T><<<requests, 32 * kVerifyWalkWarps, 0, stream>>>(p);
  verify_race_kernel<TreeVerifyParams<T>, kVerifyThreads>
      <<<dim3(unsigned(chunks), unsigned(std::min<int64_t>(p.batch, max_grid_y))), kVerifyThreads, 0, stream>>>(p);
  verify_finish_kernel<TreeVerifyParams<T>><<<requests, 32 * kVerifyWalkWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashspark::cuda
