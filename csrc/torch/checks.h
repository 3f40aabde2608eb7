// Argument checks shared by every op's binding. Messages name the op and the
// argument: "flashspark.<op>: argument '<name>' ...". Metadata only: nothing
// here reads device memory, so nothing synchronizes.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <optional>
#include <vector>

#include "flashspark/common.h"

namespace flashspark::binding {

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == dim, "flashspark.", op, ": argument '", name, "' must be ", dim, "-D, got ", t.dim(), "-D");
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "flashspark.", op, ": argument '", name, "' is on ", t.device(),
              " but the op runs on ", ref.device());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dt, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == dt, "flashspark.", op, ": argument '", name, "' must be ", dt, ", got ",
              t.scalar_type());
}

inline void check_float_dtype(const at::Tensor& t, const char* op, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "flashspark.", op, ": argument '", name,
              "' must be float32, bfloat16 or float16, got ", dt);
}

// The run-time float type of a float32 / bfloat16 / float16 tensor (checked beforehand).
inline FloatType float_type(at::ScalarType dt) {
  if (dt == at::kBFloat16) return FloatType::kBFloat16;
  return dt == at::kHalf ? FloatType::kFloat16 : FloatType::kFloat32;
}

inline void check_size(const at::Tensor& t, int64_t dim, int64_t size, const char* op, const char* name,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == size, "flashspark.", op, ": argument '", name, "' must have ", what, " = ", size,
              " in dim ", dim, ", got shape ", t.sizes());
}

// Index tensors may come as int32 or int64; kernels read one fixed type. int64 values
// narrow to int32 by saturation, never by wrapping: a value outside int32 stays outside
// every range the kernels check (2^32 + 3 is not read as 3), on the device too, with no
// host read.
inline at::Tensor as_index(const at::Tensor& t, at::ScalarType want, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "flashspark.", op, ": argument '", name,
              "' must be int32 or int64, got ", t.scalar_type());
  if (want == at::kInt && t.scalar_type() == at::kLong)
    return t.clamp(std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()).to(at::kInt).contiguous();
  return t.to(want).contiguous();
}

// A Python int (or a size) that a kernel reads as int32: checked at full width first.
inline void check_int_range(int64_t v, int64_t lo, int64_t hi, const char* op, const char* name) {
  TORCH_CHECK(v >= lo && v <= hi, "flashspark.", op, ": argument '", name, "' must lie in [", lo, ", ", hi, "], got ",
              v);
}

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// A size the kernels index with int32 (vocabulary, rows of a request, ...).
inline void check_fits_int32(int64_t v, const char* op, const char* name, const char* what) {
  TORCH_CHECK(v <= kInt32Max, "flashspark.", op, ": argument '", name, "' has ", what, " = ", v,
              ", more than the kernels index (2^31 - 1)");
}

// eps, scales: finite, and >= 0 where asked (NaN fails both).
inline void check_finite_scalar(double v, bool nonnegative, const char* op, const char* name) {
  TORCH_CHECK(std::isfinite(v) && (!nonnegative || v >= 0.0), "flashspark.", op, ": argument '", name, "' must be ",
              nonnegative ? "finite and >= 0" : "finite", ", got ", v);
}

// Whether two tensors provably share memory: their memory ranges intersect and ATen's
// overlap analysis finds them the same or overlapping. Interleaved strided views it cannot
// decide (e.g. k_cache = kv[:, 0], v_cache = kv[:, 1]) are let through.
inline bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto range = [](const at::Tensor& t) {
    int64_t lo = 0, hi = 0;  // element offsets reached from the first element
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t reach = (t.size(d) - 1) * t.stride(d);
      (reach < 0 ? lo : hi) += reach;
    }
    const auto* base = static_cast<const char*>(t.storage().data()) + t.storage_offset() * t.element_size();
    return std::pair<const char*, const char*>{base + lo * t.element_size(), base + (hi + 1) * t.element_size()};
  };
  const auto [a0, a1] = range(a);
  const auto [b0, b1] = range(b);
  if (!(a0 < b1 && b0 < a1)) return false;
  const at::MemOverlapStatus s = at::get_overlap_status(a, b);
  return s == at::MemOverlapStatus::Full || s == at::MemOverlapStatus::Partial;
}

// A tensor the op writes must not overlap itself (an expanded view), nor any input or
// other output: the kernels write each element once and read inputs as they go.
using NamedTensors = std::vector<std::pair<at::Tensor, const char*>>;

inline void check_writable(const at::Tensor& out, const char* out_name, const NamedTensors& others, const char* op) {
  TORCH_CHECK(at::has_internal_overlap(out) != at::MemOverlap::Yes, "flashspark.", op, ": argument '", out_name,
              "' is written in place and must not have overlapping elements (e.g. an expanded view)");
  for (const auto& [t, name] : others) {
    if (!t.defined() || std::strcmp(name, out_name) == 0) continue;
    TORCH_CHECK(!shares_memory(out, t), "flashspark.", op, ": argument '", out_name,
                "' is written in place and must not share memory with argument '", name, "'");
  }
}

inline const char* status_message(Status s) {
  switch (s) {
    case Status::kOk:
      return "ok";
    case Status::kBadCuNumDraft:
      return "argument 'cu_num_draft' must start at 0, never decrease, and end at the number of draft tokens";
    case Status::kSpecTooLong:
      return "argument 'cu_num_draft' gives a request more than max_spec_len draft tokens";
    case Status::kDraftTokenRange:
      return "argument 'draft_tokens' holds a token id outside [0, V) (other than the placeholder -1)";
    case Status::kCandidateRange:
      return "argument 'draft_probs_ids' holds a token id outside [0, V)";
    case Status::kBadTemperature:
      return "argument 'temperature' must be finite and >= 0 (below 1e-5 a request is greedy), and 0 or 1 "
             "with target_is_probs (probabilities come tempered)";
    case Status::kDraftNotListed:
      return "argument 'draft_tokens' holds a token that is not among its row's 'draft_probs_ids' (sparse q)";
    case Status::kNonFiniteLogit:
      return "argument 'target_logits' holds NaN or +inf in a row that is read";
    case Status::kNoFiniteLogit:
      return "argument 'target_logits' has a row that is read with every logit -inf";
    case Status::kBadDraftProb:
      return "argument 'draft_probs' holds a value read that is NaN or outside [0, 1]";
    case Status::kSlotRange:
      return "argument 'slots' holds a cache row outside [0, B)";
    case Status::kPositionRange:
      return "argument 'positions' holds a position outside [0, max_len) of the cache";
    case Status::kRopeRange:
      return "argument 'positions' holds a position beyond 'cos_sin_cache'";
    case Status::kCtxLenRange:
      return "argument 'ctx_lens' holds a length outside [0, S_max] (the cache length)";
    case Status::kBadCuBlocks:
      return "argument 'cu_blocks' must start at 0, never decrease, and end at the number of rows";
    case Status::kPathTokenRange:
      return "arguments 'cand_ids' / 'anchor' hold a token id outside [0, V) of a_emb";
    case Status::kPrevTokenRange:
      return "argument 'prev_tokens' holds a token id outside [0, V)";
    case Status::kBonusTokenRange:
      return "argument 'bonus_tokens' holds a token id outside [0, V)";
    case Status::kBadTargetProb:
      return "argument 'target_logits' holds probabilities (target_is_probs) with a value read that is NaN or "
             "outside [0, 1], or a row read with no mass";
    case Status::kBadCuNumNodes:
      return "argument 'cu_num_nodes' must start at 0, increase strictly (every tree has its root), and end at "
             "the number of nodes";
    case Status::kBadParent:
      return "argument 'parents' gives a root a parent (it must be -1), or a node a parent outside its request "
             "or not listed before it";
    case Status::kTreeTooDeep:
      return "a tree holds a node deeper than max_depth";
    case Status::kNodeTokenRange:
      return "argument 'node_tokens' holds a token id outside [0, V)";
  }
  return "invalid input";
}

// The optional status output of an op with `items` entries (requests, tokens, or 1 for
// the call): int32, 1-D, contiguous, on the op's device, sharing no memory with the
// other arguments. Returns its data pointer, or null when it is not given.
inline int32_t* status_ptr(const std::optional<at::Tensor>& status, int64_t items, const at::Tensor& ref,
                           const NamedTensors& others, const char* op) {
  if (!status.has_value()) return nullptr;
  const at::Tensor& s = *status;
  check_device(s, ref, op, "status");
  TORCH_CHECK(s.scalar_type() == at::kInt && s.dim() == 1 && s.size(0) == items && s.is_contiguous(), "flashspark.", op,
              ": argument 'status' must be a contiguous int32 tensor of shape [", items, "], got ", s.scalar_type(),
              " ", s.sizes());
  check_writable(s, "status", others, op);
  return s.mutable_data_ptr<int32_t>();
}

// CPU: where a kernel writes its per-item status. Without a caller's status tensor the
// op raises for the first failed item, like the eager checks before the launch.
struct CpuStatus {
  std::vector<int32_t> own;
  int32_t* ptr = nullptr;
  bool raise = false;

  CpuStatus(int32_t* given, int64_t items) : ptr(given), raise(given == nullptr) {
    if (raise) {
      own.assign(size_t(items), 0);
      ptr = own.data();
    }
  }
  void raise_if_failed(const char* op) const {
    if (!raise) return;
    for (int32_t code : own) TORCH_CHECK(code == 0, "flashspark.", op, ": ", status_message(Status(code)));
  }
};

// Eager checks on the CPU when the caller asked for no status: raise, before any write,
// for the first of n items that check(i) fails.
template <class Check>
void raise_before_launch(const CpuStatus& st, int64_t n, const Check& check, const char* op) {
  if (!st.raise) return;
  const Status s = first_failure(n, check);
  TORCH_CHECK(s == Status::kOk, "flashspark.", op, ": ", status_message(s));
}

inline NamedTensors with_outputs(NamedTensors inputs, std::initializer_list<std::pair<at::Tensor, const char*>> outs) {
  for (const auto& o : outs) inputs.push_back(o);
  return inputs;
}

// Strided rows are fine; the innermost dimension must be dense.
inline at::Tensor inner_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Calls f.template operator()<T>() with T the kernel storage type of dt.
template <class F>
void dispatch_float(at::ScalarType dt, const F& f) {
  switch (dt) {
    case at::kFloat:
      f.template operator()<float>();
      break;
    case at::kBFloat16:
      f.template operator()<bfloat16_t>();
      break;
    case at::kHalf:
      f.template operator()<float16_t>();
      break;
    default:
      TORCH_CHECK(false, "flashspark: unsupported dtype ", dt);
  }
}

}  // namespace flashspark::binding
