"""bench/calibration_bench.py on the tiny target, two prompts and a few tokens: every row at
every temperature (the online ones beside the offline ones), the reliability plots, and the
default output names per target."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import calibration_bench  # noqa: E402  (bench/ is not a package)

ROWS = [
    calibration_bench.DSPARK_HEAD,
    calibration_bench.DSPARK_MARGIN,
    calibration_bench.PROXY,
    calibration_bench.PROXY_ONLINE,
    calibration_bench.SELECTOR,
    calibration_bench.DFLASH2_MARGIN,
]


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # main sets --threads


def test_main_on_the_tiny_target(tmp_path, restore_threads):
    out = tmp_path / "cal.json"
    argv = ["--prompts", "1", "--max-new-tokens", "8", "--batch-size", "2", "--temperatures", "0", "1"]
    assert calibration_bench.main([*argv, "--threads", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["target"] == "tiny" and res["prompts"] == 2 and set(res["temperatures"]) == {"0", "1"}
    for t, per_t in res["temperatures"].items():
        reports = per_t["reports"]
        assert list(reports) == ROWS
        for name, r in reports.items():
            assert r["observations"] > 0, (t, name)
            assert 0.0 <= r["ece_cumulative"] <= 1.0, (t, name)
            assert math.isnan(r["auc"]) or 0.0 <= r["auc"] <= 1.0, (t, name)
        # Both drafters' outcomes are scored once per source: the same observations per drafter.
        assert reports[calibration_bench.DSPARK_MARGIN]["observations"] == reports[ROWS[0]]["observations"]
        assert len({reports[n]["observations"] for n in ROWS[2:]}) == 1
        state = per_t["online_final_state"][calibration_bench.DFLASH2_MARGIN]
        assert state["steps_observed"] > 0 and len(state["slope"]) == state["width"]
        assert (tmp_path / per_t["plot"]).is_file() and per_t["plot"] == f"cal_t{t}.png"


def test_default_output_names():
    tiny = SimpleNamespace(tiny=True)
    smollm2 = SimpleNamespace(tiny=False, ref=SimpleNamespace(known=SimpleNamespace(name="smollm2")))
    other = SimpleNamespace(tiny=False, ref=SimpleNamespace(known=None, path=Path("models") / "my-model.gguf"))
    assert calibration_bench.default_out(tiny).name == "calibration.json"
    assert calibration_bench.default_out(smollm2).name == "calibration_smollm2.json"
    assert calibration_bench.default_out(other).name == "calibration_my-model.json"
