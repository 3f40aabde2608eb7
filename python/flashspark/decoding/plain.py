"""Plain autoregressive decoding: the baseline speculative decoding must beat.

Batched over requests with ragged prompt lengths, greedy or temperature +
top-p sampling from a seeded generator. Returns tokens and stats; prints
nothing.
"""

from __future__ import annotations

import torch

from ..data import special_token_ids
from ..models.decoder import DecoderForCausalLM
from .stats import Clock


def sample_next(
    logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token per row of `logits` [B, V]: argmax when temperature == 0,
    otherwise a sample from softmax(logits / T) restricted to the top-p
    nucleus."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, limit: int, vocab_size: int) -> None:
    """Clear errors for empty prompts, prompts that cannot fit, bad ids."""
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with {max_new_tokens} new tokens it needs "
                f"{len(p) + max_new_tokens} positions but the cache holds {limit}"
            )
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")


@torch.no_grad()
def generate(
    model: DecoderForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
    batch_size: int | None = None,
    max_len: int | None = None,
) -> tuple[list[list[int]], dict]:
    """Decode every prompt; returns (new tokens per prompt, stats).

    Prompts are processed in batches of `batch_size` (default: all at once).
    A request stops after emitting `eos_id` (included in its output). The KV
    cache holds `max_len` positions (default: longest prompt + new tokens,
    capped by max_position_embeddings).
    """
    cfg = model.config
    limit = max_len if max_len is not None else cfg.max_position_embeddings
    check_prompts(prompts, max_new_tokens, limit, cfg.vocab_size)
    device = model.model.embed_tokens.weight.device
    batch_size = batch_size or len(prompts)
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    generator = torch.Generator(device=device).manual_seed(seed)
    outputs: list[list[int]] = []
    stats = {"prefill_seconds": 0.0, "decode_seconds": 0.0, "forwards": 0, "batch_size": batch_size}
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        out, st = _generate_batch(model, chunk, max_new_tokens, temperature, top_p, generator, eos_id, max_len, device)
        outputs += out
        for k in ("prefill_seconds", "decode_seconds", "forwards"):
            stats[k] += st[k]
    new_tokens = sum(len(o) for o in outputs)
    seconds = stats["prefill_seconds"] + stats["decode_seconds"]
    stats.update(
        new_tokens=new_tokens,
        seconds=seconds,
        requests=len(prompts),
        tokens_per_s=new_tokens / seconds if seconds > 0 else 0.0,
        decode_tokens_per_s=new_tokens / stats["decode_seconds"] if stats["decode_seconds"] > 0 else 0.0,
    )
    return outputs, stats


def _generate_batch(model, prompts, max_new_tokens, temperature, top_p, generator, eos_id, max_len, device):
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    cache_len = max_len or int(lens.max()) + max_new_tokens
    tokens = torch.zeros(B, int(lens.max()), dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, dtype=torch.int64)
    out: list[list[int]] = [[] for _ in range(B)]
    if max_new_tokens == 0:
        return out, {"prefill_seconds": 0.0, "decode_seconds": 0.0, "forwards": 0}
    cache = model.new_cache(B, cache_len)
    clock = Clock(device)
    lens_d = lens.to(device)
    logits = model(tokens.to(device), cache, torch.zeros_like(lens_d), lens_d).logits
    last = logits[torch.arange(B, device=device), lens_d - 1]
    nxt = sample_next(last, temperature, top_p, generator)
    clock.tick("prefill")
    forwards = 1
    done = torch.zeros(B, dtype=torch.bool)
    pos = lens_d.clone()
    ones = torch.ones(B, dtype=torch.int64, device=device)
    for step in range(max_new_tokens):
        nxt_cpu = nxt.tolist()
        for b in range(B):
            if not done[b]:
                out[b].append(nxt_cpu[b])
                if eos_id is not None and nxt_cpu[b] == eos_id:
                    done[b] = True
        if step == max_new_tokens - 1 or bool(done.all()):
            break
        logits = model(nxt[:, None], cache, pos, ones).logits[:, 0]
        forwards += 1
        pos += 1
        nxt = sample_next(logits, temperature, top_p, generator)
    clock.tick("decode")
    return out, {
        "prefill_seconds": clock.seconds["prefill"],
        "decode_seconds": clock.seconds["decode"],
        "forwards": forwards,
    }


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt (no special tokens added); an empty prompt is an error."""
    ids = []
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        ids.append(tokenizer.encode(p, add_special_tokens=False).ids)
    return ids


def generate_text(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int | None = None,
    stop_at_eos: bool = True,
) -> tuple[list[str], dict]:
    """`generate` on text: returns the decoded continuation of each prompt
    (without a final <|endoftext|>) and the stats."""
    ids = encode_prompts(tokenizer, prompts)
    eos = special_token_ids(tokenizer)["eot"]
    out, stats = generate(
        model, ids, max_new_tokens, temperature, top_p, seed, eos_id=eos if stop_at_eos else None, batch_size=batch_size
    )
    texts = [tokenizer.decode([t for t in o if t != eos]) for o in out]
    return texts, stats
