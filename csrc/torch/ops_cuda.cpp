// CUDA implementations of the flashspark ops: argument checks, then the
// torch-free launchers from csrc/kernels/*.cu on the current stream. No host
// synchronization: bad values inside device tensors trap in the kernel.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "flashspark/cuda/launch.h"
#include "dflash_args.h"
#include "verify_args.h"

namespace flashspark::binding {
namespace {

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "flashspark.", op, ": CUDA launch failed: ", cudaGetErrorString(err));
}

void verify_out_cuda(const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& cu_num_draft,
                     const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_probs_ids,
                     const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets,
                     int64_t max_spec_len, at::Tensor& out_tokens, at::Tensor& out_num_accepted) {
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const VerifyArgs a = check_verify_args(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids,
                                         temperature, seeds, offsets, max_spec_len);
  check_verify_outputs(a, target_logits, out_tokens, out_num_accepted);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(a.logits.scalar_type(), [&]<class T>() {
    const VerifyParams<T> p = make_verify_params<T>(a, out_tokens, out_num_accepted);
    check_cuda(cuda::launch_verify<T>(p, a.num_tokens, stream), "verify");
  });
}

std::tuple<at::Tensor, at::Tensor> verify_cuda(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                               const at::Tensor& cu_num_draft,
                                               const std::optional<at::Tensor>& draft_probs,
                                               const std::optional<at::Tensor>& draft_probs_ids,
                                               const at::Tensor& temperature, const at::Tensor& seeds,
                                               const at::Tensor& offsets, int64_t max_spec_len) {
  auto [out_tokens, out_num_accepted] = empty_verify_outputs(target_logits, cu_num_draft, max_spec_len);
  verify_out_cuda(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids, temperature, seeds, offsets,
                  max_spec_len, out_tokens, out_num_accepted);
  return {out_tokens, out_num_accepted};
}

at::Tensor block_diffusion_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                          const at::Tensor& ctx_lens, const at::Tensor& k_block,
                                          const at::Tensor& v_block, double scale) {
  const c10::cuda::CUDAGuard guard(q.device());
  const BlockAttnArgs a = check_block_attn_args(q, k_cache, v_cache, ctx_lens, k_block, v_block);
  at::Tensor out = at::empty({a.batch, a.gamma, a.num_q_heads, a.head_dim}, q.options());
  at::Tensor workspace;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(q.scalar_type(), [&]<class T>() {
    const BlockAttnParams<T> p = make_block_attn_params<T>(a, scale, out, workspace);
    check_cuda(cuda::launch_block_diffusion_attention<T>(p, stream), "block_diffusion_attention");
  });
  return out;
}

void inject_context_kv_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
                            const at::Tensor& slots, const at::Tensor& k_norm_weight, const at::Tensor& cos_sin_cache,
                            double eps, at::Tensor& k_cache, at::Tensor& v_cache) {
  const c10::cuda::CUDAGuard guard(k_cache.device());
  const InjectArgs a = check_inject_args(k, v, positions, slots, k_norm_weight, cos_sin_cache, k_cache, v_cache);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_float(k_cache.scalar_type(), [&]<class T>() {
    const InjectParams<T> p = make_inject_params<T>(a, eps, k_cache, v_cache);
    check_cuda(cuda::launch_inject_context_kv<T>(p, stream), "inject_context_kv");
  });
}

}  // namespace
}  // namespace flashspark::binding

TORCH_LIBRARY_IMPL(flashspark, CUDA, m) {
  m.impl("block_diffusion_attention", &flashspark::binding::block_diffusion_attention_cuda);
  m.impl("inject_context_kv", &flashspark::binding::inject_context_kv_cuda);
  m.impl("verify", &flashspark::binding::verify_cuda);
  m.impl("verify_out", &flashspark::binding::verify_out_cuda);
}
