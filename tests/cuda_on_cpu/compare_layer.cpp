// The cuda_on_cpu layer's own contract: barriers that order threads (and a missing one that
// shows), shared memory poisoned at block start, 32-lane shuffles and votes with CUDA's
// results, a lane leaving before a collective reported, CUB's thread-0-only aggregate, the
// launch limits of the target GPUs, and device buffers whose end faults.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>

#include "compare.h"
#include "layer_kernels.cuh"

using coc_test::DeviceArray;
using cuda_on_cpu::Order;

namespace {

void test_barrier_orders_threads() {
  coc_test::g_case = "barrier";
  bool missing_barrier_seen = false;
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    DeviceArray<int> out{size_t(2 * 96)};
    coc_test::expect_clean_launch([&] {
      layer_test::neighbour_kernel<<<2, 96>>>(out.ptr, true);
      return cudaGetLastError();
    });
    const std::vector<int> got = out.host();
    for (int i = 0; i < 2 * 96; ++i) COC_EXPECT(got[i] == 10 * ((i % 96 + 1) % 96) + 1, "thread %d read %d", i, got[i]);
    // Without the barrier some thread reads its neighbour's slot before it is written (poison).
    DeviceArray<int> racy{size_t(2 * 96)};
    layer_test::neighbour_kernel<<<2, 96>>>(racy.ptr, false);
    for (int v : racy.host()) missing_barrier_seen |= v == -1;
  }
  COC_EXPECT(missing_barrier_seen, "a missing __syncthreads() changed no result under any schedule");
}

void test_shared_memory_is_poisoned_per_block() {
  coc_test::g_case = "shared poison";
  DeviceArray<int> out{size_t(3)};
  coc_test::expect_clean_launch([&] {
    layer_test::poisoned_shared_kernel<<<3, 32>>>(out.ptr);
    return cudaGetLastError();
  });
  for (int v : out.host()) COC_EXPECT(v == -1, "unwritten shared int read %d", v);
}

void test_warp_collectives() {
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = std::string("warp ") + coc_test::order_name(sched.order);
    DeviceArray<int> out{size_t(64 * 8)};
    coc_test::expect_clean_launch([&] {
      layer_test::warp_kernel<<<1, 64>>>(out.ptr);
      return cudaGetLastError();
    });
    const std::vector<int> o = out.host();
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l)
      if (l % 3 == 0) ballot |= 1u << l;
    for (int t = 0; t < 64; ++t) {
      const int lane = t % 32;
      const int* r = o.data() + t * 8;
      COC_EXPECT(r[0] == (lane ^ 5) * 3, "xor lane %d: %d", lane, r[0]);
      COC_EXPECT(r[1] == (lane + 4 < 32 ? lane + 4 : lane), "down lane %d: %d", lane, r[1]);
      COC_EXPECT(r[2] == (lane >= 3 ? lane - 3 : lane), "up lane %d: %d", lane, r[2]);
      COC_EXPECT(r[3] == 63, "idx lane %d: %d", lane, r[3]);
      COC_EXPECT(r[4] == (lane ^ 1), "xor width 8 lane %d: %d", lane, r[4]);
      COC_EXPECT(unsigned(r[5]) == ballot, "ballot lane %d: %x", lane, unsigned(r[5]));
      COC_EXPECT(r[6] == 1 && r[7] == 0, "any / all lane %d: %d %d", lane, r[6], r[7]);
    }
  }
  coc_test::g_case = "lane exits";
  cuda_on_cpu::set_schedule({});
  cuda_on_cpu::clear_errors();
  DeviceArray<int> out{size_t(32)};
  layer_test::lane_exits_kernel<<<1, 32>>>(out.ptr);
  const cudaError_t e = cudaGetLastError();
  COC_EXPECT(!cuda_on_cpu::errors().empty(), "a lane leaving before a shuffle went unreported");
  COC_EXPECT(e == cudaErrorLaunchFailure, "the launch returned %d", int(e));
  cuda_on_cpu::clear_errors();
}

void test_block_reduce_contract() {
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = std::string("BlockReduce ") + coc_test::order_name(sched.order);
    std::vector<float> in(128);
    for (int i = 0; i < 128; ++i) in[i] = float(i + 1);
    DeviceArray<float> d_in(in), out{size_t(128)};
    coc_test::expect_clean_launch([&] { return layer_test::launch_block_sum<128>(d_in.ptr, out.ptr, 128); });
    const std::vector<float> o = out.host();
    COC_EXPECT(o[0] == 128.f * 129.f / 2.f, "thread 0 sum %g", double(o[0]));
    for (int t = 1; t < 128; ++t) COC_EXPECT(std::isnan(o[t]), "thread %d got %g, not poison", t, double(o[t]));
  }
  coc_test::g_case = "BlockReduce size";
  cuda_on_cpu::clear_errors();
  std::vector<float> in(96, 1.f);
  DeviceArray<float> d_in(in), out{size_t(96)};
  layer_test::launch_block_sum<128>(d_in.ptr, out.ptr, 96);  // a 128-thread reduction in a 96-thread block
  COC_EXPECT(!cuda_on_cpu::errors().empty(), "BlockReduce over a block of the wrong size went unreported");
  cuda_on_cpu::clear_errors();
}

void test_atomics() {
  for (const auto& sched : coc_test::schedules()) {
    cuda_on_cpu::set_schedule(sched);
    coc_test::g_case = std::string("atomics ") + coc_test::order_name(sched.order);
    DeviceArray<int> counter(std::vector<int>{0}), seen{size_t(3 * 64)};
    coc_test::expect_clean_launch([&] {
      layer_test::atomic_kernel<<<3, 64>>>(counter.ptr, seen.ptr);
      return cudaGetLastError();
    });
    COC_EXPECT(counter.host()[0] == 192 * 193 / 2, "sum %d", counter.host()[0]);
    std::vector<int> s = seen.host();
    std::sort(s.begin(), s.end());
    COC_EXPECT(std::adjacent_find(s.begin(), s.end()) == s.end(), "two threads saw the same old value");
  }
}

void expect_refused(cudaError_t got, cudaError_t want, const char* what) {
  COC_EXPECT(got == want, "%s: launch returned %d, want %d", what, int(got), int(want));
  COC_EXPECT(!cuda_on_cpu::errors().empty(), "%s: no report", what);
  cuda_on_cpu::clear_errors();
}

void test_launch_limits() {
  coc_test::g_case = "launch limits";
  cuda_on_cpu::set_schedule({});
  cuda_on_cpu::clear_errors();
  coc_test::expect_clean_launch([] { return layer_test::launch_empty(dim3(3, 2, 1), dim3(1024)); });
  expect_refused(layer_test::launch_empty(1, 1025), cudaErrorInvalidConfiguration, "1025 threads");
  expect_refused(layer_test::launch_empty(1, dim3(8, 8, 65)), cudaErrorInvalidConfiguration, "blockDim.z 65");
  expect_refused(layer_test::launch_empty(dim3(1, 65536), 32), cudaErrorInvalidConfiguration, "gridDim.y 65536");
  expect_refused(layer_test::launch_empty(0, 32), cudaErrorInvalidConfiguration, "an empty grid");
  expect_refused(layer_test::launch_big_param(), cudaErrorInvalidValue, "5000 bytes of parameters");
  // 48 KB of dynamic shared memory by default; more only after cudaFuncSetAttribute
  DeviceArray<float> out{size_t(1)};
  coc_test::expect_clean_launch([&] { return layer_test::launch_dynamic_smem(out.ptr, 12288, 49152, false); });
  COC_EXPECT(out.host()[0] == 12287.f, "dynamic shared memory read back %g", double(out.host()[0]));
  expect_refused(layer_test::launch_dynamic_smem(out.ptr, 12289, 49156, false), cudaErrorInvalidValue,
                 "48 KB + 4 without the attribute");
  coc_test::expect_clean_launch([&] { return layer_test::launch_dynamic_smem(out.ptr, 20000, 80000, true); });
  COC_EXPECT(out.host()[0] == 19999.f, "raised dynamic shared memory read back %g", double(out.host()[0]));
  COC_EXPECT(layer_test::launch_dynamic_smem(out.ptr, 1, 300000, true) == cudaErrorInvalidValue,
             "an attribute past the GPU's opt-in maximum was accepted");
  cuda_on_cpu::clear_errors();
}

// A read past a device buffer's end faults: in a child process, which must die.
void test_device_buffer_end_faults() {
  coc_test::g_case = "guard";
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    auto* p = static_cast<volatile float*>(cuda_on_cpu::device_alloc(64 * sizeof(float)));
    const float x = p[64];  // one past the end
    std::printf("read past the end: %g\n", double(x));
    _exit(0);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  COC_EXPECT(!(WIFEXITED(status) && WEXITSTATUS(status) == 0), "a read one past a device buffer did not fault");
}

}  // namespace

int main() {
  test_barrier_orders_threads();
  test_shared_memory_is_poisoned_per_block();
  test_warp_collectives();
  test_block_reduce_contract();
  test_atomics();
  test_launch_limits();
  test_device_buffer_end_faults();
  return coc_test::finish("layer");
}
