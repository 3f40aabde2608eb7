"""Target model (Qwen3-style decoder) and checkpoint I/O."""

from .config import Qwen3Config
from .io import SHIPPED_TARGET, hf_parameter_names, load_model, save_model
from .qwen3 import KVCache, ModelOutput, Qwen3ForCausalLM

__all__ = [
    "SHIPPED_TARGET",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "KVCache",
    "ModelOutput",
    "hf_parameter_names",
    "load_model",
    "save_model",
]
