"""The PyTorch implementations of the flashspark ops, in one namespace: the oracle the
tests compare every kernel against. Each lives beside its op in ``flashspark.ops.<method>``;
randomness is the kernels' Philox stream, bit for bit (``flashspark.ops.philox``)."""

from .ops.common import FLOAT_MAX, GREEDY_TEMPERATURE, drafter_logits, log_softmax_shifted, rms_norm
from .ops.dflash import block_diffusion_attention_reference, inject_context_kv_reference, rope_cos_sin_cache
from .ops.dflash2 import (
    CONV_GROUP,
    conv_groups,
    grouped_taps,
    path_pair_scores_reference,
    path_select_reference,
    topk_select_reference,
    two_tap_conv_reference,
)
from .ops.dspark import markov_step_reference
from .ops.philox import (
    PURPOSE_ACCEPT,
    PURPOSE_DRAFT,
    PURPOSE_PATH,
    PURPOSE_RESAMPLE,
    exponential,
    gumbel,
    philox4x32_10,
    philox_u32,
    uniform_open01,
)
from .ops.tree_verify import tree_from_paths, tree_verify_reference
from .ops.verify import verify_reference

__all__ = [
    "FLOAT_MAX",
    "GREEDY_TEMPERATURE",
    "drafter_logits",
    "log_softmax_shifted",
    "rms_norm",
    "block_diffusion_attention_reference",
    "inject_context_kv_reference",
    "rope_cos_sin_cache",
    "CONV_GROUP",
    "conv_groups",
    "grouped_taps",
    "path_pair_scores_reference",
    "path_select_reference",
    "topk_select_reference",
    "two_tap_conv_reference",
    "markov_step_reference",
    "PURPOSE_ACCEPT",
    "PURPOSE_DRAFT",
    "PURPOSE_PATH",
    "PURPOSE_RESAMPLE",
    "exponential",
    "gumbel",
    "philox4x32_10",
    "philox_u32",
    "uniform_open01",
    "verify_reference",
    "tree_verify_reference",
    "tree_from_paths",
]
