// Argument checking and parameter assembly for the DFlash 2 ops
// (two_tap_conv, topk_select, path_select), shared by CPU and CUDA.
#pragma once

#include <string>

#include "checks.h"
#include "flashspark/dflash2.h"

namespace flashspark::binding {

struct TwoTapArgs {
  at::Tensor x, base, delta, residual, cu_blocks, delta_weight, delta_ws, norm_weight, row_scale_ws, finish_delta;
  NamedTensors all;  // every argument as given, for the outputs' overlap checks
  int64_t rows = 0, channels = 0, block_size = 0, num_blocks = 0, group_size = 0, groups = 0;
  double norm_eps = 0.0;
};

inline TwoTapArgs check_two_tap_args(const at::Tensor& x, const at::Tensor& base,
                                     const std::optional<at::Tensor>& delta, int64_t block_size,
                                     const std::optional<at::Tensor>& cu_blocks,
                                     const std::optional<at::Tensor>& residual,
                                     const std::optional<at::Tensor>& delta_weight,
                                     const std::optional<at::Tensor>& norm_weight, double norm_eps, int64_t group_size,
                                     const std::optional<at::Tensor>& finish_delta) {
  constexpr const char* op = "two_tap_conv";
  TwoTapArgs a;
  a.all = {{x, "x"}, {base, "base"}};
  for (const auto& [t, name] :
       {std::pair{&delta, "delta"}, std::pair{&cu_blocks, "cu_blocks"}, std::pair{&residual, "residual"},
        std::pair{&delta_weight, "delta_weight"}, std::pair{&norm_weight, "norm_weight"}})
    if (t->has_value()) a.all.push_back({**t, name});
  check_float_dtype(x, op, "x");
  TORCH_CHECK(x.dim() >= 2, "flashspark.two_tap_conv: argument 'x' must be [..., T, C] (rank >= 2), got ", x.dim(),
              "-D");
  a.channels = x.size(-1);
  TORCH_CHECK(a.channels >= 1, "flashspark.two_tap_conv: argument 'x' must have C >= 1 channels, got shape ",
              x.sizes());
  check_fits_int32(a.channels, op, "x", "C");
  a.x = inner_contiguous(x).reshape({-1, a.channels});
  a.rows = a.x.size(0);
  check_int_range(group_size, 1, kInt32Max, op, "group_size");
  a.group_size = group_size;
  const int64_t groups = a.groups = ceil_div(a.channels, group_size);
  check_device(base, x, op, "base");
  check_dtype(base, x.scalar_type(), op, "base");
  TORCH_CHECK(base.dim() == 2 && base.size(0) == 2 && base.size(1) == a.channels, "flashspark.two_tap_conv: argument ",
              "'base' must have shape [2, ", a.channels, "], got ", base.sizes());
  a.base = base.contiguous();
  TORCH_CHECK(delta.has_value() != delta_weight.has_value(), "flashspark.two_tap_conv: pass exactly one of 'delta' ",
              "(the dynamic taps) and 'delta_weight' (their projection, computed in the op)");
  if (delta.has_value()) {
    check_device(*delta, x, op, "delta");
    check_dtype(*delta, x.scalar_type(), op, "delta");
    TORCH_CHECK(
        delta->dim() >= 2 && delta->numel() == a.rows * 2 * groups && delta->size(-1) == groups && delta->size(-2) == 2,
        "flashspark.two_tap_conv: argument 'delta' must have shape [..., 2, ", groups, "] with one row per row of x (",
        a.rows, "), got ", delta->sizes());
    a.delta = delta->contiguous();
  } else {
    check_device(*delta_weight, x, op, "delta_weight");
    check_dtype(*delta_weight, x.scalar_type(), op, "delta_weight");
    TORCH_CHECK(delta_weight->dim() == 2 &&
                    (delta_weight->size(0) == 2 * groups || delta_weight->size(0) == 4 * groups) &&
                    delta_weight->size(1) == a.channels,
                "flashspark.two_tap_conv: argument 'delta_weight' must have shape [", 2 * groups, ", ", a.channels,
                "] (2 taps x ", groups, " groups of ", group_size, " channels, by channels), or [", 4 * groups, ", ",
                a.channels, "] with the finish conv's taps after them (written to 'finish_delta'), got ",
                delta_weight->sizes());
    a.delta_weight = delta_weight->contiguous();
  }
  // The finish conv's taps: an output exactly when delta_weight projects them.
  const bool finish = a.delta_weight.defined() && a.delta_weight.size(0) == 4 * groups;
  TORCH_CHECK(finish_delta.has_value() == finish, "flashspark.two_tap_conv: argument 'finish_delta' ",
              finish
                  ? "is required with a 'delta_weight' of 4G rows (it receives the finish conv's taps, rows [2G, 4G))"
                  : "is written only with a 'delta_weight' of 4G rows (the finish conv's taps); pass None");
  if (finish) {
    const at::Tensor& f = *finish_delta;
    check_device(f, x, op, "finish_delta");
    check_dtype(f, x.scalar_type(), op, "finish_delta");
    TORCH_CHECK(f.dim() >= 2 && f.numel() == a.rows * 2 * groups && f.size(-1) == groups && f.size(-2) == 2,
                "flashspark.two_tap_conv: argument 'finish_delta' must have shape [..., 2, ", groups,
                "] with one row per row of x (", a.rows, "), got ", f.sizes());
    TORCH_CHECK(f.is_contiguous(), "flashspark.two_tap_conv: argument 'finish_delta' is written in place and must be ",
                "contiguous, got strides ", f.strides());
    check_writable(f, "finish_delta", a.all, op);
    a.finish_delta = f;
    a.all.push_back({f, "finish_delta"});  // the status output must not overlap it either
  }
  if (residual.has_value()) {
    check_device(*residual, x, op, "residual");
    check_dtype(*residual, x.scalar_type(), op, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(),
                "flashspark.two_tap_conv: argument 'residual' must have the shape of x ", x.sizes(), ", got ",
                residual->sizes());
    a.residual = inner_contiguous(*residual).reshape({-1, a.channels});
  }
  if (norm_weight.has_value()) {
    check_device(*norm_weight, x, op, "norm_weight");
    check_dtype(*norm_weight, x.scalar_type(), op, "norm_weight");
    TORCH_CHECK(norm_weight->dim() == 1 && norm_weight->size(0) == a.channels, "flashspark.two_tap_conv: argument ",
                "'norm_weight' must have shape [", a.channels, "], got ", norm_weight->sizes());
    check_finite_scalar(norm_eps, true, op, "norm_eps");
    a.norm_weight = norm_weight->contiguous();
    a.norm_eps = norm_eps;
  }
  if (cu_blocks.has_value()) {
    check_device(*cu_blocks, x, op, "cu_blocks");
    check_dim(*cu_blocks, 1, op, "cu_blocks");
    TORCH_CHECK(cu_blocks->numel() >= 2, "flashspark.two_tap_conv: argument 'cu_blocks' needs at least 2 offsets");
    check_fits_int32(cu_blocks->numel(), op, "cu_blocks", "num_blocks + 1");
    check_fits_int32(a.rows, op, "x", "N (rows) with cu_blocks");
    a.cu_blocks = as_index(*cu_blocks, at::kInt, op, "cu_blocks");
    a.num_blocks = cu_blocks->numel() - 1;
  } else {
    TORCH_CHECK(block_size > 0 && block_size <= kInt32Max, "flashspark.two_tap_conv: argument 'block_size' must lie ",
                "in [1, 2^31 - 1] when 'cu_blocks' is not given, got ", block_size);
  }
  a.block_size = block_size;
  return a;
}

template <class T>
TwoTapParams<T> make_two_tap_params(const TwoTapArgs& a, at::Tensor& out, int32_t* status) {
  TwoTapParams<T> p;
  p.status = status;
  p.x = reinterpret_cast<const T*>(a.x.const_data_ptr());
  p.x_stride = a.x.stride(0);
  p.base = reinterpret_cast<const T*>(a.base.const_data_ptr());
  if (a.delta.defined()) {
    p.delta = reinterpret_cast<const T*>(a.delta.const_data_ptr());
  } else {
    p.delta_weight = reinterpret_cast<const T*>(a.delta_weight.const_data_ptr());
    if (a.delta_ws.defined()) p.delta_ws = a.delta_ws.mutable_data_ptr<float>();  // CUDA: the taps between kernels
    if (a.finish_delta.defined()) p.finish_delta = reinterpret_cast<T*>(a.finish_delta.mutable_data_ptr());
  }
  if (a.residual.defined()) {
    p.residual = reinterpret_cast<const T*>(a.residual.const_data_ptr());
    p.res_stride = a.residual.stride(0);
  }
  if (a.norm_weight.defined()) {
    p.norm_weight = reinterpret_cast<const T*>(a.norm_weight.const_data_ptr());
    p.norm_eps = float(a.norm_eps);
    if (a.row_scale_ws.defined()) p.row_scale_ws = a.row_scale_ws.mutable_data_ptr<float>();  // CUDA
  }
  p.out = reinterpret_cast<T*>(out.mutable_data_ptr());
  if (a.cu_blocks.defined()) p.cu_blocks = a.cu_blocks.const_data_ptr<int32_t>();
  p.num_blocks = int32_t(a.num_blocks);
  p.block_size = int32_t(a.block_size);
  p.group_size = int32_t(a.group_size);
  p.rows = a.rows;
  p.channels = int32_t(a.channels);
  return p;
}

struct TopKArgs {
  at::Tensor logits;
  int64_t rows = 0, vocab = 0, k = 0;
  std::vector<int64_t> out_shape;
};

inline TopKArgs check_topk_args(const at::Tensor& logits, int64_t k) {
  constexpr const char* op = "topk_select";
  TopKArgs a;
  check_float_dtype(logits, op, "logits");
  TORCH_CHECK(logits.dim() >= 1, "flashspark.topk_select: argument 'logits' must be [..., V]");
  a.vocab = logits.size(-1);
  TORCH_CHECK(a.vocab > 0 && a.vocab < (int64_t(1) << 31), "flashspark.topk_select: argument 'logits' has an empty ",
              "or too large vocabulary");
  TORCH_CHECK(k >= 1 && k <= kMaxTopK && k <= a.vocab, "flashspark.topk_select: argument 'k' must lie in [1, min(",
              kMaxTopK, ", V)], got ", k);
  a.logits = inner_contiguous(logits).reshape({-1, a.vocab});
  a.rows = a.logits.size(0);
  a.k = k;
  a.out_shape = logits.sizes().vec();
  a.out_shape.back() = k;
  return a;
}

template <class T>
TopKParams<T> make_topk_params(const TopKArgs& a, at::Tensor& values, at::Tensor& ids, at::Tensor& lse) {
  TopKParams<T> p;
  p.logits = reinterpret_cast<const T*>(a.logits.const_data_ptr());
  p.row_stride = a.logits.stride(0);
  p.out_values = values.mutable_data_ptr<float>();
  p.out_ids = ids.mutable_data_ptr<int32_t>();
  p.out_lse = lse.mutable_data_ptr<float>();
  p.rows = a.rows;
  p.vocab = int32_t(a.vocab);
  p.k = int32_t(a.k);
  return p;
}

struct PathArgs {
  at::Tensor cand_ids, unary, a_emb, b_emb, g, hidden, g_weight, anchor, temperature, seeds, offsets;
  NamedTensors all;  // every argument as given, for the status output's overlap check
  PathMode mode = PathMode::kBacktrack;
  int64_t requests = 0, positions = 0, k = 0, rank = 0, vocab = 0, hidden_dim = 0;
};

inline PathMode parse_path_mode(const std::string& mode) {
  if (mode == "backtrack") return PathMode::kBacktrack;
  if (mode == "greedy") return PathMode::kGreedy;
  if (mode == "sample") return PathMode::kSample;
  TORCH_CHECK(false, "flashspark.path_select: argument 'mode' must be 'backtrack', 'greedy' or 'sample', got '", mode,
              "'");
}

inline PathArgs check_path_args(const at::Tensor& cand_ids, const at::Tensor& unary, const at::Tensor& a_emb,
                                const at::Tensor& b_emb, const std::optional<at::Tensor>& g, const at::Tensor& anchor,
                                const std::string& mode, const at::Tensor& temperature, const at::Tensor& seeds,
                                const at::Tensor& offsets, const std::optional<at::Tensor>& hidden,
                                const std::optional<at::Tensor>& g_weight) {
  constexpr const char* op = "path_select";
  PathArgs a;
  a.all = {{cand_ids, "cand_ids"},       {unary, "unary"}, {a_emb, "a_emb"},    {b_emb, "b_emb"}, {anchor, "anchor"},
           {temperature, "temperature"}, {seeds, "seeds"}, {offsets, "offsets"}};
  for (const auto& [t, name] : {std::pair{&g, "g"}, std::pair{&hidden, "hidden"}, std::pair{&g_weight, "g_weight"}})
    if (t->has_value()) a.all.push_back({**t, name});
  a.mode = parse_path_mode(mode);
  check_dim(cand_ids, 3, op, "cand_ids");
  check_dim(unary, 3, op, "unary");
  check_dim(a_emb, 2, op, "a_emb");
  check_dim(b_emb, 2, op, "b_emb");
  check_dim(anchor, 1, op, "anchor");
  const std::pair<const at::Tensor*, const char*> all[] = {
      {&unary, "unary"}, {&a_emb, "a_emb"},    {&b_emb, "b_emb"}, {&anchor, "anchor"}, {&temperature, "temperature"},
      {&seeds, "seeds"}, {&offsets, "offsets"}};
  for (const auto& [t, name] : all) check_device(*t, cand_ids, op, name);
  a.requests = cand_ids.size(0);
  a.positions = cand_ids.size(1);
  a.k = cand_ids.size(2);
  a.vocab = a_emb.size(0);
  a.rank = a_emb.size(1);
  TORCH_CHECK(a.k >= 1 && a.k <= kMaxPathCandidates, "flashspark.path_select: argument 'cand_ids' must have K in [1, ",
              kMaxPathCandidates, "] candidates, got ", a.k);
  check_fits_int32(a.requests * a.positions, op, "cand_ids", "R x P");
  check_fits_int32(a.vocab, op, "a_emb", "V");
  check_fits_int32(a.rank, op, "a_emb", "r");
  TORCH_CHECK(unary.sizes() == cand_ids.sizes(), "flashspark.path_select: argument 'unary' must have the shape of ",
              "cand_ids ", cand_ids.sizes(), ", got ", unary.sizes());
  check_dtype(unary, at::kFloat, op, "unary");
  check_float_dtype(a_emb, op, "a_emb");
  check_dtype(b_emb, a_emb.scalar_type(), op, "b_emb");
  TORCH_CHECK(b_emb.sizes() == a_emb.sizes(), "flashspark.path_select: argument 'b_emb' must have the shape of a_emb ",
              a_emb.sizes(), ", got ", b_emb.sizes());
  TORCH_CHECK(
      g.has_value() != (hidden.has_value() || g_weight.has_value()) && hidden.has_value() == g_weight.has_value(),
      "flashspark.path_select: pass either 'g' or both 'hidden' and 'g_weight' (g = hidden @ g_weight.T, ",
      "computed in the op)");
  if (g.has_value()) {
    check_dim(*g, 3, op, "g");
    check_device(*g, cand_ids, op, "g");
    check_dtype(*g, a_emb.scalar_type(), op, "g");
    TORCH_CHECK(g->size(0) == a.requests && g->size(1) == a.positions && g->size(2) == a.rank,
                "flashspark.path_select: argument 'g' must have shape [", a.requests, ", ", a.positions, ", ", a.rank,
                "], got ", g->sizes());
    a.g = g->contiguous();
  } else {
    check_dim(*hidden, 3, op, "hidden");
    check_dim(*g_weight, 2, op, "g_weight");
    check_device(*hidden, cand_ids, op, "hidden");
    check_device(*g_weight, cand_ids, op, "g_weight");
    check_dtype(*hidden, a_emb.scalar_type(), op, "hidden");
    check_dtype(*g_weight, a_emb.scalar_type(), op, "g_weight");
    a.hidden_dim = hidden->size(2);
    check_fits_int32(a.hidden_dim, op, "hidden", "D");
    TORCH_CHECK(hidden->size(0) == a.requests && hidden->size(1) == a.positions,
                "flashspark.path_select: argument 'hidden' must have shape [", a.requests, ", ", a.positions,
                ", D], got ", hidden->sizes());
    TORCH_CHECK(g_weight->size(0) == a.rank && g_weight->size(1) == a.hidden_dim,
                "flashspark.path_select: argument 'g_weight' must have shape [", a.rank, ", ", a.hidden_dim,
                "] (rank of a_emb by hidden's D), got ", g_weight->sizes());
    a.hidden = inner_contiguous(*hidden);
    a.g_weight = g_weight->contiguous();
  }
  const std::pair<const at::Tensor*, const char*> per_request[] = {
      {&anchor, "anchor"}, {&temperature, "temperature"}, {&seeds, "seeds"}, {&offsets, "offsets"}};
  for (const auto& [t, name] : per_request) {
    check_dim(*t, 1, op, name);
    check_size(*t, 0, a.requests, op, name, "R");
  }
  check_dtype(temperature, at::kFloat, op, "temperature");
  check_dtype(seeds, at::kLong, op, "seeds");
  check_dtype(offsets, at::kLong, op, "offsets");
  a.cand_ids = as_index(cand_ids, at::kInt, op, "cand_ids");
  a.anchor = as_index(anchor, at::kInt, op, "anchor");
  a.unary = unary.contiguous();
  a.a_emb = a_emb.contiguous();
  a.b_emb = b_emb.contiguous();
  a.temperature = temperature.contiguous();
  a.seeds = seeds.contiguous();
  a.offsets = offsets.contiguous();
  return a;
}

struct PathOutputs {
  at::Tensor tokens, choice, scores, q, lattice, best, backptr, g_ws;
};

inline PathOutputs empty_path_outputs(const PathArgs& a) {
  const auto f = a.unary.options().dtype(at::kFloat);
  const auto i = a.unary.options().dtype(at::kInt);
  return {at::empty({a.requests, a.positions}, i),
          at::empty({a.requests, a.positions}, i),
          at::empty({a.requests, a.positions, a.k}, f),
          at::empty({a.requests, a.positions, a.k}, f),
          at::empty({a.requests, a.positions, a.k, a.k}, f),
          at::empty({a.requests, a.positions, a.k}, f),
          at::empty({a.requests, a.positions, a.k}, i),
          a.g_weight.defined() ? at::empty({a.requests, a.positions, a.rank}, f) : at::Tensor()};
}

template <class T>
PathParams<T> make_path_params(const PathArgs& a, PathOutputs& o, int32_t* status) {
  PathParams<T> p;
  p.status = status;
  p.cand_ids = a.cand_ids.const_data_ptr<int32_t>();
  p.unary = a.unary.const_data_ptr<float>();
  p.a_emb = reinterpret_cast<const T*>(a.a_emb.const_data_ptr());
  p.b_emb = reinterpret_cast<const T*>(a.b_emb.const_data_ptr());
  if (a.g.defined()) {
    p.g = reinterpret_cast<const T*>(a.g.const_data_ptr());
  } else {
    p.hidden = reinterpret_cast<const T*>(a.hidden.const_data_ptr());
    p.hidden_stride_r = a.hidden.stride(0);
    p.hidden_stride_p = a.hidden.stride(1);
    p.g_weight = reinterpret_cast<const T*>(a.g_weight.const_data_ptr());
    p.g_ws = o.g_ws.mutable_data_ptr<float>();
    p.hidden_dim = int32_t(a.hidden_dim);
  }
  p.anchor = a.anchor.const_data_ptr<int32_t>();
  p.temperature = a.temperature.const_data_ptr<float>();
  p.seeds = a.seeds.const_data_ptr<int64_t>();
  p.offsets = a.offsets.const_data_ptr<int64_t>();
  p.mode = a.mode;
  p.out_tokens = o.tokens.mutable_data_ptr<int32_t>();
  p.out_choice = o.choice.mutable_data_ptr<int32_t>();
  p.out_scores = o.scores.mutable_data_ptr<float>();
  p.out_q = o.q.mutable_data_ptr<float>();
  p.lattice = o.lattice.mutable_data_ptr<float>();
  p.best = o.best.mutable_data_ptr<float>();
  p.backptr = o.backptr.mutable_data_ptr<int32_t>();
  p.requests = int32_t(a.requests);
  p.positions = int32_t(a.positions);
  p.k = int32_t(a.k);
  p.rank = int32_t(a.rank);
  p.vocab = int32_t(a.vocab);
  return p;
}

}  // namespace flashspark::binding
