// Small vector loops of the CPU kernels, compiled for several instruction
// sets with the best picked at load time (GCC/Clang target_clones), so a
// portable build still runs AVX2/AVX-512 code where the CPU has it.
#pragma once

#include <algorithm>
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

// 16-bit rows widened to fp32 in simd loops compiled per instruction set.
FS_CPU_CLONES static void widen(size_t n, const bfloat16_t* __restrict src, float* __restrict dst) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}
FS_CPU_CLONES static void widen(size_t n, const float16_t* __restrict src, float* __restrict dst) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// n values of src as fp32: src itself when T is fp32 (read in place), else converted into dst.
template <class T>
const float* as_f32(const T* src, size_t n, float* dst) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    widen(n, src, dst);
    return dst;
  }
}

// as_f32 into a buffer sized here (left empty for fp32).
template <class T>
const float* as_f32_buffer(const T* src, size_t n, std::vector<float>& buf) {
  if constexpr (!std::is_same_v<T, float>) buf.resize(n);
  return as_f32(src, n, buf.data());
}

// max_i x[i] (-inf for n = 0) and whether any x[i] is NaN, in one pass.
FS_CPU_CLONES static float max_of_checked(int64_t n, const float* __restrict x, bool* has_nan) {
  float m = -__builtin_inff();
  int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    bad |= !(x[i] == x[i]);
  }
  *has_nan = bad != 0;
  return m;
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

// The first i with x[i] == v (n when there is none): a min reduction, so it vectorizes.
FS_CPU_CLONES static int64_t first_equal(int64_t n, const float* __restrict x, float v) {
  int64_t first = n;
#pragma omp simd reduction(min : first)
  for (int64_t i = 0; i < n; ++i) first = x[i] == v && i < first ? i : first;
  return first;
}

// Philox4x32-10 blocks first, first + 1, ..., first + count - 1 of one (seed, position,
// purpose) stream, as philox_block computes them, 32 at a time in lockstep so that the rounds
// vectorize: the 32-bit words live in 64-bit lanes, where a 32 x 32 -> 64-bit product is one
// instruction and its halves need no repacking; block i's draws land in out[4 i .. 4 i + 3].
FS_CPU_CLONES static void philox_blocks(uint64_t seed, uint64_t position, uint32_t purpose, uint32_t first,
                                        int64_t count, uint32_t* __restrict out) {
  constexpr int64_t kLanes = 32;
  constexpr uint64_t kLow = 0xFFFFFFFFu;
  for (int64_t g0 = 0; g0 < count; g0 += kLanes) {
    uint64_t x[kLanes], y[kLanes], z[kLanes], w[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      x[j] = uint32_t(first + uint32_t(g0 + j));
      y[j] = uint32_t(position);
      z[j] = uint32_t(position >> 32);
      w[j] = purpose;
    }
    uint64_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    for (int round = 0; round < 10; ++round) {
#pragma omp simd
      for (int64_t j = 0; j < kLanes; ++j) {
        const uint64_t p0 = 0xD2511F53u * x[j];
        const uint64_t p1 = 0xCD9E8D57u * z[j];
        x[j] = (p1 >> 32) ^ y[j] ^ k0;
        y[j] = p1 & kLow;
        z[j] = (p0 >> 32) ^ w[j] ^ k1;
        w[j] = p0 & kLow;
      }
      k0 = (k0 + 0x9E3779B9u) & kLow;
      k1 = (k1 + 0xBB67AE85u) & kLow;
    }
    const int64_t m = std::min(kLanes, count - g0);
    for (int64_t j = 0; j < m; ++j) {
      uint32_t* o = out + 4 * (g0 + j);
      o[0] = uint32_t(x[j]);
      o[1] = uint32_t(y[j]);
      o[2] = uint32_t(z[j]);
      o[3] = uint32_t(w[j]);
    }
  }
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
