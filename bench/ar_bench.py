"""Plain autoregressive decoding throughput of the target model.

For each concurrency c, decodes c held-out prompts as one batch (greedy, a
fixed number of new tokens, no early stop) and reports generated tokens per
second. Writes bench/results/ar_bench.json.

    python bench/ar_bench.py [--concurrency 1 2 4 8 16 32] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import timing
import torch
from flashspark import data
from flashspark.decoding.plain import generate
from flashspark.models import load_model


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = load_model(args.model or data.ASSETS_DIR / "target", dtype=dtype, device=device)
    tok = data.load_tokenizer()
    n = max(args.concurrency)
    prompts = data.heldout_prompts(args.task, n, args.prompt_tokens, tok)
    # Warm up allocator and kernels once so the first row is not penalised.
    generate(model, prompts[:2], max_new_tokens=4)
    rows = []
    for c in args.concurrency:
        best = None
        for _ in range(args.repeats):
            _, st = generate(model, prompts[:c], max_new_tokens=args.max_new_tokens)
            if best is None or st["seconds"] < best["seconds"]:
                best = st
        row = {
            "concurrency": c,
            "tokens_per_s": best["tokens_per_s"],
            "decode_tokens_per_s": best["decode_tokens_per_s"],
            "per_request_tokens_per_s": best["tokens_per_s"] / c,
            "ms_per_step": 1e3 * best["decode_seconds"] / max(1, best["forwards"] - 1),
            "prefill_s": best["prefill_seconds"],
            "seconds": best["seconds"],
            "new_tokens": best["new_tokens"],
        }
        rows.append(row)
        print(
            f"{c:>11} {row['tokens_per_s']:>10.1f} {row['per_request_tokens_per_s']:>12.1f} "
            f"{row['ms_per_step']:>11.2f} {row['prefill_s']:>10.3f}",
            flush=True,
        )
    return {
        **timing.result_header("ar", "ar_bench.py", None, device, dtype),
        # Other work on the machine skews CPU numbers; record how busy it was.
        "loadavg_at_start": list(os.getloadavg()),
        "note": args.note,
        "model": str(args.model or "shipped target"),
        "params": model.num_parameters(),
        "task": args.task,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "decoding": "greedy, no early stop",
        "repeats": args.repeats,
        "results": rows,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target model directory (default: shipped)")
    p.add_argument("--task", default="code", choices=data.TASKS)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs per row")
    # One thread by default: a 7M-parameter model gains little from a second
    # one, and a spinning thread pool collapses when the cores are shared.
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ar_bench.json"))
    args = p.parse_args(argv)
    print(f"{'concurrency':>11} {'tokens/s':>10} {'per request':>12} {'ms/step':>11} {'prefill s':>10}")
    try:
        result = run(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    timing.save_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
