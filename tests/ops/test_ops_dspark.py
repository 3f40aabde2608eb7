"""Tests of the DSpark markov_step op against its oracle, with a
distribution-exact check of the sampled token and bad-input checks."""

import math

import flashspark
import pytest
import torch
from flashspark.reference import markov_step_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def markov_inputs(batch, vocab, rank=16, hidden=24, dtype=torch.float32, device="cpu", seed=0, temp=0.9, bias=True):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(dtype).to(device)

    args = dict(
        base_logits=rnd(batch, vocab, scale=2.0),
        prev_tokens=torch.randint(0, vocab, (batch,), generator=g).to(device),
        w1=rnd(vocab, rank, scale=0.5),
        w2=rnd(vocab, rank, scale=0.5),
        hidden=rnd(batch, hidden),
        conf_w=rnd(hidden + rank, scale=0.3),
        conf_b=torch.tensor([0.1], device=device),
        temperature=torch.full((batch,), temp, device=device),
        seeds=torch.arange(batch, dtype=torch.int64, device=device) * 31 + seed,
        positions=torch.arange(batch, dtype=torch.int64, device=device) + 100,
        bias=rnd(vocab, scale=0.1) if bias else None,
    )
    return args


# markov_step's positional arguments, in schema order
ARG_ORDER = (
    "base_logits",
    "prev_tokens",
    "w1",
    "w2",
    "bias",
    "hidden",
    "conf_w",
    "conf_b",
    "temperature",
    "seeds",
    "positions",
)


def positional(args):
    return tuple(args[k] for k in ARG_ORDER)


def call(args, **kw):
    a = dict(args)
    return flashspark.ops.markov_step(
        a.pop("base_logits"),
        a.pop("prev_tokens"),
        a.pop("w1"),
        a.pop("w2"),
        a.pop("hidden"),
        a.pop("conf_w"),
        a.pop("conf_b"),
        **a,
        **kw,
    )


def reference(args):
    return markov_step_reference(*positional(args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,vocab", [(1, 1), (3, 111), (19, 4097), (40, 300)])
@pytest.mark.parametrize("temp", [0.0, 0.7])
def test_matches_reference(device, dtype, batch, vocab, temp):
    args = markov_inputs(batch, vocab, dtype=dtype, device=device, seed=vocab + batch, temp=temp)
    tokens, q, conf = call(args)
    rt, rq, rc = reference(args)
    assert torch.equal(tokens.cpu(), rt.cpu())
    torch.testing.assert_close(q.cpu(), rq.cpu(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(conf.cpu(), rc.cpu(), atol=1e-5, rtol=1e-4)
    assert torch.allclose(q.sum(-1).cpu(), torch.ones(batch), atol=1e-4)


def test_large_vocab_and_rank(device):
    args = markov_inputs(4, 151936, rank=256, hidden=64, device=device, seed=5, bias=False)
    tokens, q, conf = call(args)
    rt, rq, rc = reference(args)
    assert torch.equal(tokens.cpu(), rt.cpu())
    torch.testing.assert_close(q.cpu(), rq.cpu(), atol=1e-6, rtol=1e-3)


def test_greedy_is_argmax_and_one_hot(device):
    args = markov_inputs(6, 200, device=device, seed=7, temp=0.0)
    tokens, q, _ = call(args)
    logits = args["base_logits"] + args["w1"][args["prev_tokens"]] @ args["w2"].T + args["bias"]
    assert torch.equal(tokens.long(), logits.argmax(-1))
    assert torch.equal(q, torch.nn.functional.one_hot(tokens.long(), 200).float())


def test_sampled_token_is_distribution_exact(device):
    # One request replicated with different seeds: the drawn tokens must follow q.
    n, vocab = 20000, 7
    one = markov_inputs(1, vocab, device=device, seed=9, temp=0.8)
    args = {
        k: (
            v.expand(n, *v.shape[1:]).contiguous()
            if k in ("base_logits", "hidden", "prev_tokens", "temperature")
            else v
        )
        for k, v in one.items()
    }
    args["seeds"] = torch.arange(n, dtype=torch.int64, device=device)
    args["positions"] = torch.zeros(n, dtype=torch.int64, device=device)
    # Chunks of 250 requests: the CUDA kernel takes at most 256 per call.
    chunks = [
        call({k: (v[i : i + 250] if k not in ("w1", "w2", "conf_w", "conf_b", "bias") else v) for k, v in args.items()})
        for i in range(0, n, 250)
    ]
    tokens, q = torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks])
    counts = torch.bincount(tokens.cpu().long(), minlength=vocab).double()
    p = q[0].cpu().double()
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    df = vocab - 1
    crit = df * (1 - 2 / (9 * df) + 4.75 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit
    # Power: the same counts reject the distribution without the Markov term.
    u = torch.softmax((one["base_logits"][0].cpu().double() + one["bias"].cpu().double()) / 0.8, -1)
    assert float(((counts - n * u) ** 2 / (n * u)).sum()) >= crit


def test_opcheck(device):
    a = markov_inputs(3, 50, device=device)
    torch.library.opcheck(torch.ops.flashspark.markov_step.default, positional(a))


BAD = [
    ("base_logits", {"base_logits": torch.zeros(3, 50, dtype=torch.int32)}),
    ("prev_tokens", {"prev_tokens": torch.tensor([0, 50, 1])}),
    ("prev_tokens", {"prev_tokens": torch.tensor([0, 1])}),
    ("w1", {"w1": torch.zeros(49, 16)}),
    ("w2", {"w2": torch.zeros(50, 16, dtype=torch.float64)}),
    ("hidden", {"hidden": torch.zeros(2, 24)}),
    ("conf_w", {"conf_w": torch.zeros(24)}),
    ("conf_b", {"conf_b": torch.zeros(2)}),
    ("temperature", {"temperature": torch.tensor([1.0, -1.0, 1.0])}),
    ("seeds", {"seeds": torch.zeros(3, dtype=torch.int32)}),
    ("bias", {"bias": torch.zeros(49)}),
]


@pytest.mark.parametrize("name,change", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_inputs(name, change):
    a = markov_inputs(3, 50)
    a.update(change)
    with pytest.raises(RuntimeError, match=name):
        call(a)
