// Ragged rejection-sampling verification: the math shared by the CPU and the
// CUDA kernel. Both decide a request with the same walk, race and finish (see the
// driver below); they differ in how rows are reduced and scheduled (parallel
// chunks of the rows the walk reaches on the CPU; every (row, chunk) tile of the
// batch at once, then the stop rows' chunks, on the GPU).
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
  using Value = T;
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
  // CUDA only: scratch of verify_workspace_bytes(batch, num_rows, vocab) bytes, 16-aligned
  // (num_rows: the logits' rows, T + B, or T with bonus_tokens).
  void* workspace = nullptr;
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

// The first logits row of request b (its row k is this + k).
template <class T>
FS_HOST_DEVICE int64_t verify_row_start(const VerifyParams<T>& p, int32_t b) {
  return int64_t(p.cu_num_draft[b]) + (p.bonus_tokens ? 0 : b);
}

// The request whose rows hold logits row r: the last b with verify_row_start(b) <= r, by binary
// search (well defined, if meaningless, on a malformed cu_num_draft); -1 when r is nobody's.
template <class T>
FS_HOST_DEVICE int32_t verify_row_owner(const VerifyParams<T>& p, int64_t r) {
  int32_t lo = 0, hi = p.batch;  // the answer lies in [lo - 1, hi - 1]
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (verify_row_start(p, mid) <= r)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int32_t b = lo - 1;
  if (b < 0) return -1;
  const int64_t k = r - verify_row_start(p, b), n = int64_t(p.cu_num_draft[b + 1]) - p.cu_num_draft[b];
  return k <= n - (p.bonus_tokens ? 1 : 0) ? b : -1;  // past its last row: nobody's
}

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
  // Every row of the request is its own: the CUDA kernel reduces a row for the request this
  // search finds, so rows that another request's range also covers (a cu_num_draft that is
  // not monotone) would be reduced for the wrong one. Checked on both backends alike.
  const int64_t start = verify_row_start(p, b), rows = int64_t(hi - lo) + (p.bonus_tokens ? 0 : 1);
  for (int64_t k = 0; k < rows; ++k)
    if (verify_row_owner(p, start + k) != b) return Status::kBadCuNumDraft;
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

// verify's race noise: philox.h's Gumbel and Exp(1) draws, with the log in plain arithmetic
// (log_normal: u and -log u are normal floats), so the CPU kernel computes it in simd loops and
// both backends evaluate the same arithmetic, equal up to FMA contraction (scalar libm logf,
// which the drafters' races use, does not vectorize).
FS_HOST_DEVICE float race_exponential(uint32_t bits) { return -log_normal(uniform_open01(bits)); }
FS_HOST_DEVICE float race_gumbel(uint32_t bits) { return -log_normal(race_exponential(bits)); }

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
  if (lp == kNegInf) return kNegInf;  // no target mass: no residual either
  if (q <= 0.f) return lp + g;        // no draft mass: residual equals p, skip exp/log
  const float r = exp_nonpositive(lp) - q;
  return r > 0.f ? log_positive(r) + g : kNegInf;
}

// The same races on probabilities: key r / E for residual mass r = max(p - q, 0) (p where
// q(x) = 0), given E = -log u; -inf (never emitted) without mass.
FS_HOST_DEVICE float prob_residual(float px, float q) { return q > 0.f ? px - q : px; }
FS_HOST_DEVICE float prob_key(float r, float e) { return r > 0.f ? r / e : kNegInf; }

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
  // The probability of listed entry j (a one-hot q: 1).
  FS_HOST_DEVICE float listed_prob(int32_t j) const { return mode == DraftQ::kOneHot ? 1.f : probs[j]; }
  // q(x) of the listed modes: -1 when x is not listed (q(x) = 0). A one-hot q lists the
  // draft alone, with q = 1 (a placeholder lists nothing a vocabulary id can match); tree_verify
  // lists a stop node's children this way, q = 1 each, so the residual has no mass there.
  FS_HOST_DEVICE float listed(int32_t x) const {
    if (mode == DraftQ::kOneHot) {
      for (int32_t j = 0; j < k; ++j)
        if (ids[j] == x) return 1.f;
      return -1.f;
    }
    return listed_q(ids, probs, k, x);
  }
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
    const float g = race_gumbel(bits);
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
    const float e = race_exponential(bits);
    const float kp = prob_key(px, e);
    if (argmax_better(kp, x, r.target)) r.target = ArgMax{kp, x};
    if (!argmax_better(kp, x, r.residual)) return;  // residual mass <= px: its key <= kp
    const float kr = prob_key(prob_residual(px, q.mode == DraftQ::kDense ? qx : q.listed(x)), e);
    if (kr != kNegInf && argmax_better(kr, x, r.residual)) r.residual = ArgMax{kr, x};
  }
};

// ---- the per-request driver -------------------------------------------------
//
// A request is decided in three steps that both backends share:
//   verify_walk    the accept tests, row by row, up to the stop row: the first rejected draft,
//                  or the bonus row. Greedy requests and the caller's bonus tokens end here.
//   the race       on the stop row only (race_stop_row): the one full-vocabulary pass with
//                  Philox noise, ~20x the ALU work of a softmax pass, so it never runs per row.
//   verify_finish  the emitted token from the race, and the request's outputs.
// The CPU runs them back to back per request, computing a row's softmax only when the walk
// reaches it (early exit saves work where threads are few); the CUDA kernel reduces every
// row's (row, chunk) tiles in parallel first, then walks, then races the stop rows' chunks.
//
// Backend interface of the walk (collective: every participant calls it and receives the
// same result), for request b's row k (pointer `row`):
//   ArgMax        row_argmax(const T* row, int32_t k, bool probs)  -- of greedy_logit / greedy_prob
//   SoftmaxState  row_softmax(const T* row, int32_t k, float inv_t)
//   bool          leader()    -- true for the one participant that writes outputs

// Where a request's walk ended.
struct VerifyWalk {
  Status status;
  int32_t k;        // drafts accepted (the stop row is row k of the request)
  int32_t emitted;  // the token, when the walk decided it (greedy, the caller's bonus); else -1
  int32_t race;     // 1: a race on row k decides the token (residual of draft k, or p at the bonus row)
  RowSoftmax sm;    // row k's softmax (logits mode), for its race
};

// Row k of request b (k = n_b is its bonus row).
template <class T>
FS_HOST_DEVICE const T* verify_row(const VerifyParams<T>& p, int32_t b, int32_t k) {
  return p.logits + (verify_row_start(p, b) + k) * p.logits_row_stride;  // given bonus: no bonus rows
}

// What the race at row k of request b subtracts from p: the draft's q, or nothing at the bonus row.
template <class T>
FS_HOST_DEVICE RaceQ race_q(const VerifyParams<T>& p, int32_t b, int32_t k) {
  const int32_t lo = p.cu_num_draft[b];
  if (k == p.cu_num_draft[b + 1] - lo) return RaceQ{DraftQ::kOneHot, AnyFloatPtr{}, nullptr, AnyFloatPtr{}, 0};
  const int64_t i = int64_t(lo) + k;
  if (p.q_mode == DraftQ::kDense) return RaceQ{DraftQ::kDense, p.q_probs + i * p.q_row_stride, nullptr, {}, 0};
  if (p.q_mode == DraftQ::kSparse)
    return RaceQ{DraftQ::kSparse, AnyFloatPtr{}, p.q_ids + i * p.num_candidates, p.q_probs + i * p.q_row_stride,
                 p.num_candidates};
  return RaceQ{DraftQ::kOneHot, AnyFloatPtr{}, p.draft_tokens + i, AnyFloatPtr{}, 1};
}

// Where a request's race runs: its stop row, what the race removes from p there, and its stream.
template <class T>
struct StopRow {
  const T* row;
  RaceQ q;
  uint64_t seed, position;
};

template <class T>
FS_HOST_DEVICE StopRow<T> race_stop(const VerifyParams<T>& p, int32_t b, const VerifyWalk& w) {
  return StopRow<T>{verify_row(p, b, w.k), race_q(p, b, w.k), uint64_t(p.seeds[b]), uint64_t(p.offsets[b]) + w.k};
}

// The race over a request's stop row on a backend, in the request's mode: Gumbel keys on logits,
// r / E on probabilities (verify's and tree_verify's params and walks alike).
template <class P, class Walk, class Backend>
FS_HOST_DEVICE RaceResult race_stop_row(const P& p, int32_t b, const Walk& w, Backend& be) {
  const auto s = race_stop(p, b, w);
  if (p.target_probs) return be.row_race(s.row, ProbRace{s.q}, s.seed, s.position);
  return be.row_race(s.row, LogitRace{s.q, w.sm}, s.seed, s.position);
}

// The row's softmax at 1 / inv_t, or nothing to compute on probabilities (verify's and
// tree_verify's params alike).
template <class P, class Backend>
FS_HOST_DEVICE Status row_softmax(const P& p, Backend& be, const typename P::Value* row, int32_t k, float inv_t,
                                  RowSoftmax& sm) {
  sm = RowSoftmax{0.f, inv_t, 0.f};
  if (p.target_probs) return Status::kOk;
  const SoftmaxState st = be.row_softmax(row, k, inv_t);
  sm = RowSoftmax{st.m, inv_t, log_positive(st.s)};
  return softmax_row_status(st);
}

// The caller has checked the request (verify_check_request) and passes the result; the walk
// adds the checks of the rows it reads, and writes the accepted drafts.
template <class T, class Backend>
FS_HOST_DEVICE VerifyWalk verify_walk(const VerifyParams<T>& p, int32_t b, Status status, Backend& be) {
  VerifyWalk w{status, 0, -1, 0, RowSoftmax{0.f, 1.f, 0.f}};
  if (status != Status::kOk) return w;
  int32_t* out = p.out_tokens + int64_t(b) * (p.max_spec_len + 1);
  const int32_t lo = p.cu_num_draft[b];
  const int32_t n = p.cu_num_draft[b + 1] - lo;
  const float temp = p.temperature[b];
  const bool greedy = temperature_greedy(temp);
  const float inv_t = greedy ? 1.f : 1.f / temp;
  const uint64_t seed = uint64_t(p.seeds[b]);
  const uint64_t offset = uint64_t(p.offsets[b]);
  for (; w.k < n; ++w.k) {
    const int32_t k = w.k;
    const T* row = verify_row(p, b, k);
    const int32_t x = p.draft_tokens[lo + k];
    if (greedy) {
      const ArgMax am = be.row_argmax(row, k, p.target_probs);
      w.status = greedy_row_status(am, p.target_probs);
      if (w.status != Status::kOk) return w;
      if (am.i == x) {  // never for a placeholder: it is rejected, the argmax emitted
        if (be.leader()) out[k] = x;
        continue;
      }
      w.emitted = am.i;
      return w;
    }
    w.status = row_softmax(p, be, row, k, inv_t, w.sm);
    if (w.status != Status::kOk) return w;
    // A placeholder lists no token in a one-hot q, so its residual is p itself.
    const bool placeholder = x == kPlaceholderToken;
    float p_x = 0.f, q_x = 1.f;
    if (!placeholder) {
      p_x = p.target_probs ? to_float(row[x]) : exp_nonpositive(w.sm.log_prob(to_float(row[x])));
      if (p.q_mode == DraftQ::kDense) {
        q_x = p.q_probs[int64_t(lo + k) * p.q_row_stride + x];
      } else if (p.q_mode == DraftQ::kSparse) {
        q_x = fmaxf(race_q(p, b, k).listed(x), 0.f);
      }
    }
    if (p.target_probs && !prob_ok(p_x)) {
      w.status = Status::kBadTargetProb;
      return w;
    }
    const float u = uniform_open01(philox_u32(seed, offset + k, kPurposeAccept, 0));
    if (!placeholder && accept_draft(u, p_x, q_x)) {
      if (be.leader()) out[k] = x;
      continue;
    }
    w.race = 1;  // rejected: the correction token comes from the residual at this row
    return w;
  }
  if (p.bonus_tokens) {  // every draft accepted: the caller's bonus
    w.emitted = p.bonus_tokens[b];
  } else if (greedy) {  // every draft accepted: the bonus token comes from p
    const ArgMax am = be.row_argmax(verify_row(p, b, n), n, p.target_probs);
    w.status = greedy_row_status(am, p.target_probs);
    w.emitted = am.i;
  } else {
    w.status = row_softmax(p, be, verify_row(p, b, n), n, inv_t, w.sm);
    w.race = w.status == Status::kOk;
  }
  return w;
}

// The request's outputs from its walk and, when it raced, the race over its stop row. A
// failed request writes -1 over its whole output row and num_accepted = -1; its status entry
// holds the code. Only the leader writes.
template <class T>
FS_HOST_DEVICE Status verify_finish(const VerifyParams<T>& p, int32_t b, const VerifyWalk& w, const RaceResult& r,
                                    bool leader) {
  Status status = w.status;
  int32_t emitted = w.emitted;
  if (status == Status::kOk && w.race) {
    if (r.bad) status = r.bad & kRaceBadQ ? Status::kBadDraftProb : Status::kBadTargetProb;
    emitted = r.residual.i >= 0 ? r.residual.i : r.target.i;  // p == q up to rounding: from p
    // A probabilities row with no mass at all has no winner.
    if (status == Status::kOk && emitted < 0) status = Status::kBadTargetProb;
  }
  if (leader) {
    int32_t* out = p.out_tokens + int64_t(b) * (p.max_spec_len + 1);
    if (status == Status::kOk) {
      out[w.k] = emitted;
      p.out_num_accepted[b] = w.k;
    } else {
      for (int32_t i = 0; i <= p.max_spec_len; ++i) out[i] = -1;
      p.out_num_accepted[b] = -1;
    }
    write_status(p.status, b, status);
  }
  return status;
}

// ---- the CUDA kernel's workspace (sizes only: CUDA-graph safe) ---------------

// Elements per (row, chunk) tile of the CUDA kernel: the unit of its parallelism over a row.
constexpr int64_t kVerifyChunk = 4096;

FS_HOST_DEVICE int32_t verify_chunks(int32_t vocab) { return int32_t(ceil_div(vocab, kVerifyChunk)); }

// A tile's partial: its online softmax (sampled requests on logits) or its argmax (greedy), for
// the request that owns its row (verify_row_owner).
struct VerifyRowPartial {
  SoftmaxState st;
  ArgMax am;
};

// The layout both ops' CUDA kernels share: walks [B], race partials [B * chunks], row partials
// [rows * chunks], then `ints` int32 of the op's own scratch.
template <class Walk>
struct VerifyWorkspaceOf {
  Walk* walks;             // [B]
  RaceResult* races;       // [B * chunks]: the stop row's chunk c
  VerifyRowPartial* rows;  // [num_rows * chunks]: logits row r, chunk c
  int32_t* scratch;        // [ints]
};
using VerifyWorkspace = VerifyWorkspaceOf<VerifyWalk>;

FS_HOST_DEVICE int64_t verify_align16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

template <class Walk>
FS_HOST_DEVICE int64_t workspace_bytes_of(int32_t batch, int64_t num_rows, int32_t vocab, int64_t ints) {
  const int64_t chunks = verify_chunks(vocab);
  return verify_align16(int64_t(batch) * int64_t(sizeof(Walk))) +
         verify_align16(int64_t(batch) * chunks * int64_t(sizeof(RaceResult))) +
         verify_align16(num_rows * chunks * int64_t(sizeof(VerifyRowPartial))) +
         verify_align16(ints * int64_t(sizeof(int32_t)));
}

template <class Walk>
FS_HOST_DEVICE VerifyWorkspaceOf<Walk> workspace_layout(void* workspace, int32_t batch, int64_t num_rows,
                                                        int32_t vocab) {
  const int64_t chunks = verify_chunks(vocab);
  char* base = static_cast<char*>(workspace);
  VerifyWorkspaceOf<Walk> ws;
  ws.walks = reinterpret_cast<Walk*>(base);
  base += verify_align16(int64_t(batch) * int64_t(sizeof(Walk)));
  ws.races = reinterpret_cast<RaceResult*>(base);
  base += verify_align16(int64_t(batch) * chunks * int64_t(sizeof(RaceResult)));
  ws.rows = reinterpret_cast<VerifyRowPartial*>(base);
  base += verify_align16(num_rows * chunks * int64_t(sizeof(VerifyRowPartial)));
  ws.scratch = reinterpret_cast<int32_t*>(base);
  return ws;
}

// Sizes only (CUDA-graph safe): proportional to the logits' rows, not to max_spec_len.
FS_HOST_DEVICE int64_t verify_workspace_bytes(int32_t batch, int64_t num_rows, int32_t vocab) {
  return workspace_bytes_of<VerifyWalk>(batch, num_rows, vocab, 0);
}

// verify keeps no scratch after its row partials, so their count does not enter the layout.
template <class T>
FS_HOST_DEVICE VerifyWorkspace verify_workspace(const VerifyParams<T>& p) {
  return workspace_layout<VerifyWalk>(p.workspace, p.batch, 0, p.vocab);
}

// The CUDA kernels' generic view of a verify call (tree_verify.h gives the tree's).
template <class T>
FS_HOST_DEVICE VerifyWorkspace workspace_of(const VerifyParams<T>& p) {
  return verify_workspace(p);
}
template <class T>
FS_HOST_DEVICE Status finish_request(const VerifyParams<T>& p, int32_t b, const VerifyWalk& w, const RaceResult& r,
                                     bool leader) {
  return verify_finish(p, b, w, r, leader);
}

// The tiles kernel's view of a verify batch (tree_verify.h gives the tree's).
template <class T>
FS_HOST_DEVICE int32_t tiles_row_owner(const VerifyParams<T>& p, int64_t r) {
  return verify_row_owner(p, r);
}

// The three steps back to back, on a backend that also races a row:
//   RaceResult row_race(const T* row, const LogitRace& / const ProbRace&, uint64_t seed, uint64_t position)
template <class T, class Backend>
FS_HOST_DEVICE Status verify_request(const VerifyParams<T>& p, int32_t b, Status status, Backend& be) {
  const VerifyWalk w = verify_walk(p, b, status, be);
  const RaceResult r = w.status == Status::kOk && w.race ? race_stop_row(p, b, w, be) : race_identity();
  return verify_finish(p, b, w, r, be.leader());
}

}  // namespace flashspark
