"""Qwen3 model configuration, read from and written to Hugging Face `config.json` keys."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What a drafter's layers take from its target: widths, attention shape, norm and RoPE constants.
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
class Qwen3Config:
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
    architectures: list[str] = field(default_factory=lambda: ["Qwen3ForCausalLM"])
    model_type: str = "qwen3"

    def __post_init__(self):
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

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES.get(str(self.torch_dtype), torch.float32)

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen3Config":
        """Take the keys we know; HF configs carry many more (ignored)."""
        d = dict(d)
        if d.get("model_type", "qwen3") != "qwen3":
            raise ValueError(f"model_type {d.get('model_type')!r} is not 'qwen3'")
        # Older HF configs omit head_dim: it then defaults to hidden/heads.
        if d.get("head_dim") is None and "hidden_size" in d and "num_attention_heads" in d:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if d.get("rope_theta") is None and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
        if d.get("torch_dtype") is None and d.get("dtype") is not None:
            d["torch_dtype"] = d["dtype"]
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = d["eos_token_id"][0]
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    @classmethod
    def from_file(cls, path: str | Path) -> "Qwen3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config {path} not found")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model config {path} is not valid JSON: {e}") from None
        return cls.from_dict(d)

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
