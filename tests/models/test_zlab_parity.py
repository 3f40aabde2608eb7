"""Parity with z-lab's reference implementation, `dflash` 0.1.0 (`dflash/model.py`), as a
test-only oracle (installed with --no-deps, like transformers; skipped without it).

Random-weight transformers Qwen3 targets and reference drafters of several shapes (GQA
ratios, conv group sizes, selector top-k, block sizes), saved with `save_pretrained`:

* flashspark loads them, and the draft logits of a block match in fp32 within 1e-5, through
  the ops and without them; DFlash 2's greedy path is the reference's;
* greedy decoding equals `dflash_generate`, in output and in acceptance length at every step
  (the shorter last block near max_new_tokens included);
* drafters flashspark saves load in the reference's classes and match the same way;
* at T = 1 the drafts' distribution is the reference's sampling rule: q of the first draft
  equals the reference's, and sampled paths pass a two-sample chi-square test against the
  reference's own samples (which a wrong temperature fails).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from flashspark.decoding.loop import prefill, speculative_generate
from flashspark.models.dflash import DFlashConfig, DFlashDrafter, load_dflash, save_dflash
from flashspark.models.dflash2 import DFlash2Config, DFlash2Drafter, load_dflash2, save_dflash2
from flashspark.models.io import load_model

if os.environ.get("CI"):  # CI installs the oracles (make test): a skip there would hide the parity tests
    import dflash.model as dflash_model
    import transformers
else:
    transformers = pytest.importorskip("transformers")
    dflash_model = pytest.importorskip("dflash.model")

TOL = 1e-5
VOCAB, HIDDEN, LAYERS, HEADS, HEAD_DIM = 4096, 64, 6, 4, 16
MASK = 5
TWO_WAY = [3000, 3001]


def make_target(tmp_path, kv_heads: int, seed: int = 0, two_way: bool = False, device: str = "cpu"):
    """A random transformers Qwen3 target saved with save_pretrained; (HF model, flashspark model).

    `two_way`: two LM-head rows dominate, read off one channel of the final-normed state with
    opposite signs, so the greedy token (of the target, and of a drafter sharing the head) is one
    of two: a random drafter then agrees with the target about half the time, and decoding
    accepts drafts (a wrong draft changes the acceptance lengths)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # spread the logits: a near-uniform target accepts nothing
        hf.model.embed_tokens.weight.mul_(25.0)
        hf.lm_head.weight.mul_(5.0)
        if two_way:
            hf.lm_head.weight[TWO_WAY, 0] = torch.tensor([50.0, -50.0])
    path = tmp_path / f"target_kv{kv_heads}{'_two_way' if two_way else ''}"
    hf.save_pretrained(path)
    return hf.to(device), load_model(path, dtype=torch.float32, device=device)


def make_reference_drafter(
    tmp_path, kv_heads, block_size, *, v2=True, group=16, top_k=4, rank=8, seed=1, device="cpu", **extra
):
    """A random reference drafter (every tensor set: the reference leaves its conv kernels
    uninitialized), saved with save_pretrained; returns (model, directory)."""
    draft = {"block_size": block_size, "mask_token_id": MASK, "target_layer_ids": [1, 3], **extra}
    if v2:
        draft |= {"conv_kernel_size": 2, "conv_group_size": group, "selector_rank": rank, "selector_top_k": top_k}
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rope_theta=10000.0,
        num_target_layers=LAYERS,
        dflash_config=draft,
        architectures=["DFlash2DraftModel" if v2 else "DFlashDraftModel"],
    )
    cls = dflash_model.DFlash2DraftModel if v2 else dflash_model.DFlashDraftModel
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif "base_kernel" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 + torch.tensor([1.0, 0.0])[:, None])
            elif "kernel_projection" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "codebook" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    path = tmp_path / f"drafter_{'v2' if v2 else 'v1'}_kv{kv_heads}_g{group}_k{top_k}_b{block_size}"
    model.save_pretrained(path)
    return model.to(device), path


def reference_block(ref, hf, prompt: list[int]):
    """The reference's first draft block after `prompt`: (anchor, draft states, logits)."""
    ids = torch.tensor([prompt], device=hf.device)
    out = hf(ids, output_hidden_states=True)
    feats = dflash_model.extract_context_feature(out.hidden_states, ref.target_layer_ids)
    anchor = out.logits[:, -1].argmax(-1)
    bs = ref.block_size
    block = torch.full((1, bs), ref.mask_token_id, device=hf.device)
    block[:, 0] = anchor
    scale = float(dflash_model._draft_value(ref.config, "input_embedding_scale", 1.0))
    noise = dflash_model._raw_input_embeddings(hf, block, scale)
    positions = torch.arange(len(prompt) + bs, device=hf.device)[None]
    hidden = ref(target_hidden=feats, noise_embedding=noise, position_ids=positions)
    hidden = hidden[:, 1 - bs :]
    return anchor, hidden, ref.compute_logits(hidden, hf.lm_head)


def our_block(drafter, target, prompts: list[list[int]]):
    """(drafter cache, context lengths, anchors) after prefilling `prompts` (greedy first token)."""
    device = target.model.embed_tokens.weight.device
    temp = torch.zeros(len(prompts), device=device)
    seeds = torch.arange(len(prompts), dtype=torch.int64, device=device)
    _, dcache, lens, anchor = prefill(target, drafter, prompts, 64, temp, seeds)
    return dcache, lens, anchor


PROMPT = [11, 402, 77, 1093, 5, 2047, 600, 31, 8, 19]
SHAPES = [  # (kv heads, conv group, selector top-k, block size)
    (2, 16, 4, 6),
    (1, 8, 16, 8),
    (4, 32, 1, 4),
]


# The CUDA cases run where a GPU is (bench/gpu_check.sh): the authors' code on the GPU against our ops there.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture
def exact_matmul():
    """fp32 matmuls in full precision on the GPU (no TF32), for a 1e-5 comparison."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv,group,top_k,bs", SHAPES)
@pytest.mark.parametrize("use_ops", [True, False])
@torch.no_grad()
def test_dflash2_logits_and_greedy_path_match_reference(tmp_path, exact_matmul, kv, group, top_k, bs, use_ops, device):
    hf, target = make_target(tmp_path, kv, device=device)
    ref, path = make_reference_drafter(tmp_path, kv, bs, group=group, top_k=top_k, device=device)
    ours = load_dflash2(path, target, dtype=torch.float32, use_ops=use_ops)
    assert (ours.config.conv_group_size, ours.config.selector_top_k, ours.block_size) == (group, top_k, bs)
    anchor, hidden, logits = reference_block(ref, hf, PROMPT)
    cache, lens, our_anchor = our_block(ours, target, [PROMPT])
    assert torch.equal(our_anchor, anchor)
    torch.testing.assert_close(ours.draft_logits(cache, our_anchor, lens), logits, atol=TOL, rtol=0)
    want = ref.propose(hidden, anchor, hf.lm_head, 0.0)[0]
    got = ours.select_paths(cache, our_anchor, lens, mode="greedy", signals=False)[0]
    assert torch.equal(got, want)
    # The loop's default path at temperature 0 is the reference's greedy path.
    zeros = torch.zeros(1, dtype=torch.int64, device=device)
    block = ours.propose(cache, our_anchor, lens, zeros.float(), zeros, zeros)
    assert torch.equal(block.tokens, want)


@pytest.mark.parametrize("use_ops", [True, False])
@torch.no_grad()
def test_dflash_logits_match_reference_with_scales(tmp_path, use_ops):
    """DFlash 1, with the optional input scale, output multiplier and soft-cap the reference reads."""
    hf, target = make_target(tmp_path, 2)
    ref, path = make_reference_drafter(
        tmp_path, 2, 5, v2=False, input_embedding_scale=1.5, output_multiplier=0.7, final_logit_softcapping=8.0
    )
    ours = load_dflash(path, target, dtype=torch.float32, use_ops=use_ops)
    assert (ours.config.input_embedding_scale, ours.config.final_logit_softcapping) == (1.5, 8.0)
    anchor, _, logits = reference_block(ref, hf, PROMPT)
    cache, lens, our_anchor = our_block(ours, target, [PROMPT])
    torch.testing.assert_close(ours.draft_logits(cache, our_anchor, lens), logits, atol=TOL, rtol=0)


def reference_generate(ref, hf, prompt, max_new_tokens, monkeypatch):
    # The reference times itself with torch.cuda.synchronize; a CPU clock does here.
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    res = dflash_model.dflash_generate(
        ref, hf, torch.tensor([prompt], device=hf.device), max_new_tokens, None, temperature=0.0, return_stats=True
    )
    return res.output_ids[0, len(prompt) :].tolist(), res.acceptance_lengths


def our_generate(drafter, target, prompt, max_new_tokens):
    out, stats = speculative_generate(target, drafter, [prompt], max_new_tokens, 0.0, record=True)
    # Tokens gained per step, capped at what the request still wanted (the reference's count).
    gained, left = [], max_new_tokens - 1
    for accepted in stats["records"]["num_accepted"].tolist():  # one request: one row per step
        n = min(accepted + 1, left)
        gained.append(n)
        left -= n
    return out[0], gained


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("v2,kv,bs,max_new", [(True, 2, 6, 40), (True, 1, 8, 37), (False, 4, 5, 33)])
@torch.no_grad()
def test_greedy_decoding_matches_dflash_generate(tmp_path, monkeypatch, exact_matmul, v2, kv, bs, max_new, device):
    hf, target = make_target(tmp_path, kv, two_way=True, device=device)
    ref, path = make_reference_drafter(tmp_path, kv, bs, v2=v2, device=device)
    ours = (load_dflash2 if v2 else load_dflash)(path, target, dtype=torch.float32)
    want, want_steps = reference_generate(ref, hf, PROMPT, max_new, monkeypatch)
    got, got_steps = our_generate(ours, target, PROMPT, max_new)
    assert got == want
    assert got_steps == want_steps
    assert max(want_steps) > 1, "the drafter accepted nothing: the test would not see a wrong draft"


@torch.no_grad()
def test_our_saved_drafters_load_in_the_reference(tmp_path, monkeypatch):
    """Round trip: a flashspark DFlash 2 / DFlash drafter, saved by flashspark, is the same
    function in the reference's classes."""
    hf, target = make_target(tmp_path, 2)
    hf2, target2 = make_target(tmp_path, 2, two_way=True)  # for decoding (module docstring of make_target)
    for cls, cfg_cls, save, ref_cls in (
        (DFlash2Drafter, DFlash2Config, save_dflash2, dflash_model.DFlash2DraftModel),
        (DFlashDrafter, DFlashConfig, save_dflash, dflash_model.DFlashDraftModel),
    ):
        extra = dict(selector_rank=8, selector_top_k=6, conv_group_size=8) if cls is DFlash2Drafter else {}
        cfg = cfg_cls.for_target(
            target.config, num_hidden_layers=2, block_size=6, mask_token_id=MASK, num_features=2, **extra
        )
        ours = cls(cfg, target, use_ops=True)
        ours.init_weights(3)
        g = torch.Generator().manual_seed(4)
        for name, p in ours.named_parameters():
            if not name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if "_conv." in name else 1.0) / p.shape[-1] ** 0.5)
        path = tmp_path / f"ours_{cls.__name__}"
        save(ours, path, dtype=torch.float32)
        saved = json.loads((path / "config.json").read_text())
        assert saved["model_type"] == "qwen3" and "dflash_config" in saved
        load = load_dflash2 if cls is DFlash2Drafter else load_dflash
        ours = load(path, target, dtype=torch.float32)
        ref = ref_cls.from_pretrained(path, dtype=torch.float32).eval()
        anchor, hidden, logits = reference_block(ref, hf, PROMPT)
        cache, lens, our_anchor = our_block(ours, target, [PROMPT])
        torch.testing.assert_close(ours.draft_logits(cache, our_anchor, lens), logits, atol=TOL, rtol=0)
        if cls is DFlash2Drafter:
            want = ref.propose(hidden, anchor, hf.lm_head, 0.0)[0]
            assert torch.equal(ours.select_paths(cache, our_anchor, lens, mode="greedy", signals=False)[0], want)
        want, want_steps = reference_generate(ref, hf2, PROMPT, 30, monkeypatch)
        assert our_generate(load(path, target2, dtype=torch.float32), target2, PROMPT, 30) == (want, want_steps)
        assert max(want_steps) > 1


def _two_sample_chi2(a: torch.Tensor, b: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Homogeneity chi-square of two equal-size samples of paths (rows), rare paths pooled."""
    keys, inverse = torch.unique(torch.cat([a, b]), dim=0, return_inverse=True)
    n = a.shape[0]
    ca = torch.bincount(inverse[:n], minlength=keys.shape[0]).double()
    cb = torch.bincount(inverse[n:], minlength=keys.shape[0]).double()
    rare = (ca + cb) / 2 < min_expected
    ca = torch.cat([ca[~rare], ca[rare].sum()[None]])
    cb = torch.cat([cb[~rare], cb[rare].sum()[None]])
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    exp = (ca + cb) / 2
    return float((((ca - exp) ** 2 + (cb - exp) ** 2) / exp).sum()), int(keep.sum()) - 1


def _chi2_bound(df: int) -> float:
    """The chi-square quantile at p = 1e-4 (Wilson–Hilferty)."""
    z = 3.719
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@torch.no_grad()
def test_dflash2_sampled_paths_follow_the_reference_rule(tmp_path):
    hf, target = make_target(tmp_path, 2)
    ref, path = make_reference_drafter(tmp_path, 2, 4, group=16, top_k=4, rank=8, seed=5)
    ours = load_dflash2(path, target, dtype=torch.float32)
    n = 6000
    anchor, hidden, _ = reference_block(ref, hf, PROMPT)
    torch.manual_seed(0)
    ref_paths, ref_cand, ref_q = ref.propose(hidden.repeat(n, 1, 1), anchor.repeat(n), hf.lm_head, 1.0)
    cache, lens, our_anchor = our_block(ours, target, [PROMPT] * n)

    def ours_at(temperature):
        return ours.propose(
            cache, our_anchor, lens, torch.full((n,), temperature), torch.arange(n, dtype=torch.int64),
            torch.zeros(n, dtype=torch.int64), path="sample", signals=False,
        )  # fmt: skip

    block = ours_at(1.0)
    # q of the first draft (its predecessor is the anchor for both): the reference's, per candidate id.
    want = torch.zeros(VOCAB).scatter_add_(0, ref_cand[0, 0], ref_q[0, 0])
    got = torch.zeros(VOCAB).scatter_add_(0, block.prob_ids[0, 0].long(), block.probs[0, 0])
    torch.testing.assert_close(got, want, atol=TOL, rtol=0)
    stat, df = _two_sample_chi2(block.tokens, ref_paths)
    assert df >= 10 and stat < _chi2_bound(df), (stat, df)
    # A planted bug (drafts drawn at the wrong temperature) fails the same test.
    stat, df = _two_sample_chi2(ours_at(0.6).tokens, ref_paths)
    assert stat > _chi2_bound(df), (stat, df)


@torch.no_grad()
def test_dflash_sampled_drafts_follow_the_reference_rule(tmp_path):
    """DFlash 1 at T = 1: q is the reference's softmax of the draft logits, and the drafts follow it."""
    hf, target = make_target(tmp_path, 2)
    # A large output multiplier sharpens the random drafter's logits: drafts repeat often enough to count.
    ref, path = make_reference_drafter(tmp_path, 2, 4, v2=False, seed=6, output_multiplier=20.0)
    ours = load_dflash(path, target, dtype=torch.float32)
    n = 4000
    _, _, logits = reference_block(ref, hf, PROMPT)
    want_q = dflash_model._sampling_probs(logits, 1.0)
    cache, lens, anchor = our_block(ours, target, [PROMPT] * n)
    block = ours.propose(
        cache, anchor, lens, torch.ones(n), torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    )
    torch.testing.assert_close(block.probs[:1], want_q, atol=TOL, rtol=0)
    torch.manual_seed(1)
    ref_drafts = dflash_model._sample_probs(want_q.repeat(n, 1, 1))
    stat, df = _two_sample_chi2(block.tokens[:, :2], ref_drafts[:, :2])
    assert df >= 10 and stat < _chi2_bound(df), (stat, df)


def test_unsupported_reference_features_are_refused_at_load(tmp_path):
    hf, target = make_target(tmp_path, 2)
    _, path = make_reference_drafter(tmp_path, 2, 4)
    cfg = json.loads((path / "config.json").read_text())
    cases = {
        "conv_kernel_size": ({"dflash_config": {**cfg["dflash_config"], "conv_kernel_size": 3}}, "conv_kernel_size 3"),
        "sliding": ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}, "sliding_attention"),
        "causal": ({"is_causal": True}, "is_causal"),
        "rope": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        "top_k": ({"dflash_config": {**cfg["dflash_config"], "selector_top_k": 32}}, "selector_top_k"),
        "architectures": ({"architectures": ["Qwen3ForCausalLM"]}, "not a DFlash 2 drafter"),
    }
    for name, (patch, message) in cases.items():
        (path / "config.json").write_text(json.dumps({**cfg, **patch}))
        with pytest.raises(ValueError, match=message):
            load_dflash2(path, target)


def test_published_codebook_names_and_shards_load(tmp_path):
    """Published files store the codebooks without `.weight`, and large drafters are sharded."""
    from safetensors.torch import load_file, save_file

    hf, target = make_target(tmp_path, 2)
    ref, path = make_reference_drafter(tmp_path, 2, 4)
    state = load_file(str(path / "model.safetensors"))
    assert "candidate_selector.predecessor_codebook.weight" in state  # save_pretrained's names
    want = load_dflash2(path, target, dtype=torch.float32).state_dict()
    (path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}  # fmt: skip
    for file, keys in shards.items():
        save_file({k.removesuffix(".weight") if "codebook" in k else k: state[k] for k in keys}, str(path / file))
    index = {
        "weight_map": {k.removesuffix(".weight") if "codebook" in k else k: f for f, ks in shards.items() for k in ks}
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = load_dflash2(path, target, dtype=torch.float32).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_published_format_drafter_decodes_through_the_cli(tmp_path):
    """`generate --model HF_DIR --drafter DIR`: the method comes from the drafter's architectures."""
    import subprocess
    import sys

    make_target(tmp_path, 2, two_way=True)  # vocabulary 4096: the shipped tokenizer serves it
    _, path = make_reference_drafter(tmp_path, 2, 6)
    cmd = [sys.executable, "-m", "flashspark", "generate", "--model", str(tmp_path / "target_kv2_two_way")]
    cmd += ["--drafter", str(path), "--prompt", "def read_config(path):", "--max-new-tokens", "24", "--no-chat"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "[dflash2, K=5, auto paths]" in run.stderr and "output identical to plain decoding" in run.stderr
