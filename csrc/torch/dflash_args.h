// Argument checking and parameter assembly for the DFlash ops
// (block_diffusion_attention, inject_context_kv), shared by CPU and CUDA.
#pragma once

#include "checks.h"
#include "flashspark/dflash.h"

namespace flashspark::binding {

constexpr int32_t kMaxHeadDim = 256;
constexpr int32_t kAttnSplitKeys = 256;

struct BlockAttnArgs {
  at::Tensor q, k_cache, v_cache, ctx_lens, k_block, v_block;
  NamedTensors all;  // every argument as given, for the status output's overlap check
  int64_t batch = 0, gamma = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0, max_len = 0, num_splits = 0;
};

inline BlockAttnArgs check_block_attn_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                           const at::Tensor& ctx_lens, const at::Tensor& k_block,
                                           const at::Tensor& v_block, double scale) {
  constexpr const char* op = "block_diffusion_attention";
  BlockAttnArgs a;
  a.all = {{q, "q"},
           {k_cache, "k_cache"},
           {v_cache, "v_cache"},
           {ctx_lens, "ctx_lens"},
           {k_block, "k_block"},
           {v_block, "v_block"}};
  check_finite_scalar(scale, false, op, "scale");
  const std::pair<const at::Tensor*, const char*> four_d[] = {
      {&q, "q"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&k_block, "k_block"}, {&v_block, "v_block"}};
  check_float_dtype(q, op, "q");
  for (const auto& [t, name] : four_d) {
    check_dim(*t, 4, op, name);
    check_device(*t, q, op, name);
    check_dtype(*t, q.scalar_type(), op, name);
  }
  check_dim(ctx_lens, 1, op, "ctx_lens");
  check_device(ctx_lens, q, op, "ctx_lens");
  a.batch = q.size(0);
  a.gamma = q.size(1);
  a.num_q_heads = q.size(2);
  a.head_dim = q.size(3);
  a.num_kv_heads = k_cache.size(1);
  a.max_len = k_cache.size(2);
  TORCH_CHECK(a.head_dim > 0 && a.head_dim <= kMaxHeadDim, "flashspark.", op,
              ": argument 'q' must have head_dim in [1, ", kMaxHeadDim, "], got ", a.head_dim);
  TORCH_CHECK(a.num_kv_heads > 0 && a.num_q_heads % a.num_kv_heads == 0, "flashspark.", op, ": argument 'k_cache' has ",
              a.num_kv_heads, " KV heads, which must divide the ", a.num_q_heads, " query heads");
  check_size(k_cache, 0, a.batch, op, "k_cache", "batch");
  check_size(k_cache, 3, a.head_dim, op, "k_cache", "head_dim");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "flashspark.", op, ": argument 'v_cache' must have the shape of ",
              "k_cache ", k_cache.sizes(), ", got ", v_cache.sizes());
  const std::vector<int64_t> block_shape = {a.batch, a.gamma, a.num_kv_heads, a.head_dim};
  TORCH_CHECK(k_block.sizes() == at::IntArrayRef(block_shape), "flashspark.", op,
              ": argument 'k_block' must have shape [B, G, Hkv, D] = ", at::IntArrayRef(block_shape), ", got ",
              k_block.sizes());
  TORCH_CHECK(v_block.sizes() == at::IntArrayRef(block_shape), "flashspark.", op,
              ": argument 'v_block' must have shape [B, G, Hkv, D] = ", at::IntArrayRef(block_shape), ", got ",
              v_block.sizes());
  check_size(ctx_lens, 0, a.batch, op, "ctx_lens", "batch");
  check_fits_int32(a.batch * a.num_q_heads, op, "q", "B x Hq");
  check_fits_int32(a.gamma * a.num_q_heads, op, "q", "G x Hq");
  check_fits_int32(a.max_len + a.gamma, op, "k_cache", "S_max + G");
  a.q = inner_contiguous(q);
  a.k_cache = inner_contiguous(k_cache);
  a.v_cache = inner_contiguous(v_cache);
  a.k_block = inner_contiguous(k_block);
  a.v_block = inner_contiguous(v_block);
  a.ctx_lens = as_index(ctx_lens, at::kInt, op, "ctx_lens");
  a.num_splits = ceil_div(a.max_len + a.gamma, kAttnSplitKeys);
  return a;
}

// Output plus the split-KV workspace; sizes depend on shapes only.
template <class T>
BlockAttnParams<T> make_block_attn_params(const BlockAttnArgs& a, double scale, at::Tensor& out, at::Tensor& workspace,
                                          int32_t* status) {
  BlockAttnParams<T> p;
  p.status = status;
  p.q = reinterpret_cast<const T*>(a.q.const_data_ptr());
  p.q_stride_b = a.q.stride(0);
  p.q_stride_g = a.q.stride(1);
  p.q_stride_h = a.q.stride(2);
  p.k_cache = reinterpret_cast<const T*>(a.k_cache.const_data_ptr());
  p.v_cache = reinterpret_cast<const T*>(a.v_cache.const_data_ptr());
  p.kc_stride_b = a.k_cache.stride(0);
  p.kc_stride_h = a.k_cache.stride(1);
  p.kc_stride_s = a.k_cache.stride(2);
  p.vc_stride_b = a.v_cache.stride(0);
  p.vc_stride_h = a.v_cache.stride(1);
  p.vc_stride_s = a.v_cache.stride(2);
  p.ctx_lens = a.ctx_lens.const_data_ptr<int32_t>();
  p.k_block = reinterpret_cast<const T*>(a.k_block.const_data_ptr());
  p.v_block = reinterpret_cast<const T*>(a.v_block.const_data_ptr());
  p.kb_stride_b = a.k_block.stride(0);
  p.kb_stride_g = a.k_block.stride(1);
  p.kb_stride_h = a.k_block.stride(2);
  p.vb_stride_b = a.v_block.stride(0);
  p.vb_stride_g = a.v_block.stride(1);
  p.vb_stride_h = a.v_block.stride(2);
  p.out = reinterpret_cast<T*>(out.mutable_data_ptr());
  p.scale = float(scale);
  p.batch = int32_t(a.batch);
  p.gamma = int32_t(a.gamma);
  p.num_q_heads = int32_t(a.num_q_heads);
  p.num_kv_heads = int32_t(a.num_kv_heads);
  p.head_dim = int32_t(a.head_dim);
  p.max_len = int32_t(a.max_len);
  p.split_keys = kAttnSplitKeys;
  p.num_splits = int32_t(a.num_splits);
  const int64_t partials = a.batch * a.num_kv_heads * p.rows() * a.num_splits;
  workspace = at::empty({partials * (a.head_dim + 2)}, a.q.options().dtype(at::kFloat));
  p.partial_acc = workspace.mutable_data_ptr<float>();
  p.partial_ml = p.partial_acc + partials * a.head_dim;
  return p;
}

struct InjectArgs {
  at::Tensor k, v, positions, slots, k_norm_weight, cos_sin;
  NamedTensors all;  // every argument as given, for the status output's overlap check
};

inline InjectArgs check_inject_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                                    const at::Tensor& slots, const at::Tensor& k_norm_weight,
                                    const at::Tensor& cos_sin_cache, double eps, const at::Tensor& k_cache,
                                    const at::Tensor& v_cache) {
  constexpr const char* op = "inject_context_kv";
  InjectArgs a;
  check_finite_scalar(eps, true, op, "eps");
  check_float_dtype(k_cache, op, "k_cache");
  const std::pair<const at::Tensor*, const char*> tensors[] = {{&k, "k"},
                                                               {&v, "v"},
                                                               {&positions, "positions"},
                                                               {&slots, "slots"},
                                                               {&k_norm_weight, "k_norm_weight"},
                                                               {&cos_sin_cache, "cos_sin_cache"},
                                                               {&v_cache, "v_cache"}};
  for (const auto& [t, name] : tensors) check_device(*t, k_cache, op, name);
  check_dim(k, 3, op, "k");
  check_dim(v, 3, op, "v");
  check_dim(k_cache, 4, op, "k_cache");
  check_dim(v_cache, 4, op, "v_cache");
  check_dim(positions, 1, op, "positions");
  check_dim(slots, 1, op, "slots");
  check_dim(k_norm_weight, 1, op, "k_norm_weight");
  check_dim(cos_sin_cache, 2, op, "cos_sin_cache");
  check_dtype(k, k_cache.scalar_type(), op, "k");
  check_dtype(v, k_cache.scalar_type(), op, "v");
  check_dtype(v_cache, k_cache.scalar_type(), op, "v_cache");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "flashspark.", op, ": argument 'v_cache' must have the shape of ",
              "k_cache ", k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t n = k.size(0), hkv = k_cache.size(1), d = k_cache.size(3);
  TORCH_CHECK(d % 2 == 0, "flashspark.", op, ": argument 'k_cache' must have an even head_dim for RoPE, got ", d);
  TORCH_CHECK(k.size(1) == hkv && k.size(2) == d, "flashspark.", op, ": argument 'k' must have shape [N, ", hkv, ", ",
              d, "], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "flashspark.", op, ": argument 'v' must have the shape of k ", k.sizes(),
              ", got ", v.sizes());
  check_size(positions, 0, n, op, "positions", "N");
  check_size(slots, 0, n, op, "slots", "N");
  check_size(k_norm_weight, 0, d, op, "k_norm_weight", "head_dim");
  check_size(cos_sin_cache, 1, d, op, "cos_sin_cache", "head_dim");
  check_dtype(cos_sin_cache, at::kFloat, op, "cos_sin_cache");
  check_float_dtype(k_norm_weight, op, "k_norm_weight");
  TORCH_CHECK(d > 0, "flashspark.", op, ": argument 'k_cache' must have head_dim >= 2, got ", d);
  TORCH_CHECK(hkv > 0, "flashspark.", op, ": argument 'k_cache' must have at least one KV head, got shape ",
              k_cache.sizes());
  check_fits_int32(n, op, "k", "N");
  check_fits_int32(k_cache.size(0), op, "k_cache", "B");
  check_fits_int32(k_cache.size(2), op, "k_cache", "S_max");
  check_fits_int32(cos_sin_cache.size(0), op, "cos_sin_cache", "max_pos");
  // The caches are written in place: no expanded views, and no memory shared with each
  // other or with any input.
  const NamedTensors all = {{k, "k"},
                            {v, "v"},
                            {positions, "positions"},
                            {slots, "slots"},
                            {k_norm_weight, "k_norm_weight"},
                            {cos_sin_cache, "cos_sin_cache"},
                            {k_cache, "k_cache"},
                            {v_cache, "v_cache"}};
  check_writable(k_cache, "k_cache", all, op);
  check_writable(v_cache, "v_cache", all, op);
  a.all = all;
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "flashspark.", op,
              ": arguments 'k_cache' and 'v_cache' must be contiguous in head_dim (they are written in place)");
  // Token rows may be strided; each token's [Hkv, D] block must be dense.
  a.k = k.stride(2) == 1 && k.stride(1) == d ? k : k.contiguous();
  a.v = v.stride(2) == 1 && v.stride(1) == d ? v : v.contiguous();
  a.positions = as_index(positions, at::kLong, op, "positions");
  a.slots = as_index(slots, at::kInt, op, "slots");
  a.k_norm_weight = k_norm_weight.to(at::kFloat).contiguous();
  a.cos_sin = cos_sin_cache.contiguous();
  return a;
}

template <class T>
InjectParams<T> make_inject_params(const InjectArgs& a, double eps, at::Tensor& k_cache, at::Tensor& v_cache,
                                   int32_t* status) {
  InjectParams<T> p;
  p.status = status;
  p.k = reinterpret_cast<const T*>(a.k.const_data_ptr());
  p.v = reinterpret_cast<const T*>(a.v.const_data_ptr());
  p.k_stride = a.k.stride(0);
  p.v_stride = a.v.stride(0);
  p.positions = a.positions.const_data_ptr<int64_t>();
  p.slots = a.slots.const_data_ptr<int32_t>();
  p.k_norm_weight = a.k_norm_weight.const_data_ptr<float>();
  p.cos_sin = a.cos_sin.const_data_ptr<float>();
  p.eps = float(eps);
  p.k_cache = reinterpret_cast<T*>(k_cache.mutable_data_ptr());
  p.v_cache = reinterpret_cast<T*>(v_cache.mutable_data_ptr());
  p.cache_stride_b = k_cache.stride(0);
  p.cache_stride_h = k_cache.stride(1);
  p.cache_stride_s = k_cache.stride(2);
  p.v_cache_stride_b = v_cache.stride(0);
  p.v_cache_stride_h = v_cache.stride(1);
  p.v_cache_stride_s = v_cache.stride(2);
  p.num_tokens = int32_t(a.k.size(0));
  p.num_kv_heads = int32_t(k_cache.size(1));
  p.head_dim = int32_t(k_cache.size(3));
  p.max_pos = int32_t(a.cos_sin.size(0));
  p.batch = int32_t(k_cache.size(0));
  p.max_len = int32_t(k_cache.size(2));
  return p;
}

}  // namespace flashspark::binding
