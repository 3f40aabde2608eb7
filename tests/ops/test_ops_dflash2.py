"""Tests of the DFlash 2 ops (two_tap_conv, topk_select, path_select) against
their pure-PyTorch oracles, brute force, and distribution checks."""

import itertools
import math

import flashspark
import pytest
import torch
from flashspark.reference import path_select_reference, topk_select_reference, two_tap_conv_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


# ---------------------------------------------------------------- two_tap_conv


def conv_inputs(rows, channels, dtype, device, seed=0, residual=False):
    g = torch.Generator().manual_seed(seed)
    groups = (channels + 15) // 16
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
