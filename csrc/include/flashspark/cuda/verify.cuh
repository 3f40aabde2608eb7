// CUDA kernel of `verify`: one thread block per request. The block walks the
// request's draft rows in order and stops at the first rejection, so rows
// after it are never read. Each row is reduced with CUB BlockReduce over
// 4-wide vectorized loads; the same driver as the CPU kernel decides.
#pragma once

#include <cub/block/block_reduce.cuh>

#include "flashspark/cuda/common.cuh"
#include "flashspark/cuda/launch.h"
#include "flashspark/verify.h"

namespace flashspark::cuda {

template <class T, int kThreads>
struct VerifyBlockBackend {
  using ArgMaxReduce = cub::BlockReduce<ArgMax, kThreads>;
  using SoftmaxReduce = cub::BlockReduce<SoftmaxState, kThreads>;
  using RaceReduce = cub::BlockReduce<RaceResult, kThreads>;
  struct Shared {
    union {
      typename ArgMaxReduce::TempStorage argmax;
      typename SoftmaxReduce::TempStorage softmax;
      typename RaceReduce::TempStorage race;
    } reduce;
    ArgMax argmax;
    SoftmaxState softmax;
    RaceResult race;
  };

  Shared& sh;
  int64_t vocab;

  __device__ bool leader() const { return threadIdx.x == 0; }

  // Broadcast thread 0's reduced value to the block, leaving the scratch free.
  template <class S>
  __device__ S broadcast(S& slot, const S& value) const {
    if (threadIdx.x == 0) slot = value;
    __syncthreads();
    const S out = slot;
    __syncthreads();
    return out;
  }

  __device__ ArgMax row_argmax(const T* row, bool probs) const {
    const bool vec_ok = aligned4(row);
    ArgMax a = argmax_identity();
    for (int64_t base = 4 * int64_t(threadIdx.x); base < vocab; base += 4 * kThreads) {
      float v[4];
      load4(row, base, vocab, vec_ok, v);
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (base + j < vocab) argmax_add(a, probs ? greedy_prob(v[j]) : greedy_logit(v[j]), int32_t(base + j));
    }
    return broadcast(sh.argmax, ArgMaxReduce(sh.reduce.argmax).Reduce(a, ArgMaxMergeOp{}));
  }

  __device__ SoftmaxState row_softmax(const T* row, float inv_t) const {
    const bool vec_ok = aligned4(row);
    SoftmaxState st = softmax_identity();
    for (int64_t base = 4 * int64_t(threadIdx.x); base < vocab; base += 4 * kThreads) {
      float v[4];
      load4(row, base, vocab, vec_ok, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) softmax_add(st, v[j], inv_t);
    }
    return broadcast(sh.softmax, SoftmaxReduce(sh.reduce.softmax).Reduce(st, SoftmaxMergeOp{inv_t}));
  }

  template <class Add>
  __device__ RaceResult row_race(const T* row, const Add& add, uint64_t seed, uint64_t position) const {
    const bool vec_ok = aligned4(row);
    RaceResult r = race_identity();
    for (int64_t base = 4 * int64_t(threadIdx.x); base < vocab; base += 4 * kThreads) {
      float v[4];
      load4(row, base, vocab, vec_ok, v);
      const U32x4 bits = philox_block(seed, position, kPurposeResample, uint32_t(base >> 2));
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (base + j < vocab) add(r, int32_t(base + j), v[j], lane(bits, uint32_t(j)));
    }
    return broadcast(sh.race, RaceReduce(sh.reduce.race).Reduce(r, RaceMergeOp{}));
  }
};

template <class T, int kThreads>
__global__ void __launch_bounds__(kThreads) verify_kernel(VerifyParams<T> p, int32_t num_tokens) {
  using Backend = VerifyBlockBackend<T, kThreads>;
  __shared__ typename Backend::Shared shared;
  __shared__ Status checked;
  const int32_t b = blockIdx.x;
  // Bad input fails this request alone (status, -1 outputs); the kernel never traps.
  if (threadIdx.x == 0) checked = verify_check_request(p, b, num_tokens);
  int32_t* out = p.out_tokens + int64_t(b) * (p.max_spec_len + 1);
  for (int32_t i = threadIdx.x; i <= p.max_spec_len; i += kThreads) out[i] = -1;
  __syncthreads();
  Backend backend{shared, p.vocab};
  verify_request(p, b, checked, backend);
}

constexpr int kVerifyThreads = 512;

template <class T>
cudaError_t launch_verify(const VerifyParams<T>& p, int32_t num_tokens, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  verify_kernel<T, kVerifyThreads><<<p.batch, kVerifyThreads, 0, stream>>>(p, num_tokens);
  return cudaGetLastError();
}

}  // namespace flashspark::cuda
