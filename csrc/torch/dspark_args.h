// Argument checking and parameter assembly for markov_step, shared by CPU and CUDA.
#pragma once

#include "checks.h"
#include "flashspark/dspark.h"

namespace flashspark::binding {

struct MarkovArgs {
  at::Tensor base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions;
  NamedTensors all;  // every argument as given, for the status output's overlap check
  int64_t batch = 0, vocab = 0, rank = 0, hidden_size = 0;
};

inline MarkovArgs check_markov_args(const at::Tensor& base_logits, const at::Tensor& prev_tokens, const at::Tensor& w1,
                                    const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                                    const at::Tensor& hidden, const at::Tensor& conf_w, const at::Tensor& conf_b,
                                    const at::Tensor& temperature, const at::Tensor& seeds,
                                    const at::Tensor& positions) {
  constexpr const char* op = "markov_step";
  MarkovArgs a;
  a.all = {{base_logits, "base_logits"},
           {prev_tokens, "prev_tokens"},
           {w1, "w1"},
           {w2, "w2"},
           {hidden, "hidden"},
           {conf_w, "conf_w"},
           {conf_b, "conf_b"},
           {temperature, "temperature"},
           {seeds, "seeds"},
           {positions, "positions"}};
  if (bias.has_value()) a.all.push_back({*bias, "bias"});
  check_float_dtype(base_logits, op, "base_logits");
  check_dim(base_logits, 2, op, "base_logits");
  check_dim(w1, 2, op, "w1");
  check_dim(w2, 2, op, "w2");
  check_dim(hidden, 2, op, "hidden");
  check_dim(conf_w, 1, op, "conf_w");
  a.batch = base_logits.size(0);
  a.vocab = base_logits.size(1);
  a.rank = w1.size(1);
  a.hidden_size = hidden.size(1);
  const std::pair<const at::Tensor*, const char*> floats[] = {
      {&w1, "w1"}, {&w2, "w2"}, {&hidden, "hidden"}, {&conf_w, "conf_w"}};
  for (const auto& [t, name] : floats) {
    check_device(*t, base_logits, op, name);
    check_dtype(*t, base_logits.scalar_type(), op, name);
  }
  TORCH_CHECK(w1.size(0) == a.vocab && w2.size(0) == a.vocab && w2.size(1) == a.rank,
              "flashspark.markov_step: ", "arguments 'w1' and 'w2' must both have shape [V, r] = [", a.vocab, ", ",
              a.rank, "], got ", w1.sizes(), " and ", w2.sizes());
  TORCH_CHECK(a.rank >= 1 && a.rank <= 512, "flashspark.markov_step: argument 'w1' must have rank r in [1, 512], got ",
              a.rank);
  TORCH_CHECK(a.vocab >= 1, "flashspark.markov_step: argument 'base_logits' must have V >= 1 entries per row, got ",
              base_logits.sizes());
  check_fits_int32(a.vocab, op, "base_logits", "V");
  check_fits_int32(a.batch, op, "base_logits", "B");
  check_fits_int32(a.hidden_size + a.rank, op, "hidden", "H + r");
  check_size(hidden, 0, a.batch, op, "hidden", "B");
  check_size(conf_w, 0, a.hidden_size + a.rank, op, "conf_w", "H + r");
  check_device(conf_b, base_logits, op, "conf_b");
  check_float_dtype(conf_b, op, "conf_b");
  TORCH_CHECK(conf_b.numel() == 1 && conf_b.dim() <= 1,
              "flashspark.markov_step: argument 'conf_b' must have shape [1], got ", conf_b.sizes());
  if (bias.has_value()) {
    check_device(*bias, base_logits, op, "bias");
    check_dtype(*bias, base_logits.scalar_type(), op, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == a.vocab,
                "flashspark.markov_step: argument 'bias' must have shape [", a.vocab, "], got ", bias->sizes());
    a.bias = bias->contiguous();
  }
  const std::pair<const at::Tensor*, const char*> per_request[] = {
      {&prev_tokens, "prev_tokens"}, {&temperature, "temperature"}, {&seeds, "seeds"}, {&positions, "positions"}};
  for (const auto& [t, name] : per_request) {
    check_device(*t, base_logits, op, name);
    check_dim(*t, 1, op, name);
    check_size(*t, 0, a.batch, op, name, "B");
  }
  check_dtype(temperature, at::kFloat, op, "temperature");
  check_dtype(seeds, at::kLong, op, "seeds");
  check_dtype(positions, at::kLong, op, "positions");
  a.base_logits = inner_contiguous(base_logits);
  a.prev_tokens = as_index(prev_tokens, at::kInt, op, "prev_tokens");
  a.w1 = w1.contiguous();
  a.w2 = w2.contiguous();
  a.hidden = inner_contiguous(hidden);
  a.conf_w = conf_w.contiguous();
  a.conf_b = conf_b.to(at::kFloat).reshape({1}).contiguous();
  a.temperature = temperature.contiguous();
  a.seeds = seeds.contiguous();
  a.positions = positions.contiguous();
  return a;
}

struct MarkovOutputs {
  at::Tensor tokens, q, conf, workspace;
};

template <class T>
MarkovParams<T> make_markov_params(const MarkovArgs& a, int32_t num_partials, MarkovOutputs& o, int32_t* status) {
  const auto f = a.base_logits.options().dtype(at::kFloat);
  o.tokens = at::empty({a.batch}, a.base_logits.options().dtype(at::kInt));
  o.q = at::empty({a.batch, a.vocab}, f);
  o.conf = at::empty({a.batch}, f);
  o.workspace = at::empty({markov_workspace_floats(num_partials, a.batch)}, f);
  MarkovParams<T> p;
  p.base_logits = reinterpret_cast<const T*>(a.base_logits.const_data_ptr());
  p.u_stride = a.base_logits.stride(0);
  p.prev_tokens = a.prev_tokens.const_data_ptr<int32_t>();
  p.w1 = reinterpret_cast<const T*>(a.w1.const_data_ptr());
  p.w2 = reinterpret_cast<const T*>(a.w2.const_data_ptr());
  if (a.bias.defined()) p.bias = reinterpret_cast<const T*>(a.bias.const_data_ptr());
  p.hidden = reinterpret_cast<const T*>(a.hidden.const_data_ptr());
  p.h_stride = a.hidden.stride(0);
  p.conf_w = reinterpret_cast<const T*>(a.conf_w.const_data_ptr());
  p.conf_b = a.conf_b.const_data_ptr<float>();
  p.temperature = a.temperature.const_data_ptr<float>();
  p.seeds = a.seeds.const_data_ptr<int64_t>();
  p.positions = a.positions.const_data_ptr<int64_t>();
  p.out_tokens = o.tokens.mutable_data_ptr<int32_t>();
  p.out_q = o.q.mutable_data_ptr<float>();
  p.out_conf = o.conf.mutable_data_ptr<float>();
  p.status = status;
  p.partial = o.workspace.mutable_data_ptr<float>();
  p.num_partials = num_partials;
  p.row_stats = p.partial + int64_t(num_partials) * a.batch * kMarkovSlot;
  p.batch = int32_t(a.batch);
  p.vocab = int32_t(a.vocab);
  p.rank = int32_t(a.rank);
  p.hidden_size = int32_t(a.hidden_size);
  return p;
}

}  // namespace flashspark::binding
