// Philox4x32-10 (Salmon et al., SC'11): the one counter-based generator of
// flashspark. CPU kernels, CUDA kernels and the Python reference
// (flashspark.reference.philox4x32_10) all derive their random numbers from
// it, so all three draw the same numbers for the same
// (seed, position, purpose, index).
//
// Stream layout:
//   key     = (seed & 0xffffffff, seed >> 32)     -- one seed per request
//   counter = (index, position & 0xffffffff, position >> 32, purpose)
// The batch row never enters the stream: a request draws the same numbers
// wherever it sits in the batch. `index` enumerates draws that share a
// position and purpose (e.g. vocabulary entries, four per Philox call).
#pragma once

#include "flashspark/common.h"

namespace flashspark {

struct U32x4 {
  uint32_t x, y, z, w;
};

// Purposes: one per kind of draw, so no two kinds ever share a number.
enum Purpose : uint32_t {
  kPurposeAccept = 1,    // verify: the uniform of the accept test at a draft position
  kPurposeResample = 2,  // verify: the race that samples the correction or bonus token
  kPurposeDraft = 3,     // drafters: the race that samples a draft token
  kPurposePath = 4,      // dflash2 path selector: sampled path
};

FS_HOST_DEVICE void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
#if defined(__CUDA_ARCH__)
  *lo = a * b;
  *hi = __umulhi(a, b);
#else
  const uint64_t p = uint64_t(a) * uint64_t(b);
  *lo = uint32_t(p);
  *hi = uint32_t(p >> 32);
#endif
}

FS_HOST_DEVICE U32x4 philox4x32_10(U32x4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(M0, ctr.x, &hi0, &lo0);
    mulhilo32(M1, ctr.z, &hi1, &lo1);
    ctr = U32x4{hi1 ^ ctr.y ^ k0, lo1, hi0 ^ ctr.w ^ k1, lo0};
    k0 += W0;
    k1 += W1;
  }
  return ctr;
}

// Four 32-bit draws for (seed, position, purpose, block of four indices).
FS_HOST_DEVICE U32x4 philox_block(uint64_t seed, uint64_t position, uint32_t purpose, uint32_t block) {
  return philox4x32_10(U32x4{block, uint32_t(position), uint32_t(position >> 32), purpose}, uint32_t(seed),
                       uint32_t(seed >> 32));
}

FS_HOST_DEVICE uint32_t lane(const U32x4& r, uint32_t i) { return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w; }

// One 32-bit draw for element `index`: lane index%4 of block index/4.
FS_HOST_DEVICE uint32_t philox_u32(uint64_t seed, uint64_t position, uint32_t purpose, uint32_t index) {
  return lane(philox_block(seed, position, purpose, index >> 2), index & 3u);
}

// Uniform in the open interval (0, 1): (2*(x >> 9) + 1) * 2^-24. Every value
// is exact in fp32, so every implementation converts a draw identically, and
// neither 0 nor 1 can occur (log(u) and log(-log(u)) stay finite).
FS_HOST_DEVICE float uniform_open01(uint32_t x) { return float(((x >> 9) << 1) | 1u) * 5.9604644775390625e-08f; }

// Gumbel noise -log(-log(u)). Adding it to log-weights turns argmax into an
// exponential race: argmax_x log r(x) + g_x samples from norm(r) without the
// normalizer.
FS_HOST_DEVICE float gumbel_from_u32(uint32_t x) { return -logf(-logf(uniform_open01(x))); }

}  // namespace flashspark
