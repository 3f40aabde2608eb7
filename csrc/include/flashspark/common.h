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

constexpr float kNegInf = -INFINITY;

FS_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace flashspark
