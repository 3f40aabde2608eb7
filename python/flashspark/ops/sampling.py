"""Philox-keyed sampling for the drafter and the loop.

Draws come from the same counter-based Philox4x32-10 stream as the verify op,
keyed by (request seed, position, purpose, index), so a request's randomness
never depends on which batch row it sits in, and the drafter's draws
(`PURPOSE_DRAFT`) never coincide with the verifier's (`PURPOSE_ACCEPT`,
`PURPOSE_RESAMPLE`).

Sampling is by inverse CDF with one uniform per (request, position): exact,
and it needs one Philox word per draw instead of one per vocabulary entry.
"""

from __future__ import annotations

import torch

from .philox import PURPOSE_DRAFT, PURPOSE_RESAMPLE, philox4x32_10, uniform_open01

__all__ = ["PURPOSE_DRAFT", "PURPOSE_RESAMPLE", "philox_uniform", "sample_probs", "sample_logits"]


def philox_uniform(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """Uniform (0, 1) fp32 of shape positions.shape: word 0 of Philox block
    (index 0, position, purpose) under key seed, i.e. `reference.philox_u32(seed,
    position, purpose, 0)`. seeds [B]; positions [B] or [B, P] int64."""
    seeds = seeds.to(torch.int64).view((-1,) + (1,) * (positions.dim() - 1))
    positions = positions.to(torch.int64)
    word0 = philox4x32_10((0, positions, positions >> 32, purpose), (seeds, seeds >> 32))[0]
    return uniform_open01(word0)


def sample_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF samples [...] from rows probs [..., V] (any positive scale) with uniforms u [...]."""
    cdf = probs.cumsum(-1)
    t = (u * cdf[..., -1]).unsqueeze(-1)
    # First index whose CDF reaches t: always a token of positive probability.
    return torch.searchsorted(cdf, t).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    purpose: int,
    want_probs: bool = False,
):
    """Tokens [B, P] (int64) from logits [B, P, V] at per-request temperature [B]:
    argmax where temperature == 0, else a sample from softmax(logits / T) drawn
    at Philox (seeds[b], positions[b, p], purpose). Returns (tokens, probs) where
    probs [B, P, V] fp32 is the sampling distribution (None unless want_probs and
    some temperature > 0)."""
    greedy = logits.argmax(-1)
    if not bool((temperature > 0).any()):
        return greedy, None
    t = temperature.clamp(min=1e-6).view(-1, *([1] * (logits.dim() - 1)))
    probs = torch.softmax(logits.float() / t, -1)
    sampled = sample_probs(probs, philox_uniform(seeds, positions, purpose))
    tokens = torch.where((temperature > 0).view(-1, *([1] * (logits.dim() - 2))), sampled, greedy)
    return tokens, (probs if want_probs else None)
