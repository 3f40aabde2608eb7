"""Two builds decode the same prompts: are their outputs token-identical?

Each build (a package directory holding flashspark/) decodes the demo prompt and six
held-out code prompts (40 new tokens, 1 thread) with every method at T = 0 and, for
fixed K, at T = 0.8 with seed 3 (a confidence scheduler's K depends on timing, so only
its greedy output is compared), in a child process; the parent compares them.

    python bench/outputs_ab.py --builds OLD_CHECKOUT/python python
"""

from __future__ import annotations

import argparse
import json
import sys

from timing import run_child

METHODS = ["dflash", "dflash:k=3", "dflash2", "dflash2:path=greedy", "dspark", "dflash2:sched=confidence",
           "dspark:sched=confidence"]  # fmt: skip


def decode_all() -> dict:
    import torch
    from flashspark import data
    from flashspark.models import load_model

    try:
        from flashspark.methods import make_decoder
    except ImportError:  # a build from before the package had one folder per layer
        from flashspark.spec.methods import make_decoder

    torch.set_num_threads(1)
    tok = data.load_tokenizer()
    target = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
    prompts = [tok.encode("def read_config(path):").ids] + data.heldout_prompts("code", 6, 48, tok)
    out = {}
    for method in METHODS:
        decode = make_decoder(method, target)
        for t in [0.0] if "sched=confidence" in method else [0.0, 0.8]:
            out[f"{method} T={t}"] = decode(prompts, 40, temperature=t, seed=3)[0]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--builds", nargs=2, metavar=("A", "B"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(decode_all()))
        return
    if not args.builds:
        ap.error("--builds A B is required")
    runs = []
    for path in args.builds:
        runs.append(run_child(__file__, path))
    same = True
    for key in runs[0]:
        ok = runs[0][key] == runs[1].get(key)
        same &= ok
        print(f"{key:32s} {'identical' if ok else 'DIFFERENT'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
