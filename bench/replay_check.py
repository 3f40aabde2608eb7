"""Validate the replay on this CPU: replay what `e2e_bench` measured, on the same prompts, at the
same concurrencies and repeats, priced by this machine's fitted cost model, and compare the
speedups over plain decoding.

    python bench/cost_fit.py                                                  # this CPU's description
    python bench/e2e_bench.py --task code --min-prompts 16 --concurrency 1 2 4 8 --repeats 3 \
        --methods ar dflash dflash:k=3 dflash2 dspark dspark:sched=confidence dflash2:sched=confidence \
        --out runs/e2e_code_t0.json                                           # (and --temperature 1)
    python bench/replay_check.py runs/e2e_code_t0.json runs/e2e_code_t1.json  # -> bench/results/replay_check_tiny.json

For each row of each `e2e_bench` JSON the replay decodes the trace's requests of that task (the
first `prompts` of them, in order, in batches of c) under the row's method: plain decoding,
a fixed K of a drafter (its trace cut at K), or DSpark's scheduler on DSpark's head or the
DFlash 2 proxy with a `Decoder`'s batch verdict, one policy per method carried across
concurrencies and repeats as `e2e_bench` carries its decoders. The replayed speedup is the
median over repeats of the method's tokens/s over plain's, as `e2e_bench`'s paired speedup.
Agreement: within ±10% (`--tolerance`) in every cell. The traces must come from the same
drafters, prompts and max_new_tokens (checked) and the same stopping rule: `e2e_bench` decodes
`max_new_tokens` per request with no early stop, which the tiny target's traces do too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import timing
from combo_replay import NAMES, TRACES, cost_model, drafter_dir, scheduler_policy, step_costs
from flashspark.methods import parse_method
from flashspark.scheduling.replay import FixedPolicy, Trace, replay

RESULTS = Path(__file__).resolve().parent / "results"


def policy_for(method: str, traces: dict, hardware, rest: tuple, target: str, elem: float):
    """(trace, step costs, policy) replaying an `e2e_bench` method, or a ValueError for one the
    replay cannot."""
    spec = None if method == "ar" else parse_method(method)
    if spec is not None and spec.drafter not in traces:
        raise ValueError(f"{method}: no {spec.drafter} trace")
    tr = next(iter(traces.values())) if spec is None else traces[spec.drafter]
    sc = step_costs(tr, hardware, rest, bytes_per_value=elem)
    if spec is None:
        return tr, sc, FixedPolicy(0)
    if spec.tree or spec.path != "auto":
        raise ValueError(f"{method}: the traces hold chains of the default path mode")
    if spec.scheduler == "fixed":
        return tr, sc, FixedPolicy(tr.width if spec.k is None else min(spec.k, tr.width))
    if spec.delay or spec.admission != "stop" or not spec.plain_steps or not spec.online or spec.k is not None:
        raise ValueError(f"{method}: the replay runs the confidence scheduler with its default options only")
    source = "dspark_head" if spec.drafter == "dspark" else "proxy"
    name = f"{NAMES[spec.drafter]} + scheduler"
    return tr, sc, scheduler_policy(name, tr, sc, drafter_dir(target, spec.drafter), source, spec.price == "padded")


def check(e2e: dict, traces_dir: Path, target: str, hardware, rest: tuple, elem: float, tolerance: float) -> list[dict]:
    t = float(e2e["temperature"])
    traces = {}
    for d in NAMES:
        path = traces_dir / f"{target}_{d}_t{t:g}.npz"
        if path.is_file():
            traces[d] = Trace.load(path)
    if not traces:
        raise FileNotFoundError(f"no {target} traces at T = {t:g} in {traces_dir}")
    meta = next(iter(traces.values())).meta
    if meta["max_new_tokens"] != e2e["max_new_tokens"]:
        raise ValueError(f"traces decode {meta['max_new_tokens']} new tokens, the e2e run {e2e['max_new_tokens']}")
    if meta.get("eos_id") is not None:
        raise ValueError("the traces stop at EOS while e2e_bench decodes max_new_tokens: record them without it")
    task = meta["tasks"].index(e2e["task"])
    requests = np.flatnonzero(np.array(meta["task_of_request"]) == task)[: e2e["prompts"]]
    if len(requests) < e2e["prompts"]:
        raise ValueError(f"the traces hold {len(requests)} {e2e['task']} prompts, the e2e run {e2e['prompts']}")
    measured = {(r["method"], r["concurrency"]): r["speedup_paired"] for r in e2e["results"]}
    concurrency = sorted({c for _, c in measured})
    rates: dict[str, dict[int, list[float]]] = {}
    for method in e2e["methods"]:
        tr, sc, policy = policy_for(method, traces, hardware, rest, target, elem)
        rates[method] = {
            c: [replay(tr, policy, c, sc, requests).tokens_per_s for _ in range(e2e["repeats"])] for c in concurrency
        }
    rows = []
    for method in e2e["methods"]:
        for c in concurrency:
            replayed = statistics.median(m / p for m, p in zip(rates[method][c], rates["ar"][c]))
            got = measured[(method, c)]
            error = replayed / got - 1.0
            rows.append(
                {
                    "task": e2e["task"],
                    "temperature": t,
                    "method": method,
                    "concurrency": c,
                    "measured": got,
                    "replayed": replayed,
                    "relative_error": error,
                    "agrees": abs(error) <= tolerance,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("e2e", nargs="+", help="e2e_bench JSON files (one task and temperature each)")
    p.add_argument("--target", default="tiny", help="whose traces and cost model (default %(default)s)")
    p.add_argument("--traces", default=str(TRACES))
    p.add_argument("--cost-file", default=None, help="a cost_fit.py JSON (default: the committed one)")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        hardware, rest, _, elem = cost_model("cpu", args.target, args.cost_file)
        rows = []
        for path in args.e2e:
            rows += check(
                json.loads(Path(path).read_text()), Path(args.traces), args.target, hardware, rest, elem, args.tolerance
            )
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'task':>6} {'T':>3} {'method':>28} {'c':>3} {'measured':>9} {'replayed':>9} {'error':>7}")
    for r in rows:
        print(
            f"{r['task']:>6} {r['temperature']:>3g} {r['method']:>28} {r['concurrency']:>3} {r['measured']:>8.2f}x "
            f"{r['replayed']:>8.2f}x {100 * r['relative_error']:>+6.1f}%{'' if r['agrees'] else '  OUTSIDE'}"
        )
    agree = sum(r["agrees"] for r in rows)
    worst = max(abs(r["relative_error"]) for r in rows)
    print(f"{agree} of {len(rows)} cells within ±{100 * args.tolerance:.0f}% (worst {100 * worst:.1f}%)")
    result = {
        **timing.result_header("replay_check", "replay_check.py", argv, "cpu"),
        "label": "REPLAY against measured",
        "target": args.target,
        "hardware": hardware.to_dict(),
        "step_overhead_by_batch": [list(p) for p in rest],
        "e2e_files": [str(x) for x in args.e2e],
        "tolerance": args.tolerance,
        "agree": agree,
        "cells": len(rows),
        "worst_relative_error": worst,
        "rows": rows,
    }
    out = Path(args.out) if args.out else RESULTS / f"replay_check_{args.target}.json"
    timing.save_result(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
