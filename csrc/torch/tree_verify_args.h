// Argument checking and TreeVerifyParams assembly for `tree_verify`, shared by the CPU and CUDA
// registrations. Host-side metadata checks only (dtype, device, rank, shapes): they never read
// device memory.
#pragma once

#include <optional>

#include "checks.h"
#include "flashspark/tree_verify.h"

namespace flashspark::binding {

// The one bound on max_depth: the output width is max_depth + 1 per request.
constexpr int64_t kMaxTreeDepth = 4096;

struct TreeVerifyArgs {
  at::Tensor logits, node_tokens, parents, cu_num_nodes, temperature, seeds, offsets;
  bool target_probs = false;
  NamedTensors all;  // every argument as given, for the outputs' overlap checks
  int32_t batch = 0, vocab = 0, num_nodes = 0, max_depth = 0;
};

inline TreeVerifyArgs check_tree_verify_args(const at::Tensor& target_logits, const at::Tensor& node_tokens,
                                             const at::Tensor& parents, const at::Tensor& cu_num_nodes,
                                             const at::Tensor& temperature, const at::Tensor& seeds,
                                             const at::Tensor& offsets, int64_t max_depth, bool target_is_probs) {
  constexpr const char* op = "tree_verify";
  TreeVerifyArgs a;
  a.target_probs = target_is_probs;
  a.all = {{target_logits, "target_logits"},
           {node_tokens, "node_tokens"},
           {parents, "parents"},
           {cu_num_nodes, "cu_num_nodes"},
           {temperature, "temperature"},
           {seeds, "seeds"},
           {offsets, "offsets"}};
  check_dim(target_logits, 2, op, "target_logits");
  check_float_dtype(target_logits, op, "target_logits");
  check_int_range(max_depth, 0, kMaxTreeDepth, op, "max_depth");
  a.logits = inner_contiguous(target_logits);  // rows may be strided, entries not
  TORCH_CHECK(a.logits.size(1) > 0 && a.logits.size(1) < (int64_t(1) << 31),
              "flashspark.tree_verify: argument 'target_logits' has an empty or too large vocabulary");
  const std::pair<const at::Tensor*, const char*> index[] = {
      {&node_tokens, "node_tokens"}, {&parents, "parents"}, {&cu_num_nodes, "cu_num_nodes"}};
  for (const auto& [t, name] : index) {
    check_dim(*t, 1, op, name);
    check_device(*t, target_logits, op, name);
  }
  TORCH_CHECK(cu_num_nodes.numel() >= 1, "flashspark.tree_verify: argument 'cu_num_nodes' must have B+1 >= 1 entries");
  check_fits_int32(node_tokens.numel(), op, "node_tokens", "N");
  check_fits_int32(cu_num_nodes.numel() - 1, op, "cu_num_nodes", "B");
  TORCH_CHECK(parents.numel() == node_tokens.numel(),
              "flashspark.tree_verify: argument 'parents' must have N = ", node_tokens.numel(),
              " entries (one per node), got ", parents.numel());
  TORCH_CHECK(a.logits.size(0) == node_tokens.numel(),
              "flashspark.tree_verify: argument 'target_logits' must have one row per node (N = ", node_tokens.numel(),
              "), got ", a.logits.size(0));
  a.node_tokens = as_index(node_tokens, at::kInt, op, "node_tokens");
  a.parents = as_index(parents, at::kInt, op, "parents");
  a.cu_num_nodes = as_index(cu_num_nodes, at::kInt, op, "cu_num_nodes");
  a.batch = int32_t(cu_num_nodes.numel() - 1);
  a.num_nodes = int32_t(node_tokens.numel());
  a.vocab = int32_t(a.logits.size(1));
  a.max_depth = int32_t(max_depth);
  const std::pair<const at::Tensor*, const char*> per_request[] = {
      {&temperature, "temperature"}, {&seeds, "seeds"}, {&offsets, "offsets"}};
  for (const auto& [t, name] : per_request) {
    check_dim(*t, 1, op, name);
    check_device(*t, target_logits, op, name);
    TORCH_CHECK(t->numel() == a.batch, "flashspark.tree_verify: argument '", name, "' must have B = ", a.batch,
                " entries, got ", t->numel());
  }
  TORCH_CHECK(temperature.scalar_type() == at::kFloat,
              "flashspark.tree_verify: argument 'temperature' must be float32, got ", temperature.scalar_type());
  TORCH_CHECK(seeds.scalar_type() == at::kLong, "flashspark.tree_verify: argument 'seeds' must be int64, got ",
              seeds.scalar_type());
  TORCH_CHECK(offsets.scalar_type() == at::kLong, "flashspark.tree_verify: argument 'offsets' must be int64, got ",
              offsets.scalar_type());
  a.temperature = temperature.contiguous();
  a.seeds = seeds.contiguous();
  a.offsets = offsets.contiguous();
  return a;
}

// Returns every argument, outputs included, for the status output's overlap check.
inline NamedTensors check_tree_verify_outputs(const TreeVerifyArgs& a, const at::Tensor& logits,
                                              const at::Tensor& out_nodes, const at::Tensor& out_tokens,
                                              const at::Tensor& out_num_accepted) {
  constexpr const char* op = "tree_verify";
  const std::pair<const at::Tensor*, const char*> outs[] = {
      {&out_nodes, "out_accepted_nodes"}, {&out_tokens, "out_tokens"}, {&out_num_accepted, "out_num_accepted"}};
  for (const auto& [t, name] : outs) {
    check_device(*t, logits, op, name);
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "flashspark.tree_verify: argument '", name,
                "' must be contiguous int32");
  }
  for (const at::Tensor* t : {&out_nodes, &out_tokens})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == a.batch && t->size(1) == a.max_depth + 1,
                "flashspark.tree_verify: arguments 'out_accepted_nodes' and 'out_tokens' must have shape [", a.batch,
                ", ", a.max_depth + 1, "], got ", t->sizes());
  TORCH_CHECK(out_num_accepted.dim() == 1 && out_num_accepted.size(0) == a.batch,
              "flashspark.tree_verify: argument 'out_num_accepted' must have shape [", a.batch, "], got ",
              out_num_accepted.sizes());
  NamedTensors all = with_outputs(
      a.all, {{out_nodes, "out_accepted_nodes"}, {out_tokens, "out_tokens"}, {out_num_accepted, "out_num_accepted"}});
  for (const auto& [t, name] : outs) check_writable(*t, name, all, op);
  return all;
}

// Outputs of the functional `tree_verify`: [B, max_depth + 1] node ids and tokens, [B] counts,
// int32, on the logits' device. Shapes depend only on sizes.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_tree_verify_outputs(const at::Tensor& target_logits,
                                                                                const at::Tensor& cu_num_nodes,
                                                                                int64_t max_depth) {
  TORCH_CHECK(cu_num_nodes.dim() == 1 && cu_num_nodes.numel() >= 1,
              "flashspark.tree_verify: argument 'cu_num_nodes' must be 1-D with B+1 >= 1 entries");
  check_int_range(max_depth, 0, kMaxTreeDepth, "tree_verify", "max_depth");
  const int64_t batch = cu_num_nodes.numel() - 1;
  const auto opts = target_logits.options().dtype(at::kInt);
  return {at::empty({batch, max_depth + 1}, opts), at::empty({batch, max_depth + 1}, opts), at::empty({batch}, opts)};
}

using TreeVerifyOutFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&,
                                 at::Tensor&, at::Tensor&, bool, const std::optional<at::Tensor>&);

// The functional `tree_verify` of a backend: allocate the outputs, run its tree_verify_out.
template <TreeVerifyOutFn tree_verify_out>
std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_verify_functional(
    const at::Tensor& target_logits, const at::Tensor& node_tokens, const at::Tensor& parents,
    const at::Tensor& cu_num_nodes, const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets,
    int64_t max_depth, bool target_is_probs, const std::optional<at::Tensor>& status) {
  auto [nodes, tokens, num_accepted] = empty_tree_verify_outputs(target_logits, cu_num_nodes, max_depth);
  tree_verify_out(target_logits, node_tokens, parents, cu_num_nodes, temperature, seeds, offsets, max_depth, nodes,
                  tokens, num_accepted, target_is_probs, status);
  return {nodes, tokens, num_accepted};
}

template <class T>
TreeVerifyParams<T> make_tree_verify_params(const TreeVerifyArgs& a, at::Tensor& out_nodes, at::Tensor& out_tokens,
                                            at::Tensor& out_num_accepted, int32_t* status) {
  TreeVerifyParams<T> p;
  p.logits = reinterpret_cast<const T*>(a.logits.const_data_ptr());
  p.logits_row_stride = a.logits.stride(0);
  p.node_tokens = a.node_tokens.const_data_ptr<int32_t>();
  p.parents = a.parents.const_data_ptr<int32_t>();
  p.cu_num_nodes = a.cu_num_nodes.const_data_ptr<int32_t>();
  p.temperature = a.temperature.const_data_ptr<float>();
  p.seeds = a.seeds.const_data_ptr<int64_t>();
  p.offsets = a.offsets.const_data_ptr<int64_t>();
  p.out_nodes = out_nodes.mutable_data_ptr<int32_t>();
  p.out_tokens = out_tokens.mutable_data_ptr<int32_t>();
  p.out_num_accepted = out_num_accepted.mutable_data_ptr<int32_t>();
  p.status = status;
  p.target_probs = a.target_probs;
  p.batch = a.batch;
  p.vocab = a.vocab;
  p.num_nodes = a.num_nodes;
  p.max_depth = a.max_depth;
  return p;
}

}  // namespace flashspark::binding
