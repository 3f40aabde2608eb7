"""`scripts/gpu_train_smollm2.sh` at its toy size (TOY=1: the CPU, the tiny target, seconds per
step): every step of the GPU pipeline runs (held-out, calibration and training data; DFlash with
the target's own layers; DFlash 2 and DSpark on its frozen backbone, reading its shards; the
proxy and priors fit last), the drafters land in OUT_DIR in shards no larger than asked, with
their index, and load and decode; a second run skips every finished step."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from flashspark.decoding.loop import speculative_generate
from flashspark.methods import PRIOR_FILE, PROXY_FILES, load_method_drafter
from flashspark.models import catalog
from flashspark.models.io import INDEX_NAME

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_train_smollm2.sh"

pytestmark = pytest.mark.slow


def run(out: Path, work: Path) -> str:
    env = {**os.environ, "TOY": "1", "WORK": str(work), "PY": str(Path(os.sys.executable))}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_gpu_pipeline_at_toy_size(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    run(out, work)
    pipeline = json.loads((out / "pipeline.json").read_text())
    steps = ["data_heldout", "data_calibration", "data", "dflash", "dflash2", "dspark"]
    steps += ["fit_proxy", "fit_prior_dflash2", "fit_prior_dspark"]
    assert list(pipeline["step_seconds"]) == steps and pipeline["device"] == "cpu"
    assert set(pipeline["held_out_tau"]) == {"dflash", "dflash2", "dspark"}
    target = catalog.load_target(catalog.resolve_target("tiny"))
    prompts = [[5, 6, 7, 8, 9, 10]]
    for name in ("dflash", "dflash2", "dspark"):
        d = out / name
        index = json.loads((d / INDEX_NAME).read_text())
        files = set(index["weight_map"].values())
        shards = sorted(f for f in files if "/" not in f)
        assert sorted(p.name for p in d.glob("*.safetensors")) == shards
        assert all((d / s).stat().st_size <= 2**20 for s in shards)
        # the frozen backbone is read from ../dflash's shards, not copied
        assert (
            len(shards) > 1
            if name == "dflash"
            else files - set(shards) and all(f.startswith("../dflash/") for f in files - set(shards))
        )
        assert (d / "MODEL_CARD.md").is_file() and (d / "config.json").is_file()
        if name != "dflash":  # the scheduler's prior (and DFlash 2's proxy) fit on the new drafter
            assert (d / PRIOR_FILE).is_file() and (name == "dspark" or (d / PROXY_FILES[0]).is_file())
        drafter = load_method_drafter(name, target, d)
        with torch.no_grad():
            tokens, stats = speculative_generate(target, drafter, prompts, max_new_tokens=12)
        assert len(tokens[0]) == 12 and stats["tau"] >= 1
    # Run again: every step is done, nothing retrains.
    again = run(out, work)
    assert all(f"== {s}: done" in again for s in steps)
