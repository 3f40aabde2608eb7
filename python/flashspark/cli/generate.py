"""`python -m flashspark generate`: plain decoding (`--method ar`) and speculative decoding
(`--method dflash|dflash2|dspark`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .. import data
from ..decoding.plain import encode_prompts, generate, generate_text
from ..methods import DRAFTERS, SCHEDULERS, MethodSpec, make_decoder
from ..models import load_model
from ..models.dflash2 import PATH_MODES
from .common import load_tokenizer, read_prompts

GENERATE_METHODS = ["ar", *DRAFTERS]
SPEC_METHODS = list(DRAFTERS)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument("--method", choices=GENERATE_METHODS, default="ar", help="decoding method (default %(default)s)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text; \\n, \\t and \\\\ stand for newline, tab, backslash")
    src.add_argument("--prompts-file", help="file with one prompt per line, same escapes as --prompt")
    p.add_argument("--model", default=None, help="target model directory (default: the shipped one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the shipped one)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="requests per batch (default: all prompts)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--stop-at-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop a request at <|endoftext|> (default on)",
    )

    add_generate_spec_args(p)
    p.set_defaults(func=run_generate)


def load_run(args):
    """The prompts, tokenizer and target model `generate` runs on (threads set first)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompts(args)
    tok = load_tokenizer(args.tokenizer)
    dtype = torch.float32 if args.device == "cpu" else None
    return prompts, tok, load_model(args.model or data.ASSETS_DIR / "target", dtype=dtype, device=args.device)


def run_generate(args) -> int:
    if args.method != "ar":
        return run_generate_spec(args, args.method)
    prompts, tok, model = load_run(args)
    texts, stats = generate_text(
        model,
        tok,
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
        stop_at_eos=args.stop_at_eos,
    )
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(prompts) > 1:
            print(f"===== prompt {i} =====")
        print(prompt + text)
    print(
        f"\n[{args.method}] {stats['new_tokens']} new tokens in {stats['seconds']:.2f} s: "
        f"{stats['tokens_per_s']:.1f} tokens/s (prefill {stats['prefill_seconds']:.2f} s, "
        f"batch size {stats['batch_size']})",
        file=sys.stderr,
    )
    return 0


def add_generate_spec_args(p) -> None:
    """Options of `generate` that only speculative methods read."""
    p.add_argument(
        "--k",
        type=int,
        default=None,
        help="draft tokens verified per step (fixed scheduler), or their bound (confidence "
        "scheduler); default: block size - 1",
    )
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one for --method)")
    p.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        default="fixed",
        help="fixed K, or DSpark's confidence scheduler (dspark: its head; dflash2: the "
        "confidence proxy) (default %(default)s)",
    )
    p.add_argument(
        "--path",
        choices=PATH_MODES,
        default="auto",
        help="DFlash 2 path mode; sample paths are verified with their sparse q (default %(default)s: "
        "backtrack at temperature 0, sample above)",
    )
    p.add_argument(
        "--delay", type=int, default=0, help="confidence scheduler: use confidences this many steps old (engines use 2)"
    )


def check_generate_spec_args(args, method: str) -> None:
    """What a speculative method adds to `flashspark.cli.check_args`, before anything loads:
    --top-p, and --k against the drafter's block size (from its config.json)."""

    if method not in SPEC_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {SPEC_METHODS}")
    if args.top_p < 1.0:
        raise ValueError(
            "--top-p is not supported by speculative decoding (lossless for the plain "
            "temperature distribution only); use --method ar"
        )
    gamma = drafter_block_size(Path(args.drafter) if args.drafter else data.ASSETS_DIR / method)
    if args.k is not None and gamma is not None and not 1 <= args.k <= gamma - 1:
        raise ValueError(f"--k must be in [1, {gamma - 1}] (the {method} drafter's block size - 1), got {args.k}")


def drafter_block_size(path) -> int | None:
    """γ from a drafter directory's config.json, without its weights; None where it cannot be
    read (loading the drafter then says what is wrong)."""

    try:
        return int(json.loads((path / "config.json").read_text())["block_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_generate_spec(args, method: str) -> int:
    """Decode the prompts with `method` and with plain decoding, print the
    texts, then tau, tokens/s and the speedup over plain decoding (stderr)."""

    check_generate_spec_args(args, method)
    prompts, tok, target = load_run(args)
    spec = MethodSpec(method, k=args.k, scheduler=args.scheduler, path=args.path, delay=args.delay)
    decode = make_decoder(spec, target, drafter_dir=args.drafter)
    eos = data.special_token_ids(tok)["eot"] if args.stop_at_eos else None
    ids = encode_prompts(tok, prompts)
    batch = args.batch_size or len(ids)
    chunks = [ids[i : i + batch] for i in range(0, len(ids), batch)]
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, eos_id=eos)

    # Warm both paths up once so neither pays first-call costs in the timing.
    decode(ids[:1], **{**common, "max_new_tokens": min(4, args.max_new_tokens)})
    generate(target, ids[:1], **{**common, "max_new_tokens": min(4, args.max_new_tokens)})
    spec_out, spec_stats = [], []
    for c in chunks:
        out, st = decode(c, **common)
        spec_out += out
        spec_stats.append(st)
    ar_out, ar_stats = generate(target, ids, top_p=1.0, batch_size=batch, **common)

    for i, (prompt, out) in enumerate(zip(prompts, spec_out)):
        if len(prompts) > 1:
            print(f"===== prompt {i} =====")
        print(prompt + tok.decode([t for t in out if t != eos]))
    new = sum(s["new_tokens"] for s in spec_stats)
    secs = sum(s["seconds"] for s in spec_stats)
    steps = sum(s["steps"] for s in spec_stats)
    tau = sum(s["tau"] * s["steps"] for s in spec_stats) / max(1, steps)
    verified = sum(s["drafts_verified"] for s in spec_stats) / max(1, steps)
    tps = new / secs if secs > 0 else 0.0
    same = "identical to" if spec_out == ar_out else "different from"
    k = decode.drafter.block_size - 1 if args.k is None else args.k
    how = f"K={k}" if args.scheduler == "fixed" else f"confidence scheduler, K<={k}"
    if method == "dflash2":
        how += f", {args.path} paths"
    print(
        f"\n[{method}, {how}] {new} new tokens in {secs:.2f} s: {tps:.1f} tokens/s, tau {tau:.2f} "
        f"tokens per target forward, {verified:.2f} drafts verified per step ({steps} request-steps)\n"
        f"[ar] {ar_stats['new_tokens']} new tokens in {ar_stats['seconds']:.2f} s: "
        f"{ar_stats['tokens_per_s']:.1f} tokens/s\n"
        f"speedup over plain decoding: {tps / max(ar_stats['tokens_per_s'], 1e-9):.2f}x; "
        f"output {same} plain decoding{' (expected at temperature 0)' if args.temperature == 0 else ''}",
        file=sys.stderr,
    )
    return 0
