"""Target model (a Llama-family decoder: Qwen3, Llama, Qwen2) and checkpoint I/O."""

from .config import DecoderConfig
from .decoder import DecoderForCausalLM, KVCache, ModelOutput
from .io import SHIPPED_TARGET, hf_parameter_names, load_model, load_tokenizer, save_model

__all__ = [
    "SHIPPED_TARGET",
    "DecoderConfig",
    "DecoderForCausalLM",
    "KVCache",
    "ModelOutput",
    "hf_parameter_names",
    "load_model",
    "load_tokenizer",
    "save_model",
]
