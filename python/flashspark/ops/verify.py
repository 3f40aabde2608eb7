"""Ragged rejection-sampling verification: the `verify` / `verify_out` wrappers, their
fakes, and the PyTorch implementation (the tests' oracle)."""

from __future__ import annotations

from typing import Optional

import torch

from .common import GREEDY_TEMPERATURE, _one_device, _required, _to_int, log_softmax_shifted
from .philox import PURPOSE_ACCEPT, PURPOSE_RESAMPLE, exponential, gumbel, philox_u32, uniform_open01

# A draft id of -1 marks a position with no draft (vLLM's placeholder): it is rejected, so the
# request emits the correction token sampled at that position and stops (kPlaceholderToken).
PLACEHOLDER_TOKEN = -1


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_spec_len: int,
    draft_probs: Optional[torch.Tensor] = None,
    draft_probs_ids: Optional[torch.Tensor] = None,
    bonus_tokens: Optional[torch.Tensor] = None,
    target_is_probs: bool = False,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rejection-sampling verification of draft tokens (lossless).

    B requests; request b proposes ``n_b = cu_num_draft[b+1] - cu_num_draft[b]``
    draft tokens (0 <= n_b <= max_spec_len); T = sum n_b; V = vocabulary size.

    Args:
      target_logits: ``[T + B, V]`` float32, bfloat16 or float16. Request b owns
        rows ``cu_num_draft[b] + b ... cu_num_draft[b+1] + b``: the target's
        logits at each of its draft positions, then its bonus row. Rows may be
        strided (e.g. a slice of a larger buffer). Softmax with temperature is
        fused into the kernel; probabilities are never materialized. With
        ``target_is_probs`` the rows hold the target's probabilities instead.
      draft_tokens: ``[T]`` int32/int64, flattened over requests, in ``[0, V)``; ``-1``
        (``PLACEHOLDER_TOKEN``) marks a position with no draft: it is rejected, so the
        request emits the token sampled there (argmax when greedy) and stops.
      cu_num_draft: ``[B + 1]`` int32/int64 offsets into ``draft_tokens``.
      temperature: ``[B]`` float32 per-request target temperature, finite and
        >= 0; below ``GREEDY_TEMPERATURE`` (1e-5) the request is greedy.
      seeds: ``[B]`` int64 per-request Philox seed.
      offsets: ``[B]`` int64 per-request stream position. Row k of request b
        draws at position ``offsets[b] + k``; advance it by at least
        ``max_spec_len + 1`` between calls so no draw is ever reused.
      max_spec_len: static bound on n_b (at most ``MAX_SPEC_LEN``); fixes the output width.
      draft_probs: the drafter's q. ``None``: the draft was deterministic (q is
        one-hot at the draft token). ``[T, V]``: dense q. ``[T, K]`` together with
        ``draft_probs_ids``: sparse q over K candidate ids. float32, bfloat16 or
        float16, whatever the dtype of ``target_logits``.
      bonus_tokens: optional ``[B]`` int32/int64 bonus tokens the caller sampled itself
        (vLLM samples its own), in ``[0, V)``. With them ``target_logits`` is ``[T, V]``, the
        draft rows alone, and a request that accepts all its drafts emits its bonus token.
      target_is_probs: ``target_logits`` holds probabilities p (an engine that has them
        already, as FlashInfer's and SGLang's samplers take them): each row is a
        distribution taken as given (values in [0, 1], the sum not checked), p(x) is read
        directly and the race keys are ``r(x) / E`` with ``E = -log u``, so no log or
        softmax is taken over a row and no extra pass is made. Probabilities come
        tempered: ``temperature`` must be 0 (greedy: argmax of p) or exactly 1.
      draft_probs_ids: ``[T, K]`` int32/int64 candidate ids for sparse q. An id
        listed twice counts with the sum of its probabilities.
      status: optional ``[B]`` int32 output: 0, or the code of what failed the
        request (see :func:`raise_on_status`). A failed request emits nothing: its
        ``tokens`` row is all -1 and ``num_accepted`` is -1.

    Every row the walk reads must hold finite logits or -inf, with at least one
    finite (NaN, +inf or an all -inf row fail the request); softmax is computed
    as ``(x - max) / T``, so no finite logit overflows at any temperature.

    Returns:
      ``(tokens, num_accepted)``: ``tokens`` is ``[B, max_spec_len + 1]`` int32
      holding the accepted draft tokens, then the correction token (sampled from
      norm(max(p - q, 0)) at the first rejection) or the bonus token (sampled
      from p when all n_b drafts pass), then -1. ``num_accepted`` is ``[B]``
      int32; request b emits ``num_accepted[b] + 1`` tokens.

    At temperature 0 a draft is accepted while it equals the target argmax and
    the target argmax is emitted at the first mismatch (ties: lowest id).
    """
    _required(
        "verify",
        target_logits=target_logits,
        draft_tokens=draft_tokens,
        cu_num_draft=cu_num_draft,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
    )
    return torch.ops.flashspark.verify(
        target_logits,
        draft_tokens,
        cu_num_draft,
        draft_probs,
        draft_probs_ids,
        temperature,
        seeds,
        offsets,
        max_spec_len,
        bonus_tokens=bonus_tokens,
        target_is_probs=target_is_probs,
        status=status,
    )


def verify_out(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_spec_len: int,
    out_tokens: torch.Tensor,
    out_num_accepted: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    draft_probs_ids: Optional[torch.Tensor] = None,
    bonus_tokens: Optional[torch.Tensor] = None,
    target_is_probs: bool = False,
    status: Optional[torch.Tensor] = None,
) -> None:
    """:func:`verify` writing into preallocated, contiguous int32 outputs
    ``out_tokens [B, max_spec_len + 1]`` and ``out_num_accepted [B]``, as an
    engine does with persistent buffers inside a captured CUDA graph."""
    _required(
        "verify",
        target_logits=target_logits,
        draft_tokens=draft_tokens,
        cu_num_draft=cu_num_draft,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
        out_tokens=out_tokens,
        out_num_accepted=out_num_accepted,
    )
    torch.ops.flashspark.verify_out(
        target_logits,
        draft_tokens,
        cu_num_draft,
        draft_probs,
        draft_probs_ids,
        temperature,
        seeds,
        offsets,
        max_spec_len,
        out_tokens=out_tokens,
        out_num_accepted=out_num_accepted,
        bonus_tokens=bonus_tokens,
        target_is_probs=target_is_probs,
        status=status,
    )


@torch.library.register_fake("flashspark::verify")
def _verify_fake(
    target_logits,
    draft_tokens,
    cu_num_draft,
    draft_probs,
    draft_probs_ids,
    temperature,
    seeds,
    offsets,
    max_spec_len,
    *,
    bonus_tokens=None,
    target_is_probs=False,
    status=None,
):
    _one_device(
        "verify",
        target_logits=target_logits,
        draft_tokens=draft_tokens,
        cu_num_draft=cu_num_draft,
        draft_probs=draft_probs,
        draft_probs_ids=draft_probs_ids,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
        bonus_tokens=bonus_tokens,
        status=status,
    )
    batch = cu_num_draft.shape[0] - 1
    return (
        target_logits.new_empty((batch, max_spec_len + 1), dtype=torch.int32),
        target_logits.new_empty((batch,), dtype=torch.int32),
    )


@torch.library.register_fake("flashspark::verify_out")
def _verify_out_fake(
    target_logits,
    draft_tokens,
    cu_num_draft,
    draft_probs,
    draft_probs_ids,
    temperature,
    seeds,
    offsets,
    max_spec_len,
    *,
    out_tokens,
    out_num_accepted,
    bonus_tokens=None,
    target_is_probs=False,
    status=None,
):
    # the inputs as verify checks them, then the output buffers on the same device
    _verify_fake(
        target_logits,
        draft_tokens,
        cu_num_draft,
        draft_probs,
        draft_probs_ids,
        temperature,
        seeds,
        offsets,
        max_spec_len,
        bonus_tokens=bonus_tokens,
        target_is_probs=target_is_probs,
        status=status,
    )
    _one_device("verify", target_logits=target_logits, out_tokens=out_tokens, out_num_accepted=out_num_accepted)
    return None


def verify_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_spec_len: int,
    draft_probs: Optional[torch.Tensor] = None,
    draft_probs_ids: Optional[torch.Tensor] = None,
    bonus_tokens: Optional[torch.Tensor] = None,
    target_is_probs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle of :func:`flashspark.ops.verify` (same arguments and outputs)."""
    logits = target_logits.detach().float().cpu()
    tokens = draft_tokens.detach().long().cpu()
    cu = cu_num_draft.detach().long().cpu()
    vocab = logits.shape[1]
    batch = cu.numel() - 1
    out = torch.full((batch, max_spec_len + 1), -1, dtype=torch.int32)
    num_accepted = torch.zeros(batch, dtype=torch.int32)
    vocab_ids = torch.arange(vocab)
    bonus = None if bonus_tokens is None else bonus_tokens.detach().long().cpu()
    for b in range(batch):
        lo, hi = int(cu[b]), int(cu[b + 1])
        n = hi - lo
        # with the caller's bonus tokens the logits hold no bonus rows (a stand-in keeps indices)
        rows = logits[lo + b : hi + b + 1] if bonus is None else torch.cat([logits[lo:hi], logits.new_zeros(1, vocab)])
        temp = float(temperature[b])
        seed, offset = _to_int(seeds[b]), _to_int(offsets[b])
        if temp < GREEDY_TEMPERATURE:
            target = rows.argmax(dim=-1)  # first maximum on ties; never the placeholder -1
            k = 0
            while k < n and int(target[k]) == int(tokens[lo + k]):
                k += 1
            out[b, :k] = tokens[lo : lo + k].int()
            out[b, k] = int(target[k]) if k < n or bonus is None else int(bonus[b])
            num_accepted[b] = k
            continue
        # p(x) and the race keys on the given rows: Gumbel on log p, or r / E on probabilities
        if target_is_probs:
            p_rows, logp = rows, None
        else:
            logp = log_softmax_shifted(rows, temp)
            p_rows = logp.exp()
        emitted = None
        k = 0
        for k in range(n):
            x = int(tokens[lo + k])
            placeholder = x == PLACEHOLDER_TOKEN  # rejected: the correction is sampled here
            q = torch.zeros(vocab)
            if draft_probs is None:
                if not placeholder:
                    q[x] = 1.0
            elif draft_probs_ids is None:
                q = draft_probs[lo + k].detach().float().cpu()
            else:
                ids = draft_probs_ids[lo + k].detach().long().cpu()
                probs = draft_probs[lo + k].detach().float().cpu()
                q.index_add_(0, ids, probs)  # an id listed twice counts with the sum of its probabilities
            u = uniform_open01(philox_u32(seed, offset + k, PURPOSE_ACCEPT, 0))
            if not placeholder and u * q[x] < p_rows[k, x]:
                out[b, k] = x
                continue
            emitted = _race(p_rows[k], logp, k, q, philox_u32(seed, offset + k, PURPOSE_RESAMPLE, vocab_ids))
            break
        else:
            k = n
        if emitted is None and bonus is not None:
            emitted = int(bonus[b])
        elif emitted is None:
            bits = philox_u32(seed, offset + n, PURPOSE_RESAMPLE, vocab_ids)
            emitted = _race(p_rows[n], logp, n, torch.zeros(vocab), bits)
        out[b, k] = emitted
        num_accepted[b] = k
    device = target_logits.device
    return out.to(device), num_accepted.to(device)


def _race(p: torch.Tensor, logp: Optional[torch.Tensor], k: int, q: torch.Tensor, bits: torch.Tensor) -> int:
    """The token sampled from norm(max(p - q, 0)) (p itself where that has no mass) by the
    kernels' race: Gumbel keys on logits (``logp`` given), r / E keys on probabilities."""
    if logp is None:
        e = exponential(bits)
        residual = torch.where(q > 0, p - q, p)
        key = torch.where(residual > 0, residual / e, float("-inf"))
        if torch.isneginf(key).all():  # p == q: residual empty, fall back to p
            key = torch.where(p > 0, p / e, float("-inf"))
        return int(key.argmax())
    g = gumbel(bits)
    residual = torch.clamp(p - q, min=0.0)
    key = torch.where(q > 0, torch.log(residual), logp[k]) + g
    if torch.isneginf(key).all():  # p == q: residual empty, fall back to p
        key = logp[k] + g
    return int(key.argmax())
