"""DFlash drafter: a block-diffusion drafter conditioned on the target by KV injection.

Context features: the hidden states of `len(target_layer_ids)` target layers are
concatenated, projected by `fc` and RMS-normalized (`hidden_norm`), giving one
feature H_t per committed token. In every drafter layer H_t goes through that
layer's k_proj/v_proj, k_norm and RoPE (no input norm, no Q, no o_proj, no MLP)
and joins the keys and values of the block.

A block is `[anchor, MASK x (gamma - 1)]` at absolute positions
ctx_len ... ctx_len + gamma - 1; the anchor is the last committed token (its
target hidden state does not exist yet). The block attends to all of its
context and to itself with no mask, so one forward drafts the whole block:
block position k predicts the token at ctx_len + k.

Embedding and LM head belong to the target (shared, frozen, not saved here).
Parameter names: `fc`, `hidden_norm`, `layers.{i}.self_attn.q_proj` ..., `norm`.

Two forms of the same function:
  * `forward` (training, tests): context features of whole sequences and many
    blocks packed together under an explicit mask, plain PyTorch (SDPA);
  * `inject` + `draft_logits` (inference): context K/V in a static cache that
    only grows by committed tokens, via the `inject_context_kv` and
    `block_diffusion_attention` ops (`use_ops=True`) or a vectorized PyTorch
    equivalent (`use_ops=False`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from ..ops.sampling import PURPOSE_DRAFT, sample_logits
from . import tree as tree_ops
from .config import DecoderConfig, check_supported
from .decoder import Attention, DecoderForCausalLM, DecoderLayer, RMSNorm, apply_rope, init_gpt2_
from .drafter import DraftBlock
from .io import load_state_dict, save_weights

block_diffusion_attention = ops.block_diffusion_attention
inject_context_kv = ops.inject_context_kv


def target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """Feature layers spread from the 2nd to the 3rd-from-last layer:
    round(1 + i * (L - 4) / (n - 1)), clamped into range for tiny targets."""
    L, n = num_target_layers, num_features
    if n == 1:
        return [min(1, L - 1)]
    return [min(max(round(1 + i * (L - 4) / (n - 1)), 0), L - 1) for i in range(n)]


TARGET_ONLY_KEYS = ("tie_word_embeddings", "bos_token_id", "eos_token_id")
# z-lab's config.json is a Qwen3 config whose `architectures` names the drafter class; the
# drafter's own keys sit in a `dflash_config` dict, read before the top level (the reference's
# `_draft_value` does so), so both spellings load.
DRAFT_CONFIG_KEY = "dflash_config"
DFLASH_KEYS = ("block_size", "mask_token_id", "target_layer_ids")
# Optional keys, written only when they differ from the default the reference assumes.
DFLASH_OPTIONAL = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


@dataclass
class DFlashConfig(DecoderConfig):
    """A drafter's config: the Qwen3 layer shape it inherits (at the target's widths, with its
    own number of layers) plus the block size γ, the target layers it reads, and the mask token.
    Its layers are Qwen3 layers whatever the target's family (DRAFTER_SHARED_FIELDS says why).

    On disk it is z-lab's format (`to_json`, `from_file`): what their `dflash` package and the
    engines that load their checkpoints read."""

    num_hidden_layers: int = 2
    block_size: int = 8  # gamma
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    mask_token_id: int = 1
    num_target_layers: int | None = None  # the target's depth (the reference requires the key)
    input_embedding_scale: float = 1.0  # the block's token embeddings are scaled by it
    output_multiplier: float = 1.0  # draft logits are scaled by it ...
    final_logit_softcapping: float | None = None  # ... then soft-capped: c · tanh(logits / c)
    architectures: list[str] = field(default_factory=lambda: ["DFlashDraftModel"])
    model_type: str = "qwen3"
    KIND: ClassVar[str] = "DFlash"  # the method's name in messages

    def check_family(self) -> None:
        # The layers are layer_config()'s Qwen3 layers; `architectures` names the drafter.
        if self.attention_bias or self.mlp_bias:
            raise ValueError("a drafter's Qwen3 layers have no biases (attention_bias and mlp_bias must be false)")

    def __post_init__(self):
        super().__post_init__()
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        if self.final_logit_softcapping is not None and not self.final_logit_softcapping > 0:
            self.final_logit_softcapping = None  # the reference applies it only when positive

    @classmethod
    def for_target(
        cls,
        target: DecoderConfig,
        num_hidden_layers: int = 2,
        block_size: int = 8,
        mask_token_id: int = 1,
        num_features: int = 5,
        intermediate_size: int | None = None,
        **kw,
    ) -> "DFlashConfig":
        """A drafter with the target's widths (its MLP narrower when `intermediate_size` says)
        and feature layers."""
        shared = target.drafter_shared()
        if intermediate_size:
            shared["intermediate_size"] = intermediate_size
        kw.setdefault("num_target_layers", target.num_hidden_layers)
        return cls(
            **shared,
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            target_layer_ids=target_layer_ids(target.num_hidden_layers, num_features),
            **kw,
        )

    @property
    def architecture(self) -> str:
        """The class name config.json's `architectures` gives this drafter."""
        return type(self).__dataclass_fields__["architectures"].default_factory()[0]

    @property
    def first_draft_slot(self) -> int:
        """The block slot whose state gives the first draft: 1 in DFlash's layout (slot k
        predicts the token at anchor + k; the anchor's own slot drafts nothing)."""
        return 1

    @property
    def num_drafts(self) -> int:
        """Drafts per block: slots first_draft_slot .. γ - 1 (draft j predicts anchor + j)."""
        return self.block_size - self.first_draft_slot

    def layer_config(self) -> DecoderConfig:
        """The shape of the drafter's decoder layers: Qwen3 layers at the drafter's widths."""
        names = {f.name for f in dataclasses.fields(DecoderConfig)}
        d = {
            k: v for k, v in dataclasses.asdict(self).items() if k in names and k not in ("architectures", "model_type")
        }
        return DecoderConfig(**d, model_type="qwen3")

    def qwen3_json(self) -> dict:
        """The Qwen3 part of config.json: the layers' keys as Hugging Face's Qwen3Config spells them."""
        d = dataclasses.asdict(self.layer_config())
        for key in TARGET_ONLY_KEYS + ("mlp_bias",):
            d.pop(key, None)
        return d | {
            "model_type": "qwen3",
            "architectures": [self.architecture],
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
        }

    def draft_keys(self) -> dict:
        """The drafter's own keys (`dflash_config`)."""
        d = {k: getattr(self, k) for k in DFLASH_KEYS}
        d.update({k: getattr(self, k) for k, default in DFLASH_OPTIONAL.items() if getattr(self, k) != default})
        return d

    def to_json(self) -> dict:
        if self.num_target_layers is None:
            raise ValueError("num_target_layers is unset: z-lab's format records the target's depth")
        return self.qwen3_json() | {DRAFT_CONFIG_KEY: self.draft_keys()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @staticmethod
    def read_json(path: str | Path) -> tuple[Path, dict]:
        """(the config.json path, its keys) of a drafter directory or config file."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"drafter config {path} not found")
        try:
            return path, json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"drafter config {path} is not valid JSON: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path):
        """Config of this class from a config.json in z-lab's format (subclasses inherit this):
        its `architectures` must name this drafter class."""
        path, d = cls.read_json(path)
        want = cls.__dataclass_fields__["architectures"].default_factory()[0]
        if want not in (d.get("architectures") or []):
            raise ValueError(
                f"{path} is not a {cls.KIND} drafter config (architectures {d.get('architectures')!r}, model_type "
                f"{d.get('model_type')!r}; in its authors' format a {cls.KIND} drafter's names {want!r})"
            )
        return cls.from_json(d, path)

    @classmethod
    def from_json(cls, d: dict, path) -> "DFlashConfig":
        """The config of a drafter's config.json keys: `dflash_config` over the top level, the
        reference's defaults for absent keys, and a clear error for every feature flashspark's
        drafter layers lack (module docstring of flashspark.models.dflash)."""
        d = {**d, **(d.get(DRAFT_CONFIG_KEY) or {})}
        try:
            check_supported(d)
            if d.get("is_causal"):
                raise ValueError(
                    "is_causal=true (causal block attention) is not supported: flashspark's block attention is "
                    "bidirectional within the block, as the reference's full_attention layers are"
                )
            if d.get("attention_bias"):
                raise ValueError("attention_bias=true is not supported (the drafter's Qwen3 layers have none)")
            if d.get("mask_token_id") is None:
                raise ValueError("mask_token_id is missing")
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if d.get("head_dim") is None:
            d["head_dim"] = 128  # Hugging Face's Qwen3 default
        if d.get("rope_theta") is None and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
        if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
            d["num_key_value_heads"] = d["num_attention_heads"]
        if d.get("torch_dtype") is None and d.get("dtype") is not None:
            d["torch_dtype"] = d["dtype"]
        d.setdefault("block_size", 16)  # the reference's default
        if d.get("target_layer_ids") is None:
            if d.get("num_target_layers") is None:
                raise ValueError(f"{path}: neither target_layer_ids nor num_target_layers is given")
            d["target_layer_ids"] = reference_layer_ids(d["num_target_layers"], d.get("num_hidden_layers", 1))
        names = {f.name for f in dataclasses.fields(cls)} - {"architectures", "model_type", "tie_word_embeddings"}
        try:
            return cls(**{k: v for k, v in d.items() if k in names and v is not None})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None


def reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's feature layers when config.json names none: one per drafter layer,
    spread from the 2nd to the 3rd-from-last target layer (the middle one for one layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return target_layer_ids(num_target_layers, num_draft_layers)


class DFlashCache(NamedTuple):
    """Context K/V of every drafter layer: [num_layers, batch, Hkv, max_len, head_dim],
    the layout of the target's KVCache (one layer is a [B, Hkv, S_max, D] slice)."""

    k: torch.Tensor
    v: torch.Tensor


class DFlashAttention(Attention):
    """Qwen3 attention weights; queries from the block only, keys/values from
    the injected context and the block."""

    def project_block(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, Q, Hq, D], k, v [B, Q, Hkv, D] of normalized block states x [B, Q, hidden]."""
        B, Q, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, Q, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, Q, self.num_kv_heads, self.head_dim)), cos, sin)
        return q, k, self.v_proj(x).view(B, Q, self.num_kv_heads, self.head_dim)

    def project_context(self, h: torch.Tensor):
        """k, v [..., Hkv, D] of context features h [..., hidden], before k_norm and RoPE."""
        shape = h.shape[:-1] + (self.num_kv_heads, self.head_dim)
        return self.k_proj(h).view(shape), self.v_proj(h).view(shape)


class DFlashDecoderLayer(DecoderLayer):
    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg)
        self.self_attn = DFlashAttention(cfg)


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, target: DecoderForCausalLM | None = None, use_ops: bool = True):
        super().__init__()
        self.config = config
        D, n = config.hidden_size, len(config.target_layer_ids)
        qcfg = config.layer_config()
        self.fc = nn.Linear(n * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(qcfg) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.use_ops = use_ops
        self.register_buffer(
            "cos_sin",
            reference.rope_cos_sin_cache(
                config.max_position_embeddings + 2 * config.block_size, config.head_dim, config.rope_theta
            ),
            persistent=False,
        )
        self._rope = None  # cos, sin tables expanded for apply_rope, built on first use
        self._shared: dict[str, torch.Tensor] = {}  # the target's embedding / LM head (attach); never saved
        # Inference may run the LM head in another dtype (`head_dtype`); its weight copy is cached here.
        self.head_dtype: torch.dtype | None = None
        self._head_copy: tuple | None = None
        if target is not None:
            self.attach(target)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def num_drafts(self) -> int:
        """Drafts per block (`DFlashConfig.num_drafts`): γ - 1, or γ in DeepSpec's layout."""
        return self.config.num_drafts

    def attach(self, target: DecoderForCausalLM) -> "DFlashDrafter":
        """Share the target's (frozen) embedding and LM head."""
        c, t = self.config, target.config
        if (t.hidden_size, t.vocab_size) != (c.hidden_size, c.vocab_size) or max(
            c.target_layer_ids
        ) >= t.num_hidden_layers:
            raise ValueError(
                f"drafter (hidden {c.hidden_size}, vocab {c.vocab_size}, layers {c.target_layer_ids}) "
                f"does not fit the target (hidden {t.hidden_size}, vocab {t.vocab_size}, "
                f"{t.num_hidden_layers} layers)"
            )
        self._shared = {"embed": target.model.embed_tokens.weight, "head": target.lm_head.weight}
        return self

    @property
    def embed_weight(self) -> torch.Tensor:
        return self._shared["embed"]

    @property
    def head_weight(self) -> torch.Tensor:
        return self._shared["head"]

    def init_weights(self, seed: int = 0) -> None:
        """Same scheme as the target's."""
        init_gpt2_(self, self.config.num_hidden_layers, seed)

    # ------------------------------------------------------------------ pieces
    def context_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """H_t [..., D] from the target's hidden states [..., n_feat, D]."""
        return self.hidden_norm(self.fc(target_hidden.flatten(-2).to(self.fc.weight.dtype)))

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [*positions.shape, 1, D] for rotate-half RoPE (the values of `cos_sin`)."""
        if self._rope is None or self._rope[0].dtype != dtype or self._rope[0].device != positions.device:
            half = self.config.head_dim // 2
            cos, sin = self.cos_sin[:, :half], self.cos_sin[:, half:]
            self._rope = (
                torch.cat((cos, cos), -1).to(dtype).unsqueeze(-2),
                torch.cat((sin, sin), -1).to(dtype).unsqueeze(-2),
            )
        return self._rope[0][positions], self._rope[1][positions]

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The block's input: the target's embeddings of `tokens`, times `input_embedding_scale`."""
        x = F.embedding(tokens, self.embed_weight).to(dtype)
        scale = self.config.input_embedding_scale
        return x if scale == 1.0 else x * scale

    def _block_embeddings(self, anchor: torch.Tensor, block_size: int) -> torch.Tensor:
        tokens = torch.full(
            (anchor.shape[0], block_size), self.config.mask_token_id, dtype=torch.long, device=anchor.device
        )
        tokens[:, 0] = anchor
        return self.embed(tokens, self.fc.weight.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V] fp32 of final-normed block states: the shared LM head, then
        `output_multiplier` and `final_logit_softcapping` where the config sets them."""
        out = self.head_logits(hidden)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping is not None:
            out = torch.tanh(out / c.final_logit_softcapping) * c.final_logit_softcapping
        return out

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Shared LM head on final-normed block states, fp32 logits.

        With `head_dtype` set (and no gradient wanted) the head runs in that dtype: on a CPU
        with bf16 dot-product units a bf16 head reads half the bytes and runs about twice as
        fast, and the head is the drafter's largest matmul. Drafts only steer speculation;
        the target's verify keeps the output exact whatever the drafter computes in."""
        w = self.head_weight
        if self.head_dtype is None or self.head_dtype == hidden.dtype or torch.is_grad_enabled():
            return F.linear(hidden, w.to(hidden.dtype)).float()
        key = (w.data_ptr(), w._version, self.head_dtype)
        if self._head_copy is None or self._head_copy[0] != key:
            self._head_copy = (key, w.detach().to(self.head_dtype))
        # As a 2-D product: oneDNN's 3-D bf16 path with a batch of 1 copies the whole weight
        # every call (0.7 ms vs 0.1 ms for [1, 7, 256] x [256, 4096] on a 2-core CPU).
        flat = hidden.reshape(-1, hidden.shape[-1]).to(self.head_dtype)
        return F.linear(flat, self._head_copy[1]).float().view(*hidden.shape[:-1], -1)

    # ------------------------------------------------------------ training form
    def forward(
        self, target_hidden: torch.Tensor, block_tokens: torch.Tensor, block_positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Plain PyTorch form: final-normed block states [B, Q, D].

        target_hidden [B, S, n_feat, D]: target features of context positions 0..S-1;
        block_tokens, block_positions [B, Q]: the packed blocks' tokens and absolute
        positions; mask [B, Q, S + Q] bool, True = query attends to (context, then block) key.
        """
        B, S = target_hidden.shape[:2]
        ctx = self.context_features(target_hidden)
        ctx_cos, ctx_sin = self._cos_sin(torch.arange(S, device=ctx.device)[None].expand(B, S), ctx.dtype)
        x = self.embed(block_tokens, ctx.dtype)
        cos, sin = self._cos_sin(block_positions, x.dtype)
        attn_mask = mask[:, None]
        for layer in self.layers:
            attn = layer.self_attn

            def attend(h, attn=attn):
                q, kb, vb = attn.project_block(h, cos, sin)
                kc, vc = attn.project_context(ctx)
                kc = apply_rope(attn.k_norm(kc), ctx_cos, ctx_sin)
                k = torch.cat((kc, kb), 1).transpose(1, 2)
                v = torch.cat((vc, vb), 1).transpose(1, 2)
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k, v, attn_mask=attn_mask, enable_gqa=attn.num_heads != attn.num_kv_heads
                )
                return out.transpose(1, 2).flatten(2)

            x = self.layer_forward(layer, x, attend, self.config.block_size)
        return self.norm(x)

    def layer_forward(self, layer: DFlashDecoderLayer, x: torch.Tensor, attend, block_size: int) -> torch.Tensor:
        """One drafter layer on block rows x [..., rows, D] (whole blocks of `block_size` rows):
        `attend(h)` is the attention of normalized rows h before o_proj (the two forms differ
        only there). DFlash 2 overrides it to wrap both sublayers in its convs."""
        x = x + layer.self_attn.o_proj(attend(layer.input_layernorm(x)))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    # ----------------------------------------------------------- inference form
    def new_cache(self, batch_size: int, max_len: int, dtype=None, device=None) -> DFlashCache:
        c = self.config
        dtype = dtype or self.fc.weight.dtype
        device = device or self.fc.weight.device
        shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim)
        return DFlashCache(
            torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
        )

    def inject(
        self, cache: DFlashCache, target_hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write the context K/V of N committed tokens into every layer's cache.

        target_hidden [N, n_feat, D]; positions [N] absolute positions (= cache
        index); slots [N] batch rows.
        """
        h = self.context_features(target_hidden)
        positions = positions.to(torch.int64)
        slots = slots.to(torch.int32)
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k, v = attn.project_context(h)
            if self.use_ops:
                inject_context_kv(
                    k, v, positions, slots, attn.k_norm.weight.float(), self.cos_sin, eps, cache.k[i], cache.v[i]
                )
            else:
                cos, sin = self._cos_sin(positions, k.dtype)
                k = apply_rope(attn.k_norm(k), cos, sin)
                cache.k[i][slots.long(), :, positions] = k.to(cache.k.dtype)
                cache.v[i][slots.long(), :, positions] = v.to(cache.v.dtype)

    def draft_hidden(
        self, cache: DFlashCache, anchor: torch.Tensor, ctx_lens: torch.Tensor, block_size: int | None = None
    ) -> torch.Tensor:
        """Final-normed states [B, g, D] of the blocks [anchor, MASK...] at positions ctx_lens + j,
        g = `block_size` (default γ; shorter near the end of a request, as the reference drafts)."""
        g = block_size or self.config.block_size
        x = self._block_embeddings(anchor, g)
        cos, sin = self._cos_sin(ctx_lens.to(torch.int64)[:, None] + torch.arange(g, device=x.device), x.dtype)
        ctx_lens32 = ctx_lens.to(torch.int32)
        attention = block_diffusion_attention if self.use_ops else block_attention_sdpa
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn

            def attend(h, attn=attn, i=i):
                q, kb, vb = attn.project_block(h, cos, sin)
                return attention(q, cache.k[i], cache.v[i], ctx_lens32, kb, vb, attn.head_dim**-0.5).flatten(2)

            x = self.layer_forward(layer, x, attend, g)
        return self.norm(x)

    def draft_states(
        self, cache: DFlashCache, anchor: torch.Tensor, ctx_lens: torch.Tensor, num_drafts: int | None = None
    ) -> torch.Tensor:
        """Final-normed states [B, n, D] of the slots that draft, n = `num_drafts` (default
        all of the block's): draft j (1-based) predicts the token at ctx_len + j."""
        first = self.config.first_draft_slot
        n = num_drafts or self.num_drafts
        return self.draft_hidden(cache, anchor, ctx_lens, first + n)[:, first:]

    def draft_logits(
        self, cache: DFlashCache, anchor: torch.Tensor, ctx_lens: torch.Tensor, num_drafts: int | None = None
    ) -> torch.Tensor:
        """[B, n, V] float32 logits of the drafting slots."""
        return self.logits(self.draft_states(cache, anchor, ctx_lens, num_drafts))

    def propose(
        self,
        cache,
        anchor,
        ctx_lens,
        temperature,
        seeds,
        offsets,
        path="auto",
        signals=True,
        num_drafts=None,
        tree=0,
        search="best-first",
    ) -> DraftBlock:
        """Draft n = `num_drafts` (default all) tokens per request after `anchor`, drawing at
        Philox positions offsets + 0, 1, ....

        DFlash: one parallel pass, each position sampled from its own logits (q dense). Any
        DFlash-shaped drafter runs it (a DFlash 2 drafter: its backbone with DFlash's head).
        `path` and `signals` are DFlash 2's; other drafters ignore them. A block of fewer
        drafts is shorter (fewer mask slots), as the reference drafts near max_new_tokens.
        `tree` = N >= 2: a token tree of N nodes instead (`propose_tree`, by `search`).
        """
        if tree:
            return self.propose_tree(cache, anchor, ctx_lens, temperature, tree, signals, num_drafts, search)
        logits = self.draft_logits(cache, anchor, ctx_lens, num_drafts)
        positions = offsets[:, None] + torch.arange(logits.shape[1], device=anchor.device)
        tokens, q = sample_logits(logits, temperature, seeds, positions, PURPOSE_DRAFT, want_probs=True)
        return DraftBlock(tokens, q, logits=logits)

    def propose_tree(
        self, cache, anchor, ctx_lens, temperature, num_nodes, signals=False, num_drafts=None, search="best-first"
    ):
        """DFlash's token tree: best-first expansion of its block lattice by the product of the
        per-position probabilities (`models.tree`), over each position's Top-K (K = min(N - 1,
        16): topk_select's bound). The positions are drafted in parallel, so a node's row is its position's
        whatever its parent. Probabilities are at the request's temperature (T = 0: at 1).
        Nothing is sampled: a tree is verified target-only (`tree_verify`), which is lossless
        for any tree the drafter builds."""
        logits = self.draft_logits(cache, anchor, ctx_lens, num_drafts)
        scale = torch.where(temperature > 0, temperature, 1.0).float()[:, None, None]
        topk = ops.topk_select if self.use_ops else reference.topk_select_reference
        values, ids, lse = topk(logits / scale, min(num_nodes - 1, ops.MAX_TOP_K))
        logp = values - lse[..., None]  # [B, P, K]
        tokens, tree, _ = tree_ops.best_first_tree(
            ids,
            lambda d, parents: logp[:, d - 1, None].expand(-1, parents.shape[1], -1),
            anchor,
            num_nodes,
            search=search,
        )
        return DraftBlock(tokens, tree=tree)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # Checkpoint names: the module names are the reference's; a subclass maps the few it stores
    # otherwise (DFlash 2's codebooks).
    def saved_name(self, name: str) -> str:
        return name

    def loaded_name(self, name: str) -> str:
        return name


def block_attention_sdpa(q, k_cache, v_cache, ctx_lens, k_block, v_block, scale):
    """`block_diffusion_attention` in plain PyTorch (SDPA with a context-length
    mask over the longest context of the batch); same arguments and result."""
    B, G, Hq, D = q.shape
    n = max(1, int(ctx_lens.max()))
    k = torch.cat((k_cache[:, :, :n], k_block.transpose(1, 2)), 2)
    v = torch.cat((v_cache[:, :, :n], v_block.transpose(1, 2)), 2)
    keep = torch.arange(n + G, device=q.device)[None] < ctx_lens.to(torch.int64)[:, None]
    keep[:, n:] = True
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.to(q.dtype),
        v.to(q.dtype),
        attn_mask=keep[:, None, None],
        scale=scale,
        enable_gqa=Hq != k_block.shape[2],
    )
    return out.transpose(1, 2)


def block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Training mask [B, nb * gamma, S + nb * gamma] for blocks packed in a
    sequence: block j's queries see context positions < anchors[:, j] and their
    own block, nothing else."""
    B, nb = anchors.shape
    Q = nb * block_size
    block_of = torch.arange(Q, device=anchors.device) // block_size
    ctx = (
        torch.arange(context_len, device=anchors.device)[None, None]
        < anchors.repeat_interleave(block_size, 1)[..., None]
    )
    own = (block_of[:, None] == block_of[None, :])[None].expand(B, Q, Q)
    return torch.cat((ctx, own), -1)


def packed_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block tokens and positions [B, nb * gamma] for anchors [B, nb]: [tokens[a], MASK...] at a .. a + gamma - 1."""
    B, nb = anchors.shape
    positions = (anchors[..., None] + torch.arange(block_size, device=anchors.device)).reshape(B, -1)
    block_tokens = torch.full_like(positions, mask_token_id)
    block_tokens[:, ::block_size] = tokens.gather(1, anchors)
    return block_tokens, positions


# ---------------------------------------------------------------------- I/O
def save_dflash(
    drafter: DFlashDrafter,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 0,
    share_with: str | Path | None = None,
) -> None:
    """config.json + model.safetensors in z-lab's format: every tensor of the drafter (not the
    target's embedding and head), named as their `dflash` package names them, so the directory
    loads in their code and in the engines that load their checkpoints. With `max_shard_bytes`,
    shards of at most that size and their index; with `share_with`, the tensors equal to that
    checkpoint's are read from its files (`io.save_weights`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().to("cpu", dtype).contiguous() for n, p in drafter.state_dict().items()}
    state = {drafter.saved_name(n): t for n, t in state.items()}
    dataclasses.replace(drafter.config, torch_dtype=str(dtype).removeprefix("torch.")).save(path / "config.json")
    save_weights(state, path, max_shard_bytes, share_with)


def load_drafter(
    path: str | Path, target: DecoderForCausalLM, drafter_cls, config_cls, dtype=None, use_ops: bool = True
):
    """A drafter of class `drafter_cls` (DFlash or a subclass) from a directory in its authors'
    format (one model.safetensors, or shards listed in model.safetensors.index.json), attached
    to `target` (dtype and device follow the target by default)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter directory {path} not found")
    config = config_cls.from_file(path)
    drafter = drafter_cls(config, use_ops=use_ops)
    try:
        state = load_state_dict(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"drafter weights (*.safetensors) not found in {path}") from None
    state = {drafter.loaded_name(n): t for n, t in state.items()}
    take_target_tensors(state, target, path)
    want = drafter.state_dict()
    missing = sorted(set(want) - set(state))
    if missing:
        raise ValueError(f"drafter checkpoint {path} is missing tensors: {', '.join(missing[:5])}")
    unexpected = sorted(set(state) - set(want))
    if unexpected:
        raise ValueError(
            f"drafter checkpoint {path} has tensors a {config.architecture} of this config lacks: "
            f"{', '.join(unexpected[:5])}"
        )
    for n, t in want.items():
        if tuple(state[n].shape) != tuple(t.shape):
            raise ValueError(f"tensor {n} has shape {tuple(state[n].shape)} but config.json implies {tuple(t.shape)}")
    drafter.load_state_dict({n: state[n].float() for n in want})
    p = target.model.embed_tokens.weight
    drafter.to(device=p.device, dtype=dtype or p.dtype)
    drafter.cos_sin = drafter.cos_sin.float()  # the RoPE table stays fp32
    return drafter.attach(target).eval()


# Tensors a drafter checkpoint may carry as copies of its target's (DeepSpec stores both): the
# drafter always uses the target's own, as engines do.
TARGET_TENSORS = {"embed_tokens.weight": "embed", "lm_head.weight": "head"}


def take_target_tensors(state: dict[str, torch.Tensor], target: DecoderForCausalLM, path) -> None:
    """Drop the target's tensors from a checkpoint's `state`, after checking their shapes fit the
    target (a drafter built for another vocabulary or width must not load)."""
    shapes = {"embed": target.model.embed_tokens.weight.shape, "head": target.lm_head.weight.shape}
    for name, which in TARGET_TENSORS.items():
        t = state.pop(name, None)
        if t is not None and tuple(t.shape) != tuple(shapes[which]):
            raise ValueError(
                f"drafter checkpoint {path}: {name} has shape {tuple(t.shape)}, the target's is "
                f"{tuple(shapes[which])}: it was built for another target"
            )


def load_dflash(
    path: str | Path, target: DecoderForCausalLM, dtype: torch.dtype | None = None, use_ops: bool = True
) -> DFlashDrafter:
    """DFlash drafter from a directory, attached to `target`."""
    return load_drafter(path, target, DFlashDrafter, DFlashConfig, dtype, use_ops)
