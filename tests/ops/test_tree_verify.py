"""Tests of torch.ops.flashspark.tree_verify: exact greedy trees, kernel == oracle under the
shared Philox stream, a chain given as a tree == verify with one-hot drafts, statistical
losslessness over several tree shapes (with planted-bug samplers the same statistic must
reject), duplicate siblings, bad input under the status contract, opcheck and layouts."""

import math
import random

import flashspark
import pytest
import torch
from flashspark.ops import NO_PARENT
from flashspark.reference import tree_from_paths, tree_verify_reference

# ---------------------------------------------------------------- helpers


def random_trees(num_nodes, vocab, *, seed=0, dup=0.1, logits=None):
    """Random trees (one per entry of num_nodes): node i's parent is an earlier node of its
    request, its token most often among the parent row's top tokens (so that sampled walks go
    deep), now and then a sibling's token again (duplicates are legal)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    total = sum(num_nodes)
    if logits is None:
        logits = torch.randn(total, vocab, generator=g) * 4.0
    tokens, parents, cu = [], [], [0]
    for n in num_nodes:
        lo = len(tokens)
        tokens.append(rng.randrange(vocab))
        parents.append(NO_PARENT)
        for i in range(1, n):
            parent = lo + rng.randrange(i) if rng.random() < 0.5 else lo + i - 1
            siblings = [tokens[j] for j in range(lo, lo + i) if parents[j] == parent]
            if siblings and rng.random() < dup:
                tok = rng.choice(siblings)
            else:
                top = logits[parent].topk(min(2, vocab)).indices.tolist()
                tok = rng.choice(top) if rng.random() < 0.85 else rng.randrange(vocab)
            tokens.append(tok)
            parents.append(parent)
        cu.append(len(tokens))
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return logits, as_i32(tokens), as_i32(parents), as_i32(cu)


def depth_of(parents, cu):
    depth = [0] * len(parents)
    for i, p in enumerate(parents.tolist()):
        depth[i] = 0 if p == NO_PARENT else depth[p] + 1
    return max(depth, default=0)


def kwargs_for(batch, temperature, device, *, seed=0, max_depth=8):
    temps = temperature if isinstance(temperature, list) else [temperature] * batch
    return dict(
        temperature=torch.tensor(temps, dtype=torch.float32, device=device),
        seeds=torch.arange(batch, dtype=torch.int64, device=device) * 7919 + seed,
        offsets=torch.arange(batch, dtype=torch.int64, device=device) * 5,
        max_depth=max_depth,
    )


def run_both(logits, tokens, parents, cu, kw):
    got = flashspark.tree_verify(logits, tokens, parents, cu, **kw)
    want = tree_verify_reference(logits, tokens, parents, cu, **kw)
    return [t.cpu() for t in got], [t.cpu() for t in want]


def assert_well_formed(nodes, toks, acc, tokens, parents, cu, max_depth):
    for b in range(acc.numel()):
        k = int(acc[b])
        assert 0 <= k <= max_depth
        assert int(nodes[b, 0]) == int(cu[b])
        for d in range(1, k + 1):
            v = int(nodes[b, d])
            assert int(parents[v]) == int(nodes[b, d - 1]) and int(toks[b, d - 1]) == int(tokens[v])
        assert int(toks[b, k]) >= 0
        assert (nodes[b, k + 1 :] == -1).all() and (toks[b, k + 1 :] == -1).all()


def on(device, *tensors):
    return [t.to(device) for t in tensors]


# ---------------------------------------------------------------- greedy, exact


def onehot_rows(argmaxes, vocab, base=0.0):
    rows = torch.full((len(argmaxes), vocab), base)
    for r, a in enumerate(argmaxes):
        rows[r, a] = 5.0
    return rows


def test_greedy_walks_the_argmax_path(device):
    # root -> children tokens 4, 2, 7 (nodes 1, 2, 3); node 2 -> 5 (node 4), 6 (node 5); node 4 -> 1 (node 6)
    tokens = torch.tensor([9, 4, 2, 7, 5, 6, 1], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, 0, 2, 2, 4], dtype=torch.int32)
    cu = torch.tensor([0, 7], dtype=torch.int32)
    # argmax per node row: root 2 (-> node 2), node 2: 5 (-> node 4), node 4: 1 (-> node 6), node 6: 3 (bonus)
    logits = onehot_rows([2, 0, 5, 0, 1, 0, 3], 10)
    kw = kwargs_for(1, 0.0, device, max_depth=4)
    nodes, toks, acc = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    assert nodes.cpu().tolist() == [[0, 2, 4, 6, -1]]
    assert toks.cpu().tolist() == [[2, 5, 1, 3, -1]]
    assert acc.cpu().tolist() == [3]
    # the argmax at node 2 no child holds: stop there with the correction token
    logits[2] = onehot_rows([8], 10)[0]
    nodes, toks, acc = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    assert nodes.cpu().tolist() == [[0, 2, -1, -1, -1]] and toks.cpu().tolist() == [[2, 8, -1, -1, -1]]


def test_greedy_duplicate_siblings_first_listed_wins(device):
    # root's children 1 and 2 both hold token 3; node 2's subtree would accept, node 1's stops
    tokens = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    logits = onehot_rows([3, 5, 6, 0, 0], 8)
    kw = kwargs_for(1, 0.0, device, max_depth=2)
    nodes, toks, acc = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    assert nodes.cpu().tolist() == [[0, 1, -1]] and toks.cpu().tolist() == [[3, 5, -1]]


def test_greedy_ties_break_to_lowest_id(device):
    tokens = torch.tensor([0, 6, 2], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0], dtype=torch.int32)
    logits = torch.zeros(3, 8)
    logits[0, 2] = logits[0, 6] = 1.0  # tie: id 2 wins, the second child
    _, toks, acc = flashspark.tree_verify(
        *on(device, logits, tokens, parents, torch.tensor([0, 3], dtype=torch.int32)), **kwargs_for(1, 0.0, device)
    )
    assert toks.cpu()[0, :2].tolist() == [2, 0] and int(acc[0]) == 1


def test_single_node_trees_and_empty_batch(device):
    logits = torch.randn(3, 50)
    tokens = torch.tensor([1, 2, 3], dtype=torch.int32)
    parents = torch.full((3,), -1, dtype=torch.int32)
    cu = torch.arange(4, dtype=torch.int32)
    for t in [0.0, 1.0]:
        kw = kwargs_for(3, t, device, max_depth=0)
        (nodes, toks, acc), want = run_both(*on(device, logits, tokens, parents, cu), kw)
        assert acc.tolist() == [0, 0, 0] and nodes[:, 0].tolist() == [0, 1, 2]
        assert torch.equal(toks, want[1])
        if t == 0.0:
            assert toks[:, 0].tolist() == logits.argmax(-1).tolist()
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    nodes, toks, acc = flashspark.tree_verify(
        torch.zeros(0, 7, device=device),
        empty,
        empty,
        torch.zeros(1, dtype=torch.int32, device=device),
        **kwargs_for(0, 1.0, device, max_depth=3),
    )
    assert nodes.shape == (0, 4) and toks.shape == (0, 4) and acc.shape == (0,)


# ---------------------------------------------------------------- kernel == oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.6])
def test_matches_reference(device, dtype, temperature):
    sizes = [1, 5, 12, 3, 9, 16, 2, 7]
    logits, tokens, parents, cu = random_trees(sizes, 61, seed=3)
    kw = kwargs_for(len(sizes), temperature, device, max_depth=15)
    got, want = run_both(*on(device, logits.to(dtype), tokens, parents, cu), kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert_well_formed(*got, tokens, parents, cu, 15)
    if temperature > 0:
        assert got[2].float().mean() > 0.5, "the walks hardly went past the root: a weak test"


def test_probs_match_reference(device):
    sizes = [4, 11, 1, 8]
    logits, tokens, parents, cu = random_trees(sizes, 40, seed=5)
    probs = torch.softmax(logits, -1)
    probs[:, 7] = 0.0  # no mass: never emitted
    for t in [0.0, 1.0]:
        kw = dict(kwargs_for(len(sizes), t, device, max_depth=10), target_is_probs=True)
        got, want = run_both(*on(device, probs, tokens, parents, cu), kw)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert not (got[1] == 7).any()


@pytest.mark.parametrize("vocab", [1, 3, 4097, 9001])
def test_odd_sizes_and_strided_rows(device, vocab):
    sizes = [3, 1, 6]
    logits, tokens, parents, cu = random_trees(sizes, vocab, seed=vocab)
    wide = torch.randn(logits.shape[0], vocab + 5)
    wide[:, :vocab] = logits
    rows = wide.to(device)[:, :vocab]  # strided rows
    assert not rows.is_contiguous()
    for t in [0.0, 1.0]:
        kw = kwargs_for(len(sizes), t, device, max_depth=5)
        got, want = run_both(rows, *on(device, tokens, parents, cu), kw)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_int64_indices_and_noncontiguous_index_tensors(device):
    sizes = [5, 4]
    logits, tokens, parents, cu = random_trees(sizes, 30, seed=11)
    kw = kwargs_for(2, 1.0, device, max_depth=4)
    want = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    spread = lambda t: torch.stack([t.long(), t.long()], 1)[:, 0]  # noqa: E731
    assert not spread(tokens).is_contiguous()
    got = flashspark.tree_verify(*on(device, logits, spread(tokens), spread(parents), cu.long()), **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- a chain is verify's one-hot case


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_equals_verify(device, temperature, dtype):
    g = torch.Generator().manual_seed(21)
    lengths = [0, 1, 4, 7, 3]
    vocab = 97
    paths, rows = [], []
    for n in lengths:
        r = torch.randn(n + 1, vocab, generator=g) * 4.0
        # drafts: mostly the row's mode, so chains are accepted part way
        drafts = [int(r[k].argmax()) if torch.rand((), generator=g) < 0.85 else int(r[k].argmin()) for k in range(n)]
        paths.append([drafts])
        rows.append(r)
    logits = torch.cat(rows).to(dtype)
    tokens, parents, cu = tree_from_paths(paths, [0] * len(lengths))
    kw = kwargs_for(len(lengths), temperature, device, max_depth=7)
    nodes, toks, acc = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    draft = torch.cat([tokens[int(cu[b]) + 1 : int(cu[b + 1])] for b in range(len(lengths))])
    cu_draft = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    vkw = {k: v for k, v in kw.items() if k != "max_depth"}
    out, vacc = flashspark.verify(*on(device, logits, draft, cu_draft), max_spec_len=7, **vkw)
    assert torch.equal(toks.cpu(), out.cpu()) and torch.equal(acc.cpu(), vacc.cpu())
    if temperature > 0:
        assert len(set(vacc.tolist())) > 1


# ---------------------------------------------------------------- determinism, out variant, opcheck


def test_seeded_determinism_and_batch_order_invariance(device):
    sizes = [6, 2, 9, 4]
    logits, tokens, parents, cu = random_trees(sizes, 80, seed=7)
    kw = kwargs_for(4, 1.0, device, max_depth=8)
    a = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    b = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    for r in range(4):  # alone, a request draws the same numbers: its row of the batch
        lo, hi = int(cu[r]), int(cu[r + 1])
        sub = {k: (v[r : r + 1] if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        par = torch.where(parents[lo:hi] >= 0, parents[lo:hi] - lo, parents[lo:hi])
        one = torch.tensor([0, hi - lo], dtype=torch.int32)
        nodes, toks, acc = flashspark.tree_verify(*on(device, logits[lo:hi], tokens[lo:hi], par, one), **sub)
        assert torch.equal(toks[0], a[1][r]) and int(acc[0]) == int(a[2][r])
        walked = nodes[0, : int(acc[0]) + 1] + lo
        assert torch.equal(walked, a[0][r, : int(acc[0]) + 1])


def test_out_variant_and_opcheck(device):
    sizes = [3, 7, 1]
    logits, tokens, parents, cu = random_trees(sizes, 33, seed=10)
    logits, tokens, parents, cu = on(device, logits, tokens, parents, cu)
    kw = kwargs_for(3, 1.0, device, max_depth=6)
    want = flashspark.tree_verify(logits, tokens, parents, cu, **kw)
    outs = [torch.full((3, 7), 5, dtype=torch.int32, device=device) for _ in range(2)]
    nacc = torch.full((3,), 9, dtype=torch.int32, device=device)
    flashspark.tree_verify_out(
        logits, tokens, parents, cu, out_accepted_nodes=outs[0], out_tokens=outs[1], out_num_accepted=nacc, **kw
    )
    assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1]) and torch.equal(nacc, want[2])
    args = (logits, tokens, parents, cu, kw["temperature"], kw["seeds"], kw["offsets"], 6)
    torch.library.opcheck(torch.ops.flashspark.tree_verify.default, args)
    torch.library.opcheck(
        torch.ops.flashspark.tree_verify.default, (torch.softmax(logits, -1), *args[1:]), {"target_is_probs": True}
    )
    torch.library.opcheck(
        torch.ops.flashspark.tree_verify_out.default,
        args,
        {"out_accepted_nodes": outs[0], "out_tokens": outs[1], "out_num_accepted": nacc},
    )


# ---------------------------------------------------------------- bad input


def bad_batch():
    """Three good requests of 3 nodes each, the middle one to be spoilt."""
    logits, tokens, parents, cu = random_trees([3, 3, 3], 20, seed=2)
    parents = torch.tensor([-1, 0, 1, -1, 3, 3, -1, 6, 7], dtype=torch.int32)
    return logits, tokens, parents, cu


SPOILERS = {
    "parent outside the request": (lambda lg, tk, pa, cu: pa.__setitem__(4, 0), 20),
    "parent after its child": (lambda lg, tk, pa, cu: pa.__setitem__(4, 5), 20),
    "parent is itself": (lambda lg, tk, pa, cu: pa.__setitem__(5, 5), 20),
    "root with a parent": (lambda lg, tk, pa, cu: pa.__setitem__(3, 2), 20),
    "token too large": (lambda lg, tk, pa, cu: tk.__setitem__(4, 20), 22),
    "token negative": (lambda lg, tk, pa, cu: tk.__setitem__(3, -1), 22),
    "NaN on the walked root row": (lambda lg, tk, pa, cu: lg.__setitem__((3, 0), float("nan")), 7),
    "+inf on the walked root row": (lambda lg, tk, pa, cu: lg.__setitem__((3, 4), float("inf")), 7),
    "all -inf root row": (lambda lg, tk, pa, cu: lg.__setitem__(3, float("-inf")), 8),
}


@pytest.mark.parametrize("name", list(SPOILERS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_request_fails_alone(device, name, temperature):
    logits, tokens, parents, cu = bad_batch()
    kw = kwargs_for(3, temperature, device, max_depth=2)
    good = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), **kw)
    spoil, code = SPOILERS[name]
    spoil(logits, tokens, parents, cu)
    status = torch.full((3,), 99, dtype=torch.int32, device=device)
    nodes, toks, acc = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), status=status, **kw)
    assert status.cpu().tolist() == [0, code, 0]
    assert int(acc[1]) == -1 and (nodes[1] == -1).all() and (toks[1] == -1).all()
    for b in [0, 2]:
        assert torch.equal(nodes[b], good[0][b]) and torch.equal(toks[b], good[1][b])
    if device == "cpu":
        with pytest.raises(RuntimeError, match="flashspark.tree_verify: "):
            flashspark.tree_verify(logits, tokens, parents, cu, **kw)


def test_too_deep_and_unread_rows(device):
    logits, tokens, parents, cu = bad_batch()  # depths 0, 1, 2 in requests 0 and 2; 0, 1, 1 in request 1
    kw = kwargs_for(3, 1.0, device, max_depth=1)
    status = torch.zeros(3, dtype=torch.int32, device=device)
    _, _, acc = flashspark.tree_verify(*on(device, logits, tokens, parents, cu), status=status, **kw)
    assert status.cpu().tolist() == [21, 0, 21] and acc.cpu().tolist()[0] == -1
    # NaN on a row no walk reads (a leaf under a child the greedy walk never takes) is no error
    logits = torch.zeros(3, 6)
    logits[0, 1] = 3.0
    logits[2] = float("nan")
    tokens = torch.tensor([0, 1, 2], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0], dtype=torch.int32)
    status = torch.zeros(1, dtype=torch.int32, device=device)
    _, toks, acc = flashspark.tree_verify(
        *on(device, logits, tokens, parents, torch.tensor([0, 3], dtype=torch.int32)),
        status=status,
        **kwargs_for(1, 0.0, device, max_depth=1),
    )
    assert status.cpu().tolist() == [0] and int(acc[0]) == 1


def test_padding_nodes_are_never_walked(device):
    """parents -1 on a later node: padding outside the tree (its row, here NaN, is never read, its
    token never a child's), the walk the same as without it."""
    logits = torch.zeros(4, 6)
    logits[0, 2] = 5.0
    logits[1, 4] = 5.0
    logits[2] = float("nan")
    tokens = torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    parents = torch.tensor([-1, 0, -1, 1], dtype=torch.int32)  # node 2: padding with the root's argmax
    status = torch.zeros(1, dtype=torch.int32, device=device)
    for t in [0.0, 1.0]:
        nodes, toks, acc = flashspark.tree_verify(
            *on(device, logits, tokens, parents, torch.tensor([0, 4], dtype=torch.int32)),
            status=status,
            **kwargs_for(1, t, device, max_depth=2),
        )
        assert status.cpu().tolist() == [0] and 2 not in nodes.cpu().tolist()[0]
        if t == 0.0:
            assert nodes.cpu().tolist() == [[0, 1, 3]] and toks.cpu().tolist()[0][:2] == [2, 4]
    # padding and the nodes below it are outside the tree: their tokens (an engine's -1) and depths
    # are not checked
    logits = torch.zeros(6, 6)
    tokens = torch.tensor([0, 2, -1, 4, 99, 3], dtype=torch.int32)
    parents = torch.tensor([-1, 0, -1, 2, 3, 4], dtype=torch.int32)  # 2 padding; 3 -> 4 -> 5 below it
    status = torch.zeros(1, dtype=torch.int32, device=device)
    nodes, _, acc = flashspark.tree_verify(
        *on(device, logits, tokens, parents, torch.tensor([0, 6], dtype=torch.int32)),
        status=status,
        **kwargs_for(1, 1.0, device, max_depth=1),
    )
    assert status.cpu().tolist() == [0] and set(nodes.cpu().tolist()[0]) <= {0, 1, -1}


@pytest.mark.parametrize(
    "cu_bad", [[1, 3, 6, 9], [0, 3, 3, 9], [0, 6, 3, 9], [0, 3, 6, 8], [0, 3, 6, 10], [0, 3, 7, 9]]
)
def test_malformed_cu_num_nodes(device, cu_bad):
    logits, tokens, parents, cu = bad_batch()
    status = torch.zeros(3, dtype=torch.int32, device=device)
    cu_bad = torch.tensor(cu_bad, dtype=torch.int32)
    nodes, toks, acc = flashspark.tree_verify(
        *on(device, logits, tokens, parents, cu_bad), status=status, **kwargs_for(3, 1.0, device, max_depth=2)
    )
    st = status.cpu().tolist()
    assert any(s != 0 for s in st)
    assert all(s in (0, 19, 20) for s in st)  # a shifted range also sees a foreign root or parent
    for b in range(3):
        if st[b]:
            assert int(acc[b]) == -1 and (nodes[b] == -1).all()


def test_argument_errors():
    logits, tokens, parents, cu = bad_batch()
    kw = kwargs_for(3, 1.0, "cpu", max_depth=2)
    with pytest.raises(RuntimeError, match="one row per node"):
        flashspark.tree_verify(logits[:-1], tokens, parents, cu, **kw)
    with pytest.raises(RuntimeError, match="'parents' must have N"):
        flashspark.tree_verify(logits, tokens, parents[:-1], cu, **kw)
    with pytest.raises(RuntimeError, match="max_depth"):
        flashspark.tree_verify(logits, tokens, parents, cu, **dict(kw, max_depth=-1))
    with pytest.raises(RuntimeError, match="temperature"):
        flashspark.tree_verify(logits, tokens, parents, cu, **dict(kw, temperature=kw["temperature"][:2]))
    with pytest.raises(RuntimeError, match="int32 or int64"):
        flashspark.tree_verify(logits, tokens.float(), parents, cu, **kw)
    with pytest.raises(TypeError, match="'parents' is required"):
        flashspark.tree_verify(logits, tokens, None, cu, **kw)
    with pytest.raises(RuntimeError, match="temperature"):  # probabilities come tempered
        flashspark.tree_verify(
            torch.softmax(logits, -1),
            tokens,
            parents,
            cu,
            target_is_probs=True,
            **dict(kw, temperature=kw["temperature"] * 0.5),
        )


# ---------------------------------------------------------------- statistical losslessness

# Tree shapes over a small vocabulary, as candidate paths from the root.
STAT_V, STAT_TRIALS = 5, 20000
SHAPES = {
    "wide": [[0], [1], [2], [3]],
    "deep": [[0, 1, 2, 3]],
    "branching": [[0, 1, 2], [0, 3], [1, 0], [1, 4, 4], [2]],
    "duplicate siblings": None,  # built below: the root lists token 1 twice, with different subtrees
    "chain": [[2, 2, 1]],
}


def stat_tree(shape):
    if shape == "duplicate siblings":
        # nodes: 0 root; 1 tok 1; 2 tok 1 (a duplicate: never walked); 3 tok 0 under 1; 4 tok 3 under 2; 5 tok 2
        return (
            torch.tensor([4, 1, 1, 0, 3, 2], dtype=torch.int32),
            torch.tensor([-1, 0, 0, 1, 2, 0], dtype=torch.int32),
        )
    tokens, parents, _ = tree_from_paths([SHAPES[shape]], [4])
    return tokens, parents


def stat_rows(n, seed=1234):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, STAT_V, generator=g) * 1.2


def children_of(tokens, parents):
    """Per node: {token: child} of its distinct child tokens, first listed wins."""
    kids = [dict() for _ in range(len(tokens))]
    for j in range(1, len(tokens)):
        kids[parents[j]].setdefault(tokens[j], j)
    return kids


def expected_outcomes(tokens, parents, p):
    """The target's probability of each emitted sequence: the walk's tokens, then a token no
    child of the stop node holds (any token at a leaf)."""
    kids = children_of(tokens, parents)
    out = {}

    def visit(v, prefix, prob):
        for y in range(STAT_V):
            if y in kids[v]:
                visit(kids[v][y], prefix + (y,), prob * float(p[v, y]))
            else:
                out[prefix + (y,)] = out.get(prefix + (y,), 0.0) + prob * float(p[v, y])

    visit(0, (), 1.0)
    return out


def chi2_critical(df, z=4.75):
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def outcome_stat(samples, expected):
    """Chi-square of the emitted sequences against the target (cells with an expected count
    under 5 pooled); +inf when a sequence of probability 0 was emitted."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    if any(s not in expected for s in counts):
        return math.inf, 1
    big = [s for s, q in expected.items() if q * n >= 5]
    pooled_e = n - sum(expected[s] * n for s in big)
    pooled_c = n - sum(counts.get(s, 0) for s in big)
    stat = sum((counts.get(s, 0) - expected[s] * n) ** 2 / (expected[s] * n) for s in big)
    cells = len(big)
    if pooled_e > 1e-9:
        stat += (pooled_c - pooled_e) ** 2 / pooled_e
        cells += 1
    return stat, cells - 1


def op_samples(shape, temperature, device):
    tokens, parents = stat_tree(shape)
    n, N = STAT_TRIALS, len(tokens)
    rows = stat_rows(N)
    cu = torch.arange(n + 1, dtype=torch.int32) * N
    flat_parents = torch.where(parents >= 0, parents.unsqueeze(0) + cu[:-1, None], parents).reshape(-1)
    kw = dict(
        temperature=torch.full((n,), temperature, device=device),
        seeds=torch.arange(n, dtype=torch.int64, device=device) + 99,
        offsets=torch.zeros(n, dtype=torch.int64, device=device),
        max_depth=N - 1,
    )
    _, toks, acc = flashspark.tree_verify(
        *on(device, rows.repeat(n, 1), tokens.repeat(n), flat_parents.int(), cu), **kw
    )
    toks, acc = toks.cpu().tolist(), acc.cpu().tolist()
    samples = [tuple(t[: a + 1]) for t, a in zip(toks, acc)]
    p = torch.softmax(rows / temperature, -1)
    return samples, expected_outcomes(tokens.tolist(), parents.tolist(), p), acc


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_statistically_lossless(device, shape, temperature):
    samples, expected, acc = op_samples(shape, temperature, device)
    stat, df = outcome_stat(samples, expected)
    assert stat < chi2_critical(df), f"{shape} at T={temperature}: chi2 {stat:.1f} >= {chi2_critical(df):.1f}"
    assert sum(a >= 1 for a in acc) > STAT_TRIALS // 5, "few walks left the root: a weak test"


def buggy_tree_sampler(tokens, parents, p, q, bug, trials, seed=0):
    """Sample-and-walk in plain Python with one planted bug (or none), to show that the
    statistic above has the power to reject a wrong tree sampler."""
    rng = random.Random(seed)
    kids = children_of(tokens, parents)
    p = p.tolist()
    q = q.tolist()
    out = []

    def draw(weights, banned=()):
        w = [0.0 if y in banned else max(x, 0.0) for y, x in enumerate(weights)]
        return rng.choices(range(STAT_V), weights=w)[0]

    for _ in range(trials):
        v, seq = 0, []
        while True:
            children = list(kids[v].items())
            nxt = None
            if bug == "q_as_sampled":  # SpecInfer's multi-round test, as if the children were drawn from q
                res = list(p[v])
                for y, j in children:
                    qq = q[v]
                    if rng.random() < min(1.0, res[y] / max(qq[y], 1e-12)):
                        nxt = j
                        break
                    res = [max(r - qy, 0.0) for r, qy in zip(res, qq)]
                    s = sum(res)
                    res = [r / s for r in res] if s > 0 else list(p[v])
                if nxt is None:
                    seq.append(draw(res))
                    break
            else:
                u, mass = rng.random(), 0.0
                if bug == "duplicates_counted_twice":  # every listed sibling adds its p, repeats too
                    children = [(tokens[j], j) for j in range(len(tokens)) if parents[j] == v]
                for y, j in children:
                    if bug == "wrong_running_sum":
                        mass = p[v][y]  # each child against its own p, not the running sum
                    else:
                        mass += p[v][y]
                    if u < mass:
                        nxt = j
                        break
                if nxt is None:
                    banned = () if bug == "children_left" else tuple(kids[v])
                    seq.append(draw(p[v], banned))
                    break
            seq.append(tokens[nxt])
            v = nxt
        out.append(tuple(seq))
    return out


@pytest.mark.parametrize(
    "bug,shape",
    [
        ("children_left", "branching"),
        ("wrong_running_sum", "branching"),
        ("q_as_sampled", "branching"),
        ("duplicates_counted_twice", "duplicate siblings"),
    ],
)
def test_statistic_rejects_planted_bugs(bug, shape):
    tokens, parents = stat_tree(shape)
    tokens, parents = tokens.tolist(), parents.tolist()
    rows = stat_rows(len(tokens))
    p = torch.softmax(rows, -1)
    q = torch.softmax(stat_rows(len(tokens), seed=99) * 1.5, -1)  # a drafter's q, far from p
    expected = expected_outcomes(tokens, parents, p)
    stat, df = outcome_stat(buggy_tree_sampler(tokens, parents, p, q, bug, STAT_TRIALS), expected)
    assert stat >= chi2_critical(df), f"planted bug {bug} passed: chi2 {stat:.1f} < {chi2_critical(df):.1f}"
    # ...while the same sampler without the bug passes it
    stat, df = outcome_stat(buggy_tree_sampler(tokens, parents, p, q, "none", STAT_TRIALS), expected)
    assert stat < chi2_critical(df)
