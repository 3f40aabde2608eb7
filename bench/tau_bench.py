"""Held-out τ of each drafter: tokens a request gains per target forward (accepted drafts + 1).

For each method (default: dflash, dflash2 and dspark at fixed K = γ - 1), each temperature
and each task of the target, the first `--prompts` held-out prompts of the task are decoded
in batches of `--batch-size` with the speculative loop, as `flashspark.methods` runs it
(`e2e_bench.make_methods`: `load_method_drafter` + `make_decoder`). τ comes from the loop's
stats: per request (`tau_per_request`) and over all request-steps (accepted drafts plus
steps, over steps, summed over the batches), per task and over all tasks ("all"). Also
reported: the acceptance rate of each draft position and the number of request-steps.
Prints a table, writes bench/results/tau_bench[_<target>].json and a bar chart beside it.

    python bench/tau_bench.py                                # tiny target, T = 0 and 1
    python bench/tau_bench.py --model smollm2                # -> bench/results/tau_bench_smollm2.json, .png
    python bench/tau_bench.py --methods dflash2 --temperatures 0 --prompts 8 --max-new-tokens 64
    python bench/tau_bench.py --model smollm2 --dflash path/to/dflash   # a drafter directory of your own
    python bench/tau_bench.py --tree 32      # DFlash and DFlash 2 verify 32-node trees (DSpark: chains)

The target (`--model`, `--dtype`) and its held-out prompts come from bench/targets.py: the
tiny target's are `--prompt-tokens` long (tasks code, prose), a real target's are the
held-out prompt sets' (tasks chat, code, prose; ragged lengths). A request stops at the
target's EOS token, as a server stops it (for SmolLM2 `<|im_end|>`, which ends a chat
answer: τ over text past it says nothing a user sees), or after `--max-new-tokens`;
`--no-stop-at-eos` decodes exactly `--max-new-tokens` tokens per request instead. The loop
takes one stop token, so a code or prose continuation runs on past `<|endoftext|>`, where
`train data` stopped its continuations. A request its first token ended took no step and
has no τ (`requests_without_steps` counts them).

For a target other than the tiny one the JSON also holds the issue's bars, measured on the
"all" rows of each drafter at its fixed K = γ - 1 (`dflash` or `dflash:k=7` alike): DFlash
τ >= 3.0 at T = 0, and at every temperature measured DFlash 2 τ >= 1.10 x DFlash's and DSpark
τ >= DFlash's (each with its measured value and pass / fail). `--tasks ... general` adds the
general-chat requests the target writes on held-out topics (bench/targets.py): reported in
their own rows, outside "all", with the bar DFlash τ >= 2.5 at T = 0 on them.

    python bench/tau_bench.py --model smollm2 --dtype float32 --tasks general --temperatures 0
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import e2e_bench
import targets
import timing
from flashspark.cli.common import check_args
from flashspark.methods import DRAFTERS, MethodSpec, parse_method

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_METHODS = list(DRAFTERS)
ALL_TASKS = "all"  # the task of the rows aggregated over every task
NAMES = {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}
# The bars for a real target (τ over all tasks).
DFLASH_TAU_BAR = 3.0  # DFlash at T = 0
GENERAL_TAU_BAR = 2.5  # DFlash at T = 0 on the general-chat task (targets.GENERAL)
RATIO_BARS = {"dflash2": 1.10, "dspark": 1.0}  # τ of the method over DFlash's, at each temperature
BAR_TEMPERATURE = 0.0


def check_methods(methods: list[str]) -> None:
    """ValueError for a method without a drafter, a spec the methods module rejects, or a repeat."""
    for m in methods:
        if m == "ar":
            raise ValueError("ar drafts nothing (its τ is 1): --methods takes drafters, " + ", ".join(DRAFTERS))
        parse_method(m)
    if len(set(methods)) < len(methods):
        raise ValueError(f"--methods lists a method twice: {' '.join(methods)}")


def summarize(stats: list[dict]) -> dict:
    """τ and acceptance over the batches of one row, from the loop's per-batch stats."""
    steps = sum(s["steps"] for s in stats)
    accepted = sum(s["drafts_verified"] - s["drafts_wasted"] for s in stats)
    # A request its first token ended (EOS from the prefill) took no step: it has no τ.
    per_request = [t for s in stats for t in s["tau_per_request"] if t is not None]
    stepless = sum(t is None for s in stats for t in s["tau_per_request"])
    # Position k's rate over every request-step of the row that verified draft k (the batches' counts summed).
    width = min(len(s["tried_per_position"]) for s in stats)
    acceptance = [
        sum(s["accepted_per_position"][k] for s in stats) / max(1, sum(s["tried_per_position"][k] for s in stats))
        for k in range(width)
    ]
    return {
        "tau": (accepted + steps) / max(1, steps),
        "tau_request_mean": statistics.fmean(per_request) if per_request else None,
        "tau_request_min": min(per_request, default=None),
        "tau_request_max": max(per_request, default=None),
        "tau_per_request": per_request,
        "requests": len(per_request),
        "requests_without_steps": stepless,
        "steps": steps,
        "accepted": accepted,
        "new_tokens": sum(s["new_tokens"] for s in stats),
        "iterations": sum(s.get("iterations", 0) for s in stats),  # loop iterations: batch forwards
        "acceptance_per_position": acceptance,
        "seconds": sum(s["seconds"] for s in stats),
    }


def measure(args, target: targets.BenchTarget, decoders: dict) -> tuple[list[dict], dict]:
    """Rows (method, temperature, task or "all", τ ...) and the prompt lengths per task."""
    prompts = {task: target.heldout_prompts(task, args.prompts, args.prompt_tokens) for task in args.tasks}
    eos_id = target.eos_id() if args.stop_at_eos else None
    rows = []
    for spec, decode in decoders.items():
        for t in args.temperatures:
            every = []
            for task in args.tasks:
                batches = [prompts[task][i : i + args.batch_size] for i in range(0, args.prompts, args.batch_size)]
                # Batch i draws with seed --seed + i, so its requests' streams differ from other batches'.
                stats = [
                    decode(batch, args.max_new_tokens, t, args.seed + i, eos_id=eos_id)[1]
                    for i, batch in enumerate(batches)
                ]
                if task in target.tasks:  # `general` is reported beside the aggregate, not in it
                    every += stats
                rows.append(row(spec, t, task, decode, stats))
            if every:
                rows.append(row(spec, t, ALL_TASKS, decode, every))
    lengths = {task: e2e_bench.prompt_lengths(p) for task, p in prompts.items()}
    return rows, lengths


def row(spec: str, temperature: float, task: str, decode, stats: list[dict]) -> dict:
    return {
        "method": spec,
        "temperature": temperature,
        "task": task,
        "gamma": decode.drafter.block_size,
        "drafts": decode.drafter.num_drafts,
        "k": decode.k_max,
        **summarize(stats),
    }


def bar_method(row: dict) -> str:
    """The drafter a row measures for the bars (its name) when it runs the drafter's default
    method, fixed K = its drafts per block (γ - 1, or γ in DeepSpec's layout) however the spec
    spells it; else the spec itself (no bar reads it)."""
    spec = parse_method(row["method"])
    default_k = spec.k is None or spec.k == row.get("drafts", row.get("gamma", 0) - 1)
    return (
        spec.drafter if default_k and dataclasses.replace(spec, k=None) == MethodSpec(spec.drafter) else row["method"]
    )


def check_bar_methods(decoders: dict) -> None:
    """ValueError for two specs of one drafter's default method (`dflash` and `dflash:k=7` at
    γ = 8): the same measurement twice, and the bars could read only one of them."""
    seen = {}
    for spec, decode in decoders.items():
        key = bar_method({"method": spec, "drafts": decode.drafter.num_drafts})
        if key in seen:
            raise ValueError(f"--methods {seen[key]} and {spec} are the same method (K = all drafts): measure it once")
        seen[key] = spec


def bar_check(bar: str, method: str, temperature: float, measured: float | None, threshold: float) -> dict:
    """One bar: its text, what it measured (None: not measured) and whether that passed."""
    return {
        "bar": bar,
        "method": method,
        "temperature": temperature,
        "measured": measured,
        "threshold": threshold,
        "passed": None if measured is None else measured >= threshold,
    }


def bar_checks(rows: list[dict], temperatures: list[float]) -> dict:
    """The issue's bars on the "all" rows (and the general-chat rows, when that task ran); a bar
    whose methods were not measured has passed None."""
    tau = {(bar_method(r), r["temperature"]): r["tau"] for r in rows if r["task"] == ALL_TASKS}
    general = {r["temperature"]: r["tau"] for r in rows if r["task"] == targets.GENERAL and bar_method(r) == "dflash"}
    t0 = BAR_TEMPERATURE
    checks = [
        bar_check(
            f"DFlash tau >= {DFLASH_TAU_BAR:g} at T = {t0:g}", "dflash", t0, tau.get(("dflash", t0)), DFLASH_TAU_BAR
        )
    ]
    if general:
        bar = f"DFlash tau on general chat >= {GENERAL_TAU_BAR:g} at T = {t0:g}"
        checks.append(bar_check(bar, "dflash", t0, general.get(t0), GENERAL_TAU_BAR))
    for t in temperatures:
        for method, ratio_bar in RATIO_BARS.items():
            base, tau_m = tau.get(("dflash", t)), tau.get((method, t))
            ratio = tau_m / base if base is not None and tau_m is not None else None
            bar = f"{NAMES[method]} tau >= {ratio_bar:.2f} x DFlash tau at T = {t:g}"
            checks.append(bar_check(bar, method, t, ratio, ratio_bar))
    measured = [c["passed"] for c in checks if c["passed"] is not None]
    return {"checks": checks, "all_passed": bool(measured) and all(measured), "unmeasured": len(checks) - len(measured)}


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_table(rows: list[dict]) -> None:
    w = max(8, max(len(r["method"]) for r in rows))
    print(f"{'method':>{w}} {'T':>4} {'task':>6} {'tau':>6} {'tau/req':>7} {'steps':>6}  acceptance by position")
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        print(
            f"{r['method']:>{w}} {r['temperature']:>4g} {r['task']:>6} {r['tau']:>6.2f} "
            f"{_number(r['tau_request_mean']):>7} {r['steps']:>6}  {acc}",
            flush=True,
        )


def print_bars(bars: dict) -> None:
    for c in bars["checks"]:
        got = "not measured" if c["measured"] is None else f"{c['measured']:.3f}"
        verdict = "" if c["passed"] is None else ("pass" if c["passed"] else "FAIL")
        print(f"bar: {c['bar']}: {got} {verdict}")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings, rows = result["settings"], result["results"]
    temps, methods = settings["temperatures"], settings["methods"]
    groups = settings["tasks"] + ([ALL_TASKS] if any(r["task"] == ALL_TASKS for r in rows) else [])
    width = 0.8 / len(methods)
    fig, axes = plt.subplots(
        1, len(temps), figsize=(max(6.5, 1.6 + 1.5 * len(groups) * len(temps)), 4.2), squeeze=False
    )
    top = max(r["tau"] for r in rows)
    for ax, t in zip(axes[0], temps):
        for j, m in enumerate(methods):
            tau = {r["task"]: r["tau"] for r in rows if r["method"] == m and r["temperature"] == t}
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(groups))]
            bars = ax.bar(xs, [tau[g] for g in groups], width, label=m)
            ax.bar_label(bars, fmt="%.2f", fontsize=7)
        if result["bars"] is not None and t == BAR_TEMPERATURE:
            ax.axhline(DFLASH_TAU_BAR, color="grey", linestyle="--", linewidth=1, label="DFlash bar")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylim(0, max(top, DFLASH_TAU_BAR if result["bars"] is not None else 0) * 1.25)  # room for labels, legend
        ax.set_ylabel("τ (tokens per target forward)")
        ax.set_title(f"T = {t:g}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8, ncol=len(methods) + 1, loc="upper left")
    fig.suptitle(
        f"held-out τ, target {result['target']} ({settings['prompts']} prompts per task, "
        f"{settings['max_new_tokens']} new tokens)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    targets.add_target_args(p)
    p.add_argument(
        "--methods",
        nargs="+",
        default=DEFAULT_METHODS,
        help="drafters (" + ", ".join(DRAFTERS) + ") or method specs such as dflash:k=3 (default: %(default)s)",
    )
    for name in DRAFTERS:
        p.add_argument(f"--{name}", default=None, help=f"{name} drafter directory (default: the target's shipped one)")
    targets.add_tasks_arg(p)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    e2e_bench.add_tree_arg(p)
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts per task (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tiny target only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stop-at-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop a request at the target's EOS, as a server does (default); --no-stop-at-eos: decode every token",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/tau_bench[_<target>].json)")
    args = p.parse_args(argv)
    args.methods = e2e_bench.apply_tree(p, args)
    try:
        check_args(args)  # ranges (NaN and inf temperatures too) and the device
    except ValueError as e:
        p.error(str(e))
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be at least 2 (the first token comes from the prefill, not a step)")
    for name in ("tasks", "temperatures"):
        values = getattr(args, name) or []
        if len(set(values)) != len(values):
            p.error(f"--{name} repeats a value: its rows would count twice in the summary")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_methods(args.methods)
        out = Path(args.out) if args.out else RESULTS / f"tau_bench{targets.result_tag(args.model)}.json"
        target = e2e_bench.load_target(args)
        args.tasks = args.tasks or list(target.tasks)
        targets.check_tasks(target, args.tasks)
        decoders = e2e_bench.make_methods(args, target.model)
        decoders.pop("ar")  # make_methods always adds plain decoding: nothing to measure here
        check_bar_methods(decoders)
        rows, lengths = measure(args, target, decoders)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weight = target.model.lm_head.weight
    result = {
        **timing.result_header("tau", "tau_bench.py", argv, weight.device, weight.dtype),
        "target": target.label,
        "drafters": {name: str(getattr(args, name) or "shipped") for name in DRAFTERS},
        "settings": {
            "methods": args.methods,
            "tasks": args.tasks,
            "temperatures": args.temperatures,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "prompt_tokens": args.prompt_tokens if target.tiny else None,
            "prompt_lengths": lengths,
            "decoding": (
                "each request stops at the target's EOS or after max_new_tokens"
                if args.stop_at_eos
                else "fixed number of new tokens per request, no early stop at EOS"
            ),
            "eos_id": target.eos_id() if args.stop_at_eos else None,
        },
        "results": rows,
        "bars": None if target.tiny else bar_checks(rows, args.temperatures),
    }
    print_table(rows)
    if result["bars"] is not None:
        print_bars(result["bars"])
    timing.save_result(result, out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
