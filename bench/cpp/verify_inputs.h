// Host-side input generation shared by the CPU and CUDA microbenchmarks of
// `verify`: a ragged batch whose drafts are close to the target, so that
// acceptance is mixed as in real decoding. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "flashspark/verify.h"

namespace flashspark::bench {

struct VerifyInputs {
  int32_t batch, gamma, vocab;
  std::vector<float> logits;          // [(gamma + 1) * batch, vocab]
  std::vector<int32_t> draft_tokens;  // [gamma * batch]
  std::vector<int32_t> cu_num_draft;  // [batch + 1]
  std::vector<float> temperature;
  std::vector<int64_t> seeds, offsets;
};

inline VerifyInputs make_verify_inputs(int32_t batch, int32_t gamma, int32_t vocab, uint64_t seed = 0) {
  VerifyInputs in{batch, gamma, vocab, {}, {}, {}, {}, {}, {}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 3.f);
  in.logits.resize(size_t(batch) * (gamma + 1) * vocab);
  for (float& x : in.logits) x = normal(rng);
  in.cu_num_draft.resize(batch + 1);
  for (int32_t b = 0; b <= batch; ++b) in.cu_num_draft[b] = b * gamma;
  // Draft = the target's argmax most of the time, another token otherwise.
  std::uniform_real_distribution<float> coin(0.f, 1.f);
  std::uniform_int_distribution<int32_t> any(0, vocab - 1);
  for (int32_t b = 0; b < batch; ++b)
    for (int32_t k = 0; k < gamma; ++k) {
      const float* row = in.logits.data() + (size_t(b) * (gamma + 1) + k) * vocab;
      int32_t best = 0;
      for (int32_t v = 1; v < vocab; ++v)
        if (row[v] > row[best]) best = v;
      in.draft_tokens.push_back(coin(rng) < 0.8f ? best : any(rng));
    }
  in.temperature.assign(batch, 1.f);
  for (int32_t b = 0; b < batch; ++b) {
    in.seeds.push_back(int64_t(b) + 1);
    in.offsets.push_back(0);
  }
  return in;
}

// The logits in the kernel's storage type (fp32 or bf16).
template <class T>
std::vector<T> logits_as(const std::vector<float>& logits) {
  std::vector<T> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = from_float<T>(logits[i]);
  return out;
}

// Bytes the CUDA kernel reads (bench/verify_roofline.py has the same model): every row of
// the batch once (phase 1), then each racing request's stop row again (phase 2; greedy
// requests race nothing).
inline double verify_bytes(int32_t batch, int32_t gamma, int32_t vocab, size_t elem_bytes, int32_t races) {
  return (double(batch) * (gamma + 1) + races) * vocab * double(elem_bytes);
}

// Bytes the CPU kernel reads: the rows each walk reaches (up to its stop row), then each racing
// request's stop row again.
inline double verify_walked_bytes(const std::vector<int32_t>& num_accepted, int32_t vocab, size_t elem_bytes,
                                  int32_t races) {
  double rows = races;
  for (int32_t a : num_accepted) rows += a + 1;
  return rows * vocab * double(elem_bytes);
}

}  // namespace flashspark::bench
