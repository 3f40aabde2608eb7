// Torch-free C++ tests of the shared kernel math (run by ctest): Philox
// known answers, 16-bit conversions, and the CPU verify kernel on exact cases.
#include <cmath>
#include <cstdio>
#include <vector>

#include "flashspark/cpu/parallel.h"
#include "flashspark/cpu/verify.h"
#include "flashspark/philox.h"

using namespace flashspark;

static int failures = 0;
#define EXPECT(cond)                                                \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::printf("FAILED %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      ++failures;                                                   \
    }                                                               \
  } while (0)

static void test_philox_known_answers() {
  const U32x4 a = philox4x32_10(U32x4{0, 0, 0, 0}, 0, 0);
  EXPECT(a.x == 0x6627e8d5u && a.y == 0xe169c58du && a.z == 0xbc57ac4cu && a.w == 0x9b00dbd8u);
  const U32x4 b = philox4x32_10(U32x4{~0u, ~0u, ~0u, ~0u}, ~0u, ~0u);
  EXPECT(b.x == 0x408f276du && b.y == 0x41c83b0eu && b.z == 0xa20bc7c6u && b.w == 0x6d5451fdu);
  const U32x4 c = philox4x32_10(U32x4{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0xa4093822u, 0x299f31d0u);
  EXPECT(c.x == 0xd16cfe09u && c.y == 0x94fdccebu && c.z == 0x5001e420u && c.w == 0x24126ea1u);
  EXPECT(uniform_open01(0u) > 0.f && uniform_open01(~0u) < 1.f);
}

static void test_half_conversions() {
  EXPECT(to_float(float16_t{0x3C00}) == 1.f);
  EXPECT(to_float(float16_t{0xC000}) == -2.f);
  EXPECT(to_float(float16_t{0x0001}) == std::ldexp(1.f, -24));  // smallest subnormal
  EXPECT(std::isinf(to_float(float16_t{0x7C00})));
  EXPECT(std::isnan(to_float(float16_t{0x7E00})));
  EXPECT(to_float(bfloat16_t{0x3F80}) == 1.f);
  EXPECT(to_float(to_bfloat16(3.140625f)) == 3.140625f);
}

static void test_verify_greedy() {
  // Two requests, V = 5: request 0 accepts both drafts and takes the bonus
  // argmax; request 1 is rejected at its first draft.
  const int V = 5;
  std::vector<float> logits = {
      0, 9, 0, 0, 0,  // r0 k0 argmax 1
      0, 0, 0, 9, 0,  // r0 k1 argmax 3
      9, 0, 0, 0, 0,  // r0 bonus argmax 0
      0, 0, 9, 0, 0,  // r1 k0 argmax 2
      0, 0, 0, 0, 9,  // r1 bonus
  };
  std::vector<int32_t> drafts = {1, 3, 4}, cu = {0, 2, 3}, out(2 * 3), acc(2);
  std::vector<float> temp = {0.f, 0.f};
  std::vector<int64_t> seeds = {1, 2}, offsets = {0, 0};
  VerifyParams<float> p;
  p.logits = logits.data();
  p.logits_row_stride = V;
  p.draft_tokens = drafts.data();
  p.cu_num_draft = cu.data();
  p.temperature = temp.data();
  p.seeds = seeds.data();
  p.offsets = offsets.data();
  p.out_tokens = out.data();
  p.out_num_accepted = acc.data();
  p.batch = 2;
  p.vocab = V;
  p.max_spec_len = 2;
  const auto check = [&](int64_t b) { return verify_check_request(p, int32_t(b), 3); };
  EXPECT(first_failure(2, check) == Status::kOk);
  cpu::verify_cpu(p, 3, cpu::OpenMPParallelFor{});
  EXPECT(acc[0] == 2 && out[0] == 1 && out[1] == 3 && out[2] == 0);
  EXPECT(acc[1] == 0 && out[3] == 2 && out[4] == -1 && out[5] == -1);
  drafts[2] = 7;  // out of range: request 1 fails alone, request 0 is unaffected
  EXPECT(first_failure(2, check) == Status::kDraftTokenRange);
  std::vector<int32_t> status(2, -7);
  p.status = status.data();
  cpu::verify_cpu(p, 3, cpu::OpenMPParallelFor{});
  EXPECT(status[0] == 0 && acc[0] == 2 && out[0] == 1 && out[1] == 3 && out[2] == 0);
  EXPECT(status[1] == int32_t(Status::kDraftTokenRange) && acc[1] == -1 && out[3] == -1 && out[4] == -1);
}

int main() {
  test_philox_known_answers();
  test_half_conversions();
  test_verify_greedy();
  if (failures) {
    std::printf("%d failed\n", failures);
    return 1;
  }
  std::printf("all kernel tests passed\n");
  return 0;
}
