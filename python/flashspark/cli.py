"""Command line: `python -m flashspark {train,generate,fit-proxy} ...`.

Subcommands are registered by small `add_*` functions so that new methods
(`train dflash`, `generate --method dspark`, ...) slot in without touching the
others. Expected errors (bad options, paths, checkpoints, prompts, and the ops'
argument checks) print one `error: ...` line and exit with status 2 instead of a
traceback; options are checked before any model loads.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys

GENERATE_METHODS = ["ar", "dflash", "dflash2", "dspark"]


class ArgParser(argparse.ArgumentParser):
    """argparse's errors as one `error: ...` line like every other bad argument (argparse's own
    print a usage block and the prog first). Subparsers, the trainers' included, inherit the class."""

    def error(self, message: str):
        fail(message)
        sys.exit(2)


def fail(message: str) -> int:
    print(f"error: {message.splitlines()[0] if message else 'failed'}", file=sys.stderr)
    return 2


def _at_least(lo: int):
    return lambda v: v >= lo, f"must be >= {lo}"


_FINITE_NONNEGATIVE = (lambda v: 0 <= v < math.inf, "must be finite and >= 0")
_FINITE_POSITIVE = (lambda v: 0 < v < math.inf, "must be finite and > 0")

# Ranges of numeric options, by argparse dest, checked for every subcommand that has the option
# (the drafter trainers' parsers live in flashspark.train); None is an option not given. NaN fails
# every comparison, so no range admits it.
RANGES = {
    "threads": _at_least(1),
    "batch_size": _at_least(1),
    "max_new_tokens": _at_least(1),
    "prompts": _at_least(1),
    "prompt_tokens": _at_least(1),
    "k": _at_least(1),  # its bound, the drafter's block size - 1: spec.cli.check_generate_spec_args
    "delay": _at_least(0),
    # The loop's Philox seeds are (seed << 32) + request, in int64.
    "seed": (lambda v: 0 <= v < 2**31, f"must be in [0, {2**31 - 1}]"),
    "temperature": _FINITE_NONNEGATIVE,
    "temperatures": _FINITE_NONNEGATIVE,
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "minutes": _FINITE_POSITIVE,
    "lr": _FINITE_POSITIVE,
}


def check_args(args) -> None:
    """Reject out-of-range options and an unusable --device before anything loads (ValueError)."""
    for dest, (ok, rule) in RANGES.items():
        values = getattr(args, dest, None)
        for v in values if isinstance(values, list) else [values]:
            if v is not None and not ok(v):
                raise ValueError(f"--{dest.replace('_', '-')} {rule}, got {v}")
    if getattr(args, "device", None) is not None:
        check_device(args.device)


def check_device(text: str) -> None:
    """cpu, cuda or cuda:N, present on this machine (models would fail to load on anything else)."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {text!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: no CUDA device available")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")


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

    a = TrainArgs(
        out=args.out,
        minutes=args.minutes,
        resume=args.resume,
        threads=args.threads,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        num_hidden_layers=args.layers,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        bf16=not args.no_bf16,
        eval_every_min=args.eval_every,
        command=args.command_line,
    )
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
    p.add_argument(
        "--stop-at-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop a request at <|endoftext|> (default on)",
    )
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
        try:
            # Python hands argv bytes that are not UTF-8 over as lone surrogates, which the
            # tokenizer cannot take.
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"--prompt is not valid UTF-8 (character {e.start})") from None
        return [unescape(args.prompt)]
    from pathlib import Path

    path = Path(args.prompts_file)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts-file {path} is not valid UTF-8 (byte {e.start})") from None
    # One prompt per line, with the same escapes as --prompt.
    prompts = [unescape(ln) for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def load_tokenizer(path: str | None):
    """The shipped tokenizer, or --tokenizer's, checked before any model loads: a file the
    tokenizers library cannot read (it raises a bare Exception) or one without the special
    tokens is a bad --tokenizer."""
    from . import data

    if path is None:
        return data.load_tokenizer()
    try:
        tok = data.load_tokenizer(path)
        data.special_token_ids(tok)
    except FileNotFoundError as e:
        raise ValueError(f"--tokenizer: {e}") from None
    except Exception as e:  # whatever the library raises, the file is at fault
        raise ValueError(f"--tokenizer {path} is not a usable tokenizer.json: {e}") from None
    return tok


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
    tok = load_tokenizer(args.tokenizer)
    dtype = torch.float32 if args.device == "cpu" else None
    model = load_model(args.model or data.ASSETS_DIR / "target", dtype=dtype, device=args.device)
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


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(prog="python -m flashspark", description="block-diffusion speculative decoding")
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
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0), or a bad argument ArgParser.error has reported (2)
        return e.code
    args.command_line = "python -m flashspark " + shlex.join(argv)
    try:
        check_args(args)
        return args.func(args)
    except (FileNotFoundError, ValueError) as e:
        return fail(str(e))
    except RuntimeError as e:
        # The ops' argument checks name the op first ("flashspark.verify: ..."): bad input that got
        # past the checks above. Any other RuntimeError is a bug and keeps its traceback.
        if not str(e).startswith("flashspark."):
            raise
        return fail(str(e))
    except KeyboardInterrupt:
        return 130
