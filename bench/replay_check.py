"""Validate the replay on this CPU: replay what `e2e_bench` measured, on the same prompts, at the
same concurrencies and repeats, priced by this machine's fitted cost model, and compare the
speedups over plain decoding.

    python bench/cost_fit.py                                   # this CPU's forward model
    python bench/replay_check.py --measure                     # -> bench/results/replay_check_tiny.json
    python bench/replay_check.py runs/e2e_code_t0.json ...     # against e2e_bench files already measured
    python bench/replay_check.py --rounds-from R.json --out R.json   # check a --measure result's rounds again

This machine's speed drifts by tens of percent within minutes (a shared host: the same
`e2e_bench` row's repeats spread 10-60%), so prices measured in one spell and speedups in
another disagree whatever the model. `--measure` therefore measures in rounds: the rest of
every kind of loop step (cost_fit's `step_rests`: the level the fitted forward model misses;
the kinds timed in turn, several times over, as a speculative step's price is read against a
plain one's) and then one repeat of every method under `e2e_bench`, one after the other in one
process; the replay prices each round's repeats with that round's rests. The forward model itself (the fitted
`Hardware`, which shapes a step's cost over verify widths, contexts and batch sizes) comes from
the cost file, as in every replay.

For each row the replay decodes the trace's requests of that task (the first `prompts` of
them, in order, in batches of c) under the row's method: plain decoding, a fixed K of a drafter
(its trace cut at K), or DSpark's scheduler on DSpark's head or the DFlash 2 proxy with a
`Decoder`'s batch verdict, one untaught policy per method in every (concurrency, repeat) cell,
as `e2e_bench` starts its decoders (`Decoder.forget`). Each cell compares a replayed speedup
with the measured one of the same kind (`--compare`): the median over repeats of the ratio to plain
decoding's repeat beside it (`e2e_bench`'s "paired"; the default), or the best repeat over
plain decoding's best; the table shows both. Agreement: within ±10% (`--tolerance`) in every
cell. The traces must come from the same drafters, prompts and max_new_tokens (checked) and the
same stopping rule: `e2e_bench` decodes `max_new_tokens` per request with no early stop, which
the tiny target's traces do too.
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
from flashspark.scheduling import costs
from flashspark.scheduling.replay import FixedPolicy, Trace, replay

RESULTS = Path(__file__).resolve().parent / "results"
COMBO_METHOD = "dflash2:sched=confidence"
# Issue 33's bars for the combination measured on this CPU (the replay's are combo_replay.BARS).
BARS = {"over_best_fixed": 0.95, "over_plain": 0.97}
# Plain decoding, fixed K of every drafter (DFlash also at K = 3), both confidence schedulers.
METHODS = ["ar", "dflash", "dflash:k=3", "dflash2", "dspark", "dspark:sched=confidence", COMBO_METHOD]


def policy_for(method: str, traces: dict, hardware, rest: dict, target: str, elem: float):
    """(trace, step costs, policy) replaying an `e2e_bench` method, or a ValueError for one the
    replay cannot."""
    spec = None if method == "ar" else parse_method(method)
    if spec is not None and spec.drafter not in traces:
        raise ValueError(f"{method}: no {spec.drafter} trace")
    if spec is None:  # plain decoding reads no drafts: any trace of the prompts whose steps were measured
        measured = [d for d in traces if rest and d in rest["speculative"]]
        tr = traces[measured[0] if measured else next(iter(traces))]
    else:
        tr = traces[spec.drafter]
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


def load_traces(traces_dir: Path, target: str, temperature: float) -> dict:
    traces = {}
    for d in NAMES:
        path = traces_dir / f"{target}_{d}_t{temperature:g}.npz"
        if path.is_file():
            traces[d] = Trace.load(path)
    if not traces:
        raise FileNotFoundError(f"no {target} traces at T = {temperature:g} in {traces_dir}")
    return traces


def decoded_requests(trace: Trace, e2e: dict) -> np.ndarray:
    """The trace's requests an `e2e_bench` run decoded, in its order: found by their prompts
    where the run records them, else its task's first `prompts` requests (the tiny target's
    held-out prompts are spread over the set, so only the same count selects the same ones)."""
    task = trace.meta["tasks"].index(e2e["task"])
    of_task = np.flatnonzero(np.array(trace.meta["task_of_request"]) == task)
    if "prompt_ids" not in e2e:
        if len(of_task) < e2e["prompts"]:
            raise ValueError(f"the traces hold {len(of_task)} {e2e['task']} prompts, the e2e run {e2e['prompts']}")
        return of_task[: e2e["prompts"]]
    index = {tuple(p): r for r, p in enumerate(trace.prompts())}
    missing = sum(tuple(p) not in index for p in e2e["prompt_ids"])
    if missing:
        raise ValueError(f"{missing} of the e2e run's {len(e2e['prompt_ids'])} prompts are not in the traces")
    return np.array([index[tuple(p)] for p in e2e["prompt_ids"]])


def check(
    rounds: list[tuple[dict, dict]],
    traces_dir: Path,
    target: str,
    hardware,
    elem: float,
    tolerance: float,
    compare: str = "paired",
) -> list[dict]:
    """Rows of the check for `rounds`: (an `e2e_bench` result, the step rests measured beside it)
    pairs of one task and temperature. Each repeat of a round is replayed at its round's step
    prices, in the order `e2e_bench` ran them (concurrency, then repeat), each method's policy
    untaught where its decoder was: `e2e_bench.run` starts them untaught (`Decoder.forget`) in
    every (concurrency, repeat) cell (runs recorded before it did so, without the result's
    "untaught": "cell", once per run, carried through it), their step-rate profiles (the
    schedulers' tables, here the first round's prices) kept."""
    e2e = rounds[0][0]
    t = float(e2e["temperature"])
    traces = load_traces(traces_dir, target, t)
    meta = next(iter(traces.values())).meta
    if meta["max_new_tokens"] != e2e["max_new_tokens"]:
        raise ValueError(f"traces decode {meta['max_new_tokens']} new tokens, the e2e run {e2e['max_new_tokens']}")
    if meta.get("eos_id") is not None:
        raise ValueError("the traces stop at EOS while e2e_bench decodes max_new_tokens: record them without it")
    requests = decoded_requests(next(iter(traces.values())), e2e)
    methods = e2e["methods"]
    concurrency = sorted({r["concurrency"] for r in e2e["results"]})
    measured: dict[tuple[str, int], list[float]] = {}  # tokens/s of every repeat of every round
    for run, _ in rounds:
        for r in run["results"]:
            measured.setdefault((r["method"], r["concurrency"]), []).extend(
                r["new_tokens"] / s for s in r["seconds_repeats"]
            )
    rates = {m: {c: [] for c in concurrency} for m in methods}

    def fresh():  # untaught policies, their tables priced as the first round's
        return {m: policy_for(m, traces, hardware, rounds[0][1], target, elem) for m in methods}

    for run, rest in rounds:
        # e2e_bench starts its decoders untaught in every (concurrency, repeat) cell; runs that
        # do not say so started them once per run and carried them through it.
        per_cell = run.get("untaught") == "cell"
        policies = fresh()
        priced = {m: step_costs(tr, hardware, rest, bytes_per_value=elem) for m, (tr, _, _) in policies.items()}
        for c in concurrency:
            for _ in range(run["repeats"]):
                policies = fresh() if per_cell else policies
                for m, (tr, _, policy) in policies.items():
                    rates[m][c].append(replay(tr, policy, c, priced[m], requests).tokens_per_s)
    rows = []
    for method in methods:
        for c in concurrency:
            ours, plain = rates[method][c], rates["ar"][c]
            got, got_plain = measured[(method, c)], measured[("ar", c)]
            replayed = {
                "best": max(ours) / max(plain),
                "paired": statistics.median(m / p for m, p in zip(ours, plain)),
            }
            meas = {
                "best": max(got) / max(got_plain),
                "paired": statistics.median(m / p for m, p in zip(got, got_plain)),
            }
            error = replayed[compare] / meas[compare] - 1.0
            rows.append(
                {
                    "task": e2e["task"],
                    "temperature": t,
                    "method": method,
                    "concurrency": c,
                    "measured": meas[compare],
                    "replayed": replayed[compare],
                    "relative_error": error,
                    "agrees": abs(error) <= tolerance,
                    "measured_paired": meas["paired"],
                    "replayed_paired": replayed["paired"],
                    "repeats": len(got),
                }
            )
    return rows


def measured_bars(rows: list[dict]) -> list[dict]:
    """Issue 33's bars on the measured side, per temperature and concurrency: the combination's
    paired speedup over the best fixed K's (the best measured method of a fixed K) and over
    plain decoding's (1 by construction of the paired ratios)."""
    out = []
    for key in sorted({(r["task"], r["temperature"], r["concurrency"]) for r in rows}):
        cell = {
            r["method"]: r["measured_paired"] for r in rows if (r["task"], r["temperature"], r["concurrency"]) == key
        }
        fixed = {m: v for m, v in cell.items() if m != "ar" and parse_method(m).scheduler == "fixed"}
        if COMBO_METHOD not in cell or not fixed:
            continue
        best = max(fixed, key=fixed.get)
        combo = cell[COMBO_METHOD]
        out.append({"task": key[0], "temperature": key[1], "concurrency": key[2], "combination": combo,
                    "best_fixed": best, "best_fixed_speedup": fixed[best],
                    "over_best_fixed": combo / fixed[best], "over_plain": combo,
                    "met": combo / fixed[best] >= BARS["over_best_fixed"] and combo >= BARS["over_plain"]})  # fmt: skip
    return out


def identical_work(groups: list[list[tuple[dict, dict]]]) -> dict | None:
    """The measurement's own noise: every round's cells where the combination decoded every
    batch plainly ran the plain row's own work (the same `generate` calls on the same prompts),
    so their paired ratio would read 1 on a quiet machine. Returns the ratios (plain decoding's
    seconds over the combination's, per round) and the spread of their logs, or None where no
    cell was decoded plainly."""
    ratios = []
    for rounds in groups:
        for e2e, _ in rounds:
            rows = {(r["method"], r["concurrency"]): r for r in e2e["results"]}
            for c in sorted({r["concurrency"] for r in e2e["results"]}):
                combo, plain = rows.get((COMBO_METHOD, c)), rows.get(("ar", c))
                batches = -(-e2e["prompts"] // c)
                if combo is None or plain is None or combo.get("plain_batches") != batches:
                    continue
                ratios.append({"temperature": float(e2e["temperature"]), "concurrency": c,
                               "ratio": plain["seconds"] / combo["seconds"]})  # fmt: skip
    if not ratios:
        return None
    logs = np.log([r["ratio"] for r in ratios])
    return {"cells": ratios, "min": float(np.exp(logs.min())), "max": float(np.exp(logs.max())),
            "log_sd": float(logs.std(ddof=1)) if len(logs) > 1 else 0.0}  # fmt: skip


def measure(args, hardware, elem: float) -> dict[float, list[tuple[dict, dict]]]:
    """`--measure`: per temperature, `--rounds` rounds, each the loop-step rests (cost_fit's
    `step_rests`, from `--rest-repeats` interleaved runs of every kind) then one
    `e2e_bench` repeat of every method, right after one another in one process, so that the
    prices and the speedups they are checked against come from the same minutes of a machine
    whose speed drifts (module docstring)."""
    import cost_fit
    import e2e_bench

    target_args = (
        [] if args.target == "tiny" else ["--model", args.target] + (["--dtype", args.dtype] if args.dtype else [])
    )
    e2e_args = e2e_bench.parser().parse_args(
        ["--task", args.task, "--min-prompts", str(args.prompts), "--repeats", "1", "--threads", str(args.threads)]
        + ["--concurrency", *map(str, args.concurrency), "--methods", *args.methods, *target_args]
    )
    bench_target = e2e_bench.load_target(e2e_args)
    target = bench_target.model
    shape = costs.ForwardShape.of_decoder(target.config, elem, elem)
    methods = e2e_bench.make_methods(e2e_args, target)
    drafters = {parse_method(m).drafter: methods[m].drafter for m in args.methods if m != "ar"}  # loaded once
    # Per temperature: the traces' own requests of the task (the first --prompts), decoded as recorded.
    runs = {}
    for t in args.temperatures:
        trace = next(iter(load_traces(Path(args.traces), args.target, t).values()))
        of_task = np.flatnonzero(np.array(trace.meta["task_of_request"]) == trace.meta["tasks"].index(args.task))
        prompts = trace.prompts()
        run_args = argparse.Namespace(
            **vars(e2e_args) | {"temperature": t, "max_new_tokens": trace.meta["max_new_tokens"]}
        )
        runs[t] = (run_args, [prompts[i] for i in of_task[: args.prompts]])
    spans, prefill_len = cost_fit.rest_spans(
        [len(p) for _, prompts in runs.values() for p in prompts],
        [len(p) + a.max_new_tokens for a, prompts in runs.values() for p in prompts],
    )
    contexts = args.step_contexts or spans
    out: dict[float, list[tuple[dict, dict]]] = {t: [] for t in args.temperatures}
    for r in range(args.rounds):
        for t, (run_args, prompts) in runs.items():
            print(f"round {r + 1}/{args.rounds}, T = {t:g}", flush=True)
            rest, _ = cost_fit.step_rests(
                target, shape, hardware, elem, drafters, [t], args.concurrency, contexts, args.rest_repeats,
                drafts=(*args.rest_drafts, None), prefill_len=prefill_len, steps=args.rest_steps,
            )  # fmt: skip
            out[t].append((e2e_bench.run(run_args, bench_target, methods, prompts), rest))
    return out


def stored_rounds(groups: list[list[tuple[dict, dict]]]) -> list[dict]:
    """The rounds as a result stores them (what `--rounds-from` reads back)."""
    return [{"e2e": e2e, "step_rest": rest} for rounds in groups for e2e, rest in rounds]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("e2e", nargs="*", help="e2e_bench JSON files (one task and temperature each)")
    p.add_argument("--target", default="tiny", help="whose traces and cost model (default %(default)s)")
    p.add_argument("--traces", default=str(TRACES))
    p.add_argument("--cost-file", default=None, help="a cost_fit.py JSON (default: the committed one)")
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument(
        "--compare",
        choices=("best", "paired"),
        default="paired",
        help="which speedup the replay must match: the median over repeats of the ratio to plain decoding's "
        "repeat beside it (default), or the best repeat over plain decoding's best",
    )
    p.add_argument(
        "--measure",
        action="store_true",
        help="measure instead of reading e2e files: rounds of the step rests and one e2e_bench repeat, interleaved",
    )
    g = p.add_argument_group("--measure")
    g.add_argument("--rounds", type=int, default=4)
    g.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    g.add_argument("--task", default="code")
    g.add_argument("--prompts", type=int, default=8, help="the first this many of the traces' requests of --task")
    g.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    g.add_argument("--methods", nargs="+", default=METHODS)
    g.add_argument(
        "--step-contexts",
        type=int,
        nargs="+",
        default=None,
        help="contexts the step rests are measured at (default: the shortest prompt, the longest decoded to the end)",
    )
    g.add_argument(
        "--rest-steps",
        type=int,
        default=2,
        help="a speculative rest's run decodes this many x (K + 1) tokens (default %(default)s)",
    )
    g.add_argument(
        "--rest-drafts",
        type=int,
        nargs="*",
        default=[3],
        help="K values each drafter's step rest is measured at besides its full width (default %(default)s)",
    )
    g.add_argument("--dtype", default=None, help="the target's dtype (as e2e_bench; --target other than tiny)")
    g.add_argument("--threads", type=int, default=2)
    g.add_argument(
        "--rest-repeats",
        type=int,
        default=3,
        help="runs of every kind of loop step per round, interleaved (a plain step: their median; a "
        "speculative one: paired with the plain runs, cost_fit.step_rests)",
    )
    p.add_argument(
        "--rounds-from",
        default=None,
        help="check again the rounds stored in an earlier --measure result (its JSON), measuring nothing",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if bool(args.e2e) + args.measure + bool(args.rounds_from) != 1:
        p.error("give e2e_bench JSON files, --measure or --rounds-from (one of them)")
    out = Path(args.out) if args.out else RESULTS / f"replay_check_{args.target}.json"
    try:
        hardware, rest, _, elem = cost_model("cpu", args.target, args.cost_file)
        if args.measure:
            groups = list(measure(args, hardware, elem).values())
            # Kept before the check: an hour of measurement outlives a check that cannot read it.
            timing.save_result(
                {**timing.result_header("replay_check", "replay_check.py", argv, "cpu"), "checked": False}
                | {"rounds": stored_rounds(groups)},
                out,
            )
        elif args.rounds_from:
            source = json.loads(Path(args.rounds_from).read_text())
            by_t: dict[float, list[tuple[dict, dict]]] = {}
            for r in source["rounds"]:
                by_t.setdefault(float(r["e2e"]["temperature"]), []).append((r["e2e"], r["step_rest"]))
            groups = list(by_t.values())
        else:
            groups = [[(json.loads(Path(path).read_text()), rest)] for path in args.e2e]
        rows = []
        for rounds in groups:
            rows += check(rounds, Path(args.traces), args.target, hardware, elem, args.tolerance, args.compare)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'':>42} {args.compare + ' of repeats':>26} {'paired':>19}")
    print(f"{'task':>6} {'T':>3} {'method':>28} {'c':>3} {'measured':>9} {'replayed':>9} {'error':>7}"
          f" {'measured':>9} {'replayed':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['task']:>6} {r['temperature']:>3g} {r['method']:>28} {r['concurrency']:>3} {r['measured']:>8.2f}x "
            f"{r['replayed']:>8.2f}x {100 * r['relative_error']:>+6.1f}% {r['measured_paired']:>8.2f}x "
            f"{r['replayed_paired']:>8.2f}x{'' if r['agrees'] else '  OUTSIDE'}"
        )
    agree = sum(r["agrees"] for r in rows)
    worst = max(abs(r["relative_error"]) for r in rows)
    print(f"{agree} of {len(rows)} cells within ±{100 * args.tolerance:.0f}% (worst {100 * worst:.1f}%)")
    bars = measured_bars(rows)
    if bars:
        print(f"measured: the combination over the best fixed K (bar {BARS['over_best_fixed']}) and over plain "
              f"(bar {BARS['over_plain']}), paired")  # fmt: skip
        for b in bars:
            print(f"{b['task']:>6} {b['temperature']:>3g} c={b['concurrency']:<3} {b['over_best_fixed']:.3f} "
                  f"({b['best_fixed']} {b['best_fixed_speedup']:.2f}x) {b['over_plain']:.3f}"
                  f"{'' if b['met'] else '  NOT MET'}")  # fmt: skip
    noise = identical_work(groups)
    if noise:
        print(f"identical work (the combination's all-plain cells against the plain row, {len(noise['cells'])} "
              f"round cells): {noise['min']:.2f}-{noise['max']:.2f}x, log SD {100 * noise['log_sd']:.1f}%")  # fmt: skip
    result = {
        **timing.result_header("replay_check", "replay_check.py", argv, "cpu"),
        "label": "REPLAY against measured",
        "target": args.target,
        "hardware": hardware.to_dict(),
        "compare": args.compare,
        "tolerance": args.tolerance,
        "agree": agree,
        "cells": len(rows),
        "worst_relative_error": worst,
        "rows": rows,
        "measured_bars": bars,
        "identical_work": noise,
    }
    if args.e2e:
        result |= {"e2e_files": [str(x) for x in args.e2e], "step_rest": rest}
    else:
        result["rounds"] = stored_rounds(groups)
    if args.rounds_from:  # where the measurement comes from: its file, date and command
        result["rounds_from"] = {"file": str(args.rounds_from)} | {
            k: source.get("rounds_from", {}).get(k, source.get(k)) for k in ("date", "command")
        }
    timing.save_result(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
