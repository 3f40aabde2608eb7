"""flashspark.engines.sglang (tree_speculative_sampling_target_only, verify_tree_greedy) against
the cases of sgl-kernel's own tests, re-expressed with our code: its branching tree with a peaked
target (exact outputs, sampled and greedy), the rejected sibling kept out of the final draw, its
k-ary, star and random tree builders (each call against tree_verify's reference on parents built
here by walking the lists), the JIT tests' greedy accept-all / accept-none chains, the linear
chain smoke sizes, one-hot targets accepting every draft, seeded determinism, convergence to the
target distribution, mixed greedy and random batches, vocabulary boundaries, outputs in place,
and the thresholds and trees we refuse with a clear error."""

import pytest
import torch
import torch.nn.functional as F
from flashspark.engines.sglang import tree_speculative_sampling_target_only, verify_tree_greedy
from flashspark.reference import tree_verify_reference

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


# ---------------------------------------------------------------- sgl-kernel's branching trees

# sgl-kernel's fixture: request 0 branches at the root (slots 1 and 3, tokens 1 and 3), request 1's
# root lists slot 4 (token 11) before slot 1 (token 8); the target peaked (temperature 0.01).
PEER_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
PEER_NEXT = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
PEER_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
PEER_PREDICTS = [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
PEER_ACCEPT_INDEX = [[0, 3, 4, 5], [6, 10, 11, -1]]
PEER_ACCEPT_NUM = [3, 2]


def peer_tree(device):
    as_t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    index = torch.arange(12, device=device).view(2, 6)
    return as_t(PEER_CANDIDATES), (index, as_t(PEER_NEXT), as_t(PEER_SIBLING))


def peer_logits(device):
    logits = torch.full((2, 6, 20), 1.0)
    logits[0, 0, 3] = logits[0, 3, 4] = logits[0, 4, 5] = logits[1, 0, 11] = logits[1, 4, 12] = 10.0
    for i in range(2):
        for j in range(6):
            if logits[i, j].max() < 10:
                logits[i, j, 18] = 10.0
    return logits.to(device)


def test_peer_branching_tree_sampled(device):
    """sgl-kernel's test_tree_speculative_sampling_target_only at its lossless thresholds (1, 1):
    the same predicts, accept_index and accept_token_num, whatever the coins."""
    candidates, tree = peer_tree(device)
    probs = F.softmax(peer_logits(device) / 0.01, dim=-1)
    for seed in range(3):
        got = run(candidates, tree, probs, 4, device, coins_seed=seed)
        assert got == (PEER_PREDICTS, PEER_ACCEPT_INDEX, PEER_ACCEPT_NUM)


def test_peer_branching_tree_greedy(device):
    """sgl-kernel's test_verify_tree_greedy: the same three outputs from the argmax ids."""
    candidates, tree = peer_tree(device)
    target_predict = peer_logits(device).argmax(dim=-1)
    predicts, accept_index, accept_num = outputs(2, 6, 4, device)
    verify_tree_greedy(predicts, accept_index, accept_num, candidates, *tree, target_predict)
    assert predicts.cpu().tolist() == PEER_PREDICTS
    assert accept_index.cpu().tolist() == PEER_ACCEPT_INDEX
    assert accept_num.cpu().tolist() == PEER_ACCEPT_NUM


def test_rejected_sibling_is_kept_out_of_the_final_draw(device):
    """sgl-kernel's reject-mask case at the lossless thresholds: slot 1 (token 5, p 0.9) rejected
    after slot 0's child 3 was accepted leaves token 31 (p 0.1) as the only correction."""
    bs = 2000
    candidates = torch.tensor([[0, 3, 5]], device=device).repeat(bs, 1)
    probs = torch.zeros(3, 32)
    probs[0, 0], probs[0, 3] = 0.05, 0.95
    probs[1, 5], probs[1, 31] = 0.9, 0.1
    probs[2, 0] = 1.0
    predicts, accept_index, accept_num = run(
        candidates, chain(bs, 3, device), probs.expand(bs, 3, 32).to(device), 3, device
    )
    predicts = torch.tensor(predicts).view(bs, 3)
    accept_num = torch.tensor(accept_num)
    stopped = accept_num == 1
    assert stopped.sum() > 100 and (predicts[stopped, 0] == 3).all() and (predicts[stopped, 1] == 31).all()


def kary(slots, topk):
    """sgl-kernel's k-ary tree builder (breadth first, topk children per node)."""
    nxt, sib = [-1] * slots, [-1] * slots
    queue, free = [0], 1
    while queue and free < slots:
        parent = queue.pop(0)
        k = min(topk, slots - free)
        nxt[parent] = free
        for c in range(free, free + k):
            sib[c] = c + 1 if c < free + k - 1 else -1
            queue.append(c)
        free += k
    return nxt, sib


def star(slots, topk):
    nxt, sib = [-1] * slots, [-1] * slots
    last = min(topk, slots - 1)
    if last >= 1:
        nxt[0] = 1
        for c in range(1, last):
            sib[c] = c + 1
    return nxt, sib


def random_tree(slots, topk, seed):
    """sgl-kernel's random tree builder: each slot a random earlier parent with room (topk
    children), the children shuffled into the lists."""
    g = torch.Generator().manual_seed(seed)
    children = [[] for _ in range(slots)]
    for i in range(1, slots):
        parent = None
        for _ in range(16):
            cand = int(torch.randint(i, (1,), generator=g))
            if len(children[cand]) < topk:
                parent = cand
                break
        if parent is None:
            parent = next(p for p in range(i) if len(children[p]) < topk)
        children[parent].append(i)
    nxt, sib = [-1] * slots, [-1] * slots
    for p, kids in enumerate(children):
        kids = [kids[i] for i in torch.randperm(len(kids), generator=g).tolist()]
        if kids:
            nxt[p] = kids[0]
            for a, b in zip(kids, kids[1:]):
                sib[a] = b
    return nxt, sib


def expected_from_lists(candidates, nxt, sib, probs, seeds, offsets, steps):
    """The adapter's outputs built independently: parents by walking each slot's list, the walk
    by tree_verify's reference, predicts / accept_index written slot by slot."""
    bs, slots, vocab = probs.shape
    parents = []
    for b in range(bs):
        par = [-1] * slots
        for j in range(slots):
            c = nxt[b][j]
            while c != -1:
                par[c] = j
                c = sib[b][c]
        parents += [p + b * slots if p >= 0 else -1 for p in par]
    tokens = candidates.clone()
    tokens[:, 0] = 0
    nodes, toks, acc = tree_verify_reference(
        probs.reshape(bs * slots, vocab), tokens.reshape(-1), torch.tensor(parents),
        torch.arange(bs + 1) * slots, temperature=torch.ones(bs), seeds=seeds, offsets=offsets,
        max_depth=slots - 1, target_is_probs=True,
    )  # fmt: skip
    predicts = [-1] * (bs * slots)
    accept_index = [[-1] * steps for _ in range(bs)]
    accept_num = []
    for b in range(bs):
        kept = min(int(acc[b]), steps - 1)
        for k in range(kept + 1):
            slot = int(nodes[b, k])  # retrive_index is b * N + slot here
            predicts[slot] = int(toks[b, k])
            accept_index[b][k] = slot
        accept_num.append(kept)
    return predicts, accept_index, accept_num


TREE_GRID = (
    [("kary", topk, shape, 0) for topk in (1, 4) for shape in ((1, 8, 16), (4, 16, 64))]
    + [("star", 4, (1, 9, 31), 0), ("star", 4, (2, 9, 31), 7), ("kary", 2, (2, 12, 32), 1), ("kary", 3, (2, 12, 32), 0)]
    + [("random", topk, shape, seed) for topk in (1, 2, 3, 4) for seed in (0, 7)
       for shape in ((1, 1, 7), (1, 2, 7), (1, 3, 11), (2, 9, 31))]
)  # fmt: skip


@pytest.mark.parametrize("builder,topk,shape,seed", TREE_GRID)
def test_peer_tree_builders(device, builder, topk, shape, seed):
    """sgl-kernel's k-ary, star and random trees (its sizes, top-k and seeds; logit scales 0 and
    4; S = N): the adapter equals tree_verify's reference on the same tree."""
    bs, slots, vocab = shape
    g = torch.Generator().manual_seed(seed)
    if builder == "random":
        lists = [random_tree(slots, topk, seed + slots * 13) for _ in range(bs)]
    else:
        lists = [(kary if builder == "kary" else star)(slots, topk)] * bs
    nxt = [n for n, _ in lists]
    sib = [s for _, s in lists]
    candidates = torch.randint(vocab, (bs, slots), generator=g)
    candidates[:, 0] = 0
    for scale in (0.0, 4.0):
        probs = torch.softmax(torch.randn(bs, slots, vocab, generator=g) * scale, -1)
        seeds = torch.arange(bs, dtype=torch.int64) + 11 * seed
        offsets = torch.full((bs,), 3, dtype=torch.int64)
        predicts, accept_index, accept_num = outputs(bs, slots, slots, device)
        tree_speculative_sampling_target_only(
            predicts, accept_index, accept_num, candidates.to(device),
            torch.arange(bs * slots, device=device).view(bs, slots),
            torch.tensor(nxt, device=device), torch.tensor(sib, device=device), None, None, probs.to(device),
            seeds=seeds.to(device), offsets=offsets.to(device),
        )  # fmt: skip
        want = expected_from_lists(candidates, nxt, sib, probs, seeds, offsets, slots)
        assert (predicts.cpu().tolist(), accept_index.cpu().tolist(), accept_num.cpu().tolist()) == want


def test_permuted_retrive_index_and_a_longer_predicts(device):
    """EAGLE allocates predicts with bs * N + 1 entries and may place slots anywhere in it: every
    write goes through retrive_index (sampled and greedy alike), nothing else is touched."""
    candidates, (index, nxt, sib) = peer_tree(device)
    perm = torch.tensor([5, 0, 9, 2, 11, 7, 1, 10, 3, 8, 6, 4], device=device) + 1  # slot -> predicts entry
    index = perm.view(2, 6)
    probs = F.softmax(peer_logits(device) / 0.01, dim=-1)
    want_predicts = [-1] * 13
    for flat, value in enumerate(PEER_PREDICTS):
        if value != -1:
            want_predicts[int(perm[flat])] = value
    want_accept = [[int(perm[i]) if i >= 0 else -1 for i in row] for row in PEER_ACCEPT_INDEX]
    for greedy in (False, True):
        predicts = torch.full((13,), -1, dtype=torch.int32, device=device)
        accept_index = torch.full((2, 4), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros(2, dtype=torch.int32, device=device)
        if greedy:  # the argmax ids sit where retrive_index points, as sgl-kernel reads them
            target_predict = torch.zeros(13, dtype=torch.int64, device=device)
            target_predict[perm] = peer_logits(device).argmax(-1).reshape(-1)
            verify_tree_greedy(predicts, accept_index, accept_num, candidates, index, nxt, sib, target_predict)
        else:
            tree_speculative_sampling_target_only(
                predicts, accept_index, accept_num, candidates, index, nxt, sib,
                torch.rand(2, 6, device=device), torch.rand(2, device=device), probs,
            )  # fmt: skip
        assert predicts.cpu().tolist() == want_predicts
        assert accept_index.cpu().tolist() == want_accept and accept_num.cpu().tolist() == PEER_ACCEPT_NUM
    with pytest.raises(ValueError, match="outside predicts and target_predict"):
        verify_tree_greedy(
            predicts,
            accept_index,
            accept_num,
            candidates,
            index,
            nxt,
            sib,
            torch.zeros(12, dtype=torch.int64, device=device),
        )


@pytest.mark.parametrize("bs", [1, 2])
def test_greedy_chain_accept_all_and_none(device, bs):
    """The JIT tests of verify_tree_greedy: a chain whose argmax ids are the next candidates
    accepts S - 1 = 3 drafts; argmax ids that no candidate holds accept none."""
    slots = 4
    candidates = (torch.arange(slots, device=device) % 32).repeat(bs, 1)
    index, nxt, sibling = chain(bs, slots, device)
    predict = candidates.clone()
    predict[:, :-1] = candidates[:, 1:]
    predicts, accept_index, accept_num = outputs(bs, slots, slots, device)
    verify_tree_greedy(predicts, accept_index, accept_num, candidates, index, nxt, sibling, predict)
    assert accept_num.cpu().tolist() == [3] * bs
    assert predicts.cpu().tolist() == [1, 2, 3, 3] * bs
    assert accept_index.cpu().tolist() == [[b * slots + j for j in range(slots)] for b in range(bs)]
    predicts, accept_index, accept_num = outputs(bs, slots, slots, device)
    verify_tree_greedy(predicts, accept_index, accept_num, candidates, index, nxt, sibling, torch.zeros_like(predict))
    assert accept_num.cpu().tolist() == [0] * bs
    assert [predicts.cpu().tolist()[b * slots] for b in range(bs)] == [0] * bs


def test_greedy_matches_the_sampled_path_at_temperature_zero(device):
    """verify_tree_greedy on argmax ids and the sampled adapter at temperature 0 on the
    probabilities walk the same trees (random trees of top-4, duplicate candidates included)."""
    bs, slots, vocab = 6, 12, 9  # a small vocabulary: duplicate siblings and repeated argmaxes
    g = torch.Generator().manual_seed(3)
    lists = [random_tree(slots, 4, s) for s in range(bs)]
    nxt = torch.tensor([n for n, _ in lists], device=device)
    sib = torch.tensor([s for _, s in lists], device=device)
    candidates = torch.randint(vocab, (bs, slots), generator=g).to(device)
    logits = torch.randn(bs, slots, vocab, generator=g)
    for b, (n, sb) in enumerate(lists):  # the argmax most often some child's candidate: walks go deep
        for parent in range(slots):
            kids, c = [], n[parent]
            while c != -1:
                kids.append(c)
                c = sb[c]
            if kids and torch.rand((), generator=g) < 0.8:
                pick = kids[int(torch.randint(len(kids), (1,), generator=g))]
                logits[b, parent, int(candidates[b, pick])] = 8.0
    probs = torch.softmax(logits, -1).to(device)
    index = torch.arange(bs * slots, device=device).view(bs, slots)
    greedy = outputs(bs, slots, 5, device)
    verify_tree_greedy(*greedy, candidates, index, nxt, sib, probs.argmax(-1))
    sampled = outputs(bs, slots, 5, device)
    tree_speculative_sampling_target_only(
        *sampled, candidates, index, nxt, sib, None, None, probs,
        temperature=torch.zeros(bs, device=device), seeds=torch.zeros(bs, dtype=torch.int64, device=device),
        offsets=torch.zeros(bs, dtype=torch.int64, device=device),
    )  # fmt: skip
    for a, b in zip(greedy, sampled):
        assert torch.equal(a, b)
    assert greedy[2].float().mean() > 0.3


def test_child_before_its_parent_is_refused(device):
    """A list that sends a slot to a lower slot (a child before its parent) raises with the
    check, and fails its request (status 20) without it."""
    candidates = torch.tensor([[0, 1, 2, 3]], device=device)
    index = torch.arange(4, device=device).view(1, 4)
    nxt = torch.tensor([[2, -1, 1, -1]], device=device)  # 0 -> 2 -> 1: slot 1's parent is slot 2
    sib = torch.full((1, 4), -1, device=device)
    probs = torch.full((1, 4, 5), 0.2, device=device)
    with pytest.raises(ValueError, match="request 0 lists a child at a lower slot than its parent"):
        run(candidates, (index, nxt, sib), probs, 4, device)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="parents"):
            run(candidates, (index, nxt, sib), probs, 4, device, check_tree=False)
    _, _, accept_num = run(candidates, (index, nxt, sib), probs, 4, device, check_tree=False, status=status)
    assert status.cpu().tolist() == [20] and accept_num == [-1]


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


def test_check_tree_false_skips_the_host_read(device):
    """Without the check a chain runs the same; a malformed tree gives garbage but never
    indexes outside predicts."""
    candidates = torch.tensor([[0, 3, 4, 5]], device=device)
    probs = peaked({(0, 0): 3, (0, 1): 4, (0, 2): 5}, 1, 4, device)
    assert run(candidates, chain(1, 4, device), probs, 4, device, check_tree=False) == run(
        candidates, chain(1, 4, device), probs, 4, device
    )
    index, nxt, sibling = chain(1, 4, device)
    run(candidates, (index + 100, nxt, sibling), probs, 4, device, check_tree=False)


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
    assert status.cpu().tolist() == [0, 22]  # tree_verify's kNodeTokenRange
    assert accept_num[1] == -1 and accept_index[1] == [-1, -1, -1] and predicts[3] == -1
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="outside"):
            run(candidates, chain(2, 3, device), probs, 3, device)
