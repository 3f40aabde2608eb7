"""SGLang's speculative verify, the chain case, on `flashspark.verify`.

    from flashspark.engines.sglang import tree_speculative_sampling_target_only
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_token_num,            # outputs, written in place
        candidates, retrive_index, retrive_next_token, retrive_next_sibling,
        uniform_samples, uniform_samples_for_final_sampling, target_probs,
    )

The signature of sgl-kernel's `tree_speculative_sampling_target_only` (EAGLE's sampling verify)
when the tree is a chain (top-k 1: one child per node). Shapes (bs requests, N slots each: slot 0
is the last verified token, slots 1 .. N - 1 the drafts, V vocabulary), as SGLang passes them:
    predicts            [bs * N (+ more)] int32: predicts[retrive_index[b, j]] is the token that
                        follows slot j, written for j = 0 .. accept_token_num[b]; others untouched
    accept_index        [bs, S] int32: retrive_index of the accepted slots (slot 0 first), then -1
                        (S = spec steps + 1: at most S - 1 drafts are accepted)
    accept_token_num    [bs] int32: the number of accepted drafts (the correction or bonus token
                        excluded)
    candidates          [bs, N] int32/int64: the token at each slot, in [0, V)
    retrive_index       [bs, N] int: each slot's index into predicts
    retrive_next_token  [bs, N] int: the chain, slot j -> j + 1, the last slot -> -1
    retrive_next_sibling [bs, N] int: all -1 (a chain has no siblings)
    uniform_samples     [bs, N] float32, uniform_samples_for_final_sampling [bs] float32: the coins
    target_probs        [bs, N, V] float32/bfloat16/float16: p at each slot (tempered, top-k/top-p
                        renormalized, as SGLang computes them), rows taken as given

The draft is deterministic (q one-hot at each candidate), as in SGLang's target-only verify: a
draft x is accepted with probability p(x), the correction is sampled from p without x, the bonus
from p. A chain shorter than N (next_token -1 earlier) ends there, as in SGLang.

Differences from sgl-kernel, exactly:
  * Randomness is Philox: the coins only seed it (request b's seed and offset are the bit
    patterns of its coins and its batch row), so the result is a deterministic function of the inputs, as in
    SGLang, and torch's seed still governs it, but the tokens differ from sgl-kernel's for the
    same coins; both are exact samples. flashspark's extension `seeds=` / `offsets=` ([bs] int64)
    set the streams directly; the coins may then be None.
  * threshold_single and threshold_acc must be 1.0 (SGLang's defaults): other values accept
    drafts the target would not and are not lossless, so they raise ValueError.
  * Branching trees (any retrive_next_sibling != -1) raise ValueError until tree verification lands;
    so do chains out of slot order and retrive_index values outside predicts. Checking this
    reads a small boolean summary on the host (one synchronization); `check_chain=False` skips
    the read (e.g. inside a CUDA graph): the caller then guarantees a chain, siblings are not
    looked at and out-of-range indices are clamped.
  * accept_index is written whole: -1 past the accepted slots (sgl-kernel leaves those entries as
    they were; EAGLE fills them with -1 beforehand, so it reads the same).
  * `temperature=` ([bs] float32, flashspark's extension): 0 makes a request greedy (the argmax of
    its p, lowest id on ties), 1 (the default) samples; no other value. SGLang's own greedy path
    (`verify_tree_greedy` on argmax ids) is not emulated.
  * `draft_probs=`, a scratch buffer in some sgl-kernel versions, is accepted and not touched.
  * `deterministic` has no effect: flashspark's kernels are always deterministic.
  * On CUDA a request with bad values (an id outside [0, V), a p outside [0, 1]) emits nothing:
    accept_token_num -1, its accept_index row -1, predicts[root] -1; pass `status` ([bs] int32)
    to learn why. On the CPU the call raises instead.
"""

from __future__ import annotations

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
    check_chain: bool = True,
    status: Optional[torch.Tensor] = None,
) -> None:
    """A drop-in for sgl-kernel's ``tree_speculative_sampling_target_only`` on chains (see the
    module doc); writes predicts, accept_index and accept_token_num in place."""
    del draft_probs, deterministic  # a scratch buffer of some sgl-kernel versions; always deterministic
    _check_thresholds(threshold_single, threshold_acc)
    bs, slots, vocab = _check_shapes(
        predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
        retrive_next_sibling, target_probs,
    )  # fmt: skip
    device = target_probs.device
    steps = accept_index.shape[1]
    length = chain_lengths(retrive_next_token)
    if check_chain:
        _check_chain(length, retrive_next_token, retrive_next_sibling, retrive_index, predicts.numel())
    index = retrive_index.long()
    if not check_chain:  # never gather or scatter outside predicts, even for a malformed tree
        index = index.clamp(0, max(predicts.numel() - 1, 0))

    # drafts at slots 1 .. N-1; past the chain's end, or past S - 1 accepted drafts, a placeholder
    # (-1) is rejected where it stands and the token there is sampled from p itself: the bonus
    # SGLang samples at the last accepted slot
    k = torch.arange(slots - 1, device=device)
    live = (k < (length - 1).unsqueeze(1)) & (k < steps - 1)
    drafts = torch.where(live, candidates[:, 1:].long(), ops.PLACEHOLDER_TOKEN)
    seeds, offsets = _streams(seeds, offsets, uniform_samples, uniform_samples_for_final_sampling, bs, slots, device)
    tokens, num_accepted = ops.verify(
        target_probs.reshape(bs * slots, vocab),  # slot j's row is the distribution after slot j
        drafts.reshape(-1),
        torch.arange(bs + 1, dtype=torch.int64, device=device) * (slots - 1),
        temperature=_temperature(temperature, bs, device),
        seeds=seeds,
        offsets=offsets,
        max_spec_len=slots - 1,
        target_is_probs=True,
        status=status,
    )

    # predicts: the token after slot j at retrive_index[b, j], for j <= num_accepted; the other
    # entries write the root's own value to the root, so no entry is written twice differently
    j = torch.arange(slots, device=device)
    emitted = j <= num_accepted.unsqueeze(1)
    where = torch.where(emitted, index, index[:, :1])
    values = torch.where(emitted, tokens, tokens[:, :1])
    predicts.view(-1).scatter_(0, where.reshape(-1), values.reshape(-1).to(predicts.dtype))
    # accept_index: the accepted slots' indices (slot 0 first), then -1
    width = min(steps, slots)
    accepted = torch.full((bs, steps), -1, dtype=torch.int64, device=device)
    accepted[:, :width] = torch.where(emitted[:, :width], retrive_index[:, :width].long(), -1)
    accept_index.copy_(accepted)
    accept_token_num.copy_(num_accepted)


def chain_lengths(retrive_next_token: torch.Tensor) -> torch.Tensor:
    """[bs] int64: the number of slots the chain 0 -> 1 -> 2 ... visits in slot order."""
    slots = retrive_next_token.shape[1]
    step = torch.arange(1, slots, device=retrive_next_token.device)
    in_order = retrive_next_token[:, : slots - 1].long() == step
    return 1 + in_order.long().cumprod(dim=1).sum(dim=1)


def _check_chain(length, next_token, next_sibling, retrive_index, numel) -> None:
    """Raise for a tree that is not a chain in slot order or indexes outside predicts: one host
    read of a [3, bs] summary."""
    bs, slots = next_token.shape
    j = torch.arange(slots, device=next_token.device)
    on_chain = j < length.unsqueeze(1)
    ends = next_token.long().gather(1, (length - 1).unsqueeze(1)).squeeze(1) == -1
    branches = (next_sibling != -1).any(dim=1)
    out_of_range = (((retrive_index < 0) | (retrive_index >= numel)) & on_chain).any(dim=1)
    summary = torch.stack([branches, ~ends, out_of_range]).cpu()
    if not summary.any():
        return
    kind, b = (int(v[0]) for v in torch.nonzero(summary).T)  # the first failed check, then request
    if kind == 0:
        raise ValueError(
            f"tree_speculative_sampling_target_only: request {b} branches (a retrive_next_sibling != -1); "
            "flashspark verifies chains only (top-k 1) until tree verification lands"
        )
    if kind == 1:
        raise ValueError(
            f"tree_speculative_sampling_target_only: request {b}'s retrive_next_token is not a chain in slot "
            f"order (0 -> 1 -> ... -> -1): it leaves slot {int(length[b]) - 1} for "
            f"{int(next_token[b, int(length[b]) - 1])}"
        )
    raise ValueError(
        f"tree_speculative_sampling_target_only: request {b} has a retrive_index outside predicts [0, {numel})"
    )


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
    predicts, accept_index, accept_token_num, candidates, retrive_index, next_token, next_sibling, target_probs
):
    named = {
        "predicts": predicts,
        "accept_index": accept_index,
        "accept_token_num": accept_token_num,
        "candidates": candidates,
        "retrive_index": retrive_index,
        "retrive_next_token": next_token,
        "retrive_next_sibling": next_sibling,
        "target_probs": target_probs,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tree_speculative_sampling_target_only: {name} must be a tensor, got {type(t).__name__}")
        if t.device != target_probs.device:
            raise ValueError(
                f"tree_speculative_sampling_target_only: {name} is on {t.device} but target_probs is on {target_probs.device}"
            )
    if target_probs.ndim != 3:
        raise ValueError(
            f"tree_speculative_sampling_target_only: target_probs must be [bs, N, V], got {tuple(target_probs.shape)}"
        )
    if target_probs.dtype not in PROB_DTYPES:
        raise ValueError(
            f"tree_speculative_sampling_target_only: target_probs must be float32, bfloat16 or float16, got {target_probs.dtype}"
        )
    bs, slots, vocab = target_probs.shape
    if slots == 0 or vocab == 0:
        raise ValueError(
            f"tree_speculative_sampling_target_only: target_probs needs N >= 1 slots and V >= 1, got {tuple(target_probs.shape)}"
        )
    for name in ("candidates", "retrive_index", "retrive_next_token", "retrive_next_sibling"):
        t = named[name]
        if tuple(t.shape) != (bs, slots):
            raise ValueError(
                f"tree_speculative_sampling_target_only: {name} must be [bs, N] = {(bs, slots)}, got {tuple(t.shape)}"
            )
    if accept_index.ndim != 2 or accept_index.shape[0] != bs or accept_index.shape[1] < 1:
        raise ValueError(
            f"tree_speculative_sampling_target_only: accept_index must be [bs, S >= 1] with bs = {bs}, got {tuple(accept_index.shape)}"
        )
    if tuple(accept_token_num.shape) != (bs,):
        raise ValueError(
            f"tree_speculative_sampling_target_only: accept_token_num must be [bs] = ({bs},), got {tuple(accept_token_num.shape)}"
        )
    if predicts.ndim != 1 or not predicts.is_contiguous():
        raise ValueError(
            f"tree_speculative_sampling_target_only: predicts must be a contiguous 1D tensor, got {tuple(predicts.shape)}"
        )
    for name, t in named.items():
        if name != "target_probs" and t.dtype not in INT_DTYPES:
            raise ValueError(f"tree_speculative_sampling_target_only: {name} must be int32 or int64, got {t.dtype}")
    return bs, slots, vocab
