// Mergeable reduction states shared by every kernel that reduces over the
// vocabulary: online softmax (max + rescaled sum) and argmax with
// lowest-index tie breaking. CPU kernels merge per-chunk partials in a fixed
// order; CUDA kernels merge them with CUB block reductions using the same
// operators, so both see identical per-element math.
#pragma once

#include "flashspark/common.h"

namespace flashspark {

// Online softmax over values x at inverse temperature inv_t > 0, kept in the units of
// x so that no finite logit overflows however small the temperature:
//   m = max x,  s = sum exp((x - m) * inv_t),  log p(x) = (x - m) * inv_t - log s.
// -inf entries carry no mass. A NaN entry, or two +inf entries, poison the state
// (s = NaN); a +inf entry leaves m = +inf: softmax_valid tells a usable state apart.
struct SoftmaxState {
  float m;
  float s;
};

FS_HOST_DEVICE SoftmaxState softmax_identity() { return SoftmaxState{kNegInf, 0.f}; }

FS_HOST_DEVICE void softmax_add(SoftmaxState& st, float x, float inv_t = 1.f) {
  if (x == kNegInf) return;  // masked entry: contributes nothing
  if (x > st.m) {
    st.s = st.s * expf((st.m - x) * inv_t) + 1.f;
    st.m = x;
  } else if (x <= st.m) {
    st.s += expf((x - st.m) * inv_t);
  } else {  // x (or m) is NaN: poisoned for good, and never mistaken for the identity
    st.m = NAN;
    st.s = NAN;
  }
}

FS_HOST_DEVICE SoftmaxState softmax_merge(const SoftmaxState& a, const SoftmaxState& b, float inv_t = 1.f) {
  if (a.m == kNegInf) return b;
  if (b.m == kNegInf) return a;
  if (a.m >= b.m) return SoftmaxState{a.m, a.s + b.s * expf((b.m - a.m) * inv_t)};
  if (b.m > a.m) return SoftmaxState{b.m, b.s + a.s * expf((a.m - b.m) * inv_t)};
  return SoftmaxState{NAN, NAN};
}

// A finite maximum and a sum that holds it (s >= 1): no NaN, no +inf, not all -inf.
FS_HOST_DEVICE bool softmax_valid(const SoftmaxState& st) { return st.m > kNegInf && st.m < kPosInf && st.s >= 1.f; }

// log sum exp of the reduced values (inv_t = 1).
FS_HOST_DEVICE float softmax_lse(const SoftmaxState& st) { return st.m + logf(st.s); }

// log p(x) under a valid state at inv_t, with log_s = log(st.s).
FS_HOST_DEVICE float softmax_log_prob(float x, const SoftmaxState& st, float inv_t, float log_s) {
  return (x - st.m) * inv_t - log_s;
}

// Argmax with ties broken toward the lowest index, matching torch.argmax.
// NaN never wins; index -1 means "nothing seen". Keys are fp32, or fp64 where a
// race key must not overflow (markov_step's single-pass race).
template <class V>
struct ArgMaxOf {
  V v;
  int32_t i;
};
using ArgMax = ArgMaxOf<float>;
using ArgMax64 = ArgMaxOf<double>;

template <class V>
struct SameType {
  using type = V;
};

template <class V = float>
FS_HOST_DEVICE ArgMaxOf<V> argmax_identity() {
  return ArgMaxOf<V>{V(kNegInf), -1};
}

template <class V>
FS_HOST_DEVICE bool argmax_better(typename SameType<V>::type v, int32_t i, const ArgMaxOf<V>& cur) {
  if (!(v == v)) return false;  // NaN
  if (cur.i < 0) return true;
  return v > cur.v || (v == cur.v && i < cur.i);
}

template <class V>
FS_HOST_DEVICE void argmax_add(ArgMaxOf<V>& a, typename SameType<V>::type v, int32_t i) {
  if (argmax_better(v, i, a)) a = ArgMaxOf<V>{v, i};
}

template <class V>
FS_HOST_DEVICE ArgMaxOf<V> argmax_merge(const ArgMaxOf<V>& a, const ArgMaxOf<V>& b) {
  if (b.i < 0) return a;
  if (a.i < 0) return b;
  return argmax_better(b.v, b.i, a) ? b : a;
}

struct SoftmaxMergeOp {
  float inv_t = 1.f;
  FS_HOST_DEVICE SoftmaxState operator()(const SoftmaxState& a, const SoftmaxState& b) const {
    return softmax_merge(a, b, inv_t);
  }
};

struct ArgMaxMergeOp {
  template <class V>
  FS_HOST_DEVICE ArgMaxOf<V> operator()(const ArgMaxOf<V>& a, const ArgMaxOf<V>& b) const {
    return argmax_merge(a, b);
  }
};

}  // namespace flashspark
