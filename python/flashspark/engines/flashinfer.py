"""FlashInfer's chain speculative sampling on `flashspark.verify`.

    from flashspark.engines.flashinfer import chain_speculative_sampling
    output_token_ids, accepted, emitted = chain_speculative_sampling(
        draft_probs, draft_token_ids, target_probs, accepted_buf, emitted_buf, seed=seed, offset=offset
    )

Shapes (B requests, n draft tokens each, V vocabulary), as FlashInfer takes them:
    draft_probs       [B, n, V] float32/bfloat16/float16: the drafter's q at each draft position
    draft_token_ids   [B, n] int32/int64, in [0, V); -1 is vLLM's placeholder, rejected there
    target_probs      [B, n + 1, V] float32/bfloat16/float16: the target's p, the last row being
                      each request's bonus row; rows are taken as given (values in [0, 1])
    maybe_output_accepted_token_num, maybe_output_emitted_draft_token_num
                      [B] int32/int64 buffers the counts are added into, in place; or None
    seed, offset      ints, or int64/uint64 [1] or [B] tensors on the data's device; both or neither
Returns (output_token_ids [B, n + 1] int32: the accepted drafts, then the correction or the
bonus token, then -1; output_accepted_token_num [B]; output_emitted_draft_token_num [B]).

  * accepted counts every position's accept test u * q(x) < p(x) independently, after the first
    rejection too (it measures how well the drafter matches the target); the uniforms are the
    kernel's own Philox draws, so the positions before the first rejection count exactly the
    drafts the kernel accepted. FlashInfer's kernel draws a second uniform at the rejected
    position itself; here that position counts its one (failed) test.
  * emitted counts the drafts accepted before the first rejection (the bonus token excluded):
    request b emits emitted[b] + 1 tokens.

Randomness: Philox, not FlashInfer's curand stream, so the tokens differ from FlashInfer's for
equal seeds; both are exact samples. Request b of a call draws at positions offset + b * 2**32 + k
(FlashInfer's per-request subsequence), so advancing offset by n + 1 per call never reuses a draw.
A length-B seed or offset tensor gives each request its own (FlashInfer reads element 0 only).
Without seed and offset, a seed is drawn from `generator` (torch's default one when None) on its
device: with a generator on the data's device nothing synchronizes with the host (a CPU generator
with CUDA data costs a one-element copy). `deterministic` is accepted and has no effect:
flashspark's kernels are always deterministic.

What it does not do: top-k / top-p or temperature (target_probs come tempered and filtered, as
FlashInfer takes them). On CUDA a request with bad values (a p or q outside [0, 1], an id
outside [0, V)) emits nothing: its row is -1 and both counters add 0; pass `status` (a [B]
int32 tensor, flashspark's extension) to learn why. On the CPU the call raises instead.
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

from .. import ops
from ..ops.philox import PURPOSE_ACCEPT, philox4x32_10, uniform_open01

PLACEHOLDER_TOKEN_ID = ops.PLACEHOLDER_TOKEN  # -1, in the output padding (and as a draft: rejected)
SEED_BOUND = 2**62  # seeds drawn from a generator lie in [0, SEED_BOUND)
REQUEST_STRIDE = 2**32  # request b's Philox positions start at offset + b * REQUEST_STRIDE
PROB_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
_MASK32 = 0xFFFFFFFF

SeedLike = Union[int, torch.Tensor]


def chain_speculative_sampling(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    maybe_output_accepted_token_num: Optional[torch.Tensor] = None,
    maybe_output_emitted_draft_token_num: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    generator: Optional[torch.Generator] = None,
    seed: Optional[SeedLike] = None,
    offset: Optional[SeedLike] = None,
    *,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drop-in for ``flashinfer.sampling.chain_speculative_sampling`` (see the module doc)."""
    batch, n, vocab = _check_shapes(draft_probs, draft_token_ids, target_probs)
    device = target_probs.device
    accepted_buf = _counter("maybe_output_accepted_token_num", maybe_output_accepted_token_num, batch, device)
    emitted_buf = _counter("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, batch, device)
    if not isinstance(deterministic, bool):
        raise TypeError(f"chain_speculative_sampling: deterministic must be a bool, got {type(deterministic).__name__}")
    seeds, offsets = request_streams(seed, offset, generator, batch, device)

    tokens, num_accepted = ops.verify(
        target_probs.reshape(batch * (n + 1), vocab),  # per request n draft rows then its bonus row
        draft_token_ids.reshape(-1),
        torch.arange(batch + 1, dtype=torch.int64, device=device) * n,
        temperature=torch.ones(batch, dtype=torch.float32, device=device),  # probabilities come tempered
        seeds=seeds,
        offsets=offsets,
        max_spec_len=n,
        draft_probs=draft_probs.reshape(batch * n, vocab),
        target_is_probs=True,
        status=status,
    )
    failed = num_accepted < 0  # a request the kernel failed (CUDA, or status given) counts nothing
    passes = accept_tests(draft_probs, draft_token_ids, target_probs, seeds, offsets)
    independent = passes.sum(dim=1).masked_fill(failed, 0)
    emitted = num_accepted.clamp(min=0)
    accepted_buf.add_(independent.to(accepted_buf.dtype))
    emitted_buf.add_(emitted.to(emitted_buf.dtype))
    return tokens, accepted_buf, emitted_buf


def accept_tests(
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """[B, n] bool: u * q(x) < p(x) at every draft position, with the uniform u the kernel draws
    there (Philox at (seeds[b], offsets[b] + k, PURPOSE_ACCEPT, 0)). A placeholder fails."""
    batch, n, vocab = draft_probs.shape
    ids = draft_token_ids.long()
    valid = (ids >= 0) & (ids < vocab)
    safe = ids.clamp(0, vocab - 1).unsqueeze(-1)  # gathered even where invalid: no device assert
    q = draft_probs.gather(2, safe).squeeze(-1).float()
    p = target_probs[:, :n].gather(2, safe).squeeze(-1).float()
    pos = offsets.unsqueeze(1) + torch.arange(n, dtype=torch.int64, device=offsets.device)
    key = seeds.unsqueeze(1)
    # philox_u32 at index 0: lane 0 of block 0; the words of position and seed are taken as uint64
    word = philox4x32_10(
        (0, pos & _MASK32, (pos >> 32) & _MASK32, PURPOSE_ACCEPT), (key & _MASK32, (key >> 32) & _MASK32)
    )[0]
    u = uniform_open01(word)
    return valid & (u * q < p)


def request_streams(
    seed: Optional[SeedLike],
    offset: Optional[SeedLike],
    generator: Optional[torch.Generator],
    batch: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] int64 Philox seeds and offsets from FlashInfer's scalar (or tensor) seed and offset,
    or from the generator; request b's positions start REQUEST_STRIDE * b further on."""
    if (seed is None) != (offset is None):
        raise ValueError("chain_speculative_sampling: seed and offset must be given together (or neither)")
    if seed is None:
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"chain_speculative_sampling: generator must be a torch.Generator, got {type(generator).__name__}"
            )
        # drawn on the generator's device, then copied: no host synchronization when that is the data's
        gen_device = generator.device if generator is not None else device
        drawn = torch.randint(0, SEED_BOUND, (1,), generator=generator, device=gen_device, dtype=torch.int64)
        seeds = drawn.to(device).expand(batch)
        base = torch.zeros(batch, dtype=torch.int64, device=device)
    else:
        if isinstance(seed, torch.Tensor) != isinstance(offset, torch.Tensor):
            raise ValueError("chain_speculative_sampling: seed and offset must both be tensors or both be ints")
        seeds = _stream_value("seed", seed, batch, device)
        base = _stream_value("offset", offset, batch, device)
    stride = torch.arange(batch, dtype=torch.int64, device=device) * REQUEST_STRIDE
    return seeds.contiguous(), (base + stride).contiguous()


def _stream_value(name: str, value: SeedLike, batch: int, device: torch.device) -> torch.Tensor:
    """A seed or offset as [B] int64 (uint64 values keep their bits)."""
    if isinstance(value, torch.Tensor):
        if value.device != device:
            raise ValueError(f"chain_speculative_sampling: {name} tensor must be on {device}, got {value.device}")
        if value.dtype not in (torch.int64, torch.uint64):
            raise ValueError(f"chain_speculative_sampling: {name} tensor must be int64/uint64, got {value.dtype}")
        if value.ndim != 1 or value.shape[0] not in (1, batch):
            raise ValueError(
                f"chain_speculative_sampling: {name} tensor must be 1D of length 1 or {batch}, got shape {tuple(value.shape)}"
            )
        return value.view(torch.int64).expand(batch)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"chain_speculative_sampling: {name} must be an int or a tensor, got {type(value).__name__}")
    v = int(value)
    if not -(2**63) <= v < 2**64:
        raise ValueError(f"chain_speculative_sampling: {name} {v} does not fit in 64 bits")
    return torch.full((batch,), v - 2**64 if v >= 2**63 else v, dtype=torch.int64, device=device)


def _check_shapes(draft_probs, draft_token_ids, target_probs) -> tuple[int, int, int]:
    for name, t in (("draft_probs", draft_probs), ("draft_token_ids", draft_token_ids), ("target_probs", target_probs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"chain_speculative_sampling: {name} must be a tensor, got {type(t).__name__}")
    if draft_probs.ndim != 3:
        raise ValueError(
            f"chain_speculative_sampling: draft_probs must be [B, n, V], got shape {tuple(draft_probs.shape)}"
        )
    batch, n, vocab = draft_probs.shape
    if tuple(draft_token_ids.shape) != (batch, n):
        raise ValueError(
            f"chain_speculative_sampling: draft_token_ids must be [B, n] = {(batch, n)}, got {tuple(draft_token_ids.shape)}"
        )
    if tuple(target_probs.shape) != (batch, n + 1, vocab):
        raise ValueError(
            f"chain_speculative_sampling: target_probs must be [B, n + 1, V] = {(batch, n + 1, vocab)}, "
            f"got {tuple(target_probs.shape)}"
        )
    if vocab == 0:
        raise ValueError("chain_speculative_sampling: the vocabulary is empty (V = 0)")
    for name, t in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if t.dtype not in PROB_DTYPES:
            raise ValueError(f"chain_speculative_sampling: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if draft_token_ids.dtype not in ID_DTYPES:
        raise ValueError(
            f"chain_speculative_sampling: draft_token_ids must be int32 or int64, got {draft_token_ids.dtype}"
        )
    for name, t in (("draft_probs", draft_probs), ("draft_token_ids", draft_token_ids)):
        if t.device != target_probs.device:
            raise ValueError(
                f"chain_speculative_sampling: {name} is on {t.device} but target_probs is on {target_probs.device}"
            )
    return batch, n, vocab


def _counter(name: str, buf: Optional[torch.Tensor], batch: int, device: torch.device) -> torch.Tensor:
    """The caller's [B] counter buffer (added into in place), or fresh int32 zeros."""
    if buf is None:
        return torch.zeros(batch, dtype=torch.int32, device=device)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"chain_speculative_sampling: {name} must be a tensor, got {type(buf).__name__}")
    if tuple(buf.shape) != (batch,):
        raise ValueError(f"chain_speculative_sampling: {name} must be [B] = ({batch},), got {tuple(buf.shape)}")
    if buf.dtype not in ID_DTYPES:
        raise ValueError(f"chain_speculative_sampling: {name} must be int32 or int64, got {buf.dtype}")
    if buf.device != device:
        raise ValueError(f"chain_speculative_sampling: {name} is on {buf.device} but target_probs is on {device}")
    return buf
