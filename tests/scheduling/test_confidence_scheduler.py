"""DSpark confidence scheduler: hand-computed cases, optimality against brute
force over every prefix-closed admission, ties and the prefix property,
monotone behaviour, flat and steep SPS tables, finished requests, the
two-step-old confidences, and the SPS profiler with its cache."""

import itertools
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flashspark.models import DecoderConfig, DecoderForCausalLM
from flashspark.scheduling import Scheduler
from flashspark.scheduling.calibration import prefix_survival
from flashspark.scheduling.confidence import ConfidenceScheduler, conditional, schedule_tokens
from flashspark.scheduling.costs import SPSTable, profile_sps

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> DecoderConfig:
    """A few-thousand-parameter fp32 target config (`kw` overrides)."""
    return DecoderConfig(
        **{
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "max_position_embeddings": 128,
            "torch_dtype": "float32",
        }
        | kw
    )


def theta(conf, active, k, sps):
    """Θ = τ · SPS(T) of an admission k [B] (k_r leading positions of request r)."""
    a = prefix_survival(conf)
    n = int(active.sum())
    tau = n + sum(float(a[r, : k[r]].sum()) for r in range(len(k)) if active[r])
    return tau * float(sps(torch.tensor(n + sum(int(x) for x in k))))


def test_hand_computed():
    conf = torch.tensor([[0.9, 0.5], [0.6, 0.9]])  # a = [[0.9, 0.45], [0.6, 0.54]]
    active = torch.tensor([True, True])
    # T:   2     3     4    5     6
    # Θ:  20  27.55  31.5  34.34  22.45 (admit 0.9, 0.6, 0.54, then 0.45 lowers Θ)
    sps = SPSTable([2, 3, 4, 5, 6], [10.0, 9.5, 9.0, 8.5, 5.0])
    assert schedule_tokens(conf, active, sps).tolist() == [1, 2]
    # A steeper step at T = 5 stops after two slots.
    sps2 = SPSTable([2, 3, 4, 5, 6], [10.0, 9.5, 9.0, 6.0, 5.0])
    assert schedule_tokens(conf, active, sps2).tolist() == [1, 1]
    # Interpolation between measured points and constant beyond the ends.
    t = SPSTable([4, 8], [10.0, 6.0])
    assert t(torch.tensor([2, 4, 6, 8, 20])).tolist() == [10.0, 10.0, 8.0, 6.0, 6.0]


@pytest.mark.parametrize("seed", range(6))
def test_optimal_over_all_prefix_closed_admissions(seed):
    """Sorting by a and taking the best prefix (`admit="best"`, the plan from stale or mean
    confidences) maximizes Θ over every admission that respects the prefix constraint (brute
    force), and k never exceeds K; the early stop (the lossless default) reaches the same Θ
    whenever Θ is unimodal along the sorted order, and never more."""
    g = torch.Generator().manual_seed(seed)
    B, K = 3, 3
    conf = torch.rand(B, K, generator=g) ** 0.5
    active = torch.tensor([True, True, seed % 2 == 0])
    tokens = list(range(1, B * (K + 1) + 1))
    sps = SPSTable(
        tokens,
        (
            100.0 / torch.tensor(tokens, dtype=torch.float64) ** torch.rand(1, generator=g).item()
            + torch.rand(len(tokens), generator=g).double()
        ).tolist(),
    )
    k = schedule_tokens(conf, active, sps, admit="best")
    assert k.dtype == torch.int64 and bool(((k >= 0) & (k <= K)).all()) and (active[2] or k[2] == 0)
    best = max(
        theta(conf, active, ks, sps)
        for ks in itertools.product(range(K + 1), repeat=B)
        if all(active[r] or ks[r] == 0 for r in range(B))
    )
    assert theta(conf, active, k.tolist(), sps) >= best - 1e-9
    stop, th = schedule_tokens(conf, active, sps, return_theta=True)
    assert th <= best + 1e-9 and abs(th - theta(conf, active, stop.tolist(), sps)) < 1e-9
    smooth = SPSTable(tokens, (100.0 / torch.tensor(tokens, dtype=torch.float64)).tolist())  # Θ unimodal
    assert (
        schedule_tokens(conf, active, smooth).tolist() == schedule_tokens(conf, active, smooth, admit="best").tolist()
    )


def test_ties_respect_the_prefix_constraint():
    # All a equal: ties go by position, so three slots are j=1 of both requests, then j=2 of request 0.
    conf = torch.ones(2, 4)
    sps = SPSTable([2, 5, 6], [10.0, 10.0, 1.0])  # flat up to T = 5, then a cliff
    assert schedule_tokens(conf, torch.tensor([True, True]), sps).tolist() == [2, 1]
    # A zero confidence ends the request's prefix even when later c are high.
    conf = torch.tensor([[0.9, 0.0, 0.99, 0.99], [0.5, 0.5, 0.5, 0.5]])
    k = schedule_tokens(conf, torch.tensor([True, True]), SPSTable([1, 100], [5.0, 5.0]))
    assert k.tolist() == [1, 4]


def test_flat_sps_verifies_everything_with_positive_confidence():
    conf = torch.tensor([[0.2, 0.1, 0.05, 0.0], [1e-3, 0.9, 0.9, 0.9], [0.0, 1.0, 1.0, 1.0]])
    k = schedule_tokens(conf, torch.ones(3, dtype=torch.bool), SPSTable([1], [7.0]))
    assert k.tolist() == [3, 4, 0]
    assert schedule_tokens(conf, torch.ones(3, dtype=torch.bool), SPSTable([1], [7.0]), max_spec_len=2).tolist() == [
        2,
        2,
        0,
    ]


def test_steep_sps_verifies_little():
    conf = torch.full((4, 7), 0.8)
    tokens = list(range(4, 33))
    steep = SPSTable(tokens, [1.0 / t**2 for t in tokens])  # Θ <= 1/T: nothing pays off
    assert schedule_tokens(conf, torch.ones(4, dtype=torch.bool), steep).tolist() == [0, 0, 0, 0]
    mild = SPSTable(tokens, [1.0 / t**0.5 for t in tokens])
    flat = SPSTable(tokens, [1.0] * len(tokens))
    n_mild = int(schedule_tokens(conf, torch.ones(4, dtype=torch.bool), mild).sum())
    n_flat = int(schedule_tokens(conf, torch.ones(4, dtype=torch.bool), flat).sum())
    assert 0 < n_mild < n_flat == 28


def test_higher_confidence_verifies_more():
    tokens = list(range(8, 65))
    sps = SPSTable(tokens, [1.0 / (1 + 0.04 * t) for t in tokens])  # fixed cost + per-token cost
    totals = []
    for c in (0.1, 0.3, 0.5, 0.7, 0.9, 0.97):
        k = schedule_tokens(torch.full((8, 7), c), torch.ones(8, dtype=torch.bool), sps)
        totals.append(int(k.sum()))
    assert totals == sorted(totals) and totals[0] < totals[-1]
    # One request more confident than the others gets at least as many tokens.
    conf = torch.full((8, 7), 0.6)
    conf[3] = 0.95
    k = schedule_tokens(conf, torch.ones(8, dtype=torch.bool), sps)
    assert int(k[3]) == int(k.max()) and int(k[3]) > int(k[0])


def test_finished_requests_get_zero_and_cost_nothing():
    conf = torch.full((3, 4), 0.9)
    sps = SPSTable([1, 2, 3, 4, 5, 6], [10.0, 10.0, 10.0, 10.0, 1.0, 1.0])
    # Only request 1 is active: T = 1 + its slots; three slots fit before the cliff at T = 5.
    k = schedule_tokens(conf, torch.tensor([False, True, False]), sps)
    assert k.tolist() == [0, 3, 0]
    assert schedule_tokens(conf, torch.zeros(3, dtype=torch.bool), sps).tolist() == [0, 0, 0]


def test_scheduler_interface_and_delay():
    sps = SPSTable([1], [1.0])
    sched = ConfidenceScheduler(3, sps, delay=2)
    steps = [
        torch.tensor([[0.9, 0.9, 0.9, 0.9]]),
        torch.tensor([[0.9, 0.0, 0.9, 0.9]]),
        torch.tensor([[0.0, 0.9, 0.9, 0.9]]),
        torch.tensor([[0.9, 0.9, 0.0, 0.0]]),
    ]
    active = torch.tensor([True])
    got = [int(sched(SimpleNamespace(active=active, confidence=c))[0]) for c in steps]
    assert got == [3, 3, 3, 1]  # step n uses step n-2's confidences (the oldest it has at first)
    now = ConfidenceScheduler(3, sps)
    assert [int(now.schedule(c, active)[0]) for c in steps] == [3, 1, 0, 2]
    with pytest.raises(ValueError, match="confidence"):
        now(SimpleNamespace(active=active))


def test_profile_sps_and_cache(tmp_path):
    cfg = tiny_config(num_hidden_layers=2, max_position_embeddings=128)
    target = DecoderForCausalLM(cfg)
    target.init_weights(0)
    path = tmp_path / "sps.json"
    table = profile_sps(
        target, batch_size=2, token_counts=[2, 4, 8], context_len=16, repeats=2, warmup=1, cache_file=path
    )
    assert table.tokens.tolist() == [2, 4, 8] and bool((table.sps > 0).all())
    saved = json.loads(path.read_text())
    assert saved["tokens"] == [2, 4, 8]
    # A second call reads the cache (doctor it to tell the two apart).
    saved["sps"] = [3.0, 2.0, 1.0]
    path.write_text(json.dumps(saved))
    assert profile_sps(
        target, batch_size=2, token_counts=[2, 4, 8], context_len=16, cache_file=path, repeats=2, warmup=1
    ).sps.tolist() == [3.0, 2.0, 1.0]
    # A wider forward timed faster is returned as measured (the loop may pad to it: `padded`).
    saved["sps"] = [1 / 40.0, 1 / 30.0, 1 / 50.0]
    path.write_text(json.dumps(saved))
    table = profile_sps(target, batch_size=2, token_counts=[2, 4, 8], context_len=16, cache_file=path)
    assert (1 / table.sps).tolist() == pytest.approx([40.0, 30.0, 50.0])
    with pytest.raises(ValueError, match=">= 2"):
        profile_sps(target, batch_size=2, token_counts=[1, 4], cache_file=tmp_path / "x.json")


def test_profile_sps_rounds_drop_a_slow_spell(tmp_path, monkeypatch):
    """A slow spell three sweeps of the grid long, starting mid-sweep, leaves the table exactly
    as a quiet machine measures it: the rounds leave every T samples outside the spell, and
    the fastest is kept (the median of 5 would keep the spell's). Timed one T after another,
    as the estimator once did, the spell would take every sample of a run of T. A table
    cached under another estimator is measured again."""
    from flashspark.scheduling import costs

    cfg = tiny_config(num_hidden_layers=1, max_position_embeddings=128)
    target = DecoderForCausalLM(cfg)
    target.init_weights(0)
    grid = [2, 4, 6, 8, 10, 12]
    calls = []

    def fake_seconds(target, tokens, cache, lens, num_new, *args, **kwargs):
        calls.append(int(num_new.sum()))
        slow = 4 <= len(calls) < 4 + 3 * len(grid)  # three sweeps' worth of calls, from mid-sweep
        return (1.0 + 0.1 * calls[-1]) * (5.0 if slow else 1.0)

    monkeypatch.setattr(costs, "forward_seconds", fake_seconds)
    path = tmp_path / "sps.json"
    table = profile_sps(target, batch_size=2, token_counts=grid, context_len=8, repeats=5, warmup=1, cache_file=path)
    assert sorted(calls) == sorted(grid * 5)
    assert calls[: len(grid)] == grid and calls[len(grid) : 2 * len(grid)] == grid[::-1]  # alternating sweeps
    assert (1 / table.sps).tolist() == pytest.approx([1.0 + 0.1 * t for t in grid])
    key = costs._fingerprint(target, 2, 8, grid, 0.0)
    assert json.loads(path.read_text())["key"] == key
    monkeypatch.setattr(costs, "SPS_ESTIMATOR", "the next estimator")
    assert costs._fingerprint(target, 2, 8, grid, 0.0) != key
    calls.clear()
    profile_sps(target, batch_size=2, token_counts=grid, context_len=8, repeats=5, warmup=1, cache_file=path)
    assert len(calls) == 5 * len(grid)  # measured again, not read


def test_padded_table_prices_the_cheapest_width_at_or_above():
    """`SPSTable.padded`: a forward of T tokens costs the cheapest measured point at or above
    T, and `runs` names it; a table whose seconds already rise is unchanged; the overhead
    keeps the points' runs; SmolLM2's fp32 batch-1 bumps (ms for 1-8 tokens) are priced at
    the widths that run faster."""

    def table(ms):
        return SPSTable(list(range(1, len(ms) + 1)), [1000 / x for x in ms])

    rising = table([10, 20, 30]).padded()
    assert (1000 / rising.sps).tolist() == pytest.approx([10, 20, 30])
    assert [rising.runs(t) for t in (1, 2, 3, 4)] == [1, 2, 3, 4]  # past the end: itself
    bumps = table([55, 88, 108, 77, 70, 75, 94, 73]).padded()
    assert (1000 / bumps.sps).tolist() == pytest.approx([55, 70, 70, 70, 70, 73, 73, 73])
    assert [bumps.runs(t) for t in range(1, 9)] == [1, 5, 5, 5, 5, 8, 8, 8]
    assert [bumps.with_overhead(0.01).runs(t) for t in range(1, 9)] == [1, 5, 5, 5, 5, 8, 8, 8]
    assert table([55, 88]).runs(2) == 2  # unpadded: every point runs its own width
    with pytest.raises(ValueError, match="at least"):
        SPSTable([1, 2], [1.0, 1.0], runs=[1, 1])


def test_verify_width_pads_to_the_table_and_the_loop_stays_exact():
    """A `ConfidenceScheduler` on a padded table widens the verify forward to the width the
    table prices (never past max_spec_len, never for a step that verifies nothing); the loop
    runs that forward, and greedy output still equals plain decoding."""
    from flashspark.decoding import speculative_generate
    from flashspark.decoding.plain import generate
    from flashspark.models.dflash import DFlashConfig, DFlashDrafter

    K = 4
    # Rows of one request: a 2- or 3-token forward costs more than a 4-token one.
    sps = SPSTable([1, 2, 3, 4, 5], [1 / 10, 1 / 30, 1 / 30, 1 / 12, 1 / 40]).padded()
    sched = ConfidenceScheduler(K, sps)
    assert [sched.verify_width(torch.tensor([k])) for k in range(K + 1)] == [0, 3, 3, 3, 4]
    wide = ConfidenceScheduler(2, sps)
    assert wide.verify_width(torch.tensor([1])) == 2  # capped at max_spec_len

    cfg = tiny_config(num_hidden_layers=2, max_position_embeddings=256)
    target = DecoderForCausalLM(cfg)
    target.init_weights(0)
    drafter = DFlashDrafter(DFlashConfig.for_target(cfg, num_hidden_layers=1, block_size=K + 1), target)
    drafter.init_weights(1)
    widths = []
    forward = target.forward

    def spy(tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return forward(tokens, *args, **kwargs)

    target.forward = spy
    conf = torch.tensor([0.9, 0.0, 0.0, 0.0])  # one draft a step: the rest add nothing to Θ
    sched = ConfidenceScheduler(K, sps, confidence_fn=lambda state: conf.expand(state.active.numel(), -1))
    prompts = [[3, 5, 7, 9, 11]]
    out, _ = speculative_generate(target, drafter, prompts, max_new_tokens=12, scheduler=sched)
    target.forward = forward
    ref, _ = generate(target, prompts, max_new_tokens=12)
    assert out == ref
    assert 4 in widths[1:]  # a step verifying one draft ran the 4-token forward the table prices


def test_dspark_with_confidence_scheduler_in_the_loop_is_lossless():
    """The loop runs a DSpark drafter (Markov chain via `propose`) with the confidence
    scheduler fed by the drafter's confidences (`ScheduleState.confidence`): greedy output
    equals plain decoding, and the scheduler verifies fewer tokens per request than a fixed
    K when confidences are low."""
    from flashspark.decoding import speculative_generate
    from flashspark.decoding.plain import generate
    from flashspark.models.dspark import DSparkConfig, DSparkDrafter

    cfg = DecoderConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=160,
        torch_dtype="float32",
    )
    target = DecoderForCausalLM(cfg)
    target.init_weights(0)
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(30)
    target.eval()
    d = DSparkDrafter(
        DSparkConfig.for_target(cfg, num_hidden_layers=1, block_size=5, mask_token_id=1, num_features=2, markov_rank=8),
        target,
    )
    d.init_weights(1)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
        d.confidence_head.proj.bias.fill_(2.0)  # confidences spread around 0.7-0.9: K varies per request and step
    d.eval()
    prompts = [[3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23]]
    want, _ = generate(target, prompts, max_new_tokens=24)
    tokens = list(range(1, 20))
    sched = ConfidenceScheduler(4, SPSTable(tokens, [1.0 / (1 + 0.1 * t) for t in tokens]))
    chosen = []

    class Recording(Scheduler):
        max_spec_len = 4

        def plan(self, state):
            k = sched(state)
            chosen.append(k[state.active])
            return k

    got, stats = speculative_generate(target, d, prompts, max_new_tokens=24, scheduler=Recording())
    assert got == want
    k = torch.cat(chosen).float()
    # The per-token cost keeps K below 4 on average, and K varies.
    assert 0.5 < float(k.mean()) < 3.5 and len(set(k.tolist())) >= 3 and stats["steps"] == len(k)


def test_conditional_confidences_reproduce_mean_survival():
    """Correlated blocks (all sure or all unsure): the product of mean c's understates the mean
    survival; `conditional` returns c's whose product is exactly the mean survival."""
    conf = torch.tensor([[1.0, 1.0], [0.2, 0.2]], dtype=torch.float64)
    mean_a = prefix_survival(conf).mean(0)  # [0.6, 0.52]
    c = conditional(mean_a)
    torch.testing.assert_close(c.cumprod(0), mean_a)
    assert float(conf.mean(0).prod()) < float(mean_a[-1]) - 0.1


# ------------------------------------------------- a padded verify forward (flashspark's loop)
def test_padded_admission_is_the_best_width_by_brute_force():
    """`padded_columns`: Θ(w) = (active + Σ_r Σ_{j≤w} a_rj) · SPS(rows · (w + 1)), every active
    request verifying w drafts; "best" is the argmax over w, "stop" the first fall."""
    g = torch.Generator().manual_seed(3)
    B, K = 6, 5
    tokens = [B * w for w in range(1, K + 2)]
    sps = SPSTable(tokens, [1.0 / (1 + 0.15 * w**1.5) for w in range(1, K + 2)])
    for _ in range(20):
        conf = torch.rand(B, K, generator=g) ** 0.5
        active = torch.rand(B, generator=g) < 0.8
        active[0] = True
        a = torch.cumprod(conf, 1)[active]
        theta = [(int(active.sum()) + float(a[:, :w].sum())) * float(sps.rate(B * (w + 1))) for w in range(K + 1)]
        k, th = schedule_tokens(conf, active, sps, admit="best", padded=True, return_theta=True)
        assert k[active].tolist() == [int(np.argmax(theta))] * int(active.sum()) and th == pytest.approx(max(theta))
        stop = schedule_tokens(conf, active, sps, padded=True)
        falls = [w for w in range(K) if theta[w + 1] <= theta[w]]
        assert int(stop.max()) == (falls[0] if falls else K)


def test_padded_admission_does_not_widen_a_batch_for_one_request():
    """32 rows, a compute-bound step cost: one confident request would, slot by slot, widen the
    whole forward (Algorithm 1 prices its draft at one token of T); the padded admission sees
    that the width costs 32 tokens and keeps the batch narrow."""
    B = 32
    tokens = list(range(1, B * 5 + 1))
    sps = SPSTable(tokens, [1.0 / (1 + t / 32) for t in tokens])  # each 32 tokens add a step's cost
    conf = torch.full((B, 4), 0.05, dtype=torch.float64)
    conf[0] = 0.99
    active = torch.ones(B, dtype=torch.bool)
    slots = schedule_tokens(conf, active, sps)
    assert int(slots[0]) == 4 and int(slots[1:].sum()) == 0  # one request, 4 drafts: a 5-wide forward
    padded = schedule_tokens(conf, active, sps, padded=True)
    assert padded.tolist() == [0] * B


def test_batch_tail_matches_a_simulated_batch():
    """The slowest of B requests, each emitting 1 + accepted tokens a step (P(accepted >= j) =
    a_j), against `batch_tail`'s renewal approximation: within 4% of a simulation."""
    from flashspark.scheduling.confidence import batch_tail, expected_max_normal

    rng = np.random.default_rng(0)
    assert expected_max_normal(1) == pytest.approx(0.0, abs=1e-6)
    assert expected_max_normal(32) == pytest.approx(np.mean(rng.standard_normal((4000, 32)).max(1)), abs=0.03)
    survival = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    mu = 1 + float(survival.sum())
    probs = -np.diff(np.concatenate([[1.0], survival.numpy(), [0.0]]))  # P(accepted = 0 .. 4)
    for batch, n in ((1, 96), (8, 96), (32, 96), (16, 256)):
        emitted = np.cumsum(1 + rng.choice(5, p=probs, size=(400, batch, n)), -1)  # [trials, batch, steps]
        slowest = ((emitted < n).sum(-1) + 1).max(1)  # steps until each request has n tokens; the batch's last
        simulated = np.mean(slowest) / (n / mu)
        assert batch_tail(survival, batch, n) == pytest.approx(simulated, rel=0.04), (batch, n)


def _requests_of_unequal_rates(rng, requests: int, steps: int, scale: np.ndarray | None = None):
    """Tokens each of `requests` requests commits per step [requests, steps]: request r accepts
    drafts with prefix survival base * scale[r] (base 0.7, 0.5, 0.3, 0.15)."""
    base = np.array([0.7, 0.5, 0.3, 0.15])
    scale = np.ones(requests) if scale is None else scale
    survival = np.clip(base[None] * scale[:, None], 0.0, 1.0)  # [requests, 4]
    u = rng.random((requests, steps, 1))
    return 1 + (u < survival[:, None, :]).sum(-1), survival  # accepted = how many a_j exceed u


def test_request_spread_measures_how_requests_differ():
    """`ConfidenceStats.request_spread` against the spread of requests' true steps per token:
    requests that differ by their drafts' survival (scaled by 0.5-1.3) and requests alike (only
    their sampling noise, which it takes out), fed step by step as the scheduler feeds them."""
    from flashspark.scheduling.confidence import ConfidenceStats

    rng = np.random.default_rng(1)
    for scale, want in ((rng.uniform(0.5, 1.3, 64), None), (np.ones(64), 0.0)):
        tokens, survival = _requests_of_unequal_rates(rng, 64, 96, scale)
        x = 1 / (1 + survival.sum(1))  # each request's expected steps per token
        want = x.std() / x.mean() if want is None else want
        stats = ConfidenceStats(4)
        for batch in np.split(np.arange(64), 8):  # 8 batches of 8 requests, each step of a batch
            active = torch.ones(8, dtype=torch.bool)
            active[-1] = False  # a finished row counts no steps
            for t in range(96):
                stats.add_request_steps(torch.as_tensor(tokens[batch, t]), active)
            stats.close_requests()
        assert stats.requests[0] == 56
        assert stats.request_spread() == pytest.approx(want, abs=0.03), want
        back = ConfidenceStats.from_dict(stats.to_dict())
        assert back.request_spread() == pytest.approx(stats.request_spread())
        assert stats.scaled(stats.rows or 1).request_spread() == pytest.approx(stats.request_spread())
    # Before any request: the prior spread.
    assert ConfidenceStats(4).request_spread() == ConfidenceStats.REQUEST_SPREAD


def test_batch_tail_with_requests_that_differ_matches_a_simulated_batch():
    """The slowest of B requests that differ in their survival (scale 0.6-1.2), against
    `batch_tail` given the requests' spread of steps per token: within 5% of a simulation; the
    renewal term alone (spread 0) misses by more."""
    from flashspark.scheduling.confidence import batch_tail

    rng = np.random.default_rng(2)
    base = torch.tensor([0.7, 0.5, 0.3, 0.15], dtype=torch.float64)
    n, trials = 96, 300
    for B in (4, 8, 16):
        slowest, rows, emitted = [], 0, 0
        population = rng.uniform(0.6, 1.2, 4000)
        _, survival = _requests_of_unequal_rates(rng, 4000, 1, population)
        x = 1 / (1 + survival.sum(1))
        spread = x.std() / x.mean()
        for _ in range(trials):
            tokens, _ = _requests_of_unequal_rates(rng, B, n, rng.choice(population, B))
            steps = (np.cumsum(tokens, -1) < n).sum(-1) + 1
            slowest.append(steps.max())
            rows += steps.sum()
            emitted += np.minimum(np.cumsum(tokens, -1), n)[np.arange(B), steps - 1].sum()
        # Over the mean request as the scheduler's rows see it (requests weigh by their steps).
        simulated = np.mean(slowest) / (n * rows / emitted)
        assert batch_tail(base, B, n, spread) == pytest.approx(simulated, rel=0.05), (B, spread)
        assert abs(batch_tail(base, B, n) - simulated) > 2 * abs(batch_tail(base, B, n, spread) - simulated)


def test_the_scheduler_measures_its_requests_for_the_next_batch():
    """Each verified step's tokens per active row reach the stats' open rows (finished rows
    count nothing); the next batch's scheduler, built on them as its prior, closes them as
    finished requests, and its predicted gain at batch 8 reads their spread."""
    from flashspark.scheduling.confidence import ConfidenceStats

    tokens = list(range(1, 40))
    sps = SPSTable(tokens, [1.0 / (1 + t / 64) for t in tokens])
    s = ConfidenceScheduler(4, sps, plain_sps=sps, min_rows=1)
    conf = torch.full((4, 4), 0.8, dtype=torch.float64)
    active = torch.tensor([True, True, True, False])
    for step in range(6):
        k = s.schedule(conf, active)
        fast = torch.tensor([4, 0, 4 if step % 2 else 0, 0])  # requests 0 and 2 accept more
        s.observe(None, torch.minimum(fast, k), k)
    assert s.stats.open[:, 0].tolist() == [6, 6, 6, 0] and s.stats.open[1, 1] == 6
    nxt = ConfidenceScheduler(4, sps, plain_sps=sps, min_rows=1, prior=s.stats)
    assert nxt.stats.requests[0] == 3 and nxt.stats.open.numel() == 0
    spread = nxt.stats.request_spread()
    assert spread > ConfidenceStats.REQUEST_SPREAD  # 1 to 5 tokens a step: they differ a lot
    mean = conditional(nxt.stats.mean_survival())
    assert nxt.predicted_gain(mean, 8, new_tokens=96) < nxt.predicted_gain(mean, 8)
