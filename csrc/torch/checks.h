// Argument checks shared by every op's binding. Messages name the op and the
// argument: "flashspark.<op>: argument '<name>' ...". Metadata only: nothing
// here reads device memory, so nothing synchronizes.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

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

inline void check_size(const at::Tensor& t, int64_t dim, int64_t size, const char* op, const char* name,
                       const char* what) {
  TORCH_CHECK(t.size(dim) == size, "flashspark.", op, ": argument '", name, "' must have ", what, " = ", size,
              " in dim ", dim, ", got shape ", t.sizes());
}

// Index tensors may come as int32 or int64; kernels read one fixed type.
inline at::Tensor as_index(const at::Tensor& t, at::ScalarType want, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "flashspark.", op, ": argument '", name,
              "' must be int32 or int64, got ", t.scalar_type());
  return t.to(want).contiguous();
}

// Strided rows are fine; the innermost dimension must be dense.
inline at::Tensor inner_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// Calls f.template operator()<T>() with T the kernel storage type of dt.
template <class F>
void dispatch_float(at::ScalarType dt, const F& f) {
  switch (dt) {
    case at::kFloat: f.template operator()<float>(); break;
    case at::kBFloat16: f.template operator()<bfloat16_t>(); break;
    case at::kHalf: f.template operator()<float16_t>(); break;
    default: TORCH_CHECK(false, "flashspark: unsupported dtype ", dt);
  }
}

}  // namespace flashspark::binding
