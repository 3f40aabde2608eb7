"""bench/combo_replay.py from the committed traces (H200 projection, labelled so), and
bench/cost_fit.py fitting this machine's description on a small grid, which the replay
then reads (`--cost-model cpu`)."""

import json
import sys
from pathlib import Path

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


def test_cost_fit_then_replay_on_it(tmp_path):
    fit = tmp_path / "fit.json"
    argv = ["--batches", "1", "2", "--widths", "1", "4", "--contexts", "16", "--repeats", "1", "--threads", "1"]
    assert cost_fit.main(argv + ["--out", str(fit)]) == 0
    result = json.loads(fit.read_text())
    assert [m["model"] for m in result["measurements"]] == ["target"] * 4 + ["drafter"] * 2  # fitted together
    assert result["hardware"]["bandwidth_gbs"] > 0 and len(result["step_overhead_by_batch"]) == 2
    assert result["step_overhead_s"] >= 0 and len(result["checks"]) == 2
    out = tmp_path / "replay.json"
    argv = ["--cost-model", "cpu", "--cost-file", str(fit), "--temperatures", "1", "--concurrency", "2"]
    assert combo_replay.main(argv + ["--shuffles", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["label"] == "REPLAY"

    # replay_check against an e2e_bench result: cells that agree pass, a measurement the replay
    # cannot reproduce (twice what it replays) is flagged.
    methods = ["ar", "dflash:k=3", "dflash2:sched=confidence"]
    e2e = {"task": "code", "temperature": 1.0, "max_new_tokens": 96, "prompts": 4, "repeats": 1, "methods": methods}
    e2e["results"] = [{"method": m, "concurrency": 2, "speedup_paired": 1.0} for m in methods]
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(e2e))
    check = tmp_path / "check.json"
    assert replay_check.main([str(path), "--cost-file", str(fit), "--out", str(check)]) == 0
    rows = {r["method"]: r for r in json.loads(check.read_text())["rows"]}
    for r in e2e["results"]:
        r["speedup_paired"] = rows[r["method"]]["replayed"] * (2.0 if r["method"] == "dflash:k=3" else 1.0)
    path.write_text(json.dumps(e2e))
    assert replay_check.main([str(path), "--cost-file", str(fit), "--out", str(check)]) == 0
    rows = {r["method"]: r for r in json.loads(check.read_text())["rows"]}
    assert rows["ar"]["agrees"] and rows["dflash2:sched=confidence"]["agrees"] and not rows["dflash:k=3"]["agrees"]
    e2e["max_new_tokens"] = 64  # other runs than the traces': refused
    path.write_text(json.dumps(e2e))
    assert replay_check.main([str(path), "--cost-file", str(fit), "--out", str(check)]) == 2
