// cuda_on_cpu's runtime: fibres, the seeded scheduler, barriers, warp rendezvous, shared and
// device memory, launch checks. See include/cuda_on_cpu/runtime.h.
#include "cuda_on_cpu/runtime.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>

#if defined(__SANITIZE_ADDRESS__)
#define COC_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COC_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define COC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COC_TSAN 1
#endif
#endif

#if defined(COC_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(COC_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

// ---- context switch --------------------------------------------------------------------------
// On x86-64 a fibre switch saves the callee-saved registers and the FP control words on the old
// stack and pops them off the new one (ucontext's swapcontext makes a signal-mask system call on
// every switch, which dominated the run time); elsewhere it is swapcontext.
#if defined(__x86_64__)
extern "C" void coc_switch_stack(void** save_sp, void* new_sp);
asm(R"(
  .text
  .globl coc_switch_stack
  .type coc_switch_stack, @function
coc_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size coc_switch_stack, .-coc_switch_stack
  .section .note.GNU-stack,"",@progbits
  .text
)");
#endif

namespace cuda_on_cpu {

ThreadState* g_current = nullptr;

namespace {

struct Context {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

void context_switch(Context& from, Context& to) {
#if defined(__x86_64__)
  coc_switch_stack(&from.sp, to.sp);
#else
  swapcontext(&from.uc, &to.uc);
#endif
}

// A context that starts `entry` (which never returns) on the given stack.
void context_make(Context& c, void* stack, size_t bytes, void (*entry)()) {
#if defined(COC_ASAN)
  __asan_unpoison_memory_region(stack, bytes);  // a reused stack keeps its last fibre's frames' poison
#endif
#if defined(__x86_64__)
  auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15));
  uint64_t* sp = top - 11;  // [fp control words][r15 r14 r13 r12 rbx rbp][ret: entry][0][pad]
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  std::memcpy(sp, &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpucw, 2);
  for (int i = 1; i <= 6; ++i) sp[i] = 0;
  sp[7] = reinterpret_cast<uint64_t>(entry);  // 16-byte aligned slot: entry starts as if called
  sp[8] = 0;
  c.sp = sp;
#else
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
#endif
}

}  // namespace

namespace {

#if defined(COC_ASAN) || defined(COC_TSAN)
constexpr size_t kStackBytes = 1 << 20;  // sanitizers' frames are larger
#else
constexpr size_t kStackBytes = 128 << 10;
#endif

Schedule g_schedule;
std::vector<std::string> g_errors;
cudaError_t g_last_error = cudaSuccess;
std::map<const void*, int> g_max_dynamic_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize per kernel

enum class FiberState { kReady, kBarrier, kWarp, kDone };

struct Fiber {
  ThreadState ts;
  Context ctx;
  void* stack = nullptr;
  FiberState state = FiberState::kReady;
  bool started = false;
  std::vector<unsigned char> result;  // this lane's result of the last warp collective
#if defined(COC_ASAN)
  void* fake_stack = nullptr;
#endif
#if defined(COC_TSAN)
  void* tsan_fiber = nullptr;
#endif
};

struct Warp {
  unsigned mask = 0, arrived = 0;  // the collective in progress (mask 0: none)
  size_t bytes = 0, out_bytes = 0;
  WarpCombine combine = nullptr;
  std::vector<unsigned char> values;  // 32 deposits of `bytes`
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<uint64_t> ready;  // bitset over fibres
  int live = 0, at_barrier = 0;
  std::vector<const void*> shared_seen;
  size_t static_smem = 0, smem_limit = 0;
  void* dynamic_smem = nullptr;
  size_t dynamic_bytes = 0;
  const LaunchConfig* cfg = nullptr;
  const std::function<void()>* body = nullptr;
  Context scheduler;
  std::mt19937_64 rng;
  bool abandoned = false;
#if defined(COC_ASAN)
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
#endif
#if defined(COC_TSAN)
  void* scheduler_fiber = nullptr;
  char barrier_token = 0;
#endif
};

Block* g_block = nullptr;
Fiber* g_fiber = nullptr;
std::vector<void*> g_stack_pool;

void* take_stack() {
  if (!g_stack_pool.empty()) {
    void* s = g_stack_pool.back();
    g_stack_pool.pop_back();
    return s;
  }
  void* s = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (s == MAP_FAILED) {
    std::perror("cuda_on_cpu: fibre stack");
    std::abort();
  }
  return s;
}

void set_ready(Block& b, int i, bool on) {
  if (on)
    b.ready[i / 64] |= uint64_t(1) << (i % 64);
  else
    b.ready[i / 64] &= ~(uint64_t(1) << (i % 64));
}

int pick_ready(Block& b) {
  const int words = int(b.ready.size());
  switch (g_schedule.order) {
    case Order::kForward:
      for (int w = 0; w < words; ++w)
        if (b.ready[w]) return w * 64 + __builtin_ctzll(b.ready[w]);
      return -1;
    case Order::kReverse:
      for (int w = words - 1; w >= 0; --w)
        if (b.ready[w]) return w * 64 + 63 - __builtin_clzll(b.ready[w]);
      return -1;
    case Order::kRandom: {
      int count = 0;
      for (int w = 0; w < words; ++w) count += __builtin_popcountll(b.ready[w]);
      if (count == 0) return -1;
      int k = int(b.rng() % uint64_t(count));
      for (int w = 0; w < words; ++w) {
        const int c = __builtin_popcountll(b.ready[w]);
        if (k >= c) {
          k -= c;
          continue;
        }
        uint64_t bits = b.ready[w];
        for (; k > 0; --k) bits &= bits - 1;
        return w * 64 + __builtin_ctzll(bits);
      }
      return -1;
    }
  }
  return -1;
}

// Fibre -> scheduler. `exiting`: the fibre is done and its stack may be reused.
void switch_to_scheduler(bool exiting) {
  Block& b = *g_block;
  Fiber* f = g_fiber;
#if defined(COC_ASAN)
  __sanitizer_start_switch_fiber(exiting ? nullptr : &f->fake_stack, b.scheduler_stack, b.scheduler_stack_size);
#endif
#if defined(COC_TSAN)
  // Leaving for good publishes the fibre's writes (the host reads them after the launch);
  // otherwise no happens-before is implied: only barriers and collectives order threads.
  __tsan_switch_to_fiber(b.scheduler_fiber, exiting ? 0 : __tsan_switch_to_fiber_no_sync);
#endif
  context_switch(f->ctx, b.scheduler);
#if defined(COC_ASAN)
  __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
  (void)exiting;
}

void fiber_main() {
  Block& b = *g_block;
  Fiber* f = g_fiber;
#if defined(COC_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &b.scheduler_stack, &b.scheduler_stack_size);
#endif
  (*b.body)();
  f->state = FiberState::kDone;
  --b.live;
  const int lane = f->ts.linear % 32;
  const Warp& w = b.warps[f->ts.linear / 32];
  if (w.mask >> lane & 1u && !(w.arrived >> lane & 1u))
    report("thread " + std::to_string(f->ts.linear) + " exited before joining its warp's pending collective");
  switch_to_scheduler(true);
}

void run_block(Block& b) {
  const int n = int(b.fibers.size());
  b.live = n;
  b.at_barrier = 0;
  b.ready.assign(size_t((n + 63) / 64), 0);
  for (int i = 0; i < n; ++i) set_ready(b, i, true);
  while (true) {
    int i = pick_ready(b);
    if (i < 0) {
      if (b.live == 0) break;
      if (b.at_barrier == b.live) {  // every live thread is at __syncthreads(): release them
        for (int j = 0; j < n; ++j)
          if (b.fibers[j].state == FiberState::kBarrier) {
            b.fibers[j].state = FiberState::kReady;
            set_ready(b, j, true);
          }
        b.at_barrier = 0;
        continue;
      }
      std::string who;
      int barrier = 0, warp = 0;
      for (int j = 0; j < n; ++j) {
        barrier += b.fibers[j].state == FiberState::kBarrier;
        warp += b.fibers[j].state == FiberState::kWarp;
      }
      report("deadlock in block (" + std::to_string(b.fibers[0].ts.block_idx.x) + ", " +
             std::to_string(b.fibers[0].ts.block_idx.y) + ", " + std::to_string(b.fibers[0].ts.block_idx.z) +
             "): " + std::to_string(barrier) + " threads at __syncthreads, " + std::to_string(warp) +
             " at a warp collective that a lane never joins");
      b.abandoned = true;
      break;
    }
    Fiber& f = b.fibers[i];
    set_ready(b, i, false);
    g_fiber = &f;
    g_current = &f.ts;
    if (!f.started) {
      f.started = true;
      f.stack = take_stack();
      context_make(f.ctx, f.stack, kStackBytes, fiber_main);
#if defined(COC_TSAN)
      f.tsan_fiber = __tsan_create_fiber(0);
#endif
    }
#if defined(COC_ASAN)
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
#if defined(COC_TSAN)
    __tsan_switch_to_fiber(f.tsan_fiber, 0);
#endif
    context_switch(b.scheduler, f.ctx);
#if defined(COC_ASAN)
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    g_current = nullptr;
  }
  for (Fiber& f : b.fibers) {
    if (f.stack && (f.state == FiberState::kDone || b.abandoned)) g_stack_pool.push_back(f.stack);
#if defined(COC_TSAN)
    if (f.tsan_fiber) __tsan_destroy_fiber(f.tsan_fiber);
#endif
  }
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

struct Allocation {
  void* base;
  size_t length;
};
std::map<void*, Allocation> g_allocations;

}  // namespace

void set_schedule(Schedule s) { g_schedule = s; }
Schedule schedule() { return g_schedule; }
const std::vector<std::string>& errors() { return g_errors; }
void clear_errors() { g_errors.clear(); }
void report(const std::string& what) {
  if (g_errors.size() < 64) g_errors.push_back(what);
}

int detail::lane_id() { return g_current->linear % 32; }

void syncthreads() {
  Block& b = *g_block;
#if defined(COC_TSAN)
  __tsan_release(&b.barrier_token);
#endif
  g_fiber->state = FiberState::kBarrier;
  ++b.at_barrier;
  switch_to_scheduler(false);
#if defined(COC_TSAN)
  __tsan_acquire(&b.barrier_token);
#endif
}

void warp_collective(unsigned mask, const void* value, size_t bytes, WarpCombine combine, void* out, size_t out_bytes) {
  Block& b = *g_block;
  Fiber& self = *g_fiber;
  const int lane = self.ts.linear % 32;
  const int warp_index = self.ts.linear / 32;
  Warp& w = b.warps[warp_index];
  const int warp_base = warp_index * 32;
  const int lanes_in_warp = std::min<int>(32, int(b.fibers.size()) - warp_base);
  const unsigned existing = lanes_in_warp == 32 ? 0xffffffffu : ((1u << lanes_in_warp) - 1u);
  if (!(mask >> lane & 1u)) report("a warp collective called by lane " + std::to_string(lane) + " outside its mask");
  if (mask & ~existing) report("a warp collective's mask names lanes the block does not have");
  if (w.mask == 0) {
    w.mask = mask;
    w.arrived = 0;
    w.bytes = bytes;
    w.out_bytes = out_bytes;
    w.combine = combine;
    w.values.assign(32 * bytes, 0xFF);
  } else if (w.mask != mask || w.bytes != bytes || w.combine != combine) {
    report("lanes of warp " + std::to_string(warp_index) + " meet at different warp collectives (divergence)");
  }
  std::memcpy(w.values.data() + size_t(lane) * bytes, value, bytes);
  w.arrived |= 1u << lane;
#if defined(COC_TSAN)
  __tsan_release(&w);
#endif
  if ((w.arrived & w.mask) == w.mask) {  // the last lane: every lane's result, then release them
    for (int l = 0; l < 32; ++l) {
      if (!(w.mask >> l & 1u)) continue;
      Fiber& f = b.fibers[warp_base + l];
      f.result.resize(out_bytes);
      w.combine(l, w.values.data(), w.bytes, w.mask, f.result.data());
      if (l != lane) {
        f.state = FiberState::kReady;
        set_ready(b, warp_base + l, true);
      }
    }
    w.mask = 0;
    self.state = FiberState::kReady;
    set_ready(b, warp_base + lane, true);  // yield anyway: the schedule decides who goes on
  } else {
    self.state = FiberState::kWarp;
  }
  switch_to_scheduler(false);
#if defined(COC_TSAN)
  __tsan_acquire(&w);
#endif
  if (out_bytes) std::memcpy(out, self.result.data(), out_bytes);  // __syncwarp returns nothing
}

namespace {
void ballot_combine(int, const unsigned char* values, size_t, unsigned mask, unsigned char* out) {
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l)
    if (mask >> l & 1u && values[l]) bits |= 1u << l;
  std::memcpy(out, &bits, sizeof(bits));
}
void nothing_combine(int, const unsigned char*, size_t, unsigned, unsigned char*) {}
}  // namespace

unsigned ballot(unsigned mask, bool pred) {
  const unsigned char v = pred ? 1 : 0;
  unsigned out = 0;
  warp_collective(mask, &v, 1, ballot_combine, &out, sizeof(out));
  return out;
}

void syncwarp(unsigned mask) {
  unsigned char v = 0;
  warp_collective(mask, &v, 1, nothing_combine, &v, 0);
}

void* device_alloc(size_t bytes) {
#if defined(COC_ASAN)
  void* p = nullptr;
  if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) std::abort();  // ASan's redzone follows the exact size
  poison(p, bytes);
  g_allocations[p] = {p, 0};
  return p;
#else
  // The buffer ends within 16 bytes of a PROT_NONE page (16-byte alignment is what vector
  // loads need), so a read past its end faults.
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t body = round_up(bytes, 16);
  const size_t length = round_up(body, page) + page;
  char* base = static_cast<char*>(mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (base == MAP_FAILED) std::abort();
  char* guard = base + length - page;
  mprotect(guard, page, PROT_NONE);
  char* p = guard - body;
  poison(p, body);
  g_allocations[p] = {base, length};
  return p;
#endif
}

void device_free(void* p) {
  if (!p) return;
  const auto it = g_allocations.find(p);
  if (it == g_allocations.end()) {
    report("device_free of a pointer device_alloc did not return");
    return;
  }
#if defined(COC_ASAN)
  std::free(p);
#else
  munmap(it->second.base, it->second.length);
#endif
  g_allocations.erase(it);
}

void shared_static(void* p, size_t bytes) {
  Block& b = *g_block;
  for (const void* q : b.shared_seen)
    if (q == p) return;
  b.shared_seen.push_back(p);
  poison(p, bytes);
  b.static_smem += bytes;
  if (b.static_smem > kDefaultDynamicSmem)
    report("static __shared__ memory of " + std::to_string(b.static_smem) + " bytes exceeds 48 KB");
  if (b.static_smem + b.dynamic_bytes > b.smem_limit)
    report("shared memory of " + std::to_string(b.static_smem + b.dynamic_bytes) + " bytes (static " +
           std::to_string(b.static_smem) + ") exceeds the block's limit of " + std::to_string(b.smem_limit));
}

void* dynamic_shared_bytes() { return g_block->dynamic_smem; }

void set_last_error(cudaError_t e) {
  if (g_last_error == cudaSuccess) g_last_error = e;
}
cudaError_t take_last_error() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

cudaError_t set_func_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || size_t(value) > kMaxSmemPerBlock) return cudaErrorInvalidValue;
  g_max_dynamic_smem[kernel] = value;
  return cudaSuccess;
}

cudaError_t run_grid(const LaunchConfig& cfg, size_t param_bytes, const std::function<void()>& body) {
  const dim3 g = cfg.grid, bd = cfg.block;
  const unsigned long long threads = 1ull * bd.x * bd.y * bd.z;
  auto fail = [&](cudaError_t e, const std::string& why) {
    report("launch refused: " + why);
    return e;
  };
  if (bd.x == 0 || bd.y == 0 || bd.z == 0 || bd.x > kMaxThreadsPerBlock || bd.y > kMaxThreadsPerBlock ||
      bd.z > kMaxBlockDimZ || threads > kMaxThreadsPerBlock)
    return fail(cudaErrorInvalidConfiguration, "block (" + std::to_string(bd.x) + ", " + std::to_string(bd.y) + ", " +
                                                   std::to_string(bd.z) + ") past the threads-per-block limits");
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > kMaxGridDimX || g.y > kMaxGridDimYZ || g.z > kMaxGridDimYZ)
    return fail(cudaErrorInvalidConfiguration, "grid (" + std::to_string(g.x) + ", " + std::to_string(g.y) + ", " +
                                                   std::to_string(g.z) + ") past the grid limits");
  const auto attr = g_max_dynamic_smem.find(cfg.kernel);
  const size_t dyn_limit = attr == g_max_dynamic_smem.end() ? kDefaultDynamicSmem : size_t(attr->second);
  if (cfg.dynamic_smem > dyn_limit)
    return fail(cudaErrorInvalidValue, std::to_string(cfg.dynamic_smem) + " bytes of dynamic shared memory over " +
                                           "the kernel's limit of " + std::to_string(dyn_limit));
  if (param_bytes > kMaxParamBytes)
    return fail(cudaErrorInvalidValue, std::to_string(param_bytes) + " bytes of kernel parameters");

  // Blocks in the schedule's order too (their results must not depend on it).
  std::vector<unsigned long long> order(size_t(1ull * g.x * g.y * g.z));
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::mt19937_64 rng(g_schedule.seed * 0x9E3779B97F4A7C15ull + 1);
  if (g_schedule.order == Order::kReverse) std::reverse(order.begin(), order.end());
  if (g_schedule.order == Order::kRandom) std::shuffle(order.begin(), order.end(), rng);

  const int n = int(threads);
  for (unsigned long long id : order) {
    Block b;
    b.cfg = &cfg;
    b.body = &body;
    b.rng.seed(rng());
    b.fibers.resize(size_t(n));
    b.warps.resize(size_t((n + 31) / 32));
    b.smem_limit = attr == g_max_dynamic_smem.end() ? kDefaultDynamicSmem : kMaxSmemPerBlock;
    b.dynamic_bytes = cfg.dynamic_smem;
    b.dynamic_smem = device_alloc(cfg.dynamic_smem);
    const uint3 bi{unsigned(id % g.x), unsigned(id / g.x % g.y), unsigned(id / (1ull * g.x * g.y))};
    for (int t = 0; t < n; ++t) {
      ThreadState& ts = b.fibers[size_t(t)].ts;
      ts.thread_idx = uint3{unsigned(t) % bd.x, unsigned(t) / bd.x % bd.y, unsigned(t) / (bd.x * bd.y)};
      ts.block_idx = bi;
      ts.block_dim = bd;
      ts.grid_dim = g;
      ts.linear = t;
    }
#if defined(COC_TSAN)
    b.scheduler_fiber = __tsan_get_current_fiber();
#endif
    g_block = &b;
    run_block(b);
    g_block = nullptr;
    device_free(b.dynamic_smem);
    if (b.abandoned) return cudaErrorLaunchFailure;
  }
  return cudaSuccess;
}

}  // namespace cuda_on_cpu

// Every lane of a warp is reported active: the layer does not track divergence between collectives.
unsigned __activemask() { return 0xffffffffu; }

cudaError_t cudaPeekAtLastError() {
  const cudaError_t e = ::cuda_on_cpu::take_last_error();
  ::cuda_on_cpu::set_last_error(e);
  return e;
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    default:
      return "unknown error";
  }
}
