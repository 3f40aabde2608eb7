"""The target against Hugging Face transformers (a test-only dependency; skipped without it).

Random-weight models of each family (qwen3, llama, qwen2), tied and untied, GQA ratios
1, 3 and 4, saved by transformers as sharded safetensors and loaded with `load_model`.
Logits in fp32 agree within 1e-4 through batched ragged prefill, decode with the KV cache,
the ragged verify forward (several new tokens per request at per-request cache lengths)
and rollback (cache lengths set back, then continued), each against transformers' full
forward over the request's sequence. Configs with features the decoder lacks, as
transformers writes them, are refused."""

import json

import pytest
import torch
from flashspark.models import hf_parameter_names, load_model

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
GQA = {1: (4, 4), 3: (6, 2), 4: (8, 2)}  # ratio: (query heads, KV heads)
VOCAB, HIDDEN = 97, 48  # 48 = heads * head_dim for every head count above (Qwen2 has no head_dim key)
ATOL = 1e-4


def hf_config(model_type: str, gqa: int = 3, tie: bool = False, **extra):
    heads, kv = GQA[gqa]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        tie_word_embeddings=tie,
    )
    if model_type != "qwen2":
        kw["head_dim"] = HIDDEN // heads
    kw.update(extra)
    return CONFIGS[model_type](**kw)


def hf_model(config, seed: int = 0):
    """A transformers model with every weight random: norms around 1 and non-zero biases, so
    a missing q/k-norm or bias shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    return model.eval()


def saved_sharded(model, path):
    model.save_pretrained(path, max_shard_size="40KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def check_close(ours, ref):
    err = (ours - ref).abs().max().item()
    assert err <= ATOL, f"max |ours - transformers| = {err:.2e} > {ATOL}"


def check_cached_forms(ours, hf, seed: int = 0):
    """Prefill, decode, ragged verify and rollback with the KV cache, each against the full
    transformers forward over the sequence each request holds at that point."""
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    @torch.no_grad()
    def reference(seq):
        return hf(torch.tensor([seq])).logits[0]

    def ragged(chunks):
        """[B, S] right-padded tokens and their counts."""
        S = max(len(c) for c in chunks)
        return torch.tensor([c + [0] * (S - len(c)) for c in chunks]), torch.tensor([len(c) for c in chunks])

    seqs = [rand(n) for n in (5, 9, 2)]
    B = len(seqs)
    cache = ours.new_cache(B, 48)
    with torch.no_grad():
        # Prefill with ragged prompt lengths.
        tokens, lens = ragged(seqs)
        out = ours(tokens, cache, torch.zeros(B, dtype=torch.long), lens)
        for b, s in enumerate(seqs):
            check_close(out.logits[b, : len(s)], reference(s))
        # Decode, one token per request at its own position.
        for _ in range(3):
            step = [rand(1) for _ in seqs]
            out = ours(torch.tensor(step), cache, torch.tensor([len(s) for s in seqs]))
            for b, s in enumerate(seqs):
                s += step[b]
                check_close(out.logits[b, 0], reference(s)[-1])
        # Ragged verify: several new tokens per request, then keep only an accepted prefix.
        for new_counts, accepted in (([4, 1, 3], [2, 1, 0]), ([2, 5, 1], [0, 3, 1])):
            drafts = [rand(n) for n in new_counts]
            tokens, counts = ragged(drafts)
            out = ours(tokens, cache, torch.tensor([len(s) for s in seqs]), counts)
            for b, s in enumerate(seqs):
                n = new_counts[b]
                check_close(out.logits[b, :n], reference(s + drafts[b])[-n:])
                s += drafts[b][: accepted[b]]  # rollback: the next cache_lens drop the rest
        # Continue after the rollback: stale K/V past each cache length are never read.
        step = [rand(2) for _ in seqs]
        out = ours(torch.tensor(step), cache, torch.tensor([len(s) for s in seqs]))
        for b, s in enumerate(seqs):
            check_close(out.logits[b], reference(s + step[b])[-2:])


CASES = [(t, gqa, tie) for t in CONFIGS for gqa in GQA for tie in (False, True)]


@pytest.mark.parametrize(
    "model_type,gqa,tie", CASES, ids=[f"{t}-gqa{g}-{'tied' if e else 'untied'}" for t, g, e in CASES]
)
def test_parity_with_transformers(tmp_path, model_type, gqa, tie):
    hf = hf_model(hf_config(model_type, gqa, tie))
    ours = load_model(saved_sharded(hf, tmp_path), dtype=torch.float32)
    assert ours.config.model_type == model_type and ours.config.tie_word_embeddings is tie
    assert ours.config.num_attention_heads // ours.config.num_key_value_heads == gqa
    # Every tensor transformers has is one of ours and equal.
    theirs = hf.state_dict()
    mine = dict(ours.named_parameters(remove_duplicate=False))
    assert set(hf_parameter_names(ours.config)) <= set(theirs)
    for name in hf_parameter_names(ours.config):
        assert torch.equal(mine[name], theirs[name]), name
    x = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        check_close(ours(x).logits, hf(x).logits)
    check_cached_forms(ours, hf)


@pytest.mark.parametrize(
    "model_type,extra",
    [("llama", dict(attention_bias=True)), ("llama", dict(mlp_bias=True)), ("qwen3", dict(attention_bias=True))],
    ids=["llama-attention-bias", "llama-mlp-bias", "qwen3-attention-bias"],
)
def test_parity_with_biases(tmp_path, model_type, extra):
    hf = hf_model(hf_config(model_type, gqa=3, **extra))
    ours = load_model(saved_sharded(hf, tmp_path), dtype=torch.float32)
    assert any(n.endswith(".bias") for n in hf_parameter_names(ours.config))
    check_cached_forms(ours, hf, seed=1)


UNSUPPORTED = [
    ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}), "RoPE scaling"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 2.0}), "RoPE scaling"),
    (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
        "RoPE scaling",
    ),
    ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0}), "RoPE scaling"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding window"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1), "sliding window"),
]


@pytest.mark.parametrize(
    "model_type,extra,match", UNSUPPORTED, ids=[f"{t}-{m}-{i}" for i, (t, _, m) in enumerate(UNSUPPORTED)]
)
def test_unsupported_features_as_transformers_writes_them(tmp_path, model_type, extra, match):
    config = hf_config(model_type, **extra)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


def test_qwen2_window_that_is_off_loads(tmp_path):
    """Qwen2 semantics: a sliding_window without use_sliding_window is not used."""
    hf = hf_model(hf_config("qwen2", sliding_window=4, use_sliding_window=False))
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()).get("use_sliding_window") is False
    x = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        check_close(load_model(tmp_path, dtype=torch.float32)(x).logits, hf(x).logits)
