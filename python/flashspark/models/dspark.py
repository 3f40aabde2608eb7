"""DSpark drafter: a DFlash backbone, a Markov head and a confidence head.

DSpark (docs/dflash2_dspark.md, "DSpark drafter"):

* the DFlash backbone gives the base logits U_k of the whole block in one pass;
* **Markov head** ``logits_k = U_k + W2(W1[x_{k-1}])`` (W1: Embedding(V, r),
  W2: Linear(r, V)), sampled left to right with `ops.markov_step`, one call
  per block position for all requests; x_0 is the anchor;
* **confidence head** ``c_k = σ(w · [h_k ; W1[x_{k-1}]] + b)``: the chance that
  draft k survives verification given that drafts 1..k-1 did. The op computes
  it in the same pass. Calibration (per-position temperatures T_k, fitted
  after training, see `train.dspark`) divides the confidence logit by T_k,
  which is the same as passing w / T_k and b / T_k to the op.

W2 starts at zero, so a fresh drafter drafts exactly like its DFlash backbone
(and can start from trained DFlash weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from .decoder import DecoderForCausalLM
from .dflash import DFlashCache, DFlashConfig, DFlashDrafter, load_drafter, save_dflash
from .drafter import DraftBlock, top2_margin

CALIBRATION_NAME = "calibration.json"


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 64  # r of W1 / W2 (256 at full scale)
    architectures: list[str] = field(default_factory=lambda: ["DSparkDraftModel"])
    model_type: str = "dspark"


class DSparkDrafter(DFlashDrafter):
    def __init__(self, config: DSparkConfig, target: DecoderForCausalLM | None = None, use_ops: bool = True):
        super().__init__(config, target, use_ops=use_ops)
        D, V, r = config.hidden_size, config.vocab_size, config.markov_rank
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)
        self.conf_head = nn.Linear(D + r, 1)
        # Per-position temperatures of the confidence logits (block positions 1..γ-1); set by calibration.
        self.register_buffer("conf_temperature", torch.ones(config.block_size - 1), persistent=False)
        self.last_confidence: torch.Tensor | None = None  # of the last `draft_logits` call

    def init_weights(self, seed: int = 0) -> None:
        """DFlash's init for the backbone; W2 = 0 so the Markov term starts silent."""
        super().init_weights(seed)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            self.markov_w1.weight.copy_(torch.randn(self.markov_w1.weight.shape, generator=g) * 0.02)
            self.markov_w2.weight.zero_()
            self.conf_head.weight.copy_(torch.randn(self.conf_head.weight.shape, generator=g) * 0.02)
            self.conf_head.bias.zero_()

    def load_dflash_backbone(self, state: dict[str, torch.Tensor]) -> None:
        """Start from a DFlash drafter's weights; W2 is zeroed, so it drafts exactly like that drafter."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"not a DFlash backbone: unexpected tensors {unexpected[:5]}")
        bad = [n for n in missing if not n.startswith(("markov_", "conf_head."))]
        if bad:
            raise ValueError(f"DFlash checkpoint is missing backbone tensors {bad[:5]}")
        with torch.no_grad():
            self.markov_w2.weight.zero_()

    # -------------------------------------------------------------- training form
    def heads(self, hidden: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor):
        """Differentiable Markov and confidence heads for given predecessors.

        hidden [..., D] final-normed draft states, base_logits [..., V] (U_k),
        prev [...] x_{k-1}. Returns (logits [..., V] fp32, confidence logits [...] fp32,
        before calibration).
        """
        e = self.markov_w1(prev)
        logits = base_logits.float() + self.markov_w2(e).float()
        z = self.conf_head(torch.cat([hidden, e.to(hidden.dtype)], -1))[..., 0].float()
        return logits, z

    # ------------------------------------------------------------ inference form
    @torch.no_grad()
    def propose(self, cache, anchor, ctx_lens, temperature, seeds, offsets, path="auto", signals=True) -> DraftBlock:
        """Draft a block with the Markov head's serial chain: q dense when any request samples
        (one-hot drafts otherwise), and the calibrated confidences. `path` is DFlash 2's and
        ignored here; `signals` adds the top-2 margin of the Markov logits along the drafted
        chain (one more V-wide pass per block, so only when asked: records, margin baselines)."""
        hidden = self.draft_hidden(cache, anchor, ctx_lens)[:, 1:]
        base = self.logits(hidden)
        tokens, q, conf = self._markov_chain(hidden, base, anchor, temperature, seeds, offsets)
        margin = None
        if signals:
            prev = torch.cat([anchor[:, None].long(), tokens[:, :-1]], 1)
            margin = top2_margin(base.float() + F.linear(self.markov_w1(prev), self.markov_w2.weight).float())
        return DraftBlock(tokens, q if bool((temperature > 0).any()) else None, confidence=conf, top2_margin=margin)

    def draft_markov(
        self,
        cache: DFlashCache,
        anchor: torch.Tensor,
        ctx_lens: torch.Tensor,
        temperature: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ):
        """Draft a block: (drafts [B, γ-1] int64, q [B, γ-1, V] fp32 (dense q for `verify`;
        one-hot where temperature is 0), confidences [B, γ-1] fp32 after calibration).

        One backbone pass, then one `markov_step` per block position for all requests;
        draft k (1..γ-1) draws at Philox position ``offsets[b] + k - 1``.
        """
        hidden = self.draft_hidden(cache, anchor, ctx_lens)[:, 1:]
        return self._markov_chain(hidden, self.logits(hidden), anchor, temperature, seeds, offsets)

    def _markov_chain(self, hidden, base, anchor, temperature=None, seeds=None, offsets=None):
        B, dev = anchor.shape[0], anchor.device
        temperature = torch.zeros(B, device=dev) if temperature is None else temperature.float()
        seeds = torch.zeros(B, dtype=torch.int64, device=dev) if seeds is None else seeds.long()
        offsets = torch.zeros(B, dtype=torch.int64, device=dev) if offsets is None else offsets.long()
        dt = base.dtype  # the op wants one dtype for all its weights
        w1, w2 = self.markov_w1.weight.to(dt), self.markov_w2.weight.to(dt)
        step = ops.markov_step if self.use_ops else _markov_step_reference
        prev = anchor
        drafts, qs, confs = [], [], []
        for k in range(self.block_size - 1):
            t = self.conf_temperature[k].to(dt)
            tok, q, c = step(
                base[:, k].contiguous(),
                prev,
                w1,
                w2,
                hidden[:, k].to(dt).contiguous(),
                (self.conf_head.weight[0].to(dt) / t).contiguous(),
                (self.conf_head.bias.to(dt) / t),
                temperature=temperature,
                seeds=seeds,
                positions=offsets + k,
            )
            prev = tok.long()
            drafts.append(prev)
            qs.append(q)
            confs.append(c)
        return torch.stack(drafts, 1), torch.stack(qs, 1), torch.stack(confs, 1)

    @torch.no_grad()
    def draft_logits(self, cache: DFlashCache, anchor: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        """[B, γ-1, V] Markov-head logits along the greedy chain: U_k + W2 W1[x_{k-1}] with x the
        greedy drafts, for callers that speak DFlash's interface (argmax of `draft_logits`
        is exactly DSpark's greedy block); confidences are left in `last_confidence` [B, γ-1].
        The loop uses `propose`, which is also DSpark's sampler at T > 0."""
        hidden = self.draft_hidden(cache, anchor, ctx_lens)[:, 1:]
        base = self.logits(hidden)
        drafts, _, conf = self._markov_chain(hidden, base, anchor)
        self.last_confidence = conf
        prev = torch.cat([anchor[:, None].long(), drafts[:, :-1]], 1)
        return base + F.linear(self.markov_w1(prev), self.markov_w2.weight).float()

    def set_calibration(self, temperatures) -> None:
        t = torch.as_tensor(temperatures, dtype=torch.float32).flatten()
        if t.numel() != self.block_size - 1 or not bool((t > 0).all()):
            raise ValueError(f"need {self.block_size - 1} positive temperatures, got {t.tolist()}")
        self.conf_temperature = t.to(self.conf_temperature.device)


def _markov_step_reference(
    base_logits, prev_tokens, w1, w2, hidden, conf_w, conf_b, *, temperature, seeds, positions, bias=None
):
    """`reference.markov_step_reference` with `ops.markov_step`'s signature."""
    return reference.markov_step_reference(
        base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions
    )


def markov_rollout(drafter: DSparkDrafter, hidden: torch.Tensor, base_logits: torch.Tensor, anchor: torch.Tensor):
    """Greedy left-to-right Markov drafts in the training form (no ops, any batch shape).

    hidden [..., γ-1, D], base_logits [..., γ-1, V], anchor [...]. Returns (drafts [..., γ-1],
    confidence logits [..., γ-1] before calibration), each draft conditioned on the one drawn
    before it, as in `propose` at temperature 0.
    """
    prev, drafts, zs = anchor, [], []
    for k in range(hidden.shape[-2]):
        logits, z = drafter.heads(hidden[..., k, :], base_logits[..., k, :], prev)
        prev = logits.argmax(-1)
        drafts.append(prev)
        zs.append(z)
    return torch.stack(drafts, -1), torch.stack(zs, -1)


# ---------------------------------------------------------------------- I/O
def save_dspark(
    drafter: DSparkDrafter,
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    calibration: dict | None = None,
    backbone: str | Path | None = None,
) -> None:
    """config.json + model.safetensors, and calibration.json (temperatures and their report);
    with `backbone` (a DFlash directory holding the backbone) the heads only."""
    save_dflash(drafter, path, dtype, backbone)
    cal = dict(calibration or {})
    cal["temperatures"] = [float(x) for x in drafter.conf_temperature.tolist()]
    (Path(path) / CALIBRATION_NAME).write_text(json.dumps(cal, indent=2, sort_keys=True) + "\n")


def load_dspark(
    path: str | Path, target: DecoderForCausalLM, dtype: torch.dtype | None = None, use_ops: bool = True
) -> DSparkDrafter:
    """Drafter from a directory, attached to `target`, with its calibration if present."""
    drafter = load_drafter(path, target, DSparkDrafter, DSparkConfig, dtype, use_ops)
    cal = Path(path) / CALIBRATION_NAME
    if cal.is_file():
        drafter.set_calibration(json.loads(cal.read_text())["temperatures"])
    return drafter
