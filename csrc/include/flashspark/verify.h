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
  const float* q_probs = nullptr;  // dense [T, V] or sparse [T, K]
  int64_t q_row_stride = 0;
  const int32_t* q_ids = nullptr;       // sparse only: [T, K], row stride = num_candidates
  int32_t num_candidates = 0;           // K
  const float* temperature = nullptr;   // [B]; below kGreedyTemperature = greedy
  const int64_t* seeds = nullptr;       // [B]
  const int64_t* offsets = nullptr;     // [B]
  int32_t* out_tokens = nullptr;        // [B, max_spec_len + 1]
  int32_t* out_num_accepted = nullptr;  // [B]; -1 for a failed request (it emits nothing)
  int32_t* status = nullptr;            // [B] Status codes, or null
  // [B] bonus tokens sampled by the caller (vLLM samples its own), or null. With them the
  // logits hold no bonus rows: request b's rows are cu[b] ... cu[b+1] ([T, V] in all).
  const int32_t* bonus_tokens = nullptr;
  int32_t batch = 0;
  int32_t vocab = 0;
  int32_t max_spec_len = 0;
};

// A draft id of -1 is a placeholder (vLLM's convention for a position with no draft): it is
// rejected, so the request emits the correction token sampled at that position and stops.
constexpr int32_t kPlaceholderToken = -1;

// A draft probability is usable when it is a probability (NaN fails).
FS_HOST_DEVICE bool draft_prob_ok(float q) { return q >= 0.f && q <= 1.f; }

// Checks of request b's own slice of the inputs, before any row is read: its
// cu_num_draft entries (so the rows it reads exist), temperature, draft ids,
// sparse candidates and the draft's own q. Shared by the CPU binding (eagerly,
// to raise) and both kernels (per request, into the status).
template <class T>
FS_HOST_DEVICE Status verify_check_request(const VerifyParams<T>& p, int32_t b, int32_t num_tokens) {
  const int32_t lo = p.cu_num_draft[b], hi = p.cu_num_draft[b + 1];
  if (b == 0 && lo != 0) return Status::kBadCuNumDraft;
  if (b == p.batch - 1 && hi != num_tokens) return Status::kBadCuNumDraft;
  if (hi < lo || lo < 0 || hi > num_tokens) return Status::kBadCuNumDraft;
  if (hi - lo > p.max_spec_len) return Status::kSpecTooLong;
  if (!temperature_ok(p.temperature[b])) return Status::kBadTemperature;
  if (p.bonus_tokens && (p.bonus_tokens[b] < 0 || p.bonus_tokens[b] >= p.vocab)) return Status::kBonusTokenRange;
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t x = p.draft_tokens[i];
    const bool placeholder = x == kPlaceholderToken;
    if (!placeholder && (x < 0 || x >= p.vocab)) return Status::kDraftTokenRange;
    if (p.q_mode == DraftQ::kSparse) {
      bool listed = false;
      for (int32_t j = 0; j < p.num_candidates; ++j) {
        const int32_t c = p.q_ids[int64_t(i) * p.num_candidates + j];
        if (c < 0 || c >= p.vocab) return Status::kCandidateRange;
        if (!draft_prob_ok(p.q_probs[int64_t(i) * p.q_row_stride + j])) return Status::kBadDraftProb;
        listed |= c == x;
      }
      // A draft drawn from q is always listed; an unlisted one has q(x) = 0.
      if (!listed && !placeholder) return Status::kDraftNotListed;
    } else if (p.q_mode == DraftQ::kDense && !placeholder) {  // a placeholder's row is checked in its race
      if (!draft_prob_ok(p.q_probs[int64_t(i) * p.q_row_stride + x])) return Status::kBadDraftProb;
    }
  }
  return Status::kOk;
}

// ---- per-element math -------------------------------------------------------

// q restricted to a short candidate list (sparse q, or the one-hot draft as a
// list of one): q(x) summed over every entry listing x (so duplicate ids are
// exact), or -1 when x is not listed (q(x) = 0).
FS_HOST_DEVICE float listed_q(const int32_t* ids, const float* probs, int32_t k, int32_t x) {
  float q = -1.f;
  for (int32_t j = 0; j < k; ++j)
    if (ids[j] == x) q = q < 0.f ? probs[j] : q + probs[j];
  return q;
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

// The greedy walk reads a logit as itself, except NaN as +inf: the row's maximum is
// then +inf exactly when the row holds NaN or +inf, and -inf when it is all -inf.
FS_HOST_DEVICE float greedy_logit(float x) { return x == x ? x : kPosInf; }

FS_HOST_DEVICE Status greedy_row_status(const ArgMax& am) {
  if (!(am.v < kPosInf)) return Status::kNonFiniteLogit;
  return am.v == kNegInf ? Status::kNoFiniteLogit : Status::kOk;
}

FS_HOST_DEVICE Status softmax_row_status(const SoftmaxState& st) {
  if (softmax_valid(st)) return Status::kOk;
  return st.m == kNegInf && st.s == 0.f ? Status::kNoFiniteLogit : Status::kNonFiniteLogit;
}

// Two races run over the same noise in one pass: `residual` samples the
// correction token; `target` samples from p itself and is the fallback when
// the residual has no mass left (p == q up to rounding). `bad_q` flags a dense
// q entry that is not a probability.
struct RaceResult {
  ArgMax residual;
  ArgMax target;
  int32_t bad_q;
};

FS_HOST_DEVICE RaceResult race_identity() { return RaceResult{argmax_identity(), argmax_identity(), 0}; }

FS_HOST_DEVICE RaceResult race_merge(const RaceResult& a, const RaceResult& b) {
  return RaceResult{argmax_merge(a.residual, b.residual), argmax_merge(a.target, b.target), a.bad_q | b.bad_q};
}

struct RaceMergeOp {
  FS_HOST_DEVICE RaceResult operator()(const RaceResult& a, const RaceResult& b) const { return race_merge(a, b); }
};

// What a race subtracts from p: nothing (bonus row), a dense q row, or a
// short list (sparse q, or the one-hot draft).
struct RaceQ {
  DraftQ mode;         // kOneHot with k == 0 means "no subtraction" (bonus)
  const float* dense;  // dense row, when mode == kDense
  const int32_t* ids;  // listed ids, when mode != kDense
  const float* probs;
  int32_t k;
};

// The row's softmax, as a race needs it: log p(x) = (x - m) * inv_t - log_s.
struct RowSoftmax {
  float m, inv_t, log_s;
  FS_HOST_DEVICE float log_prob(float x) const { return (x - m) * inv_t - log_s; }
};

// Adds token x with logit value x_logit and Gumbel noise g to both races.
FS_HOST_DEVICE void race_add(RaceResult& r, const RaceQ& q, const RowSoftmax& sm, int32_t x, float x_logit, float g) {
  float qx = 0.f;
  if (q.mode == DraftQ::kDense) {  // the whole q row is read once: check it as it goes
    qx = q.dense[x];
    if (!draft_prob_ok(qx)) r.bad_q = 1;
  }
  const float lp = sm.log_prob(x_logit);
  const float kp = lp + g;
  if (kp == kNegInf || !(kp == kp)) return;
  if (argmax_better(kp, x, r.target)) r.target = ArgMax{kp, x};
  // The residual key never exceeds kp, so a token that cannot beat the
  // current residual winner under p needs no look-up of q.
  if (!argmax_better(kp, x, r.residual)) return;
  float kr;
  if (q.mode == DraftQ::kDense) {
    kr = residual_key(lp, qx, g);
  } else {
    const float lq = listed_q(q.ids, q.probs, q.k, x);
    kr = lq < 0.f ? kp : residual_key(lp, lq, g);
  }
  if (kr != kNegInf && argmax_better(kr, x, r.residual)) r.residual = ArgMax{kr, x};
}

// ---- the per-request driver -------------------------------------------------
//
// Backend interface (all members are collective: every participant calls them
// and every participant receives the same result):
//   ArgMax        row_argmax(const T* row)            -- of greedy_logit(x)
//   SoftmaxState  row_softmax(const T* row, float inv_t)
//   RaceResult    row_race(const T* row, const RowSoftmax& sm, const RaceQ& q,
//                          uint64_t seed, uint64_t position)
//   bool          leader()    -- true for the one participant that writes outputs
//
// The caller has checked the request (verify_check_request) and passes the result;
// the walk adds the checks of the rows it reads. A failed request writes -1 over its
// whole output row and num_accepted = -1; its status entry holds the code.
template <class T, class Backend>
FS_HOST_DEVICE Status verify_request(const VerifyParams<T>& p, int32_t b, Status status, Backend& be) {
  int32_t* out = p.out_tokens + int64_t(b) * (p.max_spec_len + 1);
  int32_t k = 0;
  int32_t emitted = -1;
  if (status == Status::kOk) {
    const int32_t lo = p.cu_num_draft[b];
    const int32_t n = p.cu_num_draft[b + 1] - lo;
    const int64_t row0 = int64_t(lo) + (p.bonus_tokens ? 0 : b);  // given bonus tokens: no bonus rows
    const float temp = p.temperature[b];
    const bool greedy = temperature_greedy(temp);
    const float inv_t = greedy ? 1.f : 1.f / temp;
    const uint64_t seed = uint64_t(p.seeds[b]);
    const uint64_t offset = uint64_t(p.offsets[b]);
    const float one = 1.f;
    bool rejected = false;
    for (; k < n; ++k) {
      const T* row = p.logits + (row0 + k) * p.logits_row_stride;
      const int32_t x = p.draft_tokens[lo + k];
      if (greedy) {
        const ArgMax am = be.row_argmax(row);
        status = greedy_row_status(am);
        if (status != Status::kOk) break;
        if (am.i == x) {  // never for a placeholder: it is rejected, the argmax emitted
          if (be.leader()) out[k] = x;
          continue;
        }
        emitted = am.i;
        rejected = true;
        break;
      }
      const SoftmaxState st = be.row_softmax(row, inv_t);
      status = softmax_row_status(st);
      if (status != Status::kOk) break;
      const RowSoftmax sm{st.m, inv_t, logf(st.s)};
      // A placeholder lists no token in a one-hot q, so its residual is p itself.
      const bool placeholder = x == kPlaceholderToken;
      const float p_x = placeholder ? 0.f : expf(sm.log_prob(to_float(row[x])));
      RaceQ q{p.q_mode, nullptr, &x, &one, 1};
      float q_x = 1.f;
      if (p.q_mode == DraftQ::kDense) {
        q.dense = p.q_probs + int64_t(lo + k) * p.q_row_stride;
        q_x = placeholder ? 1.f : q.dense[x];
      } else if (p.q_mode == DraftQ::kSparse) {
        q.ids = p.q_ids + int64_t(lo + k) * p.num_candidates;
        q.probs = p.q_probs + int64_t(lo + k) * p.q_row_stride;
        q.k = p.num_candidates;
        q_x = fmaxf(listed_q(q.ids, q.probs, q.k, x), 0.f);
      }
      const float u = uniform_open01(philox_u32(seed, offset + k, kPurposeAccept, 0));
      if (!placeholder && accept_draft(u, p_x, q_x)) {
        if (be.leader()) out[k] = x;
        continue;
      }
      const RaceResult r = be.row_race(row, sm, q, seed, offset + k);
      if (r.bad_q) {
        status = Status::kBadDraftProb;
        break;
      }
      emitted = r.residual.i >= 0 ? r.residual.i : r.target.i;
      rejected = true;
      break;
    }
    if (status == Status::kOk && !rejected && p.bonus_tokens) {  // every draft accepted: the caller's bonus
      emitted = p.bonus_tokens[b];
    } else if (status == Status::kOk && !rejected) {  // every draft accepted: the bonus token comes from p
      const T* row = p.logits + (row0 + n) * p.logits_row_stride;
      if (greedy) {
        const ArgMax am = be.row_argmax(row);
        status = greedy_row_status(am);
        emitted = am.i;
      } else {
        const SoftmaxState st = be.row_softmax(row, inv_t);
        status = softmax_row_status(st);
        if (status == Status::kOk) {
          const RaceQ none{DraftQ::kOneHot, nullptr, nullptr, nullptr, 0};
          emitted = be.row_race(row, RowSoftmax{st.m, inv_t, logf(st.s)}, none, seed, offset + n).target.i;
        }
      }
    }
  }
  if (be.leader()) {
    if (status == Status::kOk) {
      out[k] = emitted;
      p.out_num_accepted[b] = k;
    } else {
      for (int32_t i = 0; i <= p.max_spec_len; ++i) out[i] = -1;
      p.out_num_accepted[b] = -1;
    }
    write_status(p.status, b, status);
  }
  return status;
}

}  // namespace flashspark
