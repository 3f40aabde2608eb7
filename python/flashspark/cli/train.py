"""`python -m flashspark train target|data|dflash|dflash2|dspark`: each trainer's options, parsed
straight into its args dataclass (every option's dest is the field it sets).

`--target` names the drafters' target (`models.catalog`: tiny, the default, or smollm2) or a
path. For a known target other than tiny the run's defaults follow it: `--out
runs/<target>/<what>`, `--export` its drafter directory (`assets/<target>/<what>`, never the
tiny target's), the data of `train data` in `runs/<target>/data` (held-out and calibration sets
beside it), and DFlash 2 trained on top of its DFlash backbone, frozen (`--share-backbone`).
For a target given by path, --export must be given."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from ..models import catalog
from ..train.common import DFlashTrainArgs, RunArgs
from ..train.dflash import train as train_dflash
from ..train.dflash2 import DFlash2TrainArgs
from ..train.dflash2 import train as train_dflash2
from ..train.dspark import DSparkTrainArgs
from ..train.dspark import train as train_dspark
from ..train.target import TrainArgs
from ..train.target import train as train_target
from ..train.target_data import DataArgs, default_out, generate_data


def add_run_options(p, d: RunArgs, what: str) -> None:
    """The options of every trainer, with the defaults of its args dataclass `d`."""
    p.add_argument(
        "--out", default=None, help=f"run directory: {what} (default {d.out}, runs/<target>/... for a --target)"
    )
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
    p.add_argument("--device", default=d.device, help="where to train: cpu (default) or cuda")
    p.add_argument(
        "--export-reserve",
        dest="export_reserve_min",
        type=float,
        default=d.export_reserve_min,
        help="minutes of the budget kept for the export and its measurements (default %(default)s)",
    )
    p.add_argument(
        "--shard-mib",
        type=float,
        default=d.shard_mib,
        help="export the weights in safetensors shards of at most this many MiB (default: one file)",
    )
    p.add_argument(
        "--share-weights-with",
        default=None,
        metavar="DIR",
        help="export: tensors equal to this checkpoint's (a frozen --init-from backbone) are read from its "
        "files, not written again (`python -m flashspark export` writes a self-contained copy)",
    )
    p.add_argument(
        "--target", default=None, help=f"target: {' or '.join(catalog.TARGETS)} (default tiny) or a model path"
    )
    p.add_argument(
        "--data-from", default=None, help="reuse the generated data of this run directory or `train data` directory"
    )
    p.add_argument("--eval-from", default=None, help="held-out continuations: a `train data --split heldout` directory")
    p.add_argument("--window", type=int, default=d.window, help="longest sequence read from a `train data` directory")
    p.add_argument("--intermediate-size", type=int, default=None, help="drafter MLP width (default: the target's)")
    p.add_argument("--mask-token", default=None, help="the drafter's mask token (default: the target's)")
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
    p.add_argument(
        "--head-negatives",
        type=int,
        default=d.head_negatives,
        help="train the LM head over the target's stored Top-K of each batch plus this many uniform "
        "random tokens (0 = the whole vocabulary; needs a `train data` directory)",
    )
    p.add_argument(
        "--distill",
        type=float,
        default=d.distill,
        help="weight in [0, 1] of the target's stored Top-K distribution against its greedy label in the "
        "loss (needs a `train data` directory; default %(default)s)",
    )
    p.add_argument(
        "--head-logq",
        action=argparse.BooleanOptionalAction,
        default=d.head_logq,
        help="with --head-negatives, weight each uniform draw by the share of the vocabulary it stands "
        "for (the sampled softmax's log-Q correction; off: each counts once)",
    )


def add_derived_options(p, d) -> None:
    """What DFlash 2 and DSpark add to the backbone's options."""
    add_drafter_options(p, d)
    p.add_argument("--init-from", default=None, help="DFlash drafter directory to start the backbone from")
    p.add_argument(
        "--share-backbone",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="freeze --init-from's backbone and train only this drafter's parts (the export holds the "
        "whole drafter, as its authors' format does) (default: on for DFlash 2 on a known target other than tiny)",
    )


def add_dflash2_options(p, d: DFlash2TrainArgs) -> None:
    add_derived_options(p, d)
    p.add_argument("--selector-rank", type=int, default=d.selector_rank)
    p.add_argument("--selector-top-k", type=int, default=d.selector_top_k)
    p.add_argument("--selector-weight", type=float, default=d.selector_weight)
    p.add_argument("--path-mode", choices=["backtrack", "greedy"], default=d.path_mode)


def add_dspark_options(p, d: DSparkTrainArgs) -> None:
    add_derived_options(p, d)
    p.add_argument("--markov-rank", type=int, default=d.markov_rank)
    p.add_argument(
        "--sample-from-anchor",
        action=argparse.BooleanOptionalAction,
        default=d.sample_from_anchor,
        help="DeepSpec's slot layout: the anchor's slot drafts too, γ drafts per block (default on; off: "
        "DFlash's γ - 1)",
    )
    p.add_argument(
        "--exact-tv",
        action=argparse.BooleanOptionalAction,
        default=d.exact_tv,
        help="TV and the confidence target c* over the whole vocabulary from a target forward of every batch "
        "(DeepSpec's; default on); off: the lower bound from the target's stored Top-K (half the step time)",
    )
    p.add_argument("--target-topk", type=int, default=d.target_topk)
    p.add_argument("--calib-sequences", type=int, default=d.calib_sequences)
    p.add_argument(
        "--calib-from", default=None, help="calibration continuations: a `train data --split calibration` dir"
    )


def add_data_options(p, d: DataArgs) -> None:
    p.add_argument("--target", default=d.target, help=f"target: {' or '.join(catalog.TARGETS)} or a model path")
    p.add_argument(
        "--out", default=None, help="data directory (default runs/<target>/data, or runs/<target>/data_<split>)"
    )
    p.add_argument("--split", choices=["train", "calibration", "heldout"], default=d.split, help="prompt split")
    p.add_argument("--minutes", type=float, default=d.minutes, help="generation time of the whole run (all sessions)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="stop at this many stored tokens (0: none)")
    p.add_argument("--resume", action="store_true", help="continue the data in --out")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per batch (default %(default)s)")
    p.add_argument("--kinds", default=d.kinds, help="prompt kinds and shares (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    p.add_argument("--max-prompts", type=int, default=d.max_prompts, help="prompts per kind (0: all)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy continuations")
    p.add_argument("--top-k", type=int, default=d.top_k, help="the target's Top-K kept per position")
    p.add_argument(
        "--dtype",
        choices=["", "float32", "bfloat16"],
        default=d.dtype,
        help="the target's dtype while generating (default: its CPU dtype; float32 where bf16 matmuls are slow)",
    )
    p.add_argument("--device", default=d.device, help="the target's device while generating: cpu (default) or cuda")


# name: (args dataclass, its options, the trainer, help). A new trainer is one line here.
TRAINERS = {
    "target": (TrainArgs, add_target_options, train_target, "train the tokenizer (if absent) and the target model"),
    "data": (DataArgs, add_data_options, generate_data, "generate a target's own continuations for its drafters"),
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
    given = {k: v for k, v in given.items() if v is not None}
    given |= target_defaults(args.trainer, given)
    return cls(**given, command=getattr(args, "command_line", ""))


def target_defaults(trainer: str, given: dict) -> dict:
    """The defaults that follow --target (module docstring) for the options not given."""
    if trainer == "target" or "target" not in given:
        return {}
    ref = catalog.resolve_target(given["target"])
    known = ref.known
    if trainer == "data":
        return {} if "out" in given else {"out": default_out(given["target"], given.get("split", "train"))}
    if known is None or known.name == catalog.DEFAULT_TARGET:
        if known is None and "export" not in given:
            raise ValueError("--export must be given for a target given by path (no drafter ships for it)")
        return {}
    runs = Path("runs") / known.name
    out = {
        "out": str(runs / trainer),
        # Relative to the working directory: run facts and model cards name them as the command would.
        "export": os.path.relpath(catalog.drafter_dir(trainer, known)),
        "data_from": str(runs / "data"),
        "eval_from": str(runs / "data_heldout"),
    }
    if trainer == "dspark":
        out["calib_from"] = str(runs / "data_calibration")
    if trainer in ("dflash2", "dspark"):
        out["init_from"] = os.path.relpath(catalog.drafter_dir("dflash", known))
        # DSpark in DeepSpec's layout fine-tunes the backbone it starts from (its slots move by one).
        out["share_backbone"] = trainer == "dflash2" or not given.get("sample_from_anchor", True)
        if given.get("share_backbone", out["share_backbone"]):
            # The frozen backbone's tensors stay in its directory: the repository holds them once.
            out["share_weights_with"] = given.get("init_from", out["init_from"])
    return {k: v for k, v in out.items() if k not in given}


def run_train(args) -> int:
    TRAINERS[args.trainer][2](train_args(args))
    return 0
