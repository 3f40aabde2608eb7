// Small vector loops of the CPU kernels, compiled for several instruction
// sets with the best picked at load time (GCC/Clang target_clones), so a
// portable build still runs AVX2/AVX-512 code where the CPU has it.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FS_CPU_CLONES
#endif

namespace flashspark::cpu {

// y[i] += a * x[i]
FS_CPU_CLONES static void axpy(int64_t n, float a, const float* __restrict x, float* __restrict y) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// y_r[i] += a[r] * x[i] for four rows r at once: x is read once for the four.
FS_CPU_CLONES static void axpy4(int64_t n, const float* a, const float* __restrict x, float* __restrict y0,
                                float* __restrict y1, float* __restrict y2, float* __restrict y3) {
  const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  for (int64_t i = 0; i < n; ++i) {
    const float xi = x[i];
    y0[i] += a0 * xi;
    y1[i] += a1 * xi;
    y2[i] += a2 * xi;
    y3[i] += a3 * xi;
  }
}

// sum_i x[i] * y[i]; the simd reduction lets the compiler reorder the sum.
FS_CPU_CLONES static float dot(int64_t n, const float* __restrict x, const float* __restrict y) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += x[i] * y[i];
  return acc;
}

}  // namespace flashspark::cpu
