"""Tests of the DFlash ops (block_diffusion_attention, inject_context_kv) against
their pure-PyTorch oracles and against the unfused PyTorch paths they replace."""

import flashspark
import pytest
import torch
import torch.nn.functional as F
from flashspark.reference import (
    block_diffusion_attention_reference,
    inject_context_kv_reference,
    rope_cos_sin_cache,
)

# Tolerances per dtype: the kernels accumulate in fp32 like the reference, so
# the error is the output rounding plus a few fp32 ulps of reordering.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def attn_inputs(batch, gamma, hq, hkv, dim, ctx_lens, max_len, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q = rnd(batch, gamma, hq, dim)
    k_cache, v_cache = rnd(batch, hkv, max_len, dim), rnd(batch, hkv, max_len, dim)
    k_block, v_block = rnd(batch, gamma, hkv, dim), rnd(batch, gamma, hkv, dim)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, lens, k_block, v_block


def sdpa_path(q, k_cache, v_cache, ctx_lens, k_block, v_block, scale):
    """The unfused PyTorch path: gather each request's context, concatenate the
    block, and call scaled_dot_product_attention without a mask."""
    outs = []
    for b in range(q.shape[0]):
        n = int(ctx_lens[b])
        keys = torch.cat([k_cache[b, :, :n], k_block[b].transpose(0, 1)], dim=1).float()
        vals = torch.cat([v_cache[b, :, :n], v_block[b].transpose(0, 1)], dim=1).float()
        o = F.scaled_dot_product_attention(
            q[b].transpose(0, 1).float()[None], keys[None], vals[None], scale=scale, enable_gqa=True
        )
        outs.append(o[0].transpose(0, 1))
    return torch.stack(outs).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gamma", [1, 7, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_attention_matches_reference(device, dtype, gamma, hq, hkv):
    ctx = [0, 1, 17, 300]
    args = attn_inputs(4, gamma, hq, hkv, 64, ctx, 320, dtype, device, seed=gamma + hq)
    scale = 64**-0.5
    got = flashspark.ops.block_diffusion_attention(*args, scale)
    want = block_diffusion_attention_reference(*args, scale)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dim", [8, 64, 128, 256])
def test_attention_long_context_and_head_dims(device, dim):
    # 1000+ context crosses several key splits; also an odd total (ctx + gamma).
    args = attn_inputs(2, 7, 4, 2, dim, [1203, 999], 1300, torch.float32, device, seed=dim)
    got = flashspark.ops.block_diffusion_attention(*args, 0.1)
    want = sdpa_path(*[a.cpu() for a in args], 0.1)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_attention_equals_sdpa_on_layer_slices(device):
    # Caches as one layer of a [L, B, Hkv, S, D] buffer (strided batch dim) and
    # queries as a transposed view: the op must read the strides, not copy-assume.
    full_k = torch.randn(3, 2, 2, 50, 32, device=device)
    full_v = torch.randn(3, 2, 2, 50, 32, device=device)
    q = torch.randn(2, 4, 5, 32, device=device).transpose(1, 2)  # [B, G=5, Hq=4, D], non-contiguous
    kb, vb = torch.randn(2, 5, 2, 32, device=device), torch.randn(2, 5, 2, 32, device=device)
    lens = torch.tensor([50, 13], device=device)
    got = flashspark.ops.block_diffusion_attention(q, full_k[1], full_v[1], lens, kb, vb, 0.2)
    want = sdpa_path(q.cpu(), full_k[1].cpu(), full_v[1].cpu(), lens.cpu(), kb.cpu(), vb.cpu(), 0.2)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


def test_attention_block_is_bidirectional(device):
    # Changing the last block position's K/V must change the first position's output.
    args = list(attn_inputs(1, 4, 2, 2, 16, [5], 8, torch.float32, device))
    a = flashspark.ops.block_diffusion_attention(*args, 0.25)
    args[4] = args[4].clone()
    args[4][0, 3] += 1.0
    b = flashspark.ops.block_diffusion_attention(*args, 0.25)
    assert not torch.allclose(a[0, 0], b[0, 0])


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_attention_opcheck(device, q_dtype):
    args = attn_inputs(2, 3, 4, 2, 16, [3, 0], 6, q_dtype, device)
    torch.library.opcheck(torch.ops.flashspark.block_diffusion_attention.default, (*args, 0.25))


ATTN_BAD = [
    ("q", lambda a: {**a, "q": a["q"].int()}),
    ("q", lambda a: {**a, "q": a["q"][0]}),
    ("k_cache", lambda a: {**a, "k_cache": a["k_cache"].double()}),
    ("k_cache", lambda a: {**a, "k_cache": a["k_cache"][:, :3]}),  # 3 KV heads do not divide 4 query heads
    ("v_cache", lambda a: {**a, "v_cache": a["v_cache"][:, :, :5]}),
    ("k_block", lambda a: {**a, "k_block": a["k_block"][:, :2]}),
    ("v_block", lambda a: {**a, "v_block": a["v_block"][..., :8]}),
    ("ctx_lens", lambda a: {**a, "ctx_lens": torch.tensor([1, 7], dtype=torch.int32)}),
    ("ctx_lens", lambda a: {**a, "ctx_lens": torch.tensor([1, -1], dtype=torch.int32)}),
    ("ctx_lens", lambda a: {**a, "ctx_lens": torch.tensor([1.0, 2.0])}),
    ("ctx_lens", lambda a: {**a, "ctx_lens": torch.tensor([1, 2, 3], dtype=torch.int32)}),
    (
        "head_dim",
        lambda a: {
            **a,
            **dict(
                zip(
                    ["q", "k_cache", "v_cache", "ctx_lens", "k_block", "v_block"],
                    attn_inputs(2, 3, 4, 2, 264, [3, 0], 6, torch.float32, "cpu"),
                )
            ),
        },
    ),
]


@pytest.mark.parametrize("name,change", ATTN_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ATTN_BAD)])
def test_attention_bad_inputs(name, change):
    names = ["q", "k_cache", "v_cache", "ctx_lens", "k_block", "v_block"]
    a = dict(zip(names, attn_inputs(2, 3, 4, 4, 16, [3, 0], 6, torch.float32, "cpu")))
    a = change(a)
    with pytest.raises(RuntimeError, match=name):
        flashspark.ops.block_diffusion_attention(*[a[n] for n in names], 0.25)


# ---------------------------------------------------------------- inject_context_kv


def inject_inputs(n, batch, hkv, dim, max_len, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, hkv, dim, generator=g) * 2).to(dtype).to(device)
    v = torch.randn(n, hkv, dim, generator=g).to(dtype).to(device)
    # distinct (slot, position) pairs
    flat = torch.randperm(batch * max_len, generator=g)[:n]
    slots = (flat // max_len).to(torch.int32).to(device)
    positions = (flat % max_len).to(torch.int64).to(device)
    weight = (1 + 0.1 * torch.randn(dim, generator=g)).to(device)
    cos_sin = rope_cos_sin_cache(max_len, dim, 10000.0).to(device)
    k_cache = torch.zeros(batch, hkv, max_len, dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    return k, v, positions, slots, weight, cos_sin, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,hkv,dim", [(1, 1, 2), (19, 2, 64), (99, 4, 128), (7, 3, 256)])
def test_inject_matches_reference(device, dtype, n, hkv, dim):
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(n, 5, hkv, dim, 40, dtype, device, seed=n)
    kc_ref, vc_ref = kc.clone().cpu(), vc.clone().cpu()
    flashspark.ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kc, vc)
    inject_context_kv_reference(k.cpu(), v.cpu(), pos.cpu(), slots.cpu(), w.cpu(), cs.cpu(), 1e-6, kc_ref, vc_ref)
    tol = TOL[dtype]
    torch.testing.assert_close(kc.float().cpu(), kc_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(vc.cpu(), vc_ref)  # V is a plain copy
    untouched = torch.ones(kc.shape[:3], dtype=torch.bool)
    untouched[slots.cpu().long(), :, pos.cpu()] = False
    assert (kc.cpu()[untouched] == 0).all(), "wrote outside the given slots/positions"


def test_inject_equals_unfused_model_path(device):
    # The unfused path of the target model: k_norm (RMSNorm module), apply_rope
    # with the model's own cos/sin, then an indexed cache write.
    from flashspark.models.decoder import RMSNorm, apply_rope, rope_cos_sin

    n, hkv, dim, max_len = 12, 2, 64, 64
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(n, 3, hkv, dim, max_len, torch.float32, device, seed=1)
    norm = RMSNorm(dim, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(w)
    cos, sin = rope_cos_sin(pos[None], dim, 10000.0, torch.float32)  # [1, 1, N, D]
    roped = apply_rope(norm(k).transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)  # [N, Hkv, D]
    want = torch.zeros_like(kc)
    want[slots.long(), :, pos] = roped
    flashspark.ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kc, vc)
    torch.testing.assert_close(kc, want, atol=2e-5, rtol=2e-5)


def test_inject_into_layer_slice_and_strided_tokens(device):
    # Write into layer 1 of a [L, B, Hkv, S, D] cache from every other token row.
    n, hkv, dim = 6, 2, 32
    k, v, pos, slots, w, cs, _, _ = inject_inputs(2 * n, 2, hkv, dim, 16, torch.float32, device, seed=3)
    big_k = torch.zeros(3, 2, hkv, 16, dim, device=device)
    big_v = torch.zeros_like(big_k)
    flashspark.ops.inject_context_kv(k[::2], v[::2], pos[::2], slots[::2], w, cs, 1e-6, big_k[1], big_v[1])
    ref_k, ref_v = torch.zeros(2, hkv, 16, dim), torch.zeros(2, hkv, 16, dim)
    inject_context_kv_reference(
        k[::2].cpu(), v[::2].cpu(), pos[::2].cpu(), slots[::2].cpu(), w.cpu(), cs.cpu(), 1e-6, ref_k, ref_v
    )
    torch.testing.assert_close(big_k[1].cpu(), ref_k, atol=2e-5, rtol=2e-5)
    assert (big_k[0] == 0).all() and (big_k[2] == 0).all()


def test_inject_opcheck(device):
    args = inject_inputs(5, 2, 2, 16, 8, torch.float32, device)
    torch.library.opcheck(torch.ops.flashspark.inject_context_kv.default, (*args[:6], 1e-6, *args[6:]))


INJECT_BAD = [
    ("k", lambda a: {**a, "k": a["k"].double()}),
    ("k", lambda a: {**a, "k": a["k"][:, :1]}),
    ("v", lambda a: {**a, "v": a["v"][:3]}),
    ("positions", lambda a: {**a, "positions": a["positions"][:3]}),
    ("positions", lambda a: {**a, "positions": torch.full_like(a["positions"], 8)}),
    ("positions", lambda a: {**a, "positions": torch.full_like(a["positions"], -1)}),
    ("slots", lambda a: {**a, "slots": torch.full_like(a["slots"], 2)}),
    ("slots", lambda a: {**a, "slots": a["slots"].float()}),
    ("k_norm_weight", lambda a: {**a, "k_norm_weight": a["k_norm_weight"][:4]}),
    ("cos_sin_cache", lambda a: {**a, "cos_sin_cache": a["cos_sin_cache"][:, :8]}),
    ("cos_sin_cache", lambda a: {**a, "cos_sin_cache": a["cos_sin_cache"][:3]}),
    ("cos_sin_cache", lambda a: {**a, "cos_sin_cache": a["cos_sin_cache"].double()}),
    ("v_cache", lambda a: {**a, "v_cache": a["v_cache"][:1]}),
    ("k_cache", lambda a: {**a, "k_cache": a["k_cache"].transpose(2, 3)}),
]


@pytest.mark.parametrize("name,change", INJECT_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(INJECT_BAD)])
def test_inject_bad_inputs(name, change):
    names = ["k", "v", "positions", "slots", "k_norm_weight", "cos_sin_cache", "k_cache", "v_cache"]
    a = dict(zip(names, inject_inputs(5, 2, 2, 16, 8, torch.float32, "cpu")))
    a = change(a)
    with pytest.raises(RuntimeError, match=name):
        flashspark.ops.inject_context_kv(*[a[n] for n in names[:6]], 1e-6, a["k_cache"], a["v_cache"])
