"""The ops never synchronize with the host and their output shapes depend only
on sizes, so a CUDA graph can capture them: capture once, then replay on new
input values and compare with eager calls. GPU only."""

import flashspark
import pytest
import torch
from flashspark.reference import rope_cos_sin_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def capture(fn, static_inputs):
    """Capture fn(*static_inputs) in a CUDA graph; returns (graph, static outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up allocations outside the graph
            fn(*static_inputs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static_inputs)
    return graph, out


def replay_matches(fn, make_inputs, trials=3):
    static = make_inputs(0)
    graph, out = capture(fn, static)
    for t in range(1, trials + 1):
        fresh = make_inputs(t)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        want = fn(*fresh)
        for a, b in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
            assert torch.equal(a, b)


def test_tree_verify_in_a_graph():
    B, N, V = 8, 7, 5000
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2], dtype=torch.int32)

    def make(t):
        g = torch.Generator().manual_seed(t)
        logits = torch.randn(B * N, V, generator=g).cuda()
        tokens = torch.randint(0, V, (B * N,), generator=g, dtype=torch.int32).cuda()
        cu = torch.arange(B + 1, dtype=torch.int32) * N
        flat = torch.where(parents >= 0, parents.unsqueeze(0) + cu[:-1, None], -1).reshape(-1).int().cuda()
        temp = torch.tensor([0.0, 1.0] * (B // 2)).cuda()
        seeds = torch.randint(0, 2**40, (B,), generator=g).cuda()
        offsets = torch.full((B,), t * 16, dtype=torch.int64).cuda()
        return logits, tokens, flat, cu.cuda(), temp, seeds, offsets

    def fn(logits, tokens, parents, cu, temp, seeds, offsets):
        return flashspark.tree_verify(
            logits, tokens, parents, cu, temperature=temp, seeds=seeds, offsets=offsets, max_depth=3
        )

    replay_matches(fn, make)


def test_verify_in_a_graph():
    B, K, V = 8, 6, 5000

    def make(t):
        g = torch.Generator().manual_seed(t)
        logits = torch.randn(B * (K + 1), V, generator=g).cuda()
        drafts = torch.randint(0, V, (B * K,), generator=g, dtype=torch.int32).cuda()
        cu = (torch.arange(B + 1, dtype=torch.int32) * K).cuda()
        q = torch.softmax(torch.randn(B * K, V, generator=g), -1).cuda()
        temp = torch.full((B,), 0.8).cuda()
        seeds = torch.randint(0, 2**40, (B,), generator=g).cuda()
        offsets = torch.full((B,), t * 16, dtype=torch.int64).cuda()
        return logits, drafts, cu, q, temp, seeds, offsets

    def fn(logits, drafts, cu, q, temp, seeds, offsets):
        return flashspark.verify(
            logits, drafts, cu, draft_probs=q, temperature=temp, seeds=seeds, offsets=offsets, max_spec_len=K
        )

    replay_matches(fn, make)


def test_drafter_ops_in_a_graph():
    B, G, Hq, Hkv, D, S, V, r = 4, 8, 4, 2, 64, 300, 3000, 32

    def make(t):
        g = torch.Generator().manual_seed(100 + t)
        return (
            torch.randn(B, G, Hq, D, generator=g).cuda(),
            torch.randn(B, Hkv, S, D, generator=g).cuda(),
            torch.randn(B, Hkv, S, D, generator=g).cuda(),
            torch.randint(0, S, (B,), generator=g).int().cuda(),
            torch.randn(B, G, Hkv, D, generator=g).cuda(),
            torch.randn(B, G, Hkv, D, generator=g).cuda(),
            torch.randn(B, V, generator=g).cuda(),
            torch.randint(0, V, (B,), generator=g).cuda(),
        )

    w1, w2 = torch.randn(V, r).cuda(), torch.randn(V, r).cuda()
    hid, cw, cb = torch.randn(B, 16).cuda(), torch.randn(16 + r).cuda(), torch.zeros(1).cuda()
    temp, seeds, pos = torch.ones(B).cuda(), torch.arange(B).cuda(), torch.zeros(B, dtype=torch.int64).cuda()

    def fn(q, kc, vc, lens, kb, vb, base, prev):
        att = flashspark.ops.block_diffusion_attention(q, kc, vc, lens, kb, vb, 0.125)
        vals, ids, lse = flashspark.ops.topk_select(base, 16)
        tok, probs, conf = flashspark.ops.markov_step(
            base, prev, w1, w2, hid, cw, cb, temperature=temp, seeds=seeds, positions=pos
        )
        return att, vals, ids, lse, tok, probs, conf

    replay_matches(fn, make)


def test_two_tap_convs_in_a_graph():
    """DFlash 2's sublayer: the prepare conv (norm, a 4G-row projection, group size 8, ragged
    blocks) writes the finish conv's taps into finish_delta in place, and the finish conv reads
    them, inside one graph; the offsets' check stays on the device."""
    N, C, S = 24, 96, 8
    G = C // S
    g = torch.Generator().manual_seed(300)
    base1, base2 = torch.randn(2, C, generator=g).cuda(), torch.randn(2, C, generator=g).cuda()
    w = (0.1 * torch.randn(4 * G, C, generator=g)).cuda()
    nw = (1 + 0.1 * torch.randn(C, generator=g)).cuda()
    finish = torch.empty(N, 2, G, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")

    def make(t):
        g = torch.Generator().manual_seed(310 + t)
        cu = torch.tensor([0, 5 + t, 12, 12, N], dtype=torch.int32)
        return torch.randn(N, C, generator=g).cuda(), torch.randn(N, C, generator=g).cuda(), cu.cuda()

    def fn(x, y, cu):
        a = flashspark.ops.two_tap_conv(x, base1, None, 0, cu, None, w, nw, 1e-6, S, finish, status=status)
        b = flashspark.ops.two_tap_conv(y + a, base2, finish, 0, cu, x, group_size=S, status=status)
        return a, b, finish.clone(), status.clone()

    replay_matches(fn, make)


def test_inject_in_a_graph():
    N, B, Hkv, D, S = 16, 4, 2, 64, 64
    cs = rope_cos_sin_cache(S, D, 1e4).cuda()
    w = torch.ones(D).cuda()
    kc, vc = torch.zeros(B, Hkv, S, D).cuda(), torch.zeros(B, Hkv, S, D).cuda()

    def make(t):
        g = torch.Generator().manual_seed(200 + t)
        flat = torch.randperm(B * S, generator=g)[:N]
        return (
            torch.randn(N, Hkv, D, generator=g).cuda(),
            torch.randn(N, Hkv, D, generator=g).cuda(),
            (flat % S).cuda(),
            (flat // S).int().cuda(),
        )

    def fn(k, v, pos, slots):
        kc.zero_()
        vc.zero_()
        flashspark.ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kc, vc)
        return kc.clone(), vc.clone()

    replay_matches(fn, make)
