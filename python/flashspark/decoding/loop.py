"""The speculative decoding loop: draft a block, verify it with one ragged
target forward, commit, inject, repeat.

Plain functions in the style of gpt-fast's `speculative_decode`: the whole
loop is `speculative_generate`; statistics (tau, per-position acceptance,
seconds per phase) are returned, never printed. Batched: requests finish at
different times (EOS or max_new_tokens) and then verify 0 tokens and write
nothing to the caches. Lossless at every temperature: greedy output equals
plain greedy decoding token for token, sampled output follows the target's
distribution (tests/test_spec_loop.py).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from .. import ops
from ..models.dflash import DFlashDrafter
from ..models.dflash2 import DFlash2Drafter
from ..models.dspark import DSparkDrafter
from ..models.qwen3 import Qwen3ForCausalLM
from ..scheduling.fixed import FixedK, ScheduleState
from .plain import check_prompts
from .sampling import PURPOSE_DRAFT, PURPOSE_RESAMPLE, sample_logits

PATH_MODES = ("auto", "backtrack", "greedy", "sample")  # auto: backtrack at temperature 0, else sample


class DraftBlock(NamedTuple):
    """One drafted block, whatever the drafter. Draft k (1..γ-1) sits at column k - 1."""

    tokens: torch.Tensor  # [B, γ-1] int64
    probs: torch.Tensor | None = None  # q for verify: dense [B, γ-1, V], sparse [B, γ-1, K], or None (one-hot)
    prob_ids: torch.Tensor | None = None  # [B, γ-1, K] vocabulary ids of sparse q
    logits: torch.Tensor | None = None  # [B, γ-1, V] DFlash draft logits
    confidence: torch.Tensor | None = None  # [B, γ-1] DSpark's calibrated per-token survival
    signals: torch.Tensor | None = None  # [B, γ-1, 4] DFlash 2 path-selector signals (scheduling.proxy.SIGNALS)
    cand_ids: torch.Tensor | None = None  # [B, γ-1, K] DFlash 2 Top-K candidates, best first


def draft_block(
    drafter: DFlashDrafter,
    cache,
    anchor,
    ctx_lens,
    temperature,
    seeds,
    offsets,
    path: str = "auto",
    signals: bool = True,
) -> DraftBlock:
    """Draft γ-1 tokens per request after `anchor`, drawing at Philox positions offsets + 0 .. γ-2.

    DFlash: one parallel pass, each position sampled from its own logits (q dense).
    DFlash 2: Top-K lattice + path selector; `sample` paths carry sparse q over the K
    candidates, deterministic paths (`backtrack`, `greedy`, and every path at temperature 0)
    are verified as one-hot drafts; `auto` = backtrack at temperature 0, else sample;
    `signals=False` skips the path signals that only a confidence proxy reads. DSpark: the Markov head's serial chain (q dense) and
    its confidences.
    """
    sampling = bool((temperature > 0).any())
    if isinstance(drafter, DSparkDrafter):
        tokens, q, conf = drafter.propose(cache, anchor, ctx_lens, temperature, seeds, offsets)
        return DraftBlock(tokens, q if sampling else None, confidence=conf)
    if isinstance(drafter, DFlash2Drafter):
        if path not in PATH_MODES:
            raise ValueError(f"path must be one of {PATH_MODES}, got {path!r}")
        mode = ("sample" if sampling else "backtrack") if path == "auto" else path
        mode = mode if (mode != "sample" or sampling) else "greedy"
        tokens, cand_ids, q, sig = drafter.propose(
            cache, anchor, ctx_lens, mode=mode, temperature=temperature, seeds=seeds, offsets=offsets, signals=signals
        )
        return DraftBlock(
            tokens,
            q,
            cand_ids if q is not None else None,
            signals=None if sig is None else sig.features(),
            cand_ids=cand_ids,
        )
    return draft_dflash_block(drafter, cache, anchor, ctx_lens, temperature, seeds, offsets)


def draft_dflash_block(drafter: DFlashDrafter, cache, anchor, ctx_lens, temperature, seeds, offsets) -> DraftBlock:
    """DFlash's draft: one parallel pass, each position sampled from its own logits (q dense).
    Any DFlash-shaped drafter runs it (a DFlash 2 drafter: its backbone with DFlash's head)."""
    logits = drafter.draft_logits(cache, anchor, ctx_lens)
    g = drafter.block_size
    tokens, q = sample_logits(
        logits,
        temperature,
        seeds,
        offsets[:, None] + torch.arange(g - 1, device=anchor.device),
        PURPOSE_DRAFT,
        want_probs=True,
    )
    return DraftBlock(tokens, q, logits=logits)


@torch.no_grad()
def speculative_generate(
    target: Qwen3ForCausalLM,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    scheduler=None,
    path: str = "auto",
    record: bool = False,
) -> tuple[list[list[int]], dict]:
    """Decode all prompts as one batch; returns (new tokens per prompt, stats).

    A request stops after `eos_id` (included) or `max_new_tokens` tokens.
    `scheduler` (default: FixedK(gamma - 1)) says how many drafts each request
    verifies per step; a scheduler with an `observe(block, num_accepted,
    num_verified)` method hears every step's outcomes, and one with a true
    `wants_signals` attribute gets DFlash 2's path signals. `path` is the DFlash 2
    path mode. Request b draws from the Philox stream of seed `(seed << 32) + b`.
    `record` adds stats["records"]: per request-step confidences / signals and
    outcomes (for calibration reports).
    """
    device = target.model.embed_tokens.weight.device
    g, B = drafter.block_size, len(prompts)
    scheduler = scheduler or FixedK(g - 1)
    want_signals = record or getattr(scheduler, "wants_signals", False)
    K = scheduler.max_spec_len
    if not 0 <= K <= g - 1:
        raise ValueError(f"scheduler.max_spec_len = {K} must lie in [0, block size - 1 = {g - 1}]")
    check_prompts(prompts, max_new_tokens, target.config.max_position_embeddings, target.config.vocab_size)
    clock = _Clock(device)
    if max_new_tokens == 0:
        return [[] for _ in prompts], _stats(
            clock, [], torch.zeros(B), torch.zeros(B), torch.zeros(B), torch.zeros(K), torch.zeros(K), 0
        )
    layers = drafter.config.target_layer_ids
    temp = torch.full((B,), float(temperature), device=device)
    seeds = (seed << 32) + torch.arange(B, device=device)
    ar = torch.arange(g, device=device)

    # 1. Prefill the target (ragged prompts, right-padded), sample the first
    #    token, inject the prompt's context features into the drafter cache.
    lens = torch.tensor([len(p) for p in prompts], device=device)
    P = int(lens.max())
    tokens = torch.zeros(B, P, dtype=torch.int64, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    # Room for a finished request's last commit (up to g past max_new_tokens) plus a block of junk past it.
    tcache = target.new_cache(B, P + max_new_tokens + 2 * g)
    dcache = drafter.new_cache(B, P + max_new_tokens + 2 * g)
    out = target(tokens, tcache, torch.zeros_like(lens), lens, hidden_layers=layers)
    anchor, _ = sample_logits(
        out.logits[torch.arange(B, device=device), lens - 1][:, None],
        temp,
        seeds,
        torch.zeros(B, 1, dtype=torch.int64, device=device),
        PURPOSE_RESAMPLE,
    )
    anchor = anchor[:, 0]
    # Padded positions hold junk features; they are never read (positions >= ctx_len) and get overwritten.
    drafter.inject(
        dcache,
        out.hidden.flatten(0, 1),
        ar.new_tensor(range(P)).repeat(B),
        torch.arange(B, device=device).repeat_interleave(P),
    )
    out_buf = torch.zeros(B, max_new_tokens + 2 * g, dtype=torch.int64, device=device)
    out_buf[:, 0] = anchor
    n_out = torch.ones(B, dtype=torch.int64, device=device)
    active = n_out < max_new_tokens
    if eos_id is not None:
        active &= anchor != eos_id
    offsets = torch.ones(B, dtype=torch.int64, device=device)  # Philox position 0 drew the first token
    steps, accepted, verified = (torch.zeros(B, dtype=torch.int64) for _ in range(3))
    recall = torch.zeros(3, dtype=torch.int64)  # DFlash 2: positions with a known target token, top-1 hits, Top-K hits
    records, plain_steps, iterations = [], 0, 0
    pos_accepted, pos_tried = torch.zeros(K, dtype=torch.int64), torch.zeros(K, dtype=torch.int64)
    slots = torch.arange(B, device=device).repeat_interleave(K + 1)
    clock.tick("prefill")

    while bool(active.any()):
        iterations += 1
        # 2. Draft a block [anchor, MASK...] at positions lens .. lens + g - 1, unless the
        #    scheduler expects a plain decode step to be faster now (then verify 0 drafts).
        drafted = getattr(scheduler, "wants_draft", None) is None or scheduler.wants_draft(active)
        if drafted:
            block = draft_block(drafter, dcache, anchor, lens, temp, seeds, offsets, path, want_signals)
            clock.tick("draft")
            # 3. How many drafts each request verifies (0 for finished requests).
            k_b = scheduler(ScheduleState(active, lens, block.tokens, block.logits, block.confidence, block.signals))
        else:
            block, k_b = DraftBlock(anchor.new_zeros(B, g - 1)), torch.zeros_like(lens)
            plain_steps += 1
        drafts = block.tokens
        clock.tick("schedule")
        # 4. One ragged target forward over [anchor, d_1 .. d_k_b], as wide as the longest;
        #    finished requests write nothing.
        w = K if isinstance(scheduler, FixedK) else int(k_b.max())
        fwd = target(
            torch.cat((anchor[:, None], drafts[:, :w]), 1), tcache, lens, (k_b + 1) * active, hidden_layers=layers
        )
        clock.tick("target")
        # 5. Rejection-sampling verify of the k_b + 1 logits rows per request.
        rows, flat_drafts, cu, flat_q, flat_ids = ragged_rows(
            fwd.logits, drafts[:, :w], k_b, block.probs, block.prob_ids
        )
        vtokens, n_acc = ops.verify(
            rows,
            flat_drafts,
            cu,
            temperature=temp,
            seeds=seeds,
            offsets=offsets,
            max_spec_len=K,
            draft_probs=flat_q,
            draft_probs_ids=flat_ids,
        )
        offsets += g  # the drafter drew g - 1 positions and verify up to K + 1 <= g: never reuse a draw
        clock.tick("verify")
        # 6. Commit accepted drafts + the correction/bonus token; stop at EOS / max_new_tokens.
        live = active.clone()  # the requests verified this step
        vtokens, n_acc = vtokens.long(), n_acc.long()
        if hasattr(scheduler, "observe") and drafted:
            scheduler.observe(block, n_acc, k_b)
        if record and drafted:
            records.append(_record(block, n_acc, k_b, live))
        if block.cand_ids is not None:
            recall += _recall(block.cand_ids, vtokens, n_acc, live)
        n_emit = n_acc + 1
        out_buf.scatter_(1, n_out[:, None] + ar[: K + 1], vtokens)  # columns past n_out + n_emit: overwritten later
        if eos_id is not None:
            hit = (vtokens == eos_id) & (ar[: K + 1] < n_emit[:, None])
            n_emit = torch.where(hit.any(1), hit.long().argmax(1) + 1, n_emit)
            active &= ~hit.any(1)
        n_out += n_emit * live
        active &= n_out < max_new_tokens
        # 7. Inject the committed tokens' features (anchor + accepted drafts: rows 0..n_acc at lens ..).
        #    All w + 1 rows are written; rejected ones sit past the new ctx_len and get overwritten.
        drafter.inject(
            dcache,
            fwd.hidden.flatten(0, 1),
            (lens[:, None] + ar[: w + 1]).flatten(),
            slots if w == K else torch.arange(B, device=device).repeat_interleave(w + 1),
        )
        # 8. Roll both caches back to the committed length: only the lengths move.
        lens += (n_acc + 1) * live
        anchor = torch.where(live, vtokens.gather(1, n_acc[:, None])[:, 0], anchor)
        steps += live.cpu()
        accepted += (n_acc * live).cpu()
        verified += (k_b * live).cpu()
        pos_accepted += ((ar[1 : K + 1] <= n_acc[:, None]) & live[:, None]).sum(0).cpu()
        pos_tried += ((ar[1 : K + 1] <= k_b[:, None]) & live[:, None]).sum(0).cpu()
        clock.tick("commit")

    n_final = n_out.clamp(max=max_new_tokens).tolist()
    outputs = [row[:n] for row, n in zip(out_buf.tolist(), n_final)]
    stats = _stats(clock, outputs, steps, accepted, verified, pos_accepted, pos_tried, B)
    stats["plain_steps"] = plain_steps  # loop iterations the scheduler ran as plain decode steps
    # Loop iterations (one target forward each, whole batch): requests finish at different
    # iterations, so there are more of these than steps per request.
    stats["iterations"] = iterations
    if int(recall[0]):
        stats["recall_top1"], stats["recall_topk"] = (recall[1:] / recall[0]).tolist()
        stats["recall_positions"] = int(recall[0])
    if record:
        stats["records"] = {
            k: torch.cat([r[k] for r in records]) if records and records[0][k] is not None else None
            for k in ("confidence", "signals", "num_accepted", "num_verified")
        }
    return outputs, stats


def ragged_rows(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    k_b: torch.Tensor,
    q: torch.Tensor | None = None,
    q_ids: torch.Tensor | None = None,
):
    """Flatten per-request verify inputs: request b keeps logits rows 0..k_b[b]
    (k_b drafts + bonus), drafts, q and q_ids rows 0..k_b[b]-1 (of the first K =
    logits.shape[1] - 1 draft columns). Returns (logits rows [T + B, V], drafts [T],
    cu_num_draft [B + 1], q [T, V or K] or None, q_ids [T, K] or None)."""
    B, S = logits.shape[:2]
    cu = torch.zeros(B + 1, dtype=torch.int64, device=logits.device)
    torch.cumsum(k_b, 0, out=cu[1:])
    q = None if q is None else q[:, : S - 1]
    q_ids = None if q_ids is None else q_ids[:, : S - 1]
    if bool((k_b == S - 1).all()):  # the common case: no gather
        flat = (None if x is None else x.flatten(0, 1).contiguous() for x in (q, q_ids))
        return (logits.flatten(0, 1), drafts.flatten(), cu, *flat)
    ar = torch.arange(S, device=logits.device)
    keep = ar[: S - 1] < k_b[:, None]
    return (logits[ar <= k_b[:, None]], drafts[keep], cu, *(None if x is None else x[keep] for x in (q, q_ids)))


def _recall(cand_ids, vtokens, n_acc, live) -> torch.Tensor:
    """[known, top-1 hits, Top-K hits] of the drafter's candidate lists at the block
    positions whose target token the verify step revealed (accepted drafts and the
    correction or bonus token: positions 0 .. n_acc)."""
    J = min(cand_ids.shape[1], vtokens.shape[1])
    tgt = vtokens[:, :J]
    known = (torch.arange(J, device=tgt.device) <= n_acc[:, None]) & live[:, None]
    top1 = (cand_ids[:, :J, 0] == tgt) & known
    topk = (cand_ids[:, :J] == tgt[..., None]).any(-1) & known
    return torch.stack([known.sum(), top1.sum(), topk.sum()]).cpu()


def _record(block: DraftBlock, n_acc, k_b, live) -> dict:
    """The live requests' confidences / signals and outcomes of one step, on the CPU."""
    rows = live.nonzero()[:, 0]
    pick = lambda x: None if x is None else x[rows].float().cpu()  # noqa: E731
    return {
        "confidence": pick(block.confidence),
        "signals": pick(block.signals),
        "num_accepted": n_acc[rows].cpu(),
        "num_verified": k_b[rows].cpu(),
    }


class _Clock:
    """Seconds per phase (synchronizing on CUDA so each phase owns its kernels)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def tick(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


def _stats(clock: _Clock, outputs, steps, accepted, verified, pos_accepted, pos_tried, batch) -> dict:
    seconds = clock.last - clock.start
    new_tokens = sum(len(o) for o in outputs)
    total_steps = int(steps.sum())
    decode = seconds - clock.seconds.get("prefill", 0.0)
    return {
        "requests": batch,
        "new_tokens": new_tokens,
        "steps": total_steps,
        # tau: tokens a request gains per target forward (accepted drafts + 1), over all request-steps.
        "tau": (int(accepted.sum()) + total_steps) / max(1, total_steps),
        "tau_per_request": ((accepted + steps) / steps.clamp(min=1)).tolist(),
        # Drafts sent to the target per request-step, and those of them rejected (verify work wasted).
        "verified_per_step": int(verified.sum()) / max(1, total_steps),
        "drafts_verified": int(verified.sum()),
        "drafts_wasted": int(verified.sum() - accepted.sum()),
        # Fraction of request-steps whose draft k (k = 1..K) was accepted, among those that verified it.
        "acceptance_per_position": (pos_accepted / pos_tried.clamp(min=1)).tolist(),
        "seconds": seconds,
        "prefill_seconds": clock.seconds.get("prefill", 0.0),
        "decode_seconds": decode,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
        "phase_seconds": dict(clock.seconds),
    }
