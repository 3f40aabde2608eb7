// Microbenchmark of the raw CUDA `verify` kernel (no torch): median µs per call
// from CUDA events, effective GB/s over the bytes the call must read, and that
// as a fraction of the HBM bandwidth given by --peak-gbs (default: H200, 4800).
//   flashspark_bench_cuda [--quick] [--peak-gbs N]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "flashspark/cuda/launch.h"
#include "verify_inputs.h"

using namespace flashspark;

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

template <class V>
static V* upload(const std::vector<V>& host) {
  V* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, std::max<size_t>(host.size(), 1) * sizeof(V)));
  if (!host.empty()) CHECK_CUDA(cudaMemcpy(dev, host.data(), host.size() * sizeof(V), cudaMemcpyHostToDevice));
  return dev;
}

template <class T>
static void run(int32_t batch, int32_t gamma, int32_t vocab, bool greedy, int repeats, double peak_gbs) {
  bench::VerifyInputs in = bench::make_verify_inputs(batch, gamma, vocab);
  const std::vector<T> logits = bench::logits_as<T>(in.logits);
  if (greedy) std::fill(in.temperature.begin(), in.temperature.end(), 0.f);
  VerifyParams<T> p;
  p.logits = upload(logits);
  p.logits_row_stride = vocab;
  p.draft_tokens = upload(in.draft_tokens);
  p.cu_num_draft = upload(in.cu_num_draft);
  p.temperature = upload(in.temperature);
  p.seeds = upload(in.seeds);
  p.offsets = upload(in.offsets);
  std::vector<int32_t> out(size_t(batch) * (gamma + 1)), acc(batch);
  p.out_tokens = upload(out);
  p.out_num_accepted = upload(acc);
  p.batch = batch;
  p.vocab = vocab;
  p.max_spec_len = gamma;
  const int32_t num_tokens = batch * gamma;
  CHECK_CUDA(cudaMalloc(&p.workspace, size_t(verify_workspace_bytes(batch, int64_t(batch) * (gamma + 1), vocab))));
  CHECK_CUDA(cuda::launch_verify<T>(p, num_tokens, nullptr));
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> us;
  for (int r = 0; r < repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(cuda::launch_verify<T>(p, num_tokens, nullptr));
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(ms * 1e3f);
  }
  std::sort(us.begin(), us.end());
  const double med = us[us.size() / 2];
  CHECK_CUDA(cudaMemcpy(acc.data(), p.out_num_accepted, acc.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  const double bytes = bench::verify_bytes(batch, gamma, vocab, sizeof(T), greedy ? 0 : batch);
  const double gbs = bytes / med * 1e-3;
  std::printf("%4d %3d %7d %5s %7s | %8.2f MB %9.1f us %9.2f us | %8.1f GB/s %5.1f%% of peak\n", batch, gamma, vocab,
              sizeof(T) == 4 ? "fp32" : "bf16", greedy ? "greedy" : "sample", bytes * 1e-6, med,
              bytes / (peak_gbs * 1e3), gbs, 100.0 * gbs / peak_gbs);
  for (const void* ptr : {(const void*)p.logits, (const void*)p.draft_tokens, (const void*)p.cu_num_draft,
                          (const void*)p.temperature, (const void*)p.seeds, (const void*)p.offsets,
                          (const void*)p.out_tokens, (const void*)p.out_num_accepted, (const void*)p.workspace})
    CHECK_CUDA(cudaFree(const_cast<void*>(ptr)));
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

int main(int argc, char** argv) {
  bool quick = false;
  double peak_gbs = 4800.0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (std::strcmp(argv[i], "--peak-gbs") == 0 && i + 1 < argc)
      peak_gbs = std::atof(argv[++i]);
  }
  int device = 0;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDevice(&device));
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  std::printf(
      "flashspark verify, CUDA kernel on %s (median of runs; bytes: every row once, then each sampled\n"
      "request's stop row; roofline: those bytes at --peak-gbs %.0f)\n",
      prop.name, peak_gbs);
  std::printf("   B   g       V dtype    mode |    bytes      time   roofline |   bandwidth\n");
  const int repeats = quick ? 5 : 50;
  for (int32_t vocab : {32000, 128256, 151936})
    for (int32_t batch : {1, 8, 32, 64})
      for (bool greedy : {true, false}) {
        run<float>(batch, 8, vocab, greedy, repeats, peak_gbs);
        run<bfloat16_t>(batch, 8, vocab, greedy, repeats, peak_gbs);
      }
  return 0;
}
