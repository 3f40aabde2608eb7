// CPU kernels of the DFlash drafter ops: inject_context_kv (parallel over
// token x head rows) and block_diffusion_attention (parallel over
// request x KV head x key split, then a merge per query row).
#pragma once

#include <algorithm>
#include <vector>

#include "flashspark/cpu/vec.h"
#include "flashspark/dflash.h"

namespace flashspark::cpu {

template <class T, class ParallelFor>
void inject_context_kv_cpu(const InjectParams<T>& p, const ParallelFor& parallel_for) {
  parallel_for(0, int64_t(p.num_tokens) * p.num_kv_heads, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int32_t i = int32_t(r / p.num_kv_heads);
      const Status st = inject_check_token(p, i);
      if (r % p.num_kv_heads == 0) write_status(p.status, i, st);
      if (st != Status::kOk) continue;  // a bad slot or position is never written
      const InjectRow<T> row = inject_row(p, i, int32_t(r % p.num_kv_heads));
      float ss = 0.f;
      for (int32_t j = 0; j < p.head_dim; ++j) ss += to_float(row.k[j]) * to_float(row.k[j]);
      inject_write(p, row, rms_inv(ss, p.head_dim, p.eps), 0, 1);
    }
  });
}

// One split of keys [j0, j1) for all query rows of (b, h): scores, a local
// softmax, and the unnormalized P.V, written as a partial (m, l, acc). Both
// products are written as axpy loops over contiguous memory (K transposed into
// `kt` first), which compilers vectorize without reassociating a reduction.
template <class T>
void block_attn_split_cpu(const BlockAttnParams<T>& p, int32_t b, int32_t h, int32_t s, std::vector<float>& kt,
                          std::vector<float>& scores, std::vector<float>& acc) {
  const int32_t D = p.head_dim, R = p.rows();
  const int32_t ctx = block_attn_check_request(p, b) == Status::kOk ? p.ctx_lens[b] : -p.gamma;  // bad: no keys
  const int32_t j0 = s * p.split_keys, j1 = std::min(ctx + p.gamma, j0 + p.split_keys), n = j1 - j0;
  const int64_t base = block_attn_partial_index(p, b, h, 0, s);
  float* ml = p.partial_ml;
  if (n <= 0) {
    for (int32_t r = 0; r < R; ++r) {
      ml[2 * (base + int64_t(r) * p.num_splits)] = kNegInf;
      ml[2 * (base + int64_t(r) * p.num_splits) + 1] = 0.f;
    }
    return;
  }
  for (int32_t j = j0; j < j1; ++j) {
    const T* kj = block_attn_key(p, b, h, ctx, j);
    for (int32_t d = 0; d < D; ++d) kt[size_t(d) * n + (j - j0)] = to_float(kj[d]);
  }
  std::fill_n(scores.data(), size_t(R) * n, 0.f);
  int32_t r = 0;
  for (; r + 4 <= R; r += 4) {  // four query rows per pass over K
    const T* qr[4] = {block_attn_query(p, b, h, r), block_attn_query(p, b, h, r + 1), block_attn_query(p, b, h, r + 2),
                      block_attn_query(p, b, h, r + 3)};
    float* sr = scores.data() + size_t(r) * n;
    for (int32_t d = 0; d < D; ++d) {
      const float a[4] = {to_float(qr[0][d]) * p.scale, to_float(qr[1][d]) * p.scale, to_float(qr[2][d]) * p.scale,
                          to_float(qr[3][d]) * p.scale};
      axpy4(n, a, kt.data() + size_t(d) * n, sr, sr + n, sr + 2 * n, sr + 3 * n);
    }
  }
  for (; r < R; ++r) {
    const T* qr = block_attn_query(p, b, h, r);
    for (int32_t d = 0; d < D; ++d)
      axpy(n, to_float(qr[d]) * p.scale, kt.data() + size_t(d) * n, scores.data() + size_t(r) * n);
  }
  for (int32_t r = 0; r < R; ++r) {
    float* sr = scores.data() + size_t(r) * n;
    float m = kNegInf;
    for (int32_t j = 0; j < n; ++j) m = std::max(m, sr[j]);
    float l = 0.f;
    for (int32_t j = 0; j < n; ++j) {
      sr[j] = expf(sr[j] - m);
      l += sr[j];
    }
    ml[2 * (base + int64_t(r) * p.num_splits)] = m;
    ml[2 * (base + int64_t(r) * p.num_splits) + 1] = l;
  }
  std::fill(acc.begin(), acc.begin() + size_t(R) * D, 0.f);
  for (int32_t j = j0; j < j1; ++j) {
    const T* vj = block_attn_value(p, b, h, ctx, j);
    float* row = kt.data();  // K is no longer needed: reuse its buffer for V_j
    for (int32_t d = 0; d < D; ++d) row[d] = to_float(vj[d]);
    for (int32_t r = 0; r < R; ++r) {
      axpy(D, scores[size_t(r) * n + (j - j0)], row, acc.data() + size_t(r) * D);
    }
  }
  for (int32_t r = 0; r < R; ++r)
    std::copy_n(acc.data() + size_t(r) * D, D, p.partial_acc + (base + int64_t(r) * p.num_splits) * D);
}

template <class T, class ParallelFor>
void block_diffusion_attention_cpu(const BlockAttnParams<T>& p, const ParallelFor& parallel_for) {
  const int32_t D = p.head_dim, R = p.rows();
  const int64_t tasks = int64_t(p.batch) * p.num_kv_heads * p.num_splits;
  parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> kt(size_t(D) * p.split_keys), scores(size_t(R) * p.split_keys), acc(size_t(R) * D);
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t s = int32_t(t % p.num_splits);
      const int64_t bh = t / p.num_splits;
      block_attn_split_cpu(p, int32_t(bh / p.num_kv_heads), int32_t(bh % p.num_kv_heads), s, kt, scores, acc);
    }
  });
  for (int32_t b = 0; b < p.batch; ++b) write_status(p.status, b, block_attn_check_request(p, b));
  parallel_for(0, int64_t(p.batch) * p.num_kv_heads * R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const int32_t r = int32_t(t % R);
      const int64_t bh = t / R;
      block_attn_combine_row(p, int32_t(bh / p.num_kv_heads), int32_t(bh % p.num_kv_heads), r, 0, 1);
    }
  });
}

}  // namespace flashspark::cpu
