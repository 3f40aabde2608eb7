// CUDA kernels of markov_step.
//   1. markov_tile_kernel: a warp per vocabulary row v (grid-strided); its W2
//      row is read once, coalesced, into registers and dotted with every
//      request's W1[x_{k-1}] (staged in shared memory), so W2 is read once per
//      step for the whole batch. Each warp keeps per-request partials
//      (online softmax + race leader), lane b % 32 owning request b.
//   2. markov_combine_kernel: a block per request merges the warps' partials
//      (CUB BlockReduce), picks the token and computes the confidence.
//   3. markov_normalize_kernel: q = exp(z - lse), or one-hot at T = 0.
#pragma once

#include <cub/block/block_reduce.cuh>

#include "flashspark/cuda/common.cuh"
#include "flashspark/cuda/launch.h"
#include "flashspark/dspark.h"

namespace flashspark::cuda {

constexpr int kMarkovWarps = 8;
constexpr int kMarkovMaxRankPerLane = 16;  // rank <= 512
constexpr int kMarkovMaxSlots = 8;         // batch <= 256
constexpr int kMarkovBatchChunk = 32;      // requests staged in shared memory at once
constexpr int kMarkovMaxBlocks = 1024;

inline int32_t markov_num_blocks_cuda(int64_t vocab) {
  return int32_t(std::min<int64_t>(kMarkovMaxBlocks, ceil_div(vocab, kMarkovWarps)));
}

template <class T>
__global__ void __launch_bounds__(kMarkovWarps * 32) markov_tile_kernel(MarkovParams<T> p) {
  extern __shared__ float e_smem[];  // [kMarkovBatchChunk][rank]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t R = p.rank, B = p.batch;
  MarkovPartial part[kMarkovMaxSlots];
#pragma unroll
  for (int s = 0; s < kMarkovMaxSlots; ++s) part[s] = markov_partial_identity();
  const int64_t stride = int64_t(gridDim.x) * kMarkovWarps;
  for (int64_t v0 = int64_t(blockIdx.x) * kMarkovWarps; v0 < p.vocab; v0 += stride) {
    const int64_t v = v0 + warp;
    float w[kMarkovMaxRankPerLane];
#pragma unroll
    for (int e = 0; e < kMarkovMaxRankPerLane; ++e) {
      const int32_t i = lane + 32 * e;
      w[e] = (v < p.vocab && i < R) ? to_float(p.w2[v * R + i]) : 0.f;
    }
    for (int32_t b0 = 0; b0 < B; b0 += kMarkovBatchChunk) {
      const int32_t nb = min(kMarkovBatchChunk, B - b0);
      __syncthreads();
      for (int32_t idx = threadIdx.x; idx < nb * R; idx += blockDim.x) {
        const int32_t bb = idx / R, i = idx % R;
        const int32_t prev = p.prev_tokens[b0 + bb];  // out of range: the request fails in the combine kernel
        e_smem[idx] = prev >= 0 && prev < p.vocab ? to_float(p.w1[int64_t(prev) * R + i]) : 0.f;
      }
      __syncthreads();
      if (v >= p.vocab) continue;
      for (int32_t bb = 0; bb < nb; ++bb) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < kMarkovMaxRankPerLane; ++e) {
          const int32_t i = lane + 32 * e;
          if (i < R) d += w[e] * e_smem[bb * R + i];
        }
        d = warp_allreduce_sum(d);
        const int32_t b = b0 + bb;
        if (lane == b % 32) {
          const float z = markov_logit(p, b, int32_t(v), d);
          p.out_q[int64_t(b) * p.vocab + v] = z;
          markov_add(p, b, markov_scale(p, b), part[b / 32], int32_t(v), z);
        }
      }
    }
  }
  const int64_t partial_row = int64_t(blockIdx.x) * kMarkovWarps + warp;
  for (int32_t b = lane; b < B; b += 32)
    markov_store_partial(p.partial + (partial_row * B + b) * kMarkovSlot, part[b / 32]);
}

constexpr int kMarkovCombineThreads = 256;

template <class T>
__global__ void __launch_bounds__(kMarkovCombineThreads) markov_combine_kernel(MarkovParams<T> p) {
  using PartReduce = cub::BlockReduce<MarkovPartial, kMarkovCombineThreads>;
  using SumReduce = cub::BlockReduce<float, kMarkovCombineThreads>;
  __shared__ union {
    typename PartReduce::TempStorage part;
    typename SumReduce::TempStorage sum;
  } temp;
  __shared__ Status checked;
  const int32_t b = blockIdx.x;
  // Bad input fails this request alone (status, token -1, q 0); the kernel never traps.
  if (threadIdx.x == 0) checked = markov_check_request(p, b);
  const MarkovScale sc = markov_scale(p, b);
  const float inv_t = sc.inv_t;
  MarkovPartial acc = markov_partial_identity();
  for (int32_t i = threadIdx.x; i < p.num_partials; i += blockDim.x)
    acc = markov_partial_merge(acc, markov_load_partial(p.partial + (int64_t(i) * p.batch + b) * kMarkovSlot), inv_t);
  acc = PartReduce(temp.part).Reduce(acc, MarkovMergeOp{inv_t});
  __syncthreads();  // `checked` is visible, and the scratch is free for the next reduction
  const Status st = checked;
  const float conf = st == Status::kOk ? SumReduce(temp.sum).Sum(markov_conf_dot(
                                             p, b, int32_t(threadIdx.x), p.hidden_size + p.rank, int32_t(blockDim.x)))
                                       : 0.f;
  if (threadIdx.x == 0) {
    const MarkovOutcome o = markov_outcome(sc, acc, st);
    p.out_tokens[b] = o.token;
    p.out_conf[b] = st == Status::kOk ? sigmoid(conf + p.conf_b[0]) : 0.f;
    float* stats = p.row_stats + int64_t(b) * kMarkovRowStats;
    stats[0] = o.m;
    stats[1] = o.log_s;
    stats[2] = bits_to_float(uint32_t(o.token));
    stats[3] = bits_to_float(uint32_t(o.mode));
    write_status(p.status, b, st);
  }
}

template <class T>
__global__ void markov_normalize_kernel(MarkovParams<T> p) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.batch) * p.vocab) return;
  const int32_t b = int32_t(idx / p.vocab), v = int32_t(idx % p.vocab);
  const float* stats = p.row_stats + int64_t(b) * kMarkovRowStats;
  const MarkovOutcome o{int32_t(float_to_bits(stats[2])), MarkovQ(int32_t(float_to_bits(stats[3]))), stats[0],
                        stats[1]};
  p.out_q[idx] = markov_q(o, markov_scale(p, b).inv_t, v, p.out_q[idx]);
}

template <class T>
cudaError_t launch_markov_step(const MarkovParams<T>& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.rank > 32 * kMarkovMaxRankPerLane || p.batch > 32 * kMarkovMaxSlots) return cudaErrorInvalidValue;
  const size_t smem = sizeof(float) * kMarkovBatchChunk * p.rank;
  if (smem > 48 * 1024) {  // rank > 384: above the default dynamic shared-memory limit
    const cudaError_t e =
        cudaFuncSetAttribute(markov_tile_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  markov_tile_kernel<T><<<unsigned(markov_num_blocks_cuda(p.vocab)), kMarkovWarps * 32, smem, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  markov_combine_kernel<T><<<unsigned(p.batch), kMarkovCombineThreads, 0, stream>>>(p);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const int64_t n = int64_t(p.batch) * p.vocab;
  markov_normalize_kernel<T><<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashspark::cuda
