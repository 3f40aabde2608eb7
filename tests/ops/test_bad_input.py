"""The bad-input contract of every op, class by class (README, "Bad input").

Each test pins one class of malformed call: integer narrowing, empty dimensions,
non-finite or extreme values in verify, NaN-free draft probabilities, Top-K ids,
duplicate sparse ids (with a statistical test and a planted bug), devices and
aliasing, and the status contract that replaces CUDA traps (a failed item emits
nothing, every other item is unaffected, and ``raise_on_status`` gives the CPU's
message). The property-based fuzz of the same contract is tests/test_fuzz_ops.py.
"""

import math

import flashspark
import pytest
import torch
from flashspark import ops
from flashspark.reference import (
    markov_step_reference,
    path_select_reference,
    rope_cos_sin_cache,
    topk_select_reference,
    verify_reference,
)
from test_ops_dflash import attn_inputs, inject_inputs
from test_ops_dflash2 import conv_inputs, path_inputs
from test_ops_dspark import call as markov_call
from test_ops_dspark import markov_inputs, positional
from test_verify import chi2_critical, chi2_stat, make_case

BIG = 2**32 + 3  # read as 3 if an int64 value were narrowed by wrapping
FLOAT_MAX = torch.finfo(torch.float32).max


def status_of(n, device):
    return torch.full((n,), -7, dtype=torch.int32, device=device)  # -7: "never written"


def greedy_case(device, num_draft=(2, 3), vocab=11):
    logits, drafts, cu, kw = make_case(list(num_draft), vocab, temperature=0.0, device=device)
    return logits, drafts, cu, kw


# ---------------------------------------------------------------- 1. integer narrowing


def test_verify_int64_values_are_checked_at_full_width(device):
    logits, drafts, cu, kw = greedy_case(device)
    wide = drafts.long()
    wide[1] = BIG
    with pytest.raises(RuntimeError, match="'draft_tokens' holds a token id outside"):
        flashspark.verify(logits, wide, cu, **kw)
    cu_wide = cu.long() + torch.tensor([0, 2**32, 2**32], device=device)
    with pytest.raises(RuntimeError, match="'cu_num_draft'"):
        flashspark.verify(logits, drafts, cu_wide, **kw)
    with pytest.raises(RuntimeError, match="'max_spec_len' must lie in"):
        flashspark.verify(logits, drafts, cu, **{**kw, "max_spec_len": 2**32 + 3})


def test_verify_sparse_ids_checked_at_full_width(device):
    logits, drafts, cu, kw = make_case([2, 3], 11, q_mode="sparse", device=device)
    ids = kw["draft_probs_ids"].long()
    ids[ids != drafts.long()[:, None]] += 2**32  # the drafts stay listed; the others wrap to valid ids if narrowed
    with pytest.raises(RuntimeError, match="'draft_probs_ids' holds a token id outside"):
        flashspark.verify(logits, drafts, cu, **{**kw, "draft_probs_ids": ids})


def test_drafter_ops_int64_values_are_checked_at_full_width(device):
    q, kc, vc, lens, kb, vb = attn_inputs(2, 3, 2, 1, 8, [1, 2], 4, torch.float32, device)
    with pytest.raises(RuntimeError, match="'ctx_lens'"):
        ops.block_diffusion_attention(q, kc, vc, lens.long() + torch.tensor([0, 2**32], device=device), kb, vb, 0.3)
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(3, 2, 1, 8, 4, torch.float32, device)
    with pytest.raises(RuntimeError, match="'slots'"):
        ops.inject_context_kv(k, v, pos, slots.long() + 2**32, w, cs, 1e-6, kc, vc)
    x, base, delta, _ = conv_inputs(6, 17, torch.float32, device)
    with pytest.raises(RuntimeError, match="'block_size' must lie in"):
        ops.two_tap_conv(x, base, delta, 2**32)  # was narrowed to 0, then t % 0
    with pytest.raises(RuntimeError, match="'cu_blocks'"):
        ops.two_tap_conv(x, base, delta, 0, torch.tensor([0, 2**32 + 3, 6], device=device))
    with pytest.raises(RuntimeError, match="'group_size' must lie in"):
        ops.two_tap_conv(x, base, delta, 4, group_size=2**32 + 16)  # 16 if narrowed: delta would fit
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(2, 3, 4, device=device)
    with pytest.raises(RuntimeError, match="'cand_ids'"):
        ops.path_select(cand.long() + 2**32, unary, a_emb, b_emb, g, anchor)
    with pytest.raises(RuntimeError, match="'anchor'"):
        ops.path_select(cand, unary, a_emb, b_emb, g, anchor.long() - 2**32)
    args = markov_inputs(2, 50, device=device)
    args["prev_tokens"] = args["prev_tokens"].long() + 2**32
    with pytest.raises(RuntimeError, match="'prev_tokens'"):
        markov_call(args)
    with pytest.raises(RuntimeError, match="'k' must lie in"):
        ops.topk_select(torch.randn(3, 20, device=device), 2**32 + 1)


# ---------------------------------------------------------------- 2. empty dimensions


def test_empty_dimensions_work_or_raise_clearly(device):
    # verify: no requests (and no drafts) is test_verify.py's test_empty_batch; no vocabulary raises
    with pytest.raises(RuntimeError, match="'target_logits' has an empty"):
        flashspark.verify(
            torch.randn(1, 0, device=device),
            torch.zeros(0, dtype=torch.int32, device=device),
            torch.zeros(2, dtype=torch.int32, device=device),
            temperature=torch.zeros(1, device=device),
            seeds=torch.zeros(1, dtype=torch.int64, device=device),
            offsets=torch.zeros(1, dtype=torch.int64, device=device),
            max_spec_len=0,
        )
    # attention: no requests, an empty block, no query heads
    for batch, gamma in [(0, 3), (2, 0)]:
        args = attn_inputs(batch, gamma, 2, 1, 8, [1] * batch, 4, torch.float32, device)
        assert ops.block_diffusion_attention(*args, 0.3).shape == (batch, gamma, 2, 8)
    # inject: no tokens
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(0, 2, 1, 8, 4, torch.float32, device)
    ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kc, vc)
    assert (kc == 0).all()
    # conv: no rows works, no channels is a clear error (not a reshape error)
    x, base, delta, _ = conv_inputs(0, 17, torch.float32, device)
    assert ops.two_tap_conv(x, base, delta, 4).shape == (0, 17)
    with pytest.raises(RuntimeError, match="'x' must have C >= 1"):
        ops.two_tap_conv(
            torch.zeros(3, 0, device=device), torch.zeros(2, 0, device=device), torch.zeros(3, 2, 0, device=device), 4
        )
    # topk: no rows works, no vocabulary raises
    values, ids, lse = ops.topk_select(torch.randn(0, 5, 9, device=device), 4)
    assert values.shape == (0, 5, 4) and lse.shape == (0, 5)
    with pytest.raises(RuntimeError, match="'logits' has an empty"):
        ops.topk_select(torch.randn(3, 0, device=device), 1)
    # path_select: no requests, and no block positions in every mode (backtrack read past empty buffers)
    full = path_inputs(2, 3, 4, device=device)
    for requests, positions in [(0, 3), (2, 0)]:
        cand, unary, a_emb, b_emb, g, anchor = full
        cand, unary, g = (t[:requests, :positions] for t in (cand, unary, g))
        anchor = anchor[:requests]
        for mode in ["backtrack", "greedy", "sample"]:
            tokens, choice, scores, q = ops.path_select(cand, unary, a_emb, b_emb, g, anchor, mode=mode)
            assert tokens.shape == (requests, positions) and q.shape == (requests, positions, 4)
    # markov: no requests works, no vocabulary raises
    tokens, q, conf = markov_call(markov_inputs(0, 30, device=device))
    assert tokens.shape == (0,) and q.shape == (0, 30)
    args = markov_inputs(2, 30, device=device)
    args.update(base_logits=args["base_logits"][:, :0], w1=args["w1"][:0], w2=args["w2"][:0], bias=None)
    with pytest.raises(RuntimeError, match="V >= 1"):
        markov_call(args)


# ---------------------------------------------------------------- 3. verify: non-finite and extreme values


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_non_finite_logit_in_a_read_row_fails_the_request(device, bad, temperature):
    logits, drafts, cu, kw = make_case([2, 3], 13, temperature=temperature, device=device)
    logits[0, 5] = bad  # request 0's first row: always read
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="'target_logits' holds NaN or \\+inf in a row that is read"):
            flashspark.verify(logits, drafts, cu, **kw)
    status = status_of(2, device)
    out, acc = flashspark.verify(logits, drafts, cu, **kw, status=status)
    assert status.tolist() == [7, 0]
    assert acc[0] == -1 and (out[0] == -1).all(), "a failed request emits nothing"
    clean, _, _, _ = make_case([2, 3], 13, temperature=temperature, device=device)
    want_out, want_acc = flashspark.verify(clean, drafts, cu, **kw)
    assert torch.equal(out[1], want_out[1]) and acc[1] == want_acc[1], "the other request is unaffected"
    with pytest.raises(RuntimeError, match="flashspark.verify: argument 'target_logits' holds NaN"):
        flashspark.raise_on_status(status, "verify")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_all_minus_inf_row_fails_the_request(device, temperature):
    logits, drafts, cu, kw = make_case([1], 9, temperature=temperature, device=device)
    logits[0] = float("-inf")
    status = status_of(1, device)
    out, acc = flashspark.verify(logits, drafts, cu, **kw, status=status)
    assert status.tolist() == [8] and acc.tolist() == [-1] and (out == -1).all()
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="every logit -inf"):
            flashspark.verify(logits, drafts, cu, **kw)


def test_verify_nan_in_a_row_never_read_is_not_an_error(device):
    # Greedy, the first draft mismatches the argmax: rows after it are never read.
    logits = torch.zeros(4, 6, device=device)
    logits[:, 2] = 5.0
    logits[1:, 0] = float("nan")
    drafts = torch.tensor([1, 2, 2], dtype=torch.int32, device=device)
    kw = dict(
        temperature=torch.zeros(1, device=device),
        seeds=torch.zeros(1, dtype=torch.int64, device=device),
        offsets=torch.zeros(1, dtype=torch.int64, device=device),
        max_spec_len=3,
    )
    out, acc = flashspark.verify(logits, drafts, torch.tensor([0, 3], device=device), **kw)
    assert acc.tolist() == [0] and out[0, 0] == 2


@pytest.mark.parametrize("q_mode", ["onehot", "dense", "sparse"])
def test_verify_huge_finite_logits_at_small_temperature(device, q_mode):
    # Logits of ~1e38 at T = 0.5: (x - max) / T never overflows, so the result equals
    # the same call on logits shifted into a moderate range (p is shift-invariant).
    logits, drafts, cu, kw = make_case([3, 2], 17, q_mode=q_mode, temperature=0.5, device=device, closeness=0.9)
    scale = 1e37
    huge = logits * scale
    status = status_of(2, device)
    out, acc = flashspark.verify(huge, drafts, cu, **kw, status=status)
    assert status.tolist() == [0, 0]
    want_out, want_acc = verify_reference(huge.double().cpu(), drafts, cu, **kw)
    for b in range(2):
        n = int(acc[b]) + 1
        assert n >= 1 and (out[b, :n] >= 0).all()
    assert torch.equal(out.cpu(), want_out.cpu()) and torch.equal(acc.cpu(), want_acc.cpu())


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e-38, 9.9e-6])
def test_verify_temperature_below_the_floor_is_greedy(device, temperature):
    logits, drafts, cu, kw = make_case([3, 0, 4], 19, q_mode="dense", temperature=0.0, device=device)
    greedy = flashspark.verify(logits, drafts, cu, **kw)
    tiny = flashspark.verify(logits, drafts, cu, **{**kw, "temperature": torch.full((3,), temperature, device=device)})
    assert torch.equal(greedy[0], tiny[0]) and torch.equal(greedy[1], tiny[1])


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0, -1e-30])
def test_verify_bad_temperature_fails_the_request(device, temperature):
    logits, drafts, cu, kw = make_case([2, 2], 9, device=device)
    kw["temperature"] = torch.tensor([temperature, 1.0], device=device)
    status = status_of(2, device)
    out, acc = flashspark.verify(logits, drafts, cu, **kw, status=status)
    assert status.tolist() == [5, 0] and acc[0] == -1 and (out[0] == -1).all() and acc[1] >= 0
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="'temperature' must be finite and >= 0"):
            flashspark.verify(logits, drafts, cu, **kw)


@pytest.mark.parametrize("bad", [float("nan"), -0.5, 1.5])
def test_verify_bad_draft_probabilities_fail_the_request(device, bad):
    logits, drafts, cu, kw = make_case([2, 2], 9, q_mode="dense", device=device)
    q = kw["draft_probs"].clone()
    q[0, int(drafts[0])] = bad  # q(draft) of request 0
    status = status_of(2, device)
    flashspark.verify(logits, drafts, cu, **{**kw, "draft_probs": q}, status=status)
    assert status.tolist() == [9, 0]
    logits, drafts, cu, kw = make_case([2, 2], 9, q_mode="sparse", device=device)
    probs = kw["draft_probs"].clone()
    probs[2, 1] = bad
    status = status_of(2, device)
    flashspark.verify(logits, drafts, cu, **{**kw, "draft_probs": probs}, status=status)
    assert status.tolist() == [0, 9]


def test_verify_bad_dense_q_in_the_resampled_row_fails_the_request(device):
    # A NaN q entry away from the draft is read by the residual race of the rejected row.
    logits = torch.zeros(2, 5, device=device)
    logits[0, 3] = 8.0  # p puts almost all mass on 3; the draft 0 is rejected
    q = torch.full((1, 5), 0.2, device=device)
    q[0, 4] = float("nan")
    kw = dict(
        temperature=torch.ones(1, device=device),
        seeds=torch.zeros(1, dtype=torch.int64, device=device),
        offsets=torch.zeros(1, dtype=torch.int64, device=device),
        max_spec_len=1,
    )
    status = status_of(1, device)
    out, acc = flashspark.verify(
        logits,
        torch.tensor([0], dtype=torch.int32, device=device),
        torch.tensor([0, 1], device=device),
        draft_probs=q,
        **kw,
        status=status,
    )
    assert status.tolist() == [9] and acc.tolist() == [-1]


# ---------------------------------------------------------------- 4. draft probabilities never NaN


@pytest.mark.parametrize("case", ["tiny_temperature", "huge_logits", "all_minus_inf", "nan_logits", "inf_logits"])
def test_markov_q_is_never_nan(device, case):
    args = markov_inputs(3, 40, device=device, temp=0.7, bias=False)
    if case == "tiny_temperature":
        args["temperature"] = torch.tensor([1e-39, 1e-45, 1e-20], device=device)  # 1 / T overflows fp32
    elif case == "huge_logits":  # finite logits near the fp32 limit at T < 1: z / T overflows fp32
        args["base_logits"] = args["base_logits"].clamp(-3, 3) * 1e38
    elif case == "all_minus_inf":
        args["base_logits"][1] = float("-inf")
    elif case == "nan_logits":
        args["base_logits"][0, ::3] = float("nan")
    elif case == "inf_logits":
        args["base_logits"][2, 4] = float("inf")
        args["base_logits"][2, 9] = float("inf")
    tokens, q, conf = markov_call(args)
    assert not torch.isnan(q).any()
    torch.testing.assert_close(q.sum(-1).cpu(), torch.ones(3), atol=1e-5, rtol=0)
    assert ((tokens >= 0) & (tokens < 40)).all()
    assert (q.gather(1, tokens.long()[:, None]) > 0).all(), "the drawn token has q > 0"
    want_tokens, want_q, _ = markov_step_reference(*positional(args))
    assert torch.equal(tokens.cpu(), want_tokens.cpu())
    torch.testing.assert_close(q.cpu(), want_q.cpu(), atol=1e-5, rtol=1e-5)
    if case == "all_minus_inf":
        assert tokens[1] == 0 and q[1, 0] == 1.0


@pytest.mark.parametrize("case", ["tiny_temperature", "huge_scores", "nan_scores", "all_minus_inf"])
def test_sampled_path_q_is_never_nan(device, case):
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(3, 4, 5, device=device, seed=2)
    temperature = torch.full((3,), 0.8, device=device)
    if case == "tiny_temperature":
        temperature = torch.tensor([1e-39, 1e-45, 1e-30], device=device)  # 1 / T overflows fp32
    elif case == "huge_scores":  # finite scores near the fp32 limit at T < 1
        unary = unary.clamp(-3, 3) * 1e38
        temperature = torch.full((3,), 0.5, device=device)
    elif case == "nan_scores":
        unary[0, 1, 2] = float("nan")
    elif case == "all_minus_inf":
        unary[1, 2] = float("-inf")
    kw = dict(
        mode="sample",
        temperature=temperature,
        seeds=torch.arange(3, device=device),
        offsets=torch.zeros(3, dtype=torch.int64, device=device),
    )
    tokens, choice, scores, q = ops.path_select(cand, unary, a_emb, b_emb, g, anchor, **kw)
    assert not torch.isnan(q).any() and not torch.isnan(scores).any()
    torch.testing.assert_close(q.sum(-1).cpu(), torch.ones(3, 4), atol=1e-5, rtol=0)
    assert (q.gather(-1, choice.long()[..., None]) > 0).all(), "the chosen candidate has q > 0"
    want = path_select_reference(
        cand, unary, a_emb, b_emb, g, anchor, "sample", temperature, kw["seeds"], kw["offsets"]
    )
    assert torch.equal(choice.cpu(), want[1].cpu())
    torch.testing.assert_close(q.cpu(), want[3].cpu(), atol=1e-5, rtol=1e-5)
    if case == "all_minus_inf":
        assert choice[1, 2] == 0 and q[1, 2, 0] == 1.0


# ---------------------------------------------------------------- 5. topk_select never returns -1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_fewer_finite_values_than_k(device, dtype):
    row = torch.full((2, 40), float("-inf"))
    row[0, [3, 17, 30]] = torch.tensor([1.0, 2.0, 0.5])
    row[0, [5, 6]] = float("nan")
    row[1] = float("nan")  # nothing finite at all
    values, ids, lse = ops.topk_select(row.to(dtype).to(device), 8)
    assert ((ids >= 0) & (ids < 40)).all(), "never id -1"
    assert all(len(set(r.tolist())) == 8 for r in ids.cpu()), "ids are distinct"
    assert not torch.isnan(values).any() and not torch.isnan(lse).any()
    assert ids[0, :3].tolist() == [17, 3, 30]
    assert ids[0, 3:].tolist() == [0, 1, 2, 4, 5], "then -inf entries, NaN as -inf, lowest ids first"
    assert ids[1].tolist() == list(range(8)) and (values[1] == float("-inf")).all()
    want = topk_select_reference(row.to(dtype), 8)
    assert torch.equal(ids.cpu(), want[1]) and torch.equal(values.cpu(), want[0])


def test_topk_plus_inf_reads_as_the_largest_float(device):
    row = torch.zeros(1, 10)
    row[0, 4] = float("inf")
    row[0, 7] = float("inf")
    values, ids, lse = ops.topk_select(row.to(device), 3)
    assert ids[0].tolist() == [4, 7, 0] and values[0, 0] == FLOAT_MAX and torch.isfinite(lse).all()


# ---------------------------------------------------------------- 6. duplicate sparse ids


def duplicate_sparse_trials(device, first_listed_only=False, trials=30000):
    """One draft position over V = 4: q lists id 1 twice (0.2 + 0.3) and id 2 once
    (0.5); drafts come from that q. With `first_listed_only`, the call passes q as a
    kernel that kept only the first entry of a duplicated id would read it (the
    planted bug): q(1) = 0.2 instead of 0.5."""
    g = torch.Generator().manual_seed(5)
    target = torch.tensor([[0.5, 1.5, -0.5, 0.2], [0.0, 0.3, 0.9, -1.0]])
    ids = torch.tensor([[1, 2, 1]], dtype=torch.int32).repeat(trials, 1)
    probs = torch.tensor([[0.2, 0.5, 0.3]]).repeat(trials, 1)
    drafts = torch.multinomial(torch.tensor([0.0, 0.5, 0.5, 0.0]), trials, replacement=True, generator=g)
    if first_listed_only:
        probs = probs.clone()
        probs[:, 2] = 0.0
    out, acc = flashspark.verify(
        target.repeat(trials, 1).to(device),
        drafts.to(torch.int32).to(device),
        torch.arange(trials + 1, dtype=torch.int32, device=device),
        draft_probs=probs.to(device),
        draft_probs_ids=ids.to(device),
        temperature=torch.ones(trials, device=device),
        seeds=torch.arange(trials, dtype=torch.int64, device=device) + 11,
        offsets=torch.zeros(trials, dtype=torch.int64, device=device),
        max_spec_len=1,
    )
    first = out[:, 0].cpu().long()
    counts = torch.bincount(first, minlength=4).double()
    return chi2_stat(counts, torch.softmax(target[0], -1).double())


def test_duplicate_sparse_ids_are_exact(device):
    assert duplicate_sparse_trials(device) < chi2_critical(3)


def test_duplicate_sparse_statistic_rejects_first_listed_only():
    assert duplicate_sparse_trials(torch.device("cpu"), first_listed_only=True) >= chi2_critical(3)


# ---------------------------------------------------------------- 7. devices, aliasing, scalars


def test_meta_tensor_mixed_with_cpu_raises():
    logits, drafts, cu, kw = greedy_case("cpu")
    with pytest.raises(RuntimeError, match="argument 'seeds' is on meta"):
        flashspark.verify(logits, drafts, cu, **{**kw, "seeds": kw["seeds"].to("meta")})
    x, base, delta, _ = conv_inputs(6, 17, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="'delta' is on meta"):
        ops.two_tap_conv(x, base, delta.to("meta"), 4)
    args = markov_inputs(2, 30)
    args["w2"] = args["w2"].to("meta")
    with pytest.raises(RuntimeError, match="'w2' is on meta"):
        markov_call(args)
    # all-meta calls stay shape-only (the fakes), as torch.compile needs
    out, acc = flashspark.verify(
        logits.to("meta"),
        drafts.to("meta"),
        cu.to("meta"),
        **{k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in kw.items()},
    )
    assert out.device.type == "meta" and out.shape == (2, kw["max_spec_len"] + 1)


def test_aliased_outputs_are_rejected(device):
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(3, 2, 1, 8, 4, torch.float32, device)
    with pytest.raises(
        RuntimeError, match="'k_cache' is written in place and must not share memory with argument 'v_cache'"
    ):
        ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kc, kc)
    expanded = torch.zeros(1, 1, 4, 8, device=device).expand(2, 1, 4, 8)
    with pytest.raises(RuntimeError, match="'k_cache' is written in place and must not have overlapping"):
        ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, expanded, vc)
    with pytest.raises(RuntimeError, match="must not share memory with argument 'k'"):
        ops.inject_context_kv(kc[0, 0, :3].reshape(3, 1, 8), v, pos, slots, w, cs, 1e-6, kc, vc)
    logits, drafts, cu, kw = greedy_case(device)
    buf = torch.empty(2 * (kw["max_spec_len"] + 1) + 2, dtype=torch.int32, device=device)
    out_tokens = buf[: 2 * (kw["max_spec_len"] + 1)].view(2, -1)
    with pytest.raises(
        RuntimeError,
        match="'out_tokens' is written in place and must not share memory with argument 'out_num_accepted'",
    ):
        flashspark.verify_out(logits, drafts, cu, **kw, out_tokens=out_tokens, out_num_accepted=out_tokens[0, :2])
    shared = torch.zeros(20, dtype=torch.int32, device=device)
    shared[:5] = drafts
    with pytest.raises(
        RuntimeError, match="'out_tokens' is written in place and must not share memory with argument 'draft_tokens'"
    ):
        flashspark.verify_out(
            logits, shared[:5], cu, **kw, out_tokens=shared[2:10].view(2, 4), out_num_accepted=buf[-2:]
        )
    cu32 = cu.to(torch.int32)
    with pytest.raises(
        RuntimeError, match="'status' is written in place and must not share memory with argument 'cu_num_draft'"
    ):
        flashspark.verify(logits, drafts, cu32, **kw, status=cu32[1:])


def test_conv_finish_delta_must_not_alias(device):
    """finish_delta is written in place: it may share no memory with an input, nor with status."""
    x, base, _, res = conv_inputs(6, 17, torch.float32, device, residual=True, group_size=4)
    w = 0.1 * torch.randn(20, 17, device=device)  # 4G rows, G = 5: finish_delta [6, 2, 5]
    for name in ["x", "residual", "delta_weight"]:
        args = dict(x=x, residual=res, delta_weight=w)
        buf = torch.zeros(400, device=device)
        shared = buf[: args[name].numel()].view(args[name].shape)
        shared.copy_(args[name])
        args[name] = shared
        finish = buf[30:90].view(6, 2, 5)  # overlaps the other argument's elements
        with pytest.raises(
            RuntimeError, match=f"'finish_delta' is written in place and must not share memory with argument '{name}'"
        ):
            ops.two_tap_conv(base=base, delta=None, block_size=4, group_size=4, finish_delta=finish, **args)
    buf = torch.zeros(61, device=device)
    finish, status = buf[:60].view(6, 2, 5), buf[59:60].view(torch.int32)
    with pytest.raises(
        RuntimeError, match="'status' is written in place and must not share memory with argument 'finish_delta'"
    ):
        ops.two_tap_conv(x, base, None, 4, delta_weight=w, group_size=4, finish_delta=finish, status=status)
    # the next elements of the same buffer are fine
    ops.two_tap_conv(
        x, base, None, 4, delta_weight=w, group_size=4, finish_delta=finish, status=buf[60:].view(torch.int32)
    )


@pytest.mark.parametrize("name", ["target_logits", "draft_tokens", "cu_num_draft", "temperature", "seeds", "offsets"])
def test_verify_missing_tensor_is_named(name):
    """A required tensor passed as None names itself (the op alone says "tensor does not have a device")."""
    logits, drafts, cu, kw = greedy_case("cpu")
    args = dict(target_logits=logits, draft_tokens=drafts, cu_num_draft=cu, **kw)
    args[name] = None
    with pytest.raises(TypeError, match=f"flashspark.verify: argument '{name}' is required"):
        flashspark.verify(**args)
    outs = dict(out_tokens=torch.zeros(2, kw["max_spec_len"] + 1, dtype=torch.int32), out_num_accepted=None)
    args[name] = dict(target_logits=logits, draft_tokens=drafts, cu_num_draft=cu, **kw)[name]
    with pytest.raises(TypeError, match="flashspark.verify: argument 'out_num_accepted' is required"):
        flashspark.verify_out(**args, **outs)


def test_interleaved_cache_views_are_accepted(device):
    # K and V as two interleaved slices of one [B, 2, Hkv, S, D] buffer share a storage but
    # no element: the overlap check must let them through.
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(5, 2, 2, 8, 4, torch.float32, device)
    kv = torch.zeros(2, 2, 2, 4, 8, device=device)
    ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kv[:, 0], kv[:, 1])
    ops.inject_context_kv(k, v, pos, slots, w, cs, 1e-6, kc, vc)
    assert torch.equal(kv[:, 0], kc) and torch.equal(kv[:, 1], vc)


def test_the_floor_itself_samples(device):
    # The fp32 value of 1e-5 is the floor: it samples, in the kernels and the reference alike.
    logits, drafts, cu, kw = make_case([3] * 32, 11, q_mode="dense", temperature=1.0, device=device)
    logits = logits * 1e-5  # at T = 1e-5 these logits give a spread-out p
    kw["temperature"] = torch.full((32,), ops.GREEDY_TEMPERATURE, device=device)
    assert float(kw["temperature"][0]) == ops.GREEDY_TEMPERATURE
    got = flashspark.verify(logits, drafts, cu, **kw)
    want = verify_reference(logits, drafts, cu, **kw)
    greedy = flashspark.verify(logits, drafts, cu, **{**kw, "temperature": torch.zeros(32, device=device)})
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
    assert not torch.equal(got[0], greedy[0]), "sampled, not greedy"


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_eps_and_scale_are_rejected(device, bad):
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(3, 2, 1, 8, 4, torch.float32, device)
    with pytest.raises(RuntimeError, match="'eps' must be finite and >= 0"):
        ops.inject_context_kv(k, v, pos, slots, w, cs, bad, kc, vc)
    x, base, delta, _ = conv_inputs(6, 17, torch.float32, device)
    with pytest.raises(RuntimeError, match="'norm_eps' must be finite and >= 0"):
        ops.two_tap_conv(x, base, delta, 4, norm_weight=torch.ones(17, device=device), norm_eps=bad)
    if not bad < 0:
        q, kc2, vc2, lens, kb, vb = attn_inputs(1, 2, 2, 1, 8, [1], 4, torch.float32, device)
        with pytest.raises(RuntimeError, match="'scale' must be finite"):
            ops.block_diffusion_attention(q, kc2, vc2, lens, kb, vb, bad)


# ---------------------------------------------------------------- 8. the status contract


def test_status_fails_one_item_and_leaves_the_others(device):
    """Every op with value checks: the bad item fails alone, its outputs take the
    documented failed values, and the status codes read the same on every device."""
    # block_diffusion_attention: request 1 has a context longer than the cache
    q, kc, vc, lens, kb, vb = attn_inputs(3, 2, 2, 1, 8, [1, 2, 3], 4, torch.float32, device)
    good = ops.block_diffusion_attention(q, kc, vc, lens, kb, vb, 0.3)
    status = status_of(3, device)
    out = ops.block_diffusion_attention(q, kc, vc, torch.tensor([1, 5, 3], device=device), kb, vb, 0.3, status=status)
    assert status.tolist() == [0, 13, 0] and torch.isnan(out[1]).all()
    assert torch.equal(out[0], good[0]) and torch.equal(out[2], good[2])
    # inject_context_kv: token 1 has a slot outside the cache, and writes nothing
    k, v, pos, slots, w, cs, kc, vc = inject_inputs(3, 2, 1, 8, 4, torch.float32, device)
    bad_slots = slots.clone()
    bad_slots[1] = 2
    status = status_of(3, device)
    ops.inject_context_kv(k, v, pos, bad_slots, w, cs, 1e-6, kc, vc, status=status)
    assert status.tolist() == [0, 10, 0]
    assert int((kc != 0).any(-1).sum()) == 2, "only the two good tokens were written"
    # two_tap_conv: decreasing offsets fail the call
    x, base, delta, _ = conv_inputs(6, 17, torch.float32, device)
    status = status_of(1, device)
    out = ops.two_tap_conv(
        x, base, delta, 0, torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=device), status=status
    )
    assert status.tolist() == [14] and torch.isnan(out).all()
    status = status_of(1, device)
    ops.two_tap_conv(x, base, delta, 0, torch.tensor([0, 2, 6], dtype=torch.int32, device=device), status=status)
    assert status.tolist() == [0]
    # path_select: request 0's anchor is out of range
    cand, unary, a_emb, b_emb, g, anchor = path_inputs(2, 3, 4, device=device)
    good = ops.path_select(cand, unary, a_emb, b_emb, g, anchor)
    status = status_of(2, device)
    bad_anchor = anchor.clone()
    bad_anchor[0] = -1
    tokens, choice, scores, q = ops.path_select(cand, unary, a_emb, b_emb, g, bad_anchor, status=status)
    assert status.tolist() == [15, 0]
    assert (tokens[0] == -1).all() and (choice[0] == -1).all() and torch.isnan(scores[0]).all() and (q[0] == 0).all()
    assert all(torch.equal(a[1], b[1]) for a, b in zip((tokens, choice, scores, q), good))
    # markov_step: request 1's previous token is out of range, request 2's temperature is NaN
    args = markov_inputs(3, 30, device=device)
    good = markov_call(args)
    args["prev_tokens"] = args["prev_tokens"].clone()
    args["prev_tokens"][1] = 30
    args["temperature"] = args["temperature"].clone()
    args["temperature"][2] = float("nan")
    status = status_of(3, device)
    tokens, q, conf = markov_call(args, status=status)
    assert status.tolist() == [0, 16, 5]
    assert tokens[1:].tolist() == [-1, -1] and (q[1:] == 0).all() and (conf[1:] == 0).all()
    assert tokens[0] == good[0][0] and torch.equal(q[0], good[1][0]) and conf[0] == good[2][0]
    with pytest.raises(RuntimeError, match="flashspark.markov_step: argument 'prev_tokens' holds a token id"):
        flashspark.raise_on_status(status, "markov_step")


def test_conv_failed_call_fails_finish_delta(device):
    """Bad offsets fail the whole call: the finish conv's taps are NaN too, so the finish conv fails with it."""
    x, base, _, _ = conv_inputs(6, 17, torch.float32, device, group_size=4)
    w = 0.1 * torch.randn(20, 17, device=device)
    bad = torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=device)
    finish = torch.zeros(6, 2, 5, device=device)
    status = status_of(1, device)
    out = ops.two_tap_conv(x, base, None, 0, bad, delta_weight=w, group_size=4, finish_delta=finish, status=status)
    assert status.tolist() == [14] and torch.isnan(out).all() and torch.isnan(finish).all()
    if device.type == "cpu":  # without status the CPU raises before writing anything
        finish.zero_()
        with pytest.raises(RuntimeError, match="'cu_blocks' must start at 0"):
            ops.two_tap_conv(x, base, None, 0, bad, delta_weight=w, group_size=4, finish_delta=finish)
        assert (finish == 0).all()


def test_cpu_raises_without_status_and_not_with_it():
    args = markov_inputs(2, 30)
    args["prev_tokens"] = torch.tensor([3, -1])
    with pytest.raises(RuntimeError, match="flashspark.markov_step: argument 'prev_tokens'"):
        markov_call(args)
    status = status_of(2, "cpu")
    markov_call(args, status=status)
    assert status.tolist() == [0, 16]


def test_status_messages_match_the_cpu_errors():
    """raise_on_status gives, for every code, the text the CPU binding raises."""
    codes = range(1, 17)
    messages = [torch.ops.flashspark.status_message(c) for c in codes]
    assert len(set(messages)) == len(messages) and all("argument" in m for m in messages)
    assert torch.ops.flashspark.status_message(0) == "ok"
    flashspark.raise_on_status(torch.zeros(5, dtype=torch.int32), "verify")  # all ok: no raise
    logits, drafts, cu, kw = greedy_case("cpu")
    drafts[0] = 99
    with pytest.raises(RuntimeError) as cpu_error:
        flashspark.verify(logits, drafts, cu, **kw)
    status = status_of(2, "cpu")
    flashspark.verify(logits, drafts, cu, **kw, status=status)
    with pytest.raises(RuntimeError) as status_error:
        flashspark.raise_on_status(status, "verify")
    assert str(cpu_error.value).splitlines()[0] == str(status_error.value)


@pytest.mark.parametrize("bad_status", ["dtype", "shape", "non_contiguous"])
def test_bad_status_tensor_is_rejected(device, bad_status):
    logits, drafts, cu, kw = greedy_case(device)
    status = {
        "dtype": torch.zeros(2, dtype=torch.int64, device=device),
        "shape": torch.zeros(3, dtype=torch.int32, device=device),
        "non_contiguous": torch.zeros(4, dtype=torch.int32, device=device)[::2],
    }[bad_status]
    with pytest.raises(RuntimeError, match="argument 'status' must be a contiguous int32 tensor of shape \\[2\\]"):
        flashspark.verify(logits, drafts, cu, **kw, status=status)


def test_status_ops_pass_opcheck(device):
    logits, drafts, cu, kw = greedy_case(device)
    status = torch.zeros(2, dtype=torch.int32, device=device)
    torch.library.opcheck(
        torch.ops.flashspark.verify.default,
        (logits, drafts, cu, None, None, kw["temperature"], kw["seeds"], kw["offsets"], kw["max_spec_len"]),
        {"status": status},
    )
    args = markov_inputs(2, 30, device=device)
    torch.library.opcheck(
        torch.ops.flashspark.markov_step.default,
        positional(args),
        {"status": torch.zeros(2, dtype=torch.int32, device=device)},
    )


def test_sampled_outputs_never_hold_minus_one_in_the_prefix(device):
    # Mixed bag of legal extremes in one batch: every emitted prefix is valid tokens of p > 0.
    torch.manual_seed(0)
    vocab = 23
    logits, drafts, cu, kw = make_case([4, 1, 0, 3], vocab, q_mode="dense", temperature=0.8, device=device)
    logits[:, ::4] = float("-inf")  # masked vocabulary
    kw["temperature"] = torch.tensor([0.8, 1e-6, 3.0, 1e-3], device=device)
    out, acc = flashspark.verify(logits, drafts, cu, **kw)
    for b in range(4):
        n = int(acc[b]) + 1
        row0 = int(cu[b]) + b
        for k in range(n):
            tok = int(out[b, k])
            assert 0 <= tok < vocab and math.isfinite(float(logits[row0 + k, tok]))
        assert (out[b, n:] == -1).all()


def test_rope_positions_beyond_the_cache(device):
    k, v, pos, slots, w, _, kc, vc = inject_inputs(3, 2, 1, 8, 4, torch.float32, device)
    short = rope_cos_sin_cache(2, 8, 10000.0).to(device)
    status = status_of(3, device)
    ops.inject_context_kv(k, v, torch.tensor([0, 1, 3], device=device), slots, w, short, 1e-6, kc, vc, status=status)
    assert status.tolist() == [0, 0, 12]
