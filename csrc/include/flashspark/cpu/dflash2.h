// CPU kernels of the DFlash 2 ops: two_tap_conv, topk_select, path_select.
#pragma once

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "flashspark/cpu/reduce.h"
#include "flashspark/cpu/vec.h"
#include "flashspark/dflash2.h"

namespace flashspark::cpu {

// Top-K list and softmax state of row[lo, hi), in tiles that stay in L1: per tile a
// vectorized max and sum of exponentials (merged like any two softmax states), then a
// scan that only calls the insertion for values above the current K-th (ids rise
// along the scan, so an equal value never displaces a lower id: same order as topk_push).
// Once the list is full, a run of kTopKRun values whose (vectorized) max does not beat
// the K-th is skipped whole: past the first few runs of a row almost all are.
constexpr int64_t kTopKTile = 1024;
constexpr int64_t kTopKRun = 64;

template <class T>
TopKState topk_chunk(const T* row, int64_t lo, int64_t hi, int32_t k) {
  TopKState st = topk_state_identity(k);
  float buf[kTopKTile];
  for (int64_t b = lo; b < hi; b += kTopKTile) {
    const int64_t n = std::min(kTopKTile, hi - b);
    for (int64_t i = 0; i < n; ++i) buf[i] = to_float(row[b + i]);
    float m = max_of(n, buf);  // ignores NaN
    float s = m == kNegInf ? 0.f : sum_exp_shifted(n, buf, m);
    if (!(m < kPosInf) || !(s == s) || (m == kNegInf && any_nan(n, buf))) {
      // rare: NaN (the sum is NaN) or +inf; read them as drafter_logit does
      for (int64_t i = 0; i < n; ++i) buf[i] = drafter_logit(buf[i]);
      m = max_of(n, buf);
      s = m == kNegInf ? 0.f : sum_exp_shifted(n, buf, m);
    }
    if (m != kNegInf) st.softmax = softmax_merge(st.softmax, SoftmaxState{m, s});
    for (int64_t r = 0; r < n; r += kTopKRun) {
      const int64_t e = std::min(n, r + kTopKRun);
      if (st.top.i[k - 1] >= 0 && max_of(e - r, buf + r) <= st.top.v[k - 1]) continue;
      for (int64_t i = r; i < e; ++i)
        if (buf[i] > st.top.v[k - 1] || st.top.i[k - 1] < 0) topk_push(st.top, buf[i], int32_t(b + i));
    }
  }
  return st;
}

// y[t, j] = sum_c x[t, c] * W[j, c] for a small W [J, C] (the conv's taps from delta_weight,
// path_select's g from W_h), four rows at a time, fp32. Few rows take dot products over
// W's rows (an fp32 W is read in place: nothing is built per call). Many rows take
// W^T in strips of 16 columns ([ceil(J / 16)][C][16], zero-padded) as vecmat16x4 products
// (register accumulators, no horizontal sums, about twice the rate), which repay the
// transposition from kStripRows rows up (measured at C = 256, J = 32).
struct RowProjection {
  static constexpr int64_t kStripRows = 16;
  std::vector<float> buf;
  const float* w = nullptr;  // W [J, C], or its strips when strips > 0
  int32_t J = 0, C = 0, strips = 0;

  template <class T>
  RowProjection(const T* weight, int32_t out_dim, int32_t in_dim, int64_t rows) : J(out_dim), C(in_dim) {
    if (rows < kStripRows) {
      w = as_f32_buffer(weight, size_t(J) * C, buf);
      return;
    }
    strips = (J + 15) / 16;
    buf.assign(size_t(strips) * C * 16, 0.f);
    for (int32_t j = 0; j < J; ++j)
      for (int32_t c = 0; c < C; ++c)
        buf[(size_t(j / 16) * C + c) * 16 + j % 16] = to_float(weight[int64_t(j) * C + c]);
    w = buf.data();
  }

  // Rows x[0..n), results at y + r * y_stride: W's rows (or strips) outside, four rows of x at a
  // time inside, so a strip is read from cache by every four rows of a tile, not from memory
  // (W [4G, C] of a wide layer is megabytes). Each result is the same sum whatever the grouping.
  void apply(const float* const* x, int32_t n, float* y, int64_t y_stride) const {
    const auto quad = [&](int32_t r0, const float** q) {
      for (int32_t r = 0; r < 4; ++r) q[r] = x[std::min(r0 + r, n - 1)];
      return std::min(4, n - r0);
    };
    if (strips == 0) {
      for (int32_t j = 0; j < J; ++j)
        for (int32_t r0 = 0; r0 < n; r0 += 4) {
          const float* q[4];
          const int32_t nq = quad(r0, q);
          float acc[4];
          dot4(C, q, w + size_t(j) * C, acc);
          for (int32_t r = 0; r < nq; ++r) y[(r0 + r) * y_stride + j] = acc[r];
        }
      return;
    }
    float out[64];
    for (int32_t s = 0; s < strips; ++s) {
      const int32_t width = std::min(16, J - 16 * s);
      for (int32_t r0 = 0; r0 < n; r0 += 4) {
        const float* q[4];
        const int32_t nq = quad(r0, q);
        vecmat16x4(C, q, w + size_t(s) * C * 16, out);
        for (int32_t r = 0; r < nq; ++r) std::copy_n(out + 16 * r, width, y + (r0 + r) * y_stride + 16 * s);
      }
    }
  }
};

// One row of the conv on fp32 buffers: x row, left row (null at a block start), the
// row's 2G taps d, optional residual row. Group by group, so the S channels of a group
// share their taps: each 16 channels of a group are one 16-wide vector step (compiled per
// instruction set, like vec.h; the scalar build of a variable-length group loop cost ~1 ns
// per element), the rest of a group (S not a multiple of 16, the last partial group)
// element by element. The CUDA kernel sums the same products.
template <bool kLeft, bool kRes>
static inline void two_tap_group16(float d0, float d1, const float* __restrict b0, const float* __restrict b1,
                                   const float* __restrict x, const float* __restrict left, const float* __restrict res,
                                   float* __restrict y) {
#pragma omp simd
  for (int32_t j = 0; j < 16; ++j) {
    float v = (b0[j] + d0) * x[j];
    if constexpr (kLeft) v += (b1[j] + d1) * left[j];
    if constexpr (kRes) v += res[j];
    y[j] = v;
  }
}

template <bool kLeft, bool kRes>
FS_CPU_CLONES static void two_tap_row_impl(int32_t C, int32_t S, int32_t G, const float* base, const float* d,
                                           const float* __restrict x, const float* __restrict left,
                                           const float* __restrict res, float* __restrict y) {
  for (int32_t g = 0; g < G; ++g) {
    const float d0 = d[g], d1 = d[G + g];
    int64_t c = int64_t(g) * S;
    const int64_t end = std::min<int64_t>(c + S, C);
    for (; c + 16 <= end; c += 16)
      two_tap_group16<kLeft, kRes>(d0, d1, base + c, base + C + c, x + c, left + (kLeft ? c : 0), res + (kRes ? c : 0),
                                   y + c);
    for (; c < end; ++c) {
      float v = (base[c] + d0) * x[c];
      if constexpr (kLeft) v += (base[C + c] + d1) * left[c];
      if constexpr (kRes) v += res[c];
      y[c] = v;
    }
  }
}

inline void two_tap_row(int32_t C, int32_t S, int32_t G, const float* base, const float* d, const float* __restrict x,
                        const float* __restrict left, const float* __restrict res, float* __restrict y) {
  if (left) {
    if (res)
      two_tap_row_impl<true, true>(C, S, G, base, d, x, left, res, y);
    else
      two_tap_row_impl<true, false>(C, S, G, base, d, x, left, res, y);
  } else {
    if (res)
      two_tap_row_impl<false, true>(C, S, G, base, d, x, left, res, y);
    else
      two_tap_row_impl<false, false>(C, S, G, base, d, x, left, res, y);
  }
}

// Rows of the conv whose taps are projected together: each strip of W^T (from kStripRows rows
// up) comes from memory once per tile, then from cache (measured at C = 4096, 2048 rows: 1.7x).
constexpr int32_t kConvTile = 32;

template <class T, class ParallelFor>
void two_tap_conv_cpu(const TwoTapParams<T>& p, const ParallelFor& parallel_for) {
  const Status checked = two_tap_check_blocks(p);
  write_status(p.status, 0, checked);
  const int32_t C = p.channels, S = p.group_size, G = p.groups(), J = 2 * G;
  if (checked != Status::kOk) {  // the finish conv's taps fail with the call
    std::fill_n(p.out, p.rows * p.channels, from_float<T>(NAN));
    if (p.finish_delta) std::fill_n(p.finish_delta, p.rows * J, from_float<T>(NAN));
    return;
  }
  constexpr bool kF32 = std::is_same_v<T, float>;              // fp32 rows are read and written in place (unnormalized)
  const int32_t JP = p.delta_weight ? p.projected_taps() : J;  // taps per row: the conv's, then the finish conv's
  std::vector<float> base_buf, norm_buf;                       // fp32 copies, when the operands are not fp32
  const float* base = as_f32_buffer(p.base, size_t(2) * C, base_buf);
  const float* norm = p.norm_weight ? as_f32_buffer(p.norm_weight, size_t(C), norm_buf) : nullptr;
  const std::optional<RowProjection> taps =
      p.delta_weight ? std::optional<RowProjection>(std::in_place, p.delta_weight, JP, C, p.rows) : std::nullopt;
  // Row t of the conv's input as fp32: x's row, RMS-normalized into dst with a norm weight.
  const auto input_row = [&](int64_t t, float* dst) -> const float* {
    const float* v = as_f32(p.x + t * p.x_stride, size_t(C), dst);
    if (!norm) return v;
    rms_scale(C, rms_inv(dot(C, v, v), C, p.norm_eps), norm, v, dst);
    return dst;
  };
  // At least ~16K channels of rows per task: below that (e.g. 32 rows of 256 channels, ~18 us)
  // waking a second thread between a drafter's small ops costs more than it saves.
  const int64_t grain = std::max<int64_t>(16, 16384 / std::max<int32_t>(C, 1));
  parallel_for(0, p.rows, grain, [&](int64_t t0, int64_t t1) {
    // Rows go a tile at a time: their x rows as fp32 (xp), then their taps d [tile][JP].
    const int32_t tile = int32_t(std::min<int64_t>(kConvTile, t1 - t0));
    std::vector<float> buf(size_t(tile + 3) * C + size_t(tile) * JP);
    float *xr = buf.data(), *xl = xr + size_t(tile) * C, *rr = xl + C, *yr = rr + C, *d = yr + C;
    for (int64_t tb = t0; tb < t1; tb += tile) {
      const int32_t nr = int32_t(std::min<int64_t>(tile, t1 - tb));
      const float* xp[kConvTile];
      for (int32_t r = 0; r < nr; ++r) xp[r] = input_row(tb + r, xr + size_t(r) * C);
      if (taps) {  // a row's taps depend on that row only
        taps->apply(xp, nr, d, JP);
        if (p.finish_delta)  // the finish conv's taps, rounded as a delta it is given
          for (int32_t r = 0; r < nr; ++r)
            for (int32_t i = 0; i < J; ++i) p.finish_delta[(tb + r) * J + i] = from_float<T>(d[size_t(r) * JP + J + i]);
      } else {
        for (int32_t r = 0; r < nr; ++r)
          for (int32_t i = 0; i < J; ++i) d[size_t(r) * JP + i] = to_float(p.delta[(tb + r) * J + i]);
      }
      for (int32_t r = 0; r < nr; ++r) {
        const int64_t t = tb + r;
        const float* left = nullptr;
        if (!conv_first_in_block(p, t)) left = r > 0 ? xp[r - 1] : input_row(t - 1, xl);
        const float* res = p.residual ? as_f32(p.residual + t * p.res_stride, size_t(C), rr) : nullptr;
        T* out = p.out + t * C;
        if constexpr (kF32) {
          two_tap_row(C, S, G, base, d + size_t(r) * JP, xp[r], left, res, out);
        } else {
          two_tap_row(C, S, G, base, d + size_t(r) * JP, xp[r], left, res, yr);
          for (int32_t c = 0; c < C; ++c) out[c] = from_float<T>(yr[c]);
        }
      }
    }
  });
}

// Rows per task: at least ~32K logits (torch's own grain), so a drafter's few rows at a small
// vocabulary (7 x 4096 at batch 1) run on the calling thread instead of waking the pool.
constexpr int64_t kTopKGrainLogits = 32768;

template <class T, class ParallelFor>
void topk_select_cpu(const TopKParams<T>& p, const ParallelFor& parallel_for) {
  const int64_t grain = std::max<int64_t>(1, kTopKGrainLogits / std::max<int64_t>(p.vocab, 1));
  parallel_for(0, p.rows, grain, [&](int64_t r0, int64_t r1) {
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
  // [rank, 16] panel, then A[a] ⊙ g times the panel for four predecessors a at a time
  // (vecmat16x4): every score summed in order of the rank index, like path_pair_score. Ranks above the panel
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
    float panel[kMaxPathRank * kPanel], ag[4][kMaxPathRank], rows[4 * kPanel], g_row[kMaxPathRank];
    // g_t as fp32, read once
    const float* gr = p.g_ws ? p.g_ws + rt * p.rank : as_f32(p.g + rt * p.rank, size_t(p.rank), g_row);
    for (int32_t b = 0; b < kPanel; ++b) {
      const T* brow = b < p.k ? p.b_emb + int64_t(cand[b]) * p.rank : nullptr;
      for (int32_t i = 0; i < p.rank; ++i) panel[i * kPanel + b] = brow ? to_float(brow[i]) : 0.f;
    }
    for (int32_t a0 = 0; a0 < n_prev; a0 += 4) {  // four predecessors per pass over the panel
      const int32_t na = std::min(4, n_prev - a0);
      const float* s[4];
      for (int32_t j = 0; j < 4; ++j) {
        if (j < na) {
          const T* ar = p.a_emb + int64_t(prev[a0 + j]) * p.rank;
          for (int32_t i = 0; i < p.rank; ++i) ag[j][i] = to_float(ar[i]) * gr[i];
        }
        s[j] = ag[j < na ? j : 0];
      }
      vecmat16x4(p.rank, s, panel, rows);
      for (int32_t j = 0; j < na; ++j)
        for (int32_t b = 0; b < p.k; ++b) out[(a0 + j) * p.k + b] = unary[b] + rows[j * kPanel + b];
    }
  }
};

// The fused g = W_h h of request r's P rows into g_ws, four rows at a time; h rows as
// fp32 in buf [4, D] when T is not fp32.
template <class T>
void path_g_request(const PathParams<T>& p, int32_t r, const RowProjection& w_h, float* buf) {
  const int32_t D = p.hidden_dim;
  for (int32_t t0 = 0; t0 < p.positions; t0 += 4) {
    const int32_t n = std::min(4, p.positions - t0);
    const float* h[4];
    for (int32_t j = 0; j < 4; ++j) {
      h[j] = as_f32(path_hidden_row(p, int64_t(r) * p.positions + t0 + std::min(j, n - 1)), size_t(D), buf + j * D);
    }
    w_h.apply(h, n, p.g_ws + (int64_t(r) * p.positions + t0) * p.rank, p.rank);
  }
}

template <class T, class ParallelFor>
void path_select_cpu(const PathParams<T>& p, const ParallelFor& parallel_for) {
  const std::optional<RowProjection> w_h =
      p.g_weight ? std::optional<RowProjection>(std::in_place, p.g_weight, p.rank, p.hidden_dim,
                                                int64_t(p.requests) * p.positions)
                 : std::nullopt;
  parallel_for(0, p.requests, 1, [&](int64_t r0, int64_t r1) {
    PathSerialBackend<T> backend{p};
    std::vector<float> h_buf(p.g_weight && !std::is_same_v<T, float> ? size_t(4) * p.hidden_dim : 0);
    for (int64_t r = r0; r < r1; ++r) {
      const Status st = path_check_request(p, int32_t(r));
      write_status(p.status, r, st);
      if (st != Status::kOk) {  // bad ids are never read
        path_write_failed(p, int32_t(r), 0, 1);
        continue;
      }
      if (w_h) path_g_request(p, int32_t(r), *w_h, h_buf.data());
      path_request(p, int32_t(r), backend);
    }
  });
}

}  // namespace flashspark::cpu
