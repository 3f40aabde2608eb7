"""Command-line glue for speculative decoding: `train dflash` and
`generate --method dflash`, registered from `flashspark.cli`."""

from __future__ import annotations

import argparse
import sys

SPEC_METHODS = ["dflash"]


def add_train_dflash(train_sub) -> None:
    """`python -m flashspark train dflash ...`"""
    from ..train.dflash import DFlashTrainArgs

    d = DFlashTrainArgs()
    p = train_sub.add_parser("dflash", help="distil the DFlash drafter from the target")
    p.add_argument("--out", default=d.out, help="run directory: data, checkpoint, metrics (default %(default)s)")
    p.add_argument("--export", default=None, help="where the final drafter goes (default: the package assets)")
    p.add_argument("--target", default=None, help="target model directory (default: the shipped one)")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="budget of the whole run: data, training, evaluation, export (default %(default)s)")
    p.add_argument("--gen-frac", type=float, default=d.gen_frac,
                   help="share of the budget for generating target continuations (default %(default)s)")
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt with OUT/data")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.layers, help="drafter decoder layers (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="gamma (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--blocks-per-seq", type=int, default=d.blocks_per_seq, help="random anchors per sequence")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--init-layers", action=argparse.BooleanOptionalAction, default=d.init_layers,
                   help="start the drafter layers from the target's top layers")
    p.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (slower)")
    p.add_argument("--eval-every", type=float, default=d.eval_every_min, help="minutes between held-out evals")
    p.set_defaults(func=run_train_dflash)


def run_train_dflash(args) -> int:
    from ..train.dflash import DFlashTrainArgs, train

    a = DFlashTrainArgs(out=args.out, minutes=args.minutes, gen_frac=args.gen_frac, max_sequences=args.max_sequences,
                        resume=args.resume, threads=args.threads, seed=args.seed, layers=args.layers,
                        block_size=args.block_size, batch_size=args.batch_size, blocks_per_seq=args.blocks_per_seq,
                        lr=args.lr, init_layers=args.init_layers, bf16=not args.no_bf16,
                        eval_every_min=args.eval_every, command=getattr(args, "command_line", ""))
    if args.export:
        a.export = args.export
    if args.target:
        a.target = args.target
    train(a)
    return 0


def add_generate_spec_args(p) -> None:
    """Options of `generate` that only speculative methods read."""
    p.add_argument("--k", type=int, default=None,
                   help="draft tokens verified per step (speculative methods; default: block size - 1)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one for --method)")


def run_generate_spec(args, method: str) -> int:
    """Decode the prompts with `method` and with plain decoding, print the
    texts, then tau, tokens/s and the speedup over plain decoding (stderr)."""
    import torch

    from .. import data
    from ..cli import read_prompts
    from ..generate import generate
    from ..models import load_model
    from ..models.dflash import load_dflash
    from .loop import speculative_generate
    from .schedulers import FixedK

    if method not in SPEC_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {SPEC_METHODS}")
    if args.top_p < 1.0:
        raise ValueError("top-p is not supported by speculative decoding (lossless for the plain "
                         "temperature distribution only); use --method ar")
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompts(args)
    tok = data.load_tokenizer(args.tokenizer)
    dtype = torch.float32 if args.device == "cpu" else None
    target = load_model(args.model or data.ASSETS_DIR / "target", dtype=dtype, device=args.device)
    drafter = load_dflash(getattr(args, "drafter", None) or data.ASSETS_DIR / method, target)
    k = args.k if getattr(args, "k", None) is not None else drafter.block_size - 1
    scheduler = FixedK(k)
    eos = data.special_token_ids(tok)["eot"] if args.stop_at_eos else None
    ids = []
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        ids.append(tok.encode(p, add_special_tokens=False).ids)
    batch = args.batch_size or len(ids)
    chunks = [ids[i:i + batch] for i in range(0, len(ids), batch)]
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, eos_id=eos)

    # Warm both paths up once so neither pays first-call costs in the timing.
    speculative_generate(target, drafter, ids[:1], **{**common, "max_new_tokens": min(4, args.max_new_tokens)},
                         scheduler=scheduler)
    generate(target, ids[:1], **{**common, "max_new_tokens": min(4, args.max_new_tokens)})
    spec_out, spec_stats = [], []
    for c in chunks:
        out, st = speculative_generate(target, drafter, c, scheduler=scheduler, **common)
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
    tps = new / secs if secs > 0 else 0.0
    same = "identical to" if spec_out == ar_out else "different from"
    print(f"\n[{method}, K={k}] {new} new tokens in {secs:.2f} s: {tps:.1f} tokens/s, tau {tau:.2f} "
          f"tokens per target forward ({steps} request-steps)\n"
          f"[ar] {ar_stats['new_tokens']} new tokens in {ar_stats['seconds']:.2f} s: "
          f"{ar_stats['tokens_per_s']:.1f} tokens/s\n"
          f"speedup over plain decoding: {tps / max(ar_stats['tokens_per_s'], 1e-9):.2f}x; "
          f"output {same} plain decoding{' (expected at temperature 0)' if args.temperature == 0 else ''}",
          file=sys.stderr)
    return 0
