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
from the scheduler's confidences and step tables). The other arm is still probed, after
2^lost batches: `lost` starts at 1 + round(2 |log2 ratio|) for an arm never measured (a
prediction far from even is probed late) and grows by as much after each probe it loses. An
arm that keeps losing is probed ever more rarely (the probes cost O(log n) of n batches), one
that wins a probe takes over, and a changed load or machine is noticed at the next probe.
"""

from __future__ import annotations

import math
from collections import deque


def _backoff(ratio: float) -> int:
    """Doublings of the probe interval a measured or predicted ratio between the arms earns."""
    return 1 + round(2 * abs(math.log2(max(ratio, 1e-9))))


class _Arms:
    def __init__(self, window: int):
        self.rates = {True: deque(maxlen=window), False: deque(maxlen=window)}  # tokens/s of recent batches
        self.since = {True: 0, False: 0}  # batches since the arm last ran
        self.lost = {True: None, False: None}  # doublings before its next probe (None: not yet measured)

    def mean(self, arm: bool) -> float | None:
        r = self.rates[arm]
        return sum(r) / len(r) if r else None


class BatchVerdict:
    def __init__(self, window: int = 8):
        self.window = window
        self.arms: dict = {}
        self.last: dict = {}  # key -> (arm, whether it was a probe, the favoured arm)

    def _arms(self, key) -> _Arms:
        if key not in self.arms:
            self.arms[key] = _Arms(self.window)
        return self.arms[key]

    def ratio(self, key, predicted_gain: float) -> float:
        """Speculation's tokens/s over plain decoding's: measured where both arms are, else predicted."""
        a = self._arms(key)
        spec, plain = a.mean(True), a.mean(False)
        return spec / plain if spec is not None and plain is not None else predicted_gain

    def choose(self, key, predicted_gain: float) -> bool:
        """Speculate (True) or decode plainly (False) for the next batch of `key`, given the
        prior's predicted gain (speculation's tokens/s over plain decoding's)."""
        a = self._arms(key)
        r = self.ratio(key, predicted_gain)
        best = r >= 1.0
        other = not best
        lost = a.lost[other] if a.lost[other] is not None else _backoff(r)
        measured = bool(a.rates[True] or a.rates[False])
        probe = measured and a.since[other] >= 2**lost
        arm = other if probe else best
        self.last[key] = (arm, probe, best)
        return arm

    def record(self, key, arm: bool, tokens_per_s: float) -> None:
        """The measured tokens/s of a batch of `key` that ran `arm`."""
        a = self._arms(key)
        _, probe, best = self.last.get(key, (arm, False, arm))
        rival = a.mean(best)
        if probe and arm != best and rival is not None and tokens_per_s < rival:
            a.lost[arm] = (a.lost[arm] or 0) + _backoff(rival / tokens_per_s)
        elif a.lost[arm] is None or (probe and arm != best):
            a.lost[arm] = 0  # measured now, or won its probe: probed again soon if it falls behind
        a.rates[arm].append(tokens_per_s)
        a.since[arm] = 0
        a.since[not arm] += 1

    def state(self) -> dict:
        return {
            str(k): {"speculate": list(a.rates[True]), "plain": list(a.rates[False]), "lost": dict(a.lost)}
            for k, a in self.arms.items()
        }
