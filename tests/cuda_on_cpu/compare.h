// What every CUDA-vs-CPU comparison of the cuda_on_cpu layer shares: guarded device arrays,
// the schedules each case runs under, input generators, and checks that count failures.
// The same drivers build with nvcc against the real CUDA runtime (gpu_include/), where they
// run once per case on the GPU (bench/gpu_check.sh, under compute-sanitizer).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_on_cpu/runtime.h"
#include "flashspark/common.h"

namespace coc_test {

inline int g_failures = 0;
inline int g_checks = 0;
inline std::string g_case;  // the case being run, printed with a failure
// COC_FAIL_FAST=1 (the mutation runs): stop at the first failed check.
inline const bool g_fail_fast = std::getenv("COC_FAIL_FAST") != nullptr;

#define COC_EXPECT(cond, ...)                                                                       \
  do {                                                                                              \
    ++::coc_test::g_checks;                                                                         \
    if (!(cond)) {                                                                                  \
      ++::coc_test::g_failures;                                                                     \
      if (::coc_test::g_failures <= 40) {                                                           \
        std::printf("FAIL %s:%d [%s] %s: ", __FILE__, __LINE__, ::coc_test::g_case.c_str(), #cond); \
        std::printf(__VA_ARGS__);                                                                   \
        std::printf("\n");                                                                          \
      }                                                                                             \
      if (::coc_test::g_fail_fast) std::exit(1);                                                    \
    }                                                                                               \
  } while (0)

// A device buffer holding a copy of `host` (guarded: see cuda_on_cpu::device_alloc).
template <class T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t n = 0;
  DeviceArray() = default;
  explicit DeviceArray(size_t count) : n(count) { ptr = static_cast<T*>(cuda_on_cpu::device_alloc(n * sizeof(T))); }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(host.size()) {
    if (n) cuda_on_cpu::copy_to_device(ptr, host.data(), n * sizeof(T));
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cuda_on_cpu::device_free(ptr); }
  std::vector<T> host() const {
    std::vector<T> out(n);
    if (n) cuda_on_cpu::copy_to_host(out.data(), ptr, n * sizeof(T));
    return out;
  }
};

// The schedules every case runs under: fibres and blocks in order, reversed, and shuffled
// with two seeds. A kernel whose result depends on the order of threads between barriers
// (a missing __syncthreads, a shared slot read too early) fails under one of them.
inline std::vector<cuda_on_cpu::Schedule> schedules() {
  using cuda_on_cpu::Order;
#if defined(__CUDACC__)
  return {{Order::kForward, 0}};  // a GPU has its own schedule
#endif
  return {{Order::kForward, 0}, {Order::kReverse, 0}, {Order::kRandom, 1}, {Order::kRandom, 2}};
}
inline const char* order_name(cuda_on_cpu::Order o) {
  return o == cuda_on_cpu::Order::kForward ? "forward" : o == cuda_on_cpu::Order::kReverse ? "reverse" : "random";
}

// Runs `launch()` (which must return the launcher's cudaError_t) and expects success and no
// problem reported by the layer (on a GPU: none when the stream completes).
template <class F>
void expect_clean_launch(const F& launch) {
  cuda_on_cpu::clear_errors();
  cudaError_t e = launch();
  if (e == cudaSuccess) e = cuda_on_cpu::synchronize();
  COC_EXPECT(e == cudaSuccess, "launcher returned %d (%s)", int(e), cudaGetErrorString(e));
  for (const std::string& what : cuda_on_cpu::errors()) COC_EXPECT(false, "layer: %s", what.c_str());
  cuda_on_cpu::clear_errors();
}

template <class T>
float widen(T x) {
  return flashspark::to_float(x);
}

template <class T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, float>) return "fp32";
  if constexpr (std::is_same_v<T, flashspark::bfloat16_t>) return "bf16";
  return "fp16";
}

// `n` values of T from N(0, scale^2), rounded to T (so both kernels read the same inputs).
template <class T>
std::vector<T> random_values(size_t n, std::mt19937_64& rng, float scale = 1.f) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<T> out(n);
  for (auto& x : out) x = flashspark::from_float<T>(d(rng));
  return out;
}

// Float outputs agree within `atol + rtol * |cpu|`, NaN matching NaN; prints the first misses.
inline void expect_close(const std::vector<float>& cuda, const std::vector<float>& cpu, float atol, float rtol,
                         const char* what) {
  COC_EXPECT(cuda.size() == cpu.size(), "%s: %zu vs %zu values", what, cuda.size(), cpu.size());
  size_t misses = 0;
  for (size_t i = 0; i < std::min(cuda.size(), cpu.size()); ++i) {
    const float a = cuda[i], b = cpu[i];
    const bool ok = (std::isnan(a) && std::isnan(b)) || a == b || std::fabs(a - b) <= atol + rtol * std::fabs(b);
    if (!ok && misses++ < 3) COC_EXPECT(ok, "%s[%zu]: cuda %.9g cpu %.9g", what, i, double(a), double(b));
  }
  COC_EXPECT(misses <= 3, "%s: %zu values differ", what, misses);
}

template <class I>
void expect_equal(const std::vector<I>& cuda, const std::vector<I>& cpu, const char* what) {
  COC_EXPECT(cuda.size() == cpu.size(), "%s: %zu vs %zu values", what, cuda.size(), cpu.size());
  size_t misses = 0;
  for (size_t i = 0; i < std::min(cuda.size(), cpu.size()); ++i)
    if (cuda[i] != cpu[i] && misses++ < 3)
      COC_EXPECT(cuda[i] == cpu[i], "%s[%zu]: cuda %lld cpu %lld", what, i, (long long)cuda[i], (long long)cpu[i]);
  COC_EXPECT(misses <= 3, "%s: %zu values differ", what, misses);
}

template <class T>
std::vector<float> widened(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = widen(v[i]);
  return out;
}

// The CPU kernels' parallel_for, run serially (their results never depend on the split).
struct SerialFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t, const F& f) const {
    if (end > begin) f(begin, end);
  }
};

inline int finish(const char* suite) {
  if (g_failures) {
    std::printf("%s: %d of %d checks failed\n", suite, g_failures, g_checks);
    return 1;
  }
  std::printf("%s: all %d checks passed\n", suite, g_checks);
  return 0;
}

}  // namespace coc_test
