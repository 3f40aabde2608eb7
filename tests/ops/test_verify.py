"""Tests of torch.ops.flashspark.verify against the pure-PyTorch oracle.

Exact greedy cases, kernel == oracle under the shared Philox stream,
statistical losslessness for every q form (with planted-bug samplers that the
same statistic must reject), determinism, opcheck, odd sizes, non-contiguous
inputs and bad inputs.
"""

import math

import flashspark
import pytest
import torch
from flashspark.reference import (
    PURPOSE_ACCEPT,
    PURPOSE_RESAMPLE,
    gumbel,
    philox_u32,
    uniform_open01,
    verify_reference,
)

# ---------------------------------------------------------------- helpers


def make_case(
    num_draft, vocab, *, q_mode="onehot", dtype=torch.float32, temperature=1.0, k=4, seed=0, closeness=0.7, device="cpu"
):
    """A batch whose drafts come from a q close to p, so that acceptance is mixed.

    Returns (logits, draft_tokens, cu_num_draft, kwargs) for ops.verify.
    """
    g = torch.Generator().manual_seed(seed)
    batch = len(num_draft)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(num_draft, dtype=torch.int32).cumsum(0)
    total = int(cu[-1])
    logits = torch.randn(total + batch, vocab, generator=g) * 3.0
    draft_logits = torch.empty(total, vocab)
    draft_tokens = torch.empty(total, dtype=torch.int64)
    for b in range(batch):
        lo, hi = int(cu[b]), int(cu[b + 1])
        rows = logits[lo + b : hi + b]
        draft_logits[lo:hi] = closeness * rows + (1 - closeness) * 3.0 * torch.randn(rows.shape, generator=g)
    q = torch.softmax(draft_logits, dim=-1)
    kwargs = {}
    if q_mode == "onehot":
        draft_tokens = draft_logits.argmax(-1) if total else draft_tokens
    elif q_mode == "dense":
        draft_tokens = torch.multinomial(q, 1, generator=g).squeeze(-1) if total else draft_tokens
        kwargs["draft_probs"] = q
    elif q_mode == "sparse":
        kk = min(k, vocab)
        top_p, top_i = q.topk(kk, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        pick = torch.multinomial(top_p, 1, generator=g) if total else torch.zeros(0, 1, dtype=torch.int64)
        draft_tokens = top_i.gather(-1, pick).squeeze(-1)
        kwargs["draft_probs"] = top_p
        kwargs["draft_probs_ids"] = top_i.to(torch.int32)
    kwargs.update(
        temperature=torch.full((batch,), float(temperature)),
        seeds=torch.arange(batch, dtype=torch.int64) * 7919 + seed,
        offsets=torch.arange(batch, dtype=torch.int64) * 3,
        max_spec_len=max(num_draft) if num_draft else 0,
    )
    logits = logits.to(dtype)
    moved = {k_: (v.to(device) if isinstance(v, torch.Tensor) else v) for k_, v in kwargs.items()}
    return logits.to(device), draft_tokens.to(torch.int32).to(device), cu.to(device), moved


def run_both(logits, tokens, cu, kwargs):
    got = flashspark.verify(logits, tokens, cu, **kwargs)
    want = verify_reference(logits, tokens, cu, **kwargs)
    return [t.cpu() for t in got], [t.cpu() for t in want]


def assert_well_formed(out, acc, cu, draft_tokens, max_spec_len):
    out, acc, cu, draft_tokens = out.cpu(), acc.cpu(), cu.cpu(), draft_tokens.cpu()
    for b in range(acc.numel()):
        n = int(cu[b + 1] - cu[b])
        k = int(acc[b])
        assert 0 <= k <= n
        assert torch.equal(out[b, :k], draft_tokens[int(cu[b]) : int(cu[b]) + k])
        assert out[b, k] >= 0
        assert (out[b, k + 1 :] == -1).all()
    assert out.shape[1] == max_spec_len + 1


# ---------------------------------------------------------------- Philox


def test_philox_known_answers():
    # Random123 known-answer vectors for philox4x32-10.
    from flashspark.reference import philox4x32_10

    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in philox4x32_10(ctr, key)) == want


def test_uniform_is_open_and_gumbel_finite():
    bits = torch.tensor([0, 1, 511, 512, 0xFFFFFFFF, 0x80000000], dtype=torch.int64)
    u = uniform_open01(bits)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(gumbel(bits)).all()
    # Lanes of one block and distinct purposes give distinct draws.
    draws = philox_u32(5, 9, PURPOSE_RESAMPLE, torch.arange(8))
    assert draws.unique().numel() == 8
    assert int(philox_u32(5, 9, PURPOSE_ACCEPT, 0)) != int(draws[0])


# ---------------------------------------------------------------- exact greedy cases


def _greedy_call(logits, drafts, num_draft, max_spec_len, device):
    cu = torch.tensor([0] + list(torch.tensor(num_draft).cumsum(0).tolist()), dtype=torch.int32, device=device)
    b = len(num_draft)
    return flashspark.verify(
        logits.to(device),
        torch.tensor(drafts, dtype=torch.int32, device=device),
        cu,
        temperature=torch.zeros(b, device=device),
        seeds=torch.zeros(b, dtype=torch.int64, device=device),
        offsets=torch.zeros(b, dtype=torch.int64, device=device),
        max_spec_len=max_spec_len,
    )


def test_greedy_all_accepted_emits_bonus(device):
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 1, 4, 9]):
        logits[row, tok] = 5.0
    out, acc = _greedy_call(logits, [3, 1, 4], [3], 4, device)
    assert out.cpu().tolist() == [[3, 1, 4, 9, -1]]
    assert acc.cpu().tolist() == [3]


def test_greedy_first_token_rejected(device):
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([7, 1, 4, 9]):
        logits[row, tok] = 5.0
    out, acc = _greedy_call(logits, [3, 1, 4], [3], 3, device)
    assert out.cpu().tolist() == [[7, -1, -1, -1]]
    assert acc.cpu().tolist() == [0]


def test_greedy_mixed_batch_with_empty_drafts(device):
    # request 0: rejects at 1; request 1: no drafts (bonus only); request 2: all accepted
    rows = [[2, 6, 0], [5], [1, 8]]
    logits = []
    for r in rows:
        for tok in r:
            row = torch.zeros(12)
            row[tok] = 1.0
            logits.append(row)
    logits = torch.stack(logits)
    out, acc = _greedy_call(logits, [2, 4, 1], [2, 0, 1], 3, device)
    assert out.cpu().tolist() == [[2, 6, -1, -1], [5, -1, -1, -1], [1, 8, -1, -1]]
    assert acc.cpu().tolist() == [1, 0, 1]


def test_greedy_ties_break_to_lowest_id(device):
    logits = torch.zeros(2, 6)
    logits[0, [2, 4]] = 3.0
    logits[1, [1, 5]] = 3.0
    out, acc = _greedy_call(logits, [4], [1], 1, device)  # argmax is 2, not 4
    assert out.cpu().tolist() == [[2, -1]]
    out, acc = _greedy_call(logits, [2], [1], 1, device)
    assert out.cpu().tolist() == [[2, 1]]


def test_greedy_ignores_q(device):
    logits, tokens, cu, kw = make_case([4, 2, 5], 37, q_mode="dense", temperature=0.0, device=device)
    got, want = run_both(logits, tokens, cu, kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    kw.pop("draft_probs")
    got2 = [t.cpu() for t in flashspark.verify(logits, tokens, cu, **kw)]
    assert torch.equal(got[0], got2[0])


# ---------------------------------------------------------------- kernel == oracle


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_matches_reference(device, q_mode, dtype, temperature):
    num_draft = [3, 0, 8, 1, 5, 8, 2, 0, 4, 7, 6, 1, 8, 3, 2, 5, 0, 8, 4]  # B = 19
    logits, tokens, cu, kw = make_case(
        num_draft, 111, q_mode=q_mode, dtype=dtype, temperature=temperature, seed=3, device=device
    )
    (out, acc), (ref_out, ref_acc) = run_both(logits, tokens, cu, kw)
    assert torch.equal(out, ref_out)
    assert torch.equal(acc, ref_acc)
    assert_well_formed(out, acc, cu, tokens, kw["max_spec_len"])


@pytest.mark.parametrize("vocab", [1, 2, 5, 111, 4097])
@pytest.mark.parametrize("batch", [1, 19])
def test_odd_sizes(device, vocab, batch):
    num_draft = [(3 * b + 1) % 6 for b in range(batch)]
    for q_mode in ["onehot", "dense", "sparse"]:
        logits, tokens, cu, kw = make_case(num_draft, vocab, q_mode=q_mode, seed=vocab + batch, device=device)
        (out, acc), (ref_out, ref_acc) = run_both(logits, tokens, cu, kw)
        assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc), q_mode


@pytest.mark.parametrize("q_mode", ["onehot", "sparse"])
def test_large_vocab(device, q_mode):
    # Qwen3 vocabulary; long enough rows to exercise chunked/block reductions.
    logits, tokens, cu, kw = make_case([4, 1], 151936, q_mode=q_mode, k=16, closeness=0.95, seed=11, device=device)
    (out, acc), (ref_out, ref_acc) = run_both(logits, tokens, cu, kw)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


def test_all_drafts_empty(device):
    logits, tokens, cu, kw = make_case([0, 0, 0], 50, seed=2, device=device)
    (out, acc), (ref_out, ref_acc) = run_both(logits, tokens, cu, kw)
    assert torch.equal(out, ref_out)
    assert (acc == 0).all() and (out[:, 0] >= 0).all()


def test_empty_batch(device):
    logits = torch.zeros(0, 10, device=device)
    out, acc = flashspark.verify(
        logits,
        torch.zeros(0, dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        temperature=torch.zeros(0, device=device),
        seeds=torch.zeros(0, dtype=torch.int64, device=device),
        offsets=torch.zeros(0, dtype=torch.int64, device=device),
        max_spec_len=4,
    )
    assert out.shape == (0, 5) and acc.shape == (0,)


def test_masked_logits_never_emitted(device):
    # -inf logits (top-k/top-p masking upstream) must never be sampled.
    logits, tokens, cu, kw = make_case([3] * 16, 40, q_mode="dense", seed=5, device=device)
    logits = logits.clone()
    logits[:, 20:] = float("-inf")
    kw["draft_probs"] = torch.softmax(torch.randn(tokens.numel(), 40), -1).to(device)
    out, acc = flashspark.verify(logits, tokens % 20, cu, **kw)
    emitted = out.cpu().gather(1, acc.cpu().long().unsqueeze(1))
    assert (emitted < 20).all()


# ---------------------------------------------------------------- placeholders (vLLM's draft id -1)


def test_greedy_placeholder_is_rejected(device):
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([3, 1, 4, 9]):
        logits[row, tok] = 5.0
    out, acc = _greedy_call(logits, [3, flashspark.ops.PLACEHOLDER_TOKEN, 4], [3], 3, device)
    assert out.cpu().tolist() == [[3, 1, -1, -1]]  # the argmax at the placeholder, then nothing
    assert acc.cpu().tolist() == [1]


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_placeholders_match_reference(device, q_mode, temperature):
    logits, drafts, cu, kw = make_case([3, 0, 4, 2, 1], 37, q_mode=q_mode, temperature=temperature, device=device)
    drafts = drafts.clone()
    drafts[[0, 4, 6, 8, 9]] = -1  # first, middle and last positions of requests, and a lone draft
    got, want = run_both(logits, drafts, cu, kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for b, pos in [(0, 0), (2, 1), (3, 1), (4, 0)]:  # rejected at its first placeholder (or earlier)
        assert got[1][b] <= pos
    assert (got[0] >= -1).all() and (got[0][got[0] >= 0] < 37).all()


@pytest.mark.parametrize("bad", [-2, -(2**31), 37])
def test_other_negative_or_large_ids_stay_errors(device, bad):
    logits, drafts, cu, kw = make_case([2, 2], 37, device=device)
    drafts = drafts.clone()
    drafts[1] = bad
    with pytest.raises(RuntimeError, match="'draft_tokens' holds a token id outside"):
        flashspark.verify(logits, drafts, cu, **kw)


def placeholder_trials(q_mode, device, n=30000):
    """n requests of one draft, the placeholder, over the same target row (and dense q row)."""
    g = torch.Generator().manual_seed(77)
    row = torch.randn(2, STAT_V, generator=g) * 1.5
    q = torch.softmax(torch.randn(STAT_V, generator=g) * 1.5, dim=-1)
    kw = dict(
        temperature=torch.ones(n, device=device),
        seeds=torch.arange(n, dtype=torch.int64, device=device) + 5,
        offsets=torch.zeros(n, dtype=torch.int64, device=device),
        max_spec_len=1,
    )
    if q_mode == "dense":
        kw["draft_probs"] = q.repeat(n, 1).to(device)
    out, acc = flashspark.verify(
        row.repeat(n, 1).to(device),
        torch.full((n,), -1, dtype=torch.int32, device=device),
        (torch.arange(n + 1, dtype=torch.int32)).to(device),
        **kw,
    )
    p = torch.softmax(row[0], dim=-1).double()
    expected = p if q_mode == "onehot" else torch.clamp(p - q.double(), min=0.0)
    return out.cpu(), acc.cpu(), expected / expected.sum()


@pytest.mark.parametrize("q_mode", ["onehot", "dense"])
def test_placeholder_emits_the_residual(device, q_mode):
    """At a placeholder the request emits a token from norm(max(p - q, 0)): p itself for a
    one-hot (deterministic) drafter, vLLM's recovered distribution for a dense q."""
    out, acc, expected = placeholder_trials(q_mode, device)
    assert (acc == 0).all()
    counts = torch.bincount(out[:, 0].long(), minlength=STAT_V).double()
    assert chi2_stat(counts, expected) < chi2_critical(STAT_V - 1)
    # Planted bugs the same statistic must reject: -1 read as the last id (one-hot q there, so
    # that id is never emitted), and a dense q ignored at the placeholder (p instead of the residual).
    if q_mode == "onehot":
        buggy = expected.clone()
        buggy[-1] = 0.0
    else:
        buggy = placeholder_trials("onehot", device, n=10)[2]
    g = torch.Generator().manual_seed(3)
    sample = torch.multinomial((buggy / buggy.sum()).float(), out.shape[0], replacement=True, generator=g)
    bad = torch.bincount(sample, minlength=STAT_V).double()
    try:
        rejected = chi2_stat(bad, expected) >= chi2_critical(STAT_V - 1)
    except AssertionError:  # it emitted a token of residual mass 0
        rejected = True
    assert rejected, "the planted placeholder bug passed the test"


# ---------------------------------------------------------------- bonus tokens given by the caller


def without_bonus_rows(logits, cu):
    """The [T, V] draft rows of a [T + B, V] verify layout (vLLM's target_logits)."""
    keep = torch.ones(logits.shape[0], dtype=torch.bool)
    cu = cu.cpu()
    for b in range(cu.numel() - 1):
        keep[int(cu[b + 1]) + b] = False
    return logits[keep.to(logits.device)]


def test_greedy_given_bonus_tokens(device):
    logits = torch.full((3, 10), -1.0)
    for row, tok in enumerate([3, 1, 4]):
        logits[row, tok] = 5.0
    kw = dict(
        temperature=torch.zeros(2, device=device),
        seeds=torch.zeros(2, dtype=torch.int64, device=device),
        offsets=torch.zeros(2, dtype=torch.int64, device=device),
        max_spec_len=2,
        bonus_tokens=torch.tensor([8, 9], device=device),
    )
    drafts = torch.tensor([3, 1, 7], dtype=torch.int32, device=device)
    out, acc = flashspark.verify(
        logits.to(device), drafts, torch.tensor([0, 2, 3], dtype=torch.int32, device=device), **kw
    )
    # request 0 accepts both drafts and emits its given bonus 8; request 1 is corrected to 4
    assert out.cpu().tolist() == [[3, 1, 8], [4, -1, -1]] and acc.cpu().tolist() == [2, 0]


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_given_bonus_tokens_match_reference(device, q_mode, temperature):
    logits, drafts, cu, kw = make_case(
        [3, 0, 4, 1], 29, q_mode=q_mode, temperature=temperature, closeness=0.95, device=device
    )
    bonus = torch.tensor([5, 28, 0, 13], dtype=torch.int64, device=device)
    rows = without_bonus_rows(logits, cu)
    got, want = run_both(rows, drafts, cu, {**kw, "bonus_tokens": bonus})
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # where every draft was accepted the given bonus is emitted; elsewhere the same as with rows
    full = [t.cpu() for t in flashspark.verify(logits, drafts, cu, **kw)]
    n = (cu[1:] - cu[:-1]).cpu()
    for b in range(4):
        if int(got[1][b]) == int(n[b]):
            assert int(got[0][b, n[b]]) == int(bonus[b])
        else:
            assert torch.equal(got[0][b], full[0][b]) and int(got[1][b]) == int(full[1][b])
    assert (got[1] == n).any(), "no request accepted every draft: the case does not test the bonus"


def test_given_bonus_tokens_bad_input(device):
    logits, drafts, cu, kw = make_case([2, 1], 17, device=device)
    rows = without_bonus_rows(logits, cu)
    bonus = torch.tensor([1, 2], device=device)
    with pytest.raises(RuntimeError, match="one row per draft token \\(3\\) when 'bonus_tokens' is given"):
        flashspark.verify(logits, drafts, cu, **kw, bonus_tokens=bonus)
    with pytest.raises(RuntimeError, match="'bonus_tokens' must have B = 2 entries"):
        flashspark.verify(rows, drafts, cu, **kw, bonus_tokens=bonus[:1])
    with pytest.raises(RuntimeError, match="'bonus_tokens' holds a token id outside"):
        flashspark.verify(rows, drafts, cu, **kw, bonus_tokens=torch.tensor([1, 17], device=device))
    status = torch.full((2,), -7, dtype=torch.int32, device=device)
    out, acc = flashspark.verify(
        rows, drafts, cu, **kw, bonus_tokens=torch.tensor([1, -1], device=device), status=status
    )
    assert status.cpu().tolist() == [0, 17] and int(acc[1]) == -1 and (out[1] == -1).all()


# ---------------------------------------------------------------- statistical losslessness


def chi2_critical(df, z=4.75):
    """Wilson-Hilferty upper quantile of chi-square(df); z = 4.75 is a tail of about 1e-6."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts, probs):
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def position_stats(out, acc, target_probs):
    """Chi-square of the emitted token at each position k, over the trials that
    reached k (all earlier drafts accepted); conditional on reaching k, the
    token at k must be distributed as p_k for a lossless sampler."""
    stats = []
    for k, p in enumerate(target_probs):
        reached = acc >= k
        tokens = out[reached, k].long()
        counts = torch.bincount(tokens, minlength=p.numel()).double()
        stats.append((chi2_stat(counts, p.double()), p.numel() - 1, int(reached.sum())))
    return stats


STAT_V, STAT_GAMMA, STAT_TRIALS = 6, 3, 30000


def stat_setup(q_mode, temperature):
    g = torch.Generator().manual_seed(1234)
    target_logits = torch.randn(STAT_GAMMA + 1, STAT_V, generator=g) * 1.5
    # q deliberately far from p so that rejections (and the residual) matter.
    q = torch.softmax(torch.randn(STAT_GAMMA, STAT_V, generator=g) * 1.5, dim=-1)
    if q_mode == "sparse":
        q[:, :2] = 0.0  # q has support on 4 of the 6 ids
        q = q / q.sum(-1, keepdim=True)
    p = torch.softmax(target_logits / temperature, dim=-1)
    if q_mode == "onehot":  # a deterministic drafter: always proposes the target's mode
        drafts = p[:STAT_GAMMA].argmax(-1).repeat(STAT_TRIALS, 1)
    else:
        drafts = torch.stack(
            [torch.multinomial(q[k], STAT_TRIALS, replacement=True, generator=g) for k in range(STAT_GAMMA)], dim=1
        )
    return target_logits, q, drafts, p


def run_trials(q_mode, temperature, device, probs=False, flag=True):
    """STAT_TRIALS requests over the same rows; with `probs` the rows are p itself (passed
    with target_is_probs when `flag`, and as if they were logits otherwise: a planted bug)."""
    target_logits, q, drafts, p = stat_setup(q_mode, temperature)
    n = STAT_TRIALS
    rows = p.float() if probs else target_logits
    logits = rows.repeat(n, 1)  # each trial: gamma draft rows + bonus row
    cu = torch.arange(n + 1, dtype=torch.int32) * STAT_GAMMA
    kw = dict(
        temperature=torch.full((n,), temperature),
        seeds=torch.arange(n, dtype=torch.int64) + 99,
        offsets=torch.zeros(n, dtype=torch.int64),
        max_spec_len=STAT_GAMMA,
    )
    if probs and flag:
        kw["target_is_probs"] = True
    if q_mode == "dense":
        kw["draft_probs"] = q.repeat(n, 1)
    elif q_mode == "sparse":
        kw["draft_probs"] = q[:, 2:].repeat(n, 1).contiguous()
        kw["draft_probs_ids"] = torch.arange(2, STAT_V, dtype=torch.int32).repeat(n * STAT_GAMMA, 1)
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    out, acc = flashspark.verify(logits.to(device), drafts.reshape(-1).to(torch.int32).to(device), cu.to(device), **kw)
    return out.cpu(), acc.cpu(), p, q, drafts


@pytest.mark.parametrize("q_mode,temperature", [("onehot", 1.0), ("dense", 1.0), ("sparse", 1.0), ("dense", 0.7)])
def test_statistically_lossless(device, q_mode, temperature):
    out, acc, p, _, _ = run_trials(q_mode, temperature, device)
    for k, (stat, df, reached) in enumerate(position_stats(out, acc, p)):
        assert reached > 1000, f"position {k} reached only {reached} times"
        assert stat < chi2_critical(df), f"position {k}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"
    # Acceptance rate of position 0 must equal sum_x min(p, q) (one-hot: the draft's q is 1).
    if q_mode != "onehot":
        _, q, _, pp = stat_setup(q_mode, temperature)
        expected = torch.minimum(pp[0], q[0]).sum().item()
        assert abs((acc >= 1).float().mean().item() - expected) < 5 * math.sqrt(expected / STAT_TRIALS)


def _buggy_sampler(p, q, drafts, bug):
    """Vectorized speculative sampler with one planted bug, to show that the
    statistic above has the power to reject a wrong sampler."""
    n, gamma = drafts.shape
    g = torch.Generator().manual_seed(7)
    out = torch.full((n, gamma + 1), -1, dtype=torch.int64)
    acc = torch.full((n,), gamma, dtype=torch.int64)
    alive = torch.ones(n, dtype=torch.bool)
    for k in range(gamma):
        x = drafts[:, k]
        ratio = p[k][x] / q[k][x]
        if bug == "accept_always_below_one":
            ratio = torch.clamp(ratio * 1.5, max=1.0)  # over-accepts
        accept = torch.rand(n, generator=g) < ratio
        if bug == "resample_from_p":
            residual = p[k]
        elif bug == "resample_from_q_complement":
            residual = torch.clamp(1.0 - q[k], min=0)
        else:
            residual = torch.clamp(p[k] - q[k], min=0)
        resampled = torch.multinomial(residual / residual.sum(), n, replacement=True, generator=g)
        rejected_now = alive & ~accept
        out[alive, k] = torch.where(accept[alive], x[alive], resampled[alive])
        acc[rejected_now] = k
        alive &= accept
    out[alive, gamma] = torch.multinomial(p[gamma], int(alive.sum()), replacement=True, generator=g)
    return out, acc


@pytest.mark.parametrize("bug", ["resample_from_p", "resample_from_q_complement", "accept_always_below_one"])
def test_statistic_rejects_planted_bugs(bug):
    target_logits, q, drafts, p = stat_setup("dense", 1.0)
    out, acc = _buggy_sampler(p, q, drafts, bug)
    stats = position_stats(out, acc, p)
    assert any(stat >= chi2_critical(df) for stat, df, _ in stats), f"planted bug {bug} passed the test"
    # ...while the same sampler without a bug passes it.
    out, acc = _buggy_sampler(p, q, drafts, "none")
    assert all(stat < chi2_critical(df) for stat, df, _ in position_stats(out, acc, p))


# ---------------------------------------------------------------- probabilities instead of logits


def as_probs_case(logits, kw, dtype=torch.float32, q_dtype=torch.float32):
    """The same case with the target's softmax rows (target_is_probs) and q in q_dtype."""
    kw = dict(kw, target_is_probs=True)
    if "draft_probs" in kw:
        kw["draft_probs"] = kw["draft_probs"].to(q_dtype)
    return torch.softmax(logits.float(), dim=-1).to(dtype), kw


def test_greedy_probs_exact(device):
    probs = torch.full((4, 10), 0.05)
    for row, tok in enumerate([3, 1, 4, 9]):
        probs[row, tok] = 0.55
    probs[1, 7] = 0.55  # ties with id 1 in row 1: the lowest id (1) is the argmax
    cu = torch.tensor([0, 3], dtype=torch.int32, device=device)
    kw = dict(
        temperature=torch.zeros(1, device=device),
        seeds=torch.zeros(1, dtype=torch.int64, device=device),
        offsets=torch.zeros(1, dtype=torch.int64, device=device),
        max_spec_len=3,
        target_is_probs=True,
    )
    out, acc = flashspark.verify(probs.to(device), torch.tensor([3, 1, 4], dtype=torch.int32, device=device), cu, **kw)
    assert out.cpu().tolist() == [[3, 1, 4, 9]] and acc.cpu().tolist() == [3]
    out, acc = flashspark.verify(probs.to(device), torch.tensor([3, 7, 4], dtype=torch.int32, device=device), cu, **kw)
    assert out.cpu().tolist() == [[3, 1, -1, -1]] and acc.cpu().tolist() == [1]


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_probs_match_reference(device, q_mode, dtype, temperature):
    num_draft = [3, 0, 8, 1, 5, 8, 2, 0, 4, 7, 6, 1, 8, 3, 2, 5, 0, 8, 4]
    logits, tokens, cu, kw = make_case(num_draft, 111, q_mode=q_mode, temperature=temperature, seed=8, device=device)
    probs, kw = as_probs_case(logits, kw, dtype=dtype, q_dtype=torch.bfloat16 if dtype == torch.bfloat16 else dtype)
    (out, acc), (ref_out, ref_acc) = run_both(probs, tokens, cu, kw)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    assert_well_formed(out, acc, cu, tokens, kw["max_spec_len"])
    if temperature > 0:  # some drafts rejected and some accepted: both paths ran
        assert 0 < int(acc.sum()) < sum(num_draft)


@pytest.mark.parametrize("vocab", [1, 2, 5, 4097])
def test_probs_odd_sizes_zeros_and_given_bonus(device, vocab):
    # zero-probability entries (top-k / top-p upstream) are never emitted, whatever the race draws
    logits, tokens, cu, kw = make_case([2, 5, 0, 3], vocab, q_mode="dense", seed=vocab, device=device)
    probs, kw = as_probs_case(logits, kw)
    if vocab > 2:
        probs[:, 1::2] = 0.0
        probs = probs / probs.sum(-1, keepdim=True)
    (out, acc), (ref_out, ref_acc) = run_both(probs.to(device), tokens, cu, kw)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    emitted = out.gather(1, acc.long().unsqueeze(1))
    assert (emitted % 2 == 0).all() or vocab <= 2
    bonus = torch.arange(4, dtype=torch.int32, device=device) % vocab
    rows = without_bonus_rows(probs.to(device), cu)
    (out2, acc2), (ref2, ref_acc2) = run_both(rows, tokens, cu, dict(kw, bonus_tokens=bonus))
    assert torch.equal(out2, ref2) and torch.equal(acc2, ref_acc2)


def test_bf16_draft_probs_match_reference(device):
    # bf16 q on logits: the kernel widens q as it reads; the oracle sees the same bf16 values
    logits, tokens, cu, kw = make_case([4, 2, 6, 1], 301, q_mode="dense", seed=21, device=device)
    kw["draft_probs"] = kw["draft_probs"].to(torch.bfloat16)
    (out, acc), (ref_out, ref_acc) = run_both(logits, tokens, cu, kw)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
def test_probs_statistically_lossless(device, q_mode):
    out, acc, p, q, drafts = run_trials(q_mode, 1.0, device, probs=True)
    for k, (stat, df, reached) in enumerate(position_stats(out, acc, p)):
        assert reached > 1000, f"position {k} reached only {reached} times"
        assert stat < chi2_critical(df), f"position {k}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"


def test_probs_statistic_rejects_probs_read_as_logits(device):
    # The planted bug: the probabilities handed over without the flag, so the kernel samples
    # softmax(p) (much flatter than p). The same statistic must reject it.
    out, acc, p, _, _ = run_trials("dense", 1.0, device, probs=True, flag=False)
    assert any(stat >= chi2_critical(df) for stat, df, _ in position_stats(out, acc, p))


def _probs_status(device, probs, drafts, num_draft, temperature, **extra):
    cu = torch.tensor([0] + torch.tensor(num_draft).cumsum(0).tolist(), dtype=torch.int32, device=device)
    b = len(num_draft)
    status = torch.full((b,), -7, dtype=torch.int32, device=device)
    out, acc = flashspark.verify(
        probs.to(device),
        torch.tensor(drafts, dtype=torch.int32, device=device),
        cu,
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        seeds=torch.arange(b, dtype=torch.int64, device=device),
        offsets=torch.zeros(b, dtype=torch.int64, device=device),
        max_spec_len=max(num_draft),
        target_is_probs=True,
        status=status,
        **extra,
    )
    return out.cpu(), acc.cpu(), status.cpu().tolist()


def test_probs_bad_values_fail_their_request_alone(device):
    probs = torch.full((8, 4), 0.25)
    probs[0, 2] = float("nan")  # request 0 greedy: its whole row is read
    probs[2, 1] = -0.5  # request 1 samples: p(draft) itself is read
    probs[4, :] = 0.0  # request 2 greedy: a row with no mass
    probs[6, 3] = 1.5  # request 3 samples and rejects there (p(0) = 0.25 vs q one-hot): the race reads it
    probs[6, 0] = 0.0
    out, acc, st = _probs_status(device, probs, [1, 1, 0, 0], [1, 1, 1, 1], [0.0, 1.0, 0.0, 1.0])
    assert st == [18, 18, 18, 18]
    assert (acc == -1).all() and (out == -1).all()
    # the message, raised by the CPU without a status tensor
    if device == "cpu":
        with pytest.raises(RuntimeError, match="target_is_probs.*NaN or outside"):
            flashspark.verify(
                probs[:2],
                torch.tensor([1], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32),
                temperature=torch.zeros(1),
                seeds=torch.zeros(1, dtype=torch.int64),
                offsets=torch.zeros(1, dtype=torch.int64),
                max_spec_len=1,
                target_is_probs=True,
            )


def test_probs_need_temperature_zero_or_one(device):
    probs = torch.full((6, 4), 0.25)
    out, acc, st = _probs_status(device, probs, [1, 1, 1], [1, 1, 1], [0.7, 1.0, 2.0])
    assert st == [5, 0, 5] and int(acc[1]) >= 0 and int(acc[0]) == -1
    if device == "cpu":
        with pytest.raises(RuntimeError, match="0 or 1 with target_is_probs"):
            flashspark.verify(
                probs[:2],
                torch.tensor([1], dtype=torch.int32),
                torch.tensor([0, 1], dtype=torch.int32),
                temperature=torch.full((1,), 0.5),
                seeds=torch.zeros(1, dtype=torch.int64),
                offsets=torch.zeros(1, dtype=torch.int64),
                max_spec_len=1,
                target_is_probs=True,
            )


# ---------------------------------------------------------------- determinism


def test_seeded_determinism_and_batch_order_invariance(device):
    logits, tokens, cu, kw = make_case([5, 3, 6, 2], 200, q_mode="dense", seed=4, device=device)
    a = flashspark.verify(logits, tokens, cu, **kw)
    b = flashspark.verify(logits, tokens, cu, **kw)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    outs = {
        tuple(flashspark.verify(logits, tokens, cu, **dict(kw, seeds=kw["seeds"] + s))[0].cpu().flatten().tolist())
        for s in range(6)
    }
    assert len(outs) > 1, "different seeds never changed the output"
    # A request draws the same numbers wherever it sits in the batch: verifying
    # it alone gives its row of the batched result.
    for r in range(4):
        lo, hi = int(cu[r]), int(cu[r + 1])
        sub = {name: kw[name][r : r + 1] for name in ["temperature", "seeds", "offsets"]}
        one = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        out, acc = flashspark.verify(
            logits[lo + r : hi + r + 1],
            tokens[lo:hi],
            one,
            draft_probs=kw["draft_probs"][lo:hi],
            max_spec_len=kw["max_spec_len"],
            **sub,
        )
        assert torch.equal(out[0], a[0][r]) and int(acc[0]) == int(a[1][r])


def test_offsets_change_draws(device):
    logits, tokens, cu, kw = make_case([6] * 8, 300, q_mode="dense", seed=8, device=device)
    a = flashspark.verify(logits, tokens, cu, **kw)[0]
    b = flashspark.verify(logits, tokens, cu, **dict(kw, offsets=kw["offsets"] + 100))[0]
    assert not torch.equal(a, b)


# ---------------------------------------------------------------- out variant, opcheck, layouts


def test_verify_out_matches_functional(device):
    logits, tokens, cu, kw = make_case([2, 7, 0, 4], 64, q_mode="sparse", seed=9, device=device)
    out, acc = flashspark.verify(logits, tokens, cu, **kw)
    buf = torch.full((4, kw["max_spec_len"] + 1), 123, dtype=torch.int32, device=device)
    nacc = torch.full((4,), 77, dtype=torch.int32, device=device)
    flashspark.verify_out(logits, tokens, cu, out_tokens=buf, out_num_accepted=nacc, **kw)
    assert torch.equal(out, buf) and torch.equal(acc, nacc)


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
def test_opcheck(device, q_mode):
    logits, tokens, cu, kw = make_case([3, 0, 5], 33, q_mode=q_mode, seed=10, device=device)
    args = (
        logits,
        tokens,
        cu,
        kw.get("draft_probs"),
        kw.get("draft_probs_ids"),
        kw["temperature"],
        kw["seeds"],
        kw["offsets"],
        kw["max_spec_len"],
    )
    torch.library.opcheck(torch.ops.flashspark.verify.default, args)
    out = torch.empty(3, kw["max_spec_len"] + 1, dtype=torch.int32, device=device)
    nacc = torch.empty(3, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.flashspark.verify_out.default, args, {"out_tokens": out, "out_num_accepted": nacc})
    given = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    rows = without_bonus_rows(logits, cu)
    torch.library.opcheck(torch.ops.flashspark.verify.default, (rows, *args[1:]), {"bonus_tokens": given})
    torch.library.opcheck(
        torch.ops.flashspark.verify_out.default,
        (rows, *args[1:]),
        {"out_tokens": out, "out_num_accepted": nacc, "bonus_tokens": given},
    )
    # probabilities with bf16 q, functional and out
    probs, pkw = as_probs_case(logits, kw, q_dtype=torch.bfloat16)
    pargs = (probs, tokens, cu, pkw.get("draft_probs"), *args[4:])
    torch.library.opcheck(torch.ops.flashspark.verify.default, pargs, {"target_is_probs": True})
    torch.library.opcheck(
        torch.ops.flashspark.verify_out.default,
        pargs,
        {"out_tokens": out, "out_num_accepted": nacc, "target_is_probs": True},
    )


def test_non_contiguous_inputs(device):
    logits, tokens, cu, kw = make_case([4, 6, 1, 3], 90, q_mode="dense", seed=12, device=device)
    want = flashspark.verify(logits, tokens, cu, **kw)
    # Rows strided inside a wider buffer, and a transposed (column-major) copy.
    wide = torch.full((logits.shape[0], 97), 55.0, device=device, dtype=logits.dtype)
    wide[:, :90] = logits
    transposed = logits.t().contiguous().t()
    tok_buf = torch.zeros(tokens.numel() * 2, dtype=torch.int32, device=device)
    tok_buf[::2] = tokens
    q = kw["draft_probs"]
    q_wide = torch.zeros(q.shape[0], 101, device=device)
    q_wide[:, 3:93] = q
    for lg in [wide[:, :90], transposed]:
        got = flashspark.verify(lg, tok_buf[::2], cu, **dict(kw, draft_probs=q_wide[:, 3:93]))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = verify_reference(wide[:, :90], tok_buf[::2], cu, **dict(kw, draft_probs=q_wide[:, 3:93]))
    assert torch.equal(ref[0].cpu(), want[0].cpu())


def test_int64_metadata_accepted(device):
    logits, tokens, cu, kw = make_case([3, 2], 40, q_mode="sparse", seed=13, device=device)
    a = flashspark.verify(logits, tokens, cu, **kw)
    b = flashspark.verify(logits, tokens.long(), cu.long(), **dict(kw, draft_probs_ids=kw["draft_probs_ids"].long()))
    assert torch.equal(a[0], b[0])


def test_compiles_with_torch_compile():
    logits, tokens, cu, kw = make_case([3, 4], 50, q_mode="dense", seed=14)

    def step(lg, tk, c, q, t, s, o):
        out, acc = flashspark.verify(lg, tk, c, draft_probs=q, temperature=t, seeds=s, offsets=o, max_spec_len=4)
        return out, acc + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = (logits, tokens, cu, kw["draft_probs"], kw["temperature"], kw["seeds"], kw["offsets"])
    got, want = compiled(*args), step(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------- bad inputs


def _bad(device, **changes):
    logits, tokens, cu, kw = make_case([3, 2], 20, q_mode="dense", seed=15, device=device)
    args = dict(target_logits=logits, draft_tokens=tokens, cu_num_draft=cu, **kw)
    args.update(changes)
    return args


def _call(args):
    a = dict(args)
    return flashspark.verify(a.pop("target_logits"), a.pop("draft_tokens"), a.pop("cu_num_draft"), **a)


BAD_CASES = [
    ("target_logits", lambda d: {"target_logits": torch.zeros(7, 20, dtype=torch.int32, device=d)}),
    ("target_logits", lambda d: {"target_logits": torch.zeros(7, 20, 1, device=d)}),
    ("target_logits", lambda d: {"target_logits": torch.zeros(6, 20, device=d)}),
    ("draft_tokens", lambda d: {"draft_tokens": torch.zeros(5, device=d)}),
    ("draft_tokens", lambda d: {"draft_tokens": torch.tensor([0, 1, 20, 3, 4], dtype=torch.int32, device=d)}),
    ("draft_tokens", lambda d: {"draft_tokens": torch.tensor([0, 1, -2, 3, 4], dtype=torch.int32, device=d)}),
    ("cu_num_draft", lambda d: {"cu_num_draft": torch.tensor([0, 4, 3], dtype=torch.int32, device=d)}),
    ("cu_num_draft", lambda d: {"cu_num_draft": torch.tensor([0, 3, 4], dtype=torch.int32, device=d)}),
    ("cu_num_draft", lambda d: {"cu_num_draft": torch.tensor([[0, 3, 5]], dtype=torch.int32, device=d)}),
    (
        "cu_num_draft",
        lambda d: {"cu_num_draft": torch.tensor([0, 3, 5], dtype=torch.int32, device=d), "max_spec_len": 2},
    ),
    ("max_spec_len", lambda d: {"max_spec_len": -1}),
    ("temperature", lambda d: {"temperature": torch.tensor([1.0, -0.5], device=d)}),
    ("temperature", lambda d: {"temperature": torch.tensor([1.0], device=d)}),
    ("temperature", lambda d: {"temperature": torch.tensor([1.0, 1.0], dtype=torch.float64, device=d)}),
    ("seeds", lambda d: {"seeds": torch.tensor([1, 2], dtype=torch.int32, device=d)}),
    ("offsets", lambda d: {"offsets": torch.tensor([1, 2, 3], dtype=torch.int64, device=d)}),
    ("draft_probs", lambda d: {"draft_probs": torch.rand(5, 19, device=d)}),
    ("draft_probs", lambda d: {"draft_probs": torch.rand(5, 20, dtype=torch.float64, device=d)}),
    ("draft_probs", lambda d: {"draft_probs": torch.rand(4, 20, device=d)}),
    (
        "draft_probs_ids",
        lambda d: {
            "draft_probs": torch.rand(5, 4, device=d),
            "draft_probs_ids": torch.randint(0, 20, (5, 3), device=d),
        },
    ),
    (
        "draft_probs_ids",
        lambda d: {
            "draft_probs": torch.rand(5, 4, device=d),
            "draft_probs_ids": torch.full((5, 4), 25, dtype=torch.int32, device=d),
        },
    ),
    (
        "draft_probs_ids",
        lambda d: {
            "draft_probs": torch.rand(5, 4, device=d),
            "draft_probs_ids": torch.tensor([[19, 18, 17, 16]] * 5, dtype=torch.int32, device=d),
        },
    ),
    (
        "draft_probs_ids",
        lambda d: {"draft_probs": None, "draft_probs_ids": torch.zeros((5, 4), dtype=torch.int32, device=d)},
    ),
]


@pytest.mark.parametrize("name,change", BAD_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_CASES)])
def test_bad_inputs_raise_clear_errors(name, change):
    # Value checks need host-visible data; they run on the CPU (CUDA traps in-kernel).
    with pytest.raises(RuntimeError, match=name):
        _call(_bad("cpu", **change("cpu")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bad_device_mix():
    args = _bad("cuda", seeds=torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="seeds"):
        _call(args)


def test_bad_out_buffers():
    logits, tokens, cu, kw = make_case([3, 2], 20, seed=16)
    with pytest.raises(RuntimeError, match="out_tokens"):
        flashspark.verify_out(
            logits,
            tokens,
            cu,
            out_tokens=torch.empty(2, 3, dtype=torch.int32),
            out_num_accepted=torch.empty(2, dtype=torch.int32),
            **kw,
        )
    with pytest.raises(RuntimeError, match="out_num_accepted"):
        flashspark.verify_out(
            logits,
            tokens,
            cu,
            out_tokens=torch.empty(2, 4, dtype=torch.int32),
            out_num_accepted=torch.empty(3, dtype=torch.int32),
            **kw,
        )


def test_overlapping_requests_fail_on_every_backend(device):
    # cu_num_draft = [0, 5, 1, 2, 9]: request 1 decreases (5 -> 1); request 0's rows 0..5 reach
    # into rows 3..4 that request 2's range covers, so rows would be reduced for the wrong request:
    # it fails too. Requests 2 and 3 own all of their rows (3..4 and 5..12) and are verified as
    # if alone, on the CPU and on CUDA alike (both assign rows by the same search).
    logits, _, _, kw = make_case([5, 0, 1, 7], 23, seed=31, device=device)
    logits = logits[:13]  # 9 draft rows + 4 bonus rows
    cu = torch.tensor([0, 5, 1, 2, 9], dtype=torch.int32, device=device)
    tokens = torch.randint(0, 23, (9,), dtype=torch.int32, generator=torch.Generator().manual_seed(2)).to(device)
    kw = dict(kw, max_spec_len=7)
    status = torch.full((4,), -7, dtype=torch.int32, device=device)
    out, acc = flashspark.verify(logits, tokens, cu, status=status, **kw)
    assert status.cpu().tolist() == [1, 1, 0, 0]
    assert (out.cpu()[:2] == -1).all() and acc.cpu()[:2].tolist() == [-1, -1]
    for b, rows, drafts in [(2, slice(3, 5), slice(1, 2)), (3, slice(5, 13), slice(2, 9))]:
        alone = {k: (v[b : b + 1] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        n = drafts.stop - drafts.start
        want = verify_reference(logits[rows], tokens[drafts], torch.tensor([0, n], dtype=torch.int32), **alone)
        assert out.cpu()[b].tolist() == want[0][0].tolist() and int(acc[b]) == int(want[1][0])
