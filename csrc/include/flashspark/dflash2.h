// DFlash 2 kernels, the math shared by CPU and CUDA:
//   * two_tap_conv: the two-tap dynamic depthwise conv that forces
//     left-to-right flow inside a block;
//   * topk_select: Top-K candidates per block position with the log-softmax
//     normalizer, and path selection over the K-wide lattice.
#pragma once

#include "flashspark/common.h"
#include "flashspark/philox.h"
#include "flashspark/softmax.h"

namespace flashspark {

// ---- two_tap_conv ---------------------------------------------------------------
//   out[t, c] = (base[0, c] + delta[t, 0, c / S]) * x[t, c]
//             + (base[1, c] + delta[t, 1, c / S]) * x[t - 1, c]    (0 at a block start)
//             (+ residual[t, c])
// with S channels per dynamic tap (group_size, 16 by default; G = ceil(C / S) groups) and
// delta either given or computed in the op from a projection weight W [2G, C]:
//   delta[t, i] = sum_c x[t, c] * W[i, c]   (fp32, the "dynamic" half of the conv fused in)
// With a norm weight w, x is first RMS-normalized in fp32 (the "prepare" conv fused with
// the sublayer's norm): x[t, c] -> w[c] * (x[t, c] * rms_inv(row t)), in the taps too.
// A W of 4G rows also projects rows [2G, 4G) from the same (normalized) rows: the taps of
// the sublayer's "finish" conv (one kernel projection for both convs, as z-lab's DFlash 2
// computes them from the prepare conv's input), written rounded to T into finish_delta for
// the finish conv to take as its delta; the prepare conv's own output is unchanged.

constexpr int32_t kConvGroup = 16;  // default channels sharing one dynamic tap

template <class T>
struct TwoTapParams {
  const T* x = nullptr;  // [N, C] rows of stride x_stride
  int64_t x_stride = 0;
  const T* base = nullptr;          // [2, C] contiguous
  const T* delta = nullptr;         // [N, 2, G] contiguous; or null with delta_weight
  const T* delta_weight = nullptr;  // [2G, C] or [4G, C] (with finish_delta) contiguous: delta computed in the op
  float* delta_ws = nullptr;        // [N, 2G] fp32 taps computed from delta_weight (CUDA: between its two kernels)
  T* finish_delta = nullptr;        // [N, 2, G] contiguous: rows [2G, 4G) of the projection (4G-row weight only)
  const T* residual = nullptr;      // [N, C] rows of stride res_stride, or null
  int64_t res_stride = 0;
  const T* norm_weight = nullptr;  // [C]: RMSNorm x first (or null)
  float norm_eps = 0.f;
  float* row_scale_ws = nullptr;       // [N] rms_inv of each row of x (CUDA: computed before the other kernels)
  T* out = nullptr;                    // [N, C] contiguous
  const int32_t* cu_blocks = nullptr;  // [num_blocks + 1] row offsets, or null: blocks of block_size rows
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t group_size = kConvGroup;  // S >= 1 channels per dynamic tap
  int64_t rows = 0;
  int32_t channels = 0;
  int32_t* status = nullptr;  // [1] Status of the call (CUDA: always given with cu_blocks), or null

  FS_HOST_DEVICE int32_t groups() const { return int32_t(ceil_div(channels, group_size)); }
  // Rows of delta_weight: the conv's 2G taps, then the finish conv's 2G with finish_delta.
  FS_HOST_DEVICE int32_t projected_taps() const { return (finish_delta ? 4 : 2) * groups(); }
};

// Ragged block offsets must start at 0, never decrease, and end at the row count;
// the whole call fails otherwise (its output is NaN).
template <class T>
FS_HOST_DEVICE Status two_tap_check_blocks(const TwoTapParams<T>& p) {
  if (!p.cu_blocks) return Status::kOk;
  if (p.cu_blocks[0] != 0 || p.cu_blocks[p.num_blocks] != p.rows) return Status::kBadCuBlocks;
  for (int32_t i = 0; i < p.num_blocks; ++i)
    if (p.cu_blocks[i] > p.cu_blocks[i + 1]) return Status::kBadCuBlocks;
  return Status::kOk;
}

// Whether row t starts a block (its left neighbour is outside the block).
// With ragged blocks the caller passes the block's first row.
FS_HOST_DEVICE bool conv_block_start(int64_t t, int64_t block_first_row) { return t == block_first_row; }

// delta[t, i] for i in [0, 2G): tap o = i / G, group g = i % G.
template <class T>
FS_HOST_DEVICE float two_tap_delta(const TwoTapParams<T>& p, int64_t t, int32_t i) {
  const int64_t at = t * 2 * p.groups() + i;
  return p.delta_weight ? p.delta_ws[at] : to_float(p.delta[at]);
}

// The conv's input at channel c of a row whose RMSNorm scale is s: x itself, or with a
// norm weight w[c] * (x * s) (the order of the reference's fp32 RMSNorm).
template <class T>
FS_HOST_DEVICE float two_tap_input(const TwoTapParams<T>& p, float x, float s, int32_t c) {
  return p.norm_weight ? to_float(p.norm_weight[c]) * (x * s) : x;
}

// Part of the fused projection: sum over c = c_begin, c_begin + c_step, ... < C of
// input[t, c] * W[i, c], s the row's RMSNorm scale (unused without a norm weight).
template <class T>
FS_HOST_DEVICE float two_tap_delta_dot(const TwoTapParams<T>& p, int64_t t, float s, int32_t i, int32_t c_begin,
                                       int32_t c_step) {
  const T* x = p.x + t * p.x_stride;
  const T* w = p.delta_weight + int64_t(i) * p.channels;
  float acc = 0.f;
  for (int32_t c = c_begin; c < p.channels; c += c_step) acc += two_tap_input(p, to_float(x[c]), s, c) * to_float(w[c]);
  return acc;
}

// First row of the block holding row t, for ragged blocks: binary search.
FS_HOST_DEVICE int64_t conv_block_first_row(const int32_t* cu_blocks, int32_t num_blocks, int64_t t) {
  int32_t lo = 0, hi = num_blocks;  // invariant: cu[lo] <= t < cu[hi]
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (cu_blocks[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  return cu_blocks[lo];
}

template <class T>
FS_HOST_DEVICE bool conv_first_in_block(const TwoTapParams<T>& p, int64_t t) {
  if (p.cu_blocks) return t == conv_block_first_row(p.cu_blocks, p.num_blocks, t);
  return t % p.block_size == 0;
}

// ---- topk_select (a): Top-K with the log-softmax normalizer --------------------------

constexpr int32_t kMaxTopK = 16;

// A running top-K list kept sorted descending, ties toward the lower id.
struct TopKList {
  float v[kMaxTopK];
  int32_t i[kMaxTopK];
  int32_t k;
};

FS_HOST_DEVICE void topk_init(TopKList& t, int32_t k) {
  t.k = k;
  for (int32_t j = 0; j < kMaxTopK; ++j) {
    t.v[j] = kNegInf;
    t.i[j] = -1;
  }
}

// Strict order of (value, id) pairs: larger value first, then lower id; NaN last.
FS_HOST_DEVICE bool topk_before(float va, int32_t ia, float vb, int32_t ib) {
  if (!(va == va)) return false;
  if (ib < 0 || !(vb == vb)) return true;
  return va > vb || (va == vb && ia < ib);
}

FS_HOST_DEVICE void topk_push(TopKList& t, float v, int32_t id) {
  if (!topk_before(v, id, t.v[t.k - 1], t.i[t.k - 1])) return;
  int32_t j = t.k - 1;
  while (j > 0 && topk_before(v, id, t.v[j - 1], t.i[j - 1])) {
    t.v[j] = t.v[j - 1];
    t.i[j] = t.i[j - 1];
    --j;
  }
  t.v[j] = v;
  t.i[j] = id;
}

FS_HOST_DEVICE void topk_merge_into(TopKList& dst, const TopKList& src) {
  for (int32_t j = 0; j < src.k && src.i[j] >= 0; ++j) topk_push(dst, src.v[j], src.i[j]);
}

// Top-K list and softmax state of one row, reduced together in one pass.
struct TopKState {
  TopKList top;
  SoftmaxState softmax;
};

struct TopKMergeOp {
  FS_HOST_DEVICE TopKState operator()(const TopKState& a, const TopKState& b) const {
    TopKState out = a;
    topk_merge_into(out.top, b.top);
    out.softmax = softmax_merge(a.softmax, b.softmax);
    return out;
  }
};

FS_HOST_DEVICE TopKState topk_state_identity(int32_t k) {
  TopKState s;
  topk_init(s.top, k);
  s.softmax = softmax_identity();
  return s;
}

// v as drafter_logit reads it: NaN counts as -inf, so a row always yields K ids.
FS_HOST_DEVICE void topk_state_add(TopKState& s, float v, int32_t id) {
  v = drafter_logit(v);
  topk_push(s.top, v, id);
  softmax_add(s.softmax, v);
}

template <class T>
struct TopKParams {
  const T* logits = nullptr;  // [N, V] rows of stride row_stride
  int64_t row_stride = 0;
  float* out_values = nullptr;  // [N, k] descending
  int32_t* out_ids = nullptr;   // [N, k]
  float* out_lse = nullptr;     // [N] log-sum-exp of the whole row
  int64_t rows = 0;
  int32_t vocab = 0, k = 0;
};

FS_HOST_DEVICE void topk_write(const TopKState& s, float* values, int32_t* ids, float* lse) {
  for (int32_t j = 0; j < s.top.k; ++j) {
    values[j] = s.top.v[j];
    ids[j] = s.top.i[j];
  }
  *lse = softmax_lse(s.softmax);
}

// ---- topk_select (b, c): lattice scores and path selection ---------------------------
//   S_t(a, b) = U_t(b) + < A[cand_{t-1}(a)] * g_t , B[cand_t(b)] >,  predecessor at t = 0: the anchor

enum class PathMode : int32_t { kBacktrack = 0, kGreedy = 1, kSample = 2 };

// Candidate lists longer than this are not a Top-K lattice (and would make the
// [R, P, K, K] workspace huge).
constexpr int32_t kMaxPathCandidates = 64;

template <class T>
struct PathParams {
  const int32_t* cand_ids = nullptr;  // [R, P, K]: P block positions, K candidates
  const float* unary = nullptr;       // [R, P, K]
  const T* a_emb = nullptr;           // [V, r]
  const T* b_emb = nullptr;           // [V, r]
  const T* g = nullptr;               // [R, P, r] = W_h h_t, or null with hidden and g_weight:
  const T* hidden = nullptr;          // [R, P, D] draft states, strides hidden_stride_r / _p (elements)
  int64_t hidden_stride_r = 0, hidden_stride_p = 0;
  const T* g_weight = nullptr;  // [r, D] W_h: g computed in the op into g_ws
  float* g_ws = nullptr;        // [R, P, r] fp32 g from hidden (CUDA: before the path kernel)
  int32_t hidden_dim = 0;
  const int32_t* anchor = nullptr;     // [R]
  const float* temperature = nullptr;  // [R] (sample mode)
  const int64_t* seeds = nullptr;      // [R]
  const int64_t* offsets = nullptr;    // [R]
  PathMode mode = PathMode::kBacktrack;
  int32_t* out_tokens = nullptr;  // [R, P]
  int32_t* out_choice = nullptr;  // [R, P] index into the K candidates
  float* out_scores = nullptr;    // [R, P, K]: S_t(chosen predecessor, .)
  float* out_q = nullptr;         // [R, P, K]: probability of each candidate given the chosen predecessor
  int32_t* status = nullptr;      // [R] Status codes, or null
  float* lattice = nullptr;       // workspace [R, P, K, K]: S_t(a, b) (greedy/sample fill row a = 0)
  float* best = nullptr;          // workspace [R, P, K] (backtrack)
  int32_t* backptr = nullptr;     // workspace [R, P, K] (backtrack)
  int32_t requests = 0, positions = 0, k = 0, rank = 0, vocab = 0;
};

// The draft state of row rt = r * P + t.
template <class T>
FS_HOST_DEVICE const T* path_hidden_row(const PathParams<T>& p, int64_t rt) {
  return p.hidden + (rt / p.positions) * p.hidden_stride_r + (rt % p.positions) * p.hidden_stride_p;
}

// Part of the fused g = W_h h: sum over c = c_begin, c_begin + c_step, ... < D of h_rt[c] * W_h[i, c].
template <class T>
FS_HOST_DEVICE float path_g_dot(const PathParams<T>& p, int64_t rt, int32_t i, int32_t c_begin, int32_t c_step) {
  const T* h = path_hidden_row(p, rt);
  const T* w = p.g_weight + int64_t(i) * p.hidden_dim;
  float acc = 0.f;
  for (int32_t c = c_begin; c < p.hidden_dim; c += c_step) acc += to_float(h[c]) * to_float(w[c]);
  return acc;
}

// g_rt[i]: given, or computed by the op (fp32).
template <class T>
FS_HOST_DEVICE float path_g(const PathParams<T>& p, int64_t rt, int32_t i) {
  return p.g_ws ? p.g_ws[rt * p.rank + i] : to_float(p.g[rt * p.rank + i]);
}

// S_t(a, b) for one predecessor token `prev` and candidate token `cand` at position t.
template <class T>
FS_HOST_DEVICE float path_pair_score(const PathParams<T>& p, int64_t rt, int32_t prev, int32_t cand, float unary) {
  const T* ar = p.a_emb + int64_t(prev) * p.rank;
  const T* br = p.b_emb + int64_t(cand) * p.rank;
  float dot = 0.f;
  for (int32_t i = 0; i < p.rank; ++i) dot += to_float(ar[i]) * path_g(p, rt, i) * to_float(br[i]);
  return unary + dot;
}

template <class T>
FS_HOST_DEVICE Status path_check_request(const PathParams<T>& p, int32_t r) {
  if (p.anchor[r] < 0 || p.anchor[r] >= p.vocab) return Status::kPathTokenRange;
  for (int64_t j = int64_t(r) * p.positions * p.k; j < int64_t(r + 1) * p.positions * p.k; ++j)
    if (p.cand_ids[j] < 0 || p.cand_ids[j] >= p.vocab) return Status::kPathTokenRange;
  if (p.mode == PathMode::kSample && !temperature_ok(p.temperature[r])) return Status::kBadTemperature;
  return Status::kOk;
}

// A failed request's outputs (written by every participant in turn, or the leader).
template <class T>
FS_HOST_DEVICE void path_write_failed(const PathParams<T>& p, int32_t r, int64_t begin, int64_t step) {
  const int64_t base = int64_t(r) * p.positions;
  for (int64_t i = begin; i < int64_t(p.positions) * p.k; i += step) {
    p.out_scores[base * p.k + i] = NAN;
    p.out_q[base * p.k + i] = 0.f;
    if (i < p.positions) {
      p.out_tokens[base + i] = -1;
      p.out_choice[base + i] = -1;
    }
  }
}

// Leader-only: the choice at position t from its score row (read as drafter_logit
// reads a logit, and written back so), and the q row. A row with no finite score, and
// greedy or deterministic modes, choose by argmax (the first candidate on ties) with
// q one-hot there; a sampled row races at 1 / T over the K candidates.
template <class T>
FS_HOST_DEVICE int32_t path_choose(const PathParams<T>& p, int32_t r, int32_t t, float* row, float* q) {
  const int32_t K = p.k;
  ArgMax best = argmax_identity();
  for (int32_t j = 0; j < K; ++j) {
    row[j] = drafter_logit(row[j]);
    argmax_add(best, row[j], j);
  }
  const bool sample = p.mode == PathMode::kSample && !temperature_greedy(p.temperature[r]);
  SoftmaxState st = softmax_identity();
  const float inv_t = sample ? 1.f / p.temperature[r] : 1.f;
  if (sample)
    for (int32_t j = 0; j < K; ++j) softmax_add(st, row[j], inv_t);
  if (!sample || !softmax_valid(st)) {
    const int32_t c = best.i < 0 ? 0 : best.i;
    for (int32_t j = 0; j < K; ++j) q[j] = j == c ? 1.f : 0.f;
    return c;
  }
  // Sampled path: exponential race over the K candidates at this position,
  // and q = softmax(row / T), the distribution the race draws from.
  const float log_s = logf(st.s);
  const uint64_t seed = uint64_t(p.seeds[r]), position = uint64_t(p.offsets[r]) + uint64_t(t);
  best = argmax_identity();
  for (int32_t j = 0; j < K; ++j) {
    const float lp = softmax_log_prob(row[j], st, inv_t, log_s);
    q[j] = expf(lp);
    if (lp != kNegInf) argmax_add(best, lp + gumbel_from_u32(philox_u32(seed, position, kPurposePath, uint32_t(j))), j);
  }
  return best.i < 0 ? 0 : best.i;
}

// The per-request driver shared by CPU and CUDA. Backend (collective calls):
//   void pair_scores(int64_t rt, const int32_t* prev, int32_t n_prev, float* out)
//        out[a * K + b] = S_t(prev[a], cand_t[b]) for a < n_prev, b < K
//   int32_t broadcast(int32_t v)   -- the leader's v, to every participant
//   bool leader()
template <class T, class Backend>
FS_HOST_DEVICE void path_request(const PathParams<T>& p, int32_t r, Backend& be) {
  const int32_t P = p.positions, K = p.k;
  const int64_t base = int64_t(r) * P;
  const int32_t anchor = p.anchor[r];
  float* lattice = p.lattice + base * K * K;
  if (P == 0) return;
  if (p.mode == PathMode::kBacktrack) {
    // Max-score path over the whole lattice: forward DP, then backtrack.
    for (int32_t t = 0; t < P; ++t) {
      const int32_t* prev = t == 0 ? &anchor : p.cand_ids + (base + t - 1) * K;
      be.pair_scores(base + t, prev, t == 0 ? 1 : K, lattice + int64_t(t) * K * K);
    }
    if (be.leader()) {
      for (int32_t j = 0; j < K; ++j) lattice[j] = drafter_logit(lattice[j]);  // t = 0: one predecessor
      for (int64_t i = int64_t(K) * K; i < int64_t(P) * K * K; ++i) lattice[i] = drafter_logit(lattice[i]);
      float* best = p.best + base * K;
      int32_t* bp = p.backptr + base * K;
      for (int32_t b = 0; b < K; ++b) {
        best[b] = lattice[b];
        bp[b] = 0;
      }
      for (int32_t t = 1; t < P; ++t)
        for (int32_t b = 0; b < K; ++b) {
          ArgMax am = argmax_identity();
          for (int32_t a = 0; a < K; ++a)
            argmax_add(am, best[(t - 1) * K + a] + lattice[(int64_t(t) * K + a) * K + b], a);
          best[t * K + b] = am.i < 0 ? kNegInf : drafter_logit(am.v);  // sums past FLT_MAX stay finite
          bp[t * K + b] = am.i < 0 ? 0 : am.i;
        }
      ArgMax last = argmax_identity();
      for (int32_t b = 0; b < K; ++b) argmax_add(last, best[(P - 1) * K + b], b);
      int32_t c = last.i < 0 ? 0 : last.i;
      for (int32_t t = P - 1; t >= 0; --t) {
        p.out_choice[base + t] = c;
        c = bp[t * K + c];
      }
      for (int32_t t = 0; t < P; ++t) {
        const int32_t c_t = p.out_choice[base + t];
        const float* row = lattice + (int64_t(t) * K + (t == 0 ? 0 : p.out_choice[base + t - 1])) * K;
        for (int32_t j = 0; j < K; ++j) {
          p.out_scores[(base + t) * K + j] = row[j];
          p.out_q[(base + t) * K + j] = j == c_t ? 1.f : 0.f;
        }
        p.out_tokens[base + t] = p.cand_ids[(base + t) * K + c_t];
      }
    }
    return;
  }
  // Greedy or sampled: left to right, each step conditioned on the choice before it.
  int32_t prev = anchor;
  for (int32_t t = 0; t < P; ++t) {
    float* row = lattice + int64_t(t) * K * K;
    be.pair_scores(base + t, &prev, 1, row);
    int32_t c = 0;
    if (be.leader()) {
      c = path_choose(p, r, t, row, p.out_q + (base + t) * K);
      for (int32_t j = 0; j < K; ++j) p.out_scores[(base + t) * K + j] = row[j];
      p.out_choice[base + t] = c;
      p.out_tokens[base + t] = p.cand_ids[(base + t) * K + c];
    }
    c = be.broadcast(c);
    prev = p.cand_ids[(base + t) * K + c];
  }
}

}  // namespace flashspark
