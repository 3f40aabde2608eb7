// CUDA-only helpers shared by the flashspark kernels. Torch-free.
#pragma once

#include <cstdio>

#include <cuda_runtime.h>

#include "flashspark/common.h"

namespace flashspark::cuda {

// Loads four consecutive row entries [base, base+4) widened to fp32, with -inf
// past the end of the row. `vec_ok` says the row start is aligned to four
// elements, so one 16-byte (fp32) or 8-byte (16-bit) load serves all four.
template <class T>
__device__ __forceinline__ void load4(const T* row, int64_t base, int64_t n, bool vec_ok, float v[4]) {
  if (vec_ok && base + 4 <= n) {
    if constexpr (sizeof(T) == 4) {
      const float4 f = *reinterpret_cast<const float4*>(row + base);
      v[0] = f.x;
      v[1] = f.y;
      v[2] = f.z;
      v[3] = f.w;
    } else {
      const uint2 u = *reinterpret_cast<const uint2*>(row + base);
      v[0] = to_float(T{uint16_t(u.x & 0xFFFFu)});
      v[1] = to_float(T{uint16_t(u.x >> 16)});
      v[2] = to_float(T{uint16_t(u.y & 0xFFFFu)});
      v[3] = to_float(T{uint16_t(u.y >> 16)});
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = base + j < n ? to_float(row[base + j]) : kNegInf;
}

template <class T>
__device__ __forceinline__ bool aligned4(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) % (4 * sizeof(T))) == 0;
}

}  // namespace flashspark::cuda

namespace flashspark::cuda {

// Warp-wide all-reduce (every lane gets the result), for reductions a warp
// repeats per row inside a tile loop, where a CUB WarpReduce plus a broadcast
// would cost more.
__device__ __forceinline__ float warp_allreduce_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_allreduce_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

}  // namespace flashspark::cuda
