"""bench/drafter_shape_bench.py at a toy size on the tiny target: one row per batch, every
shape timed, the first shape's ratio 1, parameters growing with depth and width, JSON written."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import drafter_shape_bench  # noqa: E402  (bench/ is not a package)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_shapes_are_timed_side_by_side(tmp_path, capsys):
    out = tmp_path / "shape.json"
    args = ["--model", "tiny", "--shapes", "1x64", "2x128", "--batches", "1", "2", "--context", "16"]
    drafter_shape_bench.main(args + ["--rounds", "2", "--repeats", "1", "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["over_first"]["1x64"] == 1.0 and r["ms"]["2x128"] > 0
        assert r["parameters"]["2x128"] > r["parameters"]["1x64"]
    assert "2x128" in capsys.readouterr().out
    with pytest.raises(ValueError):
        drafter_shape_bench.parse_shape("two-by-64")
