"""The LM head trained over a candidate vocabulary (`--head-negatives`): over the whole
vocabulary it is the full loss exactly, every label and stored Top-K token is a candidate,
and a candidate set without a label is refused."""

from __future__ import annotations

import pytest
import torch
from flashspark.train.common import block_loss, head_candidates, predicted_positions
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
    every, hits_every = block_loss(d, *args, torch.arange(target.config.vocab_size))
    torch.testing.assert_close(every, full)
    assert torch.equal(hits_every, hits_full)
    # a strict subset drops terms of the normaliser: the loss can only fall
    cand = head_candidates(b, b["anchors"], G, target.config.vocab_size, 3, torch.Generator().manual_seed(0))
    sub, _ = block_loss(d, *args, cand)
    assert len(cand) < target.config.vocab_size and sub < full


def test_candidates_hold_labels_and_topk():
    target = tiny_target(vocab=512)
    b = batch(target)
    V = target.config.vocab_size
    cand = head_candidates(b, b["anchors"], G, V, 5, torch.Generator().manual_seed(0))
    assert torch.equal(cand, cand.unique()) and 0 <= int(cand.min()) and int(cand.max()) < V
    pos = predicted_positions(b["anchors"], G)
    need = torch.cat(
        [b["labels"].gather(1, pos).flatten(), b["topk_ids"].gather(1, pos[..., None].expand(-1, -1, 4)).flatten()]
    )
    assert torch.isin(need, cand).all()
    # positions no block predicts contribute nothing but the uniform draws
    assert len(cand) <= need.unique().numel() + 5


def test_candidates_without_a_label_are_refused():
    target = tiny_target(vocab=512)
    d = tiny_drafter(target, block_size=G)
    b = batch(target)
    w = torch.ones(G - 1)
    label = int(b["labels"][0, int(b["anchors"][0, 0]) + 1])
    cand = torch.tensor([i for i in range(target.config.vocab_size) if i != label])
    with pytest.raises(ValueError, match="every label"):
        block_loss(d, b["features"], b["tokens"], b["labels"], b["anchors"], w, cand)
