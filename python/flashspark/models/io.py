"""Load and save Qwen3 checkpoints as Hugging Face style directories:
`config.json` plus `model.safetensors` (or shards listed in
`model.safetensors.index.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import Qwen3Config
from .qwen3 import Qwen3ForCausalLM

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def hf_parameter_names(config: Qwen3Config) -> list[str]:
    """The tensor names a Hugging Face Qwen3ForCausalLM checkpoint holds."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    names.append("model.norm.weight")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    elif (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path}")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {f} listed in {INDEX_NAME} is missing")
    return files


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (every shard)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(path):
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types
            raise ValueError(f"cannot read weights file {f}: {e}") from None
    return tensors


SHIPPED_TARGET = Path(__file__).resolve().parent.parent / "assets" / "target"


def load_model(
    path: str | Path | None = None, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> Qwen3ForCausalLM:
    """Build a Qwen3ForCausalLM from a checkpoint directory (default: the
    shipped target). `dtype` defaults to the config's `torch_dtype`.

    Raises FileNotFoundError for a missing directory/config/weights and
    ValueError for missing tensors or shapes that disagree with the config.
    Extra tensors (e.g. a redundant `lm_head.weight` in a tied checkpoint)
    are ignored.
    """
    path = Path(path) if path is not None else SHIPPED_TARGET
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} not found")
    config = Qwen3Config.from_file(path)
    tensors = load_state_dict(path)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    expected = hf_parameter_names(config)
    missing = [n for n in expected if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {', '.join(missing[:5])}{more}")
    params = dict(model.named_parameters())
    for name in expected:
        want, got = tuple(params[name].shape), tuple(tensors[name].shape)
        if want != got:
            raise ValueError(f"tensor {name} has shape {got} but config.json implies {want}")
    dtype = dtype or config.dtype
    state = {n: tensors[n].to(dtype) for n in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    return model.to(device) if device is not None else model


def save_model(model: Qwen3ForCausalLM, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write config.json and model.safetensors with HF Qwen3 tensor names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = hf_parameter_names(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {n: params[n].detach().to("cpu", dtype).contiguous() for n in names}
    config = Qwen3Config.from_dict({**model.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")})
    config.save(path / "config.json")
    save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
