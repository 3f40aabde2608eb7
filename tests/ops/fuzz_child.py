"""Child side of the op fuzz in test_fuzz_ops.py: builds, runs and judges cases.

A case is a JSON object ``{"id", "op", "impl", "base", "mutation"[, "status"]}``: ``base``
holds the sizes and the seed of a small valid call (drawn by hypothesis in the parent),
``mutation`` names one entry of ``MUTATIONS[op]``, which changes one argument of that
call, and ``impl`` names the callable under test (the op's wrapper in flashspark.ops,
or one of the planted-bug variants below). Everything is rebuilt from those fields with
fixed seeds, so a case means the same call in every process. With ``"status": true``
the case is the twin of the plain one that also passes a status tensor (run_status_case).

Run as ``python fuzz_child.py CASES.json REPORT.jsonl``. For each case the child first
appends ``{"start": id}`` to the report and then ``{"id", "op", "mutation", "expect",
"outcome", "message", "notes"}``, flushing both, so that a parent whose child died
knows which case was running. Outcomes:

  * ``error``: the call raised a clear error (RuntimeError / ValueError / TypeError
    whose text has "flashspark" or names the mutated argument in quotes), and the
    contract allows an error there (``notes`` say where the text misses the contract's
    form "flashspark.<op>: ... '<argument>' ...");
  * ``ok``: the call returned and its outputs pass the op's invariants (and match the
    reference in flashspark.reference where that is exact for the inputs);
  * ``violation``: anything else: an unclear error, a valid call rejected, a bad call
    silently accepted, or outputs that break an invariant;
  * ``skip``: the mutation does not apply to this base (test_fuzz_covers_every_mutation
    checks that every mutation applies to some base).

Expectations follow the project's bad-input contract (``expect`` of each mutation):
``error`` (the contract says the call is invalid), ``ok`` (it says the call is valid)
or ``either`` (it is silent: an error, or outputs passing the invariants and matching
the reference, are both fine).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import random
import resource
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
from flashspark import ops
from flashspark import reference as ref

# A child may not grow past this much address space: an op that tries to allocate
# gigabytes for a huge size argument fails with an allocator error (reported as an
# unclear error) instead of exhausting the machine.
ADDRESS_SPACE_LIMIT_BYTES = 6 << 30
MESSAGE_CHARS = 300
BIG = 2**32  # added to an int64 index: an op that narrows it to int32 reads the original value
GARBAGE_INT = 1_000_003  # fills the gaps of strided index views: out of range if the op reads it
GREEDY_FLOOR = 1e-5  # temperatures below it are greedy (contract)
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NONFINITE = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"), "1e38": 1e38, "-1e38": -1e38}


@dataclass
class Mutation:
    """One argument change: ``fn(args, meta, rng)`` returns the changed args (or None if it
    does not apply) and may set ``meta['expect']`` when the expectation depends on the base."""

    arg: str
    fn: Callable
    expect: str  # "error" | "ok" | "either"
    needs: tuple = ()  # names in NEEDS, or callables, that adapt the base so the mutation applies


def gen(seed):
    return torch.Generator().manual_seed(int(seed) % (2**63))


def idx_dtype(base):
    return torch.int64 if base.get("index64") else torch.int32


def other_float(dt):
    return torch.bfloat16 if dt == torch.float32 else torch.float32


# ---------------------------------------------------------------- builders of valid calls


def build_verify(b):
    g = gen(b["seed"])
    nd = list(b["num_draft"])
    B, V, K = len(nd), b["V"], b["K"]
    cu = [0]
    for n in nd:
        cu.append(cu[-1] + n)
    T = cu[-1]
    dt = DTYPES[b["dtype"]]
    it = idx_dtype(b)
    q_mode = b["q_mode"] if V > 0 else "onehot"
    logits = torch.randn(T + B, V, generator=g) * 3.0
    drafts = torch.zeros(T, dtype=torch.int64)
    kk = max(1, min(K, V))
    probs = torch.zeros(T, V) if q_mode == "dense" else torch.zeros(T, kk) if q_mode == "sparse" else None
    ids = torch.zeros(T, kk, dtype=torch.int64) if q_mode == "sparse" else None
    if V > 0 and T > 0:
        rows = torch.cat([logits[cu[i] + i : cu[i + 1] + i] for i in range(B)])
        draft_logits = 0.7 * rows + 0.9 * torch.randn(T, V, generator=g)
        q = torch.softmax(draft_logits, dim=-1)
        if q_mode == "onehot":
            drafts = draft_logits.argmax(-1)
        elif q_mode == "dense":
            drafts = torch.multinomial(q, 1, generator=g).squeeze(-1)
            probs = q
        else:
            top_p, top_i = q.topk(kk, dim=-1)
            top_p = top_p / top_p.sum(-1, keepdim=True)
            drafts = top_i.gather(-1, torch.multinomial(top_p, 1, generator=g)).squeeze(-1)
            probs, ids = top_p, top_i
    temps = (list(b["temps"]) + [1.0] * B)[:B]
    if b.get("probs"):  # the target's probabilities (target_is_probs): greedy or temperature 1
        logits = torch.softmax(logits, dim=-1)
        temps = [0.0 if t < GREEDY_FLOOR else 1.0 for t in temps]
        probs = None if probs is None else probs.to(dt)  # q in the target's dtype too
    a = dict(
        target_logits=logits.to(dt),
        draft_tokens=drafts.to(it),
        cu_num_draft=torch.tensor(cu, dtype=it),
        temperature=torch.tensor(temps, dtype=torch.float32),
        seeds=torch.arange(B, dtype=torch.int64) * 7919 + b["seed"] % 1000,
        offsets=torch.arange(B, dtype=torch.int64) * 3,
        max_spec_len=max(nd, default=0) + b["extra_spec"],
        draft_probs=probs,
        draft_probs_ids=None if ids is None else ids.to(it),
    )
    if b.get("bonus"):  # the caller's bonus tokens: the logits keep the draft rows alone
        keep = torch.ones(T + B, dtype=torch.bool)
        keep[[cu[i + 1] + i for i in range(B)]] = False
        a["target_logits"] = a["target_logits"][keep]
        a["bonus_tokens"] = torch.randint(0, max(V, 1), (B,), generator=g).to(it)
    if b.get("probs"):
        a["target_is_probs"] = True
    m = dict(B=B, V=V, T=T, cu=cu, n=nd, temps=temps, q_mode=q_mode, dtype=dt)
    return a, m


def build_verify_out(b):
    a, m = build_verify(b)
    a["out_tokens"] = torch.full((m["B"], a["max_spec_len"] + 1), 123, dtype=torch.int32)
    a["out_num_accepted"] = torch.full((m["B"],), 77, dtype=torch.int32)
    return a, m


TREE_PADDING = 0.1  # chance that a later node of a tree is padding (parents -1: never walked)
TREE_DUPLICATE = 0.15  # chance that a child repeats a sibling's token (legal: the first listed wins)
TREE_ARGMAX = 0.75  # chance that a child holds its parent row's argmax (the walks go deep)


def build_tree_verify(b):
    """Random trees grown from the seed: node i's parent is an earlier tree node of its request (often
    i - 1, so chains form), its token mostly the parent row's argmax. The second node of a request is
    never padding (a request of two nodes or more has depth >= 1); with ``pad`` the last node of
    request 0 is."""
    g = gen(b["seed"])
    rng = random.Random(b["seed"])
    sizes = list(b["num_nodes"])
    B, V = len(sizes), b["V"]
    N = sum(sizes)
    dt = DTYPES[b["dtype"]]
    it = idx_dtype(b)
    logits = torch.randn(N, V, generator=g) * 3.0
    read = logits.to(dt).float()  # the argmax the op sees
    tokens, parents, depth, cu = [], [], [], [0]
    for r, n in enumerate(sizes):
        lo = len(tokens)
        for i in range(n):
            pad = i >= 2 and (rng.random() < TREE_PADDING or (b.get("pad") and r == 0 and i == n - 1))
            if i == 0 or pad:
                tokens.append(rng.randrange(V) if V else 0)
                parents.append(-1)
                depth.append(0)
                continue
            tree = [j for j in range(lo, lo + i) if j == lo or parents[j] != -1]
            parent = tree[-1] if rng.random() < 0.5 else rng.choice(tree)
            siblings = [tokens[j] for j in range(lo, lo + i) if parents[j] == parent]
            if siblings and rng.random() < TREE_DUPLICATE:
                tok = rng.choice(siblings)
            elif V and rng.random() < TREE_ARGMAX:
                tok = int(read[parent].argmax())
            else:
                tok = rng.randrange(V) if V else 0
            tokens.append(tok)
            parents.append(parent)
            depth.append(depth[parent] + 1)
        cu.append(len(tokens))
    temps = (list(b["temps"]) + [1.0] * B)[:B]
    if b.get("probs"):  # the target's probabilities (target_is_probs): greedy or temperature 1
        logits = torch.softmax(logits, dim=-1)
        temps = [0.0 if t < GREEDY_FLOOR else 1.0 for t in temps]
    deepest = max(depth, default=0)
    a = dict(
        target_logits=logits.to(dt),
        node_tokens=torch.tensor(tokens, dtype=it),
        parents=torch.tensor(parents, dtype=it),
        cu_num_nodes=torch.tensor(cu, dtype=it),
        temperature=torch.tensor(temps, dtype=torch.float32),
        seeds=torch.arange(B, dtype=torch.int64) * 7919 + b["seed"] % 1000,
        offsets=torch.arange(B, dtype=torch.int64) * 5,
        max_depth=deepest + b["extra_depth"],
    )
    if b.get("probs"):
        a["target_is_probs"] = True
    m = dict(B=B, V=V, N=N, cu=cu, n=sizes, temps=temps, dtype=dt, deepest=deepest, depth=depth, parents=parents)
    return a, m


def build_tree_verify_out(b):
    a, m = build_tree_verify(b)
    W = a["max_depth"] + 1
    a["out_accepted_nodes"] = torch.full((m["B"], W), 123, dtype=torch.int32)
    a["out_tokens"] = torch.full((m["B"], W), 123, dtype=torch.int32)
    a["out_num_accepted"] = torch.full((m["B"],), 77, dtype=torch.int32)
    return a, m


def build_attention(b):
    g = gen(b["seed"])
    B, G, hkv, D = b["B"], b["G"], b["Hkv"], b["D"]
    hq = hkv * b["group"]
    dt = DTYPES[b["dtype"]]
    ctx = (list(b["ctx"]) + [0] * B)[:B]
    S = max(ctx, default=0) + b["S_extra"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dt)

    a = dict(
        q=rnd(B, G, hq, D),
        k_cache=rnd(B, hkv, S, D),
        v_cache=rnd(B, hkv, S, D),
        ctx_lens=torch.tensor(ctx, dtype=idx_dtype(b)),
        k_block=rnd(B, G, hkv, D),
        v_block=rnd(B, G, hkv, D),
        scale=float(D) ** -0.5 if D > 0 else 1.0,
    )
    return a, dict(B=B, G=G, Hq=hq, Hkv=hkv, D=D, S=S, ctx=ctx, dtype=dt)


def build_inject(b):
    g = gen(b["seed"])
    N, B, hkv, D = b["N"], b["B"], b["Hkv"], b["D"]
    S = max(b["S"], -(-N // B) if B else 0)
    dt = DTYPES[b["dtype"]]
    flat = torch.randperm(B * S, generator=g)[:N]
    it = idx_dtype(b)
    max_pos = S + b["pos_extra"]
    a = dict(
        k=(torch.randn(N, hkv, D, generator=g) * 2).to(dt),
        v=torch.randn(N, hkv, D, generator=g).to(dt),
        positions=(flat % S).to(it) if S else flat.to(it),
        slots=(flat // S).to(it) if S else flat.to(it),
        k_norm_weight=1 + 0.1 * torch.randn(D, generator=g),
        cos_sin_cache=ref.rope_cos_sin_cache(max_pos, D, 10000.0) if D % 2 == 0 else torch.randn(max_pos, D),
        eps=1e-6,
        k_cache=torch.zeros(B, hkv, S, D, dtype=dt),
        v_cache=torch.zeros(B, hkv, S, D, dtype=dt),
    )
    return a, dict(N=N, B=B, Hkv=hkv, D=D, S=S, max_pos=max_pos, dtype=dt)


def build_conv(b):
    g = gen(b["seed"])
    rows, C = b["rows"], b["C"]
    group_size = b.get("group", 16)
    groups = ref.conv_groups(C, group_size)
    dt = DTYPES[b["dtype"]]
    lead = (2,) if b["lead"] else ()
    n = rows * (2 if b["lead"] else 1)
    a = dict(
        x=torch.randn(*lead, rows, C, generator=g).to(dt),
        base=torch.randn(2, C, generator=g).to(dt),
        delta=None,
        block_size=b["block_size"],
        cu_blocks=None,
        residual=None,
        delta_weight=None,
        norm_weight=None,
        norm_eps=1e-6,
        group_size=group_size,
        finish_delta=None,
    )
    if b["taps"] == "delta":
        a["delta"] = (0.3 * torch.randn(*lead, rows, 2, groups, generator=g)).to(dt)
    else:  # "finish": the finish conv's taps projected too, into finish_delta (filled with a value never computed)
        finish = b["taps"] == "finish"
        a["delta_weight"] = (0.2 * torch.randn((4 if finish else 2) * groups, C, generator=g)).to(dt)
        if finish:
            a["finish_delta"] = torch.full((*lead, rows, 2, groups), 777.0, dtype=dt)
    if b["ragged"]:
        cuts = sorted(torch.randint(0, n + 1, (b["block_size"],), generator=g).tolist())
        a["cu_blocks"] = torch.tensor([0] + cuts + [n], dtype=idx_dtype(b))
        a["block_size"] = 0
    if b["residual"]:
        a["residual"] = torch.randn(*lead, rows, C, generator=g).to(dt)
    if b["norm"]:
        a["norm_weight"] = (1 + 0.5 * torch.randn(C, generator=g)).to(dt)
        a["norm_eps"] = 1e-5
    return a, dict(rows=n, C=C, groups=groups, dtype=dt, ragged=b["ragged"], taps=b["taps"], group_size=group_size)


def build_topk(b):
    g = gen(b["seed"])
    rows, V = b["rows"], b["V"]
    dt = DTYPES[b["dtype"]]
    shape = (2, rows, V) if b["lead"] else (rows, V)
    a = dict(logits=(torch.randn(*shape, generator=g) * 4).to(dt), k=max(1, min(b["k"], V)))
    return a, dict(rows=rows, V=V, dtype=dt)


def build_path(b):
    g = gen(b["seed"])
    R, P, K, r = b["R"], b["P"], b["K"], b["r"]
    V = max(b["V"], K)
    dt = DTYPES[b["dtype"]]
    it = idx_dtype(b)
    if V > 0 and K > 0:
        cand = torch.stack(
            [torch.randperm(V, generator=g)[:K] for _ in range(R * P)] or [torch.zeros(K, dtype=torch.int64)]
        )[: R * P]
    else:
        cand = torch.zeros(R * P, K, dtype=torch.int64)
    temps = (list(b["temps"]) + [1.0] * R)[:R]
    a = dict(
        cand_ids=cand.reshape(R, P, K).to(it),
        unary=torch.randn(R, P, K, generator=g),
        a_emb=torch.randn(V, r, generator=g).to(dt),
        b_emb=torch.randn(V, r, generator=g).to(dt),
        g=None,
        anchor=torch.randint(0, max(V, 1), (R,), generator=g).to(it),
        mode=b["mode"],
        temperature=torch.tensor(temps, dtype=torch.float32),
        seeds=torch.arange(R, dtype=torch.int64) + b["seed"] % 1000,
        offsets=torch.full((R,), 5, dtype=torch.int64),
        hidden=None,
        g_weight=None,
    )
    if b["fused_g"]:
        a["hidden"] = torch.randn(R, P, b["Dh"], generator=g).to(dt)
        a["g_weight"] = (0.3 * torch.randn(r, b["Dh"], generator=g)).to(dt)
    else:
        a["g"] = (0.5 * torch.randn(R, P, r, generator=g)).to(dt)
    return a, dict(R=R, P=P, K=K, V=V, r=r, mode=b["mode"], temps=temps, dtype=dt)


def build_markov(b):
    g = gen(b["seed"])
    B, V, r, H = b["B"], b["V"], b["r"], b["H"]
    dt = DTYPES[b["dtype"]]

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dt)

    temps = (list(b["temps"]) + [1.0] * B)[:B]
    a = dict(
        base_logits=rnd(B, V, scale=2.0),
        prev_tokens=torch.randint(0, max(V, 1), (B,), generator=g).to(idx_dtype(b)),
        w1=rnd(V, r, scale=0.5),
        w2=rnd(V, r, scale=0.5),
        hidden=rnd(B, H),
        conf_w=rnd(H + r, scale=0.3),
        conf_b=torch.tensor([0.1]),
        temperature=torch.tensor(temps, dtype=torch.float32),
        seeds=torch.arange(B, dtype=torch.int64) * 31 + b["seed"] % 1000,
        positions=torch.arange(B, dtype=torch.int64) + 100,
        bias=rnd(V, scale=0.1) if b["bias"] else None,
    )
    return a, dict(B=B, V=V, r=r, H=H, temps=temps, dtype=dt)


BUILDERS = {
    "verify": build_verify,
    "verify_out": build_verify_out,
    "tree_verify": build_tree_verify,
    "tree_verify_out": build_tree_verify_out,
    "block_diffusion_attention": build_attention,
    "inject_context_kv": build_inject,
    "two_tap_conv": build_conv,
    "topk_select": build_topk,
    "path_select": build_path,
    "markov_step": build_markov,
}


# ---------------------------------------------------------------- needs: base tweaks that make a mutation apply


def _need_all_drafts(b):
    b["num_draft"] = [max(1, n) for n in b["num_draft"]]


def _need_sampled(b):
    b["temps"] = [t if t >= GREEDY_FLOOR else 1.0 for t in b["temps"]]


NEEDS = {
    # verify / verify_out
    "drafts": _need_all_drafts,
    "B2": lambda b: b.update(num_draft=(list(b["num_draft"]) + [1, 2])[: max(2, len(b["num_draft"]))]),
    "dense": lambda b: b.update(q_mode="dense", V=max(b["V"], 1)),
    "sparse": lambda b: b.update(q_mode="sparse", V=max(b["V"], 1)),
    "K2": lambda b: b.update(K=max(b["K"], 2), V=max(b["V"], 2)),
    "V2": lambda b: b.update(V=max(b["V"], 2)),
    "sampled": _need_sampled,
    "f32": lambda b: b.update(dtype="float32"),
    "bonus": lambda b: b.update(bonus=True, V=max(b["V"], 1)),
    "probs": lambda b: b.update(probs=True, V=max(b["V"], 1)),
    # tree_verify / tree_verify_out
    "tree_B2": lambda b: b.update(num_nodes=(list(b["num_nodes"]) + [2, 3])[: max(2, len(b["num_nodes"]))]),
    "tree_nodes2": lambda b: b.update(num_nodes=[max(2, b["num_nodes"][0])] + list(b["num_nodes"][1:])),
    "tree_nodes3": lambda b: b.update(num_nodes=[max(3, b["num_nodes"][0])] + list(b["num_nodes"][1:])),
    "tree_second2": lambda b: b.update(
        num_nodes=[b["num_nodes"][0], max(2, (list(b["num_nodes"]) + [2])[1])] + list(b["num_nodes"][2:])
    ),
    "tree_pad": lambda b: b.update(pad=True, num_nodes=[max(3, b["num_nodes"][0])] + list(b["num_nodes"][1:])),
    # attention
    "unread": lambda b: b.update(ctx=[min(c, 3) for c in b["ctx"]], S_extra=max(b["S_extra"], 1)),
    "ctx1": lambda b: b.update(ctx=[max(c, 1) for c in b["ctx"]]),
    # two_tap_conv
    "taps_delta": lambda b: b.update(taps="delta"),
    "taps_weight": lambda b: b.update(taps="delta_weight"),
    "taps_finish": lambda b: b.update(taps="finish"),
    "rows2": lambda b: b.update(rows=max(b["rows"], 2)),
    "groups2": lambda b: b.update(C=max(b["C"], 2 * b.get("group", 16))),
    "ragged": lambda b: b.update(ragged=True),
    "fixed": lambda b: b.update(ragged=False),
    "residual": lambda b: b.update(residual=True),
    "norm": lambda b: b.update(norm=True),
    # path_select
    "sample": lambda b: b.update(mode="sample"),
    "plain_g": lambda b: b.update(fused_g=False),
    "fused_g": lambda b: b.update(fused_g=True),
    # markov_step
    "bias": lambda b: b.update(bias=True),
}


def apply_needs(base, needs):
    b = json.loads(json.dumps(base))
    for n in needs:
        (n if callable(n) else NEEDS[n])(b)
    return b


# ---------------------------------------------------------------- generic mutation helpers


def _tensor(a, arg):
    t = a.get(arg)
    return t if isinstance(t, torch.Tensor) else None


def m_dtype(dt):
    def f(a, m, rng, arg):
        t = _tensor(a, arg)
        if t is None:
            return None
        a[arg] = t.to(dt)
        return a

    return f


def m_other_float(a, m, rng, arg):
    t = _tensor(a, arg)
    if t is None:
        return None
    a[arg] = t.to(other_float(t.dtype))
    return a


def m_unsqueeze(a, m, rng, arg):
    t = _tensor(a, arg)
    if t is None:
        return None
    a[arg] = t.unsqueeze(0)
    return a


def m_drop(a, m, rng, arg):
    t = _tensor(a, arg)
    if t is None or t.dim() == 0:
        return None
    a[arg] = t.select(0, 0) if t.shape[0] > 0 else torch.zeros(t.shape[1:], dtype=t.dtype)
    return a


def m_grow(dim):
    def f(a, m, rng, arg):
        t = _tensor(a, arg)
        if t is None or t.dim() == 0:
            return None
        d = dim % t.dim()
        extra = (
            t.narrow(d, t.shape[d] - 1, 1)
            if t.shape[d] > 0
            else torch.zeros(t.shape[:d] + (1,) + t.shape[d + 1 :], dtype=t.dtype)
        )
        a[arg] = torch.cat([t, extra], dim=d)
        return a

    return f


def m_shrink(dim):
    def f(a, m, rng, arg):
        t = _tensor(a, arg)
        if t is None or t.dim() == 0:
            return None
        d = dim % t.dim()
        if t.shape[d] == 0:
            return None
        a[arg] = t.narrow(d, 0, t.shape[d] - 1)
        return a

    return f


def _garbage(t):
    return float("nan") if t.is_floating_point() else GARBAGE_INT if t.dtype != torch.bool else True


def m_wide(a, m, rng, arg):
    """The same values as a slice of a wider buffer (padded in the last dim, NaN / huge ints in the gaps)."""
    t = _tensor(a, arg)
    if t is None or t.dim() == 0:
        return None
    buf = torch.full(t.shape[:-1] + (t.shape[-1] + 3,), _garbage(t), dtype=t.dtype)
    view = buf[..., 1 : 1 + t.shape[-1]]
    view.copy_(t)
    a[arg] = view
    m.setdefault("guards", {})[arg] = (buf, buf.clone(), view)
    return a


def m_step(a, m, rng, arg):
    """The same values at every other position of dim 0 of a buffer."""
    t = _tensor(a, arg)
    if t is None or t.dim() == 0:
        return None
    buf = torch.full((2 * t.shape[0],) + t.shape[1:], _garbage(t), dtype=t.dtype)
    view = buf[::2]
    view.copy_(t)
    a[arg] = view
    m.setdefault("guards", {})[arg] = (buf, buf.clone(), view)
    return a


def m_transposed(a, m, rng, arg):
    """The same values, column-major (the last dim is not dense)."""
    t = _tensor(a, arg)
    if t is None or t.dim() < 2:
        return None
    a[arg] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return a


def m_expand(a, m, rng, arg):
    """Slice 0 of dim 0 broadcast over dim 0 (a stride-0 view; values change)."""
    t = _tensor(a, arg)
    if t is None or t.dim() == 0 or t.shape[0] == 0:
        return None
    a[arg] = t.narrow(0, 0, 1).expand(t.shape)
    if t.shape[0] == 1:
        m["expand_noop"] = True  # a size-1 dim "expanded" to size 1: no element repeats
    return a


def m_meta(a, m, rng, arg):
    t = _tensor(a, arg)
    if t is None:
        return None
    a[arg] = t.to("meta")
    if not any(isinstance(v, torch.Tensor) for k, v in a.items() if k != arg):
        m["expect"] = "ok"  # every tensor of the call on meta: the fake's shapes must match the kernel's
        m["meta_call"] = True
    return a


def m_set_scalar(value):
    def f(a, m, rng, arg):
        a[arg] = value
        return a

    return f


def m_set_elem(value, where=None, wide=False):
    """Set one element (random, or ``where(a, m, rng)`` giving an index tuple) to value;
    ``wide``: first widen the tensor to int64 so that value fits."""

    def f(a, m, rng, arg):
        t = _tensor(a, arg)
        if t is None:
            return None
        if where is None:
            if t.numel() == 0:
                return None
            idx = tuple(rng.randrange(s) for s in t.shape)
        else:
            idx = where(a, m, rng)
            if idx is None:
                return None
        t = t.to(torch.int64) if wide else t.clone()
        v = value(t, idx, m) if callable(value) else value
        t[idx] = v
        m["bad_index"] = idx
        if (
            t.is_floating_point()
            and t[idx].numel() == 1
            and math.isfinite(float(v))
            and not math.isfinite(float(t[idx]))
        ):
            m["overflowed"] = True  # e.g. 1e38 in float16 is +inf
        a[arg] = t
        return a

    return f


def wrapped(t, idx, m):
    return int(t[idx]) + BIG


# ---------------------------------------------------------------- mutation tables

FLOAT_BAD_DTYPES = [("float64", torch.float64), ("int16", torch.int16), ("bool", torch.bool), ("int32", torch.int32)]
INDEX_BAD_DTYPES = [
    ("float64", torch.float64),
    ("int16", torch.int16),
    ("bool", torch.bool),
    ("float32", torch.float32),
]
INT64_BAD_DTYPES = [("int32", torch.int32), ("float64", torch.float64), ("bool", torch.bool)]


def _flip_index(a, m, rng, arg):
    t = _tensor(a, arg)
    if t is None:
        return None
    a[arg] = t.to(torch.int32 if t.dtype == torch.int64 else torch.int64)
    return a


def generic(table, spec, overrides=None, needs=None):
    """Mutations common to every tensor argument: dtype, rank, shape, stride, device.

    spec: {arg: (kind, rank)}, kind in "float", "index", "int64", "temp" (inputs), "out"
    (int32 outputs), "fout" (float outputs); rank: the argument's least rank (dim -1
    mutations need 2). overrides: {mutation id: expect, or (expect, needs), or None to
    leave the mutation out} for the combinations the contract makes valid (or is silent
    on); needs: {arg: needs} for optional arguments.
    """
    overrides = overrides or {}
    needs = needs or {}
    for arg, (kind, rank) in spec.items():
        bad = {
            "float": FLOAT_BAD_DTYPES,
            "index": INDEX_BAD_DTYPES,
            "int64": INT64_BAD_DTYPES,
            "temp": FLOAT_BAD_DTYPES,
            "out": [("int64", torch.int64), ("float32", torch.float32)],
            "fout": FLOAT_BAD_DTYPES,
        }[kind]
        muts = {f"dtype:{arg}:{name}": (m_dtype(dt), "error") for name, dt in bad}
        if kind == "index":
            muts[f"dtype:{arg}:int32-int64"] = (_flip_index, "ok")
        muts[f"rank:{arg}:unsqueeze"] = (m_unsqueeze, "error")
        muts[f"rank:{arg}:drop"] = (m_drop, "error")
        muts[f"shape:{arg}:grow0"] = (m_grow(0), "error")
        muts[f"shape:{arg}:shrink0"] = (m_shrink(0), "error")
        if rank >= 2:
            muts[f"shape:{arg}:grow-1"] = (m_grow(-1), "error")
            muts[f"shape:{arg}:shrink-1"] = (m_shrink(-1), "error")
        output = kind in ("out", "fout")
        muts[f"stride:{arg}:wide"] = (m_wide, "error" if output and rank >= 2 else "ok")
        muts[f"stride:{arg}:step"] = (m_step, "error" if output else "ok")
        if rank >= 2:
            muts[f"stride:{arg}:transposed"] = (m_transposed, "error" if output else "ok")
        muts[f"stride:{arg}:expand"] = (m_expand, "error" if output else "ok")
        muts[f"device:{arg}:meta"] = (m_meta, "error")
        for mid, (fn, expect) in muts.items():
            nd = tuple(needs.get(arg, ()))
            expect = overrides.get(mid, expect)
            if expect is None:
                continue
            if isinstance(expect, tuple):
                expect, more = expect
                nd += tuple(more)
            table[mid] = Mutation(arg, (lambda fn_, arg_: lambda a, m, rng: fn_(a, m, rng, arg_))(fn, arg), expect, nd)


def add(table, mid, arg, fn, expect, needs=(), takes_arg=True):
    call = (lambda a, m, rng: fn(a, m, rng, arg)) if takes_arg else fn
    table[mid] = Mutation(arg, call, expect, tuple(needs))


def add_index_values(table, arg, upper, needs=(), low=-2):
    """-2, the upper bound, 2**32 + 3 and 2**32 + a valid value (int64) into one element."""
    add(table, f"value:{arg}:{low}", arg, m_set_elem(low), "error", needs)
    add(table, f"value:{arg}:upper", arg, m_set_elem(lambda t, i, m: upper(m)), "error", needs)
    add(table, f"value:{arg}:2**32+3", arg, m_set_elem(BIG + 3, wide=True), "error", needs)
    add(table, f"value:{arg}:2**32+valid", arg, m_set_elem(wrapped, wide=True), "error", needs)


def add_python_ints(table, arg, values, needs=()):
    for label, value, expect in values:
        add(table, f"size:{arg}:{label}", arg, m_set_scalar(value), expect, needs)


def add_scalar_floats(table, arg, expect_of, needs=()):
    for label, value in [
        ("nan", float("nan")),
        ("+inf", float("inf")),
        ("-inf", float("-inf")),
        ("-1", -1.0),
        ("0", 0.0),
        ("1e-38", 1e-38),
        ("1e38", 1e38),
    ]:
        e = expect_of(label)
        if e is not None:
            add(table, f"scalar:{arg}:{label}", arg, m_set_scalar(value), e, needs)


def add_empty(table, arg, label, changes, expect, needs=()):
    """A zero-size dimension: the base is rebuilt with the sizes in ``changes``."""

    def change(b, c=changes):
        b.update(c(b) if callable(c) else c)

    table[f"empty:{label}"] = Mutation(arg, lambda a, m, rng: a, expect, tuple(needs) + (change,))


def add_temperature(table, arg="temperature", needs=()):
    """temperature: NaN / +-inf / negative are errors; a tiny one is greedy."""
    for label, value in [("nan", float("nan")), ("+inf", float("inf")), ("-inf", float("-inf")), ("-0.5", -0.5)]:
        cls = "nonfinite" if label != "-0.5" else "value"
        add(table, f"{cls}:{arg}:{label}", arg, m_set_elem(value), "error", needs)
    add(table, f"value:{arg}:1e-38", arg, m_set_elem(1e-38), "ok", needs)
    add(table, f"value:{arg}:-0.0", arg, m_set_elem(-0.0), "ok", needs)
    add(table, f"value:{arg}:9e-6", arg, m_set_elem(9e-6), "ok", needs)


# verify ------------------------------------------------------------------------------------


def _first_row(m, rng):
    """The first logit row of a random request: the walk always reads it."""
    if m["B"] == 0:
        return None
    b = rng.randrange(m["B"])
    return m["cu"][b] + b


def _logit_at(value, whole_row=False, row_of=_first_row):
    def where(a, m, rng):
        row = row_of(m, rng)
        if row is None or m["V"] == 0:
            return None
        return (row, slice(None)) if whole_row else (row, rng.randrange(m["V"]))

    def f(a, m, rng, arg):
        out = m_set_elem(value, where)(a, m, rng, arg)
        if out is None:
            return None
        t = out[arg]
        stored = float(t[m["bad_index"]]) if not whole_row else value
        if not whole_row and stored == float("-inf"):  # -inf, or -1e38 stored as -inf in float16
            row_dead = bool(torch.isneginf(t.float()).all(dim=-1).any())
            m["expect"] = "error" if row_dead else "ok"
        elif m.get("overflowed"):
            m["expect"] = "error"  # 1e38 stored as +inf in float16
        return out

    return f


def _q_of_first_draft(value):
    """Set q(draft) of the first draft of a sampled request (dense or sparse q)."""

    def f(a, m, rng):
        bs = [b for b in range(m["B"]) if m["temps"][b] >= GREEDY_FLOOR and m["n"][b] > 0]
        if not bs:
            return None
        b = rng.choice(bs)
        m["bad_request"] = b
        row = m["cu"][b]
        x = int(a["draft_tokens"][row])
        t = a["draft_probs"].clone()
        if a["draft_probs_ids"] is None:
            t[row, x] = value
        else:
            col = int((a["draft_probs_ids"][row].long() == x).nonzero()[0])
            t[row, col] = value
        a["draft_probs"] = t
        return a

    return f


def _q_of_other_id(value):
    """Set q at another id of the first draft row of a sampled request: read only if that draft is
    rejected (the residual row), so the call must fail exactly when the walk rejects it."""

    def f(a, m, rng):
        bs = [b for b in range(m["B"]) if m["temps"][b] >= GREEDY_FLOOR and m["n"][b] > 0]
        if not bs:
            return None
        b = rng.choice(bs)
        row = m["cu"][b]
        x = int(a["draft_tokens"][row])
        t = a["draft_probs"].clone()
        ids = a["draft_probs_ids"]
        cols = [c for c in range(t.shape[1]) if (int(ids[row, c]) if ids is not None else c) != x]
        if not cols:
            return None
        t[row, rng.choice(cols)] = value
        a["draft_probs"] = t
        m["bad_request"] = b
        m["q_row_read_fails"] = b
        return a

    return f


def _p_of_first_draft(value):
    """On probabilities: set p(draft) of the first draft of a sampled request, which the accept
    test reads, so the call must fail."""

    def f(a, m, rng):
        bs = [b for b in range(m["B"]) if m["temps"][b] >= GREEDY_FLOOR and m["n"][b] > 0]
        if not bs:
            return None
        b = rng.choice(bs)
        x = int(a["draft_tokens"][m["cu"][b]])
        if x < 0:
            return None
        t = a["target_logits"].clone()
        t[m["cu"][b] + (b if a.get("bonus_tokens") is None else 0), x] = value
        a["target_logits"] = t
        m["bad_request"] = b
        return a

    return f


def _probs_temperature(a, m, rng):
    """On probabilities: a temperature other than 0 or 1 (probabilities come tempered)."""
    if m["B"] == 0:
        return None
    b = rng.randrange(m["B"])
    t = a["temperature"].clone()
    t[b] = 0.5
    a["temperature"] = t
    m["bad_request"] = b
    return a


def _with_bonus_rows(a, m, rng, arg):
    """Bonus tokens given, yet the logits keep one row per request more than the drafts."""
    logits = a["target_logits"]
    return dict(a, target_logits=torch.cat([logits, logits.new_zeros(m["B"], logits.shape[1])]))


def _expand_drafts(a, m, rng, arg):
    """Every draft equal to the first one: valid, though with sparse q a draft may no longer be listed."""
    if m["q_mode"] == "sparse":
        m["expect"] = "either"
    return m_expand(a, m, rng, arg)


def _duplicate_sparse_id(a, m, rng, arg):
    """Sparse q listing one id twice (contract: q(x) is the sum of its probs)."""
    ids = a["draft_probs_ids"]
    if ids is None or ids.shape[0] == 0 or ids.shape[1] < 2:
        return None
    ids = ids.clone()
    row = rng.randrange(ids.shape[0])
    draft = int(a["draft_tokens"][row])
    j = next(c for c in range(ids.shape[1]) if int(ids[row, c]) != draft)  # keep the draft listed
    ids[row, j] = ids[row, (j + 1) % ids.shape[1]]
    a["draft_probs_ids"] = ids
    return a


def _cu_change(kind):
    def f(a, m, rng, arg):
        cu = a["cu_num_draft"].clone()
        if kind == "decreasing":
            if cu.numel() < 3:
                return None
            cu[1] = cu[2] + 1
        elif kind == "first":
            cu[0] = 1
        elif kind == "last":
            cu[-1] = cu[-1] - 1
        elif kind == "wrap":
            cu = cu.long()
            cu[-1] += BIG
        a["cu_num_draft"] = cu
        return a

    return f


def verify_mutations(out_variant=False):
    t = {}
    spec = dict(
        target_logits=("float", 2),
        draft_tokens=("index", 1),
        cu_num_draft=("index", 1),
        temperature=("temp", 1),
        seeds=("int64", 1),
        offsets=("int64", 1),
        draft_probs=("float", 2),
        draft_probs_ids=("index", 2),
        bonus_tokens=("index", 1),
    )
    ov = {
        # one more / one less vocabulary column: valid unless a dense q or a draft pins V
        "shape:target_logits:grow-1": "either",
        "shape:target_logits:shrink-1": "either",
        "stride:cu_num_draft:expand": ("error", ("drafts",)),  # cu all equal to cu[0]: sums to 0 != T
        "stride:draft_probs_ids:expand": "either",  # drafts may fall outside the listed ids (q(draft) = 0)
        "stride:draft_tokens:expand": None,  # see below
    }
    needs = {
        "draft_probs": ("dense", "drafts"),
        "draft_probs_ids": ("sparse", "drafts"),
        "draft_tokens": ("drafts",),
        "bonus_tokens": ("bonus",),
    }
    generic(t, spec, ov, needs)
    t["valid"] = Mutation("", lambda a, m, rng: a, "ok")
    add(t, "stride:draft_tokens:expand", "draft_tokens", _expand_drafts, "ok", ("drafts",))
    # values
    add_index_values(t, "draft_tokens", lambda m: m["V"], ("drafts",))
    add(t, "value:draft_tokens:placeholder", "draft_tokens", m_set_elem(-1), "ok", ("drafts",))  # vLLM's -1
    # the caller's bonus tokens: valid, out of range (-1 is no placeholder there), or with bonus rows kept
    add(t, "valid:bonus_tokens", "bonus_tokens", lambda a, m, rng, arg: a, "ok", ("bonus",))
    add_index_values(t, "bonus_tokens", lambda m: m["V"], ("bonus",), low=-1)
    add(t, "shape:target_logits:bonus-rows", "target_logits", _with_bonus_rows, "error", ("bonus",))
    # probabilities instead of logits: valid as given (with the caller's bonus tokens too); a p(draft)
    # read that is not a probability, a row with no mass, or a temperature other than 0 / 1 fail
    add(t, "valid:target_is_probs", "target_logits", lambda a, m, rng, arg: a, "ok", ("probs",))
    add(t, "valid:target_is_probs-bonus", "target_logits", lambda a, m, rng, arg: a, "ok", ("probs", "bonus"))
    for label, value in [("nan", float("nan")), ("-0.5", -0.5), ("1.5", 1.5)]:
        cls = "value" if label != "nan" else "nonfinite"
        add(
            t,
            f"{cls}:target_logits:probs-{label}",
            "target_logits",
            _p_of_first_draft(value),
            "error",
            ("probs", "drafts", "sampled"),
            takes_arg=False,
        )
    add(t, "value:target_logits:probs-zero-row", "target_logits", _logit_at(0.0, whole_row=True), "error", ("probs",))
    add(t, "value:temperature:probs-0.5", "temperature", _probs_temperature, "error", ("probs",), takes_arg=False)
    add_index_values(t, "draft_probs_ids", lambda m: m["V"], ("drafts", "sparse"))
    add(t, "value:draft_probs_ids:duplicate", "draft_probs_ids", _duplicate_sparse_id, "ok", ("drafts", "sparse", "K2"))
    for kind in ["decreasing", "first", "last", "wrap"]:
        add(t, f"value:cu_num_draft:{kind}", "cu_num_draft", _cu_change(kind), "error", ("drafts", "B2"))
    add(t, "value:seeds:-1", "seeds", m_set_elem(-1), "ok")
    add(t, "value:offsets:-1", "offsets", m_set_elem(-1), "ok")
    add(t, "value:offsets:2**40", "offsets", m_set_elem(2**40), "ok")
    add_temperature(t)
    # logits: NaN / +inf are errors in a row the walk reads, -inf is a mask, any finite magnitude is fine
    for label, value, expect in [
        ("nan", float("nan"), "error"),
        ("+inf", float("inf"), "error"),
        ("-inf", float("-inf"), "ok"),
        ("1e38", 1e38, "ok"),
        ("-1e38", -1e38, "ok"),
    ]:
        add(t, f"nonfinite:target_logits:{label}", "target_logits", _logit_at(value), expect)
    add(t, "nonfinite:target_logits:-inf-row", "target_logits", _logit_at(float("-inf"), whole_row=True), "error")
    add(t, "nonfinite:target_logits:nan-row", "target_logits", _logit_at(float("nan"), whole_row=True), "error")
    # q(draft) of a sampled request outside [0, 1] or non-finite
    for q_mode in ["dense", "sparse"]:
        for label, value in [
            ("nan", float("nan")),
            ("+inf", float("inf")),
            ("-inf", float("-inf")),
            ("1e38", 1e38),
            ("-0.5", -0.5),
            ("1.5", 1.5),
        ]:
            cls = "value" if label in ("-0.5", "1.5") else "nonfinite"
            add(
                t,
                f"{cls}:draft_probs:{label}-{q_mode}",
                "draft_probs",
                _q_of_first_draft(value),
                "error",
                ("drafts", "sampled", q_mode),
                takes_arg=False,
            )
        for label, value in [("nan", float("nan")), ("-0.5", -0.5), ("1.5", 1.5)]:
            cls = "value" if label != "nan" else "nonfinite"
            add(
                t,
                f"{cls}:draft_probs:{label}-residual-row-{q_mode}",
                "draft_probs",
                _q_of_other_id(value),
                "either",
                ("drafts", "sampled", q_mode, "V2", "K2"),
                takes_arg=False,
            )
    # python ints (verify_out: with out_tokens of the matching width where one can be allocated)
    for label, value, expect in [
        ("-1", lambda a, m: -1, "error"),
        ("2**31", lambda a, m: 2**31, "error"),
        ("2**32+3", lambda a, m: 2**32 + 3, "error"),
        ("4097", lambda a, m: 4097, "error"),
        ("2**63-1", lambda a, m: 2**63 - 1, "error"),
        ("4096", lambda a, m: 4096, "ok"),
        ("below-max-n", lambda a, m: max(m["n"]) - 1, "error"),
        ("above", lambda a, m: a["max_spec_len"] + 5, "ok"),
        ("0", _zero_spec_len, "error"),
    ]:
        add(
            t,
            f"size:max_spec_len:{label}",
            "max_spec_len",
            _max_spec_len(value, out_variant),
            expect,
            ("drafts",) if label == "below-max-n" else (),
            takes_arg=False,
        )
    # empty dims
    add_empty(t, "cu_num_draft", "requests=0", {"num_draft": []}, "ok")
    add_empty(t, "draft_tokens", "drafts=0", lambda b: {"num_draft": [0] * len(b["num_draft"])}, "ok")
    add_empty(t, "target_logits", "vocab=0", {"V": 0, "q_mode": "onehot"}, "error", ("drafts",))
    # aliasing between inputs: read-only, so valid
    add(t, "alias:offsets:seeds", "offsets", lambda a, m, rng: dict(a, offsets=a["seeds"]), "ok", takes_arg=False)
    if out_variant:
        # documented as contiguous: a strided out may be rejected, or written through the view
        generic(
            t,
            dict(out_tokens=("out", 2), out_num_accepted=("out", 1)),
            {
                "stride:out_num_accepted:wide": "ok",
                "stride:out_tokens:wide": "either",
                "stride:out_tokens:step": "either",
                "stride:out_tokens:transposed": "either",
                "stride:out_num_accepted:step": "either",
            },
        )
        add(
            t,
            "size:max_spec_len:out-width-mismatch",
            "out_tokens",
            lambda a, m, rng: dict(a, max_spec_len=a["max_spec_len"] + 1),
            "error",
            takes_arg=False,
        )
        add(
            t,
            "alias:out_num_accepted:out_tokens",
            "out_num_accepted",
            lambda a, m, rng: dict(a, out_num_accepted=a["out_tokens"].view(-1)[: m["B"]]),
            "error",
            takes_arg=False,
        )
        add(t, "alias:out_tokens:out_num_accepted", "out_tokens", _alias_out_tokens_over_acc, "error", takes_arg=False)
        add(
            t,
            "alias:out_tokens:target_logits",
            "out_tokens",
            _alias_out_over_logits,
            "error",
            ("f32",),
            takes_arg=False,
        )
        add(
            t,
            "alias:out_tokens:draft_tokens",
            "out_tokens",
            _alias_out_over_drafts,
            "error",
            ("drafts",),
            takes_arg=False,
        )
        add(t, "alias:out_num_accepted:cu_num_draft", "out_num_accepted", _alias_acc_over_cu, "error", takes_arg=False)
        add(t, "alias:out_tokens:disjoint-views-of-one-buffer", "out_tokens", _disjoint_outs, "ok", takes_arg=False)
    return t


def _zero_spec_len(a, m):
    """max_spec_len 0: valid exactly when no request has a draft."""
    if max(m["n"], default=0) == 0:
        m["expect"] = "ok"
    return 0


def _max_spec_len(value, out_variant):
    def f(a, m, rng):
        a["max_spec_len"] = value(a, m)
        if out_variant and 0 <= a["max_spec_len"] <= 2 * 4096:
            a["out_tokens"] = torch.full((m["B"], a["max_spec_len"] + 1), 123, dtype=torch.int32)
        return a

    return f


def _alias_out_tokens_over_acc(a, m, rng):
    B, W = m["B"], a["max_spec_len"] + 1
    buf = torch.full((B * W + B,), 5, dtype=torch.int32)
    a["out_tokens"] = buf[: B * W].view(B, W)
    a["out_num_accepted"] = buf[B * W - B : B * W] if B else buf[:0]
    if B == 0:
        return None
    return a


def _disjoint_outs(a, m, rng):
    """Both outputs carved from one buffer without overlap: valid."""
    B, W = m["B"], a["max_spec_len"] + 1
    buf = torch.full((B * W + B,), 5, dtype=torch.int32)
    a["out_tokens"] = buf[: B * W].view(B, W)
    a["out_num_accepted"] = buf[B * W :]
    return a


def _alias_out_over_logits(a, m, rng):
    """out_tokens as the int32 view of the start of the logits' float32 storage."""
    B, W = m["B"], a["max_spec_len"] + 1
    lg = a["target_logits"]
    if lg.dtype != torch.float32 or lg.numel() == 0 or B == 0:
        return None
    buf = torch.zeros(max(lg.numel(), B * W), dtype=torch.float32)
    buf[: lg.numel()] = lg.reshape(-1)
    a["target_logits"] = buf[: lg.numel()].view(lg.shape)
    a["out_tokens"] = buf.view(torch.int32)[: B * W].view(B, W)
    return a


def _alias_out_over_drafts(a, m, rng):
    B, W = m["B"], a["max_spec_len"] + 1
    T = m["T"]
    if T == 0 or B * W < T:
        return None
    out = torch.zeros(B, W, dtype=torch.int32)
    out.view(-1)[:T] = a["draft_tokens"].to(torch.int32)
    a["draft_tokens"] = out.view(-1)[:T]
    a["out_tokens"] = out
    return a


def _alias_acc_over_cu(a, m, rng):
    B = m["B"]
    if B == 0:
        return None
    buf = a["cu_num_draft"].to(torch.int32).clone()
    a["cu_num_draft"] = buf
    a["out_num_accepted"] = buf[:B]
    return a


# tree_verify -------------------------------------------------------------------------------


def _root_row(m, rng):
    """The root row of a random request: every walk reads it."""
    if m["B"] == 0:
        return None
    return m["cu"][rng.randrange(m["B"])]


def _padding_row(m, rng):
    """The row of request 0's last node when it is padding (parents -1): never read."""
    if m["B"] == 0 or m["n"][0] < 2 or m["parents"][m["cu"][1] - 1] != -1:
        return None
    return m["cu"][1] - 1


def _tree_shrink_vocab(a, m, rng, arg):
    """One vocabulary column less: valid unless a node's token is the last id."""
    out = m_shrink(-1)(a, m, rng, arg)
    if out is None:
        return None
    V = out[arg].shape[-1]
    tokens = a["node_tokens"]
    m["expect"] = "error" if V == 0 or (tokens.numel() and int(tokens.max()) >= V) else "ok"
    return out


def _tree_parent(kind):
    """parents made invalid in one request: a parent listed after its child, a parent in the request
    before, a root given a parent (the previous request's last node), a node its own parent."""

    def f(a, m, rng, arg):
        cu, n, B = m["cu"], m["n"], m["B"]
        least = 3 if kind == "after" else 2
        bs = [b for b in range(B) if (kind == "root" or n[b] >= least) and (b >= 1 or kind in ("after", "self"))]
        if not bs:
            return None
        b = rng.choice(bs)
        lo, hi = cu[b], cu[b + 1]
        par = a["parents"].clone()
        if kind == "root":
            i, parent = lo, lo - 1
        elif kind == "after":
            i = rng.randrange(lo + 1, hi - 1)
            parent = rng.randrange(i + 1, hi)
        elif kind == "other":
            i, parent = rng.randrange(lo + 1, hi), rng.randrange(cu[b - 1], lo)
        else:  # "self"
            i = rng.randrange(lo + 1, hi)
            parent = i
        par[i] = parent
        a["parents"] = par
        m["bad_request"] = b
        return a

    return f


def _tree_make_padding(a, m, rng, arg):
    """A non-root node turned into padding (parents -1): valid, its subtree is cut off."""
    nodes = [i for b in range(m["B"]) for i in range(m["cu"][b] + 1, m["cu"][b + 1]) if m["parents"][i] != -1]
    if not nodes:
        return None
    par = a["parents"].clone()
    par[rng.choice(nodes)] = -1
    a["parents"] = par
    return a


def _tree_cu_change(kind):
    def f(a, m, rng, arg):
        cu = a["cu_num_nodes"].clone()
        if kind == "decreasing":
            if cu.numel() < 3:
                return None
            cu[1] = cu[2] + 1
        elif kind == "first":
            cu[0] = 1
        elif kind == "last":
            cu[-1] = cu[-1] - 1
        elif kind == "wrap":
            cu = cu.long()
            cu[-1] += BIG
        elif kind == "empty-request":  # request b holds no node (not even its root)
            B = cu.numel() - 1
            if B == 0:
                return None
            b = rng.randrange(max(B - 1, 1))
            cu[b + 1] = cu[b]
            m["bad_request"] = b
        a["cu_num_nodes"] = cu
        return a

    return f


def _tree_p_of_first_child(value):
    """On probabilities: set p at the token of the root's first child in a sampled request; the walk
    reads it (the running sum starts there), so the call must fail."""

    def f(a, m, rng):
        bs = [b for b in range(m["B"]) if m["temps"][b] >= GREEDY_FLOOR and m["n"][b] >= 2]
        if not bs:
            return None
        b = rng.choice(bs)
        lo = m["cu"][b]
        t = a["target_logits"].clone()
        t[lo, int(a["node_tokens"][lo + 1])] = value  # node lo + 1 is a child of the root (the builder)
        a["target_logits"] = t
        m["bad_request"] = b
        return a

    return f


def _tree_max_depth(value, out_variant):
    def f(a, m, rng):
        a["max_depth"] = value(a, m)
        if out_variant and 0 <= a["max_depth"] <= 2 * 4096:
            W = a["max_depth"] + 1
            a["out_accepted_nodes"] = torch.full((m["B"], W), 123, dtype=torch.int32)
            a["out_tokens"] = torch.full((m["B"], W), 123, dtype=torch.int32)
        return a

    return f


def _tree_node(a, m, rng):
    """A random node inside a tree (a root, or a node with a parent): its token is checked."""
    nodes = [i for i, p in enumerate(m["parents"]) if p != -1 or i in m["cu"][:-1]]
    return (rng.choice(nodes),) if nodes else None


def _padding_node(a, m, rng):
    nodes = [i for i, p in enumerate(m["parents"]) if p == -1 and i not in m["cu"][:-1]]
    return (rng.choice(nodes),) if nodes else None


def _zero_depth(a, m):
    """max_depth 0: valid exactly when no tree has a node below its root."""
    if m["deepest"] == 0:
        m["expect"] = "ok"
    return 0


def tree_verify_mutations(out_variant=False):
    t = {}
    spec = dict(
        target_logits=("float", 2),
        node_tokens=("index", 1),
        parents=("index", 1),
        cu_num_nodes=("index", 1),
        temperature=("temp", 1),
        seeds=("int64", 1),
        offsets=("int64", 1),
    )
    ov = {
        "shape:target_logits:grow-1": "ok",  # one more vocabulary column: every token still in range
        "shape:target_logits:shrink-1": None,  # see below
        "stride:cu_num_nodes:expand": "error",  # cu all 0: the requests own no node
    }
    generic(t, spec, ov)
    t["valid"] = Mutation("", lambda a, m, rng: a, "ok")
    add(t, "shape:target_logits:shrink-1", "target_logits", _tree_shrink_vocab, "ok")
    # values: tokens out of range; parents out of range or breaking the tree; a padding node is valid
    # a tree node's token out of range fails its request; a padding node's is never read
    for label, value, wide in [
        ("-2", -2, False),
        ("upper", lambda t, i, m: m["V"], False),
        ("2**32+3", BIG + 3, True),
        ("2**32+valid", wrapped, True),
    ]:
        add(t, f"value:node_tokens:{label}", "node_tokens", m_set_elem(value, _tree_node, wide), "error")
    add(t, "value:node_tokens:padding--1", "node_tokens", m_set_elem(-1, _padding_node), "ok", ("tree_pad",))
    add_index_values(t, "parents", lambda m: m["N"])
    for kind, needs in [
        ("after", ("tree_nodes3",)),
        ("other", ("tree_B2", "tree_second2")),
        ("root", ("tree_B2",)),
        ("self", ("tree_nodes2",)),
    ]:
        add(t, f"value:parents:{kind}", "parents", _tree_parent(kind), "error", needs)
    add(t, "value:parents:padding", "parents", _tree_make_padding, "ok", ("tree_nodes2",))
    for kind in ["decreasing", "first", "last", "wrap", "empty-request"]:
        add(t, f"value:cu_num_nodes:{kind}", "cu_num_nodes", _tree_cu_change(kind), "error", ("tree_B2",))
    add(t, "value:seeds:-1", "seeds", m_set_elem(-1), "ok")
    add(t, "value:offsets:-1", "offsets", m_set_elem(-1), "ok")
    add(t, "value:offsets:2**40", "offsets", m_set_elem(2**40), "ok")
    add_temperature(t)
    # probabilities instead of logits: valid as given; a p read that is not a probability, a root row
    # with no mass, or a temperature other than 0 / 1 fail
    add(t, "valid:target_is_probs", "target_logits", lambda a, m, rng, arg: a, "ok", ("probs",))
    for label, value in [("nan", float("nan")), ("-0.5", -0.5), ("1.5", 1.5)]:
        cls = "value" if label != "nan" else "nonfinite"
        add(
            t,
            f"{cls}:target_logits:probs-{label}",
            "target_logits",
            _tree_p_of_first_child(value),
            "error",
            ("probs", "tree_nodes2", "sampled"),
            takes_arg=False,
        )
    add(
        t,
        "value:target_logits:probs-zero-row",
        "target_logits",
        _logit_at(0.0, whole_row=True, row_of=_root_row),
        "error",
        ("probs",),
    )
    add(t, "value:temperature:probs-0.5", "temperature", _probs_temperature, "error", ("probs",), takes_arg=False)
    # logits of a root row (every walk reads it): NaN / +inf are errors, -inf a mask, any finite
    # magnitude fine; a padding row is never read, NaN there is fine
    for label, value, expect in [
        ("nan", float("nan"), "error"),
        ("+inf", float("inf"), "error"),
        ("-inf", float("-inf"), "ok"),
        ("1e38", 1e38, "ok"),
        ("-1e38", -1e38, "ok"),
    ]:
        add(t, f"nonfinite:target_logits:{label}", "target_logits", _logit_at(value, row_of=_root_row), expect)
    for label, value in [("-inf", float("-inf")), ("nan", float("nan"))]:
        add(
            t,
            f"nonfinite:target_logits:{label}-row",
            "target_logits",
            _logit_at(value, whole_row=True, row_of=_root_row),
            "error",
        )
    add(
        t,
        "nonfinite:target_logits:nan-padding-row",
        "target_logits",
        _logit_at(float("nan"), whole_row=True, row_of=_padding_row),
        "ok",
        ("tree_pad",),
    )
    # python ints (tree_verify_out: with outputs of the matching width where they can be allocated)
    for label, value, expect in [
        ("-1", lambda a, m: -1, "error"),
        ("2**31", lambda a, m: 2**31, "error"),
        ("2**32+3", lambda a, m: 2**32 + 3, "error"),
        ("4097", lambda a, m: 4097, "error"),
        ("2**63-1", lambda a, m: 2**63 - 1, "error"),
        ("4096", lambda a, m: 4096, "ok"),
        ("below-deepest", lambda a, m: m["deepest"] - 1, "error"),
        ("above", lambda a, m: a["max_depth"] + 5, "ok"),
        ("0", _zero_depth, "error"),
    ]:
        add(
            t,
            f"size:max_depth:{label}",
            "max_depth",
            _tree_max_depth(value, out_variant),
            expect,
            ("tree_nodes2",) if label == "below-deepest" else (),
            takes_arg=False,
        )
    # empty dims
    add_empty(t, "cu_num_nodes", "requests=0", {"num_nodes": []}, "ok")
    add_empty(t, "target_logits", "vocab=0", {"V": 0}, "error")
    # aliasing between inputs: read-only, so valid
    add(t, "alias:offsets:seeds", "offsets", lambda a, m, rng: dict(a, offsets=a["seeds"]), "ok", takes_arg=False)
    if out_variant:
        # documented as contiguous: a strided out may be rejected, or written through the view
        generic(
            t,
            dict(out_accepted_nodes=("out", 2), out_tokens=("out", 2), out_num_accepted=("out", 1)),
            {
                "stride:out_num_accepted:wide": "ok",
                "stride:out_accepted_nodes:wide": "either",
                "stride:out_accepted_nodes:step": "either",
                "stride:out_accepted_nodes:transposed": "either",
                "stride:out_tokens:wide": "either",
                "stride:out_tokens:step": "either",
                "stride:out_tokens:transposed": "either",
                "stride:out_num_accepted:step": "either",
            },
        )
        add(
            t,
            "size:max_depth:out-width-mismatch",
            "out_tokens",
            lambda a, m, rng: dict(a, max_depth=a["max_depth"] + 1),
            "error",
            takes_arg=False,
        )
        add(
            t,
            "alias:out_num_accepted:out_tokens",
            "out_num_accepted",
            lambda a, m, rng: dict(a, out_num_accepted=a["out_tokens"].view(-1)[: m["B"]]),
            "error",
            takes_arg=False,
        )
        add(
            t,
            "alias:out_accepted_nodes:out_tokens",
            "out_accepted_nodes",
            lambda a, m, rng: dict(a, out_accepted_nodes=a["out_tokens"]),
            "error",
            takes_arg=False,
        )
        add(
            t,
            "alias:out_tokens:out_num_accepted",
            "out_tokens",
            _tree_alias_tokens_over_acc,
            "error",
            takes_arg=False,
        )
        add(
            t,
            "alias:out_tokens:target_logits",
            "out_tokens",
            _tree_alias_out_over_logits,
            "error",
            ("f32",),
            takes_arg=False,
        )
        for out_name, index_name in [("out_accepted_nodes", "node_tokens"), ("out_tokens", "parents")]:
            add(
                t,
                f"alias:{out_name}:{index_name}",
                out_name,
                _tree_alias_out_over_index(out_name, index_name),
                "error",
                takes_arg=False,
            )
        add(
            t,
            "alias:out_num_accepted:cu_num_nodes",
            "out_num_accepted",
            _tree_alias_acc_over_cu,
            "error",
            takes_arg=False,
        )
        add(
            t, "alias:out_tokens:disjoint-views-of-one-buffer", "out_tokens", _tree_disjoint_outs, "ok", takes_arg=False
        )
    return t


def _tree_alias_tokens_over_acc(a, m, rng):
    B, W = m["B"], a["max_depth"] + 1
    if B == 0:
        return None
    buf = torch.full((B * W + B,), 5, dtype=torch.int32)
    a["out_tokens"] = buf[: B * W].view(B, W)
    a["out_num_accepted"] = buf[B * W - B : B * W]
    return a


def _tree_alias_out_over_logits(a, m, rng):
    """out_tokens as the int32 view of the start of the logits' float32 storage."""
    B, W = m["B"], a["max_depth"] + 1
    lg = a["target_logits"]
    if lg.dtype != torch.float32 or lg.numel() == 0 or B == 0:
        return None
    buf = torch.zeros(max(lg.numel(), B * W), dtype=torch.float32)
    buf[: lg.numel()] = lg.reshape(-1)
    a["target_logits"] = buf[: lg.numel()].view(lg.shape)
    a["out_tokens"] = buf.view(torch.int32)[: B * W].view(B, W)
    return a


def _tree_alias_out_over_index(out_name, index_name):
    """An int32 output whose buffer starts with the values of an index input (node_tokens, parents)."""

    def f(a, m, rng):
        B, W, N = m["B"], a["max_depth"] + 1, m["N"]
        if B == 0 or N == 0:
            return None
        buf = torch.zeros(max(B * W, N), dtype=torch.int32)
        buf[:N] = a[index_name].to(torch.int32)
        a[index_name] = buf[:N]
        a[out_name] = buf[: B * W].view(B, W)
        return a

    return f


def _tree_alias_acc_over_cu(a, m, rng):
    B = m["B"]
    if B == 0:
        return None
    buf = a["cu_num_nodes"].to(torch.int32).clone()
    a["cu_num_nodes"] = buf
    a["out_num_accepted"] = buf[:B]
    return a


def _tree_disjoint_outs(a, m, rng):
    """The three outputs carved from one buffer without overlap: valid."""
    B, W = m["B"], a["max_depth"] + 1
    buf = torch.full((2 * B * W + B,), 5, dtype=torch.int32)
    a["out_accepted_nodes"] = buf[: B * W].view(B, W)
    a["out_tokens"] = buf[B * W : 2 * B * W].view(B, W)
    a["out_num_accepted"] = buf[2 * B * W :]
    return a


# block_diffusion_attention -------------------------------------------------------------------


def _unread_cache(value):
    def where(a, m, rng):
        bs = [b for b in range(m["B"]) if m["ctx"][b] < m["S"]]
        if not bs or m["D"] == 0 or m["Hkv"] == 0:
            return None
        b = rng.choice(bs)
        return b, rng.randrange(m["Hkv"]), rng.randrange(m["ctx"][b], m["S"]), rng.randrange(m["D"])

    return m_set_elem(value, where)


def _read_cache(value):
    def where(a, m, rng):
        bs = [b for b in range(m["B"]) if m["ctx"][b] > 0]
        if not bs or m["D"] == 0 or m["Hkv"] == 0:
            return None
        b = rng.choice(bs)
        return b, rng.randrange(m["Hkv"]), rng.randrange(m["ctx"][b]), rng.randrange(m["D"])

    return m_set_elem(value, where)


def attention_mutations():
    t = {"valid": Mutation("", lambda a, m, rng: a, "ok")}
    spec = dict(
        q=("float", 4),
        k_cache=("float", 4),
        v_cache=("float", 4),
        ctx_lens=("index", 1),
        k_block=("float", 4),
        v_block=("float", 4),
    )
    # the docs ask for a dense head dim; a column-major view may be copied or rejected
    ov = {f"stride:{n}:transposed": "either" for n in ["q", "k_cache", "v_cache", "k_block", "v_block"]}
    generic(t, spec, ov)
    for n in ["q", "k_cache", "v_cache", "k_block", "v_block"]:
        add(t, f"dtype:{n}:other-float", n, m_other_float, "error")
    add(t, "value:ctx_lens:-1", "ctx_lens", m_set_elem(-1), "error")
    add(t, "value:ctx_lens:S_max+1", "ctx_lens", m_set_elem(lambda t_, i, m: m["S"] + 1), "error")
    add(t, "value:ctx_lens:2**32+valid", "ctx_lens", m_set_elem(wrapped, wide=True), "error")
    add(t, "value:ctx_lens:2**32+3", "ctx_lens", m_set_elem(BIG + 3, wide=True), "error")
    for n in ["q", "k_block", "v_block"]:
        for label in ["nan", "+inf", "1e38"]:
            add(t, f"nonfinite:{n}:{label}", n, m_set_elem(NONFINITE[label]), "either")
    for n in ["k_cache", "v_cache"]:
        for label in ["nan", "+inf"]:
            add(t, f"nonfinite:{n}:{label}-read", n, _read_cache(NONFINITE[label]), "either", ("ctx1",))
            add(t, f"nonfinite:{n}:{label}-unread", n, _unread_cache(NONFINITE[label]), "ok", ("unread",))
    add_scalar_floats(
        t, "scale", lambda label: {"nan": "error", "+inf": "error", "-inf": "error", "1e38": "either"}.get(label, "ok")
    )
    add_empty(t, "q", "requests=0", {"B": 0}, "ok")
    add_empty(t, "q", "block=0", {"G": 0}, "ok")
    add_empty(t, "ctx_lens", "context=0", lambda b: {"ctx": [0, 0, 0], "S_extra": 1}, "ok")
    add_empty(t, "k_cache", "S_max=0", lambda b: {"ctx": [0, 0, 0], "S_extra": 0}, "ok")
    add_empty(t, "q", "head_dim=0", {"D": 0}, "error")
    add_empty(t, "k_cache", "kv_heads=0", {"Hkv": 0}, "either")
    add(t, "alias:v_cache:k_cache", "v_cache", lambda a, m, rng: dict(a, v_cache=a["k_cache"]), "ok", takes_arg=False)
    add(t, "alias:v_block:k_block", "v_block", lambda a, m, rng: dict(a, v_block=a["k_block"]), "ok", takes_arg=False)
    return t


# inject_context_kv ----------------------------------------------------------------------------


def _alias_inject(kind):
    def f(a, m, rng):
        N, D, S, B = m["N"], m["D"], m["S"], m["B"]
        if kind == "v_cache=k_cache":
            a["v_cache"] = a["k_cache"]
        elif kind == "k-in-k_cache":
            if B == 0 or S < N or N == 0:
                return None
            view = a["k_cache"][0, :, :N].transpose(0, 1)  # [N, Hkv, D] inside the output
            view.copy_(a["k"])
            a["k"] = view
        elif kind == "v-in-v_cache":
            if B == 0 or S < N or N == 0:
                return None
            view = a["v_cache"][0, :, :N].transpose(0, 1)
            view.copy_(a["v"])
            a["v"] = view
        elif kind == "weight-in-k_cache":
            if a["k_cache"].dtype != torch.float32 or a["k_cache"].numel() < D or D == 0:
                return None
            view = a["k_cache"].view(-1)[:D]
            view.copy_(a["k_norm_weight"])
            a["k_norm_weight"] = view
        elif kind == "adjacent":
            buf = torch.zeros((2,) + tuple(a["k_cache"].shape), dtype=a["k_cache"].dtype)
            a["k_cache"], a["v_cache"] = buf[0], buf[1]
        return a

    return f


def _unread_cos_sin(a, m, rng, arg):
    used = set(a["positions"].long().tolist())
    free = [p for p in range(m["max_pos"]) if p not in used]
    if not free or m["D"] == 0:
        return None
    return m_set_elem(float("nan"), lambda a_, m_, r_: (rng.choice(free), rng.randrange(m["D"])))(a, m, rng, arg)


def inject_mutations():
    t = {"valid": Mutation("", lambda a, m, rng: a, "ok")}
    spec = dict(
        k=("float", 3),
        v=("float", 3),
        positions=("index", 1),
        slots=("index", 1),
        k_norm_weight=("float", 1),
        cos_sin_cache=("float", 2),
    )
    ov = {
        "shape:cos_sin_cache:grow0": "ok",
        "shape:cos_sin_cache:shrink0": "either",
        # expanded positions / slots repeat a (slot, position) pair: a documented race
        "stride:positions:expand": None,
        "stride:slots:expand": None,
    }
    generic(t, spec, ov)
    # caches: a padded head dim (D still dense) and a strided batch dim are like one layer of a bigger cache
    generic(
        t,
        dict(k_cache=("fout", 4), v_cache=("fout", 4)),
        {
            "stride:k_cache:wide": "ok",
            "stride:v_cache:wide": "ok",
            "stride:k_cache:step": "ok",
            "stride:v_cache:step": "ok",
            # documented "D dense": a column-major cache may be rejected, or written through the view
            "stride:k_cache:transposed": "either",
            "stride:v_cache:transposed": "either",
        },
    )
    for n in ["k", "v", "k_cache", "v_cache"]:
        add(t, f"dtype:{n}:other-float", n, m_other_float, "error")
    add_index_values(t, "positions", lambda m: m["S"], low=-1)
    add_index_values(t, "slots", lambda m: m["B"], low=-1)
    for n in ["k", "v", "k_norm_weight"]:
        for label in ["nan", "+inf", "1e38"]:
            add(t, f"nonfinite:{n}:{label}", n, m_set_elem(NONFINITE[label]), "either")
    add(
        t,
        "nonfinite:cos_sin_cache:nan-unread",
        "cos_sin_cache",
        _unread_cos_sin,
        "ok",
        (lambda b: b.update(pos_extra=max(1, b["pos_extra"])),),
    )
    add_scalar_floats(
        t,
        "eps",
        lambda label: {"nan": "error", "+inf": "error", "-inf": "error", "-1": "error", "1e38": "either"}.get(
            label, "ok"
        ),
    )
    add_empty(t, "k", "tokens=0", {"N": 0}, "ok")
    add_empty(t, "k", "head_dim=0", {"D": 0}, "error")
    for kind, expect in [
        ("v_cache=k_cache", "error"),
        ("k-in-k_cache", "error"),
        ("v-in-v_cache", "error"),
        ("weight-in-k_cache", "error"),
        ("adjacent", "ok"),
    ]:
        arg = {
            "v_cache=k_cache": "v_cache",
            "k-in-k_cache": "k",
            "v-in-v_cache": "v",
            "weight-in-k_cache": "k_norm_weight",
            "adjacent": "v_cache",
        }[kind]
        add(
            t,
            f"alias:{arg}:{kind}",
            arg,
            _alias_inject(kind),
            expect,
            ("f32",) if "weight" in kind else (),
            takes_arg=False,
        )
    return t


# two_tap_conv ------------------------------------------------------------------------------


def _conv_rows(change):
    """One row more / less in x: valid unless delta, residual or cu_blocks pin the rows."""

    def f(a, m, rng, arg):
        a = change(a, m, rng, arg)
        if a is None:
            return None
        valid = a["delta"] is None and a["residual"] is None and a["cu_blocks"] is None and a["finish_delta"] is None
        m["expect"] = "ok" if valid else "error"
        return a

    return f


def _cu_blocks_shrink(a, m, rng, arg):
    a = m_shrink(0)(a, m, rng, arg)
    cu = a["cu_blocks"]
    m["expect"] = "ok" if cu.numel() >= 1 and int(cu[-1]) == m["rows"] else "error"
    return a


def conv_mutations():
    t = {"valid": Mutation("", lambda a, m, rng: a, "ok")}
    spec = dict(
        x=("float", 2),
        base=("float", 2),
        delta=("float", 3),
        cu_blocks=("index", 1),
        residual=("float", 2),
        delta_weight=("float", 2),
        norm_weight=("float", 1),
        finish_delta=("fout", 3),
    )
    ov = {
        "rank:x:unsqueeze": "either",
        "rank:x:drop": "either",
        "rank:delta:unsqueeze": "either",
        "rank:residual:unsqueeze": "either",
        "rank:delta:drop": "either",
        "rank:residual:drop": "either",
        "shape:x:grow0": None,
        "shape:x:shrink0": None,  # rows: see shape:x:grow-rows / shrink-rows
        "shape:cu_blocks:grow0": "ok",  # one more empty block at the end
        "shape:cu_blocks:shrink0": None,
        "stride:cu_blocks:expand": "error",
        # finish_delta follows delta's shape rule ([..., 2, G], leading dims flattening to the rows) and is
        # written in place: contiguous, which a step or an expansion over one row, or a transposition of
        # one group, still is
        "rank:finish_delta:unsqueeze": "ok",
        "rank:finish_delta:drop": "either",
        "stride:finish_delta:step": ("error", ("rows2",)),
        "stride:finish_delta:expand": ("error", ("rows2",)),
        "stride:finish_delta:transposed": ("error", ("groups2",)),
    }
    needs = {
        "delta": ("taps_delta",),
        "delta_weight": ("taps_weight",),
        "cu_blocks": ("ragged",),
        "residual": ("residual",),
        "norm_weight": ("norm",),
        "finish_delta": ("taps_finish",),
    }
    generic(t, spec, ov, needs)
    add(t, "shape:x:grow-rows", "x", _conv_rows(m_grow(-2)), "error")
    add(t, "shape:x:shrink-rows", "x", _conv_rows(m_shrink(-2)), "error")
    add(t, "shape:cu_blocks:shrink0", "cu_blocks", _cu_blocks_shrink, "error", ("ragged",))
    for n, nd in [
        ("base", ()),
        ("delta_weight", ("taps_weight",)),
        ("norm_weight", ("norm",)),
        ("finish_delta", ("taps_finish",)),
    ]:
        add(t, f"dtype:{n}:other-float", n, m_other_float, "error" if n != "base" else "either", nd)
    for kind in ["decreasing", "first", "last", "wrap"]:
        add(t, f"value:cu_blocks:{kind}", "cu_blocks", _cu_blocks_change(kind), "error", ("ragged",), takes_arg=False)
    for n, nd in [
        ("x", ()),
        ("base", ()),
        ("delta", ("taps_delta",)),
        ("residual", ("residual",)),
        ("delta_weight", ("taps_weight",)),
        ("norm_weight", ("norm",)),
    ]:
        for label in ["nan", "+inf", "1e38"]:
            add(t, f"nonfinite:{n}:{label}", n, m_set_elem(NONFINITE[label]), "either", nd)
    add_python_ints(
        t,
        "block_size",
        [
            ("0", 0, "error"),
            ("-1", -1, "error"),
            ("1", 1, "ok"),
            ("2**31", 2**31, "either"),
            ("2**32+3", 2**32 + 3, "either"),
            ("2**63-1", 2**63 - 1, "either"),
        ],
        ("fixed",),
    )
    add_python_ints(t, "block_size", [("-1-with-cu_blocks", -1, "either")], ("ragged",))
    add_scalar_floats(
        t,
        "norm_eps",
        lambda label: {"nan": "error", "+inf": "error", "-inf": "error", "-1": "error", "1e38": "either"}.get(
            label, "ok"
        ),
        ("norm",),
    )
    add(t, "scalar:norm_eps:nan-without-norm", "norm_eps", m_set_scalar(float("nan")), "either")
    add_empty(t, "x", "rows=0", {"rows": 0}, "ok")
    add_empty(t, "x", "channels=0", {"C": 0}, "error")
    add(t, "alias:residual:x", "residual", lambda a, m, rng: dict(a, residual=a["x"]), "ok", takes_arg=False)
    # finish_delta: required exactly with a 4G-row delta_weight, and sharing no memory with an input
    add(t, "arg:finish_delta:missing", "finish_delta", m_set_scalar(None), "error", ("taps_finish",))
    for label, nd in [("with-2G-weight", ("taps_weight",)), ("with-delta", ("taps_delta",))]:
        add(t, f"arg:finish_delta:{label}", "finish_delta", _conv_finish_extra, "error", nd)
    for other in ["x", "delta_weight"]:
        add(t, f"alias:finish_delta:{other}", "finish_delta", _conv_finish_alias(other), "error", ("taps_finish",))
    add_python_ints(
        t,
        "group_size",
        [
            ("0", 0, "error"),
            ("-1", -1, "error"),
            ("-16", -16, "error"),
            ("2**31", 2**31, "error"),
            ("2**32+16", 2**32 + 16, "error"),  # read as 16 if narrowed to int32
            ("2**63-1", 2**63 - 1, "error"),
        ],
    )
    add(t, "size:group_size:2**31-1", "group_size", _conv_group_max, "error")
    return t


def _conv_finish_extra(a, m, rng, arg):
    """finish_delta of the right shape where the call projects no finish taps."""
    a["finish_delta"] = torch.zeros(m["rows"], 2, m["groups"], dtype=m["dtype"])
    return a


def _conv_finish_alias(other):
    """finish_delta over the first elements of another argument's memory (values kept)."""

    def f(a, m, rng, arg):
        t, fd = a[other], a["finish_delta"]
        if t.numel() == 0 or fd.numel() == 0:
            return None
        buf = torch.zeros(max(t.numel(), fd.numel()), dtype=t.dtype)
        buf[: t.numel()] = t.reshape(-1)
        a[other] = buf[: t.numel()].view(t.shape)
        a["finish_delta"] = buf[: fd.numel()].view(fd.shape)
        return a

    return f


def _conv_group_max(a, m, rng, arg):
    """The largest group size: one group, valid exactly when the call has one group already."""
    a["group_size"] = 2**31 - 1
    m["expect"] = "ok" if m["groups"] == 1 else "error"
    return a


def _cu_blocks_change(kind):
    def f(a, m, rng):
        cu = a["cu_blocks"].clone()
        if kind == "decreasing":
            if cu.numel() < 3 or m["rows"] == 0:
                return None
            cu[1] = m["rows"] + 1 if m["rows"] > 0 else 1
        elif kind == "first":
            cu[0] = 1
        elif kind == "last":
            cu[-1] = cu[-1] + 1
        elif kind == "wrap":
            cu = cu.long()
            cu[-1] += BIG
        a["cu_blocks"] = cu
        return a

    return f


# topk_select ---------------------------------------------------------------------------


def _topk_row(value):
    def where(a, m, rng):
        t = a["logits"]
        if t.numel() == 0:
            return None
        lead = tuple(rng.randrange(s) for s in t.shape[:-1])
        return lead + (slice(None),)

    return m_set_elem(value, where)


def topk_mutations():
    t = {"valid": Mutation("", lambda a, m, rng: a, "ok")}
    generic(
        t,
        dict(logits=("float", 2)),
        {
            "rank:logits:unsqueeze": "ok",
            "rank:logits:drop": "ok",
            "shape:logits:grow0": "ok",
            "shape:logits:shrink0": "ok",
            "shape:logits:grow-1": "ok",
        },
    )
    add(t, "shape:logits:shrink-1", "logits", lambda a, m, rng, arg: _topk_shrink_vocab(a, m, rng, arg), "ok")
    add(
        t,
        "rank:logits:scalar",
        "logits",
        lambda a, m, rng, arg: dict(a, logits=a["logits"].reshape(-1)[0]) if a["logits"].numel() else None,
        "error",
    )
    for label, value in NONFINITE.items():
        add(t, f"nonfinite:logits:{label}", "logits", m_set_elem(value), "ok")
    add(t, "nonfinite:logits:nan-row", "logits", _topk_row(float("nan")), "ok")
    add(t, "nonfinite:logits:-inf-row", "logits", _topk_row(float("-inf")), "ok")
    add(t, "nonfinite:logits:+inf-row", "logits", _topk_row(float("inf")), "ok")
    add_python_ints(
        t,
        "k",
        [
            ("0", 0, "error"),
            ("-1", -1, "error"),
            ("17", 17, "error"),
            ("2**31", 2**31, "error"),
            ("2**32+3", 2**32 + 3, "error"),
            ("2**63-1", 2**63 - 1, "error"),
            ("1", 1, "ok"),
        ],
    )
    add(t, "size:k:V+1", "k", lambda a, m, rng: dict(a, k=m["V"] + 1), "error", takes_arg=False)
    add(t, "size:k:min(16,V)", "k", lambda a, m, rng: dict(a, k=min(16, m["V"])), "ok", takes_arg=False)
    add_empty(t, "logits", "rows=0", {"rows": 0}, "ok")
    add_empty(t, "logits", "vocab=0", {"V": 0}, "error")
    return t


def _topk_shrink_vocab(a, m, rng, arg):
    a = m_shrink(-1)(a, m, rng, arg)
    if a is None:
        return None
    if a["logits"].shape[-1] < a["k"]:
        m["expect"] = "error"
    return a


# path_select --------------------------------------------------------------------------------


def _path_dead_row(value):
    def f(a, m, rng, arg):
        R, P, K = a["unary"].shape
        if R * P * K == 0:
            return None
        r, p = rng.randrange(R), rng.randrange(P)
        u = a["unary"].clone()
        u[r, p] = value
        a["unary"] = u
        m["dead_row"] = (r, p)
        return a

    return f


def path_mutations():
    t = {"valid": Mutation("", lambda a, m, rng: a, "ok")}
    spec = dict(
        cand_ids=("index", 3),
        unary=("float", 3),
        a_emb=("float", 2),
        b_emb=("float", 2),
        g=("float", 3),
        anchor=("index", 1),
        temperature=("temp", 1),
        seeds=("int64", 1),
        offsets=("int64", 1),
        hidden=("float", 3),
        g_weight=("float", 2),
    )
    ov = {}
    needs = {"g": ("plain_g",), "hidden": ("fused_g",), "g_weight": ("fused_g",)}
    generic(t, spec, ov, needs)
    for n, nd in [("b_emb", ()), ("g", ("plain_g",)), ("g_weight", ("fused_g",))]:
        add(t, f"dtype:{n}:other-float", n, m_other_float, "error", nd)
    add(t, "dtype:unary:bfloat16", "unary", m_dtype(torch.bfloat16), "either")
    add_index_values(t, "cand_ids", lambda m: m["V"])
    add_index_values(t, "anchor", lambda m: m["V"])
    add(
        t,
        "value:cand_ids:duplicate",
        "cand_ids",
        lambda a, m, rng, arg: _dup_cand(a, m, rng),
        "either",
        (lambda b: b.update(K=max(b["K"], 2)),),
    )
    add_temperature(t, needs=("sample",))
    add(t, "nonfinite:temperature:nan-any-mode", "temperature", m_set_elem(float("nan")), "either")
    for n in ["unary", "a_emb", "b_emb"]:
        for label in ["nan", "+inf", "-inf", "1e38"]:
            add(t, f"nonfinite:{n}:{label}-sample", n, m_set_elem(NONFINITE[label]), "ok", ("sample",))
        add(t, f"nonfinite:{n}:nan", n, m_set_elem(float("nan")), "either")
    add(t, "nonfinite:unary:nan-row-sample", "unary", _path_dead_row(float("nan")), "ok", ("sample",))
    add(t, "nonfinite:unary:-inf-row-sample", "unary", _path_dead_row(float("-inf")), "ok", ("sample",))
    for label, value in [("viterbi", "viterbi"), ("empty", ""), ("GREEDY", "GREEDY")]:
        add(t, f"scalar:mode:{label}", "mode", m_set_scalar(value), "error")
    add(
        t,
        "optional:g:none-without-hidden",
        "g",
        lambda a, m, rng: dict(a, g=None),
        "error",
        ("plain_g",),
        takes_arg=False,
    )
    add(
        t,
        "optional:g:both-g-and-hidden",
        "g",
        lambda a, m, rng: dict(a, g=torch.zeros(m["R"], m["P"], m["r"], dtype=m["dtype"])),
        "error",
        ("fused_g",),
        takes_arg=False,
    )
    add_empty(t, "cand_ids", "requests=0", {"R": 0}, "ok")
    add_empty(t, "cand_ids", "positions=0", {"P": 0}, "ok")
    add_empty(t, "cand_ids", "K=0", {"K": 0}, "error")
    add_empty(t, "cand_ids", "K=64", {"K": 64, "V": 70}, "ok")
    add_empty(t, "cand_ids", "K=65", {"K": 65, "V": 70}, "error")
    add_empty(t, "a_emb", "vocab=0", {"V": 0, "K": 0}, "error")
    add_empty(t, "a_emb", "rank=0", {"r": 0}, "either")
    add(t, "alias:b_emb:a_emb", "b_emb", lambda a, m, rng: dict(a, b_emb=a["a_emb"]), "ok", takes_arg=False)
    return t


def _dup_cand(a, m, rng):
    c = a["cand_ids"]
    if c.numel() == 0 or c.shape[-1] < 2:
        return None
    c = c.clone()
    r, p = rng.randrange(c.shape[0]), rng.randrange(c.shape[1])
    c[r, p, 1] = c[r, p, 0]
    a["cand_ids"] = c
    return a


# markov_step ----------------------------------------------------------------------------------


def _markov_dead_row(value, arg):
    def f(a, m, rng):
        if m["B"] == 0 or m["V"] == 0:
            return None
        b = rng.randrange(m["B"])
        if arg == "base_logits":
            t = a["base_logits"].clone()
            t[b] = value
            a["base_logits"] = t
        else:  # w1's row of prev_tokens[b]: the whole Markov term of request b is NaN
            t = a["w1"].clone()
            t[int(a["prev_tokens"][b])] = value
            a["w1"] = t
            m["conf_unknown"] = True
        m["dead_row"] = b
        return a

    return f


def markov_mutations():
    t = {"valid": Mutation("", lambda a, m, rng: a, "ok")}
    spec = dict(
        base_logits=("float", 2),
        prev_tokens=("index", 1),
        w1=("float", 2),
        w2=("float", 2),
        hidden=("float", 2),
        conf_w=("float", 1),
        conf_b=("float", 1),
        temperature=("temp", 1),
        seeds=("int64", 1),
        positions=("int64", 1),
        bias=("float", 1),
    )
    ov = {"rank:conf_b:drop": "either"}
    generic(t, spec, ov, {"bias": ("bias",)})
    for n in ["w1", "w2"]:
        add(t, f"dtype:{n}:other-float", n, m_other_float, "error")
    add_index_values(t, "prev_tokens", lambda m: m["V"])
    add(t, "value:seeds:-1", "seeds", m_set_elem(-1), "ok")
    add(t, "value:positions:-1", "positions", m_set_elem(-1), "ok")
    add_temperature(t)
    for n, nd in [("base_logits", ()), ("w2", ()), ("bias", ("bias",))]:
        for label in ["nan", "+inf", "-inf", "1e38"]:
            add(t, f"nonfinite:{n}:{label}", n, m_set_elem(NONFINITE[label]), "ok", nd)
    add(
        t,
        "nonfinite:base_logits:nan-row",
        "base_logits",
        _markov_dead_row(float("nan"), "base_logits"),
        "ok",
        takes_arg=False,
    )
    add(
        t,
        "nonfinite:base_logits:-inf-row",
        "base_logits",
        _markov_dead_row(float("-inf"), "base_logits"),
        "ok",
        takes_arg=False,
    )
    add(t, "nonfinite:w1:nan-prev-row", "w1", _markov_dead_row(float("nan"), "w1"), "ok", takes_arg=False)
    for n in ["hidden", "conf_w"]:
        add(t, f"nonfinite:{n}:nan", n, m_set_elem(float("nan")), "either")
    add_empty(t, "base_logits", "requests=0", {"B": 0}, "ok")
    add_empty(t, "base_logits", "vocab=0", {"V": 0}, "error")
    add_empty(t, "w1", "rank=0", {"r": 0}, "either")
    add_empty(t, "hidden", "hidden=0", {"H": 0}, "either")
    add(t, "alias:w2:w1", "w2", lambda a, m, rng: dict(a, w2=a["w1"]), "ok", takes_arg=False)
    return t


MUTATIONS = {
    "verify": verify_mutations(),
    "verify_out": verify_mutations(out_variant=True),
    "tree_verify": tree_verify_mutations(),
    "tree_verify_out": tree_verify_mutations(out_variant=True),
    "block_diffusion_attention": attention_mutations(),
    "inject_context_kv": inject_mutations(),
    "two_tap_conv": conv_mutations(),
    "topk_select": topk_mutations(),
    "path_select": path_mutations(),
    "markov_step": markov_mutations(),
}


# ---------------------------------------------------------------- the status argument (contract: "Status")

# Entries of each op's status: per request, per token, or one for the call.
STATUS_LEN = {
    "verify": lambda a: a["cu_num_draft"].shape[0] - 1,
    "verify_out": lambda a: a["cu_num_draft"].shape[0] - 1,
    "tree_verify": lambda a: a["cu_num_nodes"].shape[0] - 1,
    "tree_verify_out": lambda a: a["cu_num_nodes"].shape[0] - 1,
    "block_diffusion_attention": lambda a: a["q"].shape[0],
    "inject_context_kv": lambda a: a["k"].shape[0],
    "two_tap_conv": lambda a: 1,
    "path_select": lambda a: a["cand_ids"].shape[0],
    "markov_step": lambda a: a["base_logits"].shape[0],
}
# An int32 index input that a status tensor may not overlap (alias:status:*), and the needs that make it int32.
STATUS_ALIAS = {
    "verify": ("cu_num_draft", ()),
    "verify_out": ("out_num_accepted", ()),
    "tree_verify": ("cu_num_nodes", ()),
    "tree_verify_out": ("out_num_accepted", ()),
    "block_diffusion_attention": ("ctx_lens", ()),
    "inject_context_kv": ("slots", ()),
    "two_tap_conv": ("cu_blocks", ("ragged",)),
    "path_select": ("anchor", ()),
    "markov_step": ("prev_tokens", ()),
}
STATUS_SENTINEL = 12345  # a status entry still holding it was never written


def _has_status(op):
    fn = getattr(ops, op)
    return "status" in inspect.signature(fn).parameters


STATUS_OPS = [op for op in STATUS_LEN if _has_status(op)]
# Mutations whose twin runs with a status tensor: values inside tensors, empty dims and the valid call.
STATUS_CLASSES = ("valid", "value", "nonfinite", "empty")


def _status_arg(make):
    def f(a, m, rng, op):
        n = STATUS_LEN[op](a)
        st = make(n, a)
        if st is None:
            return None
        a["status"] = st
        return a

    return f


def _status_alias(op):
    def make(n, a):
        name = STATUS_ALIAS[op][0]
        t = a[name]
        if t is None or t.numel() == 0 or n == 0:
            return None
        buf = t.to(torch.int32).contiguous().clone() if name != "out_num_accepted" else t
        a[name] = buf
        return buf.view(-1)[: min(n, buf.numel())] if buf.numel() >= n else None

    return make


def _status_expand(a, m, rng, op):
    n = STATUS_LEN[op](a)
    if n < 2:
        m["expect"] = "either"
    a["status"] = torch.zeros(1, dtype=torch.int32).expand(n)
    return a


def add_status_mutations(table, op):
    z = torch.int32
    for mid, make, expect in [
        ("dtype:status:int64", lambda n, a: torch.zeros(n, dtype=torch.int64), "error"),
        ("dtype:status:float32", lambda n, a: torch.zeros(n), "error"),
        ("shape:status:grow0", lambda n, a: torch.zeros(n + 1, dtype=z), "error"),
        ("shape:status:shrink0", lambda n, a: torch.zeros(n - 1, dtype=z) if n else None, "error"),
        ("rank:status:unsqueeze", lambda n, a: torch.zeros(1, n, dtype=z), "error"),
        ("stride:status:step", lambda n, a: torch.zeros(2 * n, dtype=z)[::2] if n > 1 else None, "error"),
        ("device:status:meta", lambda n, a: torch.zeros(n, dtype=z, device="meta"), "error"),
        ("stride:status:wide", lambda n, a: torch.zeros(n + 2, dtype=z)[1 : n + 1], "ok"),
        (f"alias:status:{STATUS_ALIAS[op][0]}", _status_alias(op), "error"),
    ]:
        needs = STATUS_ALIAS[op][1] if mid.startswith("alias") else ()
        if mid == "stride:status:step":
            needs = (_at_least_two(op),)
        table[mid] = Mutation(
            "status", (lambda f_: lambda a, m, rng: f_(a, m, rng, op))(_status_arg(make)), expect, tuple(needs)
        )
    table["stride:status:expand"] = Mutation(
        "status", lambda a, m, rng: _status_expand(a, m, rng, op), "error", (_at_least_two(op),)
    )


def _at_least_two(op):
    """A base tweak giving the status at least two entries (one is contiguous in any layout)."""

    def need(b):
        if op in ("verify", "verify_out"):
            NEEDS["B2"](b)
        elif op in ("tree_verify", "tree_verify_out"):
            NEEDS["tree_B2"](b)
        elif op == "block_diffusion_attention" or op == "markov_step":
            b["B"] = max(b["B"], 2)
        elif op == "inject_context_kv":
            b["N"] = max(b["N"], 2)
        elif op == "path_select":
            b["R"] = max(b["R"], 2)

    return need


for _op in STATUS_OPS:
    add_status_mutations(MUTATIONS[_op], _op)
for _mid in [m for m in MUTATIONS.get("two_tap_conv", {}) if m in ("stride:status:step", "stride:status:expand")]:
    del MUTATIONS["two_tap_conv"][_mid]  # one entry: every layout of it is contiguous


# ---------------------------------------------------------------- calls


def _st(a):
    """The status keyword, only when the case passes one (builds without status still run the rest)."""
    return {"status": a["status"]} if a.get("status") is not None else {}


def call_verify(a):
    return ops.verify(
        a["target_logits"],
        a["draft_tokens"],
        a["cu_num_draft"],
        temperature=a["temperature"],
        seeds=a["seeds"],
        offsets=a["offsets"],
        max_spec_len=a["max_spec_len"],
        draft_probs=a["draft_probs"],
        draft_probs_ids=a["draft_probs_ids"],
        bonus_tokens=a.get("bonus_tokens"),
        target_is_probs=a.get("target_is_probs", False),
        **_st(a),
    )


def call_verify_out(a):
    ops.verify_out(
        a["target_logits"],
        a["draft_tokens"],
        a["cu_num_draft"],
        temperature=a["temperature"],
        seeds=a["seeds"],
        offsets=a["offsets"],
        max_spec_len=a["max_spec_len"],
        out_tokens=a["out_tokens"],
        out_num_accepted=a["out_num_accepted"],
        draft_probs=a["draft_probs"],
        draft_probs_ids=a["draft_probs_ids"],
        bonus_tokens=a.get("bonus_tokens"),
        target_is_probs=a.get("target_is_probs", False),
        **_st(a),
    )
    return a["out_tokens"], a["out_num_accepted"]


def call_tree_verify(a):
    return ops.tree_verify(
        a["target_logits"],
        a["node_tokens"],
        a["parents"],
        a["cu_num_nodes"],
        temperature=a["temperature"],
        seeds=a["seeds"],
        offsets=a["offsets"],
        max_depth=a["max_depth"],
        target_is_probs=a.get("target_is_probs", False),
        **_st(a),
    )


def call_tree_verify_out(a):
    ops.tree_verify_out(
        a["target_logits"],
        a["node_tokens"],
        a["parents"],
        a["cu_num_nodes"],
        temperature=a["temperature"],
        seeds=a["seeds"],
        offsets=a["offsets"],
        max_depth=a["max_depth"],
        out_accepted_nodes=a["out_accepted_nodes"],
        out_tokens=a["out_tokens"],
        out_num_accepted=a["out_num_accepted"],
        target_is_probs=a.get("target_is_probs", False),
        **_st(a),
    )
    return a["out_accepted_nodes"], a["out_tokens"], a["out_num_accepted"]


def call_attention(a):
    return ops.block_diffusion_attention(
        a["q"], a["k_cache"], a["v_cache"], a["ctx_lens"], a["k_block"], a["v_block"], a["scale"], **_st(a)
    )


def call_inject(a):
    ops.inject_context_kv(
        a["k"],
        a["v"],
        a["positions"],
        a["slots"],
        a["k_norm_weight"],
        a["cos_sin_cache"],
        a["eps"],
        a["k_cache"],
        a["v_cache"],
        **_st(a),
    )
    return a["k_cache"], a["v_cache"]


def call_conv(a):
    return ops.two_tap_conv(**{k: v for k, v in a.items() if k != "status"}, **_st(a))


def call_topk(a):
    return ops.topk_select(a["logits"], a["k"])


def call_path(a):
    return ops.path_select(
        a["cand_ids"],
        a["unary"],
        a["a_emb"],
        a["b_emb"],
        a["g"],
        a["anchor"],
        mode=a["mode"],
        temperature=a["temperature"],
        seeds=a["seeds"],
        offsets=a["offsets"],
        hidden=a["hidden"],
        g_weight=a["g_weight"],
        **_st(a),
    )


def call_markov(a):
    return ops.markov_step(
        a["base_logits"],
        a["prev_tokens"],
        a["w1"],
        a["w2"],
        a["hidden"],
        a["conf_w"],
        a["conf_b"],
        temperature=a["temperature"],
        seeds=a["seeds"],
        positions=a["positions"],
        bias=a["bias"],
        **_st(a),
    )


# Planted bugs (test_planted_bugs_are_found): each is wrong in a way the oracle must notice.


def planted_verify_clamped(a):
    """A removed range check: out-of-range drafts are clamped into [0, V) instead of rejected."""
    v = a["target_logits"].shape[-1]
    return call_verify(dict(a, draft_tokens=a["draft_tokens"].clamp(0, max(v - 1, 0))))


def planted_verify_wrap32(a):
    """int64 ids narrowed to int32 before the op: 2**32 + x is read as x."""
    return call_verify(
        dict(a, draft_tokens=a["draft_tokens"].to(torch.int32), cu_num_draft=a["cu_num_draft"].to(torch.int32))
    )


def planted_verify_tail_zero(a):
    """The padding after the emitted tokens is 0 instead of -1."""
    tokens, acc = call_verify(a)
    return tokens.clamp(min=0), acc


def planted_topk_raw(a):
    """torch.topk on the raw logits: NaN counts as the largest value."""
    values, ids = torch.topk(a["logits"].float(), a["k"], dim=-1)
    return values, ids.to(torch.int32), torch.logsumexp(a["logits"].float(), dim=-1)


def planted_verify_offsets(a):
    """Draws at the wrong stream position: every output is well formed, only the reference can tell."""
    return call_verify(dict(a, offsets=a["offsets"] + 1))


def planted_tree_verify_offsets(a):
    """Tree walks drawing at the wrong stream position: well formed, only the reference can tell."""
    return call_tree_verify(dict(a, offsets=a["offsets"] + 1))


def planted_verify_status_swallowed(a):
    """A status that stays 0 whatever happens: the bad request is never reported."""
    status = a.get("status")
    try:
        out = call_verify(dict(a, status=None))
    except RuntimeError:
        b, w = a["cu_num_draft"].shape[0] - 1, a["max_spec_len"] + 1
        out = torch.full((b, w), -1, dtype=torch.int32), torch.full((b,), -1, dtype=torch.int32)
    if status is not None:
        status.zero_()
    return out


def planted_markov_plain_softmax(a):
    """q as a plain softmax of the logits: NaN where a logit is NaN, not one-hot when greedy."""
    tokens, _, conf = call_markov(a)
    logits = a["base_logits"].float() + a["w1"].float()[a["prev_tokens"].long()] @ a["w2"].float().T
    if a["bias"] is not None:
        logits = logits + a["bias"].float()
    return tokens, torch.softmax(logits / a["temperature"].float().clamp(min=GREEDY_FLOOR)[:, None], -1), conf


def planted_inject_stray_write(a):
    """One write too many: the last element of the K cache."""
    out = call_inject(a)
    a["k_cache"].view(-1)[-1] += 1.0
    return out


def planted_conv_finish_wrong_half(a):
    """two_tap_conv projecting the finish conv's taps with the conv's own rows of delta_weight."""
    w = a["delta_weight"]
    if a.get("finish_delta") is not None:
        half = w.shape[0] // 2
        a = dict(a, delta_weight=torch.cat([w[:half], w[:half]]))
    return call_conv(a)


def planted_segfault(a):
    """Dies by SIGSEGV, as a kernel reading out of bounds would."""
    os.kill(os.getpid(), signal.SIGSEGV)


def planted_hang(a):
    """Never returns, as a kernel spinning on a bad length would."""
    while True:
        time.sleep(1)


IMPLS = {
    "planted_segfault": planted_segfault,
    "planted_hang": planted_hang,
    "planted_verify_offsets": planted_verify_offsets,
    "planted_verify_status_swallowed": planted_verify_status_swallowed,
    "planted_tree_verify_offsets": planted_tree_verify_offsets,
    "planted_markov_plain_softmax": planted_markov_plain_softmax,
    "planted_inject_stray_write": planted_inject_stray_write,
    "planted_conv_finish_wrong_half": planted_conv_finish_wrong_half,
    "verify": call_verify,
    "verify_out": call_verify_out,
    "tree_verify": call_tree_verify,
    "tree_verify_out": call_tree_verify_out,
    "block_diffusion_attention": call_attention,
    "inject_context_kv": call_inject,
    "two_tap_conv": call_conv,
    "topk_select": call_topk,
    "path_select": call_path,
    "markov_step": call_markov,
    "planted_verify_clamped": planted_verify_clamped,
    "planted_verify_wrap32": planted_verify_wrap32,
    "planted_verify_tail_zero": planted_verify_tail_zero,
    "planted_topk_raw": planted_topk_raw,
}


# ---------------------------------------------------------------- invariants and references


def _close(got, want, dtype, what):
    """Violations where want is finite and got differs beyond the dtype's tolerance (or is not finite)."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        return [f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"]
    tol = TOL.get(dtype, 1e-4)
    mask = torch.isfinite(want)
    diff = (got - want).abs()
    bad = mask & ~((diff <= tol + tol * want.abs()) & torch.isfinite(got))
    if bad.any():
        i = tuple(int(x) for x in bad.nonzero()[0])
        return [
            f"{what}: {int(bad.sum())} entries differ from the reference, e.g. at {i}: "
            f"{float(got[i]):.6g} vs {float(want[i]):.6g}"
        ]
    return []


def _floor_temps(temp):
    t = temp.detach().float().cpu().clone()
    t[t < GREEDY_FLOOR] = 0.0
    return t


def _finite_tensors(a, names):
    return all(a.get(n) is None or bool(torch.isfinite(a[n].float()).all()) for n in names)


def _moderate_tensors(a, names, bound=1e30):
    """Finite and far from overflow: the outputs of a sum of products of these must be finite."""
    return all(a.get(n) is None or bool((a[n].float().abs() < bound).all()) for n in names)


def _expect_shape(errs, t, shape, dtype, what):
    if not isinstance(t, torch.Tensor):
        errs.append(f"{what} is {type(t).__name__}, not a tensor")
        return False
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        errs.append(f"{what}: got {tuple(t.shape)} {t.dtype}, documented {tuple(shape)} {dtype}")
        return False
    if t.device.type != "cpu":
        errs.append(f"{what} on {t.device}")
        return False
    return True


def check_verify(a, out, m, mut):
    errs = []
    tokens, acc = out
    cu = a["cu_num_draft"].long().tolist()
    B = len(cu) - 1
    M = a["max_spec_len"]
    logits = a["target_logits"].float()
    V = logits.shape[-1]
    ok = _expect_shape(errs, tokens, (B, M + 1), torch.int32, "tokens")
    ok &= _expect_shape(errs, acc, (B,), torch.int32, "num_accepted")
    if not ok:
        return errs
    drafts = a["draft_tokens"].long()
    bonus = a.get("bonus_tokens")
    bonus_rows = bonus is None  # with the caller's bonus tokens request b's rows start at cu[b]
    for b in range(B):
        n, k = cu[b + 1] - cu[b], int(acc[b])
        row0 = cu[b] + (b if bonus_rows else 0)
        row = tokens[b].long()
        if not 0 <= k <= n:
            errs.append(f"request {b}: num_accepted {k} outside [0, {n}]")
            continue
        if not torch.equal(row[:k], drafts[cu[b] : cu[b] + k]):
            errs.append(
                f"request {b}: accepted prefix {row[:k].tolist()} != drafts {drafts[cu[b] : cu[b] + k].tolist()}"
            )
        if not 0 <= int(row[k]) < V:
            errs.append(f"request {b}: emitted token {int(row[k])} outside [0, {V})")
        elif not bonus_rows and k == n:
            if int(row[k]) != int(bonus[b]):
                errs.append(
                    f"request {b}: accepted every draft but emitted {int(row[k])}, not its bonus {int(bonus[b])}"
                )
        elif a.get("target_is_probs") and not float(logits[row0 + k, int(row[k])]) > 0:
            errs.append(f"request {b}: emitted token {int(row[k])} has probability 0")
        elif not math.isfinite(float(logits[row0 + k, int(row[k])])):
            errs.append(
                f"request {b}: emitted token {int(row[k])} has logit {float(logits[row0 + k, int(row[k])])}"
                " (target probability 0)"
            )
        if (row[k + 1 :] != -1).any():
            errs.append(f"request {b}: tokens after the emitted prefix are {row[k + 1 :].tolist()}, not -1")
        if m.get("q_row_read_fails") == b and k == 0 and n > 0:
            errs.append(f"request {b}: rejected its first draft, so it read a bad q row, yet the call succeeded")
    if errs:
        return errs
    # the reference, where it is exact: temperatures floored, sparse q merged into dense (sum of duplicates)
    temps = _floor_temps(a["temperature"])
    for b in range(B):
        lo = cu[b] + (b if bonus_rows else 0)
        rows = logits[lo : lo + cu[b + 1] - cu[b] + (1 if bonus_rows else 0)]
        if torch.isnan(rows).any() or torch.isposinf(rows).any():
            return errs
        if temps[b] > 0 and not torch.isfinite(rows[torch.isfinite(rows)] * (1.0 / float(temps[b]))).all():
            return errs  # the reference's logits / T overflows; the op's (x - max) / T does not
    probs, ids = a["draft_probs"], a["draft_probs_ids"]
    if ids is not None:
        dense = torch.zeros(probs.shape[0], V)
        dense.scatter_add_(1, ids.long(), probs.float())
        probs = dense
    want = ref.verify_reference(
        a["target_logits"],
        a["draft_tokens"],
        a["cu_num_draft"],
        temperature=temps,
        seeds=a["seeds"],
        offsets=a["offsets"],
        max_spec_len=M,
        draft_probs=probs,
        bonus_tokens=bonus,
        target_is_probs=a.get("target_is_probs", False),
    )
    if not torch.equal(tokens, want[0]) or not torch.equal(acc, want[1]):
        errs.append(
            f"differs from verify_reference: tokens {tokens.tolist()} acc {acc.tolist()}, "
            f"reference {want[0].tolist()} acc {want[1].tolist()}"
        )
    return errs


def _tree_reachable(parents, lo, hi):
    """Nodes of a request the walk may reach: the root, and every node whose parent is reachable
    (a parent precedes its child; padding and its subtree are out)."""
    reach = {lo}
    for i in range(lo + 1, hi):
        if parents[i] in reach:
            reach.add(i)
    return sorted(reach)


def check_tree_verify(a, out, m, mut):
    errs = []
    nodes, tokens, acc = out
    cu = a["cu_num_nodes"].long().tolist()
    B = len(cu) - 1
    D = a["max_depth"]
    logits = a["target_logits"].float()
    V = logits.shape[-1]
    ok = _expect_shape(errs, nodes, (B, D + 1), torch.int32, "accepted_nodes")
    ok &= _expect_shape(errs, tokens, (B, D + 1), torch.int32, "tokens")
    ok &= _expect_shape(errs, acc, (B,), torch.int32, "num_accepted")
    if not ok:
        return errs
    node_tokens = a["node_tokens"].long().tolist()
    parents = a["parents"].long().tolist()
    for b in range(B):
        k = int(acc[b])
        walk, row = nodes[b].long().tolist(), tokens[b].long().tolist()
        if not 0 <= k <= D:
            errs.append(f"request {b}: num_accepted {k} outside [0, {D}]")
            continue
        if walk[0] != cu[b]:
            errs.append(f"request {b}: the walk starts at node {walk[0]}, not its root {cu[b]}")
            continue
        for d in range(1, k + 1):
            v = walk[d]
            if not cu[b] < v < cu[b + 1]:
                errs.append(f"request {b}: walked node {v} outside its nodes [{cu[b]}, {cu[b + 1]})")
                break
            if parents[v] != walk[d - 1]:
                errs.append(f"request {b}: walked node {v} at depth {d} has parent {parents[v]}, not {walk[d - 1]}")
                break
            if row[d - 1] != node_tokens[v]:
                errs.append(f"request {b}: token {row[d - 1]} at depth {d - 1} != node {v}'s token {node_tokens[v]}")
                break
        else:
            y, stop = row[k], walk[k]
            if not 0 <= y < V:
                errs.append(f"request {b}: emitted token {y} outside [0, {V})")
            elif a.get("target_is_probs") and not float(logits[stop, y]) > 0:
                errs.append(f"request {b}: emitted token {y} has probability 0 at node {stop}")
            elif not math.isfinite(float(logits[stop, y])):
                errs.append(
                    f"request {b}: emitted token {y} has logit {float(logits[stop, y])} at node {stop}"
                    " (target probability 0)"
                )
        if any(x != -1 for x in walk[k + 1 :]) or any(x != -1 for x in row[k + 1 :]):
            errs.append(f"request {b}: past the walk nodes {walk[k + 1 :]} tokens {row[k + 1 :]}, not -1")
    if errs:
        return errs
    # the reference, where it is exact: temperatures floored, no NaN / +inf on a row a walk may read
    temps = _floor_temps(a["temperature"])
    for b in range(B):
        rows = logits[_tree_reachable(parents, cu[b], cu[b + 1])]
        if torch.isnan(rows).any() or torch.isposinf(rows).any():
            return errs
        if temps[b] > 0 and not torch.isfinite(rows[torch.isfinite(rows)] * (1.0 / float(temps[b]))).all():
            return errs  # the reference's logits / T overflows; the op's (x - max) / T does not
    want = ref.tree_verify_reference(
        a["target_logits"],
        a["node_tokens"],
        a["parents"],
        a["cu_num_nodes"],
        temperature=temps,
        seeds=a["seeds"],
        offsets=a["offsets"],
        max_depth=D,
        target_is_probs=a.get("target_is_probs", False),
    )
    if not all(torch.equal(g, w) for g, w in zip((nodes, tokens, acc), want)):
        errs.append(
            f"differs from tree_verify_reference: nodes {nodes.tolist()} tokens {tokens.tolist()} acc {acc.tolist()}, "
            f"reference {want[0].tolist()} {want[1].tolist()} acc {want[2].tolist()}"
        )
    return errs


def check_attention(a, out, m, mut):
    errs = []
    q = a["q"]
    if not _expect_shape(errs, out, q.shape, q.dtype, "output"):
        return errs
    want = ref.block_diffusion_attention_reference(
        a["q"], a["k_cache"], a["v_cache"], a["ctx_lens"], a["k_block"], a["v_block"], a["scale"]
    )
    finite_in = _moderate_tensors(a, ["q", "k_block", "v_block"]) and all(
        bool((a[n][b, :, : int(a["ctx_lens"][b])].float().abs() < 1e30).all())
        for n in ["k_cache", "v_cache"]
        for b in range(q.shape[0])
    )
    if finite_in and math.isfinite(a["scale"]) and abs(a["scale"]) < 1e30 and not torch.isfinite(out.float()).all():
        errs.append("non-finite output from finite inputs")
    return errs + _close(out, want, q.dtype, "output")


def check_inject(a, out, m, mut):
    errs = []
    pre_k, pre_v = m["pre_k"], m["pre_v"]
    want_k, want_v = pre_k.clone(), pre_v.clone()
    ref.inject_context_kv_reference(
        a["k"], a["v"], a["positions"], a["slots"], a["k_norm_weight"], a["cos_sin_cache"], a["eps"], want_k, want_v
    )
    kc, vc = out
    written = torch.zeros(kc.shape[:3], dtype=torch.bool)
    written[a["slots"].long(), :, a["positions"].long()] = True
    for name, got, want, pre in [("k_cache", kc, want_k, pre_k), ("v_cache", vc, want_v, pre_v)]:
        got = got.detach().cpu()
        same = (got == pre) | (torch.isnan(got) & torch.isnan(pre))
        if not same[~written].all():
            errs.append(f"{name}: wrote outside the given (slot, position) pairs")
        errs += _close(got[written], want[written], got.dtype, name)
    return errs


def check_guards(m):
    """Buffers behind strided views (stride:*:wide / step) must be untouched outside the view."""
    errs = []
    for name, (buf, before, view) in m.get("guards", {}).items():
        inside = torch.zeros(buf.shape, dtype=torch.bool)
        inside.as_strided(view.size(), view.stride(), view.storage_offset()).fill_(True)
        same = (buf == before) | (torch.isnan(buf) & torch.isnan(before))
        if not same[~inside].all():
            errs.append(f"'{name}': wrote into its buffer outside the view (the gaps of a strided argument)")
    return errs


def check_conv(a, out, m, mut):
    errs = []
    x = a["x"]
    if not _expect_shape(errs, out, x.shape, x.dtype, "output"):
        return errs
    args = {k: v for k, v in a.items() if k != "status"}
    got_finish = a.get("finish_delta")
    if got_finish is not None:  # the reference writes its own copy: the op's is judged against it
        args["finish_delta"] = want_finish = torch.full_like(got_finish, float("nan"))
    want = ref.two_tap_conv_reference(**args)
    finite_in = _moderate_tensors(a, ["x", "base", "delta", "residual", "delta_weight", "norm_weight"])
    if finite_in and not torch.isfinite(out.float()).all():
        errs.append("non-finite output from finite inputs")
    errs += _close(out, want, x.dtype, "output")
    if got_finish is not None:
        if finite_in and not torch.isfinite(got_finish.float()).all():
            errs.append("non-finite finish_delta from finite inputs")
        errs += _close(got_finish, want_finish, x.dtype, "finish_delta")
    return errs


def _read_logits(x):
    """The contract's reading of drafter logits: NaN is -inf, +inf the largest finite float."""
    x = x.float()
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    return torch.where(torch.isposinf(x), torch.full_like(x, torch.finfo(torch.float32).max), x)


def check_topk(a, out, m, mut):
    errs = []
    logits, k = a["logits"], a["k"]
    lead = tuple(logits.shape[:-1])
    values, ids, lse = out
    ok = _expect_shape(errs, values, lead + (k,), torch.float32, "values")
    ok &= _expect_shape(errs, ids, lead + (k,), torch.int32, "ids")
    ok &= _expect_shape(errs, lse, lead, torch.float32, "lse")
    if not ok:
        return errs
    V = logits.shape[-1]
    flat_ids = ids.reshape(-1, k).long()
    if ((flat_ids < 0) | (flat_ids >= V)).any():
        errs.append(f"ids outside [0, {V}): {flat_ids[((flat_ids < 0) | (flat_ids >= V)).any(-1)][0].tolist()}")
        return errs
    if any(len(set(r)) != k for r in flat_ids.tolist()):
        errs.append("ids not distinct in a row")
    if torch.isnan(values).any():
        errs.append("NaN values")
    if errs:
        return errs
    read = _read_logits(logits)
    want_v, want_i, _ = ref.topk_select_reference(read, k)
    huge = torch.isposinf(logits.float()).reshape(-1, V).gather(1, want_i.reshape(-1, k).long()).reshape(ids.shape)
    if not torch.equal(ids, want_i):
        errs.append(
            f"ids {ids.reshape(-1, k)[:2].tolist()} != reference on the read logits "
            f"{want_i.reshape(-1, k)[:2].tolist()}"
        )
    elif not torch.equal(values[~huge], want_v[~huge]):
        errs.append("values != the read logits at the ids")
    elif huge.any() and not (torch.isfinite(values[huge]).all() and (values[huge] >= 1e4).all()):
        errs.append(f"a +inf logit did not read as the largest finite float: {values[huge].tolist()}")
    if torch.isfinite(logits.float()).all():
        errs += _close(lse, torch.logsumexp(logits.float(), dim=-1), torch.float32, "lse")
    return errs


def check_path(a, out, m, mut):
    errs = []
    cand = a["cand_ids"]
    R, P, K = cand.shape
    V = a["a_emb"].shape[0]
    tokens, choice, scores, q = out
    ok = _expect_shape(errs, tokens, (R, P), torch.int32, "tokens")
    ok &= _expect_shape(errs, choice, (R, P), torch.int32, "choice")
    ok &= _expect_shape(errs, scores, (R, P, K), torch.float32, "scores")
    ok &= _expect_shape(errs, q, (R, P, K), torch.float32, "q")
    if not ok:
        return errs
    if ((choice < 0) | (choice >= K)).any():
        return errs + [f"choice outside [0, {K})"]
    if not torch.equal(tokens.long(), cand.long().gather(-1, choice.long()[..., None]).squeeze(-1)):
        errs.append("tokens != cand_ids at choice")
    if ((tokens < 0) | (tokens >= V)).any():
        errs.append(f"tokens outside [0, {V})")
    if torch.isnan(q).any():
        errs.append("q has NaN")
    elif (q < 0).any() or (R * P and not torch.allclose(q.sum(-1), torch.ones(R, P), atol=1e-4)):
        errs.append(f"q rows do not sum to 1: {q.sum(-1).flatten()[:6].tolist()}")
    temps = _floor_temps(a["temperature"])
    onehot = torch.nn.functional.one_hot(choice.long(), K).float()
    for r in range(R):
        if a["mode"] != "sample" or temps[r] == 0:
            if not torch.equal(q[r], onehot[r]):
                errs.append(f"request {r}: q not one-hot at the choice outside sampling")
    if "dead_row" in m:
        r, p = m["dead_row"]
        if int(choice[r, p]) != 0 or not torch.equal(q[r, p], onehot[r, p]):
            errs.append(
                f"request {r} position {p} (no finite score): choice {int(choice[r, p])}, q {q[r, p].tolist()}"
                ", contract: the first candidate, q one-hot"
            )
    if errs:
        return errs
    if not _finite_tensors(a, ["unary", "a_emb", "b_emb", "g", "hidden", "g_weight"]) or R * P == 0:
        return errs
    want = ref.path_select_reference(
        cand,
        a["unary"],
        a["a_emb"],
        a["b_emb"],
        a["g"],
        a["anchor"],
        a["mode"],
        temps,
        a["seeds"],
        a["offsets"],
        a["hidden"],
        a["g_weight"],
    )
    if not torch.equal(choice, want[1]):
        errs.append(f"choice {choice.tolist()} != reference {want[1].tolist()}")
        return errs
    errs += _close(scores, want[2], torch.float32 if a["a_emb"].dtype == torch.float32 else torch.bfloat16, "scores")
    errs += _close(q, want[3], torch.float32, "q")
    return errs


def check_markov(a, out, m, mut):
    errs = []
    B, V = a["base_logits"].shape
    tokens, q, conf = out
    ok = _expect_shape(errs, tokens, (B,), torch.int32, "tokens")
    ok &= _expect_shape(errs, q, (B, V), torch.float32, "q")
    ok &= _expect_shape(errs, conf, (B,), torch.float32, "confidence")
    if not ok:
        return errs
    if ((tokens < 0) | (tokens >= V)).any():
        return errs + [f"tokens {tokens.tolist()} outside [0, {V})"]
    if torch.isnan(q).any():
        errs.append("q has NaN")
    elif (q < 0).any() or (B and not torch.allclose(q.sum(-1), torch.ones(B), atol=1e-4)):
        errs.append(f"q rows do not sum to 1: {q.sum(-1).tolist()}")
    elif B and (q.gather(1, tokens.long()[:, None]) <= 0).any():
        errs.append("a token of q = 0 was drawn")
    temps = _floor_temps(a["temperature"])
    onehot = torch.nn.functional.one_hot(tokens.long(), V).float() if V else q
    for b in range(B):
        if temps[b] == 0 and not torch.equal(q[b], onehot[b]):
            errs.append(f"request {b}: greedy q not one-hot at the token")
    if "dead_row" in m:
        b = m["dead_row"]
        if int(tokens[b]) != 0 or not torch.equal(q[b], onehot[b]):
            errs.append(f"request {b} (no finite logit): token {int(tokens[b])}, contract: the lowest id, q one-hot")
    finite_conf_in = _finite_tensors(a, ["hidden", "conf_w", "conf_b"]) and not m.get("conf_unknown")
    if finite_conf_in and B and _finite_tensors(a, ["w1"]):
        if not (torch.isfinite(conf).all() and (conf >= 0).all() and (conf <= 1).all()):
            errs.append(f"confidence {conf.tolist()} not in [0, 1]")
    if errs:
        return errs
    if not _finite_tensors(a, ["base_logits", "w1", "w2", "hidden", "conf_w", "conf_b", "bias"]):
        return errs
    want = ref.markov_step_reference(
        a["base_logits"],
        a["prev_tokens"],
        a["w1"],
        a["w2"],
        a["bias"],
        a["hidden"],
        a["conf_w"],
        a["conf_b"],
        temps,
        a["seeds"],
        a["positions"],
    )
    if not torch.equal(tokens, want[0]):
        errs.append(f"tokens {tokens.tolist()} != reference {want[0].tolist()}")
    errs += _close(q, want[1], torch.float32, "q")
    errs += _close(conf, want[2], torch.float32, "confidence")
    return errs


CHECKS = {
    "verify": check_verify,
    "verify_out": check_verify,
    "tree_verify": check_tree_verify,
    "tree_verify_out": check_tree_verify,
    "block_diffusion_attention": check_attention,
    "inject_context_kv": check_inject,
    "two_tap_conv": check_conv,
    "topk_select": check_topk,
    "path_select": check_path,
    "markov_step": check_markov,
}


# ---------------------------------------------------------------- judging one case


def error_is_clear(e, arg):
    """RuntimeError / ValueError / TypeError with "flashspark" in the text or the argument named in quotes."""
    if not isinstance(e, (RuntimeError, ValueError, TypeError)):
        return False
    text = str(e)
    return "flashspark" in text or (arg and f"'{arg}'" in text)


def contract_notes(e, op, arg):
    """Where a clear error still misses the contract's form "flashspark.<op>: ... '<arg>' ..."."""
    text = str(e)
    notes = []
    if not text.startswith(f"flashspark.{op}: "):
        notes.append("message does not start with " + repr(f"flashspark.{op}: "))
    if arg and f"'{arg}'" not in text:
        notes.append(f"message does not name '{arg}'")
    return notes


def _short(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:MESSAGE_CHARS]


def build_case(case):
    """(mutation, args, meta) of a case; args None when the mutation does not apply."""
    op, mid = case["op"], case["mutation"]
    mut = MUTATIONS[op][mid]
    base = apply_needs(case["base"], mut.needs)
    a, m = BUILDERS[op](base)
    a0 = dict(a)
    a = mut.fn(dict(a), m, random.Random(f"{base['seed']}/{mid}"))
    if a is not None and op == "inject_context_kv" and a["k_cache"].device.type == "cpu":
        m["pre_k"], m["pre_v"] = a["k_cache"].detach().clone(), a["v_cache"].detach().clone()
    m["unmutated"] = a0
    if m.pop("expand_noop", False) and m.get("expect", mut.expect) == "error":
        m["expect"] = "either"
    return mut, a, m


def _flat_outputs(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_meta_call(impl, out, m):
    """A call with every tensor on meta: the fake's outputs must have the kernel's shapes and dtypes."""
    want = _flat_outputs(IMPLS[impl](m["unmutated"]))
    got = _flat_outputs(out)
    if len(got) != len(want):
        return [f"meta call gave {len(got)} outputs, the CPU call {len(want)}"]
    return [
        f"meta output {i}: {tuple(g.shape)} {g.dtype} on {g.device}, CPU gives {tuple(w.shape)} {w.dtype}"
        for i, (g, w) in enumerate(zip(got, want))
        if tuple(g.shape) != tuple(w.shape) or g.dtype != w.dtype or g.device.type != "meta"
    ]


def run_case(case):
    if case.get("status"):
        return run_status_case(case)
    op = case["op"]
    mid = case["mutation"]
    result = dict(id=case["id"], op=op, impl=case.get("impl", op), mutation=mid, notes=[])
    mut, a, m = build_case(case)
    result["expect"] = mut.expect
    if a is None:
        return dict(result, outcome="skip", message="mutation does not apply to this base")
    expect = m.get("expect", mut.expect)
    result["expect"] = expect
    try:
        out = IMPLS[result["impl"]](a)
    except Exception as e:  # noqa: BLE001 - every exception is judged
        msg = _short(e)
        if not error_is_clear(e, mut.arg):
            return dict(result, outcome="violation", message=f"unclear error: {msg}")
        if expect == "ok":
            return dict(result, outcome="violation", message=f"rejected valid input: {msg}")
        if expect == "error":
            result["notes"] = contract_notes(e, op, mut.arg)
        return dict(result, outcome="error", message=msg)
    if expect == "error":
        return dict(result, outcome="violation", message="silently accepted bad input")
    try:
        if m.get("meta_call"):
            errs = check_meta_call(result["impl"], out, m)
        else:
            errs = check_guards(m) + CHECKS[op](a, out, m, mut)
    except Exception as e:  # noqa: BLE001 - a check that cannot run on the outputs is a violation
        errs = [f"outputs break the checks: {_short(e)}"]
    if errs:
        return dict(result, outcome="violation", message="; ".join(errs)[: MESSAGE_CHARS * 2])
    return dict(result, outcome="ok", message="")


# ---------------------------------------------------------------- status twins


def _subset(a, names, keep):
    idx = torch.tensor(keep, dtype=torch.long)
    return dict(a, **{n: a[n].index_select(0, idx) for n in names if a.get(n) is not None})


def _verify_subset(a, keep):
    """The requests in keep as a call of their own (a request's result does not depend on the batch)."""
    cu = a["cu_num_draft"].long().tolist()
    bonus_rows = a.get("bonus_tokens") is None  # given bonus tokens: no bonus rows
    rows = [r for b in keep for r in range(cu[b] + bonus_rows * b, cu[b + 1] + bonus_rows * (b + 1))]
    toks = [t for b in keep for t in range(cu[b], cu[b + 1])]
    new_cu = [0]
    for b in keep:
        new_cu.append(new_cu[-1] + cu[b + 1] - cu[b])
    r, t, k = (torch.tensor(x, dtype=torch.long) for x in (rows, toks, keep))
    sub = dict(
        a,
        target_logits=a["target_logits"].index_select(0, r),
        draft_tokens=a["draft_tokens"].index_select(0, t),
        cu_num_draft=torch.tensor(new_cu, dtype=a["cu_num_draft"].dtype),
    )
    for n in ["draft_probs", "draft_probs_ids"]:
        if a[n] is not None:
            sub[n] = a[n].index_select(0, t)
    for n in ["temperature", "seeds", "offsets", "bonus_tokens"]:
        if a.get(n) is not None:
            sub[n] = a[n].index_select(0, k)
    return sub


def _tree_verify_subset(a, out, keep):
    """The requests in keep as a call of their own, with their outputs (node ids renumbered)."""
    cu = a["cu_num_nodes"].long().tolist()
    par = a["parents"].long().tolist()
    rows, new_par, new_cu = [], [], [0]
    for b in keep:
        shift = new_cu[-1] - cu[b]
        rows += range(cu[b], cu[b + 1])
        new_par += [p if p < 0 else p + shift for p in par[cu[b] : cu[b + 1]]]
        new_cu.append(new_cu[-1] + cu[b + 1] - cu[b])
    r, k = torch.tensor(rows, dtype=torch.long), torch.tensor(keep, dtype=torch.long)
    sub = dict(
        a,
        target_logits=a["target_logits"].index_select(0, r),
        node_tokens=a["node_tokens"].index_select(0, r),
        parents=torch.tensor(new_par, dtype=a["parents"].dtype),
        cu_num_nodes=torch.tensor(new_cu, dtype=a["cu_num_nodes"].dtype),
    )
    for n in ["temperature", "seeds", "offsets"]:
        sub[n] = a[n].index_select(0, k)
    nodes, tokens, acc = (o.index_select(0, k) for o in out)
    shifts = torch.tensor([new_cu[j] - cu[b] for j, b in enumerate(keep)], dtype=torch.int32)
    nodes = torch.where(nodes >= 0, nodes + shifts[:, None], nodes)
    return sub, (nodes, tokens, acc)


PER_ITEM = {  # arguments whose dim 0 runs over the status entries
    "block_diffusion_attention": ["q", "k_cache", "v_cache", "ctx_lens", "k_block", "v_block"],
    "inject_context_kv": ["k", "v", "positions", "slots"],
    "path_select": ["cand_ids", "unary", "g", "hidden", "anchor", "temperature", "seeds", "offsets"],
    "markov_step": ["base_logits", "prev_tokens", "hidden", "temperature", "seeds", "positions"],
}


def bad_item(op, mut, m):
    """The status entry the mutation breaks, where it names one."""
    if "bad_request" in m:
        return m["bad_request"]
    idx = m.get("bad_index")
    if idx is None or not isinstance(idx[0], int):
        return None
    if op == "two_tap_conv":
        return 0
    if op in ("verify", "verify_out"):
        cu = m["cu"]
        if mut.arg in ("draft_tokens", "draft_probs_ids", "draft_probs"):
            return next((b for b in range(m["B"]) if cu[b] <= idx[0] < cu[b + 1]), None)
        if mut.arg == "target_logits":
            return next((b for b in range(m["B"]) if cu[b] + b <= idx[0] <= cu[b + 1] + b), None)
        return idx[0] if mut.arg == "temperature" else None
    if op in ("tree_verify", "tree_verify_out"):
        cu = m["cu"]
        if mut.arg in ("node_tokens", "parents", "target_logits"):
            return next((b for b in range(m["B"]) if cu[b] <= idx[0] < cu[b + 1]), None)
        return idx[0] if mut.arg == "temperature" else None
    return idx[0] if mut.arg in PER_ITEM.get(op, ()) else None


def _remap_meta(m, healthy):
    """meta with the per-request marks renumbered for the healthy requests alone (dropped for the others)."""
    m = dict(m)
    for key in ["dead_row", "q_row_read_fails"]:
        if key in m:
            mark = m.pop(key)
            first = mark[0] if isinstance(mark, tuple) else mark
            if first in healthy:
                new = healthy.index(first)
                m[key] = (new,) + tuple(mark[1:]) if isinstance(mark, tuple) else new
    return m


def status_failed_outputs(op, a, out, failed, m, mut):
    """Contract: a failed request emits nothing (documented fill values); the others pass the op's checks."""
    errs = []
    healthy = [i for i in range(STATUS_LEN[op](a)) if i not in failed]
    m = _remap_meta(m, healthy)
    if op in ("verify", "verify_out"):
        tokens, acc = out
        for b in failed:
            if not ((tokens[b] == -1).all() and int(acc[b]) == -1):
                errs.append(
                    f"failed request {b}: tokens {tokens[b].tolist()} num_accepted {int(acc[b])}, "
                    "contract: all -1 and -1"
                )
        if mut.arg != "cu_num_draft" and not errs:
            k = torch.tensor(healthy, dtype=torch.long)
            errs += check_verify(
                _verify_subset(a, healthy), (tokens.index_select(0, k), acc.index_select(0, k)), m, mut
            )
        return errs
    if op in ("tree_verify", "tree_verify_out"):
        nodes, tokens, acc = out
        for b in failed:
            if not ((nodes[b] == -1).all() and (tokens[b] == -1).all() and int(acc[b]) == -1):
                errs.append(
                    f"failed request {b}: accepted_nodes {nodes[b].tolist()} tokens {tokens[b].tolist()} "
                    f"num_accepted {int(acc[b])}, contract: all -1 and -1"
                )
        if mut.arg != "cu_num_nodes" and not errs:
            errs += check_tree_verify(*_tree_verify_subset(a, out, healthy), m, mut)
        return errs
    if op == "two_tap_conv":
        if failed and not torch.isnan(out.float()).all():
            errs.append("failed call: output not all NaN")
        finish = a.get("finish_delta")
        if failed and finish is not None and not torch.isnan(finish.float()).all():
            errs.append("failed call: finish_delta not all NaN")
        return errs
    if op == "inject_context_kv":
        return check_inject(_subset(a, PER_ITEM[op], healthy), out, m, mut)
    k = torch.tensor(healthy, dtype=torch.long)
    outs = _flat_outputs(out)
    if op == "block_diffusion_attention":
        for b in failed:
            if not torch.isnan(out[b].float()).all():
                errs.append(f"failed request {b}: output not all NaN")
        sub_out = out.index_select(0, k)
    else:
        fills = {"path_select": [-1, -1, float("nan"), 0.0], "markov_step": [-1, 0.0, 0.0]}[op]
        names = {"path_select": ["tokens", "choice", "scores", "q"], "markov_step": ["tokens", "q", "confidence"]}[op]
        for b in failed:
            for o, fill, name in zip(outs, fills, names):
                ok = torch.isnan(o[b]).all() if fill != fill else (o[b] == fill).all()
                if not ok:
                    errs.append(f"failed request {b}: {name} {o[b].flatten()[:6].tolist()}, contract: {fill}")
        sub_out = tuple(o.index_select(0, k) for o in outs)
    if errs:
        return errs
    return CHECKS[op](_subset(a, PER_ITEM[op], healthy), sub_out, m, mut)


def _same(x, y):
    return all(
        torch.equal(p, q)
        or (
            p.is_floating_point()
            and torch.equal(torch.isnan(p), torch.isnan(q))
            and torch.equal(torch.nan_to_num(p), torch.nan_to_num(q))
        )
        for p, q in zip(_flat_outputs(x), _flat_outputs(y))
    )


def run_status_case(case):
    """The twin of a case with a status tensor (contract: CPU with status fills it, never raises for values,
    and fails only the bad request; raise_on_status raises the CPU's own text)."""
    op, mid = case["op"], case["mutation"]
    impl = case.get("impl", op)
    result = dict(id=case["id"], op=op, impl=impl, mutation=mid, status=True, notes=[])
    mut, a, m = build_case(case)
    if a is None:
        return dict(result, expect=mut.expect, outcome="skip", message="mutation does not apply to this base")
    expect = m.get("expect", mut.expect)
    result["expect"] = expect
    metadata_error = expect == "error" and mid.startswith("empty:")  # a zero vocabulary etc.: raised eagerly
    plain_err = plain_out = None
    try:
        plain_out = [o.detach().clone() for o in _flat_outputs(IMPLS[impl](a))]
    except Exception as e:  # noqa: BLE001
        plain_err = e
    mut, a, m = build_case(case)  # fresh tensors: the plain call may have written outputs
    status = torch.full((STATUS_LEN[op](a),), STATUS_SENTINEL, dtype=torch.int32)
    a["status"] = status
    try:
        out = IMPLS[impl](a)
    except Exception as e:  # noqa: BLE001
        msg = _short(e)
        if not error_is_clear(e, mut.arg):
            return dict(result, outcome="violation", message=f"unclear error with status: {msg}")
        if expect == "either" or metadata_error:
            return dict(result, outcome="error", message=msg)
        return dict(result, outcome="violation", message=f"raised despite status: {msg}")
    if metadata_error:
        return dict(result, outcome="violation", message="silently accepted bad input (with status)")
    codes = status.tolist()
    if STATUS_SENTINEL in codes:
        return dict(result, outcome="violation", message=f"status entries left unwritten: {codes}")
    failed = [i for i, c in enumerate(codes) if c != 0]
    errs = []
    if expect == "ok" and failed:
        errs.append(f"status {codes} on a valid call")
    elif expect == "ok":
        if plain_out is not None and not _same(out, plain_out):
            errs.append("outputs with status differ from the outputs without")
        errs += check_guards(m) + CHECKS[op](a, out, m, mut)
    elif expect == "error" and not failed:
        errs.append("bad input, yet every status entry is 0")
    else:
        bi = bad_item(op, mut, m)
        if expect == "error" and bi is not None and bi < len(codes) and codes[bi] == 0:
            errs.append(f"entry {bi} holds the bad value, yet its status is 0 (codes {codes})")
        errs += status_failed_outputs(op, a, out, failed, m, mut) if failed else CHECKS[op](a, out, m, mut)
        if failed and plain_err is not None:
            try:
                ops.raise_on_status(status, op)
                errs.append("raise_on_status did not raise on a failed status")
            except RuntimeError as e:
                if str(e).split(": ", 1)[-1] != str(plain_err).split(": ", 1)[-1]:
                    errs.append(f"raise_on_status says {str(e)[:120]!r}, the CPU raises {str(plain_err)[:120]!r}")
    if errs:
        return dict(result, outcome="violation", message="; ".join(errs)[: MESSAGE_CHARS * 2])
    return dict(result, outcome="ok", message=f"status {codes}" if failed else "")


def main(cases_path, report_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = ADDRESS_SPACE_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(hard, ADDRESS_SPACE_LIMIT_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    torch.set_num_threads(1)
    with open(cases_path) as f:
        cases = json.load(f)
    with open(report_path, "a") as rep:
        for case in cases:
            rep.write(json.dumps({"start": case["id"]}) + "\n")
            rep.flush()
            try:
                res = run_case(case)
            except Exception:  # noqa: BLE001 - a bug of the harness itself, reported as such
                res = dict(
                    id=case["id"],
                    op=case["op"],
                    impl=case.get("impl", case["op"]),
                    mutation=case["mutation"],
                    expect="?",
                    outcome="harness-error",
                    message=traceback.format_exc()[-MESSAGE_CHARS:],
                    notes=[],
                )
            rep.write(json.dumps(res) + "\n")
            rep.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
