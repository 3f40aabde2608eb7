// CPU kernel of `tree_verify`: parallel over requests, and over vocabulary chunks when there
// are fewer requests than threads (verify's row backend: the same reductions and races).
#pragma once

#include <algorithm>

#include "flashspark/cpu/verify.h"
#include "flashspark/tree_verify.h"

namespace flashspark::cpu {

// Every request is checked before its rows are read (tree_check_request), so bad input in one
// request never touches another's outputs. p.scratch holds 2N int32.
template <class T, class ParallelFor>
void tree_verify_cpu(const TreeVerifyParams<T>& p, const ParallelFor& parallel_for) {
  // Requests per task: enough that a task reads at least ~1M logits in the worst case.
  const int64_t per_request = int64_t(p.vocab) * (p.max_depth + 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 20) / std::max<int64_t>(per_request, 1));
  const int64_t width = p.max_depth + 1;
  parallel_for(0, p.batch, grain, [&](int64_t b0, int64_t b1) {
    VerifyRowBackend<T, ParallelFor> backend{p.vocab, parallel_for};
    for (int64_t b = b0; b < b1; ++b) {
      std::fill_n(p.out_nodes + b * width, width, -1);
      std::fill_n(p.out_tokens + b * width, width, -1);
      tree_verify_request(p, int32_t(b), tree_check_request(p, int32_t(b)), backend);
    }
  });
}

}  // namespace flashspark::cpu
