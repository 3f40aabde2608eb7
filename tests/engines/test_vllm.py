"""flashspark.engines.vllm.RejectionSampler against the cases of vLLM's own rejection-sampler
tests, re-expressed with our code: greedy matches and mismatches, empty and single drafts,
seeded determinism, placeholders, mixed greedy and random batches, and convergence to the
target distribution."""

from types import SimpleNamespace

import pytest
import torch
from flashspark.engines.vllm import PLACEHOLDER_TOKEN_ID as P
from flashspark.engines.vllm import RejectionSampler

VOCAB = 100


def metadata(spec_tokens, device="cpu"):
    """vLLM's SpecDecodeMetadata fields the sampler reads, for these draft tokens per request."""
    counts = [len(t) for t in spec_tokens]
    flat = [x for t in spec_tokens for x in t]
    return SimpleNamespace(
        draft_token_ids=torch.tensor(flat, dtype=torch.int32, device=device),
        num_draft_tokens=counts,
        cu_num_draft_tokens=torch.tensor(counts, dtype=torch.int32, device=device).cumsum(0).to(torch.int32),
        max_spec_len=max(counts) if counts else 0,
    )


def greedy_logits(output_tokens, device="cpu"):
    """Target rows at the draft positions whose argmax is each output token but the last (the
    last is the bonus, which vLLM samples itself)."""
    rows = [t for tokens in output_tokens for t in tokens[:-1]]
    logits = torch.full((len(rows), VOCAB), -100.0, device=device)
    for r, t in enumerate(rows):
        logits[r, t] = 100.0
    return logits


def sampling(all_greedy=True, temperature=None, generators=None):
    return SimpleNamespace(all_greedy=all_greedy, temperature=temperature, generators=generators or {})


def run_greedy(spec_tokens, output_tokens, device):
    bonus = torch.tensor([[t[-1]] for t in output_tokens], dtype=torch.int64, device=device)
    return RejectionSampler()(
        metadata(spec_tokens, device), None, greedy_logits(output_tokens, device), bonus, sampling()
    )


@pytest.mark.parametrize(
    "spec_tokens,output_tokens,expected",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # perfect match, bonus 4
        ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, P, P]]),  # early mismatch
        ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, P]]),  # several sequences
        ([[1]], [[1, 2]], [[1, 2]]),  # a single draft
        ([[]], [[5]], [[5]]),  # no draft: the bonus alone
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, P], [4, 8, P, P]]),
        ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
        ([[1]], [[2, 3]], [[2, P]]),  # first draft rejected
        ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, P], [3, 4, 7]]),
    ],
)
def test_greedy_cases(device, spec_tokens, output_tokens, expected):
    out = run_greedy(spec_tokens, output_tokens, device)
    assert out.dtype == torch.int32
    assert out.cpu().tolist() == expected


def test_greedy_by_temperature_minus_one(device):
    """vLLM marks greedy requests with temperature -1 inside a random batch."""
    spec, outputs = [[1, 2], [3, 9]], [[1, 2, 5], [3, 4, 7]]
    bonus = torch.tensor([[5], [7]], device=device)
    logits = greedy_logits(outputs, device)
    temp = torch.tensor([-1.0, -1.0], device=device)
    out = RejectionSampler()(metadata(spec, device), None, logits, bonus, sampling(False, temp))
    assert out.cpu().tolist() == [[1, 2, 5], [3, 4, P]]


def random_case(batch, k, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(torch.rand(batch * k, vocab, generator=g), dim=-1)
    target_logits = torch.rand(batch * k, vocab, generator=g)
    drafts = torch.randint(0, vocab, (batch, k), generator=g)
    bonus = torch.randint(0, vocab, (batch, 1), generator=g)
    return draft_probs.to(device), target_logits.to(device), drafts.tolist(), bonus.to(device)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_deterministic_when_seeded(device, k, batch):
    q, logits, drafts, bonus = random_case(batch, k, 1000, device)
    seeded = [i for i in range(batch) if i % 2 == 0]
    results = []
    for _ in range(6):
        gens = {i: torch.Generator(device=device).manual_seed(i) for i in seeded}
        temp = torch.ones(batch, device=device)
        results.append(RejectionSampler()(metadata(drafts, device), q, logits, bonus, sampling(False, temp, gens)))
    for i in seeded:
        assert all(torch.equal(r[i], results[0][i]) for r in results)
    assert all(r.shape == (batch, k + 1) for r in results)


def test_placeholder_draft_token_rejected(device):
    """A placeholder draft (-1) is rejected where it stands: the request emits the token
    sampled there and nothing after it, greedy or random."""
    logits = greedy_logits([[1, 2, 3, 4]], device)
    bonus = torch.tensor([[4]], device=device)
    for samp in (sampling(), sampling(False, torch.ones(1, device=device))):
        out = RejectionSampler()(metadata([[1, P, 3]], device), None, logits, bonus, samp).cpu()
        assert out[0, 0] == 1 and out[0, 1] == 2 and (out[0, 2:] == P).all()


def test_mixed_greedy_and_random_batch(device):
    spec, outputs = [[1, 2], [3, 9], [7]], [[1, 2, 5], [3, 4, 7], [7, 8]]
    logits = greedy_logits(outputs, device)  # peaked: sampling at T = 1 agrees with the argmax
    bonus = torch.tensor([[5], [7], [8]], device=device)
    temp = torch.tensor([-1.0, 1.0, -1.0], device=device)
    out = RejectionSampler()(metadata(spec, device), None, logits, bonus, sampling(False, temp))
    assert out.cpu().tolist() == [[1, 2, 5], [3, 4, P], [7, 8, P]]


def test_rejection_sampling_approximates_target_distribution(device):
    """As in vLLM: with k = 2 drafts from q, the first emitted token follows p; its distance to
    p shrinks with the sample size much faster than its distance to random distributions."""
    vocab, k = 10, 2
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.rand(vocab, generator=g), -1)
    target = torch.rand(vocab, generator=g)
    p = torch.softmax(target, -1)
    references = torch.softmax(torch.rand(100, vocab, generator=g), -1)
    to_target, to_reference = [], []
    for n in [100, 1000, 10_000, 100_000]:
        drafts = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
        out = RejectionSampler()(
            metadata(drafts.tolist(), device),
            q.repeat(n * k, 1).to(device),
            target.repeat(n * k, 1).to(device),
            torch.zeros(n, 1, dtype=torch.int64, device=device),
            sampling(False, torch.ones(n, device=device)),
        ).cpu()
        est = torch.bincount(out[:, 0].long(), minlength=vocab).double() / n
        to_target.append(torch.dist(p.double(), est).item())
        to_reference.append(torch.dist(references.double(), est).item() / references.shape[0])
    assert to_target[-1] < 0.01
    assert to_target[0] / to_target[-1] > 10 * (to_reference[0] / to_reference[-1])


def test_bad_generators_raise(device):
    q, logits, drafts, bonus = random_case(2, 2, 50, device)
    gens = {5: torch.Generator(device=device).manual_seed(0)}
    with pytest.raises(ValueError, match="names request 5, outside the batch of 2"):
        RejectionSampler()(metadata(drafts, device), q, logits, bonus, sampling(False, torch.ones(2), gens))
