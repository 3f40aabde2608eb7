"""Acceptance traces and their replay (scheduling/replay.py).

A trace recorded from a real run of the loop, replayed with the recorded policy (fixed K =
every draft), is that run: the same request-steps, accepted drafts, τ and batch forwards,
under any cost model. A planted miscount in the replay's outcome rule (the bonus token
counted as an accepted draft) is caught by the same comparison. Smaller K and plain decoding
replay as they must (fewer accepted drafts per step, one token per step); a trace saves and
loads unchanged; the confidence scheduler replays on a trace's sources.
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flashspark.methods import make_decoder
from flashspark.scheduling import replay as replay_mod
from flashspark.scheduling.confidence import ConfidenceScheduler
from flashspark.scheduling.costs import H200, ForwardShape, model_sps
from flashspark.scheduling.replay import FixedPolicy, SchedulerPolicy, StepCosts, Trace, replay

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import record_traces  # noqa: E402  (bench/ is not a package)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Tiny-target traces of DFlash 2 and DSpark at T = 0 and 1, and the real runs' stats."""
    out = tmp_path_factory.mktemp("traces")
    argv = ["--drafters", "dflash2", "dspark", "--prompts", "3", "--max-new-tokens", "24", "--threads", "1"]
    assert record_traces.main(argv + ["--out-dir", str(out), "--batch-size", "4"]) == 0
    return out


def costs_for(trace: Trace) -> StepCosts:
    from flashspark import data
    from flashspark.models import load_model

    cfg = load_model(data.ASSETS_DIR / "target").config
    return StepCosts(
        ForwardShape.of_decoder(cfg), ForwardShape.of_decoder(cfg, layers=1), H200, trace.meta["block_size"], 128
    )


def real_run(trace: Trace, batch_size: int):
    """The loop's own totals for the trace's prompts, decoded again the same way."""
    from flashspark import data
    from flashspark.models import load_model

    target = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
    decode = make_decoder(trace.meta["drafter"], target)
    prompts = trace.prompts()
    steps = accepted = iterations = 0
    for i in range(0, len(prompts), batch_size):
        _, st = decode(prompts[i : i + batch_size], trace.meta["max_new_tokens"], trace.meta["temperature"], i)
        steps, accepted, iterations = (
            steps + st["steps"],
            accepted + st["drafts_verified"] - st["drafts_wasted"],
            iterations + st["iterations"],
        )
    return steps, accepted, iterations


@pytest.mark.parametrize("name", ["tiny_dflash2_t0.npz", "tiny_dspark_t1.npz"])
def test_replaying_the_recorded_policy_is_the_recorded_run(recorded, name, monkeypatch):
    trace = Trace.load(recorded / name)
    assert set(trace.sources) >= {"margin"} and trace.tokens.shape[1] == trace.width
    K = trace.meta["drafts_per_block"]
    got = replay(trace, FixedPolicy(K), 4, costs_for(trace))
    steps, accepted, iterations = real_run(trace, 4)
    assert (got.steps, got.accepted, got.iterations) == (steps, accepted, iterations)
    assert got.tokens == int(trace.new_tokens.sum()) and got.seconds > 0
    # A planted miscount: the bonus token counted as an accepted draft. The same check catches it.
    monkeypatch.setattr(replay_mod, "outcome", lambda k, acc: np.minimum(k, acc + 1))
    bad = replay(trace, FixedPolicy(K), 4, costs_for(trace))
    assert (bad.steps, bad.accepted, bad.iterations) != (steps, accepted, iterations)


def test_smaller_k_plain_and_orders(recorded):
    trace = Trace.load(recorded / "tiny_dflash2_t0.npz")
    costs = costs_for(trace)
    full = replay(trace, FixedPolicy(trace.width), 1, costs)
    short = replay(trace, FixedPolicy(2), 1, costs)
    plain = replay(trace, FixedPolicy(0), 1, costs)
    assert plain.tau == 1.0 and plain.steps == plain.tokens - trace.requests and plain.accepted == 0
    assert 1.0 < short.tau <= full.tau and short.steps >= full.steps
    # Memory-bound H200 at batch 1: speculation pays.
    assert full.tokens_per_s > plain.tokens_per_s
    shuffled = replay(
        trace, FixedPolicy(trace.width), 2, costs, order=np.random.default_rng(0).permutation(trace.requests)
    )
    assert shuffled.tokens == full.tokens and shuffled.accepted == full.accepted  # fixed K: order moves batches only


def test_save_load_round_trip(recorded, tmp_path):
    trace = Trace.load(recorded / "tiny_dflash2_t1.npz")
    trace.save(tmp_path / "again.npz")
    again = Trace.load(tmp_path / "again.npz")
    assert again.meta == trace.meta and np.array_equal(again.accepted, trace.accepted)
    assert np.allclose(again.sources["proxy"], trace.sources["proxy"]) and again.signals.shape[-1] == 4


def test_confidence_scheduler_replays_on_a_source(recorded):
    trace = Trace.load(recorded / "tiny_dspark_t0.npz")
    costs = costs_for(trace)
    K = trace.width

    def make(batch_size):
        sps = model_sps(costs.target, H200, batch_size, [batch_size * w for w in range(1, K + 2)], 128)
        return ConfidenceScheduler(K, sps)

    policy = SchedulerPolicy("dspark head", make, lambda rows, tr: tr.sources["dspark_head"][rows])
    got = replay(trace, policy, 2, costs)
    assert got.tokens == int(trace.new_tokens.sum()) and 1.0 <= got.tau <= replay(trace, FixedPolicy(K), 2, costs).tau


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("k", [0, 2, 7])
def test_fixed_k_in_closed_form_is_the_step_loop(recorded, k, padded):
    """`replay` of a fixed K skips the step loop (a request's steps do not depend on the
    others'); every count and the seconds equal the loop's, for any batch size and order, a
    stream that decodes requests again included (replay.stream), and with each step priced at
    its batch's longest context (`padded`, under rests that depend on the context)."""
    trace = Trace.load(recorded / "tiny_dflash2_t0.npz")
    costs = costs_for(trace)
    if padded:
        rests = {"step_overhead": ((1, 10, 8, 0.01), (1, 200, 8, 0.03), (4, 10, 2, 0.0), (4, 200, 2, 0.05)),
                 "plain_overhead": ((1, 10, 0.0), (8, 200, 0.02)), "padded": True}  # fmt: skip
        costs = dataclasses.replace(costs, **rests)
        assert (
            replay(trace, FixedPolicy(k), 3, costs).seconds
            != replay(trace, FixedPolicy(k), 3, dataclasses.replace(costs, padded=False)).seconds
        )
    rng = np.random.default_rng(k)
    stream = replay_mod.stream(rng, trace.requests, 2 * trace.requests + 5)
    assert len(stream) == 2 * trace.requests + 5 and sorted(stream[: trace.requests]) == list(range(trace.requests))
    for c, order in ((1, rng.permutation(trace.requests)), (3, stream), (8, stream)):
        fast = replay(trace, FixedPolicy(k), c, costs, order)
        loop = replay(trace, FixedPolicy(k), c, costs, order, fast=False)
        counts = ("tokens", "steps", "accepted", "iterations", "plain_steps", "verified")
        assert [getattr(fast, f) for f in counts] == [getattr(loop, f) for f in counts]
        assert fast.seconds == pytest.approx(loop.seconds, rel=1e-12)


def test_rests_interpolate_over_batch_width_and_context():
    """A measured rest is read linearly between the measured batch sizes, widths and contexts,
    and flat past their ends; (batch, seconds) pairs are measured at one context and width."""
    rest = replay_mod._rest
    assert rest((), 3, 100) == 0.0
    assert rest(((1, 1.0), (4, 4.0)), 2, 999, 5) == pytest.approx(2.0)
    grid = ((1, 100, 4, 1.0), (3, 100, 4, 3.0), (1, 100, 8, 5.0), (3, 100, 8, 7.0),
            (1, 300, 4, 11.0), (3, 300, 4, 13.0), (1, 300, 8, 15.0), (3, 300, 8, 17.0))  # fmt: skip
    assert rest(grid, 2, 100, 4) == pytest.approx(2.0)
    assert rest(grid, 2, 100, 6) == pytest.approx(4.0)  # halfway between widths 4 and 8
    assert rest(grid, 2, 200, 6) == pytest.approx(9.0)  # and between the contexts
    assert rest(grid, 2, 50, 2) == pytest.approx(2.0) and rest(grid, 9, 900, 12) == pytest.approx(17.0)  # flat
    plain = ((1, 100, 1.0), (1, 300, 3.0))
    assert rest(plain, 1, 200) == pytest.approx(2.0)


def test_a_padded_batch_is_priced_at_its_longest_context(recorded):
    """The loop pads a batch's K/V to its longest request, so a step of a padded `StepCosts`
    costs what a step at the longest request's context does; unpadded, every step is priced at
    the fixed context. The prefill scales by the measured ratio."""
    trace = Trace.load(recorded / "tiny_dflash2_t0.npz")
    base = costs_for(trace)
    costs = dataclasses.replace(base, plain_overhead=((1, 0, 0.0), (1, 1000, 1.0)), padded=True)
    assert costs.step_context(np.array([10, 400, 30])) == 400 and base.step_context(np.array([10, 400])) == 128
    assert costs.plain(1, 500) - base.plain(1, 500) == pytest.approx(0.5)
    one = np.array([0])
    got = replay(trace, FixedPolicy(0), 1, costs, one).seconds - replay(trace, FixedPolicy(0), 1, base, one).seconds
    p, n = int(trace.prompt_len[0]), int(trace.new_tokens[0])
    assert got == pytest.approx(sum(p + i for i in range(1, n)) / 1000)  # step i at p + i committed tokens
    scaled = dataclasses.replace(base, prefill_scale=((1, 2.0), (8, 4.0)))
    assert scaled.prefill(1, 50) == pytest.approx(2 * base.prefill(1, 50))
    assert scaled.prefill(8, 50) == pytest.approx(4 * base.prefill(8, 50))
