"""Record acceptance traces (flashspark.scheduling.replay.Trace) from real runs: every shipped
drafter of the target, fixed K = its drafts per block (every draft verified), the loop's
record mode, held-out prompts of each task, each request stopping at EOS (or after
`--max-new-tokens`), at each temperature.

    python bench/record_traces.py                                   # tiny target
    python bench/record_traces.py --model smollm2 --dtype float32   # -> bench/results/traces/smollm2_*.npz
    python bench/record_traces.py --model smollm2 --dtype float32 --tasks chat --no-stop-at-eos \
        --out-dir runs/traces_noeos                                 # what e2e_bench decodes (replay_check)

Per drafter and temperature one file, bench/results/traces/<target>_<drafter>_t<T>.npz: per
request-step the drafted block, the accepted prefix, the context length, and the confidence
sources' per-position values: `margin` (the engines' margin logistic, run online over the
rows in decode order), `dspark_head` (DSpark's calibrated head), `proxy` (the shipped DFlash 2
proxy's offline fit; its inputs are kept as `signals`, for a replay that updates it online).
Each file records the command that wrote it. Nothing is timed: a trace is the same on any
machine (and any load) for the same drafters and prompts.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import numpy as np
import targets
import timing
import torch
from flashspark.cli.common import check_args
from flashspark.cli.fit import collect_records
from flashspark.methods import DRAFTERS, drafter_dir_of, load_proxy, make_decoder
from flashspark.scheduling.calibration import online_confidences
from flashspark.scheduling.margin import MarginLogistic
from flashspark.scheduling.replay import Trace

RESULTS = Path(__file__).resolve().parent / "results" / "traces"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    targets.add_target_args(p)
    p.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS))
    targets.add_tasks_arg(p)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per task (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tiny target only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--no-stop-at-eos",
        action="store_true",
        help="decode --max-new-tokens per request, as e2e_bench does (traces for bench/replay_check.py)",
    )
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    try:
        check_args(args)
        torch.set_num_threads(args.threads)
        target = targets.load_bench_target(args)
        tasks = args.tasks or list(target.tasks)
        targets.check_tasks(target, tasks)
        prompts, task_of = [], []
        for t, task in enumerate(tasks):
            got = target.heldout_prompts(task, args.prompts, args.prompt_tokens)
            prompts += got
            task_of += [t] * len(got)
        eos = None if target.tiny or args.no_stop_at_eos else target.eos_id()
        decoders = {d: make_decoder(d, target.model) for d in args.drafters}
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "tiny" if target.tiny else (target.ref.known.name if target.ref.known else target.ref.path.stem)
    command = "python bench/record_traces.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"{'drafter':>8} {'T':>4} {'requests':>8} {'rows':>6} {'tau':>6}  file")
    for drafter, decode in decoders.items():
        for t in args.temperatures:
            lengths: list[int] = []
            rec = collect_records(decode, prompts, args.max_new_tokens, t, args.batch_size, args.seed, eos, lengths)
            K = decode.drafter.num_drafts
            step = rec["step"]
            sources = {}
            margin = MarginLogistic(K)
            sources["margin"] = online_confidences(
                margin, rec["top2_margin"], rec["num_accepted"], rec["num_verified"], step
            ).numpy()
            if rec["confidence"] is not None:
                sources["dspark_head"] = rec["confidence"].numpy()
            signals = None
            if rec["signals"] is not None:
                signals = rec["signals"].numpy()
                directory = drafter_dir_of("dflash2", None, target.model)
                sources["proxy"] = load_proxy(directory, t)(rec["signals"]).numpy()
            trace = Trace(
                meta={
                    "target": target.label,
                    "drafter": drafter,
                    "temperature": t,
                    "drafts_per_block": K,
                    "block_size": decode.drafter.block_size,
                    # What a replay's cost model reads (no model needs loading to replay).
                    "target_config": target.model.config.to_dict(),
                    "drafter_config": decode.drafter.config.layer_config().to_dict(),
                    "tasks": tasks,
                    "task_of_request": task_of,
                    "max_new_tokens": args.max_new_tokens,
                    "eos_id": eos,
                    "command": command,
                    "date": timing.result_header("trace", "record_traces.py", argv, args.device)["date"],
                },
                request=rec["request"].numpy(),
                step=step.numpy(),
                ctx_len=rec["ctx_len"].numpy(),
                accepted=rec["num_accepted"].numpy(),
                tokens=rec["tokens"].numpy(),
                new_tokens=np.array(lengths),
                prompt_len=np.array([len(q) for q in prompts]),
                prompt_tokens=np.array([x for q in prompts for x in q]),
                sources=sources,
                signals=signals,
            )
            path = out_dir / f"{name}_{drafter}_t{t:g}.npz"
            trace.save(path)
            tau = (trace.accepted.sum() + len(trace.accepted)) / max(1, len(trace.accepted))
            print(f"{drafter:>8} {t:>4g} {trace.requests:>8} {len(trace.accepted):>6} {tau:>6.2f}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
