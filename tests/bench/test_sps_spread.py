"""bench/sps_spread.py on the tiny target: both estimators per trial and batch size, the
summary rows and the JSON."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sps_spread  # noqa: E402  (bench/ is not a package)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sps_spread_tiny(tmp_path):
    out = tmp_path / "spread.json"
    argv = ["--trials", "2", "--batches", "1", "2", "--context", "16", "--repeats", "2", "--warmup", "1"]
    assert sps_spread.main(argv + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert len(result["trials"]) == 2 * 2 * 2  # trials x batch sizes x estimators
    assert [(r["batch"], r["estimator"]) for r in result["rows"]] == [
        (b, e) for b in (1, 2) for e in sps_spread.ESTIMATORS
    ]
    for t in result["trials"]:
        assert t["tokens"] == [t["batch"] * w for w in range(1, result["width"] + 1)]
        assert all(a <= b for a, b in zip(t["seconds"], t["seconds"][1:]))  # padded: non-decreasing
        assert all(p <= r for p, r in zip(t["seconds"], t["raw_seconds"])) and t["seconds"][-1] == t["raw_seconds"][-1]
    assert [len(u["ms"]) for u in result["unfitted_ms"]] == [result["width"]] * 4
    for r in result["rows"]:
        assert r["min"] <= r["median"] <= r["max"] and r["spread"] >= 0
