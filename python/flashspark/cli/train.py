"""`python -m flashspark train target|dflash|dflash2|dspark`: each trainer's options, parsed
straight into its args dataclass (every option's dest is the field it sets)."""

from __future__ import annotations

import argparse
import dataclasses

from ..train.common import DFlashTrainArgs, RunArgs
from ..train.dflash import train as train_dflash
from ..train.dflash2 import DFlash2TrainArgs
from ..train.dflash2 import train as train_dflash2
from ..train.dspark import DSparkTrainArgs
from ..train.dspark import train as train_dspark
from ..train.target import TrainArgs
from ..train.target import train as train_target


def add_run_options(p, d: RunArgs, what: str) -> None:
    """The options of every trainer, with the defaults of its args dataclass `d`."""
    p.add_argument("--out", default=d.out, help=f"run directory: {what} (default %(default)s)")
    p.add_argument("--export", default=None, help="where the final weights go (default: the package assets)")
    p.add_argument("--minutes", type=float, default=d.minutes, help="time budget of the run (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt (and OUT's data)")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="train in plain fp32 (slower)")
    p.add_argument(
        "--eval-every",
        dest="eval_every_min",
        type=float,
        default=d.eval_every_min,
        help="minutes between held-out evals",
    )


def add_drafter_options(p, d: DFlashTrainArgs) -> None:
    """The options of every drafter trainer (the DFlash backbone's)."""
    add_run_options(p, d, "generated data, checkpoint, metrics")
    p.add_argument("--target", default=None, help="target model directory (default: the shipped one)")
    p.add_argument("--data-from", default=d.data_from, help="reuse the generated data of this run directory")
    p.add_argument(
        "--gen-frac",
        type=float,
        default=d.gen_frac,
        help="share of the budget for generating target continuations (default %(default)s)",
    )
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--eval-sequences", type=int, default=d.eval_sequences)
    p.add_argument("--layers", type=int, default=d.layers, help="drafter decoder layers (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="gamma (default %(default)s)")
    p.add_argument("--decay", type=float, default=d.decay, help="gamma_d (0 = the paper's value)")
    p.add_argument("--blocks-per-seq", type=int, default=d.blocks_per_seq, help="random anchors per sequence")


def add_target_options(p, d: TrainArgs) -> None:
    add_run_options(p, d, "checkpoint, token cache, metrics")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--layers", dest="num_hidden_layers", type=int, default=d.num_hidden_layers)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--intermediate-size", type=int, default=d.intermediate_size)


def add_dflash_options(p, d: DFlashTrainArgs) -> None:
    add_drafter_options(p, d)
    p.add_argument(
        "--init-layers",
        action=argparse.BooleanOptionalAction,
        default=d.init_layers,
        help="start the drafter layers from the target's top layers",
    )


def add_dflash2_options(p, d: DFlash2TrainArgs) -> None:
    add_drafter_options(p, d)
    p.add_argument("--init-from", default=d.init_from, help="DFlash drafter directory to start the backbone from")
    p.add_argument("--selector-rank", type=int, default=d.selector_rank)
    p.add_argument("--selector-topk", type=int, default=d.selector_topk)
    p.add_argument("--selector-weight", type=float, default=d.selector_weight)
    p.add_argument("--path-mode", choices=["backtrack", "greedy"], default=d.path_mode)


def add_dspark_options(p, d: DSparkTrainArgs) -> None:
    add_drafter_options(p, d)
    p.add_argument("--init-from", default=d.init_from, help="DFlash drafter directory to start the backbone from")
    p.add_argument("--markov-rank", type=int, default=d.markov_rank)
    p.add_argument("--target-topk", type=int, default=d.target_topk)
    p.add_argument("--calib-sequences", type=int, default=d.calib_sequences)


# name: (args dataclass, its options, the trainer, help). A new trainer is one line here.
TRAINERS = {
    "target": (TrainArgs, add_target_options, train_target, "train the tokenizer (if absent) and the target model"),
    "dflash": (DFlashTrainArgs, add_dflash_options, train_dflash, "distil the DFlash drafter from the target"),
    "dflash2": (
        DFlash2TrainArgs,
        add_dflash2_options,
        train_dflash2,
        "distil the DFlash 2 drafter (convs + path selector) from the target",
    ),
    "dspark": (
        DSparkTrainArgs,
        add_dspark_options,
        train_dspark,
        "distil the DSpark drafter (Markov + confidence heads) and calibrate it",
    ),
}


def add_train(train_sub) -> None:
    """Every `train <what>` subcommand."""
    for name, (cls, add_options, _, help) in TRAINERS.items():
        p = train_sub.add_parser(name, help=help)
        add_options(p, cls())
        p.set_defaults(func=run_train, trainer=name)


def train_args(args) -> RunArgs:
    """The trainer's args dataclass from the parsed options; an option left at None (--export,
    --target) keeps the dataclass's default."""
    cls = TRAINERS[args.trainer][0]
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "command" and hasattr(args, f.name)
    }
    return cls(**{k: v for k, v in given.items() if v is not None}, command=getattr(args, "command_line", ""))


def run_train(args) -> int:
    TRAINERS[args.trainer][2](train_args(args))
    return 0
