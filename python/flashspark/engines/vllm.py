"""vLLM's rejection sampler on `flashspark.verify`, in both of vLLM v1's forms.

    from flashspark.engines.vllm import RejectionSampler
    # vLLM's newer form: logits hold the target and the bonus rows; returns a SamplerOutput
    output = RejectionSampler()(spec_decode_metadata, draft_probs, logits, sampling_metadata)
    output_token_ids = output.sampled_token_ids
    # vLLM's older form: the draft rows alone and the bonus tokens vLLM sampled; returns the tensor
    output_token_ids = RejectionSampler()(spec_decode_metadata, draft_probs, target_logits,
                                          bonus_token_ids, sampling_metadata)

Shapes (B requests, T = sum of their draft tokens, V vocabulary), as vLLM passes them:
    metadata.draft_token_ids       [T] int32/int64
    metadata.cu_num_draft_tokens   [B] int32, cumulative counts without the leading 0
    metadata.max_spec_len          int
    metadata.target_logits_indices [T], metadata.bonus_logits_indices [B]: the rows of `logits`
                                   (newer form)
    draft_probs                    [T, V] fp32/bf16/fp16, or None for a deterministic (ngram-style) draft
    logits                         [T + B, V] fp32/bf16/fp16 (newer form): per request its n_b target
                                   rows, then its bonus row, the layout vLLM's model runner builds
    target_logits                  [T, V] (older form): the target's rows at the draft positions
    bonus_token_ids                [B, 1] (or [B]) int (older form): the bonus tokens vLLM sampled
    sampling_metadata.temperature  [B] float32; greedy at -1 (older vLLM), 0 (newer) or below 1e-5,
                                   or None when sampling_metadata.all_greedy
    sampling_metadata.generators   {request index: torch.Generator} for seeded requests
Returns [B, max_spec_len + 1] int32 (in the newer form as `SamplerOutput.sampled_token_ids`, with
`logprobs_tensors` None): the accepted drafts, then the correction or the bonus token, then -1
(vLLM's PLACEHOLDER_TOKEN_ID). A draft id of -1 is rejected where it stands.

The bonus token, in the newer form: `RejectionSampler()` samples it in the same kernel from the
bonus row at the request's temperature, reading `logits` as they are (no gather, no extra pass;
`target_logits_indices` and `bonus_logits_indices` are not read, `RejectionSampler(check_layout=True)`
checks them against the layout above, reading them on the host). `RejectionSampler(sampler)`, as vLLM
constructs it, lets vLLM's own sampler draw the bonus from `logits[bonus_logits_indices]` (its top-k,
top-p, min-p and generators) and verifies `logits[target_logits_indices]`, one gather, as vLLM does.

What it does not do: logprobs (a `max_num_logprobs` request raises), and the logits processing
vLLM applies before rejection sampling (top-k, top-p, min-p, penalties, bad words, allowed
tokens); the caller applies those to the logits (and draft_probs) first. A seeded request draws its
Philox seed from its generator, so it is reproducible across runs, but its numbers differ from
vLLM's own sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import ops

try:  # vLLM's own output type when vLLM is installed; a stand-in with its fields otherwise
    from vllm.v1.outputs import SamplerOutput
except ImportError:

    @dataclass
    class SamplerOutput:
        sampled_token_ids: torch.Tensor
        logprobs_tensors: Optional[object] = None


PLACEHOLDER_TOKEN_ID = ops.PLACEHOLDER_TOKEN  # -1, in drafts and in the output padding
GREEDY_TEMPERATURE = -1.0  # how older vLLM marks a greedy request (newer vLLM: 0, greedy here too)
SEED_BOUND = 2**62  # Philox seeds drawn from a request's generator lie in [0, SEED_BOUND)


class RejectionSampler(torch.nn.Module):
    """A drop-in for vLLM v1's `RejectionSampler`, lossless, on flashspark's fused verify:
    `forward(metadata, draft_probs, logits, sampling_metadata)` (newer vLLM) or
    `forward(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)` (older)."""

    def __init__(self, sampler=None, *, check_layout: bool = False):
        super().__init__()
        if sampler is not None and not callable(sampler):
            raise TypeError(
                f"RejectionSampler: sampler must be vLLM's Sampler (callable), got {type(sampler).__name__}"
            )
        self.sampler = sampler
        self.check_layout = check_layout

    def forward(
        self,
        metadata,
        draft_probs,
        target_logits=None,
        bonus_token_ids=None,
        sampling_metadata=None,
        *,
        logits=None,
    ):
        if logits is not None:  # newer form, by keyword
            if target_logits is not None or bonus_token_ids is not None:
                raise TypeError(
                    "RejectionSampler: pass either logits (newer vLLM) or target_logits and bonus_token_ids"
                )
            return self._forward_logits(metadata, draft_probs, logits, sampling_metadata)
        if isinstance(bonus_token_ids, torch.Tensor):  # older form
            if sampling_metadata is None:
                raise TypeError("RejectionSampler: the older form takes sampling_metadata after bonus_token_ids")
            return self._verify(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)
        if sampling_metadata is None and bonus_token_ids is not None:  # newer form, positionally
            return self._forward_logits(metadata, draft_probs, target_logits, bonus_token_ids)
        raise TypeError(
            "RejectionSampler: call forward(metadata, draft_probs, logits, sampling_metadata) or "
            "forward(metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata)"
        )

    def _forward_logits(self, metadata, draft_probs, logits, sampling_metadata):
        if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
            raise ValueError("RejectionSampler: logits must be a [T + B, V] tensor")
        if getattr(sampling_metadata, "max_num_logprobs", None) is not None:
            raise ValueError("RejectionSampler: logprobs are not returned (sampling_metadata.max_num_logprobs is set)")
        if self.sampler is not None:
            # vLLM's own bonus sampling, then the draft rows alone, as vLLM gathers them
            bonus = self.sampler(
                logits=logits[metadata.bonus_logits_indices],
                sampling_metadata=sampling_metadata,
                predict_bonus_token=True,
            ).sampled_token_ids
            tokens = self._verify(
                metadata, draft_probs, logits[metadata.target_logits_indices], bonus, sampling_metadata
            )
        else:
            tokens = self._verify(metadata, draft_probs, logits, None, sampling_metadata)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)

    def _verify(self, metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata) -> torch.Tensor:
        if not isinstance(target_logits, torch.Tensor):
            raise TypeError(f"RejectionSampler: the target logits must be a tensor, got {type(target_logits).__name__}")
        device = target_logits.device
        cu = metadata.cu_num_draft_tokens
        batch = int(cu.numel())
        num_tokens = int(metadata.draft_token_ids.numel())
        rows = num_tokens if bonus_token_ids is not None else num_tokens + batch
        if target_logits.ndim != 2 or target_logits.shape[0] != rows:
            what = "T" if bonus_token_ids is not None else "T + B (target and bonus rows)"
            raise ValueError(
                f"RejectionSampler: the target logits must be [{what}, V] = [{rows}, V] for T = {num_tokens} drafts "
                f"and B = {batch} requests, got {tuple(target_logits.shape)}"
            )
        cu_num_draft = torch.cat([cu.new_zeros(1), cu]).to(device=device, dtype=torch.int32)
        if bonus_token_ids is None and self.check_layout:
            check_logits_layout(metadata, cu_num_draft)
        tokens, _ = ops.verify(
            target_logits,
            metadata.draft_token_ids,
            cu_num_draft,
            temperature=request_temperatures(sampling_metadata, batch, device),
            seeds=request_seeds(sampling_metadata, batch, device),
            offsets=torch.zeros(batch, dtype=torch.int64, device=device),
            max_spec_len=int(metadata.max_spec_len),
            draft_probs=draft_probs,
            bonus_tokens=None if bonus_token_ids is None else bonus_token_ids.reshape(-1),
        )
        return tokens


def check_logits_layout(metadata, cu_num_draft: torch.Tensor) -> None:
    """Raise unless target_logits_indices / bonus_logits_indices name vLLM's layout (request b's
    draft rows cu[b] + b ..., then its bonus row cu[b + 1] + b); it reads them on the host."""
    cu = cu_num_draft.long()
    batch = cu.numel() - 1
    device = cu.device
    bonus = cu[1:] + torch.arange(batch, device=device)
    per_token = torch.repeat_interleave(torch.arange(batch, device=device), cu[1:] - cu[:-1], output_size=int(cu[-1]))
    target = torch.arange(per_token.numel(), device=device) + per_token
    given_t = metadata.target_logits_indices.to(device=device, dtype=torch.int64).reshape(-1)
    given_b = metadata.bonus_logits_indices.to(device=device, dtype=torch.int64).reshape(-1)
    if (
        given_t.shape != target.shape
        or given_b.shape != bonus.shape
        or not (torch.equal(given_t, target) and torch.equal(given_b, bonus))
    ):
        raise ValueError(
            "RejectionSampler: logits are not in vLLM's layout (per request its draft rows, then its bonus row); "
            "pass vLLM's sampler, RejectionSampler(sampler), to gather them by target_logits_indices and "
            "bonus_logits_indices"
        )


def request_temperatures(sampling_metadata, batch: int, device) -> torch.Tensor:
    """[B] float32 in flashspark's convention: 0 for a greedy request (vLLM's -1 or 0, or all_greedy)."""
    t = getattr(sampling_metadata, "temperature", None)
    if getattr(sampling_metadata, "all_greedy", False) or t is None:
        return torch.zeros(batch, dtype=torch.float32, device=device)
    t = t.to(device=device, dtype=torch.float32)
    return torch.where(t == GREEDY_TEMPERATURE, torch.zeros_like(t), t)


def request_seeds(sampling_metadata, batch: int, device) -> torch.Tensor:
    """[B] int64 Philox seeds: from each seeded request's generator (advancing it, as a draw
    does), else from torch's default generator."""
    seeds = torch.randint(0, SEED_BOUND, (batch,), dtype=torch.int64, device=device)
    for i, g in (getattr(sampling_metadata, "generators", None) or {}).items():
        if not 0 <= int(i) < batch:
            raise ValueError(f"sampling_metadata.generators names request {i}, outside the batch of {batch}")
        # drawn on the generator's device and copied there: no host synchronization
        seeds[int(i) : int(i) + 1] = torch.randint(0, SEED_BOUND, (1,), generator=g, device=g.device).to(device)
    return seeds
