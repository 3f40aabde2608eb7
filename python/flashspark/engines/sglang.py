"""SGLang's speculative verify (EAGLE's token trees) on `flashspark.tree_verify`.

    from flashspark.engines.sglang import tree_speculative_sampling_target_only, verify_tree_greedy
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num,            # outputs, written in place
        candidates, retrive_index, retrive_next_token, retrive_next_sibling,
        uniform_samples, uniform_samples_for_final_sampling, target_probs,
    )
    verify_tree_greedy(
        predicts, accept_index, accept_token_num,
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict,
    )

sgl-kernel's signatures. Shapes (bs requests, N slots each: slot 0 is the last verified token,
slots 1 .. N - 1 the draft tree, V vocabulary), as SGLang passes them:
    predicts            [bs * N (+ more)] int32: predicts[retrive_index[b, j]] is the token that
                        follows slot j, written for the walked slots (root first); others untouched
    accept_index        [bs, S] int32: retrive_index of the walked slots (root first), then -1
                        (S = spec steps + 1: at most S - 1 drafts are accepted)
    accept_token_num    [bs] int32: the number of accepted drafts (the correction or bonus token
                        excluded; SGLang adds it)
    candidates          [bs, N] int32/int64: the token at each slot, in [0, V) (slot 0's is not read)
    retrive_index       [bs, N] int: each slot's index into predicts
    retrive_next_token  [bs, N] int: a slot's first child (a slot of the same request), or -1
    retrive_next_sibling [bs, N] int: a slot's next sibling, or -1
    uniform_samples     [bs, N] float32, uniform_samples_for_final_sampling [bs] float32: the coins
    target_probs        [bs, N, V] float32/bfloat16/float16: p at each slot (tempered, top-k/top-p
                        renormalized, as SGLang computes them), rows taken as given
    target_predict      [bs * N] or [bs, N] int (verify_tree_greedy): the target's argmax after each
                        slot, read at retrive_index as sgl-kernel does

The drafts are deterministic candidates (q one-hot), as in SGLang's target-only verify: at a slot
the walk takes a child with probability p(child's token) (one coin against the running sum of the
children's p), and on a miss the correction is sampled from p without the children; at a leaf,
or after S - 1 accepted drafts, the bonus is sampled from p. The tree becomes `tree_verify`'s flat
arrays on the device: each slot's parent comes from retrive_next_token / retrive_next_sibling by
pointer jumping over the sibling lists (log2 N gathers, no host read); slots no list reaches are
padding (parent -1), never walked.

Differences from sgl-kernel, exactly:
  * Randomness is Philox: the coins only seed it (request b's seed and offset are the bit
    patterns of its coins and its batch row), so the result is a deterministic function of the
    inputs, as in SGLang, and torch's seed still governs it, but the tokens differ from
    sgl-kernel's for the same coins; both are exact samples. flashspark's extension `seeds=` /
    `offsets=` ([bs] int64) set the streams directly; the coins may then be None.
  * threshold_single and threshold_acc must be 1.0 (SGLang's defaults): other values accept
    drafts the target would not and are not lossless, so they raise ValueError.
  * Siblings are tried in slot order, not in sibling-list order: the same distribution (each
    child is taken with probability p of its token either way); with two siblings of the same
    token the lower slot is the child (sgl-kernel: the first in its list).
  * A parent must sit at a lower slot than its children (EAGLE's trees do), and retrive_index
    must index predicts. `check_tree=True` (the default) checks both with one host read of a
    small summary and raises ValueError; `check_tree=False` skips the read (inside a CUDA graph):
    a child before its parent then fails its request (status 20), out-of-range indices are clamped.
  * accept_index is written whole: -1 past the walked slots (sgl-kernel leaves those entries as
    they were; EAGLE fills them with -1 beforehand, so it reads the same).
  * `temperature=` ([bs] float32, flashspark's extension): 0 makes a request greedy (the argmax of
    its p, lowest id on ties), 1 (the default) samples; no other value.
  * `draft_probs=`, a scratch buffer in some sgl-kernel versions, is accepted and not touched.
  * `deterministic` has no effect: flashspark's kernels are always deterministic.
  * On CUDA a request with bad values (an id outside [0, V), a p outside [0, 1]) emits nothing:
    accept_token_num -1, its accept_index row -1, predicts[root] -1; pass `status` ([bs] int32)
    to learn why (tree_verify's codes). On the CPU the call raises instead.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import ops

LOSSLESS_THRESHOLD = 1.0  # SGLang's default threshold_single and threshold_acc
PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)
_MASK32 = 0xFFFFFFFF


def tree_speculative_sampling_target_only(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: Optional[torch.Tensor],
    uniform_samples_for_final_sampling: Optional[torch.Tensor],
    target_probs: torch.Tensor,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
    *,
    draft_probs: Optional[torch.Tensor] = None,
    temperature: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    check_tree: bool = True,
    status: Optional[torch.Tensor] = None,
) -> None:
    """A drop-in for sgl-kernel's ``tree_speculative_sampling_target_only`` (see the module
    doc); writes predicts, accept_index and accept_token_num in place."""
    del draft_probs, deterministic  # a scratch buffer of some sgl-kernel versions; always deterministic
    _check_thresholds(threshold_single, threshold_acc)
    bs, slots, vocab = _check_shapes(
        "tree_speculative_sampling_target_only", predicts, accept_index, accept_token_num, candidates,
        retrive_index, retrive_next_token, retrive_next_sibling, target_probs,
    )  # fmt: skip
    device = target_probs.device
    tree = _tree_arrays(candidates, retrive_next_token, retrive_next_sibling)
    index = _predict_index(
        retrive_index, predicts.numel(), check_tree, tree[1], "tree_speculative_sampling_target_only"
    )
    seeds, offsets = _streams(seeds, offsets, uniform_samples, uniform_samples_for_final_sampling, bs, slots, device)
    nodes, tokens, num_accepted = ops.tree_verify(
        target_probs.reshape(bs * slots, vocab),  # slot j's row is the distribution after slot j
        *tree,
        temperature=_temperature(temperature, bs, device),
        seeds=seeds,
        offsets=offsets,
        max_depth=slots - 1,
        target_is_probs=True,
        status=status,
    )
    _write(predicts, accept_index, accept_token_num, index, nodes, tokens, num_accepted)


def verify_tree_greedy(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    *,
    check_tree: bool = True,
    status: Optional[torch.Tensor] = None,
) -> None:
    """A drop-in for sgl-kernel's ``verify_tree_greedy``: the walk follows the target's argmax
    ids (``target_predict``, read at retrive_index); writes predicts, accept_index and
    accept_token_num in place, as :func:`tree_speculative_sampling_target_only` does.

    The ids go through ``tree_verify`` at temperature 0 over a vocabulary of the request's own
    slots: a slot's token is the lowest slot holding the same candidate, a slot's row is one-hot
    at the lowest slot holding its predicted id (or at N: no candidate holds it), so no row of the
    model's vocabulary is ever built."""
    op = "verify_tree_greedy"
    bs, slots = candidates.shape if isinstance(candidates, torch.Tensor) and candidates.ndim == 2 else (0, 0)
    if (
        not isinstance(target_predict, torch.Tensor)
        or target_predict.dtype not in INT_DTYPES
        or target_predict.numel() < max(bs * slots, 1)
    ):
        raise ValueError(f"{op}: target_predict must be int32 or int64 holding the [bs * N] = {bs * slots} argmax ids")
    stand_in = torch.empty((bs, max(slots, 1), 1), device=target_predict.device)  # shapes only
    bs, slots, _ = _check_shapes(
        op, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, stand_in, target_name="target_predict",
    )  # fmt: skip
    device = candidates.device
    index = retrive_index.long().clamp(0, max(predicts.numel() - 1, 0))
    # the argmax after each slot, read at its retrive_index (sgl-kernel's flat indexing)
    flat = target_predict.reshape(-1).long()
    predicted = flat.gather(0, index.reshape(-1).clamp(0, flat.numel() - 1)).view(bs, slots)
    cand = candidates.long()
    # slot-level vocabulary: the lowest slot of each candidate, and of each predicted id
    same = cand.unsqueeze(2) == cand.unsqueeze(1)  # [bs, N, N]: slot i, slot j hold one token
    same[:, :, 0] = False  # slot 0 is the root: its candidate is never a child's
    lowest = torch.arange(slots, device=device).expand(bs, slots, slots)
    canon = torch.where(same, lowest, slots).amin(dim=2)  # [bs, N]
    hits = predicted.unsqueeze(2) == cand.unsqueeze(1)
    hits[:, :, 0] = False  # slot 0 is the root: its candidate is never a child's
    target = torch.where(hits, lowest, slots).amin(dim=2)  # [bs, N]: N when no slot holds the id
    rows = torch.zeros(bs * slots, slots + 1, dtype=torch.float32, device=device)
    rows.scatter_(1, target.reshape(-1, 1), 1.0)
    node_tokens, parents, cu = _tree_arrays(canon, retrive_next_token, retrive_next_sibling)
    # retrive_index indexes predicts and target_predict both (sgl-kernel reads the argmax there)
    index = _predict_index(
        retrive_index, min(predicts.numel(), flat.numel()), check_tree, parents, op, "predicts and target_predict"
    )
    zeros = torch.zeros(bs, dtype=torch.int64, device=device)
    nodes, _, num_accepted = ops.tree_verify(
        rows, node_tokens, parents, cu,
        temperature=torch.zeros(bs, dtype=torch.float32, device=device), seeds=zeros, offsets=zeros,
        max_depth=slots - 1, target_is_probs=True, status=status,
    )  # fmt: skip
    # the token after each walked slot is its predicted id (an accepted child's token equals it)
    local = (nodes.long() - torch.arange(bs, device=device).unsqueeze(1) * slots).clamp(0, slots - 1)
    tokens = torch.where(nodes >= 0, predicted.gather(1, local), -1)
    _write(predicts, accept_index, accept_token_num, index, nodes, tokens, num_accepted)


def _tree_arrays(candidates, next_token, next_sibling) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree_verify's flat (node_tokens, parents, cu_num_nodes) from SGLang's lists, on the device.

    A slot's parent: the slot whose first child heads its sibling list. The head is found by
    pointer jumping over the reversed sibling links (ceil(log2 N) + 1 gathers). Slots no list
    reaches keep parent -1: padding, never walked. Slot 0's token is not read (set to 0)."""
    bs, slots = candidates.shape
    device = candidates.device
    j = torch.arange(slots, device=device).expand(bs, slots)
    nxt, sib = next_token.long(), next_sibling.long()
    inside = lambda t: (t >= 0) & (t < slots)  # noqa: E731  (links outside the request are ignored)
    # first_parent[c] = j for next_token[j] = c; prev[t] = s for next_sibling[s] = t
    first_parent = torch.full((bs, slots + 1), -1, dtype=torch.int64, device=device)
    first_parent.scatter_(1, torch.where(inside(nxt), nxt, slots), j.clone())
    prev = torch.full((bs, slots + 1), -1, dtype=torch.int64, device=device)
    prev.scatter_(1, torch.where(inside(sib), sib, slots), j.clone())
    prev = prev[:, :slots]
    head = torch.where(prev >= 0, prev, j)
    for _ in range(math.ceil(math.log2(max(slots, 2))) + 1):
        head = head.gather(1, head)
    parent = first_parent[:, :slots].gather(1, head)
    parent[:, 0] = -1  # the root
    base = (torch.arange(bs, device=device) * slots).unsqueeze(1)
    parents = torch.where(parent >= 0, parent + base, -1)
    tokens = candidates.long().clone()
    tokens[:, 0] = 0
    cu = torch.arange(bs + 1, dtype=torch.int64, device=device) * slots
    return tokens.reshape(-1), parents.reshape(-1), cu


def _predict_index(retrive_index, numel, check, tree_parents, op, what="predicts") -> torch.Tensor:
    """retrive_index as int64 for the scatters: checked on the host (with the tree's slot order,
    when given), or clamped into predicts."""
    index = retrive_index.long()
    if check:
        bad_index = ((index < 0) | (index >= numel)).any(dim=1)
        summary = [bad_index]
        if tree_parents is not None:
            summary.append(_misordered(tree_parents, index.shape))
        found = torch.stack(summary).cpu()
        if found.any():
            kind, b = (int(v[0]) for v in torch.nonzero(found).T)
            if kind == 0:
                raise ValueError(f"{op}: request {b} has a retrive_index outside {what} [0, {numel})")
            raise ValueError(f"{op}: request {b} lists a child at a lower slot than its parent")
    return index.clamp(0, max(numel - 1, 0))


def _misordered(parents, shape) -> torch.Tensor:
    """[bs] bool: a slot whose parent sits at the same or a higher slot."""
    bs, slots = shape
    flat = torch.arange(bs * slots, device=parents.device)
    return ((parents >= 0) & (parents >= flat)).view(bs, slots).any(dim=1)


def _write(predicts, accept_index, accept_token_num, index, nodes, tokens, num_accepted) -> None:
    """sgl-kernel's outputs from tree_verify's: the walk cut after S - 1 accepted drafts (the
    token sampled at the last kept slot is an exact sample of p there, accepted or not)."""
    bs, slots = index.shape
    steps = accept_index.shape[1]
    device = index.device
    kept = num_accepted.clamp(max=steps - 1)
    k = torch.arange(slots, device=device)
    walked = k <= kept.clamp(min=0).unsqueeze(1)  # a failed request writes its root's -1
    local = (nodes.long() - torch.arange(bs, device=device).unsqueeze(1) * slots).clamp(0, slots - 1)
    where = torch.where(walked, index.gather(1, local), index[:, :1])
    values = torch.where(walked, tokens, tokens[:, :1])
    predicts.view(-1).scatter_(0, where.reshape(-1), values.reshape(-1).to(predicts.dtype))
    width = min(steps, slots)
    accepted = torch.full((bs, steps), -1, dtype=torch.int64, device=device)
    live = walked[:, :width] & (num_accepted >= 0).unsqueeze(1)
    accepted[:, :width] = torch.where(live, index.gather(1, local)[:, :width], -1)
    accept_index.copy_(accepted)
    accept_token_num.copy_(kept)


def _streams(seeds, offsets, coins, final_coins, bs, slots, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[bs] int64 Philox seeds and offsets: the caller's, or the bit patterns of the coins."""
    if (seeds is None) != (offsets is None):
        raise ValueError("tree_speculative_sampling_target_only: seeds and offsets must be given together")
    if seeds is not None:
        for name, t in (("seeds", seeds), ("offsets", offsets)):
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.int64
                or tuple(t.shape) != (bs,)
                or t.device != device
            ):
                raise ValueError(
                    f"tree_speculative_sampling_target_only: {name} must be a [bs] = ({bs},) int64 tensor on {device}"
                )
        return seeds, offsets
    for name, t, shape in (
        ("uniform_samples", coins, (bs, slots)),
        ("uniform_samples_for_final_sampling", final_coins, (bs,)),
    ):
        if (
            not isinstance(t, torch.Tensor)
            or tuple(t.shape) != shape
            or not t.is_floating_point()
            or t.device != device
        ):
            raise ValueError(
                f"tree_speculative_sampling_target_only: {name} must be a float tensor of shape {shape} on {device} "
                "(or pass seeds= and offsets=)"
            )
    # float32 bits of uniforms in [0, 1) are below 2**31: two of them fill a non-negative int64
    coin_bits = coins.float().contiguous().view(torch.int32).long() & _MASK32
    final_bits = final_coins.float().contiguous().view(torch.int32).long() & _MASK32
    seeds = (coin_bits[:, 0] << 32) | final_bits
    # the batch row in the high word keeps equal coins (all zeros, say) from sharing draws
    rows = torch.arange(bs, dtype=torch.int64, device=device)
    offsets = (rows << 32) | coin_bits[:, -1]
    return seeds, offsets


def _temperature(temperature, bs, device) -> torch.Tensor:
    if temperature is None:
        return torch.ones(bs, dtype=torch.float32, device=device)  # p comes tempered: sample as given
    if not isinstance(temperature, torch.Tensor) or tuple(temperature.shape) != (bs,) or temperature.device != device:
        raise ValueError(
            f"tree_speculative_sampling_target_only: temperature must be a [bs] = ({bs},) tensor on {device}"
        )
    return temperature.to(torch.float32)


def _check_thresholds(threshold_single, threshold_acc) -> None:
    for name, v in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if isinstance(v, torch.Tensor):
            raise TypeError(
                f"tree_speculative_sampling_target_only: {name} got a tensor (draft_probs is keyword-only here)"
            )
        if float(v) != LOSSLESS_THRESHOLD:
            raise ValueError(
                f"tree_speculative_sampling_target_only: {name}={v} is not lossless; flashspark verifies exactly "
                f"(threshold_single = threshold_acc = {LOSSLESS_THRESHOLD})"
            )


def _check_shapes(
    op,
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    next_token,
    next_sibling,
    target_probs,
    target_name="target_probs",
):
    named = {
        "predicts": predicts,
        "accept_index": accept_index,
        "accept_token_num": accept_token_num,
        "candidates": candidates,
        "retrive_index": retrive_index,
        "retrive_next_token": next_token,
        "retrive_next_sibling": next_sibling,
        target_name: target_probs,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.device != target_probs.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {target_name} is on {target_probs.device}")
    if target_probs.ndim != 3:
        raise ValueError(f"{op}: target_probs must be [bs, N, V], got {tuple(target_probs.shape)}")
    if target_probs.dtype not in PROB_DTYPES:
        raise ValueError(f"{op}: target_probs must be float32, bfloat16 or float16, got {target_probs.dtype}")
    bs, slots, vocab = target_probs.shape
    if slots == 0 or vocab == 0:
        raise ValueError(f"{op}: target_probs needs N >= 1 slots and V >= 1, got {tuple(target_probs.shape)}")
    for name in ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        t = named[name]
        if tuple(t.shape) != (bs, slots):
            raise ValueError(f"{op}: {name} must be [bs, N] = {(bs, slots)}, got {tuple(t.shape)}")
    if accept_index.ndim != 2 or accept_index.shape[0] != bs or accept_index.shape[1] < 1:
        raise ValueError(f"{op}: accept_index must be [bs, S >= 1] with bs = {bs}, got {tuple(accept_index.shape)}")
    if tuple(accept_token_num.shape) != (bs,):
        raise ValueError(f"{op}: accept_token_num must be [bs] = ({bs},), got {tuple(accept_token_num.shape)}")
    if predicts.ndim != 1 or not predicts.is_contiguous():
        raise ValueError(f"{op}: predicts must be a contiguous 1D tensor, got {tuple(predicts.shape)}")
    for name, t in named.items():
        if name != target_name and t.dtype not in INT_DTYPES:
            raise ValueError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
    return bs, slots, vocab
