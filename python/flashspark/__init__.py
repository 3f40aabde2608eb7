"""flashspark: kernels and a speculative loop for block-diffusion speculative decoding.

Importing the package loads the compiled extension, which registers the ops
under ``torch.ops.flashspark``; ``flashspark.ops`` holds their documented
Python wrappers and ``flashspark.reference`` their pure-PyTorch oracles.
"""

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from flashspark import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "flashspark's compiled extension is missing; build it with `make build` "
        "or `pip install --no-build-isolation -e .`"
    ) from e

from flashspark import ops  # noqa: E402
from flashspark.ops import raise_on_status, tree_verify, tree_verify_out, verify, verify_out  # noqa: E402

__version__ = "0.1.0"
__all__ = ["ops", "raise_on_status", "tree_verify", "tree_verify_out", "verify", "verify_out"]
