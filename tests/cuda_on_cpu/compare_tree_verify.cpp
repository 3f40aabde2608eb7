// launch_tree_verify on cuda_on_cpu against tree_verify_cpu: wide, deep, branching trees with
// duplicate siblings and padding nodes, single-node trees, greedy and sampled requests in one
// batch, fp32 / bf16 / fp16, strided rows, odd vocabularies and rows of many CUDA chunks,
// probabilities instead of logits, blocks that loop over rows and requests, and bad requests
// (a foreign or later parent, a root with a parent, a token out of range, a node too deep, a
// non-finite walked row, a malformed cu_num_nodes) beside good ones.
//
// Outputs are integers (node ids, tokens, counts, status) and must match exactly: both kernels
// draw the same Philox numbers and run the same driver (see compare_verify.cpp on rounding).
#include <algorithm>

#include "compare.h"
#include "flashspark/cpu/tree_verify.h"
#include "flashspark/cuda/tree_verify.cuh"

using namespace flashspark;
using coc_test::DeviceArray;

namespace {

enum class Shape { kWide, kDeep, kRandom };

struct Case {
  int32_t vocab;
  std::vector<int32_t> sizes;  // nodes per request (>= 1)
  std::vector<float> temperatures;
  Shape shape = Shape::kRandom;
  int32_t row_pad = 0;         // rows this much longer than V (strided views)
  bool probs = false;          // rows hold probabilities
  int64_t max_grid_y = 65535;  // CUDA: fewer blocks along rows and requests
  int32_t extra_depth = 0;     // max_depth above the deepest node
};

int g_deep_cases = 0, g_walked_cases = 0;  // good batches with nodes past the roots, and those walked past one

enum class Bad { kNone, kForeignParent, kLaterParent, kRootParent, kToken, kTooDeep, kNaNRow, kCu };
constexpr Bad kBads[] = {Bad::kForeignParent, Bad::kLaterParent, Bad::kRootParent, Bad::kToken,
                         Bad::kTooDeep,       Bad::kNaNRow,      Bad::kCu};

template <class T>
void run_case(const Case& c, uint64_t seed, Bad bad) {
  std::mt19937_64 rng(seed);
  const int32_t B = int32_t(c.sizes.size()), V = c.vocab;
  std::vector<int32_t> cu(B + 1, 0);
  for (int32_t b = 0; b < B; ++b) cu[b + 1] = cu[b] + c.sizes[b];
  const int32_t N = cu[B];
  const int64_t stride = V + c.row_pad;
  std::vector<T> logits = coc_test::random_values<T>(size_t(std::max(N, 1)) * stride, rng, 2.f);
  for (int32_t r = 0; r < N && V > 4096; ++r) {  // as compare_verify: maxima on chunk edges, mass late
    T* row = logits.data() + r * stride;
    if (rng() % 2) row[4095] = from_float<T>(9.f);
    for (int32_t v = std::max(0, V - 4096); v < V; ++v) row[v] = from_float<T>(coc_test::widen(row[v]) + 3.f);
  }
  auto top = [&](int32_t r) {  // the row's argmax: children that the walks take
    const T* row = logits.data() + r * stride;
    int32_t best = 0;
    for (int32_t v = 1; v < V; ++v)
      if (coc_test::widen(row[v]) > coc_test::widen(row[best])) best = v;
    return best;
  };
  std::uniform_int_distribution<int32_t> any(0, V - 1);
  std::vector<int32_t> tokens(std::max(N, 1)), parents(std::max(N, 1));
  std::vector<int32_t> depth(std::max(N, 1));
  int32_t max_depth = 0;
  for (int32_t b = 0; b < B; ++b) {
    const int32_t lo = cu[b];
    tokens[lo] = any(rng);
    parents[lo] = kNoParent;
    depth[lo] = 0;
    for (int32_t i = lo + 1; i < cu[b + 1]; ++i) {
      int32_t parent = c.shape == Shape::kWide   ? lo
                       : c.shape == Shape::kDeep ? i - 1
                                                 : lo + int32_t(rng() % uint64_t(i - lo));
      if (c.shape == Shape::kRandom && rng() % 11 == 0) parent = kNoParent;  // padding: never walked
      parents[i] = parent;
      depth[i] = parent == kNoParent ? 0 : depth[parent] + 1;
      max_depth = std::max(max_depth, depth[i]);
      int32_t dup = -1;  // a sibling's token again now and then (the first listed wins)
      for (int32_t j = lo + 1; j < i && parent != kNoParent; ++j)
        if (parents[j] == parent && rng() % 4 == 0) dup = tokens[j];
      tokens[i] = dup >= 0 ? dup : parent != kNoParent && rng() % 3 ? top(parent) : any(rng);
      if (dup < 0 && parent != kNoParent && tokens[i] == top(parent) && rng() % 2) {  // a confident target:
        T& x = logits[size_t(parent) * stride + size_t(tokens[i])];                   // sampled walks go deep
        x = from_float<T>(coc_test::widen(x) + 4.f);
      }
    }
  }
  if (c.probs) {
    for (int32_t r = 0; r < N; ++r) {
      T* row = logits.data() + r * stride;
      float m = coc_test::widen(row[0]), sum = 0.f;
      for (int32_t v = 1; v < V; ++v) m = std::max(m, coc_test::widen(row[v]));
      std::vector<float> e(V);
      for (int32_t v = 0; v < V; ++v) sum += e[v] = (V > 1 && rng() % 9 == 0) ? 0.f : expf(coc_test::widen(row[v]) - m);
      for (int32_t v = 0; v < V; ++v) row[v] = from_float<T>(sum > 0.f ? e[v] / sum : 1.f);
    }
  }
  max_depth += c.extra_depth;
  // The bad request: the middle one with at least two nodes (the others must be unaffected).
  int32_t victim = -1;
  for (int32_t b = 0; b < B; ++b)
    if (c.sizes[b] >= 2 && (victim < 0 || b <= B / 2)) victim = b;
  Status want = Status::kOk;
  if (bad != Bad::kNone && victim >= 0) {
    const int32_t lo = cu[victim], last = cu[victim + 1] - 1;
    switch (bad) {
      case Bad::kForeignParent:
        parents[last] = lo > 0 ? lo - 1 : cu[victim + 1];
        want = Status::kBadParent;
        break;
      case Bad::kLaterParent:
        parents[lo + 1] = last;
        want = Status::kBadParent;
        break;
      case Bad::kRootParent:
        parents[lo] = lo + 1;
        want = Status::kBadParent;
        break;
      case Bad::kToken: {  // a node inside the tree (a padding node's token is never read)
        std::vector<char> in_tree(size_t(last - lo + 1), 0);
        in_tree[0] = 1;
        int32_t at = lo;
        for (int32_t i = lo + 1; i <= last; ++i) {
          in_tree[i - lo] = parents[i] != kNoParent && in_tree[parents[i] - lo];
          if (in_tree[i - lo]) at = i;
        }
        tokens[at] = rng() % 2 ? V : -3;
        want = Status::kNodeTokenRange;
        break;
      }
      case Bad::kTooDeep:  // a chain hung under the root one level past max_depth
        for (int32_t i = lo + 1; i <= last; ++i) parents[i] = i - 1;
        want = last - lo > max_depth ? Status::kTreeTooDeep : Status::kOk;
        break;
      case Bad::kNaNRow: {  // the root row is read by every walk: on probabilities, at its first child's token
        int32_t at = int32_t(rng() % uint64_t(V));
        for (int32_t i = last; i > lo; --i)
          if (parents[i] == lo) at = tokens[i];
        logits[size_t(lo) * stride + size_t(at)] = from_float<T>(c.probs ? -0.5f : NAN);
        want = c.probs ? Status::kBadTargetProb : Status::kNonFiniteLogit;
        break;
      }
      case Bad::kCu:
        if (B >= 3) cu[1] = std::min(N, cu[2] + 1);
        want = B >= 3 ? Status::kBadCuNumNodes : Status::kOk;
        break;
      case Bad::kNone:
        break;
    }
  }
  std::vector<float> temperature(B);
  for (int32_t b = 0; b < B; ++b) temperature[b] = c.temperatures[b % c.temperatures.size()];
  std::vector<int64_t> seeds(B), offsets(B);
  for (int32_t b = 0; b < B; ++b) {
    seeds[b] = int64_t(rng() >> 1);
    offsets[b] = int64_t(rng() % 1000);
  }
  const int64_t width = int64_t(max_depth) + 1;
  auto params = [&](const T* lg, const int32_t* tk, const int32_t* pa, const int32_t* cu_p, const float* tp,
                    const int64_t* sd, const int64_t* of, int32_t* nodes, int32_t* toks, int32_t* acc, int32_t* st) {
    TreeVerifyParams<T> p;
    p.logits = lg;
    p.logits_row_stride = stride;
    p.node_tokens = tk;
    p.parents = pa;
    p.cu_num_nodes = cu_p;
    p.temperature = tp;
    p.seeds = sd;
    p.offsets = of;
    p.out_nodes = nodes;
    p.out_tokens = toks;
    p.out_num_accepted = acc;
    p.status = st;
    p.target_probs = c.probs;
    p.batch = B;
    p.vocab = V;
    p.num_nodes = N;
    p.max_depth = max_depth;
    return p;
  };

  std::vector<int32_t> nodes_cpu(size_t(B) * width), toks_cpu(size_t(B) * width), acc_cpu(B), st_cpu(B, -7);
  std::vector<int32_t> scratch(2 * size_t(std::max(N, 1)));
  TreeVerifyParams<T> host =
      params(logits.data(), tokens.data(), parents.data(), cu.data(), temperature.data(), seeds.data(), offsets.data(),
             nodes_cpu.data(), toks_cpu.data(), acc_cpu.data(), st_cpu.data());
  host.scratch = scratch.data();
  cpu::tree_verify_cpu(host, coc_test::SerialFor{});

  DeviceArray<T> d_logits(logits);
  DeviceArray<int32_t> d_tokens(tokens), d_parents(parents), d_cu(cu);
  DeviceArray<float> d_temp(temperature);
  DeviceArray<int64_t> d_seeds(seeds), d_offsets(offsets);
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = std::string("tree_verify ") + coc_test::dtype_name<T>() + " V=" + std::to_string(V) +
                       " B=" + std::to_string(B) + " N=" + std::to_string(N) + " seed " + std::to_string(seed) +
                       " bad " + std::to_string(int(bad)) + (c.probs ? " probs" : "") + " " +
                       coc_test::order_name(sched.order) + std::to_string(sched.seed);
    DeviceArray<int32_t> d_nodes{nodes_cpu.size()}, d_toks{toks_cpu.size()}, d_acc{size_t(B)}, d_st{size_t(B)};
    DeviceArray<unsigned char> d_ws{size_t(tree_verify_workspace_bytes(B, N, V))};
    TreeVerifyParams<T> p = params(d_logits.ptr, d_tokens.ptr, d_parents.ptr, d_cu.ptr, d_temp.ptr, d_seeds.ptr,
                                   d_offsets.ptr, d_nodes.ptr, d_toks.ptr, d_acc.ptr, d_st.ptr);
    p.workspace = d_ws.ptr;
    coc_test::expect_clean_launch([&] { return flashspark::cuda::launch_tree_verify<T>(p, nullptr, c.max_grid_y); });
    coc_test::expect_equal(d_nodes.host(), nodes_cpu, "accepted_nodes");
    coc_test::expect_equal(d_toks.host(), toks_cpu, "tokens");
    coc_test::expect_equal(d_acc.host(), acc_cpu, "num_accepted");
    coc_test::expect_equal(d_st.host(), st_cpu, "status");
  }
  if (bad != Bad::kNone && bad != Bad::kCu && victim >= 0 && want != Status::kOk) {
    COC_EXPECT(st_cpu[victim] == int32_t(want), "request %d: status %d, want %d", victim, st_cpu[victim], int(want));
    COC_EXPECT(acc_cpu[victim] == -1, "request %d not failed", victim);
  }
  if (bad == Bad::kCu && want != Status::kOk) COC_EXPECT(st_cpu[1] != int32_t(Status::kOk), "request 1 not failed");
  if (bad == Bad::kNone && N > B) {  // the cases must exercise walks past the root, most of them
    ++g_deep_cases;
    for (int32_t b = 0; b < B; ++b)
      if (acc_cpu[b] > 0) {
        ++g_walked_cases;
        break;
      }
  }
}

template <class T>
void run_all() {
  const std::vector<float> mixed = {0.f, 0.7f, 1.f, 1.5f};
  const std::vector<Case> cases = {
      {1, {1, 2, 3}, mixed, Shape::kDeep},
      {7, {5, 1, 6, 3}, mixed, Shape::kWide, 3},
      {37, {6, 4, 9, 2}, mixed, Shape::kRandom, 1},
      {37, {8, 8, 8}, mixed, Shape::kDeep, 0, false, 65535, 2},
      {1001, {12, 1, 7, 16}, mixed, Shape::kRandom},
      {4099, {9, 3, 5}, {1.f, 0.f}, Shape::kRandom, 2},
      {301, {4, 6, 1, 5}, {0.f, 1.f}, Shape::kRandom, 0, true},
      {129, {7, 7, 2}, {1.f, 0.f}, Shape::kWide, 1, true},
      // rows of several CUDA chunks, more than a warp's lanes of them
      {9001, {5, 3, 6}, mixed, Shape::kRandom, 2},
      {135169, {3, 2}, {1.f, 0.f}, Shape::kDeep},
      {12289, {4, 1, 3}, {0.f, 1.f}, Shape::kWide, 1, true},
      // blocks that loop over several rows (tiles) and requests (races)
      {4099, {6, 2, 5, 1, 4}, mixed, Shape::kRandom, 0, false, 3},
      {523, {9, 4, 7}, {1.f}, Shape::kDeep, 1, false, 2},
  };
  // Each case runs good, then with two kinds of bad request in turn (every kind over the cases).
  uint64_t seed = 101;
  size_t next_bad = 0;
  constexpr size_t kinds = sizeof(kBads) / sizeof(kBads[0]);
  for (const Case& c : cases) {
    run_case<T>(c, seed++, Bad::kNone);
    for (int i = 0; i < 2; ++i) run_case<T>(c, seed++, kBads[next_bad++ % kinds]);
  }
}

}  // namespace

int main() {
  run_all<float>();
  run_all<bfloat16_t>();
  run_all<float16_t>();
  COC_EXPECT(g_walked_cases * 10 >= g_deep_cases * 8, "only %d of %d good batches walked past a root", g_walked_cases,
             g_deep_cases);
  return coc_test::finish("tree_verify");
}
