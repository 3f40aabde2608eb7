// CPU implementations of the flashspark ops. Kernels come from the torch-free
// headers; this file only checks arguments and hands over raw pointers.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "dflash2_args.h"
#include "dflash_args.h"
#include "dspark_args.h"
#include "flashspark/cpu/dflash.h"
#include "flashspark/cpu/dflash2.h"
#include "flashspark/cpu/dspark.h"
#include "flashspark/cpu/tree_verify.h"
#include "flashspark/cpu/verify.h"
#include "tree_verify_args.h"
#include "verify_args.h"

namespace flashspark::binding {
namespace {

struct AtenParallelFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    at::parallel_for(begin, end, grain, f);
  }
};

// Every op: argument checks; then, without a caller's status tensor, the value checks
// raise before anything is written (CpuStatus / raise_before_launch); with one, each
// failed item is reported there and takes its failed outputs, as on CUDA.

void verify_out_cpu(const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& cu_num_draft,
                    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_probs_ids,
                    const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets,
                    int64_t max_spec_len, at::Tensor& out_tokens, at::Tensor& out_num_accepted,
                    const std::optional<at::Tensor>& bonus_tokens, bool target_is_probs,
                    const std::optional<at::Tensor>& status) {
  const VerifyArgs a = check_verify_args(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids,
                                         temperature, seeds, offsets, max_spec_len, bonus_tokens, target_is_probs);
  const NamedTensors all = check_verify_outputs(a, target_logits, out_tokens, out_num_accepted);
  const CpuStatus st(status_ptr(status, a.batch, target_logits, all, "verify"), a.batch);
  dispatch_float(a.logits.scalar_type(), [&]<class T>() {
    const VerifyParams<T> p = make_verify_params<T>(a, out_tokens, out_num_accepted, st.ptr);
    raise_before_launch(
        st, a.batch, [&](int64_t b) { return verify_check_request(p, int32_t(b), a.num_tokens); }, "verify");
    cpu::verify_cpu(p, a.num_tokens, AtenParallelFor{});
  });
  st.raise_if_failed("verify");  // what only the walk sees: non-finite logits, bad dense q
}

void tree_verify_out_cpu(const at::Tensor& target_logits, const at::Tensor& node_tokens, const at::Tensor& parents,
                         const at::Tensor& cu_num_nodes, const at::Tensor& temperature, const at::Tensor& seeds,
                         const at::Tensor& offsets, int64_t max_depth, at::Tensor& out_accepted_nodes,
                         at::Tensor& out_tokens, at::Tensor& out_num_accepted, bool target_is_probs,
                         const std::optional<at::Tensor>& status) {
  constexpr const char* op = "tree_verify";
  const TreeVerifyArgs a = check_tree_verify_args(target_logits, node_tokens, parents, cu_num_nodes, temperature, seeds,
                                                  offsets, max_depth, target_is_probs);
  const NamedTensors all =
      check_tree_verify_outputs(a, target_logits, out_accepted_nodes, out_tokens, out_num_accepted);
  const CpuStatus st(status_ptr(status, a.batch, target_logits, all, op), a.batch);
  std::vector<int32_t> scratch(2 * size_t(a.num_nodes));  // depths, then the stop nodes' child lists
  dispatch_float(a.logits.scalar_type(), [&]<class T>() {
    TreeVerifyParams<T> p = make_tree_verify_params<T>(a, out_accepted_nodes, out_tokens, out_num_accepted, st.ptr);
    p.scratch = scratch.data();
    raise_before_launch(st, a.batch, [&](int64_t b) { return tree_check_request(p, int32_t(b)); }, op);
    cpu::tree_verify_cpu(p, AtenParallelFor{});
  });
  st.raise_if_failed(op);  // what only the walk sees: non-finite logits, bad probabilities
}

at::Tensor block_diffusion_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& ctx_lens, const at::Tensor& k_block,
                                         const at::Tensor& v_block, double scale,
                                         const std::optional<at::Tensor>& status) {
  constexpr const char* op = "block_diffusion_attention";
  const BlockAttnArgs a = check_block_attn_args(q, k_cache, v_cache, ctx_lens, k_block, v_block, scale);
  const CpuStatus st(status_ptr(status, a.batch, q, a.all, op), a.batch);
  at::Tensor out = at::empty({a.batch, a.gamma, a.num_q_heads, a.head_dim}, q.options());
  at::Tensor workspace;
  dispatch_float(q.scalar_type(), [&]<class T>() {
    const BlockAttnParams<T> p = make_block_attn_params<T>(a, scale, out, workspace, st.ptr);
    raise_before_launch(st, a.batch, [&](int64_t b) { return block_attn_check_request(p, int32_t(b)); }, op);
    cpu::block_diffusion_attention_cpu(p, AtenParallelFor{});
  });
  return out;
}

void inject_context_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                           const at::Tensor& slots, const at::Tensor& k_norm_weight, const at::Tensor& cos_sin_cache,
                           double eps, at::Tensor& k_cache, at::Tensor& v_cache,
                           const std::optional<at::Tensor>& status) {
  constexpr const char* op = "inject_context_kv";
  const InjectArgs a = check_inject_args(k, v, positions, slots, k_norm_weight, cos_sin_cache, eps, k_cache, v_cache);
  const CpuStatus st(status_ptr(status, k.size(0), k_cache, a.all, op), k.size(0));
  dispatch_float(k_cache.scalar_type(), [&]<class T>() {
    const InjectParams<T> p = make_inject_params<T>(a, eps, k_cache, v_cache, st.ptr);
    raise_before_launch(st, p.num_tokens, [&](int64_t i) { return inject_check_token(p, int32_t(i)); }, op);
    cpu::inject_context_kv_cpu(p, AtenParallelFor{});
  });
}

at::Tensor two_tap_conv_cpu(const at::Tensor& x, const at::Tensor& base, const std::optional<at::Tensor>& delta,
                            int64_t block_size, const std::optional<at::Tensor>& cu_blocks,
                            const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& delta_weight,
                            const std::optional<at::Tensor>& norm_weight, double norm_eps, int64_t group_size,
                            const std::optional<at::Tensor>& finish_delta, const std::optional<at::Tensor>& status) {
  constexpr const char* op = "two_tap_conv";
  const TwoTapArgs a = check_two_tap_args(x, base, delta, block_size, cu_blocks, residual, delta_weight, norm_weight,
                                          norm_eps, group_size, finish_delta);
  const CpuStatus st(status_ptr(status, 1, x, a.all, op), 1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float(x.scalar_type(), [&]<class T>() {
    const TwoTapParams<T> p = make_two_tap_params<T>(a, out, st.ptr);
    raise_before_launch(st, 1, [&](int64_t) { return two_tap_check_blocks(p); }, op);
    cpu::two_tap_conv_cpu(p, AtenParallelFor{});
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_select_cpu(const at::Tensor& logits, int64_t k) {
  const TopKArgs a = check_topk_args(logits, k);
  at::Tensor values = at::empty(a.out_shape, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(a.out_shape, logits.options().dtype(at::kInt));
  at::Tensor lse =
      at::empty(at::IntArrayRef(a.out_shape).slice(0, a.out_shape.size() - 1), logits.options().dtype(at::kFloat));
  dispatch_float(logits.scalar_type(),
                 [&]<class T>() { cpu::topk_select_cpu(make_topk_params<T>(a, values, ids, lse), AtenParallelFor{}); });
  return {values, ids, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> path_select_cpu(
    const at::Tensor& cand_ids, const at::Tensor& unary, const at::Tensor& a_emb, const at::Tensor& b_emb,
    const std::optional<at::Tensor>& g, const at::Tensor& anchor, c10::string_view mode, const at::Tensor& temperature,
    const at::Tensor& seeds, const at::Tensor& offsets, const std::optional<at::Tensor>& hidden,
    const std::optional<at::Tensor>& g_weight, const std::optional<at::Tensor>& status) {
  constexpr const char* op = "path_select";
  const PathArgs a = check_path_args(cand_ids, unary, a_emb, b_emb, g, anchor, std::string(mode), temperature, seeds,
                                     offsets, hidden, g_weight);
  const CpuStatus st(status_ptr(status, a.requests, cand_ids, a.all, op), a.requests);
  PathOutputs o = empty_path_outputs(a);
  dispatch_float(a_emb.scalar_type(), [&]<class T>() {
    const PathParams<T> p = make_path_params<T>(a, o, st.ptr);
    raise_before_launch(st, a.requests, [&](int64_t r) { return path_check_request(p, int32_t(r)); }, op);
    cpu::path_select_cpu(p, AtenParallelFor{});
  });
  return {o.tokens, o.choice, o.scores, o.q};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> markov_step_cpu(
    const at::Tensor& base_logits, const at::Tensor& prev_tokens, const at::Tensor& w1, const at::Tensor& w2,
    const std::optional<at::Tensor>& bias, const at::Tensor& hidden, const at::Tensor& conf_w, const at::Tensor& conf_b,
    const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& positions,
    const std::optional<at::Tensor>& status) {
  constexpr const char* op = "markov_step";
  const MarkovArgs a =
      check_markov_args(base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions);
  const CpuStatus st(status_ptr(status, a.batch, base_logits, a.all, op), a.batch);
  MarkovOutputs o;
  dispatch_float(base_logits.scalar_type(), [&]<class T>() {
    const MarkovParams<T> p = make_markov_params<T>(a, cpu::markov_num_partials_cpu(a.vocab), o, st.ptr);
    raise_before_launch(st, a.batch, [&](int64_t b) { return markov_check_request(p, int32_t(b)); }, op);
    cpu::markov_step_cpu(p, AtenParallelFor{});
  });
  return {o.tokens, o.q, o.conf};
}

}  // namespace
}  // namespace flashspark::binding

TORCH_LIBRARY_IMPL(flashspark, CPU, m) {
  m.impl("markov_step", &flashspark::binding::markov_step_cpu);
  m.impl("two_tap_conv", &flashspark::binding::two_tap_conv_cpu);
  m.impl("topk_select", &flashspark::binding::topk_select_cpu);
  m.impl("path_select", &flashspark::binding::path_select_cpu);
  m.impl("block_diffusion_attention", &flashspark::binding::block_diffusion_attention_cpu);
  m.impl("inject_context_kv", &flashspark::binding::inject_context_kv_cpu);
  m.impl("verify", &flashspark::binding::verify_functional<flashspark::binding::verify_out_cpu>);
  m.impl("verify_out", &flashspark::binding::verify_out_cpu);
  m.impl("tree_verify", &flashspark::binding::tree_verify_functional<flashspark::binding::tree_verify_out_cpu>);
  m.impl("tree_verify_out", &flashspark::binding::tree_verify_out_cpu);
}
