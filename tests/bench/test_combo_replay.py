"""bench/combo_replay.py from the committed traces (H200 projection, labelled so), and
bench/cost_fit.py fitting this machine's description on a small grid, which the replay
then reads (`--cost-model cpu`)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import combo_replay  # noqa: E402  (bench/ is not a package)
import cost_fit  # noqa: E402
import replay_check  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_replay_from_committed_traces(tmp_path):
    out = tmp_path / "replay.json"
    argv = ["--temperatures", "0", "--concurrency", "2", "--shuffles", "1", "--out", str(out)]
    assert combo_replay.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["label"] == "PROJECTION" and out.with_suffix(".md").read_text().startswith("# PROJECTION")
    cells = result["temperatures"]["0"]["cells"]
    for cell in cells.values():
        assert cell["plain"] == 1.0 and combo_replay.COMBO in cell and combo_replay.DSPARK_SCHED in cell
        assert combo_replay.best_fixed(cell)[1] > 0
    assert out.with_suffix(".png").is_file()
    check = result["published_check"]  # the roofline against DFlash's 4.86x at tau 6.49 (Qwen3-8B, H200)
    assert check["speedup"] == 4.86 and 1.0 < check["projected_over_published"] < 1.3


def test_each_method_is_judged_against_plain_decoding_of_its_own_trace(tmp_path):
    # At T = 1 each drafter's trace holds its own samples, so its requests stop at other
    # lengths (EOS) and plain decoding runs at another rate on each; a ratio taken over another
    # trace's plain rate would measure the lengths (SmolLM2: 7-12% apart), not the method.
    out = tmp_path / "replay.json"
    argv = ["--target", "smollm2", "--temperatures", "1", "--concurrency", "2", "--shuffles", "1", "--out", str(out)]
    assert combo_replay.main(argv) == 0
    cell = json.loads(out.read_text())["temperatures"]["1"]["cells"]["2"]
    hw, rest, _, elem = combo_replay.cost_model("h200", "smollm2")
    traces = {d: combo_replay.Trace.load(combo_replay.TRACES / f"smollm2_{d}_t1.npz") for d in ("dflash", "dspark")}
    order = combo_replay.stream(np.random.default_rng(0), traces["dflash"].requests, max(traces["dflash"].requests, 32))
    plain = {}
    for d, tr in traces.items():
        sc = combo_replay.step_costs(tr, hw, rest, bytes_per_value=elem)
        plain[d] = combo_replay.replay(tr, combo_replay.FixedPolicy(0), 2, sc, order).tokens_per_s
        k2 = combo_replay.replay(tr, combo_replay.FixedPolicy(2), 2, sc, order).tokens_per_s
        assert cell[f"{combo_replay.NAMES[d]} K=2"] == pytest.approx(k2 / plain[d])
    assert abs(plain["dspark"] / plain["dflash"] - 1) > 0.02  # the traces' plain rates do differ


def test_cost_fit_then_replay_on_it(tmp_path, monkeypatch):
    fit = tmp_path / "fit.json"
    argv = ["--batches", "1", "2", "--widths", "1", "4", "--contexts", "16", "--repeats", "1", "--threads", "1"]
    argv += ["--step-repeats", "1", "--step-contexts", "16", "--step-drafts", "--prefill-len", "0"]
    assert cost_fit.main(argv + ["--out", str(fit)]) == 0
    result = json.loads(fit.read_text())
    assert [m["model"] for m in result["measurements"]] == ["target"] * 4 + ["drafter"] * 2  # fitted together
    assert result["hardware"]["bandwidth_gbs"] > 0
    # the rest of every kind of step (a plain one, each drafter's), per temperature and batch size
    rest = result["step_rest"]
    assert rest["contexts"] == [16] and set(rest["plain"]) == {"0", "1"}
    assert set(rest["speculative"]) == {"dflash", "dflash2", "dspark"}
    for by_t in [rest["plain"], *rest["speculative"].values()]:
        assert all([row[:2] for row in rows] == [[1, 16], [2, 16]] for rows in by_t.values())
    assert len(result["checks"]) == 2 * 2 * 4  # temperatures x batches x (plain + 3 drafters)
    # by default the rests span the committed traces' contexts, the prefill at their median prompt
    (short, long), prompt = cost_fit.trace_spans("tiny")
    assert short <= prompt < long
    # the replay's steps at the measured points are the measured steps
    tr = combo_replay.Trace.load(combo_replay.TRACES / "tiny_dflash_t1.npz")
    hw, rests, _, elem = combo_replay.cost_model("cpu", "tiny", str(fit))
    sc = combo_replay.step_costs(tr, hw, rests, bytes_per_value=elem)
    sc = combo_replay.StepCosts(sc.target, sc.drafter, hw, sc.block_size, 16, sc.step_overhead, sc.plain_overhead)
    measured = {(c["kind"], c["temperature"], c["batch"]): c["step_s"] for c in result["checks"]}
    for b in (1, 2):
        assert sc.plain(b) == pytest.approx(measured[("plain", 1.0, b)])
        assert sc.speculative(b, tr.width + 1) == pytest.approx(measured[("dflash", 1.0, b)])
    out = tmp_path / "replay.json"
    argv = ["--cost-model", "cpu", "--cost-file", str(fit), "--temperatures", "1", "--concurrency", "2"]
    assert combo_replay.main(argv + ["--shuffles", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["label"] == "REPLAY"

    # replay_check against an e2e_bench result: cells that agree pass, a measurement the replay
    # cannot reproduce (twice what it replays, in one of the two kinds of speedup) is flagged.
    methods = ["ar", "dflash:k=3", "dflash2:sched=confidence"]
    e2e = {"task": "code", "temperature": 1.0, "max_new_tokens": 96, "prompts": 4, "repeats": 2, "methods": methods}
    e2e["results"] = [
        {"method": m, "concurrency": 2, "new_tokens": 384, "seconds_repeats": [1.0, 1.0]} for m in methods
    ]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(e2e))
    check = tmp_path / "check.json"
    assert replay_check.main([str(path), "--cost-file", str(fit), "--out", str(check)]) == 0
    rows = {r["method"]: r for r in json.loads(check.read_text())["rows"]}
    # Measured as replayed, with plain decoding's second repeat twice as fast as its first; DFlash
    # K = 3 planted with its repeats swapped: its best repeat over plain's best is still the
    # replayed ratio, its paired ratios (2x and 0.5x of it) are not.
    r = rows["dflash:k=3"]["replayed_paired"]
    e2e["results"][0]["seconds_repeats"] = [1.0, 0.5]
    e2e["results"][1]["seconds_repeats"] = [0.5 / r, 1.0 / r]
    path.write_text(json.dumps(e2e))
    for compare, flagged in (("paired", True), ("best", False)):
        argv = [str(path), "--cost-file", str(fit), "--out", str(check), "--compare", compare]
        assert replay_check.main(argv) == 0
        rows = {r["method"]: r for r in json.loads(check.read_text())["rows"]}
        assert rows["ar"]["agrees"] and "dflash2:sched=confidence" in rows
        assert rows["dflash:k=3"]["agrees"] is not flagged
    # --measure: a round of step rests and one e2e_bench repeat, priced and checked together
    argv = ["--measure", "--rounds", "1", "--temperatures", "1", "--concurrency", "2", "--prompts", "2"]
    # (DSpark alone: plain decoding is replayed over a trace whose drafter's steps were measured)
    argv += ["--methods", "ar", "dspark:k=3", "--threads", "1", "--cost-file", str(fit), "--out", str(check)]
    assert replay_check.main(argv + ["--rest-repeats", "1"]) == 0
    result = json.loads(check.read_text())
    # the rests over the decoded prompts' contexts, at K = 3 and the full width, and the prefill
    rest = result["rounds"][0]["step_rest"]
    assert rest["padded"] and len(rest["contexts"]) == 2 and [b for b, _ in rest["prefill"]] == [2]
    assert {tuple(row[1:3]) for row in rest["speculative"]["dspark"]["1"]} == {
        (c, w) for c in rest["contexts"] for w in (4, 9)
    }
    assert [(r["method"], r["concurrency"], r["repeats"]) for r in result["rows"]] == [
        ("ar", 2, 1),
        ("dspark:k=3", 2, 1),
    ]
    assert set(result["rounds"][0]["step_rest"]["speculative"]) == {"dspark"} and "e2e_files" not in result
    # --rounds-from: the stored rounds checked again, nothing measured, the same rows; a round
    # repeated replays as the first did (each round's policies start untaught, as e2e_bench's
    # decoders do), and the measurement's date and command are kept.
    again = tmp_path / "again.json"
    assert replay_check.main(["--rounds-from", str(check), "--cost-file", str(fit), "--out", str(again)]) == 0
    rechecked = json.loads(again.read_text())
    assert rechecked["rows"] == result["rows"] and rechecked["rounds_from"]["command"] == result["command"]
    twice = dict(result, rounds=result["rounds"] * 2)
    check.write_text(json.dumps(twice))
    assert replay_check.main(["--rounds-from", str(check), "--cost-file", str(fit), "--out", str(again)]) == 0
    rows = json.loads(again.read_text())["rows"]
    assert [r["replayed_paired"] for r in rows] == [r["replayed_paired"] for r in result["rows"]]
    assert [r["repeats"] for r in rows] == [2, 2]
    e2e["max_new_tokens"] = 64  # other runs than the traces': refused
    path.write_text(json.dumps(e2e))
    assert replay_check.main([str(path), "--cost-file", str(fit), "--out", str(check)]) == 2
    # a measurement outlives a check that cannot read it: its rounds are written first
    stored = {1.0: [(r["e2e"], r["step_rest"]) for r in result["rounds"]]}
    monkeypatch.setattr(replay_check, "measure", lambda *a: stored)
    monkeypatch.setattr(replay_check, "check", lambda *a, **k: (_ for _ in ()).throw(ValueError("planted")))
    assert replay_check.main(argv) == 2
    kept = json.loads(check.read_text())
    assert kept["checked"] is False and kept["rounds"] == result["rounds"]


def test_replay_check_starts_each_round_untaught():
    # e2e_bench.run starts every round's decoders untaught (Decoder.forget), so the replay of
    # three identical rounds must read as the replay of one. Carried across rounds, the
    # combination's verdict learnt in round 1 and replayed 1.000x in the later rounds where
    # the first read 0.989x (tiny traces, T = 0, concurrency 2).
    hw, rest, _, elem = combo_replay.cost_model("cpu", "tiny", None)
    methods = ["ar", "dflash:k=3", "dflash2:sched=confidence"]
    e2e = {"task": "code", "temperature": 0.0, "max_new_tokens": 96, "prompts": 8, "repeats": 2, "methods": methods}
    e2e["results"] = [
        {"method": m, "concurrency": 2, "new_tokens": 768, "seconds_repeats": [1.0, 1.0]} for m in methods
    ]
    one, three = (replay_check.check([(e2e, rest)] * n, replay_check.TRACES, "tiny", hw, elem, 0.1) for n in (1, 3))
    assert [r["replayed_paired"] for r in three] == [r["replayed_paired"] for r in one]
    assert one[2]["replayed_paired"] < 0.995  # the round does not read as a learnt verdict would
    # Runs that start every (concurrency, repeat) cell untaught (e2e_bench's "untaught": "cell")
    # replay each repeat from scratch: two repeats read as one; carried, the second had learnt.
    single = dict(e2e, repeats=1, results=[dict(r, seconds_repeats=[1.0]) for r in e2e["results"]])
    first = replay_check.check([(single, rest)], replay_check.TRACES, "tiny", hw, elem, 0.1)
    cells = replay_check.check([(dict(e2e, untaught="cell"), rest)], replay_check.TRACES, "tiny", hw, elem, 0.1)
    assert [r["replayed_paired"] for r in cells] == [r["replayed_paired"] for r in first]
    assert one[2]["replayed_paired"] > first[2]["replayed_paired"]


def test_bars_take_each_orders_best_fixed_k():
    # Two orders: the best fixed K differs between them; the combination is judged against each
    # order's own best, and the worst order decides the bar.
    ratios = {"plain": [1.0, 1.0], "DFlash K=1": [1.2, 1.0], "DFlash K=2": [1.0, 1.5]}
    ratios[combo_replay.COMBO] = [1.2, 1.44]
    b = combo_replay.bars(ratios)
    assert b["over_best_fixed"]["worst"] == pytest.approx(0.96) and not b["over_best_fixed"]["met"]
    assert b["over_plain"]["worst"] == pytest.approx(1.2) and b["over_plain"]["met"]
    ratios[combo_replay.COMBO] = [1.2, 1.47]
    assert combo_replay.bars(ratios)["over_best_fixed"]["met"]


def test_bars_split_the_gap_between_the_schedule_and_the_drafts():
    # DFlash 2's best fixed K trails DFlash's by 20% in the second order: the combination, at
    # its own drafter's best there, misses the bar by the drafts' share alone.
    ratios = {"plain": [1.0, 1.0], "DFlash K=2": [1.1, 1.5], "DFlash 2 K=1": [1.0, 1.2], "DFlash 2 K=2": [1.2, 1.0]}
    ratios[combo_replay.COMBO] = [1.2, 1.2]
    b = combo_replay.bars(ratios)
    assert not b["over_best_fixed"]["met"] and b["over_best_fixed"]["worst"] == pytest.approx(0.8)
    assert b["over_dflash2_fixed"]["worst"] == pytest.approx(1.0)  # the schedule: at its drafter's best
    assert b["dflash2_fixed_over_best"]["worst"] == pytest.approx(0.8)  # the drafts: 20% short
    assert "over_dflash2_fixed" not in combo_replay.bars({k: v for k, v in ratios.items() if "DFlash 2 K" not in k})


def test_measured_bars_against_the_best_fixed_k():
    row = {"task": "chat", "temperature": 0.0, "concurrency": 1}
    rows = [row | {"method": m, "measured_paired": v} for m, v in
            (("ar", 1.0), ("dflash:k=3", 1.30), ("dflash2", 1.10), ("dflash2:sched=confidence", 1.25))]  # fmt: skip
    (b,) = replay_check.measured_bars(rows)
    assert b["best_fixed"] == "dflash:k=3" and b["over_best_fixed"] == pytest.approx(1.25 / 1.30) and b["met"]
    rows[-1]["measured_paired"] = 1.2  # 0.923 of the best fixed K
    assert not replay_check.measured_bars(rows)[0]["met"]


def test_step_rests_interleave_kinds_and_take_medians(monkeypatch):
    """Every kind of step at a batch size is timed in turn, in an order rotated by the run (a
    speculative step's price is read against a plain one's from the same minutes), the plain
    step priced as the median of its runs and a speculative one as the median of its ratios to
    the plain run of the same pass."""
    calls, times = [], iter([5, 1, 2, 3, 9, 4, 6, 7, 8] * 2)

    def timed(kind):
        def measure(target, *args, **kw):
            b = args[1] if kind != "plain" else args[0]
            calls.append((kind, b))
            return float(next(times))

        return measure

    monkeypatch.setattr(cost_fit, "measured_plain_step_seconds", timed("plain"))
    monkeypatch.setattr(
        cost_fit, "measured_step_seconds", lambda target, drafter, b, **kw: timed(drafter.name)(target, drafter, b)
    )
    monkeypatch.setattr(cost_fit.costs, "forward_time", lambda *a: 0.0)
    monkeypatch.setattr(cost_fit.costs, "drafter_forward", lambda *a: None)

    class Drafter:
        block_size, num_drafts = 4, 3

        def __init__(self, name):
            self.name = name
            self.config = type("C", (), {"layer_config": lambda self: None})()

    drafters = {"a": Drafter("a"), "b": Drafter("b")}
    rest, checks = cost_fit.step_rests(None, None, None, 4.0, drafters, [0.0], [1, 2], [16], repeats=3)
    # run 1: plain, a, b at each batch; run 2 starts at a; run 3 at b
    assert calls[:6] == [("plain", 1), ("a", 1), ("b", 1), ("plain", 2), ("a", 2), ("b", 2)]
    assert calls[6:9] == [("a", 1), ("b", 1), ("plain", 1)]
    assert calls[12:15] == [("b", 1), ("plain", 1), ("a", 1)]
    runs = {}
    for call, t in zip(calls, [5, 1, 2, 3, 9, 4, 6, 7, 8] * 2):
        runs.setdefault(call, []).append(t)
    assert rest["plain"]["0"] == [[b, 16, float(np.median(runs[("plain", b)]))] for b in (1, 2)]
    # a speculative step: its median ratio to the plain step of the same pass, times the plain
    # step (the medians of each kind alone would price b at batch 1 at 3, not 2 x 5 / 3)
    paired = [np.median(runs[("plain", b)]) * np.median(np.divide(runs[("b", b)], runs[("plain", b)])) for b in (1, 2)]
    assert [row[:3] for row in rest["speculative"]["b"]["0"]] == [[1, 16, 4], [2, 16, 4]]  # batch, context, width
    assert [row[3] for row in rest["speculative"]["b"]["0"]] == pytest.approx(paired)
    assert rest["speculative"]["b"]["0"][0][3] != pytest.approx(np.median(runs[("b", 1)]))
    assert rest["runs_s"]["plain"]["0"]["2"]["16"] == runs[("plain", 2)]
    assert rest["runs_s"]["a"]["0"]["1"]["16"] == runs[("a", 1)] and rest["interleaved"]
    assert [c["step_s"] for c in checks if c["kind"] == "plain"] == [np.median(runs[("plain", b)]) for b in (1, 2)]


def test_identical_work_reads_the_measurements_noise():
    # The combination's cells decoded all plainly ran the plain row's own work: their ratios are
    # the measurement's noise. A cell that drafted any batch is not counted.
    def e2e(ar_s, combo_s, plain_batches):
        rows = [{"method": "ar", "concurrency": 4, "seconds": ar_s}]
        rows.append({"method": replay_check.COMBO_METHOD, "concurrency": 4, "seconds": combo_s,
                     "plain_batches": plain_batches})  # fmt: skip
        return {"temperature": 0.0, "prompts": 8, "results": rows}

    rounds = [(e2e(10.0, 10.0, 2), {}), (e2e(11.0, 10.0, 2), {}), (e2e(10.0, 20.0, 1), {})]
    noise = replay_check.identical_work([rounds])
    assert [c["ratio"] for c in noise["cells"]] == pytest.approx([1.0, 1.1])
    assert noise["min"] == pytest.approx(1.0) and noise["max"] == pytest.approx(1.1)
    assert noise["log_sd"] == pytest.approx(np.log(1.1) / np.sqrt(2))
    assert replay_check.identical_work([[(e2e(10.0, 20.0, 1), {})]]) is None
