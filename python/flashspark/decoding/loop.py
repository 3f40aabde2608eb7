"""The speculative decoding loop: draft a block, verify it with one ragged
target forward, commit, inject, repeat.

In the style of gpt-fast's `speculative_decode`: the whole loop is
`speculative_generate`, reading top to bottom; it calls the drafter through
`propose` (models/drafter.py) and the scheduler through `Scheduler`
(scheduling/base.py), and its statistics (tau, per-position acceptance, seconds
per phase) are accumulated by `LoopStats` and returned, never printed. Batched:
requests finish at different times (EOS or max_new_tokens) and then verify 0
tokens and write nothing to the caches. Lossless at every temperature: greedy
output equals plain greedy decoding token for token, sampled output follows the
target's distribution (tests/decoding/test_loop.py).
"""

from __future__ import annotations

import torch

from .. import ops
from ..models.decoder import DecoderForCausalLM
from ..models.dflash import DFlashDrafter
from ..models.dflash2 import PATH_MODES
from ..models.drafter import DraftBlock
from ..ops.sampling import PURPOSE_RESAMPLE, sample_logits
from ..scheduling import FixedK, Scheduler, ScheduleState
from .plain import check_prompts
from .stats import LoopStats

__all__ = ["PATH_MODES", "speculative_generate", "ragged_rows"]


@torch.no_grad()
def speculative_generate(
    target: DecoderForCausalLM,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    scheduler: Scheduler | None = None,
    path: str = "auto",
    record: bool = False,
) -> tuple[list[list[int]], dict]:
    """Decode all prompts as one batch; returns (new tokens per prompt, stats).

    A request stops after `eos_id` (included) or `max_new_tokens` tokens. `scheduler`
    (default: FixedK(drafter.num_drafts): γ - 1, or γ in DeepSpec's layout) says how many drafts
    each request verifies per step.
    `path` is the DFlash 2 path mode. Request b draws from the Philox stream of seed
    `(seed << 32) + b`. `record` adds stats["records"]: per request-step confidences /
    signals and outcomes (for calibration reports).
    """
    device = target.model.embed_tokens.weight.device
    g, n, B = drafter.block_size, drafter.num_drafts, len(prompts)
    scheduler = scheduler or FixedK(n)
    K = scheduler.max_spec_len
    if not 0 <= K <= n:
        raise ValueError(f"scheduler.max_spec_len = {K} must lie in [0, drafts per block = {n}]")
    check_prompts(prompts, max_new_tokens, target.config.max_position_embeddings, target.config.vocab_size)
    stats = LoopStats(B, K, device, record)
    if max_new_tokens == 0:
        return [[] for _ in prompts], stats.result([])
    layers, want_signals = drafter.config.target_layer_ids, record or scheduler.wants_signals
    temp = torch.full((B,), float(temperature), device=device)
    seeds = (seed << 32) + torch.arange(B, device=device)
    ar, rows_b = torch.arange(n + 1, device=device), torch.arange(B, device=device)

    # 1. Prefill the target, sample the first token, inject the prompt's features into the drafter cache.
    # Room past the longest output: a finished request keeps being written up to K + 1 columns past
    # its last token, and a live one's last step may overrun max_new_tokens by K: 2 (n + 1).
    room = max_new_tokens + 2 * max(g, n + 1)
    tcache, dcache, lens, anchor = prefill(target, drafter, prompts, room, temp, seeds)
    out_buf = torch.zeros(B, room, dtype=torch.int64, device=device)
    out_buf[:, 0] = anchor
    n_out = torch.ones(B, dtype=torch.int64, device=device)
    active = (n_out < max_new_tokens) & (anchor != eos_id if eos_id is not None else True)
    offsets = torch.ones(B, dtype=torch.int64, device=device)  # Philox position 0 drew the first token
    slots = rows_b.repeat_interleave(K + 1)
    stats.tick("prefill")

    while (left := int(torch.where(active, max_new_tokens - n_out, 0).max())) > 0:
        # 2. Draft a block [anchor, MASK...] at positions lens .. lens + g - 1, unless the
        #    scheduler expects a plain decode step to be faster now (then verify 0 drafts). Near
        #    max_new_tokens the block is shorter, no more drafts than any request still wants
        #    (the reference does the same: its drafts there are its shorter block's).
        if drafted := scheduler.wants_draft(active):
            width = min(n, left)
            block = drafter.propose(dcache, anchor, lens, temp, seeds, offsets, path, want_signals, num_drafts=width)
            block = widen(block, n) if width < n else block
            stats.tick("draft")
            # 3. How many drafts each request verifies (0 for finished requests), never past
            #    its max_new_tokens (what depends on counts only leaves verify lossless).
            k_b = scheduler.plan(
                ScheduleState(active, lens, block.tokens, block.logits, block.confidence, block.signals)
            )
            k_b = torch.minimum(k_b, (max_new_tokens - n_out).clamp(min=0)) if width < n else k_b
        else:
            block, k_b = DraftBlock(anchor.new_zeros(B, n)), torch.zeros_like(lens)
        stats.tick("schedule")
        # 4. One ragged target forward over [anchor, d_1 .. d_k_b], as wide as the longest;
        #    finished requests write nothing.
        w = K if scheduler.fixed_width else int(k_b.max())
        fwd = target(torch.cat((anchor[:, None], block.tokens[:, :w]), 1), tcache, lens, (k_b + 1) * active, layers)
        stats.tick("target")
        # 5. Rejection-sampling verify of the k_b + 1 logits rows per request.
        rows, drafts, cu, q, q_ids = ragged_rows(fwd.logits, block.tokens[:, :w], k_b, block.probs, block.prob_ids)
        vtokens, n_acc = ops.verify(
            rows, drafts, cu, temperature=temp, seeds=seeds, offsets=offsets, max_spec_len=K, draft_probs=q,
            draft_probs_ids=q_ids,
        )  # fmt: skip
        offsets += n + 1  # the drafter drew n positions and verify up to K + 1 <= n + 1: never reuse a draw
        stats.tick("verify")
        # 6. Commit accepted drafts + the correction/bonus token; stop at EOS / max_new_tokens.
        live, vtokens, n_acc = active.clone(), vtokens.long(), n_acc.long()  # live: the requests verified this step
        if drafted:
            scheduler.observe(block, n_acc, k_b)
        stats.step(block, drafted, vtokens, n_acc, k_b, live)
        n_out, active = emit(out_buf, n_out, active, vtokens, n_acc, live, eos_id, max_new_tokens)
        # 7. Inject the committed tokens' features (anchor + accepted drafts: rows 0..n_acc at lens ..).
        #    All w + 1 rows are written; rejected ones sit past the new ctx_len and get overwritten.
        positions = (lens[:, None] + ar[: w + 1]).flatten()
        drafter.inject(
            dcache, fwd.hidden.flatten(0, 1), positions, slots if w == K else rows_b.repeat_interleave(w + 1)
        )
        # 8. Roll both caches back to the committed length: only the lengths move.
        lens += (n_acc + 1) * live
        anchor = torch.where(live, vtokens.gather(1, n_acc[:, None])[:, 0], anchor)
        stats.tick("commit")

    outputs = [row[:n] for row, n in zip(out_buf.tolist(), n_out.clamp(max=max_new_tokens).tolist())]
    return outputs, stats.result(outputs)


def prefill(target, drafter, prompts, room: int, temp, seeds):
    """Prefill the target on the ragged prompts (right-padded), sample each request's first
    token at Philox position 0, and inject the prompts' context features into a new drafter
    cache (padded positions hold junk features that are never read and get overwritten).
    Both caches get `room` positions past the longest prompt. Returns (target cache,
    drafter cache, prompt lengths [B], first tokens [B])."""
    device = seeds.device
    B = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    P = int(lens.max())
    tokens = torch.zeros(B, P, dtype=torch.int64, device=device)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.tensor(p, device=device)
    tcache, dcache = target.new_cache(B, P + room), drafter.new_cache(B, P + room)
    out = target(tokens, tcache, torch.zeros_like(lens), lens, hidden_layers=drafter.config.target_layer_ids)
    rows = torch.arange(B, device=device)
    first = out.logits[rows, lens - 1][:, None]
    anchor = sample_logits(first, temp, seeds, torch.zeros(B, 1, dtype=torch.int64, device=device), PURPOSE_RESAMPLE)[0]
    drafter.inject(
        dcache, out.hidden.flatten(0, 1), torch.arange(P, device=device).repeat(B), rows.repeat_interleave(P)
    )
    return tcache, dcache, lens, anchor[:, 0]


def widen(block: DraftBlock, n: int) -> DraftBlock:
    """A shorter block padded with zero columns to n drafts (the loop's fixed width; the padding
    is never verified: k_b stays within the drafts a request still wants)."""

    def pad(x):
        if x is None:
            return None
        shape = list(x.shape)
        shape[1] = n - shape[1]
        return torch.cat((x, x.new_zeros(shape)), 1)

    return DraftBlock(*(pad(x) for x in block))


def emit(out_buf, n_out, active, vtokens, n_acc, live, eos_id, max_new_tokens):
    """Append each live request's accepted drafts and correction / bonus token (n_acc + 1
    tokens) to its output, cut at EOS (included); a request stops at EOS or max_new_tokens.
    Returns (tokens out per request, still active)."""
    n_emit = n_acc + 1
    cols = torch.arange(vtokens.shape[1], device=vtokens.device)
    out_buf.scatter_(1, n_out[:, None] + cols, vtokens)  # columns past n_out + n_emit: overwritten later
    if eos_id is not None:
        hit = (vtokens == eos_id) & (cols < n_emit[:, None])
        n_emit = torch.where(hit.any(1), hit.long().argmax(1) + 1, n_emit)
        active = active & ~hit.any(1)
    n_out = n_out + n_emit * live
    return n_out, active & (n_out < max_new_tokens)


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
