"""BatchVerdict (scheduling/verdict.py): the per-batch-size choice between speculating and
decoding plainly converges to the arm that measures faster, whatever the prior predicted,
probes the losing arm ever more rarely (later the farther behind it is), and notices when
the better arm changes."""

import numpy as np
import pytest
from flashspark.scheduling.verdict import BatchVerdict


def run(verdict, rates, batches, predicted, rng, key=1, noise=0.1):
    picks = []
    for _ in range(batches):
        arm = verdict.choose(key, predicted)
        picks.append(arm)
        verdict.record(key, arm, rates[arm] * (1 + noise * rng.uniform(-1, 1)))
    return np.array(picks)


@pytest.mark.parametrize("predicted", [1.3, 0.8])
@pytest.mark.parametrize("better", [True, False])
def test_converges_to_the_faster_arm_whatever_the_prediction(predicted, better):
    rng = np.random.default_rng(0)
    rates = {better: 1.4, not better: 1.0}
    picks = run(BatchVerdict(), rates, 200, predicted, rng)
    assert (picks == better).mean() >= 0.93
    assert (picks[100:] == better).mean() >= 0.96  # probes of the loser thin out (O(log n) of n)
    assert (picks[:16] == better).sum() >= 7  # a wrong prediction is probed at batch 8 and corrected


def test_the_old_defect_is_gone():
    """Predicted slightly plain while speculation pays 1.4x: the first four batches run plain,
    then a probe of speculation wins and speculation takes over (a one-shot verdict stayed plain)."""
    v = BatchVerdict()
    arms = []
    for _ in range(40):
        arm = v.choose(1, 0.9)
        arms.append(arm)
        v.record(1, arm, 28.0 if arm else 20.0)
    assert arms[:4] == [False] * 4 and arms[4] is True  # the first probe of speculation
    assert v.ratio(1, 0.9) == pytest.approx(1.4) and sum(arms[4:]) >= 0.85 * len(arms[4:])


def test_a_confident_prediction_probes_late():
    """Speculation predicted (and measured) 2.5x plain: plain decoding is first probed after 64
    batches, then, 2.5x behind, after 2^11 more; a few dozen batches never pay a probe."""
    v = BatchVerdict()
    arms = []
    for _ in range(80):
        arm = v.choose(1, 2.5)
        arms.append(arm)
        v.record(1, arm, 25.0 if arm else 10.0)
    assert [i for i, a in enumerate(arms) if not a] == [64]


def test_notices_a_change_and_keys_are_separate():
    rng = np.random.default_rng(1)
    v = BatchVerdict()
    run(v, {True: 1.5, False: 1.0}, 60, 1.2, rng, key=4)
    picks = run(v, {True: 0.7, False: 1.0}, 120, 1.2, rng, key=4)  # the load changed: plain wins now
    assert (picks[-40:] == False).mean() >= 0.9  # noqa: E712
    assert v.choose(8, 0.5) is False  # another batch size starts from its own prediction
    assert "4" in v.state()


def test_counterfactual_plain_rates_spare_the_probes():
    """Speculative batches also report the plain rate they estimate (their prefill plus a plain
    step per token of their longest output): measured at 1.5x that estimate, 32 batches pay no
    whole plain batch (without estimates plain is probed at batch 8, and having lost, not
    again before batch 8 + 2^(3 + 3))."""
    for estimates, plain_batches in ((True, []), (False, [8])):
        v = BatchVerdict()
        arms = []
        for _ in range(32):
            arm = v.choose(1, 1.3)
            arms.append(arm)
            v.record(1, arm, 15.0 if arm else 10.0, 10.0 if arm and estimates else None)
        assert [i for i, a in enumerate(arms) if not a] == plain_batches
        assert v.ratio(1, 1.3) == pytest.approx(1.5)


def test_a_biased_plain_estimate_is_probed_and_corrected():
    """The estimate puts plain decoding at 10 tokens/s while it runs at 20 (speculation 15): the
    estimated ratio is far from even, so the first probe of plain comes late (batch 128), wins,
    and plain decoding takes over."""
    v = BatchVerdict()
    arms = []
    for _ in range(200):
        arm = v.choose(1, 1.3)
        arms.append(arm)
        v.record(1, arm, 15.0 if arm else 20.0, 10.0 if arm else None)
    first_plain = arms.index(False)
    assert first_plain == 128 and sum(arms[first_plain:]) <= 0.1 * len(arms[first_plain:])


@pytest.mark.parametrize("predicted", [0.66, 1.2])
def test_a_lost_probe_never_brings_the_next_one_sooner(predicted):
    """Speculation measures 0.72x plain. Predicted 0.66x: plain runs, speculation is probed after
    2^4 batches and loses, and its next probe waits 2^(4 + 4) more, not 2^4 (the first probe's
    wait was dropped). Predicted 1.2x: the first batch speculates, its counterfactual plain
    rate puts it behind at once: its probe waits 2^4 batches (not one), the next 2^(4 + 4)."""
    v = BatchVerdict()
    arms = []
    for _ in range(300):
        arm = v.choose(1, predicted)
        arms.append(arm)
        v.record(1, arm, 7.2 if arm else 10.0, 10.0 if arm else None)
    spec = [i for i, a in enumerate(arms) if a]
    assert spec == ([16, 273] if predicted < 1 else [0, 17, 274])


@pytest.mark.parametrize("bias", [1.0, 1.5])
def test_paired_ratios_see_through_batch_to_batch_spread(bias):
    """Batches differ by up to 30% in tokens/s (which requests share one), speculation pays 4%:
    compared batch by batch with the plain rate estimated on each (here biased by `bias`, which
    the plain batches' own estimates take out), speculation wins; the arms' means over
    different batches would flip back and forth."""
    rng = np.random.default_rng(2)
    v = BatchVerdict()
    arms = []
    for _ in range(64):
        arm = v.choose(1, 1.02)
        arms.append(arm)
        hardness = rng.uniform(0.7, 1.3)
        v.record(1, arm, 10.0 * hardness * (1.04 if arm else 1.0), 10.0 * hardness * bias)
    assert sum(arms[16:]) >= 0.9 * len(arms[16:])
    assert v.ratio(1, 1.02) == pytest.approx(1.04)


def test_a_tie_goes_to_plain():
    """Speculation measures 1% ahead of plain decoding, within the margin: plain decoding is
    favoured; 4% ahead, speculation is."""
    for gain, favoured in ((1.01, False), (1.04, True)):
        v = BatchVerdict()
        for _ in range(3):
            v.record(1, True, 10.0 * gain, 10.0)
        assert v.choose(1, 1.3) is favoured and v.ratio(1, 1.3) == pytest.approx(gain)
