// CPU kernel of `verify`: parallel over requests, and over vocabulary chunks
// when there are fewer requests than threads.
#pragma once

#include <algorithm>

#include "flashspark/cpu/reduce.h"
#include "flashspark/cpu/vec.h"
#include "flashspark/verify.h"

namespace flashspark::cpu {

// Rows are reduced in tiles that stay in L1 (fp32 rows in place, 16-bit rows converted).
constexpr int64_t kVerifyTile = 1024;

// The argmax of keys[0, n) as vocabulary ids base + i (lowest on ties); none when all are -inf.
inline ArgMax tile_argmax(int64_t n, const float* keys, int64_t base) {
  const float m = max_of(n, keys);
  if (m == kNegInf) return argmax_identity();
  return ArgMax{m, int32_t(base + first_equal(n, keys, m))};
}

// q of the tile [b, b + n) of a dense row as fp32: in place, or converted into buf.
inline const float* dense_q_tile(const RaceQ& q, int64_t b, int64_t n, float* buf) {
  if (q.dense.type == FloatType::kFloat32) return static_cast<const float*>(q.dense.data) + b;
  for (int64_t i = 0; i < n; ++i) buf[i] = q.dense[b + i];
  return buf;
}

// q of the listed ids that fall in the tile [b, b + n), summed over an id's entries (duplicates),
// into qsum at the id's offset: O(K) per tile (only those entries are written and read).
inline void listed_q_tile(const RaceQ& q, int64_t b, int64_t n, float* qsum) {
  for (int32_t j = 0; j < q.k; ++j) {
    const int64_t i = int64_t(q.ids[j]) - b;
    if (i >= 0 && i < n) qsum[i] = 0.f;
  }
  for (int32_t j = 0; j < q.k; ++j) {
    const int64_t i = int64_t(q.ids[j]) - b;
    if (i >= 0 && i < n) qsum[i] += q.listed_prob(j);
  }
}

// LogitRace's keys over a tile: target keys log p + g, then the residual keys (dense q: every
// entry; listed q: only the listed ids differ from the target keys).
FS_CPU_CLONES static void logit_target_keys(int64_t n, const float* __restrict x, const uint32_t* __restrict bits,
                                            RowSoftmax sm, float* __restrict g, float* __restrict keys) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    g[i] = race_gumbel(bits[i]);
    keys[i] = sm.log_prob(x[i]) + g[i];
  }
}

FS_CPU_CLONES static void logit_residual_keys(int64_t n, const float* __restrict x, const float* __restrict q,
                                              const float* __restrict g, RowSoftmax sm, float* __restrict keys) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) keys[i] = residual_key(sm.log_prob(x[i]), q[i], g[i]);
}

inline RaceResult logit_race_tile(const LogitRace& race, int64_t b, int64_t n, const float* x, const uint32_t* bits) {
  float g[kVerifyTile], keys[kVerifyTile], qbuf[kVerifyTile];
  logit_target_keys(n, x, bits, race.sm, g, keys);
  RaceResult r = race_identity();
  r.target = tile_argmax(n, keys, b);
  const RaceQ& q = race.q;
  if (q.mode == DraftQ::kDense) {
    const float* qt = dense_q_tile(q, b, n, qbuf);
    if (any_outside01(n, qt)) r.bad |= kRaceBadQ;
    logit_residual_keys(n, x, qt, g, race.sm, keys);
    r.residual = tile_argmax(n, keys, b);
    return r;
  }
  if (q.k == 0) {  // nothing subtracted (the bonus row): the residual is p
    r.residual = r.target;
    return r;
  }
  listed_q_tile(q, b, n, qbuf);
  for (int32_t j = 0; j < q.k; ++j) {
    const int64_t i = int64_t(q.ids[j]) - b;
    if (i >= 0 && i < n) keys[i] = residual_key(race.sm.log_prob(x[i]), qbuf[i], g[i]);
  }
  r.residual = tile_argmax(n, keys, b);
  return r;
}

// ProbRace's keys over a tile: r / E with E = -log u, for r = p (target) and r = max(p - q, 0).
FS_CPU_CLONES static void prob_target_keys(int64_t n, const float* __restrict px, const uint32_t* __restrict bits,
                                           float* __restrict e, float* __restrict keys) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    e[i] = race_exponential(bits[i]);
    keys[i] = prob_key(px[i], e[i]);
  }
}

FS_CPU_CLONES static void prob_residual_keys(int64_t n, const float* __restrict px, const float* __restrict q,
                                             const float* __restrict e, float* __restrict keys) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) keys[i] = prob_key(prob_residual(px[i], q[i]), e[i]);
}

inline RaceResult prob_race_tile(const ProbRace& race, int64_t b, int64_t n, const float* px, const uint32_t* bits) {
  float e[kVerifyTile], keys[kVerifyTile], qbuf[kVerifyTile];
  RaceResult r = race_identity();
  if (any_outside01(n, px)) r.bad |= kRaceBadP;
  prob_target_keys(n, px, bits, e, keys);
  r.target = tile_argmax(n, keys, b);
  const RaceQ& q = race.q;
  if (q.mode == DraftQ::kDense) {
    const float* qt = dense_q_tile(q, b, n, qbuf);
    if (any_outside01(n, qt)) r.bad |= kRaceBadQ;
    prob_residual_keys(n, px, qt, e, keys);
    r.residual = tile_argmax(n, keys, b);
    return r;
  }
  if (q.k == 0) {
    r.residual = r.target;
    return r;
  }
  listed_q_tile(q, b, n, qbuf);
  for (int32_t j = 0; j < q.k; ++j) {
    const int64_t i = int64_t(q.ids[j]) - b;
    if (i >= 0 && i < n) keys[i] = prob_key(prob_residual(px[i], qbuf[i]), e[i]);
  }
  r.residual = tile_argmax(n, keys, b);
  return r;
}

template <class T, class ParallelFor>
struct VerifyRowBackend {
  int64_t vocab;
  const ParallelFor& parallel_for;

  bool leader() const { return true; }

  ArgMax row_argmax(const T* row, int32_t /*k*/, bool probs) const {
    return chunked_reduce(
        vocab, argmax_identity(),
        [&](int64_t lo, int64_t hi) {
          // Per tile: a vectorized max and NaN test, then the first index of the max (a
          // later tile replaces it only when strictly larger: ties go to the lowest id).
          float buf[kVerifyTile];
          ArgMax a = argmax_identity();
          for (int64_t b = lo; b < hi; b += kVerifyTile) {
            const int64_t n = std::min(kVerifyTile, hi - b);
            const float* x = as_f32(row + b, size_t(n), buf);
            // greedy_logit / greedy_prob: NaN (on probabilities, anything outside [0, 1]) reads as +inf
            if (probs ? any_outside01(n, x) : any_nan(n, x)) return ArgMax{kPosInf, int32_t(b)};
            const float m = max_of(n, x);
            if (a.i < 0 || m > a.v) a = ArgMax{m, int32_t(b + first_equal(n, x, m))};
          }
          return a;
        },
        ArgMaxMergeOp{}, parallel_for);
  }

  SoftmaxState row_softmax(const T* row, int32_t /*k*/, float inv_t) const {
    return chunked_reduce(
        vocab, softmax_identity(),
        [&](int64_t lo, int64_t hi) {
          // Per tile: a vectorized max, NaN test and rescaled sum, merged like any two states.
          float buf[kVerifyTile];
          SoftmaxState st = softmax_identity();
          for (int64_t b = lo; b < hi; b += kVerifyTile) {
            const int64_t n = std::min(kVerifyTile, hi - b);
            const float* x = as_f32(row + b, size_t(n), buf);
            bool has_nan;
            const float m = max_of_checked(n, x, &has_nan);
            if (has_nan) return SoftmaxState{NAN, NAN};  // poisoned, whatever else the row holds
            if (m == kNegInf) continue;                  // all -inf: no mass
            // +inf leaves s = NaN (inf - inf), which softmax_valid rejects.
            st = softmax_merge(st, SoftmaxState{m, sum_exp_scaled(n, x, m, inv_t)}, inv_t);
          }
          return st;
        },
        SoftmaxMergeOp{inv_t}, parallel_for);
  }

  // The races over a row, tile by tile: the tile's Philox blocks, then both races' keys in L1
  // buffers (simd loops over the per-element math of LogitRace / ProbRace), then their argmaxes.
  RaceResult row_race(const T* row, const LogitRace& race, uint64_t seed, uint64_t position) const {
    return race_tiles(row, seed, position, [&](int64_t b, int64_t n, const float* x, const uint32_t* bits) {
      return logit_race_tile(race, b, n, x, bits);
    });
  }
  RaceResult row_race(const T* row, const ProbRace& race, uint64_t seed, uint64_t position) const {
    return race_tiles(row, seed, position, [&](int64_t b, int64_t n, const float* x, const uint32_t* bits) {
      return prob_race_tile(race, b, n, x, bits);
    });
  }

  template <class Tile>
  RaceResult race_tiles(const T* row, uint64_t seed, uint64_t position, const Tile& tile) const {
    return chunked_reduce(
        vocab, race_identity(),
        [&](int64_t lo, int64_t hi) {
          float buf[kVerifyTile];
          uint32_t bits[kVerifyTile];
          RaceResult r = race_identity();
          for (int64_t b = lo; b < hi; b += kVerifyTile) {  // b is a multiple of 4: whole Philox blocks
            const int64_t n = std::min(kVerifyTile, hi - b);
            philox_blocks(seed, position, kPurposeResample, uint32_t(b >> 2), ceil_div(n, 4), bits);
            r = race_merge(r, tile(b, n, as_f32(row + b, size_t(n), buf), bits));
          }
          return r;
        },
        RaceMergeOp{}, parallel_for);
  }
};

// Every request is checked before its rows are read (verify_check_request), so bad
// input in one request never touches another's outputs.
template <class T, class ParallelFor>
void verify_cpu(const VerifyParams<T>& p, int32_t num_tokens, const ParallelFor& parallel_for) {
  // Requests per task: enough that a task reads at least ~1M logits in the worst case.
  const int64_t per_request = int64_t(p.vocab) * (p.max_spec_len + 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(per_request, 1));
  parallel_for(0, p.batch, grain, [&](int64_t b0, int64_t b1) {
    VerifyRowBackend<T, ParallelFor> backend{p.vocab, parallel_for};
    for (int64_t b = b0; b < b1; ++b) {
      std::fill_n(p.out_tokens + b * (p.max_spec_len + 1), p.max_spec_len + 1, -1);
      verify_request(p, int32_t(b), verify_check_request(p, int32_t(b), num_tokens), backend);
    }
  });
}

}  // namespace flashspark::cpu
