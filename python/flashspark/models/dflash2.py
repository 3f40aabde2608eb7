"""DFlash 2 drafter: the DFlash backbone with two-tap dynamic convs, plus a path selector.

Two patches on DFlash (docs/dflash2_dspark.md, "DFlash 2 drafter"):

* **Two-tap dynamic depthwise convs** around every attention and MLP sublayer.
  The "prepare" conv runs after the sublayer's norm, the "finish" conv on the
  sublayer's output before the residual add. Each computes
  ``out[t, c] = (base[0, c] + δ[t, 0, c // 16]) · x[t, c] + (base[1, c] + δ[t, 1, c // 16]) · x[t - 1, c]``
  with ``x[t - 1] = 0`` at the first row of a block and ``δ = Linear(H → 2·H/16)(x)``.
  Identity at init, so a fresh DFlash 2 backbone computes exactly DFlash (and
  can start from trained DFlash weights). The convs only see block rows: the
  injected context features skip the input norm and the sublayers, so KV
  injection and the drafter cache are DFlash's, unchanged.

  The convs live *inside* the modules the DFlash layer loop already calls
  (`input_layernorm`, `post_attention_layernorm`, `self_attn.o_proj`, `mlp`),
  so both DFlash forms (`forward` for training, `inject` + `draft_hidden` for
  inference) run unmodified and stay equal to each other.

* **Path selector** over the Top-K lattice of the block: unary U_t = Top-K
  log-probs of the backbone logits, ``S_t(a, b) = U_t(b) + <A[a] ⊙ g_t, B[b]>``
  with ``g_t = W_h h_t``; the anchor is the predecessor at t = 0. Paths come
  from `ops.path_select` (backtrack | greedy | sample).

Inference uses the ops (`two_tap_conv`, `topk_select`, `path_select`) when
`use_ops` is set and no gradient is needed; otherwise the differentiable
references in `flashspark.reference`, which compute the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from .decoder import MLP, DecoderForCausalLM, RMSNorm
from .dflash import DFlashCache, DFlashConfig, DFlashDrafter, load_drafter, save_dflash
from .drafter import DraftBlock

PATH_MODES = ("auto", "backtrack", "greedy", "sample")  # auto: backtrack at temperature 0, else sample
CONV_GROUP = reference.CONV_GROUP  # channels sharing one dynamic tap (fixed by the op)
# The ops' overloads, called without the wrappers' Python frames on the drafting path.
_two_tap_conv = torch.ops.flashspark.two_tap_conv.default
_topk_select = torch.ops.flashspark.topk_select.default
_path_select = torch.ops.flashspark.path_select.default


@dataclass
class DFlash2Config(DFlashConfig):
    selector_rank: int = 64  # r of the A/B factors (256 at full scale)
    selector_topk: int = 16  # K candidates per block position (<= 16, the op's bound)
    architectures: list[str] = field(default_factory=lambda: ["DFlash2DraftModel"])
    model_type: str = "dflash2"

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.selector_topk <= 16:
            raise ValueError(f"selector_topk must lie in [1, 16], got {self.selector_topk}")


# ---------------------------------------------------------------------- two-tap conv
class TwoTapConv(nn.Module):
    """Two-tap dynamic depthwise conv over blocks of `block_size` consecutive rows."""

    def __init__(self, channels: int, block_size: int):
        super().__init__()
        self.groups = (channels + CONV_GROUP - 1) // CONV_GROUP
        self.block_size = block_size
        self.base = nn.Parameter(torch.zeros(2, channels))
        self.proj = nn.Linear(channels, 2 * self.groups, bias=False)
        self.use_ops = False
        self.reset_identity()

    def reset_identity(self) -> None:
        """base[0] = 1, base[1] = 0, δ = 0: the conv returns its input."""
        with torch.no_grad():
            self.base.zero_()
            self.base[0] = 1.0
            self.proj.weight.zero_()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: RMSNorm | None = None
    ) -> torch.Tensor:
        """x [..., T, C] with T a multiple of block_size; optional residual added, and optional
        RMSNorm applied to x first (both fused in the op)."""
        # The op has no autograd: use it only when nothing needs a gradient. It computes δ from
        # the projection weight itself and normalizes x itself (one op per conv: at a batch of
        # one the separate norm, projection and their small tensors cost more than the conv).
        # Parameters are read from the modules' dicts and the op overload is called directly:
        # nn.Module attribute lookups (~0.5 us each) and the wrapper's frame made the module
        # cost 15 us around a 7 us op at 8 rows (now 11.5).
        base = self._parameters["base"]
        if self.use_ops and not (torch.is_grad_enabled() and (x.requires_grad or base.requires_grad)):
            w, dtype = self._modules["proj"]._parameters["weight"], x.dtype
            norm_weight, eps = (None, 1e-6) if norm is None else (norm._parameters["weight"], norm.eps)
            if base.dtype != dtype:  # (a no-op `.to` still costs microseconds)
                base, w = base.to(dtype), w.to(dtype)
            if residual is not None and residual.dtype != dtype:
                residual = residual.to(dtype)
            if norm_weight is not None and norm_weight.dtype != dtype:
                norm_weight = norm_weight.to(dtype)
            return _two_tap_conv(x, base, None, self.block_size, None, residual, w, norm_weight, eps)
        if norm is not None:
            x = reference.rms_norm(x, norm.weight, norm.eps)
        delta = self.proj(x).unflatten(-1, (2, self.groups))
        return reference.two_tap_conv_reference(x, self.base, delta, self.block_size, residual=residual)


class PreparedRMSNorm(RMSNorm):
    """RMSNorm followed by the sublayer's "prepare" conv (parameter names: weight, conv.*);
    with the ops, one op does both."""

    def __init__(self, dim: int, eps: float, block_size: int):
        super().__init__(dim, eps)
        self.conv = TwoTapConv(dim, block_size)

    def forward(self, x):
        return self.conv(x, norm=self)


class FinishedLinear(nn.Linear):
    """The attention's o_proj followed by the "finish" conv on the sublayer output."""

    def __init__(self, in_features: int, out_features: int, block_size: int):
        super().__init__(in_features, out_features, bias=False)
        self.conv = TwoTapConv(out_features, block_size)

    def forward(self, x, residual=None):
        return self.conv(super().forward(x), residual)


class FinishedMLP(MLP):
    """SwiGLU MLP followed by the "finish" conv on its output."""

    def __init__(self, cfg, block_size: int):
        super().__init__(cfg)
        self.conv = TwoTapConv(cfg.hidden_size, block_size)

    def forward(self, x, residual=None):
        return self.conv(super().forward(x), residual)


# ---------------------------------------------------------------------- path selector
class PathSelector(nn.Module):
    """``S_t(a, b) = U_t(b) + <A[a] ⊙ W_h h_t, B[b]>`` over the Top-K lattice."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.w_h = nn.Linear(hidden_size, rank, bias=False)
        self.a_emb = nn.Parameter(torch.zeros(vocab_size, rank))
        self.b_emb = nn.Parameter(torch.zeros(vocab_size, rank))

    def reset(self, generator: torch.Generator) -> None:
        # Small factors: the pair term starts near 0, so the first paths are the unary argmax (DFlash).
        with torch.no_grad():
            for p in (self.w_h.weight, self.a_emb, self.b_emb):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)

    def pair_scores(
        self, unary: torch.Tensor, cand_ids: torch.Tensor, prev: torch.Tensor, g: torch.Tensor
    ) -> torch.Tensor:
        """Differentiable score rows ``S_t(prev, ·)`` [..., K] for one predecessor per row.

        unary [..., K] fp32; cand_ids [..., K]; prev [...] token ids; g [..., r].
        """
        ag = F.embedding(prev, self.a_emb).float() * g.float()  # [..., r]
        return unary + (F.embedding(cand_ids.long(), self.b_emb).float() * ag[..., None, :]).sum(-1)


class PathSignals(NamedTuple):
    """Per draft position [B, γ - 1]: what a confidence proxy reads (README, "The combination").

    Every signal of position k is known before draft k is drawn: it reads the selector's score
    row S_k(x_{k-1}, ·) given the drafts before k, never the candidate drawn at k. (A scheduler
    that read the drawn candidate's own probability would verify a draft because of its value,
    which is not lossless at T > 0: scheduling/confidence.py.)"""

    top_prob: torch.Tensor  # softmax(score row) of its best candidate, at T = 1
    top_margin: torch.Tensor  # the row's best score minus its second best (logit units; +inf with K = 1)
    unary_top1: torch.Tensor  # the backbone's top-1 probability at the position
    entropy: torch.Tensor  # entropy (nats) of softmax(score row) over the K candidates
    position: torch.Tensor  # block position k = 1 .. γ - 1 (int64)
    unary_margin: torch.Tensor  # the backbone's top-1 minus top-2 log-prob (+inf with K = 1; not a proxy signal)

    def features(self) -> torch.Tensor:
        """[B, γ - 1, 4] float32: top_prob, top_margin, unary_top1, entropy (the order of
        `scheduling.proxy.SIGNALS`; the position is the column index)."""
        return torch.stack([self.top_prob, self.top_margin, self.unary_top1, self.entropy], -1).float()


def path_signals(scores: torch.Tensor, unary: torch.Tensor) -> PathSignals:
    """Signals from path_select's score rows [B, P, K] (each given the drafts before it) and
    the unary log-probs [B, P, K]."""
    scores = scores.float()
    logp = torch.log_softmax(scores, -1)
    B, P, K = scores.shape
    if K > 1:
        top2 = scores.topk(2, -1).values
        top_margin = top2[..., 0] - top2[..., 1]
    else:
        top_margin = torch.full(scores.shape[:2], float("inf"), device=scores.device)
    position = torch.arange(1, P + 1, device=scores.device).expand(B, P)
    # unary is sorted, best first: its top-2 gap is the backbone's margin, free here.
    unary_margin = unary[..., 0] - unary[..., 1] if K > 1 else torch.full_like(top_margin, float("inf"))
    return PathSignals(
        logp.max(-1).values.exp(),
        top_margin,
        unary[..., 0].exp(),
        -(logp.exp() * logp).sum(-1),
        position,
        unary_margin.float(),
    )


# ---------------------------------------------------------------------- drafter
class DFlash2Drafter(DFlashDrafter):
    """DFlash backbone with two-tap convs in every layer, and a path selector head."""

    def __init__(self, config: DFlash2Config, target: DecoderForCausalLM | None = None, use_ops: bool = True):
        super().__init__(config, target, use_ops=use_ops)
        qcfg, g, D = config.layer_config(), config.block_size, config.hidden_size
        for layer in self.layers:
            layer.input_layernorm = PreparedRMSNorm(D, config.rms_norm_eps, g)
            layer.post_attention_layernorm = PreparedRMSNorm(D, config.rms_norm_eps, g)
            attn = layer.self_attn
            attn.o_proj = FinishedLinear(attn.num_heads * attn.head_dim, D, g)
            layer.mlp = FinishedMLP(qcfg, g)
        self.selector = PathSelector(D, config.vocab_size, config.selector_rank)
        self.use_ops = use_ops  # reach the convs just created

    @property
    def use_ops(self) -> bool:
        return self._use_ops

    @use_ops.setter
    def use_ops(self, value: bool) -> None:
        # The convs sit inside the layers and need the flag too.
        object.__setattr__(self, "_use_ops", bool(value))
        if "layers" in self._modules:
            for m in self.convs():
                m.use_ops = bool(value)

    @staticmethod
    def add_sublayer(x: torch.Tensor, sublayer: nn.Module, inp: torch.Tensor) -> torch.Tensor:
        """x + sublayer(inp), the add fused into the sublayer's finish conv (one pass fewer)."""
        return sublayer(inp, residual=x)

    def convs(self) -> list[TwoTapConv]:
        return [m for m in self.modules() if isinstance(m, TwoTapConv)]

    def init_weights(self, seed: int = 0) -> None:
        """DFlash's init for the backbone, then identity convs and a near-zero pair term."""
        super().init_weights(seed)
        for m in self.convs():
            m.reset_identity()
        self.selector.reset(torch.Generator().manual_seed(seed + 1))

    def load_dflash_backbone(self, state: dict[str, torch.Tensor]) -> None:
        """Start from a DFlash drafter's weights; the convs are reset to the identity, so the
        backbone is exactly that drafter."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"not a DFlash backbone: unexpected tensors {unexpected[:5]}")
        bad = [n for n in missing if ".conv." not in n and not n.startswith("selector.")]
        if bad:
            raise ValueError(f"DFlash checkpoint is missing backbone tensors {bad[:5]}")
        for m in self.convs():
            m.reset_identity()

    # ------------------------------------------------------------ selector
    def lattice(self, hidden: torch.Tensor, use_ops: bool | None = None, with_g: bool = True):
        """Top-K lattice of final-normed draft states hidden [..., D]:
        (cand_ids [..., K] int32, unary log-probs [..., K] fp32, g = W_h h [..., r], or None
        without `with_g`: path_select computes it)."""
        use_ops = self.use_ops if use_ops is None else use_ops
        logits = self.logits(hidden)
        topk = _topk_select if use_ops else reference.topk_select_reference
        values, ids, lse = topk(logits, self.config.selector_topk)
        return ids, values - lse[..., None], (self.selector.w_h(hidden) if with_g else None)

    @torch.no_grad()
    def propose(self, cache, anchor, ctx_lens, temperature, seeds, offsets, path="auto", signals=True) -> DraftBlock:
        """Draft a block through the Top-K lattice and the path selector. `sample` paths carry
        sparse q over the K candidates; deterministic paths (`backtrack`, `greedy`, and every
        path at temperature 0) are verified as one-hot drafts; `auto` = backtrack at
        temperature 0, else sample. `signals=False` skips the path signals that only a
        confidence proxy reads."""
        if path not in PATH_MODES:
            raise ValueError(f"path must be one of {PATH_MODES}, got {path!r}")
        sampling = bool((temperature > 0).any())
        mode = ("sample" if sampling else "backtrack") if path == "auto" else path
        mode = mode if (mode != "sample" or sampling) else "greedy"
        tokens, cand_ids, q, sig = self.select_paths(
            cache, anchor, ctx_lens, mode=mode, temperature=temperature, seeds=seeds, offsets=offsets, signals=signals
        )
        return DraftBlock(
            tokens,
            q,
            cand_ids if q is not None else None,
            signals=None if sig is None else sig.features(),
            cand_ids=cand_ids,
            top2_margin=None if sig is None else sig.unary_margin,
        )

    def select_paths(
        self,
        cache: DFlashCache,
        anchor: torch.Tensor,
        ctx_lens: torch.Tensor,
        mode: str = "backtrack",
        temperature: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        signals: bool = True,
    ):
        """Draft a block: (drafts [B, γ-1] int64, cand_ids [B, γ-1, K] int32,
        q [B, γ-1, K] fp32 in sample mode (sparse q for `verify` with cand_ids) else None,
        PathSignals, or None when `signals` is False: they cost a few small ops per step
        that only a confidence proxy needs).

        Draft k (1..γ-1) draws at Philox position ``offsets[b] + k - 1``, like the loop's DFlash drafts.
        """
        hidden = self.draft_states(cache, anchor, ctx_lens)
        cand_ids, unary, _ = self.lattice(hidden, with_g=False)
        # The selector's tensors from the modules' dicts (attribute lookups cost ~0.5 us each).
        sel = self._modules["selector"]
        a_emb, b_emb = sel._parameters["a_emb"], sel._parameters["b_emb"]
        w_h = sel._modules["w_h"]._parameters["weight"]
        if hidden.dtype != a_emb.dtype:  # (a no-op `.to` still costs microseconds)
            hidden = hidden.to(a_emb.dtype)
        if w_h.dtype != a_emb.dtype:
            w_h = w_h.to(a_emb.dtype)
        if temperature is None or seeds is None or offsets is None:
            temperature, seeds, offsets = ops.path_sampling_defaults(cand_ids, temperature, seeds, offsets)
        # g = W_h h inside the op (one op fewer per draft).
        select = _path_select if self.use_ops else reference.path_select_reference
        tokens, choice, scores, q = select(
            cand_ids, unary, a_emb, b_emb, None, anchor, mode, temperature, seeds, offsets, hidden, w_h
        )
        return (
            tokens.long(),
            cand_ids,
            (q if mode == "sample" else None),
            path_signals(scores, unary) if signals else None,
        )

    def selector_loss(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        prev: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ):
        """Teacher-forced selector cross-entropy over the Top-K scores.

        hidden [..., D] final-normed draft states, logits [..., V] their backbone logits,
        prev [...] the true previous tokens (the anchor at block position 1), labels [...]
        the true tokens, weights [...] optional per-position weights. Positions whose
        label is not among the Top-K are masked out. Returns (loss, in_topk [...] bool,
        selector top-1 hit [...] bool).
        """
        logp = torch.log_softmax(logits.float(), -1)
        unary, cand = logp.topk(self.config.selector_topk, -1)
        scores = self.selector.pair_scores(unary, cand, prev, self.selector.w_h(hidden))
        match = cand == labels[..., None]
        in_topk = match.any(-1)
        ce = F.cross_entropy(scores.flatten(0, -2), match.float().argmax(-1).flatten(), reduction="none")
        w = in_topk.float() if weights is None else in_topk.float() * weights
        loss = (ce.view(in_topk.shape) * w).sum() / w.sum().clamp(min=1e-6)
        return loss, in_topk, (scores.argmax(-1) == match.float().argmax(-1)) & in_topk


# ---------------------------------------------------------------------- I/O
def save_dflash2(
    drafter: DFlash2Drafter, path: str | Path, dtype: torch.dtype = torch.bfloat16, backbone: str | Path | None = None
) -> None:
    """config.json + model.safetensors (the drafter's own weights: backbone, convs, selector;
    with `backbone`, a DFlash directory holding the backbone, the convs and selector only)."""
    save_dflash(drafter, path, dtype, backbone)


def load_dflash2(
    path: str | Path, target: DecoderForCausalLM, dtype: torch.dtype | None = None, use_ops: bool = True
) -> DFlash2Drafter:
    return load_drafter(path, target, DFlash2Drafter, DFlash2Config, dtype, use_ops)
