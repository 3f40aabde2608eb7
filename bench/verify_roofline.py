"""On-paper roofline of the CUDA `verify` and `tree_verify` kernels: the bytes each phase must
read, the time those bytes take at the HBM bandwidth, and the grid each phase launches, for
B in {1, 8, 32, 64} x k in {4, 8} drafts (verify) or N in {16, 32, 64} tree nodes
(tree_verify) x V in {32000, 128256, 151936} (bf16 logits, sampled requests, one-hot drafts:
the logits alone). Nothing is timed: this is the bar the first GPU run is measured against
(flashspark_bench_cuda, bench/verify_bench.py and bench/tree_verify_bench.py --device cuda).

    python bench/verify_roofline.py                 # H200: 4.8 TB/s
    python bench/verify_roofline.py --peak-gbs 3350 # H100 SXM

Writes bench/results/verify_roofline.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os

# The kernel's launch constants (csrc/include/flashspark/verify.h, cuda/verify.cuh);
# tests/test_bench.py checks that they match the sources.
VERIFY_CHUNK = 4096  # kVerifyChunk: elements per (row, chunk) tile
VERIFY_THREADS = 256  # kVerifyThreads: threads of a tile or race block
VERIFY_WALK_WARPS = 4  # kVerifyWalkWarps: requests per block of the walk and finish kernels

HERE = os.path.dirname(os.path.abspath(__file__))


def verify_bytes(batch: int, k: int, vocab: int, elem_bytes: int = 2, races: int | None = None) -> dict:
    """Bytes the two phases read for B requests of k drafts each: phase 1 every row once (the k
    draft rows and the bonus row of each request), phase 2 each racing request's stop row again
    (``races``: all of them by default, as for sampled requests; 0 when all are greedy)."""
    races = batch if races is None else races
    row = vocab * elem_bytes
    phase1 = batch * (k + 1) * row
    phase2 = races * row
    return {"phase1": phase1, "phase2": phase2, "total": phase1 + phase2}


def grids(batch: int, k: int, vocab: int) -> dict:
    """The launch shape of each of the four kernels, as launch_verify computes it."""
    chunks = -(-vocab // VERIFY_CHUNK)
    walk = -(-batch // VERIFY_WALK_WARPS)
    return {
        "tiles": (chunks, min(batch * (k + 1), 65535), VERIFY_THREADS),
        "walk": (walk, 1, 32 * VERIFY_WALK_WARPS),
        "race": (chunks, min(batch, 65535), VERIFY_THREADS),
        "finish": (walk, 1, 32 * VERIFY_WALK_WARPS),
    }


def tree_bytes(batch: int, nodes: int, vocab: int, elem_bytes: int = 2, races: int | None = None) -> dict:
    """tree_verify's bytes: phase 1 every node row once (N per request: the tree's rows are the
    target forward's output, all of them reduced in parallel before the walks), phase 2 each
    racing request's stop row again: verify's bytes for N - 1 drafts and the bonus row."""
    return verify_bytes(batch, nodes - 1, vocab, elem_bytes, races)


def tree_table(peak_gbs: float) -> list[dict]:
    """The tree rows: the same four launches over N rows per request (verify's k = N - 1)."""
    return [
        dict(
            batch=r["batch"], nodes=r["k"] + 1, **{c: v for c, v in r.items() if c not in ("batch", "k", "tile_blocks")}
        )
        for r in _rows(peak_gbs, [n - 1 for n in (16, 32, 64)])
    ]


def table(peak_gbs: float) -> list[dict]:
    return _rows(peak_gbs, [4, 8])


def _rows(peak_gbs: float, ks: list[int]) -> list[dict]:
    """One row per (V, k, B) of verify's bytes and launch grids."""
    rows = []
    for vocab in (32000, 128256, 151936):
        for k in ks:
            for batch in (1, 8, 32, 64):
                b = verify_bytes(batch, k, vocab)
                g = grids(batch, k, vocab)
                rows.append(
                    dict(
                        batch=batch,
                        k=k,
                        vocab=vocab,
                        mb=b["total"] / 1e6,
                        phase1_mb=b["phase1"] / 1e6,
                        phase2_mb=b["phase2"] / 1e6,
                        roofline_us=b["total"] / (peak_gbs * 1e3),
                        tiles_grid=g["tiles"],
                        race_grid=g["race"],
                        walk_grid=g["walk"],
                        tile_blocks=g["tiles"][0] * g["tiles"][1],
                    )
                )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM bandwidth in GB/s (default: H200)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_roofline"), help="path without suffix")
    args = ap.parse_args(argv)
    rows = table(args.peak_gbs)
    head = (
        "|   B |  k |      V |     MB | phase 1 MB | phase 2 MB | roofline µs | tiles grid (x, y) × threads "
        "| race grid | walk / finish blocks |"
    )
    lines = [
        f"On-paper roofline of `verify` (CUDA, bf16 logits, sampled requests, one-hot drafts) at "
        f"{args.peak_gbs:.0f} GB/s. Phase 1 reads every row once, phase 2 each request's stop row.",
        "",
        head,
        "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|",
    ]
    for r in rows:
        t, rc, w = r["tiles_grid"], r["race_grid"], r["walk_grid"]
        lines.append(
            f"| {r['batch']:3d} | {r['k']:2d} | {r['vocab']:6d} | {r['mb']:6.1f} | {r['phase1_mb']:10.1f} "
            f"| {r['phase2_mb']:10.1f} | {r['roofline_us']:11.2f} | ({t[0]}, {t[1]}) × {t[2]} "
            f"| ({rc[0]}, {rc[1]}) × {rc[2]} | {w[0]} × {w[2]} |"
        )
    trees = tree_table(args.peak_gbs)
    head = "|   B |  N |      V |     MB | phase 1 MB | phase 2 MB | roofline µs | tiles grid (x, y) × threads | race grid |"
    lines += [
        "",
        f"`tree_verify` (same kernels' shapes over N node rows per request, bf16, sampled) at {args.peak_gbs:.0f} GB/s. "
        "Phase 1 reads every node row once, phase 2 each request's stop row.",
        "",
        head,
        "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|",
    ]
    for r in trees:
        t, rc = r["tiles_grid"], r["race_grid"]
        lines.append(
            f"| {r['batch']:3d} | {r['nodes']:2d} | {r['vocab']:6d} | {r['mb']:6.1f} | {r['phase1_mb']:10.1f} "
            f"| {r['phase2_mb']:10.1f} | {r['roofline_us']:11.2f} | ({t[0]}, {t[1]}) × {t[2]} | ({rc[0]}, {rc[1]}) × {rc[2]} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump(
            {"peak_gbs": args.peak_gbs, "command": "python bench/verify_roofline.py", "rows": rows, "tree_rows": trees},
            f,
            indent=1,
        )
    return rows


if __name__ == "__main__":
    main()
