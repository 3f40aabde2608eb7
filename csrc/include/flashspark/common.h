// Common definitions shared by every flashspark kernel, CPU and CUDA.
// Torch-free: this header is included by the kernel library, the
// microbenchmarks and the torch binding layer alike.
#pragma once

#include <cstdint>
#include <cstring>
#include <cmath>

#if defined(__CUDACC__)
#define FS_HOST_DEVICE __host__ __device__ __forceinline__
#define FS_DEVICE __device__ __forceinline__
#else
#define FS_HOST_DEVICE inline
#define FS_DEVICE inline
#endif

namespace flashspark {

// 16-bit storage types, layout-compatible with at::BFloat16 / at::Half and
// with __nv_bfloat16 / __half. Kernels only ever load them and widen to fp32.
struct bfloat16_t { uint16_t bits; };
struct float16_t { uint16_t bits; };

FS_HOST_DEVICE float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FS_HOST_DEVICE uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FS_HOST_DEVICE float to_float(float x) { return x; }
FS_HOST_DEVICE float to_float(bfloat16_t x) { return bits_to_float(uint32_t(x.bits) << 16); }

// IEEE binary16 -> binary32, exact for every input (normals, subnormals,
// infinities and NaN), without relying on F16C or cuda_fp16.h.
FS_HOST_DEVICE float to_float(float16_t x) {
  const uint32_t h = x.bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  const float mag = float(man) * 5.9604644775390625e-08f;
  return sign ? -mag : mag;
}

// Float -> bf16 with round-to-nearest-even (used by tests and benchmarks
// that build inputs without torch).
FS_HOST_DEVICE bfloat16_t to_bfloat16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x7FFFFFu)) return bfloat16_t{uint16_t((u >> 16) | 0x40u)};
  u += 0x7FFFu + ((u >> 16) & 1u);
  return bfloat16_t{uint16_t(u >> 16)};
}

// Float -> fp16 with round-to-nearest-even, overflow to inf, subnormals kept.
FS_HOST_DEVICE float16_t to_float16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs >= 0x7F800000u) return float16_t{uint16_t(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u))};
  if (abs >= 0x477FF000u) return float16_t{uint16_t(sign | 0x7C00u)};  // rounds past 65504
  if (abs < 0x38800000u) {  // below the smallest normal: a multiple of 2^-24
    const float mag = bits_to_float(abs) * 16777216.f;  // exact scaling
    // round half to even, in integer arithmetic on the scaled magnitude
    const uint32_t whole = uint32_t(mag);
    const float frac = mag - float(whole);
    uint32_t r = whole + ((frac > 0.5f || (frac == 0.5f && (whole & 1u))) ? 1u : 0u);
    return float16_t{uint16_t(sign | r)};
  }
  uint32_t h = ((abs - 0x38000000u) >> 13);  // rebias exponent 127 -> 15
  const uint32_t rest = abs & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return float16_t{uint16_t(sign | h)};
}

// Widen-and-narrow helpers used by kernels that write their output dtype.
template <class T>
FS_HOST_DEVICE T from_float(float x);
template <>
FS_HOST_DEVICE float from_float<float>(float x) { return x; }
template <>
FS_HOST_DEVICE bfloat16_t from_float<bfloat16_t>(float x) { return to_bfloat16(x); }
template <>
FS_HOST_DEVICE float16_t from_float<float16_t>(float x) { return to_float16(x); }

constexpr float kNegInf = -INFINITY;

FS_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// RMSNorm's scale of a row: 1 / sqrt(mean(x^2) + eps) from its sum of squares.
FS_HOST_DEVICE float rms_inv(float sum_squares, int32_t dim, float eps) {
  return 1.f / sqrtf(sum_squares / float(dim) + eps);
}

}  // namespace flashspark
