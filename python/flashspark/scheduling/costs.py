"""What a step costs: SPS(T) tables (target verify steps per second at T verified tokens),
profiled once on the running machine and cached on disk, and the timing of one forward; and a
cost model that computes them from a model's sizes and a hardware description instead.

The cost model (`Hardware`, `ForwardShape`, `forward_time`): one forward of `tokens` new
tokens for each of `batch` requests at `context` committed tokens reads the weights once, the
KV cache of every request and writes fp32 logits; it runs the matmuls and the attention's
FLOPs. It takes the slower of reading and computing, plus a fixed overhead per forward:

    t = overhead + max(bytes / bandwidth, FLOPs / peak)

A CPU's description is fitted to its measured SPS tables (`fit_hardware`, with the fit's
error); `H200` is written down from the data sheet. `model_sps` turns either into the
SPS table a scheduler reads, before (or without) measuring one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .. import data

if TYPE_CHECKING:
    from ..models.config import DecoderConfig


class SPSTable:
    """Steps per second of the target's verify forward as a function of the
    verified tokens T: piecewise-linear between measured points, constant
    beyond the ends."""

    def __init__(self, tokens: Sequence[int], sps: Sequence[float], runs: Sequence[int] | None = None):
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
        # The token count each point's forward actually runs at (`padded`): its own unless padded.
        r = self._t.astype(np.int64) if runs is None else np.asarray(runs, dtype=np.int64)[order.numpy()]
        if r.shape != self._t.shape or bool((r < self._t).any()):
            raise ValueError("a forward runs at least the tokens it verifies")
        self._runs = r

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

    def padded(self) -> "SPSTable":
        """The table of a forward that may run wider than it must: verifying T tokens costs the
        cheapest measured point at or above T (the extra columns are computed and ignored), so
        seconds never fall as T grows. `runs(T)` says which point that is. The loop pads a
        confidence schedule's verify forward so (`ConfidenceScheduler.verify_width`).

        Why: a forward's time is not monotone in its width. On this CPU SmolLM2's fp32 forward
        at batch 1 takes 55, 88, 108, 77, 70, 75, 94, 73 ms for 1-8 tokens, every profile
        alike (matrix kernels chosen per shape; `bench/sps_spread.py`): verifying 1 or 2 drafts
        as a 5-token forward saves a fifth to a third, and a table that reads the bump at 2-3 tokens stops
        the lossless early stop (`schedule_tokens`) before the cheap widths beyond it. (Noise
        only adds time, and `profile_sps` keeps the fastest of its rounds.)"""
        seconds = 1.0 / self._s
        runs = self._runs.copy()
        for i in range(seconds.size - 2, -1, -1):
            if seconds[i + 1] < seconds[i]:
                seconds[i], runs[i] = seconds[i + 1], runs[i + 1]
        return SPSTable(self.tokens.tolist(), (1.0 / seconds).tolist(), runs.tolist())

    def runs(self, tokens: int) -> int:
        """The token count a forward of `tokens` runs at: at a point of a `padded` table the
        cheapest point at or above it, else `tokens` itself."""
        i = int(np.searchsorted(self._t, tokens, side="left"))
        return int(self._runs[i]) if i < self._t.size and self._t[i] == tokens else int(tokens)

    def with_overhead(self, seconds: float) -> "SPSTable":
        """The table of whole steps that also spend `seconds` on work independent of T
        (drafting): 1 / (1 / SPS(T) + seconds)."""
        if seconds < 0:
            raise ValueError("overhead must be >= 0")
        return SPSTable(self.tokens.tolist(), (1.0 / (1.0 / self.sps + seconds)).tolist(), self._runs.tolist())

    def to_dict(self) -> dict:
        return {"tokens": [int(x) for x in self.tokens.tolist()], "sps": self.sps.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "SPSTable":
        return cls(d["tokens"], d["sps"])


# ---------------------------------------------------------------------- SPS profiling
def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashspark"


# Bumped whenever profile_sps measures differently, so that tables cached by an older
# estimator are measured again rather than read.
SPS_ESTIMATOR = "rounds-min-1"


def _fingerprint(target, batch_size: int, context_len: int, token_counts: list[int], overhead_s: float) -> str:
    """Key of a profile: target shape and dtype, the machine, the torch build, the grid and the estimator."""
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
            "estimator": SPS_ESTIMATOR,
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
    that does not depend on T (drafting, verify, bookkeeping). Every T is warmed
    `warmup` times, then timed once per round for `repeats` rounds that sweep the grid
    in alternating directions; the fastest time per T, as measured (a forward's time
    need not grow with T: `SPSTable.padded`). The measured rates are cached in
    `cache_file` (default: the user cache dir, keyed by target, machine, grid and this
    estimator); `refresh` re-measures.

    Why rounds and the fastest: what the scheduler reads is the table's shape (a wide
    verify against a one-token step), and a shared machine's interference only ever adds
    time, in bursts from one forward to spells of seconds. Swept in rounds, every T gets
    its chances spread over the whole profile, and the fastest of them is the forward
    without interference. Timed one T after another, the median of each block, the
    padded shape of SmolLM2's table (fp32, batch 1, a verify of 8 tokens over one)
    ranged 1.11-1.76 over 8 profiles minutes apart; the fastest over rounds, 1.26-1.49
    (`bench/sps_spread.py`).
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
            return SPSTable.from_dict(d)
    p = target.model.embed_tokens.weight
    device = p.device
    width = max(-(-t // batch_size) for t in token_counts)
    cache = target.new_cache(batch_size, context_len + width)
    lens = torch.full((batch_size,), context_len, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (batch_size, width), generator=gen).to(device)
    splits = [_split(total, batch_size).to(device) for total in token_counts]
    forwards = [(tokens[:, : int(n.max())], n) for n in splits]
    for x, n in forwards:  # warm every shape before any is timed
        for _ in range(warmup):
            target(x, cache, lens, n, hidden_layers=hidden_layers)
    times: list[list[float]] = [[] for _ in forwards]
    for r in range(repeats):
        order = range(len(forwards)) if r % 2 == 0 else reversed(range(len(forwards)))
        for i in order:
            x, n = forwards[i]
            times[i].append(forward_seconds(target, x, cache, lens, n, hidden_layers, warmup=0, repeats=1))
    rates = [1.0 / (min(t) + overhead_s) for t in times]
    table = SPSTable(token_counts, rates)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Atomic: other processes on the machine share the cache and may read it at any moment.
    data.write_json(path, table.to_dict() | {"key": key, "batch_size": batch_size, "context_len": context_len})
    return table


# ---------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class Hardware:
    """A machine as the cost model sees it: bytes move at `bandwidth_gbs`, matmul FLOPs run at
    `peak_tflops`, and every forward pays `overhead_s` besides (kernel launches or framework
    dispatch, synchronization), plus `layer_overhead_s` per layer (a layer's dozen operators
    each dispatched from the host: on a CPU a 2-layer drafter's pass then costs a fraction of an
    8-layer target's however small both are; 0 where a CUDA graph replays the layers)."""

    name: str
    bandwidth_gbs: float
    peak_tflops: float
    overhead_s: float
    layer_overhead_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Hardware":
        return cls(
            **{k: d[k] for k in ("name", "bandwidth_gbs", "peak_tflops", "overhead_s")},
            layer_overhead_s=d.get("layer_overhead_s", 0.0),
        )


# An H200 SXM: HBM3e at 4.8 TB/s, 989 dense bf16 TFLOP/s (the data sheet's 1979 counts 2:4
# sparsity). The overhead is a CUDA-graph replay of a decode step, as vLLM and SGLang run one:
# about 20 us of launch and host-device synchronization per forward (a graph replays each
# layer's kernels back to back; without graphs a 36-layer forward issues ~300 launches, ~1.5 ms).
H200 = Hardware("H200 SXM (data sheet; projection)", 4800.0, 989.0, 20e-6)


@dataclass(frozen=True)
class ForwardShape:
    """The sizes of a decoder that set what one forward costs."""

    weight_bytes: float  # read once per forward (every matmul's weights)
    matmul_flops_per_token: float  # 2 x the matmul parameters a token passes through
    kv_bytes_per_token: float  # one cached token's K and V over all layers
    attention_flops_per_pair: float  # QK^T and PV over all layers, per (query, key) pair
    logits_bytes_per_token: float  # fp32 logits written per token (0 where none are)
    layers: int = 0  # decoder layers, for the hardware's per-layer overhead

    @classmethod
    def of_decoder(
        cls,
        cfg: "DecoderConfig",
        weight_bytes_per_param: float = 2.0,
        kv_bytes_per_value: float = 2.0,
        layers: int | None = None,
        head_rows: float = 1.0,
    ) -> "ForwardShape":
        """A Llama-family decoder of `cfg` (its first `layers` layers), bf16 by default. The LM
        head counts as a matmul (the embedding is a gather); `head_rows` of every token's rows
        go through it (a drafter's block: γ - 1 of its γ slots)."""
        L = cfg.num_hidden_layers if layers is None else layers
        D, V = cfg.hidden_size, cfg.vocab_size
        q_dim, kv_dim = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        layer = D * (q_dim + 2 * kv_dim) + q_dim * D + 3 * D * cfg.intermediate_size
        return cls(
            weight_bytes=weight_bytes_per_param * (L * layer + V * D),
            matmul_flops_per_token=2.0 * (L * layer + head_rows * V * D),
            kv_bytes_per_token=kv_bytes_per_value * L * 2 * kv_dim,
            attention_flops_per_pair=4.0 * L * q_dim,
            logits_bytes_per_token=4.0 * V * head_rows,
            layers=L,
        )


def drafter_forward(
    cfg: "DecoderConfig", block_size: int, num_drafts: int, layers: int | None = None, bytes_per_value: float = 2.0
) -> ForwardShape:
    """A DFlash-shaped drafter's forward: `cfg`'s layers (its first `layers`) over a block of
    `block_size` rows per request (the context K/V injected from the target), the shared LM
    head over its `num_drafts` drafting rows; weights and K/V of `bytes_per_value` each."""
    return ForwardShape.of_decoder(
        cfg, bytes_per_value, bytes_per_value, layers=layers, head_rows=num_drafts / block_size
    )


def forward_time(shape: ForwardShape, hw: Hardware, batch, tokens, context):
    """Seconds of one forward of `tokens` new tokens for each of `batch` requests at `context`
    committed ones (numbers or NumPy arrays): overhead + layers x layer overhead
    + max(bytes / bandwidth, FLOPs / peak)."""
    batch, tokens, context = (np.asarray(x, dtype=np.float64) for x in (batch, tokens, context))
    rows, keys = batch * tokens, context + tokens
    reads = shape.weight_bytes + batch * keys * shape.kv_bytes_per_token + rows * shape.logits_bytes_per_token
    flops = rows * (shape.matmul_flops_per_token + shape.attention_flops_per_pair * keys)
    fixed = hw.overhead_s + shape.layers * hw.layer_overhead_s
    return fixed + np.maximum(reads / (hw.bandwidth_gbs * 1e9), flops / (hw.peak_tflops * 1e12))


def model_sps(
    shape: ForwardShape, hw: Hardware, batch_size: int, token_counts: Sequence[int], context: int, overhead_s=0.0
) -> SPSTable:
    """The SPS table the cost model predicts (`profile_sps`'s grid: T tokens spread over the
    batch, at least one each), with `overhead_s` per step beside the forward (drafting)."""
    counts = sorted({int(t) for t in token_counts})
    if counts[0] < batch_size:
        raise ValueError(f"every request verifies at least one token: token counts must be >= {batch_size}")
    # T rows in all, as an engine flattens a ragged batch (profile_sps's default grid is T = B k).
    seconds = [float(forward_time(shape, hw, batch_size, t / batch_size, context)) + overhead_s for t in counts]
    return SPSTable(counts, [1.0 / x for x in seconds])


@dataclass(frozen=True)
class HardwareFit:
    hardware: Hardware
    relative_errors: list[float]  # predicted / measured - 1, per measurement

    @property
    def rms_error(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.relative_errors))))

    @property
    def max_error(self) -> float:
        return float(np.max(np.abs(self.relative_errors)))


def fit_hardware(
    shape: ForwardShape,
    measured: Sequence[tuple[int, float, int, float]],
    name: str = "fitted",
    others: Sequence[tuple[ForwardShape, Sequence[tuple[int, float, int, float]]]] = (),
) -> HardwareFit:
    """The `Hardware` whose `forward_time` best fits measured forwards (batch, tokens per
    request, context, seconds) of `shape`, and of `others` (more models' shapes and forwards:
    with models of different depths the per-layer overhead is fitted too), in relative error.
    For a fixed split of the points between the memory-bound and the compute-bound regime the
    model is linear in (overhead, layer overhead, 1 / bandwidth, 1 / peak): least squares,
    re-split by the fit, repeated to a fixed point, from every split by a threshold on the
    FLOPs-to-bytes ratio; the best fit wins. A CPU has no data sheet that predicts its PyTorch
    forwards: its fitted numbers are effective rates, whatever the caches, threads and dispatch
    make of them. `relative_errors` follow the measurements in order, `shape`'s first."""
    groups = [(shape, measured), *others]
    cols_of = []
    for sh, meas in groups:
        m = np.asarray(meas, dtype=np.float64)
        if m.ndim != 2 or m.shape[1] != 4:
            raise ValueError("measured forwards are (batch, tokens, context, seconds)")
        batch, tokens, context, sec = m.T
        rows, keys = batch * tokens, context + tokens
        reads = sh.weight_bytes + batch * keys * sh.kv_bytes_per_token + rows * sh.logits_bytes_per_token
        flops = rows * (sh.matmul_flops_per_token + sh.attention_flops_per_pair * keys)
        cols_of.append((np.full_like(sec, float(sh.layers)), reads, flops, sec))
    layers, reads, flops, seconds = (np.concatenate(x) for x in zip(*cols_of))
    if seconds.size < 3:
        raise ValueError("fit_hardware needs at least 3 measured forwards (batch, tokens, context, seconds)")
    # The per-layer overhead is identifiable only beside models of another depth.
    per_layer = np.unique(layers).size > 1

    def solve(memory: np.ndarray):
        # Relative least squares on (overhead, layer overhead, seconds per byte, seconds per FLOP),
        # all >= 0: a coefficient the solution makes negative is dropped and the rest solved again.
        cols = np.stack((np.ones_like(seconds), layers, reads * memory, flops * ~memory), 1) / seconds[:, None]
        keep = [j for j in range(4) if cols[:, j].any() and (j != 1 or per_layer)]
        while True:
            x = np.zeros(4)
            x[keep] = np.linalg.lstsq(cols[:, keep], np.ones_like(seconds), rcond=None)[0]
            if (x[keep] >= 0).all() or len(keep) == 1:
                return np.maximum(x, 0.0)
            keep = [j for j in keep if x[j] > 0]

    best = None
    intensity = flops / reads
    for threshold in np.concatenate(([-np.inf], np.sort(intensity))):
        memory = intensity <= threshold
        for _ in range(20):
            x = solve(memory)
            split = reads * x[2] >= flops * x[3]
            if (split == memory).all():
                break
            memory = split
        pred = x[0] + layers * x[1] + np.maximum(reads * x[2], flops * x[3])
        err = pred / seconds - 1.0
        if best is None or np.square(err).sum() < np.square(best[1]).sum():
            best = (x, err)
    x, err = best
    hw = Hardware(
        name,
        float(1e-9 / x[2]) if x[2] > 0 else math.inf,
        float(1e-12 / x[3]) if x[3] > 0 else math.inf,
        float(x[0]),
        float(x[1]),
    )
    return HardwareFit(hw, err.tolist())
