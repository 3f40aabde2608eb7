"""Two builds of flashspark side by side: the same op calls timed under each build's
package directory, in child processes run alternately (A, B, A, B, ...), so both see
the same machine state. Prints a table with the median of each build and B / A, and
writes JSON.

    # A = a checkout of the old commit, built with `python setup.py build_ext --inplace`
    python bench/ops_ab.py --builds OLD_CHECKOUT/python python --labels OLD_COMMIT NEW_COMMIT --rounds 3

The calls: verify (dense q, one-hot drafts and probabilities at T = 1, greedy; V = 4096 to
151936, fp32 and bf16), markov_step and topk_select at a drafter's sizes; one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from timing import run_child

HERE = os.path.dirname(os.path.abspath(__file__))


def median_us(f, n=15) -> float:
    f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e6


def measure() -> dict:
    """Runs in the child: times every call under the build on sys.path."""
    import flashspark
    from flashspark import ops
    from verify_bench import make_batch

    torch.set_num_threads(1)
    out = {}
    # (B, gamma, V, dtype, mode): the dense q at T = 1 of verify_bench, one-hot (deterministic)
    # drafts, greedy, and the probabilities mode
    for batch, gamma, vocab, dtype, mode in [
        (1, 7, 4096, torch.float32, "dense"),
        (1, 8, 151936, torch.float32, "dense"),
        (1, 8, 151936, torch.bfloat16, "dense"),
        (1, 8, 151936, torch.float32, "onehot"),
        (1, 8, 151936, torch.bfloat16, "onehot"),
        (1, 8, 151936, torch.float32, "probs"),
        (32, 7, 4096, torch.float32, "dense"),
        (32, 8, 32000, torch.bfloat16, "onehot"),
        (8, 7, 4096, torch.float32, "greedy"),
        (1, 8, 151936, torch.float32, "greedy"),
    ]:
        logits, tokens, cu, kw = make_batch(batch, gamma, vocab, dtype, "cpu")
        if mode in ("greedy", "onehot"):
            kw.pop("draft_probs")
        if mode == "greedy":
            kw["temperature"] = torch.zeros(batch)
        if mode == "probs":
            logits = torch.softmax(logits.float(), dim=-1)
            kw["target_is_probs"] = True
        name = f"verify B={batch} gamma={gamma} V={vocab} {str(dtype)[6:]} {mode}"
        try:
            out[name] = median_us(lambda: flashspark.verify(logits, tokens, cu, **kw))
        except (TypeError, RuntimeError):  # a build older than the call (e.g. no probabilities mode)
            out[name] = None
    g = torch.Generator().manual_seed(0)
    vocab, rank, hidden = 4096, 256, 256
    for batch in (1, 16):
        base, prev = torch.randn(batch, vocab, generator=g), torch.randint(0, vocab, (batch,), generator=g)
        w1, w2 = torch.randn(vocab, rank, generator=g), torch.randn(vocab, rank, generator=g)
        h, cw = torch.randn(batch, hidden, generator=g), torch.randn(hidden + rank, generator=g)
        kw = dict(
            temperature=torch.ones(batch), seeds=torch.arange(batch), positions=torch.zeros(batch, dtype=torch.int64)
        )
        out[f"markov_step B={batch} V={vocab} r={rank}"] = median_us(
            lambda: ops.markov_step(base, prev, w1, w2, h, cw, torch.zeros(1), **kw)
        )
        rows = torch.randn(batch * 7, vocab, generator=g)
        out[f"topk_select {batch * 7} x {vocab}"] = median_us(lambda: ops.topk_select(rows, 16))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--builds", nargs=2, metavar=("A", "B"), help="the two package directories (each holds flashspark/)"
    )
    ap.add_argument("--labels", nargs=2, default=["A", "B"], help="what the two builds are (e.g. two commits)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ops_ab.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure()))
        return
    if not args.builds:
        ap.error("--builds A B is required")
    runs = {"A": [], "B": []}
    for r in range(args.rounds):
        for label, path in zip("AB", args.builds):
            runs[label].append(run_child(__file__, path))
            print(f"round {r + 1}/{args.rounds}: build {label} done", file=sys.stderr)
    rows = []
    for name in runs["A"][0]:
        if any(run.get(name) is None for run in runs["A"] + runs["B"]):
            rows.append({"call": name, "A_us": None, "B_us": None, "B_over_A": None})  # a build lacks it
            continue
        a = sorted(run[name] for run in runs["A"])[len(runs["A"]) // 2]
        b = sorted(run[name] for run in runs["B"])[len(runs["B"]) // 2]
        rows.append({"call": name, "A_us": a, "B_us": b, "B_over_A": b / a})
    print(f"{'call':48s} {'A (us)':>10s} {'B (us)':>10s} {'B / A':>7s}")
    for row in rows:
        if row["A_us"] is None:
            print(f"{row['call']:48s} {'(not in both builds)':>29s}")
            continue
        print(f"{row['call']:48s} {row['A_us']:10.1f} {row['B_us']:10.1f} {row['B_over_A']:7.3f}")
    with open(args.out, "w") as f:
        json.dump(
            {"builds": dict(zip("AB", args.labels)), "rounds": args.rounds, "threads": 1, "rows": rows, "runs": runs},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
