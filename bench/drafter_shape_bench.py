"""What a deeper or wider DFlash backbone costs per drafting pass, against the shipped shape.

The depth and width levers of the SmolLM2 drafters (docs/smollm2.md) must stay within +25% of
the shipped shape's drafting time per step at batch 1. One drafting pass (`drafter.propose`,
temperature 0) per shape, random weights (time does not depend on them) built for the target's
config, over a context of --context injected positions; shapes timed in interleaved rounds,
the order rotating per round. Ratios are medians of the per-round ratios to the first shape.
Prints a table and writes JSON.

    python bench/drafter_shape_bench.py --model smollm2 [--shapes 2x1024 2x1536 3x1536] [--batches 1 4]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from draft_overhead_bench import primed_cache
from flashspark.models import catalog
from flashspark.models.dflash import DFlashConfig, DFlashDrafter
from timing import median_time, write_result


def parse_shape(text: str) -> tuple[int, int]:
    layers, width = text.lower().split("x")
    return int(layers), int(width)


def build(target, shape: str, block_size: int) -> DFlashDrafter:
    layers, width = parse_shape(shape)
    config = DFlashConfig.for_target(
        target.config, num_hidden_layers=layers, block_size=block_size, mask_token_id=0, intermediate_size=width
    )
    return DFlashDrafter(config, target).eval()


def bench_batch(drafters: dict, batch: int, context: int, rounds: int, repeats: int) -> dict:
    anchor = torch.full((batch,), 7, dtype=torch.int64)
    lens = torch.full((batch,), context, dtype=torch.int64)
    temperature, seeds = torch.zeros(batch), torch.arange(batch, dtype=torch.int64)
    offsets = torch.ones(batch, dtype=torch.int64)
    passes = {}
    for name, d in drafters.items():
        cache = primed_cache(d, batch, context, 0)
        passes[name] = lambda d=d, cache=cache: d.propose(cache, anchor, lens, temperature, seeds, offsets)
    for fn in passes.values():
        for _ in range(3):
            fn()
    times = {k: [] for k in passes}
    names = list(passes)
    cpu = torch.device("cpu")
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(median_time(passes[name], repeats, cpu))
    base = names[0]
    return dict(
        batch=batch,
        context=context,
        ms={k: 1e3 * statistics.median(v) for k, v in times.items()},
        over_first={k: statistics.median(x / y for x, y in zip(v, times[base])) for k, v in times.items()},
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="target whose config the drafters are built for")
    ap.add_argument("--shapes", nargs="+", default=["2x1024", "2x1536", "3x1536", "4x1536"], help="LAYERSxMLP_WIDTH")
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=20, help="timed passes per shape per round (median)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = catalog.load_target(catalog.resolve_target(args.model), dtype=torch.float32)
    drafters = {s: build(target, s, args.block_size) for s in args.shapes}
    params = {s: sum(p.numel() for p in d.parameters() if p.requires_grad) for s, d in drafters.items()}
    print(
        f"DFlash drafting pass per backbone shape ({args.model}, γ = {args.block_size}, context {args.context}, "
        f"{torch.get_num_threads()} threads; median ms, ratio to {args.shapes[0]})"
    )
    head = f"{'batch':>5} | " + " | ".join(f"{s:>16}" for s in args.shapes)
    print(head)
    print("-" * len(head))
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            r = bench_batch(drafters, batch, args.context, args.rounds, args.repeats)
            r["parameters"] = params
            rows.append(r)
            cells = " | ".join(f"{r['ms'][s]:>7.2f} ({r['over_first'][s]:.2f}x)" for s in args.shapes)
            print(f"{batch:>5} | {cells}", flush=True)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "drafter_shape_bench.json")
    write_result("drafter_shape", "bench/drafter_shape_bench.py", argv, torch.device("cpu"), rows, out)


if __name__ == "__main__":
    main()
