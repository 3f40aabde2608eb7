"""vLLM's rejection sampler on `flashspark.verify`.

    from flashspark.engines.vllm import RejectionSampler
    sampler = RejectionSampler()
    output_token_ids = sampler(spec_decode_metadata, draft_probs, target_logits, bonus_token_ids,
                               sampling_metadata)

Shapes (B requests, T = sum of their draft tokens, V vocabulary), as vLLM passes them:
    metadata.draft_token_ids       [T] int32/int64
    metadata.cu_num_draft_tokens   [B] int32, cumulative counts without the leading 0
    metadata.max_spec_len          int
    draft_probs                    [T, V] float32, or None for a deterministic (ngram-style) draft
    target_logits                  [T, V] fp32/bf16/fp16: the target's rows at the draft positions
    bonus_token_ids                [B, 1] (or [B]) int: the bonus token vLLM sampled for each request
    sampling_metadata.temperature  [B] float32, -1 marking a greedy request (vLLM's convention),
                                   or None when sampling_metadata.all_greedy
    sampling_metadata.generators   {request index: torch.Generator} for seeded requests
Returns [B, max_spec_len + 1] int32: the accepted drafts, then the correction or the bonus token,
then -1 (vLLM's PLACEHOLDER_TOKEN_ID). A draft id of -1 is rejected where it stands.

What it does not do: logprobs, and the logits processing vLLM applies before rejection
sampling (top-k, top-p, min-p, penalties, bad words, allowed tokens); the caller applies those
to target_logits (and draft_probs) first. A seeded request draws its Philox seed from its
generator, so it is reproducible across runs, but its numbers differ from vLLM's own sampler.
"""

from __future__ import annotations

import torch

from .. import ops

PLACEHOLDER_TOKEN_ID = ops.PLACEHOLDER_TOKEN  # -1, in drafts and in the output padding
GREEDY_TEMPERATURE = -1.0  # how vLLM marks a greedy request
SEED_BOUND = 2**62  # Philox seeds drawn from a request's generator lie in [0, SEED_BOUND)


class RejectionSampler(torch.nn.Module):
    """A drop-in for vLLM v1's `RejectionSampler.forward(metadata, draft_probs, target_logits,
    bonus_token_ids, sampling_metadata)`, lossless, on flashspark's fused verify."""

    def forward(self, metadata, draft_probs, target_logits, bonus_token_ids, sampling_metadata) -> torch.Tensor:
        device = target_logits.device
        cu = metadata.cu_num_draft_tokens
        batch = int(cu.numel())
        cu_num_draft = torch.cat([cu.new_zeros(1), cu]).to(device=device, dtype=torch.int32)
        tokens, _ = ops.verify(
            target_logits,
            metadata.draft_token_ids,
            cu_num_draft,
            temperature=request_temperatures(sampling_metadata, batch, device),
            seeds=request_seeds(sampling_metadata, batch, device),
            offsets=torch.zeros(batch, dtype=torch.int64, device=device),
            max_spec_len=int(metadata.max_spec_len),
            draft_probs=draft_probs,
            bonus_tokens=bonus_token_ids.reshape(-1),
        )
        return tokens


def request_temperatures(sampling_metadata, batch: int, device) -> torch.Tensor:
    """[B] float32 in flashspark's convention: 0 for a greedy request (vLLM's -1 or all_greedy)."""
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
