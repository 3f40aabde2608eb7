"""What DSpark's exact confidence target costs on this machine, and how far the Top-K bound is from it.

DeepSpec trains the confidence head on c* = 1 − ½‖q − p‖₁ over the whole vocabulary, p the
target's next-token distribution, which takes the target's full logits at every drafted
position. `train dspark` by default keeps the target's Top-K (computed once over the data)
and uses a lower bound of the TV; `--exact-tv` runs a target forward per batch instead.

For one training batch of held-out continuations (the target's own, greedy) and the
target's shipped DSpark drafter, this measures, interleaved over --rounds:

  bound   one training step (loss, backward) with the Top-K bound (its one-off Top-K pass not counted)
  exact   the same step with the target forward that gives p over the whole vocabulary

and, at every drafted position of the batch, c* from each (teacher-forced Markov q of the
drafter): their mean, mean and largest absolute gap. Prints a table and writes JSON.

    python bench/dspark_tv_bench.py [--model tiny|smollm2] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from flashspark.methods import load_method_drafter
from flashspark.train.common import block_targets, generate_sequences, sample_anchors
from flashspark.train.dspark import (
    _gather_positions,
    dspark_forward,
    dspark_loss,
    exact_tv,
    sparse_tv,
    target_next_logp,
    target_topk,
)
from targets import add_target_args, load_bench_target, result_tag
from timing import result_header, save_result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(p)
    p.add_argument("--rows", type=int, default=8, help="sequences per batch (the trainers' default batch)")
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    p.add_argument("--gen-tokens", type=int, default=96, help="tokens the target continues each prompt by")
    p.add_argument("--topk", type=int, default=32, help="the bound's Top-K (train dspark --target-topk)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bt = load_bench_target(args)
    target = bt.model.float()
    drafter = load_method_drafter("dspark", target, use_ops=False).float().train()
    span = drafter.num_drafts + 1
    task = "code" if "code" in bt.tasks else bt.tasks[0]
    held = bt.heldout_prompts(task, args.rows, 48)
    m = min(48, *(len(x) for x in held))  # one batch of equal lengths: the last m tokens of each
    prompts = torch.tensor([x[-m:] for x in held])
    tokens, feats, labels = generate_sequences(target, prompts, args.gen_tokens, drafter.config.target_layer_ids)
    gen = torch.Generator().manual_seed(0)
    L = tokens.shape[1]
    anchors = sample_anchors(args.rows, args.anchors, prompts.shape[1] - 1, L - span, gen)
    ids, logp = target_topk(target, tokens, args.topk)
    weights = torch.ones(span - 1)

    def step(mode):
        if mode == "exact":
            full = target_next_logp(target, tokens, anchors, span)
            loss, _ = dspark_loss(drafter, feats.float(), tokens, labels, anchors, None, None, weights, p_full=full)
        else:
            loss, _ = dspark_loss(drafter, feats.float(), tokens, labels, anchors, ids, logp, weights)
        loss.backward()
        drafter.zero_grad(set_to_none=True)

    times = {"bound": [], "exact": []}
    for r in range(args.rounds + 1):
        for mode in ("bound", "exact") if r % 2 else ("exact", "bound"):
            t0 = time.perf_counter()
            step(mode)
            if r:  # round 0 warms up
                times[mode].append(time.perf_counter() - t0)
    with torch.no_grad():
        hidden, base = dspark_forward(drafter, feats.float(), tokens, anchors)
        prev, _ = block_targets(tokens, labels, anchors, span)
        q = torch.softmax(drafter.heads(hidden, base, prev)[0], -1)
        c_exact = 1 - exact_tv(q, target_next_logp(target, tokens, anchors, span))
        c_bound = 1 - sparse_tv(q, _gather_positions(ids, anchors, span), _gather_positions(logp, anchors, span))
        gap = (c_bound - c_exact).abs()
    ratios = [e / b for e, b in zip(times["exact"], times["bound"])]
    row = {
        "target": bt.label,
        "vocab": target.config.vocab_size,
        "positions": int(q.shape[:-1].numel()),
        "step_seconds_bound": statistics.median(times["bound"]),
        "step_seconds_exact": statistics.median(times["exact"]),
        "exact_over_bound": statistics.median(ratios),
        "c_star_exact_mean": float(c_exact.mean()),
        "c_star_bound_mean": float(c_bound.mean()),
        "c_star_gap_mean": float(gap.mean()),
        "c_star_gap_max": float(gap.max()),
        "topk": args.topk,
    }
    print(
        f"{'target':>10} {'V':>6} {'bound s/step':>13} {'exact s/step':>13} {'exact/bound':>12} "
        f"{'c* exact':>9} {'c* bound':>9} {'|gap| mean':>11} {'|gap| max':>10}"
    )
    print(
        f"{row['target']:>10} {row['vocab']:>6} {row['step_seconds_bound']:>13.3f} {row['step_seconds_exact']:>13.3f} "
        f"{row['exact_over_bound']:>11.2f}x {row['c_star_exact_mean']:>9.4f} {row['c_star_bound_mean']:>9.4f} "
        f"{row['c_star_gap_mean']:>11.5f} {row['c_star_gap_max']:>10.5f}"
    )
    result = result_header("dspark_tv_bench", "dspark_tv_bench.py", argv, "cpu") | {
        "drafter": "the target's shipped dspark",
        "rows": [row],
    }
    save_result(result, args.out or f"bench/results/dspark_tv_bench{result_tag(args.model)}.json")


if __name__ == "__main__":
    main()
