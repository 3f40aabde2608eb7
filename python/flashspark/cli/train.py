"""`python -m flashspark train target|dflash|dflash2|dspark`: each trainer's options, mapped onto
its args dataclass."""

from __future__ import annotations

import argparse

from ..train.common import DFlashTrainArgs
from ..train.dflash import train as train_dflash
from ..train.dflash2 import DFlash2TrainArgs
from ..train.dflash2 import train as train_dflash2
from ..train.dspark import DSparkTrainArgs
from ..train.dspark import train as train_dspark
from ..train.target import TrainArgs
from ..train.target import train as train_target


def add_train_target(sub) -> None:
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
    train_target(a)
    return 0


def add_train_dflash(train_sub) -> None:
    """`python -m flashspark train dflash ...`"""

    d = DFlashTrainArgs()
    p = train_sub.add_parser("dflash", help="distil the DFlash drafter from the target")
    p.add_argument("--out", default=d.out, help="run directory: data, checkpoint, metrics (default %(default)s)")
    p.add_argument("--export", default=None, help="where the final drafter goes (default: the package assets)")
    p.add_argument("--target", default=None, help="target model directory (default: the shipped one)")
    p.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help="budget of the whole run: data, training, evaluation, export (default %(default)s)",
    )
    p.add_argument(
        "--gen-frac",
        type=float,
        default=d.gen_frac,
        help="share of the budget for generating target continuations (default %(default)s)",
    )
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt with OUT/data")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.layers, help="drafter decoder layers (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="gamma (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--blocks-per-seq", type=int, default=d.blocks_per_seq, help="random anchors per sequence")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--init-layers",
        action=argparse.BooleanOptionalAction,
        default=d.init_layers,
        help="start the drafter layers from the target's top layers",
    )
    p.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (slower)")
    p.add_argument("--eval-every", type=float, default=d.eval_every_min, help="minutes between held-out evals")
    p.set_defaults(func=run_train_dflash)


def run_train_dflash(args) -> int:
    a = DFlashTrainArgs(
        out=args.out,
        minutes=args.minutes,
        gen_frac=args.gen_frac,
        max_sequences=args.max_sequences,
        resume=args.resume,
        threads=args.threads,
        seed=args.seed,
        layers=args.layers,
        block_size=args.block_size,
        batch_size=args.batch_size,
        blocks_per_seq=args.blocks_per_seq,
        lr=args.lr,
        init_layers=args.init_layers,
        bf16=not args.no_bf16,
        eval_every_min=args.eval_every,
        command=getattr(args, "command_line", ""),
    )
    if args.export:
        a.export = args.export
    if args.target:
        a.target = args.target
    train_dflash(a)
    return 0


# ------------------------------------------------------------------- CLI
def add_common_drafter_options(p, d) -> None:
    """Options shared by the drafter trainers (defaults from the args dataclass `d`)."""
    p.add_argument("--out", default=d.out, help="run directory (default %(default)s)")
    p.add_argument("--export", default=d.export, help="where the drafter goes (default: the package assets)")
    p.add_argument("--target", default=d.target, help="target model directory (default: the shipped one)")
    p.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help="whole run: data + training + evaluation + export (default %(default)s)",
    )
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt (and OUT's data)")
    p.add_argument("--init-from", default=d.init_from, help="DFlash drafter directory to start the backbone from")
    p.add_argument("--data-from", default=d.data_from, help="reuse the generated data of this run directory")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--decay", type=float, default=d.decay, help="gamma_d (0 = the paper's value)")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--blocks-per-seq", type=int, default=d.blocks_per_seq)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--gen-frac", type=float, default=d.gen_frac)
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--eval-sequences", type=int, default=d.eval_sequences)
    p.add_argument("--eval-every", type=float, default=d.eval_every_min, help="minutes between held-out evals")
    p.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (slower)")


def common_drafter_args(args) -> dict:
    return dict(
        out=args.out,
        export=args.export,
        target=args.target,
        minutes=args.minutes,
        resume=args.resume,
        init_from=args.init_from,
        data_from=args.data_from,
        threads=args.threads,
        seed=args.seed,
        layers=args.layers,
        block_size=args.block_size,
        decay=args.decay,
        batch_size=args.batch_size,
        blocks_per_seq=args.blocks_per_seq,
        lr=args.lr,
        gen_frac=args.gen_frac,
        max_sequences=args.max_sequences,
        eval_sequences=args.eval_sequences,
        eval_every_min=args.eval_every,
        bf16=not args.no_bf16,
        command=getattr(args, "command_line", ""),
    )


def add_train_dflash2(sub) -> None:
    """`python -m flashspark train dflash2 ...`"""
    d = DFlash2TrainArgs()
    p = sub.add_parser("dflash2", help="distil the DFlash 2 drafter (convs + path selector) from the target")
    add_common_drafter_options(p, d)
    p.add_argument("--selector-rank", type=int, default=d.selector_rank)
    p.add_argument("--selector-topk", type=int, default=d.selector_topk)
    p.add_argument("--selector-weight", type=float, default=d.selector_weight)
    p.add_argument("--path-mode", choices=["backtrack", "greedy"], default=d.path_mode)
    p.set_defaults(func=run_train_dflash2)


def run_train_dflash2(args) -> int:
    train_dflash2(
        DFlash2TrainArgs(
            **common_drafter_args(args),
            selector_rank=args.selector_rank,
            selector_topk=args.selector_topk,
            selector_weight=args.selector_weight,
            path_mode=args.path_mode,
        )
    )
    return 0


# ------------------------------------------------------------------- CLI
def add_train_dspark(sub) -> None:
    """`python -m flashspark train dspark ...`"""
    d = DSparkTrainArgs()
    p = sub.add_parser("dspark", help="distil the DSpark drafter (Markov + confidence heads) and calibrate it")
    add_common_drafter_options(p, d)
    p.add_argument("--markov-rank", type=int, default=d.markov_rank)
    p.add_argument("--target-topk", type=int, default=d.target_topk)
    p.add_argument("--calib-sequences", type=int, default=d.calib_sequences)
    p.set_defaults(func=run_train_dspark)


def run_train_dspark(args) -> int:
    train_dspark(
        DSparkTrainArgs(
            **common_drafter_args(args),
            markov_rank=args.markov_rank,
            target_topk=args.target_topk,
            calib_sequences=args.calib_sequences,
        )
    )
    return 0
