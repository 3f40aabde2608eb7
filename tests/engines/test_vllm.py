"""flashspark.engines.vllm.RejectionSampler against the cases of vLLM's own rejection-sampler
tests, re-expressed with our code, in vLLM's older form (target rows and bonus tokens) and its
newer one (logits with bonus rows, vLLM's sampler for the bonus): greedy matches and mismatches,
empty and single drafts, seeded determinism, placeholders, mixed greedy and random batches, and
convergence to the target distribution."""

from types import SimpleNamespace

import pytest
import torch
from flashspark.engines.vllm import PLACEHOLDER_TOKEN_ID as P
from flashspark.engines.vllm import RejectionSampler, SamplerOutput

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


GREEDY_CASES = [
    ([[1, 2, 3]], [[1, 2, 3, 4]], [[1, 2, 3, 4]]),  # perfect match, bonus 4
    ([[1, 2, 3]], [[1, 5, 3, 4]], [[1, 5, P, P]]),  # early mismatch
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], [[1, 2, 5], [3, 4, P]]),  # several sequences
    ([[1]], [[1, 2]], [[1, 2]]),  # a single draft
    ([[]], [[5]], [[5]]),  # no draft: the bonus alone
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7, 6], [4, 8, 6, 9]], [[1, 2, 7, P], [4, 8, P, P]]),
    ([[1, 2]], [[1, 2, 3]], [[1, 2, 3]]),
    ([[1]], [[2, 3]], [[2, P]]),  # first draft rejected
    ([[1, 2], [3, 4]], [[1, 5, 6], [3, 4, 7]], [[1, 5, P], [3, 4, 7]]),
]


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


@pytest.mark.parametrize("spec_tokens,output_tokens,expected", GREEDY_CASES)
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


# ---- vLLM's newer form: forward(metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput


class BonusSampler:
    """Stands in for vLLM's Sampler, as vLLM's own tests mock it: returns the given bonus tokens
    and records what it was called with."""

    def __init__(self, bonus):
        self.bonus, self.calls = bonus, []

    def __call__(self, logits, sampling_metadata, predict_bonus_token=False):
        self.calls.append((tuple(logits.shape), predict_bonus_token))
        return SimpleNamespace(sampled_token_ids=self.bonus, logprobs_tensors=None)


def newer_metadata(spec_tokens, device, bonus_rows=True):
    """SpecDecodeMetadata with the logits indices: vLLM's layout (each request's draft rows, then
    its bonus row), or, as vLLM's tests mock the sampler, the draft rows alone."""
    md = metadata(spec_tokens, device)
    target, bonus, row = [], [], 0
    for tokens in spec_tokens:
        target += list(range(row, row + len(tokens)))
        row += len(tokens)
        if bonus_rows:
            bonus.append(row)
            row += 1
    md.target_logits_indices = torch.tensor(target, dtype=torch.int32, device=device)
    md.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32, device=device)
    return md


def layout_logits(output_tokens, device):
    """[T + B, V] in vLLM's layout, the argmax of each row the wanted output token."""
    rows = [t for tokens in output_tokens for t in tokens]
    logits = torch.full((len(rows), VOCAB), -100.0, device=device)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 100.0
    return logits


@pytest.mark.parametrize("spec_tokens,output_tokens,expected", GREEDY_CASES)
def test_newer_form_greedy_cases(device, spec_tokens, output_tokens, expected):
    """vLLM's greedy cases in the newer form: the bonus from vLLM's sampler (mocked, the logits
    holding the draft rows alone, as vLLM's tests do), or sampled here from the bonus rows."""
    bonus = torch.tensor([[t[-1]] for t in output_tokens], device=device)
    sampler = BonusSampler(bonus)
    md = newer_metadata(spec_tokens, device, bonus_rows=False)
    out = RejectionSampler(sampler)(md, None, logits=greedy_logits(output_tokens, device), sampling_metadata=sampling())
    assert isinstance(out, SamplerOutput) and out.logprobs_tensors is None
    assert out.sampled_token_ids.dtype == torch.int32 and out.sampled_token_ids.cpu().tolist() == expected
    assert sampler.calls == [((0, VOCAB), True)]
    md = newer_metadata(spec_tokens, device)
    for sampler in (RejectionSampler(), RejectionSampler(check_layout=True)):
        out = sampler(md, None, layout_logits(output_tokens, device), sampling())  # positional
        assert out.sampled_token_ids.cpu().tolist() == expected


def test_newer_form_greedy_at_temperature_zero(device):
    """Newer vLLM marks greedy requests with temperature 0 (older with -1): both are greedy."""
    spec, outputs = [[1, 2], [3, 9]], [[1, 2, 5], [3, 4, 7]]
    temp = torch.tensor([0.0, -1.0], device=device)
    out = RejectionSampler()(newer_metadata(spec, device), None, layout_logits(outputs, device), sampling(False, temp))
    assert out.sampled_token_ids.cpu().tolist() == [[1, 2, 5], [3, 4, P]]


def test_newer_form_mixed_greedy_and_random_batch(device):
    spec, outputs = [[1, 2], [3, 9], [7]], [[1, 2, 5], [3, 4, 7], [7, 8]]
    temp = torch.tensor([0.0, 1.0, 0.0], device=device)  # peaked rows: sampling agrees with the argmax
    out = RejectionSampler()(newer_metadata(spec, device), None, layout_logits(outputs, device), sampling(False, temp))
    assert out.sampled_token_ids.cpu().tolist() == [[1, 2, 5], [3, 4, P], [7, 8, P]]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_newer_form_deterministic_when_seeded(device, k, batch):
    q, logits, drafts, _ = random_case(batch, k, 1000, device)
    logits = torch.cat([logits.view(batch, k, -1), torch.rand(batch, 1, 1000, device=device)], 1).view(-1, 1000)
    seeded = [i for i in range(batch) if i % 2 == 0]
    results = []
    for _ in range(6):
        gens = {i: torch.Generator(device=device).manual_seed(i) for i in seeded}
        temp = torch.ones(batch, device=device)
        out = RejectionSampler()(newer_metadata(drafts, device), q, logits, sampling(False, temp, gens))
        results.append(out.sampled_token_ids)
    for i in seeded:
        assert all(torch.equal(r[i], results[0][i]) for r in results)


def test_newer_form_approximates_target_distribution(device):
    """As in newer vLLM: with k = 2 drafts from q, the emitted draft-position tokens follow p; the
    distance to p shrinks 20 times faster than the distance to random distributions, sample
    sizes 10 to 100000. The bonus rows hold p too, sampled here."""
    vocab, k = 10, 2
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.rand(vocab, generator=g), -1)
    target = torch.rand(vocab, generator=g)
    p = torch.softmax(target, -1)
    references = torch.softmax(torch.rand(100, vocab, generator=g), -1)
    to_target, to_reference = [], []
    for n in [10, 100, 1000, 10_000, 100_000]:
        drafts = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k)
        gens = {i: torch.Generator(device=device).manual_seed(i) for i in range(min(n, 4))}
        out = (
            RejectionSampler()(
                newer_metadata(drafts.tolist(), device),
                q.repeat(n * k, 1).to(device),
                target.repeat(n * (k + 1), 1).to(device),
                sampling(False, torch.ones(n, device=device), gens),
            )
            .sampled_token_ids[:, :-1]
            .flatten()
            .cpu()
        )
        est = torch.bincount(out[out >= 0].long(), minlength=vocab).double()
        est /= est.sum()
        to_target.append(torch.dist(p.double(), est).item())
        to_reference.append(torch.dist(references.double(), est).item() / references.shape[0])
    assert to_target[0] / to_target[-1] > 20 * (to_reference[0] / to_reference[-1])


def test_newer_form_placeholder_rejected(device):
    md = newer_metadata([[1, P, 3]], device)
    logits = layout_logits([[1, 2, 3, 4]], device)
    for samp in (sampling(), sampling(False, torch.ones(1, device=device))):
        out = RejectionSampler()(md, None, logits, samp).sampled_token_ids.cpu()
        assert out.tolist() == [[1, 2, P, P]]


def test_newer_form_bad_inputs(device):
    spec = [[1, 2], [3]]
    md = newer_metadata(spec, device)
    logits = layout_logits([[1, 2, 5], [3, 4]], device)
    with pytest.raises(ValueError, match="must be \\[T \\+ B \\(target and bonus rows\\), V\\] = \\[5, V\\]"):
        RejectionSampler()(md, None, logits[:3], sampling())
    with pytest.raises(ValueError, match="logprobs are not returned"):
        RejectionSampler()(md, None, logits, SimpleNamespace(all_greedy=True, temperature=None, max_num_logprobs=0))
    shuffled = newer_metadata(spec, device)
    shuffled.bonus_logits_indices = torch.tensor([0, 3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="not in vLLM's layout"):
        RejectionSampler(check_layout=True)(shuffled, None, logits, sampling())
    with pytest.raises(TypeError, match="either logits"):
        RejectionSampler()(md, None, logits, logits=logits, sampling_metadata=sampling())
    with pytest.raises(TypeError, match="call forward"):
        RejectionSampler()(md, None, logits)
    with pytest.raises(TypeError, match="sampler must be"):
        RejectionSampler(sampler=3)
    with pytest.raises(ValueError, match="must be \\[T, V\\] = \\[3, V\\]"):  # older form, bonus rows left in
        RejectionSampler()(md, None, logits, torch.tensor([[5], [4]], device=device), sampling())
