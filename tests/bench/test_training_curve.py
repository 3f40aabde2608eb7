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
