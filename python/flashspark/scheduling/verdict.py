"""Whether a whole batch speculates or decodes plainly, learnt from what both measure.

A confidence method decides per batch size (and temperature) whether to run the speculative
loop or plain decoding. Judged once from the confidences' prior, a "plain" verdict can never
be corrected: a plain batch produces no verify outcomes, so the prior never moves, and the
method stays plain where speculation would have paid (on SmolLM2 at concurrency 1 it decoded
plainly in one run at 1.05x while a fixed K ran at 1.41x).

`BatchVerdict` is a two-armed bandit per key (batch size, temperature): arm True speculates,
arm False decodes plainly; each batch's measured tokens/s goes to the arm that ran it. The
arm with the better mean over its last `window` batches runs, except for probes of the other
arm: after `2^lost` batches, where `lost` counts the other arm's consecutive probes that
measured worse (a never-measured arm the prediction disfavours: after 2). An arm that keeps losing is probed ever more rarely (the probes cost
O(log n) of n batches), one that wins a probe takes over, and a changed load or machine is
noticed at the next probe. Before any measurement the prior's prediction decides.
"""

from __future__ import annotations

from collections import deque


class _Arms:
    def __init__(self, window: int):
        self.rates = {True: deque(maxlen=window), False: deque(maxlen=window)}  # tokens/s of recent batches
        self.since = {True: 0, False: 0}  # batches since the arm last ran
        self.lost = {True: 0, False: 0}  # its consecutive lost probes

    def mean(self, arm: bool) -> float | None:
        r = self.rates[arm]
        return sum(r) / len(r) if r else None


class BatchVerdict:
    def __init__(self, window: int = 8):
        self.window = window
        self.arms: dict = {}
        self.last: dict = {}  # key -> (arm, whether it was a probe)

    def _arms(self, key) -> _Arms:
        if key not in self.arms:
            self.arms[key] = _Arms(self.window)
        return self.arms[key]

    def best(self, key, predicted: bool) -> bool:
        """The arm the measurements favour (the prediction while neither has any, or on a tie of unknowns)."""
        a = self._arms(key)
        m = {arm: a.mean(arm) for arm in (True, False)}
        if m[True] is None and m[False] is None:
            return predicted
        if m[True] is None or m[False] is None:
            return m[True] is not None  # the measured arm, until the other's first probe
        return m[True] >= m[False]

    def choose(self, key, predicted: bool) -> bool:
        """Speculate (True) or decode plainly (False) for the next batch of `key`."""
        a = self._arms(key)
        best = self.best(key, predicted)
        other = not best
        # A never-measured arm the prediction disfavours waits one doubling more for its first probe.
        need = 2 ** (a.lost[other] + (not a.rates[other] and other != predicted))
        probe = bool(a.since[other] >= need and (a.rates[best] or a.rates[other]))
        arm = other if probe else best
        self.last[key] = (arm, bool(probe), best)
        return arm

    def record(self, key, arm: bool, tokens_per_s: float) -> None:
        """The measured tokens/s of a batch of `key` that ran `arm`."""
        a = self._arms(key)
        _, probe, best = self.last.get(key, (arm, False, arm))
        if probe and arm != best:
            rival = a.mean(best)
            a.lost[arm] = a.lost[arm] + 1 if rival is not None and tokens_per_s < rival else 0
        a.rates[arm].append(tokens_per_s)
        a.since[arm] = 0
        a.since[not arm] += 1

    def state(self) -> dict:
        return {
            str(k): {"speculate": list(a.rates[True]), "plain": list(a.rates[False]), "lost": dict(a.lost)}
            for k, a in self.arms.items()
        }
