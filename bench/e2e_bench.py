"""End-to-end decoding benchmark: plain decoding against speculative methods.

For each concurrency c, held-out prompts of `--task` (default code) are decoded
in batches of c by every method, side by side in the same process. Reports tau (tokens
per target forward), tokens/s and the ratio to plain decoding at the same
concurrency, twice: best of the repeats over best of plain's ("vs plain"), and
the median over rounds of the ratio to plain's run of the same round ("paired").
Within a round the methods take turns batch by batch, in the orders of a Williams design
(balanced for place and predecessor), and every (concurrency, round) cell starts the
schedulers' decoders untaught (`Decoder.forget`, keeping their one-off step-rate profiles), as
each replayed one does.
Prints a table, writes bench/results/e2e_bench.json and a plot bench/results/e2e_bench.png.

    python bench/e2e_bench.py [--quick] [--temperature 1] [--methods ar dflash:k=7 dspark:sched=confidence]
    python bench/e2e_bench.py --model smollm2 [--task chat]   # -> bench/results/e2e_bench_smollm2.json

The target (`--model`, `--dtype`) and its held-out prompts come from bench/targets.py:
the tiny target's are `--prompt-tokens` long (tasks code, prose); a real target's are the
held-out prompt sets (tasks chat, code, prose), of ragged lengths, `--prompt-tokens`
unused. For a target other than the tiny one, the default result files carry its name.
Every request decodes exactly `--max-new-tokens` tokens: a real server would stop a
request at EOS, but here no request stops early, so every method and row does the same
work.

Methods are `ar` or a `flashspark.methods` spec (drafter plus options:
`dflash:k=3`, `dflash2:path=sample`, `dspark:sched=confidence,delay=2`, `dflash2:tree=32`);
`--tree N` gives every DFlash and DFlash 2 method a tree of N nodes.
Also reports drafts verified per step and the fraction of them rejected
(wasted verify work).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import targets
import timing
import torch
from flashspark.cli.common import check_args
from flashspark.decoding.plain import generate
from flashspark.methods import DRAFTERS, drafter_dir_of, load_method_drafter, make_decoder, parse_method, with_tree
from flashspark.models import catalog

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_METHODS = ["ar", "dflash", "dflash:k=3", "dflash2", "dspark", "dspark:sched=confidence"]


def add_tree_arg(p) -> None:
    p.add_argument(
        "--tree",
        type=int,
        default=0,
        metavar="N",
        help="verify token trees of N nodes: every dflash / dflash2 method gets tree=N (DSpark stays a chain)",
    )


def apply_tree(p, args) -> list[str]:
    """--methods with --tree applied (`flashspark.methods.with_tree`); a parser error for N = 1 or < 0."""
    if args.tree == 1 or args.tree < 0:
        p.error(f"--tree must be a node budget >= 2, got {args.tree}")
    return [with_tree(m, args.tree) for m in args.methods]


def make_ar(target):
    def decode(prompts, max_new_tokens, temperature, seed):
        return generate(target, prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)

    decode.prepare = lambda batch_size, temperature: None
    return decode


def make_methods(args, target) -> dict:
    """Method name -> decode(prompts, max_new_tokens, temperature, seed); each drafter loaded once."""
    drafters, methods = {}, {"ar": make_ar(target)}
    dirs = {"dflash": args.dflash, "dflash2": args.dflash2, "dspark": args.dspark}
    for text in args.methods:
        if text == "ar":
            continue
        spec = parse_method(text)
        if spec.drafter not in drafters:
            drafters[spec.drafter] = load_method_drafter(spec.drafter, target, dirs[spec.drafter])
        drafter_dir = drafter_dir_of(spec.drafter, dirs[spec.drafter], target)  # its proxy and scheduler prior
        methods[text] = make_decoder(spec, target, drafters[spec.drafter], drafter_dir=drafter_dir)
    return methods


def load_target(args) -> targets.BenchTarget:
    """The target of --model / --dtype on --device: on a CPU in the target's own dtype, on a
    GPU in bf16 unless --dtype says otherwise."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type != "cpu" and not args.dtype:
        args = argparse.Namespace(**(vars(args) | {"dtype": "bfloat16"}))
    return targets.load_bench_target(args, device)


def load_target_and_drafter(args, drafter: str):
    """(the bench target of --model / --dtype on --device, the `drafter` method's shipped drafter
    for it, the target's short name), or None after printing why not (bad arguments, no drafter)."""
    try:
        check_args(args)
        bench_target = load_target(args)
        d = load_method_drafter(drafter, bench_target.model)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    return bench_target, d, "tiny" if bench_target.tiny else bench_target.ref.known.name


def prompt_lengths(prompts: list[list[int]]) -> dict:
    lens = [len(p) for p in prompts]
    return {"min": min(lens), "max": max(lens), "mean": sum(lens) / len(lens)}


def run(args, target: targets.BenchTarget | None = None, methods=None, prompts=None) -> dict:
    """One task at one temperature: every method at every concurrency (target, methods and the
    prompts, token lists of `args.task`, may be given)."""
    bench_target = target or load_target(args)
    targets.check_tasks(bench_target, [args.task])
    target = bench_target.model
    device, dtype = target.model.embed_tokens.weight.device, target.model.embed_tokens.weight.dtype
    n_prompts = max(max(args.concurrency), args.min_prompts)
    prompts = prompts or bench_target.heldout_prompts(args.task, n_prompts, args.prompt_tokens)
    methods = methods or make_methods(args, target)
    # Warm up allocator and kernels; profile SPS tables before any timing (what the warm-up call
    # teaches a Decoder is forgotten at the start of every timed cell below).
    for decode in methods.values():
        decode(prompts[:2], 8, args.temperature, 0)
        for c in args.concurrency:
            decode.prepare(c, args.temperature)
    w = max(12, max(len(m) for m in methods))
    print(
        f"{'method':>{w}} {'conc':>5} {'tau':>6} {'verified':>8} {'wasted':>7} {'tokens/s':>10} {'vs plain':>9} "
        f"{'paired':>7} {'ms/step':>8}  same as plain"
    )
    rows = []
    for c in args.concurrency:
        # Every row decodes the same prompts (batches of c), so rows differ only by method and
        # concurrency, and low concurrency is not a few prompts' luck.
        batches = [prompts[i : i + c] for i in range(0, len(prompts), c)]
        runs: dict[str, list] = {spec: [] for spec in methods}
        for r in range(args.repeats):
            for decode in methods.values():
                if hasattr(decode, "forget"):  # every cell starts untaught, as each replayed one does
                    decode.forget()
            done: dict[str, tuple[list, list]] = {spec: ([], []) for spec in methods}
            # Interleaved batch by batch, in balanced orders: a slow spell of a shared machine (tens
            # of seconds) then lands on every method's run of the same batch, not on whichever
            # method ran through it, and no method always runs first or after the same one.
            for i, batch in enumerate(batches):
                for spec in balanced_order(list(methods), r * len(batches) + i):
                    out, st = methods[spec](batch, args.max_new_tokens, args.temperature, r)
                    done[spec][0].extend(out)
                    done[spec][1].append(st)
            for spec, (outs, sts) in done.items():
                runs[spec].append((outs, _merge(sts)))
        plain_out, plain_tps = None, None
        for spec in methods:
            times = [st["seconds"] for _, st in runs[spec]]
            out, st = min(runs[spec], key=lambda run: run[1]["seconds"])  # best of the repeats
            tau = st["tau"]
            if spec == "ar":
                plain_out, plain_tps = out, st["tokens_per_s"]
            same = out == plain_out if args.temperature == 0 else None
            row = {
                "method": spec,
                "concurrency": c,
                "prompts": len(out),
                "tau": tau,
                "tokens_per_s": st["tokens_per_s"],
                "per_request_tokens_per_s": st["tokens_per_s"] / c,
                "speedup": st["tokens_per_s"] / plain_tps,
                # median over rounds of the ratio to plain decoding's run of the same round: a slow
                # or fast spell of the shared machine then tends to hit both sides of each ratio
                "speedup_paired": statistics.median(
                    m[1]["tokens_per_s"] / a[1]["tokens_per_s"] for m, a in zip(runs[spec], runs["ar"])
                ),
                "ms_per_step": st["ms_per_step"],
                "seconds": st["seconds"],
                "seconds_repeats": times,
                # spread of the repeats: the noise a comparison between rows must clear
                "spread": (max(times) - min(times)) / min(times) if len(times) > 1 else None,
                "new_tokens": st["new_tokens"],
                "same_as_plain": same,
                "verified_per_step": st.get("verified_per_step", 0.0),
                "drafts_verified": st.get("drafts_verified", 0),
                "drafts_wasted": st.get("drafts_wasted", 0),
                "wasted_fraction": st.get("drafts_wasted", 0) / max(1, st.get("drafts_verified", 0)),
                "acceptance_per_position": st.get("acceptance_per_position"),
                "recall_top1": st.get("recall_top1"),
                "recall_topk": st.get("recall_topk"),
                "draft_ms_per_step": st.get("draft_ms_per_step"),
                # confidence scheduler: loop steps run plain, and batches decoded plainly at this load
                "plain_steps": st.get("plain_steps"),
                "plain_batches": st.get("plain_batches"),
                "phase_seconds": st.get("phase_seconds"),
            }
            rows.append(row)
            print(
                f"{spec:>{w}} {c:>5} {tau:>6.2f} {row['verified_per_step']:>8.2f} {row['wasted_fraction']:>7.2f} "
                f"{row['tokens_per_s']:>10.1f} {row['speedup']:>8.2f}x {row['speedup_paired']:>6.2f}x "
                f"{row['ms_per_step']:>8.2f}  {'' if same is None else ('yes' if same else 'NO')}",
                flush=True,
            )
    return {
        **timing.result_header("e2e", "e2e_bench.py", None, device, dtype),
        "target": str(args.model or "shipped target"),
        "target_label": bench_target.label,
        "drafters": {name: str(getattr(args, name) or "shipped") for name in DRAFTERS},
        "task": args.task,
        # the tiny target's prompts are all this long; a real target's are the prompt sets' own
        "prompt_tokens": args.prompt_tokens if bench_target.tiny else None,
        "prompt_lengths": prompt_lengths(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "min_prompts": args.min_prompts,
        "prompts": len(prompts),
        "prompt_ids": prompts,  # what was decoded (bench/replay_check.py replays the same requests)
        "decoding": "no early stop; best of repeats; every row decodes the same prompts, in batches of c",
        # how the rounds ran (replay_check replays them alike): the methods take turns batch by
        # batch in balanced orders, and every (concurrency, round) cell starts its decoders untaught
        "interleave": "batch, balanced orders",
        "untaught": "cell",
        "repeats": args.repeats,
        "methods": list(methods),
        "results": rows,
    }


def balanced_order(items: list, k: int) -> list:
    """Row k of a Williams design over `items`: over any n consecutive rows (n = len(items), 2n
    where n is odd) each item takes every place equally often and follows every other item
    equally often, so neither a place in the order nor what ran just before (the state it leaves
    in the caches and the allocator) favours a method."""
    n = len(items)
    base, lo, hi = [0], 1, n - 1  # 0, 1, n - 1, 2, n - 2, ...
    while len(base) < n:
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    r = k % (n if n % 2 == 0 else 2 * n)
    row = [items[(x + r) % n] for x in base]
    return row[::-1] if r >= n else row


def _merge(stats: list[dict]) -> dict:
    """Totals over the batches of one row: tokens/s over their summed time, tau over all request-steps."""
    seconds = sum(s["seconds"] for s in stats)
    new = sum(s["new_tokens"] for s in stats)
    # One loop iteration per target forward: ar counts forwards, speculative methods their loop
    # iterations (the whole batch each, finished requests included).
    iters = sum(s.get("iterations") or s.get("forwards", 0) or s["steps"] / max(1, s["requests"]) for s in stats)
    steps = sum(s.get("steps", 0) for s in stats)
    merged = {
        "seconds": seconds,
        "new_tokens": new,
        "tokens_per_s": new / seconds if seconds > 0 else 0.0,
        "ms_per_step": 1e3 * sum(s["decode_seconds"] for s in stats) / max(1, iters),
        "tau": sum(s["tau"] * s.get("steps", 1) for s in stats) / max(1, steps) if steps else 1.0,
    }
    if any("recall_positions" in s for s in stats):
        n = sum(s.get("recall_positions", 0) for s in stats)
        for key in ("recall_top1", "recall_topk"):
            merged[key] = sum(s.get(key, 0.0) * s.get("recall_positions", 0) for s in stats) / max(1, n)
    if "drafts_verified" in stats[0]:
        for key in ("drafts_verified", "drafts_wasted", "plain_steps"):
            merged[key] = sum(s.get(key, 0) for s in stats)
        merged["verified_per_step"] = merged["drafts_verified"] / max(1, steps)
        merged["plain_batches"] = sum(bool(s.get("plain_batch")) for s in stats)
    if "phase_seconds" in stats[0]:
        merged["phase_seconds"] = {
            k: sum(s["phase_seconds"].get(k, 0.0) for s in stats) for k in stats[0]["phase_seconds"]
        }
        # Drafting time per drafted block of the batch (an iteration that drafted): what DFlash 2's
        # convs and selector add over DFlash, whatever the number of iterations each ran.
        drafted = iters - sum(s.get("plain_steps", 0) for s in stats)  # plain batches: all their forwards
        merged["draft_ms_per_step"] = 1e3 * merged["phase_seconds"].get("draft", 0.0) / max(1, drafted)
        tried = [s["acceptance_per_position"] for s in stats if s["acceptance_per_position"]]
        merged["acceptance_per_position"] = [sum(col) / len(col) for col in zip(*tried)]
    return merged


def style_concurrency_axes(ax, concurrencies, ylabel: str, title: str) -> None:
    """Log-2 concurrency x axis with plain tick labels, labels, title and grid."""
    import matplotlib

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(concurrencies)))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests per batch)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in result["methods"]:
        pts = [(r["concurrency"], r["tokens_per_s"]) for r in result["results"] if r["method"] == m]
        ax.plot(*zip(*pts), marker="o", label=m)
    label = result.get("target_label", catalog.DEFAULT_TARGET)
    on = "" if label == catalog.DEFAULT_TARGET else f" on {label}, {result['task']}"
    style_concurrency_axes(
        ax,
        [r["concurrency"] for r in result["results"]],
        "generated tokens / s",
        f"flashspark end to end{on}, T = {result['temperature']:g}, {result['device']}",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--methods",
        nargs="+",
        default=DEFAULT_METHODS,
        help="ar, or drafter[:k=N,sched=fixed|confidence,path=...,delay=N,admit=stop|budget] with drafter one of "
        + ", ".join(DRAFTERS)
        + " (default: %(default)s)",
    )
    targets.add_target_args(p)
    for name in DRAFTERS:
        p.add_argument(f"--{name}", default=None, help=f"{name} drafter directory (default: the target's shipped one)")
    p.add_argument(
        "--task",
        default="code",
        help="held-out prompts: code or prose (tiny target), chat, code or prose (others); default %(default)s",
    )
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tiny target only)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=0.0)
    add_tree_arg(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs per row")
    p.add_argument(
        "--min-prompts",
        type=int,
        default=32,
        help="prompts per row at least, in batches of c (default %(default)s: every row decodes the "
        "same 32 prompts, so rows differ only by method and concurrency)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="concurrency 1 4 16, 48 new tokens, 16 prompts, 1 repeat")
    p.add_argument(
        "--out", default=None, help="JSON path (default bench/results/e2e_bench[_<target>][_quick][_t1].json)"
    )
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.methods = apply_tree(p, args)
    if args.quick:
        args.concurrency, args.max_new_tokens, args.repeats, args.min_prompts = [1, 4, 16], 48, 1, 16
    suffix = ("_quick" if args.quick else "") + (f"_t{args.temperature:g}" if args.temperature else "")
    try:
        check_args(args)
        for m in args.methods:
            if m != "ar":
                parse_method(m)
        out = Path(args.out) if args.out else RESULTS / f"e2e_bench{targets.result_tag(args.model)}{suffix}.json"
        result = run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timing.save_result(result, out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
