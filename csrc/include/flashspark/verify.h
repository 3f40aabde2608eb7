// Ragged rejection-sampling verification: the math shared by the CPU and the
// CUDA kernel. Both run the same per-request driver (`verify_request`); they
// differ only in how a backend reduces one vocabulary row (parallel chunks on
// the CPU, a CUB block reduction on the GPU).
//
// Layout (B requests, T = cu_num_draft[B] draft tokens, V vocabulary):
//   logits        [T + B, V]  request b owns rows cu[b]+b ... cu[b+1]+b: one per
//                             draft token, then its bonus row
//   draft_tokens  [T]
//   draft q       dense [T, V], sparse ids/probs [T, K], or none (one-hot draft)
//   out_tokens    [B, max_spec_len + 1]: accepted drafts, then the correction or
//                             bonus token, then -1
//   num_accepted  [B]
//
// Randomness (see philox.h), for request b and row k of that request:
//   accept test   philox_u32(seed[b], offset[b] + k, kPurposeAccept, 0)
//   resample race philox_u32(seed[b], offset[b] + k, kPurposeResample, x) for token x
#pragma once

#include "flashspark/common.h"
#include "flashspark/philox.h"
#include "flashspark/softmax.h"

namespace flashspark {

enum class DraftQ : int32_t {
  kOneHot = 0,  // no q: the draft was deterministic (q = one-hot at the draft token)
  kDense = 1,   // q as [T, V] probabilities
  kSparse = 2,  // q as [T, K] (ids, probs): mass outside the K ids is zero
};

template <class T>
struct VerifyParams {
  const T* logits = nullptr;
  int64_t logits_row_stride = 0;
  const int32_t* draft_tokens = nullptr;
  const int32_t* cu_num_draft = nullptr;
  DraftQ q_mode = DraftQ::kOneHot;
  const float* q_probs = nullptr;     // dense [T, V] or sparse [T, K]
  int64_t q_row_stride = 0;
  const int32_t* q_ids = nullptr;     // sparse only: [T, K], row stride = num_candidates
  int32_t num_candidates = 0;         // K
  const float* temperature = nullptr; // [B]; 0 = greedy
  const int64_t* seeds = nullptr;     // [B]
  const int64_t* offsets = nullptr;   // [B]
  int32_t* out_tokens = nullptr;      // [B, max_spec_len + 1]
  int32_t* out_num_accepted = nullptr;// [B]
  int32_t batch = 0;
  int32_t vocab = 0;
  int32_t max_spec_len = 0;
};

// Per-request input errors. The CPU binding reports them as exceptions before
// launching; the CUDA kernel traps on them (no host synchronization).
enum class VerifyError : int32_t {
  kOk = 0,
  kBadCuNumDraft,     // cu_num_draft not starting at 0, decreasing, or not ending at T
  kSpecTooLong,       // a request has more than max_spec_len draft tokens
  kDraftTokenRange,   // a draft token outside [0, V)
  kCandidateRange,    // a sparse q id outside [0, V)
  kBadTemperature,    // negative or NaN temperature
  kDraftNotListed,    // sparse q: a draft token that is not among its row's candidate ids
};

template <class T>
FS_HOST_DEVICE VerifyError verify_check_request(const VerifyParams<T>& p, int32_t b, int32_t num_tokens) {
  const int32_t lo = p.cu_num_draft[b], hi = p.cu_num_draft[b + 1];
  if (b == 0 && lo != 0) return VerifyError::kBadCuNumDraft;
  if (b == p.batch - 1 && hi != num_tokens) return VerifyError::kBadCuNumDraft;
  if (hi < lo || lo < 0 || hi > num_tokens) return VerifyError::kBadCuNumDraft;
  if (hi - lo > p.max_spec_len) return VerifyError::kSpecTooLong;
  const float t = p.temperature[b];
  if (!(t >= 0.f)) return VerifyError::kBadTemperature;
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t x = p.draft_tokens[i];
    if (x < 0 || x >= p.vocab) return VerifyError::kDraftTokenRange;
    if (p.q_mode == DraftQ::kSparse) {
      bool listed = false;
      for (int32_t j = 0; j < p.num_candidates; ++j) {
        const int32_t c = p.q_ids[int64_t(i) * p.num_candidates + j];
        if (c < 0 || c >= p.vocab) return VerifyError::kCandidateRange;
        listed |= c == x;
      }
      // A draft drawn from q is always listed; an unlisted one has q(x) = 0.
      if (!listed) return VerifyError::kDraftNotListed;
    }
  }
  return VerifyError::kOk;
}

// ---- per-element math -------------------------------------------------------

// q restricted to a short candidate list (sparse q, or the one-hot draft as a
// list of one): q(x) for a listed x, or -1 when x is not listed (q(x) = 0).
FS_HOST_DEVICE float listed_q(const int32_t* ids, const float* probs, int32_t k, int32_t x) {
  for (int32_t j = 0; j < k; ++j)
    if (ids[j] == x) return probs[j];
  return -1.f;
}

// Race key of token x for the residual norm(max(p - q, 0)), given
// lp = log p(x), q = q(x) and Gumbel noise g. -inf when x has no residual mass.
FS_HOST_DEVICE float residual_key(float lp, float q, float g) {
  if (q <= 0.f) return lp + g;  // no draft mass: residual equals p, skip exp/log
  const float r = expf(lp) - q;
  return r > 0.f ? logf(r) + g : kNegInf;
}

// Accept test of the draft token: u < p(x) / q(x), written without division so
// that q(x) = 0 (never drafted; only reachable through bad input) accepts iff p > 0.
FS_HOST_DEVICE bool accept_draft(float u, float p_x, float q_x) { return u * q_x < p_x; }

// Two races run over the same noise in one pass: `residual` samples the
// correction token; `target` samples from p itself and is the fallback when
// the residual has no mass left (p == q up to rounding).
struct RaceResult {
  ArgMax residual;
  ArgMax target;
};

FS_HOST_DEVICE RaceResult race_identity() { return RaceResult{argmax_identity(), argmax_identity()}; }

FS_HOST_DEVICE RaceResult race_merge(const RaceResult& a, const RaceResult& b) {
  return RaceResult{argmax_merge(a.residual, b.residual), argmax_merge(a.target, b.target)};
}

struct RaceMergeOp {
  FS_HOST_DEVICE RaceResult operator()(const RaceResult& a, const RaceResult& b) const { return race_merge(a, b); }
};

// What a race subtracts from p: nothing (bonus row), a dense q row, or a
// short list (sparse q, or the one-hot draft).
struct RaceQ {
  DraftQ mode;          // kOneHot with k == 0 means "no subtraction" (bonus)
  const float* dense;   // dense row, when mode == kDense
  const int32_t* ids;   // listed ids, when mode != kDense
  const float* probs;
  int32_t k;
};

// Adds token x with log-probability lp and Gumbel noise g to both races.
FS_HOST_DEVICE void race_add(RaceResult& r, const RaceQ& q, int32_t x, float lp, float g) {
  const float kp = lp + g;
  if (kp == kNegInf || !(kp == kp)) return;
  if (argmax_better(kp, x, r.target)) r.target = ArgMax{kp, x};
  // The residual key never exceeds kp, so a token that cannot beat the
  // current residual winner under p needs no look-up of q.
  if (!argmax_better(kp, x, r.residual)) return;
  float kr;
  if (q.mode == DraftQ::kDense) {
    kr = residual_key(lp, q.dense[x], g);
  } else {
    const float qx = listed_q(q.ids, q.probs, q.k, x);
    kr = qx < 0.f ? kp : residual_key(lp, qx, g);
  }
  if (kr != kNegInf && argmax_better(kr, x, r.residual)) r.residual = ArgMax{kr, x};
}

// ---- the per-request driver -------------------------------------------------
//
// Backend interface (all members are collective: every participant calls them
// and every participant receives the same result):
//   ArgMax        row_argmax(const T* row)
//   SoftmaxState  row_softmax(const T* row, float inv_t)
//   RaceResult    row_race(const T* row, float inv_t, float lse, const RaceQ& q,
//                          uint64_t seed, uint64_t position)
//   bool          leader()    -- true for the one participant that writes outputs
template <class T, class Backend>
FS_HOST_DEVICE void verify_request(const VerifyParams<T>& p, int32_t b, Backend& be) {
  const int32_t lo = p.cu_num_draft[b];
  const int32_t n = p.cu_num_draft[b + 1] - lo;
  const int64_t row0 = int64_t(lo) + b;
  const float temp = p.temperature[b];
  const bool greedy = temp == 0.f;
  const float inv_t = greedy ? 1.f : 1.f / temp;
  const uint64_t seed = uint64_t(p.seeds[b]);
  const uint64_t offset = uint64_t(p.offsets[b]);
  int32_t* out = p.out_tokens + int64_t(b) * (p.max_spec_len + 1);
  const float one = 1.f;

  int32_t k = 0;
  int32_t emitted = -1;
  bool rejected = false;
  for (; k < n; ++k) {
    const T* row = p.logits + (row0 + k) * p.logits_row_stride;
    const int32_t x = p.draft_tokens[lo + k];
    if (greedy) {
      const ArgMax am = be.row_argmax(row);
      if (am.i == x) {
        if (be.leader()) out[k] = x;
        continue;
      }
      emitted = am.i;
      rejected = true;
      break;
    }
    const SoftmaxState st = be.row_softmax(row, inv_t);
    const float lse = softmax_lse(st);
    const float p_x = expf(to_float(row[x]) * inv_t - lse);
    RaceQ q{p.q_mode, nullptr, &x, &one, 1};
    float q_x = 1.f;
    if (p.q_mode == DraftQ::kDense) {
      q.dense = p.q_probs + int64_t(lo + k) * p.q_row_stride;
      q_x = q.dense[x];
    } else if (p.q_mode == DraftQ::kSparse) {
      q.ids = p.q_ids + int64_t(lo + k) * p.num_candidates;
      q.probs = p.q_probs + int64_t(lo + k) * p.q_row_stride;
      q.k = p.num_candidates;
      q_x = fmaxf(listed_q(q.ids, q.probs, q.k, x), 0.f);
    }
    const float u = uniform_open01(philox_u32(seed, offset + k, kPurposeAccept, 0));
    if (accept_draft(u, p_x, q_x)) {
      if (be.leader()) out[k] = x;
      continue;
    }
    const RaceResult r = be.row_race(row, inv_t, lse, q, seed, offset + k);
    emitted = r.residual.i >= 0 ? r.residual.i : r.target.i;
    rejected = true;
    break;
  }
  if (!rejected) {  // every draft accepted: the bonus token comes from p
    const T* row = p.logits + (row0 + n) * p.logits_row_stride;
    if (greedy) {
      emitted = be.row_argmax(row).i;
    } else {
      const RaceQ none{DraftQ::kOneHot, nullptr, nullptr, nullptr, 0};
      // lse only shifts every key equally, so the bonus race skips the softmax pass.
      emitted = be.row_race(row, inv_t, 0.f, none, seed, offset + n).target.i;
    }
  }
  if (be.leader()) {
    out[k] = emitted;
    p.out_num_accepted[b] = k;
  }
}

}  // namespace flashspark
