"""Target model: HF parameter names per family, checkpoint I/O, KV-cache forward forms,
plain AR decoding, and clear errors on bad input and on config features the decoder lacks.
(Parity with transformers: test_hf_parity.py; GGUF files: test_gguf.py.)"""

import json

import pytest
import torch
from flashspark import data
from flashspark.decoding.plain import generate, sample_next
from flashspark.models import DecoderConfig, DecoderForCausalLM, hf_parameter_names, load_model, save_model
from safetensors.torch import load_file, save_file

SHIPPED = data.ASSETS_DIR / "target"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**kw) -> DecoderConfig:
    base = dict(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        max_position_embeddings=64,
        torch_dtype="float32",
    )
    base.update(kw)
    return DecoderConfig(**base)


def tiny_model(seed=0, **kw) -> DecoderForCausalLM:
    m = DecoderForCausalLM(tiny_config(**kw))
    m.init_weights(seed)
    # Non-trivial norm weights so a swapped q_norm/k_norm would show.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return m.eval()


def tokens(B, S, vocab=101, seed=0):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


def close(a, b):
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------- names and I/O


def test_hf_parameter_names_layer0():
    names = hf_parameter_names(tiny_config(num_hidden_layers=1, tie_word_embeddings=False))
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]


def test_hf_parameter_names_per_family():
    """Llama and Qwen2 have no q/k-norm; Qwen2 has q/k/v biases and no o_proj bias; Llama's
    attention_bias and mlp_bias add biases to every projection."""
    qwen3 = hf_parameter_names(tiny_config(num_hidden_layers=1))
    llama = hf_parameter_names(tiny_config(num_hidden_layers=1, model_type="llama"))
    assert llama == [n for n in qwen3 if not n.endswith(("q_norm.weight", "k_norm.weight"))]
    qwen2 = hf_parameter_names(tiny_config(num_hidden_layers=1, model_type="qwen2"))
    assert sorted(set(qwen2) - set(llama)) == [f"model.layers.0.self_attn.{p}_proj.bias" for p in "kqv"]
    biased = hf_parameter_names(
        tiny_config(num_hidden_layers=1, model_type="llama", attention_bias=True, mlp_bias=True)
    )
    extra = sorted(n.removeprefix("model.layers.0.") for n in set(biased) - set(llama))
    assert extra == sorted(
        [f"self_attn.{p}_proj.bias" for p in "qkvo"] + [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    )
    for config in (tiny_config(model_type=t) for t in ("qwen3", "llama", "qwen2")):
        names = [n for n, _ in DecoderForCausalLM(config).named_parameters(remove_duplicate=False)]
        assert sorted(names) == sorted(hf_parameter_names(config) + (["lm_head.weight"] * config.tie_word_embeddings))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_family_save_load_round_trip(tmp_path, model_type):
    m = tiny_model(model_type=model_type, tie_word_embeddings=False)
    save_model(m, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == model_type
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]]
    m2 = load_model(tmp_path)
    assert m2.config == m.config
    x = tokens(2, 11)
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


@pytest.mark.parametrize("tie", [True, False])
def test_save_load_round_trip(tmp_path, tie):
    m = tiny_model(tie_word_embeddings=tie)
    save_model(m, tmp_path, dtype=torch.float32)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == set(hf_parameter_names(m.config))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["tie_word_embeddings"] is tie
    m2 = load_model(tmp_path)
    assert m2.config == m.config
    if tie:
        assert m2.lm_head.weight is m2.model.embed_tokens.weight
    x = tokens(2, 11)
    with torch.no_grad():
        assert torch.equal(m(x).logits, m2(x).logits)


def test_sharded_checkpoint_loads(tmp_path):
    m = tiny_model(tie_word_embeddings=False)
    save_model(m, tmp_path, dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
        weight_map.update({k: fname for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    x = tokens(1, 9)
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path)(x).logits, m(x).logits)


def test_hf_style_config_keys(tmp_path):
    """Newer HF configs put rope_theta under rope_parameters and use `dtype`."""
    m = tiny_model()
    save_model(m, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    cfg["dtype"] = cfg.pop("torch_dtype")
    cfg["attention_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path).config == m.config


# ------------------------------------------------------------ forward forms


def test_incremental_equals_full_forward():
    m = tiny_model()
    x = tokens(2, 24)
    with torch.no_grad():
        full = m(x, hidden_layers=[0, 2])
        cache = m.new_cache(2, 40)
        out = m(x[:, :9], cache, torch.zeros(2, dtype=torch.long), hidden_layers=[0, 2])
        close(out.logits, full.logits[:, :9])
        for s in range(9, 24):
            out = m(x[:, s : s + 1], cache, torch.full((2,), s), hidden_layers=[0, 2])
            close(out.logits[:, 0], full.logits[:, s])
            close(out.hidden[:, 0], full.hidden[:, s])
            close(out.last_hidden[:, 0], full.last_hidden[:, s])
    assert full.logits.dtype == torch.float32
    assert full.hidden.shape == (2, 24, 2, 64)


def test_ragged_forward_equals_per_request():
    """Verification form: each request its own position and count of new tokens."""
    m = tiny_model()
    B = 4
    x = tokens(B, 30)
    lens = torch.tensor([5, 12, 1, 20])
    num_new = torch.tensor([3, 7, 1, 5])
    with torch.no_grad():
        cache = m.new_cache(B, 32)
        m(x[:, :20], cache, torch.zeros(B, dtype=torch.long), lens)
        new = torch.stack([x[b, lens[b] : lens[b] + 7] for b in range(B)])
        out = m(new, cache, lens, num_new, hidden_layers=[1])
        for b in range(B):
            n = int(lens[b] + num_new[b])
            ref = m(x[b : b + 1, :n], hidden_layers=[1])
            close(out.logits[b, : num_new[b]], ref.logits[0, lens[b] : n])
            close(out.hidden[b, : num_new[b]], ref.hidden[0, lens[b] : n])


def test_padded_prefill_equals_per_request():
    m = tiny_model()
    prompts = [tokens(1, n, seed=n)[0] for n in (7, 2, 13)]
    B, S = 3, 13
    padded = torch.full((B, S), 5, dtype=torch.long)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    lens = torch.tensor([len(p) for p in prompts])
    with torch.no_grad():
        cache = m.new_cache(B, 20)
        out = m(padded, cache, torch.zeros(B, dtype=torch.long), lens)
        nxt = torch.tensor([[1], [2], [3]])
        step = m(nxt, cache, lens)
        for b, p in enumerate(prompts):
            ref = m(torch.cat([p, nxt[b]])[None]).logits[0]
            close(out.logits[b, : len(p)], ref[: len(p)])
            close(step.logits[b, 0], ref[len(p)])


def test_padding_never_writes_past_cache_or_into_others():
    m = tiny_model()
    with torch.no_grad():
        cache = m.new_cache(2, 10)
        # Request 0 ends exactly at the cache end; its padding would run past it.
        out = m(tokens(2, 6), cache, torch.tensor([8, 0]), torch.tensor([2, 6]))
        assert torch.isfinite(out.logits).all()
        assert cache.k[:, 0, :, :8].abs().sum() == 0  # nothing written before its start
        assert cache.k[:, 1, :, 6:].abs().sum() == 0  # request 1's padding-free tail untouched


def test_rollback_by_cache_lens():
    """Stale K/V beyond cache_lens are never read."""
    m = tiny_model()
    x = tokens(1, 12)
    with torch.no_grad():
        cache = m.new_cache(1, 16)
        m(x[:, :8], cache, torch.zeros(1, dtype=torch.long))
        m(tokens(1, 4, seed=9), cache, torch.tensor([8]))  # rejected draft
        out = m(x[:, 8:12], cache, torch.tensor([8]))
        close(out.logits[0], m(x).logits[0, 8:12])


def test_bf16_forward_runs():
    m = tiny_model().to(torch.bfloat16)
    with torch.no_grad():
        cache = m.new_cache(2, 16)
        out = m(tokens(2, 5), cache, torch.zeros(2, dtype=torch.long))
    assert cache.k.dtype == torch.bfloat16 and out.logits.dtype == torch.float32


# ------------------------------------------------------------------- decoding


def test_greedy_batch_equals_single():
    m = tiny_model()
    prompts = [tokens(1, n, seed=n)[0].tolist() for n in (3, 9, 5)]
    batched, stats = generate(m, prompts, max_new_tokens=8)
    singles = [generate(m, [p], max_new_tokens=8)[0][0] for p in prompts]
    assert batched == singles
    assert stats["new_tokens"] == 24 and stats["tokens_per_s"] > 0
    full = m(torch.tensor([prompts[1] + batched[1]])).logits[0]
    assert full[len(prompts[1]) - 1 : -1].argmax(-1).tolist() == batched[1]


def test_sampling_seeded_and_top_p():
    m = tiny_model()
    prompts = [[1, 2, 3], [4, 5]]
    a = generate(m, prompts, 10, temperature=1.0, top_p=0.9, seed=3)[0]
    b = generate(m, prompts, 10, temperature=1.0, top_p=0.9, seed=3)[0]
    assert a == b
    logits = torch.randn(4, 50)
    # A tiny nucleus keeps only the argmax.
    assert torch.equal(sample_next(logits, 1.0, 1e-6, torch.Generator().manual_seed(0)), logits.argmax(-1))


def test_eos_stops_request():
    m = tiny_model()
    first = generate(m, [[1, 2, 3]], 1)[0][0][0]
    out, _ = generate(m, [[1, 2, 3], [7, 8]], 6, eos_id=first)
    assert out[0] == [first]


def test_generate_bad_prompts():
    m = tiny_model()
    with pytest.raises(ValueError, match="empty"):
        generate(m, [[1, 2], []], 4)
    with pytest.raises(ValueError, match="cache holds 64"):
        generate(m, [list(range(60))], 10)
    with pytest.raises(ValueError, match="cache holds 16"):
        generate(m, [[1] * 10], 10, max_len=16)


def test_forward_past_cache_raises():
    m = tiny_model()
    cache = m.new_cache(1, 8)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        m(tokens(1, 4), cache, torch.tensor([6]))


# ----------------------------------------------------------------- bad files


def test_unknown_model_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config"):
        load_model(tmp_path)


def test_missing_weights_and_tensors(tmp_path):
    m = tiny_model()
    m.config.save(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    save_model(m, tmp_path, dtype=torch.float32)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(tmp_path)


def test_config_shape_mismatch(tmp_path):
    save_model(tiny_model(), tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape \(96, 64\).*\(128, 64\)"):
        load_model(tmp_path)


def test_bad_config_values(tmp_path):
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny_config(num_key_value_heads=3)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DecoderConfig.from_file(tmp_path)


# Config features the decoder does not implement: each would load and give wrong logits.
UNSUPPORTED = [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling of type 'linear'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling of type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling of type 'llama3'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5000.0}}, "rope_parameters of type 'longrope'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial rotary"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh'"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window"),
    ({"model_type": "llama", "sliding_window": 4096}, "sliding_window=4096"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "sliding_attention"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized checkpoints.*gptq"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"model_type": "qwen3_moe"}, "model_type 'qwen3_moe' is not supported"),
    ({"attention_bias": "yes"}, "attention_bias must be true or false"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, "rope_parameters per layer type"),
]


@pytest.mark.parametrize("change,match", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_config_features_raise(tmp_path, change, match):
    save_model(tiny_model(), tmp_path, dtype=torch.float32)
    cfg = {**json.loads((tmp_path / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"rope_scaling": None},
        {"rope_scaling": {"rope_type": "default"}},
        {"attention_dropout": 0.1},  # inference: no dropout
        {"hidden_act": "silu"},
        {"sliding_window": 4096, "use_sliding_window": False},  # Qwen semantics: the window is off
        {"layer_types": ["full_attention"] * 3},
    ],
)
def test_supported_config_values_load(tmp_path, change):
    m = tiny_model()
    save_model(m, tmp_path, dtype=torch.float32)
    cfg = {**json.loads((tmp_path / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path).config == m.config


def test_absent_keys_take_the_families_defaults():
    """As in Hugging Face's classes: untied, KV heads = query heads, head_dim = hidden / heads
    (Qwen3: 128)."""
    d = {
        k: v
        for k, v in tiny_config().to_dict().items()
        if k not in ("tie_word_embeddings", "num_key_value_heads", "head_dim")
    }
    for model_type, head_dim in (("llama", 16), ("qwen2", 16), ("qwen3", 128)):
        c = DecoderConfig.from_dict({**d, "model_type": model_type, "architectures": None})
        assert (c.tie_word_embeddings, c.num_key_value_heads, c.head_dim) == (False, 4, head_dim)


def test_family_flags_checked():
    with pytest.raises(ValueError, match="model_type 'gemma' is not supported"):
        tiny_config(model_type="gemma")
    with pytest.raises(ValueError, match="qwen2 has q/k/v biases"):
        tiny_config(model_type="qwen2", attention_bias=True)
    with pytest.raises(ValueError, match="mlp_bias is a llama option"):
        tiny_config(model_type="qwen3", mlp_bias=True)
    # Keys transformers' class for the family does not read are ignored, as there.
    d = {**tiny_config(model_type="qwen2").to_dict(), "attention_bias": True, "mlp_bias": True}
    assert DecoderConfig.from_dict(d) == tiny_config(model_type="qwen2")


# ------------------------------------------------------------ shipped model


@pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(), reason="shipped target not exported yet")
def test_shipped_target():
    tok = data.load_tokenizer()
    m = load_model(dtype=torch.float32)  # default: the shipped target
    assert m.config.vocab_size == tok.get_vocab_size() == 4096
    assert m.config.eos_token_id == data.special_token_ids(tok)["eot"]
    size = sum(f.stat().st_size for f in SHIPPED.iterdir())
    assert size < 16 * 2**20
    for name in ("MODEL_CARD.md", "corpus_manifest.json", "config.json"):
        assert (SHIPPED / name).is_file()
    prompt = tok.encode("def add(a, b):\n    return", add_special_tokens=False).ids
    a, _ = generate(m, [prompt], 12)
    b, _ = generate(m, [prompt, prompt[:3]], 12)
    assert a[0] == b[0]


def test_save_weights_shards_under_a_size_and_loads_back(tmp_path):
    """`io.save_weights` with a shard size: every shard at most that size on disk, an HF index
    naming each tensor's shard, the same tensors loaded back, and a later one-file save clears
    the shards (a directory never mixes two saves)."""
    from flashspark.models.io import INDEX_NAME, WEIGHTS_NAME, load_state_dict, save_weights

    gen = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(40 + 7 * i, 33, generator=gen) for i in range(9)}  # 5.3-12.8 KiB each
    state["big"] = torch.randn(200, 100, generator=gen)  # 78 KiB: larger than a shard, alone in one
    limit = 100 * 1024
    names = save_weights(state, tmp_path, max_shard_bytes=limit)
    assert len(names) > 1 and not (tmp_path / WEIGHTS_NAME).exists()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(state) and set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    for n in names:
        assert (tmp_path / n).stat().st_size <= limit
    got = load_state_dict(tmp_path)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    assert save_weights(state, tmp_path) == [WEIGHTS_NAME]
    assert sorted(p.name for p in tmp_path.iterdir()) == [WEIGHTS_NAME]


def test_save_weights_shares_a_frozen_backbones_files_and_export_copies_them(tmp_path, capsys):
    """`save_weights(share_with=...)`: tensors equal to the other checkpoint's are mapped, by
    relative path and with that file's sha256, to its files instead of being written again; the
    directory loads whole; a changed shared file, or an index that points outside its directory
    without a hash, is refused; `python -m flashspark export` writes a self-contained copy."""
    from flashspark.cli import main
    from flashspark.models.io import (
        INDEX_NAME,
        SHARED_KEY,
        is_self_contained,
        load_state_dict,
        save_weights,
    )

    gen = torch.Generator().manual_seed(0)
    backbone = {f"layers.{i}.w": torch.randn(30, 17, generator=gen) for i in range(3)}
    save_weights(backbone, tmp_path / "dflash")
    drafter = {**backbone, "layers.0.w": backbone["layers.0.w"] + 1, "conv.w": torch.randn(5, 3, generator=gen)}
    drafter["layers.1.w"] = backbone["layers.1.w"].to(torch.bfloat16)  # equal values, other dtype: its own copy
    save_weights(drafter, tmp_path / "dflash2", share_with=tmp_path / "dflash")
    index = json.loads((tmp_path / "dflash2" / INDEX_NAME).read_text())
    shared = {k for k, f in index["weight_map"].items() if f.startswith("../")}
    assert shared == {"layers.2.w"} and list(index["metadata"][SHARED_KEY]) == ["../dflash/model.safetensors"]
    got = load_state_dict(tmp_path / "dflash2")
    assert got.keys() == drafter.keys() and all(torch.equal(got[k], drafter[k]) for k in drafter)
    assert not is_self_contained(tmp_path / "dflash2") and is_self_contained(tmp_path / "dflash")
    with pytest.raises(ValueError, match="its own directory"):
        save_weights(drafter, tmp_path / "dflash", share_with=tmp_path / "dflash")

    assert main(["export", str(tmp_path / "dflash2"), str(tmp_path / "engine"), "--shard-mib", "0.002"]) == 0
    assert "read some from its backbone" in capsys.readouterr().out
    assert is_self_contained(tmp_path / "engine") and len(list((tmp_path / "engine").glob("*.safetensors"))) > 1
    got = load_state_dict(tmp_path / "engine")
    assert got.keys() == drafter.keys() and all(torch.equal(got[k], drafter[k]) for k in drafter)

    # the backbone retrained after the drafter was written: refused, not mixed in
    save_weights({**backbone, "layers.2.w": backbone["layers.2.w"] * 2}, tmp_path / "dflash")
    with pytest.raises(ValueError, match="changed since it was written"):
        load_state_dict(tmp_path / "dflash2")
    # an index that reads a file outside its directory must name it with its hash
    del index["metadata"][SHARED_KEY]
    (tmp_path / "dflash2" / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the directory"):
        load_state_dict(tmp_path / "dflash2")
