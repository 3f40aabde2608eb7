"""The margin logistic baseline (scheduling/margin.py): it learns online from a neutral prior on
synthetic blocks whose survival depends monotonically on the margin (and planted bugs in its
update do not), it is scored predict-then-observe, it rejects bad inputs, and the loop's
records carry the drafters' top-2 margins it reads."""

import math

import pytest
import torch
from flashspark.scheduling import margin as margin_mod
from flashspark.scheduling.calibration import calibration_report, online_confidences
from flashspark.scheduling.margin import MARGIN_CAP, PRIOR_SLOPE, MarginLogistic

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, BATCH, STEPS = 7, 16, 200
EARLY, LATE = 5, 100  # steps scored before learning / after it


def synthetic_steps(steps=STEPS, batch=BATCH, width=WIDTH, seed=0):
    """Margins, true c_k and outcomes of fully verified blocks, `batch` requests per step. Later
    positions have larger margins but no better odds, so ranking across positions needs the
    per-position fit, not the prior's slope alone."""
    g = torch.Generator().manual_seed(seed)
    n = steps * batch
    k = torch.arange(width)
    m = torch.rand(n, width, generator=g) * 4 + 1.5 * k
    c = torch.sigmoid(2.0 * (m - 1.5 * k) - 3.0)
    survive = torch.rand(n, width, generator=g) < c
    acc = torch.where(survive.all(1), torch.full((n,), width), (~survive).long().argmax(1))
    return m, c, acc, torch.full((n,), width), torch.arange(steps).repeat_interleave(batch)


def learning_curve():
    """(early, late, frozen-prior-late, oracle-late) calibration reports of the online model."""
    m, c, acc, ver, step = synthetic_steps()
    conf = online_confidences(MarginLogistic(WIDTH), m, acc, ver, step)
    early, late = slice(0, EARLY * BATCH), slice(LATE * BATCH, None)
    return (
        calibration_report(conf[early], acc[early], ver[early]),
        calibration_report(conf[late], acc[late], ver[late]),
        calibration_report(MarginLogistic(WIDTH)(m[late]), acc[late], ver[late]),
        calibration_report(c[late], acc[late], ver[late]),
    )


def learns(curve) -> bool:
    early, late, frozen, oracle = curve
    return (
        late["auc"] > 0.8
        and late["auc"] > frozen["auc"] + 0.1
        and late["auc"] > oracle["auc"] - 0.02
        and late["ece_cumulative"] < 0.03
        and late["ece_cumulative"] < early["ece_cumulative"] / 3
    )


def test_learns_online_from_the_prior():
    early, late, frozen, oracle = curve = learning_curve()
    assert learns(curve), (early, late, frozen, oracle)
    assert frozen["ece_cumulative"] > 0.2  # the prior alone is far off: what it learned is the fit


def _flip_update(monkeypatch):
    real = margin_mod.solve_2x2
    monkeypatch.setattr(margin_mod, "solve_2x2", lambda a, b: -real(a, b))  # ascend instead of descend


def _flip_labels(monkeypatch):
    real = margin_mod._bernoulli_terms
    monkeypatch.setattr(margin_mod, "_bernoulli_terms", lambda x, y, seen, theta: real(x, 1 - y, seen, theta))


def _teach_past_rejection(monkeypatch):
    # Teach positions past the first rejection too, as rejections: not "accepted given the prefix".
    real = margin_mod.outcomes

    def outcomes(num_accepted, num_verified, width):
        ok, prefix_seen, _ = real(num_accepted, num_verified, width)
        return ok, prefix_seen, prefix_seen

    monkeypatch.setattr(margin_mod, "outcomes", outcomes)


@pytest.mark.parametrize("plant", [_flip_update, _flip_labels, _teach_past_rejection])
def test_planted_bugs_fail_the_learning_check(monkeypatch, plant):
    plant(monkeypatch)
    assert not learns(learning_curve())


def test_prior_is_neutral_and_monotone():
    model = MarginLogistic(WIDTH)
    m = torch.tensor([[0.0] * WIDTH, [1.0] * WIDTH, [4.0] * WIDTH])
    c = model(m)
    assert torch.allclose(c[0], torch.full((WIDTH,), 0.5))
    assert bool((c[1] > c[0]).all() and (c[2] > c[1]).all())
    assert math.isclose(float(c[1, 0]), 1 / (1 + math.exp(-PRIOR_SLOPE)), rel_tol=1e-6)


def test_predictions_never_see_their_own_outcome():
    m, _, acc, ver, step = synthetic_steps(steps=12, batch=3)
    conf = online_confidences(MarginLogistic(WIDTH), m, acc, ver, step)
    for s in (0, 5, 11):  # replay by hand: observe steps < s, then predict step s
        model = MarginLogistic(WIDTH)
        for t in range(s):
            rows = step == t
            model.observe(m[rows], acc[rows], ver[rows])
        assert torch.equal(conf[step == s], model(m[step == s]))


def test_online_confidences_needs_time_order():
    m, _, acc, ver, step = synthetic_steps(steps=4, batch=2)
    with pytest.raises(ValueError, match="time order"):
        online_confidences(MarginLogistic(WIDTH), m, acc, ver, step.flip(0))
    with pytest.raises(ValueError, match="one step id per record"):
        online_confidences(MarginLogistic(WIDTH), m, acc, ver, step[:-1])


def test_unseen_outcomes_teach_nothing():
    # Positions past the verified count, or past the first rejection, carry no outcome: changing
    # their margins must not move the fit; positions past the block's K' are not touched at all.
    m, _, acc, _, _ = synthetic_steps(steps=1, batch=64)
    ver = torch.full((64,), 3)
    a, b = MarginLogistic(WIDTH), MarginLogistic(WIDTH)
    a.observe(m, acc, ver)
    m2 = m.clone()
    m2[:, 3:] = torch.rand(64, WIDTH - 3) * 9
    cols = torch.arange(WIDTH)[None]
    m2[cols > acc[:, None]] = 0.0
    b.observe(m2, acc, ver)
    assert torch.allclose(a.theta, b.theta) and torch.allclose(a.precision, b.precision)
    short = MarginLogistic(WIDTH)
    short.observe(m[:, :4], acc.clamp(max=4), torch.full((64,), 4))
    assert torch.equal(short.theta[4:], MarginLogistic(WIDTH).theta[4:])
    assert not torch.equal(short.theta[:4], MarginLogistic(WIDTH).theta[:4])


def test_infinite_margins_read_as_the_cap():
    model = MarginLogistic(2)
    inf = torch.tensor([[float("inf"), 1.0]])
    assert torch.equal(model(inf), model(torch.tensor([[MARGIN_CAP, 1.0]])))
    model.observe(inf.repeat(8, 1), torch.full((8,), 2), torch.full((8,), 2))
    assert bool(torch.isfinite(model.theta).all()) and float(model(inf)[0, 0]) > 0.99


@pytest.mark.parametrize(
    "margin, match",
    [
        (torch.rand(4), "float \\[B, K\\]"),
        (torch.rand(2, 3, 1), "float \\[B, K\\]"),
        (torch.ones(2, 3, dtype=torch.long), "float \\[B, K\\]"),
        (torch.rand(2, 0), "0 draft positions"),
        (torch.rand(2, WIDTH + 1), f"{WIDTH + 1} draft positions; this model has 1..{WIDTH}"),
        (torch.tensor([[0.5, float("nan")]]), "NaN"),
        (torch.tensor([[0.5, -0.1]]), "negative"),
    ],
)
def test_bad_margins(margin, match):
    model = MarginLogistic(WIDTH)
    with pytest.raises(ValueError, match=match):
        model(margin)
    with pytest.raises(ValueError, match=match):
        model.observe(margin, torch.zeros(margin.shape[0]), torch.zeros(margin.shape[0]))


def test_bad_outcomes_and_settings():
    model = MarginLogistic(WIDTH)
    with pytest.raises(ValueError, match="outcomes must be \\[3\\]"):
        model.observe(torch.rand(3, 2), torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="outcomes must be \\[3\\]"):
        model.observe(torch.rand(3, 2), torch.zeros(3), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="width"):
        MarginLogistic(0)
    with pytest.raises(ValueError, match="forget"):
        MarginLogistic(WIDTH, forget=0.0)


def test_records_carry_the_drafters_margins():
    """The loop records both drafters' top-2 margins beside the existing fields: DFlash 2's is the
    backbone's unary gap, DSpark's the Markov logits' gap along the drafted (greedy) chain."""
    from flashspark.decoding import speculative_generate
    from flashspark.decoding.loop import prefill
    from flashspark.methods import load_method_drafter
    from flashspark.models import catalog
    from flashspark.models.dflash2 import path_signals
    from flashspark.models.drafter import top2_margin

    unary = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    s = path_signals(torch.zeros(1, 1, 3), unary)
    assert math.isclose(float(s.unary_margin), math.log(0.5 / 0.3), rel_tol=1e-6) and s.features().shape[-1] == 4

    target = catalog.load_target(catalog.resolve_target(None))
    prompts = [list(range(5, 25)), list(range(40, 52))]
    for name in ("dflash2", "dspark"):
        d = load_method_drafter(name, target)
        _, st = speculative_generate(target, d, prompts, max_new_tokens=10, record=True)
        rec = st["records"]
        assert rec["top2_margin"].shape == (st["steps"], d.num_drafts)
        assert bool((rec["top2_margin"] >= 0).all())
        assert rec["step"].shape == (st["steps"],) and bool((rec["step"].diff() >= 0).all())
        assert (rec["signals"] is None) == (name == "dspark") and (rec["confidence"] is None) == (name == "dflash2")
    # DSpark's margin is that of the logits its greedy chain drew from.
    zeros = torch.zeros(2, dtype=torch.int64)
    with torch.no_grad():
        _, dcache, lens, anchor = prefill(target, d, prompts, 2 * d.block_size, torch.zeros(2), zeros)
        blk = d.propose(dcache, anchor, lens, torch.zeros(2), zeros, zeros, "auto", True)
        want = top2_margin(d.draft_logits(dcache, anchor, lens))
        assert d.propose(dcache, anchor, lens, torch.zeros(2), zeros, zeros, "auto", False).top2_margin is None
    torch.testing.assert_close(blk.top2_margin, want, atol=1e-4, rtol=1e-4)
