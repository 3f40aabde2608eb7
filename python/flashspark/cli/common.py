"""What every command shares: one-line argument errors, option ranges checked before
anything loads, prompts and the tokenizer."""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import torch

from .. import data
from ..models import catalog


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
    "k": _at_least(1),  # its bound, the drafter's block size - 1: cli.generate.check_generate_spec_args
    "delay": _at_least(0),
    # The loop's Philox seeds are (seed << 32) + request, in int64.
    "seed": (lambda v: 0 <= v < 2**31, f"must be in [0, {2**31 - 1}]"),
    "temperature": _FINITE_NONNEGATIVE,
    "temperatures": _FINITE_NONNEGATIVE,
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "minutes": _FINITE_POSITIVE,
    "lr": _FINITE_POSITIVE,
    # train data and the drafter trainers on its data
    "max_tokens": _at_least(0),
    "max_prompts": _at_least(0),
    "max_prompt_tokens": _at_least(1),
    "top_k": _at_least(1),
    "window": _at_least(2),
    "intermediate_size": _at_least(1),
    "head_negatives": _at_least(0),
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


def load_tokenizer(path: str | None, target: catalog.TargetRef | None = None):
    """--tokenizer's tokenizer, else the target's (`catalog.target_tokenizer`; default: the
    shipped one), checked before any model loads: a file the tokenizers library cannot read (it
    raises a bare Exception) is a bad --tokenizer, and so is one without the special tokens the
    tiny target's pipeline uses (<|endoftext|>, <|mask|>)."""

    tiny = target is None or (target.known is not None and target.known.name == catalog.DEFAULT_TARGET)
    if path is None:
        return data.load_tokenizer() if target is None else catalog.target_tokenizer(target)
    try:
        tok = data.load_tokenizer(path)
        if tiny:
            data.special_token_ids(tok)
    except FileNotFoundError as e:
        raise ValueError(f"--tokenizer: {e}") from None
    except Exception as e:  # whatever the library raises, the file is at fault
        raise ValueError(f"--tokenizer {path} is not a usable tokenizer.json: {e}") from None
    return tok
