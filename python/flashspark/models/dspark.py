"""DSpark drafter: a DFlash backbone, a Markov head and a confidence head, as DeepSpec
(deepseek-ai/DeepSpec, the DSpark paper's reference) defines them and stores them.

* **Slot layout** (`sample_from_anchor`, DeepSpec's and the default): a block of γ inputs
  `[anchor, MASK × (γ-1)]` at positions a .. a + γ - 1 gives γ drafts; slot k predicts the
  token at a + k + 1, the anchor's slot included. With `sample_from_anchor = false` the block
  drafts like DFlash: slot k predicts a + k and slot 0 drafts nothing (γ - 1 drafts). A
  checkpoint read in the other layout drafts every token one position off.
* **Markov head** (`markov_head.markov_w1` Embedding(V, r), `markov_head.markov_w2` Linear(r, V),
  no bias): ``logits_j = U_j + W2(W1[x_{j-1}])`` for draft j, x_0 the anchor; sampled left to
  right with `ops.markov_step`, one call per draft for all requests. DeepSpec's "vanilla" head;
  its "gated" and "rnn" heads are refused at load.
* **Confidence head** (`confidence_head.proj`, Linear(H + r, 1), or Linear(H, 1) without
  `confidence_head_with_markov`): ``c_j = σ(proj([h_j ; W1[x_{j-1}]]))``, the chance draft j
  survives verification given that the drafts before it did; h_j is the final-normed state.
  Calibration (per-draft temperatures T_j fitted after training, `calibration.json`, a
  flashspark addition) divides the logit by T_j, which is the same as passing w / T_j and
  b / T_j to the op.

The checkpoint is DeepSpec's: config.json a Qwen3 config (`model_type` qwen3, `architectures`
Qwen3DSparkModel) with `block_size`, `target_layer_ids`, `mask_token_id`, `markov_rank`,
`markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`; model.safetensors
with the backbone's names (`fc`, `hidden_norm`, `layers.i.*`, `norm`) and the heads'.
`embed_tokens` / `lm_head` may be stored; they are the target's and are taken from it.

W2 starts at zero, so a fresh drafter drafts exactly like its backbone (and can start from
trained DFlash weights).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from .decoder import DecoderForCausalLM
from .dflash import DFlashCache, DFlashConfig, DFlashDrafter, load_drafter
from .drafter import DraftBlock, top2_margin
from .io import save_weights

CALIBRATION_NAME = "calibration.json"
ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's config.json names its drafters so
MARKOV_HEAD_TYPES = ("vanilla",)  # DeepSpec also has "gated" and "rnn" (not implemented)
# Keys of a DeepSpec config.json that describe the drafter rather than its Qwen3 layers.
DSPARK_KEYS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
    "sample_from_anchor",
    "num_target_layers",
    "num_anchors",
)


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 64  # r of W1 / W2 (256 in the published drafters)
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head reads W1[x_{j-1}] too
    sample_from_anchor: bool = True  # DeepSpec's slot layout (module docstring)
    num_anchors: int = 512  # a training setting DeepSpec's model class requires in its config
    architectures: list[str] = field(default_factory=lambda: [ARCHITECTURE])
    model_type: str = "qwen3"
    KIND: ClassVar[str] = "DSpark"

    def __post_init__(self):
        super().__post_init__()
        self.markov_head_type = str(self.markov_head_type).lower()
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(
                f"markov_head_type {self.markov_head_type!r} is not supported: flashspark implements DeepSpec's "
                "vanilla head (logits + W2·W1[x_prev]); its gated and rnn heads are not implemented"
            )
        if self.markov_rank < 1:
            raise ValueError(
                f"markov_rank must be >= 1 (0 means no Markov head: not a DSpark drafter), got {self.markov_rank}"
            )
        if not self.enable_confidence_head:
            raise ValueError(
                "enable_confidence_head is false: DSpark's scheduler needs the confidence head, which this "
                "checkpoint lacks (decode it with fixed K as a DFlash-style drafter instead)"
            )

    @property
    def first_draft_slot(self) -> int:
        return 0 if self.sample_from_anchor else 1

    def to_json(self) -> dict:
        """config.json as DeepSpec writes it: the Qwen3 layer config plus the DSpark keys at its top level."""
        d = self.qwen3_json()
        d.update({k: getattr(self, k) for k in DSPARK_KEYS if getattr(self, k) is not None})
        return d


class MarkovHead(nn.Module):
    """DeepSpec's `markov_head`: the bias W2 · W1[x_prev] added to a draft's logits."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    """DeepSpec's `confidence_head`: one logit per draft from [h_j ; W1[x_{j-1}]] (or h_j)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, config: DSparkConfig, target: DecoderForCausalLM | None = None, use_ops: bool = True):
        super().__init__(config, target, use_ops=use_ops)
        D, V, r = config.hidden_size, config.vocab_size, config.markov_rank
        self.markov_head = MarkovHead(V, r)
        self.confidence_head = ConfidenceHead(D + r if config.confidence_head_with_markov else D)
        # Per-draft temperatures of the confidence logits; set by calibration.
        self.register_buffer("conf_temperature", torch.ones(config.num_drafts), persistent=False)
        self.last_confidence: torch.Tensor | None = None  # of the last `draft_logits` call

    @property
    def markov_w1(self) -> nn.Embedding:
        return self.markov_head.markov_w1

    @property
    def markov_w2(self) -> nn.Linear:
        return self.markov_head.markov_w2

    def conf_weight(self) -> torch.Tensor:
        """The confidence head's weight over [h ; W1[x_prev]], [H + r] (zeros over W1 when the head
        reads h alone): the form `markov_step` takes."""
        w = self.confidence_head.proj.weight[0]
        if self.config.confidence_head_with_markov:
            return w
        return torch.cat([w, w.new_zeros(self.config.markov_rank)])

    def init_weights(self, seed: int = 0) -> None:
        """DFlash's init for the backbone; W2 = 0 so the Markov term starts silent."""
        super().init_weights(seed)
        g = torch.Generator().manual_seed(seed + 1)
        proj = self.confidence_head.proj
        with torch.no_grad():
            self.markov_w1.weight.copy_(torch.randn(self.markov_w1.weight.shape, generator=g) * 0.02)
            self.markov_w2.weight.zero_()
            proj.weight.copy_(torch.randn(proj.weight.shape, generator=g) * 0.02)
            proj.bias.zero_()

    def load_dflash_backbone(self, state: dict[str, torch.Tensor]) -> None:
        """Start from a DFlash drafter's weights; W2 is zeroed, so it drafts exactly like that drafter
        (in DeepSpec's layout each slot then starts out predicting its DFlash slot's token, one
        position early: training moves it)."""
        missing, unexpected = self.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"not a DFlash backbone: unexpected tensors {unexpected[:5]}")
        bad = [n for n in missing if not n.startswith(("markov_head.", "confidence_head."))]
        if bad:
            raise ValueError(f"DFlash checkpoint is missing backbone tensors {bad[:5]}")
        with torch.no_grad():
            self.markov_w2.weight.zero_()

    # -------------------------------------------------------------- training form
    def heads(self, hidden: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor):
        """Differentiable Markov and confidence heads for given predecessors.

        hidden [..., D] final-normed draft states, base_logits [..., V] (U_j),
        prev [...] x_{j-1}. Returns (logits [..., V] fp32, confidence logits [...] fp32,
        before calibration).
        """
        e = self.markov_w1(prev)
        logits = base_logits.float() + self.markov_w2(e).float()
        x = torch.cat([hidden, e.to(hidden.dtype)], -1) if self.config.confidence_head_with_markov else hidden
        z = self.confidence_head.proj(x)[..., 0].float()
        return logits, z

    # ------------------------------------------------------------ inference form
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
        """Draft a block with the Markov head's serial chain: q dense when any request samples
        (one-hot drafts otherwise), and the calibrated confidences. `path` is DFlash 2's and
        ignored here; `signals` adds the top-2 margin of the Markov logits along the drafted
        chain (one more V-wide pass per block, so only when asked: records, margin baselines);
        `num_drafts` shortens the block. No trees (`tree`): README, "Trees"."""
        if tree:
            raise ValueError(
                "DSpark drafts chains only: its Markov head conditions each position on the draft "
                "before it, one V-wide head step per node of a tree (README, Trees)"
            )
        hidden = self.draft_states(cache, anchor, ctx_lens, num_drafts)
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
        """Draft a block: (drafts [B, n] int64, q [B, n, V] fp32 (dense q for `verify`;
        one-hot where temperature is 0), confidences [B, n] fp32 after calibration), n = num_drafts.

        One backbone pass, then one `markov_step` per draft for all requests; draft j (1..n)
        draws at Philox position ``offsets[b] + j - 1``.
        """
        hidden = self.draft_states(cache, anchor, ctx_lens)
        return self._markov_chain(hidden, self.logits(hidden), anchor, temperature, seeds, offsets)

    def _markov_chain(self, hidden, base, anchor, temperature=None, seeds=None, offsets=None):
        B, dev = anchor.shape[0], anchor.device
        temperature = torch.zeros(B, device=dev) if temperature is None else temperature.float()
        seeds = torch.zeros(B, dtype=torch.int64, device=dev) if seeds is None else seeds.long()
        offsets = torch.zeros(B, dtype=torch.int64, device=dev) if offsets is None else offsets.long()
        dt = base.dtype  # the op wants one dtype for all its weights
        w1, w2 = self.markov_w1.weight.to(dt), self.markov_w2.weight.to(dt)
        conf_w, conf_b = self.conf_weight().to(dt), self.confidence_head.proj.bias.to(dt)
        step = ops.markov_step if self.use_ops else _markov_step_reference
        prev = anchor
        drafts, qs, confs = [], [], []
        for j in range(hidden.shape[1]):
            t = self.conf_temperature[j].to(dt)
            tok, q, c = step(
                base[:, j].contiguous(),
                prev,
                w1,
                w2,
                hidden[:, j].to(dt).contiguous(),
                (conf_w / t).contiguous(),
                conf_b / t,
                temperature=temperature,
                seeds=seeds,
                positions=offsets + j,
            )
            prev = tok.long()
            drafts.append(prev)
            qs.append(q)
            confs.append(c)
        return torch.stack(drafts, 1), torch.stack(qs, 1), torch.stack(confs, 1)

    @torch.no_grad()
    def draft_logits(self, cache: DFlashCache, anchor: torch.Tensor, ctx_lens: torch.Tensor) -> torch.Tensor:
        """[B, n, V] Markov-head logits along the greedy chain: U_j + W2 W1[x_{j-1}] with x the
        greedy drafts, for callers that speak DFlash's interface (argmax of `draft_logits`
        is exactly DSpark's greedy block); confidences are left in `last_confidence` [B, n].
        The loop uses `propose`, which is also DSpark's sampler at T > 0."""
        hidden = self.draft_states(cache, anchor, ctx_lens)
        base = self.logits(hidden)
        drafts, _, conf = self._markov_chain(hidden, base, anchor)
        self.last_confidence = conf
        prev = torch.cat([anchor[:, None].long(), drafts[:, :-1]], 1)
        return base + F.linear(self.markov_w1(prev), self.markov_w2.weight).float()

    def set_calibration(self, temperatures) -> None:
        t = torch.as_tensor(temperatures, dtype=torch.float32).flatten()
        if t.numel() != self.num_drafts or not bool((t > 0).all()):
            raise ValueError(f"need {self.num_drafts} positive temperatures, got {t.tolist()}")
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

    hidden [..., n, D], base_logits [..., n, V] of the drafting slots, anchor [...]. Returns
    (drafts [..., n], confidence logits [..., n] before calibration), each draft conditioned on the one drawn
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
    max_shard_bytes: int = 0,
    share_with: str | Path | None = None,
) -> None:
    """DeepSpec's format (module docstring): config.json + model.safetensors with every tensor of
    the drafter (not the target's embedding and head), and calibration.json (temperatures and
    their report). With `max_shard_bytes`, shards and their index; with `share_with`, the tensors
    equal to that checkpoint's are read from its files (`io.save_weights`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {n: p.detach().to("cpu", dtype).contiguous() for n, p in drafter.state_dict().items()}
    dataclasses.replace(drafter.config, torch_dtype=str(dtype).removeprefix("torch.")).save(path / "config.json")
    save_weights(state, path, max_shard_bytes, share_with)
    cal = dict(calibration or {})
    cal["temperatures"] = [float(x) for x in drafter.conf_temperature.tolist()]
    (path / CALIBRATION_NAME).write_text(json.dumps(cal, indent=2, sort_keys=True) + "\n")


def load_dspark(
    path: str | Path, target: DecoderForCausalLM, dtype: torch.dtype | None = None, use_ops: bool = True
) -> DSparkDrafter:
    """A DeepSpec-format drafter from a directory, attached to `target`, with its calibration if present."""
    drafter = load_drafter(path, target, DSparkDrafter, DSparkConfig, dtype, use_ops)
    cal = Path(path) / CALIBRATION_NAME
    if cal.is_file():
        drafter.set_calibration(json.loads(cal.read_text())["temperatures"])
    return drafter
