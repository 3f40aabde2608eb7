"""flashspark.engines.flashinfer.chain_speculative_sampling against the cases of FlashInfer's own
tests and docs, re-expressed with our code: the documented example, one-hot targets reproduced
exactly and the validity of random chains at test_chain_speculative_sampling's sizes, counters
added in place, per-position independent acceptance counts, seeded determinism, convergence to
the target distribution, vocabulary boundaries, placeholders and bad input."""

import math

import pytest
import torch
from flashspark.engines.flashinfer import REQUEST_STRIDE, accept_tests, chain_speculative_sampling, request_streams

# FlashInfer's own sizes; past SLOW_ELEMENTS elements (B * (n + 1) * V) a case is marked slow,
# past CPU_ELEMENTS it needs GBs of host memory, so the CPU runs the smaller ones, the GPU all
BATCHES, VOCABS, NUM_SPEC = [1, 99, 989], [111, 32000, 128256], [1, 3, 5, 7]
SLOW_ELEMENTS = 2_000_000
CPU_ELEMENTS = 300_000_000


def normalized(shape, g, device, dtype=torch.float32):
    x = torch.rand(shape, generator=g)
    return (x / x.sum(dim=-1, keepdim=True)).to(device=device, dtype=dtype)


def _peer_sizes():
    for b in BATCHES:
        for v in VOCABS:
            for n in NUM_SPEC:
                marks = [pytest.mark.slow] if b * (n + 1) * v > SLOW_ELEMENTS else []
                yield pytest.param(b, v, n, marks=marks, id=f"B{b}-V{v}-n{n}")


PEER_SIZES = list(_peer_sizes())


def trials_on(device, batch, vocab, n) -> int:
    """FlashInfer's 10 trials; on the CPU a large case runs 3 (each resamples B rows of V), and
    one past CPU_ELEMENTS is left to the GPU."""
    elements = batch * (n + 1) * vocab
    if device.type == "cpu" and elements > CPU_ELEMENTS:
        pytest.skip("needs several GB of host memory; runs on the GPU")
    return 3 if device.type == "cpu" and elements > SLOW_ELEMENTS else 10


def test_documented_example(device):
    """FlashInfer's docstring example: draft 2 passes (p = 0.6 > q = 0.3), draft 1 has p = 0 and
    is rejected, the correction is drawn from max(p - q, 0) = [0.8, 0, 0, 0]."""
    draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], device=device)
    draft_ids = torch.tensor([[2, 1]], dtype=torch.int32, device=device)
    target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], device=device)
    for seed in range(5):
        ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, seed=seed, offset=0)
        assert ids.dtype == torch.int32 and ids.cpu().tolist() == [[2, 0, -1]]
        assert accepted.dtype == torch.int32 and accepted.cpu().tolist() == [1]
        assert emitted.dtype == torch.int32 and emitted.cpu().tolist() == [1]


@pytest.mark.parametrize("batch,vocab,n", PEER_SIZES)
def test_onehot_target_is_reproduced(device, batch, vocab, n):
    """As test_chain_speculative_sampling(onehot_target=True): a target one-hot at each draft
    (then at a random bonus id) accepts every draft and emits exactly the target's ids."""
    trials = trials_on(device, batch, vocab, n)
    g = torch.Generator().manual_seed(batch * 1000 + n)
    draft_probs = normalized((batch, n, vocab), g, device)
    draft_ids = torch.randint(vocab, (batch, n), generator=g).to(device)
    target_ids = torch.randint(vocab, (batch, n + 1), generator=g).to(device)
    target_ids[:, :n] = draft_ids
    target_probs = torch.zeros(batch, n + 1, vocab, device=device).scatter_(2, target_ids.unsqueeze(-1), 1.0)
    for _ in range(trials):
        accepted = torch.zeros(batch, dtype=torch.int32, device=device)
        emitted = torch.zeros(batch, dtype=torch.int32, device=device)
        ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, accepted, emitted)
        assert torch.equal(ids, target_ids.int())
        assert (emitted == n).all() and (accepted == n).all()


@pytest.mark.parametrize("batch,vocab,n", PEER_SIZES)
def test_random_chains_are_valid(device, batch, vocab, n):
    """As test_chain_speculative_sampling(onehot_target=False): ids in [0, V), the drafts kept up to
    the first mismatch, -1 after it, emitted + 1 tokens per request; and, ours, accepted counts
    at least the emitted drafts and at most n."""
    trials = trials_on(device, batch, vocab, n)
    g = torch.Generator().manual_seed(batch * 1000 + n + 1)
    draft_probs = normalized((batch, n, vocab), g, device)
    draft_ids = torch.randint(vocab, (batch, n), generator=g).to(device)
    target_probs = normalized((batch, n + 1, vocab), g, device)
    for _ in range(trials):
        accepted = torch.zeros(batch, dtype=torch.int32, device=device)
        emitted = torch.zeros(batch, dtype=torch.int32, device=device)
        ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, accepted, emitted)
        assert ids.shape == (batch, n + 1) and ids.dtype == torch.int32
        assert (ids[ids >= 0] < vocab).all()
        kept = ids[:, :n] == draft_ids
        first_miss = torch.where(kept.all(dim=1), n, (~kept).int().argmax(dim=1))
        assert torch.equal(first_miss, emitted.long())
        j = torch.arange(n + 1, device=device)
        assert ((ids >= 0) == (j <= emitted.unsqueeze(1))).all()  # -1 exactly after the emitted tokens
        assert torch.equal(emitted + 1, (ids != -1).sum(dim=1).int())
        assert (accepted >= emitted).all() and (accepted <= n).all()


def test_counters_are_added_in_place(device):
    draft_probs = torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]] * 2, device=device)
    draft_ids = torch.tensor([[2, 1]] * 2, device=device)
    target_probs = torch.tensor([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]] * 2, device=device)
    for dtype in (torch.int32, torch.int64):
        accepted = torch.tensor([5, 7], dtype=dtype, device=device)
        emitted = torch.tensor([10, 0], dtype=dtype, device=device)
        _, acc_out, emit_out = chain_speculative_sampling(draft_probs, draft_ids, target_probs, accepted, emitted)
        assert acc_out is accepted and emit_out is emitted
        assert accepted.cpu().tolist() == [6, 8] and emitted.cpu().tolist() == [11, 1]
        chain_speculative_sampling(draft_probs, draft_ids, target_probs, accepted, emitted)
        assert accepted.cpu().tolist() == [7, 9] and emitted.cpu().tolist() == [12, 2]


def test_accepted_counts_every_position_independently(device):
    """The first draft has p = 0 and is always rejected; the later ones have p = 1 and would
    always pass: nothing is emitted but the correction, yet accepted counts n - 1."""
    n, vocab = 4, 6
    draft_ids = torch.tensor([[1, 2, 3, 4]], device=device)
    draft_probs = torch.full((1, n, vocab), 1.0 / vocab, device=device)
    target_probs = torch.zeros(1, n + 1, vocab, device=device)
    target_probs[0, 0, 5] = 1.0  # no mass on draft 1: rejected, correction 5
    for k in range(1, n):
        target_probs[0, k, int(draft_ids[0, k])] = 1.0
    target_probs[0, n, 0] = 1.0
    ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, seed=3, offset=0)
    assert ids.cpu().tolist() == [[5, -1, -1, -1, -1]]
    assert accepted.cpu().tolist() == [n - 1] and emitted.cpu().tolist() == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_accept_tests_agree_with_the_kernel(device, dtype):
    """The counter's tests use the kernel's uniforms: every position before the first rejection
    passes and the first rejected one fails, in every dtype."""
    batch, n, vocab = 64, 5, 50
    g = torch.Generator().manual_seed(1)
    # draft and target close, so that rejections fall at every position
    draft_probs = normalized((batch, n, vocab), g, device, dtype)
    target_probs = normalized((batch, n + 1, vocab), g, device, dtype)
    draft_ids = (
        torch.multinomial(draft_probs.float().reshape(-1, vocab).cpu(), 1, generator=g).view(batch, n).to(device)
    )
    for seed, offset in [(0, 0), (2**63 + 5, 2**40), (-7, -(2**62))]:
        ids, accepted, emitted = chain_speculative_sampling(
            draft_probs, draft_ids, target_probs, seed=seed, offset=offset
        )
        seeds, offsets = request_streams(seed, offset, None, batch, device)
        passes = accept_tests(draft_probs, draft_ids, target_probs, seeds, offsets).cpu()
        emitted = emitted.cpu()
        for b in range(batch):
            e = int(emitted[b])
            assert passes[b, :e].all()
            assert e == n or not passes[b, e]
        assert torch.equal(accepted.cpu(), passes.sum(dim=1).int())
        assert 0 < int(emitted.sum()) < batch * n  # rejections happen, and not only at position 0


def test_seed_offset_and_generator_determinism(device):
    batch, n, vocab = 16, 4, 30
    g = torch.Generator().manual_seed(2)
    draft_probs = normalized((batch, n, vocab), g, device)
    draft_ids = torch.randint(vocab, (batch, n), generator=g).to(device)
    target_probs = normalized((batch, n + 1, vocab), g, device)

    def run(**kw):
        return chain_speculative_sampling(draft_probs, draft_ids, target_probs, **kw)

    first = run(seed=11, offset=100)
    assert all(torch.equal(a, b) for a, b in zip(first, run(seed=11, offset=100)))
    # tensors of length 1 or B, int64 or uint64 (FlashInfer's forms), give the same streams
    for s, o in [
        (torch.tensor([11], device=device), torch.tensor([100], device=device)),
        (torch.full((batch,), 11, device=device), torch.full((batch,), 100, device=device)),
        (torch.tensor([11], dtype=torch.uint64, device=device), torch.tensor([100], dtype=torch.uint64, device=device)),
    ]:
        assert all(torch.equal(a, b) for a, b in zip(first, run(seed=s, offset=o)))
    assert not torch.equal(first[0], run(seed=11, offset=100 + n + 1)[0])  # the next call's draws
    assert not torch.equal(first[0], run(seed=12, offset=100)[0])
    # a generator: reproducible from its seed, and advanced by a call
    for gen_device in {torch.device("cpu"), device}:
        a = run(generator=torch.Generator(device=gen_device).manual_seed(5))
        b = run(generator=torch.Generator(device=gen_device).manual_seed(5))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        gen = torch.Generator(device=gen_device).manual_seed(5)
        run(generator=gen)
        assert not torch.equal(a[0], run(generator=gen)[0])
    run()  # torch's default generator


def test_each_request_has_its_own_stream(device):
    seeds, offsets = request_streams(9, 40, None, 3, device)
    assert seeds.cpu().tolist() == [9, 9, 9]
    assert offsets.cpu().tolist() == [40, 40 + REQUEST_STRIDE, 40 + 2 * REQUEST_STRIDE]
    seeds, offsets = request_streams(
        torch.tensor([1, 2, 3], device=device), torch.tensor([0, 0, 5], device=device), None, 3, device
    )
    assert seeds.cpu().tolist() == [1, 2, 3] and offsets.cpu().tolist() == [0, REQUEST_STRIDE, 5 + 2 * REQUEST_STRIDE]
    # equal rows in one call draw differently: identical requests do not emit in lockstep
    vocab = 1000
    draft_probs = torch.zeros(64, 1, vocab, device=device)
    draft_probs[..., 0] = 1.0
    target_probs = torch.full((64, 2, vocab), 1.0 / (vocab - 1), device=device)
    target_probs[:, 0, 0] = 0.0  # draft 0 always rejected: each request samples a uniform correction
    ids, _, _ = chain_speculative_sampling(
        draft_probs, torch.zeros(64, 1, dtype=torch.int64, device=device), target_probs, seed=0, offset=0
    )
    assert ids[:, 0].unique().numel() > 32


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


def lossless_case(batch, device, shift=False):
    """batch identical requests, n = 2, V = 10; returns the first emitted token's counts, the
    mean counters and the case's p, q (shift: the target rows read one position late, a bug)."""
    vocab, n = 10, 2
    g = torch.Generator().manual_seed(4)
    q = torch.softmax(torch.rand(vocab, generator=g) * 2, -1)
    p_rows = torch.softmax(torch.rand(n + 1, vocab, generator=g) * 2, -1)
    draft_ids = torch.multinomial(q, batch * n, replacement=True, generator=g).view(batch, n).to(device)
    target = p_rows.roll(-1, dims=0) if shift else p_rows
    ids, accepted, emitted = chain_speculative_sampling(
        q.expand(batch, n, vocab).to(device),
        draft_ids,
        target.expand(batch, n + 1, vocab).to(device),
        seed=123,
        offset=0,
    )
    counts = torch.bincount(ids[:, 0].long().cpu(), minlength=vocab)
    return counts, accepted.double().mean().item(), emitted.double().mean().item(), p_rows, q


def test_statistically_lossless(device):
    """The first emitted token follows p (chi-square, 9 degrees of freedom, p-value 1e-4 bound
    33.7); the mean counters match their expectations: accepted n * alpha_k summed over positions,
    emitted alpha_0 + alpha_0 * alpha_1, with alpha_k = sum min(p_k, q)."""
    batch = 40_000
    counts, acc_mean, emit_mean, p_rows, q = lossless_case(batch, device)
    assert chi_square(counts, p_rows[0]) < 33.7
    alpha = torch.minimum(p_rows[:2], q).sum(dim=1).double()
    acc_sd = math.sqrt(float((alpha * (1 - alpha)).sum()) / batch)
    assert abs(acc_mean - float(alpha.sum())) < 5 * acc_sd
    assert abs(emit_mean - float(alpha[0] + alpha[0] * alpha[1])) < 5 * 2 / math.sqrt(batch)


def test_statistic_rejects_a_planted_bug(device):
    """The same statistic fails when the target rows are read one position late."""
    counts, _, _, p_rows, _ = lossless_case(40_000, device, shift=True)
    assert chi_square(counts, p_rows[0]) > 33.7


def test_converges_to_the_target_distribution(device):
    """vLLM's convergence check through this API: the emitted tokens' distance to p falls much
    faster with the sample size than their distance to random distributions."""
    vocab, n = 10, 2
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.rand(vocab, generator=g), -1)
    p = torch.softmax(torch.rand(vocab, generator=g), -1)
    references = torch.softmax(torch.rand(100, vocab, generator=g), -1)
    to_target, to_reference = [], []
    for size in [10, 100, 1000, 10_000, 100_000]:
        draft_ids = torch.multinomial(q, size * n, replacement=True, generator=g).view(size, n).to(device)
        ids, _, _ = chain_speculative_sampling(
            q.expand(size, n, vocab).to(device), draft_ids, p.expand(size, n + 1, vocab).to(device), seed=size, offset=0
        )
        drafts = ids[:, :n].flatten().cpu()
        est = torch.bincount(drafts[drafts >= 0].long(), minlength=vocab).double()
        est /= est.sum()
        to_target.append(torch.dist(p.double(), est).item())
        to_reference.append(torch.dist(references.double(), est).item() / references.shape[0])
    assert to_target[0] / to_target[-1] > 20 * (to_reference[0] / to_reference[-1])


@pytest.mark.parametrize("vocab", [1, 2, 257])
def test_vocabulary_boundaries(device, vocab):
    """The last id V - 1 is accepted and emitted as the bonus; V = 1 emits token 0 throughout."""
    n = 3
    last = vocab - 1
    draft_ids = torch.full((2, n), last, dtype=torch.int64, device=device)
    draft_probs = torch.zeros(2, n, vocab, device=device)
    draft_probs[..., last] = 1.0
    target_probs = torch.zeros(2, n + 1, vocab, device=device)
    target_probs[..., last] = 1.0
    ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, seed=1, offset=0)
    assert ids.cpu().tolist() == [[last] * (n + 1)] * 2
    assert accepted.cpu().tolist() == [n, n] and emitted.cpu().tolist() == [n, n]


def test_no_draft_tokens_emit_the_bonus(device):
    target_probs = torch.zeros(3, 1, 8, device=device)
    target_probs[torch.arange(3), 0, torch.tensor([7, 0, 4])] = 1.0
    ids, accepted, emitted = chain_speculative_sampling(
        torch.zeros(3, 0, 8, device=device), torch.zeros(3, 0, dtype=torch.int32, device=device), target_probs
    )
    assert ids.cpu().tolist() == [[7], [0], [4]]
    assert accepted.cpu().tolist() == [0, 0, 0] and emitted.cpu().tolist() == [0, 0, 0]


def test_empty_batch(device):
    ids, accepted, emitted = chain_speculative_sampling(
        torch.zeros(0, 2, 5, device=device), torch.zeros(0, 2, dtype=torch.int32, device=device),
        torch.zeros(0, 3, 5, device=device),
    )  # fmt: skip
    assert ids.shape == (0, 3) and accepted.shape == (0,) and emitted.shape == (0,)


def test_placeholder_draft_is_rejected(device):
    """vLLM's placeholder -1 (not a FlashInfer notion) is rejected where it stands: the token
    there is drawn from max(p - q, 0), and the accept counter does not count it."""
    vocab = 6
    draft_ids = torch.tensor([[2, -1, 4]], device=device)
    draft_probs = torch.full((1, 3, vocab), 1.0 / vocab, device=device)
    target_probs = torch.zeros(1, 4, vocab, device=device)
    target_probs[0, 0, 2] = 1.0
    target_probs[0, 1, 3] = 1.0
    target_probs[0, 2, 4] = 1.0
    target_probs[0, 3, 0] = 1.0
    ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, seed=0, offset=0)
    assert ids.cpu().tolist() == [[2, 3, -1, -1]]
    assert accepted.cpu().tolist() == [2] and emitted.cpu().tolist() == [1]


@pytest.mark.parametrize("target_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_half_precision_probabilities(device, target_dtype, draft_dtype):
    """FlashInfer casts to fp32; here fp32, bf16 and fp16 are read as they are."""
    batch, n, vocab = 8, 3, 40
    g = torch.Generator().manual_seed(6)
    draft_ids = torch.randint(vocab, (batch, n), generator=g).to(device)
    target_ids = torch.cat([draft_ids, torch.randint(vocab, (batch, 1), generator=g).to(device)], dim=1)
    target_probs = torch.zeros(batch, n + 1, vocab, device=device, dtype=target_dtype)
    target_probs.scatter_(2, target_ids.unsqueeze(-1), 1.0)
    draft_probs = normalized((batch, n, vocab), g, device, draft_dtype)
    ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs)
    assert torch.equal(ids, target_ids.int()) and (accepted == n).all() and (emitted == n).all()


def test_bad_values_fail_their_request_with_status(device):
    """A p outside [0, 1] fails its request alone: with `status` the row is -1 and both counters
    add 0 (on the CPU without status the call raises)."""
    batch, n, vocab = 3, 2, 5
    draft_probs = torch.full((batch, n, vocab), 0.2, device=device)
    draft_ids = torch.ones(batch, n, dtype=torch.int64, device=device)
    target_probs = torch.zeros(batch, n + 1, vocab, device=device)
    target_probs[..., 1] = 1.0
    target_probs[1, 0, 1] = 1.5
    status = torch.zeros(batch, dtype=torch.int32, device=device)
    ids, accepted, emitted = chain_speculative_sampling(draft_probs, draft_ids, target_probs, status=status)
    assert status.cpu().tolist() == [0, 18, 0]
    assert ids.cpu().tolist() == [[1, 1, 1], [-1, -1, -1], [1, 1, 1]]
    assert accepted.cpu().tolist() == [2, 0, 2] and emitted.cpu().tolist() == [2, 0, 2]
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="NaN or outside"):
            chain_speculative_sampling(draft_probs, draft_ids, target_probs)
        with pytest.raises(RuntimeError, match="outside"):
            chain_speculative_sampling(draft_probs, draft_ids + vocab, target_probs.clamp(max=1))


def bad_call(case: str, device):
    """(args, kwargs) of the bad call named by the message it must raise."""
    dp = torch.full((2, 3, 5), 0.2, device=device)
    ids = torch.zeros(2, 3, dtype=torch.int64, device=device)
    tp = torch.full((2, 4, 5), 0.2, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return {
        "draft_probs must be \\[B, n, V\\]": ((dp[0], ids, tp), {}),
        "draft_token_ids must be \\[B, n\\]": ((dp, ids[:, :2], tp), {}),
        "target_probs must be \\[B, n \\+ 1, V\\] = \\(2, 4, 5\\), got \\(2, 3, 5\\)": ((dp, ids, tp[:, :3]), {}),
        "target_probs must be \\[B, n \\+ 1, V\\] = \\(2, 4, 5\\), got \\(2, 4, 4\\)": ((dp, ids, tp[..., :4]), {}),
        "vocabulary is empty": ((dp[..., :0], ids, tp[..., :0]), {}),
        "draft_probs must be float32": ((dp.double(), ids, tp), {}),
        "draft_token_ids must be int32 or int64": ((dp, ids.float(), tp), {}),
        "draft_probs must be a tensor": ((dp.tolist(), ids, tp), {}),
        "draft_probs is on meta": ((dp.to("meta"), ids, tp), {}),
        "maybe_output_accepted_token_num must be \\[B\\]": ((dp, ids, tp, torch.zeros(3, **i32)), {}),
        "maybe_output_emitted_draft_token_num must be int32": ((dp, ids, tp, None, torch.zeros(2, device=device)), {}),
        "seed and offset must be given together": ((dp, ids, tp), {"seed": 1}),
        "seed and offset must both be tensors": ((dp, ids, tp), {"seed": 1, "offset": torch.zeros(1, **i64)}),
        "seed tensor must be int64/uint64": (
            (dp, ids, tp),
            {"seed": torch.zeros(1, **i32), "offset": torch.zeros(1, **i32)},
        ),
        "offset tensor must be 1D of length 1 or 2": (
            (dp, ids, tp),
            {"seed": torch.zeros(1, **i64), "offset": torch.zeros(3, **i64)},
        ),
        "seed tensor must be on .*, got meta": (
            (dp, ids, tp),
            {"seed": torch.zeros(1, **i64).to("meta"), "offset": torch.zeros(1, **i64)},
        ),
        "seed must be an int": ((dp, ids, tp), {"seed": 1.5, "offset": 0}),
        "does not fit in 64 bits": ((dp, ids, tp), {"seed": 2**64, "offset": 0}),
        "generator must be a torch.Generator": ((dp, ids, tp), {"generator": 3}),
        "deterministic must be a bool": ((dp, ids, tp), {"deterministic": "yes"}),
    }[case]


BAD_CASES = [
    "draft_probs must be \\[B, n, V\\]",
    "draft_token_ids must be \\[B, n\\]",
    "target_probs must be \\[B, n \\+ 1, V\\] = \\(2, 4, 5\\), got \\(2, 3, 5\\)",
    "target_probs must be \\[B, n \\+ 1, V\\] = \\(2, 4, 5\\), got \\(2, 4, 4\\)",
    "vocabulary is empty",
    "draft_probs must be float32",
    "draft_token_ids must be int32 or int64",
    "draft_probs must be a tensor",
    "draft_probs is on meta",
    "maybe_output_accepted_token_num must be \\[B\\]",
    "maybe_output_emitted_draft_token_num must be int32",
    "seed and offset must be given together",
    "seed and offset must both be tensors",
    "seed tensor must be int64/uint64",
    "offset tensor must be 1D of length 1 or 2",
    "seed tensor must be on .*, got meta",
    "seed must be an int",
    "does not fit in 64 bits",
    "generator must be a torch.Generator",
    "deterministic must be a bool",
]


@pytest.mark.parametrize("message", BAD_CASES)
def test_bad_inputs_raise_clear_errors(device, message):
    args, kwargs = bad_call(message, device)
    with pytest.raises((ValueError, TypeError), match=message):
        chain_speculative_sampling(*args, **kwargs)
