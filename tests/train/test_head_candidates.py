"""The LM head trained over a candidate vocabulary (`--head-negatives`): over the whole
vocabulary it is the full loss exactly, every label and stored Top-K token is a candidate,
the log-Q weighted draws estimate the full softmax normaliser without bias (the unweighted
ones do not), and a candidate set without a label is refused."""

from __future__ import annotations

import math

import pytest
import torch
from flashspark.models.dflash import block_mask, packed_blocks
from flashspark.train.common import HeadCandidates, block_loss, head_candidates, predicted_positions
from spec_helpers import tiny_drafter, tiny_target

G = 5


def batch(target, B=3, S=23, K=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    V = target.config.vocab_size
    n = 2  # tiny_drafter reads two feature layers
    return {
        "features": torch.randn(B, S, n, target.config.hidden_size, generator=gen),
        "tokens": torch.randint(0, V, (B, S + 1), generator=gen),
        "labels": torch.randint(0, V, (B, S + 1), generator=gen),
        "topk_ids": torch.randint(0, V, (B, S + 1, K), generator=gen),
        "anchors": torch.stack([torch.randperm(S - G, generator=gen)[:4].sort().values for _ in range(B)]),
    }


def test_whole_vocabulary_is_the_full_loss():
    target = tiny_target(vocab=512)
    d = tiny_drafter(target, block_size=G)
    b = batch(target)
    w = torch.exp(-torch.arange(G - 1.0) / 2)
    args = (b["features"], b["tokens"], b["labels"], b["anchors"], w)
    full, hits_full = block_loss(d, *args)
    V = target.config.vocab_size
    every, hits_every = block_loss(d, *args, HeadCandidates(torch.arange(V), torch.zeros(V)))
    torch.testing.assert_close(every, full)
    assert torch.equal(hits_every, hits_full)
    # a strict subset without the correction drops terms of the normaliser: the loss can only fall
    cand = head_candidates(b, b["anchors"], G, V, 3, torch.Generator().manual_seed(0), logq=False)
    sub, _ = block_loss(d, *args, cand)
    assert len(cand.ids) < V and sub < full and not cand.log_weight.any()


def test_candidates_hold_labels_and_topk():
    target = tiny_target(vocab=512)
    b = batch(target)
    V = target.config.vocab_size
    cand, log_weight = head_candidates(b, b["anchors"], G, V, 5, torch.Generator().manual_seed(0))
    assert torch.equal(cand, cand.unique()) and 0 <= int(cand.min()) and int(cand.max()) < V
    pos = predicted_positions(b["anchors"], G)
    need = torch.cat(
        [b["labels"].gather(1, pos).flatten(), b["topk_ids"].gather(1, pos[..., None].expand(-1, -1, 4)).flatten()]
    )
    assert torch.isin(need, cand).all()
    # positions no block predicts contribute nothing but the uniform draws
    assert len(cand) <= need.unique().numel() + 5
    # the certain tokens count once; a draw stands for the rest of the vocabulary over the draws
    certain = torch.isin(cand, need.unique())
    assert not log_weight[certain].any()
    drawn = int((~certain).sum())
    assert drawn > 0
    torch.testing.assert_close(log_weight[~certain], torch.full((drawn,), math.log((V - int(certain.sum())) / drawn)))


@pytest.mark.parametrize("logq", [True, False])
def test_weighted_draws_estimate_the_normaliser(logq):
    """Over many batches' draws the weighted sampled normaliser averages to the full one; the
    unweighted one falls far short (the bias that put a quarter of SmolLM2's position-1 argmaxes
    outside the target's Top-32)."""
    V, N = 512, 16
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(V, generator=gen) * 2
    b = {
        "labels": torch.randint(0, V, (1, 12), generator=gen),
        "topk_ids": torch.randint(0, V, (1, 12, 3), generator=gen),
        "anchors": torch.tensor([[0, 5]]),
    }
    full = logits.exp().sum()
    estimates = []
    for _ in range(4000):
        ids, log_weight = head_candidates(b, b["anchors"], G, V, N, gen, logq=logq)
        estimates.append((logits[ids] + log_weight).exp().sum())
    ratio = float(torch.stack(estimates).mean() / full)
    if logq:
        assert abs(ratio - 1) < 0.03, ratio
    else:
        assert ratio < 0.3, ratio


def test_candidates_without_a_label_are_refused():
    target = tiny_target(vocab=512)
    d = tiny_drafter(target, block_size=G)
    b = batch(target)
    w = torch.ones(G - 1)
    label = int(b["labels"][0, int(b["anchors"][0, 0]) + 1])
    ids = torch.tensor([i for i in range(target.config.vocab_size) if i != label])
    cand = HeadCandidates(ids, torch.zeros(len(ids)))
    with pytest.raises(ValueError, match="every label"):
        block_loss(d, b["features"], b["tokens"], b["labels"], b["anchors"], w, cand)


def test_distillation_is_the_soft_cross_entropy_of_the_targets_top_k():
    """`block_loss(distill=w)`: (1 - w)·CE(label) + w·CE(renormalised Top-K) per position, the
    same over the whole vocabulary and over candidates holding the Top-K, and w = 0 is the plain
    loss."""
    target = tiny_target(vocab=512)
    d = tiny_drafter(target, block_size=G)
    b = batch(target)
    gen = torch.Generator().manual_seed(3)
    b["topk_logp"] = torch.randn(b["topk_ids"].shape, generator=gen).to(torch.float16)
    w = torch.exp(-torch.arange(G - 1.0) / 2)
    args = (b["features"], b["tokens"], b["labels"], b["anchors"], w)
    topk = (b["topk_ids"], b["topk_logp"])
    plain, _ = block_loss(d, *args)
    torch.testing.assert_close(block_loss(d, *args, None, 0.0, topk)[0], plain)
    # by hand: the drafter's log-probabilities at the predicted positions
    full_soft, _ = block_loss(d, *args, None, 1.0, topk)
    mixed, _ = block_loss(d, *args, None, 0.25, topk)
    torch.testing.assert_close(mixed, 0.75 * plain + 0.25 * full_soft)
    B, nb = b["anchors"].shape
    pos = predicted_positions(b["anchors"], G)
    with torch.no_grad():
        bt, p = packed_blocks(b["tokens"], b["anchors"], G, d.config.mask_token_id)
        h = d(b["features"], bt, p, block_mask(b["anchors"], b["features"].shape[1], G)).view(B, nb, G, -1)[:, :, 1:]
        logq = d.logits(h).log_softmax(-1)
        K = b["topk_ids"].shape[-1]
        ids = b["topk_ids"].gather(1, pos[..., None].expand(-1, -1, K)).view(B, nb, G - 1, K)
        pk = b["topk_logp"].gather(1, pos[..., None].expand(-1, -1, K)).view(B, nb, G - 1, K).float().softmax(-1)
        soft = -(pk * logq.gather(-1, ids)).sum(-1)
        want = (soft * w).sum() / (w.sum() * B * nb)
    torch.testing.assert_close(full_soft.detach(), want, rtol=1e-5, atol=1e-5)
    V = target.config.vocab_size
    every = HeadCandidates(torch.arange(V), torch.zeros(V))
    torch.testing.assert_close(block_loss(d, *args, every, 1.0, topk)[0], full_soft)
