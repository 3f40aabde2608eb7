"""bench/tree_bench.py: a tiny run end to end (JSON, PNG, the projection labelled as one), the
bars from hand-made rows, and `--tree` in the benchmarks that take method lists."""

import json
import sys
from pathlib import Path

import pytest
from flashspark.methods import with_tree

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_bench  # noqa: E402  (bench/ is not a package)
import tree_bench  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tiny_run_writes_json_png_and_a_labelled_projection(tmp_path):
    out = tmp_path / "tree.json"
    argv = ["--trees", "4", "--prompts", "1", "--max-new-tokens", "6", "--temperatures", "0", "--concurrency", "1"]
    argv += ["--e2e-new-tokens", "6", "--repeats", "1", "--min-prompts", "1", "--draft-rounds", "1", "--threads", "1"]
    assert tree_bench.main(argv + ["--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file() and result["bars"] is None  # the tiny target has no bars
    methods = {r["method"] for r in result["tau"]}
    assert methods == {"dflash", "dflash:tree=4", "dflash2", "dflash2:tree=4"}
    assert {(r["drafter"], r["batch"], r["tree"]) for r in result["draft_ms"]} >= {("dflash2", 1, 4), ("dflash", 4, 0)}
    assert result["projection"]["label"].startswith("PROJECTION")
    assert {r["batch"] for r in result["projection"]["rows"]} == {1, 32}
    assert all(r["same_as_plain"] for r in result["e2e"]["results"])


def test_bars_from_rows():
    def row(method, tau, task="chat"):
        return {"method": method, "temperature": 0.0, "task": task, "tau": tau}

    e2e = {
        "results": [
            {"method": "ar", "concurrency": 1, "speedup_paired": 1.0},
            {"method": "dflash2", "concurrency": 1, "speedup_paired": 1.3},
            {"method": "dflash2:tree=32", "concurrency": 1, "speedup_paired": 1.4},
            {"method": "dflash2:tree=8", "concurrency": 2, "speedup_paired": 9.0},
        ]
    }
    bars = tree_bench.bars([row("dflash2", 2.0), row("dflash2:tree=32", 2.6), row("dflash2", 9.0, "code")], e2e, False)
    (tau, speed) = bars["checks"]
    assert tau["measured"] == pytest.approx(1.3) and tau["passed"]
    assert speed["passed"] and speed["measured"]["tree"] == ["dflash2:tree=32", 1.4]
    assert (
        tree_bench.bars([row("dflash2", 2.0), row("dflash2:tree=32", 2.4)], None, False)["checks"][0]["passed"] is False
    )


def test_tree_flag_rewrites_methods():
    assert with_tree("dflash2", 32) == "dflash2:tree=32"
    assert with_tree("dflash2:sched=confidence,tree=8", 16) == "dflash2:sched=confidence,tree=16"
    assert with_tree("dspark:sched=confidence", 16) == "dspark:sched=confidence"
    assert with_tree("ar", 16) == "ar" and with_tree("dflash", 0) == "dflash"
    with pytest.raises(SystemExit):
        e2e_bench.main(["--tree", "1", "--methods", "ar", "dflash"])
