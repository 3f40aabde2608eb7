"""The confidence scheduler composed with `verify` is lossless at T > 0.

Speculative sampling is exact when whether draft j is verified depends only on what was
drawn before it. A slot's confidence reads the draft before it, so an admission that looks
past slot j (the best of all prefixes, searching over a dip in Θ) verifies slot j because of
draft j itself. These tests compose the project's own `ConfidenceScheduler` with
`flashspark.verify` on a setting where that happens (V = 4, a uniform target, a skewed
first draft, slot 2's confidence 0.9 after draft token 0 and 0.1 otherwise, and an SPS table
of 1.0 / 0.6 / 0.55 steps per second at 1 / 2 / 3 tokens), and chi-square the emitted tokens.
The old rule (the best prefix) is planted back and must fail; so must a confidence source that
reads the draft it schedules (the old DFlash 2 proxy signal). A property test checks, for
random batches, that no slot's admission moves when the confidences after it change.
"""

import numpy as np
import pytest
import torch
from flashspark import verify
from flashspark.scheduling import confidence as confidence_mod
from flashspark.scheduling.confidence import ConfidenceScheduler, schedule_tokens
from flashspark.scheduling.costs import SPSTable
from spec_helpers import chi_square_ok

pytestmark = pytest.mark.usefixtures("one_thread")

V = 4
P = torch.full((V,), 1.0 / V)  # the target: uniform at every position
Q1 = torch.tensor([0.7, 0.1, 0.1, 0.1])  # draft 1
Q2 = torch.tensor([0.1, 0.1, 0.1, 0.7])  # draft 2
SPS = SPSTable([1, 2, 3], [1.0, 0.6, 0.55])
TRIALS = 8000


def c2_after(x1: int) -> float:
    return 0.9 if x1 == 0 else 0.1


def run_trials(scheduler, c1_of, trials=TRIALS, seed=0):
    """Counts [V * V] of the first two emitted tokens over `trials` one-request steps.

    Each trial draws x1 ~ Q1, x2 ~ Q2, asks `scheduler` how many of them to verify from the
    confidences (c1_of(x1), c2_after(x1)), and verifies against the uniform target with
    `flashspark.verify`. A step that emits one token is followed by a plain draw from the
    target (what any lossless next step emits), so the pair must be uniform."""
    g = torch.Generator().manual_seed(seed)
    x1 = torch.multinomial(Q1, trials, replacement=True, generator=g)
    x2 = torch.multinomial(Q2, trials, replacement=True, generator=g)
    one = torch.ones(1, dtype=torch.bool)
    k = torch.empty(trials, dtype=torch.int64)
    for t in range(trials):
        a = int(x1[t])
        conf = torch.tensor([[c1_of(a), c2_after(a)]])
        k[t] = int(scheduler.schedule(conf, one)[0])
    cu = torch.zeros(trials + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(k, 0).to(torch.int32)
    drafts = torch.stack([x1, x2], 1)
    keep = torch.arange(2)[None] < k[:, None]
    q = torch.stack([Q1.expand(trials, V), Q2.expand(trials, V)], 1)
    tokens, acc = verify(
        torch.zeros(int(k.sum()) + trials, V),  # uniform logits: draft rows then the bonus row
        drafts[keep].to(torch.int32),
        cu,
        draft_probs=q[keep].contiguous(),
        temperature=torch.ones(trials),
        seeds=torch.arange(trials, dtype=torch.int64) + seed * trials,
        offsets=torch.zeros(trials, dtype=torch.int64),
        max_spec_len=2,
    )
    first = tokens[:, 0].long()
    plain = torch.multinomial(P, trials, replacement=True, generator=g)
    second = torch.where(acc >= 1, tokens[:, 1].long(), plain)
    assert bool((first >= 0).all()) and bool((second >= 0).all())
    return torch.bincount(first * V + second, minlength=V * V).double(), k


UNIFORM_PAIR = torch.full((V * V,), 1.0 / (V * V))


@pytest.mark.parametrize(
    "admission,delay,padded",
    [("stop", 0, False), ("stop", 2, False), ("budget", 0, False), ("stop", 0, True), ("budget", 0, True)],
    ids=["stop", "stop-delay2", "budget", "stop-padded", "budget-padded"],
)
@pytest.mark.parametrize("c1", [0.6, 0.7], ids=["dip", "rise"])
def test_scheduler_then_verify_is_lossless(admission, delay, c1, padded):
    """c1 = 0.6: Θ dips at one slot and rises again at two only when x1 = 0; c1 = 0.7: Θ rises
    at one slot, and at two only when x1 = 0 (verifying slot 2 on draft 1 is allowed). `padded`:
    the admission of widths (`padded_columns`), which for one request prices as Algorithm 1."""
    sched = ConfidenceScheduler(2, SPS, delay=delay, admission=admission, padded=padded)
    counts, k = run_trials(sched, lambda x1: c1)
    assert chi_square_ok(counts, UNIFORM_PAIR)
    if admission == "stop" and delay == 0:  # the setting is not vacuous: both depths occur
        assert set(k.tolist()) == ({0} if c1 == 0.6 else {1, 2})


@pytest.mark.parametrize("padded", [False, True], ids=["slots", "padded"])
def test_planted_best_prefix_rule_is_caught(monkeypatch, padded):
    """The old rule, the best of all prefixes, verifies x1 only when x1 = 0: token 0 comes
    first about 33% of the time instead of 25% (the best width, for the padded admission)."""
    monkeypatch.setattr(confidence_mod, "early_stop", lambda theta: int(np.argmax(theta)))
    counts, k = run_trials(ConfidenceScheduler(2, SPS, padded=padded), lambda x1: 0.6)
    assert set(k.tolist()) == {0, 2}
    assert not chi_square_ok(counts, UNIFORM_PAIR)
    first = counts.view(V, V).sum(1) / counts.sum()
    assert float(first[0]) > 0.3


def test_planted_confidence_reading_its_own_draft_is_caught():
    """A confidence that reads the draft it schedules (the old DFlash 2 proxy read the chosen
    candidate's own probability): slot 1 is verified only when x1 = 0, under the early stop too."""
    counts, _ = run_trials(ConfidenceScheduler(2, SPS), lambda x1: 0.7 if x1 == 0 else 0.5)
    assert not chi_square_ok(counts, UNIFORM_PAIR)


# ----------------------------------------------------------------- the property behind it
@pytest.mark.parametrize("admit", ["stop", 5, 11])
@pytest.mark.parametrize("seed", range(4))
def test_admission_of_a_slot_ignores_the_confidences_after_it(admit, seed):
    """For random batches and bumpy SPS tables: resampling request r's confidences at positions
    after j never changes whether (r, j) is admitted (the rule is non-anticipating)."""
    g = torch.Generator().manual_seed(seed)
    B, K = 4, 5
    tokens = list(range(1, B * (K + 1) + 1))
    rates = 1.0 / torch.tensor(tokens, dtype=torch.float64) ** 0.5 * (1 + 0.3 * torch.rand(len(tokens), generator=g))
    sps = SPSTable(tokens, rates.tolist())
    active = torch.ones(B, dtype=torch.bool)
    for _ in range(40):
        conf = torch.rand(B, K, generator=g) ** 0.3
        k = schedule_tokens(conf, active, sps, admit=admit)
        r, j = int(torch.randint(B, (1,), generator=g)), int(torch.randint(K, (1,), generator=g))
        other = conf.clone()
        other[r, j + 1 :] = torch.rand(K - j - 1, generator=g) ** 0.3
        k2 = schedule_tokens(other, active, sps, admit=admit)
        assert (int(k[r]) > j) == (int(k2[r]) > j)


def test_best_prefix_does_anticipate():
    """The same property fails for the best of all prefixes (why it is not an admission rule)."""
    conf = torch.tensor([[0.6, 0.9]])
    active = torch.ones(1, dtype=torch.bool)
    assert schedule_tokens(conf, active, SPS, admit="best").tolist() == [2]
    assert schedule_tokens(torch.tensor([[0.6, 0.1]]), active, SPS, admit="best").tolist() == [0]
    assert schedule_tokens(conf, active, SPS).tolist() == [0]  # the early stop: decided before slot 2


@pytest.mark.parametrize("admit", ["stop", 3])
@pytest.mark.parametrize("seed", range(4))
def test_padded_width_ignores_the_confidences_after_it(admit, seed):
    """The padded admission verifies column j of every active request or of none: resampling
    any request's confidences after position j never changes whether column j is verified."""
    g = torch.Generator().manual_seed(seed)
    B, K = 5, 6
    tokens = [B * w for w in range(1, K + 2)]
    rates = 1.0 / torch.tensor(tokens, dtype=torch.float64) ** 0.4 * (1 + 0.2 * torch.rand(K + 1, generator=g))
    sps = SPSTable(tokens, rates.tolist())
    active = torch.tensor([True, True, False, True, True])
    for _ in range(40):
        conf = torch.rand(B, K, generator=g) ** 0.3
        k = schedule_tokens(conf, active, sps, admit=admit, padded=True)
        assert set(k[active].tolist()) == {int(k.max())} and int(k[~active].sum()) == 0
        j = int(torch.randint(K, (1,), generator=g))
        other = conf.clone()
        other[:, j + 1 :] = torch.rand(B, K - j - 1, generator=g) ** 0.3
        k2 = schedule_tokens(other, active, sps, admit=admit, padded=True)
        assert (int(k.max()) > j) == (int(k2.max()) > j)
