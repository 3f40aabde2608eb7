"""Counter-based randomness shared bit for bit with the kernels: Philox4x32-10
(csrc/include/flashspark/philox.h), keyed by (seed, position, purpose, index), so given
equal seeds the kernels and the PyTorch implementations draw identical numbers."""

from __future__ import annotations

import torch

# Purposes of draws; must match enum Purpose in philox.h.
PURPOSE_ACCEPT = 1
PURPOSE_RESAMPLE = 2
PURPOSE_DRAFT = 3
PURPOSE_PATH = 4

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a constant a and int64 tensor b < 2^32,
    using 16-bit halves so that no intermediate leaves int64."""
    ah, al = a >> 16, a & 0xFFFF
    bh, bl = b >> 16, b & 0xFFFF
    mid = ah * bl + al * bh
    t = al * bl + ((mid & 0xFFFF) << 16)
    return ah * bh + (mid >> 16) + (t >> 32), t & _MASK32


def philox4x32_10(counter: tuple, key: tuple) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 on int64 tensors (or ints) holding 32-bit words.

    counter: four words (c0, c1, c2, c3); key: two words (k0, k1); all broadcast.
    Returns the four output words as int64 tensors in [0, 2^32).
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & _MASK32 for k in key)
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_M0, c0)
        hi1, lo1 = _mulhilo32(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def philox_u32(seed: int, position: int, purpose: int, index: torch.Tensor | int) -> torch.Tensor:
    """32-bit draw for each ``index`` at (seed, position, purpose): lane index%4
    of the Philox block index//4, exactly as ``philox_u32`` in philox.h."""
    index = torch.as_tensor(index, dtype=torch.int64)
    seed &= (1 << 64) - 1
    position &= (1 << 64) - 1
    words = philox4x32_10(
        (index >> 2, position & _MASK32, position >> 32, purpose),
        (seed & _MASK32, seed >> 32),
    )
    out = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    return out.gather(-1, (index & 3).unsqueeze(-1).expand(out.shape[:-1] + (1,))).squeeze(-1)


def uniform_open01(bits: torch.Tensor) -> torch.Tensor:
    """Uniform in (0, 1) from 32-bit draws: (2*(x >> 9) + 1) * 2^-24, exact in fp32."""
    return (((bits >> 9) << 1) | 1).to(torch.float32) * (2.0**-24)


def gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log u): argmax(log r + g) samples from norm(r)."""
    return -torch.log(-torch.log(uniform_open01(bits)))


def exponential(bits: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise -log u, the same draw's inner term: argmax(r / E) samples from norm(r)."""
    return -torch.log(uniform_open01(bits))
