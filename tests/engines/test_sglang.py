"""flashspark.engines.sglang.tree_speculative_sampling_target_only against the cases of
sgl-kernel's own tests, re-expressed with our code on chains: the peaked-target case (its
accepted paths as chains), the spec-step bound, the linear-chain smoke sizes, one-hot targets
accepting every draft, seeded determinism, convergence to the target distribution, mixed greedy
and random batches, vocabulary boundaries, outputs in place, and the trees and thresholds we
refuse with a clear error."""

import pytest
import torch
import torch.nn.functional as F
from flashspark.engines.sglang import chain_lengths, tree_speculative_sampling_target_only

VOCAB = 20


def chain(bs, slots, device, length=None):
    """retrive_index, retrive_next_token, retrive_next_sibling of bs chains in slot order; a
    chain of `length` < slots ends there (its next_token -1)."""
    index = (torch.arange(bs * slots, device=device)).view(bs, slots)
    nxt = torch.arange(1, slots + 1, device=device).repeat(bs, 1)
    lengths = length if length is not None else [slots] * bs
    for b, n in enumerate(lengths):
        nxt[b, n - 1 :] = -1
    return index, nxt, torch.full((bs, slots), -1, device=device)


def peaked(peaks, bs, slots, device, vocab=VOCAB):
    """SGLang's test target: logits 10 at each (request, slot)'s peak token, else at token 18,
    softmax at temperature 0.01 (one-hot in fp32)."""
    logits = torch.zeros(bs, slots, vocab, device=device)
    logits[..., 18 % vocab] = 10.0
    for (b, j), t in peaks.items():
        logits[b, j] = 0.0
        logits[b, j, t] = 10.0
    return F.softmax(logits / 0.01, dim=-1)


def outputs(bs, slots, steps, device):
    return (
        torch.full((bs * slots,), -1, dtype=torch.int32, device=device),
        torch.full((bs, steps), -1, dtype=torch.int32, device=device),
        torch.zeros(bs, dtype=torch.int32, device=device),
    )


def run(candidates, tree, target_probs, steps, device, coins_seed=0, **kw):
    bs, slots = candidates.shape
    predicts, accept_index, accept_num = outputs(bs, slots, steps, device)
    g = torch.Generator().manual_seed(coins_seed)
    tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_num,
        candidates,
        *tree,
        torch.rand(bs, slots, generator=g).to(device),
        torch.rand(bs, generator=g).to(device),
        target_probs,
        **kw,
    )
    return predicts.cpu().tolist(), accept_index.cpu().tolist(), accept_num.cpu().tolist()


def test_peaked_target_chains(device):
    """sgl-kernel's case, its accepted paths as chains: request 0 accepts 3, 4, 5 and stops at
    the spec-step bound (S = 4), its bonus 18 from the row of slot 3; request 1's chain ends at
    slot 2 (next_token -1), accepting 11 and 12, the bonus 18 from slot 2's row."""
    bs, slots, steps = 2, 6, 4
    candidates = torch.tensor([[0, 3, 4, 5, 9, 9], [7, 11, 12, 0, 0, 0]], device=device)
    tree = chain(bs, slots, device, length=[6, 3])
    probs = peaked({(0, 0): 3, (0, 1): 4, (0, 2): 5, (1, 0): 11, (1, 1): 12}, bs, slots, device)
    predicts, accept_index, accept_num = run(candidates, tree, probs, steps, device)
    assert predicts == [3, 4, 5, 18, -1, -1, 11, 12, 18, -1, -1, -1]
    assert accept_index == [[0, 1, 2, 3], [6, 7, 8, -1]]
    assert accept_num == [3, 2]


def test_rejected_first_draft(device):
    """A draft with no target mass is rejected at once: the correction is the target's token."""
    candidates = torch.tensor([[0, 1, 2, 3]], device=device)
    probs = peaked({(0, 0): 3}, 1, 4, device)
    predicts, accept_index, accept_num = run(candidates, chain(1, 4, device), probs, 4, device)
    assert predicts == [3, -1, -1, -1] and accept_index == [[0, -1, -1, -1]] and accept_num == [0]


@pytest.mark.parametrize(
    "bs,slots,steps,vocab", [(1, 4, 4, 32), (2, 8, 5, 64), (4, 16, 8, 128), (1, 1, 1, 32), (8, 32, 8, 256)]
)
def test_linear_chain_smoke(device, bs, slots, steps, vocab):
    """sgl-kernel's linear-chain sizes (candidates i % V, random normalized p): accept counts in
    [0, S - 1], the accepted slots in order, predicts along them the next slot's candidate, and
    a valid token after the last one."""
    g = torch.Generator().manual_seed(bs * slots)
    candidates = (torch.arange(slots, device=device) % vocab).repeat(bs, 1)
    raw = torch.rand(bs, slots, vocab, generator=g).to(device)
    probs = raw / raw.sum(dim=-1, keepdim=True)
    predicts, accept_index, accept_num = run(candidates, chain(bs, slots, device), probs, steps, device)
    for b in range(bs):
        k = accept_num[b]
        assert 0 <= k <= min(steps, slots) - 1
        assert accept_index[b] == [b * slots + j for j in range(k + 1)] + [-1] * (steps - k - 1)
        row = predicts[b * slots : (b + 1) * slots]
        assert row[:k] == [int(c) for c in candidates[b, 1 : k + 1]]
        assert 0 <= row[k] < vocab and all(t == -1 for t in row[k + 1 :])


@pytest.mark.parametrize("bs,slots,steps", [(1, 4, 4), (2, 4, 4), (3, 8, 5)])
def test_onehot_target_accepts_every_draft(device, bs, slots, steps):
    """sgl-kernel's accept-all cases, reached losslessly: p one-hot at every candidate accepts
    S - 1 drafts (their thresholds of 0 are refused, see below)."""
    vocab = 32
    g = torch.Generator().manual_seed(slots)
    candidates = torch.randint(vocab, (bs, slots), generator=g).to(device)
    probs = torch.zeros(bs, slots, vocab, device=device)
    probs[:, :-1].scatter_(2, candidates[:, 1:].unsqueeze(-1), 1.0)
    probs[:, -1, 0] = 1.0
    _, accept_index, accept_num = run(candidates, chain(bs, slots, device), probs, steps, device)
    assert accept_num == [min(steps, slots) - 1] * bs


def test_deterministic_given_the_coins(device):
    bs, slots, vocab = 16, 5, 50
    g = torch.Generator().manual_seed(3)
    candidates = torch.randint(vocab, (bs, slots), generator=g).to(device)
    probs = torch.softmax(torch.randn(bs, slots, vocab, generator=g), -1).to(device)
    probs[:, :, 0] += 1.0  # most drafts rejected: the sampled corrections carry the randomness
    probs /= probs.sum(dim=-1, keepdim=True)
    tree = chain(bs, slots, device)
    first = run(candidates, tree, probs, slots, device, coins_seed=1)
    assert run(candidates, tree, probs, slots, device, coins_seed=1) == first
    assert run(candidates, tree, probs, slots, device, coins_seed=2) != first
    # flashspark's own streams, the coins unused
    streams = dict(seeds=torch.arange(bs, device=device), offsets=torch.zeros(bs, dtype=torch.int64, device=device))
    predicts, accept_index, accept_num = outputs(bs, slots, slots, device)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, candidates, *tree, None, None, probs, **streams
    )
    again = outputs(bs, slots, slots, device)
    tree_speculative_sampling_target_only(*again, candidates, *tree, None, None, probs, **streams)
    assert torch.equal(predicts, again[0]) and torch.equal(accept_num, again[2])


def test_first_token_follows_the_target(device):
    """Target-only verify is lossless: the token emitted after the root follows p at the root
    (chi-square, 7 degrees of freedom, p-value 1e-4 bound 29.9), and the first draft x is
    accepted with probability p(x)."""
    bs, slots, vocab = 20_000, 3, 8
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.rand(slots, vocab, generator=g) * 3, -1)
    draft = 2
    candidates = torch.full((bs, slots), draft, device=device)
    predicts, _, accept_num = run(
        candidates, chain(bs, slots, device), p.expand(bs, slots, vocab).to(device), slots, device
    )
    first = torch.tensor(predicts).view(bs, slots)[:, 0]
    counts = torch.bincount(first, minlength=vocab).double()
    expected = p[0].double() * bs
    assert float(((counts - expected) ** 2 / expected).sum()) < 29.9
    accepted = (torch.tensor(accept_num) > 0).double().mean().item()
    assert abs(accepted - float(p[0, draft])) < 5 * (float(p[0, draft] * (1 - p[0, draft])) / bs) ** 0.5


def test_mixed_greedy_and_random_batch(device):
    """flashspark's temperature= extension: 0 is greedy (argmax of p), 1 samples."""
    bs, slots = 3, 3
    candidates = torch.tensor([[0, 5, 6], [0, 5, 6], [0, 5, 6]], device=device)
    probs = torch.full((bs, slots, VOCAB), 0.01, device=device)
    probs[:, 0, 5] = 0.6  # the argmax is the draft: a greedy request accepts it
    probs[:, 1, 7] = 0.6  # the argmax is not: a greedy request emits 7 there
    probs[:, 2, 9] = 0.6
    temperature = torch.tensor([0.0, 1.0, 0.0], device=device)
    predicts, accept_index, accept_num = run(
        candidates, chain(bs, slots, device), probs, slots, device, temperature=temperature
    )
    assert predicts[0:3] == [5, 7, -1] and predicts[6:9] == [5, 7, -1]
    assert accept_num[0] == accept_num[2] == 1
    assert 0 <= predicts[3] < VOCAB
    status = torch.zeros(bs, dtype=torch.int32, device=device)
    half = torch.full((bs,), 0.5, device=device)  # probabilities come tempered: only 0 or 1
    _, _, accept_num = run(candidates, chain(bs, slots, device), probs, slots, device, temperature=half, status=status)
    assert status.cpu().tolist() == [5] * bs and accept_num == [-1] * bs


@pytest.mark.parametrize("vocab", [1, 2, 300])
def test_vocabulary_boundaries(device, vocab):
    """The last id V - 1 accepted throughout and emitted as the bonus; V = 1 emits token 0."""
    slots = 4
    last = vocab - 1
    candidates = torch.full((2, slots), last, device=device)
    probs = torch.zeros(2, slots, vocab, device=device)
    probs[..., last] = 1.0
    predicts, accept_index, accept_num = run(candidates, chain(2, slots, device), probs, slots, device)
    assert predicts == [last] * (2 * slots) and accept_num == [slots - 1] * 2


def test_outputs_written_in_place(device):
    """predicts keeps what it held past the emitted slots; other dtypes (int64) are written too;
    a larger predicts (EAGLE allocates bs * N + 1) is fine."""
    bs, slots = 2, 4
    candidates = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]], device=device)
    probs = peaked({(0, 0): 1, (0, 1): 2, (1, 0): 9}, bs, slots, device)
    predicts = torch.full((bs * slots + 1,), 777, dtype=torch.int64, device=device)
    accept_index = torch.full((bs, slots), 5, dtype=torch.int64, device=device)
    accept_num = torch.full((bs,), 9, dtype=torch.int64, device=device)
    tree = chain(bs, slots, device)
    tree_speculative_sampling_target_only(
        predicts, accept_index, accept_num, candidates, *tree,
        torch.rand(bs, slots, device=device), torch.rand(bs, device=device), probs,
    )  # fmt: skip
    assert predicts.cpu().tolist() == [1, 2, 18, 777, 9, 777, 777, 777, 777]
    assert accept_index.cpu().tolist() == [[0, 1, 2, -1], [4, -1, -1, -1]]
    assert accept_num.cpu().tolist() == [2, 0]


def test_chain_lengths():
    nxt = torch.tensor([[1, 2, 3, -1], [1, -1, 0, 0], [-1, 5, 5, 5], [2, 3, 1, -1]])
    assert chain_lengths(nxt).tolist() == [4, 2, 1, 1]


def test_peer_branching_tree_is_refused(device):
    """sgl-kernel's own tree (request 0 branches at slot 1, request 1's root child is slot 4)."""
    candidates = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]], device=device)
    index = torch.arange(12, device=device).view(2, 6)
    nxt = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]], device=device)
    sibling = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]], device=device)
    probs = peaked({}, 2, 6, device)
    with pytest.raises(ValueError, match="request 0 branches.*chains only"):
        run(candidates, (index, nxt, sibling), probs, 4, device)
    with pytest.raises(ValueError, match="request 1's retrive_next_token is not a chain in slot order"):
        run(candidates, (index, nxt, torch.full_like(sibling, -1)), probs, 4, device)


@pytest.mark.parametrize("single,acc", [(0.0, 0.0), (0.9, 0.9), (1.0, 0.5), (0.0, 1.0)])
def test_lossy_thresholds_are_refused(device, single, acc):
    """sgl-kernel's threshold cases (0, 0) and the JIT tests' 0.9 accept drafts the target
    would not: not lossless, refused."""
    candidates = torch.tensor([[0, 1, 2]], device=device)
    with pytest.raises(ValueError, match="is not lossless"):
        run(
            candidates,
            chain(1, 3, device),
            peaked({}, 1, 3, device),
            3,
            device,
            threshold_single=single,
            threshold_acc=acc,
        )


def test_check_chain_false_skips_the_host_read(device):
    """Without the check a chain runs the same; a malformed tree gives garbage but never
    indexes outside predicts."""
    candidates = torch.tensor([[0, 3, 4, 5]], device=device)
    probs = peaked({(0, 0): 3, (0, 1): 4, (0, 2): 5}, 1, 4, device)
    assert run(candidates, chain(1, 4, device), probs, 4, device, check_chain=False) == run(
        candidates, chain(1, 4, device), probs, 4, device
    )
    index, nxt, sibling = chain(1, 4, device)
    run(candidates, (index + 100, nxt, sibling), probs, 4, device, check_chain=False)


def bad_call(case, device):
    bs, slots, steps = 2, 3, 3
    predicts, accept_index, accept_num = outputs(bs, slots, steps, device)
    candidates = torch.zeros(bs, slots, dtype=torch.int64, device=device)
    index, nxt, sibling = chain(bs, slots, device)
    coins, final = torch.rand(bs, slots, device=device), torch.rand(bs, device=device)
    probs = torch.full((bs, slots, 4), 0.25, device=device)
    args = [predicts, accept_index, accept_num, candidates, index, nxt, sibling, coins, final, probs]
    kw = {}
    slot = {
        "predicts": 0, "accept_index": 1, "accept_token_num": 2, "candidates": 3, "retrive_index": 4,
        "uniform_samples": 7, "target_probs": 9,
    }  # fmt: skip
    changes = {
        "target_probs must be \\[bs, N, V\\]": ("target_probs", probs[0]),
        "target_probs must be float32": ("target_probs", probs.double()),
        "N >= 1 slots and V >= 1": ("target_probs", probs[..., :0]),
        "candidates must be \\[bs, N\\]": ("candidates", candidates[:, :2]),
        "candidates must be int32 or int64": ("candidates", candidates.float()),
        "candidates is on meta": ("candidates", candidates.to("meta")),
        "accept_index must be \\[bs, S >= 1\\]": ("accept_index", accept_index[:, :0]),
        "accept_token_num must be \\[bs\\]": ("accept_token_num", accept_num[:1]),
        "predicts must be a contiguous 1D tensor": ("predicts", predicts.view(bs, slots)),
        "uniform_samples must be a float tensor of shape \\(2, 3\\)": ("uniform_samples", coins[:, :2]),
        "retrive_index outside predicts": ("retrive_index", index + 6),
        "predicts must be a tensor": ("predicts", [0] * 6),
    }
    if case in changes:
        name, value = changes[case]
        args[slot[name]] = value
    elif case == "seeds and offsets must be given together":
        kw = {"seeds": torch.zeros(bs, dtype=torch.int64, device=device)}
    elif case == "seeds must be a \\[bs\\]":
        kw = {"seeds": torch.zeros(bs, device=device), "offsets": torch.zeros(bs, dtype=torch.int64, device=device)}
    elif case == "temperature must be a \\[bs\\]":
        kw = {"temperature": torch.ones(bs + 1, device=device)}
    elif case == "threshold_single got a tensor":
        args.append(probs)  # sgl-kernel's draft_probs passed positionally
    return args, kw


BAD_CASES = [
    "target_probs must be \\[bs, N, V\\]",
    "target_probs must be float32",
    "N >= 1 slots and V >= 1",
    "candidates must be \\[bs, N\\]",
    "candidates must be int32 or int64",
    "candidates is on meta",
    "accept_index must be \\[bs, S >= 1\\]",
    "accept_token_num must be \\[bs\\]",
    "predicts must be a contiguous 1D tensor",
    "uniform_samples must be a float tensor of shape \\(2, 3\\)",
    "retrive_index outside predicts",
    "predicts must be a tensor",
    "seeds and offsets must be given together",
    "seeds must be a \\[bs\\]",
    "temperature must be a \\[bs\\]",
    "threshold_single got a tensor",
]


@pytest.mark.parametrize("message", BAD_CASES)
def test_bad_inputs_raise_clear_errors(device, message):
    args, kw = bad_call(message, device)
    with pytest.raises((ValueError, TypeError), match=message):
        tree_speculative_sampling_target_only(*args, **kw)


def test_bad_candidate_raises_on_cpu_and_fails_the_request_with_status(device):
    candidates = torch.tensor([[0, 1, 2], [0, 1, 99]], device=device)
    probs = torch.full((2, 3, 4), 0.25, device=device)
    status = torch.zeros(2, dtype=torch.int32, device=device)
    predicts, accept_index, accept_num = run(candidates, chain(2, 3, device), probs, 3, device, status=status)
    assert status.cpu().tolist() == [0, 3]
    assert accept_num[1] == -1 and accept_index[1] == [-1, -1, -1] and predicts[3] == -1
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="outside"):
            run(candidates, chain(2, 3, device), probs, 3, device)
