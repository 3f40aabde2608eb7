"""DFlash drafter ops: block_diffusion_attention and inject_context_kv (wrappers, fakes,
PyTorch implementations)."""

from __future__ import annotations

from typing import Optional

import torch

from .common import _one_device, rms_norm


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


def block_diffusion_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_lens: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Oracle of :func:`flashspark.ops.block_diffusion_attention`.

    q [B, G, Hq, D] block queries; k_cache/v_cache [B, Hkv, S_max, D] context
    K/V, of which request b uses the first ctx_lens[b] positions; k_block /
    v_block [B, G, Hkv, D] the block's own K/V. No mask: every block query sees
    all of its request's context and the whole block. GQA: query head h reads
    KV head h // (Hq // Hkv). Computed in fp32, returned in q's dtype.
    """
    batch, gamma, hq, dim = q.shape
    hkv = k_block.shape[2]
    group = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(batch):
        n = int(ctx_lens[b])
        keys = torch.cat([k_cache[b, :, :n].float(), k_block[b].float().transpose(0, 1)], dim=1)  # [Hkv, n+G, D]
        vals = torch.cat([v_cache[b, :, :n].float(), v_block[b].float().transpose(0, 1)], dim=1)
        keys = keys.repeat_interleave(group, dim=0)  # [Hq, n+G, D]
        vals = vals.repeat_interleave(group, dim=0)
        qb = q[b].float().transpose(0, 1)  # [Hq, G, D]
        probs = torch.softmax(qb @ keys.transpose(1, 2) * scale, dim=-1)
        out[b] = (probs @ vals).transpose(0, 1)
    return out.to(q.dtype)


def rope_cos_sin_cache(max_positions: int, head_dim: int, theta: float) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos(p * f_i) in the first half, sin in the
    second, f_i = theta^(-2i / head_dim) (rotate-half RoPE, as in Qwen3)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def inject_context_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Oracle of :func:`flashspark.ops.inject_context_kv` (writes the caches in place).

    For each new context token i: k_cache[slots[i], :, positions[i]] =
    RoPE(RMSNorm(k[i]) * k_norm_weight) and v_cache[slots[i], :, positions[i]] = v[i].
    k, v [N, Hkv, D]; RMSNorm is over D per head, in fp32.
    """
    kf = k.float()
    kf = rms_norm(kf, k_norm_weight.float(), eps)
    half = k.shape[-1] // 2
    cs = cos_sin_cache.float()[positions.long()]  # [N, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = kf[..., :half], kf[..., half:]
    roped = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    slots_l, pos_l = slots.long(), positions.long()
    k_cache[slots_l, :, pos_l] = roped.to(k_cache.dtype)
    v_cache[slots_l, :, pos_l] = v.to(v_cache.dtype)
