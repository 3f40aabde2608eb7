// DFlash drafter kernels, the math shared by CPU and CUDA:
//   * inject_context_kv: k_norm (RMSNorm over head_dim) + RoPE on the projected
//     context K, and the write of K and V into the drafter's cache;
//   * block_diffusion_attention: the block's queries attend, with no mask, to the
//     request's context K/V plus the block's own K/V, split along the keys
//     (flash-decoding): each split yields a partial (max, sum, acc) and the
//     partials are merged.
#pragma once

#include "flashspark/common.h"
#include "flashspark/softmax.h"

namespace flashspark {

// ---- inject_context_kv --------------------------------------------------------

template <class T>
struct InjectParams {
  const T* k = nullptr;  // [N, Hkv, D], token stride k_stride, head stride D
  const T* v = nullptr;
  int64_t k_stride = 0, v_stride = 0;
  const int64_t* positions = nullptr;    // [N]
  const int32_t* slots = nullptr;        // [N]
  const float* k_norm_weight = nullptr;  // [D]
  const float* cos_sin = nullptr;        // [max_pos, D]: cos | sin
  float eps = 1e-6f;
  T* k_cache = nullptr;  // [B, Hkv, S, D] with strides below, D contiguous
  T* v_cache = nullptr;
  int64_t cache_stride_b = 0, cache_stride_h = 0, cache_stride_s = 0;
  int64_t v_cache_stride_b = 0, v_cache_stride_h = 0, v_cache_stride_s = 0;
  int32_t* status = nullptr;  // [N] Status codes, or null: a failed token writes nothing
  int32_t num_tokens = 0, num_kv_heads = 0, head_dim = 0, max_pos = 0, batch = 0, max_len = 0;
};

template <class T>
FS_HOST_DEVICE Status inject_check_token(const InjectParams<T>& p, int32_t i) {
  const int32_t slot = p.slots[i];
  const int64_t pos = p.positions[i];
  if (slot < 0 || slot >= p.batch) return Status::kSlotRange;
  if (pos < 0 || pos >= p.max_len) return Status::kPositionRange;
  if (pos >= p.max_pos) return Status::kRopeRange;
  return Status::kOk;
}

// Where row (token i, KV head h) reads and writes.
template <class T>
struct InjectRow {
  const T* k;
  const T* v;
  T* k_out;
  T* v_out;
  const float* cos_sin;
};

template <class T>
FS_HOST_DEVICE InjectRow<T> inject_row(const InjectParams<T>& p, int32_t i, int32_t h) {
  const int64_t slot = p.slots[i], pos = p.positions[i];
  return InjectRow<T>{p.k + i * p.k_stride + int64_t(h) * p.head_dim, p.v + i * p.v_stride + int64_t(h) * p.head_dim,
                      p.k_cache + slot * p.cache_stride_b + h * p.cache_stride_h + pos * p.cache_stride_s,
                      p.v_cache + slot * p.v_cache_stride_b + h * p.v_cache_stride_h + pos * p.v_cache_stride_s,
                      p.cos_sin + pos * p.head_dim};
}

// Writes K (normalized by `inv`, weighted, rotated) and V for the pairs
// j = j0, j0 + step, ... < D/2 (and the V entries at the same strides).
template <class T>
FS_HOST_DEVICE void inject_write(const InjectParams<T>& p, const InjectRow<T>& row, float inv, int32_t j0,
                                 int32_t step) {
  const int32_t D = p.head_dim, half = D / 2;
  for (int32_t j = j0; j < half; j += step) {
    const float x1 = to_float(row.k[j]) * inv * p.k_norm_weight[j];
    const float x2 = to_float(row.k[j + half]) * inv * p.k_norm_weight[j + half];
    const float c = row.cos_sin[j], s = row.cos_sin[half + j];
    row.k_out[j] = from_float<T>(x1 * c - x2 * s);  // rotate-half RoPE
    row.k_out[j + half] = from_float<T>(x2 * c + x1 * s);
  }
  for (int32_t j = j0; j < D; j += step) row.v_out[j] = row.v[j];
}

// ---- block_diffusion_attention --------------------------------------------------

template <class T>
struct BlockAttnParams {
  const T* q = nullptr;  // [B, G, Hq, D]: strides q_stride_b, q_stride_g, q_stride_h
  int64_t q_stride_b = 0, q_stride_g = 0, q_stride_h = 0;
  const T* k_cache = nullptr;  // [B, Hkv, S, D]
  const T* v_cache = nullptr;
  int64_t kc_stride_b = 0, kc_stride_h = 0, kc_stride_s = 0;
  int64_t vc_stride_b = 0, vc_stride_h = 0, vc_stride_s = 0;
  const int32_t* ctx_lens = nullptr;  // [B]
  const T* k_block = nullptr;         // [B, G, Hkv, D]
  const T* v_block = nullptr;
  int64_t kb_stride_b = 0, kb_stride_g = 0, kb_stride_h = 0;
  int64_t vb_stride_b = 0, vb_stride_g = 0, vb_stride_h = 0;
  T* out = nullptr;  // [B, G, Hq, D] contiguous
  float scale = 1.f;
  int32_t batch = 0, gamma = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, max_len = 0;
  int32_t split_keys = 256;      // keys per split
  float* partial_acc = nullptr;  // workspace [B, Hkv, R, num_splits, D]
  float* partial_ml = nullptr;   // workspace [B, Hkv, R, num_splits, 2]
  int32_t num_splits = 0;        // ceil((S + G) / split_keys): static, from sizes only
  int32_t* status = nullptr;     // [B] Status codes, or null: a failed request's output is NaN

  FS_HOST_DEVICE int32_t group() const { return num_q_heads / num_kv_heads; }
  FS_HOST_DEVICE int32_t rows() const { return gamma * group(); }  // query rows per KV head
};

template <class T>
FS_HOST_DEVICE Status block_attn_check_request(const BlockAttnParams<T>& p, int32_t b) {
  const int32_t ctx = p.ctx_lens[b];
  return ctx >= 0 && ctx <= p.max_len ? Status::kOk : Status::kCtxLenRange;
}

// Key j of request b, KV head h: the context cache for j < ctx, else the block.
template <class T>
FS_HOST_DEVICE const T* block_attn_key(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t ctx, int32_t j) {
  return j < ctx ? p.k_cache + b * p.kc_stride_b + h * p.kc_stride_h + int64_t(j) * p.kc_stride_s
                 : p.k_block + b * p.kb_stride_b + int64_t(j - ctx) * p.kb_stride_g + h * p.kb_stride_h;
}

template <class T>
FS_HOST_DEVICE const T* block_attn_value(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t ctx, int32_t j) {
  return j < ctx ? p.v_cache + b * p.vc_stride_b + h * p.vc_stride_h + int64_t(j) * p.vc_stride_s
                 : p.v_block + b * p.vb_stride_b + int64_t(j - ctx) * p.vb_stride_g + h * p.vb_stride_h;
}

// Query row r of KV head h: block position r / group, query head h*group + r % group.
template <class T>
FS_HOST_DEVICE const T* block_attn_query(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t r) {
  const int32_t g = r / p.group(), hq = h * p.group() + r % p.group();
  return p.q + b * p.q_stride_b + int64_t(g) * p.q_stride_g + int64_t(hq) * p.q_stride_h;
}

template <class T>
FS_HOST_DEVICE T* block_attn_out(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t r) {
  const int32_t g = r / p.group(), hq = h * p.group() + r % p.group();
  return p.out + ((int64_t(b) * p.gamma + g) * p.num_q_heads + hq) * p.head_dim;
}

// Partial results of split s for (b, h, row r).
template <class T>
FS_HOST_DEVICE int64_t block_attn_partial_index(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t r,
                                                int32_t s) {
  return ((int64_t(b) * p.num_kv_heads + h) * p.rows() + r) * p.num_splits + s;
}

// Merge the per-split partials of one query row into its output: the partials
// are online-softmax states (m, l) with unnormalized accumulators.
template <class T>
FS_HOST_DEVICE void block_attn_combine_row(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t r,
                                           int32_t d_begin, int32_t d_step) {
  const int64_t base = block_attn_partial_index(p, b, h, r, 0);
  float m = kNegInf;
  for (int32_t s = 0; s < p.num_splits; ++s) m = fmaxf(m, p.partial_ml[2 * (base + s)]);
  float l = 0.f;
  for (int32_t s = 0; s < p.num_splits; ++s) {
    const float ms = p.partial_ml[2 * (base + s)];
    if (ms != kNegInf) l += p.partial_ml[2 * (base + s) + 1] * expf(ms - m);
  }
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
  T* out = block_attn_out(p, b, h, r);
  if (block_attn_check_request(p, b) != Status::kOk) {  // its splits read nothing
    for (int32_t d = d_begin; d < p.head_dim; d += d_step) out[d] = from_float<T>(NAN);
    return;
  }
  for (int32_t d = d_begin; d < p.head_dim; d += d_step) {
    float acc = 0.f;
    for (int32_t s = 0; s < p.num_splits; ++s) {
      const float ms = p.partial_ml[2 * (base + s)];
      if (ms != kNegInf) acc += p.partial_acc[(base + s) * p.head_dim + d] * expf(ms - m);
    }
    out[d] = from_float<T>(acc * inv_l);
  }
}

}  // namespace flashspark
