// CPU kernels of the DFlash 2 ops: two_tap_conv, topk_select, path_select.
#pragma once

#include <algorithm>

#include "flashspark/cpu/reduce.h"
#include "flashspark/dflash2.h"

namespace flashspark::cpu {

template <class T, class ParallelFor>
void two_tap_conv_cpu(const TwoTapParams<T>& p, const ParallelFor& parallel_for) {
  parallel_for(0, p.rows, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const bool first = conv_first_in_block(p, t);
      T* out = p.out + t * p.channels;
      for (int32_t c = 0; c < p.channels; ++c) out[c] = from_float<T>(two_tap_value(p, t, c, first));
    }
  });
}

template <class T, class ParallelFor>
void topk_select_cpu(const TopKParams<T>& p, const ParallelFor& parallel_for) {
  parallel_for(0, p.rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = p.logits + r * p.row_stride;
      const TopKState s = chunked_reduce(
          p.vocab, topk_state_identity(p.k),
          [&](int64_t lo, int64_t hi) {
            TopKState st = topk_state_identity(p.k);
            for (int64_t i = lo; i < hi; ++i) topk_state_add(st, to_float(row[i]), int32_t(i));
            return st;
          },
          TopKMergeOp{}, parallel_for);
      topk_write(s, p.out_values + r * p.k, p.out_ids + r * p.k, p.out_lse + r);
    }
  });
}

template <class T>
struct PathSerialBackend {
  const PathParams<T>& p;
  bool leader() const { return true; }
  int32_t broadcast(int32_t v) const { return v; }
  void pair_scores(int64_t rt, const int32_t* prev, int32_t n_prev, float* out) const {
    const int32_t* cand = p.cand_ids + rt * p.k;
    const float* unary = p.unary + rt * p.k;
    for (int32_t a = 0; a < n_prev; ++a)
      for (int32_t b = 0; b < p.k; ++b) out[a * p.k + b] = path_pair_score(p, rt, prev[a], cand[b], unary[b]);
  }
};

template <class T, class ParallelFor>
void path_select_cpu(const PathParams<T>& p, const ParallelFor& parallel_for) {
  parallel_for(0, p.requests, 1, [&](int64_t r0, int64_t r1) {
    PathSerialBackend<T> backend{p};
    for (int64_t r = r0; r < r1; ++r) path_request(p, int32_t(r), backend);
  });
}

template <class T>
PathError path_check(const PathParams<T>& p) {
  for (int32_t r = 0; r < p.requests; ++r) {
    const PathError e = path_check_request(p, r);
    if (e != PathError::kOk) return e;
  }
  return PathError::kOk;
}

}  // namespace flashspark::cpu
