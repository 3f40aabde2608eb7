"""bench/tau_bench.py: τ from the loop's stats (hand-made and measured on the tiny target),
the issue's bars, its JSON and PNG, and clear errors for bad arguments in it and in the
benchmarks that take the target from bench/targets.py."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import combo_bench  # noqa: E402  (bench/ is not a package)
import e2e_bench  # noqa: E402
import tau_bench  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TINY_RUN = ["--prompts", "2", "--max-new-tokens", "8", "--temperatures", "0", "--threads", "1"]


def batch_stats(accepted: list[int], steps: list[int], tried: list[int], hits: list[int]) -> dict:
    """What the loop returns for one batch, reduced to the keys tau_bench reads: per request its
    accepted drafts and steps, per draft position the request-steps that verified and accepted it."""
    verified = sum(tried)
    return {
        "steps": sum(steps),
        "tau": (sum(accepted) + sum(steps)) / sum(steps),
        "tau_per_request": [(a + s) / s for a, s in zip(accepted, steps)],
        "drafts_verified": verified,
        "drafts_wasted": verified - sum(accepted),
        "acceptance_per_position": [h / max(1, t) for h, t in zip(hits, tried)],
        "accepted_per_position": hits,
        "tried_per_position": tried,
        "new_tokens": sum(a + s for a, s in zip(accepted, steps)),
        "iterations": max(steps),
        "seconds": 1.0,
    }


def test_summarize_counts_request_steps():
    # a confidence scheduler verified draft 2 at only 2 of batch a's 4 request-steps
    a = batch_stats([4, 1], [2, 2], tried=[4, 2], hits=[4, 1])  # 4 steps, 5 accepted
    b = batch_stats([0], [4], tried=[4, 4], hits=[0, 0])  # 4 steps, nothing accepted
    s = tau_bench.summarize([a, b])
    assert s["steps"] == 8 and s["accepted"] == 5 and s["requests"] == 3
    assert s["tau"] == pytest.approx(13 / 8)  # (5 + 8) / 8 over all request-steps
    assert s["tau_per_request"] == [3.0, 1.5, 1.0] and s["tau_request_mean"] == pytest.approx(5.5 / 3)
    # over the request-steps that verified each draft: 4 of 8, 1 of 6 (weighting batches by steps: 0.25)
    assert s["acceptance_per_position"] == pytest.approx([0.5, 1 / 6])
    # A request that took no step (EOS from the prefill) has no τ: it lowers no request mean.
    c = batch_stats([0], [3], tried=[3, 3], hits=[0, 0]) | {"tau_per_request": [None, 1.0]}
    s = tau_bench.summarize([a, c])
    assert s["requests"] == 3 and s["requests_without_steps"] == 1
    assert s["tau_request_min"] == 1.0 and s["tau_request_mean"] == pytest.approx(5.5 / 3)
    assert tau_bench.summarize([c | {"tau_per_request": [None]}])["tau_request_mean"] is None


def test_bars():
    def rows(taus: dict) -> list[dict]:
        return [{"method": m, "temperature": t, "task": tau_bench.ALL_TASKS, "tau": v} for (m, t), v in taus.items()]

    ok = tau_bench.bar_checks(rows({("dflash", 0.0): 3.2, ("dflash2", 0.0): 3.6, ("dspark", 0.0): 3.2}), [0.0])
    assert ok["all_passed"] and ok["unmeasured"] == 0
    assert [c["passed"] for c in ok["checks"]] == [True, True, True]
    assert ok["checks"][1]["measured"] == pytest.approx(3.6 / 3.2)
    low = tau_bench.bar_checks(rows({("dflash", 0.0): 2.9, ("dflash2", 0.0): 3.1, ("dspark", 0.0): 2.8}), [0.0])
    assert [c["passed"] for c in low["checks"]] == [False, False, False] and not low["all_passed"]
    only = tau_bench.bar_checks(rows({("dflash", 1.0): 2.0, ("dflash2", 1.0): 2.5}), [1.0])
    assert [c["passed"] for c in only["checks"]] == [None, True, None] and only["unmeasured"] == 2
    # A drafter's default spelt out (K = γ - 1) counts for the bars; another K or scheduler does not.
    spelt = rows({("dflash:k=7", 0.0): 3.2, ("dflash2:k=7", 0.0): 3.6, ("dspark:k=3", 0.0): 9.0})
    for r in spelt:
        r["gamma"] = 8
    spelt_out = tau_bench.bar_checks(spelt, [0.0])
    assert [c["passed"] for c in spelt_out["checks"]] == [True, True, None]
    sched = rows({("dflash", 0.0): 3.2, ("dflash2:sched=confidence", 0.0): 3.6})
    assert [c["passed"] for c in tau_bench.bar_checks(sched, [0.0])["checks"]] == [True, None, None]
    # The general-chat rows add their own bar (DFlash τ >= 2.5 at T = 0); they are not "all" rows.
    general = [{"method": "dflash", "temperature": 0.0, "task": "general", "tau": 2.6}]
    with_general = tau_bench.bar_checks(rows({("dflash", 0.0): 3.2}) + general, [0.0])
    assert [c["passed"] for c in with_general["checks"]] == [True, True, None, None]
    assert with_general["checks"][1]["measured"] == 2.6 and "general chat" in with_general["checks"][1]["bar"]
    low_general = tau_bench.bar_checks(general[:0] + [general[0] | {"tau": 2.4}], [0.0])
    assert [c["passed"] for c in low_general["checks"]] == [None, False, None, None]


def test_main_on_the_tiny_target(tmp_path, capsys):
    out = tmp_path / "tau.json"
    assert tau_bench.main(TINY_RUN + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    for key in ("command", "date", "hardware", "target", "dtype", "settings", "results", "bars"):
        assert key in result
    assert result["target"] == "tiny" and result["dtype"] == "float32" and result["bars"] is None
    settings = result["settings"]
    assert settings["methods"] == ["dflash", "dflash2", "dspark"] and settings["tasks"] == ["code", "prose"]
    assert settings["prompts"] == 2 and settings["max_new_tokens"] == 8 and settings["temperatures"] == [0.0]
    rows = result["results"]
    assert {(r["method"], r["task"]) for r in rows} == {
        (m, t) for m in settings["methods"] for t in ("code", "prose", tau_bench.ALL_TASKS)
    }
    for r in rows:
        assert 1.0 <= r["tau"] <= r["drafts"] + 1 and r["k"] == r["drafts"]
        assert r["drafts"] == (r["gamma"] if r["method"] == "dspark" else r["gamma"] - 1)  # DeepSpec's layout
        assert r["requests"] == (4 if r["task"] == tau_bench.ALL_TASKS else 2) and r["steps"] > 0
        assert all(1.0 <= t <= r["gamma"] for t in r["tau_per_request"])
        assert len(r["acceptance_per_position"]) == r["k"]
        assert all(0.0 <= a <= 1.0 for a in r["acceptance_per_position"])
    for m in settings["methods"]:  # "all" is the request-steps of both tasks together
        code, prose, every = (
            next(r for r in rows if r["method"] == m and r["task"] == t) for t in ("code", "prose", "all")
        )
        assert every["steps"] == code["steps"] + prose["steps"]
        assert every["tau"] == pytest.approx(
            (code["tau"] * code["steps"] + prose["tau"] * prose["steps"]) / every["steps"]
        )
    assert "acceptance by position" in capsys.readouterr().out
    assert settings["eos_id"] is not None and "stops at the target's EOS" in settings["decoding"]


def test_stopping_at_eos_is_passed_to_the_loop(monkeypatch, tmp_path):
    """--stop-at-eos (the default) hands the target's EOS id to every decode; --no-stop-at-eos none."""
    seen = []
    real = tau_bench.measure

    def spy(args, target, decoders):
        for name, decode in decoders.items():
            decoders[name] = Spy(decode)
        return real(args, target, decoders)

    class Spy:
        def __init__(self, decode):
            self.decode, self.drafter, self.k_max = decode, decode.drafter, decode.k_max

        def __call__(self, *a, eos_id=None, **k):
            seen.append(eos_id)
            return self.decode(*a, eos_id=eos_id, **k)

    monkeypatch.setattr(tau_bench, "measure", spy)
    one = TINY_RUN + ["--methods", "dflash", "--tasks", "code", "--out", str(tmp_path / "t.json")]
    assert tau_bench.main(one) == 0 and seen and all(e is not None for e in seen)
    seen.clear()
    assert tau_bench.main(one + ["--no-stop-at-eos"]) == 0 and seen == [None]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "chat"], "unknown task 'chat' for the target tiny"),
        (["--methods", "dflash", "bogus"], "unknown drafter 'bogus'"),
        (["--methods", "ar"], "ar drafts nothing"),
        (["--methods", "dflash:k=x"], "not understood"),
        (["--methods", "dflash", "dflash:k=7"], "are the same method"),
    ],
)
def test_tau_bench_bad_arguments(tmp_path, capsys, argv, message):
    assert tau_bench.main(TINY_RUN + argv + ["--out", str(tmp_path / "t.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_tau_bench_bad_numbers_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        tau_bench.main(["--max-new-tokens", "1"])
    assert e.value.code == 2 and "--max-new-tokens must be at least 2" in capsys.readouterr().err


def test_e2e_and_combo_bad_task(tmp_path, capsys):
    e2e = ["--task", "chat", "--methods", "ar", "--concurrency", "1", "--threads", "1"]
    assert e2e_bench.main(e2e + ["--out", str(tmp_path / "e.json")]) == 2
    assert "unknown task 'chat' for the target tiny; expected code or prose" in capsys.readouterr().err
    combo = ["--tasks", "code", "poetry", "--threads", "1", "--out", str(tmp_path / "c.json")]
    assert combo_bench.main(combo) == 2
    assert "unknown task 'poetry' for the target tiny" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
