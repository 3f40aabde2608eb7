"""Command line: `python -m flashspark {train,generate,fit-proxy} ...`.

Subcommands are registered by small `add_*` functions so that new methods
(`train dflash`, `generate --method dspark`, ...) slot in without touching the
others. Expected errors (bad paths, bad checkpoints, bad prompts) print one
line and exit with status 2 instead of a traceback.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

GENERATE_METHODS = ["ar", "dflash", "dflash2", "dspark"]


def add_train_target(sub) -> None:
    from .train.target import TrainArgs

    d = TrainArgs()
    p = sub.add_parser("target", help="train the tokenizer (if absent) and the target model")
    p.add_argument("--out", default=d.out, help="run directory: checkpoint, token cache, metrics (default %(default)s)")
    p.add_argument("--export", default=None, help="where the final weights go (default: the package assets)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="training time budget (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.num_hidden_layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)
    p.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (slower)")
    p.add_argument("--eval-every", type=float, default=d.eval_every_min, help="minutes between held-out evals")
    p.set_defaults(func=run_train_target)


def run_train_target(args) -> int:
    from .train.target import TrainArgs, train

    a = TrainArgs(out=args.out, minutes=args.minutes, resume=args.resume, threads=args.threads,
                  batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                  num_hidden_layers=args.layers, hidden_size=args.hidden_size,
                  intermediate_size=args.intermediate_size, bf16=not args.no_bf16,
                  eval_every_min=args.eval_every, command=args.command_line)
    if args.export:
        a.export = args.export
    train(a)
    return 0


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
    p.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="stop a request at <|endoftext|> (default on)")
    from .spec.cli import add_generate_spec_args

    add_generate_spec_args(p)
    p.set_defaults(func=run_generate)


_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    """Turn the escapes \\n, \\t and \\\\ into newline, tab and backslash, so a
    one-line shell argument can hold a multi-line Python prompt."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [unescape(args.prompt)]
    from pathlib import Path

    path = Path(args.prompts_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    # One prompt per line, with the same escapes as --prompt.
    prompts = [unescape(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def run_generate(args) -> int:
    import torch

    from . import data
    from .generate import generate_text
    from .models import load_model

    if args.method != "ar":
        from .spec.cli import run_generate_spec

        return run_generate_spec(args, args.method)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompts(args)
    tok = data.load_tokenizer(args.tokenizer)
    dtype = torch.float32 if args.device == "cpu" else None
    model = load_model(args.model or data.ASSETS_DIR / "target", dtype=dtype, device=args.device)
    texts, stats = generate_text(model, tok, prompts, max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                 batch_size=args.batch_size, stop_at_eos=args.stop_at_eos)
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if len(prompts) > 1:
            print(f"===== prompt {i} =====")
        print(prompt + text)
    print(f"\n[{args.method}] {stats['new_tokens']} new tokens in {stats['seconds']:.2f} s: "
          f"{stats['tokens_per_s']:.1f} tokens/s (prefill {stats['prefill_seconds']:.2f} s, "
          f"batch size {stats['batch_size']})", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashspark",
                                     description="block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train an embedded default model")
    train_sub = train.add_subparsers(dest="what", required=True)
    add_train_target(train_sub)
    from .spec.cli import add_train_dflash
    from .train.dflash2 import add_train_dflash2
    from .train.dspark import add_train_dspark

    add_train_dflash(train_sub)
    add_train_dflash2(train_sub)
    add_train_dspark(train_sub)
    add_generate(sub)
    from .spec.cli import add_fit_prior, add_fit_proxy

    add_fit_proxy(sub)
    add_fit_prior(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command_line = "python -m flashspark " + shlex.join(argv)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
