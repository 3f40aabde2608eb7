"""The DSpark confidence scheduler: how many drafts each request verifies,
chosen for the whole batch from per-token survival confidences.

DSpark's scheduler (the paper's Algorithm 1; docs/dflash2_dspark.md, "Confidence scheduler"):

1. prefix survival ``a_{r,j} = ∏_{i≤j} c_{r,i}`` (the chance that drafts
   1..j of request r are all accepted);
2. all (request, position) slots of the batch sorted by a, globally;
3. slots admitted in that order while ``Θ = τ · SPS(T)`` grows, where
   ``τ = Σ_r (1 + Σ_{admitted j} a_{r,j})`` is the expected number of tokens
   the step commits and SPS(T) the target's verify steps per second at T
   verified tokens (every active request verifies its anchor row, so
   T = active requests + admitted slots); **the first slot that does not raise Θ
   stops the admission**.

Why the early stop (losslessness). Speculative sampling is exact for any number of
verified drafts that is decided, slot by slot, from what was drawn *before* the slot:
whether draft j of request r is verified may depend on drafts 1..j-1 (and on other
requests), never on draft j or later ones. c_{r,j} reads draft j-1 (DSpark's head reads
W1[x_{j-1}]; the DFlash 2 proxy reads the selector's row before draft j is drawn), so
a_{r,j} and every slot sorted before (r, j) (a is non-increasing in j, ties sort by
position) are known before draft j. The early stop decides (r, j) from that sorted prefix
alone. Searching on past a dip (the best of all prefixes) would verify slot j because of
slot j + 1's confidence, which reads draft j: the paper's Appendix A shows that this is
biased, and `tests/scheduling/test_admission_lossless.py` measures the bias.

Two lossless rules (`ConfidenceScheduler(admission=...)`):

* ``"stop"`` (default): Algorithm 1's early stop on the current confidences;
* ``"budget"``: the engines' rule (vLLM's adaptive verification, SGLang's DSpark planner):
  the number of slots N is sized from confidences at least a step old (there the best of all
  prefixes is allowed: nothing of the current block enters it), then the N slots of highest
  current survival are verified. A slot's rank depends only on slots sorted before it.

A prefix of the sorted order never admits position j of a request without
position j - 1: a is non-increasing in j and ties sort by position.

The SPS table comes from `costs.profile_sps`, measured once on the running
machine and cached in a JSON file.
"""

from __future__ import annotations

import math
import time
from collections import deque

import numpy as np
import torch

from .base import Scheduler
from .calibration import prefix_survival
from .costs import SPSTable

ADMISSIONS = ("stop", "budget")


def early_stop(theta: np.ndarray) -> int:
    """Slots admitted by Algorithm 1 from Θ of every prefix [M + 1]: the leading slots that
    each raised Θ (the count before the first slot that does not)."""
    falls = np.flatnonzero(theta[1:] <= theta[:-1])
    return int(falls[0]) if falls.size else theta.size - 1


def schedule_tokens(
    confidence: torch.Tensor,
    active: torch.Tensor,
    sps: SPSTable,
    max_spec_len: int | None = None,
    return_theta: bool = False,
    admit: str | int = "stop",
    padded: bool = False,
):
    """Drafts to verify per request, int64 [B] (0 for inactive requests).

    confidence [B, K'] per-token survival c_{r,j} for draft positions 1..K';
    active [B] bool; only the first max_spec_len positions are candidates.
    `admit`: "stop" (Algorithm 1: stop at the first slot that does not raise Θ; lossless on
    the current block's confidences), "best" (the best of all prefixes: only for confidences
    that no current draft enters, such as stale ones sizing a budget, or a plan from mean
    confidences), or an int N (the N leading slots of the sorted order).
    `return_theta`: also return Θ (expected tokens per second of the step) of the admission.
    `padded`: the verify forward runs every one of the B rows as wide as the widest request
    (flashspark's loop; `padded_columns`), rather than the T = active + admitted tokens an
    engine packs.
    """
    B = confidence.shape[0]
    K = confidence.shape[1] if max_spec_len is None else min(max_spec_len, confidence.shape[1])
    device = confidence.device
    # On the host in NumPy: a few dozen values a step (torch's per-op cost dominated here).
    active = active.to(torch.bool).cpu().numpy()
    a = prefix_survival(confidence[:, :K].detach().cpu()).numpy()  # [B, K]
    n_active = int(active.sum())
    k_b = np.zeros(B, dtype=np.int64)
    if n_active == 0 or K == 0:
        theta0 = float(n_active * sps.rate(max(1, n_active)))
        return (torch.from_numpy(k_b).to(device), theta0) if return_theta else torch.from_numpy(k_b).to(device)
    rows = np.flatnonzero(active)
    a = a[rows]  # [R, K]
    if padded:
        w, theta = padded_columns(a, n_active, B, sps, admit)
        k_b[rows] = w
        out = torch.from_numpy(k_b).to(device)
        return (out, theta) if return_theta else out
    R = rows.size
    req = np.repeat(np.arange(R), K)
    pos = np.tile(np.arange(K), R)
    flat = a.ravel()
    # Order: a descending; ties by position (prefix constraint), then request. Two stable sorts.
    order = np.argsort(pos, kind="stable")
    order = order[np.argsort(-flat[order], kind="stable")]
    gains = flat[order]
    tau = n_active + np.concatenate([np.zeros(1), np.cumsum(gains)])  # prefix of m slots
    T = n_active + np.arange(gains.size + 1, dtype=np.float64)
    theta = tau * sps.rate(T)
    if admit == "stop":
        m = early_stop(theta)
    elif admit == "best":
        m = int(np.argmax(theta))  # the first maximum
    elif isinstance(admit, (int, np.integer)) and not isinstance(admit, bool) and admit >= 0:
        m = min(int(admit), gains.size)
    else:
        raise ValueError(f"admit must be 'stop', 'best' or a slot count >= 0, got {admit!r}")
    k_b[rows] = np.bincount(req[order[:m]], minlength=R)
    out = torch.from_numpy(k_b).to(device)
    return (out, float(theta[m])) if return_theta else out


def padded_columns(a: np.ndarray, n_active: int, rows: int, sps: SPSTable, admit: str | int) -> tuple[int, float]:
    """(drafts every active request verifies, Θ) when the verify forward is padded: all `rows`
    rows of the batch run as wide as its widest request, so a step verifying w drafts costs
    1 / SPS(rows · (w + 1)) however few requests use the width, and once a width is paid its
    columns are free to every active request. Θ(w) = (n_active + Σ_r Σ_{j≤w} a_{r,j}) ·
    SPS(rows · (w + 1)) over the prefix survivals a [R, K] of the active requests.

    Algorithm 1 over slots prices a slot as one token of T and would widen the whole batch for
    one confident request (at 32 rows, one more draft of one request costs 32 tokens).

    Lossless as Algorithm 1 is: with "stop" column j is admitted iff every column up to it
    raised Θ, and column j's gain Σ_r a_{r,j} reads drafts 1..j-1 only. "best" (the best width;
    for confidences no current draft enters) and an int (that many columns) as in
    `schedule_tokens`."""
    K = a.shape[1]
    tau = n_active + np.concatenate([np.zeros(1), np.cumsum(a.sum(0))])  # [K + 1]
    theta = tau * sps.rate(rows * np.arange(1, K + 2, dtype=np.float64))
    if admit == "stop":
        w = early_stop(theta)
    elif admit == "best":
        w = int(np.argmax(theta))
    elif isinstance(admit, (int, np.integer)) and not isinstance(admit, bool) and admit >= 0:
        w = min(int(admit), K)
    else:
        raise ValueError(f"admit must be 'stop', 'best' or a column count >= 0, got {admit!r}")
    return w, float(theta[w])


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 1.03 for 4, 2.04 for 32)."""
    x = np.linspace(-8.0, 8.0, 4001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    cdf = np.clip(np.cumsum(phi) * (x[1] - x[0]), 0.0, 1.0)
    density = n * phi * cdf ** (n - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


def batch_tail(survival: torch.Tensor, batch_size: int, new_tokens: int, spread: float = 0.0) -> float:
    """How much longer than its mean request a batch of speculative requests runs, as a factor
    on its steps.

    A batch lasts as long as its slowest request (finished requests wait in its forwards). A
    plain step emits one token per request, so `new_tokens` tokens take exactly that many steps
    for every request; a speculative step emits X = 1 + accepted tokens, random (P(X > j) = the
    prefix survival a_j of the verified drafts), so the steps to emit n tokens are a renewal
    count: mean n / μ, variance n σ² / μ³, a relative spread σ / sqrt(n μ). Requests also differ
    in how well they are drafted: `spread` is the relative spread of their steps per token
    (`ConfidenceStats.request_spread`, measured: 0.12-0.21 at T = 0 on our traces, 0.05-0.08 at
    T = 1, where the renewal term is 0.06-0.09). The slowest of B requests takes about the mean
    times 1 + E[max of B normals] · sqrt(spread² + σ² / (n μ)) (1 at batch 1; at T = 0 on
    SmolLM2's DFlash 2 trace, spread 0.13, 96 tokens: 1.08 at 2 requests, 1.15 at 4, 1.21 at
    8). Without the spread between requests the factor came to about half of what the replay
    measures (bench/combo_replay.py). Requests of unequal length only shorten the wait (the
    longest dominates), so the factor errs toward plain decoding."""
    a = survival.double().flatten()
    mu = 1.0 + float(a.sum())
    j = torch.arange(1, a.numel() + 1, dtype=torch.float64)
    var = max(0.0, float(((2 * j - 1) * a).sum()) - (mu - 1.0) ** 2)
    if batch_size <= 1 or new_tokens <= 0:
        return 1.0
    return 1.0 + expected_max_normal(batch_size) * math.sqrt(spread**2 + var / (new_tokens * mu))


class ConfidenceStats:
    """What a scheduler has learnt about a confidence source, as per-position sums over a
    block's draft positions 1..K':

    * `survival`: the predicted prefix survival ∏c of every scheduled row (`rows` of them),
      whose mean says how much a typical block is worth;
    * `predicted` / `observed`: over the verified slots only, predicted survival against
      whether the prefix was in fact accepted. Their ratio ρ_k recalibrates the source online:
      a head calibrated on other text or at another temperature (DSpark's, fitted teacher-forced
      on code at T = 0, is overconfident at T = 1) is pulled toward what verification shows.
    * `requests`: how the requests of finished batches differed in their speculative steps per
      token (count, Σx, Σx², Σ of each x's sampling variance), and `open` the rows of the batch
      under way (steps, Σ tokens, Σ tokens²): `request_spread`, which `batch_tail` reads.

    Sums (not means) so that a prior from earlier batches or a shipped calibration run adds
    to this batch's rows; `scaled` weighs a prior down to a number of rows.
    """

    RATIO_STRENGTH = 4.0  # pseudo-observations of ρ = 1 per position: a few outcomes cannot swing it
    # The relative spread of requests' steps per token before requests measure it, weighing as
    # REQUEST_STRENGTH requests: between the 0.05-0.08 our traces measure at T = 1 and the
    # 0.12-0.21 at T = 0 (bench/results/traces; the README's combination section).
    REQUEST_SPREAD = 0.1
    REQUEST_STRENGTH = 4.0

    def __init__(self, width: int):
        z = lambda: torch.zeros(width, dtype=torch.float64)  # noqa: E731
        self.survival, self.predicted, self.observed = z(), z(), z()
        self.rows = 0
        self.requests = torch.zeros(4, dtype=torch.float64)  # count, Σx, Σx², Σ var(x); x: steps per token
        self.open = torch.zeros(0, 3, dtype=torch.float64)  # per row of this batch: steps, Σ tokens, Σ tokens²

    @property
    def width(self) -> int:
        return self.survival.numel()

    def add_rows(self, survival: torch.Tensor) -> None:
        """Predicted prefix survivals [R, K'] of R scheduled rows."""
        self.survival += survival.detach().double().cpu().sum(0)
        self.rows += survival.shape[0]

    def add_outcomes(
        self,
        survival: torch.Tensor,
        num_accepted: torch.Tensor,
        num_verified: torch.Tensor,
        accepted: torch.Tensor | None = None,
    ) -> None:
        """Predicted survivals [B, K'] of a step's blocks and their outcomes [B]: slot k (0-based)
        was verified iff k < num_verified, its prefix accepted iff k < num_accepted (a tree's
        node: iff `accepted` [B, K'] says it is on the walked path)."""
        k = torch.arange(self.width)
        seen = k < num_verified.cpu()[:, None]
        ok = ((k < num_accepted.cpu()[:, None]) if accepted is None else accepted.cpu()) & seen
        self.predicted += (survival.detach().double().cpu() * seen).sum(0)
        self.observed += ok.sum(0).double()

    def add_request_steps(self, tokens: torch.Tensor, active: torch.Tensor) -> None:
        """Tokens [B] each row of the batch under way committed in a speculative step (accepted
        drafts plus one); rows not `active` [B] are skipped."""
        a = active.detach().cpu().double()
        t = tokens.detach().cpu().double() * a
        if self.open.shape[0] != t.numel():
            self.close_requests()  # another batch: the rows under way are finished requests
            self.open = torch.zeros(t.numel(), 3, dtype=torch.float64)
        self.open += torch.stack((a, t, t * t), 1)

    @staticmethod
    def _request_moments(rows: torch.Tensor) -> torch.Tensor:
        """(count, Σx, Σx², Σ var(x)) of rows (steps, Σ tokens, Σ tokens²) with 2 steps or more:
        x = steps per token, var(x) its sampling variance (delta method: var(tokens) / (n m⁴))."""
        n, st, stt = rows[rows[:, 0] >= 2].unbind(1)
        m = st / n
        var = ((stt - n * m * m) / (n - 1)).clamp(min=0.0)
        x = 1.0 / m
        return torch.stack((n.new_tensor(float(n.numel())), x.sum(), (x * x).sum(), (var / (n * m**4)).sum()))

    def close_requests(self) -> None:
        """The batch under way is over: its rows join the finished requests."""
        if self.open.numel():
            self.requests = self.requests + self._request_moments(self.open)
        self.open = torch.zeros(0, 3, dtype=torch.float64)

    def request_spread(self) -> float:
        """The relative spread of requests' steps per token between requests (their sampling
        noise taken out), over the finished requests and this batch's rows, shrunk toward
        REQUEST_SPREAD."""
        r, sx, sxx, sv = (self.requests + self._request_moments(self.open)).tolist()
        s, prior = self.REQUEST_STRENGTH, self.REQUEST_SPREAD**2
        if r < 2:
            return self.REQUEST_SPREAD
        mean = sx / r
        between = max(0.0, (sxx - r * mean * mean) / (r - 1) - sv / r) / (mean * mean)
        return math.sqrt(((r - 1) * between + s * prior) / (r - 1 + s))

    def ratio(self) -> torch.Tensor:
        """ρ [K'] = observed / predicted survival of the verified slots, shrunk toward 1."""
        s = self.RATIO_STRENGTH
        return (self.observed + s) / (self.predicted + s)

    def correct(self, survival: torch.Tensor) -> torch.Tensor:
        """Recalibrated prefix survivals [..., K']: scaled by ρ, kept in [0, 1] and non-increasing."""
        a = (survival.double().cpu() * self.ratio()).clamp(0.0, 1.0)
        return torch.cummin(a, -1).values

    def mean_survival(self) -> torch.Tensor:
        """Recalibrated mean prefix survival [K'] of the rows seen (NaN without rows)."""
        return self.correct(self.survival / self.rows) if self.rows else torch.full((self.width,), float("nan"))

    def scaled(self, rows: int) -> "ConfidenceStats":
        """A copy weighing as much as `rows` rows (as a prior): the same means and, up to its
        shrinkage toward 1, the same ρ."""
        out = self.copy()
        out.close_requests()
        if self.rows:
            f = rows / self.rows
            out.survival, out.predicted, out.observed = self.survival * f, self.predicted * f, self.observed * f
            out.requests = out.requests * f  # the same spread, from as many requests in proportion
            out.rows = rows
        return out

    def copy(self) -> "ConfidenceStats":
        out = ConfidenceStats(self.width)
        out.survival, out.predicted, out.observed = self.survival.clone(), self.predicted.clone(), self.observed.clone()
        out.requests, out.open = self.requests.clone(), self.open.clone()
        out.rows = self.rows
        return out

    def to_dict(self) -> dict:
        closed = self.copy()
        closed.close_requests()
        return {
            "rows": self.rows,
            "survival": self.survival.tolist(),
            "predicted": self.predicted.tolist(),
            "observed": self.observed.tolist(),
            "requests": closed.requests.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ConfidenceStats":
        out = cls(len(d["survival"]))
        out.rows = int(d["rows"])
        out.survival, out.predicted, out.observed = (
            torch.tensor(d[k], dtype=torch.float64) for k in ("survival", "predicted", "observed")
        )
        if "requests" in d:  # (priors fitted before requests were measured have none)
            out.requests = torch.tensor(d["requests"], dtype=torch.float64)
        return out


def conditional(mean_survival: torch.Tensor) -> torch.Tensor:
    """Per-position c_k = a_k / a_(k-1) of prefix survivals a [..., K]: the confidences whose
    product reproduces them (a product of mean c's would understate a mean survival whenever
    confidences along a block are correlated)."""
    prev = torch.cat([torch.ones_like(mean_survival[..., :1]), mean_survival[..., :-1]], -1)
    return (mean_survival / prev.clamp(min=1e-12)).clamp(0.0, 1.0)


class ConfidenceScheduler(Scheduler):
    """Scheduler for the speculative loop (`spec.schedulers` interface): call it with the
    step's `ScheduleState`; it reads per-token confidences [B, γ - 1] from
    `state.confidence` and returns int64 [B] in [0, max_spec_len].

    `confidence_fn(state)` supplies them instead where the state carries none: a DFlash 2
    confidence proxy (`ConfidenceProxy.for_scheduler()`), which also hears each step's
    outcomes through `observe`.

    Confidences are recalibrated online before use (`ConfidenceStats.correct`): each step's
    verify outcomes update the observed / predicted survival ratio per position.

    `admission` is the lossless rule (module docstring): "stop" admits by Algorithm 1's early
    stop; "budget" sizes the step's slot count from confidences max(delay, 1) steps old (the
    shipped prior's mean, or every draft, before there are any) and verifies that many slots
    of highest current survival.

    `padded`: the step's verify forward runs all B rows as wide as the widest request (as
    flashspark's loop does), so admission chooses a width for the batch (`padded_columns`)
    instead of Algorithm 1's slots priced at one token each (the engines' packed forward, the
    default).

    `batch_verdict`: a batch verdict (`verdict.BatchVerdict`, as a `Decoder` keeps) decided
    from measured tokens/s that this batch speculates: while every request is active,
    `wants_draft` drafts (plain steps are weighed only once requests have finished). Gated
    again by the prior that the verdict's probe is there to test, a probe of speculation would
    run plain steps, measure plain decoding, and never learn that drafting pays.

    `delay` = 2 admits by the confidences of two steps earlier, as engines do so that
    scheduling adds no latency (until there are any, the prior's mean, or every draft).

    `plain_sps` (steps per second of a plain decode step at T tokens) lets the
    scheduler skip drafting altogether: before each step, `wants_draft` compares the
    best Θ the recalibrated mean confidences so far promise for the active requests
    (`sps` prices a whole speculative step, drafting included) with the rate of a plain
    step, n_active · plain_sps(n_active), and drafts only when speculation is expected to
    win; the comparison is made only once `min_rows` confidence rows (this batch's, plus a
    `prior` from earlier ones or a calibration run) back the mean. Without `plain_sps` it
    always drafts. Speculation must promise `min_gain` times the plain rate (default 1.1):
    the tables and the clock carry about that much noise on a shared machine, and a wrong
    "draft" cost up to 17% (4 requests, 64 new tokens) where a wrong "plain" forgoes a gain
    that small. (A `Decoder`'s batch verdict, which measures both arms and has its own margin,
    takes `predicted_gain` without it.)

    With `time_steps`, the price of a step is checked against the clock too: the wall time from one
    `wants_draft` call to the next (one loop iteration) over the 1 / SPS(T) the table
    predicted for it gives a step-cost ratio (`step_prior`: (sum of ratios, steps) from
    earlier batches of this size), which divides Θ in that comparison. It catches what
    a profile of full batches misses: requests that finish early leave steps that cost
    nearly as much but commit less. (The schedule itself is unchanged by it: a constant
    factor does not move the best prefix.)
    """

    STEP_RATIO_STRENGTH = 2.0  # pseudo-steps of ratio 1
    REVERDICT_STEPS = 8

    def __init__(
        self,
        max_spec_len: int,
        sps: SPSTable,
        delay: int = 0,
        confidence_fn=None,
        plain_sps: SPSTable | None = None,
        min_rows: int = 64,
        prior: ConfidenceStats | None = None,
        step_prior: tuple[float, int] | None = None,
        time_steps: bool = False,
        min_gain: float = 1.1,
        admission: str = "stop",
        padded: bool = False,
        batch_verdict: bool = False,
    ):
        if max_spec_len < 0 or delay < 0:
            raise ValueError("max_spec_len and delay must be >= 0")
        if admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, got {admission!r}")
        self.max_spec_len = max_spec_len
        self.sps = sps
        self.delay = delay
        self.admission = admission
        self.padded = padded
        self.batch_verdict = batch_verdict
        # How old the confidences that decide (stop) or size (budget) a step are.
        self.age = max(delay, 1) if admission == "budget" else delay
        self.confidence_fn = confidence_fn
        self.plain_sps = plain_sps
        self.min_rows = min_rows
        # Everything learnt so far: the prior plus this scheduler's rows and outcomes.
        self.stats = None if prior is None else prior.copy()
        if self.stats is not None:
            self.stats.close_requests()  # the prior's batch is over: its rows are finished requests
        self._active: torch.Tensor | None = None  # the active rows of the step being verified
        self._history: deque[torch.Tensor] = deque(maxlen=self.age + 1)
        self._last: torch.Tensor | None = None  # survival of the step being verified (for observe)
        self._decision: tuple | None = None  # (active count, draft?) of the last verdict
        self._since_verdict = 0  # wants_draft calls since it
        self._step_ratio = list(step_prior) if step_prior is not None else [0.0, 0]  # (sum of ratios, steps)
        self.time_steps = time_steps
        self.min_gain = min_gain
        self._step_start: float | None = None  # when the current loop iteration began
        self._step_predicted: float | None = None  # its predicted seconds, if it drafted

    def reset(self) -> None:
        self._history.clear()
        self._decision = None
        self._step_start = self._step_predicted = None  # a new decode: nothing to time across the gap

    @property
    def wants_signals(self) -> bool:
        """Whether the loop must compute DFlash 2 path signals (a confidence proxy reads them)."""
        return bool(getattr(self.confidence_fn, "wants_signals", False))

    def wants_draft(self, active: torch.Tensor) -> bool:
        """Whether this step should draft (and verify by the schedule), or be a plain decode step.

        Judged on the recalibrated mean confidences seen so far (one hard block says little
        about the next); redone when the load changes and every REVERDICT_STEPS calls."""
        if self.time_steps:
            self._time_step()
        if self.plain_sps is None or self.stats is None or self.stats.rows < self.min_rows:
            return True
        n = int(active.sum())
        if self.batch_verdict and n == active.numel():
            return True  # the whole batch: the batch verdict's measurements decided
        self._since_verdict += 1
        # A verdict costs about half a millisecond of small tensor ops: redone when the load changes,
        # and every REVERDICT_STEPS iterations as confidences, outcomes and step times come in.
        if self._decision is None or self._decision[0] != n or self._since_verdict >= self.REVERDICT_STEPS:
            gain = self.expects_gain(conditional(self.stats.mean_survival()), max(1, n), active.numel())
            self._decision = (n, gain)
            self._since_verdict = 0
        return self._decision[1]

    def _time_step(self) -> None:
        """Close the timing of the previous loop iteration (if it drafted) and open the next."""
        now = time.perf_counter()
        if self._step_start is not None and self._step_predicted is not None:
            self._step_ratio[0] += (now - self._step_start) / self._step_predicted
            self._step_ratio[1] += 1
        self._step_start, self._step_predicted = now, None

    def step_cost_ratio(self) -> float:
        """Measured over predicted seconds of the drafting steps timed so far, shrunk toward 1."""
        s = self.STEP_RATIO_STRENGTH
        return (self._step_ratio[0] + s) / (self._step_ratio[1] + s)

    def step_cost_totals(self) -> tuple[float, int]:
        """(sum of measured / predicted step seconds, steps timed): the `step_prior` of a later batch."""
        return self._step_ratio[0], self._step_ratio[1]

    def plan(self, state) -> torch.Tensor:
        conf = self.confidence_fn(state) if self.confidence_fn is not None else getattr(state, "confidence", None)
        if conf is None:
            raise ValueError("ConfidenceScheduler needs per-token confidences (ScheduleState.confidence)")
        return self.schedule(conf, state.active)

    def verify_width(self, num_verified: torch.Tensor) -> int:
        """The plan's widest request, padded to the width the SPS table prices it at: a `padded`
        table (`SPSTable.padded`, as a `Decoder`'s is) prices a width by the cheapest measured
        forward at or above it, and the step runs that forward. Which drafts are verified is
        the plan's alone, so the schedule stays lossless."""
        w = int(num_verified.max())
        if w == 0:
            return 0  # nothing to verify: the step's forward is a plain one
        rows = num_verified.numel()
        runs = self.sps.runs(rows * (w + 1))
        return max(w, min(self.max_spec_len, -(-runs // rows) - 1))

    def observe(self, block, num_accepted: torch.Tensor, num_verified: torch.Tensor) -> None:
        """The loop reports each step's outcomes: they recalibrate the confidences, and a
        confidence source that learns online hears them too."""
        if self._last is not None and self.stats is not None:
            tree = getattr(block, "tree", None)  # (callers replaying outcomes may pass no block)
            accepted = None if tree is None else tree.accepted
            self.stats.add_outcomes(self._last, num_accepted, num_verified, accepted)
            if self._active is not None:
                self.stats.add_request_steps(num_accepted + 1, self._active)
        observe = getattr(self.confidence_fn, "observe", None)
        if observe is not None:
            observe(block, num_accepted, num_verified)

    def expects_gain(self, confidence: torch.Tensor, batch_size: int, rows: int | None = None) -> bool:
        """Would `batch_size` requests with per-position confidences `confidence` [K'] beat (by min_gain)
        plain decoding? (True without a plain table.) Engines use this to switch speculation
        off for a whole batch at high load, where even plain steps inside the speculative
        loop cost more than plain decoding (they keep the drafter's cache up to date)."""
        return self.predicted_gain(confidence, batch_size, rows) > self.min_gain

    def predicted_gain(
        self, confidence: torch.Tensor, batch_size: int, rows: int | None = None, new_tokens: int | None = None
    ) -> float:
        """Speculation's expected tokens/s over plain decoding's for `batch_size` active requests
        with per-position confidences `confidence` [K'] (inf without a plain table). `rows`: the
        forward's rows when it is padded (active requests plus finished ones it still runs;
        default `batch_size`), whose cost both a speculative and a plain step pay.

        `new_tokens`: the batch decodes that many tokens per request and lasts as long as its
        slowest request (`batch_tail`); without it, every step's tokens count (requests are
        replaced as they finish)."""
        if self.plain_sps is None:
            return math.inf
        rows = batch_size if rows is None or not self.padded else max(rows, batch_size)
        active = torch.arange(rows) < batch_size
        k, theta = schedule_tokens(
            confidence.double().expand(rows, -1),
            active,
            self.sps,
            self.max_spec_len,
            return_theta=True,
            admit="stop" if self.admission == "stop" else "best",
            padded=self.padded,
        )
        gain = theta / self.step_cost_ratio() / (batch_size * float(self.plain_sps.rate(rows)))
        if new_tokens is not None:
            survival = prefix_survival(confidence.double()[None, : int(k[0])])[0]
            spread = self.stats.request_spread() if self.stats is not None else ConfidenceStats.REQUEST_SPREAD
            gain /= batch_tail(survival, batch_size, new_tokens, spread)
        return gain

    def schedule(self, confidence: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Drafts each request verifies, from this step's confidences [B, K'] (lossless: see the
        module docstring). Nothing of the current block enters a decision except through the
        sorted prefix before each slot; the online statistics only learn from it afterwards."""
        survival = prefix_survival(confidence.detach().cpu())
        if self.stats is None:
            self.stats = ConfidenceStats(survival.shape[1])
        self._history.append(survival)
        # Confidences `age` steps old; before there are any, the mean of earlier batches (the prior),
        # else none (verify every draft): never the current block's.
        old = self._history[0] if len(self._history) > self.age else self._stale_fallback(survival.shape)
        decide = conditional(self.stats.correct(old))
        K, padded = self.max_spec_len, self.padded
        if self.admission == "stop":
            k_b = schedule_tokens(decide, active, self.sps, K, padded=padded)
        else:
            sized = schedule_tokens(decide, active, self.sps, K, admit="best", padded=padded)
            budget = int(sized.max() if padded else sized.sum())  # columns of a padded forward, else slots
            k_b = schedule_tokens(
                conditional(self.stats.correct(survival)), active, self.sps, K, admit=budget, padded=padded
            )
        self.stats.add_rows(survival[active.cpu()])  # after the decision: it learns from this block
        self._last, self._active = survival, active.cpu()
        if self._step_start is not None:  # the loop times its iterations through wants_draft
            T = active.numel() * (int(k_b.max()) + 1) if self.padded else int(active.sum()) + int(k_b.sum())
            self._step_predicted = 1.0 / float(self.sps.rate(T))
        return k_b

    def _stale_fallback(self, shape) -> torch.Tensor:
        """Survivals [B, K'] to decide by while no confidences are `age` steps old: the recorded
        mean survival of earlier batches where there is one, else certain survival (every draft
        is verified, unless the SPS table prices drafts out)."""
        if self.stats.rows:
            mean = self.stats.survival / self.stats.rows  # raw: `correct` is applied by the caller
            return mean.expand(shape).clone()
        return torch.ones(shape, dtype=torch.float64)

    def __repr__(self) -> str:
        return (
            f"ConfidenceScheduler(max_spec_len={self.max_spec_len}, delay={self.delay}, admission={self.admission!r})"
        )
