// Argument checking and VerifyParams assembly for `verify`, shared by the CPU
// and CUDA registrations. Checks here are host-side metadata checks only
// (dtype, device, rank, shapes): they never read device memory.
#pragma once

#include <optional>

#include "checks.h"
#include "flashspark/verify.h"

namespace flashspark::binding {

inline at::Tensor as_int32(const at::Tensor& t, const char* name) { return as_index(t, at::kInt, "verify", name); }
inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  binding::check_device(t, ref, "verify", name);
}
inline void check_dim(const at::Tensor& t, int64_t dim, const char* name) {
  binding::check_dim(t, dim, "verify", name);
}

// The one bound on max_spec_len: the output width is max_spec_len + 1 per request.
constexpr int64_t kMaxSpecLen = 4096;

// Tensors kept alive for the duration of the launch (converted copies).
struct VerifyArgs {
  at::Tensor logits, draft_tokens, cu_num_draft, q_probs, q_ids, temperature, seeds, offsets, bonus_tokens;
  DraftQ q_mode = DraftQ::kOneHot;
  bool target_probs = false;
  NamedTensors all;  // every argument as given, for the outputs' overlap checks
  int32_t batch = 0, vocab = 0, num_tokens = 0, num_candidates = 0, max_spec_len = 0;
};

inline VerifyArgs check_verify_args(const at::Tensor& target_logits, const at::Tensor& draft_tokens,
                                    const at::Tensor& cu_num_draft, const std::optional<at::Tensor>& draft_probs,
                                    const std::optional<at::Tensor>& draft_probs_ids, const at::Tensor& temperature,
                                    const at::Tensor& seeds, const at::Tensor& offsets, int64_t max_spec_len,
                                    const std::optional<at::Tensor>& bonus_tokens, bool target_is_probs) {
  VerifyArgs a;
  a.target_probs = target_is_probs;
  a.all = {{target_logits, "target_logits"},
           {draft_tokens, "draft_tokens"},
           {cu_num_draft, "cu_num_draft"},
           {temperature, "temperature"},
           {seeds, "seeds"},
           {offsets, "offsets"}};
  if (draft_probs.has_value()) a.all.push_back({*draft_probs, "draft_probs"});
  if (draft_probs_ids.has_value()) a.all.push_back({*draft_probs_ids, "draft_probs_ids"});
  if (bonus_tokens.has_value()) a.all.push_back({*bonus_tokens, "bonus_tokens"});
  check_dim(target_logits, 2, "target_logits");
  check_float_dtype(target_logits, "verify", "target_logits");
  check_int_range(max_spec_len, 0, kMaxSpecLen, "verify", "max_spec_len");
  // Rows may be strided (a slice of a larger logits buffer); entries must not.
  a.logits = inner_contiguous(target_logits);
  TORCH_CHECK(a.logits.size(1) > 0 && a.logits.size(1) < (int64_t(1) << 31),
              "flashspark.verify: argument 'target_logits' has an empty or too large vocabulary");
  check_dim(draft_tokens, 1, "draft_tokens");
  check_dim(cu_num_draft, 1, "cu_num_draft");
  check_device(draft_tokens, target_logits, "draft_tokens");
  check_device(cu_num_draft, target_logits, "cu_num_draft");
  a.draft_tokens = as_int32(draft_tokens, "draft_tokens");
  a.cu_num_draft = as_int32(cu_num_draft, "cu_num_draft");
  TORCH_CHECK(cu_num_draft.numel() >= 1, "flashspark.verify: argument 'cu_num_draft' must have B+1 >= 1 entries");
  check_fits_int32(draft_tokens.numel(), "verify", "draft_tokens", "T");
  check_fits_int32(cu_num_draft.numel() - 1, "verify", "cu_num_draft", "B");
  a.batch = int32_t(cu_num_draft.numel() - 1);
  a.num_tokens = int32_t(draft_tokens.numel());
  a.vocab = int32_t(a.logits.size(1));
  a.max_spec_len = int32_t(max_spec_len);
  if (bonus_tokens.has_value()) {  // the caller's bonus tokens: no bonus rows in the logits
    check_dim(*bonus_tokens, 1, "bonus_tokens");
    check_device(*bonus_tokens, target_logits, "bonus_tokens");
    TORCH_CHECK(bonus_tokens->numel() == a.batch, "flashspark.verify: argument 'bonus_tokens' must have B = ", a.batch,
                " entries, got ", bonus_tokens->numel());
    a.bonus_tokens = as_int32(*bonus_tokens, "bonus_tokens");
    TORCH_CHECK(a.logits.size(0) == int64_t(a.num_tokens),
                "flashspark.verify: argument 'target_logits' must have one row per draft token (", a.num_tokens,
                ") when 'bonus_tokens' is given, got ", a.logits.size(0));
  } else {
    TORCH_CHECK(a.logits.size(0) == int64_t(a.num_tokens) + a.batch,
                "flashspark.verify: argument 'target_logits' must have ",
                "one row per draft token plus one bonus row per request (", a.num_tokens, " + ", a.batch, " = ",
                a.num_tokens + a.batch, "), got ", a.logits.size(0));
  }

  const std::pair<const at::Tensor*, const char*> per_request[] = {
      {&temperature, "temperature"}, {&seeds, "seeds"}, {&offsets, "offsets"}};
  for (const auto& [t, name] : per_request) {
    check_dim(*t, 1, name);
    check_device(*t, target_logits, name);
    TORCH_CHECK(t->numel() == a.batch, "flashspark.verify: argument '", name, "' must have B = ", a.batch,
                " entries, got ", t->numel());
  }
  TORCH_CHECK(temperature.scalar_type() == at::kFloat,
              "flashspark.verify: argument 'temperature' must be float32, got ", temperature.scalar_type());
  TORCH_CHECK(seeds.scalar_type() == at::kLong, "flashspark.verify: argument 'seeds' must be int64, got ",
              seeds.scalar_type());
  TORCH_CHECK(offsets.scalar_type() == at::kLong, "flashspark.verify: argument 'offsets' must be int64, got ",
              offsets.scalar_type());
  a.temperature = temperature.contiguous();
  a.seeds = seeds.contiguous();
  a.offsets = offsets.contiguous();

  TORCH_CHECK(!draft_probs_ids.has_value() || draft_probs.has_value(),
              "flashspark.verify: argument 'draft_probs_ids' needs 'draft_probs' (the sparse q probabilities)");
  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    check_dim(q, 2, "draft_probs");
    check_device(q, target_logits, "draft_probs");
    check_float_dtype(q, "verify", "draft_probs");
    TORCH_CHECK(q.size(0) == a.num_tokens,
                "flashspark.verify: argument 'draft_probs' must have one row per draft token (", a.num_tokens,
                "), got ", q.size(0));
    check_fits_int32(q.size(1), "verify", "draft_probs", "K");
    a.q_probs = inner_contiguous(q);
    if (draft_probs_ids.has_value()) {
      const at::Tensor& ids = *draft_probs_ids;
      check_dim(ids, 2, "draft_probs_ids");
      check_device(ids, target_logits, "draft_probs_ids");
      TORCH_CHECK(ids.sizes() == q.sizes(), "flashspark.verify: argument 'draft_probs_ids' must have the shape of ",
                  "'draft_probs' ", q.sizes(), ", got ", ids.sizes());
      a.q_ids = as_int32(ids, "draft_probs_ids");
      a.q_mode = DraftQ::kSparse;
      a.num_candidates = int32_t(q.size(1));
    } else {
      TORCH_CHECK(q.size(1) == a.vocab,
                  "flashspark.verify: argument 'draft_probs' must be dense [T, V] with V = ", a.vocab,
                  " (or pass 'draft_probs_ids' for sparse q), got ", q.sizes());
      a.q_mode = DraftQ::kDense;
    }
  }
  return a;
}

// Returns every argument, outputs included, for the status output's overlap check.
inline NamedTensors check_verify_outputs(const VerifyArgs& a, const at::Tensor& logits, const at::Tensor& out_tokens,
                                         const at::Tensor& out_num_accepted) {
  check_device(out_tokens, logits, "out_tokens");
  check_device(out_num_accepted, logits, "out_num_accepted");
  TORCH_CHECK(out_tokens.scalar_type() == at::kInt && out_num_accepted.scalar_type() == at::kInt,
              "flashspark.verify: arguments 'out_tokens' and 'out_num_accepted' must be int32");
  TORCH_CHECK(out_tokens.dim() == 2 && out_tokens.size(0) == a.batch && out_tokens.size(1) == a.max_spec_len + 1,
              "flashspark.verify: argument 'out_tokens' must have shape [", a.batch, ", ", a.max_spec_len + 1,
              "], got ", out_tokens.sizes());
  TORCH_CHECK(out_num_accepted.dim() == 1 && out_num_accepted.size(0) == a.batch,
              "flashspark.verify: argument 'out_num_accepted' must have shape [", a.batch, "], got ",
              out_num_accepted.sizes());
  TORCH_CHECK(out_tokens.is_contiguous() && out_num_accepted.is_contiguous(),
              "flashspark.verify: arguments 'out_tokens' and 'out_num_accepted' must be contiguous");
  NamedTensors all = with_outputs(a.all, {{out_tokens, "out_tokens"}, {out_num_accepted, "out_num_accepted"}});
  check_writable(out_tokens, "out_tokens", all, "verify");
  check_writable(out_num_accepted, "out_num_accepted", all, "verify");
  return all;
}

// Outputs of the functional `verify`: [B, max_spec_len + 1] tokens and [B]
// accepted counts, int32, on the logits' device. Shapes depend only on sizes.
inline std::tuple<at::Tensor, at::Tensor> empty_verify_outputs(const at::Tensor& target_logits,
                                                               const at::Tensor& cu_num_draft, int64_t max_spec_len) {
  TORCH_CHECK(cu_num_draft.dim() == 1 && cu_num_draft.numel() >= 1,
              "flashspark.verify: argument 'cu_num_draft' must be 1-D with B+1 >= 1 entries");
  check_int_range(max_spec_len, 0, kMaxSpecLen, "verify", "max_spec_len");
  const int64_t batch = cu_num_draft.numel() - 1;
  const auto opts = target_logits.options().dtype(at::kInt);
  return {at::empty({batch, max_spec_len + 1}, opts), at::empty({batch}, opts)};
}

using VerifyOutFn = void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             int64_t, at::Tensor&, at::Tensor&, const std::optional<at::Tensor>&, bool,
                             const std::optional<at::Tensor>&);

// The functional `verify` of a backend: allocate the outputs, run its verify_out.
template <VerifyOutFn verify_out>
std::tuple<at::Tensor, at::Tensor> verify_functional(
    const at::Tensor& target_logits, const at::Tensor& draft_tokens, const at::Tensor& cu_num_draft,
    const std::optional<at::Tensor>& draft_probs, const std::optional<at::Tensor>& draft_probs_ids,
    const at::Tensor& temperature, const at::Tensor& seeds, const at::Tensor& offsets, int64_t max_spec_len,
    const std::optional<at::Tensor>& bonus_tokens, bool target_is_probs, const std::optional<at::Tensor>& status) {
  auto [out_tokens, out_num_accepted] = empty_verify_outputs(target_logits, cu_num_draft, max_spec_len);
  verify_out(target_logits, draft_tokens, cu_num_draft, draft_probs, draft_probs_ids, temperature, seeds, offsets,
             max_spec_len, out_tokens, out_num_accepted, bonus_tokens, target_is_probs, status);
  return {out_tokens, out_num_accepted};
}

template <class T>
VerifyParams<T> make_verify_params(const VerifyArgs& a, at::Tensor& out_tokens, at::Tensor& out_num_accepted,
                                   int32_t* status) {
  VerifyParams<T> p;
  p.logits = reinterpret_cast<const T*>(a.logits.const_data_ptr());
  p.logits_row_stride = a.logits.stride(0);
  p.draft_tokens = a.draft_tokens.const_data_ptr<int32_t>();
  p.cu_num_draft = a.cu_num_draft.const_data_ptr<int32_t>();
  p.q_mode = a.q_mode;
  if (a.q_mode != DraftQ::kOneHot) {
    p.q_probs = AnyFloatPtr{a.q_probs.const_data_ptr(), float_type(a.q_probs.scalar_type())};
    p.q_row_stride = a.q_probs.stride(0);
  }
  if (a.q_mode == DraftQ::kSparse) p.q_ids = a.q_ids.const_data_ptr<int32_t>();
  p.num_candidates = a.num_candidates;
  p.temperature = a.temperature.const_data_ptr<float>();
  p.seeds = a.seeds.const_data_ptr<int64_t>();
  p.offsets = a.offsets.const_data_ptr<int64_t>();
  p.out_tokens = out_tokens.mutable_data_ptr<int32_t>();
  p.out_num_accepted = out_num_accepted.mutable_data_ptr<int32_t>();
  p.status = status;
  if (a.bonus_tokens.defined()) p.bonus_tokens = a.bonus_tokens.const_data_ptr<int32_t>();
  p.batch = a.batch;
  p.vocab = a.vocab;
  p.max_spec_len = a.max_spec_len;
  p.target_probs = a.target_probs;
  return p;
}

}  // namespace flashspark::binding
