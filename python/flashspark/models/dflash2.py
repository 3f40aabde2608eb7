"""DFlash 2 drafter: the DFlash backbone with grouped dynamic convs, plus a candidate selector,
the function of z-lab's reference (`dflash` 0.1.0, `DFlash2DraftModel`) and its checkpoints.

* **Grouped dynamic causal convs** around every attention and MLP sublayer (`attention_conv`,
  `mlp_conv`: `base_kernel` [2, 2, D] and `kernel_projection` Linear(D → 2·2·G), G = D / group).
  One projection of the *prepare* conv's input h (the sublayer's normalized input) gives the
  dynamic taps of both convs: ``δ = kernel_projection(h)`` viewed [2 (prepare, finish), 2
  (taps), G]. The prepare conv runs on h, the finish conv on the sublayer's output y:
  ``out[t, c] = (base[i, 0, c] + δ[t, i, 0, c // group]) · z[t, c]
  + (base[i, 1, c] + δ[t, i, 1, c // group]) · z[t - 1, c]``, z = h (i = 0) or y (i = 1), and
  z[t - 1] = 0 at a block's first row. Identity at init (base[:, 0] = 1, base[:, 1] = 0,
  projection 0), so a fresh DFlash 2 backbone computes exactly DFlash. The convs see block rows
  only: KV injection and the drafter cache are DFlash's, unchanged.

* **Candidate selector** over the Top-K lattice of the block: unary U_t = Top-K log-probs of
  the draft logits (the reference uses the raw logits: a per-position shift, the same paths
  and the same softmax), ``S_t(a, b) = U_t(b) + <A[a] ⊙ W_h h_t, B[b]>`` with A / B the
  predecessor / successor codebooks and W_h the hidden projection; the anchor is the
  predecessor at t = 0. At temperature 0 the path is the reference's: greedy, left to right;
  at T > 0 each position samples from softmax(S_t / T) over its K candidates.
  `path=backtrack` (the max-score path by dynamic programming) is a flashspark option.

Inference uses the ops (`two_tap_conv` with the finish taps written by the prepare call,
`topk_select`, `path_select`) when `use_ops` is set and no gradient is needed; otherwise the
differentiable references in `flashspark.reference`, which compute the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from . import tree as tree_ops
from .decoder import DecoderForCausalLM, RMSNorm
from .dflash import DFlashCache, DFlashConfig, DFlashDrafter, load_drafter, save_dflash
from .drafter import DraftBlock

PATH_MODES = ("auto", "greedy", "backtrack", "sample")  # auto: greedy at temperature 0 (the reference's), else sample
CONV_KERNEL_SIZE = 2  # taps per conv: what the op computes
MAX_TOP_K = ops.MAX_TOP_K  # topk_select's bound
# The ops' overloads, called without the wrappers' Python frames on the drafting path.
_two_tap_conv = torch.ops.flashspark.two_tap_conv.default
_topk_select = torch.ops.flashspark.topk_select.default
_path_select = torch.ops.flashspark.path_select.default
# Published checkpoints store the codebooks as bare tensors (the reference maps them onto
# `.weight` when it loads): saved and read so.
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass
class DFlash2Config(DFlashConfig):
    conv_kernel_size: int = CONV_KERNEL_SIZE
    conv_group_size: int = 16  # channels sharing one dynamic tap
    selector_rank: int = 64  # r of the codebooks (256 at full scale)
    selector_top_k: int = 16  # K candidates per block position
    architectures: list[str] = field(default_factory=lambda: ["DFlash2DraftModel"])
    KIND: ClassVar[str] = "DFlash 2"

    def __post_init__(self):
        super().__post_init__()
        if self.conv_kernel_size != CONV_KERNEL_SIZE:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} is not supported: flashspark's two_tap_conv op "
                f"computes {CONV_KERNEL_SIZE}-tap convs"
            )
        if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size} (the reference's groups)"
            )
        if not 1 <= self.selector_top_k <= MAX_TOP_K:
            raise ValueError(
                f"selector_top_k must lie in [1, {MAX_TOP_K}] (topk_select's bound), got {self.selector_top_k}"
            )
        if self.selector_rank < 1:
            raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}")

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    def draft_keys(self) -> dict:
        return super().draft_keys() | {k: getattr(self, k) for k in DFLASH2_KEYS}


# ---------------------------------------------------------------------- convs
class GroupedDynamicConv(nn.Module):
    """The reference's `GroupedDynamicCausalConv`: the prepare and finish convs of one sublayer."""

    def __init__(self, channels: int, group_size: int):
        super().__init__()
        self.group_size = group_size
        self.groups = channels // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, CONV_KERNEL_SIZE, channels))  # [prepare/finish, tap, C]
        self.kernel_projection = nn.Linear(channels, 2 * CONV_KERNEL_SIZE * self.groups, bias=False)
        self.use_ops = False
        self.reset_identity()

    def reset_identity(self) -> None:
        """base[:, 0] = 1, base[:, 1] = 0, δ = 0: both convs return their input."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def _op_ready(self, x: torch.Tensor) -> bool:
        # The op has no autograd: use it only when nothing needs a gradient.
        base = self._parameters["base_kernel"]
        return self.use_ops and not (torch.is_grad_enabled() and (x.requires_grad or base.requires_grad))

    def prepare(self, x: torch.Tensor, norm: RMSNorm, block_size: int):
        """(the prepare conv of norm(x), the finish conv's taps [..., 2, G]) for rows x [..., T, C]
        in blocks of `block_size` rows. With the ops, one call normalizes, projects all four
        taps, convolves and writes the finish taps."""
        w = self._modules["kernel_projection"]._parameters["weight"]
        base = self._parameters["base_kernel"]
        if self._op_ready(x):
            # Parameters are read from the modules' dicts and the overload called directly: at a
            # batch of one, attribute lookups and wrapper frames cost as much as the op.
            dtype = x.dtype
            norm_weight = norm._parameters["weight"]
            if base.dtype != dtype:  # (a no-op `.to` still costs microseconds)
                base, w, norm_weight = base.to(dtype), w.to(dtype), norm_weight.to(dtype)
            taps = x.new_empty(x.shape[:-1] + (2, self.groups))
            out = _two_tap_conv(
                x, base[0], None, block_size, None, None, w, norm_weight, norm.eps, self.group_size, taps
            )
            return out, taps
        h = reference.rms_norm(x, norm.weight, norm.eps)
        delta = F.linear(h, w).unflatten(-1, (2, CONV_KERNEL_SIZE, self.groups))
        out = reference.two_tap_conv_reference(h, base[0], delta[..., 0, :, :], block_size, group_size=self.group_size)
        return out, delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, taps: torch.Tensor, residual: torch.Tensor, block_size: int) -> torch.Tensor:
        """residual + the finish conv of the sublayer output y with the taps `prepare` gave."""
        base = self._parameters["base_kernel"]
        if self._op_ready(y):
            dtype = y.dtype
            if base.dtype != dtype:
                base = base.to(dtype)
            if residual.dtype != dtype:
                residual = residual.to(dtype)
            return _two_tap_conv(y, base[1], taps, block_size, None, residual, None, None, 1e-6, self.group_size, None)
        return reference.two_tap_conv_reference(
            y, base[1], taps, block_size, residual=residual, group_size=self.group_size
        )


# ---------------------------------------------------------------------- candidate selector
class CandidateSelector(nn.Module):
    """``S_t(a, b) = U_t(b) + <A[a] ⊙ W_h h_t, B[b]>`` over the Top-K lattice (the reference's names)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)  # A
        self.successor_codebook = nn.Embedding(vocab_size, rank)  # B
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)  # W_h

    def reset(self, generator: torch.Generator) -> None:
        # Small factors: the pair term starts near 0, so the first paths are the unary argmax (DFlash).
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)

    def pair_scores(
        self, unary: torch.Tensor, cand_ids: torch.Tensor, prev: torch.Tensor, g: torch.Tensor
    ) -> torch.Tensor:
        """Differentiable score rows ``S_t(prev, ·)`` [..., K] for one predecessor per row.

        unary [..., K] fp32; cand_ids [..., K]; prev [...] token ids; g [..., r] = W_h h.
        """
        ag = self.predecessor_codebook(prev).float() * g.float()  # [..., r]
        return unary + (self.successor_codebook(cand_ids.long()).float() * ag[..., None, :]).sum(-1)


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
    """DFlash backbone with grouped dynamic convs in every layer, and a candidate selector."""

    def __init__(self, config: DFlash2Config, target: DecoderForCausalLM | None = None, use_ops: bool = True):
        super().__init__(config, target, use_ops=use_ops)
        D, group = config.hidden_size, config.conv_group_size
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(D, group)
            layer.mlp_conv = GroupedDynamicConv(D, group)
        self.candidate_selector = CandidateSelector(D, config.vocab_size, config.selector_rank)
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

    @property
    def selector(self) -> CandidateSelector:
        return self.candidate_selector

    def layer_forward(self, layer, x: torch.Tensor, attend, block_size: int) -> torch.Tensor:
        """The reference's layer: each sublayer between its conv pair, the residual add fused
        into the finish conv."""
        conv = layer.attention_conv
        h, taps = conv.prepare(x, layer.input_layernorm, block_size)
        x = conv.finish(layer.self_attn.o_proj(attend(h)), taps, x, block_size)
        conv = layer.mlp_conv
        h, taps = conv.prepare(x, layer.post_attention_layernorm, block_size)
        return conv.finish(layer.mlp(h), taps, x, block_size)

    def convs(self) -> list[GroupedDynamicConv]:
        return [m for m in self.modules() if isinstance(m, GroupedDynamicConv)]

    def saved_name(self, name: str) -> str:
        return name.removesuffix(".weight") if name.removesuffix(".weight") in CODEBOOKS else name

    def loaded_name(self, name: str) -> str:
        return name + ".weight" if name in CODEBOOKS else name

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
        bad = [n for n in missing if "_conv." not in n and not n.startswith("candidate_selector.")]
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
        values, ids, lse = topk(logits, self.config.selector_top_k)
        return ids, values - lse[..., None], (self.selector.hidden_projection(hidden) if with_g else None)

    @torch.no_grad()
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
        """Draft a block through the Top-K lattice and the candidate selector. `sample` paths
        carry sparse q over the K candidates; deterministic paths (`greedy`, `backtrack`, and
        every path at temperature 0) are verified as one-hot drafts; `auto` = greedy at
        temperature 0 (the reference's path), else sample. `signals=False` skips the path
        signals that only a confidence proxy reads; `num_drafts` shortens the block. `tree` = N
        >= 2: a token tree of N nodes instead (`propose_tree`; `path` does not apply)."""
        if tree:
            return self.propose_tree(cache, anchor, ctx_lens, temperature, tree, signals, num_drafts, search)
        if path not in PATH_MODES:
            raise ValueError(f"path must be one of {PATH_MODES}, got {path!r}")
        sampling = bool((temperature > 0).any())
        mode = ("sample" if sampling else "greedy") if path == "auto" else path
        mode = mode if (mode != "sample" or sampling) else "greedy"
        tokens, cand_ids, q, sig = self.select_paths(
            cache, anchor, ctx_lens, mode, temperature, seeds, offsets, signals, num_drafts
        )
        return DraftBlock(
            tokens,
            q,
            cand_ids if q is not None else None,
            signals=None if sig is None else sig.features(),
            cand_ids=cand_ids,
            top2_margin=None if sig is None else sig.unary_margin,
        )

    def propose_tree(
        self, cache, anchor, ctx_lens, temperature, num_nodes, signals=True, num_drafts=None, search="best-first"
    ):
        """DFlash 2's token tree: best-first expansion through its Top-K lattice by the selector's
        path probability (`models.tree`). A child b of a node with token a at depth d - 1 gets
        log softmax(S_d(a, ·) / T)[b] over the position's K candidates (T = 0: at 1): the
        distribution the sampled paths draw from, whose argmax is the greedy path's choice, and,
        normalized per row, a score no child exceeds its parent in (the raw S of the backtrack
        path is not). With `signals`, each node carries its parent's score row's path signals
        (what the confidence proxy reads: known before the node is chosen). Nothing is sampled:
        the tree is verified target-only (`tree_verify`)."""
        hidden = self.draft_states(cache, anchor, ctx_lens, num_drafts)
        cand_ids, unary, g = self.lattice(hidden)
        sel = self.selector
        succ = sel.successor_codebook(cand_ids.long()).float()  # [B, P, K, r]
        g = g.float()
        scale = torch.where(temperature > 0, temperature, 1.0).float()[:, None, None]
        rows: dict[int, torch.Tensor] = {}

        def row_logp(d, parents):  # S_d(a, ·) for each parent token a [B, W] -> [B, W, K]
            a = sel.predecessor_codebook(parents).float() * g[:, d - 1, None]
            rows[d] = unary[:, d - 1, None] + a @ succ[:, d - 1].transpose(1, 2)
            return torch.log_softmax(rows[d] / scale, -1)

        def row_signals(d, parents, logp):
            scores = rows.pop(d)
            return path_signals(scores, unary[:, d - 1, None].expand_as(scores)).features()

        tokens, tree, sig = tree_ops.best_first_tree(
            cand_ids, row_logp, anchor, num_nodes, with_rows=row_signals if signals else None, search=search
        )
        return DraftBlock(tokens, signals=sig, tree=tree)

    def select_paths(
        self,
        cache: DFlashCache,
        anchor: torch.Tensor,
        ctx_lens: torch.Tensor,
        mode: str = "greedy",
        temperature: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        signals: bool = True,
        num_drafts: int | None = None,
    ):
        """Draft a block: (drafts [B, γ-1] int64, cand_ids [B, γ-1, K] int32,
        q [B, γ-1, K] fp32 in sample mode (sparse q for `verify` with cand_ids) else None,
        PathSignals, or None when `signals` is False: they cost a few small ops per step
        that only a confidence proxy needs).

        Draft k (1..γ-1) draws at Philox position ``offsets[b] + k - 1``, like the loop's DFlash drafts.
        """
        hidden = self.draft_states(cache, anchor, ctx_lens, num_drafts)
        cand_ids, unary, _ = self.lattice(hidden, with_g=False)
        # The selector's tensors from the modules' dicts (attribute lookups cost ~0.5 us each).
        sel = self._modules["candidate_selector"]._modules
        a_emb = sel["predecessor_codebook"]._parameters["weight"]
        b_emb = sel["successor_codebook"]._parameters["weight"]
        w_h = sel["hidden_projection"]._parameters["weight"]
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
        unary, cand = logp.topk(self.config.selector_top_k, -1)
        scores = self.selector.pair_scores(unary, cand, prev, self.selector.hidden_projection(hidden))
        match = cand == labels[..., None]
        in_topk = match.any(-1)
        ce = F.cross_entropy(scores.flatten(0, -2), match.float().argmax(-1).flatten(), reduction="none")
        w = in_topk.float() if weights is None else in_topk.float() * weights
        loss = (ce.view(in_topk.shape) * w).sum() / w.sum().clamp(min=1e-6)
        return loss, in_topk, (scores.argmax(-1) == match.float().argmax(-1)) & in_topk


# ---------------------------------------------------------------------- I/O
def save_dflash2(
    drafter: DFlash2Drafter,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 0,
    share_with: str | Path | None = None,
) -> None:
    """config.json + model.safetensors in z-lab's format (`save_dflash`): loads in their `DFlash2DraftModel`."""
    save_dflash(drafter, path, dtype, max_shard_bytes, share_with)


def load_dflash2(
    path: str | Path, target: DecoderForCausalLM, dtype: torch.dtype | None = None, use_ops: bool = True
) -> DFlash2Drafter:
    """A DFlash 2 drafter in z-lab's format (codebooks with or without `.weight`), attached to `target`."""
    return load_drafter(path, target, DFlash2Drafter, DFlash2Config, dtype, use_ops)
