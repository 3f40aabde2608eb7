"""Token trees from a drafter's block lattice: best-first expansion under a node budget.

Shapes (B requests, P draft positions of the block, K candidates per position, M = N - 1 draft
nodes under the root of a tree of N nodes):

  cand_ids   [B, P, K]   candidate tokens per block position
  row_logp   (d, parent tokens [B, W]) -> [B, W, K] log-probabilities of position d's candidates
             given each parent (DFlash: the same row for every parent; DFlash 2: the selector's
             score row S_d(parent, ·), normalized)
  tokens     [B, M]      out: draft node tokens, best first
  DraftTree  parents / depths / rank / probs / score [B, M]

A node's score is its path log-probability, the sum of its ancestors' row log-probabilities.
Every factor is <= 1, so a child never scores above its parent, and the M best nodes of the
whole lattice form a tree: no node is chosen without its parent (ties go to the shallower
node). Best-first expansion, the DDTree rule, returns exactly those M nodes. Computed level by
level: depth d keeps the M best children of depth d - 1's kept nodes (a node among the M best
overall is among the M best of its depth, and its parent was kept), then the M best of all
kept nodes are sorted. One loop over the P depths, each a [B, W, K] top-k: no Python loop per
node on the drafting path.
"""

from __future__ import annotations

import torch

from .drafter import DraftTree

SEARCHES = ("best-first", "beam")  # best-first: the DDTree rule, the default (README, Trees)


@torch.no_grad()
def best_first_tree(
    cand_ids: torch.Tensor, row_logp, anchor: torch.Tensor, num_nodes: int, with_rows=None, search: str = "best-first"
):
    """The `num_nodes - 1` best draft nodes of the lattice (module docstring), best first.

    `search="beam"` instead keeps the ceil(M / P) best nodes of each depth (a beam search
    whose beams are merged into a prefix tree): as deep as the lattice, narrower at the top.

    Returns (tokens [B, M] int64, DraftTree, row extras): `with_rows(d, parent tokens, logp)`
    may return a tensor [B, W, K, ...] per level (DFlash 2: its path signals of each parent's
    row), gathered for each chosen node from its parent's row (None without it).
    """
    B, P, K = cand_ids.shape
    M = num_nodes - 1
    if M < 1:
        raise ValueError(f"a tree needs at least 2 nodes (the root and a draft), got {num_nodes}")
    if search not in SEARCHES:
        raise ValueError(f"search must be one of {SEARCHES}, got {search!r}")
    width = M if search == "best-first" else -(-M // P)  # nodes kept per depth
    device = cand_ids.device
    rows_b = torch.arange(B, device=device)[:, None]
    # The frontier: the kept nodes of the previous depth (the root first).
    f_tok = anchor.long()[:, None]  # [B, W]
    f_score = torch.zeros(B, 1, device=device)
    f_id = torch.full((B, 1), -1, dtype=torch.int64, device=device)  # candidate ids (root: -1)
    scores, toks, parent_ids, depths, ranks, probs, tops, extras = [], [], [], [], [], [], [], []
    offset = 0
    for d in range(1, P + 1):
        logp = row_logp(d, f_tok).float()  # [B, W, K]
        W = logp.shape[1]
        # A candidate's rank in its own row (0: the row's best) and its probability there.
        rank = torch.argsort(torch.argsort(logp, dim=-1, descending=True, stable=True), dim=-1)
        child = (f_score[..., None] + logp).flatten(1)  # [B, W * K]
        keep = min(width, W * K)
        top, idx = child.topk(keep, -1)  # idx = w * K + k
        w, k = idx // K, idx % K
        scores.append(top)
        toks.append(cand_ids[:, d - 1].long().gather(1, k))
        parent_ids.append(f_id.gather(1, w))
        depths.append(torch.full_like(idx, d))
        ranks.append(rank.flatten(1).gather(1, idx))
        probs.append(logp.exp().flatten(1).gather(1, idx))
        tops.append(logp.max(-1).values.exp().gather(1, w))
        if with_rows is not None:
            extra = with_rows(d, f_tok, logp)  # [B, W, ...]: per parent row
            extras.append(extra[rows_b, w])
        f_tok, f_score = toks[-1], top
        f_id = offset + torch.arange(keep, device=device).expand(B, keep)
        offset += keep
    score = torch.cat(scores, 1)  # [B, C], depth-ascending
    # Stable: on a tie the shallower node (listed first) wins, so a parent never sorts after its child.
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :M]
    if order.shape[1] < M:
        raise ValueError(f"the lattice holds {order.shape[1]} nodes, fewer than the {M} asked for")
    # Node j (1-based: the root is node 0) of the tree is candidate order[:, j - 1].
    node_of = torch.zeros(B, score.shape[1] + 1, dtype=torch.int64, device=device)  # candidate + 1 -> node
    node_of.scatter_(1, order + 1, torch.arange(1, M + 1, device=device).expand(B, M))
    pick = lambda xs: torch.cat(xs, 1).gather(1, order)  # noqa: E731
    parents = node_of.gather(1, pick(parent_ids) + 1)  # root (-1) -> node 0
    tree = DraftTree(parents, pick(depths), pick(ranks), pick(probs), pick(tops), score.gather(1, order))
    extra = None
    if extras:
        flat = torch.cat(extras, 1)
        extra = flat.gather(1, order.view(B, M, *([1] * (flat.dim() - 2))).expand(-1, -1, *flat.shape[2:]))
    return pick(toks), tree, extra


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, S, S] bool: node i sees node j iff j is i or an ancestor of i. parents [B, S] local
    node ids, -1 for the root (and for padding), each parent listed before its child; trees no
    deeper than `max_depth`. One gather per level."""
    B, S = parents.shape
    eye = torch.eye(S, dtype=torch.bool, device=parents.device).expand(B, S, S)
    up = torch.where(parents < 0, torch.arange(S, device=parents.device), parents)  # a root points at itself
    anc = eye
    for _ in range(max_depth):
        anc = eye | anc.gather(1, up[..., None].expand(B, S, S))
    return anc


def node_survival(c_row: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[B, M] each node's path survival, the chance the target accepts it: the product of its
    path's per-node confidences. c_row [B, M] is the confidence that the target's token at a
    node's row is the row's best candidate (a confidence proxy's c). A node of rank 0 takes it;
    another takes the rest, 1 - c, shared in proportion to its drafter probability among the
    non-best candidates. (A chain's nodes are all rank 0: its survival is DSpark's prefix
    product.) Made non-increasing along the columns (a cummin), so that every prefix of the
    best-first order is also a best-survival set a scheduler can cut."""
    rest = (tree.probs / (1.0 - tree.row_top).clamp(min=1e-6)).clamp(max=1.0)
    c = torch.where(tree.rank == 0, c_row, (1.0 - c_row) * rest).double().clamp(0.0, 1.0)
    B, M = c.shape
    # Pointer jumping on log c (node 0, the root, holds log 1 and points at itself): after j
    # rounds a node holds the sum over its 2^j nearest ancestors-or-self. A static number of
    # rounds, no host read.
    val = torch.cat((c.new_zeros(B, 1), c.log()), 1)
    up = torch.cat((tree.parents.new_zeros(B, 1), tree.parents), 1)
    for _ in range(M.bit_length()):
        val = val + val.gather(1, up)
        up = up.gather(1, up)
    return torch.cummin(val[:, 1:].exp(), 1).values
