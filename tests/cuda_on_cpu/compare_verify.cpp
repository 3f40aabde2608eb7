// launch_verify on cuda_on_cpu against verify_cpu: one-hot, dense and sparse q, greedy and
// sampled requests in one batch, ragged draft lengths (0, 1, ..., max_spec_len), fp32 / bf16 /
// fp16, strided rows, odd vocabularies, probabilities instead of logits, bf16 draft q, and a
// request with bad input next to good ones.
//
// Outputs are integers (tokens, counts, status) and must match exactly. Both kernels draw the
// same Philox numbers and run the same driver; only the order in which a row's softmax sum is
// reduced differs (rounding near 1e-7 relative), which could flip a decision only for a
// uniform within that distance of its threshold: the seeds here keep clear of such ties.
#include <algorithm>

#include "compare.h"
#include "flashspark/cpu/verify.h"
#include "flashspark/cuda/verify.cuh"

using namespace flashspark;
using coc_test::DeviceArray;

namespace {

struct Case {
  int32_t vocab;
  std::vector<int32_t> lengths;  // draft tokens per request
  std::vector<float> temperatures;
  DraftQ q_mode;
  int32_t num_candidates = 0;  // sparse K
  int32_t row_pad = 0;         // logits / dense q rows are this much longer than V (strided views)
  bool given_bonus = false;    // the caller's bonus tokens: logits hold the draft rows alone
  bool probs = false;          // the rows hold probabilities (softmax of random logits, some zeros)
  bool q_bf16 = false;         // draft q stored as bf16
  int64_t max_grid_y = 65535;  // CUDA: fewer blocks along the batch, so blocks loop over slots
  bool scramble_cu = false;    // cu_num_draft made non-monotone: overlapping requests fail alike
};

template <class T>
void run_case(const Case& c, uint64_t seed, bool with_bad_request) {
  std::mt19937_64 rng(seed);
  const int32_t B = int32_t(c.lengths.size()), V = c.vocab;
  int32_t max_spec = 0;
  std::vector<int32_t> cu(B + 1, 0);
  for (int32_t b = 0; b < B; ++b) {
    cu[b + 1] = cu[b] + c.lengths[b];
    max_spec = std::max(max_spec, c.lengths[b]);
  }
  const int32_t T_ = cu[B];
  const int64_t stride = V + c.row_pad;
  const int32_t bonus_rows = c.given_bonus ? 0 : B;
  std::vector<T> logits = coc_test::random_values<T>(size_t(T_ + bonus_rows) * stride, rng, 2.f);
  // Rows of several CUDA chunks: now and then a row's maximum sits on a chunk's last entry (a
  // tile short of its chunk misses it), and the last chunks carry most of the mass (a stop row's
  // chunk left out of the race's merge would rarely go unseen).
  for (int32_t r = 0; r < T_ + bonus_rows && V > 4096; ++r) {
    T* row = logits.data() + r * stride;
    if (rng() % 2) row[4095] = from_float<T>(9.f);
    for (int32_t v = std::max(0, V - 4096); v < V; ++v) row[v] = from_float<T>(coc_test::widen(row[v]) + 3.f);
  }
  if (c.probs) {  // each row's softmax, with a zero now and then (no mass: never emitted)
    for (int32_t r = 0; r < T_ + bonus_rows; ++r) {
      T* row = logits.data() + r * stride;
      float m = coc_test::widen(row[0]), sum = 0.f;
      for (int32_t v = 1; v < V; ++v) m = std::max(m, coc_test::widen(row[v]));
      std::vector<float> e(V);
      for (int32_t v = 0; v < V; ++v) sum += e[v] = (V > 1 && rng() % 9 == 0) ? 0.f : expf(coc_test::widen(row[v]) - m);
      for (int32_t v = 0; v < V; ++v) row[v] = from_float<T>(sum > 0.f ? e[v] / sum : 1.f);
    }
  }
  // Drafts: the row's argmax half of the time (so some requests accept), else a random id, and
  // now and then the placeholder -1 (rejected: the request emits the token sampled there).
  std::vector<int32_t> drafts(T_);
  std::uniform_int_distribution<int32_t> any(0, V - 1);
  for (int32_t b = 0; b < B; ++b)
    for (int32_t i = cu[b]; i < cu[b + 1]; ++i) {
      const T* row = logits.data() + (i + (c.given_bonus ? 0 : b)) * stride;
      int32_t best = 0;
      for (int32_t v = 1; v < V; ++v)
        if (coc_test::widen(row[v]) > coc_test::widen(row[best])) best = v;
      drafts[i] = rng() % 7 == 0 ? kPlaceholderToken : rng() % 2 ? best : any(rng);
    }
  int32_t bad = -1;  // the last request with a draft fails alone (status), the others are unaffected
  for (int32_t b = 0; b < B; ++b)
    if (c.lengths[b] > 0) bad = b;
  if (with_bad_request && bad >= 0) drafts[cu[bad]] = rng() % 2 ? V + 3 : -2;
  // Probabilities: a value that is not one (NaN, negative or above 1) in request 0's first row,
  // which fails it wherever that value is read (the greedy walk or a race reads the whole row).
  if (with_bad_request && c.probs && bad != 0) {
    const float poison[] = {NAN, -0.25f, 1.5f};
    logits[size_t(rng() % uint64_t(V))] = from_float<T>(poison[rng() % 3]);
  }
  std::vector<float> q_probs;
  std::vector<int32_t> q_ids;
  int64_t q_stride = 0;
  if (c.q_mode == DraftQ::kDense) {
    q_stride = stride;
    q_probs.assign(size_t(std::max(T_, 1)) * q_stride, 0.f);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (int32_t i = 0; i < T_; ++i) {
      float sum = 0.f;
      for (int32_t v = 0; v < V; ++v) sum += q_probs[i * q_stride + v] = u(rng);
      for (int32_t v = 0; v < V; ++v) q_probs[i * q_stride + v] /= sum;
    }
  } else if (c.q_mode == DraftQ::kSparse) {
    const int32_t K = c.num_candidates;
    q_stride = K;
    q_probs.assign(size_t(std::max(T_, 1)) * K, 0.f);
    q_ids.assign(size_t(std::max(T_, 1)) * K, 0);
    std::uniform_real_distribution<float> u(0.05f, 1.f);
    for (int32_t i = 0; i < T_; ++i) {
      float sum = 0.f;
      for (int32_t k = 0; k < K; ++k) {
        // the draft first; a repeated id now and then (duplicates are summed)
        q_ids[i * K + k] = k == 0                  ? std::clamp(drafts[i], 0, V - 1)
                           : (k == K - 1 && K > 2) ? q_ids[i * K + 1]
                                                   : any(rng);
        sum += q_probs[i * K + k] = u(rng);
      }
      for (int32_t k = 0; k < K; ++k) q_probs[i * K + k] /= sum;
    }
  }
  std::vector<bfloat16_t> q_probs16(q_probs.size());
  for (size_t i = 0; i < q_probs.size(); ++i) q_probs16[i] = to_bfloat16(q_probs[i]);
  std::vector<float> temperature(B);
  for (int32_t b = 0; b < B; ++b) temperature[b] = c.temperatures[b % c.temperatures.size()];
  // A boundary moved past the next one: the requests around it fail (status 1) on both backends,
  // the CUDA tiles assign rows to requests by the same search, and nothing reads out of bounds.
  if (c.scramble_cu && B >= 3) cu[1] = std::min(T_, cu[2] + 2);
  std::vector<int64_t> seeds(B), offsets(B);
  std::vector<int32_t> bonus(B);
  for (int32_t b = 0; b < B; ++b) bonus[b] = int32_t(rng() % uint64_t(V));
  for (int32_t b = 0; b < B; ++b) {
    seeds[b] = int64_t(rng() >> 1);
    offsets[b] = int64_t(rng() % 1000);
  }

  auto params = [&](const T* lg, const int32_t* dr, const int32_t* cu_p, const void* qp, const int32_t* qi,
                    const float* tp, const int64_t* sd, const int64_t* of, const int32_t* bn, int32_t* out,
                    int32_t* acc, int32_t* st) {
    VerifyParams<T> p;
    p.logits = lg;
    p.logits_row_stride = stride;
    p.draft_tokens = dr;
    p.cu_num_draft = cu_p;
    p.q_mode = c.q_mode;
    if (c.q_mode != DraftQ::kOneHot) p.q_probs = AnyFloatPtr{qp, c.q_bf16 ? FloatType::kBFloat16 : FloatType::kFloat32};
    p.q_row_stride = q_stride;
    p.q_ids = c.q_mode == DraftQ::kSparse ? qi : nullptr;
    p.num_candidates = c.num_candidates;
    p.temperature = tp;
    p.seeds = sd;
    p.offsets = of;
    p.out_tokens = out;
    p.out_num_accepted = acc;
    p.status = st;
    p.bonus_tokens = c.given_bonus ? bn : nullptr;
    p.batch = B;
    p.vocab = V;
    p.max_spec_len = max_spec;
    p.target_probs = c.probs;
    return p;
  };

  // CPU reference
  std::vector<int32_t> out_cpu(size_t(B) * (max_spec + 1)), acc_cpu(B), st_cpu(B, -7);
  const void* host_q = c.q_bf16 ? static_cast<const void*>(q_probs16.data()) : q_probs.data();
  cpu::verify_cpu(params(logits.data(), drafts.data(), cu.data(), host_q, q_ids.data(), temperature.data(),
                         seeds.data(), offsets.data(), bonus.data(), out_cpu.data(), acc_cpu.data(), st_cpu.data()),
                  T_, coc_test::SerialFor{});

  DeviceArray<T> d_logits(logits);
  DeviceArray<int32_t> d_drafts(drafts), d_cu(cu), d_ids(q_ids), d_bonus(bonus);
  DeviceArray<float> d_q(q_probs), d_temp(temperature);
  DeviceArray<bfloat16_t> d_q16(q_probs16);
  DeviceArray<int64_t> d_seeds(seeds), d_offsets(offsets);
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = std::string("verify ") + coc_test::dtype_name<T>() + " V=" + std::to_string(V) +
                       " q=" + std::to_string(int(c.q_mode)) + " B=" + std::to_string(B) + " seed " +
                       std::to_string(seed) + (with_bad_request ? " +bad" : "") +
                       (c.given_bonus ? " given-bonus" : "") + (c.probs ? " probs" : "") + (c.q_bf16 ? " q-bf16" : "") +
                       " " + coc_test::order_name(sched.order) + std::to_string(sched.seed);
    DeviceArray<int32_t> d_out{out_cpu.size()}, d_acc{size_t(B)}, d_st{size_t(B)};
    const void* dev_q = c.q_bf16 ? static_cast<const void*>(d_q16.ptr) : d_q.ptr;
    DeviceArray<unsigned char> d_ws{size_t(verify_workspace_bytes(B, T_ + bonus_rows, V))};
    VerifyParams<T> p = params(d_logits.ptr, d_drafts.ptr, d_cu.ptr, dev_q, d_ids.ptr, d_temp.ptr, d_seeds.ptr,
                               d_offsets.ptr, d_bonus.ptr, d_out.ptr, d_acc.ptr, d_st.ptr);
    p.workspace = d_ws.ptr;
    coc_test::expect_clean_launch([&] { return flashspark::cuda::launch_verify<T>(p, T_, nullptr, c.max_grid_y); });
    coc_test::expect_equal(d_out.host(), out_cpu, "out_tokens");
    coc_test::expect_equal(d_acc.host(), acc_cpu, "num_accepted");
    coc_test::expect_equal(d_st.host(), st_cpu, "status");
  }
  if (with_bad_request && bad >= 0 && !c.scramble_cu)
    COC_EXPECT(st_cpu[bad] == int32_t(Status::kDraftTokenRange), "request %d not failed", bad);
  if (c.scramble_cu) COC_EXPECT(st_cpu[0] != int32_t(Status::kOk), "request 0 not failed");
}

template <class T>
void run_all() {
  const std::vector<float> mixed = {0.f, 0.7f, 1.f, 1.5f};  // greedy and sampled requests together
  const std::vector<Case> cases = {
      {1, {0, 1, 2}, mixed, DraftQ::kOneHot},
      {7, {3, 0, 1, 2}, mixed, DraftQ::kOneHot, 0, 3},
      {37, {4, 1, 0, 3}, mixed, DraftQ::kDense, 0, 1},
      {1001, {5, 0, 1, 2, 5}, mixed, DraftQ::kOneHot, 0, 5},
      {1001, {3, 1, 0, 4}, mixed, DraftQ::kDense},
      {2053, {2, 5, 1, 0}, mixed, DraftQ::kSparse, 4},
      {523, {1, 3, 2}, {0.f}, DraftQ::kSparse, 1},
      {4099, {6, 2}, {1.f, 0.f}, DraftQ::kOneHot, 0, 2},
      // the caller's bonus tokens: the logits hold the draft rows alone
      {211, {3, 0, 2, 1}, mixed, DraftQ::kOneHot, 0, 0, true},
      {97, {2, 1, 3}, mixed, DraftQ::kDense, 0, 3, true},
      // probabilities instead of logits (greedy or temperature 1), and bf16 draft q
      {1, {0, 1, 2}, {0.f, 1.f}, DraftQ::kOneHot, 0, 0, false, true},
      {301, {3, 0, 2, 4}, {0.f, 1.f}, DraftQ::kOneHot, 0, 2, false, true},
      {129, {4, 1, 0, 3}, {1.f, 0.f}, DraftQ::kDense, 0, 1, false, true, true},
      {1031, {2, 5, 1, 0}, {1.f, 1.f, 0.f}, DraftQ::kSparse, 4, 0, true, true, true},
      {77, {3, 2, 0}, mixed, DraftQ::kDense, 0, 0, false, false, true},
      // rows of several CUDA chunks (kVerifyChunk = 4096): the partials merged across lanes
      {9001, {3, 0, 5, 1}, mixed, DraftQ::kDense, 0, 2},
      {8193, {2, 4, 1}, mixed, DraftQ::kSparse, 3, 0, true},
      {12289, {2, 1, 0}, {0.f, 1.f}, DraftQ::kOneHot, 0, 1, false, true},
      {135169, {1, 2}, {1.f, 0.f}, DraftQ::kOneHot},  // 34 chunks: more than a warp's lanes
      {135169, {2, 0, 1}, {1.f, 0.7f, 1.f}, DraftQ::kDense, 0, 0, false, false, true},
      // blocks that loop over several rows (tiles) and requests (races)
      {4099, {3, 1, 4, 0, 2}, mixed, DraftQ::kOneHot, 0, 0, false, false, false, 3},
      {9001, {2, 3, 1}, {1.f}, DraftQ::kSparse, 2, 1, false, false, false, 2},
      // malformed cu_num_draft
      {37, {3, 1, 4, 2}, mixed, DraftQ::kDense, 0, 0, false, false, false, 65535, true},
      {4099, {2, 0, 3, 1, 2}, mixed, DraftQ::kOneHot, 0, 1, true, false, false, 2, true},
  };
  uint64_t seed = 11;
  for (const Case& c : cases) {
    run_case<T>(c, seed++, false);
    run_case<T>(c, seed++, true);
  }
}

}  // namespace

int main() {
  run_all<float>();
  run_all<bfloat16_t>();
  run_all<float16_t>();
  return coc_test::finish("verify");
}
