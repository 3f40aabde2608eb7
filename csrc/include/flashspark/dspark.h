// DSpark Markov-head intra-block step, the math shared by CPU and CUDA.
//
// For every request b at block position k:
//   e_b        = W1[x_{k-1}]                                   (Embedding(V, r))
//   logits[v]  = U[b, v] + <W2[v], e_b> (+ bias[v])            (Linear(r, V))
//   x_k        = argmax_v logits[v] / T + gumbel(seed, position, kPurposeDraft, v)   (argmax below the floor)
//   q[b, :]    = softmax(logits / T)                           (one-hot when greedy)
// Logits are read as drafter_logit does (NaN as -inf, +inf as the largest float).
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
  const T* w1 = nullptr;                 // [V, r]
  const T* w2 = nullptr;                 // [V, r]
  const T* bias = nullptr;               // [V] or null
  const T* hidden = nullptr;             // h [B, H], rows of stride h_stride
  int64_t h_stride = 0;
  const T* conf_w = nullptr;           // [H + r]
  const float* conf_b = nullptr;       // [1]
  const float* temperature = nullptr;  // [B]
  const int64_t* seeds = nullptr;      // [B]
  const int64_t* positions = nullptr;  // [B] Philox position of this draw
  int32_t* out_tokens = nullptr;       // [B]; -1 for a failed request
  float* out_q = nullptr;              // [B, V]: first the logits (as drafter_logit reads them), then q
  float* out_conf = nullptr;           // [B]
  int32_t* status = nullptr;           // [B] Status codes, or null
  float* partial = nullptr;            // workspace [num_partials, B, kMarkovSlot]
  int32_t num_partials = 0;
  float* row_stats = nullptr;  // workspace [B, kMarkovRowStats]: how q is normalized
  int32_t batch = 0, vocab = 0, rank = 0, hidden_size = 0;
};

constexpr int32_t kMarkovSlot = 5;      // m, s, race key (fp64 as two words), race index
constexpr int32_t kMarkovRowStats = 4;  // m, log s, token, q mode

// Workspace floats for the partials and the per-request row stats.
inline int64_t markov_workspace_floats(int32_t num_partials, int64_t batch) {
  return int64_t(num_partials) * batch * kMarkovSlot + batch * kMarkovRowStats;
}

template <class T>
FS_HOST_DEVICE Status markov_check_request(const MarkovParams<T>& p, int32_t b) {
  if (p.prev_tokens[b] < 0 || p.prev_tokens[b] >= p.vocab) return Status::kPrevTokenRange;
  if (!temperature_ok(p.temperature[b])) return Status::kBadTemperature;
  return Status::kOk;
}

// How request b samples: at 1 / T, or greedily below the temperature floor (computed
// once per request; inv_t64 = 1 / T in fp64 scales the race key).
struct MarkovScale {
  bool greedy;
  float inv_t;
  double inv_t64;
};

template <class T>
FS_HOST_DEVICE MarkovScale markov_scale(const MarkovParams<T>& p, int32_t b) {
  const float t = p.temperature[b];
  if (!(t >= kGreedyTemperature)) return MarkovScale{true, 1.f, 1.0};
  return MarkovScale{false, 1.f / t, 1.0 / double(t)};
}

// Per-(tile, request) partial: softmax over the logits (in logit units, at 1 / T) and
// the race leader. The race key z / T + g is fp64: it must be comparable across
// tiles in one pass, and in fp32 a large finite logit at a small T would overflow.
struct MarkovPartial {
  SoftmaxState softmax;
  ArgMax64 race;
};

FS_HOST_DEVICE MarkovPartial markov_partial_identity() {
  return MarkovPartial{softmax_identity(), argmax_identity<double>()};
}

FS_HOST_DEVICE MarkovPartial markov_partial_merge(const MarkovPartial& a, const MarkovPartial& b, float inv_t) {
  return MarkovPartial{softmax_merge(a.softmax, b.softmax, inv_t), argmax_merge(a.race, b.race)};
}

struct MarkovMergeOp {
  float inv_t;
  FS_HOST_DEVICE MarkovPartial operator()(const MarkovPartial& a, const MarkovPartial& b) const {
    return markov_partial_merge(a, b, inv_t);
  }
};

// Adds vocabulary entry v with logit z (as drafter_logit reads it) for request b.
template <class T>
FS_HOST_DEVICE void markov_add(const MarkovParams<T>& p, int32_t b, const MarkovScale& sc, MarkovPartial& part,
                               int32_t v, float z) {
  if (z == kNegInf) return;
  softmax_add(part.softmax, z, sc.inv_t);
  const double key = sc.greedy ? double(z)
                               : double(z) * sc.inv_t64 +
                                     double(gumbel_from_u32(philox_u32(uint64_t(p.seeds[b]), uint64_t(p.positions[b]),
                                                                       kPurposeDraft, uint32_t(v))));
  argmax_add(part.race, key, v);
}

// The logit of entry v for request b, given the Markov term <W2[v], e_b>.
template <class T>
FS_HOST_DEVICE float markov_logit(const MarkovParams<T>& p, int32_t b, int32_t v, float markov) {
  float z = to_float(p.base_logits[int64_t(b) * p.u_stride + v]) + markov;
  if (p.bias) z += to_float(p.bias[v]);
  return drafter_logit(z);
}

FS_HOST_DEVICE void markov_store_partial(float* slot, const MarkovPartial& part) {
  const uint64_t key = double_to_bits(part.race.v);
  slot[0] = part.softmax.m;
  slot[1] = part.softmax.s;
  slot[2] = bits_to_float(uint32_t(key));  // the key and the index travel bit-exact
  slot[3] = bits_to_float(uint32_t(key >> 32));
  slot[4] = bits_to_float(uint32_t(part.race.i));
}

FS_HOST_DEVICE MarkovPartial markov_load_partial(const float* slot) {
  const uint64_t key = uint64_t(float_to_bits(slot[2])) | (uint64_t(float_to_bits(slot[3])) << 32);
  return MarkovPartial{SoftmaxState{slot[0], slot[1]}, ArgMax64{bits_to_double(key), int32_t(float_to_bits(slot[4]))}};
}

// How a request's q row is written once its partials are merged.
enum class MarkovQ : int32_t { kSoftmax = 0, kOneHot = 1, kFailed = 2 };

// The request's outcome from its merged partial and its check: token, q mode and the
// softmax normalizer. Greedy requests, and rows with no finite logit (all -inf: the
// lowest id, deterministically), take a one-hot q; a failed request emits token -1.
struct MarkovOutcome {
  int32_t token;
  MarkovQ mode;
  float m, log_s;
};

FS_HOST_DEVICE MarkovOutcome markov_outcome(const MarkovScale& sc, const MarkovPartial& acc, Status st) {
  if (st != Status::kOk) return MarkovOutcome{-1, MarkovQ::kFailed, 0.f, 0.f};
  const int32_t token = acc.race.i < 0 ? 0 : acc.race.i;
  if (sc.greedy || !softmax_valid(acc.softmax)) return MarkovOutcome{token, MarkovQ::kOneHot, 0.f, 0.f};
  return MarkovOutcome{token, MarkovQ::kSoftmax, acc.softmax.m, logf(acc.softmax.s)};
}

// q[v] of an outcome, from the logit z stored in out_q.
FS_HOST_DEVICE float markov_q(const MarkovOutcome& o, float inv_t, int32_t v, float z) {
  if (o.mode == MarkovQ::kFailed) return 0.f;
  if (o.mode == MarkovQ::kOneHot) return v == o.token ? 1.f : 0.f;
  return expf((z - o.m) * inv_t - o.log_s);
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
