// CUDA kernels of the DFlash drafter ops.
//   inject_context_kv: one warp per (token, KV head) row.
//   block_diffusion_attention: split-KV (flash-decoding) — grid (split, row
//   group, request x KV head); each CTA of 4 warps takes 16 query rows of one
//   KV head (the block positions x the query heads sharing it, so K/V tiles are
//   loaded once for the whole GQA group) over one split of keys, keeping an
//   online softmax per row; a second kernel merges the splits of each row.
#pragma once

#include "flashspark/cuda/common.cuh"
#include "flashspark/cuda/launch.h"
#include "flashspark/dflash.h"

namespace flashspark::cuda {

constexpr int kInjectWarps = 4;

template <class T>
__global__ void __launch_bounds__(kInjectWarps * 32) inject_context_kv_kernel(InjectParams<T> p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r = int64_t(blockIdx.x) * kInjectWarps + warp;
  if (r >= int64_t(p.num_tokens) * p.num_kv_heads) return;
  const int32_t i = int32_t(r / p.num_kv_heads), h = int32_t(r % p.num_kv_heads);
  // A bad slot or position fails this token alone (status; nothing written), never traps.
  const Status st = inject_check_token(p, i);  // warp-uniform
  if (lane == 0 && h == 0) write_status(p.status, i, st);
  if (st != Status::kOk) return;
  const InjectRow<T> row = inject_row(p, i, h);
  float ss = 0.f;
  for (int32_t j = lane; j < p.head_dim; j += 32) ss += to_float(row.k[j]) * to_float(row.k[j]);
  inject_write(p, row, rms_inv(warp_allreduce_sum(ss), p.head_dim, p.eps), lane, 32);
}

template <class T>
cudaError_t launch_inject_context_kv(const InjectParams<T>& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.num_tokens) * p.num_kv_heads;
  if (rows == 0) return cudaSuccess;
  inject_context_kv_kernel<T><<<unsigned(ceil_div(rows, kInjectWarps)), kInjectWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

constexpr int kAttnWarps = 4;
constexpr int kAttnRowsPerWarp = 4;
constexpr int kAttnRows = kAttnWarps * kAttnRowsPerWarp;  // query rows per CTA
constexpr int kAttnTile = 32;                             // keys per shared-memory tile (one per lane)

inline size_t block_attn_smem_bytes(int32_t head_dim) {
  // q rows [16][D], K tile [32][D+1] (padded: lane-per-key dot products are
  // then bank-conflict free), V tile [32][D]
  return sizeof(float) *
         (size_t(kAttnRows) * head_dim + size_t(kAttnTile) * (head_dim + 1) + size_t(kAttnTile) * head_dim);
}

template <class T, int kDimPerLane>
__global__ void __launch_bounds__(kAttnWarps * 32) block_attn_split_kernel(BlockAttnParams<T> p) {
  extern __shared__ float smem[];
  const int32_t D = p.head_dim, R = p.rows();
  float* qs = smem;
  float* ks = qs + kAttnRows * D;
  float* vs = ks + kAttnTile * (D + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t b = blockIdx.z / p.num_kv_heads, h = blockIdx.z % p.num_kv_heads;
  const int32_t s = blockIdx.x, row0 = blockIdx.y * kAttnRows;
  // A bad context length fails this request alone: no keys are read, the combine writes NaN.
  const int32_t ctx = block_attn_check_request(p, b) == Status::kOk ? p.ctx_lens[b] : -p.gamma;
  const int32_t j0 = s * p.split_keys, j1 = min(ctx + p.gamma, j0 + p.split_keys);

  for (int idx = threadIdx.x; idx < kAttnRows * D; idx += blockDim.x) {
    const int32_t rr = idx / D, d = idx % D, r = row0 + rr;
    qs[idx] = r < R ? to_float(block_attn_query(p, b, h, r)[d]) * p.scale : 0.f;
  }
  float m[kAttnRowsPerWarp], l[kAttnRowsPerWarp], acc[kAttnRowsPerWarp][kDimPerLane];
#pragma unroll
  for (int rr = 0; rr < kAttnRowsPerWarp; ++rr) {
    m[rr] = kNegInf;
    l[rr] = 0.f;
#pragma unroll
    for (int e = 0; e < kDimPerLane; ++e) acc[rr][e] = 0.f;
  }
  for (int32_t tile = j0; tile < j1; tile += kAttnTile) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < kAttnTile * D; idx += blockDim.x) {
      const int32_t jj = idx / D, d = idx % D, j = tile + jj;
      const bool valid = j < j1;
      ks[jj * (D + 1) + d] = valid ? to_float(block_attn_key(p, b, h, ctx, j)[d]) : 0.f;
      vs[jj * D + d] = valid ? to_float(block_attn_value(p, b, h, ctx, j)[d]) : 0.f;
    }
    __syncthreads();
    const int32_t tile_keys = min(kAttnTile, j1 - tile);
#pragma unroll
    for (int rr = 0; rr < kAttnRowsPerWarp; ++rr) {
      const int32_t local = warp * kAttnRowsPerWarp + rr;
      if (row0 + local >= R) break;  // warp-uniform
      float score = kNegInf;
      if (lane < tile_keys) {
        float dot = 0.f;
        for (int32_t d = 0; d < D; ++d) dot += qs[local * D + d] * ks[lane * (D + 1) + d];
        score = dot;
      }
      const float m_new = fmaxf(m[rr], warp_allreduce_max(score));
      const float correction = expf(m[rr] - m_new);  // 0 on the first tile (m = -inf)
      const float pj = lane < tile_keys ? expf(score - m_new) : 0.f;
      l[rr] = l[rr] * correction + warp_allreduce_sum(pj);
#pragma unroll
      for (int e = 0; e < kDimPerLane; ++e) acc[rr][e] *= correction;
      for (int32_t jj = 0; jj < tile_keys; ++jj) {
        const float pjj = __shfl_sync(0xffffffffu, pj, jj);
#pragma unroll
        for (int e = 0; e < kDimPerLane; ++e) {
          const int32_t d = lane + 32 * e;
          if (d < D) acc[rr][e] += pjj * vs[jj * D + d];
        }
      }
      m[rr] = m_new;
    }
  }
#pragma unroll
  for (int rr = 0; rr < kAttnRowsPerWarp; ++rr) {
    const int32_t r = row0 + warp * kAttnRowsPerWarp + rr;
    if (r >= R) break;
    const int64_t idx = block_attn_partial_index(p, b, h, r, s);
    if (lane == 0) {
      p.partial_ml[2 * idx] = m[rr];
      p.partial_ml[2 * idx + 1] = l[rr];
    }
#pragma unroll
    for (int e = 0; e < kDimPerLane; ++e) {
      const int32_t d = lane + 32 * e;
      if (d < D) p.partial_acc[idx * D + d] = acc[rr][e];
    }
  }
}

template <class T>
__global__ void block_attn_combine_kernel(BlockAttnParams<T> p) {
  const int32_t R = p.rows();
  const int32_t r = blockIdx.x % R, bh = blockIdx.x / R;
  if (r == 0 && bh % p.num_kv_heads == 0 && threadIdx.x == 0)
    write_status(p.status, bh / p.num_kv_heads, block_attn_check_request(p, bh / p.num_kv_heads));
  block_attn_combine_row(p, bh / p.num_kv_heads, bh % p.num_kv_heads, r, threadIdx.x, blockDim.x);
}

template <class T, int kDimPerLane>
cudaError_t launch_block_attn_split(const BlockAttnParams<T>& p, cudaStream_t stream) {
  const size_t smem = block_attn_smem_bytes(p.head_dim);
  auto kernel = block_attn_split_kernel<T, kDimPerLane>;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  const dim3 grid(unsigned(p.num_splits), unsigned(ceil_div(p.rows(), kAttnRows)), unsigned(p.batch * p.num_kv_heads));
  kernel<<<grid, kAttnWarps * 32, smem, stream>>>(p);
  return cudaGetLastError();
}

// With no query rows there is nothing to attend, but each request's status is still written.
template <class T>
__global__ void block_attn_status_kernel(BlockAttnParams<T> p) {
  const int32_t b = int32_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < p.batch) write_status(p.status, b, block_attn_check_request(p, b));
}

template <class T>
cudaError_t launch_block_diffusion_attention(const BlockAttnParams<T>& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.rows() == 0) {
    if (p.status) block_attn_status_kernel<T><<<unsigned(ceil_div(p.batch, 256)), 256, 0, stream>>>(p);
    return cudaGetLastError();
  }
  cudaError_t e;
  if (p.head_dim <= 32)
    e = launch_block_attn_split<T, 1>(p, stream);
  else if (p.head_dim <= 64)
    e = launch_block_attn_split<T, 2>(p, stream);
  else if (p.head_dim <= 128)
    e = launch_block_attn_split<T, 4>(p, stream);
  else
    e = launch_block_attn_split<T, 8>(p, stream);
  if (e != cudaSuccess) return e;
  block_attn_combine_kernel<T><<<unsigned(int64_t(p.batch) * p.num_kv_heads * p.rows()), 64, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashspark::cuda
