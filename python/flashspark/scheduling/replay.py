"""Acceptance traces and their replay: what a scheduling policy would have done over recorded
acceptance, priced by a cost model.

What a method accepts does not depend on the machine; what a step costs does. A trace keeps
the first and the replay supplies the second.

**A trace** (one target, one drafter, one temperature) holds, per request-step of a real run
with every draft verified (fixed K = the drafter's drafts per block), in decode order: the
request, its context length, the drafted block, the accepted prefix, and each confidence
source's per-position values (DSpark's head, the DFlash 2 proxy's offline fit and its inputs,
the margin-logistic baseline run online); per request, the tokens the run emitted.

**A replay** decodes the trace's requests in batches of c, as `e2e_bench` does (a batch runs
until its last request is done; finished requests stay in the batch's forwards, as in the
loop). Each step, a policy picks K per active request from that request's confidences; the
outcome is min(K, the recorded accepted prefix), plus the correction or bonus token; the
step's time comes from the cost model (`costs.forward_time`): the drafter's forward and the
target's verify forward as wide as the largest K, or a plain decode step.

**The approximation:** steps are exchangeable. A request's i-th replayed step reads its i-th
recorded step whatever the policy did before (a request that needs more steps than were
recorded cycles through its steps again), so a policy that verifies fewer drafts than the
recorded run does not change what the drafter proposes next. For fixed K = the recorded K
the replay is the recorded run itself, step for step (`tests/scheduling/test_replay.py`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .base import ScheduleState
from .costs import ForwardShape, Hardware, SPSTable, forward_time

TRACE_FORMAT = 1
# Per-row arrays of a trace (np.savez_compressed; floats stored as float16).
ROW_KEYS = ("request", "step", "ctx_len", "accepted", "tokens")
REQUEST_KEYS = ("new_tokens", "prompt_len", "prompt_tokens")


@dataclass
class Trace:
    """One recorded run (module docstring). Rows are request-steps in decode order."""

    meta: dict  # target, drafter, temperature, drafts per block, the command that recorded it
    request: np.ndarray  # [N] int: the request of each row (0 .. R - 1)
    step: np.ndarray  # [N] int: the loop iteration (non-decreasing)
    ctx_len: np.ndarray  # [N] int: committed tokens before the step
    accepted: np.ndarray  # [N] int: accepted drafts of the fully verified block
    tokens: np.ndarray  # [N, K] int: the drafted block
    new_tokens: np.ndarray  # [R] int: tokens each request emitted (the prefill's first one included)
    prompt_len: np.ndarray  # [R] int
    prompt_tokens: np.ndarray  # [sum of prompt_len] int: the prompts, one after another
    sources: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [N, K] per-token confidences
    signals: np.ndarray | None = None  # [N, K, 4] DFlash 2's path signals (the proxy's inputs)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def requests(self) -> int:
        return self.new_tokens.shape[0]

    def prompts(self) -> list[list[int]]:
        """The recorded prompts, as token lists."""
        ends = np.cumsum(self.prompt_len)
        return [self.prompt_tokens[e - n : e].tolist() for e, n in zip(ends, self.prompt_len)]

    def rows_of(self) -> list[np.ndarray]:
        """Per request, its rows in step order."""
        order = np.lexsort((self.step, self.request))
        bounds = np.searchsorted(self.request[order], np.arange(self.requests + 1))
        return [order[bounds[r] : bounds[r + 1]] for r in range(self.requests)]

    def save(self, path: str | Path) -> None:
        path = Path(path)
        arrays = {k: getattr(self, k) for k in (*ROW_KEYS, *REQUEST_KEYS)}
        arrays = {k: v.astype(np.int32) for k, v in arrays.items()}
        arrays |= {f"source/{k}": v.astype(np.float16) for k, v in self.sources.items()}
        if self.signals is not None:
            arrays["signals"] = self.signals.astype(np.float16)
        np.savez_compressed(
            path, meta=np.frombuffer(json.dumps(self.meta | {"format": TRACE_FORMAT}).encode(), np.uint8), **arrays
        )

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        with np.load(Path(path)) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != TRACE_FORMAT:
                raise ValueError(f"{path}: trace format {meta.get('format')}, expected {TRACE_FORMAT}")
            ints = {k: z[k].astype(np.int64) for k in (*ROW_KEYS, *REQUEST_KEYS)}
            sources = {k.removeprefix("source/"): z[k].astype(np.float64) for k in z.files if k.startswith("source/")}
            signals = z["signals"].astype(np.float32) if "signals" in z.files else None
        return cls(meta, **ints, sources=sources, signals=signals)


def _rest(rows: tuple, batch: int, context: int, width: int | None = None) -> float:
    """A measured rest at (batch, context, width): `rows` are (batch, seconds) pairs, measured
    at one context and width, or (batch, context, seconds) / (batch, context, width, seconds)
    rows of a grid. Linear in the batch size, then the width, then the context, and flat past
    the measured ends (a rest is a correction measured where the loop runs, not a law to
    extrapolate)."""
    if not rows:
        return 0.0
    if len(rows[0]) == 2:
        b, sec = zip(*sorted(rows))
        return float(np.interp(batch, b, sec))
    cells: dict[tuple, list] = {}
    for row in rows:
        cells.setdefault(tuple(row[1:-1]), []).append((row[0], row[-1]))
    at_context = {}
    for key, pairs in cells.items():
        b, sec = zip(*sorted(pairs))
        at_context.setdefault(key[0], []).append((key[1:], float(np.interp(batch, b, sec))))
    ctx = sorted(at_context)
    values = []
    for c in ctx:
        cell = sorted(at_context[c])
        if width is None or not cell[0][0]:
            values.append(cell[-1][1])
        else:
            values.append(float(np.interp(width, [w[0] for w, _ in cell], [v for _, v in cell])))
    return float(np.interp(context, ctx, values))


@dataclass(frozen=True)
class StepCosts:
    """Seconds of a loop step's parts for a batch of B requests at a context of committed
    tokens: the drafter's forward, the target's forward over T tokens per request, and the rest
    of each kind of step beyond its modelled forwards (verify, commit, sampling, scheduling),
    measured on the machine (`_rest`): `step_overhead` of a speculative step, `plain_overhead`
    of a plain decoding step (none: 0; negative where the forward model overprices the step's
    forwards), and `prefill_scale`, (batch, measured / modelled) pairs of the prefill (none: 1).

    A step is priced at `context` committed tokens unless it is given its own: with `padded`,
    the replay gives each step its batch's longest context, as the loop pads a batch's K/V to
    its longest request (`models.decoder`: every row attends over the batch's longest), which
    an engine's ragged attention does not."""

    target: ForwardShape
    drafter: ForwardShape
    hardware: Hardware
    block_size: int
    context: int
    step_overhead: tuple = ()
    plain_overhead: tuple = ()
    prefill_scale: tuple = ()
    padded: bool = False

    def step_context(self, committed: np.ndarray) -> int:
        """The context a step of a batch whose requests hold `committed` tokens is priced at."""
        return int(committed.max()) if self.padded else self.context

    def plain(self, batch: int, context: int | None = None) -> float:
        ctx = self.context if context is None else context
        forward = float(forward_time(self.target, self.hardware, batch, 1, ctx))
        return forward + _rest(self.plain_overhead, batch, ctx)

    def _draft(self, batch: int, context: int) -> float:
        return float(forward_time(self.drafter, self.hardware, batch, self.block_size, context))

    def speculative(self, batch: int, width: int, context: int | None = None) -> float:
        """A step verifying `width` tokens per request (the anchor and width - 1 drafts)."""
        ctx = self.context if context is None else context
        verify = float(forward_time(self.target, self.hardware, batch, width, ctx))
        return self._draft(batch, ctx) + verify + _rest(self.step_overhead, batch, ctx, width)

    def prefill(self, batch: int, prompt_len: int) -> float:
        scale = _rest(self.prefill_scale, batch, 0) if self.prefill_scale else 1.0
        return scale * float(forward_time(self.target, self.hardware, batch, prompt_len, 0))

    def plain_run(self, prompt_len: np.ndarray, new_tokens: np.ndarray) -> float:
        """Seconds of a batch's plain decoding steps after its prefill (each request's first
        token came from it): what its plain run would have cost."""
        steps = int(new_tokens.max()) - 1
        if not self.padded:
            return steps * self.plain(len(prompt_len))
        return sum(
            self.plain(len(prompt_len), self.step_context(prompt_len + np.minimum(i + 1, new_tokens)))
            for i in range(steps)
        )

    def sps(self, batch: int, widths) -> tuple[SPSTable, SPSTable]:
        """(speculative, plain) SPS tables for a scheduler, priced as these steps are: whole
        speculative steps verifying each of `widths` tokens per request, and a plain step."""
        widths = sorted(set(widths))
        spec = SPSTable([batch * w for w in widths], [1.0 / self.speculative(batch, w) for w in widths])
        return spec, SPSTable([batch], [1.0 / self.plain(batch)])


class FixedPolicy:
    """Every active request verifies k drafts (k = 0: plain decoding, no drafter)."""

    def __init__(self, k: int):
        self.k = k
        self.name = "plain" if k == 0 else f"fixed K={k}"

    def start(self, batch_size: int) -> bool:
        """A new batch: False decodes it plainly from the start."""
        return self.k > 0

    def wants_draft(self, active: np.ndarray) -> bool:
        return True

    def plan(self, rows: np.ndarray, active: np.ndarray, trace: Trace) -> np.ndarray:
        return np.where(active, self.k, 0)

    def observe(self, rows: np.ndarray, accepted: np.ndarray, verified: np.ndarray, trace: Trace) -> None:
        pass


class SchedulerPolicy:
    """A `Scheduler` (scheduling/base.py: DSpark's confidence scheduler, on DSpark's head or the
    DFlash 2 proxy) replayed: each step it reads the active rows' confidences and plans as in
    the loop, then hears the outcomes. `make(batch_size)` builds a fresh scheduler per batch
    (a `Decoder` keeps what it learnt across batches: pass a factory that does the same);
    `confidence(rows, trace)` gives the rows' per-token confidences [n, K] (a trace source, or
    a proxy run online on the rows' signals); `predict(batch_size)` is the prior's predicted
    gain of speculation at that size (its tokens/s over plain decoding's; None: no prior),
    and `verdict` the `BatchVerdict` that decides, as a `Decoder` does, whether a batch
    speculates or decodes plainly (without one: whether the prediction exceeds 1)."""

    def __init__(self, name: str, make, confidence, predict=None, observe=None, verdict=None):
        self.name, self.make, self.confidence = name, make, confidence
        self.predict = predict or (lambda batch_size: math.inf)
        self.hear = observe  # optional: the confidence source hears the outcomes too
        self.verdict = verdict
        self.scheduler = None

    def start(self, batch_size: int) -> bool:
        predicted = self.predict(batch_size)
        if self.verdict is not None:
            speculate = self.verdict.choose(batch_size, predicted, requests=batch_size)
        else:
            speculate = predicted is None or predicted >= 1.0
        if speculate:
            self.scheduler = self.make(batch_size)
        return speculate

    def end_batch(self, batch_size: int, speculated: bool, tokens: int, seconds: float, plain_seconds: float) -> None:
        """A batch is done: its tokens and seconds, and the seconds plain decoding would have taken
        on it (the verdict's estimated plain rate; exact here, where the cost model is the clock)."""
        if self.verdict is not None:
            self.verdict.record(batch_size, speculated, tokens / seconds, tokens / plain_seconds)

    def wants_draft(self, active: np.ndarray) -> bool:
        return self.scheduler.wants_draft(torch.from_numpy(active))

    def plan(self, rows: np.ndarray, active: np.ndarray, trace: Trace) -> np.ndarray:
        B, K = len(rows), trace.width
        conf = torch.zeros(B, K, dtype=torch.float64)
        live = np.flatnonzero(active)
        if live.size:
            conf[torch.from_numpy(live)] = torch.as_tensor(self.confidence(rows[live], trace), dtype=torch.float64)
        state = ScheduleState(torch.from_numpy(active), torch.from_numpy(trace.ctx_len[rows]), None, confidence=conf)
        return self.scheduler.plan(state).numpy()

    def observe(self, rows: np.ndarray, accepted: np.ndarray, verified: np.ndarray, trace: Trace) -> None:
        self.scheduler.observe(None, torch.from_numpy(accepted), torch.from_numpy(verified))
        if self.hear is not None:
            self.hear(rows, accepted, verified, trace)


@dataclass
class Replayed:
    tokens: int
    seconds: float
    steps: int  # request-steps
    accepted: int
    iterations: int  # batch forwards
    plain_steps: int = 0  # iterations run as plain decode steps (a plain batch's, or a scheduler's call)
    verified: int = 0  # drafts verified over all request-steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / max(1, self.steps)


def outcome(k: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """Drafts accepted when K = k of a recorded block are verified: the recorded accepted prefix,
    cut at k (the correction or bonus token comes on top)."""
    return np.minimum(k, accepted)


def replay(
    trace: Trace, policy, concurrency: int, costs: StepCosts, order: np.ndarray | None = None, fast: bool = True
) -> Replayed:
    """Decode the trace's requests (in `order`, default as recorded; an order may repeat
    requests, a stream longer than the trace, see `stream`) in batches of `concurrency` under
    `policy`, priced by `costs` (module docstring). A `FixedPolicy` is replayed in closed form
    unless `fast` is False (the same numbers, step by step)."""
    per_request = trace.rows_of()
    order = np.arange(trace.requests) if order is None else np.asarray(order)
    if fast and type(policy) is FixedPolicy:
        return _replay_fixed(trace, policy.k, concurrency, costs, order, per_request)
    total = Replayed(0, 0.0, 0, 0, 0)
    for start in range(0, len(order), concurrency):
        batch = order[start : start + concurrency]
        B = len(batch)
        seconds_before = total.seconds
        prefill = costs.prefill(B, int(trace.prompt_len[batch].max()))
        total.seconds += prefill
        left = trace.new_tokens[batch] - 1  # the prefill drew each request's first token
        total.tokens += int(trace.new_tokens[batch].sum())
        cursor = np.zeros(B, dtype=np.int64)
        speculate = policy.start(B)
        while (active := left > 0).any():
            # (A request its first token ended has no rows: it is never active, row 0 stands in.)
            rows = np.array(
                [per_request[r][c % len(per_request[r])] if len(per_request[r]) else 0 for r, c in zip(batch, cursor)]
            )
            context = (  # None: the fixed context (only a padded batch's steps need their own)
                costs.step_context(trace.prompt_len[batch] + trace.new_tokens[batch] - np.maximum(left, 0))
                if costs.padded
                else None
            )
            if speculate and policy.wants_draft(active):
                k = np.minimum(policy.plan(rows, active, trace), trace.width) * active
                gained = outcome(k, trace.accepted[rows])
                policy.observe(rows, gained, k, trace)
                total.seconds += costs.speculative(B, int(k.max()) + 1, context)
            else:
                k = gained = np.zeros(B, dtype=np.int64)
                total.seconds += costs.plain(B, context)
                total.plain_steps += 1
            total.steps += int(active.sum())
            total.accepted += int((gained * active).sum())
            total.verified += int((k * active).sum())
            total.iterations += 1
            left -= (gained + 1) * active
            cursor += active
        end_batch = getattr(policy, "end_batch", None)
        if end_batch is not None:
            plain_seconds = prefill + costs.plain_run(trace.prompt_len[batch], trace.new_tokens[batch])
            end_batch(B, speculate, int(trace.new_tokens[batch].sum()), total.seconds - seconds_before, plain_seconds)
    return total


def stream(rng: np.random.Generator, requests: int, length: int) -> np.ndarray:
    """A request order of `length` drawn as consecutive shuffles of the trace's `requests`: a
    server keeps serving, so a replay at concurrency c over a trace of fewer than a few
    batches' worth of requests decodes some of them again (each pass in a new order), as
    requests are exchangeable as the steps are."""
    passes = -(-length // requests)
    return np.concatenate([rng.permutation(requests) for _ in range(passes)])[:length]


def _replay_fixed(
    trace: Trace, k: int, concurrency: int, costs: StepCosts, order: np.ndarray, per_request: list[np.ndarray]
) -> Replayed:
    """`replay` of a fixed K without the step loop. Each request's steps do not depend on the
    others': it cycles through its recorded rows, each emitting outcome(K, accepted) + 1
    tokens, until its tokens are out. A batch runs as many iterations as its slowest request
    needs, each one a step verifying K + 1 tokens per request (or a plain step, K = 0)."""
    k = min(k, trace.width)
    left = trace.new_tokens - 1  # the prefill drew each request's first token
    steps = np.zeros(trace.requests, dtype=np.int64)
    accepted = np.zeros(trace.requests, dtype=np.int64)
    emitted_by = [np.zeros(1, dtype=np.int64)] * trace.requests  # tokens emitted before each step
    for r, rows in enumerate(per_request):
        if left[r] <= 0 or not len(rows):
            continue
        cycle = rows[np.arange(left[r]) % len(rows)]  # enough: every step emits at least one token
        emitted = np.cumsum(outcome(np.full(len(cycle), k), trace.accepted[cycle]) + 1)
        steps[r] = int(np.searchsorted(emitted, left[r])) + 1  # the first step that reaches it
        accepted[r] = int(emitted[steps[r] - 1]) - steps[r]
        emitted_by[r] = np.minimum(np.concatenate([[0], emitted[: steps[r]]]), left[r])
    # Counted over the order, which may decode a request more than once (a stream of requests).
    n_steps = int(steps[order].sum())
    total = Replayed(0, 0.0, n_steps, int(accepted[order].sum()), 0, verified=k * n_steps)
    for start in range(0, len(order), concurrency):
        batch = order[start : start + concurrency]
        B, iterations = len(batch), int(steps[batch].max())
        if costs.padded:  # each step at the batch's longest context, as the step loop prices it
            done = np.array(
                [[e[min(i, len(e) - 1)] for i in range(iterations)] for e in (emitted_by[r] for r in batch)]
            )
            committed = (trace.prompt_len[batch] + 1)[:, None] + done
            contexts = [costs.step_context(committed[:, i]) for i in range(iterations)]
        else:
            contexts = [costs.context]
        seconds = [costs.speculative(B, k + 1, c) if k > 0 else costs.plain(B, c) for c in contexts]
        step_seconds = sum(seconds) if costs.padded else iterations * seconds[0]
        total.seconds += costs.prefill(B, int(trace.prompt_len[batch].max())) + step_seconds
        total.tokens += int(trace.new_tokens[batch].sum())
        total.iterations += iterations
        total.plain_steps += 0 if k > 0 else iterations
    return total
