// Ragged rejection-sampling verification: the math shared by the CPU and the
// CUDA kernel. Both run the same per-request driver (`verify_request`); they
// differ only in how a backend reduces one vocabulary row (parallel chunks on
// the CPU, a CUB block reduction on the GPU).
//
// Layout (B requests, T = cu_num_draft[B] draft tokens, V vocabulary):
//   logits        [T + B, V]  request b owns rows cu[b]+b ... cu[b+1]+b: one per
//                             draft token, then its bonus row; logits, or the
//                             target's probabilities p when target_probs is set
//   draft_tokens  [T]
//   draft q       dense [T, V], sparse ids/probs [T, K] (fp32, bf16 or fp16), or none
//                             (one-hot draft)
//   out_tokens    [B, max_spec_len + 1]: accepted drafts, then the correction or
//                             bonus token, then -1
//   num_accepted  [B]
//
// Randomness (see philox.h), for request b and row k of that request:
//   accept test   philox_u32(seed[b], offset[b] + k, kPurposeAccept, 0)
//   resample race philox_u32(seed[b], offset[b] + k, kPurposeResample, x) for token x:
//                 Gumbel keys log r(x) + g on logits, r(x) / E keys on probabilities (the
//                 same draw: g = -log E), so neither mode takes a log of the other's values
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
  AnyFloatPtr q_probs;  // dense [T, V] or sparse [T, K]
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
  // The logits rows hold probabilities p instead (an engine that has them already): p(x) is
  // read as given, never renormalized, and temperature must be greedy or exactly 1.
  bool target_probs = false;
  int32_t batch = 0;
  int32_t vocab = 0;
  int32_t max_spec_len = 0;
};

// A draft id of -1 is a placeholder (vLLM's convention for a position with no draft): it is
// rejected, so the request emits the correction token sampled at that position and stops.
constexpr int32_t kPlaceholderToken = -1;

// A draft or target probability is usable when it lies in [0, 1] (NaN fails).
FS_HOST_DEVICE bool prob_ok(float v) { return v >= 0.f && v <= 1.f; }

// Probabilities are already tempered: a request on them is greedy or samples them as given.
FS_HOST_DEVICE bool probs_temperature_ok(float t) { return temperature_greedy(t) || t == 1.f; }

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
  const float t = p.temperature[b];
  if (!temperature_ok(t) || (p.target_probs && !probs_temperature_ok(t))) return Status::kBadTemperature;
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
        if (!prob_ok(p.q_probs[int64_t(i) * p.q_row_stride + j])) return Status::kBadDraftProb;
        listed |= c == x;
      }
      // A draft drawn from q is always listed; an unlisted one has q(x) = 0.
      if (!listed && !placeholder) return Status::kDraftNotListed;
    } else if (p.q_mode == DraftQ::kDense && !placeholder) {  // a placeholder's row is checked in its race
      if (!prob_ok(p.q_probs[int64_t(i) * p.q_row_stride + x])) return Status::kBadDraftProb;
    }
  }
  return Status::kOk;
}

// ---- per-element math -------------------------------------------------------

// q restricted to a short candidate list (sparse q, or the one-hot draft as a
// list of one): q(x) summed over every entry listing x (so duplicate ids are
// exact), or -1 when x is not listed (q(x) = 0).
FS_HOST_DEVICE float listed_q(const int32_t* ids, AnyFloatPtr probs, int32_t k, int32_t x) {
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

// On probabilities, a value outside [0, 1] (NaN included) reads as +inf in the same way.
FS_HOST_DEVICE float greedy_prob(float x) { return prob_ok(x) ? x : kPosInf; }

FS_HOST_DEVICE Status greedy_row_status(const ArgMax& am, bool probs) {
  if (probs) return am.v < kPosInf && am.v > 0.f ? Status::kOk : Status::kBadTargetProb;
  if (!(am.v < kPosInf)) return Status::kNonFiniteLogit;
  return am.v == kNegInf ? Status::kNoFiniteLogit : Status::kOk;
}

FS_HOST_DEVICE Status softmax_row_status(const SoftmaxState& st) {
  if (softmax_valid(st)) return Status::kOk;
  return st.m == kNegInf && st.s == 0.f ? Status::kNoFiniteLogit : Status::kNonFiniteLogit;
}

// Two races run over the same noise in one pass: `residual` samples the
// correction token; `target` samples from p itself and is the fallback when
// the residual has no mass left (p == q up to rounding). `bad` flags a dense
// q entry (kRaceBadQ) or a p entry (kRaceBadP) that is not a probability.
struct RaceResult {
  ArgMax residual;
  ArgMax target;
  int32_t bad;
};
constexpr int32_t kRaceBadQ = 1, kRaceBadP = 2;

FS_HOST_DEVICE RaceResult race_identity() { return RaceResult{argmax_identity(), argmax_identity(), 0}; }

FS_HOST_DEVICE RaceResult race_merge(const RaceResult& a, const RaceResult& b) {
  return RaceResult{argmax_merge(a.residual, b.residual), argmax_merge(a.target, b.target), a.bad | b.bad};
}

struct RaceMergeOp {
  FS_HOST_DEVICE RaceResult operator()(const RaceResult& a, const RaceResult& b) const { return race_merge(a, b); }
};

// What a race subtracts from p: nothing (bonus row), a dense q row, or a
// short list (sparse q, or the one-hot draft).
struct RaceQ {
  DraftQ mode;         // kOneHot with k == 0 means "no subtraction" (bonus)
  AnyFloatPtr dense;   // dense row, when mode == kDense
  const int32_t* ids;  // listed ids, when mode != kDense
  AnyFloatPtr probs;
  int32_t k;

  // q(x) of a dense row, flagging an entry that is not a probability (the whole row is read
  // once in a race: it is checked as it goes); 0 for the other modes.
  FS_HOST_DEVICE float dense_q(RaceResult& r, int32_t x) const {
    if (mode != DraftQ::kDense) return 0.f;
    const float qx = dense[x];
    if (!prob_ok(qx)) r.bad |= kRaceBadQ;
    return qx;
  }
  // q(x) of the listed modes: -1 when x is not listed (q(x) = 0).
  FS_HOST_DEVICE float listed(int32_t x) const { return listed_q(ids, probs, k, x); }
};

// The row's softmax, as a race needs it: log p(x) = (x - m) * inv_t - log_s.
struct RowSoftmax {
  float m, inv_t, log_s;
  FS_HOST_DEVICE float log_prob(float x) const { return (x - m) * inv_t - log_s; }
};

// Adds token x of a logits row (value x_logit, Philox draw `bits`) to both races: Gumbel keys
// on log p.
struct LogitRace {
  RaceQ q;
  RowSoftmax sm;
  FS_HOST_DEVICE void operator()(RaceResult& r, int32_t x, float x_logit, uint32_t bits) const {
    const float qx = q.dense_q(r, x);
    const float g = gumbel_from_u32(bits);
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
      const float lq = q.listed(x);
      kr = lq < 0.f ? kp : residual_key(lp, lq, g);
    }
    if (kr != kNegInf && argmax_better(kr, x, r.residual)) r.residual = ArgMax{kr, x};
  }
};

// Adds token x of a probabilities row (p(x) = px) to both races: keys r(x) / E, with no log
// of p and no normalizer (an exponential race is invariant to the scale of r).
struct ProbRace {
  RaceQ q;
  FS_HOST_DEVICE void operator()(RaceResult& r, int32_t x, float px, uint32_t bits) const {
    const float qx = q.dense_q(r, x);
    if (!prob_ok(px)) {
      r.bad |= kRaceBadP;
      return;
    }
    if (px == 0.f) return;  // no mass: never emitted
    const float e = exponential_from_u32(bits);
    const float kp = px / e;
    if (argmax_better(kp, x, r.target)) r.target = ArgMax{kp, x};
    if (!argmax_better(kp, x, r.residual)) return;  // residual mass <= px: its key <= kp
    float lq = qx;
    if (q.mode != DraftQ::kDense) lq = q.listed(x);
    const float res = lq > 0.f ? px - lq : px;
    if (res > 0.f && argmax_better(res / e, x, r.residual)) r.residual = ArgMax{res / e, x};
  }
};

// ---- the per-request driver -------------------------------------------------
//
// Backend interface (all members are collective: every participant calls them
// and every participant receives the same result):
//   ArgMax        row_argmax(const T* row, bool probs)  -- of greedy_logit(x), or greedy_prob(x)
//   SoftmaxState  row_softmax(const T* row, float inv_t)
//   RaceResult    row_race(const T* row, const Add& add, uint64_t seed, uint64_t position)
//                 -- folds add(r, x, value of x, Philox draw for x) over the row
//   bool          leader()    -- true for the one participant that writes outputs

// The race over one row: sampled from norm(max(p - q, 0)) (q.k == 0 and one-hot: from p).
template <class T, class Backend>
FS_HOST_DEVICE RaceResult race_row(const VerifyParams<T>& p, Backend& be, const T* row, const RowSoftmax& sm,
                                   const RaceQ& q, uint64_t seed, uint64_t position) {
  if (p.target_probs) return be.row_race(row, ProbRace{q}, seed, position);
  return be.row_race(row, LogitRace{q, sm}, seed, position);
}

// The row's softmax at 1 / inv_t, or nothing to compute on probabilities.
template <class T, class Backend>
FS_HOST_DEVICE Status row_softmax(const VerifyParams<T>& p, Backend& be, const T* row, float inv_t, RowSoftmax& sm) {
  sm = RowSoftmax{0.f, inv_t, 0.f};
  if (p.target_probs) return Status::kOk;
  const SoftmaxState st = be.row_softmax(row, inv_t);
  sm = RowSoftmax{st.m, inv_t, logf(st.s)};
  return softmax_row_status(st);
}

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
        const ArgMax am = be.row_argmax(row, p.target_probs);
        status = greedy_row_status(am, p.target_probs);
        if (status != Status::kOk) break;
        if (am.i == x) {  // never for a placeholder: it is rejected, the argmax emitted
          if (be.leader()) out[k] = x;
          continue;
        }
        emitted = am.i;
        rejected = true;
        break;
      }
      RowSoftmax sm;
      status = row_softmax(p, be, row, inv_t, sm);
      if (status != Status::kOk) break;
      // A placeholder lists no token in a one-hot q, so its residual is p itself.
      const bool placeholder = x == kPlaceholderToken;
      float p_x = 0.f;
      if (!placeholder) p_x = p.target_probs ? to_float(row[x]) : expf(sm.log_prob(to_float(row[x])));
      if (p.target_probs && !prob_ok(p_x)) {
        status = Status::kBadTargetProb;
        break;
      }
      RaceQ q{p.q_mode, AnyFloatPtr{}, &x, AnyFloatPtr{&one, FloatType::kFloat32}, 1};
      float q_x = 1.f;
      if (p.q_mode == DraftQ::kDense) {
        q.dense = p.q_probs + int64_t(lo + k) * p.q_row_stride;
        q_x = placeholder ? 1.f : q.dense[x];
      } else if (p.q_mode == DraftQ::kSparse) {
        q.ids = p.q_ids + int64_t(lo + k) * p.num_candidates;
        q.probs = p.q_probs + int64_t(lo + k) * p.q_row_stride;
        q.k = p.num_candidates;
        q_x = fmaxf(q.listed(x), 0.f);
      }
      const float u = uniform_open01(philox_u32(seed, offset + k, kPurposeAccept, 0));
      if (!placeholder && accept_draft(u, p_x, q_x)) {
        if (be.leader()) out[k] = x;
        continue;
      }
      const RaceResult r = race_row(p, be, row, sm, q, seed, offset + k);
      if (r.bad) {
        status = r.bad & kRaceBadQ ? Status::kBadDraftProb : Status::kBadTargetProb;
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
        const ArgMax am = be.row_argmax(row, p.target_probs);
        status = greedy_row_status(am, p.target_probs);
        emitted = am.i;
      } else {
        RowSoftmax sm;
        status = row_softmax(p, be, row, inv_t, sm);
        if (status == Status::kOk) {
          const RaceQ none{DraftQ::kOneHot, AnyFloatPtr{}, nullptr, AnyFloatPtr{}, 0};
          const RaceResult r = race_row(p, be, row, sm, none, seed, offset + n);
          if (r.bad) status = Status::kBadTargetProb;
          emitted = r.target.i;
          // A probabilities row with no mass at all has no winner.
          if (status == Status::kOk && emitted < 0) status = Status::kBadTargetProb;
        }
      }
    }
    if (status == Status::kOk && rejected && emitted < 0) status = Status::kBadTargetProb;  // ditto, a rejected row
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
