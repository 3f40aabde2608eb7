"""Distil the DFlash drafter from the shipped target on CPU.

1. Data: prompts are random windows of the training split; the target
   continues each greedily (fp32, KV cache), and every position keeps the
   target's feature-layer hidden states and the target's greedy prediction.
   Acceptance at temperature 0 is agreement with exactly that prediction, so
   the labels are the target's own choices, not the corpus.
2. Training: many random anchors per sequence, packed into one forward under a
   block-structured mask (block j sees context < anchor_j and itself). Block
   position k (1..gamma-1) predicts the target's token at anchor + k, with loss
   weight exp(-(k-1)/gamma_d); position 0 has no loss. Embedding and LM head are
   the target's, frozen.
3. Export: bf16 weights of the drafter alone, config.json and MODEL_CARD.md with
   held-out per-position acceptance and tau, measured on the shipped weights.

The whole run (data, training, evaluation, export) fits `--minutes`; the
learning rate follows training time, so `--resume` continues the schedule.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import data
from ..decoding.loop import speculative_generate
from ..models.dflash import DFlashConfig, DFlashDrafter, load_dflash, save_dflash
from .common import (
    DFlashTrainArgs,
    block_loss,
    command_lines,
    data_description,
    data_pool,
    eval_description,
    eval_set,
    evaluate,
    head_candidates,
    init_from_target,
    publish,
    run_facts,
    setup_run,
    target_description,
    train_drafter,
)
from .target_data import TargetData

DEFAULT_EXPORT = data.ASSETS_DIR / "dflash"


def train(a: DFlashTrainArgs) -> dict:
    wall_start = time.time()
    out, log, tok, target, mask_id = setup_run(a)
    config = DFlashConfig.for_target(
        target.config,
        num_hidden_layers=a.layers,
        block_size=a.block_size,
        mask_token_id=mask_id,
        intermediate_size=a.intermediate_size or None,
    )
    g = config.block_size
    decay = a.gamma_d()
    layer_ids = config.target_layer_ids

    ev = eval_set(target, a, layer_ids, out, tok)  # greedy continuations of held-out code prompts
    gen_budget = max(30.0, a.gen_frac * a.minutes * 60 - (time.time() - wall_start))
    pool = data_pool(target, a, layer_ids, out, tok, gen_budget, log)

    torch.manual_seed(a.seed)
    drafter = DFlashDrafter(config, target, use_ops=False).to(a.device)
    drafter.init_weights(a.seed)
    init_from_target(drafter, target, a.init_layers)
    log(f"drafter: gamma_d {decay}, features from target layers {layer_ids}")
    weights = torch.exp(-torch.arange(g - 1, dtype=torch.float32) / decay)  # k = 1..g-1 -> exp(-(k-1)/gamma_d)

    if (a.head_negatives or a.distill) and not isinstance(pool, TargetData):
        raise ValueError(
            "--head-negatives and --distill need a `train data` directory (--data-from): they read the target's Top-K"
        )
    if not 0 <= a.distill <= 1:
        raise ValueError(f"--distill is a weight in [0, 1], got {a.distill}")
    vocab = target.config.vocab_size
    head_gen = torch.Generator().manual_seed(a.seed + 7)

    def loss_fn(d, b):
        cand = None
        if a.head_negatives:
            cand = head_candidates(b, b["anchors"], g, vocab, a.head_negatives, head_gen, a.head_logq)
        topk = (b["topk_ids"], b["topk_logp"]) if a.distill else None
        loss, hits = block_loss(
            d, b["features"], b["tokens"], b["labels"], b["anchors"], weights, cand, a.distill, topk
        )
        return loss, {"acc1": hits[..., 0].float().mean().item()}

    def eval_fn(d):
        return evaluate(d, ev, a.prompt_tokens, bf16=a.bf16)

    run = train_drafter(a, drafter, target, config, pool, loss_fn, eval_fn, wall_start, log, "train dflash")
    return export(drafter, target, ev, a, config, run, decay, log)


def export(drafter, target, ev, a, config, run, decay, log) -> dict:
    """Write the bf16 drafter, then measure what ships: held-out acceptance and a real speculative run."""
    export_dir = Path(a.export)
    save_dflash(drafter, export_dir, dtype=torch.bfloat16, **a.export_options())
    shipped = load_dflash(export_dir, target, dtype=torch.float32)
    final = evaluate(shipped, ev, a.prompt_tokens, bf16=False)
    if "start" in ev:  # a held-out set of `train data`: its prompts
        prompts = [ev["tokens"][b, : int(ev["start"][b])].tolist() for b in range(min(8, len(ev["start"])))]
    else:
        prompts = data.heldout_prompts("code", 8, a.prompt_tokens, data.load_tokenizer())
    _, spec = speculative_generate(target, shipped, prompts, max_new_tokens=96)
    summary = {
        "final": final,
        "spec_tau": spec["tau"],
        "spec_acceptance": spec["acceptance_per_position"],
        "params": shipped.num_parameters(),
        **run_facts(a, config, target, decay, run),
    }
    publish(summary, a.out, export_dir, write_model_card)
    log(
        f"exported to {export_dir}: held-out tau {final['tau']:.3f}, acceptance "
        f"{' '.join(f'{x:.3f}' for x in final['acceptance'])}; speculative run tau {spec['tau']:.3f}"
    )
    return summary


def write_model_card(path: Path, s: dict) -> None:
    c, a, f = s["config"], s["args"], s["final"]
    g = c["block_size"]
    acc = "\n".join(
        f"| {k + 1} | {f['top1'][k]:.3f} | {f['acceptance'][k]:.3f} | {s['spec_acceptance'][k]:.3f} |"
        for k in range(g - 1)
    )
    rows = "\n".join(
        f"| {r['step']} | {r['minutes']:.1f} | {r['train_loss']:.3f} | {r['tau']:.2f} |" for r in s["history"]
    )
    data_line = data_description(s) or (
        f"{s['sequences']:,} sequences of {a['prompt_tokens']} training-split tokens followed by\n"
        f"  {a['gen_tokens']} tokens of the target's own greedy continuation (fp32), with the target's\n"
        "  feature-layer hidden states. Labels are the target's greedy tokens"
    )
    text = f"""# flashspark DFlash drafter for {s.get("target_name", "tiny")}

A block-diffusion drafter for {target_description(s)}, trained by
distillation from that target on two CPU cores. It drafts a block of
{g - 1} tokens in one forward, conditioned on the target by KV injection.

## Architecture

| field | value |
|---|---|
| decoder layers | {c["num_hidden_layers"]} (Qwen3: RMSNorm, GQA {c["num_attention_heads"]}/{c["num_key_value_heads"]} heads × {c["head_dim"]}, q/k norm, RoPE, SwiGLU {c["intermediate_size"]}) |
| hidden size | {c["hidden_size"]} (the target's) |
| block size γ | {g}: `[anchor, mask × {g - 1}]`, mask token {s.get("mask_token", "")} (id {c["mask_token_id"]}) |
| target feature layers | {c["target_layer_ids"]} of {s["target_layers"]} (`round(1 + i(L-4)/4)`) → `fc` ({len(c["target_layer_ids"])}·{c["hidden_size"]} → {c["hidden_size"]}) → `hidden_norm` |
| KV injection | context features through each layer's k_proj/v_proj, k_norm, RoPE; no mask inside the block |
| embedding, LM head | the target's, shared and frozen (not in this checkpoint) |
| parameters | {s["params"]:,} (target: {s["target_params"]:,}) |
| shipped dtype | bfloat16 (`model.safetensors`) |

## Training

```
{command_lines(s, "python -m flashspark train dflash")}
```

- Hardware: {s["hardware"]}; torch {s["torch"]}, {a["threads"]} threads.
- Data: {data_line}.
- {s["step"]:,} steps of {a["batch_size"]} sequences × {a["blocks_per_seq"]} random anchors
  (packed under a block mask), loss weight exp(−(k−1)/{s["decay"]:g}) on block position k ≥ 1.
- AdamW (β = 0.9, 0.95, weight decay {a["weight_decay"]}), peak lr {a["lr"]:g}, warmup
  {a["warmup_frac"] * 100:g}% then cosine to {a["min_lr_frac"] * 100:g}% on training time; bf16 autocast.
- Training time {s["train_minutes"]:.1f} min; wall time of every session of the run {s["wall_minutes"]:.1f} min
  (data generation, evaluation and export included).

## Held-out acceptance (temperature 0)

The shipped bf16 weights, computed in fp32, one block at {eval_description(a)}
({f["blocks"]:,} blocks). "top-1" is
agreement of draft k with the target's greedy token; "accepted" is the chance
that drafts 1..k all agree (draft k is accepted at T = 0). The last column is a
real speculative run (`speculative_generate`, 8 of those prompts, 96 new tokens, K = {g - 1}).

| block position k | top-1 | accepted | accepted (speculative run) |
|---|---|---|---|
{acc}

τ estimate (tokens per target forward, K = {g - 1}): **{f["tau"]:.2f}** from the held-out
blocks; **{s["spec_tau"]:.2f}** measured in the speculative run.
The first number weighs every position equally; the loop crosses easy
stretches in one step and spends more steps in hard ones, so the measured
run is the number to expect (and it varies a lot between prompts).

Progress (bf16 autocast):

| step | minutes | train loss | held-out τ |
|---|---|---|---|
{rows}

## Limitations

Distilled from its target for a short time on CPU: it drafts what that
target writes on the prompts it was trained on (Python-flavoured chat, code
and prose) best. It is specific to this target's weights; retrain it whenever
the target changes.
"""
    path.write_text(text)
