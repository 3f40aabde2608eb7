"""flashspark.verify against softmax + FlashInfer's chain_speculative_sampling, side by side on
one GPU: what an engine pays today for chain verification from logits (a softmax pass that
materializes p, then FlashInfer's sampler) versus flashspark's fused logits mode, and versus
flashspark's probabilities mode on the same p. Runs where FlashInfer is importable (a CUDA
machine with flashinfer installed); elsewhere it says so and exits 0.

    python bench/verify_vs_flashinfer.py [--quick] [--out PATH]

Rows: bf16 logits, B requests of k drafts each with a dense fp32 q (FlashInfer's draft probs are
fp32), temperature 1. Times are medians of CUDA-synchronized runs; `bytes` is what flashspark's
kernel reads (bench/verify_roofline.py) and `peak` that over the time at --peak-gbs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import flashspark
import torch
from timing import median_time, write_result
from verify_roofline import verify_bytes

HERE = os.path.dirname(os.path.abspath(__file__))


def batch_inputs(batch: int, k: int, vocab: int, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(batch, k + 1, vocab, generator=g, device=device) * 3.0).to(torch.bfloat16)
    q = torch.softmax(0.8 * logits[:, :k].float() + 0.6 * torch.randn(batch, k, vocab, generator=g, device=device), -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, k).to(torch.int32)
    return logits, q, drafts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--peak-gbs", type=float, default=4800.0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_vs_flashinfer.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None:
        print("verify_vs_flashinfer: needs a CUDA device and an importable flashinfer: skipped")
        return None
    import flashinfer.sampling  # noqa: PLC0415  (only where it is installed: checked just above)

    device = torch.device("cuda")
    grid = (
        [(1, 8, 128256), (32, 8, 128256)]
        if args.quick
        else [(b, k, v) for v in (32000, 128256, 151936) for k in (4, 8) for b in (1, 8, 32, 64)]
    )
    rows = []
    print(
        f"{'B':>3} {'k':>2} {'V':>7} | {'softmax+FI ms':>13} {'fs logits ms':>12} {'fs probs ms':>11} | "
        f"{'FI/fs':>6} {'peak':>6}"
    )
    for batch, k, vocab in grid:
        logits, q, drafts = batch_inputs(batch, k, vocab, device)
        seeds = torch.arange(batch, dtype=torch.int64, device=device)
        kw = dict(
            temperature=torch.ones(batch, device=device),
            seeds=seeds,
            offsets=torch.zeros(batch, dtype=torch.int64, device=device),
            max_spec_len=k,
            draft_probs=q.reshape(-1, vocab),
        )
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device) * k
        flat_logits = logits.reshape(-1, vocab)
        probs = torch.softmax(logits.float(), -1)

        def engine():  # the softmax pass an engine runs, then FlashInfer's sampler
            p = torch.softmax(logits.float(), -1)
            return flashinfer.sampling.chain_speculative_sampling(q, drafts, p)

        def fused():
            return flashspark.verify(flat_logits, drafts.reshape(-1), cu, **kw)

        def on_probs():
            return flashspark.verify(probs.reshape(-1, vocab), drafts.reshape(-1), cu, target_is_probs=True, **kw)

        t_fi = median_time(engine, args.repeats, device)
        t_fs = median_time(fused, args.repeats, device)
        t_fp = median_time(on_probs, args.repeats, device)
        moved = verify_bytes(batch, k, vocab, 2)["total"] + batch * vocab * 4  # + the stop rows' dense q
        rows.append(
            dict(
                batch=batch,
                k=k,
                vocab=vocab,
                softmax_flashinfer_ms=t_fi * 1e3,
                flashspark_logits_ms=t_fs * 1e3,
                flashspark_probs_ms=t_fp * 1e3,
                speedup=t_fi / t_fs,
                bytes=moved,
                peak_fraction=moved / t_fs * 1e-9 / args.peak_gbs,
            )
        )
        r = rows[-1]
        print(
            f"{batch:>3} {k:>2} {vocab:>7} | {t_fi * 1e3:>13.3f} {t_fs * 1e3:>12.3f} {t_fp * 1e3:>11.3f} | "
            f"{r['speedup']:>5.2f}x {100 * r['peak_fraction']:>5.1f}%"
        )
    return write_result("verify_vs_flashinfer", "bench/verify_vs_flashinfer.py", argv, device, rows, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
