// CUDA kernels of the DFlash 2 ops.
//   two_tap_conv: one thread per (row, 4 channels), 4-wide vectorized loads of x;
//                 with a norm weight, first one warp per row for its RMSNorm scale;
//                 with a delta_weight, then one warp per (row, tap) for the projection
//                 (2G taps, or 4G with the finish conv's, written to finish_delta there).
//   topk_select: one block per row; per-thread Top-K lists + online softmax,
//                merged by a CUB BlockReduce with the same merge as the CPU.
//   path_select: one block per request; threads share the K x K pair scores,
//                the leader runs the DP / greedy / sampled step; with a g_weight,
//                first one warp per (row, rank index) for g = W_h h.
#pragma once

#include <cub/block/block_reduce.cuh>

#include "flashspark/cuda/common.cuh"
#include "flashspark/cuda/launch.h"
#include "flashspark/dflash2.h"

namespace flashspark::cuda {

constexpr int kConvThreads = 256;

template <class T>
__global__ void __launch_bounds__(kConvThreads) two_tap_conv_kernel(TwoTapParams<T> p) {
  const int64_t quads = ceil_div(p.channels, 4);
  const int64_t idx = int64_t(blockIdx.x) * kConvThreads + threadIdx.x;
  if (idx >= p.rows * quads) return;
  const int64_t t = idx / quads;
  const int32_t c0 = int32_t(idx % quads) * 4;
  T* out = p.out + t * p.channels;
  if (p.cu_blocks && p.status[0] != int32_t(Status::kOk)) {  // bad offsets: no neighbour row is read
    for (int32_t c = c0; c < min(c0 + 4, p.channels); ++c) out[c] = from_float<T>(NAN);
    return;
  }
  const bool first = conv_first_in_block(p, t);
  const T* x = p.x + t * p.x_stride;
  float cur[4], left[4] = {0.f, 0.f, 0.f, 0.f};
  load4(x, c0, p.channels, aligned4(x), cur);
  if (!first) load4(x - p.x_stride, c0, p.channels, aligned4(x - p.x_stride), left);
  const int32_t G = p.groups(), S = p.group_size;
  const float s = p.norm_weight ? p.row_scale_ws[t] : 1.f;
  const float s_left = p.norm_weight && !first ? p.row_scale_ws[t - 1] : 1.f;
  // The group of c0 by one division; the next channels step through it (S may be any size).
  int32_t g = c0 / S, in_group = c0 - g * S;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int32_t c = c0 + j;
    if (c >= p.channels) break;
    float y = (to_float(p.base[c]) + two_tap_delta(p, t, g)) * two_tap_input(p, cur[j], s, c);
    if (!first)
      y += (to_float(p.base[p.channels + c]) + two_tap_delta(p, t, G + g)) * two_tap_input(p, left[j], s_left, c);
    if (p.residual) y += to_float(p.residual[t * p.res_stride + c]);
    out[c] = from_float<T>(y);
    if (++in_group == S) {  // the next channel starts the next group
      in_group = 0;
      ++g;
    }
  }
}

// The fused RMSNorm's row scales: one warp per row, lanes stride the channels.
template <class T>
__global__ void __launch_bounds__(kConvThreads) two_tap_norm_kernel(TwoTapParams<T> p) {
  const int32_t lane = threadIdx.x % 32;
  const int64_t t = (int64_t(blockIdx.x) * kConvThreads + threadIdx.x) / 32;
  if (t >= p.rows) return;  // whole warps exit together
  const T* x = p.x + t * p.x_stride;
  float ss = 0.f;
  for (int32_t c = lane; c < p.channels; c += 32) {
    const float v = to_float(x[c]);
    ss += v * v;
  }
  ss = warp_allreduce_sum(ss);
  if (lane == 0) p.row_scale_ws[t] = rms_inv(ss, p.channels, p.norm_eps);
}

// The fused projection: one warp per (row t, tap i), lanes stride the channels, then a
// butterfly sum; writes delta_ws[t, i] for the conv kernel that follows on the stream, and
// taps i >= 2G (the finish conv's) to finish_delta in T, NaN when the call failed (its
// check ran before on the stream), as on the CPU.
template <class T>
__global__ void __launch_bounds__(kConvThreads) two_tap_delta_kernel(TwoTapParams<T> p) {
  const int32_t J = 2 * p.groups(), JP = p.projected_taps(), lane = threadIdx.x % 32;
  const int64_t pair = (int64_t(blockIdx.x) * kConvThreads + threadIdx.x) / 32;
  if (pair >= p.rows * JP) return;  // whole warps exit together: pair is uniform across a warp
  const int64_t t = pair / JP;
  const int32_t i = int32_t(pair % JP);
  float acc = two_tap_delta_dot(p, t, p.norm_weight ? p.row_scale_ws[t] : 1.f, i, lane, 32);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane != 0) return;
  if (i < J) {
    p.delta_ws[t * J + i] = acc;
  } else {
    const bool failed = p.cu_blocks && p.status[0] != int32_t(Status::kOk);
    p.finish_delta[t * J + i - J] = from_float<T>(failed ? NAN : acc);
  }
}

// Ragged offsets checked once, before the conv kernel reads them (the binding passes a
// status buffer whenever cu_blocks is given).
template <class T>
__global__ void two_tap_check_kernel(TwoTapParams<T> p) {
  if (threadIdx.x == 0) write_status(p.status, 0, two_tap_check_blocks(p));
}

template <class T>
cudaError_t launch_two_tap_conv(const TwoTapParams<T>& p, cudaStream_t stream) {
  const int64_t work = p.rows * ceil_div(p.channels, 4);
  if (p.cu_blocks && !p.status) return cudaErrorInvalidValue;
  if (p.status) {  // written on every call that asks, as on the CPU
    two_tap_check_kernel<T><<<1, 32, 0, stream>>>(p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (work == 0) return cudaSuccess;
  if (p.norm_weight) {
    two_tap_norm_kernel<T><<<unsigned(ceil_div(p.rows * 32, kConvThreads)), kConvThreads, 0, stream>>>(p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (p.delta_weight) {
    const int64_t warps = p.rows * p.projected_taps();
    two_tap_delta_kernel<T><<<unsigned(ceil_div(warps * 32, kConvThreads)), kConvThreads, 0, stream>>>(p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  two_tap_conv_kernel<T><<<unsigned(ceil_div(work, kConvThreads)), kConvThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

constexpr int kTopKThreads = 256;

template <class T>
__global__ void __launch_bounds__(kTopKThreads) topk_select_kernel(TopKParams<T> p) {
  using Reduce = cub::BlockReduce<TopKState, kTopKThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t r = blockIdx.x;
  const T* row = p.logits + r * p.row_stride;
  const bool vec_ok = aligned4(row);
  TopKState s = topk_state_identity(p.k);
  for (int64_t base = 4 * int64_t(threadIdx.x); base < p.vocab; base += 4 * kTopKThreads) {
    float v[4];
    load4(row, base, p.vocab, vec_ok, v);
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (base + j < p.vocab) topk_state_add(s, v[j], int32_t(base + j));
  }
  s = Reduce(temp).Reduce(s, TopKMergeOp{});
  if (threadIdx.x == 0) topk_write(s, p.out_values + r * p.k, p.out_ids + r * p.k, p.out_lse + r);
}

template <class T>
cudaError_t launch_topk_select(const TopKParams<T>& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  topk_select_kernel<T><<<unsigned(p.rows), kTopKThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

constexpr int kPathThreads = 256;

template <class T>
struct PathBlockBackend {
  const PathParams<T>& p;
  int32_t* slot;  // shared broadcast slot

  __device__ bool leader() const { return threadIdx.x == 0; }

  __device__ int32_t broadcast(int32_t v) const {
    if (threadIdx.x == 0) *slot = v;
    __syncthreads();
    const int32_t out = *slot;
    __syncthreads();
    return out;
  }

  __device__ void pair_scores(int64_t rt, const int32_t* prev, int32_t n_prev, float* out) const {
    const int32_t* cand = p.cand_ids + rt * p.k;
    const float* unary = p.unary + rt * p.k;
    for (int32_t idx = threadIdx.x; idx < n_prev * p.k; idx += blockDim.x) {
      const int32_t a = idx / p.k, b = idx % p.k;
      out[idx] = path_pair_score(p, rt, prev[a], cand[b], unary[b]);
    }
    __syncthreads();  // the lattice rows are read by the leader next
  }
};

template <class T>
__global__ void __launch_bounds__(kPathThreads) path_select_kernel(PathParams<T> p) {
  __shared__ int32_t slot;
  __shared__ Status checked;
  const int32_t r = blockIdx.x;
  // Bad input fails this request alone (status, -1 tokens); the kernel never traps.
  if (threadIdx.x == 0) {
    checked = path_check_request(p, r);
    write_status(p.status, r, checked);
  }
  __syncthreads();
  if (checked != Status::kOk) {
    path_write_failed(p, r, threadIdx.x, blockDim.x);
    return;
  }
  PathBlockBackend<T> backend{p, &slot};
  path_request(p, r, backend);
}

// The fused g = W_h h: one warp per (row rt, rank index i), lanes stride the hidden
// channels, then a butterfly sum into g_ws for the path kernel that follows on the stream.
template <class T>
__global__ void __launch_bounds__(kPathThreads) path_g_kernel(PathParams<T> p) {
  const int32_t lane = threadIdx.x % 32;
  const int64_t pair = (int64_t(blockIdx.x) * kPathThreads + threadIdx.x) / 32;
  if (pair >= int64_t(p.requests) * p.positions * p.rank) return;  // whole warps exit together
  const int64_t rt = pair / p.rank;
  const int32_t i = int32_t(pair % p.rank);
  const float acc = warp_allreduce_sum(path_g_dot(p, rt, i, lane, 32));
  if (lane == 0) p.g_ws[rt * p.rank + i] = acc;
}

template <class T>
cudaError_t launch_path_select(const PathParams<T>& p, cudaStream_t stream) {
  if (p.requests == 0) return cudaSuccess;  // with P == 0 the kernel still checks and writes each status
  const int64_t warps = int64_t(p.requests) * p.positions * p.rank;
  if (p.g_weight && warps > 0) {
    path_g_kernel<T><<<unsigned(ceil_div(warps * 32, kPathThreads)), kPathThreads, 0, stream>>>(p);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  path_select_kernel<T><<<unsigned(p.requests), kPathThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashspark::cuda
