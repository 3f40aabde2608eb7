"""Benchmark of flashspark.tree_verify: the op against its PyTorch reference on token trees, and
against flashspark.verify on the same chain, side by side in one run.

For each (B, N, V) it builds B trees of N nodes (`--shape`: `topk`, a best-first tree of a
drafter's top-4 candidates, the shape DFlash tree decoding and EAGLE build; `spine`, a deep path
with a sibling at every level) whose children are the target's likeliest tokens (walks go deep,
as in real decoding), and times, interleaved:
  * tree_verify on the trees, and the reference on the same inputs;
  * tree_verify and verify (one-hot drafts) on one chain of N nodes per request.
It reports the bytes the CPU kernel reads (the rows each walk reaches, then the stop row's race),
GB/s, and their share of this machine's memory bandwidth, measured in the same run as the read
bandwidth of a sum over a 512 MiB buffer with the same threads.

    python bench/tree_verify_bench.py            # B {1, 8, 32} x N {8, 16, 32, 64} x V {32000, 151936}
    python bench/tree_verify_bench.py --quick    # a few rows

Writes bench/results/tree_verify_bench_<device>.json (quick runs: runs/).
"""

from __future__ import annotations

import argparse
import os

import flashspark
import torch
from flashspark.reference import tree_from_paths, tree_verify_reference
from timing import median_time, write_result

TOPK = 4


def tree_paths(logits_of, n, shape, g):
    """Candidate paths of one tree of n nodes (root included) from a row function: `topk` grows
    best-first (the child with the highest cumulative rank score next), `spine` a path with one
    sibling per level."""
    if shape == "spine":
        depth = n // 2
        top = [logits_of(d).topk(2).indices.tolist() for d in range(depth)]
        spine = [top[d][0] for d in range(depth)]
        paths = [spine] + [spine[:d] + [top[d][1]] for d in range(n - 1 - depth)]
        return paths
    frontier = [((), 0.0)]  # (path, score): each node offers its next-ranked child
    nodes = []
    while len(nodes) < n - 1:
        frontier.sort(key=lambda x: -x[1])
        path, score = frontier.pop(0)
        ranked = logits_of(len(path)).topk(TOPK).indices.tolist()
        siblings = [p for p in nodes if len(p) == len(path) + 1 and p[:-1] == path]
        if len(siblings) < TOPK:
            child = path + (ranked[len(siblings)],)
            nodes.append(child)
            frontier.append((path, score - 1.0 - len(siblings)))  # its next sibling, ranked lower
            frontier.append((child, score - 0.5))  # deeper: preferred, as a confident drafter's
    return [list(p) for p in nodes]


def make_trees(batch, n, vocab, dtype, shape, seed=0):
    """B trees and their [N, V] logits: node rows peaked (the target is confident) so that the
    drafter's top candidates are often right."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, vocab, generator=g) * 2.0
    peaks = torch.randint(0, vocab, (n,), generator=g)
    base[torch.arange(n), peaks] += 14.0
    paths = tree_paths(lambda d: base[min(d, n - 1)], n, shape, g)
    tokens, parents, cu = tree_from_paths([paths] * batch, [0] * batch)
    per = int(cu[1])
    # node i of a tree takes the row of its depth: the target agrees with the top candidates
    depth = torch.zeros(per, dtype=torch.long)
    for i in range(1, per):
        depth[i] = depth[int(parents[i])] + 1
    logits = base[depth.clamp(max=n - 1)].repeat(batch, 1)
    return logits.to(dtype), tokens, parents, cu, int(depth.max())


def make_chain(batch, n, vocab, dtype, seed=1):
    """One chain of n nodes per request (n - 1 drafts, mostly the row's argmax), as tree arrays
    and as verify's inputs over the same logits rows."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(batch * n, vocab, generator=g) * 2.0
    rows[torch.arange(batch * n), torch.randint(0, vocab, (batch * n,), generator=g)] += 14.0
    paths = []
    for b in range(batch):
        r = rows[b * n : (b + 1) * n]
        paths.append([[int(r[k].argmax()) for k in range(n - 1)]])
    tokens, parents, cu = tree_from_paths(paths, [0] * batch)
    drafts = torch.cat([tokens[int(cu[b]) + 1 : int(cu[b + 1])] for b in range(batch)])
    cu_draft = torch.arange(batch + 1, dtype=torch.int32) * (n - 1)
    return rows.to(dtype), tokens, parents, cu, drafts, cu_draft


def read_bandwidth_gbs() -> float:
    """This machine's read bandwidth with torch's threads: a sum over 512 MiB, median of 5."""
    x = torch.ones(128 * 1024 * 1024)
    t = median_time(lambda: x.sum(), 5, torch.device("cpu"))
    return x.numel() * 4 / t * 1e-9


def walk_bytes(acc, temperature, vocab, elem) -> float:
    """Bytes the CPU kernel reads: each walked row once (its softmax or argmax), then the stop
    row's race for a sampled request."""
    rows = float((acc + 1).sum()) + float((temperature >= 1e-5).sum())
    return rows * vocab * elem


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ref-repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--shape", default="topk", choices=["topk", "spine"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    grid = (
        [(1, 16, 32000), (8, 16, 32000), (32, 32, 32000)]
        if args.quick
        else [(b, n, v) for v in (32000, 151936) for n in (8, 16, 32, 64) for b in (1, 8, 32)]
    )
    bandwidth = read_bandwidth_gbs() if device.type == "cpu" else None
    print(
        f"flashspark.tree_verify on {device} ({torch.get_num_threads()} threads), {args.shape} trees, "
        f"{args.dtype}, T={args.temperature}; machine read bandwidth {bandwidth or 0:.1f} GB/s (sum over 512 MiB)"
    )
    head = (
        f"{'B':>3} {'N':>3} {'V':>7} | {'op ms':>8} {'MB':>7} {'GB/s':>6} {'bw %':>5} {'τ':>5} | "
        f"{'ref ms':>8} {'ref/op':>7} | {'chain ms':>8} {'verify ms':>9} {'tree/verify':>11}"
    )
    print(head)
    print("-" * len(head))
    rows = []
    for batch, n, vocab in grid:
        logits, tokens, parents, cu, depth = make_trees(batch, n, vocab, dtype, args.shape)
        kw = dict(
            temperature=torch.full((batch,), args.temperature),
            seeds=torch.arange(batch, dtype=torch.int64),
            offsets=torch.zeros(batch, dtype=torch.int64),
            max_depth=depth,
        )
        on = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        args_op = on(logits, tokens, parents, cu)
        nodes, toks, acc = flashspark.tree_verify(*args_op, **kw)
        want = tree_verify_reference(*args_op, **kw)
        agree = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip((nodes, toks, acc), want))
        # the chain: tree_verify and verify on the same rows, timed interleaved
        c_logits, c_tokens, c_parents, c_cu, drafts, cu_draft = make_chain(batch, n, vocab, dtype)
        c_args = on(c_logits, c_tokens, c_parents, c_cu)
        # verify wants a bonus row after each request's drafts: the chain's last node row is it
        v_args = on(c_logits, drafts, cu_draft)
        c_kw = dict(kw, max_depth=n - 1)
        v_kw = {k: v for k, v in kw.items() if k != "max_depth"}
        chain_tree = flashspark.tree_verify(*c_args, **c_kw)
        chain_verify = flashspark.verify(*v_args, max_spec_len=n - 1, **v_kw)
        chain_agree = torch.equal(chain_tree[1].cpu(), chain_verify[0].cpu())
        t_op, t_chain, t_verify = [], [], []
        for _ in range(args.repeats):  # interleaved, so machine noise hits all three alike
            t_op.append(median_time(lambda: flashspark.tree_verify(*args_op, **kw), 1, device))
            t_chain.append(median_time(lambda: flashspark.tree_verify(*c_args, **c_kw), 1, device))
            t_verify.append(median_time(lambda: flashspark.verify(*v_args, max_spec_len=n - 1, **v_kw), 1, device))
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        t_op, t_chain, t_verify = med(t_op), med(t_chain), med(t_verify)
        t_ref = median_time(lambda: tree_verify_reference(*args_op, **kw), args.ref_repeats, device)
        moved = walk_bytes(acc.cpu(), kw["temperature"].cpu(), vocab, logits.element_size())
        gbs = moved / t_op * 1e-9
        share = gbs / bandwidth if bandwidth else None
        tau = float(acc.float().mean()) + 1.0
        rows.append(
            dict(
                batch=batch,
                nodes=n,
                vocab=vocab,
                shape=args.shape,
                dtype=args.dtype,
                temperature=args.temperature,
                op_ms=t_op * 1e3,
                bytes=moved,
                gbs=gbs,
                bandwidth_share=share,
                machine_read_gbs=bandwidth,
                tau=tau,
                ref_ms=t_ref * 1e3,
                ref_over_op=t_ref / t_op,
                chain_tree_ms=t_chain * 1e3,
                chain_verify_ms=t_verify * 1e3,
                chain_tree_over_verify=t_chain / t_verify,
                agrees_with_reference=agree,
                chain_agrees_with_verify=chain_agree,
            )
        )
        print(
            f"{batch:>3} {n:>3} {vocab:>7} | {t_op * 1e3:>8.3f} {moved / 1e6:>7.2f} {gbs:>6.1f} "
            f"{100 * (share or 0):>4.0f}% {tau:>5.2f} | {t_ref * 1e3:>8.1f} {t_ref / t_op:>6.0f}x | "
            f"{t_chain * 1e3:>8.3f} {t_verify * 1e3:>9.3f} {t_chain / t_verify:>10.2f}x"
            + ("" if agree and chain_agree else "  (outputs differ!)")
        )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = args.out or (
        os.path.join(root, "runs", f"tree_verify_bench_{device.type}_quick.json")
        if args.quick
        else os.path.join(root, "bench", "results", f"tree_verify_bench_{device.type}.json")
    )
    return write_result("tree_verify", "bench/tree_verify_bench.py", argv, device, rows, out)


if __name__ == "__main__":
    main()
