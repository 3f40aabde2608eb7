"""The speculative decoding loop: draft a block, verify it with one ragged
target forward, commit, inject, repeat.

A block is a chain of drafts, or (`tree=N`) a token tree of N nodes: the anchor
and N - 1 drafts, best first (models/tree.py). A tree runs the same steps: the
scheduler cuts a prefix of its nodes, the target runs one tree forward (each node
sees its ancestors), `tree_verify` walks it, and the accepted path's cache rows
move to the slots of their depths (`compact_path`) before the lengths move. A chain
is the tree whose nodes are one path: its rows are already in place.

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
from ..models.decoder import DecoderForCausalLM, TreeInputs, compact_path
from ..models.dflash import DFlashDrafter
from ..models.dflash2 import PATH_MODES
from ..models.drafter import DraftBlock
from ..models.tree import ancestor_mask
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
    tree: int = 0,
    search: str = "best-first",
) -> tuple[list[list[int]], dict]:
    """Decode all prompts as one batch; returns (new tokens per prompt, stats).

    A request stops after `eos_id` (included) or `max_new_tokens` tokens. `scheduler`
    (default: FixedK(drafter.num_drafts): γ - 1, or γ in DeepSpec's layout) says how many drafts
    each request verifies per step.
    `path` is the DFlash 2 path mode. Request b draws from the Philox stream of seed
    `(seed << 32) + b`. `record` adds stats["records"]: per request-step confidences /
    signals and outcomes (for calibration reports).
    `tree` = N >= 2 drafts a token tree of N nodes per step (the scheduler's bound then counts
    its draft nodes: default FixedK(N - 1), every node); 0 drafts chains. `search` builds the
    trees (`models.tree.SEARCHES`).
    """
    device = target.model.embed_tokens.weight.device
    g, n, B = drafter.block_size, drafter.num_drafts, len(prompts)
    if tree == 1 or tree < 0:
        raise ValueError(f"tree must be 0 (chains) or a node budget >= 2, got {tree}")
    nodes = tree - 1 if tree else n  # draft columns of a block
    scheduler = scheduler or FixedK(nodes)
    K = scheduler.max_spec_len
    if not 0 <= K <= nodes:
        what = f"tree nodes under the root = {nodes}" if tree else f"drafts per block = {n}"
        raise ValueError(f"scheduler.max_spec_len = {K} must lie in [0, {what}]")
    check_prompts(prompts, max_new_tokens, target.config.max_position_embeddings, target.config.vocab_size)
    stats = LoopStats(B, n if tree else K, device, record)  # acceptance per block position (a tree's depth)
    if max_new_tokens == 0:
        return [[] for _ in prompts], stats.result([])
    layers, want_signals = drafter.config.target_layer_ids, record or scheduler.wants_signals
    temp = torch.full((B,), float(temperature), device=device)
    seeds = (seed << 32) + torch.arange(B, device=device)
    ar, rows_b = torch.arange(n + 1, device=device), torch.arange(B, device=device)

    # 1. Prefill the target, sample the first token, inject the prompt's features into the drafter cache.
    # Room past the longest output: a finished request keeps being written up to K + 1 columns past
    # its last token, and a live one's last step may overrun max_new_tokens by K: 2 (n + 1).
    room = max_new_tokens + 2 * max(g, n + 1, tree)
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
        #    max_new_tokens a chain's block is shorter, no more drafts than any request still wants
        #    (the reference does the same: its drafts there are its shorter block's); a tree keeps
        #    its depth (what it emits past max_new_tokens is cut).
        if drafted := scheduler.wants_draft(active):
            width = n if tree else min(n, left)
            block = drafter.propose(dcache, anchor, lens, temp, seeds, offsets, path, want_signals, width, tree, search)
            block = widen(block, n) if width < n else block
            stats.tick("draft")
            # 3. How many drafts (a tree: its first nodes) each request verifies (0 for finished
            #    requests), never past its max_new_tokens (what depends on counts only leaves verify lossless).
            k_b = scheduler.plan(
                ScheduleState(active, lens, block.tokens, block.logits, block.confidence, block.signals, block.tree)
            )
            k_b = torch.minimum(k_b, (max_new_tokens - n_out).clamp(min=0)) if width < n else k_b
        else:
            block, k_b = DraftBlock(anchor.new_zeros(B, nodes)), torch.zeros_like(lens)
        stats.tick("schedule")
        # 4. One ragged target forward over [anchor, d_1 .. d_k_b] (a tree's nodes, each seeing its
        #    ancestors), as wide as the longest (a chain's as the scheduler pads it: columns past
        #    k_b are computed, never verified); finished requests write nothing.
        if scheduler.fixed_width:
            w = K
        elif block.tree is None:
            w = scheduler.verify_width(k_b)
        else:
            w = int(k_b.max())
        tokens = torch.cat((anchor[:, None], block.tokens[:, :w]), 1)
        shape = None if block.tree is None else tree_inputs(block.tree, w, n)
        fwd = target(tokens, tcache, lens, (k_b + 1) * active, layers, shape)
        stats.tick("target")
        # 5. Verify the k_b + 1 logits rows per request: rejection sampling of a chain, the
        #    sample-and-walk of a tree (`walk`: the accepted nodes, root first).
        if block.tree is None:
            rows, drafts, cu, q, q_ids = ragged_rows(fwd.logits, block.tokens[:, :w], k_b, block.probs, block.prob_ids)
            vtokens, n_acc = ops.verify(
                rows, drafts, cu, temperature=temp, seeds=seeds, offsets=offsets, max_spec_len=K, draft_probs=q,
                draft_probs_ids=q_ids,
            )  # fmt: skip
            walk = None
        else:
            rows, node_tokens, parents, cu = tree_rows(fwd.logits, tokens, block.tree.parents[:, :w], k_b)
            walk, vtokens, n_acc = ops.tree_verify(
                rows, node_tokens, parents, cu, temperature=temp, seeds=seeds, offsets=offsets, max_depth=n
            )
            walk = torch.where(walk >= 0, walk - cu[:-1, None], -1).long()  # local node ids
            block = block._replace(tree=block.tree._replace(accepted=on_path(walk, block.tree.parents.shape[1])))
        offsets += n + 1  # the drafter drew n positions and verify up to n + 1 (a tree: depths 0..n)
        stats.tick("verify")
        # 6. Commit accepted drafts + the correction/bonus token; stop at EOS / max_new_tokens.
        live, vtokens, n_acc = active.clone(), vtokens.long(), n_acc.long()  # live: the requests verified this step
        if drafted:
            scheduler.observe(block, n_acc, k_b)
        stats.step(block, drafted, vtokens, n_acc, k_b, live, lens)
        n_out, active = emit(out_buf, n_out, active, vtokens, n_acc, live, eos_id, max_new_tokens)
        # 7. Inject the committed tokens' features (anchor + accepted drafts: rows 0..n_acc at lens ..).
        #    All rows are written; rejected ones sit past the new ctx_len and get overwritten. A tree's
        #    accepted path first moves to the slots of its depths in the target cache (one gather).
        hidden = fwd.hidden
        if walk is not None:
            compact_path(tcache, lens, walk)
            hidden = hidden[rows_b[:, None], walk.clamp(min=0)]  # [B, n + 1, layers, D]: the path's rows
        h = hidden.shape[1]
        positions = (lens[:, None] + ar[:h]).flatten()
        drafter.inject(dcache, hidden.flatten(0, 1), positions, slots if h == K + 1 else rows_b.repeat_interleave(h))
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


def tree_inputs(tree, w: int, depth: int) -> TreeInputs:
    """The target's tree forward inputs for a block's first w draft nodes and its root."""
    B = tree.parents.shape[0]
    root = tree.parents.new_zeros(B, 1)
    parents = torch.cat((root - 1, tree.parents[:, :w]), 1)
    return TreeInputs(torch.cat((root, tree.depths[:, :w]), 1), ancestor_mask(parents, depth))


def tree_rows(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, k_b: torch.Tensor):
    """Flatten per-request trees for `tree_verify`: request b keeps its root and first k_b draft
    nodes. logits [B, S, V], tokens [B, S] (root first), parents [B, S - 1] (node ids, 0 = root).
    Returns (logits rows [T + B, V], node tokens [T + B], flat parents [T + B] (-1 for roots),
    cu_num_nodes [B + 1])."""
    B, S = tokens.shape
    cu = torch.zeros(B + 1, dtype=torch.int64, device=logits.device)
    torch.cumsum(k_b + 1, 0, out=cu[1:])
    flat = torch.cat((parents.new_full((B, 1), -1), parents), 1).long()
    flat = torch.where(flat >= 0, flat + cu[:-1, None], -1)
    keep = torch.arange(S, device=logits.device) <= k_b[:, None]
    return logits[keep], tokens[keep], flat[keep], cu


def on_path(walk: torch.Tensor, nodes: int) -> torch.Tensor:
    """[B, nodes] bool: draft node i + 1 is on the walked path (walk [B, D + 1] local ids, -1 after)."""
    hit = torch.zeros(walk.shape[0], nodes + 1, dtype=torch.bool, device=walk.device)
    hit.scatter_(1, walk.clamp(min=0), True)
    return hit[:, 1:]


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
