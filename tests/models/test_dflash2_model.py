"""DFlash 2 drafter: identity convs reduce to DFlash, the ops path equals the
reference path (convs, Top-K, path selection), the training form equals the
inference form, the selector's loss and signals, and checkpoint I/O. Parity with
z-lab's reference implementation is tests/models/test_zlab_parity.py."""

import dataclasses
import math

import pytest
import torch
from flashspark.models import DecoderConfig, DecoderForCausalLM
from flashspark.models.decoder import RMSNorm
from flashspark.models.dflash import DFlashConfig, DFlashDrafter, block_mask, packed_blocks
from flashspark.models.dflash2 import (
    DFlash2Config,
    DFlash2Drafter,
    GroupedDynamicConv,
    load_dflash2,
    path_signals,
    save_dflash2,
)

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 101


def tiny_target(seed=0, vocab=VOCAB) -> DecoderForCausalLM:
    cfg = DecoderConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        max_position_embeddings=96,
        torch_dtype="float32",
    )
    m = DecoderForCausalLM(cfg)
    m.init_weights(seed)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(20)  # peaked logits: paths and Top-K are not all ties
    return m.eval()


def tiny_dflash2(target, seed=1, block_size=4, use_ops=True) -> DFlash2Drafter:
    cfg = DFlash2Config.for_target(
        target.config,
        num_hidden_layers=2,
        block_size=block_size,
        mask_token_id=1,
        num_features=3,
        selector_rank=8,
        selector_top_k=6,
        conv_group_size=8,
    )
    d = DFlash2Drafter(cfg, target, use_ops=use_ops)
    d.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every piece non-trivial: convs far from identity, a strong pair term
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif "_conv." in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name.endswith("base_kernel") else 0.2))
            elif name.startswith("candidate_selector."):
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)
            else:
                p.mul_(5)
    return d.eval()


def fill_cache(d, hidden, ctx):
    B = hidden.shape[0]
    cache = d.new_cache(B, hidden.shape[1] + d.block_size)
    rows = [(b, t) for b in range(B) for t in range(int(ctx[b]))]
    bs, ts = torch.tensor(rows).T
    d.inject(cache, hidden[bs, ts], ts, bs)
    return cache


def run_conv(conv, norm, x, y, res):
    """The prepare conv of norm(x) and the finish conv of y with the taps prepare gave."""
    h, taps = conv.prepare(x, norm, 4)
    return h, conv.finish(y, taps, res, 4)


def test_conv_op_equals_reference_and_trains():
    conv, norm = GroupedDynamicConv(40, 8), RMSNorm(40, 1e-6)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
        norm.weight.uniform_(0.5, 1.5)
    x, y, res = torch.randn(3, 8, 40), torch.randn(3, 8, 40), torch.randn(3, 8, 40)
    conv.use_ops = True
    with torch.no_grad():
        got = run_conv(conv, norm, x, y, res)
    conv.use_ops = False
    want = run_conv(conv, norm, x, y, res)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # Row 0 of each block of 4 ignores its left neighbour; the finish taps come from x, not y.
    x2 = x.clone()
    x2[:, 3] += 1.0
    with torch.no_grad():
        h, out = run_conv(conv, norm, x, y, res)
        h2, out2 = run_conv(conv, norm, x2, y, res)
    assert torch.equal(h2[:, 4:], h[:, 4:]) and not torch.equal(h2[:, 3], h[:, 3])
    assert not torch.equal(out2[:, 3], out[:, 3]) and torch.equal(out2[:, 5:], out[:, 5:])
    # With gradients the differentiable reference runs even when use_ops is set.
    conv.use_ops = True
    sum(t.sum() for t in run_conv(conv, norm, x.requires_grad_(), y, res)).backward()
    assert conv.base_kernel.grad.abs().sum() > 0 and conv.kernel_projection.weight.grad.abs().sum() > 0


def test_identity_convs_reduce_to_dflash():
    """A fresh DFlash 2 backbone loaded with DFlash weights drafts exactly like DFlash."""
    torch.manual_seed(0)
    target = tiny_target()
    d2 = tiny_dflash2(target)  # convs far from identity: loading a DFlash backbone resets them
    base = DFlashDrafter(
        DFlashConfig.for_target(target.config, num_hidden_layers=2, block_size=4, mask_token_id=1, num_features=3),
        target,
    )
    base.init_weights(3)
    d2.load_dflash_backbone(base.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 30))
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d2.config.target_layer_ids).hidden
        ctx = torch.tensor([11, 25])
        anchor = tokens.gather(1, ctx[:, None])[:, 0]
        want = base.draft_hidden(fill_cache(base, hidden, ctx), anchor, ctx)
        got = d2.draft_hidden(fill_cache(d2, hidden, ctx), anchor, ctx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # ... and non-identity convs change it (the test above can fail).
    with torch.no_grad():
        d2.layers[0].mlp_conv.base_kernel[1, 1].fill_(0.5)
        moved = d2.draft_hidden(fill_cache(d2, hidden, ctx), anchor, ctx)
    assert not torch.allclose(moved, want, atol=1e-3)


@pytest.mark.parametrize("mode", ["backtrack", "greedy", "sample"])
def test_propose_ops_equal_reference(mode):
    """Inference forward through the ops (two_tap_conv, attention, topk_select, path_select)
    equals the pure-PyTorch reference path: same drafts, candidates, q and signals."""
    torch.manual_seed(1)
    target = tiny_target()
    d_op = tiny_dflash2(target, use_ops=True)
    d_ref = tiny_dflash2(target, use_ops=False)
    B, S = 3, 40
    tokens = torch.randint(0, VOCAB, (B, S))
    ctx = torch.tensor([5, 17, 33])
    anchor = tokens.gather(1, ctx[:, None])[:, 0]
    temp = torch.tensor([1.0, 0.7, 0.0])
    seeds = torch.tensor([11, 12, 13])
    offsets = torch.tensor([0, 5, 9])
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d_op.config.target_layer_ids).hidden
        outs = [
            d.select_paths(
                fill_cache(d, hidden, ctx), anchor, ctx, mode=mode, temperature=temp, seeds=seeds, offsets=offsets
            )
            for d in (d_op, d_ref)
        ]
    (t1, c1, q1, s1), (t2, c2, q2, s2) = outs
    assert t1.shape == (B, 3) and t1.dtype == torch.int64
    assert torch.equal(t1, t2) and torch.equal(c1.long(), c2.long())
    assert (t1[..., None] == c1.long()).any(-1).all()  # drafts are lattice candidates
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)
    if mode == "sample":
        torch.testing.assert_close(q1, q2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(q1.sum(-1), torch.ones(B, 3))
        # At T = 1 the sampled q row is the distribution the top-probability signal reads, before the draw.
        torch.testing.assert_close(q1[0].max(-1).values, s1.top_prob[0], atol=1e-5, rtol=1e-5)
    else:
        assert q1 is None


@pytest.mark.parametrize("use_ops", [True, False])
def test_propose_sampling_defaults(use_ops):
    """Without temperature / seeds / offsets, propose samples as at T = 1, seed 0, offset 0
    (ops.path_select's defaults), through the ops and through the reference."""
    torch.manual_seed(4)
    target = tiny_target()
    d = tiny_dflash2(target, use_ops=use_ops)
    B, S = 2, 30
    tokens = torch.randint(0, VOCAB, (B, S))
    ctx = torch.tensor([9, 21])
    anchor = tokens.gather(1, ctx[:, None])[:, 0]
    with torch.no_grad():
        cache = fill_cache(d, target(tokens, hidden_layers=d.config.target_layer_ids).hidden, ctx)
        got = d.select_paths(cache, anchor, ctx, mode="sample")
        want = d.select_paths(
            cache,
            anchor,
            ctx,
            mode="sample",
            temperature=torch.ones(B),
            seeds=torch.zeros(B, dtype=torch.int64),
            offsets=torch.zeros(B, dtype=torch.int64),
        )
        other_seed = d.select_paths(
            cache,
            anchor,
            ctx,
            mode="sample",
            temperature=torch.ones(B),
            seeds=torch.full((B,), 7, dtype=torch.int64),
            offsets=torch.zeros(B, dtype=torch.int64),
        )
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    assert not torch.equal(got[0], other_seed[0])  # the seed reaches the draws
    assert got[0].shape == (B, d.block_size - 1)


def test_training_form_equals_inference_form():
    """The packed training forward (reference convs, SDPA) equals draft_hidden (ops) block by block."""
    torch.manual_seed(2)
    target = tiny_target()
    d = tiny_dflash2(target, use_ops=True)
    B, S, g = 2, 36, d.block_size
    tokens = torch.randint(0, VOCAB, (B, S))
    anchors = torch.tensor([[4, 20], [30, 9]])
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d.config.target_layer_ids).hidden
        bt, pos = packed_blocks(tokens, anchors, g, 1)
        d.use_ops = False
        want = d(hidden, bt, pos, block_mask(anchors, S, g))
        d.use_ops = True
        for j in range(2):
            ctx = anchors[:, j]
            got = d.draft_hidden(fill_cache(d, hidden, ctx), tokens.gather(1, ctx[:, None])[:, 0], ctx)
            torch.testing.assert_close(got, want[:, j * g : (j + 1) * g], atol=1e-4, rtol=1e-4)


def test_backtrack_path_is_max_score():
    """Backtrack mode returns the best path of the lattice (brute force over K^P paths)."""
    torch.manual_seed(3)
    target = tiny_target()
    d = tiny_dflash2(target, block_size=4)
    tokens = torch.randint(0, VOCAB, (1, 20))
    ctx = torch.tensor([12])
    anchor = tokens[:, 12]
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d.config.target_layer_ids).hidden
        cache = fill_cache(d, hidden, ctx)
        drafts, cand, _, _ = d.select_paths(cache, anchor, ctx, mode="backtrack")
        h = d.draft_hidden(cache, anchor, ctx)[:, 1:]
        cand2, unary, gg = d.lattice(h)
    K = cand.shape[-1]
    best, best_path = -math.inf, None
    for idx in range(K**3):
        path = [idx // K**2, (idx // K) % K, idx % K]
        total, prev = 0.0, anchor[0]
        for t, c in enumerate(path):
            with torch.no_grad():
                row = d.selector.pair_scores(unary[0, t], cand2[0, t], prev, gg[0, t])
            total += float(row[c])
            prev = cand2[0, t, c].long()
        if total > best + 1e-6:
            best, best_path = total, path
    assert drafts[0].tolist() == [int(cand[0, t, c]) for t, c in enumerate(best_path)]


def test_selector_loss_masks_and_learns():
    torch.manual_seed(4)
    target = tiny_target()
    d = tiny_dflash2(target).train()
    h = torch.randn(5, 64)
    logits = d.logits(d.norm(h))
    top = logits.topk(6, -1).indices
    labels = torch.stack([top[0, 2], top[1, 0], top[2, 5], torch.tensor(-1), top[4, 1]])
    labels[3] = int(torch.argsort(logits[3])[0])  # least likely token: never in the Top-6
    prev = torch.randint(0, VOCAB, (5,))
    loss, in_topk, hit = d.selector_loss(h, logits, prev, labels)
    assert in_topk.tolist() == [True, True, True, False, True]
    loss.backward()
    sel = d.selector
    assert sel.predecessor_codebook.weight.grad.abs().sum() > 0 and sel.successor_codebook.weight.grad.abs().sum() > 0
    # Masked positions carry no loss: weights zero everywhere but row 3 give zero loss.
    loss3, _, _ = d.selector_loss(h, logits, prev, labels, weights=torch.tensor([0.0, 0, 0, 1, 0]))
    assert float(loss3.detach()) == 0.0


def test_path_signals_hand_computed():
    """Every signal reads the score row given the drafts before the position, none reads the
    candidate drawn there (the confidence scheduler stays lossless): the choice is not an input."""
    scores = torch.tensor([[[2.0, 1.0, 0.0], [0.0, 0.0, 0.0]]])
    unary = torch.log(torch.tensor([[[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]]))
    s = path_signals(scores, unary)
    p = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), -1)
    assert math.isclose(float(s.top_prob[0, 0]), float(p[0]), rel_tol=1e-6)
    assert math.isclose(float(s.top_prob[0, 1]), 1 / 3, rel_tol=1e-6)
    assert math.isclose(float(s.top_margin[0, 0]), 1.0) and math.isclose(float(s.top_margin[0, 1]), 0.0)
    assert math.isclose(float(s.unary_top1[0, 1]), 0.9, rel_tol=1e-6)
    assert math.isclose(float(s.entropy[0, 1]), math.log(3), rel_tol=1e-6)
    assert s.position.tolist() == [[1, 2]] and s.features().shape == (1, 2, 4)
    assert s.features()[0, 1].tolist() == [
        float(s.top_prob[0, 1]),
        0.0,
        float(s.unary_top1[0, 1]),
        float(s.entropy[0, 1]),
    ]
    single = path_signals(scores[..., :1], unary[..., :1])
    assert single.top_margin.isinf().all() and single.top_prob.eq(1).all()


def test_save_load_round_trip(tmp_path):
    target = tiny_target()
    d = tiny_dflash2(target)
    save_dflash2(d, tmp_path, dtype=torch.float32)
    d2 = load_dflash2(tmp_path, target)
    assert dataclasses.replace(d2.config, torch_dtype="x") == dataclasses.replace(d.config, torch_dtype="x")
    assert isinstance(d2, DFlash2Drafter) and d2.use_ops
    for (n, a), (_, b) in zip(d.state_dict().items(), d2.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    # z-lab's names: bare codebooks, the convs' base_kernel / kernel_projection.
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"candidate_selector.predecessor_codebook", "layers.0.attention_conv.base_kernel"} <= names
    with pytest.raises(ValueError, match="not a DFlash 2 drafter config"):
        (tmp_path / "config.json").write_text(
            (tmp_path / "config.json").read_text().replace('"DFlash2DraftModel"', '"DFlashDraftModel"')
        )
        load_dflash2(tmp_path, target)


def test_train_subcommands_parse():
    """`train dflash2` / `train dspark` options map onto the trainers' argument dataclasses."""
    import argparse

    from flashspark.cli import train as cli
    from flashspark.train.dflash2 import DFlash2TrainArgs
    from flashspark.train.dspark import DSparkTrainArgs

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what")
    cli.add_train(sub)
    args = parser.parse_args(["dflash2", "--minutes", "7", "--init-from", "x", "--selector-top-k", "8", "--no-bf16"])
    a = cli.train_args(args)
    assert isinstance(a, DFlash2TrainArgs)
    assert (a.minutes, a.init_from, a.selector_top_k, a.bf16, a.out) == (7.0, "x", 8, False, "runs/dflash2")
    assert args.func is cli.run_train and cli.TRAINERS[args.trainer][2].__module__ == "flashspark.train.dflash2"
    args = parser.parse_args(["dspark", "--resume", "--data-from", "runs/dflash", "--markov-rank", "32"])
    a = cli.train_args(args)
    assert isinstance(a, DSparkTrainArgs)
    assert (a.resume, a.data_from, a.markov_rank, a.export.endswith("dspark")) == (True, "runs/dflash", 32, True)
    assert args.func is cli.run_train and cli.TRAINERS[args.trainer][2].__module__ == "flashspark.train.dspark"
    # every option the old mapping carried, for each trainer: the dataclass gets what was given
    args = parser.parse_args(["target", "--layers", "3", "--hidden-size", "64", "--eval-every", "2", "--export", "e"])
    a = cli.train_args(args)
    assert (a.num_hidden_layers, a.hidden_size, a.eval_every_min, a.export, a.bf16) == (3, 64, 2.0, "e", True)
    args = parser.parse_args(["dflash", "--no-init-layers", "--target", "tiny", "--gen-frac", "0.5"])
    a = cli.train_args(args)
    assert (a.init_layers, a.target, a.gen_frac, a.out, a.command) == (False, "tiny", 0.5, "runs/dflash", "")
    # a --target naming neither a known target nor an existing path fails at parse time
    with pytest.raises(FileNotFoundError, match="not found"):
        cli.train_args(parser.parse_args(["dflash", "--target", "no/such/model"]))


def test_position_weights_and_block_targets():
    from flashspark.train.common import block_targets, position_weights

    torch.testing.assert_close(position_weights(4, 2.0), torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 2))
    torch.testing.assert_close(position_weights(4, 2.0, first=0), torch.exp(-torch.tensor([1.0, 2.0, 3.0]) / 2))
    tokens = torch.arange(100, 112)[None]
    labels = torch.arange(200, 212)[None]
    prev, target = block_targets(tokens, labels, torch.tensor([[2, 7]]), 4)
    assert target.tolist() == [[[203, 204, 205], [208, 209, 210]]]
    assert prev.tolist() == [[[102, 203, 204], [107, 208, 209]]]  # the anchor token, then the true tokens
