// Microbenchmark of the raw CPU `verify` kernel (no torch): median µs per call
// and effective GB/s over the bytes the call must read.
//   flashspark_bench_cpu [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "flashspark/cpu/parallel.h"
#include "flashspark/cpu/verify.h"
#include "verify_inputs.h"

using namespace flashspark;

template <class T>
static void run(int32_t batch, int32_t gamma, int32_t vocab, bool greedy, int repeats) {
  bench::VerifyInputs in = bench::make_verify_inputs(batch, gamma, vocab);
  const std::vector<T> logits = bench::logits_as<T>(in.logits);
  if (greedy) std::fill(in.temperature.begin(), in.temperature.end(), 0.f);
  std::vector<int32_t> out(size_t(batch) * (gamma + 1)), acc(batch);
  VerifyParams<T> p;
  p.logits = logits.data();
  p.logits_row_stride = vocab;
  p.draft_tokens = in.draft_tokens.data();
  p.cu_num_draft = in.cu_num_draft.data();
  p.temperature = in.temperature.data();
  p.seeds = in.seeds.data();
  p.offsets = in.offsets.data();
  p.out_tokens = out.data();
  p.out_num_accepted = acc.data();
  p.batch = batch;
  p.vocab = vocab;
  p.max_spec_len = gamma;
  const cpu::OpenMPParallelFor pf;
  cpu::verify_cpu(p, p.cu_num_draft[batch], pf);  // warm-up
  std::vector<double> us;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    cpu::verify_cpu(p, p.cu_num_draft[batch], pf);
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  const double med = us[us.size() / 2];
  const double bytes = bench::verify_walked_bytes(acc, vocab, sizeof(T), greedy ? 0 : batch);
  double tau = 0;
  for (int32_t a : acc) tau += a + 1;
  std::printf("%4d %3d %7d %5s %7s | %10.1f us %8.2f GB/s | tau %.2f\n", batch, gamma, vocab,
              sizeof(T) == 4 ? "fp32" : "bf16", greedy ? "greedy" : "sample", med, bytes / med * 1e-3, tau / batch);
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::printf(
      "flashspark verify, CPU kernel (median of runs; GB/s over the rows it reads: walked rows, then the stop row)\n");
  std::printf("   B   g       V dtype    mode |       time        bandwidth | acceptance\n");
  const int repeats = quick ? 3 : 20;
  const std::vector<int32_t> batches = quick ? std::vector<int32_t>{1, 8} : std::vector<int32_t>{1, 8, 32, 64};
  const std::vector<int32_t> vocabs = quick ? std::vector<int32_t>{4096} : std::vector<int32_t>{4096, 32000, 151936};
  for (int32_t vocab : vocabs)
    for (int32_t batch : batches)
      for (bool greedy : {true, false}) {
        run<float>(batch, 8, vocab, greedy, repeats);
        if (!quick) run<bfloat16_t>(batch, 8, vocab, greedy, repeats);
      }
  return 0;
}
