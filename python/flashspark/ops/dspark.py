"""DSpark op: markov_step (wrapper, fake, PyTorch implementation)."""

from __future__ import annotations

from typing import Optional

import torch

from .common import GREEDY_TEMPERATURE, _one_device, _to_int, drafter_logits, log_softmax_shifted
from .philox import PURPOSE_DRAFT, gumbel, philox_u32


def markov_step(
    base_logits: torch.Tensor,
    prev_tokens: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    hidden: torch.Tensor,
    conf_w: torch.Tensor,
    conf_b: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    status: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DSpark intra-block step for all requests at once.

    ``logits = base_logits + W2 · W1[prev_tokens] (+ bias)``; the token is drawn
    by an exponential race at ``temperature`` (argmax at 0) with Philox at
    ``(seeds[b], positions[b])`` (greedy below a temperature of 1e-5); logits read
    NaN as -inf and +inf as the largest float, and a row with no finite logit takes
    token 0 with q one-hot; q = softmax(logits / T) is what ``verify``
    needs as dense q; the confidence is ``sigmoid(conf_w · [hidden ; W1[prev]] + conf_b)``.

    Args:
      base_logits: ``[B, V]`` the backbone's logits U_k at this block position.
      prev_tokens: ``[B]`` int32/int64 token drawn at the previous position.
      w1: ``[V, r]`` Markov embedding; w2: ``[V, r]`` Markov projection
        (a ``Linear(r, V)`` weight); same dtype as base_logits.
      hidden: ``[B, H]`` backbone hidden state h_k; conf_w ``[H + r]``; conf_b ``[1]``.
      temperature: ``[B]`` fp32; seeds ``[B]`` int64; positions ``[B]`` int64.
      bias: optional ``[V]``.
      status: optional ``[B]`` int32 output (see :func:`raise_on_status`): a
        request with a previous token outside ``[0, V)`` or a bad temperature fails:
        token -1, q 0, confidence 0.

    Returns ``(tokens [B] int32, q [B, V] fp32, confidence [B] fp32)``. The CUDA
    kernel reads W2 once per step for the whole batch (B <= 256, r <= 512).
    """
    return torch.ops.flashspark.markov_step(
        base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions, status=status
    )


@torch.library.register_fake("flashspark::markov_step")
def _markov_step_fake(
    base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions, *, status=None
):
    _one_device(
        "markov_step",
        base_logits=base_logits,
        prev_tokens=prev_tokens,
        w1=w1,
        w2=w2,
        bias=bias,
        hidden=hidden,
        conf_w=conf_w,
        conf_b=conf_b,
        temperature=temperature,
        seeds=seeds,
        positions=positions,
        status=status,
    )
    b, v = base_logits.shape
    return (
        base_logits.new_empty((b,), dtype=torch.int32),
        base_logits.new_empty((b, v), dtype=torch.float32),
        base_logits.new_empty((b,), dtype=torch.float32),
    )


def markov_step_reference(
    base_logits, prev_tokens, w1, w2, bias, hidden, conf_w, conf_b, temperature, seeds, positions
):
    """Oracle of :func:`flashspark.ops.markov_step`."""
    batch, vocab = base_logits.shape
    e = w1.float()[prev_tokens.long()]  # [B, r]
    logits = base_logits.float() + e @ w2.float().T  # [B, V]
    if bias is not None:
        logits = logits + bias.float()
    logits = drafter_logits(logits)
    tokens = torch.empty(batch, dtype=torch.int32)
    q = torch.zeros(batch, vocab)
    for b in range(batch):
        t = float(temperature[b])
        z = logits[b].cpu()
        if t < GREEDY_TEMPERATURE or not bool(torch.isfinite(z).any()):
            c = int(z.argmax())  # all -inf: token 0
            q[b, c] = 1.0
        else:
            q[b] = log_softmax_shifted(z, t).exp()
            # The race key z / T + g in fp64, as the kernel compares it across tiles.
            noise = gumbel(philox_u32(_to_int(seeds[b]), _to_int(positions[b]), PURPOSE_DRAFT, torch.arange(vocab)))
            c = int((z.double() * (1.0 / t) + noise.double()).argmax())
        tokens[b] = c
    feats = torch.cat([hidden.float(), e], dim=-1)
    conf = torch.sigmoid(feats @ conf_w.float() + conf_b.float().reshape(()))
    device = base_logits.device
    return tokens.to(device), q.to(device), conf.to(device)
