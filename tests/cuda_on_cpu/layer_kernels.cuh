// Small CUDA kernels that exercise the cuda_on_cpu layer itself (compare_layer.cpp): written as
// CUDA and translated like the project's kernels.
#pragma once

#include <cuda_runtime.h>
#include <cub/block/block_reduce.cuh>

namespace layer_test {

// out[t] = the value thread t + 1 wrote, read after a barrier (or, with `barrier` off, not).
__global__ void neighbour_kernel(int* out, bool barrier) {
  __shared__ int slots[256];
  const int t = threadIdx.x;
  slots[t] = 10 * t + 1;
  if (barrier) __syncthreads();
  out[blockIdx.x * blockDim.x + t] = slots[(t + 1) % blockDim.x];
}

// The first read of a __shared__ variable in a block, before anyone writes it: poison.
__global__ void poisoned_shared_kernel(int* out) {
  __shared__ int never_written;
  if (threadIdx.x == 0) out[blockIdx.x] = never_written;
}

// Each lane's results of the shuffles and votes, 8 ints per lane.
__global__ void warp_kernel(int* out) {
  const int lane = threadIdx.x % 32;
  int* o = out + threadIdx.x * 8;
  o[0] = __shfl_xor_sync(0xffffffffu, lane * 3, 5);
  o[1] = __shfl_down_sync(0xffffffffu, lane, 4);
  o[2] = __shfl_up_sync(0xffffffffu, lane, 3);
  o[3] = __shfl_sync(0xffffffffu, lane * 7, 9);
  o[4] = __shfl_xor_sync(0xffffffffu, lane, 1, 8);  // within segments of 8 lanes
  o[5] = int(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[6] = __any_sync(0xffffffffu, lane == 17);
  o[7] = __all_sync(0xffffffffu, lane < 31);
}

// A lane that leaves before a shuffle its warp waits on.
__global__ void lane_exits_kernel(int* out) {
  if (threadIdx.x % 32 == 3) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, int(threadIdx.x), 1);
}

template <int kThreads>
__global__ void block_sum_kernel(const float* in, float* out) {
  using Reduce = cub::BlockReduce<float, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  out[threadIdx.x] = Reduce(temp).Sum(in[threadIdx.x]);  // the sum in thread 0, poison elsewhere
}

template <int kThreads>
cudaError_t launch_block_sum(const float* in, float* out, int threads) {
  block_sum_kernel<kThreads><<<1, threads>>>(in, out);
  return cudaGetLastError();
}

__global__ void dynamic_smem_kernel(float* out, int n) {
  extern __shared__ float buffer[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) buffer[i] = float(i);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = buffer[n - 1];
}

inline cudaError_t launch_dynamic_smem(float* out, int n, size_t bytes, bool raise_limit) {
  if (raise_limit) {
    const cudaError_t e =
        cudaFuncSetAttribute(dynamic_smem_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (e != cudaSuccess) return e;
  }
  dynamic_smem_kernel<<<1, 64, bytes>>>(out, n);
  return cudaGetLastError();
}

// Every thread of every block adds its id into one counter and records the value it saw.
__global__ void atomic_kernel(int* counter, int* seen) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  seen[t] = atomicAdd(counter, t + 1);  // every addend positive: every old value distinct
}

__global__ void empty_kernel() {}

inline cudaError_t launch_empty(dim3 grid, dim3 block) {
  empty_kernel<<<grid, block>>>();
  return cudaGetLastError();
}

struct Big {
  char bytes[5000];
};
__global__ void big_param_kernel(Big) {}

inline cudaError_t launch_big_param() {
  big_param_kernel<<<1, 1>>>(Big{});
  return cudaGetLastError();
}

}  // namespace layer_test
