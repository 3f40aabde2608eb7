"""Speculative decoding: the loop, schedulers and Philox sampling helpers."""

from .loop import speculative_generate
from .schedulers import FixedK, ScheduleState

__all__ = ["speculative_generate", "FixedK", "ScheduleState"]
