// The cuda_on_cpu API the comparison drivers use, on a real GPU: the drivers built with nvcc
// (bench/gpu_check.sh) run each case once, on device memory from cudaMalloc; the schedules and
// the layer's reports have no counterpart there (compute-sanitizer reports instead).
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace cuda_on_cpu {

enum class Order { kForward, kReverse, kRandom };
struct Schedule {
  Order order = Order::kForward;
  uint64_t seed = 0;
};
inline void set_schedule(Schedule) {}
inline const std::vector<std::string>& errors() {
  static const std::vector<std::string> none;
  return none;
}
inline void clear_errors() {}

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("%s: %s\n", what, cudaGetErrorString(e));
    std::exit(2);
  }
}
inline void* device_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
  check(cudaMemset(p, 0xFF, bytes), "cudaMemset");  // poisoned, as on the layer
  return p;
}
inline void device_free(void* p) {
  if (p) cudaFree(p);
}
inline void copy_to_device(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}
inline void copy_to_host(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}
inline cudaError_t synchronize() { return cudaDeviceSynchronize(); }

}  // namespace cuda_on_cpu
