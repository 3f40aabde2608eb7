// launch_inject_context_kv and launch_block_diffusion_attention on cuda_on_cpu against
// inject_context_kv_cpu and block_diffusion_attention_cpu.
//
// block_diffusion_attention: contexts of 0, 1, 255, 256, 257 and S_max keys, several 256-key
// splits (about 600 and 1100 keys), ragged context lengths within a batch, GQA ratios 1, 2, 3
// and 4, head_dim 1 to 256 (every kDimPerLane branch, at and just past its limits 32, 64 and
// 128; odd sizes; the opt-in shared memory of D > 128), block sizes 0, 1, 4, 7 and 16 (query
// rows per KV head from 1 to 64: one CTA row group, a partial one, several), fp32 / bf16 /
// fp16, strided and permuted views of q, the caches and the block K/V, scores all near -128
// (each exp(score) alone underflows), and a request with a context length outside [0, S_max]
// next to good ones (its status, its NaN output, the others unaffected), with and without a
// status buffer. Cache positions at or past a request's context, and every padding element,
// are NaN: a kernel reading one of them spreads NaN into the output.
//
// inject_context_kv: token counts 0 to 130 (partial CTAs), 1 to 5 KV heads, head_dim 2 to 256
// (odd halves: head_dim must be even for the rotation), max_pos below and above S_max, strided
// token rows and strided / permuted caches, tokens with a bad slot, a bad position and a
// position past the cos/sin cache next to good ones. Both caches start with the same random
// contents (padding NaN) and are compared whole after the call: rows written, rows left alone,
// padding untouched.
//
// Tolerances. Both backends compute in fp32 from the same inputs (rounded to T once, on the
// host) and differ only in the order of their reductions:
//   * inject: the sum of squares of a K row is sequential on the CPU, lane-strided then a
//     butterfly on the CUDA side. Its relative rounding is below D * 2^-24 (1.5e-5 at
//     D = 256) and about sqrt(D) * 2^-24 in practice; it carries unchanged through the rsqrt
//     and the scaling into the rotated K (|K| <= ~6 here), an absolute error near 1e-6.
//     kInjectAtol = kInjectRtol = 1e-5. V is copied and must match bit for bit, as must every
//     cache entry the call does not write.
//   * attention: the scores are the same fp32 dot products (q * scale, summed over d in
//     order), but the softmax is online per 32-key tile with warp-shuffle sums on the CUDA
//     side and per 256-key split with sequential sums on the CPU, so exp() sees different
//     maxima and the sums of p and p * v are associated differently. For n keys the sums'
//     relative error is bounded by n * 2^-24 (6.7e-5 at 1116 keys) and behaves as
//     sqrt(n) * 2^-24 (~2e-6); the output, a convex combination of V entries (|v| <= ~5),
//     errs by about that times max |v| in absolute terms (at most 1e-6 on these inputs).
//     kAttnAtol = kAttnRtol = 2e-5 keep a margin of 20x, while a dropped, doubled or misread
//     key (an error of order p_j * |v_j|, 1e-3 and up with the peaked softmax used here) fails.
//   * outputs rounded to a 16-bit T: two fp32 values that close can round to neighbouring
//     values of T, one unit in the last place apart: at most 2^-7 (bf16) or 2^-10 (fp16) of
//     the value, added to rtol (fp16 subnormals, 2^-24 apart, fall within atol).
// Status outputs must match exactly.
#include <algorithm>
#include <climits>
#include <numeric>

#include "compare.h"
#include "flashspark/cpu/dflash.h"
#include "flashspark/cuda/dflash.cuh"

using namespace flashspark;
using coc_test::DeviceArray;

namespace {

constexpr float kInjectAtol = 1e-5f, kInjectRtol = 1e-5f;
constexpr float kAttnAtol = 2e-5f, kAttnRtol = 2e-5f;
constexpr int32_t kSplitKeys = 256;  // the binding's kAttnSplitKeys

// One unit in the last place of T relative to the value (at most): the rounding of outputs.
template <class T>
float ulp_rel() {
  if constexpr (std::is_same_v<T, float>) return 0.f;
  if constexpr (std::is_same_v<T, bfloat16_t>) return 1.f / 128.f;
  return 1.f / 1024.f;
}

template <class T>
std::vector<uint32_t> bit_patterns(const std::vector<T>& v) {
  std::vector<uint32_t> out(v.size(), 0);
  for (size_t i = 0; i < v.size(); ++i) std::memcpy(&out[i], &v[i], sizeof(T));
  return out;
}

// A [n0, n1, n2, D] tensor, D contiguous, inside a buffer: rows of D + pad elements, dims 1
// and 2 swapped in memory when `swap`, each entry of dim 0 `pad` elements longer.
struct View {
  int64_t n0 = 0, n1 = 0, n2 = 0, d = 0;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  size_t size = 0;
  int64_t at(int64_t i0, int64_t i1, int64_t i2) const { return i0 * s0 + i1 * s1 + i2 * s2; }
};

View make_view(int64_t n0, int64_t n1, int64_t n2, int64_t d, int32_t pad, bool swap) {
  View v{n0, n1, n2, d};
  const int64_t row = d + pad;
  if (swap) {
    v.s1 = row;
    v.s2 = n1 * row;
  } else {
    v.s2 = row;
    v.s1 = n2 * row;
  }
  v.s0 = n1 * n2 * row + pad;
  v.size = size_t(n0 * v.s0);
  return v;
}

// The view's buffer: NaN everywhere but the rows where live(i0, i1, i2), whose entries are
// value(d) rounded to T.
template <class T, class Live, class Value>
std::vector<T> fill_rows(const View& v, const Live& live, const Value& value) {
  std::vector<T> buf(v.size, from_float<T>(NAN));
  for (int64_t i0 = 0; i0 < v.n0; ++i0)
    for (int64_t i1 = 0; i1 < v.n1; ++i1)
      for (int64_t i2 = 0; i2 < v.n2; ++i2)
        if (live(i0, i1, i2))
          for (int64_t d = 0; d < v.d; ++d) buf[size_t(v.at(i0, i1, i2) + d)] = from_float<T>(value(d));
  return buf;
}

inline bool every_row(int64_t, int64_t, int64_t) { return true; }

// Every row of the view N(0, scale^2), padding NaN.
template <class T>
std::vector<T> fill_view(const View& v, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  return fill_rows<T>(v, every_row, [&](int64_t) { return dist(rng); });
}

std::string list(const std::vector<int32_t>& xs) {
  std::string s = "[";
  for (size_t i = 0; i < xs.size(); ++i) s += (i ? "," : "") + std::to_string(xs[i]);
  return s + "]";
}

// ---- block_diffusion_attention ------------------------------------------------------------

struct AttnCase {
  std::vector<int32_t> ctx;  // per request, each in [0, max_len]
  int32_t max_len, gamma, hq, hkv, dim;
  int32_t pad = 0;        // q, caches and blocks in padded rows ...
  bool swap = false;      // ... and with dims 1 and 2 swapped in memory (caches [B, S, Hkv, D])
  float scale_mul = 2.f;  // scale = scale_mul / sqrt(D): a peaked softmax
  bool status = true;
  bool shifted = false;  // every score near -128 (see run_attn_case): needs D = 16, scale_mul = 2
};

// split_keys and num_splits = ceil((S + G) / split_keys), from sizes only, as the binding's
// make_block_attn_params sets them.
template <class T>
void size_splits(BlockAttnParams<T>& p) {
  p.split_keys = kSplitKeys;
  p.num_splits = int32_t(ceil_div(int64_t(p.max_len) + p.gamma, kSplitKeys));
}

// The split partials: the binding allocates one fp32 workspace of partials * (D + 2), acc
// first, then (m, l) pairs; here acc and ml are two guarded buffers of the same sizes.
template <class T>
int64_t num_partials(const BlockAttnParams<T>& p) {
  return int64_t(p.batch) * p.num_kv_heads * p.rows() * p.num_splits;
}

template <class T>
void run_attn_case(const AttnCase& c, uint64_t seed, bool with_bad_request) {
  std::mt19937_64 rng(seed);
  const int32_t B = int32_t(c.ctx.size()), G = c.gamma, Hq = c.hq, Hkv = c.hkv, D = c.dim, S = c.max_len;
  const View qv = make_view(B, G, Hq, D, c.pad, c.swap);
  const View kcv = make_view(B, Hkv, S, D, c.pad, c.swap), vcv = make_view(B, Hkv, S, D, c.pad + 1, c.swap);
  const View kbv = make_view(B, G, Hkv, D, c.pad, c.swap), vbv = make_view(B, G, Hkv, D, c.pad + 2, false);
  // Cache positions at or past a request's context are stale: NaN.
  auto in_context = [&](int64_t b, int64_t, int64_t s) { return s < c.ctx[size_t(b)]; };
  // Shifted: entries in {-1, 0, 1} but d = 0, -16 in q and +16 in every key, so that with
  // scale 1/2 every score is an exact multiple of 1/2 near -128 (exp of it underflows).
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_int_distribution<int> unit(-1, 1);
  auto entries = [&](float first) {
    return [&, first](int64_t d) { return !c.shifted ? normal(rng) : d == 0 ? first : float(unit(rng)); };
  };
  const std::vector<T> q = fill_rows<T>(qv, every_row, entries(-16.f));
  const std::vector<T> k_cache = fill_rows<T>(kcv, in_context, entries(16.f));
  const std::vector<T> v_cache = fill_rows<T>(vcv, in_context, [&](int64_t) { return normal(rng); });
  const std::vector<T> k_block = fill_rows<T>(kbv, every_row, entries(16.f));
  const std::vector<T> v_block = fill_view<T>(vbv, rng, 1.f);

  std::vector<int32_t> ctx = c.ctx;
  int32_t bad = -1;
  if (with_bad_request && B > 0) {
    bad = int32_t(seed % uint64_t(B));
    const int32_t bad_values[] = {-1, S + 1, INT_MIN, INT_MAX, -G - 1};
    ctx[size_t(bad)] = bad_values[seed % 5];
  }

  auto params = [&](const T* q_p, const T* kc, const T* vc, const int32_t* ctx_p, const T* kb, const T* vb, T* out,
                    float* acc, float* ml, int32_t* st) {
    BlockAttnParams<T> p;
    p.q = q_p;
    p.q_stride_b = qv.s0;
    p.q_stride_g = qv.s1;
    p.q_stride_h = qv.s2;
    p.k_cache = kc;
    p.v_cache = vc;
    p.kc_stride_b = kcv.s0;
    p.kc_stride_h = kcv.s1;
    p.kc_stride_s = kcv.s2;
    p.vc_stride_b = vcv.s0;
    p.vc_stride_h = vcv.s1;
    p.vc_stride_s = vcv.s2;
    p.ctx_lens = ctx_p;
    p.k_block = kb;
    p.v_block = vb;
    p.kb_stride_b = kbv.s0;
    p.kb_stride_g = kbv.s1;
    p.kb_stride_h = kbv.s2;
    p.vb_stride_b = vbv.s0;
    p.vb_stride_g = vbv.s1;
    p.vb_stride_h = vbv.s2;
    p.out = out;
    p.scale = c.scale_mul / std::sqrt(float(D));
    p.batch = B;
    p.gamma = G;
    p.num_q_heads = Hq;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
    p.max_len = S;
    size_splits(p);
    p.partial_acc = acc;
    p.partial_ml = ml;
    p.status = c.status ? st : nullptr;
    return p;
  };
  const BlockAttnParams<T> shape =
      params(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
  const int64_t partials = num_partials(shape);
  const size_t out_n = size_t(B) * G * Hq * D;

  // CPU reference (workspace NaN, as the device's is poisoned)
  auto cpu_run = [&](const std::vector<int32_t>& lens, std::vector<T>& out, std::vector<int32_t>& st) {
    out.assign(out_n, from_float<T>(-7.f));
    st.assign(size_t(B), -7);
    std::vector<float> acc(size_t(partials) * D, NAN), ml(size_t(partials) * 2, NAN);
    cpu::block_diffusion_attention_cpu(params(q.data(), k_cache.data(), v_cache.data(), lens.data(), k_block.data(),
                                              v_block.data(), out.data(), acc.data(), ml.data(), st.data()),
                                       coc_test::SerialFor{});
  };
  std::vector<T> out_cpu;
  std::vector<int32_t> st_cpu;
  cpu_run(ctx, out_cpu, st_cpu);

  const std::string name = std::string("attn ") + coc_test::dtype_name<T>() + " ctx=" + list(ctx) +
                           " S=" + std::to_string(S) + " G=" + std::to_string(G) + " Hq=" + std::to_string(Hq) +
                           " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D) +
                           (c.pad || c.swap ? " strided" : "") + (c.shifted ? " shifted" : "") +
                           (c.status ? "" : " nostatus") + " seed " + std::to_string(seed);
  coc_test::g_case = name + " cpu";
  const size_t per_request = size_t(G) * Hq * D;
  if (bad >= 0) {
    // The bad request fails alone: its status and NaN output; every other request's output
    // is bit for bit what it is without the bad request.
    if (c.status) {
      for (int32_t b = 0; b < B; ++b)
        COC_EXPECT(st_cpu[b] == int32_t(b == bad ? Status::kCtxLenRange : Status::kOk), "status[%d] = %d", b,
                   st_cpu[b]);
    }
    size_t not_nan = 0;
    for (size_t i = size_t(bad) * per_request; i < size_t(bad + 1) * per_request; ++i)
      not_nan += !std::isnan(coc_test::widen(out_cpu[i]));
    COC_EXPECT(not_nan == 0, "%zu outputs of request %d are not NaN", not_nan, bad);
    std::vector<T> out_clean;
    std::vector<int32_t> st_clean;
    cpu_run(c.ctx, out_clean, st_clean);
    std::vector<uint32_t> a = bit_patterns(out_cpu), b = bit_patterns(out_clean);
    std::fill(a.begin() + ptrdiff_t(bad * per_request), a.begin() + ptrdiff_t((bad + 1) * per_request), 0u);
    std::fill(b.begin() + ptrdiff_t(bad * per_request), b.begin() + ptrdiff_t((bad + 1) * per_request), 0u);
    coc_test::expect_equal(a, b, "other requests' out");
  } else if (c.status) {
    for (int32_t b = 0; b < B; ++b) COC_EXPECT(st_cpu[b] == 0, "status[%d] = %d", b, st_cpu[b]);
  }
  size_t nan_good = 0;
  for (int32_t b = 0; b < B; ++b)
    if (b != bad)
      for (size_t i = size_t(b) * per_request; i < size_t(b + 1) * per_request; ++i)
        nan_good += std::isnan(coc_test::widen(out_cpu[i]));
  COC_EXPECT(nan_good == 0, "%zu outputs of good requests are NaN", nan_good);

  DeviceArray<T> d_q(q), d_kc(k_cache), d_vc(v_cache), d_kb(k_block), d_vb(v_block);
  DeviceArray<int32_t> d_ctx(ctx);
  const float atol = kAttnAtol, rtol = kAttnRtol + ulp_rel<T>();
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case =
        name + (with_bad_request ? " +bad " : " ") + coc_test::order_name(sched.order) + std::to_string(sched.seed);
    DeviceArray<T> d_out{out_n};
    DeviceArray<int32_t> d_st{size_t(B)};
    DeviceArray<float> d_acc{size_t(partials) * D}, d_ml{size_t(partials) * 2};
    const BlockAttnParams<T> p =
        params(d_q.ptr, d_kc.ptr, d_vc.ptr, d_ctx.ptr, d_kb.ptr, d_vb.ptr, d_out.ptr, d_acc.ptr, d_ml.ptr, d_st.ptr);
    coc_test::expect_clean_launch([&] { return cuda::launch_block_diffusion_attention<T>(p, nullptr); });
    coc_test::expect_close(coc_test::widened(d_out.host()), coc_test::widened(out_cpu), atol, rtol, "out");
    if (c.status) coc_test::expect_equal(d_st.host(), st_cpu, "status");
  }
}

// ---- inject_context_kv ----------------------------------------------------------------------

struct InjectCase {
  int32_t n, batch, hkv, dim, max_len, max_pos;
  int32_t token_pad = 0;  // k / v token rows this much longer than Hkv * D
  int32_t cache_pad = 0;  // cache rows this much longer than D ...
  bool swap = false;      // ... and caches [B, S, Hkv, D] in memory
  bool status = true;
};

template <class T>
void run_inject_case(const InjectCase& c, uint64_t seed, bool with_bad_tokens) {
  std::mt19937_64 rng(seed);
  const int32_t N = c.n, B = c.batch, Hkv = c.hkv, D = c.dim, S = c.max_len, P = c.max_pos, half = D / 2;
  const View kv_tokens = make_view(N, Hkv, 1, D, 0, false);  // a token's [Hkv, D] block is dense
  const int64_t k_stride = int64_t(Hkv) * D + c.token_pad, v_stride = int64_t(Hkv) * D + 2 * c.token_pad;
  std::vector<T> k(size_t(N) * k_stride, from_float<T>(NAN)), v(size_t(N) * v_stride, from_float<T>(NAN));
  {
    const std::vector<T> kd = fill_view<T>(kv_tokens, rng, 1.5f), vd = fill_view<T>(kv_tokens, rng, 1.f);
    for (int32_t i = 0; i < N; ++i)
      for (int64_t e = 0; e < int64_t(Hkv) * D; ++e) {
        k[size_t(i * k_stride + e)] = kd[size_t(i) * Hkv * D + e];
        v[size_t(i * v_stride + e)] = vd[size_t(i) * Hkv * D + e];
      }
  }
  // Distinct (slot, position) pairs: two tokens never write the same cache row.
  std::vector<int64_t> cells(size_t(B) * std::min(S, P));
  std::iota(cells.begin(), cells.end(), 0);
  std::shuffle(cells.begin(), cells.end(), rng);
  std::vector<int32_t> slots(N);
  std::vector<int64_t> positions(N);
  for (int32_t i = 0; i < N; ++i) {
    slots[i] = int32_t(cells[size_t(i)] % B);
    positions[i] = cells[size_t(i)] / B;
  }
  std::vector<std::pair<int32_t, Status>> expect_bad;
  if (with_bad_tokens && N > 0) {
    const int32_t bad_slots[] = {-1, B, INT_MIN, INT_MAX};
    slots[0] = bad_slots[seed % 4];
    expect_bad.push_back({0, Status::kSlotRange});
    if (N >= 2) {
      const int64_t bad_pos[] = {-1, S, int64_t(1) << 40, INT64_MIN};
      positions[size_t(N / 2)] = bad_pos[seed % 4];
      expect_bad.push_back({N / 2, Status::kPositionRange});
    }
    if (N >= 3 && P < S) {
      positions[size_t(N - 1)] = P + int64_t(seed % uint64_t(S - P));
      expect_bad.push_back({N - 1, Status::kRopeRange});
    }
  }
  std::vector<float> weight(D), cos_sin(size_t(P) * D);
  std::uniform_real_distribution<float> w(0.5f, 1.5f);
  for (auto& x : weight) x = w(rng);
  for (int32_t pos = 0; pos < P; ++pos)
    for (int32_t j = 0; j < half; ++j) {
      const double angle = pos * std::pow(10000.0, -2.0 * j / D);
      cos_sin[size_t(pos) * D + j] = float(std::cos(angle));
      cos_sin[size_t(pos) * D + half + j] = float(std::sin(angle));
    }
  const View kcv = make_view(B, Hkv, S, D, c.cache_pad, c.swap), vcv = make_view(B, Hkv, S, D, c.cache_pad + 3, c.swap);
  const std::vector<T> k_cache0 = fill_view<T>(kcv, rng, 1.f), v_cache0 = fill_view<T>(vcv, rng, 1.f);

  auto params = [&](const T* k_p, const T* v_p, const int64_t* pos_p, const int32_t* slot_p, const float* w_p,
                    const float* cs_p, T* kc, T* vc, int32_t* st) {
    InjectParams<T> p;
    p.k = k_p;
    p.v = v_p;
    p.k_stride = k_stride;
    p.v_stride = v_stride;
    p.positions = pos_p;
    p.slots = slot_p;
    p.k_norm_weight = w_p;
    p.cos_sin = cs_p;
    p.eps = 1e-6f;
    p.k_cache = kc;
    p.v_cache = vc;
    p.cache_stride_b = kcv.s0;
    p.cache_stride_h = kcv.s1;
    p.cache_stride_s = kcv.s2;
    p.v_cache_stride_b = vcv.s0;
    p.v_cache_stride_h = vcv.s1;
    p.v_cache_stride_s = vcv.s2;
    p.status = c.status ? st : nullptr;
    p.num_tokens = N;
    p.num_kv_heads = Hkv;
    p.head_dim = D;
    p.max_pos = P;
    p.batch = B;
    p.max_len = S;
    return p;
  };

  std::vector<T> kc_cpu = k_cache0, vc_cpu = v_cache0;
  std::vector<int32_t> st_cpu(size_t(N), -7);
  cpu::inject_context_kv_cpu(params(k.data(), v.data(), positions.data(), slots.data(), weight.data(), cos_sin.data(),
                                    kc_cpu.data(), vc_cpu.data(), st_cpu.data()),
                             coc_test::SerialFor{});
  const std::string name = std::string("inject ") + coc_test::dtype_name<T>() + " N=" + std::to_string(N) +
                           " B=" + std::to_string(B) + " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D) +
                           " S=" + std::to_string(S) + " P=" + std::to_string(P) +
                           (c.token_pad || c.cache_pad || c.swap ? " strided" : "") + (c.status ? "" : " nostatus") +
                           " seed " + std::to_string(seed) + (with_bad_tokens ? " +bad" : "");
  coc_test::g_case = name + " cpu";
  if (c.status) {
    std::vector<int32_t> want(size_t(N), 0);
    for (const auto& [i, s] : expect_bad) want[size_t(i)] = int32_t(s);
    coc_test::expect_equal(st_cpu, want, "cpu status");
  }
  COC_EXPECT(N == int32_t(expect_bad.size()) || bit_patterns(vc_cpu) != bit_patterns(v_cache0), "nothing written");

  DeviceArray<T> d_k(k), d_v(v);
  DeviceArray<int64_t> d_pos(positions);
  DeviceArray<int32_t> d_slots(slots);
  DeviceArray<float> d_w(weight), d_cs(cos_sin);
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = name + " " + coc_test::order_name(sched.order) + std::to_string(sched.seed);
    DeviceArray<T> d_kc(k_cache0), d_vc(v_cache0);
    DeviceArray<int32_t> d_st{size_t(N)};
    const InjectParams<T> p =
        params(d_k.ptr, d_v.ptr, d_pos.ptr, d_slots.ptr, d_w.ptr, d_cs.ptr, d_kc.ptr, d_vc.ptr, d_st.ptr);
    coc_test::expect_clean_launch([&] { return cuda::launch_inject_context_kv<T>(p, nullptr); });
    coc_test::expect_close(coc_test::widened(d_kc.host()), coc_test::widened(kc_cpu), kInjectAtol,
                           kInjectRtol + ulp_rel<T>(), "k_cache");
    coc_test::expect_equal(bit_patterns(d_vc.host()), bit_patterns(vc_cpu), "v_cache");
    if (c.status) coc_test::expect_equal(d_st.host(), st_cpu, "status");
  }
}

template <class T>
void run_all(uint64_t& seed) {
  // N, B, Hkv, D, S_max, max_pos, token_pad, cache_pad, swap, status
  const std::vector<InjectCase> inject = {
      {0, 2, 2, 8, 4, 4},
      {1, 1, 1, 2, 1, 1},
      {5, 2, 1, 6, 8, 16},
      {7, 3, 3, 38, 9, 5, 3, 1},
      {37, 3, 2, 64, 20, 20, 0, 0, true},
      {12, 2, 5, 70, 10, 12, 5, 2, true},
      {130, 2, 1, 128, 80, 70},
      {9, 2, 2, 160, 8, 8, 1, 4, false, false},
      {6, 2, 2, 256, 4, 3, 0, 0, true},
  };
  for (const InjectCase& c : inject) {
    run_inject_case<T>(c, seed++, false);
    run_inject_case<T>(c, seed++, true);
  }

  // ctx, S_max, gamma, Hq, Hkv, D, pad, swap, scale_mul, status, shifted
  const std::vector<AttnCase> attn = {
      {{0, 1}, 8, 1, 1, 1, 16},
      {{1, 0, 3}, 4, 4, 2, 1, 1},
      {{255, 3, 256}, 300, 1, 2, 1, 32, 3, false},
      {{257, 0, 100}, 260, 4, 4, 1, 64, 0, true},
      {{5, 12}, 16, 7, 6, 2, 96, 1, true},
      {{30, 40}, 40, 16, 4, 4, 160, 0, false, 3.f},
      {{20, 7}, 20, 16, 8, 2, 33, 2, true, 1.f},
      {{9, 0, 2}, 9, 7, 3, 1, 256, 0, false, 2.f, false},
      {{3, 6}, 6, 0, 4, 2, 24},
      {{600, 1100}, 1100, 1, 1, 1, 64, 1, true, 3.f},
      {{508, 1}, 520, 4, 3, 3, 65, 0, false, 2.f},
      {{599, 1100}, 1100, 4, 2, 1, 128, 0, false, 2.f},
      {{1000}, 1000, 16, 2, 1, 40, 1, false, 2.f},
      {{700, 257, 1}, 800, 4, 8, 2, 129, 0, true, 2.5f},
      {{1024, 513}, 1030, 7, 3, 1, 160, 0, true, 2.f},
      {{40, 300, 0}, 300, 4, 2, 1, 16, 1, true, 2.f, true, true},
  };
  for (const AttnCase& c : attn) {
    run_attn_case<T>(c, seed++, false);
    run_attn_case<T>(c, seed++, true);
  }
}

}  // namespace

int main() {
  uint64_t seed = 101;
  run_all<float>(seed);
  run_all<bfloat16_t>(seed);
  run_all<float16_t>(seed);
  return coc_test::finish("dflash");
}
