"""Fit this machine's description for the cost model (flashspark.scheduling.costs): time the
target's verify forwards over a grid of batch sizes, tokens per request and context lengths,
and the drafter's drafting passes, fit bandwidth, peak FLOP/s, a per-forward and a per-layer
overhead to both (`fit_hardware`), then measure whole loop steps against the fit.

    python bench/cost_fit.py                               # tiny target
    python bench/cost_fit.py --model smollm2 --dtype float32

Writes bench/results/cost_model_<target>_cpu.json: the fitted `Hardware`, every measurement
with its relative error, the fit's RMS and worst error, and `step_rest`: the rest of each kind
of loop step beyond its modelled forwards (a speculative step of each drafter at each of
`--step-drafts` and its full width, a plain decoding step), measured in the loops' own code per
temperature, batch size and context (`step_rests`, over the committed traces' span of contexts),
and the prefill's ratio to its modelled forward. The replay adds the rests to every step it
prices, at its batch's longest context (bench/combo_replay.py --cost-model cpu). Run it on an
otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import e2e_bench
import numpy as np
import targets
import timing
import torch
from flashspark.decoding.loop import prefill
from flashspark.methods import (
    load_method_drafter,
    measured_plain_step_seconds,
    measured_prefill_seconds,
    measured_step_seconds,
)
from flashspark.scheduling import costs
from flashspark.scheduling.replay import Trace

RESULTS = Path(__file__).resolve().parent / "results"
TRACES = RESULTS / "traces"


@torch.no_grad()
def draft_seconds(target, drafter, batch: int, context: int, repeats: int) -> float:
    prompts = torch.randint(2, target.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
    temp, seeds = torch.zeros(batch), torch.arange(batch)
    _, dcache, lens, anchor = prefill(target, drafter, prompts.tolist(), 8, temp, seeds)
    offsets = torch.ones(batch, dtype=torch.int64)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        drafter.propose(dcache, anchor, lens, temp, seeds, offsets, signals=False)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rest_spans(prompt_lens, decoded_ends) -> tuple[list[int], int]:
    """The contexts and the prefill length the step rests are measured at, for requests of
    these prompt lengths decoded to these ends: a batch's steps attend over its longest request
    (the loop pads to it), so the contexts span the shortest prompt to the longest request
    decoded to the end; the prefill is the median prompt's."""
    lens = sorted(int(n) for n in prompt_lens)
    return [lens[0], int(max(decoded_ends))], lens[len(lens) // 2]


def trace_spans(name: str) -> tuple[list[int], int] | None:
    """`rest_spans` of the target's committed traces, if there are any."""
    traces = [Trace.load(p) for p in sorted(TRACES.glob(f"{name}_*.npz"))]
    if not traces:
        return None
    return rest_spans(
        np.concatenate([t.prompt_len for t in traces]), np.concatenate([t.prompt_len + t.new_tokens for t in traces])
    )


def step_rests(
    target,
    shape,
    hw,
    elem: float,
    drafters: dict,
    temperatures,
    batches,
    contexts,
    repeats: int,
    drafts=(None,),
    prefill_len: int | None = None,
    steps: int = 6,
) -> tuple[dict, list[dict]]:
    """The rest of each kind of loop step beyond its modelled forwards, measured in the loops'
    own code: a speculative step of each of `drafters` (name -> drafter; drafting and verifying
    K drafts per request, each K of `drafts`, None: its drafts per block) minus the modelled
    drafter pass and verify forward, and a plain decoding step minus the modelled one-token
    forward; per temperature (sampling costs a step more), batch size and context (committed
    tokens, each of `contexts`); a speculative run decodes `steps` x (K + 1) tokens (random
    prompts: about as many loop steps, their drafts rarely accepted). A rest is negative where
    the fit overprices the step's forwards (a one-token forward on this CPU, cheaper than the
    fit's shape puts it): added to the modelled forwards it gives the measured step back. The
    replay interpolates the rests between the measured batches, widths and contexts
    (`replay._rest`), and prices a step at its batch's longest context (`"padded"`), as this
    loop attends.

    The kinds of one batch size and context are timed one after the other, `repeats` times over
    in rotated orders, and a speculative step is priced as the median of its ratios to the plain
    step timed in the same pass, times the plain step's median: what the replay compares is a
    speculative step's price against a plain one's, and a shared machine's speed drifts by tens
    of percent within a minute, so the two must come from the same minutes (timed in blocks,
    one kind after another, their ratio would read the drift between the blocks; medians of
    each kind alone, a slow spell that hit one kind's runs but not the other's). `runs_s` keeps
    every run (kind -> temperature -> batch -> context -> seconds, in the order timed).

    With `prefill_len`, the prefill of each batch size's prompts of that many tokens too, timed
    in the same passes: `prefill` holds (batch, measured / modelled) pairs (the fit's forwards
    are a few tokens per request wide; a prefill is hundreds, where this CPU runs slower than
    the fit's peak)."""
    rest = {
        "contexts": list(contexts),
        "repeats": repeats,
        "steps": steps,
        "interleaved": True,
        "paired": True,
        "padded": True,
        "speculative": {},
        "plain": {},
        "runs_s": {},
    }
    checks = []
    spec = {(d, k): (d if k is None else f"{d}:k={k}") for d in drafters for k in drafts}
    label = {"plain": "plain", "prefill": "prefill", **spec}  # kind -> its name in the runs and logs
    kinds = ["plain", *spec] + (["prefill"] if prefill_len else [])
    prefill_runs: dict[int, list[float]] = {b: [] for b in batches}
    for t in temperatures:
        key = f"{t:g}"
        runs = {(kind, b, c): [] for kind in kinds if kind != "prefill" for b in batches for c in contexts}
        for i in range(repeats):
            for b in batches:
                for c in contexts:
                    for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:
                        if kind == "prefill":
                            if c != contexts[0] or t != temperatures[0]:
                                continue
                            step = measured_prefill_seconds(target, b, prefill_len)
                        elif kind == "plain":
                            step = measured_plain_step_seconds(target, b, c, temperature=t)
                        else:
                            d, k = kind
                            step = measured_step_seconds(
                                target, drafters[d], b, context_len=c, steps=steps, temperature=t, k=k
                            )
                        (prefill_runs[b] if kind == "prefill" else runs[(kind, b, c)]).append(step)
                        print(f"T {t:g} run {i + 1}/{repeats} batch {b} context {c}: {label[kind]} "
                              f"{1e3 * step:.2f} ms", flush=True)  # fmt: skip
        for (kind, b, c), seconds in runs.items():
            rest["runs_s"].setdefault(label[kind], {}).setdefault(key, {}).setdefault(str(b), {})[str(c)] = seconds
        rest["plain"][key] = []
        for b in batches:
            for c in contexts:
                step = statistics.median(runs[("plain", b, c)])
                model = float(costs.forward_time(shape, hw, b, 1, c))
                rest["plain"][key].append([b, c, step - model])
                checks.append({"kind": "plain", "temperature": t, "batch": b, "context": c, "step_s": step,
                               "forward_model_s": model})  # fmt: skip
        for kind, name in spec.items():
            d, drafter = kind[0], drafters[kind[0]]
            k = drafter.num_drafts if kind[1] is None else min(kind[1], drafter.num_drafts)
            shape_d = costs.drafter_forward(
                drafter.config.layer_config(), drafter.block_size, drafter.num_drafts, None, elem
            )
            rows = rest["speculative"].setdefault(d, {}).setdefault(key, [])
            for b in batches:
                for c in contexts:
                    # Paired: the median of its runs' ratios to the plain step of the same pass, times
                    # the plain step's median (a slow spell over one pass moves both of its runs).
                    plain = runs[("plain", b, c)]
                    step = statistics.median(plain) * statistics.median(
                        s / q for s, q in zip(runs[(kind, b, c)], plain)
                    )
                    draft = float(costs.forward_time(shape_d, hw, b, drafter.block_size, c))
                    verify = float(costs.forward_time(shape, hw, b, k + 1, c))
                    rows.append([b, c, k + 1, step - draft - verify])
                    checks.append({"kind": name, "temperature": t, "batch": b, "context": c, "width": k + 1,
                                   "step_s": step, "draft_model_s": draft, "verify_model_s": verify})  # fmt: skip
                    print(f"T {t:g} batch {b} context {c}: {name} step {1e3 * step:.2f} ms (paired), model draft "
                          f"{1e3 * draft:.2f} + verify {1e3 * verify:.2f}", flush=True)  # fmt: skip
    if prefill_len:
        rest["prefill_len"] = prefill_len
        rest["prefill"] = []
        for b in batches:
            model = float(costs.forward_time(shape, hw, b, prefill_len, 0))
            rest["prefill"].append([b, statistics.median(prefill_runs[b]) / model])
            checks.append({"kind": "prefill", "batch": b, "tokens": prefill_len,
                           "prefill_s": statistics.median(prefill_runs[b]), "forward_model_s": model})  # fmt: skip
        rest["runs_s"]["prefill"] = {str(b): v for b, v in prefill_runs.items()}
    return rest, checks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    targets.add_target_args(p)
    p.add_argument("--drafter", default="dflash", help="the drafter whose passes check the fit (default %(default)s)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8], help="tokens per request")
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--step-contexts",
        type=int,
        nargs="+",
        default=None,
        help="contexts of the loop-step measurements (default: the target's committed traces, from the shortest "
        "prompt to the longest decoded to the end)",
    )
    p.add_argument(
        "--step-drafts",
        type=int,
        nargs="*",
        default=[1, 3],
        help="K values each drafter's step is measured at besides its full width (default %(default)s)",
    )
    p.add_argument(
        "--prefill-len",
        type=int,
        default=None,
        help="prompt tokens of the prefill measurement (default: the traces' median prompt; 0: none)",
    )
    p.add_argument("--step-drafters", nargs="+", default=["dflash", "dflash2", "dspark"])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--step-repeats", type=int, default=3, help="runs per loop-step measurement (the median)")
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
    elem = torch.finfo(dtype).bits // 8
    shape = costs.ForwardShape.of_decoder(target.config, weight_bytes_per_param=elem, kv_bytes_per_value=elem)
    shape_d = costs.drafter_forward(drafter.config.layer_config(), drafter.block_size, drafter.num_drafts, None, elem)
    layers = drafter.config.target_layer_ids
    measured = []
    print(f"{'batch':>5} {'tokens':>6} {'context':>7} {'ms':>8}")
    for ctx in args.contexts:
        for b in args.batches:
            for w in args.widths:
                cache = target.new_cache(b, ctx + w)
                lens = torch.full((b,), ctx, dtype=torch.int64)
                tokens = torch.randint(2, target.config.vocab_size, (b, w), generator=torch.Generator().manual_seed(0))
                sec = costs.forward_seconds(target, tokens, cache, lens, torch.full((b,), w), layers, 1, args.repeats)
                measured.append((b, w, ctx, sec))
                print(f"{b:>5} {w:>6} {ctx:>7} {1e3 * sec:>8.2f}", flush=True)
    # The drafter's passes, fitted with the target's: two depths (its layers, the target's) set
    # the per-layer overhead apart from the per-forward one.
    drafted = []
    for ctx in args.contexts:
        for b in args.batches:
            sec = draft_seconds(target, drafter, b, ctx, args.repeats)
            drafted.append((b, drafter.block_size, ctx, sec))
            print(f"{b:>5} {'draft':>6} {ctx:>7} {1e3 * sec:>8.2f}", flush=True)
    label = f"this CPU, {name} {str(dtype).removeprefix('torch.')}, fitted"
    fit = costs.fit_hardware(shape, measured, label, others=[(shape_d, drafted)])
    hw = fit.hardware
    print(f"fit: {hw}; relative error RMS {fit.rms_error:.3f}, worst {fit.max_error:.3f}")
    spans = trace_spans(name) or (args.contexts, args.contexts[-1])
    rest, checks = step_rests(
        target,
        shape,
        hw,
        elem,
        {d: load_method_drafter(d, target) for d in args.step_drafters},
        args.temperatures,
        args.batches,
        args.step_contexts or spans[0],
        args.step_repeats,
        drafts=(*args.step_drafts, None),
        prefill_len=spans[1] if args.prefill_len is None else args.prefill_len,
    )
    result = {
        **timing.result_header("cost_fit", "cost_fit.py", argv, "cpu", dtype),
        "target": bench_target.label,
        "hardware": hw.to_dict(),
        "bytes_per_value": elem,  # the shapes' weight and K/V bytes the rates were fitted with
        "fit": {"rms_error": fit.rms_error, "max_error": fit.max_error},
        "measurements": [
            {"model": model, "batch": b, "tokens": w, "context": c, "seconds": s, "relative_error": e}
            for model, (b, w, c, s), e in zip(
                ["target"] * len(measured) + ["drafter"] * len(drafted), measured + drafted, fit.relative_errors
            )
        ],
        "drafter": args.drafter,
        # What the replay adds to each modelled step (combo_replay.step_costs): per step kind,
        # drafter and temperature, [batch, context, (width,) seconds] rows it interpolates in each.
        "step_rest": rest,
        "checks": checks,
    }
    out = Path(args.out) if args.out else RESULTS / f"cost_model_{name}_cpu.json"
    timing.save_result(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
