"""Token trees in the target and from the drafters' lattices.

* The tree forward: a chain given as a tree is the ragged verify forward bit for bit (fp32);
  each node's logits and feature-layer states equal transformers' forward over the request's
  sequence followed by the node's path (test-only dependency: skipped without it).
* `compact_path`: after any accepted path, the next forward's logits equal a fresh prefill of
  the committed text; nothing outside the path's slots moves.
* `best_first_tree`: the M best nodes of a lattice by path log-probability (brute force over
  every path), prefix-closed, best first, parents before children; `ancestor_mask` against
  a walk up the parents; `node_survival` of a chain is the prefix product.
"""

import itertools

import pytest
import torch
from flashspark.models.decoder import TreeInputs, compact_path
from flashspark.models.drafter import DraftTree
from flashspark.models.tree import ancestor_mask, best_first_tree, node_survival
from spec_helpers import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    """Parents of a random tree of n nodes (node 0 the root, -1), each parent before its child."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def depths_of(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i, p in enumerate(parents):
        d[i] = 0 if p < 0 else d[p] + 1
    return d


def path_to(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def tree_batch(trees: list[list[int]]):
    """Right-padded [B, S] parents (padding: its own root) -> TreeInputs and node counts."""
    S = max(len(t) for t in trees)
    parents = torch.tensor([t + [-1] * (S - len(t)) for t in trees])
    depths = torch.tensor([depths_of(t) + [0] * (S - len(t)) for t in trees])
    return TreeInputs(depths, ancestor_mask(parents, S)), torch.tensor([len(t) for t in trees])


def test_ancestor_mask_matches_walking_up():
    gen = torch.Generator().manual_seed(0)
    trees = [random_tree(n, gen) for n in (1, 5, 12, 12)]
    S = 12
    parents = torch.tensor([t + [-1] * (S - len(t)) for t in trees])
    anc = ancestor_mask(parents, S)
    for b, t in enumerate(trees):
        for i in range(len(t)):
            want = torch.zeros(S, dtype=torch.bool)
            want[path_to(t, i)] = True
            assert torch.equal(anc[b, i], want)


def test_chain_as_tree_is_the_ragged_forward_bit_for_bit():
    target = tiny_target(vocab=61, layers=2, seed=3)
    gen = torch.Generator().manual_seed(1)
    B, S = 3, 6
    prompts = torch.randint(0, 61, (B, 9), generator=gen)
    lens = torch.tensor([9, 4, 7])
    counts = torch.tensor([6, 2, 4])
    new = torch.randint(0, 61, (B, S), generator=gen)
    outs = []
    for tree in (
        None,
        TreeInputs(torch.arange(S).expand(B, S), ancestor_mask(torch.arange(-1, S - 1).expand(B, S), S)),
    ):
        cache = target.new_cache(B, 32)
        with torch.no_grad():
            target(prompts, cache, torch.zeros(B, dtype=torch.long), lens)
            outs.append(target(new, cache, lens, counts, hidden_layers=[0, 1], tree=tree))
    for b in range(B):
        n = int(counts[b])
        assert torch.equal(outs[0].logits[b, :n], outs[1].logits[b, :n])
        assert torch.equal(outs[0].hidden[b, :n], outs[1].hidden[b, :n])


def test_tree_forward_matches_transformers_per_path(tmp_path):
    """Every node of ragged trees against transformers' forward over prefix + the node's path:
    logits and the states of each feature layer (transformers' hidden_states[i + 1])."""
    transformers = pytest.importorskip("transformers")
    from flashspark.models import load_model
    from test_hf_parity import hf_config, hf_model, saved_sharded

    for model_type in ("qwen3", "llama"):
        hf = hf_model(hf_config(model_type, gqa=3))
        ours = load_model(saved_sharded(hf, tmp_path / model_type), dtype=torch.float32)
        gen = torch.Generator().manual_seed(2)
        V = ours.config.vocab_size
        prefixes = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (5, 11, 2)]
        trees = [random_tree(n, gen) for n in (9, 4, 1)]
        tokens = [torch.randint(0, V, (len(t),), generator=gen).tolist() for t in trees]
        B, S = len(trees), max(len(t) for t in trees)
        cache = ours.new_cache(B, 40)
        lens = torch.tensor([len(p) for p in prefixes])
        with torch.no_grad():
            pre = torch.tensor([p + [0] * (11 - len(p)) for p in prefixes])
            ours(pre, cache, torch.zeros(B, dtype=torch.long), lens)
            shape, counts = tree_batch(trees)
            x = torch.tensor([t + [0] * (S - len(t)) for t in tokens])
            out = ours(x, cache, lens, counts, hidden_layers=[0, 1], tree=shape)
            for b, t in enumerate(trees):
                for i in range(len(t)):
                    seq = prefixes[b] + [tokens[b][j] for j in path_to(t, i)]
                    ref = hf(torch.tensor([seq]), output_hidden_states=True)
                    err = (out.logits[b, i] - ref.logits[0, -1]).abs().max().item()
                    assert err < 1e-4, (model_type, b, i, err)
                    for h, layer in enumerate((0, 1)):  # (transformers norms its last state)
                        err = (out.hidden[b, i, h] - ref.hidden_states[layer + 1][0, -1]).abs().max().item()
                        assert err < 1e-4, (model_type, b, i, layer, err)
        assert transformers is not None


def test_compaction_then_next_step_equals_a_fresh_prefill():
    """For every node of a tree as the accepted leaf: compact its path, then decode two tokens;
    the logits equal a fresh prefill of the committed text, and the slots before the committed
    length hold the same K/V as that prefill's (nothing else moved)."""
    target = tiny_target(vocab=53, layers=2, seed=4)
    gen = torch.Generator().manual_seed(5)
    parents = random_tree(10, gen)
    prefix = torch.randint(0, 53, (7,), generator=gen).tolist()
    toks = torch.randint(0, 53, (10,), generator=gen).tolist()
    shape, counts = tree_batch([parents])
    nxt = torch.randint(0, 53, (2,), generator=gen).tolist()
    for leaf in range(10):
        path = path_to(parents, leaf)
        cache = target.new_cache(1, 32)
        lens = torch.tensor([len(prefix)])
        with torch.no_grad():
            target(torch.tensor([prefix]), cache, torch.zeros(1, dtype=torch.long), lens)
            target(torch.tensor([toks]), cache, lens, counts, tree=shape)
            walk = torch.tensor([path + [-1] * (10 - len(path))])
            compact_path(target_cache := cache, lens, walk)
            committed = prefix + [toks[j] for j in path]
            got = target(torch.tensor([nxt]), target_cache, torch.tensor([len(committed)])).logits
            fresh_cache = target.new_cache(1, 32)
            want = target(torch.tensor([committed + nxt]), fresh_cache, torch.zeros(1, dtype=torch.long)).logits
        assert (got[0] - want[0, -2:]).abs().max().item() < 1e-5, leaf
        n = len(committed) + 2
        assert (cache.k[:, :, :, :n] - fresh_cache.k[:, :, :, :n]).abs().max().item() < 1e-5, leaf


def test_compaction_moves_only_the_path_per_request():
    target = tiny_target(vocab=17, layers=1)
    cache = target.new_cache(2, 12)
    cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view(cache.k.shape))
    cache.v.copy_(-cache.k)
    before = cache.k.clone()
    lens = torch.tensor([2, 5])
    walk = torch.tensor([[0, 3, 5, -1], [0, -1, -1, -1]])
    compact_path(cache, lens, walk)
    for src, dst in ((2, 2), (5, 3), (7, 4)):
        assert torch.equal(cache.k[:, 0, :, dst], before[:, 0, :, src])
    untouched = [s for s in range(12) if s not in (3, 4)]
    assert torch.equal(cache.k[:, 0, :, untouched], before[:, 0, :, untouched])
    assert torch.equal(cache.k[:, 1], before[:, 1]) and torch.equal(cache.v, -cache.k)


def brute_force_best(logp: torch.Tensor, M: int) -> list[tuple[int, ...]]:
    """The M best prefixes (tuples of candidate indices) of a position-independent lattice."""
    P, K = logp.shape
    scored = []
    for depth in range(1, P + 1):
        for path in itertools.product(range(K), repeat=depth):
            scored.append((sum(float(logp[d, k]) for d, k in enumerate(path)), -depth, path))
    scored.sort(reverse=True)
    return [p for _, _, p in scored[:M]]


@pytest.mark.parametrize("M", [1, 3, 7, 20, 40])
def test_best_first_tree_is_the_best_prefix_closed_set(M):
    gen = torch.Generator().manual_seed(M)
    B, P, K = 3, 4, 3
    logp = torch.log_softmax(torch.randn(B, P, 5, generator=gen) * 2, -1).topk(K, -1).values
    cand = torch.randint(100, 200, (B, P, K), generator=gen)
    anchor = torch.tensor([7, 8, 9])
    tokens, tree, _ = best_first_tree(
        cand, lambda d, par: logp[:, d - 1, None].expand(-1, par.shape[1], -1), anchor, M + 1
    )
    assert tokens.shape == (B, M) and tree.parents.shape == (B, M)
    for b in range(B):
        # Reconstruct each node's candidate path from the parents, then compare with brute force.
        paths = {0: ()}
        for i in range(M):
            p = int(tree.parents[b, i])
            assert 0 <= p <= i  # parents come first
            d = int(tree.depths[b, i])
            assert d == len(paths[p]) + 1
            k = int((cand[b, d - 1] == tokens[b, i]).nonzero()[0, 0])
            paths[i + 1] = paths[p] + (k,)
        got = [paths[i + 1] for i in range(M)]
        assert sorted(got) == sorted(brute_force_best(logp[b], M))
        assert bool((tree.score[b, 1:] <= tree.score[b, :-1]).all())  # best first
        want_score = torch.tensor([sum(float(logp[b, d, k]) for d, k in enumerate(p)) for p in got])
        assert torch.allclose(tree.score[b], want_score, atol=1e-5)


def test_ties_keep_parents_first():
    """Probability-1 rows: every path ties with its prefix; the tree still lists parents first."""
    P, K = 5, 2
    logp = torch.tensor([[[0.0, -30.0]] * P])
    cand = torch.arange(P * K).view(1, P, K)
    tokens, tree, _ = best_first_tree(
        cand, lambda d, par: logp[:, d - 1, None].expand(-1, par.shape[1], -1), torch.tensor([0]), 6
    )
    assert tree.parents[0].tolist() == [0, 1, 2, 3, 4] and tree.depths[0].tolist() == [1, 2, 3, 4, 5]


def test_node_survival():
    c = torch.tensor([[0.9, 0.5, 0.8]])
    ar = torch.arange(3)[None]
    chain = DraftTree(ar, ar + 1, torch.zeros_like(ar), torch.ones(1, 3), torch.ones(1, 3), torch.zeros(1, 3))
    assert torch.allclose(node_survival(c, chain), torch.tensor([[0.9, 0.45, 0.36]], dtype=torch.float64))
    # Root's two children (best, and a runner-up with half the rest), then the best's child.

    tree = DraftTree(
        torch.tensor([[0, 0, 1]]),
        torch.tensor([[1, 1, 2]]),
        torch.tensor([[0, 1, 0]]),
        torch.tensor([[0.6, 0.2, 0.7]]),
        torch.tensor([[0.6, 0.6, 0.7]]),
        torch.zeros(1, 3),
    )
    c_row = torch.tensor([[0.8, 0.8, 0.5]])
    want = torch.tensor([[0.8, 0.2 * 0.5, min(0.1, 0.8 * 0.5)]], dtype=torch.float64)  # cummin on the last
    assert torch.allclose(node_survival(c_row, tree), want)


def test_node_survival_of_random_trees_is_the_path_product():
    gen = torch.Generator().manual_seed(9)
    for M in (1, 2, 5, 31, 63):
        parents = [p for p in random_tree(M + 1, gen)[1:]]
        depths = depths_of([-1] + parents)[1:]
        c = torch.rand(1, M, generator=gen)
        tree = DraftTree(torch.tensor([parents]), torch.tensor([depths]), torch.zeros(1, M, dtype=torch.long), c, c, c)
        want = []
        for i in range(M):
            want.append(float(torch.tensor([float(c[0, j - 1]) for j in path_to([-1] + parents, i + 1)[1:]]).prod()))
        want = torch.cummin(torch.tensor([want], dtype=torch.float64), 1).values
        assert torch.allclose(node_survival(c, tree), want, rtol=1e-5)
