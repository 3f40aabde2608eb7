// CPU kernels of the DFlash 2 ops: two_tap_conv, topk_select, path_select.
#pragma once

#include <algorithm>

#include "flashspark/cpu/reduce.h"
#include "flashspark/cpu/vec.h"
#include "flashspark/dflash2.h"

namespace flashspark::cpu {

// Top-K list and softmax state of row[lo, hi), in tiles that stay in L1: per tile a
// vectorized max and sum of exponentials (merged like any two softmax states), then a
// scan that only calls the insertion for values above the current K-th (ids rise
// along the scan, so an equal value never displaces a lower id: same order as topk_push).
constexpr int64_t kTopKTile = 1024;

template <class T>
TopKState topk_chunk(const T* row, int64_t lo, int64_t hi, int32_t k) {
  TopKState st = topk_state_identity(k);
  float buf[kTopKTile];
  for (int64_t b = lo; b < hi; b += kTopKTile) {
    const int64_t n = std::min(kTopKTile, hi - b);
    for (int64_t i = 0; i < n; ++i) buf[i] = to_float(row[b + i]);
    const float m = max_of(n, buf);
    if (m != kNegInf) st.softmax = softmax_merge(st.softmax, SoftmaxState{m, sum_exp_shifted(n, buf, m)});
    for (int64_t i = 0; i < n; ++i)
      if (buf[i] > st.top.v[k - 1] || st.top.i[k - 1] < 0) topk_push(st.top, buf[i], int32_t(b + i));
  }
  return st;
}

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
          p.vocab, topk_state_identity(p.k), [&](int64_t lo, int64_t hi) { return topk_chunk(row, lo, hi, p.k); },
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
  // S(a, b) = U(b) + <A[a] ⊙ g, B[b]>: the K candidate rows of B transposed once into a
  // [rank, 16] panel, then per predecessor A[a] ⊙ g times the panel (vecmat16): every
  // score summed in order of the rank index, like path_pair_score. Ranks above the panel
  // and K above 16 take the scalar path_pair_score.
  static constexpr int32_t kMaxPathRank = 512;
  static constexpr int32_t kPanel = 16;
  void pair_scores(int64_t rt, const int32_t* prev, int32_t n_prev, float* out) const {
    const int32_t* cand = p.cand_ids + rt * p.k;
    const float* unary = p.unary + rt * p.k;
    if (p.rank > kMaxPathRank || p.k > kPanel) {
      for (int32_t a = 0; a < n_prev; ++a)
        for (int32_t b = 0; b < p.k; ++b) out[a * p.k + b] = path_pair_score(p, rt, prev[a], cand[b], unary[b]);
      return;
    }
    const T* gr = p.g + rt * p.rank;
    float panel[kMaxPathRank * kPanel], ag[kMaxPathRank], row[kPanel];
    for (int32_t b = 0; b < kPanel; ++b) {
      const T* brow = b < p.k ? p.b_emb + int64_t(cand[b]) * p.rank : nullptr;
      for (int32_t i = 0; i < p.rank; ++i) panel[i * kPanel + b] = brow ? to_float(brow[i]) : 0.f;
    }
    for (int32_t a = 0; a < n_prev; ++a) {
      const T* ar = p.a_emb + int64_t(prev[a]) * p.rank;
      for (int32_t i = 0; i < p.rank; ++i) ag[i] = to_float(ar[i]) * to_float(gr[i]);
      vecmat16(p.rank, ag, panel, row);
      for (int32_t b = 0; b < p.k; ++b) out[a * p.k + b] = unary[b] + row[b];
    }
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
