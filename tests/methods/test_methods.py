"""DFlash 2 and DSpark drafters in the speculative loop are lossless.

Greedy: every DFlash 2 path mode and DSpark, with fixed K, a ragged scheduler
and the confidence scheduler (DSpark head or DFlash 2 proxy), equals plain
greedy decoding token for token. Sampled: DFlash 2 `sample` paths (sparse q
over the Top-K candidates), DFlash 2 `backtrack` paths (one-hot drafts) and
DSpark's Markov chain (dense q) follow the target's distribution, and planted
bugs in the q handed to verify are caught."""

import pytest
import torch
from flashspark.decoding import speculative_generate
from flashspark.decoding.plain import generate
from flashspark.models.dflash2 import DFlash2Config, DFlash2Drafter
from flashspark.models.dspark import DSparkConfig, DSparkDrafter
from flashspark.scheduling import FixedK, Scheduler
from flashspark.scheduling.confidence import ConfidenceScheduler
from flashspark.scheduling.costs import SPSTable
from flashspark.scheduling.proxy import ConfidenceProxy
from spec_helpers import (
    chi_square_ok,
    exact_joint,
    prompts_of,
    spec_joint,
    tiny_dflash2,
    tiny_drafter,
    tiny_dspark,
    tiny_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")


class RaggedK(Scheduler):
    """Request b verifies (b + step) % (K + 1) drafts."""

    def __init__(self, k):
        self.max_spec_len, self.step = k, 0

    def plan(self, state):
        self.step += 1
        return (torch.arange(len(state.active)) + self.step) % (self.max_spec_len + 1) * state.active


def linear_sps(n=40, cost=0.1):
    tokens = list(range(1, n))
    return SPSTable(tokens, [1.0 / (1 + cost * t) for t in tokens])


# ----------------------------------------------------------------- greedy
@pytest.mark.parametrize("path", ["auto", "backtrack", "greedy", "sample"])
@pytest.mark.parametrize("scheduler", ["fixed", "ragged"])
def test_dflash2_greedy_equals_plain(path, scheduler):
    target = tiny_target(seed=4)
    d = tiny_dflash2(target)
    prompts = prompts_of([3, 10, 1, 6], 48, seed=4)
    want, _ = generate(target, prompts, max_new_tokens=28)
    sched = FixedK(4) if scheduler == "fixed" else RaggedK(3)
    got, st = speculative_generate(target, d, prompts, max_new_tokens=28, path=path, scheduler=sched)
    assert got == want
    assert st["new_tokens"] == 4 * 28 and st["drafts_verified"] >= st["drafts_wasted"] >= 0


def test_dflash2_backtrack_drafts_are_the_selectors_best_path():
    """The loop really drafts with the selector: backtrack and greedy paths differ somewhere."""
    target = tiny_target(seed=4)
    d = tiny_dflash2(target)
    prompts = prompts_of([3, 10, 1, 6], 48, seed=4)
    blocks = {}
    for path in ("backtrack", "greedy"):
        cache = d.new_cache(4, 20)
        hidden = target(
            torch.tensor([p + [0] * (10 - len(p)) for p in prompts]), hidden_layers=d.config.target_layer_ids
        ).hidden
        lens = torch.tensor([len(p) for p in prompts])
        rows = [(b, t) for b in range(4) for t in range(int(lens[b]))]
        bs, ts = torch.tensor(rows).T
        d.inject(cache, hidden[bs, ts], ts, bs)
        z = torch.zeros(4)
        blk = d.propose(cache, torch.tensor([5, 6, 7, 8]), lens, z, z.long(), z.long(), path)
        assert blk.probs is None and blk.signals.shape == (4, 4, 4)
        blocks[path] = blk.tokens
    assert not torch.equal(blocks["backtrack"], blocks["greedy"])


@pytest.mark.parametrize("from_anchor", [True, False], ids=["sample_from_anchor", "dflash_slots"])
def test_dspark_greedy_equals_plain_fixed_and_ragged(from_anchor):
    target = tiny_target(seed=5)
    d = tiny_dspark(target, from_anchor=from_anchor)
    prompts = prompts_of([4, 9, 2], 48, seed=5)
    want, _ = generate(target, prompts, max_new_tokens=26)
    n = d.num_drafts
    for sched in (FixedK(n), RaggedK(n), FixedK(2)):
        got, _ = speculative_generate(target, d, prompts, max_new_tokens=26, scheduler=sched)
        assert got == want


def test_dflash2_proxy_scheduler_greedy_and_online_updates():
    """DFlash 2 + confidence proxy + the unchanged DSpark scheduler: exact, K varies, and the
    proxy learns online from the loop's outcomes (its weights move)."""
    target = tiny_target(seed=4)
    d = tiny_dflash2(target)
    prompts = prompts_of([3, 10, 1, 6, 8], 48, seed=6)
    want, _ = generate(target, prompts, max_new_tokens=30)
    proxy = ConfidenceProxy(4, refit_every=2)
    with torch.no_grad():
        proxy.bias.fill_(1.0)
    before = proxy.weight.clone()
    sched = ConfidenceScheduler(4, linear_sps(), confidence_fn=proxy.for_scheduler())
    ks = []
    real = sched.__call__

    class Recording(Scheduler):
        max_spec_len = 4
        wants_signals = sched.wants_signals

        def plan(self, state):
            k = real(state)
            ks.append(k[state.active])
            return k

        def observe(self, *a):
            sched.observe(*a)

    got, st = speculative_generate(target, d, prompts, max_new_tokens=30, scheduler=Recording(), record=True)
    assert got == want
    k = torch.cat(ks)
    assert len(set(k.tolist())) >= 2
    assert not torch.equal(proxy.weight, before)
    rec = st["records"]
    assert rec["signals"].shape == (st["steps"], 4, 4) and rec["confidence"] is None
    assert int(rec["num_verified"].sum()) == st["drafts_verified"]
    # Fixed K needs no signals: the loop skips them (and the proxy scheduler asks for them).
    assert sched.wants_signals and not getattr(FixedK(4), "wants_signals", False)
    blk = d.propose(
        d.new_cache(1, 16),
        torch.tensor([3]),
        torch.tensor([0]),
        torch.zeros(1),
        torch.zeros(1, dtype=torch.long),
        torch.zeros(1, dtype=torch.long),
        signals=False,
    )
    assert blk.signals is None and blk.cand_ids is not None


def test_record_collects_dspark_confidences():
    target = tiny_target(seed=5)
    d = tiny_dspark(target)
    _, st = speculative_generate(target, d, prompts_of([4, 9], 48, seed=7), max_new_tokens=12, record=True)
    rec = st["records"]
    assert rec["confidence"].shape == (st["steps"], d.num_drafts) == (st["steps"], 5) and rec["signals"] is None
    # Near max_new_tokens the block is shorter: its missing columns are padding, never verified.
    verified = torch.arange(d.num_drafts) < rec["num_verified"][:, None]
    c = rec["confidence"][verified]
    assert bool(((c > 0) & (c < 1)).all())
    assert bool((rec["num_accepted"] <= rec["num_verified"]).all())


def test_bad_path_mode():
    target = tiny_target(seed=4)
    with pytest.raises(ValueError, match="path must be one of"):
        speculative_generate(target, tiny_dflash2(target), [[3, 4]], max_new_tokens=4, path="beam")


def test_proxy_scheduler_needs_signals():
    target = tiny_target(seed=5)
    sched = ConfidenceScheduler(4, linear_sps(), confidence_fn=ConfidenceProxy(4).for_scheduler())
    with pytest.raises(ValueError, match="path signals"):
        speculative_generate(target, tiny_dspark(target), [[3, 4]], max_new_tokens=4, scheduler=sched)


# ----------------------------------------------------------------- sampled
V, PROMPT, N, SAMPLES = 8, [3, 5, 2], 3, 12000


def small_target():
    return tiny_target(vocab=V, layers=1, seed=5, scale=3.0)


def marginal_tv_ok(counts, p, bound=0.03):
    emp, exact = (counts / counts.sum()).view(V, V, V), p.double().view(V, V, V)
    return all(0.5 * float((emp.sum(d) - exact.sum(d)).abs().sum()) < bound for d in ((1, 2), (0, 2), (0, 1)))


@pytest.mark.parametrize("path,temperature", [("sample", 1.0), ("sample", 0.6), ("backtrack", 1.0)])
def test_dflash2_sampled_distribution_matches_target(path, temperature):
    target = small_target()
    d = tiny_dflash2(target, block_size=4, topk=4, seed=6, scale=8.0)
    p = exact_joint(target, PROMPT, N, temperature)
    counts = spec_joint(target, d, PROMPT, N, temperature, samples=SAMPLES, path=path)
    assert chi_square_ok(counts, p) and marginal_tv_ok(counts, p)


def test_dspark_sampled_distribution_matches_target():
    target = small_target()
    d = tiny_dspark(target, block_size=4, seed=6, scale=8.0)
    p = exact_joint(target, PROMPT, N, 0.8)
    counts = spec_joint(target, d, PROMPT, N, 0.8, samples=SAMPLES)
    assert chi_square_ok(counts, p) and marginal_tv_ok(counts, p)


def _planted(monkeypatch, drafter, corrupt):
    real = drafter.propose

    def buggy(*a, **kw):
        blk = real(*a, **kw)
        return blk._replace(probs=corrupt(blk))

    monkeypatch.setattr(drafter, "propose", buggy)


def test_dflash2_planted_bug_sparse_q_caught(monkeypatch):
    """q over the K candidates handed to verify in the wrong order (ids no longer match)."""
    target = small_target()
    d = tiny_dflash2(target, block_size=4, topk=4, seed=6, scale=8.0)
    _planted(monkeypatch, d, lambda blk: blk.probs.flip(-1))
    p = exact_joint(target, PROMPT, N, 1.0)
    assert not chi_square_ok(spec_joint(target, d, PROMPT, N, 1.0, samples=SAMPLES, path="sample"), p)


def test_dspark_planted_bug_dense_q_caught(monkeypatch):
    """Verify told the first Markov step's q for every position (ignores the chain)."""
    target = small_target()
    d = tiny_dspark(target, block_size=4, seed=6, scale=8.0)
    _planted(monkeypatch, d, lambda blk: blk.probs[:, :1].expand_as(blk.probs).contiguous())
    p = exact_joint(target, PROMPT, N, 0.8)
    assert not chi_square_ok(spec_joint(target, d, PROMPT, N, 0.8, samples=SAMPLES), p)


# ----------------------------------------------------------------- methods and CLI
def test_parse_method_and_bad_specs():
    from flashspark.methods import MethodSpec, parse_method

    assert parse_method("dflash") == MethodSpec("dflash")
    assert parse_method("dflash:k=3") == MethodSpec("dflash", k=3)
    assert parse_method("dflash2:sched=confidence,path=sample,delay=2,online=0") == MethodSpec(
        "dflash2", scheduler="confidence", path="sample", delay=2, online=False
    )
    for bad, msg in (
        ("medusa", "unknown drafter"),
        ("dflash:k=x", "not understood"),
        ("dflash:beam=4", "not understood"),
        ("dflash:sched=confidence", "needs confidences"),
        ("dspark:sched=oracle", "unknown scheduler"),
        ("dflash2:path=beam", "unknown path"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_method(bad)


def test_sps_with_overhead():
    t = SPSTable([1, 2, 4], [100.0, 50.0, 25.0])
    w = t.with_overhead(0.01)
    torch.testing.assert_close(w(torch.tensor([1, 2, 4])), 1 / (1 / torch.tensor([100.0, 50.0, 25.0]).double() + 0.01))
    with pytest.raises(ValueError):
        t.with_overhead(-1)


@pytest.mark.slow
def test_cli_fit_proxy_and_generate_every_method(tmp_path, monkeypatch, capsys):
    """Untrained drafters for the shipped target: `fit-proxy` writes the proxies, and
    `generate` runs dflash2 / dspark with both schedulers, equal to plain decoding at T = 0."""
    from flashspark import cli, data
    from flashspark.models import load_model
    from flashspark.models.dflash2 import save_dflash2
    from flashspark.models.dspark import save_dspark

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the SPS profile cache
    target = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
    d2 = DFlash2Drafter(DFlash2Config.for_target(target.config, num_hidden_layers=1, block_size=4), target)
    d2.init_weights(0)
    save_dflash2(d2, tmp_path / "dflash2")
    ds = DSparkDrafter(DSparkConfig.for_target(target.config, num_hidden_layers=1, block_size=4), target)
    ds.init_weights(0)
    save_dspark(ds, tmp_path / "dspark")
    assert (
        cli.main(
            [
                "fit-proxy",
                "--drafter",
                str(tmp_path / "dflash2"),
                "--prompts",
                "2",
                "--max-new-tokens",
                "6",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert {"proxy_t0.json", "proxy_t1.json", "proxy_fit.json"} <= {p.name for p in (tmp_path / "dflash2").iterdir()}
    for method, extra in (
        ("dflash2", ["--scheduler", "confidence"]),
        ("dflash2", ["--path", "greedy"]),
        ("dspark", ["--scheduler", "confidence", "--delay", "2"]),
        ("dspark", []),
    ):
        capsys.readouterr()
        assert (
            cli.main(
                [
                    "generate",
                    "--method",
                    method,
                    "--drafter",
                    str(tmp_path / method),
                    "--prompt",
                    "def f(x):",
                    "--max-new-tokens",
                    "10",
                    "--threads",
                    "1",
                    *extra,
                ]
            )
            == 0
        )
        err = capsys.readouterr().err
        assert "identical to plain decoding" in err and "drafts verified per step" in err, err
    # A drafter directory of the wrong kind, and a missing proxy, fail with one clear line.
    assert cli.main(["generate", "--method", "dspark", "--drafter", str(tmp_path / "dflash2"), "--prompt", "x"]) == 2
    (tmp_path / "dflash2" / "proxy_t0.json").unlink()
    assert (
        cli.main(
            [
                "generate",
                "--method",
                "dflash2",
                "--scheduler",
                "confidence",
                "--drafter",
                str(tmp_path / "dflash2"),
                "--prompt",
                "x",
                "--max-new-tokens",
                "4",
            ]
        )
        == 2
    )
    assert "proxy" in capsys.readouterr().err


def test_dflash2_recall_stats():
    """Top-K recall is 1 when the candidate list is the whole vocabulary, below 1 for a short
    list, and never below top-1 recall."""
    target = tiny_target(seed=4)
    prompts = prompts_of([3, 10, 1, 6], 48, seed=4)
    _, full = speculative_generate(target, tiny_dflash2(target, topk=16), prompts, max_new_tokens=20)
    _, short = speculative_generate(target, tiny_dflash2(target, topk=2), prompts, max_new_tokens=20)
    assert full["recall_positions"] >= full["steps"]
    assert 0 <= short["recall_top1"] <= short["recall_topk"] < full["recall_topk"] <= 1
    _, dflash = speculative_generate(target, tiny_drafter(target), prompts, max_new_tokens=20)
    assert "recall_top1" not in dflash


@pytest.mark.slow
@pytest.mark.parametrize(
    "method", ["dflash2", "dflash2:sched=confidence,plain=0", "dspark", "dspark:sched=confidence,plain=0"]
)
def test_shipped_drafters_greedy_equal_plain(method, tmp_path, monkeypatch):
    """The shipped DFlash 2 and DSpark drafters with the shipped target: exact at T = 0, and they draft
    (plain=0: the confidence scheduler may not fall back to plain steps, which depend on the machine)."""
    from flashspark import data
    from flashspark.methods import make_decoder, parse_method
    from flashspark.models import load_model

    if not (data.ASSETS_DIR / parse_method(method).drafter / "model.safetensors").is_file():
        pytest.skip("drafter not shipped")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    target = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
    tok = data.load_tokenizer()
    prompts = [p[:n] for p, n in zip(data.heldout_prompts("code", 4, 48, tok), (48, 17, 33, 5))]
    want, _ = generate(target, prompts, max_new_tokens=40)
    got, st = make_decoder(method, target)(prompts, 40)
    assert got == want
    assert st["tau"] > 1.5


@pytest.mark.parametrize("plain_rate,expect_plain", [(1e6, True), (1e-6, False)])
def test_confidence_scheduler_plain_steps_exact(plain_rate, expect_plain):
    """When plain decoding is priced faster than any speculative step, the scheduler runs
    plain decode steps once the confidences back that verdict; output stays exact."""
    target = tiny_target(seed=5)
    d = tiny_dspark(target)
    prompts = prompts_of([4, 9, 2], 48, seed=5)
    want, _ = generate(target, prompts, max_new_tokens=30)
    plain = SPSTable([1, 100], [plain_rate, plain_rate])
    sched = ConfidenceScheduler(4, linear_sps(), plain_sps=plain, min_rows=3)
    got, st = speculative_generate(target, d, prompts, max_new_tokens=30, scheduler=sched, record=True)
    assert got == want
    if expect_plain:
        # The first steps draft (until 3 confidence rows); the rest are plain steps that verify nothing.
        assert st["plain_steps"] >= 0.6 * st["steps"] / 3 and st["records"]["num_verified"].numel() < st["steps"]
    else:
        assert st["plain_steps"] == 0 and st["records"]["num_verified"].numel() == st["steps"]


def test_wants_draft_follows_mean_confidence_and_load():
    """Drafting is judged on the mean confidences seen, per active-request count: with these
    tables one active request gains from speculation (Θ 3.44 > 2) and two do not (6.88 < 8)."""
    sched = ConfidenceScheduler(3, SPSTable([1, 100], [1.0, 1.0]), plain_sps=SPSTable([1, 2], [2.0, 4.0]), min_rows=2)
    one, two = torch.tensor([True, False]), torch.tensor([True, True])
    assert sched.wants_draft(two)  # no confidences yet: draft to learn them
    sched.schedule(torch.full((2, 3), 0.9), two)
    assert [sched.wants_draft(two) for _ in range(3)] == [False] * 3
    assert sched.wants_draft(one) and not sched.wants_draft(two)
    assert ConfidenceScheduler(3, linear_sps()).wants_draft(two)  # no plain table: always draft
    # Under a batch verdict (a Decoder's): a whole batch drafts whatever the prior says, since the
    # verdict decided it from measurements (a probe of speculation must measure speculation);
    # once a request has finished, the prior weighs plain steps again.
    judged = ConfidenceScheduler(
        3, SPSTable([1, 100], [1.0, 1.0]), plain_sps=SPSTable([1, 2], [2.0, 4.0]), min_rows=2, batch_verdict=True
    )
    judged.schedule(torch.full((2, 3), 0.9), two)
    assert judged.wants_draft(two) and not judged.wants_draft(torch.tensor([True, True, False]))
    # Speculation must promise min_gain x plain: Θ 3.44 for one request against plain 3.3 (or 3.0).
    conf = torch.full((3,), 0.9)
    assert not ConfidenceScheduler(
        3, SPSTable([1, 100], [1.0, 1.0]), plain_sps=SPSTable([1, 2], [3.3, 3.3])
    ).expects_gain(conf, 1)
    assert ConfidenceScheduler(
        3, SPSTable([1, 100], [1.0, 1.0]), plain_sps=SPSTable([1, 2], [3.3, 3.3]), min_gain=1.0
    ).expects_gain(conf, 1)
    assert not ConfidenceScheduler(
        3, SPSTable([1, 100], [1.0, 1.0]), plain_sps=SPSTable([1, 2], [3.2, 3.2])
    ).expects_gain(conf, 1)


def test_confidence_stats_recalibrate_from_outcomes():
    """ρ_k = observed / predicted survival of the verified slots (shrunk toward 1) scales the
    predictions; unverified slots teach nothing; corrected survivals stay non-increasing in [0, 1]."""
    from flashspark.scheduling.confidence import ConfidenceStats

    st = ConfidenceStats(3)
    survival = torch.tensor([[0.9, 0.8, 0.4]]).expand(100, 3)
    st.add_rows(survival)
    # Every block verifies 2 drafts; half accept both, half reject the first.
    n_acc = torch.tensor([2, 0]).repeat(50)
    st.add_outcomes(survival, n_acc, torch.full((100,), 2))
    s = st.RATIO_STRENGTH
    want = torch.tensor([(50 + s) / (90 + s), (50 + s) / (80 + s), 1.0], dtype=torch.float64)
    torch.testing.assert_close(st.ratio(), want)
    corrected = st.mean_survival()
    torch.testing.assert_close(corrected[:2], torch.tensor([0.9, 0.8], dtype=torch.float64) * want[:2])
    assert corrected[2] <= corrected[1] and bool((corrected >= 0).all())  # position 3 never verified: ρ = 1, capped
    # A prior keeps its means and (up to the shrinkage) its ratio at any weight; round trip through JSON.
    w = st.scaled(10)
    assert w.rows == 10 and torch.allclose(w.survival / w.rows, st.survival / st.rows)
    assert torch.allclose(ConfidenceStats.from_dict(st.to_dict()).ratio(), st.ratio())


def test_scheduler_learns_overconfidence_online():
    """A source that claims 0.95 per token while verification accepts nothing: after a few
    steps' outcomes the scheduler admits fewer drafts, and with a plain table it stops drafting."""
    sps = SPSTable([2, 16], [1.0, 0.25])  # a step of 2 requests: 1/s verifying nothing, 4 s verifying 14 drafts
    sched = ConfidenceScheduler(7, sps, plain_sps=SPSTable([1, 100], [1.0, 1.0]), min_rows=4)
    active = torch.ones(2, dtype=torch.bool)
    conf = torch.full((2, 7), 0.95)
    first = sched.schedule(conf, active)
    assert int(first.sum()) > 0 and sched.wants_draft(active)
    for _ in range(30):
        k_b = sched.schedule(conf, active)
        sched.observe(None, torch.zeros(2, dtype=torch.int64), k_b.clamp(min=1))
    assert int(sched.schedule(conf, active).sum()) < int(first.sum())
    assert not sched.wants_draft(active)


def test_scheduler_prices_steps_by_the_clock(monkeypatch):
    """Steps that take 3x the seconds the table predicts (as when requests finish early and
    leave steps that cost as much but commit less) turn a predicted gain into plain steps;
    steps as fast as predicted keep drafting. Loop iterations are timed between wants_draft calls."""
    from flashspark.scheduling import confidence

    clock = [0.0]
    monkeypatch.setattr(confidence.time, "perf_counter", lambda: clock[0])
    sps = SPSTable([2, 16], [1.0, 0.5])  # a drafting step of 2 requests: 1 s .. 2 s
    plain = SPSTable([1, 100], [1.5, 1.5])  # plain steps: Θ = 3 tokens/s; drafting: Θ 4.8 as priced
    active = torch.ones(2, dtype=torch.bool)
    conf = torch.full((2, 7), 0.8)
    for slowdown, drafts in ((1.0, True), (3.0, False)):
        sched = ConfidenceScheduler(7, sps, plain_sps=plain, min_rows=2, time_steps=True)
        verdicts = []
        for _ in range(12):
            verdicts.append(sched.wants_draft(active))
            k_b = sched.schedule(conf, active)
            clock[0] += slowdown / float(sps(torch.tensor(2 + int(k_b.sum()))))
        assert verdicts[0] and verdicts[-1] == drafts  # the first step drafts: nothing learnt yet
        assert abs(sched.step_cost_ratio() - slowdown) < 0.2 * slowdown
        again = ConfidenceScheduler(7, sps, plain_sps=plain, min_rows=2, step_prior=sched.step_cost_totals())
        assert ConfidenceScheduler(7, sps, plain_sps=plain, min_rows=2).step_cost_ratio() == 1.0
        assert again.step_cost_ratio() == sched.step_cost_ratio()


def test_decoder_switches_speculation_off_when_it_cannot_pay(tmp_path, monkeypatch):
    """make_decoder with the confidence scheduler: a first call speculates and learns the
    drafter's confidences; when the tables then say no admission beats plain decoding, later
    batches are decoded plainly (exact, τ = 1); with speculation priced cheap it keeps drafting."""
    from flashspark import methods

    target = tiny_target(seed=5)
    d = tiny_dspark(target)
    prompts = prompts_of([4, 9, 2], 48, seed=5)
    want, _ = generate(target, prompts, max_new_tokens=20)
    for plain_rate, speculate in ((1e6, False), (1e-6, True)):
        tables = (linear_sps(), SPSTable([1, 100], [plain_rate, plain_rate]))
        monkeypatch.setattr(methods, "step_sps", lambda *a, **k: tables)
        monkeypatch.setattr(methods, "MIN_PRIOR_ROWS", 3)
        decode = methods.make_decoder("dspark:sched=confidence", target, d)
        first, st1 = decode(prompts, 20)  # speculates (no prior yet): at least 3 confidence rows
        second, st2 = decode(prompts, 20)
        assert first == want and second == want
        assert not st1.get("plain_batch") and bool(st2.get("plain_batch")) != speculate
        # Speculating, the loop drafts every step (what it verifies is the recalibrated schedule's call).
        assert (st2["plain_steps"] == 0) == speculate and (st2["tau"] == 1.0 or speculate)
        # forget(): the next call is decided as the first was (e2e_bench's warm-up teaches nothing).
        decode.forget()
        third, st3 = decode(prompts, 20)
        assert third == want and not st3.get("plain_batch") and st3["steps"] == st1["steps"]


def test_a_prior_of_another_width_is_ignored(tmp_path):
    """A scheduler prior left from a drafter with another number of drafts per block (retrained in
    DeepSpec's slot layout) would break the scheduler's arithmetic: it is ignored, with a warning."""
    import json  # noqa: PLC0415

    from flashspark.methods import PRIOR_FILE, load_prior  # noqa: PLC0415
    from flashspark.scheduling.confidence import ConfidenceStats  # noqa: PLC0415

    stats = ConfidenceStats(7)
    stats.add_rows(torch.full((4, 7), 0.5))
    (tmp_path / PRIOR_FILE).write_text(json.dumps({"temperatures": {"0": {"stats": stats.to_dict()}}}))
    assert load_prior(tmp_path, 0.0, 7).width == 7
    with pytest.warns(UserWarning, match="covers 7 drafts per block, the drafter drafts 8"):
        assert load_prior(tmp_path, 0.0, 8) is None


def test_step_table_covers_every_verify_width(monkeypatch):
    """The step table spans 1 .. num_drafts + 1 tokens per request (DeepSpec's layout: γ + 1), so the
    last draft is never priced as free."""
    from flashspark import methods  # noqa: PLC0415

    seen = {}

    def fake_profile(target, batch_size, token_counts=None, **kw):
        seen["tokens"] = list(token_counts)
        return SPSTable(seen["tokens"], [1.0] * len(seen["tokens"]))

    monkeypatch.setattr(methods, "profile_sps", fake_profile)
    monkeypatch.setattr(methods, "measured_step_seconds", lambda *a, **k: 1.0)
    monkeypatch.setattr(methods, "measured_plain_step_seconds", lambda *a, **k: 1.0)
    target = tiny_target(seed=5)
    methods.step_sps(target, tiny_dspark(target), 3)
    assert seen["tokens"] == [3 * w for w in range(1, 5 + 2)]  # γ = 5: up to 6 tokens per request


def test_step_tables_price_the_measured_steps(monkeypatch):
    """The speculative table costs what a full-width step measures in the loop at its full
    width, and the profile's shape (padded) below it; the plain table costs what a plain
    decoding step measures at T = batch size. Both step kinds are measured back to back,
    median of the rounds."""
    from flashspark import methods  # noqa: PLC0415

    profile = [0.050, 0.090, 0.070, 0.080, 0.085, 0.100]  # seconds at 1..6 tokens per request, batch 2
    monkeypatch.setattr(
        methods, "profile_sps", lambda target, b, tokens, **kw: SPSTable(tokens, [1 / x for x in profile])
    )
    order = []
    spec = iter([0.120, 0.500, 0.110])  # one slow round: the median drops it
    plain = iter([0.040, 0.041, 0.300])
    monkeypatch.setattr(methods, "measured_step_seconds", lambda *a, **k: order.append("spec") or next(spec))
    monkeypatch.setattr(methods, "measured_plain_step_seconds", lambda *a, **k: order.append("plain") or next(plain))
    target = tiny_target(seed=5)
    spec_sps, plain_sps = methods.step_sps(target, tiny_dspark(target), 2, rounds=3)  # γ = 5: 1..6 tokens
    assert order == ["spec", "plain"] * 3
    # Overhead 0.120 - 0.100 = 0.020 on the padded profile (0.070 at 2 and 3 tokens per request).
    assert (1 / spec_sps.sps).tolist() == pytest.approx([0.070, 0.090, 0.090, 0.100, 0.105, 0.120])
    assert 1 / float(plain_sps.rate(2)) == pytest.approx(0.041)


def test_a_measured_step_verifies_the_k_it_is_given(monkeypatch):
    """`measured_step_seconds(k=K)` times steps that verify K drafts per request (the rests the
    replay reads at each width), the drafter's drafts per block without it; `steps` x (K + 1)
    tokens are decoded after a warm-up, and a step is the decode time per loop iteration."""
    from flashspark import methods  # noqa: PLC0415

    calls = []

    def fake(target, drafter, prompts, max_new_tokens, scheduler=None, **kw):
        calls.append((max_new_tokens, None if scheduler is None else scheduler.max_spec_len))
        return [], {"decode_seconds": 2.0, "iterations": 8}

    monkeypatch.setattr(methods, "speculative_generate", fake)
    target = tiny_target(seed=5)
    drafter = tiny_dspark(target)  # γ = 5: 5 drafts per block here
    assert methods.measured_step_seconds(target, drafter, 2, steps=2, k=3) == pytest.approx(0.25)
    assert calls == [(2, 3), (8, 3)]
    calls.clear()
    methods.measured_step_seconds(target, drafter, 2, steps=2)
    assert calls == [(2, None), (2 * (drafter.num_drafts + 1), None)]
    calls.clear()
    methods.measured_step_seconds(target, drafter, 2, steps=1, k=99)  # capped at the block's drafts
    assert calls[-1] == (drafter.num_drafts + 1, drafter.num_drafts)


def test_a_measured_prefill_is_plain_decodings_own(monkeypatch):
    """`measured_prefill_seconds` reads `generate`'s prefill time of B prompts of L tokens,
    after a warm-up."""
    from flashspark import methods  # noqa: PLC0415

    seen = []

    def fake(target, prompts, max_new_tokens):
        seen.append((len(prompts), {len(p) for p in prompts}, max_new_tokens))
        return [], {"prefill_seconds": 0.5 * len(seen)}

    monkeypatch.setattr(methods, "generate", fake)
    assert methods.measured_prefill_seconds(tiny_target(seed=5), 3, 17) == 1.0
    assert seen == [(3, {17}, 1)] * 2
