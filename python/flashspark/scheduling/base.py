"""The scheduler interface the speculative loop calls, with documented no-op hooks.

Each step the loop asks `wants_draft(active)` (False: run a plain decode step, verify 0
drafts), drafts a block, calls `plan(state)` for how many drafts each request verifies
(int64 [B] in [0, max_spec_len], 0 for finished requests), and after `verify` hands the
outcomes to `observe(block, num_accepted, num_verified)`. `max_spec_len` is the static
bound the loop sizes its buffers with; `wants_signals` asks the drafter for DFlash 2's path
signals; `fixed_width` says every active request verifies exactly max_spec_len drafts (the
target forward is then that wide without reading the plan back); otherwise `verify_width`
sets the forward's width from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.drafter import DraftTree


@dataclass
class ScheduleState:
    active: torch.Tensor  # [B] bool: request still generating
    ctx_lens: torch.Tensor  # [B] int64: committed tokens in the caches
    draft_tokens: torch.Tensor  # [B, gamma - 1] int64
    draft_logits: torch.Tensor | None = None  # [B, gamma - 1, V] float32 (DFlash drafters)
    confidence: torch.Tensor | None = None  # [B, gamma - 1] per-token survival (DSpark's head)
    signals: torch.Tensor | None = None  # [B, gamma - 1, 4] path-selector signals (DFlash 2)
    tree: DraftTree | None = None  # a tree block: the per-draft fields hold its N - 1 nodes, best first


class Scheduler:
    max_spec_len: int = 0
    wants_signals: bool = False
    fixed_width: bool = False

    def wants_draft(self, active: torch.Tensor) -> bool:
        """Whether this step drafts at all (every step, unless a scheduler expects plain decoding to win)."""
        return True

    def plan(self, state: ScheduleState) -> torch.Tensor:
        """Drafts each request verifies this step: int64 [B] in [0, max_spec_len], 0 when finished."""
        raise NotImplementedError

    def verify_width(self, num_verified: torch.Tensor) -> int:
        """Draft columns of the step's verify forward, given the drafts each request verifies
        (int64 [B]): at least the most any request verifies (the default, exactly that). A
        wider forward computes columns nobody verifies, worth it where the wider shape runs
        faster; what is verified does not change."""
        return int(num_verified.max())

    def observe(self, block, num_accepted: torch.Tensor, num_verified: torch.Tensor) -> None:
        """The step's outcomes: accepted and verified drafts per request (nothing to learn by default)."""

    def __call__(self, state: ScheduleState) -> torch.Tensor:
        return self.plan(state)
