// CPU implementations of the flashspark ops. Kernels come from the torch-free
// headers; this file only checks arguments and hands over raw pointers.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "flashspark/cpu/verify.h"
#include "verify_args.h"

namespace flashspark::binding {
namespace {

struct AtenParallelFor {
  template <class F>
  void operator()(int64_t begin, int64_t end, int64_t grain, const F& f) const {
    at::parallel_for(begin, end, grain, f);
  }
};

void verify_out_cpu(const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& cu_num_draft,
                    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_probs_ids,
                    const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets,
                    int64_t max_spec_len, at::Tensor& out_tokens, at::Tensor& out_num_accepted) {
  const VerifyArgs a = check_verify_args(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids,
                                         temperature, seeds, offsets, max_spec_len);
  check_verify_outputs(a, target_logits, out_tokens, out_num_accepted);
  dispatch_logits(a.logits.scalar_type(), [&]<class T>() {
    const VerifyParams<T> p = make_verify_params<T>(a, out_tokens, out_num_accepted);
    const VerifyError e = cpu::verify_check(p, a.num_tokens);
    TORCH_CHECK(e == VerifyError::kOk, "flashspark.verify: ", verify_error_message(e));
    cpu::verify_cpu(p, AtenParallelFor{});
  });
}

std::tuple<at::Tensor, at::Tensor> verify_cpu(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                              const at::Tensor& cu_num_draft,
                                              const std::optional<at::Tensor>& draft_probs,
                                              const std::optional<at::Tensor>& draft_probs_ids,
                                              const at::Tensor& temperature, const at::Tensor& seeds,
                                              const at::Tensor& offsets, int64_t max_spec_len) {
  auto [out_tokens, out_num_accepted] = empty_verify_outputs(target_logits, cu_num_draft, max_spec_len);
  verify_out_cpu(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids, temperature, seeds, offsets,
                 max_spec_len, out_tokens, out_num_accepted);
  return {out_tokens, out_num_accepted};
}

}  // namespace
}  // namespace flashspark::binding

TORCH_LIBRARY_IMPL(flashspark, CPU, m) {
  m.impl("verify", &flashspark::binding::verify_cpu);
  m.impl("verify_out", &flashspark::binding::verify_out_cpu);
}
