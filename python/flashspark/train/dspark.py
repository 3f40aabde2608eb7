"""Distil the DSpark drafter from the shipped target on CPU, then calibrate its confidences.

Data, anchors, masks and the budgeted loop are the DFlash trainer's
(`train.dflash.train_drafter`). The drafter is trained in DeepSpec's slot layout by default
(`--sample-from-anchor`: γ drafts per block, the anchor's slot drafting the next token; the
DFlash layout's γ - 1 with `--no-sample-from-anchor`). The loss (docs/dflash2_dspark.md,
"DSpark drafter"), per draft j = 1..n weighted by exp(-(j-1)/γ_d) as DeepSpec weighs it, with
teacher forcing (x_{j-1} = the true previous token):

    0.1 · CE(Markov logits, target's greedy token)
  + 0.9 · TV(q, p)                 q = softmax(Markov logits), p = the target's distribution
  + 1.0 · BCE(c_k, c*_k)           c*_k = 1 − TV(q, p), detached

p is the target's next-token distribution at that position, over the whole vocabulary from
a target forward of every batch, as DeepSpec computes it (c* = 1 − ½‖q − p‖₁ exactly; the
default, `--exact-tv`). `--no-exact-tv` keeps p as its Top-K (`--target-topk`, computed
once over the generated data) and uses a lower bound of the TV: exact on those K tokens,
the total remaining mass for the rest. On this CPU the exact form costs 1.8x (tiny target)
to 2.1x (SmolLM2) a training step, and the bound raises c* by 0.05-0.07 on average (up to
0.6 at a position): `bench/dspark_tv_bench.py`, bench/results/dspark_tv_bench*.json.

**Calibration**: after training, the confidence logits get per-position
temperatures T_k, fitted sequentially on a held-out calibration split
(disjoint from the evaluation prompts): T_1, then T_2 given T_1, ..., each
minimizing the log loss of the cumulative product a_k = ∏_{i≤k} σ(z_i / T_i)
against the cumulative outcome "drafts 1..k all accepted" (temperature 0:
accepted = equal to the target's greedy token). ECE of a_k and AUC are
reported before and after (the metrics of `scheduling.calibration`, shared with the
DFlash 2 confidence proxy), on the calibration and the evaluation split, and
saved with the drafter (`calibration.json`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import data
from ..models.dflash import block_mask, packed_blocks
from ..models.dspark import DSparkConfig, DSparkDrafter, load_dspark, markov_rollout, save_dspark
from ..scheduling.calibration import calibration_report as block_calibration_report
from ..scheduling.calibration import expected_calibration_error
from .common import (
    DerivedDrafterArgs,
    backbone_line,
    block_targets,
    command_lines,
    data_description,
    data_pool,
    eval_anchors,
    eval_batch,
    eval_description,
    eval_set,
    gather_positions,
    generate_sequences,
    init_from_target,
    position_weights,
    publish,
    rows_anchors,
    run_facts,
    setup_run,
    start_backbone,
    target_description,
    train_drafter,
    valid_blocks,
)
from .target_data import TargetData

DEFAULT_EXPORT = data.ASSETS_DIR / "dspark"


@dataclass
class DSparkTrainArgs(DerivedDrafterArgs):
    out: str = "runs/dspark"
    export: str = str(DEFAULT_EXPORT)
    markov_rank: int = 64
    target_topk: int = 32  # Top-K of the target's distribution kept for TV and c*
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    calib_sequences: int = 64  # held-out prompts for calibration (disjoint from the evaluation ones)
    calib_from: str = ""  # `train data --split calibration` directory ("" = held-out code prompts generated here)
    sample_from_anchor: bool = True  # DeepSpec's slot layout (models/dspark.py)
    exact_tv: bool = (
        True  # TV and c* over the full vocabulary (DeepSpec's; a target forward per batch), else the Top-K bound
    )


# ------------------------------------------------------------------- target distributions
@torch.no_grad()
def target_topk(target, tokens: torch.Tensor, k: int, batch: int = 32):
    """The target's Top-k next-token log-probs for every position of sequences tokens [N, L]:
    (ids [N, L, k] int16/int32, logp [N, L, k] fp16); row t is the distribution of token t
    given tokens < t (row 0 is empty: ids 0, logp -inf)."""
    N, L = tokens.shape
    id_dtype = torch.int16 if target.config.vocab_size <= 2**15 else torch.int32
    ids = torch.zeros(N, L, k, dtype=id_dtype)
    logp = torch.full((N, L, k), float("-inf"), dtype=torch.float16)
    for i in range(0, N, batch):
        lp = torch.log_softmax(target(tokens[i : i + batch, :-1]).logits.float(), -1)
        v, j = lp.topk(k, -1)
        ids[i : i + batch, 1:] = j.to(id_dtype)
        logp[i : i + batch, 1:] = v.to(torch.float16)
    return ids, logp


def cached_topk(target, tokens: torch.Tensor, k: int, path: Path, log=print):
    if path.is_file():
        d = torch.load(path)
        if d["ids"].shape[:2] == tokens.shape and d["ids"].shape[2] == k:
            return d["ids"], d["logp"]
    t0 = time.time()
    ids, logp = target_topk(target, tokens, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    data.atomic_write(path, lambda f: torch.save({"ids": ids, "logp": logp}, f))
    log(f"target top-{k} distributions of {tokens.shape[0]} sequences in {time.time() - t0:.0f} s")
    return ids, logp


@torch.no_grad()
def target_next_logp(target, tokens: torch.Tensor, anchors: torch.Tensor, span: int) -> torch.Tensor:
    """The target's full next-token log-probs [B, nb, span-1, V] at the drafted positions
    anchor + 1 .. anchor + span - 1 (the distribution of token t is the logits row t - 1),
    from one forward of the batch's sequences [B, L] (right padding, read by no anchor)."""
    B, nb = anchors.shape
    logits = target(tokens.clamp(min=0)).logits  # [B, L, V]
    rows = (anchors[..., None] + torch.arange(span - 1, device=anchors.device)).flatten(1)  # row t - 1 for t = a + 1 ..
    picked = logits.gather(1, rows[..., None].expand(-1, -1, logits.shape[-1]))
    return torch.log_softmax(picked.float(), -1).view(B, nb, span - 1, -1)


def exact_tv(q: torch.Tensor, p_logp: torch.Tensor) -> torch.Tensor:
    """½‖q − p‖₁ [...] over the whole vocabulary, q and p [..., V] (p as log-probs)."""
    return 0.5 * (q - p_logp.exp()).abs().sum(-1)


def sparse_tv(q: torch.Tensor, p_ids: torch.Tensor, p_logp: torch.Tensor) -> torch.Tensor:
    """½‖q − p‖₁ [...] for dense q [..., V] and p given by its Top-K (ids, log-probs) [..., K]:
    exact on the K tokens, |mass_p − mass_q| for the rest (a lower bound)."""
    p = p_logp.float().exp()
    qk = q.gather(-1, p_ids.long())
    rest = ((1 - p.sum(-1)) - (1 - qk.sum(-1))).abs()
    return 0.5 * ((p - qk).abs().sum(-1) + rest)


# ------------------------------------------------------------------- loss
def dspark_forward(drafter: DSparkDrafter, feats, tokens, anchors):
    """Packed training forward: draft states h and base logits U [B, nb, n, ...] of the drafting slots."""
    g, first = drafter.block_size, drafter.config.first_draft_slot
    B, nb = anchors.shape
    bt, pos = packed_blocks(tokens, anchors, g, drafter.config.mask_token_id)
    hidden = drafter(feats, bt, pos, block_mask(anchors, feats.shape[1], g)).view(B, nb, g, -1)[:, :, first:]
    return hidden, drafter.logits(hidden)


def dspark_loss(
    drafter: DSparkDrafter,
    feats,
    tokens,
    labels,
    anchors,
    p_ids,
    p_logp,
    weights,
    coefs=(0.1, 0.9, 1.0),
    p_full=None,
    exact_rows=None,
):
    """0.1·CE + 0.9·TV + 1.0·BCE(conf, 1 − TV), position-weighted, teacher forced.
    p_ids / p_logp [B, L, K]: the target's Top-K per position (the TV bound); or p_full
    [B, nb, n, V]: its full log-probs at the drafted positions (`target_next_logp`, exact TV);
    with both, `exact_rows` [B] bool says which rows take the exact TV (the others the bound).
    Returns (loss, stats)."""
    span = drafter.num_drafts + 1
    hidden, base = dspark_forward(drafter, feats, tokens, anchors)
    prev, target = block_targets(tokens, labels, anchors, span)
    logits, z = drafter.heads(hidden, base, prev)
    q = torch.softmax(logits, -1)
    if p_full is not None:
        tv = exact_tv(q, p_full)
    if p_ids is not None:
        bound = sparse_tv(q, gather_positions(p_ids, anchors, span), gather_positions(p_logp, anchors, span))
        tv = bound if p_full is None else torch.where(exact_rows[:, None, None], tv, bound)
    c_star = (1 - tv).detach().clamp(0, 1)
    ce = F.cross_entropy(logits.flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    bce = F.binary_cross_entropy_with_logits(z, c_star, reduction="none")
    w = weights / (weights.sum() * target.shape[0] * target.shape[1])
    parts = [(x * w).sum() for x in (ce, tv, bce)]
    loss = sum(c * x for c, x in zip(coefs, parts))
    stats = {
        "ce": parts[0].item(),
        "tv": parts[1].item(),
        "bce": parts[2].item(),
        "acc1": (logits[..., 0, :].argmax(-1) == target[..., 0]).float().mean().item(),
        "c*": c_star.mean().item(),
        "conf": torch.sigmoid(z.detach()).mean().item(),
    }
    return loss, stats


# ------------------------------------------------------------------- evaluation
@torch.no_grad()
def rollout_outcomes(drafter: DSparkDrafter, ev: dict, prompt_tokens: int, batch: int = 8):
    """Greedy Markov drafts at every anchor of the continuation (as `train.dflash.evaluate`):
    (accepted [blocks, γ-1] bool: draft k equals the target's greedy token, confidence logits
    z [blocks, γ-1] before calibration)."""
    was = drafter.training
    drafter.eval()
    span = drafter.num_drafts + 1
    anchors = eval_anchors(ev, prompt_tokens, span)
    batch = eval_batch(ev, anchors, span, drafter.config.vocab_size, batch)
    acc, zs = [], []
    for i in range(0, ev["tokens"].shape[0], batch):
        sl = slice(i, i + batch)
        tokens, labels = ev["tokens"][sl], ev["labels"][sl]
        an = rows_anchors(anchors, sl, tokens.shape[0])
        hidden, base = dspark_forward(drafter, ev["features"][sl].float(), tokens, an)
        drafts, z = markov_rollout(drafter, hidden, base, tokens.gather(1, an))
        acc.append(valid_blocks(ev, sl, drafts == block_targets(tokens, labels, an, span)[1]))
        zs.append(valid_blocks(ev, sl, z))
    drafter.train(was)
    return torch.cat(acc).cpu(), torch.cat(zs).cpu()


def evaluate_dspark(drafter: DSparkDrafter, ev: dict, prompt_tokens: int) -> dict:
    """Held-out acceptance (T = 0) of the greedy Markov drafts, tau, and the calibration report
    of the drafter's current confidence temperatures."""
    acc, z = rollout_outcomes(drafter, ev, prompt_tokens)
    prefix = acc.float().cumprod(1).mean(0)
    rep = temperature_calibration_report(z, acc, drafter.conf_temperature.float())
    return {
        "acceptance": prefix.tolist(),
        "top1": acc.float().mean(0).tolist(),
        "tau": 1 + float(prefix.sum()),
        "blocks": acc.shape[0],
        "calibration": rep,
    }


# ------------------------------------------------------------------- calibration
def cumulative_confidence(z: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """a [N, P] = cumulative product of σ(z_k / T_k) along positions."""
    return torch.sigmoid(z.double() / temperatures.double()).cumprod(-1)


def fit_sequential_temperatures(z: torch.Tensor, accepted: torch.Tensor, grid: torch.Tensor | None = None):
    """Per-position temperatures [P], fitted in order: T_k minimizes the log loss of
    a_k = a_{k-1} · σ(z_k / T_k) against y_k = 1[drafts 1..k all accepted], given T_1..T_{k-1}.
    z, accepted [N, P]. Grid search over log T (default 0.05 .. 20, 261 points: bounded so
    that a position whose outcome never varies cannot drive T to 0 or infinity)."""
    z, y = z.double(), accepted.double().cumprod(-1)
    grid = torch.logspace(-1.3, 1.3, 261, dtype=torch.float64) if grid is None else grid.double()
    a_prev = torch.ones(z.shape[0], dtype=torch.float64)
    temps = []
    eps = 1e-12
    for k in range(z.shape[1]):
        a = a_prev[None] * torch.sigmoid(z[None, :, k] / grid[:, None])  # [G, N]
        nll = -(y[None, :, k] * torch.log(a + eps) + (1 - y[None, :, k]) * torch.log1p(-a + eps)).mean(-1)
        best = int(torch.argmin(nll))
        temps.append(float(grid[best]))
        a_prev = a[best]
    return torch.tensor(temps, dtype=torch.float32)


def temperature_calibration_report(z: torch.Tensor, accepted: torch.Tensor, temperatures: torch.Tensor) -> dict:
    """`scheduling.calibration.calibration_report` (ECE of the cumulative product, AUC of c_k against the
    conditional outcome: the same metrics as the DFlash 2 confidence proxy) of σ(z / T) for blocks
    verified in full, plus the ECE of a_k and the mean a_k and outcome per position.
    z, accepted [N, P]: confidence logits and per-position acceptance."""
    conf = torch.sigmoid(z.double() / temperatures.double())
    num_accepted = accepted.long().cumprod(-1).sum(-1)
    P = z.shape[1]
    rep = block_calibration_report(conf, num_accepted, torch.full_like(num_accepted, P))
    rep.pop("reliability")
    a, y = conf.cumprod(-1), accepted.double().cumprod(-1)
    return rep | {
        "ece_per_position": [expected_calibration_error(a[:, k], y[:, k]) for k in range(P)],
        "mean_confidence": a.mean(0).tolist(),
        "mean_outcome": y.mean(0).tolist(),
    }


def temperature_fit_prompts(a, tok) -> torch.Tensor:
    """Held-out code prompts for calibration, none of them an evaluation prompt."""
    ev = {tuple(p) for p in data.heldout_prompts("code", a.eval_sequences, a.prompt_tokens, tok)}
    pool = data.heldout_prompts("code", a.eval_sequences + a.calib_sequences, a.prompt_tokens, tok)
    picks = [p for p in pool if tuple(p) not in ev][: a.calib_sequences]
    return torch.tensor(picks)


def calibrate(drafter: DSparkDrafter, calib: dict, ev: dict, prompt_tokens: int) -> dict:
    """Fit the temperatures on `calib`, set them on the drafter, report before/after on both splits."""
    acc_c, z_c = rollout_outcomes(drafter, calib, prompt_tokens)
    acc_e, z_e = rollout_outcomes(drafter, ev, prompt_tokens)
    ones = torch.ones(drafter.num_drafts)
    temps = fit_sequential_temperatures(z_c, acc_c)
    drafter.set_calibration(temps)
    return {
        "temperatures_fitted": temps.tolist(),
        "calibration_blocks": int(acc_c.shape[0]),
        "before": {
            "calibration_split": temperature_calibration_report(z_c, acc_c, ones),
            "eval_split": temperature_calibration_report(z_e, acc_e, ones),
        },
        "after": {
            "calibration_split": temperature_calibration_report(z_c, acc_c, temps),
            "eval_split": temperature_calibration_report(z_e, acc_e, temps),
        },
        "outcome": "temperature 0: draft k accepted iff it equals the target's greedy token",
    }


# ------------------------------------------------------------------- train
def train(a: DSparkTrainArgs) -> dict:
    wall_start = time.time()
    out, log, tok, target, mask_id = setup_run(a)
    config = DSparkConfig.for_target(
        target.config,
        num_hidden_layers=a.layers,
        block_size=a.block_size,
        mask_token_id=mask_id,
        intermediate_size=a.intermediate_size or None,
        markov_rank=a.markov_rank,
        sample_from_anchor=a.sample_from_anchor,
    )
    if a.share_backbone and a.sample_from_anchor:
        raise ValueError(
            "--share-backbone keeps the DFlash backbone frozen, whose slots draft in DFlash's layout; DeepSpec's "
            "layout (--sample-from-anchor) fine-tunes the whole backbone: drop --share-backbone (--init-from "
            "still starts from it), or train with --no-sample-from-anchor"
        )
    span = config.num_drafts + 1
    decay = a.gamma_d()
    layer_ids = config.target_layer_ids
    ev = eval_set(target, a, layer_ids, out, tok, span)
    calib_path = out / "calib.pt"
    if a.calib_from:
        held = TargetData(a.calib_from)
        held.check_for(target, layer_ids)
        calib = held.eval_set(span, a.window, a.calib_sequences)
    elif calib_path.is_file():
        calib = torch.load(calib_path)
    else:
        calib = dict(
            zip(
                ("tokens", "features", "labels"),
                generate_sequences(target, temperature_fit_prompts(a, tok), 128, layer_ids),
            )
        )
        data.atomic_write(calib_path, lambda f: torch.save(calib, f))
    gen_budget = max(30.0, a.gen_frac * a.minutes * 60 - (time.time() - wall_start))
    pool = data_pool(target, a, layer_ids, out, tok, gen_budget, log)
    if a.exact_tv:  # the full distribution comes from a target forward of each batch
        p_ids = p_logp = None
    elif isinstance(pool, TargetData):  # the target's Top-K was kept with the data
        if pool.definition["top_k"] < a.target_topk:
            raise ValueError(
                f"{a.data_from} keeps the target's top-{pool.definition['top_k']}; asked for {a.target_topk}"
            )
        p_ids = p_logp = None
    else:
        p_ids, p_logp = cached_topk(
            target, pool["tokens"], a.target_topk, out / "data" / f"target_top{a.target_topk}.pt", log
        )

    torch.manual_seed(a.seed)
    drafter = DSparkDrafter(config, target, use_ops=False).to(a.device)
    drafter.init_weights(a.seed)
    init_from_target(drafter, target, False)
    start_backbone(drafter, a, target, log)
    weights = position_weights(span, decay, first=1)  # exp(-(j-1)/γ_d), drafts j = 1..n (DeepSpec's)
    coefs = (a.ce_weight, a.tv_weight, a.conf_weight)

    def loss_fn(d, b):
        full = exact_rows = ids = logp = None
        if a.exact_tv:
            full = target_next_logp(target, b["tokens"], b["anchors"], span)
            cut = b.get("cut")
            # Rows cut to --window: the target saw less context than the data's; they take the stored bound.
            exact_rows = cut == 0 if cut is not None and bool((cut > 0).any()) else None
        if full is None or exact_rows is not None:
            if p_ids is None:  # the Top-K stored with the data
                ids, logp = b["topk_ids"][..., : a.target_topk], b["topk_logp"][..., : a.target_topk]
            else:
                ids, logp = p_ids[b["idx"]], p_logp[b["idx"]]
        feats, tokens, labels, anchors = b["features"], b["tokens"], b["labels"], b["anchors"]
        return dspark_loss(d, feats, tokens, labels, anchors, ids, logp, weights, coefs, full, exact_rows)

    def eval_fn(d):
        return evaluate_dspark(d, ev, a.prompt_tokens)

    run = train_drafter(a, drafter, target, config, pool, loss_fn, eval_fn, wall_start, log, "train dspark")
    return export(drafter, target, ev, calib, a, config, run, decay, log)


def export(drafter, target, ev, calib, a, config, run, decay, log) -> dict:
    """Calibrate, write the bf16 drafter with calibration.json, and measure what ships."""
    cal = calibrate(drafter, calib, ev, a.prompt_tokens)
    export_dir = Path(a.export)
    save_dspark(drafter, export_dir, dtype=torch.bfloat16, calibration=cal, **a.export_options())
    shipped = load_dspark(export_dir, target, dtype=torch.float32)
    final = evaluate_dspark(shipped, ev, a.prompt_tokens)
    summary = {
        "final": final,
        "calibration": cal,
        "params": shipped.num_parameters(),
        "head_params": sum(
            p.numel() for n, p in shipped.named_parameters() if n.startswith(("markov_head.", "confidence_head."))
        ),
        **run_facts(a, config, target, decay, run),
    }
    publish(summary, a.out, export_dir, write_model_card)
    b, f = cal["before"]["eval_split"], final["calibration"]
    log(
        f"exported to {export_dir}: held-out tau {final['tau']:.3f}; eval-split ECE {b['ece_cumulative']:.3f} -> "
        f"{f['ece_cumulative']:.3f}, "
        f"AUC {b['auc']:.3f} -> {f['auc']:.3f}"
    )
    return summary


def write_model_card(path: Path, s: dict) -> None:
    c, a, f, cal = s["config"], s["args"], s["final"], s["calibration"]
    g, n = c["block_size"], len(f["top1"])
    fc = f["calibration"]
    acc = "\n".join(
        f"| {k + 1} | {f['top1'][k]:.3f} | {f['acceptance'][k]:.3f} | {fc['mean_confidence'][k]:.3f} | "
        f"{cal['temperatures_fitted'][k]:.3f} | {cal['before']['eval_split']['ece_per_position'][k]:.3f} | "
        f"{fc['ece_per_position'][k]:.3f} |"
        for k in range(n)
    )
    rows = "\n".join(
        f"| {r['step']} | {r['minutes']:.1f} | {r['train_loss']:.3f} | {r['tau']:.2f} |" for r in s["history"]
    )
    bc, ac = cal["before"]["calibration_split"], cal["after"]["calibration_split"]
    be, ae = cal["before"]["eval_split"], cal["after"]["eval_split"]
    tv_line = (
        "TV and c* = 1 − TV over the whole vocabulary, from a target forward of every batch (DeepSpec's)"
        if a.get("exact_tv")
        else f"TV and c* from the target's Top-{a['target_topk']} at every position (a lower bound of the TV)"
    )
    data_line = data_description(s) or (
        f"{s['sequences']:,} target-generated sequences of {s['seq_len']} tokens"
        + (f" (reused from {a['data_from']})" if a["data_from"] else "")
    )
    text = f"""# flashspark DSpark drafter for {s.get("target_name", "tiny")}

A DSpark drafter for {target_description(s)}: a DFlash backbone gives
the block's base logits U_k in one pass; a Markov head adds W2·W1[x_(k−1)] and
drafts left to right (`flashspark.ops.markov_step`); a confidence head predicts
the chance each draft survives verification, calibrated per position
(`calibration.json`). Trained by distillation from that target on CPU.

## Architecture

| field | value |
|---|---|
| backbone | DFlash: {c["num_hidden_layers"]} Qwen3 layers, hidden {c["hidden_size"]}, features from target layers {c["target_layer_ids"]} of {s["target_layers"]} |
| Markov head | W1 Embedding({c["vocab_size"]}, {c["markov_rank"]}), W2 Linear({c["markov_rank"]}, {c["vocab_size"]}) |
| confidence head | σ(Linear([h_k ; W1[x_(k−1)]]) / T_k) |
| block size γ | {g}: {n} drafts per block ({"DeepSpec's layout: the anchor's slot drafts the next token" if c.get("sample_from_anchor") else "DFlash's layout: slot k drafts the token at anchor + k"}) |
| checkpoint | DeepSpec's format (`Qwen3DSparkModel`, `markov_head.*`, `confidence_head.proj.*`) |
| parameters | {s["params"]:,} ({s["head_params"]:,} in the heads; target: {s["target_params"]:,}) |
| shipped dtype | bfloat16 |

## Training

```
{command_lines(s, "python -m flashspark train dspark")}
```

- Hardware: {s["hardware"]}; torch {s["torch"]}, {a["threads"]} threads.
- Data: {data_line}; {tv_line}.
- Backbone{backbone_line(a, "the Markov and confidence heads")}; {s["step"]:,} steps of
  {a["batch_size"]} sequences × {a["blocks_per_seq"]} anchors. Loss {a["ce_weight"]:g}·CE + {a["tv_weight"]:g}·TV +
  {a["conf_weight"]:g}·BCE(c, 1 − TV), draft j weighted exp(−(j−1)/{s["decay"]:g}), teacher forced.
- Training time {s["train_minutes"]:.1f} min; wall time {s["wall_minutes"]:.1f} min.

## Held-out acceptance and confidence (temperature 0)

Shipped bf16 weights computed in fp32; greedy Markov drafts (one block) at
{eval_description(a)} ({f["blocks"]:,} blocks).
"accepted" = drafts 1..k all equal the target's greedy tokens; "confidence" = mean
calibrated a_k = ∏ c_i; ECE of a_k before/after calibration on this evaluation split.

| k | top-1 | accepted | confidence | T_k | ECE before | ECE after |
|---|---|---|---|---|---|---|
{acc}

τ (K = {n}): **{f["tau"]:.2f}**.

Calibration ({cal["calibration_blocks"]:,} blocks of {a["calib_sequences"]} other held-out prompts): ECE of the
cumulative product over all positions, AUC of c_k against the conditional outcome:

| split | ECE before | ECE after | AUC before | AUC after |
|---|---|---|---|---|
| calibration | {bc["ece_cumulative"]:.4f} | {ac["ece_cumulative"]:.4f} | {bc["auc"]:.3f} | {ac["auc"]:.3f} |
| evaluation | {be["ece_cumulative"]:.4f} | {ae["ece_cumulative"]:.4f} | {be["auc"]:.3f} | {ae["auc"]:.3f} |

| step | minutes | train loss | held-out τ |
|---|---|---|---|
{rows}
"""
    path.write_text(text)
