"""DFlash 2 ops: two_tap_conv, topk_select, path_select (wrappers, fakes, PyTorch
implementations)."""

from __future__ import annotations

from typing import Optional

import torch

from .common import GREEDY_TEMPERATURE, _one_device, _to_int, drafter_logits, log_softmax_shifted, rms_norm
from .philox import PURPOSE_PATH, gumbel, philox_u32

# topk_select's bound on k.
MAX_TOP_K = 16
# The default number of channels sharing one dynamic tap of two_tap_conv (its group_size).
CONV_GROUP = 16


def conv_groups(channels: int, group_size: int = CONV_GROUP) -> int:
    """G, the dynamic tap groups of two_tap_conv over ``channels``: ceil(channels / group_size)."""
    return -(-channels // group_size)


def grouped_taps(delta: torch.Tensor, group_size: int, channels: int) -> torch.Tensor:
    """Per-group taps ``delta [..., G]`` spread over the channels: ``[..., channels]`` where
    channel c takes group ``c // group_size`` (the last group may be partial). Differentiable
    (an index_select), and without materializing G * group_size entries."""
    idx = torch.arange(channels, device=delta.device) // group_size
    return delta.index_select(-1, idx)


def two_tap_conv(
    x: torch.Tensor,
    base: torch.Tensor,
    delta: Optional[torch.Tensor],
    block_size: int = 0,
    cu_blocks: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    delta_weight: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    group_size: int = CONV_GROUP,
    finish_delta: Optional[torch.Tensor] = None,
    *,
    status: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DFlash 2 two-tap dynamic depthwise conv (one pass over x).

    ``out[t, c] = (base[0, c] + delta[t, 0, c // S]) * x[t, c]
    + (base[1, c] + delta[t, 1, c // S]) * x[t - 1, c]`` (+ ``residual[t, c]``),
    with ``x[t - 1] = 0`` at the first row of each block, S = ``group_size``
    channels per dynamic tap and G = ceil(C / S) groups.

    Args:
      x: ``[..., T, C]`` fp32/bf16/fp16; rows are x flattened to ``[N, C]``.
      base: ``[2, C]`` static taps (identity init: base[0] = 1, base[1] = 0).
      delta: ``[..., 2, G]`` dynamic taps, one row per row of x, shared by
        groups of S channels; or None with ``delta_weight``.
      block_size: rows per block when ``cu_blocks`` is None (row t starts a
        block when ``t % block_size == 0``).
      cu_blocks: ``[num_blocks + 1]`` int32 row offsets of ragged blocks.
      residual: optional ``[..., T, C]`` added to the output (fused residual).
      delta_weight: ``[2G, C]`` the taps' projection (x's dtype), instead of
        ``delta``: the op computes ``delta[t] = x[t] @ delta_weight.T`` itself, in
        fp32 (the whole dynamic conv in one op; no δ tensor). Or ``[4G, C]``: rows
        ``[2G, 4G)`` are the sublayer's finish conv's projection (z-lab's DFlash 2
        computes both convs' taps from the prepare conv's input); the op projects
        them from the same (normalized) rows and writes them to ``finish_delta``,
        which the caller passes as ``delta`` to the finish conv. The conv's own
        output is the same as with the first 2G rows alone.
      norm_weight: optional ``[C]`` (x's dtype): the conv runs on RMSNorm(x) =
        ``norm_weight * (x * rsqrt(mean(x^2) + norm_eps))`` per row, computed in
        fp32 (DFlash 2's "prepare" conv fused with the sublayer's norm); the taps
        from ``delta_weight`` see the normalized rows too. The residual is added
        unnormalized.
      norm_eps: RMSNorm's epsilon (finite, >= 0).
      group_size: S >= 1, channels sharing one dynamic tap (16 by default).
      finish_delta: ``[..., 2, G]`` output, required exactly with a 4G-row
        ``delta_weight``: contiguous, x's dtype and device, one row per row of x,
        sharing no memory with the other arguments; receives the finish conv's
        taps (fp32 sums rounded to x's dtype). NaN when the call fails.
      status: optional ``[1]`` int32 output (see :func:`raise_on_status`): with
        offsets ``cu_blocks`` that do not start at 0, decrease, or do not end at
        the row count, the call fails and its output (and ``finish_delta``) is NaN.

    Returns x's shape and dtype. Inference op (no autograd): training uses the
    reference, which computes the same function.
    """
    return torch.ops.flashspark.two_tap_conv(
        x,
        base,
        delta,
        block_size,
        cu_blocks,
        residual,
        delta_weight,
        norm_weight,
        norm_eps,
        group_size,
        finish_delta,
        status=status,
    )


def topk_select(logits: torch.Tensor, k: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-K candidates per row with the log-softmax normalizer, in one pass.

    Args:
      logits: ``[..., V]`` fp32/bf16/fp16 (rows may be strided). V up to 2^31.
      k: 1 <= k <= 16.

    Returns ``(values [..., k] fp32, ids [..., k] int32, lse [...] fp32)``: the k
    largest logits in descending order (ties: lower id first) and the row's
    log-sum-exp, so ``values - lse[..., None]`` are the candidates' log-probs.
    A NaN logit reads as -inf and +inf as the largest finite float, so a row always
    gives k distinct ids in ``[0, V)`` and no NaN (a row with fewer than k finite
    logits fills up with -inf entries, lowest ids first).
    """
    return torch.ops.flashspark.topk_select(logits, k)


def path_select(
    cand_ids: torch.Tensor,
    unary: torch.Tensor,
    a_emb: torch.Tensor,
    b_emb: torch.Tensor,
    g: Optional[torch.Tensor],
    anchor: torch.Tensor,
    *,
    mode: str = "backtrack",
    temperature: Optional[torch.Tensor] = None,
    seeds: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    hidden: Optional[torch.Tensor] = None,
    g_weight: Optional[torch.Tensor] = None,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash 2 path selector over the K-wide candidate lattice of a block.

    Transition score from candidate a at position t-1 to candidate b at t:
    ``S_t(a, b) = unary[t, b] + <a_emb[cand[t-1, a]] * g[t], b_emb[cand[t, b]]>``;
    the anchor token is the predecessor at t = 0.

    Args:
      cand_ids: ``[R, P, K]`` int32/int64 candidate ids per request and position, 1 <= K <= 64.
      unary: ``[R, P, K]`` fp32 unary scores (e.g. Top-K logits or log-probs).
      a_emb, b_emb: ``[V, r]`` selector factors; g: ``[R, P, r]`` = W_h h_t (same dtype),
        or None with ``hidden`` and ``g_weight``.
      anchor: ``[R]`` int32/int64 last committed token per request.
      mode: ``"backtrack"`` (max-score path by DP and backtracking),
        ``"greedy"`` (left to right), or ``"sample"`` (left to right, sampled at
        ``temperature`` with Philox; below 1e-5 the step is greedy).
      temperature, seeds, offsets: ``[R]`` fp32 / int64 / int64 (sample mode;
        defaults: 1, 0, 0). Position t draws at ``offsets[r] + t``.
      hidden, g_weight: ``[R, P, D]`` draft states (rows may be strided) and
        ``[r, D]`` W_h (a_emb's dtype), instead of ``g``: the op computes
        ``g = hidden @ g_weight.T`` itself, in fp32 (one op for the selector
        after Top-K).
      status: optional ``[R]`` int32 output (see :func:`raise_on_status`): a
        request with an id outside ``[0, V)`` or a bad temperature fails: tokens and
        choice -1, scores NaN, q 0.

    Scores read NaN as -inf and +inf as the largest float; a position with no finite
    score takes its first candidate with q one-hot there (the draft is deterministic).

    Returns ``(tokens [R, P] int32, choice [R, P] int32, scores [R, P, K] fp32,
    q [R, P, K] fp32)``: the chosen token and its index among the candidates,
    the score row S_t(chosen predecessor, ·), and the draft distribution over
    the K candidates (softmax(scores / T) in sample mode, one-hot otherwise) to
    pass to ``verify`` as sparse q with ``cand_ids``.
    """
    temperature, seeds, offsets = path_sampling_defaults(cand_ids, temperature, seeds, offsets)
    return torch.ops.flashspark.path_select(
        cand_ids, unary, a_emb, b_emb, g, anchor, mode, temperature, seeds, offsets, hidden, g_weight, status=status
    )


def path_sampling_defaults(
    cand_ids: torch.Tensor,
    temperature: Optional[torch.Tensor],
    seeds: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
):
    """path_select's per-request temperature, seeds and offsets, with the defaults (1, 0, 0) for None."""
    r, dev = cand_ids.shape[0], cand_ids.device
    if temperature is None:
        temperature = torch.ones(r, device=dev)
    if seeds is None:
        seeds = torch.zeros(r, dtype=torch.int64, device=dev)
    if offsets is None:
        offsets = torch.zeros(r, dtype=torch.int64, device=dev)
    return temperature, seeds, offsets


@torch.library.register_fake("flashspark::two_tap_conv")
def _two_tap_conv_fake(
    x,
    base,
    delta,
    block_size,
    cu_blocks,
    residual,
    delta_weight=None,
    norm_weight=None,
    norm_eps=1e-6,
    group_size=CONV_GROUP,
    finish_delta=None,
    *,
    status=None,
):
    _one_device(
        "two_tap_conv",
        x=x,
        base=base,
        delta=delta,
        cu_blocks=cu_blocks,
        residual=residual,
        delta_weight=delta_weight,
        norm_weight=norm_weight,
        finish_delta=finish_delta,
        status=status,
    )
    return x.new_empty(x.shape)  # finish_delta is written in place: nothing to return for it


@torch.library.register_fake("flashspark::topk_select")
def _topk_select_fake(logits, k):  # one tensor: nothing to mix
    shape = logits.shape[:-1]
    return (
        logits.new_empty(shape + (k,), dtype=torch.float32),
        logits.new_empty(shape + (k,), dtype=torch.int32),
        logits.new_empty(shape, dtype=torch.float32),
    )


@torch.library.register_fake("flashspark::path_select")
def _path_select_fake(
    cand_ids,
    unary,
    a_emb,
    b_emb,
    g,
    anchor,
    path_mode,
    temperature,
    seeds,
    offsets,
    hidden=None,
    g_weight=None,
    *,
    status=None,
):
    _one_device(
        "path_select",
        cand_ids=cand_ids,
        unary=unary,
        a_emb=a_emb,
        b_emb=b_emb,
        g=g,
        anchor=anchor,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
        hidden=hidden,
        g_weight=g_weight,
        status=status,
    )
    r, p, k = cand_ids.shape
    return (
        cand_ids.new_empty((r, p), dtype=torch.int32),
        cand_ids.new_empty((r, p), dtype=torch.int32),
        unary.new_empty((r, p, k), dtype=torch.float32),
        unary.new_empty((r, p, k), dtype=torch.float32),
    )


def two_tap_conv_reference(
    x,
    base,
    delta,
    block_size=0,
    cu_blocks=None,
    residual=None,
    delta_weight=None,
    norm_weight=None,
    norm_eps=1e-6,
    group_size=CONV_GROUP,
    finish_delta=None,
):
    """Oracle of :func:`flashspark.ops.two_tap_conv`.

    out[t, c] = (base[0, c] + delta[t, 0, c // S]) * x[t, c]
              + (base[1, c] + delta[t, 1, c // S]) * x[t - 1, c]  (zero at a block's first row)
              (+ residual[t, c]); rows t run over x flattened to [N, C], S = group_size,
    G = ceil(C / S). With `delta_weight` (and delta None), delta = x @ delta_weight[:2G].T in
    fp32; a 4G-row delta_weight also gives the finish conv's taps x @ delta_weight[2G:].T,
    copied (rounded to x's dtype, without autograd) into `finish_delta` when it is given.
    With `norm_weight`, x is first RMS-normalized in fp32 (`rms_norm` on fp32 rows).
    Differentiable in x, base, delta, residual, delta_weight and norm_weight.
    """
    shape = x.shape
    channels = shape[-1]
    xf = x.reshape(-1, channels).float()
    if norm_weight is not None:
        xf = rms_norm(xf, norm_weight.float(), norm_eps)
    rows = xf.shape[0]
    groups = conv_groups(channels, group_size)
    if delta_weight is not None:
        if delta_weight.shape[0] not in (2 * groups, 4 * groups):
            raise ValueError(
                f"delta_weight must have 2G = {2 * groups} or 4G = {4 * groups} rows, got {delta_weight.shape[0]}"
            )
        proj = xf @ delta_weight.float().t()
        delta = proj[:, : 2 * groups]
        if finish_delta is not None and proj.shape[1] == 4 * groups:
            with torch.no_grad():
                finish_delta.copy_(proj[:, 2 * groups :].reshape(finish_delta.shape).to(x.dtype))
    d = grouped_taps(delta.reshape(rows, 2, groups).float(), group_size, channels)
    taps = base.float()[None] + d  # [N, 2, C]
    left = torch.cat([torch.zeros(1, channels, device=x.device), xf[:-1]], dim=0)
    if cu_blocks is not None:
        first = torch.zeros(rows, dtype=torch.bool, device=x.device)
        starts = cu_blocks.long()[:-1]
        first[starts[starts < rows]] = True
    else:
        first = torch.arange(rows, device=x.device) % block_size == 0
    left = torch.where(first[:, None], torch.zeros_like(left), left)
    out = taps[:, 0] * xf + taps[:, 1] * left
    if residual is not None:
        out = out + residual.reshape(-1, channels).float()
    return out.to(x.dtype).reshape(shape)


def topk_select_reference(logits, k):
    """Oracle of :func:`flashspark.ops.topk_select`: the k largest logits per row
    (descending, ties to the lower id) as fp32, their int32 ids, and the row's
    log-sum-exp."""
    lf = drafter_logits(logits)
    values, ids = torch.sort(lf, dim=-1, descending=True, stable=True)  # stable: lower id first on ties
    return values[..., :k].contiguous(), ids[..., :k].to(torch.int32).contiguous(), torch.logsumexp(lf, dim=-1)


def path_pair_scores_reference(cand_ids, unary, a_emb, b_emb, g, prev_tokens, t):
    """S_t(a, b) = U_t(b) + <A[prev_a] * g_t, B[cand_t(b)]> for every listed predecessor a."""
    ag = a_emb.float()[prev_tokens.long()] * g.float()[t]  # [n_prev, r]
    return unary[t].float()[None, :] + ag @ b_emb.float()[cand_ids[t].long()].T


def path_select_reference(
    cand_ids, unary, a_emb, b_emb, g, anchor, mode, temperature, seeds, offsets, hidden=None, g_weight=None
):
    """Oracle of :func:`flashspark.ops.path_select` (plain loops over requests and positions).
    With g None, g = hidden @ g_weight.T in fp32."""
    if g is None:
        g = hidden.float() @ g_weight.float().t()
    requests, positions, k = cand_ids.shape
    tokens = torch.empty(requests, positions, dtype=torch.int32)
    choice = torch.empty(requests, positions, dtype=torch.int32)
    scores = torch.empty(requests, positions, k)
    q = torch.zeros(requests, positions, k)
    # No positions: nothing to choose, the empty outputs as the op returns them (the lattice
    # walk below needs a first position).
    for r in range(requests if positions else 0):
        cid, un, gr = cand_ids[r].cpu(), unary[r].cpu(), g[r].cpu()
        anchor_r = anchor[r : r + 1].cpu()
        if mode == "backtrack":
            lattice = [
                drafter_logits(
                    path_pair_scores_reference(
                        cid, un, a_emb.cpu(), b_emb.cpu(), gr, anchor_r if t == 0 else cid[t - 1], t
                    )
                )
                for t in range(positions)
            ]
            best = lattice[0][0].clone()
            back = []
            for t in range(1, positions):
                total = best[:, None] + lattice[t]  # [a, b]
                best, arg = total.max(dim=0)  # ties: the lowest a
                best = drafter_logits(best)  # sums past the largest float stay finite, as in the kernel
                back.append(arg)
            c = int(best.argmax())
            path = [c]
            for arg in reversed(back):
                c = int(arg[c])
                path.append(c)
            path.reverse()
            for t, c in enumerate(path):
                scores[r, t] = lattice[t][0 if t == 0 else path[t - 1]]
                q[r, t, c] = 1.0
                choice[r, t] = c
            continue
        prev = anchor_r
        temp = float(temperature[r])
        for t in range(positions):
            row = drafter_logits(path_pair_scores_reference(cid, un, a_emb.cpu(), b_emb.cpu(), gr, prev, t)[0])
            scores[r, t] = row
            if mode == "sample" and temp >= GREEDY_TEMPERATURE and bool(torch.isfinite(row).any()):
                logp = log_softmax_shifted(row, temp)
                q[r, t] = logp.exp()
                noise = gumbel(philox_u32(_to_int(seeds[r]), _to_int(offsets[r]) + t, PURPOSE_PATH, torch.arange(k)))
                c = int((logp + noise).argmax())
            else:
                c = int(row.argmax())
                q[r, t, c] = 1.0
            choice[r, t] = c
            prev = cid[t, c : c + 1]
    for r in range(requests):
        tokens[r] = cand_ids[r].cpu().gather(-1, choice[r].long()[:, None]).squeeze(-1).int()
    device = cand_ids.device
    return tokens.to(device), choice.to(device), scores.to(device), q.to(device)
