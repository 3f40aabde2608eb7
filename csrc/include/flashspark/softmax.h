// Mergeable reduction states shared by every kernel that reduces over the
// vocabulary: online softmax (max + rescaled sum) and argmax with
// lowest-index tie breaking. CPU kernels merge per-chunk partials in a fixed
// order; CUDA kernels merge them with CUB block reductions using the same
// operators, so both see identical per-element math.
#pragma once

#include "flashspark/common.h"

namespace flashspark {

// Online softmax over values x: m = max x, s = sum exp(x - m).
struct SoftmaxState {
  float m;
  float s;
};

FS_HOST_DEVICE SoftmaxState softmax_identity() { return SoftmaxState{kNegInf, 0.f}; }

FS_HOST_DEVICE void softmax_add(SoftmaxState& st, float x) {
  if (x == kNegInf) return;  // masked entry: contributes nothing
  if (x > st.m) {
    st.s = st.s * expf(st.m - x) + 1.f;
    st.m = x;
  } else {
    st.s += expf(x - st.m);
  }
}

FS_HOST_DEVICE SoftmaxState softmax_merge(const SoftmaxState& a, const SoftmaxState& b) {
  if (a.m == kNegInf) return b;
  if (b.m == kNegInf) return a;
  if (a.m >= b.m) return SoftmaxState{a.m, a.s + b.s * expf(b.m - a.m)};
  return SoftmaxState{b.m, b.s + a.s * expf(a.m - b.m)};
}

// log sum exp of the reduced values.
FS_HOST_DEVICE float softmax_lse(const SoftmaxState& st) { return st.m + logf(st.s); }

// Argmax with ties broken toward the lowest index, matching torch.argmax.
// NaN never wins; index -1 means "nothing seen".
struct ArgMax {
  float v;
  int32_t i;
};

FS_HOST_DEVICE ArgMax argmax_identity() { return ArgMax{kNegInf, -1}; }

FS_HOST_DEVICE bool argmax_better(float v, int32_t i, const ArgMax& cur) {
  if (!(v == v)) return false;  // NaN
  if (cur.i < 0) return true;
  return v > cur.v || (v == cur.v && i < cur.i);
}

FS_HOST_DEVICE void argmax_add(ArgMax& a, float v, int32_t i) {
  if (argmax_better(v, i, a)) a = ArgMax{v, i};
}

FS_HOST_DEVICE ArgMax argmax_merge(const ArgMax& a, const ArgMax& b) {
  if (b.i < 0) return a;
  if (a.i < 0) return b;
  return argmax_better(b.v, b.i, a) ? b : a;
}

struct SoftmaxMergeOp {
  FS_HOST_DEVICE SoftmaxState operator()(const SoftmaxState& a, const SoftmaxState& b) const {
    return softmax_merge(a, b);
  }
};

struct ArgMaxMergeOp {
  FS_HOST_DEVICE ArgMax operator()(const ArgMax& a, const ArgMax& b) const { return argmax_merge(a, b); }
};

}  // namespace flashspark
