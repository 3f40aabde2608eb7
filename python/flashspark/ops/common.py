"""What every op shares: the temperature floor, verify's width bound, the status
contract (:func:`raise_on_status`), the fakes' one-device rule, and the numerics the
PyTorch implementations share with the kernels."""

from __future__ import annotations

import torch

# Below this temperature a request samples greedily (vLLM's floor): the kernels' kGreedyTemperature,
# the fp32 value of 1e-5, which itself samples.
GREEDY_TEMPERATURE = float(torch.tensor(1e-5, dtype=torch.float32))
# The bound on verify's max_spec_len (the kernels' kMaxSpecLen).
MAX_SPEC_LEN = 4096


def raise_on_status(status: torch.Tensor, op: str) -> None:
    """Raise the ``RuntimeError`` the CPU binding raises for the first failed entry
    of an op's ``status`` output, or return if every entry is 0.

    Opt-in and synchronizing (it reads ``status`` on the host): an engine calls it
    off its hot path, e.g. after a step, or reads the codes itself. ``op`` names
    the op for the message (``"verify"``, ``"markov_step"``, ...).
    """
    codes = status.detach().reshape(-1).cpu()
    failed = torch.nonzero(codes).flatten()
    if failed.numel():
        code = int(codes[failed[0]])
        raise RuntimeError(f"flashspark.{op}: {torch.ops.flashspark.status_message(code)}")


def _one_device(op: str, **tensors) -> None:
    """Fakes run for meta tensors too; an op's tensors must share one device, or
    a fake would hand back uninitialized memory for a call the kernels reject."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise RuntimeError(
                f"flashspark.{op}: argument '{name}' is on {t.device} but argument "
                f"'{first[0]}' is on {first[1]}; every tensor of a call must be on one device"
            )


def _required(op: str, **tensors) -> None:
    """A required tensor argument passed as None raises a TypeError naming it (the op itself
    would fail with "tensor does not have a device", which names no argument)."""
    for name, t in tensors.items():
        if t is None:
            raise TypeError(f"flashspark.{op}: argument '{name}' is required (a tensor), got None")


def _to_int(t) -> int:
    return int(t.item()) if isinstance(t, torch.Tensor) else int(t)


FLOAT_MAX = torch.finfo(torch.float32).max


def drafter_logits(x: torch.Tensor) -> torch.Tensor:
    """How the drafter-side ops read logits and scores: NaN as -inf, +inf as the
    largest finite float (the kernels' drafter_logit)."""
    x = x.float()
    return torch.where(torch.isnan(x), float("-inf"), x).clamp(max=FLOAT_MAX)


def log_softmax_shifted(rows: torch.Tensor, temp: float) -> torch.Tensor:
    """log softmax(rows / temp) computed as (x - max) / temp, as the kernels do, so
    that finite logits never overflow at small temperatures."""
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temp, dtype=torch.float32)  # fp32, as the kernels
    shifted = (rows - rows.max(dim=-1, keepdim=True).values) * inv_t
    return torch.log_softmax(shifted, dim=-1)


def rms_norm(x, weight, eps):
    """Qwen3's RMSNorm: normalize in fp32, then scale by weight in x's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
