"""What DFlash 2's convs and path selector add to a drafting pass, measured in isolation.

One drafting pass (`drafter.propose`, temperature 0, greedy path: the default) of the shipped
drafters over a context of --context injected positions, per batch size, four variants
timed in interleaved rounds on the same cache:

  dflash2     the shipped DFlash 2 drafter: backbone + eight two-tap convs (four conv pairs,
              one tap projection each) + Top-16 lattice, W_h and path selection
  no-convs    the same, every conv replaced by the identity (what the selector costs)
  backbone    the same weights, convs as the identity, and DFlash's draft (its head, argmax
              at temperature 0): the pass DFlash 2 is built on
  dflash      the shipped DFlash drafter (same shape as the backbone, its own weights)

The bar of DFlash 2 (docs/dflash2_dspark.md) is dflash2 / backbone <= 1.10. Ratios are
medians over rounds of the two variants' times in the same round; the order of the
variants rotates from round to round. Prints a table and writes JSON.

    python bench/draft_overhead_bench.py [--batches 1 4 16 32] [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

import torch
from flashspark.methods import load_method_drafter
from flashspark.models.dflash import DFlashDrafter
from flashspark.models.dflash2 import DFlash2Drafter
from flashspark.models.io import load_model
from timing import median_time, write_result


@contextlib.contextmanager
def convs_as_identity():
    """DFlash 2's layers without their convs: DFlash's layer (the norms as RMSNorm modules,
    the residual adds as their own ops)."""
    layer_forward = DFlash2Drafter.layer_forward
    DFlash2Drafter.layer_forward = DFlashDrafter.layer_forward
    try:
        yield
    finally:
        DFlash2Drafter.layer_forward = layer_forward


def primed_cache(drafter, batch: int, context: int, seed: int):
    """A drafter cache holding `context` injected positions per request (random features)."""
    g = torch.Generator().manual_seed(seed)
    cache = drafter.new_cache(batch, context + 2 * drafter.block_size)
    features = torch.randn(
        batch * context, len(drafter.config.target_layer_ids), drafter.config.hidden_size, generator=g
    )
    drafter.inject(cache, features, torch.arange(context).repeat(batch), torch.arange(batch).repeat_interleave(context))
    return cache


def bench_batch(dflash2, dflash, batch, context, rounds, repeats):
    anchor = torch.full((batch,), 7, dtype=torch.int64)
    lens = torch.full((batch,), context, dtype=torch.int64)
    temperature, seeds = torch.zeros(batch), torch.arange(batch, dtype=torch.int64)
    offsets = torch.ones(batch, dtype=torch.int64)
    cache2, cache1 = primed_cache(dflash2, batch, context, 0), primed_cache(dflash, batch, context, 0)

    def pass_of(drafter, cache):
        return lambda: drafter.propose(cache, anchor, lens, temperature, seeds, offsets, "auto", False)

    def backbone():  # DFlash's draft (head, argmax at temperature 0) on DFlash 2's backbone
        return DFlashDrafter.propose(dflash2, cache2, anchor, lens, temperature, seeds, offsets)

    variants = {
        "dflash2": (pass_of(dflash2, cache2), False),
        "no-convs": (pass_of(dflash2, cache2), True),
        "backbone": (backbone, True),
        "dflash": (pass_of(dflash, cache1), False),
    }
    times = {k: [] for k in variants}
    cpu = torch.device("cpu")
    for fn, identity in variants.values():  # warm every variant before the first round
        with convs_as_identity() if identity else contextlib.nullcontext():
            for _ in range(5):
                fn()
    names = list(variants)
    for r in range(rounds):
        # The variant order rotates per round: the first passes after a switch run with
        # another drafter's weights in the caches, and no variant should always pay that.
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, identity = variants[name]
            with convs_as_identity() if identity else contextlib.nullcontext():
                times[name].append(median_time(fn, repeats, cpu))

    def paired(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    def share(a, b):  # (a - b) / backbone, per round
        return statistics.median((x - y) / z for x, y, z in zip(times[a], times[b], times["backbone"]))

    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    return dict(
        batch=batch,
        context=context,
        ms=ms,
        dflash2_over_backbone=paired("dflash2", "backbone"),
        convs_over_backbone=share("dflash2", "no-convs"),
        selector_over_backbone=share("no-convs", "backbone"),
        dflash2_over_dflash=paired("dflash2", "dflash"),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=40, help="timed passes per variant per round (median)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_model(dtype=torch.float32).eval()
    dflash2 = load_method_drafter("dflash2", target)
    dflash = load_method_drafter("dflash", target)
    print(
        f"DFlash 2 drafting pass vs its backbone (median ms; ratios: median of per-round ratios), "
        f"context {args.context}, {torch.get_num_threads()} threads"
    )
    head = (
        f"{'batch':>5} | {'dflash2':>8} {'no-convs':>8} {'backbone':>8} {'dflash':>8} | "
        f"{'d2/backbone':>11} {'convs':>7} {'selector':>8} | {'d2/dflash':>9}"
    )
    print(head)
    print("-" * len(head))
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            r = bench_batch(dflash2, dflash, batch, args.context, args.rounds, args.repeats)
            rows.append(r)
            m = r["ms"]
            print(
                f"{batch:>5} | {m['dflash2']:>8.3f} {m['no-convs']:>8.3f} {m['backbone']:>8.3f} {m['dflash']:>8.3f} | "
                f"{r['dflash2_over_backbone']:>10.3f}x {100 * r['convs_over_backbone']:>+6.1f}% "
                f"{100 * r['selector_over_backbone']:>+7.1f}% | {r['dflash2_over_dflash']:>8.3f}x",
                flush=True,
            )
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "draft_overhead_bench.json")
    write_result("draft_overhead", "bench/draft_overhead_bench.py", argv, torch.device("cpu"), rows, out)


if __name__ == "__main__":
    main()
