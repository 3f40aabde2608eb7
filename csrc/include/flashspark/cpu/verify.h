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

template <class T, class ParallelFor>
struct VerifyRowBackend {
  int64_t vocab;
  const ParallelFor& parallel_for;

  bool leader() const { return true; }

  ArgMax row_argmax(const T* row, bool probs) const {
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

  SoftmaxState row_softmax(const T* row, float inv_t) const {
    return chunked_reduce(
        vocab, softmax_identity(),
        [&](int64_t lo, int64_t hi) {
          // Per tile: a vectorized max, NaN test and rescaled sum, merged like any two states.
          float buf[kVerifyTile];
          SoftmaxState st = softmax_identity();
          for (int64_t b = lo; b < hi; b += kVerifyTile) {
            const int64_t n = std::min(kVerifyTile, hi - b);
            const float* x = as_f32(row + b, size_t(n), buf);
            if (any_nan(n, x)) return SoftmaxState{NAN, NAN};  // poisoned, whatever else the row holds
            const float m = max_of(n, x);
            if (m == kNegInf) continue;  // all -inf: no mass
            // +inf leaves s = NaN (inf - inf), which softmax_valid rejects.
            st = softmax_merge(st, SoftmaxState{m, sum_exp_scaled(n, x, m, inv_t)}, inv_t);
          }
          return st;
        },
        SoftmaxMergeOp{inv_t}, parallel_for);
  }

  template <class Add>
  RaceResult row_race(const T* row, const Add& add, uint64_t seed, uint64_t position) const {
    return chunked_reduce(
        vocab, race_identity(),
        [&](int64_t lo, int64_t hi) {
          RaceResult r = race_identity();
          for (int64_t i = lo; i < hi; i += 4) {
            const U32x4 bits = philox_block(seed, position, kPurposeResample, uint32_t(i >> 2));
            const int64_t n = std::min<int64_t>(4, hi - i);
            for (int64_t j = 0; j < n; ++j) add(r, int32_t(i + j), to_float(row[i + j]), lane(bits, uint32_t(j)));
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
