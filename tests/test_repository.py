"""The repository as a whole: its tracked files stay under the size a GPU machine's copy allows,
and every shipped checkpoint loads its weights (those read from a shared backbone included)."""

import subprocess
from pathlib import Path

import pytest
from flashspark import data
from flashspark.models.io import has_weights, load_state_dict

ROOT = Path(__file__).resolve().parent.parent
CAP_BYTES = 60 * 10**6


def test_tracked_files_fit_the_size_cap():
    """Under 60 MB, so that the whole tree can be copied to a GPU machine (bench/gpu_check.sh). The
    shipped drafters are most of it: SmolLM2's DFlash 2 and DSpark read the DFlash backbone's file
    (14 MB in bf16) rather than each holding a copy (`io.save_weights(share_with=...)`)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / f for f in listed.decode().split("\0") if f]
    total = sum(f.stat().st_size for f in files if f.is_file())
    assert total < CAP_BYTES, f"tracked files are {total / 1e6:.1f} MB"


def test_every_shipped_checkpoint_reads_all_its_weights():
    """A shared file that changed (the backbone retrained without its dependants re-exported) is
    refused at load with its sha256; here every shipped directory's files agree."""
    dirs = [p.parent for p in data.ASSETS_DIR.rglob("config.json") if has_weights(p.parent)]
    assert len(dirs) >= 4
    for d in dirs:
        assert load_state_dict(d), d
