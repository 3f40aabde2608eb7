"""Fixed K: every active request verifies the same number of drafts."""

from __future__ import annotations

import torch

from .base import Scheduler, ScheduleState


class FixedK(Scheduler):
    """Every active request verifies the same k drafts."""

    fixed_width = True

    def __init__(self, k: int):
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        self.max_spec_len = k

    def plan(self, state: ScheduleState) -> torch.Tensor:
        return state.active.to(torch.int64) * self.max_spec_len

    def __repr__(self) -> str:
        return f"FixedK({self.max_spec_len})"
