// Common definitions shared by every flashspark kernel, CPU and CUDA.
// Torch-free: this header is included by the kernel library, the
// microbenchmarks and the torch binding layer alike.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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
struct bfloat16_t {
  uint16_t bits;
};
struct float16_t {
  uint16_t bits;
};

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

FS_HOST_DEVICE uint64_t double_to_bits(double d) {
#if defined(__CUDA_ARCH__)
  return uint64_t(__double_as_longlong(d));
#else
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  return u;
#endif
}

FS_HOST_DEVICE double bits_to_double(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double((long long)u);
#else
  double d;
  std::memcpy(&d, &u, sizeof(d));
  return d;
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
  if (abs < 0x38800000u) {                                             // below the smallest normal: a multiple of 2^-24
    const float mag = bits_to_float(abs) * 16777216.f;                 // exact scaling
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

// A read-only pointer to fp32, bf16 or fp16 values whose type is known only at run time
// (a drafter's probabilities come in its own dtype, independent of the logits'). Every read
// widens to fp32; the branch is the same for a whole row, so it predicts perfectly.
enum class FloatType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct AnyFloatPtr {
  const void* data = nullptr;
  FloatType type = FloatType::kFloat32;

  FS_HOST_DEVICE float operator[](int64_t i) const {
    switch (type) {
      case FloatType::kBFloat16:
        return to_float(static_cast<const bfloat16_t*>(data)[i]);
      case FloatType::kFloat16:
        return to_float(static_cast<const float16_t*>(data)[i]);
      default:
        return static_cast<const float*>(data)[i];
    }
  }
  FS_HOST_DEVICE AnyFloatPtr operator+(int64_t i) const {
    const int64_t bytes = type == FloatType::kFloat32 ? 4 : 2;
    return AnyFloatPtr{static_cast<const char*>(data) + i * bytes, type};
  }
};

// exp(x) for x <= 0 (the terms of a max-shifted softmax sum, the probabilities of a race), in
// plain arithmetic so that CPU simd loops vectorize it (the C library's expf is a call) and every
// backend computes the same value: n = round(x / ln 2) by the 1.5 * 2^23 shifter (the sum's low
// bits hold n: no float <-> int conversion), Cody-Waite reduction by ln 2, the Cephes expf
// polynomial, and 2^n added to the exponent bits; within 1 ulp of exp for x in [-87, 0]. Below
// -87 (-inf included) it returns 0: a probability under 1.7e-38 is no mass (a masked token is
// never accepted), and no sum that contains exp(0) = 1 can notice. NaN stays NaN. The selects
// vectorize under -fno-trapping-math (setup.py, CMakeLists.txt).
FS_HOST_DEVICE float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.f;  // 1.5 * 2^23
  const float t = xc * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;  // in [0.7, 1.42]: 2^n times it stays normal for n >= -126
  const float e = bits_to_float(float_to_bits(y) + ((float_to_bits(t) - float_to_bits(shifter)) << 23));
  return x < -87.0f ? 0.f : (x == x ? e : x);
}

// log(x) for a normal float x > 0, in the same branch-free style: x = m * 2^e with m in
// [sqrt(1/2), sqrt(2)), then the Cephes logf polynomial in m - 1 (within 1 ulp of logf).
FS_HOST_DEVICE float log_normal(float x) {
  const uint32_t u = float_to_bits(x);
  float e = float(int32_t(u >> 23) - 126);
  float m = bits_to_float((u & 0x007FFFFFu) | 0x3F000000u);  // [0.5, 1)
  const bool low = m < 0.707106781186547524f;
  e = low ? e - 1.f : e;
  m = low ? m + m - 1.f : m - 1.f;
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = y * m * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return m + y + 0.693359375f * e;
}

// log(x) for any finite x > 0, subnormals scaled up by 2^23 first.
FS_HOST_DEVICE float log_positive(float x) {
  const bool subnormal = x < 1.17549435e-38f;
  const float l = log_normal(subnormal ? x * 8388608.f : x);
  return subnormal ? l - 15.9423851528787f : l;  // 23 ln 2
}

// Widen-and-narrow helpers used by kernels that write their output dtype.
template <class T>
FS_HOST_DEVICE T from_float(float x);
template <>
FS_HOST_DEVICE float from_float<float>(float x) {
  return x;
}
template <>
FS_HOST_DEVICE bfloat16_t from_float<bfloat16_t>(float x) {
  return to_bfloat16(x);
}
template <>
FS_HOST_DEVICE float16_t from_float<float16_t>(float x) {
  return to_float16(x);
}

constexpr float kNegInf = -INFINITY;

constexpr float kPosInf = INFINITY;
constexpr float kFloatMax = 3.40282347e+38f;

FS_HOST_DEVICE int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- the bad-input contract shared by every kernel ----------------------------
//
// Per-item status codes. Kernels never trap: a check that fails writes its code
// into the op's optional status tensor (one entry per request, token or call), and
// that item's outputs take their documented "failed" values. The CPU binding raises
// the same message eagerly when no status tensor is passed. One code space for all
// ops, so a status tensor reads the same whichever op wrote it.
enum class Status : int32_t {
  kOk = 0,
  kBadCuNumDraft = 1,     // verify: cu_num_draft not starting at 0, decreasing, or not ending at T
  kSpecTooLong = 2,       // verify: a request has more than max_spec_len draft tokens
  kDraftTokenRange = 3,   // verify: a draft token outside [0, V) other than the placeholder -1
  kCandidateRange = 4,    // verify: a sparse q id outside [0, V)
  kBadTemperature = 5,    // verify, path_select, markov_step: NaN, infinite or negative temperature
  kDraftNotListed = 6,    // verify: sparse q whose candidates do not list the draft token
  kNonFiniteLogit = 7,    // verify: NaN or +inf in a logit row the walk reads
  kNoFiniteLogit = 8,     // verify: a logit row the walk reads is all -inf
  kBadDraftProb = 9,      // verify: a draft probability read is NaN or outside [0, 1]
  kSlotRange = 10,        // inject_context_kv: a cache row outside [0, B)
  kPositionRange = 11,    // inject_context_kv: a position outside [0, S_max)
  kRopeRange = 12,        // inject_context_kv: a position beyond the cos/sin cache
  kCtxLenRange = 13,      // block_diffusion_attention: a context length outside [0, S_max]
  kBadCuBlocks = 14,      // two_tap_conv: cu_blocks not starting at 0, decreasing, or not ending at N
  kPathTokenRange = 15,   // path_select: a candidate or anchor id outside [0, V)
  kPrevTokenRange = 16,   // markov_step: a previous token outside [0, V)
  kBonusTokenRange = 17,  // verify: a given bonus token outside [0, V)
  kBadTargetProb = 18,    // verify (probabilities mode): a p value read is NaN or outside [0, 1], or a row has no mass
  kBadCuNumNodes = 19,    // tree_verify: cu_num_nodes not starting at 0, not increasing, or not ending at N
  kBadParent = 20,        // tree_verify: a root with a parent, or a parent outside the request or not before its child
  kTreeTooDeep = 21,      // tree_verify: a node deeper than max_depth
  kNodeTokenRange = 22,   // tree_verify: a node token outside [0, V)
};

FS_HOST_DEVICE void write_status(int32_t* status, int64_t i, Status s) {
  if (status) status[i] = int32_t(s);
}

// The first failed item of n, by an item check (host-side, CPU tensors): kOk if none.
template <class Check>
inline Status first_failure(int64_t n, const Check& check) {
  for (int64_t i = 0; i < n; ++i) {
    const Status s = check(i);
    if (s != Status::kOk) return s;
  }
  return Status::kOk;
}

// Below this temperature a request samples greedily (vLLM's floor): 1 / T then never
// exceeds 1e5, and temperatures whose reciprocal overflows cannot reach a kernel.
constexpr float kGreedyTemperature = 1e-5f;

// A usable temperature is finite and >= 0; NaN fails both comparisons.
FS_HOST_DEVICE bool temperature_ok(float t) { return t >= 0.f && t < kPosInf; }
FS_HOST_DEVICE bool temperature_greedy(float t) { return t < kGreedyTemperature; }

// How drafter-side kernels (topk_select, path_select, markov_step) read a logit: NaN as
// -inf (never chosen, no mass) and +inf as the largest finite float, so every score is
// finite or -inf and no softmax over them can produce NaN.
FS_HOST_DEVICE float drafter_logit(float x) {
  if (!(x == x)) return kNegInf;
  return x > kFloatMax ? kFloatMax : x;
}

// RMSNorm's scale of a row: 1 / sqrt(mean(x^2) + eps) from its sum of squares.
FS_HOST_DEVICE float rms_inv(float sum_squares, int32_t dim, float eps) {
  return 1.f / sqrtf(sum_squares / float(dim) + eps);
}

}  // namespace flashspark
