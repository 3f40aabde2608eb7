"""Tests of the calibration metrics and the DFlash 2 confidence proxy on
synthetic blocks whose true survival probabilities are known."""

import math

import pytest
import torch
from flashspark.scheduling.calibration import auc, calibration_report, expected_calibration_error, outcomes
from flashspark.scheduling.proxy import SIGNALS, ConfidenceProxy


def synthetic_blocks(n=6000, width=7, seed=0):
    """Signals, true c_k, and outcomes of blocks verified in full: token k
    survives with probability c_k given its prefix survived."""
    g = torch.Generator().manual_seed(seed)
    sel = torch.rand(n, width, generator=g) * 0.98 + 0.01
    margin = torch.rand(n, width, generator=g) * 3
    top1 = torch.rand(n, width, generator=g) * 0.98 + 0.01
    entropy = torch.rand(n, width, generator=g) * 2
    signals = torch.stack([sel, margin, top1, entropy], -1)
    logit = 1.5 * (torch.log(sel) - torch.log1p(-sel)) + 0.8 * margin - 1.0 * entropy - 0.2 * torch.arange(width)
    c_true = torch.sigmoid(logit)
    survive = torch.rand(n, width, generator=g) < c_true
    num_accepted = torch.where(survive.all(1), torch.full((n,), width), (~survive).long().argmax(1))
    return signals, c_true, num_accepted, torch.full((n,), width)


def test_outcome_masks():
    ok, prefix_seen, cond_seen = outcomes(torch.tensor([2, 0]), torch.tensor([4, 3]), 5)
    assert ok.tolist() == [[1, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert prefix_seen.tolist() == [[True] * 4 + [False], [True] * 3 + [False] * 2]
    assert cond_seen.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]


def test_ece_and_auc():
    g = torch.Generator().manual_seed(1)
    pred = torch.rand(50000, generator=g)
    label = (torch.rand(50000, generator=g) < pred).float()
    assert expected_calibration_error(pred, label) < 0.02
    assert abs(expected_calibration_error(torch.full_like(pred, 0.9), torch.full_like(pred, 0.5)) - 0.4) < 1e-6
    assert math.isclose(auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])), 1.0)
    assert math.isclose(auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])), 0.0)
    assert math.isclose(auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])), 0.5)
    assert 0.81 < auc(pred, label) < 0.86  # E[AUC] for this model is 5/6


def test_true_confidences_are_calibrated():
    signals, c_true, acc, ver = synthetic_blocks()
    rep = calibration_report(c_true, acc, ver)
    assert rep["ece_cumulative"] < 0.02
    bad = calibration_report(torch.full_like(c_true, 0.95), acc, ver)
    assert bad["ece_cumulative"] > 0.2


def test_offline_fit_recovers_calibration():
    signals, c_true, acc, ver = synthetic_blocks()
    proxy = ConfidenceProxy(width=7)
    before = calibration_report(proxy(signals), acc, ver)
    proxy.fit(signals, acc, ver)
    test_signals, test_c, test_acc, test_ver = synthetic_blocks(seed=1)
    after = calibration_report(proxy(test_signals), test_acc, test_ver)
    oracle = calibration_report(test_c, test_acc, test_ver)
    assert math.isclose(before["auc"], 0.5)  # untrained: one constant score, no ranking
    assert after["ece_cumulative"] < 0.03
    assert after["auc"] > oracle["auc"] - 0.02 and after["auc"] > 0.75


def test_online_updates_learn_without_offline_fit():
    proxy = ConfidenceProxy(width=7, capacity=4096, refit_every=4, refit_steps=25)
    signals, c_true, acc, ver = synthetic_blocks(n=4000)
    for i in range(0, 4000, 64):  # 62 verify steps of 64 requests
        proxy.observe(signals[i : i + 64], acc[i : i + 64], ver[i : i + 64])
    test_signals, _, test_acc, test_ver = synthetic_blocks(seed=2)
    rep = calibration_report(proxy(test_signals), test_acc, test_ver)
    assert rep["auc"] > 0.75 and rep["ece_cumulative"] < 0.08
    assert proxy._feats.shape[0] == 4096  # bounded memory


def test_partially_verified_blocks_only_teach_what_was_seen():
    # Positions past the verified count carry no outcome: flipping their
    # signals must not change the fit.
    signals, _, acc, _ = synthetic_blocks(n=2000)
    ver = torch.full((2000,), 3)
    acc = acc.clamp(max=3)
    a, b = ConfidenceProxy(width=7), ConfidenceProxy(width=7)
    a.fit(signals, acc, ver)
    s2 = signals.clone()
    s2[:, 4:] = torch.rand_like(s2[:, 4:])
    b.fit(s2, acc, ver)
    assert torch.allclose(a.weight, b.weight, atol=1e-4)


@pytest.mark.parametrize("rows_per_step", [7, 21, 35])
def test_online_ring_buffer_keeps_the_last_observations_in_order(rows_per_step):
    # A small ring that wraps (and, at 35 rows a step, overflows): it must hold the last
    # `capacity` observations, slot (start + i) % capacity for the i-th since `start`.
    signals, _, acc, ver = synthetic_blocks(n=40)
    proxy = ConfidenceProxy(width=7, capacity=30, refit_every=10**6)
    per = rows_per_step // 7
    feats, pos, label, mask = [], [], [], []
    for step in range(5):
        s, a, v = (
            signals[step * per : (step + 1) * per],
            acc[step * per : (step + 1) * per],
            ver[step * per : (step + 1) * per],
        )
        proxy(s)  # scored first, like the loop does: observe reuses its features
        proxy.observe(s, a, v)
        f, p_, l_, m_ = ConfidenceProxy(width=7)._observations(s, a, v)
        feats.append(f), pos.append(p_), label.append(l_), mask.append(m_)
    total = 5 * rows_per_step
    kept = min(total, 30)
    want = [torch.cat(x)[-kept:] for x in (feats, pos, label, mask)]
    slots = (torch.arange(total - kept, total)) % 30
    for buf, w in zip((proxy._feats, proxy._pos, proxy._label, proxy._mask), want):
        assert torch.equal(buf[slots], w)
    assert proxy._head == total % 30


def test_save_load_roundtrip(tmp_path):
    signals, _, acc, ver = synthetic_blocks(n=500)
    proxy = ConfidenceProxy(width=7)
    proxy.fit(signals, acc, ver)
    proxy.save(tmp_path / "proxy.json")
    again = ConfidenceProxy.load(tmp_path / "proxy.json")
    assert torch.allclose(proxy(signals), again(signals))
    with pytest.raises(FileNotFoundError):
        ConfidenceProxy.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"signals": ["x"], "width": 7, "weight": [0], "bias": [0]}')
    with pytest.raises(ValueError, match="signals"):
        ConfidenceProxy.load(tmp_path / "bad.json")
    assert len(SIGNALS) == 4
