"""What every trainer shares: the learning-rate schedule over training time."""

from __future__ import annotations

import math


def lr_at(progress: float, a) -> float:
    """Linear warmup then cosine decay to min_lr_frac, over training time: `progress` in [0, 1]
    is the fraction of the time budget spent; `a` holds lr, warmup_frac and min_lr_frac."""
    if progress < a.warmup_frac:
        return a.lr * progress / a.warmup_frac
    p = min(1.0, (progress - a.warmup_frac) / (1.0 - a.warmup_frac))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))
