"""The combination question replayed: every method over recorded acceptance traces, priced by a
cost model, at concurrency 1-64 (flashspark.scheduling.replay; traces from
bench/record_traces.py).

    python bench/combo_replay.py --quick                  # tiny target's traces, H200: a minute at most
    python bench/combo_replay.py --target smollm2         # SmolLM2's traces
    python bench/combo_replay.py --cost-model cpu         # this CPU's fitted description (bench/cost_fit.py)

Methods: plain decoding; every fixed K of each drafter (the best one reported per drafter and
over all); DSpark's confidence scheduler on its head; the combination (DFlash 2 + its
confidence proxy, updated online, + DSpark's scheduler). The schedulers are flashspark's own
(`ConfidenceScheduler`, with the shipped priors and a `Decoder`'s batch verdict), on SPS
tables from the same cost model. Each cell is the median over `--shuffles` orders of the
trace's requests (they change which requests share a batch), as tokens/s relative to plain
decoding's on the same trace: at T > 0 each drafter's trace holds its own samples, so its
requests run to other lengths (SmolLM2 at T = 1: plain decoding reads 7% and 12% faster on
DFlash 2's and DSpark's traces than on DFlash's), and a ratio across traces would measure the
lengths, not the method. An order holds at least `--min-batches` batches: where the trace has fewer
requests than that many batches at a concurrency, requests are drawn again in new orders
(`replay.stream`), as a server keeps serving; otherwise a batch-level verdict would be judged
on the prior's prediction alone at high concurrency (48 requests are one batch at 64).

Results are labelled: **replay** under a fitted CPU description, **projection** under the
H200's (scheduling/costs.py). Steps are treated as exchangeable (replay.py says what that
means). Writes bench/results/combo_replay_<target>_<cost model>[_quick].json, .md and a PNG
per temperature.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import timing
from flashspark.methods import MIN_PRIOR_ROWS, PRIOR_FILE, PROXY_FILES, SHIPPED_PRIOR_ROWS
from flashspark.models import catalog
from flashspark.models.config import DecoderConfig
from flashspark.scheduling import costs
from flashspark.scheduling.confidence import ConfidenceScheduler, ConfidenceStats, conditional
from flashspark.scheduling.proxy import ConfidenceProxy
from flashspark.scheduling.replay import FixedPolicy, SchedulerPolicy, StepCosts, Trace, replay, stream
from flashspark.scheduling.verdict import BatchVerdict

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces"
COMBO = "DFlash 2 + proxy + scheduler"
DSPARK_SCHED = "DSpark + scheduler"
NAMES = {"dflash": "DFlash", "dflash2": "DFlash 2", "dspark": "DSpark"}
# Qwen3-8B (its config.json) and a DFlash drafter of the published drafters' shape for it: 5
# decoder layers at the target's width, block size 16 (z-lab's b16 drafters).
QWEN3_8B = DecoderConfig(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
DFLASH_LAYERS, DFLASH_BLOCK = 5, 16
# Issue 33: the combination against the best fixed K and plain decoding, in every request order.
BARS = {"over_best_fixed": 0.97, "over_plain": 0.99}
PUBLISHED = {"speedup": 4.86, "tau": 6.49, "source": "DFlash, Qwen3-8B, H200, T = 0, batch 1 (its paper's average)"}


def cost_model(name: str, target: str, path: str | None = None) -> tuple[costs.Hardware, dict | None, str, float]:
    """(hardware, measured rest of each kind of step or None, label, bytes per weight and K/V
    value): the H200's description (bf16, no rest), or this CPU's fit for the target
    (bench/cost_fit.py's JSON, `path` or the committed one: its `step_rest`, and the bytes its
    rates were fitted with)."""
    if name == "h200":
        return costs.H200, None, "projection", 2.0
    path = Path(path) if path else RESULTS / f"cost_model_{target}_cpu.json"
    if not path.is_file():
        raise FileNotFoundError(f"no fitted CPU description {path}: run python bench/cost_fit.py --model {target}")
    fit = json.loads(path.read_text())
    if "step_rest" not in fit:
        raise ValueError(f"{path} has no measured step rests (an older cost_fit.py): run it again")
    return costs.Hardware.from_dict(fit["hardware"]), fit["step_rest"], "replay", fit.get("bytes_per_value", 2.0)


def step_rest(rest: dict | None, drafter: str, temperature: float) -> tuple[tuple, tuple]:
    """(speculative, plain) rests of a step for `drafter`'s steps at the measured temperature
    nearest `temperature`: (batch, seconds) pairs, or rows of a grid over contexts and widths
    (`replay._rest`; none without a measurement)."""
    if not rest:
        return (), ()
    if drafter not in rest["speculative"]:
        raise ValueError(f"the cost model has no measured {drafter} steps: run bench/cost_fit.py with it")

    def nearest(by_t: dict) -> tuple:
        key = min(by_t, key=lambda t: abs(float(t) - temperature))
        return tuple(map(tuple, by_t[key]))

    return nearest(rest["speculative"][drafter]), nearest(rest["plain"])


def drafter_dir(target: str, drafter: str) -> Path:
    """The shipped drafter whose proxy and prior the schedulers read (the traces' own)."""
    return catalog.drafter_dir(drafter, catalog.TARGETS[target])


class Shipped:
    """What a `Decoder` of a confidence method carries across batches at one temperature: its
    prior (the shipped one, then every batch's), its online proxy, and its per-batch verdict."""

    def __init__(self, directory: Path, temperature: float, width: int, proxy: bool):
        self.stats = None
        prior = directory / PRIOR_FILE
        if prior.is_file():
            per_t = json.loads(prior.read_text())["temperatures"]
            key = min(per_t, key=lambda t: abs(float(t) - temperature))
            stats = ConfidenceStats.from_dict(per_t[key]["stats"])
            self.stats = stats.scaled(SHIPPED_PRIOR_ROWS) if stats.width == width else None
        self.proxy = None
        if proxy:
            key = min(PROXY_FILES, key=lambda t: abs(t - temperature))
            self.proxy = ConfidenceProxy.load(directory / PROXY_FILES[key])


def scheduler_policy(
    name, trace: Trace, step: StepCosts, directory: Path, source: str, padded: bool = True
) -> SchedulerPolicy:
    """DSpark's scheduler on a trace source ("dspark_head"), or on the DFlash 2 proxy run online
    on the trace's signals ("proxy"), as `methods.Decoder` runs either. `padded`: admission
    prices the padded verify forward the loop and the replay run (`confidence.padded_columns`);
    False: Algorithm 1's slots, each one token of a packed forward."""
    K = trace.width
    new_tokens = int(trace.new_tokens.max())  # the recorded run's cap, as a Decoder's max_new_tokens
    shipped = Shipped(directory, trace.meta["temperature"], K, proxy=source == "proxy")
    tables: dict[int, tuple] = {}

    def sps(batch_size: int):
        # The scheduler's tables priced as the replay prices its steps.
        if batch_size not in tables:
            tables[batch_size] = step.sps(batch_size, range(1, K + 2))
        return tables[batch_size]

    def make(batch_size: int):
        spec, plain = sps(batch_size)
        scheduler = ConfidenceScheduler(
            K, spec, plain_sps=plain, min_rows=MIN_PRIOR_ROWS, prior=shipped.stats, padded=padded, batch_verdict=True
        )
        policy.current = scheduler
        return scheduler

    def predict(batch_size: int) -> float | None:
        # The Decoder's predicted gain from its prior (the shipped one, then every batch's).
        if policy.current is not None and policy.current.stats is not None:
            shipped.stats = policy.current.stats
        s = shipped.stats
        if s is None or s.rows < MIN_PRIOR_ROWS:
            return None
        spec, plain = sps(batch_size)
        judge = ConfidenceScheduler(K, spec, plain_sps=plain, min_rows=MIN_PRIOR_ROWS, prior=s, padded=padded)
        return judge.predicted_gain(conditional(s.mean_survival()), batch_size, new_tokens=new_tokens)

    if source == "proxy":

        def confidence(rows, tr):
            return shipped.proxy(_tensor(tr.signals[rows])).numpy()

        def hear(rows, accepted, verified, tr):
            shipped.proxy.observe(_tensor(tr.signals[rows]), _tensor(accepted), _tensor(verified))
    else:

        def confidence(rows, tr):
            return tr.sources[source][rows]

        hear = None
    policy = SchedulerPolicy(name, make, confidence, predict, hear, BatchVerdict())
    policy.current = None
    return policy


def _tensor(x):
    import torch

    return torch.as_tensor(np.asarray(x))


def step_costs(
    trace: Trace,
    hardware: costs.Hardware,
    rest: dict | None = None,
    setting: str = "traced",
    bytes_per_value: float = 2.0,
) -> StepCosts:
    """The step costs of the trace's own target and drafter, or (`setting` "qwen3-8b") of a
    Qwen3-8B-sized target with a drafter of the published DFlash drafters' relative size (5
    layers at the target's width), drafting the trace's block size; weights and K/V of
    `bytes_per_value` (what the hardware's rates were fitted with); the rest of each kind of
    step measured for the trace's drafter and temperature (`cost_model`, `step_rest`)."""
    block, drafts = trace.meta["block_size"], trace.meta["drafts_per_block"]
    b = bytes_per_value
    if setting == "qwen3-8b":
        target = costs.ForwardShape.of_decoder(QWEN3_8B, b, b)
        drafter = costs.drafter_forward(QWEN3_8B, block, drafts, DFLASH_LAYERS, b)
    else:
        target = costs.ForwardShape.of_decoder(DecoderConfig.from_dict(trace.meta["target_config"]), b, b)
        drafter = costs.drafter_forward(DecoderConfig.from_dict(trace.meta["drafter_config"]), block, drafts, None, b)
    context = int(np.median(trace.ctx_len))
    speculative, plain = step_rest(rest, trace.meta["drafter"], float(trace.meta["temperature"]))
    # Rests measured over contexts price this loop, which pads a batch to its longest request.
    prefill, padded = tuple(map(tuple, (rest or {}).get("prefill", ()))), bool((rest or {}).get("padded"))
    return StepCosts(target, drafter, hardware, block, context, speculative, plain, prefill, padded)


def run(args) -> dict:
    hardware, rest, label, elem = cost_model(args.cost_model, args.target, args.cost_file)
    rng = np.random.default_rng(args.seed)
    result = {
        **timing.result_header("combo_replay", "combo_replay.py", args.argv, "cpu"),
        "label": label.upper(),
        "target": args.target,
        "setting": "the traced target and drafter"
        if args.setting == "traced"
        else f"a Qwen3-8B-sized target and a {DFLASH_LAYERS}-layer drafter at its width, on {args.target}'s traces",
        "hardware": hardware.to_dict(),
        "approximation": "steps are exchangeable: a request's i-th replayed step reads its i-th recorded step "
        "(flashspark/scheduling/replay.py)",
        "price": args.price,
        "shuffles": args.shuffles,
        "min_batches": args.min_batches,
        "concurrency": args.concurrency,
        "temperatures": {},
    }
    if label == "projection":
        result["published_check"] = published_check(hardware)
    for t in args.temperatures:
        traces = {}
        for d in ("dflash", "dflash2", "dspark"):
            path = Path(args.traces) / f"{args.target}_{d}_t{t:g}.npz"
            if path.is_file():
                traces[d] = Trace.load(path)
        if not traces:
            raise FileNotFoundError(f"no traces for {args.target} at T = {t:g} in {args.traces}")
        any_trace = next(iter(traces.values()))
        methods = {"plain": (any_trace, lambda: FixedPolicy(0))}
        if len({tr.requests for tr in traces.values()}) != 1:
            raise ValueError(f"{args.target}'s traces at T = {t:g} hold different prompts: record them together")
        for d, tr in traces.items():
            for k in range(1, tr.width + 1):
                methods[f"{NAMES[d]} K={k}"] = (tr, lambda k=k: FixedPolicy(k))
        if "dspark" in traces and "dspark_head" in traces["dspark"].sources:
            tr = traces["dspark"]
            methods[DSPARK_SCHED] = (tr, lambda tr=tr: scheduler_policy(
                DSPARK_SCHED, tr, step_costs(tr, hardware, rest, args.setting, elem), drafter_dir(args.target, "dspark"), "dspark_head", args.price == "padded"))  # fmt: skip
        if "dflash2" in traces and traces["dflash2"].signals is not None:
            tr = traces["dflash2"]
            methods[COMBO] = (tr, lambda tr=tr: scheduler_policy(
                COMBO, tr, step_costs(tr, hardware, rest, args.setting, elem), drafter_dir(args.target, "dflash2"), "proxy", args.price == "padded"))  # fmt: skip
        cells = {}
        for c in args.concurrency:
            # At least --min-batches batches at every concurrency (replay.stream): the verdict
            # learns over batches, and a server at concurrency 64 serves more than 48 requests.
            length = max(any_trace.requests, args.min_batches * c)
            orders = [stream(rng, any_trace.requests, length) for _ in range(args.shuffles)]
            # Each method over plain decoding of the same requests at the same lengths: its own trace's.
            plain = {}
            for tr in traces.values():
                sc = step_costs(tr, hardware, rest, args.setting, elem)
                plain[id(tr)] = [replay(tr, FixedPolicy(0), c, sc, order).tokens_per_s for order in orders]
            ratios = {}
            for name, (tr, make) in methods.items():
                sc = step_costs(tr, hardware, rest, args.setting, elem)
                rates = [replay(tr, make(), c, sc, order).tokens_per_s for order in orders]
                ratios[name] = [r / p for r, p in zip(rates, plain[id(tr)])]
            cells[c] = {name: statistics.median(r) for name, r in ratios.items()} | {
                "_plain_tokens_per_s": statistics.median(plain[id(any_trace)])
            }
            if COMBO in ratios:
                cells[c]["_bars"] = bars(ratios)
        result["temperatures"][f"{t:g}"] = {"methods": list(methods), "cells": cells}
    return result


def bars(ratios: dict) -> dict:
    """Issue 33's bars for the combination, order by order (each order's best fixed K is the
    best of that order): its ratio to the best fixed K and to plain decoding, as the worst and
    the median over the orders, and whether every order clears BARS."""
    fixed = [r for name, r in ratios.items() if " K=" in name]
    best = [max(per_k) for per_k in zip(*fixed)]
    out = {}
    for key, ref in (("over_best_fixed", best), ("over_plain", [1.0] * len(best))):
        r = [c / b for c, b in zip(ratios[COMBO], ref)]
        out[key] = {"worst": min(r), "median": statistics.median(r), "bar": BARS[key], "met": min(r) >= BARS[key]}
    # The gap split in two: the combination over DFlash 2's own best fixed K (the schedule's
    # share), and that K over the best fixed K of any drafter (the drafts' share, no bar).
    own = [max(per_k) for per_k in zip(*[r for name, r in ratios.items() if name.startswith(f"{NAMES['dflash2']} K=")])]
    if own:
        for key, num, den in (("over_dflash2_fixed", ratios[COMBO], own), ("dflash2_fixed_over_best", own, best)):
            r = [a / b for a, b in zip(num, den)]
            out[key] = {"worst": min(r), "median": statistics.median(r)}
    return out


def published_check(hardware: costs.Hardware, context: int = 1024) -> dict:
    """The cost model against DFlash's published point: the speedup it projects for Qwen3-8B and
    its drafter at the published τ, batch 1, beside the published speedup."""
    costs_8b = StepCosts(
        costs.ForwardShape.of_decoder(QWEN3_8B),
        costs.drafter_forward(QWEN3_8B, DFLASH_BLOCK, DFLASH_BLOCK - 1, layers=DFLASH_LAYERS),
        hardware,
        DFLASH_BLOCK,
        context,
    )
    plain, step = costs_8b.plain(1), costs_8b.speculative(1, DFLASH_BLOCK)
    projected = PUBLISHED["tau"] * plain / step
    return PUBLISHED | {
        "context": context,
        "plain_ms": 1e3 * plain,
        "step_ms": 1e3 * step,
        "projected_speedup": projected,
        "projected_over_published": projected / PUBLISHED["speedup"],
    }


def best_fixed(cell: dict, drafter: str | None = None) -> tuple[str, float]:
    """The best fixed K of the cell (of `drafter`'s, a NAMES value, if given)."""
    fixed = {k: v for k, v in cell.items() if " K=" in k and (drafter is None or k.startswith(f"{drafter} K="))}
    name = max(fixed, key=fixed.get)
    return name, fixed[name]


def markdown(result: dict) -> str:
    lines = [f"# {result['label']}: the combination question, {result['setting']}, {result['hardware']['name']}", ""]
    lines.append(f"Median over {result['shuffles']} request orders, each at least {result.get('min_batches', 1)} batches "
                 "long (requests drawn again where the trace holds fewer); tokens/s relative to plain decoding. "
                 f"{result['approximation']}. The schedulers price a step's verify forward as "
                 f"{'padded to its widest request' if result.get('price', 'padded') == 'padded' else 'packed (Algorithm 1)'}.")  # fmt: skip
    check = result.get("published_check")
    if check:
        lines += ["", f"Check against a published point ({check['source']}): at τ {check['tau']} the model projects "
                  f"{check['projected_speedup']:.2f}x against the published {check['speedup']}x "
                  f"({check['projected_over_published']:.2f} of it)."]  # fmt: skip
    for t, block in result["temperatures"].items():
        cols = ["plain", "best fixed K", "DFlash 2's best K", DSPARK_SCHED, COMBO]
        lines += ["", f"## T = {t}", "", "| concurrency | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for c, cell in block["cells"].items():
            name, value = best_fixed(cell)
            own, own_value = best_fixed(cell, NAMES["dflash2"])
            row = [f"{cell['plain']:.2f}", f"{value:.2f} ({name})", f"{own_value:.2f} ({own.split()[-1]})"]
            row += [f"{cell[m]:.2f}" if m in cell else "-" for m in (DSPARK_SCHED, COMBO)]
            lines.append(f"| {c} | " + " | ".join(row) + " |")
        bar_cells = {c: cell["_bars"] for c, cell in block["cells"].items() if "_bars" in cell}
        if bar_cells:
            lines += ["", f"The combination order by order (worst / median over the {result['shuffles']} orders; "
                      f"bars ≥ {BARS['over_best_fixed']} × the best fixed K, ≥ {BARS['over_plain']} × plain). "
                      "The ratio to the best fixed K splits in two: the combination over DFlash 2's best fixed K "
                      "(the schedule's share) times that K over the best fixed K of any drafter (the drafts' share):",
                      "", "| concurrency | over best fixed K | over plain | bars | over DFlash 2's best fixed K "
                      "| DFlash 2's best fixed K over the best |", "|---|---|---|---|---|---|"]  # fmt: skip
            for c, b in bar_cells.items():
                fixed, plain = b["over_best_fixed"], b["over_plain"]
                met = "met" if fixed["met"] and plain["met"] else "**not met**"
                split = [f"{b[k]['worst']:.3f} / {b[k]['median']:.3f}" if k in b else "-"
                         for k in ("over_dflash2_fixed", "dflash2_fixed_over_best")]  # fmt: skip
                lines.append(f"| {c} | {fixed['worst']:.3f} / {fixed['median']:.3f} | "
                             f"{plain['worst']:.3f} / {plain['median']:.3f} | {met} | " + " | ".join(split) + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(result["temperatures"])
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps):
        cells = result["temperatures"][t]["cells"]
        cs = [int(c) for c in cells]
        best = [best_fixed(cells[c])[1] for c in cells]
        ax.plot(cs, best, marker="o", label="best fixed K")
        for m in (DSPARK_SCHED, COMBO):
            if all(m in cells[c] for c in cells):
                ax.plot(cs, [cells[c][m] for c in cells], marker="s", label=m)
        ax.axhline(1.0, color="black", linewidth=0.8, label="plain")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("tokens/s over plain decoding")
        ax.set_title(f"T = {t}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['label']}: {result['target']} on {result['hardware']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="tiny", help="whose traces (file prefix in --traces; default %(default)s)")
    p.add_argument("--traces", default=str(TRACES))
    p.add_argument("--cost-model", choices=("h200", "cpu"), default="h200")
    p.add_argument(
        "--cost-file", default=None, help="a cost_fit.py JSON for --cost-model cpu (default: the committed one)"
    )
    p.add_argument(
        "--setting",
        choices=("traced", "qwen3-8b"),
        default="traced",
        help="whose step costs: the traced target and drafter, or a Qwen3-8B-sized target with a 5-layer drafter "
        "at its width, on the traces' acceptance (labelled so)",
    )
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--shuffles", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--min-batches",
        type=int,
        default=16,
        help="each replay decodes at least this many batches, drawing the trace's requests again in new "
        "orders where it holds fewer (default %(default)s)",
    )
    p.add_argument(
        "--price",
        choices=("padded", "packed"),
        default="padded",
        help="the schedulers' T in Θ = τ · SPS(T): the padded forward the replay (as flashspark's loop) runs, or "
        "Algorithm 1's slots each priced as one token of a packed forward (method option price=)",
    )
    p.add_argument("--quick", action="store_true", help="3 shuffles, concurrency 1 4 16 64")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.shuffles, args.concurrency = 3, [1, 4, 16, 64]
    try:
        result = run(args)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    suffix = "_quick" if args.quick else ""
    setting = ("" if args.setting == "traced" else f"_{args.setting}") + ("_packed" if args.price == "packed" else "")
    out = (
        Path(args.out) if args.out else RESULTS / f"combo_replay_{args.target}{setting}_{args.cost_model}{suffix}.json"
    )
    md = markdown(result)
    print(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md)
    timing.save_result(result, out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
