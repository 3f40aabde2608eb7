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
    assert (picks[100:] == better).mean() >= 0.96  # probes of the loser thin out (O(log n) of n)
    # A prediction 20-30% from even is trusted for 2^6 batches (PREDICTED_MAX): a wrong one is
    # probed at batch 64, its arm run again soon after (the prior weighs as two batches) and
    # takes over.
    right = (predicted > 1) == better
    assert (picks[:64] == better).sum() == (64 if right else 0)
    assert (picks[64:96] == better).sum() >= 28 and (picks == better).mean() >= (0.99 if right else 0.6)


def test_the_old_defect_is_gone():
    """Predicted plain (0.9x) while speculation pays 1.4x: the first 64 batches run plain
    (2^6, PREDICTED_MAX: a prediction of a loss is trusted), then a probe of speculation wins
    and speculation takes over (a one-shot verdict stayed plain)."""
    v = BatchVerdict()
    arms = []
    for _ in range(120):
        arm = v.choose(1, 0.9)
        arms.append(arm)
        v.record(1, arm, 28.0 if arm else 20.0)
    assert arms[:64] == [False] * 64 and arms[64] is True  # the first probe of speculation
    assert v.ratio(1, 0.9) == pytest.approx(1.4) and sum(arms[64:]) >= 0.9 * len(arms[64:])


def test_a_confident_prediction_probes_late():
    """Speculation predicted (and measured) 2.5x plain: plain decoding is first probed after 64
    batches (PREDICTED_MAX: however sure the prior, the other arm is measured by then), then,
    2.5x behind, after 2^13 more; a few dozen batches never pay a probe."""
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
    step per token of their longest output): measured at 1.5x that estimate, 160 batches pay no
    whole plain batch (without estimates plain is probed at batch 64, as the prediction of 1.3x
    earns, and having lost, not again before batch 64 + 2^(6 + 5))."""
    for estimates, plain_batches in ((True, []), (False, [64])):
        v = BatchVerdict()
        arms = []
        for _ in range(160):
            arm = v.choose(1, 1.3)
            arms.append(arm)
            v.record(1, arm, 15.0 if arm else 10.0, 10.0 if arm and estimates else None)
        assert [i for i, a in enumerate(arms) if not a] == plain_batches
        assert v.ratio(1, 1.3) == pytest.approx(1.5)


def test_a_biased_plain_estimate_is_probed_and_corrected():
    """The estimate puts plain decoding at 10 tokens/s while it runs at 20 (speculation 15): the
    estimated ratio is far from even, so the first probe of plain comes late (batch 256: 2^5 for
    a measured 1.5x, 2^3 more as it rests on estimates), wins, and plain decoding takes over."""
    v = BatchVerdict()
    arms = []
    for _ in range(320):
        arm = v.choose(1, 1.3)
        arms.append(arm)
        v.record(1, arm, 15.0 if arm else 20.0, 10.0 if arm else None)
    first_plain = arms.index(False)
    assert first_plain == 256 and sum(arms[first_plain:]) <= 0.1 * len(arms[first_plain:])


@pytest.mark.parametrize("predicted", [0.66, 1.2])
def test_a_lost_probe_never_brings_the_next_one_sooner(predicted):
    """Speculation measures 0.72x plain. Predicted 0.66x: plain runs, speculation is probed after
    2^6 batches (PREDICTED_MAX) and loses, and its next probe waits 2^(6 + 5) more, not 2^5 (the
    first probe's wait was dropped). Predicted 1.2x: the first batch speculates; its
    counterfactual plain rate, pooled with the prediction (worth two batches), puts it behind,
    but by less than two standard errors (OPTIMISM) until three batches measure it; then its
    probe waits 2^2 batches, and having lost, the next 2^5, then 2^8."""
    v = BatchVerdict()
    arms = []
    for _ in range(600):
        arm = v.choose(1, predicted)
        arms.append(arm)
        v.record(1, arm, 7.2 if arm else 10.0, 10.0 if arm else None)
    spec = [i for i, a in enumerate(arms) if a]
    assert spec == ([64] if predicted < 1 else [0, 1, 2, 7, 40, 297])


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
    favoured; 4% ahead, speculation is. Three batches are too few to tell 1% from noise, and
    speculation gets the benefit of the doubt (OPTIMISM); it fades as batches add up."""
    for gain, favoured in ((1.01, False), (1.04, True)):
        v = BatchVerdict(prior_batches=0, optimism=0)  # the measurement alone, taken as exact
        for _ in range(3):
            v.record(1, True, 10.0 * gain, 10.0)
        assert v.choose(1, 1.3) is favoured and v.ratio(1, 1.3) == pytest.approx(gain)
    v = BatchVerdict(prior_batches=0)
    for batches in (3, 400):
        while v.arms.get(1) is None or v.arms[1].runs[True] < batches:
            v.record(1, True, 10.1, 10.0)
        v.choose(1, 1.3)
        assert v.last[1][2] is (batches == 3)  # the favoured arm (plain is probed by now, too)


@pytest.mark.parametrize("prior_batches", [0, 2])
@pytest.mark.parametrize("optimism", [0.0, None])
def test_one_bad_batch_against_the_prior_is_rechecked_soon(prior_batches, optimism):
    """Predicted 1.1x; the first speculative batch measures 0.82x the plain rate estimated on
    it (a batch of hard requests), every later one 1.2x. One batch is one draw from a spread of
    15% and more: speculation, given the benefit of two standard errors (OPTIMISM), runs again
    at once and takes over. Judged as exact (optimism 0: the rule before), plain decoding runs:
    on that batch alone for 16 batches, and the probe's 1.2x averaged with the bad batch still
    loses, plain for the rest; pooled with the prediction (worth two batches) the probe comes
    after 4 batches and wins. (On the H200 projection at concurrency 1, T = 0, a first request
    measuring 0.82x kept the worst of 50 orders plain at 0.83x the best fixed K.)"""
    v = BatchVerdict(prior_batches=prior_batches, optimism=optimism)
    arms = []
    for i in range(24):
        arm = v.choose(1, 1.1)
        arms.append(arm)
        v.record(1, arm, (8.2 if i == 0 else 12.0) if arm else 10.0, 10.0)
    probe = 1 + arms[1:].index(True)
    if optimism is None:
        assert all(arms)
        return
    assert probe == (5 if prior_batches else 17)
    if prior_batches:
        assert sum(arms[probe:]) >= 0.75 * len(arms[probe:]) and all(arms[-8:])
    else:
        assert not any(arms[probe + 1 :])


@pytest.mark.parametrize("predicted", [1.0, 1.1])
def test_the_benefit_of_the_doubt_is_bounded(predicted):
    """Speculation loses 15% (each batch's ratio spreads by 10% more) where the prior predicted
    even or a gain: it runs three batches before its measurements outweigh the doubt, then is
    probed ever more rarely (a probe or two in the next 30 batches, none after batch 64)."""
    rng = np.random.default_rng(3)
    v = BatchVerdict()
    arms = []
    for _ in range(200):
        arm = v.choose(1, predicted)
        arms.append(arm)
        hardness = rng.uniform(0.8, 1.25)
        spec = 0.85 * rng.uniform(0.9, 1.1)
        v.record(1, arm, 10.0 * hardness * (spec if arm else 1.0), 10.0 * hardness)
    assert arms[:3] == [True] * 3 and 4 <= sum(arms[:32]) <= 5 and sum(arms[64:]) <= 1


def test_without_a_prior_the_measurements_alone_decide():
    """No prior (None): speculation runs first; measured at 0.8x the plain rate estimated on
    it, it runs once more (one batch is too few to tell, OPTIMISM), then plain decoding takes
    over, and speculation, 0.8x behind, is probed 2^4 batches later, then, having lost, 2^8
    after that."""
    v = BatchVerdict()
    arms = []
    for _ in range(300):
        arm = v.choose(1, None)
        arms.append(arm)
        v.record(1, arm, 8.0 if arm else 10.0, 10.0)
    assert arms[:3] == [True, True, False] and [i for i, a in enumerate(arms) if a] == [0, 1, 18, 275]


@pytest.mark.parametrize("predicted, measured", [(0.98, 1.01), (1.05, 0.95)])
def test_the_benefit_of_the_doubt_goes_only_where_the_prior_chose_speculation(predicted, measured):
    """Speculation's batches measure within the doubt of even (one batch spreads by 15%).
    Where the prior chose speculation (1.05x; its batches measure 0.95x), the doubt keeps it
    running for the first batches: one unlucky batch must not overturn a prediction of a gain.
    Where the prior chose plain decoding (0.98x; the probe measures 1.01x, inside the margin),
    the probe must win on its measurements, pooled with the prior: it does not, and plain
    decoding runs on until the next probe (on the H200 projection at concurrency 8, T = 0, the
    prior predicts 0.987x where speculation gains nothing; a probe given the doubt ran more
    speculative batches, 0.973x plain in the worst of 50 orders)."""
    v = BatchVerdict()
    arms = []
    for _ in range(16):
        arm = v.choose(1, predicted)
        arms.append(arm)
        v.record(1, arm, 10.0 * measured if arm else 10.0, 10.0)
    if predicted > 1:
        assert arms[:3] == [True] * 3
    else:
        assert arms.index(True) == 8 and not any(arms[9:])


def test_the_prior_counts_as_it_stood_before_the_first_batch():
    """Predicted 1.04x at batch 4; the first speculative batch draws 0.82x, every later one
    1.04x. The prior learns from that batch's verify outcomes and next predicts 0.92x: pooled
    with the measurement, that word would count the bad batch twice (plain for the next four
    batches; on the H200 projection at concurrency 4, T = 0, it put the worst of a draw of 50
    orders at 0.956x the best fixed K). Pooled with the prediction made before the batch,
    speculation keeps the benefit of the doubt and runs on."""
    v = BatchVerdict()
    arms = []
    for i in range(6):
        arm = v.choose(4, 1.04 if i == 0 else 0.92, requests=4)
        arms.append(arm)
        v.record(4, arm, (8.2 if i == 0 else 10.4) if arm else 10.0, 10.0)
    assert all(arms)


def test_a_rerun_does_not_reset_the_probes_wait():
    """Predicted 0.987x at batch 8: plain runs and speculation is first probed after 2^3
    batches. The probe draws 1.04x, ahead on its own but not against the prior, so it runs again
    after one batch (outvoted), and that rerun loses (0.82x). The next probe waits longer than
    the first did (2^(3 + 2)); counted from the rerun's wait of none, it came four batches later
    and drew another 0.82x (0.975x plain in the worst of a draw of 50 orders on the H200
    projection)."""
    v = BatchVerdict()
    spec = iter([10.4] + [8.2] * 10)
    arms = []
    for _ in range(60):
        arm = v.choose(8, 0.987, requests=8)
        arms.append(arm)
        v.record(8, arm, next(spec) if arm else 10.0, 10.0)
    assert [i for i, a in enumerate(arms) if a] == [8, 10, 43]


def test_a_won_probe_that_falls_behind_waits_before_the_next():
    """Predicted 0.987x at batch 8: speculation's probe draws 1.14x and takes over, then its
    batches draw 1.01x and 0.82x and it falls behind. Its next probe comes after 2^2 batches,
    not the next one (which drew the same 0.82x spread again, 0.980x plain in the worst of a
    draw of 50 orders on the H200 projection), and having lost, after longer than the first
    probe waited."""
    v = BatchVerdict()
    spec = iter([11.4, 10.1, 8.2] + [9.0] * 10)
    arms = []
    for _ in range(60):
        arm = v.choose(8, 0.987, requests=8)
        arms.append(arm)
        v.record(8, arm, next(spec) if arm else 10.0, 10.0)
    assert [i for i, a in enumerate(arms) if a] == [8, 10, 11, 16, 49]
