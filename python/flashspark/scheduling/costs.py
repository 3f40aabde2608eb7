"""What a step costs: SPS(T) tables (target verify steps per second at T verified tokens),
profiled once on the running machine and cached on disk, and the timing of one forward."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .. import data


class SPSTable:
    """Steps per second of the target's verify forward as a function of the
    verified tokens T: piecewise-linear between measured points, constant
    beyond the ends."""

    def __init__(self, tokens: Sequence[int], sps: Sequence[float]):
        t = torch.as_tensor(tokens, dtype=torch.float64)
        s = torch.as_tensor(sps, dtype=torch.float64)
        if t.numel() == 0 or t.shape != s.shape:
            raise ValueError("SPS table needs matching, non-empty token counts and rates")
        if not bool((s > 0).all()):
            raise ValueError("SPS values must be positive")
        order = torch.argsort(t)
        self.tokens, self.sps = t[order], s[order]
        if bool((self.tokens[1:] == self.tokens[:-1]).any()):
            raise ValueError("SPS table has repeated token counts")
        self._t, self._s = self.tokens.numpy(), self.sps.numpy()

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """SPS at token counts `tokens` (any shape), float64."""
        return torch.from_numpy(self.rate(torch.as_tensor(tokens).cpu().numpy()))

    def rate(self, tokens) -> np.ndarray:
        """`__call__` on host numbers (int, float or a NumPy array): the scheduler runs every
        step on a handful of values, where NumPy costs microseconds and torch ops tens."""
        x = np.clip(np.asarray(tokens, dtype=np.float64), self._t[0], self._t[-1])
        if self._t.size == 1:
            return np.full(x.shape, self._s[0])
        i = np.clip(np.searchsorted(self._t, x, side="right"), 1, self._t.size - 1)
        t0, t1, s0, s1 = self._t[i - 1], self._t[i], self._s[i - 1], self._s[i]
        w = np.clip((x - t0) / (t1 - t0), 0.0, 1.0)
        return np.asarray(s0 + w * (s1 - s0))

    def monotone(self) -> "SPSTable":
        """The closest table (least squares in seconds per step) in which a forward over more
        tokens never costs less: the measured seconds fitted non-decreasing in T by pooling
        adjacent violators. A shared machine's timing noise otherwise leaves bumps that price
        the next few drafts out (at batch 1 a verify of 3 tokens once timed 40 ms, of 5 tokens
        45 ms, of 8 tokens 46 ms: a flat cost read as a 15% rise)."""
        blocks: list[list[float]] = []  # [sum of seconds, count] of each pooled run
        for sec in (1.0 / self._s).tolist():
            blocks.append([sec, 1])
            while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
                total, count = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += count
        seconds = [total / count for total, count in blocks for _ in range(int(count))]
        return SPSTable(self.tokens.tolist(), [1.0 / x for x in seconds])

    def with_overhead(self, seconds: float) -> "SPSTable":
        """The table of whole steps that also spend `seconds` on work independent of T
        (drafting): 1 / (1 / SPS(T) + seconds)."""
        if seconds < 0:
            raise ValueError("overhead must be >= 0")
        return SPSTable(self.tokens.tolist(), (1.0 / (1.0 / self.sps + seconds)).tolist())

    def to_dict(self) -> dict:
        return {"tokens": [int(x) for x in self.tokens.tolist()], "sps": self.sps.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "SPSTable":
        return cls(d["tokens"], d["sps"])


# ---------------------------------------------------------------------- SPS profiling
def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashspark"


def _fingerprint(target, batch_size: int, context_len: int, token_counts: list[int], overhead_s: float) -> str:
    """Key of a profile: target shape and dtype, the machine, the torch build and the grid."""
    p = target.model.embed_tokens.weight
    dev = str(p.device)
    if p.device.type == "cuda":
        dev += ":" + torch.cuda.get_device_name(p.device)
    key = json.dumps(
        {
            "config": target.config.to_dict(),
            "dtype": str(p.dtype),
            "device": dev,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "batch": batch_size,
            "context": context_len,
            "tokens": token_counts,
            "overhead": overhead_s,
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _split(total: int, batch_size: int) -> torch.Tensor:
    """Spread `total` verified tokens over `batch_size` requests (ragged, each >= 1)."""
    n = torch.full((batch_size,), total // batch_size, dtype=torch.int64)
    n[: total % batch_size] += 1
    return n


@torch.no_grad()
def forward_seconds(
    target,
    tokens: torch.Tensor,
    cache,
    lens: torch.Tensor,
    num_new: torch.Tensor,
    hidden_layers: list[int] | None = None,
    warmup: int = 1,
    repeats: int = 3,
) -> float:
    """Median wall seconds, now, of the ragged target forward `target(tokens, cache, lens, num_new)`
    (synchronized on CUDA), after `warmup` untimed runs."""
    cuda = tokens.device.type == "cuda"
    times = []
    for i in range(warmup + repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        target(tokens, cache, lens, num_new, hidden_layers=hidden_layers)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def profile_sps(
    target,
    batch_size: int,
    token_counts: Sequence[int] | None = None,
    context_len: int = 256,
    repeats: int = 5,
    warmup: int = 2,
    overhead_s: float = 0.0,
    hidden_layers: list[int] | None = None,
    cache_file: str | Path | None = None,
    refresh: bool = False,
) -> SPSTable:
    """Measure SPS(T) = 1 / (seconds of one ragged verify forward of T tokens + overhead_s).

    `batch_size` requests sit at `context_len` committed tokens; T (from batch_size up)
    is spread over them as evenly as possible. `overhead_s` adds the per-step cost
    that does not depend on T (drafting, verify, bookkeeping). Median of `repeats`
    timings after `warmup`, fitted non-decreasing in T (`SPSTable.monotone`). The
    measured rates are cached in `cache_file` (default: the user cache dir, keyed by
    target, machine and grid); `refresh` re-measures.
    """
    if token_counts is None:
        token_counts = sorted({batch_size * k for k in range(1, 9)})
    token_counts = sorted({int(t) for t in token_counts})
    if token_counts[0] < batch_size:
        raise ValueError(f"every request verifies at least one token: token counts must be >= {batch_size}")
    key = _fingerprint(target, batch_size, context_len, token_counts, overhead_s)
    path = Path(cache_file) if cache_file else default_cache_dir() / f"sps_{key}.json"
    if path.is_file() and not refresh:
        d = json.loads(path.read_text())
        if d.get("key") == key:
            return SPSTable.from_dict(d).monotone()
    p = target.model.embed_tokens.weight
    device = p.device
    width = max(-(-t // batch_size) for t in token_counts)
    cache = target.new_cache(batch_size, context_len + width)
    lens = torch.full((batch_size,), context_len, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (batch_size, width), generator=gen).to(device)
    rates = []
    for total in token_counts:
        num_new = _split(total, batch_size).to(device)
        seconds = forward_seconds(
            target, tokens[:, : int(num_new.max())], cache, lens, num_new, hidden_layers, warmup, repeats
        )
        rates.append(1.0 / (seconds + overhead_s))
    table = SPSTable(token_counts, rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic: other processes on the machine share the cache and may read it at any moment.
    data.write_json(path, table.to_dict() | {"key": key, "batch_size": batch_size, "context_len": context_len})
    return table.monotone()
