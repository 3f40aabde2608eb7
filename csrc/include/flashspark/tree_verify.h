// Tree verification (sample-and-walk): the math shared by the CPU and the CUDA kernel of
// `tree_verify`. It reuses verify's rows, races and noise (verify.h); only the walk differs.
//
// Layout (B requests, N = cu_num_nodes[B] nodes, V vocabulary). Node ids are flat over the
// batch (one index space for node_tokens, parents, the logits rows and the output):
//   cu_num_nodes  [B + 1]  request b owns nodes cu[b] ... cu[b+1] - 1 (at least one: its root)
//   node_tokens   [N]      node i's token; the root's is the last committed token
//   parents       [N]      -1 for a root; else a node of the same request listed before i (-1 on a
//                          later node marks padding: a slot outside the tree with its subtree, never
//                          walked, its token not checked)
//   logits        [N, V]   row i: the target's distribution of the token after node i (logits, or
//                          the probabilities p with target_probs)
//   out_nodes     [B, max_depth + 1]  the walked node ids, root first, then -1
//   out_tokens    [B, max_depth + 1]  the accepted nodes' tokens, then the correction or bonus, then -1
//   out_num_accepted [B]   accepted nodes (the root not counted); -1 for a failed request
//
// The walk, at node v of depth d (children: deterministic candidates, e.g. a drafter's top-K):
//   sample y ~ p_v; if y is a child's token, accept that child and continue from it; else emit y
//   and stop (at a leaf, y is the bonus token). Output: an exact sample of the target, accepting
//   the longest prefix of it that the tree holds. It is computed as one coin against the running
//   sum of the children's p (each distinct token once, in listed order), and on a miss one race
//   over p with the children's tokens removed: only the stop row takes a full-vocabulary pass.
//   Siblings with the same token: the first listed is the child; later ones are never walked.
//   Greedy: the argmax of p_v (lowest id on ties) in place of y.
//
// Randomness, for request b at depth d (verify's streams, row k = depth d, so a chain given as a
// tree draws exactly as verify with one-hot drafts):
//   coin   philox_u32(seed[b], offset[b] + d, kPurposeAccept, 0)
//   race   philox_u32(seed[b], offset[b] + d, kPurposeResample, x) for token x
#pragma once

#include "flashspark/verify.h"

namespace flashspark {

constexpr int32_t kNoParent = -1;

template <class T>
struct TreeVerifyParams {
  using Value = T;
  const T* logits = nullptr;
  int64_t logits_row_stride = 0;
  const int32_t* node_tokens = nullptr;   // [N]
  const int32_t* parents = nullptr;       // [N]
  const int32_t* cu_num_nodes = nullptr;  // [B + 1]
  const float* temperature = nullptr;     // [B]; below kGreedyTemperature = greedy
  const int64_t* seeds = nullptr;         // [B]
  const int64_t* offsets = nullptr;       // [B]
  int32_t* out_nodes = nullptr;           // [B, max_depth + 1]
  int32_t* out_tokens = nullptr;          // [B, max_depth + 1]
  int32_t* out_num_accepted = nullptr;    // [B]
  int32_t* status = nullptr;              // [B] Status codes, or null
  // [2N] int32: node depths (the checks), then per request the stop node's child tokens (its
  // race's list) at cu[b]. Both backends; on CUDA a part of the workspace.
  int32_t* scratch = nullptr;
  // CUDA only: scratch of tree_verify_workspace_bytes(batch, num_nodes, vocab) bytes, 16-aligned.
  void* workspace = nullptr;
  bool target_probs = false;  // as verify's: p read as given; temperature greedy or exactly 1
  int32_t batch = 0;
  int32_t vocab = 0;
  int32_t num_nodes = 0;  // N
  int32_t max_depth = 0;
};

// The request whose nodes hold node r: the last b with cu[b] <= r, by binary search (well
// defined, if meaningless, on a malformed cu_num_nodes); -1 when r is nobody's.
template <class T>
FS_HOST_DEVICE int32_t tree_row_owner(const TreeVerifyParams<T>& p, int64_t r) {
  int32_t lo = 0, hi = p.batch;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (p.cu_num_nodes[mid] <= r)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int32_t b = lo - 1;
  return b >= 0 && r < p.cu_num_nodes[b + 1] ? b : -1;
}

// Checks of request b's own slice of the inputs, before any logits row is read: its cu entries
// (every node its own, as verify_check_request), temperature, tokens, parents and depths (written
// to scratch[0, N) as it goes). Shared by the CPU binding (eagerly, to raise) and both kernels.
template <class T>
FS_HOST_DEVICE Status tree_check_request(const TreeVerifyParams<T>& p, int32_t b) {
  const int32_t lo = p.cu_num_nodes[b], hi = p.cu_num_nodes[b + 1];
  if (b == 0 && lo != 0) return Status::kBadCuNumNodes;
  if (b == p.batch - 1 && hi != p.num_nodes) return Status::kBadCuNumNodes;
  if (hi <= lo || lo < 0 || hi > p.num_nodes) return Status::kBadCuNumNodes;
  for (int32_t i = lo; i < hi; ++i)
    if (tree_row_owner(p, i) != b) return Status::kBadCuNumNodes;
  const float t = p.temperature[b];
  if (!temperature_ok(t) || (p.target_probs && !probs_temperature_ok(t))) return Status::kBadTemperature;
  int32_t* depth = p.scratch;  // -1: outside the tree (padding, or below padding): never walked, not checked
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t parent = p.parents[i];
    if (i == lo) {
      if (parent != kNoParent) return Status::kBadParent;
      depth[i] = 0;
    } else if (parent == kNoParent) {  // padding (a static-shape engine's unused slot)
      depth[i] = -1;
    } else {
      if (parent < lo || parent >= i) return Status::kBadParent;  // another request's, or not before i
      depth[i] = depth[parent] < 0 ? -1 : depth[parent] + 1;
      if (depth[i] > p.max_depth) return Status::kTreeTooDeep;
    }
    const int32_t x = p.node_tokens[i];
    if (depth[i] >= 0 && (x < 0 || x >= p.vocab)) return Status::kNodeTokenRange;
  }
  return Status::kOk;
}

// Where a request's walk ended.
struct TreeWalk {
  Status status;
  int32_t depth;     // accepted nodes; the stop node lies at this depth
  int32_t node;      // the stop node (flat id)
  int32_t emitted;   // the token, when the walk decided it (greedy); else -1
  int32_t race;      // 1: a race on the stop row decides the token
  int32_t children;  // the stop node's distinct child tokens, listed at scratch[N + cu[b]]
  RowSoftmax sm;     // the stop row's softmax (logits mode), for its race
};

template <class T>
FS_HOST_DEVICE const T* tree_row(const TreeVerifyParams<T>& p, int32_t node) {
  return p.logits + int64_t(node) * p.logits_row_stride;
}

// The first listed sibling among the children of v before node j with j's token: a duplicate.
template <class T>
FS_HOST_DEVICE bool tree_duplicate(const TreeVerifyParams<T>& p, int32_t v, int32_t j) {
  for (int32_t i = v + 1; i < j; ++i)
    if (p.parents[i] == v && p.node_tokens[i] == p.node_tokens[j]) return true;
  return false;
}

// What the stop row's race removes from p: the children's tokens (a one-hot list of them, so
// the residual max(p - 1, 0) has no mass there), or nothing at a leaf.
template <class T>
FS_HOST_DEVICE RaceQ tree_race_q(const TreeVerifyParams<T>& p, int32_t b, const TreeWalk& w) {
  return RaceQ{DraftQ::kOneHot, AnyFloatPtr{}, p.scratch + p.num_nodes + p.cu_num_nodes[b], AnyFloatPtr{}, w.children};
}

// The walk from the root (the caller has checked the request and passes the result). Backend:
// verify's walk interface (row_argmax / row_softmax of a request's row k, leader); rows are
// indexed by node within the request. Writes the walked nodes and tokens (leader only).
template <class T, class Backend>
FS_HOST_DEVICE TreeWalk tree_walk(const TreeVerifyParams<T>& p, int32_t b, Status status, Backend& be) {
  const int32_t lo = p.cu_num_nodes[b];
  TreeWalk w{status, 0, lo, -1, 0, 0, RowSoftmax{0.f, 1.f, 0.f}};
  if (status != Status::kOk) return w;
  const int32_t hi = p.cu_num_nodes[b + 1];
  int32_t* nodes = p.out_nodes + int64_t(b) * (p.max_depth + 1);
  int32_t* tokens = p.out_tokens + int64_t(b) * (p.max_depth + 1);
  const float temp = p.temperature[b];
  const bool greedy = temperature_greedy(temp);
  const float inv_t = greedy ? 1.f : 1.f / temp;
  const uint64_t seed = uint64_t(p.seeds[b]), offset = uint64_t(p.offsets[b]);
  if (be.leader()) nodes[0] = lo;
  for (;;) {
    const int32_t v = w.node, k = v - lo;
    const T* row = tree_row(p, v);
    int32_t next = -1;
    if (greedy) {
      const ArgMax am = be.row_argmax(row, k, p.target_probs);
      w.status = greedy_row_status(am, p.target_probs);
      if (w.status != Status::kOk) return w;
      for (int32_t j = v + 1; j < hi && next < 0; ++j)  // the first listed child with the argmax
        if (p.parents[j] == v && p.node_tokens[j] == am.i) next = j;
      if (next < 0) {
        w.emitted = am.i;
        return w;
      }
    } else {
      w.status = row_softmax(p, be, row, k, inv_t, w.sm);
      if (w.status != Status::kOk) return w;
      const float u = uniform_open01(philox_u32(seed, offset + w.depth, kPurposeAccept, 0));
      int32_t* listed = p.scratch + p.num_nodes + lo;
      float mass = 0.f;  // the running sum of the children's p, each distinct token once
      w.children = 0;
      for (int32_t j = v + 1; j < hi; ++j) {
        if (p.parents[j] != v || tree_duplicate(p, v, j)) continue;
        const int32_t x = p.node_tokens[j];
        const float px = p.target_probs ? to_float(row[x]) : exp_nonpositive(w.sm.log_prob(to_float(row[x])));
        if (p.target_probs && !prob_ok(px)) {
          w.status = Status::kBadTargetProb;
          return w;
        }
        mass += px;
        if (u < mass) {
          next = j;
          break;
        }
        if (be.leader()) listed[w.children] = x;
        ++w.children;
      }
      if (next < 0) {  // y is no child's: the race draws it from p without the children
        w.race = 1;
        return w;
      }
    }
    ++w.depth;
    w.node = next;
    if (be.leader()) {
      nodes[w.depth] = next;
      tokens[w.depth - 1] = p.node_tokens[next];
    }
  }
}

// The request's outputs from its walk and, when it raced, the race over its stop row (as
// verify_finish: a failed request writes -1 everywhere, num_accepted = -1, its status code).
template <class T>
FS_HOST_DEVICE Status tree_finish(const TreeVerifyParams<T>& p, int32_t b, const TreeWalk& w, const RaceResult& r,
                                  bool leader) {
  Status status = w.status;
  int32_t emitted = w.emitted;
  if (status == Status::kOk && w.race) {
    if (r.bad) status = Status::kBadTargetProb;
    // No residual mass (the children held all of p, up to rounding): from p itself.
    emitted = r.residual.i >= 0 ? r.residual.i : r.target.i;
    if (status == Status::kOk && emitted < 0) status = Status::kBadTargetProb;
  }
  if (leader) {
    const int64_t width = p.max_depth + 1;
    int32_t* nodes = p.out_nodes + int64_t(b) * width;
    int32_t* tokens = p.out_tokens + int64_t(b) * width;
    if (status == Status::kOk) {
      tokens[w.depth] = emitted;
      p.out_num_accepted[b] = w.depth;
    } else {
      for (int64_t i = 0; i < width; ++i) nodes[i] = tokens[i] = -1;
      p.out_num_accepted[b] = -1;
    }
    write_status(p.status, b, status);
  }
  return status;
}

template <class T>
FS_HOST_DEVICE StopRow<T> race_stop(const TreeVerifyParams<T>& p, int32_t b, const TreeWalk& w) {
  return StopRow<T>{tree_row(p, w.node), tree_race_q(p, b, w), uint64_t(p.seeds[b]), uint64_t(p.offsets[b]) + w.depth};
}

// The walk, the race and the finish back to back (the CPU; the CUDA kernel splits them).
template <class T, class Backend>
FS_HOST_DEVICE Status tree_verify_request(const TreeVerifyParams<T>& p, int32_t b, Status status, Backend& be) {
  const TreeWalk w = tree_walk(p, b, status, be);
  const RaceResult r = w.status == Status::kOk && w.race ? race_stop_row(p, b, w, be) : race_identity();
  return tree_finish(p, b, w, r, be.leader());
}

// ---- the CUDA kernel's workspace (sizes only: CUDA-graph safe) ---------------

using TreeVerifyWorkspace = VerifyWorkspaceOf<TreeWalk>;  // scratch: [2N] depths, child lists

FS_HOST_DEVICE int64_t tree_verify_workspace_bytes(int32_t batch, int64_t num_nodes, int32_t vocab) {
  return workspace_bytes_of<TreeWalk>(batch, num_nodes, vocab, 2 * num_nodes);
}

template <class T>
FS_HOST_DEVICE TreeVerifyWorkspace tree_verify_workspace(const TreeVerifyParams<T>& p) {
  return workspace_layout<TreeWalk>(p.workspace, p.batch, p.num_nodes, p.vocab);
}

// The CUDA kernels' generic view of a tree batch (verify.cuh's tiles, race and finish kernels
// serve both ops).
template <class T>
FS_HOST_DEVICE int32_t tiles_row_owner(const TreeVerifyParams<T>& p, int64_t r) {
  return tree_row_owner(p, r);
}
template <class T>
FS_HOST_DEVICE TreeVerifyWorkspace workspace_of(const TreeVerifyParams<T>& p) {
  return tree_verify_workspace(p);
}
template <class T>
FS_HOST_DEVICE Status finish_request(const TreeVerifyParams<T>& p, int32_t b, const TreeWalk& w, const RaceResult& r,
                                     bool leader) {
  return tree_finish(p, b, w, r, leader);
}

}  // namespace flashspark
