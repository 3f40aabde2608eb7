"""The combination benchmark's verdict and report logic on hand-made rows (the
benchmark itself is measured, not tested)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import combo_bench  # noqa: E402

COMBO = combo_bench.COMBO


def rows(speedups: dict[str, float], c=1, task="code", t=0.0):
    return [
        {
            "task": task,
            "temperature": t,
            "concurrency": c,
            "method": m,
            "speedup": s,
            "tokens_per_s": 100 * s,
            "tau": 1.0 + s,
            "verified_per_step": 2.0,
            "wasted_fraction": 0.5,
        }
        for m, s in speedups.items()
    ]


def test_verdict_within_noise_and_above_plain():
    ok = rows({"ar": 1.0, "dflash": 1.40, COMBO: 1.38})  # 1.4% behind: within 3% noise
    assert combo_bench.verdict(ok, 0.03)["bar_met"]
    behind = rows({"ar": 1.0, "dflash": 1.40, COMBO: 1.30})  # 7% behind
    v = combo_bench.verdict(behind, 0.03)
    assert not v["bar_met"] and v["cells"][0]["best_other"] == "dflash"
    at_plain = rows({"ar": 1.0, "dflash": 0.5, COMBO: 1.0}, c=32)  # not above plain
    assert not combo_bench.verdict(at_plain, 0.03)["bar_met"]
    both = ok + rows({"ar": 1.0, "dflash": 0.9, COMBO: 1.1}, c=2)
    assert combo_bench.verdict(both, 0.03)["bar_met"]


def test_markdown_and_labels():
    result = {
        "date": "d",
        "command": "c",
        "hardware": "h",
        "threads": 2,
        "max_new_tokens": 8,
        "prompt_tokens": 4,
        "repeats": 1,
        "tasks": ["code"],
        "temperatures": [0.0],
        "methods": ["ar", "dflash", "dflash2:k=4", COMBO],
        "results": rows({"ar": 1.0, "dflash": 1.2, "dflash2:k=4": 1.3, COMBO: 1.28}),
    }
    result["verdict"] = combo_bench.verdict(result["results"], 0.03)
    result["labels"] = {m: combo_bench.label(m, 7) for m in result["methods"]}  # γ = 8, γ - 1 drafts
    md = combo_bench.markdown(result)
    assert "| DFlash 2 K=4 | **1.30x (2.30)** |" in md and "| plain | 1.00x (2.00) |" in md
    assert "**met**" in md
    assert combo_bench.label("dspark:sched=confidence", 7) == "DSpark + scheduler"
    assert combo_bench.label(COMBO, 7) == "DFlash 2 + proxy + scheduler"
    assert combo_bench.label("dflash", 7) == "DFlash K=7"
    assert combo_bench.label("dspark", 8) == "DSpark K=8"  # DeepSpec's layout: γ drafts
