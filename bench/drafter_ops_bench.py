"""Benchmark of the drafter ops, side by side in one run on the same inputs:

  block_diffusion_attention  vs  the unfused path (gather context + cat block +
                                 scaled_dot_product_attention)  and the reference
  inject_context_kv          vs  the unfused path (RMSNorm, RoPE, indexed writes)
  two_tap_conv               vs  the reference (PyTorch ops)
  two_tap_conv + delta_weight vs  the taps' projection as a linear, then the op
  two_tap_conv + norm_weight  vs  RMSNorm in torch ops, then the op (both with delta_weight)
  two_tap_conv + finish taps  vs  the op on 2G rows, then the finish conv's taps as a linear
                                 of RMSNorm(x) (a 4G-row delta_weight writing finish_delta)
  topk_select                vs  torch.topk + torch.logsumexp
  path_select                vs  the reference
  path_select + g_weight     vs  W_h as a linear, then the op
  markov_step                vs  the unfused path (gather, matmul, softmax, sampling)

Reports median times, ratios, and effective GB/s over the bytes each op must
touch. Prints a table and writes JSON.

    python bench/drafter_ops_bench.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import os

import flashspark
import torch
import torch.nn.functional as F
from flashspark.reference import (
    block_diffusion_attention_reference,
    inject_context_kv_reference,
    markov_step_reference,
    path_select_reference,
    rms_norm,
    rope_cos_sin_cache,
    two_tap_conv_reference,
)
from timing import median_time, write_result


def unfused_attention(q, k_cache, v_cache, ctx_lens, k_block, v_block, scale):
    """What a drafter does without the op: per request, slice its context,
    append the block, and call SDPA (no mask). ctx_lens is read on the host."""
    lens = ctx_lens.tolist()
    outs = []
    for b, n in enumerate(lens):
        keys = torch.cat([k_cache[b, :, :n], k_block[b].transpose(0, 1)], dim=1)
        vals = torch.cat([v_cache[b, :, :n], v_block[b].transpose(0, 1)], dim=1)
        outs.append(
            F.scaled_dot_product_attention(
                q[b].transpose(0, 1)[None], keys[None], vals[None], scale=scale, enable_gqa=True
            )[0].transpose(0, 1)
        )
    return torch.stack(outs)


def unfused_inject(k, v, positions, slots, weight, cos_sin, eps, k_cache, v_cache):
    kf = k.float()
    kf = kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + eps) * weight
    half = k.shape[-1] // 2
    cs = cos_sin[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = kf[..., :half], kf[..., half:]
    k_cache[slots.long(), :, positions] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(k_cache.dtype)
    v_cache[slots.long(), :, positions] = v


def bench_attention(batch, ctx, gamma, hq, hkv, dim, dtype, device, repeats):
    g = torch.Generator().manual_seed(0)
    max_len = ctx + 16

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dtype).to(device)

    args = (
        rnd(batch, gamma, hq, dim),
        rnd(batch, hkv, max_len, dim),
        rnd(batch, hkv, max_len, dim),
        torch.full((batch,), ctx, dtype=torch.int32, device=device),
        rnd(batch, gamma, hkv, dim),
        rnd(batch, gamma, hkv, dim),
    )
    scale = dim**-0.5
    t_op = median_time(lambda: flashspark.ops.block_diffusion_attention(*args, scale), repeats, device)
    t_unfused = median_time(lambda: unfused_attention(*args, scale), repeats, device)
    t_ref = median_time(lambda: block_diffusion_attention_reference(*args, scale), max(1, repeats // 4), device)
    err = (
        (
            flashspark.ops.block_diffusion_attention(*args, scale).float()
            - block_diffusion_attention_reference(*args, scale).float()
        )
        .abs()
        .max()
        .item()
    )
    elem = torch.tensor([], dtype=dtype).element_size()
    bytes_moved = elem * (2 * batch * hkv * (ctx + gamma) * dim + 2 * batch * gamma * hq * dim)
    return dict(
        op="block_diffusion_attention",
        batch=batch,
        ctx=ctx,
        gamma=gamma,
        hq=hq,
        hkv=hkv,
        dim=dim,
        dtype=str(dtype).replace("torch.", ""),
        op_ms=t_op * 1e3,
        unfused_ms=t_unfused * 1e3,
        ref_ms=t_ref * 1e3,
        unfused_over_op=t_unfused / t_op,
        ref_over_op=t_ref / t_op,
        op_gbs=bytes_moved / t_op * 1e-9,
        max_abs_err_vs_ref=err,
    )


def bench_inject(n, batch, hkv, dim, dtype, device, repeats):
    g = torch.Generator().manual_seed(1)
    max_len = max(64, n // batch + 8)
    k = torch.randn(n, hkv, dim, generator=g).to(dtype).to(device)
    v = torch.randn(n, hkv, dim, generator=g).to(dtype).to(device)
    flat = torch.randperm(batch * max_len, generator=g)[:n]
    slots = (flat // max_len).to(torch.int32).to(device)
    positions = (flat % max_len).to(device)
    weight = torch.ones(dim, device=device)
    cs = rope_cos_sin_cache(max_len, dim, 1e6).to(device)
    kc = torch.zeros(batch, hkv, max_len, dim, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    args = (k, v, positions, slots, weight, cs, 1e-6, kc, vc)
    t_op = median_time(lambda: flashspark.ops.inject_context_kv(*args), repeats, device)
    t_unfused = median_time(lambda: unfused_inject(*args), repeats, device)
    t_ref = median_time(lambda: inject_context_kv_reference(*args), max(1, repeats // 4), device)
    elem = torch.tensor([], dtype=dtype).element_size()
    bytes_moved = elem * 4 * n * hkv * dim  # read k, v; write k, v
    return dict(
        op="inject_context_kv",
        n=n,
        batch=batch,
        hkv=hkv,
        dim=dim,
        dtype=str(dtype).replace("torch.", ""),
        op_ms=t_op * 1e3,
        unfused_ms=t_unfused * 1e3,
        ref_ms=t_ref * 1e3,
        unfused_over_op=t_unfused / t_op,
        ref_over_op=t_ref / t_op,
        op_gbs=bytes_moved / t_op * 1e-9,
    )


def _row(op, desc, dtype, t_op, t_base, base_name, t_ref, bytes_moved, **extra):
    return dict(
        op=op,
        shape=desc,
        dtype=str(dtype).replace("torch.", ""),
        op_ms=t_op * 1e3,
        unfused_ms=t_base * 1e3,
        unfused_is=base_name,
        ref_ms=None if t_ref is None else t_ref * 1e3,
        unfused_over_op=t_base / t_op,
        ref_over_op=None if t_ref is None else t_ref / t_op,
        op_gbs=bytes_moved / t_op * 1e-9,
        **extra,
    )


def bench_conv(rows, channels, dtype, device, repeats):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    base = torch.randn(2, channels, generator=g).to(dtype).to(device)
    delta = torch.randn(rows, 2, (channels + 15) // 16, generator=g).to(dtype).to(device)
    res = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    t_op = median_time(lambda: flashspark.ops.two_tap_conv(x, base, delta, 16, residual=res), repeats, device)
    t_ref = median_time(lambda: two_tap_conv_reference(x, base, delta, 16, residual=res), repeats, device)
    elem = x.element_size()
    return _row(
        "two_tap_conv", f"N{rows} C{channels}", dtype, t_op, t_ref, "reference", None, elem * 3 * rows * channels
    )


def bench_conv_fused(rows, channels, dtype, device, repeats):
    """The whole dynamic conv: taps projected inside the op (delta_weight) vs the projection
    as its own linear followed by the op."""
    g = torch.Generator().manual_seed(3)
    groups = (channels + 15) // 16
    x = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    base = torch.randn(2, channels, generator=g).to(dtype).to(device)
    w = (0.05 * torch.randn(2 * groups, channels, generator=g)).to(dtype).to(device)
    res = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    conv = flashspark.ops.two_tap_conv
    t_op = median_time(lambda: conv(x, base, None, 8, residual=res, delta_weight=w), repeats, device)
    t_unf = median_time(
        lambda: conv(x, base, F.linear(x, w).unflatten(-1, (2, groups)), 8, residual=res), repeats, device
    )
    t_ref = median_time(lambda: two_tap_conv_reference(x, base, None, 8, residual=res, delta_weight=w), repeats, device)
    elem = x.element_size()
    return _row(
        "two_tap_conv+proj",
        f"N{rows} C{channels}",
        dtype,
        t_op,
        t_unf,
        "linear+two_tap_conv",
        t_ref,
        elem * (3 * rows * channels + 2 * groups * channels),
    )


def bench_conv_prepared(rows, channels, dtype, device, repeats):
    """DFlash 2's prepare conv: RMSNorm and the dynamic conv in one op (norm_weight +
    delta_weight) vs Qwen3's RMSNorm in torch ops followed by the op."""
    g = torch.Generator().manual_seed(5)
    groups = (channels + 15) // 16
    x = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    base = torch.randn(2, channels, generator=g).to(dtype).to(device)
    w = (0.05 * torch.randn(2 * groups, channels, generator=g)).to(dtype).to(device)
    nw = (1 + 0.1 * torch.randn(channels, generator=g)).to(dtype).to(device)
    conv = flashspark.ops.two_tap_conv
    t_op = median_time(lambda: conv(x, base, None, 8, delta_weight=w, norm_weight=nw), repeats, device)
    t_unf = median_time(lambda: conv(rms_norm(x, nw, 1e-6), base, None, 8, delta_weight=w), repeats, device)
    t_ref = median_time(
        lambda: two_tap_conv_reference(x, base, None, 8, delta_weight=w, norm_weight=nw), repeats, device
    )
    elem = x.element_size()
    return _row(
        "two_tap_conv+norm+proj",
        f"N{rows} C{channels}",
        dtype,
        t_op,
        t_unf,
        "rms_norm+two_tap_conv",
        t_ref,
        elem * (2 * rows * channels + (2 * groups + 3) * channels),
    )


def bench_conv_prepared_finish(rows, channels, dtype, device, repeats):
    """z-lab's DFlash 2 sublayer start: the prepare conv with its norm, projecting the finish
    conv's taps too (a 4G-row delta_weight into finish_delta) vs the op on the first 2G rows
    and the finish taps as their own linear of RMSNorm(x)."""
    g = torch.Generator().manual_seed(6)
    groups = (channels + 15) // 16
    x = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    base = torch.randn(2, channels, generator=g).to(dtype).to(device)
    w = (0.05 * torch.randn(4 * groups, channels, generator=g)).to(dtype).to(device)
    nw = (1 + 0.1 * torch.randn(channels, generator=g)).to(dtype).to(device)
    finish = torch.empty(rows, 2, groups, dtype=dtype, device=device)
    conv = flashspark.ops.two_tap_conv
    w_prep, w_fin = w[: 2 * groups], w[2 * groups :]

    def unfused():
        conv(x, base, None, 8, delta_weight=w_prep, norm_weight=nw)
        return F.linear(rms_norm(x, nw, 1e-6), w_fin)

    t_op = median_time(
        lambda: conv(x, base, None, 8, delta_weight=w, norm_weight=nw, finish_delta=finish), repeats, device
    )
    t_unf = median_time(unfused, repeats, device)
    t_ref = median_time(
        lambda: two_tap_conv_reference(x, base, None, 8, delta_weight=w, norm_weight=nw, finish_delta=finish),
        repeats,
        device,
    )
    elem = x.element_size()
    return _row(
        "two_tap_conv+norm+proj4G",
        f"N{rows} C{channels}",
        dtype,
        t_op,
        t_unf,
        "two_tap_conv+rms_norm+linear",
        t_ref,
        elem * (2 * rows * channels + (4 * groups + 3) * channels + 2 * groups * rows),
    )


def bench_topk(rows, vocab, dtype, device, repeats):
    logits = torch.randn(rows, vocab, device=device).to(dtype)
    t_op = median_time(lambda: flashspark.ops.topk_select(logits, 16), repeats, device)
    t_torch = median_time(
        lambda: (torch.topk(logits.float(), 16), torch.logsumexp(logits.float(), -1)), repeats, device
    )
    return _row(
        "topk_select",
        f"rows{rows} V{vocab}",
        dtype,
        t_op,
        t_torch,
        "torch.topk+logsumexp",
        None,
        logits.element_size() * rows * vocab,
    )


def path_bench_inputs(requests, positions, k, vocab, rank, device, seed):
    """cand_ids, unary, a_emb, b_emb, anchor of a random lattice, and the generator for more."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.randint(0, vocab, (requests, positions, k), generator=g, dtype=torch.int32).to(device)
    unary = torch.randn(requests, positions, k, generator=g).to(device)
    a_emb = torch.randn(vocab, rank, generator=g).to(device)
    b_emb = torch.randn(vocab, rank, generator=g).to(device)
    anchor = torch.randint(0, vocab, (requests,), generator=g, dtype=torch.int32).to(device)
    return cand, unary, a_emb, b_emb, anchor, g


def bench_path(requests, positions, k, vocab, rank, mode, device, repeats):
    cand, unary, a_emb, b_emb, anchor, g = path_bench_inputs(requests, positions, k, vocab, rank, device, 3)
    gg = torch.randn(requests, positions, rank, generator=g).to(device)
    temp = torch.ones(requests, device=device)
    seeds = torch.arange(requests, dtype=torch.int64, device=device)
    offs = torch.zeros(requests, dtype=torch.int64, device=device)
    t_op = median_time(
        lambda: flashspark.ops.path_select(
            cand, unary, a_emb, b_emb, gg, anchor, mode=mode, temperature=temp, seeds=seeds, offsets=offs
        ),
        repeats,
        device,
    )
    t_ref = median_time(
        lambda: path_select_reference(cand, unary, a_emb, b_emb, gg, anchor, mode, temp, seeds, offs),
        max(1, repeats // 4),
        device,
    )
    bytes_moved = 4 * (2 * requests * positions * k * rank + requests * positions * (rank + 2 * k))
    return _row(
        "path_select",
        f"R{requests} P{positions} K{k} r{rank} {mode}",
        torch.float32,
        t_op,
        t_ref,
        "reference",
        None,
        bytes_moved,
    )


def bench_path_fused_g(requests, positions, k, vocab, rank, hidden_dim, device, repeats):
    """path_select computing g = W_h h itself (hidden, g_weight) vs W_h as a linear, then the op."""
    cand, unary, a_emb, b_emb, anchor, g = path_bench_inputs(requests, positions, k, vocab, rank, device, 6)
    hidden = torch.randn(requests, positions, hidden_dim, generator=g).to(device)
    w_h = (0.05 * torch.randn(rank, hidden_dim, generator=g)).to(device)
    select = flashspark.ops.path_select
    t_op = median_time(
        lambda: select(cand, unary, a_emb, b_emb, None, anchor, hidden=hidden, g_weight=w_h), repeats, device
    )
    t_unf = median_time(lambda: select(cand, unary, a_emb, b_emb, F.linear(hidden, w_h), anchor), repeats, device)
    bytes_moved = 4 * (
        2 * requests * positions * k * rank + requests * positions * (hidden_dim + 2 * k) + rank * hidden_dim
    )
    return _row(
        "path_select+g",
        f"R{requests} P{positions} K{k} r{rank} D{hidden_dim}",
        torch.float32,
        t_op,
        t_unf,
        "linear+path_select",
        None,
        bytes_moved,
    )


def bench_markov(batch, vocab, rank, hidden, dtype, device, repeats):
    g = torch.Generator().manual_seed(4)

    def rnd(*s):
        return torch.randn(*s, generator=g).to(dtype).to(device)

    args = (
        rnd(batch, vocab),
        torch.randint(0, vocab, (batch,), generator=g).to(device),
        rnd(vocab, rank),
        rnd(vocab, rank),
        None,
        rnd(batch, hidden),
        rnd(hidden + rank),
        torch.zeros(1, device=device),
        torch.ones(batch, device=device),
        torch.arange(batch, dtype=torch.int64, device=device),
        torch.zeros(batch, dtype=torch.int64, device=device),
    )

    def unfused():
        base, prev, w1, w2, _, h, cw, cb, temp, _, _ = args
        e = w1[prev]
        logits = (base + e @ w2.T).float() / temp[:, None]
        q = torch.softmax(logits, -1)
        tok = torch.multinomial(q, 1)
        conf = torch.sigmoid(torch.cat([h, e], -1).float() @ cw.float() + cb)
        return tok, q, conf

    t_op = median_time(
        lambda: flashspark.ops.markov_step(
            *args[:4], args[5], args[6], args[7], temperature=args[8], seeds=args[9], positions=args[10]
        ),
        repeats,
        device,
    )
    t_unf = median_time(unfused, repeats, device)
    t_ref = median_time(lambda: markov_step_reference(*args), max(1, repeats // 4), device)
    elem = args[0].element_size()
    bytes_moved = elem * (vocab * rank + 2 * batch * vocab) + 4 * batch * vocab
    return _row("markov_step", f"B{batch} V{vocab} r{rank}", dtype, t_op, t_unf, "unfused torch", t_ref, bytes_moved)


def print_row(r):
    ref = f"{r['ref_ms']:>8.2f}" if r.get("ref_ms") is not None else f"{'-':>8}"
    print(
        f"{r['op']:<26} {r['shape']:<34} {r['dtype']:>8} | {r['op_ms']:>8.3f} {r['unfused_ms']:>8.3f} "
        f"{ref} | {r['unfused_over_op']:>5.1f}x {r['op_gbs']:>7.1f}"
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 gives stable timings on a loaded machine",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = args.repeats or (5 if args.quick else 20)
    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16, torch.float16]
    # Shapes: the embedded drafter (4 heads, 2 KV heads, D 64, γ 8) and a Qwen3-8B-sized
    # DFlash drafter layer (32 query heads, 8 KV heads, D 128, γ 16).
    attn_grid = [(1, 512, 8, 4, 2, 64), (8, 512, 8, 4, 2, 64), (1, 4096, 16, 32, 8, 128)]
    if not args.quick:
        attn_grid += [(32, 1024, 8, 4, 2, 64), (8, 4096, 16, 32, 8, 128), (32, 8192, 16, 32, 8, 128)]
    inject_grid = [(64, 8, 2, 64), (512, 32, 8, 128)] + ([] if args.quick else [(4096, 64, 8, 128)])
    rows = []
    print(f"Drafter ops on {device}: op vs unfused PyTorch vs reference (median ms)")
    head = f"{'op':<26} {'shape':<34} {'dtype':>8} | {'op':>8} {'unfused':>8} {'ref':>8} | {'unf/op':>6} {'GB/s':>7}"
    print(head)
    print("-" * len(head))
    for dtype in dtypes:
        for shape in attn_grid:
            if device.type == "cpu" and shape[1] > 4096 and args.quick:
                continue
            r = bench_attention(*shape, dtype, device, repeats)
            rows.append(r)
            r["shape"] = f"B{r['batch']} ctx{r['ctx']} γ{r['gamma']} H{r['hq']}/{r['hkv']} D{r['dim']}"
            print_row(r)
        for shape in inject_grid:
            r = bench_inject(*shape, dtype, device, repeats)
            rows.append(r)
            r["shape"] = f"N{r['n']} B{r['batch']} Hkv{r['hkv']} D{r['dim']}"
            print_row(r)
        for rows_, channels in [(256, 256), (2048, 4096)] + ([] if args.quick else [(16384, 4096)]):
            rows.append(bench_conv(rows_, channels, dtype, device, repeats))
            print_row(rows[-1])
        for rows_, channels in [(8, 256), (256, 256), (2048, 4096)]:
            rows.append(bench_conv_fused(rows_, channels, dtype, device, repeats))
            print_row(rows[-1])
            rows.append(bench_conv_prepared(rows_, channels, dtype, device, repeats))
            print_row(rows[-1])
            rows.append(bench_conv_prepared_finish(rows_, channels, dtype, device, repeats))
            print_row(rows[-1])
        for nrows, vocab in [(8, 4096), (64, 151936)] + ([] if args.quick else [(512, 151936)]):
            rows.append(bench_topk(nrows, vocab, dtype, device, repeats))
            print_row(rows[-1])
        for batch, vocab, rank in [(8, 4096, 64), (32, 151936, 256)]:
            if device.type == "cpu" and vocab > 100000 and args.quick:
                continue
            rows.append(bench_markov(batch, vocab, rank, 256, dtype, device, repeats))
            print_row(rows[-1])
    for mode in ("backtrack", "sample"):
        rows.append(bench_path(32, 15, 16, 4096, 64, mode, device, repeats))
        print_row(rows[-1])
    for requests in (1, 32):  # the embedded drafter's shapes: γ - 1 = 7 positions, D = 256
        rows.append(bench_path_fused_g(requests, 7, 16, 4096, 64, 256, device, repeats))
        print_row(rows[-1])
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"drafter_ops_bench_{device.type}.json"
    )
    write_result("drafter_ops", "bench/drafter_ops_bench.py", argv, device, rows, out)


if __name__ == "__main__":
    main()
