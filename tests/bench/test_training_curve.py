"""bench/training_curve.py: τ against minutes with its log trend, from a run's metrics.jsonl."""

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import training_curve  # noqa: E402  (bench/ is not a package)


def test_trend_and_projection(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    # tau = 1 + 0.25 ln(minutes): reaches 3.0 at e^8 minutes.
    rows = [
        {"step": 10 * i, "minutes": float(m), "tau": 1 + 0.25 * math.log(m)}
        for i, m in enumerate([2, 4, 8, 16, 32, 64], 1)
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    monkeypatch.setattr(training_curve, "RESULTS", tmp_path)
    assert training_curve.main([str(run), "--target-tau", "3.0", "--name", "t"]) == 0
    result = json.loads((tmp_path / "training_curve_t.json").read_text())
    t = result["runs"]["run"]["trend"]
    assert abs(t["b"] - 0.25) < 1e-9 and abs(t["minutes_to_target"] - math.exp(8)) < 1e-6 * math.exp(8)
    assert result["runs"]["run"]["positions_trained"] is None  # no checkpoint beside it
    assert (tmp_path / "training_curve_t.png").is_file() and "PROJECTION" in result["trend"]


def test_an_exported_drafters_card_stands_in_for_its_run(tmp_path, monkeypatch):
    """Without metrics.jsonl, the MODEL_CARD.md progress table and the last training command's
    batch and blocks (with the config's γ) give the same curve."""
    src = ROOT / "python" / "flashspark" / "assets" / "smollm2" / "dflash" / "config.json"
    card = tmp_path / "dflash"
    card.mkdir()
    (card / "config.json").write_text(src.read_text())  # γ = 8
    (card / "MODEL_CARD.md").write_text(
        "## Training\n\n```\npython -m flashspark train dflash --batch-size 4 --blocks-per-seq 16\n"
        "python -m flashspark train dflash --batch-size 8 --blocks-per-seq 32 --resume\n```\n\n"
        "| step | minutes | train loss | held-out τ |\n|---|---|---|---|\n"
        "| 100 | 2.0 | 5.0 | 1.25 |\n| 1,200 | 8.0 | 4.0 | 1.75 |\n\n## Limitations\n| 1 | x |\n"
    )
    monkeypatch.setattr(training_curve, "RESULTS", tmp_path)
    assert training_curve.main([str(card), "--name", "card"]) == 0
    run = json.loads((tmp_path / "training_curve_card.json").read_text())["runs"]["dflash"]
    assert run["steps"] == [100, 1200] and run["minutes"] == [2.0, 8.0] and run["tau"] == [1.25, 1.75]
    assert run["positions_trained"] == [100 * 8 * 32 * 7, 1200 * 8 * 32 * 7]
    (card / "MODEL_CARD.md").write_text("# no table\n")
    assert training_curve.main([str(card)]) == 2
