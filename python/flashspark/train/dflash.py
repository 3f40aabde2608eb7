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

import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from .. import data
from ..models import load_model
from ..models.dflash import DFlashConfig, DFlashDrafter, block_mask, load_dflash, packed_blocks, save_dflash
from .common import lr_at
from .target import hardware_string

DEFAULT_EXPORT = data.ASSETS_DIR / "dflash"
DECAY = {8: 4.0, 10: 5.0, 16: 7.0}  # gamma_d of the DFlash paper per block size


@dataclass
class DFlashTrainArgs:
    out: str = "runs/dflash"
    export: str = str(DEFAULT_EXPORT)
    target: str = str(data.ASSETS_DIR / "target")
    minutes: float = 50.0  # whole run: data generation + training + evaluation + export
    gen_frac: float = 0.3  # share of the budget spent generating target continuations
    max_sequences: int = 8192  # cap on generated sequences (memory: ~0.65 MB each)
    export_reserve_min: float = 2.5
    resume: bool = False
    threads: int = 2
    seed: int = 0
    layers: int = 2
    block_size: int = 8
    decay: float = 0.0  # gamma_d; 0 = the paper's value for the block size
    prompt_tokens: int = 64
    gen_tokens: int = 192
    gen_batch: int = 128
    batch_size: int = 16  # sequences per step
    blocks_per_seq: int = 32  # random anchors per sequence
    min_anchor: int = 16
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup_frac: float = 0.03
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    bf16: bool = True
    init_layers: bool = False  # start the decoder layers from the target's top layers
    eval_every_min: float = 5.0
    ckpt_every_min: float = 5.0
    eval_sequences: int = 64
    command: str = ""


# ------------------------------------------------------------------- data
@torch.no_grad()
def generate_sequences(target, prompts: torch.Tensor, gen_tokens: int, layer_ids: list[int]):
    """Greedy continuations of prompts [B, P] with the target's features.

    Returns tokens [B, P + G] int64, features [B, P + G - 1, n, D] bf16 (the
    target's hidden states at every fed position) and labels [B, P + G] int64:
    labels[t] = the target's greedy token for position t given tokens < t
    (labels[0] = -1). In the continuation labels equal the tokens.
    """
    B, P = prompts.shape
    cache = target.new_cache(B, P + gen_tokens)
    lens = torch.zeros(B, dtype=torch.int64)
    out = target(prompts, cache, lens, torch.full((B,), P), hidden_layers=layer_ids)
    feats = [out.hidden.to(torch.bfloat16)]
    preds = [out.logits.argmax(-1)]
    tokens = [prompts]
    nxt = preds[-1][:, -1:]
    ones = torch.ones(B, dtype=torch.int64)
    for i in range(gen_tokens - 1):
        tokens.append(nxt)
        out = target(nxt, cache, torch.full((B,), P + i), ones, hidden_layers=layer_ids)
        feats.append(out.hidden.to(torch.bfloat16))
        nxt = out.logits.argmax(-1)
        preds.append(nxt)
    tokens.append(nxt)
    labels = torch.cat([torch.full((B, 1), -1, dtype=torch.int64)] + preds, 1)
    return torch.cat(tokens, 1), torch.cat(feats, 1), labels


def random_prompts(ids: np.ndarray, n: int, length: int, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(ids) - length, size=n)
    return torch.from_numpy(np.stack([ids[s : s + length] for s in starts]).astype(np.int64))


def build_pool(target, a: DFlashTrainArgs, layer_ids, train_ids, seconds: float, out: Path, log) -> dict:
    """Generate sequences for `seconds` (or until max_sequences), saved in out/data."""
    from tqdm import tqdm

    ddir = out / "data"
    ddir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([a.seed, 1])
    pool, t0, n, n_chunks = None, time.time(), 0, 0
    bar = tqdm(total=round(seconds), unit="s", desc="generate", dynamic_ncols=True, mininterval=5)
    while time.time() - t0 < seconds and n + a.gen_batch <= a.max_sequences:
        prompts = random_prompts(train_ids, a.gen_batch, a.prompt_tokens, rng)
        chunk = dict(
            zip(("tokens", "features", "labels"), generate_sequences(target, prompts, a.gen_tokens, layer_ids))
        )
        path = ddir / f"chunk_{n_chunks:04d}.pt"
        torch.save(chunk, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        pool = _append(pool, chunk, n, a.max_sequences)
        n += a.gen_batch
        n_chunks += 1
        bar.update(min(round(seconds), round(time.time() - t0)) - bar.n)
        bar.set_postfix(sequences=n, refresh=False)
    bar.close()
    gen_seconds = time.time() - t0
    (ddir / "done.json").write_text(json.dumps({"chunks": n_chunks, "sequences": n, "seconds": gen_seconds}))
    log(f"generated {n} sequences of {a.prompt_tokens}+{a.gen_tokens} tokens in {gen_seconds / 60:.1f} min")
    return {k: v[:n] for k, v in pool.items()} | {"gen_seconds": gen_seconds}


def load_pool(out: Path) -> dict | None:
    ddir = out / "data"
    done = ddir / "done.json"
    if not done.is_file():
        return None
    meta = json.loads(done.read_text())
    pool, n = None, 0
    for i in range(meta["chunks"]):
        chunk = torch.load(ddir / f"chunk_{i:04d}.pt")
        pool = _append(pool, chunk, n, meta["sequences"])
        n += chunk["tokens"].shape[0]
    return pool | {"gen_seconds": meta["seconds"]}


def _append(pool: dict | None, chunk: dict, n: int, capacity: int) -> dict:
    """Copy a chunk into preallocated pool tensors (no concatenation peak)."""
    if pool is None:
        pool = {k: v.new_empty((capacity,) + v.shape[1:]) for k, v in chunk.items()}
    for k, v in chunk.items():
        pool[k][n : n + v.shape[0]] = v
    return pool


def sample_anchors(n_seq: int, blocks: int, lo: int, hi: int, gen: torch.Generator) -> torch.Tensor:
    """[n_seq, blocks] anchors uniform in [lo, hi]."""
    return torch.randint(lo, hi + 1, (n_seq, blocks), generator=gen)


def init_from_target(drafter: DFlashDrafter, target, layers: bool = False) -> None:
    """The final norm feeds the target's LM head: start it at the target's final
    norm so the first logits have the target's scale. Optionally copy the
    target's top decoder layers into the drafter's (same shapes)."""
    with torch.no_grad():
        drafter.norm.weight.copy_(target.model.norm.weight)
        if layers:
            n = len(drafter.layers)
            for mine, theirs in zip(drafter.layers, target.model.layers[-n:]):
                mine.load_state_dict(theirs.state_dict())


# ------------------------------------------------------------------- loss
def block_loss(drafter: DFlashDrafter, feats, tokens, labels, anchors, weights):
    """Weighted CE over block positions 1..gamma-1 and the top-1 hits [B, nb, gamma-1]."""
    g = drafter.block_size
    B, nb = anchors.shape
    S = feats.shape[1]
    bt, pos = packed_blocks(tokens, anchors, g, drafter.config.mask_token_id)
    hidden = drafter(feats, bt, pos, block_mask(anchors, S, g))
    hidden = hidden.view(B, nb, g, -1)[:, :, 1:]
    logits = drafter.logits(hidden)  # [B, nb, g-1, V] fp32
    target = labels.gather(1, (anchors[..., None] + torch.arange(1, g)).flatten(1)).view(B, nb, g - 1)
    ce = F.cross_entropy(logits.flatten(0, 2), target.flatten(), reduction="none").view(B, nb, g - 1)
    loss = (ce * weights).sum() / (weights.sum() * B * nb)
    return loss, logits.argmax(-1) == target


@torch.no_grad()
def evaluate(drafter: DFlashDrafter, ev: dict, prompt_tokens: int, bf16: bool = False, batch: int = 16) -> dict:
    """Held-out agreement with the target's greedy tokens, anchors over the
    whole continuation (every position from the prompt's end on).

    acceptance[k-1] = P(drafts 1..k all equal the target's greedy tokens) =
    the chance draft k is accepted at temperature 0; tau = 1 + sum(acceptance)
    is the expected tokens per target forward with K = gamma - 1.
    """
    was = drafter.training
    drafter.eval()
    g = drafter.block_size
    S = ev["features"].shape[1]
    anchors = torch.arange(prompt_tokens, S + 1 - g + 1)[None]  # anchor a needs labels up to a + g - 1 <= S
    hits_all = []
    for i in range(0, ev["tokens"].shape[0], batch):
        sl = slice(i, i + batch)
        a = anchors.expand(ev["tokens"][sl].shape[0], -1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, hits = block_loss(
                drafter, ev["features"][sl].float(), ev["tokens"][sl], ev["labels"][sl], a, torch.ones(g - 1)
            )
        hits_all.append(hits.flatten(0, 1))
    hits = torch.cat(hits_all).float()  # [blocks, g-1]
    drafter.train(was)
    prefix = hits.cumprod(1).mean(0)
    return {
        "acceptance": prefix.tolist(),
        "top1": hits.mean(0).tolist(),
        "tau": 1 + float(prefix.sum()),
        "blocks": hits.shape[0],
    }


# ------------------------------------------------------------------- train
def _log_to(out: Path):
    def log(msg: str) -> None:
        print(msg, flush=True)
        with open(out / "train.log.txt", "a") as f:
            f.write(msg + "\n")

    return log


def train(a: DFlashTrainArgs) -> dict:
    wall_start = time.time()
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = _log_to(out)
    ckpt_path = out / "ckpt.pt"
    if a.resume and not ckpt_path.is_file():
        raise FileNotFoundError(f"--resume given but no checkpoint {ckpt_path}")
    budget = a.minutes * 60.0
    tok = data.load_tokenizer()
    special = data.special_token_ids(tok)
    target = load_model(a.target, dtype=torch.float32)
    for p in target.parameters():
        p.requires_grad_(False)
    config = DFlashConfig.for_target(
        target.config, num_hidden_layers=a.layers, block_size=a.block_size, mask_token_id=special["mask"]
    )
    g = config.block_size
    decay = a.decay or DECAY.get(g, g / 2)
    layer_ids = config.target_layer_ids

    # Held-out evaluation set: greedy continuations of held-out code prompts (what the benchmark decodes).
    ev_prompts = torch.tensor(data.heldout_prompts("code", a.eval_sequences, a.prompt_tokens, tok))
    ev_path = out / "eval.pt"
    if ev_path.is_file():
        ev = torch.load(ev_path)
    else:
        ev = dict(zip(("tokens", "features", "labels"), generate_sequences(target, ev_prompts, 128, layer_ids)))
        torch.save(ev, ev_path)

    pool = load_pool(out) if a.resume else None
    if pool is None:
        gen_budget = max(30.0, a.gen_frac * budget - (time.time() - wall_start))
        train_ids = data.split_token_ids("train", tok, out / "cache")
        pool = build_pool(target, a, layer_ids, train_ids, gen_budget, out, log)
    else:
        log(f"reusing {pool['tokens'].shape[0]} generated sequences from {out / 'data'}")
    N, L = pool["tokens"].shape

    torch.manual_seed(a.seed)
    drafter = DFlashDrafter(config, target, use_ops=False)
    drafter.init_weights(a.seed)
    init_from_target(drafter, target, a.init_layers)
    log(f"drafter: gamma_d {decay}, features from target layers {layer_ids}")
    weights = torch.exp(-torch.arange(g - 1, dtype=torch.float32) / decay)  # k = 1..g-1 -> exp(-(k-1)/gamma_d)

    def loss_fn(d, feats, tokens, labels, anchors, idx):
        loss, hits = block_loss(d, feats, tokens, labels, anchors, weights)
        return loss, {"acc1": hits[..., 0].float().mean().item()}

    def eval_fn(d):
        return evaluate(d, ev, a.prompt_tokens, bf16=a.bf16)

    step, elapsed, history, prior_wall = train_drafter(
        a, drafter, target, config, pool, loss_fn, eval_fn, wall_start, log, "train dflash"
    )
    return export(
        drafter,
        target,
        ev,
        a,
        config,
        history,
        step,
        elapsed,
        N,
        L,
        decay,
        wall_minutes=(prior_wall + time.time() - wall_start) / 60,
        log=log,
    )


def train_drafter(
    a, drafter, target, config, pool: dict, loss_fn: Callable, eval_fn: Callable, wall_start: float, log, desc: str
):
    """The budgeted training loop of every drafter trainer (DFlash, DFlash 2, DSpark).

    loss_fn(drafter, feats, tokens, labels, anchors, idx) -> (loss, {name: float} for the bar);
    eval_fn(drafter) -> {"tau": float, "acceptance": [...], ...}. Returns (step, elapsed, history,
    prior_wall), prior_wall being the wall seconds of the runs this one resumed.
    """
    from tqdm import tqdm

    out = Path(a.out)
    ckpt_path = out / "ckpt.pt"
    budget = a.minutes * 60.0
    N, L = pool["tokens"].shape
    g = config.block_size
    decay_params = [p for p in drafter.parameters() if p.dim() >= 2]
    other = [p for p in drafter.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
    )
    step, elapsed, history, prior_wall = 0, 0.0, [], 0.0
    if a.resume:
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ck["config"] != dataclasses.asdict(config):
            raise ValueError(f"checkpoint {ckpt_path} was made with a different drafter config")
        drafter.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed, history = ck["step"], ck["elapsed"], ck["history"]
        prior_wall = ck.get("wall", 0.0)
        log(f"resumed at step {step}, {elapsed / 60:.1f} min trained")
    train_budget = elapsed + budget - prior_wall - (time.time() - wall_start) - a.export_reserve_min * 60
    if train_budget <= elapsed:
        log("no training time left in the budget; exporting")
    log(
        f"{desc}: {drafter.num_parameters():,} parameters, {a.layers} layers, gamma {g}; pool {N} x {L} tokens; "
        f"training {(train_budget - elapsed) / 60:.1f} min"
    )

    gen = torch.Generator().manual_seed(a.seed * 1000 + step)
    next_eval = elapsed + a.eval_every_min * 60
    next_ckpt = elapsed + a.ckpt_every_min * 60
    bar = tqdm(
        total=max(1, round(train_budget)),
        initial=min(round(elapsed), max(1, round(train_budget))),
        unit="s",
        desc=desc,
        dynamic_ncols=True,
        mininterval=5,
    )
    drafter.train()
    ema: dict[str, float] = {}

    def save_ckpt():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {
                "model": drafter.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "history": history,
                "config": dataclasses.asdict(config),
                "args": asdict(a),
                "wall": prior_wall + time.time() - wall_start,
            },
            tmp,
        )
        os.replace(tmp, ckpt_path)

    while elapsed < train_budget:
        t0 = time.time()
        lr = lr_at(elapsed / train_budget, a)
        for grp in opt.param_groups:
            grp["lr"] = lr
        idx = torch.randint(0, N, (a.batch_size,), generator=gen)
        anchors = sample_anchors(a.batch_size, a.blocks_per_seq, a.min_anchor, L - g, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss, stats = loss_fn(
                drafter, pool["features"][idx], pool["tokens"][idx], pool["labels"][idx], anchors, idx
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), a.grad_clip)
        opt.step()
        step += 1
        elapsed += time.time() - t0
        stats = {"loss": loss.item()} | stats
        ema = {k: v if k not in ema else 0.98 * ema[k] + 0.02 * v for k, v in stats.items()}
        bar.update(max(0, min(round(elapsed), bar.total) - bar.n))
        bar.set_postfix(step=step, lr=f"{lr:.1e}", **{k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        if elapsed >= next_eval:
            ev = eval_fn(drafter)
            drafter.train()
            rec = {
                "step": step,
                "minutes": elapsed / 60,
                "train_loss": ema["loss"],
                "tau": ev["tau"],
                "acceptance": ev["acceptance"],
            }
            history.append(rec)
            bar.write(
                f"step {step} ({elapsed / 60:.1f} min): loss {ema['loss']:.3f}  held-out tau {ev['tau']:.2f}  "
                f"acceptance {' '.join(f'{x:.2f}' for x in ev['acceptance'])}"
            )
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            next_eval = elapsed + a.eval_every_min * 60
        if elapsed >= next_ckpt:
            save_ckpt()
            next_ckpt = elapsed + a.ckpt_every_min * 60
    bar.close()
    save_ckpt()
    return step, elapsed, history, prior_wall


def export(drafter, target, ev, a, config, history, step, elapsed, n_seq, seq_len, decay, wall_minutes, log) -> dict:
    """Write the bf16 drafter, then measure what ships: held-out acceptance and a real speculative run."""
    from ..decoding.loop import speculative_generate

    t0 = time.time()
    export_dir = Path(a.export)
    save_dflash(drafter, export_dir, dtype=torch.bfloat16)
    shipped = load_dflash(export_dir, target, dtype=torch.float32)
    final = evaluate(shipped, ev, a.prompt_tokens, bf16=False)
    tok = data.load_tokenizer()
    prompts = data.heldout_prompts("code", 8, a.prompt_tokens, tok)
    _, spec = speculative_generate(target, shipped, prompts, max_new_tokens=96)
    summary = {
        "step": step,
        "train_minutes": elapsed / 60,
        "wall_minutes": wall_minutes + (time.time() - t0) / 60,
        "final": final,
        "spec_tau": spec["tau"],
        "spec_acceptance": spec["acceptance_per_position"],
        "history": history,
        "params": shipped.num_parameters(),
        "sequences": n_seq,
        "seq_len": seq_len,
        "decay": decay,
        "hardware": hardware_string(),
        "torch": torch.__version__,
        "args": asdict(a),
        "config": dataclasses.asdict(config),
        "target_params": target.num_parameters(),
        "target_layers": target.config.num_hidden_layers,
    }
    data.write_json(Path(a.out) / "summary.json", summary)
    write_model_card(export_dir / "MODEL_CARD.md", summary)
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
    text = f"""# flashspark embedded DFlash drafter

A block-diffusion drafter for the embedded target (`../target`), trained by
distillation from that target on two CPU cores. It drafts a block of
{g - 1} tokens in one forward, conditioned on the target by KV injection.

## Architecture

| field | value |
|---|---|
| decoder layers | {c["num_hidden_layers"]} (Qwen3: RMSNorm, GQA {c["num_attention_heads"]}/{c["num_key_value_heads"]} heads × {c["head_dim"]}, q/k norm, RoPE, SwiGLU {c["intermediate_size"]}) |
| hidden size | {c["hidden_size"]} (the target's) |
| block size γ | {g}: `[anchor, <\\|mask\\|> × {g - 1}]`, mask id {c["mask_token_id"]} |
| target feature layers | {c["target_layer_ids"]} of {s["target_layers"]} (`round(1 + i(L-4)/4)`) → `fc` ({len(c["target_layer_ids"])}·{c["hidden_size"]} → {c["hidden_size"]}) → `hidden_norm` |
| KV injection | context features through each layer's k_proj/v_proj, k_norm, RoPE; no mask inside the block |
| embedding, LM head | the target's, shared and frozen (not in this checkpoint) |
| parameters | {s["params"]:,} (target: {s["target_params"]:,}) |
| shipped dtype | bfloat16 (`model.safetensors`) |

## Training

```
{a["command"] or "python -m flashspark train dflash"}
```

- Hardware: {s["hardware"]}; torch {s["torch"]}, {a["threads"]} threads.
- Data: {s["sequences"]:,} sequences of {a["prompt_tokens"]} training-split tokens followed by
  {a["gen_tokens"]} tokens of the target's own greedy continuation (fp32), with the target's
  feature-layer hidden states. Labels are the target's greedy tokens.
- {s["step"]:,} steps of {a["batch_size"]} sequences × {a["blocks_per_seq"]} random anchors
  (packed under a block mask), loss weight exp(−(k−1)/{s["decay"]:g}) on block position k ≥ 1.
- AdamW (β = 0.9, 0.95, weight decay {a["weight_decay"]}), peak lr {a["lr"]:g}, warmup
  {a["warmup_frac"] * 100:g}% then cosine to {a["min_lr_frac"] * 100:g}% on training time; bf16 autocast.
- Training time {s["train_minutes"]:.1f} min; wall time of the whole command {s["wall_minutes"]:.1f} min
  (data generation, evaluation and export included).

## Held-out acceptance (temperature 0)

The shipped bf16 weights, computed in fp32, on greedy target continuations of
{a["eval_sequences"]} held-out code prompts ({a["prompt_tokens"]} tokens + 128 generated), one block
at every position of the continuation ({f["blocks"]:,} blocks). "top-1" is
agreement of draft k with the target's greedy token; "accepted" is the chance
that drafts 1..k all agree (draft k is accepted at T = 0). The last column is a
real speculative run (`speculative_generate`, 8 held-out prompts, 96 new tokens, K = {g - 1}).

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

Distilled from a small target for a short time: it drafts the target's
habits on Python code well and anything else poorly. The drafter is
specific to this target's weights; retrain it whenever the target changes.
"""
    path.write_text(text)
