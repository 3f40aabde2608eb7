"""What every drafter's `propose` returns: one drafted block, whatever the method.

The loop calls `drafter.propose(cache, anchor, ctx_lens, temperature, seeds, offsets,
path=..., signals=...)` and reads only this; a new drafter is one file (a subclass of
`DFlashDrafter` with its own `propose`) plus one registry line in `flashspark.methods`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class DraftTree(NamedTuple):
    """The shape of a block drafted as a tree (`models.tree`): draft column i is node i + 1 of
    the tree, whose node 0 is the anchor (the root). Columns are in best-first order: every
    node's parent comes before it, so every prefix of the columns is a tree (what a scheduler
    may cut). A chain is the tree with parents[i] = i."""

    parents: torch.Tensor  # [B, M] int64: node i + 1's parent, a node in [0, i]
    depths: torch.Tensor  # [B, M] int64 >= 1: block position (the anchor is depth 0)
    rank: torch.Tensor  # [B, M] int64: the node's rank among its parent's candidates (0: the best)
    probs: torch.Tensor  # [B, M] fp32: its probability among them (the drafter's, or the selector's)
    row_top: torch.Tensor  # [B, M] fp32: the probability of the best of them (rank 0)
    score: torch.Tensor  # [B, M] fp32: path log-probability, non-increasing along the columns
    accepted: torch.Tensor | None = None  # [B, M] bool, set by the loop after verify: on the walked path


class DraftBlock(NamedTuple):
    """One drafted block. Draft k (1..γ-1) sits at column k - 1; as a tree (`tree` set), column
    i holds node i + 1 and the per-draft fields hold each node's."""

    tokens: torch.Tensor  # [B, γ-1] int64
    probs: torch.Tensor | None = None  # q for verify: dense [B, γ-1, V], sparse [B, γ-1, K], or None (one-hot)
    prob_ids: torch.Tensor | None = None  # [B, γ-1, K] vocabulary ids of sparse q
    logits: torch.Tensor | None = None  # [B, γ-1, V] DFlash draft logits
    confidence: torch.Tensor | None = None  # [B, γ-1] DSpark's calibrated per-token survival
    signals: torch.Tensor | None = None  # [B, γ-1, 4] DFlash 2 path-selector signals (scheduling.proxy.SIGNALS)
    cand_ids: torch.Tensor | None = None  # [B, γ-1, K] DFlash 2 Top-K candidates, best first
    top2_margin: torch.Tensor | None = None  # [B, γ-1] drafter's top-1 minus top-2 log-prob (with signals)
    tree: DraftTree | None = None  # a token tree of N - 1 draft nodes (None: a chain)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits -> [...] fp32 top-1 minus top-2 (equal in logits and log-probs: the
    normalizer cancels); +inf for a single entry. `scheduling.margin` reads it."""
    if logits.shape[-1] < 2:
        return torch.full(logits.shape[:-1], float("inf"), device=logits.device)
    top = logits.float().topk(2, -1).values
    return top[..., 0] - top[..., 1]
