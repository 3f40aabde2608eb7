// cuda_on_cpu: flashspark's own layer for running its CUDA kernels on the host, for tests.
//
// Every CUDA thread of a block is a fibre; a seeded scheduler decides which runnable fibre
// goes next (forward, reversed or random order), so a missing barrier changes results.
// __syncthreads() is a real barrier over the block's live threads; warp shuffles, votes and
// __syncwarp are 32-lane rendezvous (every lane of the mask must arrive, or the layer reports
// it). Shared memory is poisoned (0xFF bytes: NaN floats, -1 integers) at block start,
// dynamic shared memory is a guarded allocation of exactly the launch's size, and launches
// are checked against the target GPUs' limits (threads per block, grid dimensions, 48 KB of
// dynamic shared memory unless cudaFuncSetAttribute raised it, 4 KB of parameters).
//
// The kernel headers compile unmodified: translate.py only rewrites the two constructs that
// are not C++ (`k<<<grid, block, smem, stream>>>(args)` and `__shared__` declarations) into
// calls of this runtime. Blocks run one after another; there is no memory model, no real
// concurrency, and device math (expf, logf) is the host's.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- CUDA's vocabulary ----------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __noinline__

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(const uint3& u) : x(u.x), y(u.y), z(u.z) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
};
using cudaError = cudaError_t;
struct CUstream_st;
using cudaStream_t = CUstream_st*;
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

constexpr int warpSize = 32;

// CUDA's integer min / max overloads (device code calls them unqualified).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }

namespace cuda_on_cpu {

// ---- target limits (the stricter of sm_80 and sm_90) ---------------------------------------
constexpr unsigned kMaxThreadsPerBlock = 1024;
constexpr unsigned kMaxBlockDimZ = 64;
constexpr unsigned long long kMaxGridDimX = 2147483647ull;
constexpr unsigned kMaxGridDimYZ = 65535;
constexpr size_t kDefaultDynamicSmem = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kMaxSmemPerBlock = 166912;        // sm_80's opt-in maximum (sm_90: 232448)
constexpr size_t kMaxParamBytes = 4096;

enum class Order { kForward, kReverse, kRandom };

// How the scheduler orders fibres and blocks; set by the tests before a launch.
struct Schedule {
  Order order = Order::kForward;
  uint64_t seed = 0;
};
void set_schedule(Schedule s);
Schedule schedule();

// Problems a GPU would report or that are undefined behaviour there (a launch past a limit,
// a warp collective some lane of the mask never joins, a deadlocked barrier, BlockReduce
// over a block of another size). Tests require this list to stay empty.
const std::vector<std::string>& errors();
void clear_errors();
void report(const std::string& what);

// ---- the running thread ---------------------------------------------------------------------
struct ThreadState {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
  int linear = 0;  // threadIdx in row-major order (x fastest)
};
extern ThreadState* g_current;

// ---- barriers and warp collectives ----------------------------------------------------------
void syncthreads();
// The rendezvous of warp collectives: every lane of `mask` deposits `bytes` of `value` (lanes
// of one collective deposit the same size); when the last one arrives, `combine(lane, values,
// bytes, mask, out)` computes each lane's result from all deposits (values[lane * bytes]).
// Returns once this lane's result is in `out`. Lanes must name the same mask, and every lane
// of it must arrive: otherwise the layer reports the collective.
using WarpCombine = void (*)(int lane, const unsigned char* values, size_t bytes, unsigned mask, unsigned char* out);
void warp_collective(unsigned mask, const void* value, size_t bytes, WarpCombine combine, void* out, size_t out_bytes);

// ---- memory ------------------------------------------------------------------------------
// A device buffer: `bytes` bytes at a 256-byte aligned address (as cudaMalloc gives), followed
// by an inaccessible guard (a PROT_NONE page, or AddressSanitizer's redzone in that build), so
// that an out-of-bounds read faults. Contents start poisoned.
void* device_alloc(size_t bytes);
void device_free(void* p);
inline void copy_to_device(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
inline void copy_to_host(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }
// Kernels run to completion inside their launch: nothing is pending.
inline cudaError_t synchronize() { return cudaSuccess; }

// A __shared__ variable's storage, registered by the first thread of each block to reach it:
// poisoned then, counted against the block's shared-memory limit.
void shared_static(void* p, size_t bytes);
// The block's dynamic shared memory (exactly the launch's bytes, guarded and poisoned).
void* dynamic_shared_bytes();
template <class T>
T* dynamic_shared() {
  return static_cast<T*>(dynamic_shared_bytes());
}
// Poison bytes (0xFF: NaN for floats, -1 for integers).
inline void poison(void* p, size_t bytes) { std::memset(p, 0xFF, bytes); }

// ---- launches -------------------------------------------------------------------------------
struct LaunchConfig {
  dim3 grid, block;
  size_t dynamic_smem = 0;
  const void* kernel = nullptr;
};
// Checks the configuration against the limits; runs `body` for every thread of every block.
cudaError_t run_grid(const LaunchConfig& cfg, size_t param_bytes, const std::function<void()>& body);
void set_last_error(cudaError_t e);
cudaError_t take_last_error();
cudaError_t set_func_attribute(const void* kernel, cudaFuncAttribute attr, int value);

template <class... P>
struct Launch {
  void (*kernel)(P...);
  LaunchConfig cfg;
  template <class... A>
  void operator()(A&&... args) const {
    // Kernel arguments are copied once, as the driver copies them into parameter space.
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    auto k = kernel;
    const cudaError_t e = run_grid(cfg, sizeof(params), [&params, k] { std::apply(k, params); });
    if (e != cudaSuccess) set_last_error(e);
  }
};

template <class... P>
Launch<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem = 0, cudaStream_t = nullptr) {
  return Launch<P...>{kernel, LaunchConfig{grid, block, smem, reinterpret_cast<const void*>(kernel)}};
}

// ---- warp intrinsics ---------------------------------------------------------------------
namespace detail {
int lane_id();
template <class T>
struct ShflDeposit {
  int src;  // the lane this lane reads; -1: its own value (a source outside its segment)
  T value;
};
template <class T>
void shfl_combine(int lane, const unsigned char* values, size_t bytes, unsigned mask, unsigned char* out) {
  ShflDeposit<T> mine, theirs;
  std::memcpy(&mine, values + size_t(lane) * bytes, sizeof(mine));
  const int from = mine.src < 0 ? lane : mine.src;
  if (!(mask >> from & 1u)) {  // reading a lane outside the mask: undefined, poisoned here
    poison(out, sizeof(T));
    return;
  }
  std::memcpy(&theirs, values + size_t(from) * bytes, sizeof(theirs));
  std::memcpy(out, &theirs.value, sizeof(T));
}
}  // namespace detail

template <class T>
T shfl_from(unsigned mask, T var, int src) {
  static_assert(std::is_trivially_copyable_v<T>, "shuffles move trivially copyable values");
  const detail::ShflDeposit<T> d{src, var};
  T out;
  warp_collective(mask, &d, sizeof(d), detail::shfl_combine<T>, &out, sizeof(T));
  return out;
}

unsigned ballot(unsigned mask, bool pred);
void syncwarp(unsigned mask);

}  // namespace cuda_on_cpu

#define threadIdx (::cuda_on_cpu::g_current->thread_idx)
#define blockIdx (::cuda_on_cpu::g_current->block_idx)
#define blockDim (::cuda_on_cpu::g_current->block_dim)
#define gridDim (::cuda_on_cpu::g_current->grid_dim)

inline void __syncthreads() { ::cuda_on_cpu::syncthreads(); }
inline int __syncthreads_count(int pred) {
  // not a primitive of its own here: a ballot per warp would need the block; kernels do not use it
  ::cuda_on_cpu::report("__syncthreads_count is not modelled");
  ::cuda_on_cpu::syncthreads();
  return pred;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::cuda_on_cpu::syncwarp(mask); }
inline unsigned __ballot_sync(unsigned mask, int pred) { return ::cuda_on_cpu::ballot(mask, pred != 0); }
inline int __any_sync(unsigned mask, int pred) { return ::cuda_on_cpu::ballot(mask, pred != 0) != 0; }
inline int __all_sync(unsigned mask, int pred) { return ::cuda_on_cpu::ballot(mask, pred != 0) == mask; }
unsigned __activemask();

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  const int lane = ::cuda_on_cpu::detail::lane_id();
  const int seg = lane & ~(width - 1);
  return ::cuda_on_cpu::shfl_from(mask, var, seg + (src_lane & (width - 1)));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  const int lane = ::cuda_on_cpu::detail::lane_id();
  const int src = lane ^ lane_mask;
  // a source past the end of this lane's segment returns the lane's own value
  return ::cuda_on_cpu::shfl_from(mask, var, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : -1);
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = ::cuda_on_cpu::detail::lane_id();
  const int src = lane + int(delta);
  return ::cuda_on_cpu::shfl_from(mask, var, (src & ~(width - 1)) == (lane & ~(width - 1)) ? src : -1);
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  const int lane = ::cuda_on_cpu::detail::lane_id();
  const int src = lane - int(delta);
  return ::cuda_on_cpu::shfl_from(mask, var, src >= (lane & ~(width - 1)) ? src : -1);
}

// Atomics: a fibre is never pre-empted inside one, so a plain read-modify-write is atomic.
namespace cuda_on_cpu::detail {
template <class T, class F>
T read_modify_write(T* address, const F& f) {
  const T old = *address;
  *address = f(old);
  return old;
}
}  // namespace cuda_on_cpu::detail
template <class T>
T atomicAdd(T* address, T val) {
  return ::cuda_on_cpu::detail::read_modify_write(address, [val](T old) { return T(old + val); });
}
template <class T>
T atomicMax(T* address, T val) {
  return ::cuda_on_cpu::detail::read_modify_write(address, [val](T old) { return old < val ? val : old; });
}
template <class T>
T atomicMin(T* address, T val) {
  return ::cuda_on_cpu::detail::read_modify_write(address, [val](T old) { return val < old ? val : old; });
}
template <class T>
T atomicExch(T* address, T val) {
  return ::cuda_on_cpu::detail::read_modify_write(address, [val](T) { return val; });
}
template <class T>
T atomicCAS(T* address, T compare, T val) {
  return ::cuda_on_cpu::detail::read_modify_write(address, [&](T old) { return old == compare ? val : old; });
}
inline void __threadfence() {}
inline void __threadfence_block() {}

// ---- the runtime API the launchers call ----------------------------------------------------------
inline cudaError_t cudaGetLastError() { return ::cuda_on_cpu::take_last_error(); }
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);
template <class F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  return ::cuda_on_cpu::set_func_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
