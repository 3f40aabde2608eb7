// CPU kernel of markov_step: vocabulary tiles in parallel, each tile's W2
// rows read once for the whole batch, then a per-request merge in tile order.
#pragma once

#include <algorithm>
#include <vector>

#include "flashspark/cpu/vec.h"
#include "flashspark/dspark.h"

namespace flashspark::cpu {

constexpr int64_t kMarkovTile = 2048;  // vocabulary rows per tile (and per partial)

inline int32_t markov_num_partials_cpu(int64_t vocab) { return int32_t(ceil_div(vocab, kMarkovTile)); }

template <class T, class ParallelFor>
void markov_step_cpu(const MarkovParams<T>& p, const ParallelFor& parallel_for) {
  const int32_t B = p.batch, R = p.rank, V = p.vocab;
  const int64_t tiles = markov_num_partials_cpu(V);
  std::vector<Status> checked(static_cast<size_t>(B));
  std::vector<MarkovScale> scale(static_cast<size_t>(B));
  for (int32_t b = 0; b < B; ++b) {
    checked[size_t(b)] = markov_check_request(p, b);
    scale[size_t(b)] = markov_scale(p, b);
  }
  parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> e(size_t(B) * R), w(R);
    for (int32_t b = 0; b < B; ++b)  // a failed request's previous token is never read
      for (int32_t i = 0; i < R; ++i)
        e[size_t(b) * R + i] =
            checked[size_t(b)] == Status::kOk ? to_float(p.w1[int64_t(p.prev_tokens[b]) * R + i]) : 0.f;
    std::vector<MarkovPartial> parts(B);
    for (int64_t tile = t0; tile < t1; ++tile) {
      std::fill(parts.begin(), parts.end(), markov_partial_identity());
      const int64_t v1 = std::min<int64_t>(V, (tile + 1) * kMarkovTile);
      for (int64_t v = tile * kMarkovTile; v < v1; ++v) {
        for (int32_t i = 0; i < R; ++i) w[i] = to_float(p.w2[v * R + i]);
        for (int32_t b = 0; b < B; ++b) {
          const float z = markov_logit(p, b, int32_t(v), dot(R, e.data() + size_t(b) * R, w.data()));
          p.out_q[int64_t(b) * V + v] = z;
          markov_add(p, b, scale[size_t(b)], parts[b], int32_t(v), z);
        }
      }
      for (int32_t b = 0; b < B; ++b) markov_store_partial(p.partial + (tile * B + b) * kMarkovSlot, parts[b]);
    }
  });
  parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const Status st = checked[size_t(b)];
      const MarkovScale& sc = scale[size_t(b)];
      MarkovPartial acc = markov_partial_identity();
      for (int64_t tile = 0; tile < tiles; ++tile)
        acc = markov_partial_merge(acc, markov_load_partial(p.partial + (tile * B + b) * kMarkovSlot), sc.inv_t);
      const MarkovOutcome o = markov_outcome(sc, acc, st);
      p.out_tokens[b] = o.token;
      float* q = p.out_q + b * V;
      for (int64_t v = 0; v < V; ++v) q[v] = markov_q(o, sc.inv_t, int32_t(v), q[v]);
      p.out_conf[b] =
          st == Status::kOk ? sigmoid(markov_conf_dot(p, int32_t(b), 0, p.hidden_size + R, 1) + p.conf_b[0]) : 0.f;
      write_status(p.status, b, st);
    }
  });
}

}  // namespace flashspark::cpu
