"""How steady the confidence scheduler's SPS table is on a shared machine. The table's shape,
a full-width verify forward over a one-token step, is what the scheduler's predicted gain
rests on. Each trial profiles the target's verify forward per batch size twice, side by side
in alternating order: with `profile_sps` ("rounds": every T warmed, then timed once per round
over alternating sweeps, the fastest per T) and with the estimator it replaced ("blocks": each
T timed in one block, the median of its repeats). Both are read as the scheduler reads them:
padded (`SPSTable.padded`, a verify of T tokens priced at the cheapest measured width at or
above T).

    python bench/sps_spread.py --model smollm2 --dtype float32 --trials 8

Prints, per estimator and batch size, the shape's median, range and spread (max / min - 1)
over the trials, and the per-T median over the trials of each estimator's unfitted seconds
(what padding prices away: noise, or a real bump); writes
bench/results/sps_spread_<target>_<dtype>.json and a PNG of every trial's shape.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import e2e_bench
import targets
import timing
import torch
from flashspark.scheduling import costs

RESULTS = Path(__file__).resolve().parent / "results"
ESTIMATORS = ("rounds", "blocks")


@torch.no_grad()
def blocks_table(target, batch_size: int, grid: list[int], context_len: int, layers, warmup: int, repeats: int):
    """The estimator `profile_sps` used before its rounds: each T warmed and timed in one block,
    the median of `repeats`, one T after another."""
    width = -(-grid[-1] // batch_size)
    cache = target.new_cache(batch_size, context_len + width)
    lens = torch.full((batch_size,), context_len, dtype=torch.int64)
    tokens = torch.randint(0, target.config.vocab_size, (batch_size, width), generator=torch.Generator().manual_seed(0))
    rates = []
    for total in grid:
        n = costs._split(total, batch_size)
        rates.append(
            1.0 / costs.forward_seconds(target, tokens[:, : int(n.max())], cache, lens, n, layers, warmup, repeats)
        )
    raw = costs.SPSTable(grid, rates)
    return raw, raw.padded()


def shape(table) -> float:
    """Seconds of the table's widest verify forward over its one-token-per-request step."""
    seconds = 1.0 / table.sps
    return float(seconds[-1] / seconds[0])


def summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "spread": max(values) / min(values) - 1.0,
    }


def plot(result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = result["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for est, color in zip(ESTIMATORS, ("tab:blue", "tab:orange")):
            for i, trial in enumerate(t for t in result["trials"] if t["batch"] == b and t["estimator"] == est):
                x = [t / b for t in trial["tokens"]]
                y = [s / trial["seconds"][0] for s in trial["seconds"]]
                ax.plot(x, y, color=color, alpha=0.6, label=est if i == 0 else None)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("tokens verified per request")
        ax.set_ylabel("forward seconds / one-token step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SPS table shape over {result['trials_per_estimator']} trials ({result['target']})")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    targets.add_target_args(p)
    p.add_argument("--drafter", default="dflash2", help="whose verify width and tapped layers (default %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--gap", type=float, default=0.0, help="seconds to wait between trials")
    p.add_argument("--context", type=int, default=256, help="committed tokens per request (profile_sps's default)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    loaded = e2e_bench.load_target_and_drafter(args, args.drafter)
    if loaded is None:
        return 2
    bench_target, drafter, name = loaded
    target = bench_target.model
    dtype = target.lm_head.weight.dtype
    layers = drafter.config.target_layer_ids
    width = drafter.num_drafts + 1
    trials = []
    scratch_dir = tempfile.TemporaryDirectory(prefix="sps_spread_")  # profile_sps's cache files
    scratch = Path(scratch_dir.name)
    print(f"{'trial':>5} {'batch':>5} {'estimator':>9} {'shape':>6} {'one-token ms':>12} {'seconds':>7}")
    for i in range(args.trials):
        if i and args.gap:
            time.sleep(args.gap)
        for b in args.batches:
            grid = [b * w for w in range(1, width + 1)]
            order = ESTIMATORS if i % 2 == 0 else ESTIMATORS[::-1]  # neither always goes first
            for est in order:
                t0 = time.perf_counter()
                if est == "rounds":
                    cached = scratch / f"{i}_{b}.json"
                    raw = costs.profile_sps(
                        target, b, grid, args.context, args.repeats, args.warmup,
                        hidden_layers=layers, cache_file=cached, refresh=True,
                    )  # fmt: skip
                    table = raw.padded()
                else:
                    raw, table = blocks_table(target, b, grid, args.context, layers, args.warmup, args.repeats)
                wall = time.perf_counter() - t0
                seconds = (1.0 / table.sps).tolist()
                trials.append({"trial": i, "batch": b, "estimator": est, "tokens": grid, "seconds": seconds,
                               "raw_seconds": (1.0 / raw.sps).tolist(), "shape": shape(table),
                               "wall_s": wall})  # fmt: skip
                print(f"{i:>5} {b:>5} {est:>9} {shape(table):>6.2f} {1e3 * seconds[0]:>12.1f} {wall:>7.1f}", flush=True)
    scratch_dir.cleanup()
    rows = []
    print(f"\n{'batch':>5} {'estimator':>9} {'median':>6} {'min':>6} {'max':>6} {'spread':>6}")
    for b in args.batches:
        for est in ESTIMATORS:
            s = summary([t["shape"] for t in trials if t["batch"] == b and t["estimator"] == est])
            rows.append({"batch": b, "estimator": est, **s})
            print(f"{b:>5} {est:>9} {s['median']:>6.2f} {s['min']:>6.2f} {s['max']:>6.2f} {100 * s['spread']:>5.0f}%")
    print(f"\n{'batch':>5} {'estimator':>9}  unfitted ms per T, median over trials")
    unfitted = []
    for b in args.batches:
        for est in ESTIMATORS:
            raw = [t["raw_seconds"] for t in trials if t["batch"] == b and t["estimator"] == est]
            ms = [1e3 * statistics.median(col) for col in zip(*raw)]
            unfitted.append({"batch": b, "estimator": est, "ms": ms})
            print(f"{b:>5} {est:>9}  " + " ".join(f"{x:.0f}" for x in ms))
    result = {
        **timing.result_header("sps_spread", "sps_spread.py", argv, args.device, dtype),
        "target": bench_target.label,
        "drafter": args.drafter,
        "batches": args.batches,
        "width": width,
        "context": args.context,
        "trials_per_estimator": args.trials,
        "shape": "seconds of the widest verify forward (width tokens per request) over the one-token step",
        "rows": rows,
        "unfitted_ms": unfitted,
        "trials": trials,
    }
    out = args.out or RESULTS / f"sps_spread_{name}_{str(dtype).removeprefix('torch.')}.json"
    timing.save_result(result, out, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
