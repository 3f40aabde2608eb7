// The one TORCH_LIBRARY of flashspark: every op's schema lives here. The
// backends register implementations in their own TORCH_LIBRARY_IMPL blocks
// (ops_cpu.cpp, ops_cuda.cpp).
#include <Python.h>
#include <torch/library.h>

#include "checks.h"

namespace {
std::string flashspark_status_message(int64_t code) {
  if (code < 0 || code > flashspark::binding::kInt32Max) return "invalid input";
  return flashspark::binding::status_message(flashspark::Status(int32_t(code)));
}
}  // namespace

extern "C" {
// Importing flashspark._C only runs the static registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(flashspark, m) {
  m.def(
      "verify(Tensor target_logits, Tensor draft_tokens, Tensor cu_num_draft, Tensor? draft_probs, "
      "Tensor? draft_probs_ids, Tensor temperature, Tensor seeds, Tensor offsets, int max_spec_len, *, "
      "Tensor? bonus_tokens=None, bool target_is_probs=False, Tensor(a!)? status=None) -> (Tensor, Tensor)");
  m.def(
      "verify_out(Tensor target_logits, Tensor draft_tokens, Tensor cu_num_draft, Tensor? draft_probs, "
      "Tensor? draft_probs_ids, Tensor temperature, Tensor seeds, Tensor offsets, int max_spec_len, *, "
      "Tensor(a!) out_tokens, Tensor(b!) out_num_accepted, Tensor? bonus_tokens=None, bool target_is_probs=False, "
      "Tensor(c!)? status=None) -> ()");
  m.def(
      "tree_verify(Tensor target_logits, Tensor node_tokens, Tensor parents, Tensor cu_num_nodes, "
      "Tensor temperature, Tensor seeds, Tensor offsets, int max_depth, *, bool target_is_probs=False, "
      "Tensor(a!)? status=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "tree_verify_out(Tensor target_logits, Tensor node_tokens, Tensor parents, Tensor cu_num_nodes, "
      "Tensor temperature, Tensor seeds, Tensor offsets, int max_depth, *, Tensor(a!) out_accepted_nodes, "
      "Tensor(b!) out_tokens, Tensor(c!) out_num_accepted, bool target_is_probs=False, Tensor(d!)? status=None) -> ()");
  m.def(
      "block_diffusion_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor ctx_lens, Tensor k_block, "
      "Tensor v_block, float scale, *, Tensor(a!)? status=None) -> Tensor");
  m.def(
      "inject_context_kv(Tensor k, Tensor v, Tensor positions, Tensor slots, Tensor k_norm_weight, "
      "Tensor cos_sin_cache, float eps, Tensor(a!) k_cache, Tensor(b!) v_cache, *, Tensor(c!)? status=None) -> ()");
  m.def(
      "two_tap_conv(Tensor x, Tensor base, Tensor? delta, int block_size, Tensor? cu_blocks, Tensor? residual, "
      "Tensor? delta_weight=None, Tensor? norm_weight=None, float norm_eps=1e-6, int group_size=16, "
      "Tensor(a!)? finish_delta=None, *, Tensor(b!)? status=None) -> Tensor");
  m.def("topk_select(Tensor logits, int k) -> (Tensor, Tensor, Tensor)");
  m.def(
      "path_select(Tensor cand_ids, Tensor unary, Tensor a_emb, Tensor b_emb, Tensor? g, Tensor anchor, str path_mode, "
      "Tensor temperature, Tensor seeds, Tensor offsets, Tensor? hidden=None, Tensor? g_weight=None, *, "
      "Tensor(a!)? status=None) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "markov_step(Tensor base_logits, Tensor prev_tokens, Tensor w1, Tensor w2, Tensor? bias, Tensor hidden, "
      "Tensor conf_w, Tensor conf_b, Tensor temperature, Tensor seeds, Tensor positions, *, Tensor(a!)? status=None) "
      "-> (Tensor, Tensor, Tensor)");
  // The message of a status code, as the CPU binding raises it (for raise_on_status).
  m.def("status_message(int code) -> str", &flashspark_status_message);
}
