"""Whether a whole batch speculates or decodes plainly, learnt from what both measure.

A confidence method decides per batch size (and temperature) whether to run the speculative
loop or plain decoding. Judged once from the confidences' prior, a "plain" verdict can never
be corrected: a plain batch produces no verify outcomes, so the prior never moves, and the
method stays plain where speculation would have paid (on SmolLM2 at concurrency 1 it decoded
plainly in one run at 1.05x while a fixed K ran at 1.41x).

`BatchVerdict` is a two-armed bandit per key (batch size, temperature): arm True speculates,
arm False decodes plainly; each batch's measured tokens/s goes to the arm that ran it. The
ratio of the two arms' mean tokens/s over their last `window` batches decides; an arm not yet
measured takes the prior's predicted ratio (speculation's tokens/s over plain decoding's,
from the scheduler's confidences and step tables).

**Counterfactual plain rates.** A speculative batch also says what plain decoding would have
taken on it: its prefill plus one plain step (measured on an earlier plain batch, else the
profiled forward) per token of its longest request. Until a plain batch is measured, that
estimate stands for the plain arm, so a batch size where speculation clearly wins need not
pay whole plain batches to learn it.

**Probes.** The other arm is still probed, after 2^lost batches: `lost` starts at
1 + round(3 |log2 ratio|) for an arm never measured (a prediction far from even is probed
late), ESTIMATE_DOUBLINGS more when the ratio rests on counterfactual estimates (they only
miss by the plain step's error), and grows by as much after each probe it loses. An arm that
keeps losing is probed ever more rarely (the probes cost O(log n) of n batches), one that
wins a probe takes over, and a changed load or machine is noticed at the next probe.
"""

from __future__ import annotations

import math
from collections import deque


def _backoff(ratio: float) -> int:
    """Doublings of the probe interval a measured or predicted ratio between the arms earns."""
    return 1 + round(3 * abs(math.log2(max(ratio, 1e-9))))


class _Arms:
    def __init__(self, window: int):
        self.rates = {True: deque(maxlen=window), False: deque(maxlen=window)}  # tokens/s of recent batches
        self.since = {True: 0, False: 0}  # batches since the arm last ran
        self.lost = {True: None, False: None}  # doublings before its next probe (None: not yet measured)
        self.plain_estimates = deque(maxlen=window)  # counterfactual plain tokens/s of speculative batches

    def mean(self, arm: bool) -> float | None:
        r = self.rates[arm]
        return sum(r) / len(r) if r else None


class BatchVerdict:
    ESTIMATE_DOUBLINGS = 3

    def __init__(self, window: int = 8):
        self.window = window
        self.arms: dict = {}
        self.last: dict = {}  # key -> (arm, whether it was a probe, the favoured arm)

    def _arms(self, key) -> _Arms:
        if key not in self.arms:
            self.arms[key] = _Arms(self.window)
        return self.arms[key]

    def _plain(self, a: _Arms) -> float | None:
        """The plain arm's tokens/s: measured, else estimated from speculative batches, else None."""
        if a.rates[False]:
            return a.mean(False)
        e = a.plain_estimates
        return sum(e) / len(e) if e else None

    def ratio(self, key, predicted_gain: float) -> float:
        """Speculation's tokens/s over plain decoding's: measured (or the plain arm estimated from
        speculative batches) where there are both, else predicted."""
        a = self._arms(key)
        spec, plain = a.mean(True), self._plain(a)
        return spec / plain if spec is not None and plain is not None else predicted_gain

    def choose(self, key, predicted_gain: float) -> bool:
        """Speculate (True) or decode plainly (False) for the next batch of `key`, given the
        prior's predicted gain (speculation's tokens/s over plain decoding's)."""
        a = self._arms(key)
        r = self.ratio(key, predicted_gain)
        best = r >= 1.0
        other = not best
        lost = a.lost[other]
        if lost is None:
            estimated = a.rates[True] and not a.rates[False] and a.plain_estimates
            lost = _backoff(r) + (self.ESTIMATE_DOUBLINGS if estimated else 0)
        measured = bool(a.rates[True] or a.rates[False])
        probe = measured and a.since[other] >= 2**lost
        arm = other if probe else best
        self.last[key] = (arm, probe, best)
        return arm

    def record(self, key, arm: bool, tokens_per_s: float, plain_estimate: float | None = None) -> None:
        """The measured tokens/s of a batch of `key` that ran `arm`; for a speculative batch,
        optionally the tokens/s plain decoding is estimated to have reached on it."""
        a = self._arms(key)
        _, probe, best = self.last.get(key, (arm, False, arm))
        rival = a.mean(True) if best else self._plain(a)
        if probe and arm != best and rival is not None and tokens_per_s < rival:
            a.lost[arm] = (a.lost[arm] or 0) + _backoff(rival / tokens_per_s)
        elif a.lost[arm] is None or (probe and arm != best):
            a.lost[arm] = 0  # measured now, or won its probe: probed again soon if it falls behind
        a.rates[arm].append(tokens_per_s)
        if arm and plain_estimate is not None and plain_estimate > 0:
            a.plain_estimates.append(plain_estimate)
        a.since[arm] = 0
        a.since[not arm] += 1

    def state(self) -> dict:
        return {
            str(k): {"speculate": list(a.rates[True]), "plain": list(a.rates[False]), "lost": dict(a.lost)}
            for k, a in self.arms.items()
        }
