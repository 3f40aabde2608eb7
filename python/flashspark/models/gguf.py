"""GGUF files (llama.cpp's format) of Llama-family models: the config, the weights, the
tokenizer and the chat template, all from the one file.

* **Config.** The `{arch}.*` metadata of general.architecture llama, qwen2 or qwen3
  (block_count, embedding_length, head counts, rope.freq_base, ...) becomes a
  `DecoderConfig`; tied embeddings when the file has no `output.weight`. A key this
  loader does not know, RoPE scaling, experts or partial rotary is an error.
* **Weights.** F32, F16, BF16, Q8_0, Q4_0 and Q4_1 tensors are dequantized to fp32 with
  the `gguf` package (any other type is an error naming the tensor) and renamed to the
  Hugging Face names. llama.cpp's converter permutes Llama's q_proj / k_proj rows so that
  each rotary pair is adjacent (its RoPE rotates elements 2i, 2i + 1); the decoder's
  rotate-half pairs i with i + head_dim / 2, so `unpermute_qk` puts them back. Qwen2 and
  Qwen3 files are not permuted.
* **Tokenizer.** tokenizer.ggml.model "gpt2" (byte-level BPE): the tokens and merges, the
  pre-tokenizer's splits that llama.cpp uses for tokenizer.ggml.pre, control tokens as
  special tokens and user-defined ones as added tokens, BOS / EOS added when the file says.
* **Chat template.** tokenizer.chat_template, rendered like Hugging Face's
  `apply_chat_template` (a sandboxed Jinja environment, `models.chat`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from .chat import ChatTemplate, apply_chat_template  # noqa: F401 (apply_chat_template: part of this API)
from .config import DecoderConfig

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # general.architecture values, named as model_type
Q = gguf.GGMLQuantizationType
DEQUANTIZED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1)

# {arch}.* keys the loader reads; any other is a feature it does not implement.
_ARCH_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "rope.scaling.type",
    "rope.scaling.factor",
    "expert_count",
    "expert_used_count",
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), applied in turn: each splits the pieces
# the previous one left, and text that no regex matches stays a piece of its own.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "gpt-2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),  # single digits first, as SmolLM's tokenizer was trained
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}
_CONTROL, _USER_DEFINED = int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED)
SPECIAL_ROLES = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}


class GGUFTokenizer(NamedTuple):
    tokenizer: Tokenizer
    special_ids: dict[str, int]  # the roles of SPECIAL_ROLES the file names: bos, eos, pad, unk
    chat_template: str | None  # Jinja source, or None when the file has none


# ---------------------------------------------------------------------- reading


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    stat = path.stat()
    return _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


# Parsing the metadata of a real vocabulary takes seconds (the reader maps every token string);
# loading a model and then its tokenizer reads the same file, so the last one parsed is kept.
@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct and numpy errors on a bad file
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value field: numbers, strings, and lists of them."""
    return {name: field.contents() for name, field in reader.fields.items()}


def read_gguf(path: str | Path) -> tuple[DecoderConfig, dict[str, torch.Tensor]]:
    """The config and the fp32 weights (Hugging Face names) of a GGUF file."""
    reader = open_gguf(path)
    meta = metadata(reader)
    try:
        config = gguf_config(meta, {t.name for t in reader.tensors})
        tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            w = dequantize(t)
            if config.model_type == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_qk(w, config.num_attention_heads)
            elif config.model_type == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_qk(w, config.num_key_value_heads)
            tensors[name] = w
    except ValueError as e:
        raise ValueError(f"GGUF file {path}: {e}") from None
    return config, tensors


def read_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The tokenizer, special token ids and chat template of a GGUF file."""
    try:
        return build_tokenizer(metadata(open_gguf(path)))
    except ValueError as e:
        raise ValueError(f"GGUF file {path}: {e}") from None


# ---------------------------------------------------------------------- config


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> DecoderConfig:
    """The DecoderConfig that a file's metadata and tensor names describe."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"general.architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if int(meta.get("split.count", 1)) > 1:
        raise ValueError(f"a split GGUF ({meta['split.count']} files) is not supported; merge it into one file")
    prefix = arch + "."
    unknown = sorted(k for k in meta if k.startswith(prefix) and k[len(prefix) :] not in _ARCH_KEYS)
    if unknown:
        raise ValueError(f"metadata {', '.join(unknown)} not supported (a feature the decoder does not implement)")

    def key(name: str, default: Any = ...) -> Any:
        if prefix + name in meta:
            value = meta[prefix + name]
            if isinstance(value, list) and name != "attention.head_count_kv":
                raise ValueError(f"per-layer {prefix + name} {value[:4]}... is not supported")
            return value
        if default is ...:
            raise ValueError(f"metadata {prefix + name} is missing")
        return default

    scaling = key("rope.scaling.type", "none")
    if scaling != "none" or key("rope.scaling.factor", 1.0) != 1.0:
        raise ValueError(f"RoPE scaling {scaling!r} (factor {key('rope.scaling.factor', 1.0)}) is not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("tensor rope_freqs.weight (llama3-style RoPE scaling) is not supported")
    if key("expert_count", 0):
        raise ValueError(f"{key('expert_count')} experts (mixture of experts) are not supported")
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):  # per layer in some files
        if len(set(kv_heads)) != 1:
            raise ValueError(f"per-layer KV head counts {sorted(set(kv_heads))} are not supported")
        kv_heads = kv_heads[0]
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"value length {key('attention.value_length')} differs from key length {head_dim}")
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"partial rotary (rope.dimension_count {key('rope.dimension_count')} of {head_dim})")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(key("vocab_size"))
    if int(key("vocab_size", vocab)) != vocab:
        raise ValueError(f"{prefix}vocab_size {key('vocab_size')} differs from the {vocab} tokens of the tokenizer")
    return DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),  # llama.cpp's default
        max_position_embeddings=int(key("context_length")),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        tie_word_embeddings="output.weight" not in tensor_names,
        torch_dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        # Qwen2's q/k/v biases are part of its family; the files say the others by their tensors.
        attention_bias=arch != "qwen2" and "blk.0.attn_q.bias" in tensor_names,
        mlp_bias=arch == "llama" and "blk.0.ffn_gate.bias" in tensor_names,
        model_type=arch,
    )


# ---------------------------------------------------------------------- weights


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _BLOCK_NAME.fullmatch(name)
    if m is None or m.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"tensor {name} has no counterpart in the decoder (a layer it does not implement)")
    return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}.{m.group(3)}"


def dequantize(tensor) -> torch.Tensor:
    """The fp32 values of a GGUF tensor, shaped [rows, columns] like PyTorch's weights."""
    qtype = Q(tensor.tensor_type)
    if qtype not in DEQUANTIZED:
        supported = ", ".join(t.name for t in DEQUANTIZED)
        raise ValueError(f"tensor {tensor.name} has type {qtype.name}; supported types: {supported}")
    values = gguf.quants.dequantize(tensor.data, qtype)
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    # A copy: F32 data is a view of the read-only file map.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a Llama q_proj / k_proj weight or bias
    [num_heads * head_dim, ...]: the converter stored each head's rows as head_dim / 2
    pairs (reshape(heads, 2, head_dim / 2).swapaxes(1, 2)); this is its inverse."""
    rest = w.shape[1:]
    return w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------- tokenizer


def build_tokenizer(meta: dict[str, Any]) -> GGUFTokenizer:
    """A `tokenizers` Tokenizer from tokenizer.ggml.* metadata (byte-level BPE only)."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError("no tokenizer (tokenizer.ggml.model is missing)")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model {model!r} is not supported (only 'gpt2', byte-level BPE)")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZER_SPLITS)})")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise ValueError("tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"tokenizer.ggml.tokens holds {len(tokens) - len(vocab)} duplicate tokens")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise ValueError(f"merge {bad!r} is not two tokens separated by one space")
    tok = Tokenizer(BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole in the text (as llama.cpp does), at their own ids.
    types = meta.get("tokenizer.ggml.token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
    tok.add_special_tokens(control)
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    )

    special_ids = {}
    for role, key in SPECIAL_ROLES.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None:
            if not 0 <= int(i) < len(tokens):
                raise ValueError(f"tokenizer.ggml.{key} {i} is outside the {len(tokens)} tokens")
            special_ids[role] = int(i)
    # BOS / EOS around a sequence when encoding with add_special_tokens, where the file asks for it.
    ends = [
        (role, f"tokenizer.ggml.add_{role}_token")
        for role in ("bos", "eos")
        if meta.get(f"tokenizer.ggml.add_{role}_token", False)
    ]
    missing = [key for role, key in ends if role not in special_ids]
    if missing:
        raise ValueError(f"{missing[0]} is set but the file names no such token")
    if ends:
        names = {role: tokens[special_ids[role]] for role, _ in ends}
        single = " ".join(
            ([names["bos"]] if "bos" in names else []) + ["$A"] + ([names["eos"]] if "eos" in names else [])
        )
        pair = single + " " + single.replace("$A", "$B")
        tok.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[(names[r], special_ids[r]) for r in names]
        )
    return GGUFTokenizer(tok, special_ids, meta.get("tokenizer.chat_template"))


# ---------------------------------------------------------------------- chat template


def chat_template(vocab: GGUFTokenizer) -> ChatTemplate | None:
    """The file's chat template with its BOS / EOS strings; None when the file has none."""
    if vocab.chat_template is None:
        return None
    names = {role: vocab.tokenizer.id_to_token(i) for role, i in vocab.special_ids.items()}
    return ChatTemplate(vocab.chat_template, names.get("bos", ""), names.get("eos", ""))


def chat_prompt(vocab: GGUFTokenizer, user_text: str) -> str:
    """One user turn under the file's chat template, ending where the assistant's reply starts."""
    template = chat_template(vocab)
    if template is None:
        raise ValueError("the GGUF file has no chat template (tokenizer.chat_template)")
    return template.user(user_text)
