"""The target: a Llama-family decoder (Qwen3, Llama, Qwen2) with a static, preallocated KV cache.

The config's `model_type` picks the family's layer shape (q/k-norm, biases; `models.config`).
Parameter names follow Hugging Face's `Qwen3ForCausalLM` / `LlamaForCausalLM` /
`Qwen2ForCausalLM`, so their checkpoints load unchanged (see `models.io`), and so do
GGUF files of these architectures (`models.gguf`).

One `forward` covers every use in speculative decoding:

* batched prefill with ragged prompt lengths (right-padded, `num_new`),
* batched decode (S = 1),
* the ragged verification forward (each request its own number of new
  tokens at its own position),
* the tree verification forward (`tree`: each request's new tokens are the
  nodes of a token tree).

Token s of request b sits at absolute position `cache_lens[b] + s`. Its K/V
are written there; it attends to cache positions `< cache_lens[b]` and to the
valid new tokens at or before it. The cache keeps no notion of validity:
rolling back means passing smaller `cache_lens` next time.

With a `TreeInputs`, new token s is node s of a tree (node 0 its root): it is
written at cache slot `cache_lens[b] + s` as before, but its rotary position is
`cache_lens[b] + depth` and it attends to the committed prefix and to its own
ancestors only. A chain given as a tree is the ragged forward, bit for bit.
After verification the accepted path's rows move to the slots of their depths
(`compact_path`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..reference import rms_norm
from .config import DecoderConfig


class ModelOutput(NamedTuple):
    logits: torch.Tensor  # [B, S, V] float32
    hidden: torch.Tensor | None  # [B, S, len(hidden_layers), D] (decoder layer outputs)
    last_hidden: torch.Tensor  # [B, S, D] after the final norm (input of lm_head)


@dataclass
class KVCache:
    """Static K/V storage: [num_layers, batch, num_kv_heads, max_len, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like HF's Qwen3 and Llama, then scale in the input dtype.
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [B, 1, S, head_dim] for integer positions [B, S]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:  # Llama and Qwen2: identities keep one forward for every family
            self.q_norm = nn.Identity()
            self.k_norm = nn.Identity()

    def forward(self, x, cos, sin, k_cache=None, v_cache=None, plan=None):
        B, S, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x).view(B, S, H, D)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, S, Hkv, D)).transpose(1, 2)
        v = self.v_proj(x).view(B, S, Hkv, D).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        if k_cache is None:
            # Full causal forward from position 0 (training, scoring).
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != Hkv)
        else:
            # Write the valid new K/V at their absolute positions.
            k_rows = k.transpose(1, 2).reshape(B * S, Hkv, D)
            v_rows = v.transpose(1, 2).reshape(B * S, Hkv, D)
            if plan.rows is not None:
                k_rows, v_rows = k_rows[plan.rows], v_rows[plan.rows]
            k_cache[plan.b_idx, :, plan.pos_idx] = k_rows
            v_cache[plan.b_idx, :, plan.pos_idx] = v_rows
            kk = k_cache[:, :, : plan.kv_len]
            vv = v_cache[:, :, : plan.kv_len]
            # GQA without copying K/V: the G query heads of one KV head are
            # stacked along the query axis, and the mask repeats G times.
            G = H // Hkv
            qg = q.reshape(B, Hkv, G * S, D)
            out = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=plan.mask)
            out = out.view(B, H, S, D)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H * D))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache=None, v_cache=None, plan=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class TreeInputs(NamedTuple):
    """The tree of a tree forward's S new tokens per request."""

    depths: torch.Tensor  # [B, S] int64: node depth (root 0): the rotary position past cache_lens
    ancestors: torch.Tensor  # [B, S, S] bool: node s attends to node j (j an ancestor of s, or s)


class _CachePlan(NamedTuple):
    """Per-forward indexing shared by all layers."""

    rows: torch.Tensor | None  # flat [B*S] indices of tokens to write (None = all)
    b_idx: torch.Tensor  # request of each written token
    pos_idx: torch.Tensor  # cache position of each written token
    kv_len: int  # cache prefix read by attention
    mask: torch.Tensor  # [B, 1, G*S, kv_len] bool, True = attend


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _plan(
    cache: KVCache, cache_lens: torch.Tensor, num_new: torch.Tensor, S: int, groups: int, tree: TreeInputs | None = None
) -> tuple[_CachePlan, torch.Tensor]:
    """Where the new tokens go, what each may attend to, and their rotary positions."""
    B, L = cache.batch_size, cache.max_len
    device = cache.k.device
    cache_lens = cache_lens.to(device=device, dtype=torch.int64)
    num_new = num_new.to(device=device, dtype=torch.int64)
    s = torch.arange(S, device=device)
    positions = cache_lens[:, None] + s[None, :]  # [B, S]
    valid = s[None, :] < num_new[:, None]  # [B, S]
    ends = (cache_lens + num_new).tolist()
    if max(ends) > L:
        raise ValueError(f"sequence of {max(ends)} tokens does not fit the KV cache of {L} positions")
    if min(cache_lens.tolist()) < 0:
        raise ValueError("cache_lens must be non-negative")
    kv_len = max(1, max(ends))
    if bool(valid.all()):
        rows = None
        b_idx = torch.arange(B, device=device).repeat_interleave(S)
        pos_idx = positions.reshape(-1)
    else:
        # Padded tokens are never written: they cannot touch other requests
        # nor run past the end of the cache.
        rows = valid.reshape(-1).nonzero().squeeze(1)
        b_idx = rows // S
        pos_idx = positions.reshape(-1)[rows]
    j = torch.arange(kv_len, device=device)
    if tree is None:
        # Causal over absolute positions. A padded query may see stale slots;
        # its output is ignored, and position 0 keeps its row from being empty.
        mask = j[None, None, :] <= positions[:, :, None]  # [B, S, kv_len]
    else:
        # The committed prefix, then the node's ancestors among the new slots (a chain's
        # ancestors are the slots before it: the causal mask above).
        rel = j[None, :] - cache_lens[:, None]  # [B, kv_len]: slot past the prefix
        in_tree = (rel >= 0) & (rel < S)
        anc = tree.ancestors.to(device).gather(2, rel.clamp(0, S - 1)[:, None, :].expand(B, S, kv_len))
        mask = (rel < 0)[:, None, :] | (anc & in_tree[:, None, :])
        positions = cache_lens[:, None] + tree.depths.to(device=device, dtype=torch.int64)
    mask = mask[:, None, None].expand(B, 1, groups, S, kv_len).reshape(B, 1, groups * S, kv_len)
    return _CachePlan(rows, b_idx, pos_idx, kv_len, mask), positions.clamp(max=L - 1)


def compact_path(cache: KVCache, cache_lens: torch.Tensor, path: torch.Tensor) -> None:
    """Move each request's accepted tree path to the slots of its depths: the row of node
    path[b, d] (slot cache_lens[b] + path[b, d]) goes to slot cache_lens[b] + d, in every layer,
    with one gather and one scatter per K and V; nothing else moves. path [B, D + 1] local node
    ids, root first, -1 past the accepted ones (those slots are left alone). Nodes lie at or
    after their depth's slot (a parent precedes its child), so no row is read after it was
    overwritten: the gather copies first."""
    B, W = path.shape
    device = cache.k.device
    lens = cache_lens.to(device=device, dtype=torch.int64)[:, None]
    dst = lens + torch.arange(W, device=device)
    src = torch.where(path >= 0, lens + path.to(device=device, dtype=torch.int64), dst)
    b = torch.arange(B, device=device)[:, None].expand(B, W)
    for t in (cache.k, cache.v):  # [L, B, H, T, D]: advanced indices (b, slot) -> [B, W, L, H, D]
        t[:, b, :, dst] = t[:, b, :, src]


def init_gpt2_(module: nn.Module, num_layers: int, seed: int = 0) -> None:
    """GPT-2 style init: N(0, 0.02), norms 1, residual projections scaled down by
    sqrt(2 * layers) so the residual stream starts near unit scale."""
    g = torch.Generator().manual_seed(seed)
    std = 0.02
    resid_std = std / math.sqrt(2 * max(1, num_layers))
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.copy_(torch.randn(p.shape, generator=g) * resid_std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ------------------------------------------------------------------ setup
    def init_weights(self, seed: int = 0) -> None:
        init_gpt2_(self, self.config.num_hidden_layers, seed)

    def new_cache(self, batch_size: int, max_len: int, dtype=None, device=None) -> KVCache:
        """Zeroed static cache for `batch_size` requests of up to `max_len` tokens."""
        if batch_size <= 0 or max_len <= 0:
            raise ValueError(f"cache needs positive batch_size and max_len, got {batch_size}, {max_len}")
        p = self.model.embed_tokens.weight
        dtype = dtype or p.dtype
        device = device or p.device
        c = self.config
        shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim)
        return KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        cache_lens: torch.Tensor | None = None,
        num_new: torch.Tensor | None = None,
        hidden_layers: list[int] | None = None,
        tree: TreeInputs | None = None,
    ) -> ModelOutput:
        """See the module docstring. With `cache=None` this is a plain causal
        forward from position 0 (training and scoring)."""
        last, hidden = self.backbone(tokens, cache, cache_lens, num_new, hidden_layers, tree)
        return ModelOutput(self.lm_head(last).float(), hidden, last)

    def backbone(self, tokens, cache=None, cache_lens=None, num_new=None, hidden_layers=None, tree=None):
        """Decoder stack without the LM head: (last_hidden, hidden or None)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        B, S = tokens.shape
        if S == 0:
            raise ValueError("tokens is empty (sequence length 0)")
        c = self.config
        n_layers = c.num_hidden_layers
        want = []
        if hidden_layers is not None:
            want = [int(i) for i in hidden_layers]
            bad = [i for i in want if not 0 <= i < n_layers]
            if bad:
                raise ValueError(f"hidden_layers {bad} out of range for {n_layers} layers")
        x = self.model.embed_tokens(tokens)
        if cache is None:
            if tree is not None:
                raise ValueError("a tree forward needs a KV cache")
            positions = torch.arange(S, device=tokens.device)[None].expand(B, S)
            plan = None
        else:
            if cache.batch_size != B:
                raise ValueError(f"cache holds {cache.batch_size} requests but tokens has {B}")
            if cache_lens is None:
                cache_lens = torch.zeros(B, dtype=torch.int64)
            if num_new is None:
                num_new = torch.full((B,), S, dtype=torch.int64)
            if int(num_new.max()) > S or int(num_new.min()) < 0:
                raise ValueError(f"num_new must lie in [0, {S}]")
            if tree is not None and (tree.depths.shape != (B, S) or tree.ancestors.shape != (B, S, S)):
                raise ValueError(f"tree depths / ancestors must be [{B}, {S}] / [{B}, {S}, {S}]")
            groups = c.num_attention_heads // c.num_key_value_heads
            plan, positions = _plan(cache, cache_lens, num_new, S, groups, tree)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        collected = {}
        for i, layer in enumerate(self.model.layers):
            if cache is None:
                x = layer(x, cos, sin)
            else:
                x = layer(x, cos, sin, cache.k[i], cache.v[i], plan)
            if i in want:
                collected[i] = x
        hidden = torch.stack([collected[i] for i in want], dim=2) if hidden_layers is not None else None
        return self.model.norm(x), hidden

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        seen, n = set(), 0
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if exclude_embeddings and "embed_tokens" in name:
                continue
            n += p.numel()
        return n
