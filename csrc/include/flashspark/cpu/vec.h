// Small vector loops of the CPU kernels, compiled for several instruction
// sets with the best picked at load time (GCC/Clang target_clones), so a
// portable build still runs AVX2/AVX-512 code where the CPU has it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "flashspark/common.h"

// Not under ThreadSanitizer: the clones' ifunc resolvers run before it is initialized.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
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

// y[i] = w[i] * (x[i] * s): RMSNorm's scaling of a row (y may be x).
FS_CPU_CLONES static void rms_scale(int64_t n, float s, const float* w, const float* x, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = w[i] * (x[i] * s);
}

// out[r] = sum_i s[r][i] * w[i] for four row vectors s[0..3]: w is read once for the four.
FS_CPU_CLONES static void dot4(int64_t n, const float* const* s, const float* __restrict w, float* __restrict out) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  const float *s0 = s[0], *s1 = s[1], *s2 = s[2], *s3 = s[3];
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t i = 0; i < n; ++i) {
    a0 += s0[i] * w[i];
    a1 += s1[i] * w[i];
    a2 += s2[i] * w[i];
    a3 += s3[i] * w[i];
  }
  out[0] = a0;
  out[1] = a1;
  out[2] = a2;
  out[3] = a3;
}

// out[r * 16 + j] = sum_i s[r][i] * m[i * 16 + j] for four row vectors s[0..3] and the 16
// columns j of m [n, 16]: one broadcast multiply-add per row of m and no horizontal sums;
// m is read once for the four rows, whose four accumulator chains hide the multiply-add
// latency. Each output is summed in order of i.
FS_CPU_CLONES static void vecmat16x4(int64_t n, const float* const* s, const float* __restrict m,
                                     float* __restrict out) {
  float a0[16] = {}, a1[16] = {}, a2[16] = {}, a3[16] = {};
  const float *s0 = s[0], *s1 = s[1], *s2 = s[2], *s3 = s[3];
  for (int64_t i = 0; i < n; ++i) {
    const float x0 = s0[i], x1 = s1[i], x2 = s2[i], x3 = s3[i];
    const float* mi = m + i * 16;
#pragma omp simd
    for (int j = 0; j < 16; ++j) {
      a0[j] += x0 * mi[j];
      a1[j] += x1 * mi[j];
      a2[j] += x2 * mi[j];
      a3[j] += x3 * mi[j];
    }
  }
  for (int j = 0; j < 16; ++j) {
    out[j] = a0[j];
    out[16 + j] = a1[j];
    out[32 + j] = a2[j];
    out[48 + j] = a3[j];
  }
}

// max_i x[i] (-inf for n = 0).
FS_CPU_CLONES static float max_of(int64_t n, const float* __restrict x) {
  float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// n values of src as fp32: src itself when T is fp32 (read in place), else converted into dst.
template <class T>
const float* as_f32(const T* src, size_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
    return dst;
  }
}

// as_f32 into a buffer sized here (left empty for fp32).
template <class T>
const float* as_f32_buffer(const T* src, size_t n, std::vector<float>& buf) {
  if constexpr (!std::is_same_v<T, float>) buf.resize(n);
  return as_f32(src, n, buf.data());
}

// Whether any x[i] is NaN.
FS_CPU_CLONES static bool any_nan(int64_t n, const float* __restrict x) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= !(x[i] == x[i]);
  return bad != 0;
}

// Whether any x[i] lies outside [0, 1] (NaN included): a value that is not a probability.
FS_CPU_CLONES static bool any_outside01(int64_t n, const float* __restrict x) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) bad |= !(x[i] >= 0.f && x[i] <= 1.f);
  return bad != 0;
}

// The first i with x[i] == v (n when there is none).
static inline int64_t first_equal(int64_t n, const float* x, float v) {
  int64_t i = 0;
  while (i < n && !(x[i] == v)) ++i;
  return i;
}

// exp(x) for x <= 0 (the terms of a max-shifted softmax sum), in plain arithmetic so
// that simd loops vectorize it (the C library's expf is a call): Cody-Waite range
// reduction by ln 2 and a degree-6 polynomial (the Cephes expf coefficients), within
// 2 ulp of expf for x in [-87, 0]; below -87 it returns about 1.6e-38 instead of an
// underflowing value, which no sum that contains exp(0) = 1 can notice. The clamp is
// a select that vectorizes under -fno-trapping-math (setup.py, CMakeLists.txt).
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // NaN stays NaN, and so does the result (callers detect it)
  // n = round(x / ln 2) by truncating a non-negative number (a vector conversion, no call);
  // from a copy in which NaN reads as -87, since converting NaN to an integer is undefined.
  const float xn = x > -87.0f ? x : -87.0f;
  const int32_t ni = -int32_t(0.5f - xn * 1.44269504088896341f);
  const float n = float(ni);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// sum_i exp(x[i] - m) for m >= max_i x[i].
FS_CPU_CLONES static float sum_exp_shifted(int64_t n, const float* __restrict x, float m) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += exp_nonpositive(x[i] - m);
  return s;
}

// sum_i exp((x[i] - m) * inv_t) for m >= max_i x[i] and inv_t > 0: a softmax at 1 / inv_t
// kept in logit units, as SoftmaxState.
FS_CPU_CLONES static float sum_exp_scaled(int64_t n, const float* __restrict x, float m, float inv_t) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += exp_nonpositive((x[i] - m) * inv_t);
  return s;
}

}  // namespace flashspark::cpu
