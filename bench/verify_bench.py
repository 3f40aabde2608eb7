"""Benchmark of flashspark.verify against the pure-PyTorch reference, side by side.

For each (B, gamma, V, dtype) it builds one ragged batch whose drafts come from a
q close to the target p (acceptance is mixed, as in real decoding), then times
the op and the reference on the same inputs in the same run, and reports median
times and their ratio, with the bytes the kernel reads, its bandwidth and (on CUDA) the
fraction of the HBM peak (--peak-gbs). Prints a table and writes JSON.

Modes (--modes): `logits` (the target's logits, softmax fused), `probs` (the
target's probabilities, target_is_probs: what FlashInfer's and SGLang's samplers
take) and `log-probs` (the same probabilities through the glue an adapter needs
without the probabilities mode: log over every row, then the logits mode), timed
one after another on the same batch.

    python bench/verify_bench.py            # full grid
    python bench/verify_bench.py --quick    # the demo: a few rows
"""

from __future__ import annotations

import argparse
import os

import flashspark
import torch
from flashspark.reference import verify_reference
from timing import median_time, write_result
from verify_roofline import verify_bytes


def make_batch(batch, gamma, vocab, dtype, device, seed=0, closeness=0.8):
    g = torch.Generator().manual_seed(seed)
    num_draft = [gamma] * batch
    cu = torch.arange(batch + 1, dtype=torch.int32) * gamma
    total = batch * gamma
    logits = torch.randn(total + batch, vocab, generator=g) * 3.0
    draft_rows = torch.cat([logits[b * (gamma + 1) : b * (gamma + 1) + gamma] for b in range(batch)])
    q = torch.softmax(closeness * draft_rows + (1 - closeness) * 3.0 * torch.randn(total, vocab, generator=g), -1)
    tokens = torch.multinomial(q, 1, generator=g).squeeze(-1).to(torch.int32)
    kw = dict(
        temperature=torch.ones(batch),
        seeds=torch.arange(batch, dtype=torch.int64),
        offsets=torch.zeros(batch, dtype=torch.int64),
        max_spec_len=max(num_draft),
        draft_probs=q,
    )
    kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return logits.to(dtype).to(device), tokens.to(device), cu.to(device), kw


def read_bytes(device, mode, logits, acc, gamma, kw) -> float:
    """Bytes the kernel reads for this call: on CUDA every row once, then each sampled request's
    stop row (verify_roofline.verify_bytes; probabilities sampled: the stop rows alone); on the
    CPU the rows each walk reaches (none on probabilities), then the stop row. A log-probs call also reads and writes
    the probabilities once more for the log."""
    batch, vocab, elem = acc.numel(), logits.shape[1], logits.element_size()
    sampled = int((kw["temperature"] >= 1e-5).sum())
    if device.type == "cuda":
        b = verify_bytes(batch, gamma, vocab, elem, races=sampled)
        moved = b["phase2"] if mode == "probs" else b["total"]
    else:
        walked = 0 if mode == "probs" else float(acc.sum()) + batch  # probabilities: p(draft) alone
        moved = (walked + sampled) * vocab * elem
    if mode == "log-probs":
        moved += 2 * logits.numel() * 4
    if "draft_probs" in kw:  # a dense q row per race
        moved += sampled * vocab * kw["draft_probs"].element_size()
    return moved


# How each mode calls the op on a batch built from logits (probabilities: their softmax at T = 1).
MODES = {
    "logits": lambda logits, probs, tokens, cu, kw: flashspark.verify(logits, tokens, cu, **kw),
    "probs": lambda logits, probs, tokens, cu, kw: flashspark.verify(probs, tokens, cu, target_is_probs=True, **kw),
    "log-probs": lambda logits, probs, tokens, cu, kw: flashspark.verify(torch.log(probs), tokens, cu, **kw),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few representative rows (the demo)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ref-repeats", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 gives stable timings on a loaded machine",
    )
    ap.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM bandwidth for the fraction (H200)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="target input modes")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/verify_bench_<device>.json)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    if args.quick:
        grid = [
            (1, 8, 32000, torch.float32),
            (8, 8, 32000, torch.float32),
            (32, 8, 32000, torch.float32),
            (32, 8, 32000, torch.bfloat16),
        ]
    else:
        grid = [
            (b, g, v, d)
            for d in (torch.float32, torch.bfloat16)
            for v in (4096, 32000, 151936)
            for g in (4, 8, 16)
            for b in (1, 8, 32, 64)
        ]

    rows = []
    header = (
        f"{'B':>3} {'γ':>3} {'V':>7} {'dtype':>9} {'mode':>9} | {'op ms':>9} {'MB':>7} {'GB/s':>7} {'peak':>6} | "
        f"{'ref ms':>9} {'ref/op':>7} | {'τ':>5}"
    )
    print(f"flashspark.verify vs reference on {device} ({torch.get_num_threads()} threads), median of runs")
    print(header)
    print("-" * len(header))
    for batch, gamma, vocab, dtype in grid:
        logits, tokens, cu, kw = make_batch(batch, gamma, vocab, dtype, device)
        probs = torch.softmax(logits.float(), dim=-1).to(dtype)
        for mode in args.modes:
            run = MODES[mode]
            out, acc = run(logits, probs, tokens, cu, kw)
            on_probs = mode != "logits"
            ref_in = probs if on_probs else logits
            ref_out, ref_acc = verify_reference(ref_in, tokens, cu, target_is_probs=on_probs, **kw)
            agree = bool(torch.equal(out.cpu(), ref_out.cpu())) if mode != "log-probs" else None
            t_op = median_time(lambda: run(logits, probs, tokens, cu, kw), args.repeats, device)
            t_ref = median_time(
                lambda: verify_reference(ref_in, tokens, cu, target_is_probs=on_probs, **kw), args.ref_repeats, device
            )
            tau = float(acc.float().mean()) + 1.0
            moved = read_bytes(device, mode, logits, acc, gamma, kw)
            gbs = moved / t_op * 1e-9
            peak = f"{100 * gbs / args.peak_gbs:>5.1f}%" if device.type == "cuda" else f"{'-':>6}"
            rows.append(
                dict(
                    batch=batch,
                    gamma=gamma,
                    vocab=vocab,
                    dtype=str(dtype).replace("torch.", ""),
                    mode=mode,
                    op_ms=t_op * 1e3,
                    bytes=moved,
                    gbs=gbs,
                    peak_fraction=gbs / args.peak_gbs if device.type == "cuda" else None,
                    ref_ms=t_ref * 1e3,
                    speedup=t_ref / t_op,
                    tau=tau,
                    agrees_with_reference=agree,
                )
            )
            print(
                f"{batch:>3} {gamma:>3} {vocab:>7} {rows[-1]['dtype']:>9} {mode:>9} | {t_op * 1e3:>9.3f} "
                f"{moved / 1e6:>7.2f} {gbs:>7.1f} {peak} | {t_ref * 1e3:>9.2f} {t_ref / t_op:>6.1f}x | {tau:>5.2f}"
                + ("  (outputs differ!)" if agree is False else "")
            )

    # Quick runs (the demo) go to runs/, full grids to the committed bench/results/.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out_path = args.out or (
        os.path.join(root, "runs", f"verify_bench_{device.type}_quick.json")
        if args.quick
        else os.path.join(root, "bench", "results", f"verify_bench_{device.type}.json")
    )
    return write_result("verify", "bench/verify_bench.py", argv, device, rows, out_path)


if __name__ == "__main__":
    main()
