"""Distil the DFlash 2 drafter from the shipped target on CPU.

Same data, anchors, masks, loss weights and budget handling as the DFlash
trainer (`train.dflash`, imported): target-generated continuations with the
target's features and greedy labels, many random anchors per sequence packed
under a block mask, the backbone's CE on block positions 1..γ-1 weighted by
exp(-(k-1)/γ_d) (`train.dflash.block_loss` itself). On top of it the path
selector's cross-entropy over its Top-K scores, with teacher-forced
predecessors (the true previous token; the anchor at position 1) and the
positions whose true token is not in the Top-K masked out.

`--init-from DIR` starts the backbone from a trained DFlash drafter: the convs
start as the identity, so step 0 drafts exactly like it. `--data-from RUN`
reuses another run's generated data (e.g. `runs/dflash`), saving the
generation share of the budget.

The budgeted loop (resume, checkpoints, progress bar, periodic held-out
evaluation) is `train.dflash.train_drafter`, shared by every drafter trainer.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import data, ops
from ..models.dflash import block_mask, packed_blocks
from ..models.dflash2 import DFlash2Config, DFlash2Drafter, load_dflash2, save_dflash2
from .common import (
    DerivedDrafterArgs,
    backbone_line,
    block_loss,
    block_targets,
    command_lines,
    data_description,
    data_pool,
    eval_anchors,
    eval_batch,
    eval_description,
    eval_set,
    evaluate,
    init_from_target,
    position_weights,
    publish,
    rows_anchors,
    run_facts,
    setup_run,
    start_backbone,
    target_description,
    train_drafter,
    valid_blocks,
)

DEFAULT_EXPORT = data.ASSETS_DIR / "dflash2"


@dataclass
class DFlash2TrainArgs(DerivedDrafterArgs):
    out: str = "runs/dflash2"
    export: str = str(DEFAULT_EXPORT)
    selector_rank: int = 64
    selector_top_k: int = 16
    selector_weight: float = 1.0  # weight of the selector CE next to the backbone CE
    path_mode: str = "greedy"  # path mode of the held-out evaluation (the reference's)


# ------------------------------------------------------------------- DFlash 2 loss and evaluation
@contextlib.contextmanager
def capture_logits(drafter):
    """Collect (hidden, logits) of every `drafter.logits` call in the block, so the
    selector reuses the backbone pass of `block_loss` instead of a second one."""
    got = []
    inner = drafter.logits

    def logits(hidden):
        out = inner(hidden)
        got.append((hidden, out))
        return out

    drafter.logits = logits
    try:
        yield got
    finally:
        del drafter.logits


def dflash2_loss(drafter: DFlash2Drafter, feats, tokens, labels, anchors, weights, selector_weight: float = 1.0):
    """Backbone CE exactly as DFlash (`block_loss`) + selector CE over Top-K scores (teacher forced).

    Returns (loss, stats): backbone and selector losses, backbone top-1 at position 1,
    Top-K coverage and the selector's teacher-forced top-1 (over covered positions).
    """
    with capture_logits(drafter) as got:
        base_loss, hits = block_loss(drafter, feats, tokens, labels, anchors, weights)
    hidden, logits = got[0]  # [B, nb, γ-1, D], [B, nb, γ-1, V]
    prev, target = block_targets(tokens, labels, anchors, drafter.block_size)
    sel_loss, in_topk, sel_hit = drafter.selector_loss(hidden, logits, prev, target, weights)
    stats = {
        "base": base_loss.item(),
        "sel": sel_loss.item(),
        "acc1": hits[..., 0].float().mean().item(),
        "topk": in_topk.float().mean().item(),
        "sel1": (sel_hit.float().sum() / in_topk.float().sum().clamp(min=1)).item(),
    }
    return base_loss + selector_weight * sel_loss, stats


@torch.no_grad()
def evaluate_paths(
    drafter: DFlash2Drafter, ev: dict, prompt_tokens: int, mode: str = "greedy", batch: int = 16
) -> dict:
    """Held-out agreement of the selector's paths with the target's greedy tokens.

    One block at every anchor of the continuation (as `train.dflash.evaluate`); the
    path through the Top-K lattice comes from `ops.path_select` (`mode`) with the anchor
    as predecessor. acceptance[k-1] = P(path tokens 1..k all right); tau = 1 + sum.
    Also the backbone's own argmax acceptance, Top-K coverage and the teacher-forced
    selector top-1 for comparison.
    """
    was = drafter.training
    drafter.eval()
    g = drafter.block_size
    S = ev["features"].shape[1]
    anchors = eval_anchors(ev, prompt_tokens, g)
    batch = eval_batch(ev, anchors, g, drafter.config.vocab_size, batch)
    path_hits, base_hits, cover, sel_hits = [], [], [], []
    for i in range(0, ev["tokens"].shape[0], batch):
        sl = slice(i, i + batch)
        tokens, labels = ev["tokens"][sl], ev["labels"][sl]
        an = rows_anchors(anchors, sl, tokens.shape[0])
        bt, pos = packed_blocks(tokens, an, g, drafter.config.mask_token_id)
        hidden = drafter(ev["features"][sl].float(), bt, pos, block_mask(an, S, g))
        hidden = hidden.view(an.shape[0], an.shape[1], g, -1)[:, :, 1:]
        prev, target = block_targets(tokens, labels, an, g)
        cand, unary, gg = drafter.lattice(hidden, use_ops=True)
        R = an.numel()
        a_emb, b_emb = drafter.selector.predecessor_codebook.weight, drafter.selector.successor_codebook.weight
        paths = ops.path_select(
            cand.reshape(R, g - 1, -1),
            unary.reshape(R, g - 1, -1).contiguous(),
            a_emb,
            b_emb,
            gg.reshape(R, g - 1, -1).to(a_emb.dtype).contiguous(),
            prev[..., 0].reshape(R),
            mode=mode,
        )[0]
        per_block = an.shape
        path_hits.append(valid_blocks(ev, sl, (paths.long() == target.reshape(R, g - 1)).view(*per_block, g - 1)))
        base_hits.append(valid_blocks(ev, sl, cand[..., 0].long() == target))
        _, in_topk, hit = drafter.selector_loss(hidden, drafter.logits(hidden), prev, target)
        cover.append(valid_blocks(ev, sl, in_topk))
        sel_hits.append(valid_blocks(ev, sl, hit))
    drafter.train(was)
    path_hits, base_hits = torch.cat(path_hits).float(), torch.cat(base_hits).float()
    cover, sel_hits = torch.cat(cover).float(), torch.cat(sel_hits).float()
    prefix, base_prefix = path_hits.cumprod(1).mean(0), base_hits.cumprod(1).mean(0)
    return {
        "acceptance": prefix.tolist(),
        "top1": path_hits.mean(0).tolist(),
        "tau": 1 + float(prefix.sum()),
        "backbone_acceptance": base_prefix.tolist(),
        "backbone_tau": 1 + float(base_prefix.sum()),
        "topk_coverage": cover.mean(0).tolist(),
        "selector_top1": (sel_hits.sum(0) / cover.sum(0).clamp(min=1)).tolist(),
        "blocks": path_hits.shape[0],
        "mode": mode,
    }


# ------------------------------------------------------------------- train
def train(a: DFlash2TrainArgs) -> dict:
    wall_start = time.time()
    out, log, tok, target, mask_id = setup_run(a)
    config = DFlash2Config.for_target(
        target.config,
        num_hidden_layers=a.layers,
        block_size=a.block_size,
        mask_token_id=mask_id,
        intermediate_size=a.intermediate_size or None,
        selector_rank=a.selector_rank,
        selector_top_k=a.selector_top_k,
    )
    g = config.block_size
    decay = a.gamma_d()
    layer_ids = config.target_layer_ids
    ev = eval_set(target, a, layer_ids, out, tok)
    gen_budget = max(30.0, a.gen_frac * a.minutes * 60 - (time.time() - wall_start))
    pool = data_pool(target, a, layer_ids, out, tok, gen_budget, log)

    torch.manual_seed(a.seed)
    drafter = DFlash2Drafter(config, target, use_ops=False).to(a.device)
    drafter.init_weights(a.seed)
    init_from_target(drafter, target, False)  # the final norm; layer copy would miss the convs
    start_backbone(drafter, a, target, log)
    weights = position_weights(g, decay)

    def loss_fn(d, b):
        return dflash2_loss(d, b["features"], b["tokens"], b["labels"], b["anchors"], weights, a.selector_weight)

    def eval_fn(d):
        return evaluate_paths(d, ev, a.prompt_tokens, a.path_mode)

    run = train_drafter(a, drafter, target, config, pool, loss_fn, eval_fn, wall_start, log, "train dflash2")
    return export(drafter, target, ev, a, config, run, decay, log)


def export(drafter, target, ev, a, config, run, decay, log) -> dict:
    """Write the bf16 drafter, then measure what ships: held-out path and backbone acceptance."""
    export_dir = Path(a.export)
    save_dflash2(drafter, export_dir, dtype=torch.bfloat16, **a.export_options())
    shipped = load_dflash2(export_dir, target, dtype=torch.float32)
    final = evaluate_paths(shipped, ev, a.prompt_tokens, a.path_mode)
    dflash_eval = evaluate(shipped, ev, a.prompt_tokens)  # the backbone alone, DFlash's own metric
    summary = {
        "final": final,
        "backbone_final": dflash_eval,
        "params": shipped.num_parameters(),
        "selector_params": sum(p.numel() for p in shipped.selector.parameters()),
        "conv_params": sum(p.numel() for m in shipped.convs() for p in m.parameters()),
        **run_facts(a, config, target, decay, run),
    }
    publish(summary, a.out, export_dir, write_model_card)
    log(
        f"exported to {export_dir}: held-out path tau {final['tau']:.3f} ({final['mode']}), backbone tau "
        f"{final['backbone_tau']:.3f}, top-{config.selector_top_k} coverage "
        f"{' '.join(f'{x:.3f}' for x in final['topk_coverage'])}"
    )
    return summary


def write_model_card(path: Path, s: dict) -> None:
    c, a, f = s["config"], s["args"], s["final"]
    g = c["block_size"]
    acc = "\n".join(
        f"| {k + 1} | {f['topk_coverage'][k]:.3f} | {f['selector_top1'][k]:.3f} | {f['top1'][k]:.3f} | "
        f"{f['acceptance'][k]:.3f} | {f['backbone_acceptance'][k]:.3f} |"
        for k in range(g - 1)
    )
    rows = "\n".join(
        f"| {r['step']} | {r['minutes']:.1f} | {r['train_loss']:.3f} | {r['tau']:.2f} |" for r in s["history"]
    )
    data_line = data_description(s) or (
        f"{s['sequences']:,} target-generated sequences of {s['seq_len']} tokens"
        + (f" (reused from {a['data_from']})" if a["data_from"] else "")
    )
    text = f"""# flashspark DFlash 2 drafter for {s.get("target_name", "tiny")}

A DFlash 2 drafter for {target_description(s)}: the DFlash backbone
with grouped dynamic causal convs around every attention and MLP sublayer,
and a candidate selector that picks one coherent path through the Top-{c["selector_top_k"]}
lattice of the block: z-lab's `DFlash2DraftModel`, in their format (it loads in their
`dflash` package). Trained by distillation from that target on CPU.

## Architecture

| field | value |
|---|---|
| decoder layers | {c["num_hidden_layers"]} (Qwen3, hidden {c["hidden_size"]}, GQA {c["num_attention_heads"]}/{c["num_key_value_heads"]} × {c["head_dim"]}, SwiGLU {c["intermediate_size"]}) |
| convs | a pair per sublayer: prepare (on the normed input) + finish (on the output), {c["conv_kernel_size"]} taps; both convs' dynamic taps, per {c["conv_group_size"]} channels, from one Linear(H → 4·H/{c["conv_group_size"]}) of the prepare input; {s["conv_params"]:,} parameters |
| candidate selector | unary = Top-{c["selector_top_k"]} log-probs, pair term <A[a] ⊙ W_h h_t, B[b]>, r = {c["selector_rank"]}; {s["selector_params"]:,} parameters |
| block size γ | {g} |
| target feature layers | {c["target_layer_ids"]} of {s["target_layers"]} |
| embedding, LM head | the target's, shared and frozen (not in this checkpoint) |
| format | z-lab's: `config.json` with `dflash_config`, tensors `layers.i.{{attention,mlp}}_conv.*`, `candidate_selector.*` |
| parameters | {s["params"]:,} (target: {s["target_params"]:,}) |
| shipped dtype | bfloat16 |

## Training

```
{command_lines(s, "python -m flashspark train dflash2")}
```

- Hardware: {s["hardware"]}; torch {s["torch"]}, {a["threads"]} threads.
- Data: {data_line}.
- Backbone{backbone_line(a, "the convs and the path selector")}; {s["step"]:,} steps of
  {a["batch_size"]} sequences × {a["blocks_per_seq"]} anchors. Loss: backbone CE weighted exp(−(k−1)/{s["decay"]:g})
  + {a["selector_weight"]:g} × selector CE over the Top-{c["selector_top_k"]} scores with teacher-forced predecessors
  (positions whose true token is outside the Top-K masked out).
- Training time {s["train_minutes"]:.1f} min; wall time {s["wall_minutes"]:.1f} min.

## Held-out acceptance (temperature 0)

Shipped bf16 weights computed in fp32, one block at
{eval_description(a)} ({f["blocks"]:,} blocks).
Paths: `{f["mode"]}` mode. "coverage": true token among the Top-{c["selector_top_k"]};
"selector top-1": teacher-forced selector choice right, among covered positions;
"path top-1"/"accepted": the selected path against the target's greedy tokens;
"backbone accepted": the backbone's own argmax (DFlash drafting).

| k | coverage | selector top-1 | path top-1 | accepted | backbone accepted |
|---|---|---|---|---|---|
{acc}

τ (K = {g - 1}): **{f["tau"]:.2f}** with the path selector, {f["backbone_tau"]:.2f} with the backbone's argmax.

| step | minutes | train loss | held-out τ |
|---|---|---|---|
{rows}
"""
    path.write_text(text)
