"""`python -m flashspark export SRC DST`: a drafter directory as an engine loads it, every tensor
in its own files. A shipped drafter trained on a frozen backbone reads those tensors from the
backbone's directory (`io.save_weights(share_with=...)`), which the method's reference code and
the engines do not follow."""

from __future__ import annotations

from pathlib import Path

from .. import data
from ..models.io import export_drafter, is_self_contained


def add_export(sub) -> None:
    """`python -m flashspark export ...`"""
    p = sub.add_parser("export", help="write a drafter directory with all of its weights inside it, for an engine")
    p.add_argument("src", help="drafter directory, or a shipped drafter's name (e.g. smollm2/dflash2)")
    p.add_argument("dst", help="directory to write (config, model card, shards and their index)")
    p.add_argument(
        "--shard-mib", type=float, default=0.0, help="safetensors shards of at most this many MiB (default: one file)"
    )
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    src = Path(args.src)
    if not src.is_dir() and (data.ASSETS_DIR / src).is_dir():
        src = data.ASSETS_DIR / src  # a shipped drafter by name
    names = export_drafter(src, args.dst, int(args.shard_mib * 2**20))
    shared = "" if is_self_contained(src) else " (it read some from its backbone's directory)"
    print(f"{args.dst}: {len(names)} weight file(s), every tensor of {src}{shared}")
    return 0
