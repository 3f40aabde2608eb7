"""Train the tokenizer and the embedded target model on CPU.

The run lives in `out` (checkpoint, token cache, metrics). The learning-rate
schedule runs on training *time*, not steps, so the run ends at its budget
whatever the machine's speed, and `--resume` continues the same schedule.
At the end the weights are exported (bf16 safetensors + config.json + model
card + corpus manifest) into the package assets.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .. import data
from ..models import DecoderConfig, DecoderForCausalLM, load_model, save_model
from .common import RunArgs, hardware_string, lr_at

DEFAULT_EXPORT = data.ASSETS_DIR / "target"


@dataclass
class TrainArgs(RunArgs):
    out: str = "runs/target"
    export: str = str(DEFAULT_EXPORT)
    tokenizer: str = str(data.TOKENIZER_PATH)
    minutes: float = 60.0
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_frac: float = 0.02
    weight_decay: float = 0.1
    eval_windows: int = 64
    # The widths the CLI exposes; the rest of the architecture is DecoderConfig's default (Qwen3).
    num_hidden_layers: int = DecoderConfig.num_hidden_layers
    hidden_size: int = DecoderConfig.hidden_size
    intermediate_size: int = DecoderConfig.intermediate_size


def get_tokenizer(path: Path):
    """Load the tokenizer, training it on the training split first if absent."""
    if path.is_file():
        return data.load_tokenizer(path)
    print(f"training tokenizer -> {path}", flush=True)
    tok = data.train_tokenizer((data.read_source(f) for f in data.split_files("train")), vocab_size=4096)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return tok


def sample_batch(ids: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> torch.Tensor:
    """Random windows of seq_len + 1 tokens; seeded by step so a resumed run
    sees the same stream it would have seen."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(ids) - seq_len - 1, size=batch_size)
    return torch.from_numpy(np.stack([ids[s : s + seq_len + 1] for s in starts]).astype(np.int64))


def heldout_windows(ids: np.ndarray, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows (seq_len + 1 tokens, stepping by seq_len) over
    the held-out stream; `limit` picks that many spread evenly."""
    n = (len(ids) - 1) // seq_len
    idx = np.arange(n) if limit is None or limit >= n else np.linspace(0, n - 1, limit).round().astype(int)
    return torch.from_numpy(np.stack([ids[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int64))


@torch.no_grad()
def evaluate(
    model: DecoderForCausalLM, windows: torch.Tensor, byte_lens: np.ndarray, bf16: bool = False, batch_size: int = 16
) -> dict:
    """Mean per-token loss (nats), perplexity and bits per byte."""
    was_training = model.training
    model.eval()
    total_nats, total_tokens, total_bytes = 0.0, 0, 0
    blen = torch.from_numpy(byte_lens)
    for i in range(0, len(windows), batch_size):
        x = windows[i : i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            last, _ = model.backbone(x[:, :-1])
            logits = model.lm_head(last)
        nats = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total_nats += float(nats)
        total_tokens += x[:, 1:].numel()
        total_bytes += int(blen[x[:, 1:]].sum())
    model.train(was_training)
    loss = total_nats / total_tokens
    return {
        "loss": loss,
        "ppl": math.exp(loss),
        "bpb": total_nats / math.log(2) / max(1, total_bytes),
        "tokens": total_tokens,
    }


def _save_ckpt(path: Path, model, opt, step: int, elapsed: float, a: TrainArgs, history: list, commands: list) -> None:
    state = {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "step": step,
        "elapsed": elapsed,
        "args": asdict(a),
        "config": model.config.to_dict(),
        "history": history,
        "commands": commands,
    }
    data.atomic_write(path, lambda f: torch.save(state, f))


def _log(out: Path, record: dict) -> None:
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def train(a: TrainArgs) -> dict:
    """Run (or resume) training for `a.minutes` of training time and export."""
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "ckpt.pt"
    if a.resume and not ckpt_path.is_file():
        raise FileNotFoundError(f"--resume given but no checkpoint {ckpt_path}")

    wall_start = time.time()
    tok = get_tokenizer(Path(a.tokenizer))
    special = data.special_token_ids(tok)
    train_ids = data.split_token_ids("train", tok, out / "cache")
    heldout_ids = data.split_token_ids("heldout", tok, out / "cache")
    byte_lens = data.token_byte_lengths(tok)
    print(f"tokens: train {len(train_ids):,}  heldout {len(heldout_ids):,}", flush=True)

    config = DecoderConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        tie_word_embeddings=True,
        torch_dtype="float32",
        eos_token_id=special["eot"],
    )
    torch.manual_seed(a.seed)
    model = DecoderForCausalLM(config)
    model.init_weights(a.seed)
    # No weight decay on norms (1-D); the tied embedding is decayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
    )
    step, elapsed = 0, 0.0
    history: list[dict] = []
    commands = [a.command or "python -m flashspark train target"]
    if a.resume:
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        if ck["config"] != config.to_dict():
            raise ValueError(f"checkpoint {ckpt_path} was made with a different model config")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed = ck["step"], ck["elapsed"]
        # The model card tells the whole story of a resumed run.
        history = ck.get("history", [])
        commands = ck.get("commands", []) + commands
        print(f"resumed at step {step}, {elapsed / 60:.1f} min trained", flush=True)
    print(
        f"model: {model.num_parameters():,} parameters ({model.num_parameters(True):,} without embeddings)", flush=True
    )

    budget = a.minutes * 60.0
    eval_small = heldout_windows(heldout_ids, a.seq_len, a.eval_windows)
    next_eval = elapsed + a.eval_every_min * 60
    next_ckpt = elapsed + a.ckpt_every_min * 60
    tokens_per_step = a.batch_size * a.seq_len
    bar = tqdm(
        total=round(budget),
        initial=round(min(elapsed, budget)),
        unit="s",
        mininterval=5,
        dynamic_ncols=True,
        desc="train target",
    )
    model.train()
    ema_loss = None
    while elapsed < budget:
        t0 = time.time()
        lr = lr_at(elapsed / budget, a)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_batch(train_ids, a.batch_size, a.seq_len, a.seed, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            last, _ = model.backbone(x[:, :-1])
            logits = model.lm_head(last)
        loss = F.cross_entropy(logits.float().reshape(-1, config.vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        step += 1
        dt = time.time() - t0
        elapsed += dt
        loss_val = loss.item()
        ema_loss = loss_val if ema_loss is None else 0.98 * ema_loss + 0.02 * loss_val
        bar.update(round(min(elapsed, budget)) - bar.n)
        bar.set_postfix(
            step=step, loss=f"{ema_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_step / dt:.0f}", refresh=False
        )
        if elapsed >= next_eval or elapsed >= budget:
            ev = evaluate(model, eval_small, byte_lens, bf16=a.bf16)
            rec = {
                "step": step,
                "minutes": elapsed / 60,
                "train_loss": ema_loss,
                "heldout_loss": ev["loss"],
                "heldout_ppl": ev["ppl"],
                "heldout_bpb": ev["bpb"],
                "lr": lr,
            }
            history.append(rec)
            _log(out, rec)
            bar.write(
                f"step {step} ({elapsed / 60:.1f} min): train {ema_loss:.3f}  "
                f"held-out loss {ev['loss']:.3f}  ppl {ev['ppl']:.2f}  bpb {ev['bpb']:.3f}"
            )
            next_eval = elapsed + a.eval_every_min * 60
        if elapsed >= next_ckpt:
            _save_ckpt(ckpt_path, model, opt, step, elapsed, a, history, commands)
            next_ckpt = elapsed + a.ckpt_every_min * 60
    bar.close()
    _save_ckpt(ckpt_path, model, opt, step, elapsed, a, history, commands)

    # Export, then evaluate exactly what ships (bf16 weights, run in fp32)
    # on the whole held-out split.
    export = Path(a.export)
    save_model(model, export, dtype=torch.bfloat16)
    shipped = load_model(export, dtype=torch.float32)
    final = evaluate(shipped, heldout_windows(heldout_ids, a.seq_len), byte_lens, bf16=False)
    print(
        f"final held-out (shipped bf16 weights, fp32 compute): loss {final['loss']:.4f}  "
        f"ppl {final['ppl']:.3f}  bpb {final['bpb']:.4f}  over {final['tokens']:,} tokens",
        flush=True,
    )
    manifest = data.corpus_manifest("train")
    manifest["heldout"] = data.corpus_manifest("heldout")
    manifest["tokens"] = {"train": int(len(train_ids)), "heldout": int(len(heldout_ids))}
    data.write_json(export / "corpus_manifest.json", manifest)
    summary = {
        "step": step,
        "train_minutes": elapsed / 60,
        "wall_minutes": (time.time() - wall_start) / 60,
        "tokens_seen": step * tokens_per_step,
        "final": final,
        "history": history,
        "params": model.num_parameters(),
        "params_no_embed": model.num_parameters(True),
        "hardware": hardware_string(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "args": asdict(a),
        "commands": commands,
        "config": config.to_dict(),
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(heldout_ids)),
        "manifest_sha256": manifest["sha256"],
        "heldout_sha256": manifest["heldout"]["sha256"],
        "num_train_files": manifest["num_files"],
        "num_heldout_files": manifest["heldout"]["num_files"],
    }
    data.write_json(out / "summary.json", summary)
    write_model_card(export / "MODEL_CARD.md", summary)
    print(f"exported to {export}", flush=True)
    return summary


def write_model_card(path: Path, s: dict) -> None:
    c, a, f = s["config"], s["args"], s["final"]
    rows = "\n".join(
        f"| {r['step']} | {r['minutes']:.1f} | {r['train_loss']:.3f} | {r['heldout_loss']:.3f} |" for r in s["history"]
    )
    text = f"""# flashspark embedded target model

A small Qwen3-architecture decoder trained from scratch on the Python standard
library, shipped so that the speculative decoding demo, tests and benchmarks run
anywhere without downloads. It writes plausible-looking Python; it is not a
useful code assistant.

## Architecture

Qwen3 (`Qwen3ForCausalLM`, Hugging Face parameter names): RMSNorm, grouped-query
attention with per-head q/k RMSNorm, RoPE (theta {c["rope_theta"]:g}), SwiGLU MLP,
tied input/output embeddings.

| field | value |
|---|---|
| layers | {c["num_hidden_layers"]} |
| hidden size | {c["hidden_size"]} |
| attention heads × head dim | {c["num_attention_heads"]} × {c["head_dim"]} |
| KV heads | {c["num_key_value_heads"]} |
| MLP intermediate size | {c["intermediate_size"]} |
| vocabulary | {c["vocab_size"]} (byte-level BPE, `../tokenizer.json`) |
| max positions | {c["max_position_embeddings"]} |
| parameters | {s["params"]:,} ({s["params_no_embed"]:,} without the embedding) |
| shipped dtype | bfloat16 (`model.safetensors`) |

Special tokens: `<|endoftext|>` (id 0, separates files, `eos_token_id`) and
`<|mask|>` (id 1, used by the block-diffusion drafters).

## Data

The `.py` files of the CPython {s["python"]} standard library (`site-packages`
skipped), read in sorted order of relative path, each followed by
`<|endoftext|>`. A file is held out when sha256 of its posix relative path mod
100 < 5: {s["num_train_files"]} training files ({s["train_tokens"]:,} tokens) and
{s["num_heldout_files"]} held-out files ({s["heldout_tokens"]:,} tokens). The
tokenizer was trained on the training files only. `corpus_manifest.json` lists
the files; content sha256 train `{s["manifest_sha256"][:16]}…`, held-out
`{s["heldout_sha256"][:16]}…`. Another Python version gives a different corpus.

## Training

```
{chr(10).join(s["commands"])}
```

- Hardware: {s["hardware"]}; torch {s["torch"]}, {a["threads"]} threads.
- {s["step"]:,} steps of {a["batch_size"]} × {a["seq_len"]} tokens
  ({s["tokens_seen"]:,} tokens, {s["tokens_seen"] / max(1, s["train_tokens"]):.2f} epochs).
- AdamW (β = 0.9, 0.95, weight decay {a["weight_decay"]}), peak lr {a["lr"]:g}, linear
  warmup over {a["warmup_frac"] * 100:g}% then cosine to {a["min_lr_frac"] * 100:g}%, scheduled on
  training time; gradient clip {a["grad_clip"]}; bf16 autocast with fp32 master weights.
- Training time {s["train_minutes"]:.1f} min ({s["tokens_seen"] / max(1e-9, 60 * s["train_minutes"]):,.0f} tokens/s
  on average); wall time of the last command {s["wall_minutes"]:.1f} min (tokenization,
  evaluation and export included).

## Held-out evaluation

The shipped bf16 weights, computed in fp32, over all held-out files in
non-overlapping {a["seq_len"]}-token windows ({f["tokens"]:,} predicted tokens):

| metric | value |
|---|---|
| loss (nats / token) | {f["loss"]:.4f} |
| perplexity (per token) | {f["ppl"]:.3f} |
| bits per byte | {f["bpb"]:.4f} |

Progress ({a["eval_windows"]} held-out windows, bf16 autocast):

| step | minutes | train loss | held-out loss |
|---|---|---|---|
{rows}

## Limitations

Trained for about an hour on two CPU cores: it knows Python syntax and stdlib
idioms, repeats itself under greedy decoding, and knows nothing outside the
standard library. Use it to exercise speculative decoding, not to write code.
"""
    path.write_text(text)
