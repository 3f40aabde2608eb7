"""Decoder configuration, read from and written to Hugging Face `config.json` keys.

One decoder covers three Hugging Face families, told apart by `model_type`:

| model_type | q/k-norm | q/k/v bias       | o_proj bias      | MLP bias   |
|------------|----------|------------------|------------------|------------|
| qwen3      | yes      | `attention_bias` | `attention_bias` | no         |
| llama      | no       | `attention_bias` | `attention_bias` | `mlp_bias` |
| qwen2      | no       | always           | never            | no         |

`from_dict` refuses every Hugging Face key whose feature the decoder does not implement
(rope scaling, another activation, sliding windows, partial rotary, quantized weights):
such a checkpoint would otherwise load and compute wrong logits.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MODEL_TYPES = ("qwen3", "llama", "qwen2")
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Hugging Face names of SiLU (ACT2FN maps both to nn.SiLU).
SILU_NAMES = ("silu", "swish")

# What a drafter's layers take from its target: widths, attention shape, norm and RoPE constants.
# Not the target's family flags (q/k-norm, biases): a drafter's layers are DFlash's own Qwen3
# layers whatever the target is (the DFlash release does the same for its Llama targets), and
# the drafter kernels normalize the injected keys (`inject_context_kv` takes k_norm's weight).
DRAFTER_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
)


@dataclass
class DecoderConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    attention_bias: bool = False  # llama / qwen3: biases on q, k, v and o_proj
    mlp_bias: bool = False  # llama: biases on gate, up and down
    architectures: list[str] | None = None  # None: the family's class (ARCHITECTURES)
    model_type: str = "qwen3"

    def __post_init__(self):
        if self.architectures is None:
            self.architectures = [ARCHITECTURES.get(self.model_type, self.model_type)]
        self.check_family()
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"config {name} must be positive, got {getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def check_family(self) -> None:
        """The model_type is one the decoder implements, with flags that family has."""
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
        if self.model_type == "qwen2" and self.attention_bias:
            raise ValueError("qwen2 has q/k/v biases and no o_proj bias by definition; attention_bias must be false")
        if self.model_type != "llama" and self.mlp_bias:
            raise ValueError(f"mlp_bias is a llama option; {self.model_type} MLPs have no biases")

    # The layer shape each family implies (table in the module docstring).
    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        return self.attention_bias

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES.get(str(self.torch_dtype), torch.float32)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        """Take the keys we know after refusing the features we lack; HF configs carry many
        more keys, ignored as Hugging Face's own model classes ignore them."""
        d = dict(d)
        d.setdefault("model_type", "qwen3")
        check_supported(d)
        # An absent key means the default of Hugging Face's class for the family, not ours. (Absent
        # widths keep our defaults: the checkpoint's tensor shapes then disagree, a clear error.)
        if d.get("head_dim") is None and d["model_type"] == "qwen3":
            d["head_dim"] = 128
        elif d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("num_key_value_heads") is None and "num_attention_heads" in d:
            d["num_key_value_heads"] = d["num_attention_heads"]
        if d.get("tie_word_embeddings") is None:
            d["tie_word_embeddings"] = False
        if d.get("rope_theta") is None and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
        if d.get("torch_dtype") is None and d.get("dtype") is not None:
            d["torch_dtype"] = d["dtype"]
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = d["eos_token_id"][0]
        # Keys Hugging Face's class for this family does not read (its layers are fixed).
        if d["model_type"] == "qwen2":
            d.pop("attention_bias", None)
        if d["model_type"] != "llama":
            d.pop("mlp_bias", None)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    @classmethod
    def from_file(cls, path: str | Path) -> "DecoderConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config {path} not found")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model config {path} is not valid JSON: {e}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"model config {path}: {e}") from None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def drafter_shared(self) -> dict:
        """The fields a drafter built for this target copies (DRAFTER_SHARED_FIELDS)."""
        return {name: getattr(self, name) for name in DRAFTER_SHARED_FIELDS}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def _rope_type(spec) -> str | None:
    """The scaling type of a rope_scaling / rope_parameters dict (old and new HF spellings)."""
    if not isinstance(spec, dict):
        return None if spec is None else str(spec)
    return spec.get("rope_type", spec.get("type"))


def check_supported(d: dict) -> None:
    """ValueError for every key of a Hugging Face config whose feature the decoder lacks."""
    model_type = d.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    for key in ("rope_scaling", "rope_parameters"):
        spec = d.get(key)
        if isinstance(spec, dict) and any(isinstance(v, dict) for v in spec.values()):
            raise ValueError(f"{key} per layer type ({', '.join(spec)}) is not supported")
        kind = _rope_type(spec)
        if spec is not None and kind not in (None, "default"):
            raise ValueError(f"{key} of type {kind!r} is not supported (RoPE scaling is not implemented)")
        if isinstance(spec, dict) and spec.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"{key}.partial_rotary_factor={spec['partial_rotary_factor']} (partial rotary) is not supported"
            )
    if d.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']} (partial rotary) is not supported")
    act = d.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    # Qwen2 / Qwen3 semantics: a window applies only with use_sliding_window; Llama has none, so a
    # window there is a config of another family.
    if d.get("use_sliding_window"):
        raise ValueError(f"use_sliding_window=true (sliding window {d.get('sliding_window')}) is not supported")
    if model_type == "llama" and d.get("sliding_window") is not None:
        raise ValueError(f"sliding_window={d['sliding_window']} is not supported (llama has full attention)")
    other_layers = sorted({t for t in d.get("layer_types") or () if t != "full_attention"})
    if other_layers:
        raise ValueError(f"layer_types {other_layers} are not supported (only full_attention)")
    if d.get("quantization_config") is not None:
        method = d["quantization_config"].get("quant_method") if isinstance(d["quantization_config"], dict) else None
        raise ValueError(f"quantized checkpoints (quantization_config, method {method!r}) are not supported")
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if key in d and d[key] is not None and not isinstance(d[key], bool):
            raise ValueError(f"{key} must be true or false, got {d[key]!r}")
