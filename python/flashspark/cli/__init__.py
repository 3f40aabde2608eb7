"""Command line: `python -m flashspark {generate,train,fit-proxy,fit-prior,export} ...`, one module per
command group (the only place that parses arguments). Expected errors (bad options, paths,
checkpoints, prompts, and the ops' argument checks) print one `error: ...` line and exit with
status 2 instead of a traceback; options are checked before any model loads."""

from __future__ import annotations

import argparse
import shlex
import sys

from .common import ArgParser, check_args, fail
from .export import add_export
from .fit import add_fit_prior, add_fit_proxy
from .generate import add_generate
from .train import add_train


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(prog="python -m flashspark", description="block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train an embedded default model")
    train_sub = train.add_subparsers(dest="what", required=True)
    add_train(train_sub)
    add_generate(sub)
    add_fit_proxy(sub)
    add_fit_prior(sub)
    add_export(sub)
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
