// cuda_on_cpu's stand-in for cub::BlockReduce, with CUB's documented contract:
//   - every thread of the block calls Reduce / Sum (BLOCK_DIM_X x BLOCK_DIM_Y x BLOCK_DIM_Z
//     threads, the launch's block size);
//   - the aggregate is returned in thread 0 only: the other threads get a poisoned value
//     (0xFF bytes: NaN floats, -1 integers), so a kernel that reads it elsewhere fails;
//   - TempStorage may be reused only after a __syncthreads(): the stand-in poisons it once
//     thread 0 has read it, so a union member overlapping it does not survive a reduction.
// The algorithm is CUB's default (BLOCK_REDUCE_WARP_REDUCTIONS): a shuffle-down tree within
// each warp (lane i combines lane i + 1, 2, 4, 8, 16), lane 0 of each warp stores its warp's
// aggregate, and after a barrier thread 0 folds the warp aggregates in warp order.
#pragma once

#include <cstring>

#include "cuda_on_cpu/runtime.h"

namespace cub {

struct Sum {
  template <class T>
  T operator()(const T& a, const T& b) const {
    return a + b;
  }
};

enum BlockReduceAlgorithm { BLOCK_REDUCE_RAKING, BLOCK_REDUCE_RAKING_COMMUTATIVE_ONLY, BLOCK_REDUCE_WARP_REDUCTIONS };

template <class T, int BLOCK_DIM_X, BlockReduceAlgorithm ALGORITHM = BLOCK_REDUCE_WARP_REDUCTIONS, int BLOCK_DIM_Y = 1,
          int BLOCK_DIM_Z = 1, int LEGACY_PTX_ARCH = 0>
class BlockReduce {
  static constexpr int kThreads = BLOCK_DIM_X * BLOCK_DIM_Y * BLOCK_DIM_Z;
  static constexpr int kWarps = (kThreads + 31) / 32;

 public:
  struct TempStorage {
    T warp_aggregates[kWarps];
  };

  explicit BlockReduce(TempStorage& temp) : temp_(temp) {
    const unsigned n = blockDim.x * blockDim.y * blockDim.z;
    if (n != unsigned(kThreads))
      ::cuda_on_cpu::report("cub::BlockReduce for " + std::to_string(kThreads) + " threads in a block of " +
                            std::to_string(n));
  }

  template <class Op>
  T Reduce(T input, Op op) {
    return reduce(input, op, kThreads);
  }
  template <class Op>
  T Reduce(T input, Op op, int num_valid) {
    return reduce(input, op, num_valid);
  }
  T Sum(T input) { return reduce(input, ::cub::Sum{}, kThreads); }
  T Sum(T input, int num_valid) { return reduce(input, ::cub::Sum{}, num_valid); }

 private:
  TempStorage& temp_;

  static T poisoned() {
    T t;
    ::cuda_on_cpu::poison(&t, sizeof(T));
    return t;
  }

  template <class Op>
  T reduce(T x, Op op, int num_valid) {
    const int linear = ::cuda_on_cpu::g_current->linear;
    const int lane = linear % 32, warp = linear / 32;
    const int warp_valid = num_valid - warp * 32;  // lanes of this warp holding inputs
    for (int offset = 1; offset < 32; offset *= 2) {
      const T peer = __shfl_down_sync(0xffffffffu, x, offset);
      if (lane + offset < warp_valid && lane + offset < 32) x = op(x, peer);
    }
    if (lane == 0 && warp_valid > 0) temp_.warp_aggregates[warp] = x;
    __syncthreads();
    if (linear != 0) return poisoned();
    T aggregate = temp_.warp_aggregates[0];
    for (int w = 1; w < kWarps && w * 32 < num_valid; ++w) aggregate = op(aggregate, temp_.warp_aggregates[w]);
    ::cuda_on_cpu::poison(&temp_, sizeof(temp_));
    return aggregate;
  }
};

}  // namespace cub
