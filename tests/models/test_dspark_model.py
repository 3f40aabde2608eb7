"""DSpark drafter: the ops path (markov_step and the DFlash ops) equals the
reference path, the inference form equals the training form, the Markov and
confidence heads compute what the method specifies (docs/dflash2_dspark.md), calibration temperatures, and
checkpoint I/O."""

import dataclasses
import json

import pytest
import torch
from flashspark.models import DecoderConfig, DecoderForCausalLM
from flashspark.models.dflash import DFlashConfig, DFlashDrafter, block_mask, packed_blocks
from flashspark.models.dspark import DSparkConfig, DSparkDrafter, load_dspark, markov_rollout, save_dspark
from flashspark.train.dspark import cumulative_confidence, fit_sequential_temperatures, sparse_tv
from flashspark.train.dspark import temperature_calibration_report as calibration_report

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 97


def tiny_target(seed=0) -> DecoderForCausalLM:
    cfg = DecoderConfig(
        vocab_size=VOCAB,
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
        m.model.embed_tokens.weight.mul_(20)
    return m.eval()


def tiny_dspark(target, seed=1, block_size=5, use_ops=True, markov=True, from_anchor=True) -> DSparkDrafter:
    cfg = DSparkConfig.for_target(
        target.config,
        num_hidden_layers=2,
        block_size=block_size,
        mask_token_id=1,
        num_features=3,
        markov_rank=8,
        sample_from_anchor=from_anchor,
    )
    d = DSparkDrafter(cfg, target, use_ops=use_ops)
    d.init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif name.startswith(("markov_head.", "confidence_head.")):
                if markov:  # a strong Markov term: later drafts depend on earlier ones
                    p.copy_(torch.randn(p.shape, generator=g) * (3.0 if "markov" in name else 0.3))
            else:
                p.mul_(5)
    return d.eval()


def setup(d, target, B=3, S=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, S), generator=gen)
    ctx = torch.tensor([6, 19, 33])[:B]
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d.config.target_layer_ids).hidden
    cache = d.new_cache(B, S + d.block_size)
    rows = [(b, t) for b in range(B) for t in range(int(ctx[b]))]
    bs, ts = torch.tensor(rows).T
    d.inject(cache, hidden[bs, ts], ts, bs)
    return tokens, hidden, ctx, cache, tokens.gather(1, ctx[:, None])[:, 0]


LAYOUTS = pytest.mark.parametrize("from_anchor", [True, False], ids=["sample_from_anchor", "dflash_slots"])


@LAYOUTS
def test_propose_ops_equal_reference(from_anchor):
    target = tiny_target()
    d = tiny_dspark(target, from_anchor=from_anchor)
    n = d.num_drafts
    assert n == (5 if from_anchor else 4)
    _, _, ctx, cache, anchor = setup(d, target)
    temp, seeds, offs = torch.tensor([1.0, 0.0, 0.6]), torch.tensor([3, 4, 5]), torch.tensor([0, 7, 100])
    d.set_calibration([0.5, 1.0, 2.0, 3.0, 0.8][:n])
    got = d.draft_markov(cache, anchor, ctx, temperature=temp, seeds=seeds, offsets=offs)
    d.use_ops = False
    want = d.draft_markov(cache, anchor, ctx, temperature=temp, seeds=seeds, offsets=offs)
    assert torch.equal(got[0], want[0]) and got[0].shape == (3, n)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].sum(-1), torch.ones(3, n))
    assert torch.equal(got[1][1].argmax(-1), got[0][1]) and bool((got[1][1].max(-1).values == 1).all())  # T = 0


@LAYOUTS
def test_inference_form_equals_training_form(from_anchor):
    """Greedy `propose` (ops) == the packed training forward + `markov_rollout`:
    same drafts, and confidences = sigmoid(z / T_k)."""
    target = tiny_target()
    d = tiny_dspark(target, from_anchor=from_anchor)
    tokens, hidden, ctx, cache, anchor = setup(d, target)
    temps = torch.tensor([1.0, 0.5, 2.0, 1.5, 0.9][: d.num_drafts])
    d.set_calibration(temps)
    drafts, _, conf = d.draft_markov(cache, anchor, ctx)
    g = d.block_size
    with torch.no_grad():
        bt, pos = packed_blocks(tokens, ctx[:, None], g, 1)
        h = d(hidden, bt, pos, block_mask(ctx[:, None], tokens.shape[1], g))[:, d.config.first_draft_slot :]
        want_drafts, z = markov_rollout(d, h, d.logits(h), anchor)
    assert torch.equal(drafts, want_drafts)
    torch.testing.assert_close(conf, torch.sigmoid(z / temps), atol=1e-5, rtol=1e-5)


def test_draft_logits_follow_the_greedy_chain():
    """The DFlash interface (argmax of draft_logits) drafts DSpark's greedy block, and
    leaves its confidences for a scheduler."""
    target = tiny_target()
    d = tiny_dspark(target)
    _, _, ctx, cache, anchor = setup(d, target)
    drafts, _, conf = d.draft_markov(cache, anchor, ctx)
    logits = d.draft_logits(cache, anchor, ctx)
    assert logits.shape == (3, 5, VOCAB) and torch.equal(logits.argmax(-1), drafts)
    torch.testing.assert_close(d.last_confidence, conf)
    assert not torch.equal(d.logits(d.draft_states(cache, anchor, ctx)).argmax(-1), drafts)


def test_markov_head_conditions_on_previous_draft():
    """logits_k = U_k + W2 W1[x_{k-1}]: with W2 = 0 the drafts are the backbone's argmax
    (DFlash); a strong Markov term makes them differ."""
    target = tiny_target()
    d = tiny_dspark(target, markov=False)
    _, _, ctx, cache, anchor = setup(d, target)
    base = d.draft_logits(cache, anchor, ctx).argmax(-1)
    drafts, _, conf = d.draft_markov(cache, anchor, ctx)
    assert torch.equal(drafts, base)
    torch.testing.assert_close(conf, torch.full_like(conf, 0.5), atol=0.05, rtol=0)  # conf head near 0 at init
    d2 = tiny_dspark(target, markov=True)
    d2.load_state_dict(d.state_dict() | {k: v for k, v in d2.state_dict().items() if k.startswith("markov_head.")})
    assert not torch.equal(d2.draft_markov(cache, anchor, ctx)[0], base)
    # The heads by hand for one request and position.
    h = d2.draft_states(cache, anchor, ctx)
    with torch.no_grad():
        logits, zk = d2.heads(h[0, 2], d2.logits(h[0, 2]), torch.tensor(7))
        want = d2.logits(h[0, 2]) + d2.markov_w2.weight @ d2.markov_w1.weight[7]
        proj = d2.confidence_head.proj
        want_z = proj.weight[0] @ torch.cat([h[0, 2], d2.markov_w1.weight[7]]) + proj.bias[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(zk, want_z, atol=1e-5, rtol=1e-5)


@LAYOUTS
def test_dflash_backbone_start(from_anchor):
    """A DFlash backbone loads into DSpark with the Markov term silent: its drafts are the
    backbone's argmax at the drafting slots (in DeepSpec's layout the anchor's slot too)."""
    target = tiny_target()
    base = DFlashDrafter(
        DFlashConfig.for_target(target.config, num_hidden_layers=2, block_size=5, mask_token_id=1, num_features=3),
        target,
    )
    base.init_weights(5)
    d = DSparkDrafter(
        DSparkConfig.for_target(
            target.config,
            num_hidden_layers=2,
            block_size=5,
            mask_token_id=1,
            num_features=3,
            markov_rank=8,
            sample_from_anchor=from_anchor,
        ),
        target,
    )
    d.init_weights(0)
    with torch.no_grad():
        d.markov_w2.weight.normal_()  # loading a DFlash backbone silences the Markov term again
    d.load_dflash_backbone(base.state_dict())
    _, _, ctx, cache, anchor = setup(d, target)
    _, _, _, cache_b, _ = setup(base, target)
    slots = base.draft_hidden(cache_b, anchor, ctx)[:, d.config.first_draft_slot :]
    assert torch.equal(d.draft_markov(cache, anchor, ctx)[0], base.logits(slots).argmax(-1))
    with pytest.raises(ValueError, match="missing backbone"):
        d.load_dflash_backbone({"fc.weight": base.fc.weight})


def test_calibration_validation_and_round_trip(tmp_path):
    target = tiny_target()
    d = tiny_dspark(target)
    with pytest.raises(ValueError):
        d.set_calibration([1.0, 2.0])
    with pytest.raises(ValueError):
        d.set_calibration([1.0, 2.0, 0.0, 1.0, 1.0])
    d.set_calibration([0.7, 1.1, 1.3, 2.0, 0.9])
    save_dspark(d, tmp_path, dtype=torch.float32, calibration={"ece_after": 0.01})
    cal = json.loads((tmp_path / "calibration.json").read_text())
    assert cal["ece_after"] == 0.01 and len(cal["temperatures"]) == 5
    d2 = load_dspark(tmp_path, target)
    assert dataclasses.replace(d2.config, torch_dtype="x") == dataclasses.replace(d.config, torch_dtype="x")
    torch.testing.assert_close(d2.conf_temperature, d.conf_temperature)
    _, _, ctx, cache, anchor = setup(d, target)
    a, b = d.draft_markov(cache, anchor, ctx), d2.draft_markov(cache, anchor, ctx)
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[2], b[2])


# ---------------------------------------------------------------- calibration (synthetic data)


def test_calibration_report_hand_computed():
    """Per-position acceptance -> block outcomes: a block counts as accepted through k only
    while every earlier draft was accepted (the 1 after a 0 does not count)."""
    accepted = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    z = torch.zeros(3, 4)  # c = 0.5 everywhere
    rep = calibration_report(z, accepted, torch.ones(4))
    assert rep["mean_outcome"] == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    torch.testing.assert_close(torch.tensor(rep["mean_confidence"]), torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    assert rep["observations"] == 12
    # AUC of c_k against the conditional outcome: all c equal -> 0.5.
    assert rep["auc"] == 0.5
    assert abs(rep["ece_per_position"][0] - (2 / 3 - 0.5)) < 1e-12


def synthetic(n, scales, seed):
    """Confidence logits z_k = s_k · u_k of true conditional survival σ(u_k), outcomes drawn from it."""
    g = torch.Generator().manual_seed(seed)
    u = 1.0 + 1.5 * torch.randn(n, len(scales), generator=g)
    accepted = torch.rand(n, len(scales), generator=g) < torch.sigmoid(u)
    return u * torch.tensor(scales), accepted


def test_sequential_temperature_scaling_recovers_miscalibration():
    scales = [2.0, 0.5, 3.0, 1.0]
    z, acc = synthetic(40000, scales, 0)
    temps = fit_sequential_temperatures(z, acc)
    torch.testing.assert_close(temps, torch.tensor(scales), rtol=0.12, atol=0)
    z2, acc2 = synthetic(40000, scales, 1)  # held out
    before = calibration_report(z2, acc2, torch.ones(4))
    after = calibration_report(z2, acc2, temps)
    assert after["ece_cumulative"] < 0.015 < before["ece_cumulative"]
    assert all(b > a for b, a in zip(before["ece_per_position"], after["ece_per_position"]))
    assert after["auc"] > 0.7 and abs(after["auc"] - before["auc"]) < 0.05
    # The cumulative product is what gets calibrated: mean a_k matches the survival rate of drafts 1..k.
    a = cumulative_confidence(z2, temps)
    torch.testing.assert_close(a.mean(0), acc2.double().cumprod(-1).mean(0), atol=0.01, rtol=0)


def test_sparse_tv():
    q = torch.softmax(torch.randn(3, 10), -1)
    p = torch.softmax(torch.randn(3, 10), -1)
    full = 0.5 * (p - q).abs().sum(-1)
    v, i = p.topk(10, -1)
    torch.testing.assert_close(sparse_tv(q, i, v.log()), full)  # K = V: exact
    v4, i4 = p.topk(4, -1)
    part = sparse_tv(q, i4, v4.log())
    assert bool((part <= full + 1e-6).all()) and bool((part >= full - (1 - v4.sum(-1)) - 1e-6).all())


def test_exact_tv_and_the_targets_full_distribution():
    """`target_next_logp` reads the logits row before each drafted position (the distribution of
    token t given tokens < t), and `exact_tv` is ½‖q − p‖₁ over the whole vocabulary, which the
    Top-K bound never exceeds."""
    from flashspark.train.dspark import exact_tv, target_next_logp  # noqa: PLC0415 (functions under test)

    target = tiny_target()
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([[3, 11], [0, 20]])
    p = target_next_logp(target, tokens, anchors, 5)  # drafts at anchor + 1 .. anchor + 4
    assert p.shape == (2, 2, 4, VOCAB)
    with torch.no_grad():
        for b, i, j in ((0, 1, 2), (1, 0, 0), (1, 1, 3)):
            t = int(anchors[b, i]) + j + 1
            want = torch.log_softmax(target(tokens[b : b + 1, :t]).logits[0, -1].float(), -1)
            torch.testing.assert_close(p[b, i, j], want, atol=1e-5, rtol=1e-5)
    q = torch.softmax(torch.randn(2, 2, 4, VOCAB), -1)
    full = exact_tv(q, p)
    torch.testing.assert_close(full, 0.5 * (q - p.exp()).abs().sum(-1))
    v, i = p.exp().topk(8, -1)
    bound = sparse_tv(q.flatten(0, 2), i.flatten(0, 2), v.log().flatten(0, 2)).view(2, 2, 4)
    assert bool((bound <= full + 1e-6).all())


def test_exact_rows_pick_the_exact_or_the_bound_per_row():
    """Rows a --window cut take the stored Top-K bound, the others the exact TV: the mixed loss
    equals the exact one when every row is exact and the bound's when none is."""
    from flashspark.train.dspark import dspark_loss, target_next_logp, target_topk  # noqa: PLC0415

    target = tiny_target()
    d = tiny_dspark(target)
    tokens = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        feats = target(tokens, hidden_layers=d.config.target_layer_ids).hidden
    labels = torch.cat([torch.full((2, 1), -1), tokens[:, 1:]], 1)
    anchors = torch.tensor([[4, 12], [7, 20]])
    span, w = d.num_drafts + 1, torch.ones(d.num_drafts)
    full = target_next_logp(target, tokens, anchors, span)
    ids, logp = target_topk(target, tokens, 4)
    args = (d, feats, tokens, labels, anchors)
    with torch.no_grad():
        exact = dspark_loss(*args, None, None, w, p_full=full)[0]
        bound = dspark_loss(*args, ids, logp, w)[0]
        every = dspark_loss(*args, ids, logp, w, p_full=full, exact_rows=torch.tensor([True, True]))[0]
        none_ = dspark_loss(*args, ids, logp, w, p_full=full, exact_rows=torch.tensor([False, False]))[0]
        mixed = dspark_loss(*args, ids, logp, w, p_full=full, exact_rows=torch.tensor([True, False]))[0]
    torch.testing.assert_close(every, exact)
    torch.testing.assert_close(none_, bound)
    assert float(exact) != float(bound) and min(exact, bound) - 1e-6 <= mixed <= max(exact, bound) + 1e-6
