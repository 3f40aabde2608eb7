// Deterministic chunked reductions over a vocabulary row on the CPU. Chunks
// have a fixed size, independent of the thread count, and partials are merged
// in chunk order, so results never depend on how many threads ran.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "flashspark/common.h"

namespace flashspark::cpu {

// Multiple of 4 so that a chunk starts on a Philox block boundary; large
// enough that only long rows (e.g. V = 151936) are split across threads,
// where the work outweighs a parallel region's start-up.
constexpr int64_t kVocabChunk = 32768;

// body(begin, end) -> State for one chunk; merge(a, b) -> State.
template <class State, class Body, class Merge, class ParallelFor>
State chunked_reduce(int64_t n, State init, const Body& body, const Merge& merge, const ParallelFor& parallel_for) {
  const int64_t num_chunks = ceil_div(n, kVocabChunk);
  if (num_chunks <= 1) return merge(init, body(0, n));
  std::vector<State> partial(size_t(num_chunks), init);
  parallel_for(0, num_chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) partial[size_t(c)] = body(c * kVocabChunk, std::min(n, (c + 1) * kVocabChunk));
  });
  State acc = init;
  for (const State& s : partial) acc = merge(acc, s);
  return acc;
}

}  // namespace flashspark::cpu
