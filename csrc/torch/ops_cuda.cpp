// CUDA implementations of the flashspark ops: argument checks, then the
// torch-free launchers from csrc/kernels/*.cu on the current stream. No host
// synchronization: bad values inside device tensors fail their request alone,
// reported in the optional status tensor (see flashspark.raise_on_status); no
// kernel traps.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "dflash2_args.h"
#include "dflash_args.h"
#include "dspark_args.h"
#include "flashspark/cuda/launch.h"
#include "tree_verify_args.h"
#include "verify_args.h"

namespace flashspark::binding {
namespace {

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "flashspark.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void verify_out_cuda(const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& cu_num_draft,
                     const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_probs_ids,
                     const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets,
                     int64_t max_spec_len, at::Tensor& out_tokens, at::Tensor& out_num_accepted,
                     const std::optional<at::Tensor>& bonus_tokens, bool target_is_probs,
                     const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const VerifyArgs a = check_verify_args(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids,
                                         temperature, seeds, offsets, max_spec_len, bonus_tokens, target_is_probs);
  const NamedTensors all = check_verify_outputs(a, target_logits, out_tokens, out_num_accepted);
  int32_t* st = status_ptr(status, a.batch, target_logits, all, "verify");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(a.logits.scalar_type(), [&]<class T>() {
    VerifyParams<T> p = make_verify_params<T>(a, out_tokens, out_num_accepted, st);
    // scratch for the kernel's (row, chunk) partials; its size depends on sizes only
    const at::Tensor workspace = at::empty({verify_workspace_bytes(a.batch, a.logits.size(0), a.vocab)},
                                           target_logits.options().dtype(at::kByte));
    p.workspace = workspace.mutable_data_ptr();
    check_cuda(cuda::launch_verify<T>(p, a.num_tokens, stream), "verify");
  });
}

void tree_verify_out_cuda(const at::Tensor& target_logits, const at::Tensor& node_tokens, const at::Tensor& parents,
                          const at::Tensor& cu_num_nodes, const at::Tensor& temperature, const at::Tensor& seeds,
                          const at::Tensor& offsets, int64_t max_depth, at::Tensor& out_accepted_nodes,
                          at::Tensor& out_tokens, at::Tensor& out_num_accepted, bool target_is_probs,
                          const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const TreeVerifyArgs a = check_tree_verify_args(target_logits, node_tokens, parents, cu_num_nodes, temperature, seeds,
                                                  offsets, max_depth, target_is_probs);
  const NamedTensors all =
      check_tree_verify_outputs(a, target_logits, out_accepted_nodes, out_tokens, out_num_accepted);
  int32_t* st = status_ptr(status, a.batch, target_logits, all, "tree_verify");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(a.logits.scalar_type(), [&]<class T>() {
    TreeVerifyParams<T> p = make_tree_verify_params<T>(a, out_accepted_nodes, out_tokens, out_num_accepted, st);
    // partials, walks, depths and child lists; the size depends on sizes only
    const at::Tensor workspace = at::empty({tree_verify_workspace_bytes(a.batch, a.num_nodes, a.vocab)},
                                           target_logits.options().dtype(at::kByte));
    p.workspace = workspace.mutable_data_ptr();
    check_cuda(cuda::launch_tree_verify<T>(p, stream), "tree_verify");
  });
}

at::Tensor block_diffusion_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& ctx_lens, const at::Tensor& k_block,
                                          const at::Tensor& v_block, double scale,
                                          const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(q.device());
  const BlockAttnArgs a = check_block_attn_args(q, k_cache, v_cache, ctx_lens, k_block, v_block, scale);
  int32_t* st = status_ptr(status, a.batch, q, a.all, "block_diffusion_attention");
  at::Tensor out = at::empty({a.batch, a.gamma, a.num_q_heads, a.head_dim}, q.options());
  at::Tensor workspace;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(q.scalar_type(), [&]<class T>() {
    const BlockAttnParams<T> p = make_block_attn_params<T>(a, scale, out, workspace, st);
    check_cuda(cuda::launch_block_diffusion_attention<T>(p, stream), "block_diffusion_attention");
  });
  return out;
}

void inject_context_kv_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                            const at::Tensor& slots, const at::Tensor& k_norm_weight, const at::Tensor& cos_sin_cache,
                            double eps, at::Tensor& k_cache, at::Tensor& v_cache,
                            const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const InjectArgs a = check_inject_args(k, v, positions, slots, k_norm_weight, cos_sin_cache, eps, k_cache, v_cache);
  int32_t* st = status_ptr(status, k.size(0), k_cache, a.all, "inject_context_kv");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(k_cache.scalar_type(), [&]<class T>() {
    const InjectParams<T> p = make_inject_params<T>(a, eps, k_cache, v_cache, st);
    check_cuda(cuda::launch_inject_context_kv<T>(p, stream), "inject_context_kv");
  });
}

at::Tensor two_tap_conv_cuda(const at::Tensor& x, const at::Tensor& base, const std::optional<at::Tensor>& delta,
                             int64_t block_size, const std::optional<at::Tensor>& cu_blocks,
                             const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& delta_weight,
                             const std::optional<at::Tensor>& norm_weight, double norm_eps, int64_t group_size,
                             const std::optional<at::Tensor>& finish_delta, const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(x.device());
  TwoTapArgs a = check_two_tap_args(x, base, delta, block_size, cu_blocks, residual, delta_weight, norm_weight,
                                    norm_eps, group_size, finish_delta);
  int32_t* st = status_ptr(status, 1, x, a.all, "two_tap_conv");
  // The conv kernel reads the offsets' check from a status entry: the caller's, or ours.
  at::Tensor own_status;
  if (!st && a.cu_blocks.defined()) {
    own_status = at::empty({1}, x.options().dtype(at::kInt));
    st = own_status.mutable_data_ptr<int32_t>();
  }
  // The conv's taps computed from delta_weight, one fp32 row [2G] per row of x, between the two kernels (the
  // finish conv's taps of a 4G-row weight go straight to finish_delta).
  if (a.delta_weight.defined()) a.delta_ws = at::empty({a.rows, 2 * a.groups}, x.options().dtype(at::kFloat));
  // The fused RMSNorm's scale of each row, computed first.
  if (a.norm_weight.defined()) a.row_scale_ws = at::empty({a.rows}, x.options().dtype(at::kFloat));
  at::Tensor out = at::empty(x.sizes(), x.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(x.scalar_type(), [&]<class T>() {
    check_cuda(cuda::launch_two_tap_conv<T>(make_two_tap_params<T>(a, out, st), stream), "two_tap_conv");
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_select_cuda(const at::Tensor& logits, int64_t k) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const TopKArgs a = check_topk_args(logits, k);
  at::Tensor values = at::empty(a.out_shape, logits.options().dtype(at::kFloat));
  at::Tensor ids = at::empty(a.out_shape, logits.options().dtype(at::kInt));
  at::Tensor lse =
      at::empty(at::IntArrayRef(a.out_shape).slice(0, a.out_shape.size() - 1), logits.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(logits.scalar_type(), [&]<class T>() {
    check_cuda(cuda::launch_topk_select<T>(make_topk_params<T>(a, values, ids, lse), stream), "topk_select");
  });
  return {values, ids, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> path_select_cuda(
    const at::Tensor& cand_ids, const at::Tensor& unary, const at::Tensor& a_emb, const at::Tensor& b_emb,
    const std::optional<at::Tensor>& g, const at::Tensor& anchor, c10::string_view mode, const at::Tensor& temperature,
    const at::Tensor& seeds, const at::Tensor& offsets, const std::optional<at::Tensor>& hidden,
    const std::optional<at::Tensor>& g_weight, const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(cand_ids.device());
  const PathArgs a = check_path_args(cand_ids, unary, a_emb, b_emb, g, anchor, std::string(mode), temperature, seeds,
                                     offsets, hidden, g_weight);
  int32_t* st = status_ptr(status, a.requests, cand_ids, a.all, "path_select");
  PathOutputs o = empty_path_outputs(a);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(a_emb.scalar_type(), [&]<class T>() {
    check_cuda(cuda::launch_path_select<T>(make_path_params<T>(a, o, st), stream), "path_select");
  });
  return {o.tokens, o.choice, o.scores, o.q};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> markov_step_cuda(
    const at::Tensor& base_logits, const at::Tensor& prev_tokens, const at::Tensor& w1, const at::Tensor& w2,
    const std::optional<at::Tensor>& bias, const at::Tensor& hidden, const at::Tensor& conf_w, const at::Tensor& conf_b,
    const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& positions,
    const std::optional<at::Tensor>& status) {
  const c10::cuda::CUDAGuard guard(base_logits.device());
  const MarkovArgs a =
      check_markov_args(base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions);
  TORCH_CHECK(a.batch <= 256, "flashspark.markov_step: argument 'base_logits' has ", a.batch,
              " requests; the CUDA kernel takes at most 256 per call");
  int32_t* st = status_ptr(status, a.batch, base_logits, a.all, "markov_step");
  MarkovOutputs o;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(base_logits.scalar_type(), [&]<class T>() {
    const MarkovParams<T> p = make_markov_params<T>(a, cuda::markov_num_partials(a.vocab), o, st);
    check_cuda(cuda::launch_markov_step<T>(p, stream), "markov_step");
  });
  return {o.tokens, o.q, o.conf};
}

}  // namespace
}  // namespace flashspark::binding

TORCH_LIBRARY_IMPL(flashspark, CUDA, m) {
  m.impl("markov_step", &flashspark::binding::markov_step_cuda);
  m.impl("two_tap_conv", &flashspark::binding::two_tap_conv_cuda);
  m.impl("topk_select", &flashspark::binding::topk_select_cuda);
  m.impl("path_select", &flashspark::binding::path_select_cuda);
  m.impl("block_diffusion_attention", &flashspark::binding::block_diffusion_attention_cuda);
  m.impl("inject_context_kv", &flashspark::binding::inject_context_kv_cuda);
  m.impl("verify", &flashspark::binding::verify_functional<flashspark::binding::verify_out_cuda>);
  m.impl("verify_out", &flashspark::binding::verify_out_cuda);
  m.impl("tree_verify", &flashspark::binding::tree_verify_functional<flashspark::binding::tree_verify_out_cuda>);
  m.impl("tree_verify_out", &flashspark::binding::tree_verify_out_cuda);
}
