"""GGUF loading on small files the tests write with gguf's own writer: random tiny models of
each architecture (llama, qwen2, qwen3) with Q8_0 / Q4_0 / Q4_1 / F16 / BF16 / F32 tensors
and a tiny byte-level BPE vocabulary. The loaded weights equal gguf's dequantization with
llama.cpp's Q/K permutation undone, logits equal those of the same weights loaded from
safetensors, and both weights and logits match transformers' GGUF loader when it is
installed. The tokenizer built from the metadata gives the ids of the tokenizer it was
written from (and transformers'); the chat template renders like transformers'. Every
unsupported feature is a clear error."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from flashspark.models import (
    DecoderConfig,
    DecoderForCausalLM,
    hf_parameter_names,
    load_model,
    load_tokenizer,
    save_model,
)
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

gguf = pytest.importorskip("gguf")
from flashspark.models import gguf as model_gguf  # noqa: E402 (needs the gguf package)

pytestmark = pytest.mark.usefixtures("one_thread")

Q = gguf.GGMLQuantizationType
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The year 2024 had 366 days; it's a leap year, isn't it?",
    "  leading spaces,\ttabs and\n\nblank lines  ",
    "unicode: café, naïve, 東京, emoji 🙂",
    "<|im_start|>user\nhello<|im_end|>\n",
    "x<think>y</think>z 12345678",
]


def smollm_style_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE trained like SmolLM's: single digits split first, then GPT-2's regex."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n",
        "The quick brown fox jumps over the lazy dog. It's 10:30 and we're late; they'll wait.",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(["<think>", "</think>"])  # user-defined tokens, matched whole but not special
    return tok


def vocab_metadata(tok: Tokenizer):
    """tokens, token types and merges as llama.cpp's converter writes them."""
    n = tok.get_vocab_size()
    tokens = [tok.id_to_token(i) for i in range(n)]
    types = [
        int(gguf.TokenType.CONTROL)
        if t in SPECIALS
        else int(gguf.TokenType.USER_DEFINED)
        if t in ("<think>", "</think>")
        else int(gguf.TokenType.NORMAL)
        for t in tokens
    ]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama's q_proj / k_proj rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# A type per tensor kind: every supported type appears in each file.
TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.Q4_1,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.F16,
    "ffn_down": Q.BF16,
}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    parts = hf.split(".")  # model.layers.{i}.{module...}.{weight|bias}
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def tensor_type(name: str, array: np.ndarray):
    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    if array.ndim == 1:
        return Q.F32  # norms and biases, as llama.cpp keeps them
    return TYPES[kind]


def tiny_config(model_type: str, tie: bool, vocab: int, **kw) -> DecoderConfig:
    base = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
        model_type=model_type,
    )
    return DecoderConfig(**{**base, **kw})


def random_model(config: DecoderConfig, seed: int = 0) -> DecoderForCausalLM:
    m = DecoderForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m.eval()


def write_gguf(path, model: DecoderForCausalLM, tok: Tokenizer, types=None, meta=None, skip=(), extra_tensors=None):
    """A GGUF file of `model` and `tok` as llama.cpp's converter would write it. Returns the
    Hugging Face state the loader should produce: each tensor dequantized from its type."""
    c = model.config
    arch = c.model_type
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "qwen3":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    else:
        w.add_rope_dimension_count(c.head_dim)
    tokens, token_types, merges = vocab_metadata(tok)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for key, value in (meta or {}).items():
        (w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32)(
            key, value
        )
    expected = {}
    for hf in hf_parameter_names(c):
        name = gguf_name(hf)
        if name in skip:
            continue
        array = dict(model.named_parameters(remove_duplicate=False))[hf].detach().numpy().astype(np.float32)
        stored = array
        if arch == "llama" and ".attn_q." in name:
            stored = permute(array, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            stored = permute(array, c.num_key_value_heads)
        qtype = (types or {}).get(name, tensor_type(name, array))
        data = gguf.quants.quantize(stored, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
        values = gguf.quants.dequantize(data, qtype).reshape(array.shape)
        if stored is not array:  # the loader's view: the permutation undone
            n = c.num_attention_heads if ".attn_q." in name else c.num_key_value_heads
            values = unpermute_reference(values, n)
        expected[hf] = torch.from_numpy(np.array(values, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tok():
    return smollm_style_tokenizer()


def unpermute_reference(values: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' _reverse_permute_weights (the oracle of the inverse)."""
    dim = values.shape[0] // n_head // 2
    return values.reshape(n_head, dim, 2, *values.shape[1:]).swapaxes(2, 1).reshape(values.shape)


def test_unpermute_inverts_the_converter():
    g = np.random.default_rng(0)
    for n_head, head_dim, cols in ((4, 16, 8), (3, 64, 5), (1, 4, 1)):
        w = g.standard_normal((n_head * head_dim, cols)).astype(np.float32)
        stored = permute(w, n_head)
        assert not np.array_equal(stored, w)
        ours = model_gguf.unpermute_qk(torch.from_numpy(stored), n_head).numpy()
        assert np.array_equal(ours, w)
        assert np.array_equal(unpermute_reference(stored, n_head), w)
        bias = g.standard_normal(n_head * head_dim).astype(np.float32)
        assert np.array_equal(model_gguf.unpermute_qk(torch.from_numpy(permute(bias, n_head)), n_head).numpy(), bias)


CASES = [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)]


@pytest.mark.parametrize("arch,tie", CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def test_gguf_loads_like_safetensors(tmp_path, tok, arch, tie):
    model = random_model(tiny_config(arch, tie, tok.get_vocab_size()))
    path = tmp_path / "tiny.gguf"
    expected = write_gguf(path, model, tok)
    loaded = load_model(path)
    # GGUF stores floats as float32, and the loader keeps the stored value (as transformers does).
    assert loaded.config == dataclasses.replace(model.config, rms_norm_eps=float(np.float32(1e-5)))
    params = dict(loaded.named_parameters())
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name
        if value.dim() == 2:
            assert not torch.equal(value, dict(model.named_parameters())[name])  # really quantized
    if tie:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    # The same weights through safetensors give the same logits, bit for bit.
    ref = DecoderForCausalLM(model.config)
    ref.load_state_dict({**expected, **({"lm_head.weight": expected["model.embed_tokens.weight"]} if tie else {})})
    save_model(ref, tmp_path / "hf", dtype=torch.float32)
    x = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, load_model(tmp_path / "hf")(x).logits)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    assert load_model(path, dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16


def test_llama_permutation_is_undone(tmp_path, tok):
    """With F32 tensors the loaded q/k projections are the model's own, exactly."""
    model = random_model(tiny_config("llama", False, tok.get_vocab_size()))
    path = tmp_path / "f32.gguf"
    types = {gguf_name(n): Q.F32 for n in hf_parameter_names(model.config)}
    write_gguf(path, model, tok, types=types)
    loaded = dict(load_model(path).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(loaded[name], p.detach()), name


def test_tokenizer_from_metadata(tmp_path, tok):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, tok)
    vocab = model_gguf.read_tokenizer(path)
    assert vocab.special_ids == {"bos": 1, "eos": 2, "pad": 2}
    assert vocab.chat_template == CHATML
    ours = load_tokenizer(path)
    assert ours.get_vocab_size() == tok.get_vocab_size()
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == tok.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("<|im_start|>", add_special_tokens=False).ids == [1]
    think = tok.token_to_id("<think>")
    assert think in ours.encode("a<think>b").ids
    # Control tokens are special (dropped by skip_special_tokens); user-defined ones are not.
    assert ours.decode(ours.encode("<|im_end|><think>").ids) == "<think>"


def test_bos_added_when_the_file_says(tmp_path, tok):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    path = tmp_path / "bos.gguf"
    write_gguf(path, model, tok)
    meta = model_gguf.metadata(model_gguf.open_gguf(path))
    meta["tokenizer.ggml.add_bos_token"] = True
    with_bos = model_gguf.build_tokenizer(meta).tokenizer
    plain = with_bos.encode("hello", add_special_tokens=False).ids
    assert with_bos.encode("hello").ids == [1] + plain
    del meta["tokenizer.ggml.bos_token_id"]
    with pytest.raises(ValueError, match="add_bos_token is set but the file names no such token"):
        model_gguf.build_tokenizer(meta)


SPLIT_SAMPLES = TEXTS + ["I'LL say it's 1234567 o'clock\r\n\r\n  x", "a\n\n\nb  \n  c", "Ünïcödé ١٢٣ ⅷ"]


def test_pre_tokenizer_splits():
    """llama.cpp's split regexes against tokenizers' own forms of the same pre-tokenizers."""

    def pieces(pre, text):
        return [p for p, _ in pre.pre_tokenize_str(text)]

    def ours(name):
        meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": name, "tokenizer.ggml.tokens": ["a", "b"]}
        return model_gguf.build_tokenizer({**meta, "tokenizer.ggml.merges": []}).tokenizer.pre_tokenizer

    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    smollm = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    for text in SPLIT_SAMPLES:
        assert pieces(ours("gpt-2"), text) == pieces(gpt2, text), text
        assert pieces(ours("smollm"), text) == pieces(smollm, text), text


def test_pre_tokenizer_splits_against_transformers():
    """llama.cpp's case-insensitive rewrites of the Llama 3 and Qwen2 regexes split like the
    originals (which transformers uses)."""
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")

    def ours(name):
        meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": name, "tokenizer.ggml.tokens": ["a"]}
        return model_gguf.build_tokenizer({**meta, "tokenizer.ggml.merges": []}).tokenizer.pre_tokenizer

    for name in ("llama-bpe", "qwen2"):
        theirs = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(mapping.GGUF_PRE_TOKENIZER_SPLITS[name]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        for text in SPLIT_SAMPLES:
            assert ours(name).pre_tokenize_str(text) == theirs.pre_tokenize_str(text), (name, text)


def test_chat_template():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    text = model_gguf.apply_chat_template(CHATML, messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n"
    assert not model_gguf.apply_chat_template(CHATML, messages, add_generation_prompt=False).endswith("assistant\n")
    failing = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ValueError, match="chat template failed: only user turns"):
        model_gguf.apply_chat_template(failing, messages)
    with pytest.raises(ValueError, match="messages must be a list"):
        model_gguf.apply_chat_template(CHATML, [{"role": "user"}])
    with pytest.raises(ValueError, match="chat template failed"):
        model_gguf.apply_chat_template("{{ x.__class__.__mro__ }}{% for %}", messages)


def test_chat_prompt_of_a_file(tmp_path, tok):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    write_gguf(tmp_path / "chat.gguf", model, tok)
    vocab = model_gguf.read_tokenizer(tmp_path / "chat.gguf")
    assert model_gguf.chat_prompt(vocab, "Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="no chat template"):
        model_gguf.chat_prompt(vocab._replace(chat_template=None), "Hi")


# ---------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", True)])
def test_against_transformers_gguf_loader(tmp_path, tok, arch, tie):
    """transformers' from_pretrained(gguf_file=...) is the oracle: the same dequantized,
    un-permuted weights, the same logits, the same tokenizer ids and chat text."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for GGUF files
    model = random_model(tiny_config(arch, tie, tok.get_vocab_size()))
    write_gguf(tmp_path / "tiny.gguf", model, tok)
    ours = load_model(tmp_path / "tiny.gguf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="tiny.gguf", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    theirs = hf.state_dict()
    for name, p in ours.named_parameters(remove_duplicate=False):
        assert torch.equal(p, theirs[name]), name
    x = torch.randint(0, tok.get_vocab_size(), (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (ours(x).logits - hf(x).logits).abs().max().item()
    assert err <= 1e-4
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    our_tok = load_tokenizer(tmp_path / "tiny.gguf")
    for text in TEXTS:
        assert our_tok.encode(text, add_special_tokens=False).ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "Hi?"}]
    assert model_gguf.apply_chat_template(CHATML, messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


# ---------------------------------------------------------------------- errors


def test_unsupported_quant_type_names_tensor_and_type(tmp_path, tok):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    path = tmp_path / "q5.gguf"
    write_gguf(path, model, tok, types={"blk.1.attn_v.weight": Q.Q5_0})
    with pytest.raises(ValueError, match=r"tensor blk\.1\.attn_v\.weight has type Q5_0; supported types: F32, F16"):
        load_model(path)


@pytest.mark.parametrize(
    "meta,match",
    [
        ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, "RoPE scaling 'linear'"),
        ({"llama.rope.scaling.type": "yarn"}, "RoPE scaling 'yarn'"),
        ({"llama.expert_count": 8}, "mixture of experts"),
        ({"llama.attention.sliding_window": 16}, r"metadata llama\.attention\.sliding_window not supported"),
        ({"llama.rope.dimension_count": 8}, "partial rotary"),
        ({"llama.vocab_size": 7}, "vocab_size 7 differs"),
        ({"split.count": 3}, "split GGUF"),
        ({"llama.feed_forward_length": [96, 128]}, r"per-layer llama\.feed_forward_length"),
        ({"llama.attention.head_count_kv": [2, 1]}, r"per-layer KV head counts \[1, 2\]"),
    ],
)
def test_unsupported_metadata_raises(tmp_path, tok, meta, match):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    path = tmp_path / "bad.gguf"
    # Keys write_gguf sets itself are changed in the metadata dict the loader reads.
    own = ("llama.rope.dimension_count", "llama.feed_forward_length", "llama.attention.head_count_kv")
    written = {k: v for k, v in meta.items() if k not in own}
    write_gguf(path, model, tok, meta=written)
    full = model_gguf.metadata(model_gguf.open_gguf(path))
    full.update(meta)
    names = {t.name for t in model_gguf.open_gguf(path).tensors}
    with pytest.raises(ValueError, match=match):
        model_gguf.gguf_config(full, names)
    if written:
        with pytest.raises(ValueError, match=match):
            load_model(path)


def test_bad_architecture_tensors_and_files(tmp_path, tok):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    path = tmp_path / "x.gguf"
    write_gguf(path, model, tok, extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        load_model(path)
    meta = model_gguf.metadata(model_gguf.open_gguf(path))
    with pytest.raises(ValueError, match="general.architecture 'gemma' is not supported"):
        model_gguf.gguf_config({**meta, "general.architecture": "gemma"}, set())
    with pytest.raises(ValueError, match="tensor blk.0.ffn_gate_inp.weight has no counterpart"):
        model_gguf.hf_name("blk.0.ffn_gate_inp.weight")
    write_gguf(tmp_path / "y.gguf", model, tok, skip={"blk.1.ffn_up.weight"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path / "y.gguf")
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        load_model(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(tmp_path / "junk.gguf")


@pytest.mark.parametrize(
    "change,match",
    [
        ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
        ({"tokenizer.ggml.pre": "default"}, "pre-tokenizer 'default' is not supported"),
        ({"tokenizer.ggml.merges": ["a b c"]}, "merge 'a b c' is not two tokens"),
        ({"tokenizer.ggml.token_type": [1]}, "token_type has 1 entries"),
        ({"tokenizer.ggml.eos_token_id": 10**6}, "outside the"),
    ],
)
def test_bad_tokenizer_metadata(tmp_path, tok, change, match):
    model = random_model(tiny_config("llama", True, tok.get_vocab_size()))
    write_gguf(tmp_path / "t.gguf", model, tok)
    meta = model_gguf.metadata(model_gguf.open_gguf(tmp_path / "t.gguf"))
    with pytest.raises(ValueError, match=match):
        model_gguf.build_tokenizer({**meta, **change})
    del meta["tokenizer.ggml.model"]
    with pytest.raises(ValueError, match="no tokenizer"):
        model_gguf.build_tokenizer(meta)
