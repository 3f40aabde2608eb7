"""The speculative loop of one build, timed per phase: decode 8 held-out code prompts in
batches of 2 (64 new tokens, 2 threads, best of 3 passes) with each named method, and
print wall seconds and seconds per phase as JSON. Run it alternately under two builds to
compare them on the same machine state:

    PYTHONPATH=OLD_CHECKOUT/python python bench/loop_ab.py old dflash dspark
    PYTHONPATH=python python bench/loop_ab.py new dflash dspark
"""

from __future__ import annotations

import json
import sys
import time

import torch
from flashspark import data
from flashspark.models import load_model

try:
    from flashspark.methods import make_decoder
except ImportError:  # a build from before the package had one folder per layer
    from flashspark.spec.methods import make_decoder

PASSES, BATCH, PROMPTS, NEW_TOKENS = 3, 2, 8, 64


def main() -> None:
    label, methods = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(2)
    tok = data.load_tokenizer()
    target = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
    prompts = data.heldout_prompts("code", PROMPTS, 64, tok)
    out = {}
    for method in methods:
        decode = make_decoder(method, target)
        decode(prompts[:BATCH], 8)  # warm-up
        walls, phases = [], {}
        for _ in range(PASSES):
            t0 = time.perf_counter()
            for j in range(0, PROMPTS, BATCH):
                _, st = decode(prompts[j : j + BATCH], NEW_TOKENS)
                for k, v in st.get("phase_seconds", {}).items():
                    phases[k] = phases.get(k, 0.0) + v / PASSES
            walls.append(time.perf_counter() - t0)
        out[method] = {"seconds": min(walls), "phase_seconds": {k: round(v, 4) for k, v in phases.items()}}
    print(json.dumps({"build": label, "methods": out}))


if __name__ == "__main__":
    main()
