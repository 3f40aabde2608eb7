"""The whole loop at T = 1 under the confidence scheduler is lossless: `dspark:sched=confidence`
(DSpark's own head) and `dflash2:sched=confidence` (the confidence proxy, on the selector row's
top margin), with SPS tables whose dips would make the old rule (the best of all prefixes)
verify a draft because of the confidence that follows it. The emitted tokens are chi-squared
against the target's exact joint distribution; the old rule, planted back, must fail the same
test in both cases. Both cases verify drafts under the correct rule too (about half of the
request-steps verify at least one), so the test sees speculative verification, not plain decoding.

The bias lives at small batches (in a large batch one request's draft barely moves the global
cut), so each request is scheduled alone, as at batch 1, by its own `ConfidenceScheduler`:
`PerRequest` hands every scheduler its row of the step's state. Everything else is the loop's.
"""

import numpy as np
import pytest
import torch
from flashspark.scheduling import Scheduler, ScheduleState
from flashspark.scheduling import confidence as confidence_mod
from flashspark.scheduling.confidence import ConfidenceScheduler
from flashspark.scheduling.costs import SPSTable
from flashspark.scheduling.proxy import ConfidenceProxy
from spec_helpers import chi_square_ok, exact_joint, spec_joint, tiny_dflash2, tiny_dspark, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")

V, PROMPT, N, SAMPLES = 8, [3, 5, 2], 3, 6000


class PerRequest(Scheduler):
    """One `ConfidenceScheduler` per request, each seeing only its own row (batch 1)."""

    def __init__(self, make, batch_size: int):
        self.scheds = [make() for _ in range(batch_size)]
        self.max_spec_len = self.scheds[0].max_spec_len
        self.wants_signals = self.scheds[0].wants_signals

    def plan(self, state: ScheduleState) -> torch.Tensor:
        k = torch.zeros(len(state.active), dtype=torch.int64)
        row = lambda x, b: None if x is None else x[b : b + 1]  # noqa: E731
        for b in torch.nonzero(state.active)[:, 0].tolist():
            sub = ScheduleState(
                state.active[b : b + 1],
                state.ctx_lens[b : b + 1],
                state.draft_tokens[b : b + 1],
                None,
                row(state.confidence, b),
                row(state.signals, b),
            )
            k[b] = self.scheds[b].plan(sub)[0]
        return k


def dspark_case():
    """DSpark whose confidence reads the previous draft strongly (W1[x_{k-1}] only)."""
    target = tiny_target(vocab=V, layers=1, seed=5, scale=3.0)
    d = tiny_dspark(target, block_size=4, seed=6, scale=8.0)
    with torch.no_grad():
        w, D = d.confidence_head.proj.weight, d.config.hidden_size
        w[:, :D] = 0
        w[:, D:] = torch.randn(w[:, D:].shape, generator=torch.Generator().manual_seed(3)) * 0.35
        d.confidence_head.proj.bias.fill_(1.0)
    sps = SPSTable([1, 2, 3, 4], [1.0, 0.6, 0.55, 0.5])
    return target, d, (lambda: ConfidenceScheduler(3, sps)), {}


def dflash2_case():
    """DFlash 2 whose proxy reads the selector row's top margin, which swings with the draft before it.

    The codebooks are scaled down (x0.3) so that the selector's pair term is O(1): the sampled
    paths spread over the K candidates (a one-hot q leaves nothing for x_1 to decide) and the
    margin of row 2, S_2(x_1, ·), moves with x_1 through the predecessor codebook (0.01-2.4 for
    the anchors here). The proxy reads only that margin, steeply (weight 3; biases by
    position). With this SPS table one slot pays for itself at c_1 > 0.82, two at
    c_1 (1 + c_2) > 1. Anchors 0, 3, 6, 7 give c_1 > 0.9: the early stop verifies 2-3
    drafts there (about 28% of first blocks). The likeliest anchor (2, p = 0.43) gives
    c_1 = 0.63: the early stop verifies nothing, while the best prefix verifies 3 slots
    exactly when x_1 = 1 (c_2 = 0.74, the other candidates 0.27-0.38), a draft the path
    over-samples (q = 0.15 against p = 0.12): the old rule then emits token 1 with about
    1.85 times its probability. Anchors 1, 4, 5 flip the same way."""
    target = tiny_target(vocab=V, layers=1, seed=5, scale=3.0)
    d = tiny_dflash2(target, block_size=4, topk=4, seed=6, scale=8.0)
    with torch.no_grad():
        d.selector.predecessor_codebook.weight.mul_(0.3)
        d.selector.successor_codebook.weight.mul_(0.3)
    proxy = ConfidenceProxy(3)
    proxy.weight = torch.tensor([0.0, 3.0, 0.0, 0.0])  # top_prob, top_margin, unary_top1, entropy
    proxy.bias = torch.tensor([0.0, -1.25, 1.0])
    sps = SPSTable([1, 2, 3, 4], [1.0, 0.55, 0.5, 0.45])
    return (
        target,
        d,
        (lambda: ConfidenceScheduler(3, sps, confidence_fn=proxy.for_scheduler(online=False))),
        {"path": "sample"},
    )


CASES = {"dspark": dspark_case, "dflash2": dflash2_case}


def joint_counts(case):
    target, d, make, kw = CASES[case]()
    # Decoding past the N counted tokens keeps the blocks whole where the scheduler decides.
    counts = spec_joint(
        target, d, PROMPT, N, 1.0, samples=SAMPLES, decode=N + 4, scheduler=PerRequest(make, SAMPLES), **kw
    )
    return counts, exact_joint(target, PROMPT, N, 1.0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_confidence_scheduler_loop_is_lossless(case):
    counts, p = joint_counts(case)
    assert chi_square_ok(counts, p)


@pytest.mark.parametrize("case", sorted(CASES))
def test_planted_best_prefix_rule_fails_the_loop_test(case, monkeypatch):
    """The old rule's bias is far outside the test's bound in both cases: chi-square about 600
    against a limit of 278 (196 degrees of freedom, 6000 samples), where the correct rule
    gives about 190-200 (DFlash 2 over loop seeds 0-2: 618-628 planted, 190-199 correct)."""
    monkeypatch.setattr(confidence_mod, "early_stop", lambda theta: int(np.argmax(theta)))
    counts, p = joint_counts(case)
    assert not chi_square_ok(counts, p)
