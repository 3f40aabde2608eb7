"""Tests of the DFlash 2 ops (two_tap_conv, topk_select, path_select) against
their pure-PyTorch oracles, brute force, and distribution checks."""

import itertools
import math

import flashspark
import pytest
import torch
from flashspark.reference import (
    conv_groups,
    grouped_taps,
    path_select_reference,
    rms_norm,
    topk_select_reference,
    two_tap_conv_reference,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# ---------------------------------------------------------------- two_tap_conv


def conv_inputs(rows, channels, dtype, device, seed=0, residual=False, group_size=16):
    g = torch.Generator().manual_seed(seed)
    groups = conv_groups(channels, group_size)
    x = torch.randn(rows, channels, generator=g).to(dtype).to(device)
    base = torch.randn(2, channels, generator=g).to(dtype).to(device)
    delta = (0.3 * torch.randn(rows, 2, groups, generator=g)).to(dtype).to(device)
    res = torch.randn(rows, channels, generator=g).to(dtype).to(device) if residual else None
    return x, base, delta, res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [1, 15, 16, 17, 100, 257])
@pytest.mark.parametrize("residual", [False, True])
def test_conv_matches_reference(device, dtype, channels, residual):
    x, base, delta, res = conv_inputs(21, channels, dtype, device, seed=channels, residual=residual)
    got = flashspark.ops.two_tap_conv(x, base, delta, 7, residual=res)
    want = two_tap_conv_reference(x, base, delta, 7, residual=res)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])


def test_conv_ragged_blocks_and_3d(device):
    x, base, delta, _ = conv_inputs(19, 40, torch.float32, device, seed=1)
    cu = torch.tensor([0, 5, 6, 6, 19], dtype=torch.int32, device=device)
    got = flashspark.ops.two_tap_conv(x, base, delta, cu_blocks=cu)
    want = two_tap_conv_reference(x, base, delta, cu_blocks=cu.cpu())
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    # [B, T, C] with block_size = T is the same as ragged blocks of T rows.
    x3 = torch.randn(3, 8, 40, device=device)
    d3 = torch.randn(3, 8, 2, 3, device=device)
    a = flashspark.ops.two_tap_conv(x3, base, d3, 8)
    b = flashspark.ops.two_tap_conv(
        x3.reshape(24, 40), base, d3.reshape(24, 2, 3), cu_blocks=torch.tensor([0, 8, 16, 24], device=device)
    )
    assert torch.equal(a.reshape(24, 40), b)


def test_conv_identity_init_and_left_to_right(device):
    x, _, _, _ = conv_inputs(16, 32, torch.float32, device)
    base = torch.zeros(2, 32, device=device)
    base[0] = 1.0
    delta = torch.zeros(16, 2, 2, device=device)
    assert torch.equal(flashspark.ops.two_tap_conv(x, base, delta, 8), x)
    # Information flows left to right only: changing row 5 changes rows 5 and 6, nothing before.
    base[1] = 0.5
    a = flashspark.ops.two_tap_conv(x, base, delta, 8)
    x2 = x.clone()
    x2[5] += 1.0
    b = flashspark.ops.two_tap_conv(x2, base, delta, 8)
    changed = (a != b).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5, 6]


def test_conv_non_contiguous(device):
    x, base, delta, res = conv_inputs(12, 33, torch.float32, device, residual=True)
    wide = torch.zeros(12, 50, device=device)
    wide[:, 3:36] = x
    got = flashspark.ops.two_tap_conv(wide[:, 3:36], base, delta, 4, residual=res.t().contiguous().t())
    torch.testing.assert_close(got, flashspark.ops.two_tap_conv(x, base, delta, 4, residual=res))


def test_conv_opcheck(device):
    x, base, delta, res = conv_inputs(10, 20, torch.float32, device, residual=True)
    torch.library.opcheck(torch.ops.flashspark.two_tap_conv.default, (x, base, delta, 4, None, res))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flashspark.two_tap_conv.default, (x, base, delta, 0, cu, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [1, 17, 100, 257])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [6, 23, 70])
def test_conv_fused_projection_matches_reference(device, dtype, channels, residual, rows):
    """delta_weight: the op computes delta = x @ W.T itself (fp32) and applies the conv
    (rows not a multiple of the CPU kernel's four-row steps; 6 rows take the CPU taps as
    dot products, 23 and 70 from W^T strips)."""
    x, base, _, res = conv_inputs(rows, channels, dtype, device, seed=channels + 1, residual=residual)
    groups = (channels + 15) // 16
    w = (0.2 * torch.randn(2 * groups, channels, generator=torch.Generator().manual_seed(7))).to(dtype).to(device)
    got = flashspark.ops.two_tap_conv(x, base, None, 8, residual=res, delta_weight=w)
    want = two_tap_conv_reference(x, base, None, 8, residual=res, delta_weight=w)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    # The same conv as an fp32 delta passed in (fp32: the unfused op on the projected taps).
    if dtype == torch.float32:
        delta = (x @ w.t()).view(rows, 2, groups)
        torch.testing.assert_close(
            got, flashspark.ops.two_tap_conv(x, base, delta, 8, residual=res), atol=1e-5, rtol=1e-5
        )
    # A projection that is not the identity's zero must move the output (the taps are read).
    plain = flashspark.ops.two_tap_conv(x, base, None, 8, residual=res, delta_weight=torch.zeros_like(w))
    assert not torch.equal(plain, got)


def test_conv_fused_projection_ragged_strided_and_opcheck(device):
    x, base, _, res = conv_inputs(19, 40, torch.float32, device, seed=3, residual=True)
    w = torch.randn(6, 40, device=device) * 0.1
    cu = torch.tensor([0, 5, 6, 6, 19], dtype=torch.int32, device=device)
    wide = torch.zeros(19, 57, device=device)
    wide[:, 9:49] = x
    got = flashspark.ops.two_tap_conv(wide[:, 9:49], base, None, cu_blocks=cu, residual=res, delta_weight=w)
    want = two_tap_conv_reference(x, base, None, cu_blocks=cu.cpu(), residual=res, delta_weight=w)
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    torch.library.opcheck(torch.ops.flashspark.two_tap_conv.default, (x, base, None, 4, None, res, w))
    torch.library.opcheck(torch.ops.flashspark.two_tap_conv.default, (x, base, None, 0, cu, None, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [1, 17, 100, 257])
@pytest.mark.parametrize("taps", ["delta", "delta_weight"])
@pytest.mark.parametrize("rows", [6, 23])
def test_conv_fused_norm_matches_reference(device, dtype, channels, taps, rows):
    """norm_weight: the conv (and the taps from delta_weight) run on RMSNorm(x), the
    residual is added unnormalized; rows at scales far from 1 so a missing or misplaced
    normalization shows."""
    x, base, delta, res = conv_inputs(rows, channels, dtype, device, seed=channels + 3, residual=True)
    scale = torch.logspace(-2, 2, rows, device=device)[:, None]
    x = (x.float() * scale).to(dtype)
    g = torch.Generator().manual_seed(11)
    nw = (1 + 0.5 * torch.randn(channels, generator=g)).to(dtype).to(device)
    groups = (channels + 15) // 16
    w = (0.2 * torch.randn(2 * groups, channels, generator=g)).to(dtype).to(device)
    kw = dict(delta_weight=w) if taps == "delta_weight" else {}
    d = None if taps == "delta_weight" else delta
    got = flashspark.ops.two_tap_conv(x, base, d, 8, residual=res, norm_weight=nw, norm_eps=1e-5, **kw)
    want = two_tap_conv_reference(x, base, d, 8, residual=res, norm_weight=nw, norm_eps=1e-5, **kw)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    # The same as normalizing first with Qwen3's RMSNorm (fp32) and running the plain op.
    if dtype == torch.float32:
        xn = nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        plain = flashspark.ops.two_tap_conv(xn, base, d, 8, residual=res, **kw)
        torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got.float(), flashspark.ops.two_tap_conv(x, base, d, 8, residual=res, **kw).float())


def test_conv_fused_norm_ragged_strided_and_opcheck(device):
    x, base, delta, _ = conv_inputs(19, 40, torch.float32, device, seed=5)
    w = torch.randn(6, 40, device=device) * 0.1
    nw = torch.rand(40, device=device) + 0.5
    cu = torch.tensor([0, 5, 6, 6, 19], dtype=torch.int32, device=device)
    wide = torch.zeros(19, 57, device=device)
    wide[:, 9:49] = x * 30
    got = flashspark.ops.two_tap_conv(
        wide[:, 9:49], base, None, cu_blocks=cu, delta_weight=w, norm_weight=nw, norm_eps=1e-6
    )
    want = two_tap_conv_reference(x * 30, base, None, cu_blocks=cu.cpu(), delta_weight=w, norm_weight=nw, norm_eps=1e-6)
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)
    op = torch.ops.flashspark.two_tap_conv.default
    torch.library.opcheck(op, (x, base, None, 4, None, None, w, nw, 1e-6))
    torch.library.opcheck(op, (x, base, delta, 0, cu, None, None, nw, 1e-5))


# ---- group sizes other than 16, and the finish conv's taps (a 4G-row delta_weight)

GROUP_SIZES = [1, 3, 8, 16, 32, 37, 64]  # with C = 37: one channel per tap up to one (partial) group


def finish_inputs(rows, channels, group_size, dtype, device, seed=0):
    """x at scales far from 1 (a missing normalization shows), base, a 4G-row projection and a norm weight."""
    g = torch.Generator().manual_seed(seed)
    groups = conv_groups(channels, group_size)
    x = (torch.randn(rows, channels, generator=g) * torch.logspace(-1, 0.5, rows)[:, None]).to(dtype).to(device)
    base = torch.randn(2, channels, generator=g).to(dtype).to(device)
    w = (0.5 / channels**0.5 * torch.randn(4 * groups, channels, generator=g)).to(dtype).to(device)
    nw = (1 + 0.3 * torch.randn(channels, generator=g)).to(dtype).to(device)
    return x, base, w, nw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("taps", ["delta", "delta_weight"])
@pytest.mark.parametrize("rows", [6, 23])
def test_conv_group_size_matches_reference(device, dtype, group_size, taps, rows):
    """Channel c takes tap group c // group_size, G = ceil(C / group_size) (C = 37: never a
    multiple of the group but for 1 and 37), with given taps and projected ones (6 rows: the CPU
    taps as dot products; 23: from W^T strips), residual and ragged blocks."""
    channels = 37
    x, base, delta, res = conv_inputs(
        rows, channels, dtype, device, seed=group_size, residual=True, group_size=group_size
    )
    groups = conv_groups(channels, group_size)
    assert delta.shape == (rows, 2, groups)
    w = (0.2 * torch.randn(2 * groups, channels, generator=torch.Generator().manual_seed(3))).to(dtype).to(device)
    kw = dict(delta_weight=w) if taps == "delta_weight" else {}
    d = None if taps == "delta_weight" else delta
    cu = torch.tensor([0, 2, 2, 5, rows], dtype=torch.int32, device=device)
    for blocks in [dict(block_size=4), dict(cu_blocks=cu)]:
        got = flashspark.ops.two_tap_conv(x, base, d, **blocks, residual=res, group_size=group_size, **kw)
        want = two_tap_conv_reference(x, base, d, **blocks, residual=res, group_size=group_size, **kw)
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    # The group is read: taps that differ between groups give another output under another group size.
    if 1 < groups and taps == "delta":
        other = flashspark.ops.two_tap_conv(x, base, delta.flip(-1), 4, residual=res, group_size=group_size)
        assert not torch.equal(
            other, flashspark.ops.two_tap_conv(x, base, delta, 4, residual=res, group_size=group_size)
        )


def test_conv_default_group_size_is_16(device):
    """Callers that name neither new argument (the drafter passes nine positionally) keep groups of 16."""
    x, base, _, res = conv_inputs(11, 40, torch.float32, device, seed=2, residual=True)
    w = 0.2 * torch.randn(6, 40, device=device)
    nw = torch.rand(40, device=device) + 0.5
    a = torch.ops.flashspark.two_tap_conv.default(x, base, None, 4, None, res, w, nw, 1e-6)
    assert torch.equal(a, flashspark.ops.two_tap_conv(x, base, None, 4, None, res, w, nw, 1e-6, 16, None))
    want = two_tap_conv_reference(x, base, None, 4, residual=res, delta_weight=w, norm_weight=nw)
    assert torch.equal(want, two_tap_conv_reference(x, base, None, 4, None, res, w, nw, 1e-6, 16))
    torch.testing.assert_close(a.cpu(), want.cpu(), atol=1e-5, rtol=1e-5)


def test_conv_reference_is_the_formula():
    """The oracle itself, element by element on a small case (group 3, a 4G-row projection, norm)."""
    rows, channels, group_size = 5, 8, 3
    groups = conv_groups(channels, group_size)
    x, base, w, nw = finish_inputs(rows, channels, group_size, torch.float64, "cpu", seed=4)
    x, base, w, nw = (t.float() for t in (x, base, w, nw))
    finish = torch.empty(rows, 2, groups)
    out = two_tap_conv_reference(
        x, base, None, 2, delta_weight=w, norm_weight=nw, group_size=group_size, finish_delta=finish
    )
    xn = nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    want = torch.zeros(rows, channels)
    for t in range(rows):
        taps = [[float(xn[t] @ w[o * groups + c // group_size]) for c in range(channels)] for o in range(2)]
        for c in range(channels):
            want[t, c] = (base[0, c] + taps[0][c]) * xn[t, c]
            if t % 2:
                want[t, c] += (base[1, c] + taps[1][c]) * xn[t - 1, c]
            for o in range(2):
                for gi in range(groups):
                    assert math.isclose(
                        float(finish[t, o, gi]),
                        float(xn[t] @ w[2 * groups + o * groups + gi]),
                        rel_tol=1e-5,
                        abs_tol=1e-5,
                    )
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # grouped_taps: channel c takes group c // group_size, and gradients flow back to the groups.
    d = torch.randn(4, 2, groups, requires_grad=True)
    spread = grouped_taps(d, group_size, channels)
    assert torch.equal(spread, d.repeat_interleave(group_size, dim=-1)[..., :channels])
    spread.sum().backward()
    assert d.grad[0, 0].tolist() == [3.0, 3.0, 2.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_size", [1, 3, 16, 32, 37])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("rows", [6, 23])
def test_conv_finish_delta_matches_reference(device, dtype, group_size, norm, rows):
    """A 4G-row delta_weight: the op writes the finish conv's taps (rows [2G, 4G) of the
    projection of the same, normalized rows) to finish_delta, its own output unchanged; the
    finish conv fed finish_delta then equals the reference's two-conv composition."""
    channels = 37
    x, base, w, nw = finish_inputs(rows, channels, group_size, dtype, device, seed=group_size + 7 * norm)
    groups = conv_groups(channels, group_size)
    norm_kw = dict(norm_weight=nw, norm_eps=1e-5) if norm else {}
    finish = torch.full((rows, 2, groups), 777.0, dtype=dtype, device=device)
    got = flashspark.ops.two_tap_conv(
        x, base, None, 8, delta_weight=w, group_size=group_size, finish_delta=finish, **norm_kw
    )
    want_finish = torch.empty_like(finish)
    want = two_tap_conv_reference(
        x, base, None, 8, delta_weight=w, group_size=group_size, finish_delta=want_finish, **norm_kw
    )
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(finish.float().cpu(), want_finish.float().cpu(), atol=TOL[dtype], rtol=TOL[dtype])
    # The prepare conv's output is the one of the first 2G rows alone, bit for bit.
    alone = flashspark.ops.two_tap_conv(
        x, base, None, 8, delta_weight=w[: 2 * groups], group_size=group_size, **norm_kw
    )
    assert torch.equal(got, alone)
    # The finish taps are the projection of the conv's input: (normalized) x @ W[2G:].T.
    xin = rms_norm(x.float(), nw.float(), 1e-5) if norm else x.float()
    torch.testing.assert_close(
        finish.float(), (xin @ w[2 * groups :].float().t()).view(rows, 2, groups), atol=TOL[dtype], rtol=TOL[dtype]
    )
    # The sublayer's output y goes through the finish conv with those taps (and the sublayer's residual).
    g = torch.Generator().manual_seed(9)
    mix = (torch.randn(channels, channels, generator=g) / channels**0.5).to(dtype).to(device)
    base2 = torch.randn(2, channels, generator=g).to(dtype).to(device)
    y = torch.tanh(got.float() @ mix.float()).to(dtype)
    out = flashspark.ops.two_tap_conv(y, base2, finish, 8, residual=x, group_size=group_size)
    ref_y = torch.tanh(want.float() @ mix.float()).to(dtype)
    ref_out = two_tap_conv_reference(ref_y, base2, want_finish, 8, residual=x, group_size=group_size)
    tol = 2 * TOL[dtype]  # two convs and the sublayer between them, each rounded to dtype
    torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=tol, rtol=tol)


def test_conv_finish_delta_shapes_strides_and_blocks(device):
    """finish_delta follows delta's shape rule ([B, T, 2, G] for x [B, T, C]); x strided,
    ragged blocks; every entry is written (a stale value never survives)."""
    x3 = torch.randn(3, 7, 50, device=device)
    wide = torch.zeros(3, 7, 61, device=device)
    wide[..., 5:55] = x3
    group_size, groups = 8, 7
    w = 0.2 * torch.randn(4 * groups, 50, device=device)
    nw = torch.rand(50, device=device) + 0.5
    finish = torch.full((3, 7, 2, groups), float("nan"), device=device)
    cu = torch.tensor([0, 4, 4, 11, 21], dtype=torch.int32, device=device)
    got = flashspark.ops.two_tap_conv(
        wide[..., 5:55], torch.randn(2, 50, device=device), None, 0, cu, None, w, nw, 1e-6, group_size, finish
    )
    assert got.shape == (3, 7, 50) and torch.isfinite(finish).all()
    flat = torch.empty(21, 2, groups, device=device)
    flashspark.ops.two_tap_conv(
        x3.reshape(21, 50), torch.randn(2, 50, device=device), None, 7, None, None, w, nw, 1e-6, group_size, flat
    )
    assert torch.equal(finish.reshape(21, 2, groups), flat)
    # no rows: nothing to write, an empty output
    empty = torch.empty(0, 2, groups, device=device)
    assert flashspark.ops.two_tap_conv(
        x3[:0].reshape(0, 50),
        torch.randn(2, 50, device=device),
        None,
        4,
        delta_weight=w,
        group_size=group_size,
        finish_delta=empty,
    ).shape == (0, 50)


def test_conv_group_size_and_finish_opcheck(device):
    op = torch.ops.flashspark.two_tap_conv.default
    x, base, delta, res = conv_inputs(10, 20, torch.float32, device, residual=True, group_size=3)
    torch.library.opcheck(op, (x, base, delta, 4, None, res, None, None, 1e-6, 3))
    _, _, w, nw = finish_inputs(10, 20, 6, torch.float32, device)
    finish = torch.empty(10, 2, 4, device=device)
    torch.library.opcheck(op, (x, base, None, 4, None, res, w, nw, 1e-6, 6, finish))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    torch.library.opcheck(op, (x, base, None, 0, cu, None, w, None, 1e-6, 6, finish), {"status": status})


CONV_BAD = [
    ("x", lambda a: {**a, "x": a["x"].int()}),
    ("x", lambda a: {**a, "x": a["x"][0]}),
    ("base", lambda a: {**a, "base": a["base"][:1]}),
    ("base", lambda a: {**a, "base": a["base"].double()}),
    ("delta", lambda a: {**a, "delta": a["delta"][:, :, :1]}),
    ("delta", lambda a: {**a, "delta": a["delta"][:5]}),
    ("block_size", lambda a: {**a, "block_size": 0}),
    ("cu_blocks", lambda a: {**a, "cu_blocks": torch.tensor([0, 5, 3, 10], dtype=torch.int32)}),
    ("cu_blocks", lambda a: {**a, "cu_blocks": torch.tensor([0, 5, 9], dtype=torch.int32)}),
    ("residual", lambda a: {**a, "residual": a["x"][:, :5]}),
    ("exactly one of 'delta'", lambda a: {**a, "delta_weight": torch.zeros(4, 20)}),
    ("exactly one of 'delta'", lambda a: {**a, "delta": None}),
    ("delta_weight", lambda a: {**a, "delta": None, "delta_weight": torch.zeros(4, 19)}),
    ("delta_weight", lambda a: {**a, "delta": None, "delta_weight": torch.zeros(2, 20)}),
    ("delta_weight", lambda a: {**a, "delta": None, "delta_weight": torch.zeros(4, 20, dtype=torch.float64)}),
    ("norm_weight", lambda a: {**a, "norm_weight": torch.ones(19)}),
    ("norm_weight", lambda a: {**a, "norm_weight": torch.ones(2, 20)}),
    ("norm_weight", lambda a: {**a, "norm_weight": torch.ones(20, dtype=torch.float64)}),
    ("norm_eps", lambda a: {**a, "norm_weight": torch.ones(20), "norm_eps": -1.0}),
    ("'group_size' must lie in", lambda a: {**a, "group_size": 0}),
    ("'group_size' must lie in", lambda a: {**a, "group_size": -16}),
    ("'group_size' must lie in", lambda a: {**a, "group_size": 2**31}),
    ("'group_size' must lie in", lambda a: {**a, "group_size": 2**32 + 16}),  # not narrowed to 16
    ("'delta'", lambda a: {**a, "group_size": 8}),  # G = 3 now: delta [10, 2, 2] no longer fits
    (
        "'delta_weight' must have shape \\[4, 20\\].*or \\[8, 20\\]",
        lambda a: {**a, "delta": None, "delta_weight": torch.zeros(6, 20)},
    ),
    ("'delta_weight'", lambda a: {**a, "delta": None, "delta_weight": torch.zeros(16, 20)}),
    ("'finish_delta' is required", lambda a: {**a, "delta": None, "delta_weight": torch.zeros(8, 20)}),
    (
        "'finish_delta' is written only with",
        lambda a: {**a, "delta": None, "delta_weight": torch.zeros(4, 20), "finish_delta": torch.zeros(10, 2, 2)},
    ),
    ("'finish_delta' is written only with", lambda a: {**a, "finish_delta": torch.zeros(10, 2, 2)}),
    *[
        ("'finish_delta'", lambda a, f=f: {**a, "delta": None, "delta_weight": torch.zeros(8, 20), "finish_delta": f})
        for f in [
            torch.zeros(9, 2, 2),
            torch.zeros(10, 2, 3),
            torch.zeros(10, 4),
            torch.zeros(20, 2),
            torch.zeros(10, 2, 2, dtype=torch.float64),
            torch.zeros(10, 2, 2, dtype=torch.bfloat16),
            torch.zeros(10, 2, 4)[..., ::2],  # not contiguous
            torch.zeros(1, 2, 2).expand(10, 2, 2),  # overlapping itself
        ]
    ],
]


@pytest.mark.parametrize("name,change", CONV_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONV_BAD)])
def test_conv_bad_inputs(name, change):
    x, base, delta, _ = conv_inputs(10, 20, torch.float32, "cpu")
    a = change(
        dict(
            x=x,
            base=base,
            delta=delta,
            block_size=4,
            cu_blocks=None,
            residual=None,
            delta_weight=None,
            norm_weight=None,
            norm_eps=1e-6,
            group_size=16,
            finish_delta=None,
        )
    )
    with pytest.raises(RuntimeError, match=name):
        flashspark.ops.two_tap_conv(**a)


# ---------------------------------------------------------------- topk_select


@pytest.mark.parametrize("vocab", [1, 17, 4097, 151936])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_matches_reference(device, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(dtype).to(device)
    k = min(16, vocab)
    values, ids, lse = flashspark.ops.topk_select(logits, k)
    rv, ri, rl = topk_select_reference(logits.cpu(), k)
    assert torch.equal(ids.cpu(), ri)  # bf16 has many ties: the tie order is part of the contract
    assert torch.equal(values.cpu(), rv)
    torch.testing.assert_close(lse.cpu(), rl, atol=1e-4, rtol=1e-5)
    tv, _ = torch.topk(logits.float().cpu(), k)
    assert torch.equal(values.cpu(), tv)


def test_topk_ties_and_masking(device):
    logits = torch.zeros(2, 40, device=device)
    logits[1, 30:] = float("-inf")
    logits[1, [3, 9]] = 2.0
    values, ids, lse = flashspark.ops.topk_select(logits, 16)
    assert ids[0].cpu().tolist() == list(range(16))
    assert ids[1].cpu().tolist()[:2] == [3, 9] and ids[1].cpu().tolist()[2:] == [
        0,
        1,
        2,
        4,
        5,
        6,
        7,
        8,
        10,
        11,
        12,
        13,
        14,
        15,
    ]
    assert math.isclose(float(lse[0]), math.log(40), rel_tol=1e-6)


def test_topk_batched_shape_and_strides(device):
    logits = torch.randn(3, 4, 100, device=device)
    values, ids, lse = flashspark.ops.topk_select(logits[:, 1:3], 8)
    assert values.shape == (3, 2, 8) and ids.shape == (3, 2, 8) and lse.shape == (3, 2)
    rv, ri, _ = topk_select_reference(logits[:, 1:3].cpu(), 8)
    assert torch.equal(ids.cpu(), ri)


def test_topk_opcheck(device):
    torch.library.opcheck(torch.ops.flashspark.topk_select.default, (torch.randn(4, 300, device=device), 16))


@pytest.mark.parametrize("k", [0, 17, 11])
def test_topk_bad_k(k):
    with pytest.raises(RuntimeError, match="'k'"):
        flashspark.ops.topk_select(torch.randn(2, 10), k)


def test_topk_bad_dtype():
    with pytest.raises(RuntimeError, match="logits"):
        flashspark.ops.topk_select(torch.zeros(2, 10, dtype=torch.int64), 4)


# ---------------------------------------------------------------- path_select


def path_inputs(requests, positions, k, vocab=50, rank=8, dtype=torch.float32, device="cpu", seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(requests * positions)])
    cand = cand.reshape(requests, positions, k).to(torch.int32)
    unary = torch.randn(requests, positions, k, generator=g) * scale
    a_emb = torch.randn(vocab, rank, generator=g).to(dtype)
    b_emb = torch.randn(vocab, rank, generator=g).to(dtype)
    gg = (torch.randn(requests, positions, rank, generator=g) * 0.5).to(dtype)
    anchor = torch.randint(0, vocab, (requests,), generator=g, dtype=torch.int32)
    return [t.to(device) for t in (cand, unary, a_emb, b_emb, gg, anchor)]


def test_backtrack_is_the_best_path_by_brute_force(device):
    k, positions = 3, 4
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(6, positions, k, device=device, seed=1)
    tokens, choice, scores, q = flashspark.ops.path_select(cand, unary, a_emb, b_emb, g, anchor, mode="backtrack")
    for r in range(6):

        def path_score(path):
            total, prev = 0.0, int(anchor[r])
            for t, c in enumerate(path):
                tok = int(cand[r, t, c])
                total += float(unary[r, t, c]) + float((a_emb[prev] * g[r, t] * b_emb[tok]).sum())
                prev = tok
            return total

        best = max(itertools.product(range(k), repeat=positions), key=path_score)
        assert tuple(choice[r].cpu().tolist()) == best
        assert math.isclose(path_score(choice[r].cpu().tolist()), path_score(best), rel_tol=1e-5)
        assert tokens[r].cpu().tolist() == [int(cand[r, t, c]) for t, c in enumerate(best)]


@pytest.mark.parametrize("mode", ["backtrack", "greedy", "sample"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_path_matches_reference(device, mode, dtype):
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(
        7, 15, 16, vocab=300, rank=32, dtype=dtype, device=device, seed=2
    )
    temp = torch.full((7,), 0.8, device=device)
    temp[3] = 0.0  # sample mode at temperature 0 is greedy
    seeds = torch.arange(7, dtype=torch.int64, device=device) + 5
    offsets = torch.full((7,), 40, dtype=torch.int64, device=device)
    got = flashspark.ops.path_select(
        cand, unary, a_emb, b_emb, g, anchor, mode=mode, temperature=temp, seeds=seeds, offsets=offsets
    )
    want = path_select_reference(cand, unary, a_emb, b_emb, g, anchor, mode, temp, seeds, offsets)
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.cpu(), b.cpu())
    torch.testing.assert_close(got[2].cpu(), want[2].cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[3].cpu(), want[3].cpu(), atol=1e-5, rtol=1e-4)
    assert torch.allclose(got[3].sum(-1).cpu(), torch.ones(7, 15), atol=1e-5)


@pytest.mark.parametrize("mode", ["backtrack", "sample"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("positions", [1, 7, 15])
def test_path_fused_g_matches_reference(device, mode, dtype, positions):
    """hidden + g_weight: the op computes g = hidden @ g_weight.T itself (fp32), here from
    strided rows of a wider state (odd D, positions not a multiple of the CPU's four rows)."""
    cand, unary, a_emb, b_emb, _, anchor = path_inputs(
        5, positions, 16, vocab=300, rank=24, dtype=dtype, device=device, seed=6, scale=0.3
    )
    gen = torch.Generator().manual_seed(8)
    states = torch.randn(5, positions + 1, 71, generator=gen).to(dtype).to(device)
    hidden = states[:, 1:]  # non-contiguous, like the drafter's block positions 1..γ-1
    w_h = (0.3 * torch.randn(24, 71, generator=gen)).to(dtype).to(device)
    temp = torch.full((5,), 0.9, device=device)
    seeds = torch.arange(5, dtype=torch.int64, device=device)
    offsets = torch.full((5,), 3, dtype=torch.int64, device=device)
    got = flashspark.ops.path_select(
        cand,
        unary,
        a_emb,
        b_emb,
        None,
        anchor,
        mode=mode,
        temperature=temp,
        seeds=seeds,
        offsets=offsets,
        hidden=hidden,
        g_weight=w_h,
    )
    want = path_select_reference(cand, unary, a_emb, b_emb, None, anchor, mode, temp, seeds, offsets, hidden, w_h)
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a.cpu(), b.cpu())
    torch.testing.assert_close(got[2].cpu(), want[2].cpu(), atol=1e-3, rtol=1e-3)
    # The same as passing g computed outside (fp32 g: bf16 g would round it).
    if dtype == torch.float32:
        g = hidden @ w_h.t()
        given = flashspark.ops.path_select(
            cand, unary, a_emb, b_emb, g, anchor, mode=mode, temperature=temp, seeds=seeds, offsets=offsets
        )
        assert torch.equal(given[1], got[1])
        torch.testing.assert_close(given[2], got[2], atol=1e-4, rtol=1e-4)
    # The pair term is read: without it (g = 0) the scores are the unary ones.
    zero = flashspark.ops.path_select(
        cand,
        unary,
        a_emb,
        b_emb,
        None,
        anchor,
        mode=mode,
        temperature=temp,
        seeds=seeds,
        offsets=offsets,
        hidden=hidden,
        g_weight=torch.zeros_like(w_h),
    )
    assert not torch.allclose(zero[2], got[2])


@pytest.mark.parametrize("mode", ["backtrack", "greedy", "sample"])
@pytest.mark.parametrize("fused_g", [False, True])
def test_path_no_positions_matches_reference(device, mode, fused_g):
    """P = 0: the op and its reference both return empty outputs of the same shapes and dtypes."""
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(3, 2, 4, device=device, seed=5)
    cand, unary, g = cand[:, :0], unary[:, :0], g[:, :0]
    extra = dict(
        temperature=torch.full((3,), 0.7, device=device),
        seeds=torch.arange(3, dtype=torch.int64, device=device),
        offsets=torch.zeros(3, dtype=torch.int64, device=device),
    )
    hidden, w_h = torch.randn(3, 0, 10, device=device), torch.randn(8, 10, device=device)
    given = dict(g=None, hidden=hidden, g_weight=w_h) if fused_g else dict(g=g)
    got = flashspark.ops.path_select(cand, unary, a_emb, b_emb, given.pop("g"), anchor, mode=mode, **extra, **given)
    want = path_select_reference(
        cand,
        unary,
        a_emb,
        b_emb,
        None if fused_g else g,
        anchor,
        mode,
        *extra.values(),
        hidden if fused_g else None,
        w_h if fused_g else None,
    )
    for a, b, shape in zip(got, want, [(3, 0), (3, 0), (3, 0, 4), (3, 0, 4)]):
        assert a.shape == b.shape == shape and a.dtype == b.dtype and a.device == b.device


def test_greedy_equals_backtrack_without_pair_terms(device):
    # With zero pair scores the lattice factorizes: every mode picks the unary argmax.
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(3, 5, 16, device=device, seed=3)
    g = torch.zeros_like(g)
    outs = [
        flashspark.ops.path_select(
            cand, unary, a_emb, b_emb, g, anchor, mode=m, temperature=torch.zeros(3, device=device)
        )[1]
        for m in ("backtrack", "greedy", "sample")
    ]
    assert torch.equal(outs[0], unary.argmax(-1).int()) and torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1], outs[2])


def test_path_ties_break_to_lowest_index(device):
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(2, 3, 4, device=device)
    unary = torch.zeros_like(unary)
    g = torch.zeros_like(g)
    for mode in ("backtrack", "greedy"):
        _, choice, _, _ = flashspark.ops.path_select(cand, unary, a_emb, b_emb, g, anchor, mode=mode)
        assert (choice == 0).all()


def test_sampled_path_is_distribution_exact(device):
    # One request replicated over many seeds: position 0's choice must follow
    # q_0 = softmax(S_0 / T), and position 1's choice, given position 0's, its q_1.
    n = 20000
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(1, 2, 5, device=device, seed=4, scale=1.5)
    rep = [
        t.expand(n, *t.shape[1:]).contiguous() if t.dim() > 1 and t.shape[0] == 1 else t
        for t in (cand, unary, a_emb, b_emb, g)
    ]
    temp = torch.full((n,), 0.7, device=device)
    seeds = torch.arange(n, dtype=torch.int64, device=device)
    tokens, choice, scores, q = flashspark.ops.path_select(
        *rep,
        anchor.expand(n).contiguous(),
        mode="sample",
        temperature=temp,
        seeds=seeds,
        offsets=torch.zeros(n, dtype=torch.int64, device=device),
    )
    choice, q = choice.cpu(), q.cpu()

    def chi2(counts, probs):
        e = probs * counts.sum()
        return float(((counts - e) ** 2 / e).sum())

    crit = 4 * (1 - 2 / 36 + 4.75 * math.sqrt(2 / 36)) ** 3  # chi-square(4), tail ~1e-6
    counts0 = torch.bincount(choice[:, 0].long(), minlength=5).double()
    assert chi2(counts0, q[0, 0].double()) < crit
    for c0 in range(5):
        sel = choice[:, 0] == c0
        if sel.sum() < 500:
            continue
        counts1 = torch.bincount(choice[sel, 1].long(), minlength=5).double()
        assert chi2(counts1, q[sel][0, 1].double()) < crit
    # Power: the same statistic rejects q taken at the wrong temperature.
    wrong = torch.softmax(scores[0, 0].cpu() / 1.4, -1).double()
    assert chi2(counts0, wrong) >= crit


def test_path_opcheck(device):
    args = path_inputs(2, 3, 4, device=device)
    extra = (
        torch.ones(2, device=device),
        torch.zeros(2, dtype=torch.int64, device=device),
        torch.zeros(2, dtype=torch.int64, device=device),
    )
    for mode in ("backtrack", "sample"):
        torch.library.opcheck(torch.ops.flashspark.path_select.default, (*args, mode, *extra))
    hidden = torch.randn(2, 3, 10, device=device)
    w_h = torch.randn(8, 10, device=device)
    fused = (*args[:4], None, args[5], "backtrack", *extra, hidden, w_h)
    torch.library.opcheck(torch.ops.flashspark.path_select.default, fused)


PATH_BAD = [
    ("mode", {"mode": "viterbi"}),
    ("cand_ids", {"cand_ids": torch.full((2, 3, 4), 50, dtype=torch.int32)}),
    ("anchor", {"anchor": torch.tensor([1, 99], dtype=torch.int32)}),
    ("unary", {"unary": torch.zeros(2, 3, 5)}),
    ("unary", {"unary": torch.zeros(2, 3, 4, dtype=torch.float64)}),
    ("b_emb", {"b_emb": torch.zeros(50, 9)}),
    ("g", {"g": torch.zeros(2, 2, 8)}),
    ("temperature", {"temperature": torch.tensor([1.0, -1.0]), "mode": "sample"}),
    ("seeds", {"seeds": torch.zeros(3, dtype=torch.int64)}),
    ("'g' or both", {"g": None}),
    ("'g' or both", {"hidden": torch.zeros(2, 3, 10), "g_weight": torch.zeros(8, 10)}),
    ("'g' or both", {"g": None, "hidden": torch.zeros(2, 3, 10)}),
    ("hidden", {"g": None, "hidden": torch.zeros(2, 4, 10), "g_weight": torch.zeros(8, 10)}),
    ("hidden", {"g": None, "hidden": torch.zeros(2, 3, 10, dtype=torch.float64), "g_weight": torch.zeros(8, 10)}),
    ("g_weight", {"g": None, "hidden": torch.zeros(2, 3, 10), "g_weight": torch.zeros(8, 11)}),
    ("g_weight", {"g": None, "hidden": torch.zeros(2, 3, 10), "g_weight": torch.zeros(7, 10)}),
]


@pytest.mark.parametrize("name,change", PATH_BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(PATH_BAD)])
def test_path_bad_inputs(name, change):
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(2, 3, 4)
    a = dict(
        cand_ids=cand,
        unary=unary,
        a_emb=a_emb,
        b_emb=b_emb,
        g=g,
        anchor=anchor,
        mode="greedy",
        temperature=torch.ones(2),
        seeds=torch.zeros(2, dtype=torch.int64),
        offsets=torch.zeros(2, dtype=torch.int64),
    )
    a.update(change)
    with pytest.raises(RuntimeError, match=name):
        flashspark.ops.path_select(
            a.pop("cand_ids"), a.pop("unary"), a.pop("a_emb"), a.pop("b_emb"), a.pop("g"), a.pop("anchor"), **a
        )
