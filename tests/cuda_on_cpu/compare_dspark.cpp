// launch_markov_step on cuda_on_cpu against markov_step_cpu: ranks up to the op's 512 (above
// 384 the tile kernel needs more than the default 48 KB of dynamic shared memory), batches past
// one 32-request shared-memory chunk and one 32-lane slot, odd vocabularies (one tile, several
// CPU tiles, the CUDA grid-stride loop), bias or none, strided rows, greedy and sampled
// requests, fp32 / bf16 / fp16, and a request with a bad previous token next to good ones.
//
// Tokens and status must match exactly. The logit z = u + <W2[v], W1[x]> (+ bias) is a dot of
// `rank` fp32 products summed in another order on each side (a lane-strided sum and a butterfly
// against the CPU's vectorized dot), so z and the race keys differ by a few ulps of the terms'
// magnitudes (|terms| <= ~4 here, rank <= 512: under 1e-4 absolute); a token could flip only if
// two keys were that close, which these seeds avoid. q = exp((z - m) / T - log s) inherits z's
// error times 1/T (<= 2 here) plus the normalizer's reassociation: 1e-4 absolute, 1e-3 relative.
// The confidence is a sigmoid of a dot over H + rank terms, compared within 1e-5 absolute.
#include <algorithm>

#include "compare.h"
#include "flashspark/cpu/dspark.h"
#include "flashspark/cuda/launch.h"

using namespace flashspark;
using coc_test::DeviceArray;

namespace {

struct Case {
  int32_t batch, vocab, rank, hidden;
  bool bias;
  int32_t u_pad = 0, h_pad = 0;  // row padding of base_logits / hidden (strided views)
  bool heavy = false;            // hundreds of blocks: fp32 only, two schedules (the indexing is dtype-blind)
};

template <class T>
void run_case(const Case& c, uint64_t seed, bool with_bad_request) {
  std::mt19937_64 rng(seed);
  const int32_t B = c.batch, V = c.vocab, R = c.rank, H = c.hidden;
  const int64_t u_stride = V + c.u_pad, h_stride = H + c.h_pad;
  const float scale = 1.f / std::sqrt(float(R));  // keeps the Markov term O(1) at every rank
  const std::vector<T> u = coc_test::random_values<T>(size_t(B) * u_stride, rng, 2.f);
  const std::vector<T> w1 = coc_test::random_values<T>(size_t(V) * R, rng, 1.f);
  const std::vector<T> w2 = coc_test::random_values<T>(size_t(V) * R, rng, scale);
  const std::vector<T> bias = coc_test::random_values<T>(c.bias ? size_t(V) : 0, rng, 0.5f);
  const std::vector<T> hidden = coc_test::random_values<T>(size_t(B) * h_stride, rng, 1.f);
  const std::vector<T> conf_w = coc_test::random_values<T>(size_t(H + R), rng, 0.1f);
  const std::vector<float> conf_b = {0.25f};
  std::vector<int32_t> prev(B);
  std::vector<float> temperature(B);
  std::vector<int64_t> seeds(B), positions(B);
  const float temps[] = {0.f, 0.5f, 1.f, 2.f};
  for (int32_t b = 0; b < B; ++b) {
    prev[b] = int32_t(rng() % uint64_t(V));
    temperature[b] = temps[(b + seed) % 4];
    seeds[b] = int64_t(rng() >> 1);
    positions[b] = int64_t(rng() % 64);
  }
  if (with_bad_request) prev[B / 2] = V + int32_t(rng() % 5);  // out of range: that request fails alone

  auto params = [&](const T* u_p, const int32_t* prev_p, const T* w1_p, const T* w2_p, const T* bias_p,
                    const T* hidden_p, const T* cw, const float* cb, const float* tp, const int64_t* sd,
                    const int64_t* pos, int32_t* tokens, float* q, float* conf, int32_t* st, float* ws,
                    int32_t num_partials) {
    MarkovParams<T> p;
    p.base_logits = u_p;
    p.u_stride = u_stride;
    p.prev_tokens = prev_p;
    p.w1 = w1_p;
    p.w2 = w2_p;
    p.bias = c.bias ? bias_p : nullptr;
    p.hidden = hidden_p;
    p.h_stride = h_stride;
    p.conf_w = cw;
    p.conf_b = cb;
    p.temperature = tp;
    p.seeds = sd;
    p.positions = pos;
    p.out_tokens = tokens;
    p.out_q = q;
    p.out_conf = conf;
    p.status = st;
    p.partial = ws;
    p.num_partials = num_partials;
    p.row_stats = ws + int64_t(num_partials) * B * kMarkovSlot;
    p.batch = B;
    p.vocab = V;
    p.rank = R;
    p.hidden_size = H;
    return p;
  };

  const int32_t cpu_partials = cpu::markov_num_partials_cpu(V);
  std::vector<int32_t> tokens_cpu(B), st_cpu(B, -7);
  std::vector<float> q_cpu(size_t(B) * V), conf_cpu(B), ws_cpu(size_t(markov_workspace_floats(cpu_partials, B)));
  cpu::markov_step_cpu(params(u.data(), prev.data(), w1.data(), w2.data(), bias.data(), hidden.data(), conf_w.data(),
                              conf_b.data(), temperature.data(), seeds.data(), positions.data(), tokens_cpu.data(),
                              q_cpu.data(), conf_cpu.data(), st_cpu.data(), ws_cpu.data(), cpu_partials),
                       coc_test::SerialFor{});

  const int32_t cuda_partials = flashspark::cuda::markov_num_partials(V);
  DeviceArray<T> d_u(u), d_w1(w1), d_w2(w2), d_bias(bias), d_hidden(hidden), d_cw(conf_w);
  DeviceArray<float> d_cb(conf_b), d_temp(temperature);
  DeviceArray<int32_t> d_prev(prev);
  DeviceArray<int64_t> d_seeds(seeds), d_pos(positions);
  std::vector<cuda_on_cpu::Schedule> scheds = coc_test::schedules();
  if (c.heavy) scheds = {scheds.front(), scheds.back()};
  for (const auto& sched : scheds) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = std::string("markov_step ") + coc_test::dtype_name<T>() + " B=" + std::to_string(B) +
                       " V=" + std::to_string(V) + " rank=" + std::to_string(R) + " H=" + std::to_string(H) +
                       (c.bias ? " bias" : "") + (with_bad_request ? " +bad" : "") + " " +
                       coc_test::order_name(sched.order) + std::to_string(sched.seed);
    DeviceArray<int32_t> d_tokens{size_t(B)}, d_st{size_t(B)};
    DeviceArray<float> d_q{size_t(B) * V}, d_conf{size_t(B)}, d_ws{size_t(markov_workspace_floats(cuda_partials, B))};
    const MarkovParams<T> p =
        params(d_u.ptr, d_prev.ptr, d_w1.ptr, d_w2.ptr, d_bias.ptr, d_hidden.ptr, d_cw.ptr, d_cb.ptr, d_temp.ptr,
               d_seeds.ptr, d_pos.ptr, d_tokens.ptr, d_q.ptr, d_conf.ptr, d_st.ptr, d_ws.ptr, cuda_partials);
    coc_test::expect_clean_launch([&] { return flashspark::cuda::launch_markov_step<T>(p, nullptr); });
    coc_test::expect_equal(d_tokens.host(), tokens_cpu, "tokens");
    coc_test::expect_equal(d_st.host(), st_cpu, "status");
    coc_test::expect_close(d_q.host(), q_cpu, 1e-4f, 1e-3f, "q");
    coc_test::expect_close(d_conf.host(), conf_cpu, 1e-5f, 0.f, "conf");
  }
  if (with_bad_request) COC_EXPECT(st_cpu[B / 2] == int32_t(Status::kPrevTokenRange), "bad request not failed");
}

template <class T>
void run_all() {
  const std::vector<Case> cases = {
      {1, 1, 1, 3, false},
      {3, 7, 5, 8, true, 3, 1},
      {2, 37, 33, 13, false},
      {2, 8, 4, 8, false},  // one block, every warp's partial holds a real row
      {3, 200, 16, 8, true},
      {5, 1001, 64, 16, true, 5, 2},
      {2, 2053, 100, 8, false},            // two CPU tiles of 2048
      {33, 97, 16, 8, true},               // two shared-memory chunks, two lane slots
      {3, 1031, 385, 8, false},            // 49280 bytes of dynamic shared memory: the raised limit
      {2, 211, 512, 8, true, 0, 3},        // the op's largest rank
      {1, 8233, 8, 4, false, 0, 0, true},  // the tile kernel's grid-stride loop (1024 blocks of 8 rows)
  };
  uint64_t seed = 101;
  for (const Case& c : cases) {
    if (c.heavy && !std::is_same_v<T, float>) continue;
    run_case<T>(c, seed++, false);
    if (c.batch > 1) run_case<T>(c, seed++, true);
  }
}

}  // namespace

int main() {
  run_all<float>();
  run_all<bfloat16_t>();
  run_all<float16_t>();
  return coc_test::finish("dspark");
}
