"""What SmolLM2's drafter data costs on this machine: store the target's features or recompute them?

Measures, with the target in bf16 (as `train data` runs it) and `--threads` threads:
* a generation decode step at batch `--gen-batch` (tokens/s of `train data`'s continuations);
* a teacher-forced forward over `--rows` x `--seq` tokens with the feature layers kept: what
  recomputing the features of one training batch would cost;
* one drafter training step (the shipped shape: 2 layers, MLP 1024) on such a batch with the
  features given, as `train dflash` runs it from stored data;
* the bytes a stored token takes.

    python bench/smollm2_data_bench.py      # about 2 minutes -> bench/results/smollm2_data_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from flashspark.models import catalog
from flashspark.models.dflash import DFlashConfig, DFlashDrafter
from flashspark.train.common import block_loss, hardware_string, sample_anchors

RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gen-batch", type=int, default=32)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--rows", type=int, default=8, help="sequences per training step")
    p.add_argument("--seq", type=int, default=400, help="tokens per training sequence")
    p.add_argument("--blocks", type=int, default=32, help="anchors per sequence")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "smollm2_data_bench.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ref = catalog.resolve_target("smollm2")
    target = catalog.load_target(ref)  # bf16 on the CPU
    c = target.config
    cfg = DFlashConfig.for_target(c, num_hidden_layers=2, intermediate_size=1024, mask_token_id=16)
    layers = cfg.target_layer_ids
    gen = torch.Generator().manual_seed(0)

    # generation: one decode step of the whole batch at `context` tokens of cache
    B = a.gen_batch
    cache = target.new_cache(B, a.context + 2)
    lens = torch.full((B,), a.context)
    tok = torch.randint(100, c.vocab_size, (B, 1), generator=gen)
    with torch.no_grad():
        step = timed(lambda: target.backbone(tok, cache, lens, torch.ones(B, dtype=torch.int64), layers), a.repeats)
        head = timed(lambda: target.lm_head(torch.randn(B, c.hidden_size, dtype=torch.bfloat16)), a.repeats)
    gen_tok_s = B / (step + head)

    # recomputing the features of one training batch
    seqs = torch.randint(100, c.vocab_size, (a.rows, a.seq), generator=gen)
    with torch.no_grad():
        recompute = timed(lambda: target.backbone(seqs, hidden_layers=layers), a.repeats)

    # one training step of the drafter from stored features (fp32 master weights, bf16 autocast)
    fp32 = catalog.load_target(ref, dtype=torch.float32)
    drafter = DFlashDrafter(cfg, fp32, use_ops=False)
    drafter.init_weights(0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    feats = torch.randn(a.rows, a.seq - 1, len(layers), c.hidden_size).to(torch.bfloat16)
    weights = torch.ones(cfg.block_size - 1)

    def train_step():
        anchors = sample_anchors(a.rows, a.blocks, 16, a.seq - cfg.block_size, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = block_loss(drafter, feats, seqs, seqs, anchors, weights)
        opt.zero_grad()
        loss.backward()
        opt.step()

    train = timed(train_step, a.repeats)
    per_token = len(layers) * c.hidden_size * 2 + 2 * 2 + 32 * (2 + 2)  # features, token + label, Top-32
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": hardware_string(),
        "torch": torch.__version__,
        "threads": a.threads,
        "generation": {"batch": B, "context": a.context, "step_s": step + head, "tokens_per_s": gen_tok_s},
        "recompute_features": {
            "rows": a.rows,
            "seq": a.seq,
            "seconds": recompute,
            "tokens_per_s": a.rows * a.seq / recompute,
        },
        "train_step_stored_features": {"rows": a.rows, "blocks": a.blocks, "seconds": train},
        "recompute_share_of_step": recompute / (recompute + train),
        "bytes_per_stored_token": per_token,
        "layers": layers,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
