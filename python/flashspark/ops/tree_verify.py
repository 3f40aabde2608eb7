"""Tree verification (sample-and-walk): the `tree_verify` / `tree_verify_out` wrappers, their
fakes, and the PyTorch implementation (the tests' oracle).

Shapes (B requests, N nodes in all, V vocabulary); node ids are flat over the batch:
  target_logits      [N, V]   row i: the target's distribution of the token after node i
  node_tokens        [N]      node i's token (a request's first node is its root)
  parents            [N]      -1 for a root (or padding), else an earlier node of the same request
  cu_num_nodes       [B + 1]
  accepted_nodes     [B, max_depth + 1]  out: the walked node ids, root first, then -1
  tokens             [B, max_depth + 1]  out: accepted tokens, then the correction or bonus, then -1
  num_accepted       [B]                 out: accepted nodes (the root not counted)
"""

from __future__ import annotations

from typing import Optional

import torch

from .common import GREEDY_TEMPERATURE, _one_device, _required, _to_int, log_softmax_shifted
from .philox import PURPOSE_ACCEPT, PURPOSE_RESAMPLE, philox_u32, uniform_open01
from .verify import _race

# The bound on max_depth (the kernels' kMaxTreeDepth).
MAX_TREE_DEPTH = 4096
# parents[] of a root.
NO_PARENT = -1


def tree_verify(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_depth: int,
    target_is_probs: bool = False,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless verification of token trees whose children are deterministic candidates (a
    drafter's top-K, not samples of q), one tree per request.

    Request b owns nodes ``cu_num_nodes[b] ... cu_num_nodes[b+1] - 1``; its first node is the
    root (the last committed token, ``parents`` -1), and every other node's parent is an
    earlier node of the same request. At node v the op samples y from the target's p at v: if
    y is the token of one of v's children it accepts that child and walks on; otherwise it
    emits y and stops (at a leaf, y is the bonus token). The emitted tokens are an exact
    sample of the target, and the walk accepts the longest prefix of that sample the tree
    holds (no lossless verifier accepts more on a fixed tree). Computed as SGLang's sampler
    does: one coin against the running sum of the children's p, and on a miss one race over
    p with the children removed, so only the stop row takes a full pass over the vocabulary.
    At temperature 0 the walk follows the argmax (lowest id on ties).

    Siblings with the same token are legal: the first listed is the child that token
    reaches; a later duplicate (and its subtree) is never walked.

    Args:
      target_logits: ``[N, V]`` float32, bfloat16 or float16, one row per node (rows may be
        strided); probabilities instead with ``target_is_probs`` (then the temperature must
        be 0 or exactly 1, as :func:`flashspark.ops.verify`).
      node_tokens: ``[N]`` int32/int64 in ``[0, V)``.
      parents: ``[N]`` int32/int64 flat node ids: -1 for a request's first node, else a node
        of the same request listed before this one. -1 on a later node marks padding (an
        engine's unused slot in a static-shape tree): it and the nodes below it are outside
        the tree, never walked, their tokens not checked and their rows never decide anything.
      cu_num_nodes: ``[B + 1]`` int32/int64, starting at 0, strictly increasing, ending at N.
      temperature, seeds, offsets: ``[B]``, as :func:`flashspark.ops.verify`. A request at
        depth d draws at stream position ``offsets[b] + d`` (the coin and the race of
        verify's row d), so a chain given as a tree reproduces verify's one-hot result token
        for token; advance offsets by at least ``max_depth + 1`` between calls.
      max_depth: static bound on a node's depth (root: 0), at most ``MAX_TREE_DEPTH``; fixes
        the output width.
      status: optional ``[B]`` int32 output (see :func:`flashspark.ops.raise_on_status`). A
        failed request writes -1 over its output rows and ``num_accepted`` -1.

    Returns:
      ``(accepted_nodes, tokens, num_accepted)``: ``[B, max_depth + 1]`` int32 flat node ids
      of the walk (root first, then -1); ``[B, max_depth + 1]`` int32 accepted tokens, then
      the correction or bonus token, then -1; ``[B]`` int32. Request b emits
      ``num_accepted[b] + 1`` tokens.
    """
    _required(
        "tree_verify",
        target_logits=target_logits,
        node_tokens=node_tokens,
        parents=parents,
        cu_num_nodes=cu_num_nodes,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
    )
    return torch.ops.flashspark.tree_verify(
        target_logits,
        node_tokens,
        parents,
        cu_num_nodes,
        temperature,
        seeds,
        offsets,
        max_depth,
        target_is_probs=target_is_probs,
        status=status,
    )


def tree_verify_out(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_depth: int,
    out_accepted_nodes: torch.Tensor,
    out_tokens: torch.Tensor,
    out_num_accepted: torch.Tensor,
    target_is_probs: bool = False,
    status: Optional[torch.Tensor] = None,
) -> None:
    """:func:`tree_verify` writing into preallocated, contiguous int32 outputs (persistent
    buffers inside a captured CUDA graph)."""
    _required(
        "tree_verify",
        target_logits=target_logits,
        node_tokens=node_tokens,
        parents=parents,
        cu_num_nodes=cu_num_nodes,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
        out_accepted_nodes=out_accepted_nodes,
        out_tokens=out_tokens,
        out_num_accepted=out_num_accepted,
    )
    torch.ops.flashspark.tree_verify_out(
        target_logits,
        node_tokens,
        parents,
        cu_num_nodes,
        temperature,
        seeds,
        offsets,
        max_depth,
        out_accepted_nodes=out_accepted_nodes,
        out_tokens=out_tokens,
        out_num_accepted=out_num_accepted,
        target_is_probs=target_is_probs,
        status=status,
    )


@torch.library.register_fake("flashspark::tree_verify")
def _tree_verify_fake(
    target_logits,
    node_tokens,
    parents,
    cu_num_nodes,
    temperature,
    seeds,
    offsets,
    max_depth,
    *,
    target_is_probs=False,
    status=None,
):
    _one_device(
        "tree_verify",
        target_logits=target_logits,
        node_tokens=node_tokens,
        parents=parents,
        cu_num_nodes=cu_num_nodes,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
        status=status,
    )
    batch = cu_num_nodes.shape[0] - 1
    width = max_depth + 1
    return (
        target_logits.new_empty((batch, width), dtype=torch.int32),
        target_logits.new_empty((batch, width), dtype=torch.int32),
        target_logits.new_empty((batch,), dtype=torch.int32),
    )


@torch.library.register_fake("flashspark::tree_verify_out")
def _tree_verify_out_fake(
    target_logits,
    node_tokens,
    parents,
    cu_num_nodes,
    temperature,
    seeds,
    offsets,
    max_depth,
    *,
    out_accepted_nodes,
    out_tokens,
    out_num_accepted,
    target_is_probs=False,
    status=None,
):
    _tree_verify_fake(
        target_logits,
        node_tokens,
        parents,
        cu_num_nodes,
        temperature,
        seeds,
        offsets,
        max_depth,
        target_is_probs=target_is_probs,
        status=status,
    )
    _one_device(
        "tree_verify",
        target_logits=target_logits,
        out_accepted_nodes=out_accepted_nodes,
        out_tokens=out_tokens,
        out_num_accepted=out_num_accepted,
    )
    return None


def tree_verify_reference(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    cu_num_nodes: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_depth: int,
    target_is_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle of :func:`tree_verify` (same arguments and outputs; valid trees only)."""
    logits = target_logits.detach().float().cpu()
    tokens = node_tokens.detach().long().cpu().tolist()
    par = parents.detach().long().cpu().tolist()
    cu = cu_num_nodes.detach().long().cpu().tolist()
    vocab = logits.shape[1]
    batch = len(cu) - 1
    nodes_out = torch.full((batch, max_depth + 1), -1, dtype=torch.int32)
    tokens_out = torch.full((batch, max_depth + 1), -1, dtype=torch.int32)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    vocab_ids = torch.arange(vocab)
    for b in range(batch):
        lo, hi = cu[b], cu[b + 1]
        rows = logits[lo:hi]
        temp = float(temperature[b])
        seed, offset = _to_int(seeds[b]), _to_int(offsets[b])
        greedy = temp < GREEDY_TEMPERATURE
        logp = None if greedy or target_is_probs else log_softmax_shifted(rows, temp)
        p_rows = rows if target_is_probs else (None if greedy else logp.exp())
        v, depth = lo, 0
        nodes_out[b, 0] = lo
        while True:
            # the children of v in listed order, each distinct token once (the first listed wins)
            children = {}
            for j in range(v + 1, hi):
                if par[j] == v and tokens[j] not in children:
                    children[tokens[j]] = j
            if greedy:
                y = int(rows[v - lo].argmax())  # first maximum on ties
                nxt = children.get(y)
                if nxt is None:
                    emitted = y
                    break
            else:
                u = uniform_open01(philox_u32(seed, offset + depth, PURPOSE_ACCEPT, 0))
                mass = torch.zeros((), dtype=torch.float32)  # the running sum, in fp32 as the kernels
                nxt = None
                for x, j in children.items():
                    mass = mass + p_rows[v - lo, x]
                    if u < mass:
                        nxt = j
                        break
                if nxt is None:
                    q = torch.zeros(vocab)
                    q[list(children)] = 1.0  # the children removed: the residual of a one-hot list
                    bits = philox_u32(seed, offset + depth, PURPOSE_RESAMPLE, vocab_ids)
                    emitted = _race(p_rows[v - lo], logp, v - lo, q, bits)
                    break
            depth += 1
            v = nxt
            nodes_out[b, depth] = v
            tokens_out[b, depth - 1] = tokens[v]
        tokens_out[b, depth] = emitted
        num_accepted[b] = depth
    device = target_logits.device
    return nodes_out.to(device), tokens_out.to(device), num_accepted.to(device)


def tree_from_paths(paths: list[list[list[int]]], root_tokens: list[int]) -> tuple[torch.Tensor, ...]:
    """Flat tree arrays from each request's candidate paths (token lists from the root): a
    prefix trie, nodes in first-seen order, so every parent precedes its child. Returns
    ``(node_tokens, parents, cu_num_nodes)`` as int32 tensors; for tests and examples."""
    tokens, par, cu = [], [], [0]
    for root, request in zip(root_tokens, paths):
        base = len(tokens)
        tokens.append(int(root))
        par.append(NO_PARENT)
        index = {(): base}
        for path in request:
            for d in range(1, len(path) + 1):
                key = tuple(path[:d])
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(path[d - 1]))
                    par.append(index[key[:-1]])
        cu.append(len(tokens))
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return as_i32(tokens), as_i32(par), as_i32(cu)
