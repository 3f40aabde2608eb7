// CUDA kernel of `verify`: four launches whose shapes depend on sizes only (CUDA-graph safe),
// none of which synchronizes with the host.
//   1. verify_tiles_kernel   grid (chunks, logits rows): every (row, chunk) tile of the batch at
//                            once; its online softmax at the temperature of the request that
//                            owns the row (sampled, logits) or its argmax (greedy). Probabilities
//                            sampled: nothing (the walk reads p(draft) alone).
//   2. verify_walk_kernel    a warp per request: merges each row's partials in chunk order (a
//                            fixed butterfly, so every lane holds the same value) as it walks the
//                            accept tests to the stop row (verify_walk, as on the CPU).
//   3. verify_race_kernel    grid (chunks, B): the race over each stop row's chunks.
//   4. verify_finish_kernel  a warp per request: merges the race partials, writes the outputs.
// Bytes read: every row of the batch once, plus each stop row again (and its dense q row):
// (k + 2) / (k + 1) passes over the logits, none of them serial.
#pragma once

#include <algorithm>

#include <cub/block/block_reduce.cuh>

#include "flashspark/cuda/common.cuh"
#include "flashspark/cuda/launch.h"
#include "flashspark/verify.h"

namespace flashspark::cuda {

constexpr int kVerifyThreads = 256;   // 16 elements per thread and tile
constexpr int kVerifyWalkWarps = 4;   // requests per block of the walk and finish kernels
constexpr int64_t kMaxGridY = 65535;  // the hardware's bound; blocks then loop over the rest

// Lane exchange of the reduction states (field by field).
__device__ __forceinline__ ArgMax shfl_xor(const ArgMax& a, int o) {
  return ArgMax{__shfl_xor_sync(0xffffffffu, a.v, o), __shfl_xor_sync(0xffffffffu, a.i, o)};
}
__device__ __forceinline__ SoftmaxState shfl_xor(const SoftmaxState& a, int o) {
  return SoftmaxState{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
}
__device__ __forceinline__ RaceResult shfl_xor(const RaceResult& a, int o) {
  return RaceResult{shfl_xor(a.residual, o), shfl_xor(a.target, o), __shfl_xor_sync(0xffffffffu, a.bad, o)};
}

// A warp's merge of its lanes' states: a butterfly of a commutative merge, so every lane ends
// with the same value, in an order fixed by the sizes alone.
template <class S, class Merge>
__device__ __forceinline__ S warp_merge(S x, const Merge& merge) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = merge(x, shfl_xor(x, o));
  return x;
}

// 1. ---------------------------------------------------------------------------------------

// Serves verify and tree_verify alike (P: VerifyParams<T> or TreeVerifyParams<T>): a row's
// owner and the partials' place come from tiles_row_owner / workspace_of.
template <class P, int kThreads>
__global__ void __launch_bounds__(kThreads) verify_tiles_kernel(P p, int64_t num_rows) {
  using T = typename P::Value;
  using ArgMaxReduce = cub::BlockReduce<ArgMax, kThreads>;
  using SoftmaxReduce = cub::BlockReduce<SoftmaxState, kThreads>;
  __shared__ union {
    typename ArgMaxReduce::TempStorage argmax;
    typename SoftmaxReduce::TempStorage softmax;
  } scratch;
  VerifyRowPartial* const partials = workspace_of(p).rows;
  const int32_t chunks = verify_chunks(p.vocab);
  const int64_t c = blockIdx.x;
  const int64_t begin = c * kVerifyChunk, end = min(int64_t(p.vocab), begin + kVerifyChunk);
  for (int64_t r = blockIdx.y; r < num_rows; r += gridDim.y) {  // block-uniform from here on
    // The request the row belongs to; none (a malformed cu_num_draft): nothing to reduce, and no
    // request that passes its checks reads it (verify_check_request).
    const int32_t b = tiles_row_owner(p, r);
    if (b < 0) continue;
    const float temp = p.temperature[b];
    const bool greedy = temperature_greedy(temp);
    if (!greedy && p.target_probs) continue;
    const T* row = p.logits + r * p.logits_row_stride;
    const bool vec_ok = aligned4(row);  // begin is a multiple of 4
    VerifyRowPartial part{softmax_identity(), argmax_identity()};
    if (greedy) {
      ArgMax a = argmax_identity();
      for (int64_t base = begin + 4 * int64_t(threadIdx.x); base < end; base += 4 * kThreads) {
        float v[4];
        load4(row, base, end, vec_ok, v);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (base + j < end) argmax_add(a, p.target_probs ? greedy_prob(v[j]) : greedy_logit(v[j]), int32_t(base + j));
      }
      part.am = ArgMaxReduce(scratch.argmax).Reduce(a, ArgMaxMergeOp{});
    } else {
      const float inv_t = 1.f / temp;
      SoftmaxState st = softmax_identity();
      for (int64_t base = begin + 4 * int64_t(threadIdx.x); base < end; base += 4 * kThreads) {
        float v[4];
        load4(row, base, end, vec_ok, v);
#pragma unroll
        for (int j = 0; j < 4; ++j) softmax_add(st, v[j], inv_t);
      }
      part.st = SoftmaxReduce(scratch.softmax).Reduce(st, SoftmaxMergeOp{inv_t});
    }
    if (threadIdx.x == 0) partials[r * chunks + c] = part;  // CUB's aggregate is thread 0's
    __syncthreads();                                        // the scratch is reused next row
  }
}

// 2. ---------------------------------------------------------------------------------------

// The walk's rows, from the tiles' partials: lane l merges chunks l, l + 32, ... in order.
template <class T>
struct VerifyMergedBackend {
  const VerifyRowPartial* rows;  // request b's row 0, chunk 0
  int32_t chunks;
  int32_t lane;

  __device__ bool leader() const { return lane == 0; }

  __device__ ArgMax row_argmax(const T*, int32_t k, bool) const {
    ArgMax a = argmax_identity();
    for (int32_t c = lane; c < chunks; c += 32) a = argmax_merge(a, rows[int64_t(k) * chunks + c].am);
    return warp_merge(a, ArgMaxMergeOp{});
  }

  __device__ SoftmaxState row_softmax(const T*, int32_t k, float inv_t) const {
    SoftmaxState st = softmax_identity();
    for (int32_t c = lane; c < chunks; c += 32) st = softmax_merge(st, rows[int64_t(k) * chunks + c].st, inv_t);
    return warp_merge(st, SoftmaxMergeOp{inv_t});
  }
};

template <class T>
__global__ void __launch_bounds__(32 * kVerifyWalkWarps) verify_walk_kernel(VerifyParams<T> p, int32_t num_tokens) {
  const int32_t b = int32_t(blockIdx.x) * kVerifyWalkWarps + int32_t(threadIdx.x / 32);
  if (b >= p.batch) return;  // warp-uniform
  const int32_t lane = int32_t(threadIdx.x % 32);
  const VerifyWorkspace ws = verify_workspace(p);
  const int32_t chunks = verify_chunks(p.vocab);
  // Bad input fails this request alone (status, -1 outputs); the kernel never traps.
  const Status checked = verify_check_request(p, b, num_tokens);  // every lane: the same reads
  int32_t* out = p.out_tokens + int64_t(b) * (p.max_spec_len + 1);
  for (int32_t i = lane; i <= p.max_spec_len; i += 32) out[i] = -1;
  __syncwarp();
  VerifyMergedBackend<T> be{ws.rows + verify_row_start(p, b) * chunks, chunks, lane};
  const VerifyWalk w = verify_walk(p, b, checked, be);
  if (lane == 0) ws.walks[b] = w;
  if (w.status != Status::kOk || !w.race) verify_finish(p, b, w, race_identity(), lane == 0);
}

// 3. ---------------------------------------------------------------------------------------

template <class T, int kThreads, class Add>
__device__ RaceResult chunk_race(const T* row, int64_t begin, int64_t end, const Add& add, uint64_t seed,
                                 uint64_t position) {
  const bool vec_ok = aligned4(row);
  RaceResult r = race_identity();
  for (int64_t base = begin + 4 * int64_t(threadIdx.x); base < end; base += 4 * kThreads) {
    float v[4];
    load4(row, base, end, vec_ok, v);
    const U32x4 bits = philox_block(seed, position, kPurposeResample, uint32_t(base >> 2));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (base + j < end) add(r, int32_t(base + j), v[j], lane(bits, uint32_t(j)));
  }
  return r;
}

// Serves both ops (P as the tiles kernel's): the stop row, its q and stream from race_stop.
template <class P, int kThreads>
__global__ void __launch_bounds__(kThreads) verify_race_kernel(P p) {
  using T = typename P::Value;
  using RaceReduce = cub::BlockReduce<RaceResult, kThreads>;
  __shared__ typename RaceReduce::TempStorage scratch;
  const auto ws = workspace_of(p);
  const int32_t chunks = verify_chunks(p.vocab);
  const int64_t c = blockIdx.x;
  const int64_t begin = c * kVerifyChunk, end = min(int64_t(p.vocab), begin + kVerifyChunk);
  for (int64_t bb = blockIdx.y; bb < p.batch; bb += gridDim.y) {
    const int32_t b = int32_t(bb);
    const auto w = ws.walks[b];
    if (w.status != Status::kOk || !w.race) continue;  // block-uniform
    const StopRow<T> s = race_stop(p, b, w);
    const RaceResult r = p.target_probs
                             ? chunk_race<T, kThreads>(s.row, begin, end, ProbRace{s.q}, s.seed, s.position)
                             : chunk_race<T, kThreads>(s.row, begin, end, LogitRace{s.q, w.sm}, s.seed, s.position);
    const RaceResult total = RaceReduce(scratch).Reduce(r, RaceMergeOp{});
    if (threadIdx.x == 0) ws.races[int64_t(b) * chunks + c] = total;
    __syncthreads();
  }
}

// 4. ---------------------------------------------------------------------------------------

template <class P>
__global__ void __launch_bounds__(32 * kVerifyWalkWarps) verify_finish_kernel(P p) {
  const int32_t b = int32_t(blockIdx.x) * kVerifyWalkWarps + int32_t(threadIdx.x / 32);
  if (b >= p.batch) return;
  const int32_t lane = int32_t(threadIdx.x % 32);
  const auto ws = workspace_of(p);
  const int32_t chunks = verify_chunks(p.vocab);
  const auto w = ws.walks[b];
  if (w.status != Status::kOk || !w.race) return;  // finished by the walk
  RaceResult r = race_identity();
  for (int32_t c = lane; c < chunks; c += 32) r = race_merge(r, ws.races[int64_t(b) * chunks + c]);
  r = warp_merge(r, RaceMergeOp{});
  finish_request(p, b, w, r, lane == 0);
}

template <class T>
cudaError_t launch_verify(const VerifyParams<T>& p, int32_t num_tokens, cudaStream_t stream, int64_t max_grid_y) {
  max_grid_y = std::max<int64_t>(1, std::min(max_grid_y, kMaxGridY));
  if (p.batch == 0) return cudaSuccess;
  const int64_t chunks = verify_chunks(p.vocab);
  const int64_t num_rows = int64_t(num_tokens) + (p.bonus_tokens ? 0 : p.batch);
  const unsigned requests = unsigned(ceil_div(p.batch, kVerifyWalkWarps));
  verify_tiles_kernel<VerifyParams<T>, kVerifyThreads>
      <<<dim3(unsigned(chunks), unsigned(std::max<int64_t>(1, std::min(num_rows, max_grid_y)))), kVerifyThreads, 0,
         stream>>>(p, num_rows);
  verify_walk_kernel<T><<<requests, 32 * kVerifyWalkWarps, 0, stream>>>(p, num_tokens);
  verify_race_kernel<VerifyParams<T>, kVerifyThreads>
      <<<dim3(unsigned(chunks), unsigned(std::min<int64_t>(p.batch, max_grid_y))), kVerifyThreads, 0, stream>>>(p);
  verify_finish_kernel<VerifyParams<T>><<<requests, 32 * kVerifyWalkWarps, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashspark::cuda
