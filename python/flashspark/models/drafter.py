"""What every drafter's `propose` returns: one drafted block, whatever the method.

The loop calls `drafter.propose(cache, anchor, ctx_lens, temperature, seeds, offsets,
path=..., signals=...)` and reads only this; a new drafter is one file (a subclass of
`DFlashDrafter` with its own `propose`) plus one registry line in `flashspark.methods`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftBlock(NamedTuple):
    """One drafted block. Draft k (1..γ-1) sits at column k - 1."""

    tokens: torch.Tensor  # [B, γ-1] int64
    probs: torch.Tensor | None = None  # q for verify: dense [B, γ-1, V], sparse [B, γ-1, K], or None (one-hot)
    prob_ids: torch.Tensor | None = None  # [B, γ-1, K] vocabulary ids of sparse q
    logits: torch.Tensor | None = None  # [B, γ-1, V] DFlash draft logits
    confidence: torch.Tensor | None = None  # [B, γ-1] DSpark's calibrated per-token survival
    signals: torch.Tensor | None = None  # [B, γ-1, 4] DFlash 2 path-selector signals (scheduling.proxy.SIGNALS)
    cand_ids: torch.Tensor | None = None  # [B, γ-1, K] DFlash 2 Top-K candidates, best first
    top2_margin: torch.Tensor | None = None  # [B, γ-1] drafter's top-1 minus top-2 log-prob (with signals)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] fp32 top-1 minus top-2 (equal in logits and log-probs: the
    normalizer cancels); +inf for a single entry. `scheduling.margin` reads it."""
    if logits.shape[-1] < 2:
        return torch.full(logits.shape[:-1], float("inf"), device=logits.device)
    top = logits.float().topk(2, -1).values
    return top[..., 0] - top[..., 1]
