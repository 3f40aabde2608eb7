"""Token trees against chains: τ, what building a tree adds to drafting, end-to-end speed, and
an H200 projection.

    python bench/tree_bench.py                                     # tiny target
    python bench/tree_bench.py --model smollm2 --dtype float32     # -> bench/results/tree_bench_smollm2.json, .png
    python bench/tree_bench.py --quick                             # minutes: fewer prompts, N in {8, 32}

1. **τ** (tau_bench's measurement: held-out prompts per task, stopping at EOS) of each drafter
   (`--drafters`: dflash, dflash2) as a chain (K = γ - 1) and as trees of N in `--trees` nodes
   (best-first; with `--beam` also beam-searched trees of the same sizes), at each
   `--temperatures`, per task and over all tasks.
2. **Drafting time**: `propose` of a chain and of each tree on the same prefilled caches, batch 1
   and 4, interleaved rounds, median: what the tree builder adds.
3. **End to end** (e2e_bench's measurement, at T = 0 on `--task`): plain decoding, each
   drafter's chain and its trees, at `--concurrency`; ratios to plain decoding paired per round.
4. **Projection, not a measurement**: one step on an H200 as a roofline (weights, KV cache and
   logits at `--peak-gbs`, matmul FLOPs at `--peak-tflops`, whichever takes longer), for the
   target's verify forward of the chain's K + 1 or the tree's N tokens per request and the
   drafter's forward, at batch 1 and 32, with the τ measured in part 1: the tree's projected
   gain over the chain. The model and the H200's description are `flashspark.scheduling.costs`'.

The bars (a real target): DFlash 2 with a 32-node tree reaches >= 1.25 x its chain's τ on the
held-out chat prompts at T = 0; at concurrency 1 the best tree is faster than the best chain.
Prints tables, writes bench/results/tree_bench[_<target>][_quick].json and a PNG beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import e2e_bench
import targets
import tau_bench
import timing
import torch
from flashspark.cli.common import check_args
from flashspark.decoding.loop import prefill
from flashspark.scheduling import costs
from flashspark.scheduling.replay import StepCosts

RESULTS = Path(__file__).resolve().parent / "results"
TREE_DRAFTERS = ("dflash", "dflash2")  # DSpark drafts chains only
TAU_BAR = 1.25  # DFlash 2, 32-node tree over its chain, chat prompts, T = 0
BAR_TREE = 32


def method_of(drafter: str, tree: int, search: str = "best-first") -> str:
    return drafter if not tree else f"{drafter}:tree={tree}" + ("" if search == "best-first" else f",search={search}")


# ------------------------------------------------------------------ 2. drafting time
@torch.no_grad()
def draft_times(decoders: dict, prompts: list[list[int]], trees: list[int], batches: list[int], rounds: int) -> list:
    """Median ms of one `propose` per (drafter, batch, chain or tree), rounds interleaved."""
    rows = []
    for drafter_name in TREE_DRAFTERS:
        decode = decoders.get(drafter_name)
        if decode is None:
            continue
        target, drafter = decode.target, decode.drafter
        for B in batches:
            batch = (prompts * B)[:B]
            device = target.model.embed_tokens.weight.device
            temp = torch.zeros(B, device=device)
            seeds = torch.arange(B, device=device)
            _, dcache, lens, anchor = prefill(target, drafter, batch, 8, temp, seeds)
            offsets = torch.ones(B, dtype=torch.int64, device=device)
            times = {n: [] for n in [0, *trees]}
            for _ in range(rounds):
                for n in times:
                    t0 = time.perf_counter()
                    drafter.propose(dcache, anchor, lens, temp, seeds, offsets, tree=n, signals=n > 0)
                    times[n].append(time.perf_counter() - t0)
            chain = statistics.median(times[0])
            for n, ts in times.items():
                ms = 1e3 * statistics.median(ts)
                rows.append({"drafter": drafter_name, "batch": B, "tree": n, "ms": ms, "vs_chain": ms / (1e3 * chain)})
    return rows


# ------------------------------------------------------------------ 4. projection
def hardware(args) -> costs.Hardware:
    """The H200's description (scheduling/costs.py), with --peak-gbs / --peak-tflops if given."""
    return dataclasses.replace(costs.H200, bandwidth_gbs=args.peak_gbs, peak_tflops=args.peak_tflops)


def projection(decoders: dict, tau: dict, trees: list[int], args) -> list[dict]:
    """Per drafter, temperature, batch and tree: projected tokens/s over the chain's (τ ratio
    times the step-time ratio) and over plain decoding."""
    rows = []
    for (drafter_name, temperature, n), t in sorted(tau.items()):
        if not n or (drafter_name, temperature, 0) not in tau:
            continue
        decode = decoders[drafter_name]
        d = decode.drafter
        step = StepCosts(
            costs.ForwardShape.of_decoder(decode.target.config),
            costs.drafter_forward(d.config.layer_config(), d.block_size, d.num_drafts),
            hardware(args),
            d.block_size,
            args.context,
        )
        for B in (1, 32):
            plain, chain, tree = step.plain(B), step.speculative(B, d.num_drafts + 1), step.speculative(B, n)
            tau_chain = tau[(drafter_name, temperature, 0)]
            rows.append(
                {
                    "drafter": drafter_name,
                    "temperature": temperature,
                    "batch": B,
                    "tree": n,
                    "tau_chain": tau_chain,
                    "tau_tree": t,
                    "step_us_chain": 1e6 * chain,
                    "step_us_tree": 1e6 * tree,
                    "gain_over_chain": (t / tree) / (tau_chain / chain),
                    "chain_over_plain": (tau_chain / chain) / (1 / plain),
                    "tree_over_plain": (t / tree) / (1 / plain),
                }
            )
    return rows


# ------------------------------------------------------------------ report
def bars(tau_rows: list[dict], e2e: dict | None, tiny: bool) -> dict | None:
    if tiny:
        return None
    tau = {(r["method"], r["temperature"], r["task"]): r["tau"] for r in tau_rows}
    chain, tree = tau.get(("dflash2", 0.0, "chat")), tau.get((method_of("dflash2", BAR_TREE), 0.0, "chat"))
    ratio = tree / chain if chain and tree else None
    checks = [
        {
            "bar": f"DFlash 2, {BAR_TREE}-node tree: tau >= {TAU_BAR} x its chain's (chat, T = 0)",
            "measured": ratio,
            "passed": None if ratio is None else ratio >= TAU_BAR,
        }
    ]
    if e2e is not None:
        c1 = [r for r in e2e["results"] if r["concurrency"] == 1 and r["method"] != "ar"]
        best = {
            kind: max(
                (r for r in c1 if ("tree=" in r["method"]) == kind), key=lambda r: r["speedup_paired"], default=None
            )
            for kind in (False, True)
        }
        ok = best[True] is not None and best[False] is not None
        checks.append(
            {
                "bar": "concurrency 1: the best tree is faster than the best chain (paired ratios to plain)",
                "measured": {
                    k: None if r is None else [r["method"], r["speedup_paired"]]
                    for k, r in (("chain", best[False]), ("tree", best[True]))
                },
                "passed": None if not ok else best[True]["speedup_paired"] > best[False]["speedup_paired"],
            }
        )
    return {"checks": checks}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    temps = s["temperatures"]
    panels = 1 + (result["e2e"] is not None)
    fig, axes = plt.subplots(1, len(temps) + panels - 1, figsize=(5 * (len(temps) + panels - 1), 4), squeeze=False)
    xs = [s["chain_tokens"]] + s["trees"]
    for ax, t in zip(axes[0], temps):
        for d in s["drafters"]:
            tau = {r["method"]: r["tau"] for r in result["tau"] if r["temperature"] == t and r["task"] == "all"}
            ys = [tau.get(method_of(d, 0))] + [tau.get(method_of(d, n)) for n in s["trees"]]
            ax.plot(xs[1:], ys[1:], marker="o", label=f"{d} tree")
            colour = ax.lines[-1].get_color()
            if "beam" in s.get("searches", []):
                beam = [tau.get(method_of(d, n, "beam")) for n in s["trees"]]
                ax.plot(xs[1:], beam, marker="s", linestyle=":", color=colour, label=f"{d} beam tree")
            ax.axhline(ys[0], linestyle="--", linewidth=1, color=colour, label=f"{d} chain (K + 1 = {xs[0]})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes N")
        ax.set_ylabel("τ (tokens per target forward)")
        ax.set_title(f"held-out τ, T = {t:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if result["e2e"] is not None:
        ax = axes[0][-1]
        rows = result["e2e"]["results"]
        for m in result["e2e"]["methods"]:
            if m == "ar":
                continue
            pts = sorted((r["concurrency"], r["speedup_paired"]) for r in rows if r["method"] == m)
            ax.plot(
                [c for c, _ in pts], [v for _, v in pts], marker="o", linestyle="-" if "tree=" in m else "--", label=m
            )
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tokens/s over plain decoding (paired)")
        ax.set_title(f"end to end, T = 0, {result['e2e']['task']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"token trees against chains, target {result['target']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    targets.add_target_args(p)
    p.add_argument("--drafters", nargs="+", choices=TREE_DRAFTERS, default=list(TREE_DRAFTERS))
    for name in ("dflash", "dflash2", "dspark"):
        p.add_argument(f"--{name}", default=None, help=f"{name} drafter directory (default: the target's shipped one)")
    p.add_argument("--trees", type=int, nargs="+", default=[8, 16, 32, 64], help="node budgets N (default %(default)s)")
    targets.add_tasks_arg(p)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--beam", action="store_true", help="τ of beam-searched trees too (models.tree.SEARCHES)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per task for τ (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8, help="requests decoded together for τ (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tiny target only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task", default=None, help="end-to-end prompts (default: chat for a real target, code for the tiny one)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--e2e-trees", type=int, nargs="+", default=None, help="trees run end to end (default: --trees)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--e2e-new-tokens", type=int, default=64)
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end part")
    p.add_argument("--draft-rounds", type=int, default=20)
    p.add_argument("--context", type=int, default=1024, help="projection: committed tokens per request")
    p.add_argument("--peak-gbs", type=float, default=costs.H200.bandwidth_gbs)
    p.add_argument("--peak-tflops", type=float, default=costs.H200.peak_tflops)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="N in {8, 32}, 4 prompts per task, 48 new tokens, 1 repeat")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/tree_bench[_<target>][_quick].json)")
    args = p.parse_args(argv)
    if args.quick:
        args.trees, args.prompts, args.max_new_tokens, args.e2e_new_tokens = [8, 32], 4, 48, 48
        args.repeats, args.min_prompts, args.draft_rounds = 1, 4, 5
    try:
        check_args(args)
    except ValueError as e:
        p.error(str(e))
    if any(n < 2 for n in args.trees) or len(set(args.trees)) < len(args.trees):
        p.error("--trees takes distinct node budgets >= 2")
    args.e2e_trees = args.e2e_trees or args.trees
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        target = e2e_bench.load_target(args)
        args.tasks = args.tasks or list(target.tasks)
        targets.check_tasks(target, args.tasks)
        args.task = args.task or ("code" if target.tiny else "chat")
        searches = ["best-first"] + ["beam"] * args.beam
        args.methods = [
            method_of(d, n, s)
            for d in args.drafters
            for s in searches
            for n in [0, *args.trees]
            if n or s == "best-first"
        ]
        args.stop_at_eos = True
        decoders = e2e_bench.make_methods(args, target.model)
        decoders.pop("ar")
        tau_rows, lengths = tau_bench.measure(args, target, decoders)
        tau_bench.print_table(tau_rows)
        prompts = target.heldout_prompts(args.tasks[0], 1, args.prompt_tokens)
        drafts = draft_times(decoders, prompts, args.trees, [1, 4], args.draft_rounds)
        print(f"{'drafter':>8} {'batch':>5} {'tree':>5} {'ms':>8} {'vs chain':>8}")
        for r in drafts:
            print(f"{r['drafter']:>8} {r['batch']:>5} {r['tree']:>5} {r['ms']:>8.2f} {r['vs_chain']:>7.2f}x")
        e2e = None
        if not args.no_e2e:
            e2e_args = argparse.Namespace(**vars(args))
            e2e_args.methods = ["ar"] + [method_of(d, n) for d in args.drafters for n in [0, *args.e2e_trees]]
            e2e_args.temperature, e2e_args.max_new_tokens = 0.0, args.e2e_new_tokens
            e2e = e2e_bench.run(e2e_args, target, e2e_bench.make_methods(e2e_args, target.model))
        tau = {
            (
                r["method"].split(":")[0],
                r["temperature"],
                int(r["method"].partition("tree=")[2].partition(",")[0] or 0),
            ): r["tau"]
            for r in tau_rows
            if r["task"] == "all" and "search=" not in r["method"]
        }
        projected = projection(decoders, tau, args.trees, args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("PROJECTION (roofline, not measured): H200 step time and the tree's gain over the chain")
    print(f"{'drafter':>8} {'T':>4} {'batch':>5} {'tree':>5} {'tau x':>6} {'step x':>7} {'gain':>6} {'vs plain':>8}")
    for r in projected:
        print(
            f"{r['drafter']:>8} {r['temperature']:>4g} {r['batch']:>5} {r['tree']:>5} {r['tau_tree'] / r['tau_chain']:>6.2f} "
            f"{r['step_us_tree'] / r['step_us_chain']:>7.2f} {r['gain_over_chain']:>6.2f} {r['tree_over_plain']:>7.2f}x"
        )
    weight = target.model.lm_head.weight
    chain_tokens = next(iter(decoders.values())).drafter.num_drafts + 1
    result = {
        **timing.result_header("tree", "tree_bench.py", argv, weight.device, weight.dtype),
        "target": target.label,
        "settings": {
            "drafters": args.drafters,
            "trees": args.trees,
            "searches": searches,
            "chain_tokens": chain_tokens,
            "tasks": args.tasks,
            "temperatures": args.temperatures,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "batch_size": args.batch_size,
            "prompt_lengths": lengths,
            "decoding": "tau: each request stops at the target's EOS or after max_new_tokens",
        },
        "tau": tau_rows,
        "draft_ms": drafts,
        "e2e": e2e,
        "projection": {
            "label": "PROJECTION: a roofline of one step on an H200, not a measurement",
            "hardware": hardware(args).to_dict(),
            "context": args.context,
            "model": "step = drafter forward + target forward of K + 1 (chain) or N (tree) tokens per request, "
            "each overhead + max(bytes / bandwidth, FLOPs / peak) (scheduling/costs.py), bf16 weights and KV "
            "cache, fp32 logits; tokens/s = tau / step; tau measured in this run",
            "rows": projected,
        },
        "bars": bars(tau_rows, e2e, target.tiny),
    }
    if result["bars"]:
        for c in result["bars"]["checks"]:
            print(
                f"bar: {c['bar']}: {c['measured']} {'' if c['passed'] is None else ('pass' if c['passed'] else 'FAIL')}"
            )
    suffix = "_quick" if args.quick else ""
    out = Path(args.out) if args.out else RESULTS / f"tree_bench{targets.result_tag(args.model)}{suffix}.json"
    timing.save_result(result, out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
