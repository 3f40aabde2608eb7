"""bench/verify_roofline.py: its launch constants are the kernel's, and its bytes and grids
follow the two-phase design (the issue's worked example: B = 32, k = 8, V = 128256, bf16)."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import verify_roofline  # noqa: E402  (bench/ is not a package)


def constant(path: str, name: str) -> int:
    text = (ROOT / path).read_text()
    m = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*(\d+)", text)
    assert m, f"{name} not found in {path}"
    return int(m.group(1))


def test_constants_match_the_kernel():
    assert verify_roofline.VERIFY_CHUNK == constant("csrc/include/flashspark/verify.h", "kVerifyChunk")
    assert verify_roofline.VERIFY_THREADS == constant("csrc/include/flashspark/cuda/verify.cuh", "kVerifyThreads")
    assert verify_roofline.VERIFY_WALK_WARPS == constant("csrc/include/flashspark/cuda/verify.cuh", "kVerifyWalkWarps")


def test_bytes_and_grids():
    b = verify_roofline.verify_bytes(32, 8, 128256)
    assert b["phase1"] == 32 * 9 * 128256 * 2 and b["phase2"] == 32 * 128256 * 2
    assert abs(b["total"] / 1e6 - 82.1) < 0.1  # about 17 us at 4.8 TB/s
    assert verify_roofline.verify_bytes(4, 2, 10, races=0)["phase2"] == 0  # greedy: no race row
    g = verify_roofline.grids(32, 8, 128256)
    assert g["tiles"] == (32, 288, 256) and g["race"] == (32, 32, 256) and g["walk"] == (8, 1, 128)
    assert verify_roofline.grids(8000, 8, 10)["tiles"][1] == 65535  # the hardware's grid.y bound


def test_table_writes_every_combination(tmp_path):
    rows = verify_roofline.main(["--out", str(tmp_path / "r")])
    assert len(rows) == 4 * 2 * 3
    text = (tmp_path / "r.md").read_text()
    assert text.count("\n|") == 2 + 24 + 2 + 36  # verify's table, then tree_verify's (3 V x 3 N x 4 B)


def test_tree_bytes():
    """tree_verify reads every node row once, then each racing request's stop row."""
    b = verify_roofline.tree_bytes(8, 32, 151936)
    assert b["phase1"] == 8 * 32 * 151936 * 2 and b["phase2"] == 8 * 151936 * 2
    assert verify_roofline.tree_bytes(8, 32, 151936, races=0)["phase2"] == 0
    # a chain of N nodes is verify's k = N - 1 drafts plus the bonus row: the same bytes
    assert verify_roofline.tree_bytes(4, 9, 1000) == verify_roofline.verify_bytes(4, 8, 1000)
