"""Python wrappers of the ``torch.ops.flashspark`` ops, each with its fake
(meta) implementation beside it so ``torch.compile`` can trace the op.

Conventions shared by every op:
  * randomness is Philox4x32-10 keyed by a per-request int64 seed; a per-request
    int64 ``offsets`` counter says where in that request's stream the call draws
    (see ``flashspark.reference.philox4x32_10``);
  * output shapes depend only on sizes and size arguments, never on values, and
    no op synchronizes with the host, so every op can be captured in a CUDA graph;
  * invalid arguments raise ``RuntimeError`` naming the argument. Bad values
    inside tensors (token ids, lengths, offsets, temperatures, non-finite target
    logits) fail only the request, token or call they belong to: ops that can see
    such values take an optional ``status`` int32 tensor (see
    :func:`raise_on_status`), where the kernel writes 0 or a status code, and the
    failed item's outputs take documented values. On the CPU, without ``status``,
    the op raises instead. On CUDA no kernel ever traps or synchronizes.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "verify",
    "verify_out",
    "block_diffusion_attention",
    "inject_context_kv",
    "two_tap_conv",
    "topk_select",
    "path_select",
    "markov_step",
    "raise_on_status",
    "GREEDY_TEMPERATURE",
    "MAX_SPEC_LEN",
]

# Below this temperature a request samples greedily (vLLM's floor): the kernels' kGreedyTemperature,
# the fp32 value of 1e-5, which itself samples.
GREEDY_TEMPERATURE = float(torch.tensor(1e-5, dtype=torch.float32))
# The bound on verify's max_spec_len (the kernels' kMaxSpecLen).
MAX_SPEC_LEN = 4096


def raise_on_status(status: torch.Tensor, op: str) -> None:
    """Raise the ``RuntimeError`` the CPU binding raises for the first failed entry
    of an op's ``status`` output, or return if every entry is 0.

    Opt-in and synchronizing (it reads ``status`` on the host): an engine calls it
    off its hot path, e.g. after a step, or reads the codes itself. ``op`` names
    the op for the message (``"verify"``, ``"markov_step"``, ...).
    """
    codes = status.detach().reshape(-1).cpu()
    failed = torch.nonzero(codes).flatten()
    if failed.numel():
        code = int(codes[failed[0]])
        raise RuntimeError(f"flashspark.{op}: {torch.ops.flashspark.status_message(code)}")


def _one_device(op: str, **tensors) -> None:
    """Fakes run for meta tensors too; an op's tensors must share one device, or
    a fake would hand back uninitialized memory for a call the kernels reject."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise RuntimeError(
                f"flashspark.{op}: argument '{name}' is on {t.device} but argument "
                f"'{first[0]}' is on {first[1]}; every tensor of a call must be on one device"
            )


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_spec_len: int,
    draft_probs: Optional[torch.Tensor] = None,
    draft_probs_ids: Optional[torch.Tensor] = None,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged rejection-sampling verification of draft tokens (lossless).

    B requests; request b proposes ``n_b = cu_num_draft[b+1] - cu_num_draft[b]``
    draft tokens (0 <= n_b <= max_spec_len); T = sum n_b; V = vocabulary size.

    Args:
      target_logits: ``[T + B, V]`` float32, bfloat16 or float16. Request b owns
        rows ``cu_num_draft[b] + b ... cu_num_draft[b+1] + b``: the target's
        logits at each of its draft positions, then its bonus row. Rows may be
        strided (e.g. a slice of a larger buffer). Softmax with temperature is
        fused into the kernel; probabilities are never materialized.
      draft_tokens: ``[T]`` int32/int64, flattened over requests.
      cu_num_draft: ``[B + 1]`` int32/int64 offsets into ``draft_tokens``.
      temperature: ``[B]`` float32 per-request target temperature, finite and
        >= 0; below ``GREEDY_TEMPERATURE`` (1e-5) the request is greedy.
      seeds: ``[B]`` int64 per-request Philox seed.
      offsets: ``[B]`` int64 per-request stream position. Row k of request b
        draws at position ``offsets[b] + k``; advance it by at least
        ``max_spec_len + 1`` between calls so no draw is ever reused.
      max_spec_len: static bound on n_b (at most ``MAX_SPEC_LEN``); fixes the output width.
      draft_probs: the drafter's q. ``None``: the draft was deterministic (q is
        one-hot at the draft token). ``[T, V]`` float32: dense q. ``[T, K]``
        float32 together with ``draft_probs_ids``: sparse q over K candidate ids.
      draft_probs_ids: ``[T, K]`` int32/int64 candidate ids for sparse q. An id
        listed twice counts with the sum of its probabilities.
      status: optional ``[B]`` int32 output: 0, or the code of what failed the
        request (see :func:`raise_on_status`). A failed request emits nothing: its
        ``tokens`` row is all -1 and ``num_accepted`` is -1.

    Every row the walk reads must hold finite logits or -inf, with at least one
    finite (NaN, +inf or an all -inf row fail the request); softmax is computed
    as ``(x - max) / T``, so no finite logit overflows at any temperature.

    Returns:
      ``(tokens, num_accepted)``: ``tokens`` is ``[B, max_spec_len + 1]`` int32
      holding the accepted draft tokens, then the correction token (sampled from
      norm(max(p - q, 0)) at the first rejection) or the bonus token (sampled
      from p when all n_b drafts pass), then -1. ``num_accepted`` is ``[B]``
      int32; request b emits ``num_accepted[b] + 1`` tokens.

    At temperature 0 a draft is accepted while it equals the target argmax and
    the target argmax is emitted at the first mismatch (ties: lowest id).
    """
    return torch.ops.flashspark.verify(
        target_logits,
        draft_tokens,
        cu_num_draft,
        draft_probs,
        draft_probs_ids,
        temperature,
        seeds,
        offsets,
        max_spec_len,
        status=status,
    )


def verify_out(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    offsets: torch.Tensor,
    max_spec_len: int,
    out_tokens: torch.Tensor,
    out_num_accepted: torch.Tensor,
    draft_probs: Optional[torch.Tensor] = None,
    draft_probs_ids: Optional[torch.Tensor] = None,
    status: Optional[torch.Tensor] = None,
) -> None:
    """:func:`verify` writing into preallocated, contiguous int32 outputs
    ``out_tokens [B, max_spec_len + 1]`` and ``out_num_accepted [B]``, as an
    engine does with persistent buffers inside a captured CUDA graph."""
    torch.ops.flashspark.verify_out(
        target_logits,
        draft_tokens,
        cu_num_draft,
        draft_probs,
        draft_probs_ids,
        temperature,
        seeds,
        offsets,
        max_spec_len,
        out_tokens=out_tokens,
        out_num_accepted=out_num_accepted,
        status=status,
    )


@torch.library.register_fake("flashspark::verify")
def _verify_fake(
    target_logits,
    draft_tokens,
    cu_num_draft,
    draft_probs,
    draft_probs_ids,
    temperature,
    seeds,
    offsets,
    max_spec_len,
    *,
    status=None,
):
    _one_device(
        "verify",
        target_logits=target_logits,
        draft_tokens=draft_tokens,
        cu_num_draft=cu_num_draft,
        draft_probs=draft_probs,
        draft_probs_ids=draft_probs_ids,
        temperature=temperature,
        seeds=seeds,
        offsets=offsets,
        status=status,
    )
    batch = cu_num_draft.shape[0] - 1
    return (
        target_logits.new_empty((batch, max_spec_len + 1), dtype=torch.int32),
        target_logits.new_empty((batch,), dtype=torch.int32),
    )


@torch.library.register_fake("flashspark::verify_out")
def _verify_out_fake(
    target_logits,
    draft_tokens,
    cu_num_draft,
    draft_probs,
    draft_probs_ids,
    temperature,
    seeds,
    offsets,
    max_spec_len,
    *,
    out_tokens,
    out_num_accepted,
    status=None,
):
    # the inputs as verify checks them, then the output buffers on the same device
    _verify_fake(
        target_logits,
        draft_tokens,
        cu_num_draft,
        draft_probs,
        draft_probs_ids,
        temperature,
        seeds,
        offsets,
        max_spec_len,
        status=status,
    )
    _one_device("verify", target_logits=target_logits, out_tokens=out_tokens, out_num_accepted=out_num_accepted)
    return None


# ---------------------------------------------------------------- DFlash drafter


def block_diffusion_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_lens: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    scale: float,
    *,
    status: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DFlash block attention with injected context K/V (no mask).

    Every query of a request's block attends to that request's context K/V in
    the drafter cache and to the whole block's own K/V, bidirectionally.

    Args:
      q: ``[B, G, Hq, D]`` block queries (G = block size γ), fp32/bf16/fp16,
        q_norm and RoPE already applied. Any strides with D dense.
      k_cache, v_cache: ``[B, Hkv, S_max, D]`` drafter cache (same dtype);
        request b reads its first ``ctx_lens[b]`` positions. Strided batch/head
        dims are fine (e.g. one layer of a ``[L, B, Hkv, S, D]`` cache).
      ctx_lens: ``[B]`` int32/int64 context lengths, ``0 <= ctx_lens[b] <= S_max``.
      k_block, v_block: ``[B, G, Hkv, D]`` the block's own K/V (k_norm and RoPE applied).
      scale: softmax scale, usually ``D ** -0.5`` (finite).
      status: optional ``[B]`` int32 output (see :func:`raise_on_status`): a
        request with a context length outside ``[0, S_max]`` fails and its output
        is NaN.

    Returns ``[B, G, Hq, D]`` in q's dtype. GQA: query head h reads KV head
    ``h // (Hq // Hkv)``. Softmax in fp32. The CUDA kernel splits the keys
    (flash-decoding) since the context is long and the queries few.
    """
    return torch.ops.flashspark.block_diffusion_attention(
        q, k_cache, v_cache, ctx_lens, k_block, v_block, scale, status=status
    )


def inject_context_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    status: Optional[torch.Tensor] = None,
) -> None:
    """DFlash KV injection: k_norm + RoPE on new context K, then the cache write.

    For each of N newly committed tokens i and KV head h:
    ``k_cache[slots[i], h, positions[i]] = RoPE(RMSNorm(k[i, h]) * k_norm_weight)``
    and ``v_cache[slots[i], h, positions[i]] = v[i, h]``.

    Args:
      k, v: ``[N, Hkv, D]`` the context features projected by the layer's
        k_proj / v_proj (before k_norm), in the caches' dtype.
      positions: ``[N]`` int64 absolute positions (= the cache index and the
        RoPE position), in ``[0, S_max)``.
      slots: ``[N]`` int32 cache row of each token, in ``[0, B)``.
      k_norm_weight: ``[D]`` RMSNorm weight (computed in fp32).
      cos_sin_cache: ``[max_pos, D]`` fp32, cos in the first half and sin in the
        second (see ``flashspark.reference.rope_cos_sin_cache``).
      eps: RMSNorm epsilon (finite, >= 0).
      k_cache, v_cache: ``[B, Hkv, S_max, D]``, written in place (D dense); they
        must not share memory with each other or any input, nor be expanded views.
      status: optional ``[N]`` int32 output (see :func:`raise_on_status`): a token
        with a bad slot or position fails and writes nothing.

    Two tokens writing the same (slot, position) race; callers pass distinct ones.
    """
    torch.ops.flashspark.inject_context_kv(
        k, v, positions, slots, k_norm_weight, cos_sin_cache, eps, k_cache, v_cache, status=status
    )


@torch.library.register_fake("flashspark::block_diffusion_attention")
def _block_diffusion_attention_fake(q, k_cache, v_cache, ctx_lens, k_block, v_block, scale, *, status=None):
    _one_device(
        "block_diffusion_attention",
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        ctx_lens=ctx_lens,
        k_block=k_block,
        v_block=v_block,
        status=status,
    )
    return q.new_empty(q.shape)


@torch.library.register_fake("flashspark::inject_context_kv")
def _inject_context_kv_fake(
    k, v, positions, slots, k_norm_weight, cos_sin_cache, eps, k_cache, v_cache, *, status=None
):
    _one_device(
        "inject_context_kv",
        k_cache=k_cache,
        k=k,
        v=v,
        positions=positions,
        slots=slots,
        k_norm_weight=k_norm_weight,
        cos_sin_cache=cos_sin_cache,
        v_cache=v_cache,
        status=status,
    )
    return None


# ---------------------------------------------------------------- DFlash 2


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
    *,
    status: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """DFlash 2 two-tap dynamic depthwise conv (one pass over x).

    ``out[t, c] = (base[0, c] + delta[t, 0, c // 16]) * x[t, c]
    + (base[1, c] + delta[t, 1, c // 16]) * x[t - 1, c]`` (+ ``residual[t, c]``),
    with ``x[t - 1] = 0`` at the first row of each block.

    Args:
      x: ``[..., T, C]`` fp32/bf16/fp16; rows are x flattened to ``[N, C]``.
      base: ``[2, C]`` static taps (identity init: base[0] = 1, base[1] = 0).
      delta: ``[..., 2, ceil(C / 16)]`` dynamic taps, one row per row of x,
        shared by groups of 16 channels; or None with ``delta_weight``.
      block_size: rows per block when ``cu_blocks`` is None (row t starts a
        block when ``t % block_size == 0``).
      cu_blocks: ``[num_blocks + 1]`` int32 row offsets of ragged blocks.
      residual: optional ``[..., T, C]`` added to the output (fused residual).
      delta_weight: ``[2 * ceil(C / 16), C]`` the taps' projection (x's dtype),
        instead of ``delta``: the op computes ``delta[t] = x[t] @ delta_weight.T``
        itself, in fp32 (the whole dynamic conv in one op; no δ tensor).
      norm_weight: optional ``[C]`` (x's dtype): the conv runs on RMSNorm(x) =
        ``norm_weight * (x * rsqrt(mean(x^2) + norm_eps))`` per row, computed in
        fp32 (DFlash 2's "prepare" conv fused with the sublayer's norm); the taps
        from ``delta_weight`` see the normalized rows too. The residual is added
        unnormalized.
      norm_eps: RMSNorm's epsilon (finite, >= 0).
      status: optional ``[1]`` int32 output (see :func:`raise_on_status`): with
        offsets ``cu_blocks`` that do not start at 0, decrease, or do not end at
        the row count, the call fails and its output is NaN.

    Returns x's shape and dtype. Inference op (no autograd): training uses the
    reference, which computes the same function.
    """
    return torch.ops.flashspark.two_tap_conv(
        x, base, delta, block_size, cu_blocks, residual, delta_weight, norm_weight, norm_eps, status=status
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
    x, base, delta, block_size, cu_blocks, residual, delta_weight=None, norm_weight=None, norm_eps=1e-6, *, status=None
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
        status=status,
    )
    return x.new_empty(x.shape)


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


# ---------------------------------------------------------------- DSpark


def markov_step(
    base_logits: torch.Tensor,
    prev_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden: torch.Tensor,
    conf_w: torch.Tensor,
    conf_b: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSpark intra-block step for all requests at once.

    ``logits = base_logits + W2 · W1[prev_tokens] (+ bias)``; the token is drawn
    by an exponential race at ``temperature`` (argmax at 0) with Philox at
    ``(seeds[b], positions[b])`` (greedy below a temperature of 1e-5); logits read
    NaN as -inf and +inf as the largest float, and a row with no finite logit takes
    token 0 with q one-hot; q = softmax(logits / T) is what ``verify``
    needs as dense q; the confidence is ``sigmoid(conf_w · [hidden ; W1[prev]] + conf_b)``.

    Args:
      base_logits: ``[B, V]`` the backbone's logits U_k at this block position.
      prev_tokens: ``[B]`` int32/int64 token drawn at the previous position.
      w1: ``[V, r]`` Markov embedding; w2: ``[V, r]`` Markov projection
        (a ``Linear(r, V)`` weight); same dtype as base_logits.
      hidden: ``[B, H]`` backbone hidden state h_k; conf_w ``[H + r]``; conf_b ``[1]``.
      temperature: ``[B]`` fp32; seeds ``[B]`` int64; positions ``[B]`` int64.
      bias: optional ``[V]``.
      status: optional ``[B]`` int32 output (see :func:`raise_on_status`): a
        request with a previous token outside ``[0, V)`` or a bad temperature fails:
        token -1, q 0, confidence 0.

    Returns ``(tokens [B] int32, q [B, V] fp32, confidence [B] fp32)``. The CUDA
    kernel reads W2 once per step for the whole batch (B <= 256, r <= 512).
    """
    return torch.ops.flashspark.markov_step(
        base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions, status=status
    )


@torch.library.register_fake("flashspark::markov_step")
def _markov_step_fake(
    base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions, *, status=None
):
    _one_device(
        "markov_step",
        base_logits=base_logits,
        prev_tokens=prev_tokens,
        w1=w1,
        w2=w2,
        bias=bias,
        hidden=hidden,
        conf_w=conf_w,
        conf_b=conf_b,
        temperature=temperature,
        seeds=seeds,
        positions=positions,
        status=status,
    )
    b, v = base_logits.shape
    return (
        base_logits.new_empty((b,), dtype=torch.int32),
        base_logits.new_empty((b, v), dtype=torch.float32),
        base_logits.new_empty((b,), dtype=torch.float32),
    )
