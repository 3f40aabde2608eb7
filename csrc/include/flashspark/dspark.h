// DSpark Markov-head intra-block step, the math shared by CPU and CUDA.
//
// For every request b at block position k:
//   e_b        = W1[x_{k-1}]                                   (Embedding(V, r))
//   logits[v]  = U[b, v] + <W2[v], e_b> (+ bias[v])            (Linear(r, V))
//   x_k        = argmax_v logits[v] / T + gumbel(seed, position, kPurposeDraft, v)   (argmax at T = 0)
//   q[b, :]    = softmax(logits / T)                           (one-hot at T = 0)
//   c_k        = sigmoid(<w_c, [h_b ; e_b]> + b_c)             (confidence head)
//
// The vocabulary is cut into tiles; a tile's W2 rows are read once for the
// whole batch and leave per-(tile, request) partials (online softmax and the
// race's leader), merged per request afterwards.
#pragma once

#include "flashspark/common.h"
#include "flashspark/philox.h"
#include "flashspark/softmax.h"

namespace flashspark {

template <class T>
struct MarkovParams {
  const T* base_logits = nullptr;  // U [B, V], rows of stride u_stride
  int64_t u_stride = 0;
  const int32_t* prev_tokens = nullptr;  // [B]
  const T* w1 = nullptr;          // [V, r]
  const T* w2 = nullptr;          // [V, r]
  const T* bias = nullptr;        // [V] or null
  const T* hidden = nullptr;      // h [B, H], rows of stride h_stride
  int64_t h_stride = 0;
  const T* conf_w = nullptr;      // [H + r]
  const float* conf_b = nullptr;  // [1]
  const float* temperature = nullptr;  // [B]
  const int64_t* seeds = nullptr;      // [B]
  const int64_t* positions = nullptr;  // [B] Philox position of this draw
  int32_t* out_tokens = nullptr;  // [B]
  float* out_q = nullptr;         // [B, V]: first the scaled logits, then the probabilities
  float* out_conf = nullptr;      // [B]
  float* partial = nullptr;       // workspace [num_partials, B, 4]: m, s, race key, race index
  int32_t num_partials = 0;
  float* row_stats = nullptr;     // workspace [B, 2]: log-sum-exp and token (as bits), for q's normalization
  int32_t batch = 0, vocab = 0, rank = 0, hidden_size = 0;
};

enum class MarkovError : int32_t { kOk = 0, kTokenRange, kBadTemperature };

template <class T>
FS_HOST_DEVICE MarkovError markov_check_request(const MarkovParams<T>& p, int32_t b) {
  if (p.prev_tokens[b] < 0 || p.prev_tokens[b] >= p.vocab) return MarkovError::kTokenRange;
  if (!(p.temperature[b] >= 0.f)) return MarkovError::kBadTemperature;
  return MarkovError::kOk;
}

// Per-(tile, request) partial: softmax over the scaled logits and the race leader.
struct MarkovPartial {
  SoftmaxState softmax;
  ArgMax race;
};

FS_HOST_DEVICE MarkovPartial markov_partial_identity() { return MarkovPartial{softmax_identity(), argmax_identity()}; }

FS_HOST_DEVICE MarkovPartial markov_partial_merge(const MarkovPartial& a, const MarkovPartial& b) {
  return MarkovPartial{softmax_merge(a.softmax, b.softmax), argmax_merge(a.race, b.race)};
}

struct MarkovMergeOp {
  FS_HOST_DEVICE MarkovPartial operator()(const MarkovPartial& a, const MarkovPartial& b) const {
    return markov_partial_merge(a, b);
  }
};

// Adds vocabulary entry v with (temperature-scaled) logit z for request b.
template <class T>
FS_HOST_DEVICE void markov_add(const MarkovParams<T>& p, int32_t b, MarkovPartial& part, int32_t v, float z) {
  softmax_add(part.softmax, z);
  const bool greedy = p.temperature[b] == 0.f;
  const float key = greedy ? z
                           : z + gumbel_from_u32(philox_u32(uint64_t(p.seeds[b]), uint64_t(p.positions[b]),
                                                            kPurposeDraft, uint32_t(v)));
  if (z != kNegInf) argmax_add(part.race, key, v);
}

// The logit of entry v for request b, scaled by 1/T (unscaled at T = 0), given
// the Markov term <W2[v], e_b>.
template <class T>
FS_HOST_DEVICE float markov_scaled_logit(const MarkovParams<T>& p, int32_t b, int32_t v, float markov) {
  float z = to_float(p.base_logits[int64_t(b) * p.u_stride + v]) + markov;
  if (p.bias) z += to_float(p.bias[v]);
  const float t = p.temperature[b];
  return t == 0.f ? z : z / t;
}

FS_HOST_DEVICE void markov_store_partial(float* slot, const MarkovPartial& part) {
  slot[0] = part.softmax.m;
  slot[1] = part.softmax.s;
  slot[2] = part.race.v;
  slot[3] = bits_to_float(uint32_t(part.race.i));  // the index travels bit-exact
}

FS_HOST_DEVICE MarkovPartial markov_load_partial(const float* slot) {
  return MarkovPartial{SoftmaxState{slot[0], slot[1]}, ArgMax{slot[2], int32_t(float_to_bits(slot[3]))}};
}

// Confidence head: sigmoid(<w_c, [h_b ; W1[x_{k-1}]]> + b_c), partial dot over [lo, hi).
template <class T>
FS_HOST_DEVICE float markov_conf_dot(const MarkovParams<T>& p, int32_t b, int32_t lo, int32_t hi, int32_t step) {
  const T* e = p.w1 + int64_t(p.prev_tokens[b]) * p.rank;
  const T* h = p.hidden + int64_t(b) * p.h_stride;
  float acc = 0.f;
  for (int32_t i = lo; i < hi; i += step) {
    const float x = i < p.hidden_size ? to_float(h[i]) : to_float(e[i - p.hidden_size]);
    acc += to_float(p.conf_w[i]) * x;
  }
  return acc;
}

FS_HOST_DEVICE float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

}  // namespace flashspark
