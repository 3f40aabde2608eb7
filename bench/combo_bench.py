"""The combination question: does DFlash 2 + confidence proxy + DSpark's scheduler
beat every fixed K, DFlash and DSpark, at every concurrency, and never fall
below plain decoding?

Grid: tasks (code: held-out stdlib files; prose: their docstrings and comments)
x temperature (0, 1) x concurrency (1 .. 32) x methods, every cell measured side
by side in one process with `e2e_bench.run` (same prompts, same target, plain
decoding first in each cell). Writes bench/results/combo_bench.json, a Markdown
table (combo_bench.md) and one PNG per task (throughput ratio to plain decoding
vs concurrency, one line per method, the 1.0x line drawn).

    python bench/combo_bench.py            # full grid
    python bench/combo_bench.py --quick    # 48 new tokens, 8 prompts per row, 1 repeat
    python bench/combo_bench.py --model smollm2 --quick   # tasks chat, code, prose -> combo_bench_smollm2_quick.json

The target (`--model`, `--dtype`) and its held-out prompts come from bench/targets.py (see
e2e_bench.py); for a target other than the tiny one the default result files carry its name.
Every request decodes exactly `--max-new-tokens` tokens (no stop at EOS, as a real server
would): every method and cell does the same work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import e2e_bench
import targets
import timing
from flashspark.cli.common import check_args
from flashspark.methods import DRAFTERS, parse_method
from flashspark.models import catalog

RESULTS = Path(__file__).resolve().parent / "results"
COMBO = "dflash2:sched=confidence"
METHODS = [
    "ar",
    "dflash",
    "dflash:k=3",
    "dflash2:k=2",
    "dflash2:k=4",
    "dflash2",
    "dspark",
    "dspark:sched=confidence",
    COMBO,
]


def label(method: str, drafts: int) -> str:
    """Readable names for tables and plots."""
    if method == "ar":
        return "plain"
    spec = parse_method(method)
    name = {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}[spec.drafter]
    if spec.scheduler == "confidence":
        return name + (" + proxy + scheduler" if spec.drafter == "dflash2" else " + scheduler")
    return f"{name} K={drafts if spec.k is None else spec.k}"


def verdict(rows: list[dict], noise: float) -> dict:
    """Per (task, temperature, concurrency): is the combination at or above every other method
    (within `noise`, relative) and above plain decoding?"""
    cells = {}
    for r in rows:
        cells.setdefault((r["task"], r["temperature"], r["concurrency"]), {})[r["method"]] = r
    out = []
    for (task, t, c), m in sorted(cells.items()):
        combo = m[COMBO]["tokens_per_s"]
        best_name, best = max(((k, v["tokens_per_s"]) for k, v in m.items() if k != COMBO), key=lambda x: x[1])
        out.append(
            {
                "task": task,
                "temperature": t,
                "concurrency": c,
                "combo_speedup": m[COMBO]["speedup"],
                "best_other": best_name,
                "best_other_speedup": m[best_name]["speedup"],
                "combo_vs_best": combo / best,
                "at_or_above_all": combo >= best * (1 - noise),
                "above_plain": m[COMBO]["speedup"] > 1.0,
            }
        )
    return {"noise": noise, "cells": out, "bar_met": all(v["at_or_above_all"] and v["above_plain"] for v in out)}


def markdown(result: dict) -> str:
    target_name = result.get("target_label", catalog.DEFAULT_TARGET)
    on = "" if target_name == catalog.DEFAULT_TARGET else f", target {target_name}"
    prompts = (
        f"{result['prompt_tokens']}-token prompts"
        if result["prompt_tokens"] is not None
        else "the held-out prompt sets' prompts"
    )
    lines = [
        f"# Combination benchmark ({result['date']})",
        "",
        f"`{result['command']}` on {result['hardware']}, {result['threads']} threads{on}; "
        f"{result['max_new_tokens']} new tokens per request, {prompts}, "
        f"best of {result['repeats']}.",
        "",
        "Tokens/s relative to plain decoding (τ in brackets); **bold**: the best method of the cell.",
        "",
    ]
    rows = result["results"]
    for task in result["tasks"]:
        for t in result["temperatures"]:
            sub = [r for r in rows if r["task"] == task and r["temperature"] == t]
            concs = sorted({r["concurrency"] for r in sub})
            lines += [
                f"## {task}, temperature {t:g}",
                "",
                "| method | " + " | ".join(f"c={c}" for c in concs) + " |",
                "|---|" + "---:|" * len(concs),
            ]
            best = {
                c: max((r for r in sub if r["concurrency"] == c), key=lambda r: r["tokens_per_s"])["method"]
                for c in concs
            }
            for m in result["methods"]:
                cells = []
                for c in concs:
                    r = next(r for r in sub if r["method"] == m and r["concurrency"] == c)
                    txt = f"{r['speedup']:.2f}x ({r['tau']:.2f})"
                    cells.append(f"**{txt}**" if best[c] == m else txt)
                lines.append(f"| {result['labels'][m]} | " + " | ".join(cells) + " |")
            wasted = [r for r in sub if r["method"] in (COMBO, "dflash2")]
            lines += [
                "",
                "Drafts verified per step / fraction wasted: "
                + "; ".join(
                    f"{result['labels'][r['method']]} c={r['concurrency']}: {r['verified_per_step']:.2f} / "
                    f"{r['wasted_fraction']:.2f}"
                    for r in wasted
                ),
                "",
            ]
    v = result["verdict"]
    lines += [
        f"Bar (combination at or above every method within {v['noise']:.0%}, and above 1.0x, "
        f"in every cell): **{'met' if v['bar_met'] else 'not met'}**.",
        "",
    ]
    misses = [c for c in v["cells"] if not (c["at_or_above_all"] and c["above_plain"])]
    for c in misses:
        lines.append(
            f"- {c['task']}, T={c['temperature']:g}, c={c['concurrency']}: combination "
            f"{c['combo_speedup']:.2f}x, best other {result['labels'][c['best_other']]} "
            f"{c['best_other_speedup']:.2f}x"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, task: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = result["temperatures"]
    fig, axes = plt.subplots(1, len(temps), figsize=(6.2 * len(temps), 4.4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        for m in result["methods"]:
            pts = sorted(
                (r["concurrency"], r["speedup"])
                for r in result["results"]
                if r["task"] == task and r["temperature"] == t and r["method"] == m
            )
            style = dict(linewidth=2.6, color="black") if m == COMBO else dict(linewidth=1.3)
            ax.plot(*zip(*pts), marker="o", label=result["labels"][m], **style)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        e2e_bench.style_concurrency_axes(
            ax,
            [r["concurrency"] for r in result["results"]],
            "tokens/s relative to plain decoding",
            f"{task}, temperature {t:g}",
        )
    axes[0][0].legend(fontsize=8)
    target_name = result.get("target_label", catalog.DEFAULT_TARGET)
    on = "" if target_name == catalog.DEFAULT_TARGET else f" on {target_name}"
    fig.suptitle(f"flashspark combination benchmark{on} ({result['device']}, {result['threads']} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=METHODS)
    targets.add_tasks_arg(p)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tiny target only)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs per row")
    p.add_argument(
        "--min-prompts",
        type=int,
        default=16,
        help="prompts per row at least, in batches of c (default %(default)s; the same prompts in every row)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.03,
        help="relative tolerance of 'at or above' (default %(default)s; compare with the rows' spread)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    targets.add_target_args(p)
    for name in DRAFTERS:
        p.add_argument(f"--{name}", default=None, help=f"{name} drafter directory (default: the target's shipped one)")
    p.add_argument("--quick", action="store_true", help="48 new tokens, 8 prompts per row, 1 repeat")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/combo_bench[_<target>][_quick].json)")
    args = p.parse_args(argv)
    if COMBO not in args.methods or "ar" not in args.methods:
        p.error(f"--methods must include ar and {COMBO}")
    if args.quick:
        args.max_new_tokens, args.repeats, args.min_prompts = 48, 1, 8
    t0 = time.time()
    try:
        check_args(args)
        tag = targets.result_tag(args.model)
        out = Path(args.out) if args.out else RESULTS / f"combo_bench{tag}{'_quick' if args.quick else ''}.json"
        target = e2e_bench.load_target(args)
        args.tasks = args.tasks or list(target.tasks)
        targets.check_tasks(target, args.tasks)
        methods = e2e_bench.make_methods(args, target.model)
        # A method's default K is its drafter's drafts per block (γ - 1, or γ in DeepSpec's layout).
        drafts = {m: d.drafter.num_drafts for m, d in methods.items() if hasattr(d, "drafter")}
        rows = []
        for task in args.tasks:
            for t in args.temperatures:
                print(f"\n=== task {task}, temperature {t:g} ({(time.time() - t0) / 60:.1f} min) ===", flush=True)
                cell = argparse.Namespace(**vars(args), task=task, temperature=t)
                res = e2e_bench.run(cell, target, methods)
                rows += [r | {"task": task, "temperature": t} for r in res["results"]]
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weight = target.model.lm_head.weight
    result = {
        **timing.result_header("combo", "combo_bench.py", argv, weight.device, weight.dtype),
        "minutes": (time.time() - t0) / 60,
        "target": str(args.model or "shipped target"),
        "target_label": target.label,
        "tasks": args.tasks,
        "temperatures": args.temperatures,
        "methods": list(methods),
        "labels": {m: label(m, drafts.get(m, 0)) for m in methods},
        # the tiny target's prompts are all this long; a real target's are the prompt sets' own
        "prompt_tokens": args.prompt_tokens if target.tiny else None,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "min_prompts": args.min_prompts,
        "results": rows,
    }
    result["verdict"] = verdict(rows, args.noise)
    timing.save_result(result, out)
    md = out.with_suffix(".md")
    md.write_text(markdown(result))
    pngs = []
    for task in args.tasks:
        png = out.with_name(f"{out.stem}_{task}.png")
        plot(result, task, png)
        pngs.append(png.name)
    print(
        f"\nbar {'met' if result['verdict']['bar_met'] else 'NOT met'}; wrote {out}, {md.name}, {', '.join(pngs)} "
        f"({result['minutes']:.1f} min)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
