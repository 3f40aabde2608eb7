"""Python wrappers of the ``torch.ops.flashspark`` ops, one module per method
(``verify``, ``tree_verify``, ``dflash``, ``dflash2``, ``dspark``), each op with its fake (meta)
implementation beside it so ``torch.compile`` can trace it, and its PyTorch
implementation (differentiable where training needs it; the tests' oracle).

Conventions shared by every op:
  * randomness is Philox4x32-10 keyed by a per-request int64 seed; a per-request
    int64 ``offsets`` counter says where in that request's stream the call draws
    (see ``flashspark.ops.philox``);
  * output shapes depend only on sizes and size arguments, never on values, and
    no op synchronizes with the host, so every op can be captured in a CUDA graph;
  * invalid arguments raise ``RuntimeError`` naming the argument. Bad values
    inside tensors (token ids, lengths, offsets, temperatures, non-finite target
    logits) fail only the request, token or call they belong to: ops that can see
    such values take an optional ``status`` int32 tensor (see
    :func:`raise_on_status`), where the kernel writes 0 or a status code, and the
    failed item's outputs take documented values. On the CPU, without ``status``,
    the op raises instead. On CUDA no kernel ever traps or synchronizes.
"""

from .common import GREEDY_TEMPERATURE, MAX_SPEC_LEN, raise_on_status
from .dflash import block_diffusion_attention, inject_context_kv
from .dflash2 import MAX_TOP_K, path_sampling_defaults, path_select, topk_select, two_tap_conv
from .dspark import markov_step
from .tree_verify import MAX_TREE_DEPTH, NO_PARENT, tree_verify, tree_verify_out
from .verify import PLACEHOLDER_TOKEN, verify, verify_out

__all__ = [
    "MAX_TOP_K",
    "verify",
    "verify_out",
    "tree_verify",
    "tree_verify_out",
    "block_diffusion_attention",
    "inject_context_kv",
    "two_tap_conv",
    "topk_select",
    "path_select",
    "path_sampling_defaults",
    "markov_step",
    "raise_on_status",
    "GREEDY_TEMPERATURE",
    "PLACEHOLDER_TOKEN",
    "MAX_SPEC_LEN",
    "MAX_TREE_DEPTH",
    "NO_PARENT",
]
