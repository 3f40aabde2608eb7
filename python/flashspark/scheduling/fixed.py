"""How many draft tokens each request verifies this step.

A scheduler is any callable `scheduler(state) -> torch.Tensor` returning an
int64 tensor [B] with values in [0, max_spec_len]; it must return 0 for
finished requests. `max_spec_len` (an attribute) is the static bound the loop
sizes its buffers with. The confidence scheduler (scheduling.confidence) reads
DSpark's confidences or, through a confidence proxy, DFlash 2's signals.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScheduleState:
    active: torch.Tensor  # [B] bool: request still generating
    ctx_lens: torch.Tensor  # [B] int64: committed tokens in the caches
    draft_tokens: torch.Tensor  # [B, gamma - 1] int64
    draft_logits: torch.Tensor | None = None  # [B, gamma - 1, V] float32 (DFlash drafters)
    confidence: torch.Tensor | None = None  # [B, gamma - 1] per-token survival (DSpark's head)
    signals: torch.Tensor | None = None  # [B, gamma - 1, 4] path-selector signals (DFlash 2)


class FixedK:
    """Every active request verifies the same k drafts."""

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.max_spec_len = k

    def __call__(self, state: ScheduleState) -> torch.Tensor:
        return state.active.to(torch.int64) * self.max_spec_len

    def __repr__(self) -> str:
        return f"FixedK({self.max_spec_len})"
