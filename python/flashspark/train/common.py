"""What every trainer shares: the learning-rate schedule, the hardware string of model cards,
and for the drafters the args, the data pool of target continuations (generated within a
budget, resumable), the budgeted training loop with checkpoints, and the block targets."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import data
from ..models import catalog
from ..models.dflash import DFlashDrafter, block_mask, load_dflash, packed_blocks
from .target_data import PROGRESS, TargetData, sample_row_anchors


def lr_at(progress: float, a) -> float:
    """Linear warmup then cosine decay to min_lr_frac, over training time: `progress` in [0, 1]
    is the fraction of the time budget spent; `a` holds lr, warmup_frac and min_lr_frac."""
    if progress < a.warmup_frac:
        return a.lr * progress / a.warmup_frac
    p = min(1.0, (progress - a.warmup_frac) / (1.0 - a.warmup_frac))
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def hardware_string() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}"


DECAY = {8: 4.0, 10: 5.0, 16: 7.0}  # gamma_d of the DFlash paper per block size


@dataclass
class RunArgs:
    """The options of every budgeted, resumable training run; each trainer's args add its own."""

    resume: bool = False
    threads: int = 2
    seed: int = 0
    grad_clip: float = 1.0
    bf16: bool = True  # bf16 autocast (fp32 master weights)
    eval_every_min: float = 5.0
    ckpt_every_min: float = 5.0
    command: str = ""  # the command line, kept in the run's summary


@dataclass
class DFlashTrainArgs(RunArgs):
    out: str = "runs/dflash"
    export: str = str(data.ASSETS_DIR / "dflash")
    target: str = str(data.ASSETS_DIR / "target")
    minutes: float = 50.0  # whole run: data generation + training + evaluation + export
    gen_frac: float = 0.3  # share of the budget spent generating target continuations
    max_sequences: int = 8192  # cap on generated sequences (memory: ~0.65 MB each)
    export_reserve_min: float = 2.5
    shard_mib: float = 0.0  # export weights in safetensors shards of at most this many MiB (0: one file)
    share_weights_with: str = ""  # export: tensors equal to this checkpoint's are read from its files
    device: str = "cpu"  # where the target, the drafter and the batches live (cuda: `scripts/gpu_train_smollm2.sh`)
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
    init_layers: bool = False  # start the decoder layers from the target's top layers
    eval_sequences: int = 64
    data_from: str = ""  # run directory whose generated data / eval set to reuse, or a `train data` directory
    # Held-out continuations from `train data --split heldout` ("" = held-out code prompts generated here).
    eval_from: str = ""
    intermediate_size: int = 0  # the drafter's MLP width (0: the target's)
    mask_token: str = ""  # the drafter's mask token ("": the target's, models.catalog)
    window: int = 512  # the longest sequence of a `train data` directory a step reads (its last tokens)
    # The LM head's training vocabulary (`head_candidates`): 0 = all of it; N > 0 = the union of
    # the target's stored Top-K at the batch's predicted positions plus N uniform random tokens
    # (a `train data` directory only). Held-out evaluations always use the whole vocabulary.
    head_negatives: int = 0
    distill: float = 0.0  # weight of the target's Top-K distribution in the backbone's loss (`block_loss`)
    head_logq: bool = True  # weight the uniform draws by the share of the vocabulary each stands for

    def gamma_d(self) -> float:
        """γ_d of the position weights: --decay, else the DFlash paper's value for γ (γ/2 off its table)."""
        return self.decay or DECAY.get(self.block_size, self.block_size / 2)

    def export_options(self) -> dict:
        """The save_* keywords of the export: shard size and the checkpoint it shares tensors with."""
        return dict(max_shard_bytes=int(self.shard_mib * 2**20), share_with=self.share_weights_with or None)


@dataclass
class DerivedDrafterArgs(DFlashTrainArgs):
    """A drafter on a DFlash backbone (DFlash 2, DSpark), which may start from a trained one."""

    init_from: str = ""  # DFlash drafter directory to start the backbone from ("" = fresh)
    # Keep --init-from's backbone frozen and train only what this drafter adds (the export still
    # holds every tensor: the authors' formats have no shared-backbone reference).
    share_backbone: bool = False


def start_backbone(drafter, a: DerivedDrafterArgs, target, log) -> None:
    """Load --init-from's DFlash backbone into `drafter` (not on --resume: the checkpoint has it);
    with --share-backbone, freeze it (on --resume too)."""
    if a.share_backbone and not a.init_from:
        raise ValueError("--share-backbone needs --init-from (the DFlash drafter whose backbone is shared)")
    if not a.init_from:
        return
    base = load_dflash(a.init_from, target, dtype=torch.float32, use_ops=False)
    if a.share_backbone:
        shared = set(base.state_dict())
        for n, p in drafter.named_parameters():
            p.requires_grad_(n not in shared)
    if a.resume:
        return
    want = drafter.config
    if base.config.block_size != want.block_size or base.config.num_hidden_layers != want.num_hidden_layers:
        raise ValueError(
            f"--init-from {a.init_from} has block size {base.config.block_size} and "
            f"{base.config.num_hidden_layers} layers; this run wants {want.block_size} and {want.num_hidden_layers}"
        )
    drafter.load_dflash_backbone(base.state_dict())
    log(f"backbone from {a.init_from}")


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
        data.atomic_write(ddir / f"chunk_{n_chunks:04d}.pt", lambda f: torch.save(chunk, f))
        pool = _append(pool, chunk, n, a.max_sequences)
        n += a.gen_batch
        n_chunks += 1
        bar.update(min(round(seconds), round(time.time() - t0)) - bar.n)
        bar.set_postfix(sequences=n, refresh=False)
    bar.close()
    gen_seconds = time.time() - t0
    data.write_json(ddir / "done.json", {"chunks": n_chunks, "sequences": n, "seconds": gen_seconds})
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
    target's top decoder layers into the drafter's (same shapes). The drafter's layers are
    Qwen3's, with q/k norms: a target without them (Llama's, SmolLM2's) leaves those at their
    initial ones, so the copy is a starting point, not the target's function."""
    with torch.no_grad():
        drafter.norm.weight.copy_(target.model.norm.weight)
        if layers:
            n = len(drafter.layers)
            for mine, theirs in zip(drafter.layers, target.model.layers[-n:]):
                missing, unexpected = mine.load_state_dict(theirs.state_dict(), strict=False)
                if unexpected or any(not k.endswith(("q_norm.weight", "k_norm.weight")) for k in missing):
                    raise ValueError(
                        f"--init-layers: the target's layers do not fit the drafter's "
                        f"(missing {missing}, unexpected {unexpected}); set --intermediate-size to the target's"
                    )


def _log_to(out: Path):
    def log(msg: str) -> None:
        print(msg, flush=True)
        with open(out / "train.log.txt", "a") as f:
            f.write(msg + "\n")

    return log


@dataclass
class TrainedRun:
    """What the budgeted loop hands to a trainer's export."""

    step: int
    elapsed: float  # training seconds, over every session of the run
    history: list  # the held-out evaluations
    prior_wall: float  # wall seconds of the sessions this one resumed
    wall_start: float  # time.time() when this session started
    sequences: int  # the data pool's size and sequence length
    seq_len: int
    data: dict | None = None  # a `train data` directory's facts (TargetData.facts)
    commands: list[str] = dataclasses.field(default_factory=list)  # each session's command line


def train_drafter(
    a, drafter, target, config, pool: dict, loss_fn: Callable, eval_fn: Callable, wall_start: float, log, desc: str
) -> TrainedRun:
    """The budgeted training loop of every drafter trainer (DFlash, DFlash 2, DSpark).

    loss_fn(drafter, feats, tokens, labels, anchors, idx) -> (loss, {name: float} for the bar);
    eval_fn(drafter) -> {"tau": float, "acceptance": [...], ...}.
    """
    out = Path(a.out)
    ckpt_path = out / "ckpt.pt"
    budget = a.minutes * 60.0
    sample, N, L = batch_sampler(pool, a, config.num_drafts + 1)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    decay_params = [p for p in trainable if p.dim() >= 2]
    other = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay_params, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
    )
    step, elapsed, history, prior_wall, commands = 0, 0.0, [], 0.0, []
    if a.resume:
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ck["config"] != dataclasses.asdict(config):
            raise ValueError(f"checkpoint {ckpt_path} was made with a different drafter config")
        drafter.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed, history = ck["step"], ck["elapsed"], ck["history"]
        prior_wall = ck.get("wall", 0.0)
        commands = ck.get("commands", [])
        # The checkpoint is written when training ends, before the export: a finished session's
        # wall time (export included) is its summary's.
        summary = out / "summary.json"
        if summary.is_file():
            prior_wall = max(prior_wall, 60.0 * json.loads(summary.read_text()).get("wall_minutes", 0.0))
        log(f"resumed at step {step}, {elapsed / 60:.1f} min trained")
    commands = commands + [a.command]  # every session's command line, for the model card
    train_budget = elapsed + budget - prior_wall - (time.time() - wall_start) - a.export_reserve_min * 60
    if train_budget <= elapsed:
        log("no training time left in the budget: one step, then export")
    log(
        f"{desc}: {drafter.num_parameters():,} parameters ({sum(p.numel() for p in trainable):,} trained), "
        f"{a.layers} layers, gamma {config.block_size} ({config.num_drafts} drafts); pool {N} x {L} tokens; "
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
        state = {
            "model": drafter.state_dict(),
            "opt": opt.state_dict(),
            "step": step,
            "elapsed": elapsed,
            "history": history,
            "config": dataclasses.asdict(config),
            "args": asdict(a),
            "wall": prior_wall + time.time() - wall_start,
            "commands": commands,
        }
        data.atomic_write(ckpt_path, lambda f: torch.save(state, f))

    # At least one step per run, even when the setup spent the budget (a loaded machine): every
    # session makes progress, and a resumed run's step count always grows.
    first_step = step
    while elapsed < train_budget or step == first_step:
        t0 = time.time()
        lr = lr_at(min(1.0, elapsed / train_budget) if train_budget > 0 else 1.0, a)
        for grp in opt.param_groups:
            grp["lr"] = lr
        batch = on_device(sample(gen), a.device)
        with torch.autocast(torch.device(a.device).type, dtype=torch.bfloat16, enabled=a.bf16):
            loss, stats = loss_fn(drafter, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, a.grad_clip)
        opt.step()
        step += 1
        elapsed += time.time() - t0
        stats = {"loss": loss.item()} | stats
        ema = {k: v if k not in ema else 0.98 * ema[k] + 0.02 * v for k, v in stats.items()}
        bar.update(max(0, min(round(elapsed), bar.total) - bar.n))
        bar.set_postfix(step=step, lr=f"{lr:.1e}", **{k: f"{v:.3f}" for k, v in ema.items()}, refresh=False)
        if elapsed >= next_eval or elapsed >= train_budget:  # the last step too: history ends with it
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
    facts = pool.facts() if isinstance(pool, TargetData) else None
    return TrainedRun(step, elapsed, history, prior_wall, wall_start, N, L, facts, commands)


def on_device(batch: dict, device) -> dict:
    """A batch (or held-out set) with its tensors on `device`; batches are drawn on the CPU (memory
    maps, CPU generators) and moved once."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def batch_sampler(pool, a, block_size: int):
    """(sample(generator) -> batch, sequences, tokens per sequence) over a pool of generated data.
    `block_size` is the span of a block's labels: the anchor and its drafts (γ for DFlash,
    γ + 1 for a drafter in DeepSpec's layout, whose anchor slot drafts too).

    A batch holds features, tokens, labels and anchors [B, blocks_per_seq]; from a `TargetData`
    directory also the target's Top-K (topk_ids, topk_logp), from an in-memory pool the rows'
    indices (idx). Anchors of a pool lie in [min_anchor, L - γ]; of `TargetData`, in each
    row's generated part (as in decoding, where the drafter drafts after the prompt)."""
    if isinstance(pool, TargetData):
        usable = torch.from_numpy(pool.usable(block_size))
        if len(usable) == 0:
            raise ValueError(f"{pool.dir} holds no sequence with {block_size + 1} generated tokens")
        lengths = pool.index[usable.numpy(), 2]

        def sample(gen):
            rows = pool.rows(usable[torch.randint(0, len(usable), (a.batch_size,), generator=gen)].tolist(), a.window)
            rows["anchors"] = sample_row_anchors(rows["start"], rows["length"], a.blocks_per_seq, block_size, gen)
            return rows

        return sample, len(usable), round(float(lengths.mean()))

    N, L = pool["tokens"].shape

    def sample(gen):
        idx = torch.randint(0, N, (a.batch_size,), generator=gen)
        anchors = sample_anchors(a.batch_size, a.blocks_per_seq, a.min_anchor, L - block_size, gen)
        return {"features": pool["features"][idx], "tokens": pool["tokens"][idx], "labels": pool["labels"][idx]} | {
            "anchors": anchors,
            "idx": idx,
        }

    return sample, N, L


def position_weights(block_size: int, decay: float, first: int = 1) -> torch.Tensor:
    """[γ-1] weights of block positions k = 1..γ-1: exp(-(k - first)/γ_d) (DFlash: first = 1, DSpark: 0)."""
    return torch.exp(-(torch.arange(1, block_size, dtype=torch.float32) - first) / decay)


def block_targets(tokens: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, block_size: int):
    """Teacher forcing of packed blocks: (prev, target) [B, nb, n] for drafts j = 1..n,
    n = block_size - 1 (block_size: the span of anchor and drafts, as in `batch_sampler`);
    target = the target's greedy token at anchor + j (as in `block_loss`), prev = the token
    before it (the anchor token at j = 1, the previous target token after)."""
    B, nb = anchors.shape
    target = labels.gather(1, predicted_positions(anchors, block_size)).view(B, nb, block_size - 1)
    prev = torch.cat([tokens.gather(1, anchors)[..., None], target[..., :-1]], -1)
    return prev, target


def eval_set(target, a, layer_ids, out: Path, tok, span: int | None = None) -> dict:
    """Held-out greedy continuations: --eval-from's (a `train data --split heldout` directory),
    else held-out code prompts continued here (as in the DFlash trainer), reused from
    --data-from when it fits. `span`: tokens from the anchor to its last draft (default γ)."""
    device = target.model.embed_tokens.weight.device
    if a.eval_from:
        held = TargetData(a.eval_from)
        held.check_for(target, layer_ids)
        return on_device(held.eval_set(span or a.block_size, a.window, a.eval_sequences), device)
    for d in ([Path(a.data_from)] if a.data_from else []) + [out]:
        p = d / "eval.pt"
        if p.is_file():
            ev = torch.load(p)
            if ev["features"].shape[2] == len(layer_ids) and ev["tokens"].shape[0] >= a.eval_sequences:
                return on_device(ev, device)
    prompts = torch.tensor(data.heldout_prompts("code", a.eval_sequences, a.prompt_tokens, tok))
    ev = dict(zip(("tokens", "features", "labels"), generate_sequences(target, prompts, 128, layer_ids)))
    data.atomic_write(out / "eval.pt", lambda f: torch.save(ev, f))
    return on_device(ev, device)


def data_pool(target, a, layer_ids, out: Path, tok, budget_s: float, log) -> dict:
    """Generated training data: --data-from's (a run directory, or a `train data` directory,
    memory-mapped), else ours from a previous run (--resume), else new."""
    if a.data_from and (Path(a.data_from) / PROGRESS).is_file():
        pool = TargetData(a.data_from)
        pool.check_for(target, layer_ids)
        log(f"reading {len(pool)} generated sequences ({pool.tokens:,} tokens) from {a.data_from}")
        return pool
    if a.data_from:
        pool = load_pool(Path(a.data_from))
        if pool is None:
            raise FileNotFoundError(f"--data-from {a.data_from} holds no finished data (data/done.json)")
        if pool["features"].shape[2] != len(layer_ids):
            raise ValueError(
                f"--data-from {a.data_from} has features of {pool['features'].shape[2]} layers, "
                f"this drafter reads {len(layer_ids)}"
            )
        log(f"reusing {pool['tokens'].shape[0]} generated sequences from {a.data_from}")
        return pool
    pool = load_pool(out) if a.resume else None
    if pool is not None:
        log(f"reusing {pool['tokens'].shape[0]} generated sequences from {out / 'data'}")
        return pool
    train_ids = data.split_token_ids("train", tok, out / "cache")
    return build_pool(target, a, layer_ids, train_ids, budget_s, out, log)


def setup_run(a):
    """Common start of a drafter run: threads, out dir, log, tokenizer, frozen fp32 target
    (--target: a known target's name or a path), and the drafters' mask token id."""
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    if a.resume and not (out / "ckpt.pt").is_file():
        raise FileNotFoundError(f"--resume given but no checkpoint {out / 'ckpt.pt'}")
    ref = catalog.resolve_target(a.target)
    tok = catalog.target_tokenizer(ref)
    mask_id = catalog.mask_token_id(tok, ref.known, a.mask_token or None)
    out.mkdir(parents=True, exist_ok=True)
    log = _log_to(out)
    target = catalog.load_target(ref, dtype=torch.float32, device=a.device)
    for p in target.parameters():
        p.requires_grad_(False)
    return out, log, tok, target, mask_id


def predicted_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, nb * (γ-1)] the positions whose labels a block predicts: anchor + 1 .. anchor + γ - 1."""
    return (anchors[..., None] + torch.arange(1, block_size, device=anchors.device)).flatten(1)


def gather_positions(x: torch.Tensor, anchors: torch.Tensor, span: int) -> torch.Tensor:
    """Rows anchor + j (j = 1..span-1, the drafts) of per-position tensors x [B, L, K] -> [B, nb, span-1, K]."""
    B, nb = anchors.shape
    pos = predicted_positions(anchors, span)
    return x.gather(1, pos[..., None].expand(-1, -1, x.shape[-1])).view(B, nb, span - 1, -1)


class HeadCandidates(NamedTuple):
    """The LM head's vocabulary for one batch (`head_candidates`): sorted token ids holding
    every label, and the log of how many tokens of the whole vocabulary each one stands for in
    the softmax's normaliser (0 for a token that is always there)."""

    ids: torch.Tensor  # [C] int64, sorted, unique
    log_weight: torch.Tensor  # [C] fp32


def head_candidates(
    batch: dict, anchors: torch.Tensor, block_size: int, vocab_size: int, negatives: int, gen, logq: bool = True
) -> HeadCandidates:
    """The vocabulary the LM head is trained over for one batch: the target's Top-K at every
    predicted position (its greedy label among them), the labels, and `negatives` tokens drawn
    uniformly. On a 49152-token vocabulary the head over 2048 predicted positions is most of a
    CPU training step; the target's Top-32 of a batch spans about a tenth of it and holds every
    token the target finds plausible there.

    The uniform draws stand for the rest of the vocabulary. Without a correction each counts
    once in the normaliser, so a token outside the Top-K is pushed down about V / N times too
    weakly, and the drafter's argmax over the whole vocabulary lands on such tokens (a quarter
    of position-1 drafts on SmolLM2's held-out data). With `logq` each draw's logit is raised by
    log(rest / drawn): the sampled normaliser is an unbiased estimate of the full one (sampled
    softmax with the log-Q correction)."""
    pos = predicted_positions(anchors, block_size)
    ids = batch["topk_ids"].gather(1, pos[..., None].expand(-1, -1, batch["topk_ids"].shape[-1]))
    labels = batch["labels"].gather(1, pos).clamp(min=0)
    certain = torch.cat([ids.flatten(), labels.flatten()]).unique()
    rand = torch.randint(0, vocab_size, (negatives,), generator=gen).to(ids.device).unique()
    drawn = rand[~torch.isin(rand, certain)]
    every = torch.cat([certain, drawn])
    order = every.argsort()
    log_weight = torch.zeros(len(every), device=every.device)
    if logq and len(drawn):
        log_weight[len(certain) :] = math.log((vocab_size - len(certain)) / len(drawn))
    return HeadCandidates(every[order], log_weight[order])


def block_loss(
    drafter: DFlashDrafter, feats, tokens, labels, anchors, weights, candidates=None, distill: float = 0.0, topk=None
):
    """Weighted CE over block positions 1..gamma-1 and the top-1 hits [B, nb, gamma-1]; with
    `candidates` (`head_candidates`: they must hold every label) the softmax is over those tokens
    only, each weighted by the share of the vocabulary it stands for, and the hits are over
    the candidates' own logits.

    With `distill` = w > 0 and `topk` = (ids, logp) [B, W, K], the target's stored Top-K at every
    position, each position's loss is (1 - w)·CE(greedy label) + w·CE(target's Top-K
    distribution, renormalised): distillation towards the whole distribution the drafter's
    drafts are accepted against at T > 0, not only its argmax (the Top-K holds most of its mass;
    `candidates` hold every Top-K id)."""
    g = drafter.block_size
    B, nb = anchors.shape
    S = feats.shape[1]
    bt, pos = packed_blocks(tokens, anchors, g, drafter.config.mask_token_id)
    hidden = drafter(feats, bt, pos, block_mask(anchors, S, g))
    hidden = hidden.view(B, nb, g, -1)[:, :, 1:]
    target = labels.gather(1, predicted_positions(anchors, g)).view(B, nb, g - 1)
    if candidates is None:
        logits = drafter.logits(hidden)  # [B, nb, g-1, V] fp32
        scored = logits
    else:
        w = drafter.head_weight[candidates.ids]
        logits = F.linear(hidden, w.to(hidden.dtype)).float()  # [B, nb, g-1, C]
        scored = logits + candidates.log_weight
        index = torch.searchsorted(candidates.ids, target).clamp(max=len(candidates.ids) - 1)
        if not torch.equal(candidates.ids[index], target):
            raise ValueError("head candidates must hold every label")
        target = index
    ce = F.cross_entropy(scored.flatten(0, 2), target.flatten(), reduction="none").view(B, nb, g - 1)
    weights = weights.to(ce.device)
    if distill > 0:
        ids = gather_positions(topk[0], anchors, g)
        logp = gather_positions(topk[1], anchors, g).float()
        p = logp.softmax(-1).nan_to_num(0.0)  # a position without a Top-K row (all -inf) adds 0
        if candidates is not None:
            ids = torch.searchsorted(candidates.ids, ids).clamp(max=len(candidates.ids) - 1)
        logq = scored.log_softmax(-1).gather(-1, ids)
        soft = -(p * logq).sum(-1)
        ce = (1 - distill) * ce + distill * soft
    loss = (ce * weights).sum() / (weights.sum() * B * nb)
    return loss, logits.argmax(-1) == target


def eval_anchors(ev: dict, prompt_tokens: int, block_size: int) -> torch.Tensor:
    """The anchors of a held-out set: a ragged set's own per row ([B, A], `TargetData.eval_set`),
    else [1, A] shared by the rows, every position from the first continuation token
    (prompt_tokens) to the last whose block fits (labels up to a + γ - 1 <= S)."""
    if "anchors" in ev:
        return ev["anchors"]
    S = ev["features"].shape[1]
    return torch.arange(prompt_tokens, S + 1 - block_size + 1)[None]


def rows_anchors(anchors: torch.Tensor, rows: slice, n: int) -> torch.Tensor:
    """The anchors [n, A] of rows `rows` (n of them): their own, or the shared ones."""
    return anchors[rows] if anchors.shape[0] > 1 else anchors.expand(n, -1)


# Logits one evaluation batch may hold ([rows, anchors, γ - 1, V] fp32): 1 GiB.
EVAL_LOGITS = 2**28


def eval_batch(ev: dict, anchors: torch.Tensor, block_size: int, vocab_size: int, batch: int) -> int:
    """Rows per evaluation batch: `batch`, fewer where their logits would pass EVAL_LOGITS (a
    vocabulary of 49152 over a few hundred anchors per row)."""
    per_row = anchors.shape[-1] * (block_size - 1) * vocab_size
    return max(1, min(batch, EVAL_LOGITS // max(1, per_row)))


def valid_blocks(ev: dict, rows: slice, x: torch.Tensor) -> torch.Tensor:
    """Per-block results x [B, anchors, ...] of rows `rows` as [blocks, ...]: all of them, or of a
    ragged set those its `valid` mask counts (each anchor of a row once)."""
    return x[ev["valid"][rows]] if "valid" in ev else x.flatten(0, 1)


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
    anchors = eval_anchors(ev, prompt_tokens, g)
    batch = eval_batch(ev, anchors, g, drafter.config.vocab_size, batch)
    hits_all = []
    for i in range(0, ev["tokens"].shape[0], batch):
        sl = slice(i, i + batch)
        a = rows_anchors(anchors, sl, ev["tokens"][sl].shape[0])
        with torch.autocast(ev["tokens"].device.type, dtype=torch.bfloat16, enabled=bf16):
            _, hits = block_loss(
                drafter, ev["features"][sl].float(), ev["tokens"][sl], ev["labels"][sl], a, torch.ones(g - 1)
            )
        hits_all.append(valid_blocks(ev, sl, hits))
    hits = torch.cat(hits_all).float()  # [blocks, g-1]
    drafter.train(was)
    prefix = hits.cumprod(1).mean(0)
    return {
        "acceptance": prefix.tolist(),
        "top1": hits.mean(0).tolist(),
        "tau": 1 + float(prefix.sum()),
        "blocks": hits.shape[0],
    }


def run_facts(a, config, target, decay: float, run: TrainedRun) -> dict:
    """What every drafter's summary and model card record about its run: steps, times (the wall
    time of every session, export included), the evaluations, the data, the decay, the machine,
    the arguments, the config and the target."""
    return {
        "step": run.step,
        "train_minutes": run.elapsed / 60,
        "wall_minutes": (run.prior_wall + time.time() - run.wall_start) / 60,
        "history": run.history,
        "commands": run.commands,
        "sequences": run.sequences,
        "seq_len": run.seq_len,
        "data": run.data,
        "decay": decay,
        "hardware": hardware_string(),
        "torch": torch.__version__,
        "args": asdict(a),
        "config": dataclasses.asdict(config),
        "target_params": target.num_parameters(),
        "target_layers": target.config.num_hidden_layers,
        "target_name": known.name if (known := catalog.target_of(target)) else str(getattr(target, "source", "")),
        "mask_token": _token_name(target, config.mask_token_id),
    }


def data_description(summary: dict) -> str | None:
    """A model card's line on a `train data` directory (None for the in-memory pools)."""
    d = summary.get("data")
    if not d:
        return None
    return (
        f"{d['sequences']:,} continuations by the target ({d['tokens']:,} tokens, {d['generated_tokens']:,} "
        f"of them generated, {d['generation_minutes']:.0f} min of generation) of the training prompt sets "
        f"({d['kinds']}; chat through the chat template), greedy, up to {d['max_new_tokens']} new tokens, "
        f"in `{d['dir']}`; labels are the target's greedy tokens, anchors in each continuation"
    )


def backbone_line(args: dict, parts: str) -> str:
    """How a derived drafter's model card says its backbone was made."""
    if not args.get("init_from"):
        return " from scratch"
    if args.get("share_backbone"):
        return f" {args['init_from']}'s, frozen (only {parts} trained; the file holds the whole drafter)"
    return f" started from {args['init_from']}"


def eval_description(args: dict) -> str:
    """Where a model card's held-out acceptance was measured (the anchors of its blocks)."""
    if args.get("eval_from"):
        return (
            "48 anchors spread evenly over each of the target's continuations of up to "
            f"{args['eval_sequences']} held-out prompts (chat, code and prose: `train data --split heldout`)"
        )
    return (
        f"every position of the greedy continuations of {args['eval_sequences']} held-out code prompts "
        f"({args['prompt_tokens']} tokens + 128 generated)"
    )


def _token_name(target, token_id: int) -> str:
    """The mask token's text, for model cards (escaped for a Markdown table)."""
    source, name = getattr(target, "source", None), None
    try:
        if source is not None:
            name = catalog.target_tokenizer(catalog.resolve_target(source)).id_to_token(token_id)
    except (FileNotFoundError, ValueError):
        pass
    return (name or f"id {token_id}").replace("|", "\\|")


def target_description(summary: dict) -> str:
    """The target a model card's drafter was trained for."""
    name = summary.get("target_name", catalog.DEFAULT_TARGET)
    known = catalog.TARGETS.get(name)
    return f"{known.description} (`--model {name}`)" if known else f"the target at `{name}`"


def command_lines(summary: dict, default: str) -> str:
    """A model card's training commands: each session's in order (a resumed run's too), else
    the one recorded, else `default`."""
    lines = [c for c in summary.get("commands", []) if c] or [summary["args"].get("command") or default]
    return "\n".join(lines)


def publish(summary: dict, out: str | Path, export_dir: Path, write_model_card) -> None:
    """A run's summary.json in its run directory, and the model card beside the exported weights."""
    data.write_json(Path(out) / "summary.json", summary)
    write_model_card(export_dir / "MODEL_CARD.md", summary)
