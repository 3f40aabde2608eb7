"""Whether a whole batch speculates or decodes plainly, learnt from what both measure.

A confidence method decides per batch size (and temperature) whether to run the speculative
loop or plain decoding. Judged once from the confidences' prior, a "plain" verdict can never
be corrected: a plain batch produces no verify outcomes, so the prior never moves, and the
method stays plain where speculation would have paid (on SmolLM2 at concurrency 1 it decoded
plainly in one run at 1.05x while a fixed K ran at 1.41x).

`BatchVerdict` is a two-armed bandit per key (batch size, temperature): arm True speculates,
arm False decodes plainly; each batch's measured tokens/s goes to the arm that ran it. The
ratio of the two arms over their last `window` batches decides; an arm not yet measured
takes the prior's predicted ratio (speculation's tokens/s over plain decoding's, from the
scheduler's confidences and step tables).

**Counterfactual plain rates, paired.** A speculative batch also says what plain decoding would
have taken on it: its prefill plus one plain step (the profiled forward) per token of its
longest request. Batches differ (a batch lasts as long as its longest request, and which
requests share one changes its tokens/s by 10% and more), so the arms' mean tokens/s over
different batches compare noisily. The ratio is taken per batch instead: each speculative
batch's tokens/s over the plain rate estimated on it. A plain batch reports the same
estimator's figure for itself, and its measured-over-estimated ratio takes the estimator's
bias out. Until a plain batch is measured the estimate is taken as unbiased, so a batch size
where speculation clearly wins need not pay whole plain batches to learn it. Batches without
estimates fall back to the arms' mean tokens/s.

**The prior counts as PRIOR_BATCHES batches.** Per-batch ratios at low concurrency spread by
15% and more (which requests share a batch: on the H200 projection at concurrency 2 they run
0.82-1.21x where speculation averages 1.13x), so a first speculative batch that happens to
measure 0.82x would, on its own, send a key plain for 16 batches. The measured ratio is pooled
with the prior's prediction instead, in log space, the prediction weighing as PRIOR_BATCHES
speculative batches against all the speculative batches run so far (the mean over the
window, weighted by their count, so the prior fades): one bad batch against a prediction of
a clear gain moves the verdict less than two or three do. The prediction pooled is the one the
prior made before the key's first batch: the prior learns from the verify outcomes of the very
batches the arms measure, so its later word would count them twice (on the H200 projection at
concurrency 4, T = 0, one first batch at 0.82x moved the prediction from 1.04x to 0.93x, and the
two together sent the key plain where speculation gains 4%: 0.956x the best fixed K in the
worst of a draw of 50 orders; 0.983x pooled with the prediction as it stood). The price: where
the prior is far off and one batch corrects it, one more speculative batch runs (the tiny
target's traces priced as a Qwen3-8B at concurrency 64: predicted 1.19x, measured 0.73x).

A probe whose batches measure ahead while the prior still outweighs them is not counted as
lost: it runs again after one batch, when its second measurement carries more weight. If the
rerun loses, the next probe waits longer than the first one did, not counted from the rerun's
wait of none (which brought it four batches later, to draw a second 0.82x batch: 0.975x plain
in the worst of a draw of 50 orders on the H200 projection at concurrency 8).

**A tie goes to plain.** Speculation is favoured only when it measures MARGIN (2%) ahead:
per-batch ratios spread by 10% and more, so arms within 2% of each other swap on noise, and
in the replay (bench/combo_replay.py, H200 projection, concurrency 8-16) the swaps cost up
to 3% of plain decoding's rate in the worst of 6 orders; plain decoding needs no drafter.
(The prior's prediction is taken as it is: since `confidence.batch_tail` counts how requests
differ, it is within 1-2% of the replay at every concurrency on the H200 projection, T = 0,
where net of the scheduler's `min_gain` it sent concurrency 4, where speculation gains 4%,
plain.)

**The benefit of the doubt.** Speculation is favoured while its judged ratio, raised by
OPTIMISM (2) standard errors of its log, clears even: the spread of its batches' paired log
ratios (SPREAD / batch^(1/4) counting as one of them, so a single batch has a spread) over the
root of the speculative batches run plus the prior's weight. The plain arm needs none: the
counterfactual estimates measure it on every speculative batch. One batch at concurrency 1 is
one request, and requests' gains spread by 15%: on the H200 projection at T = 0 a first request
measuring 0.82x, against a gain of 1.21x, kept the worst of 50 orders plain at 0.83x the best
fixed K; with the benefit of the doubt speculation runs on and the worst order reads 0.99x
(concurrency 2: 0.90x -> 0.995x). The bonus fades as batches add up (by the count run, not the
window, which would keep it for good): a loss of 15% is run three batches before the
measurements outweigh it, and in the long run the margin below decides ties again. It goes
only where the prior's prediction, before any measurement, chose speculation: the doubt is
whether a few unlucky batches should overturn a predicted gain. Where the prior chose plain
decoding a probe of speculation wins on its measurements alone (pooled with the prior, over
the margin): at concurrency 8 on the H200 projection the prior predicts 0.987x, speculation
gains nothing, and probes given the doubt ran on (0.973x plain in the worst of 50 orders;
0.976x without). (Decided by the prior's first choice, not its latest: the prior learns from
the same unlucky verify outcomes, and following it took the doubt away at concurrency 1.)

**Probes.** The other arm is still probed, after 2^lost batches. For an arm never measured,
`lost` starts at 2 + round(PREDICTED_SLOPE |log2 ratio|) on the prior's prediction alone, at
most PREDICTED_MAX (a prediction of a loss is probed late: 0.98x at batch 8, 0.96x at 16, 0.94x
at 32, 0.93x and below at 64; a prediction within 1% of even waits 4 batches), and at
2 + round(MEASURED_SLOPE |log2 ratio|) on a measured ratio, ESTIMATE_DOUBLINGS more when it
rests on counterfactual estimates (they only miss by the plain step's error). A probe costs up
to (1 - ratio) of a batch: one of speculation 19% behind in 16 batches costs 1.2% of plain
decoding's rate (the replay at concurrency 32 on the H200 projection), so a prior that is right
about a loss should not be checked early. Where it predicts a loss it is, if anything,
optimistic: on the H200 projection at concurrency 8 and 16 it predicted 0.92-0.99x (over
`min_gain`, before the batch tail counted how requests differ) where speculation's probes
measured 0.81-0.82x, so a probe there costs more than the prediction says (hence the steeper
slope for the prediction alone). Since the tail counts how requests differ and the prediction
is taken without `min_gain` it is within 1-2% of the replay, and the slope doubled (17 -> 34)
to trust it as long as before: at 17, a prediction of 0.93x at T = 1, concurrency 1 (the H200
projection) was probed at batch 16 and the worst of 50 orders read 0.989x plain. `lost` grows by the
measured doublings after each probe the arm loses: a probe never comes sooner than any
before it did (a first probe that confirms the prediction waits the prediction's doublings plus
its own). An arm whose first batch, run as the favoured arm, already measures behind the other
(pooled with the prior) waits as if it had lost a probe. An arm that keeps losing is probed
ever more rarely (the probes cost O(log n) of n batches), one that wins a probe takes over (and
should its batches then put it behind, waits 2^2 batches before its next probe, as a measured
near-tie earns: the next batch is another draw from the same spread), and
a changed load or machine is noticed at the next probe. The slopes were tuned in the replay
(bench/combo_replay.py, SmolLM2's traces, both cost models, 12 orders per cell, then checked
over 50); the price: a prior that wrongly predicts a loss of 7% or more costs 64 batches before
its probe (PREDICTED_MAX; as before the doubling, when the prediction net of `min_gain` had to be
20% wrong).
"""

from __future__ import annotations

import math
from collections import deque

# Doublings of the probe interval per octave of the ratio between the arms: measured, or
# predicted by the prior alone (which waits longer: a probe costs a batch's loss, and where the
# prior predicts one the loss measures larger; one batch's measurement spreads by 15% and more).
MEASURED_SLOPE = 5
PREDICTED_SLOPE = 34
PREDICTED_MAX = 6  # however sure the prior, the other arm is measured within 2^6 batches


def _backoff(ratio: float, slope: float = MEASURED_SLOPE) -> int:
    """Doublings of the probe interval a measured (or, with PREDICTED_SLOPE, predicted) ratio
    between the arms earns."""
    return 2 + round(slope * abs(math.log2(max(ratio, 1e-9))))


class _Arms:
    def __init__(self, window: int):
        self.predicted = None  # the prior's predicted ratio (speculation over plain) before the first batch
        self.rates = {True: deque(maxlen=window), False: deque(maxlen=window)}  # tokens/s of recent batches
        # Each batch's tokens/s over the plain rate estimated on it (None: no estimate).
        self.paired = {True: deque(maxlen=window), False: deque(maxlen=window)}
        self.since = {True: 0, False: 0}  # batches since the arm last ran
        self.runs = {True: 0, False: 0}  # batches the arm ran, all told
        self.lost = {True: None, False: None}  # doublings before its next probe (None: not yet measured)
        # The most doublings a probe of the arm has waited (a first probe: what the prediction
        # earned); a lost probe's successor waits longer, a rerun in between notwithstanding.
        self.longest = {True: 0, False: 0}
        self.first_choice = None  # the arm the prior's prediction chose before any measurement (None: no prior)

    def mean(self, arm: bool) -> float | None:
        r = self.rates[arm]
        return sum(r) / len(r) if r else None

    def paired_mean(self, arm: bool) -> float | None:
        """The mean of the arm's paired ratios, if every recent batch of the arm carries one."""
        r = self.paired[arm]
        return None if not r or None in r else sum(r) / len(r)


class BatchVerdict:
    ESTIMATE_DOUBLINGS = 3
    MARGIN = 1.02  # speculation must measure this far ahead of plain decoding to be favoured
    PRIOR_BATCHES = 2  # the prior's prediction weighs as many speculative batches
    OPTIMISM = 2.0  # standard errors of its judged ratio that speculation is given the benefit of
    # A speculative batch's spread of log paired ratios at batch 1, until its own batches measure
    # it; it falls as batch^(-1/4) (a batch lasts as long as its slowest request, so averaging
    # its requests narrows it less than 1/sqrt(batch) would): the H200 projection's DFlash 2
    # K = 3 batches at T = 0 spread by 0.155, 0.137, 0.089, 0.083 at batch 1, 2, 4, 8.
    SPREAD = 0.15

    def __init__(
        self,
        window: int = 8,
        margin: float = MARGIN,
        prior_batches: float = PRIOR_BATCHES,
        optimism: float | None = None,
    ):
        self.window = window
        self.margin = margin
        self.prior_batches = prior_batches
        self.optimism = self.OPTIMISM if optimism is None else optimism
        self.arms: dict = {}
        self.last: dict = {}  # key -> (arm, whether it was a probe, the favoured arm)

    def _arms(self, key) -> _Arms:
        if key not in self.arms:
            self.arms[key] = _Arms(self.window)
        return self.arms[key]

    def _measured_ratio(self, a: _Arms) -> float | None:
        """Speculation's tokens/s over plain decoding's from the batches run, or None. Paired
        where the batches carry plain estimates: each speculative batch against the estimate
        on it, the estimator's bias taken out by the plain batches' own measured-over-estimated
        ratios (none measured: unbiased). Else the two arms' mean tokens/s."""
        spec = a.paired_mean(True)
        if spec is not None:
            bias = a.paired_mean(False) if a.rates[False] else 1.0
            if bias is not None:
                return spec / bias
        if a.rates[True] and a.rates[False]:
            return a.mean(True) / a.mean(False)
        return None

    def _judged_ratio(self, a: _Arms, r: float | None) -> float | None:
        """The measured ratio `r` as the verdict judges it: pooled with the prior's prediction
        (worth `prior_batches` speculative batches, in log space), over the margin speculation
        must clear."""
        if r is None:
            return None
        w = self._prior_weight(a)
        if w > 0:
            n = a.runs[True]  # the prior fades as speculation keeps running
            r = math.exp((w * math.log(a.predicted) + n * math.log(r)) / (w + n))
        return r / self.margin

    def _prior_weight(self, a: _Arms) -> float:
        """How many speculative batches the prior's prediction counts as (0 without one)."""
        return self.prior_batches if a.predicted is not None and a.predicted > 0 else 0

    def _benefit(self, a: _Arms, requests: int) -> float:
        """The factor speculation's judged ratio is raised by while its measurement is uncertain:
        exp(optimism x its standard error in log space), the spread of its batches' paired log
        ratios (SPREAD counting as one of them) over the root of the batches and the prior's
        weight behind it."""
        logs = [math.log(x) for x in a.paired[True] if x is not None and x > 0]
        if not self.optimism or not logs or a.first_choice is False:
            return 1.0  # (the prior chose plain decoding: a probe of speculation wins on its measurements)
        mean = sum(logs) / len(logs)
        floor = self.SPREAD**2 / math.sqrt(max(1, requests))  # SPREAD / batch^(1/4), squared
        var = (floor + sum((x - mean) ** 2 for x in logs)) / len(logs)
        # All the speculative batches run count (as in the pooling): the bonus fades as they add
        # up, where the window's spread alone would keep it for good.
        weight = a.runs[True] + self._prior_weight(a)
        return math.exp(self.optimism * math.sqrt(var / weight))

    def ratio(self, key, predicted_gain: float | None) -> float | None:
        """Speculation's tokens/s over plain decoding's: measured where there is a measurement
        of both (the plain arm possibly as estimates on speculative batches), else predicted."""
        measured = self._measured_ratio(self._arms(key))
        return predicted_gain if measured is None else measured

    def choose(self, key, predicted_gain: float | None, requests: int = 1) -> bool:
        """Speculate (True) or decode plainly (False) for the next batch of `key`, given the
        prior's predicted gain (speculation's tokens/s over plain decoding's; None: there is no
        prior, speculation runs first and the measurements alone decide)."""
        a = self._arms(key)
        if not (a.runs[True] or a.runs[False]):
            # The prior as it stood before this key's first batch: it learns from the same verify
            # outcomes the key's batches measure, so its later word would count them twice.
            a.predicted = predicted_gain
        measured_ratio = self._judged_ratio(a, self._measured_ratio(a))
        r = predicted_gain if measured_ratio is None else measured_ratio
        if r is None:  # nothing to go on yet: speculate, which measures both arms' rates
            self.last[key] = (True, False, True)
            return True
        if measured_ratio is None and a.first_choice is None:
            a.first_choice = r >= 1.0
        best = r * self._benefit(a, requests) >= 1.0 if measured_ratio is not None else r >= 1.0
        other = not best
        lost = a.lost[other]
        if lost is None:
            estimated = a.rates[True] and not a.rates[False] and measured_ratio is not None
            if measured_ratio is None:
                lost = min(_backoff(r, PREDICTED_SLOPE), PREDICTED_MAX)
            else:
                lost = _backoff(r) + (self.ESTIMATE_DOUBLINGS if estimated else 0)
            a.longest[other] = max(a.longest[other], lost)
        measured = bool(a.rates[True] or a.rates[False])
        probe = measured and a.since[other] >= 2**lost
        arm = other if probe else best
        self.last[key] = (arm, probe, best)
        return arm

    def record(self, key, arm: bool, tokens_per_s: float, plain_estimate: float | None = None) -> None:
        """The measured tokens/s of a batch of `key` that ran `arm`, and optionally the tokens/s
        plain decoding is estimated to reach on it (for a speculative batch its counterfactual
        rate; for a plain batch what the same estimator said of it, which measures its bias)."""
        a = self._arms(key)
        _, probe, best = self.last.get(key, (arm, False, arm))
        first = a.lost[arm] is None
        a.rates[arm].append(tokens_per_s)
        ok = plain_estimate is not None and plain_estimate > 0
        a.paired[arm].append(tokens_per_s / plain_estimate if ok else None)
        a.since[arm] = 0
        a.since[not arm] += 1
        a.runs[arm] += 1
        measured = self._measured_ratio(a)
        r = self._judged_ratio(a, measured)

        def behind_at(ratio: float | None) -> bool:  # does `ratio` put `arm` behind the other?
            return ratio is not None and (ratio < 1.0 if arm else ratio >= 1.0)

        behind = behind_at(r)
        outvoted = behind and not behind_at(measured / self.margin)  # behind by the prior alone
        if probe and arm != best:
            if outvoted:
                a.lost[arm] = 0  # its batches win, the prior still outweighs them: run it again
            elif behind:
                # Lost its probe: the next waits longer than any probe of the arm did (a first
                # probe waited what the prediction earned; a rerun the prior outvoted waited none).
                a.lost[arm] = max(a.lost[arm] or 0, a.longest[arm]) + _backoff(r)
                a.longest[arm] = a.lost[arm]
            else:
                a.lost[arm] = _backoff(1.0)  # won its probe: probed 2^2 batches after it falls behind
        elif first:
            # Measured for the first time as the favoured arm: if that already puts it behind the
            # other (say against the plain rate estimated on it), its probe waits by how far.
            a.lost[arm] = _backoff(r) if behind else 0

    def state(self) -> dict:
        return {
            str(k): {"speculate": list(a.rates[True]), "plain": list(a.rates[False]), "lost": dict(a.lost)}
            for k, a in self.arms.items()
        }
