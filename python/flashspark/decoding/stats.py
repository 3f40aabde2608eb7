"""What the speculative loop measures, accumulated step by step and returned as a dict:
τ per request, drafts verified and wasted, per-position acceptance, DFlash 2's Top-K
recall, seconds per phase, and (with `record`) per-step confidences and outcomes."""

from __future__ import annotations

import time

import torch

from ..models.drafter import top2_margin


class Clock:
    """Seconds per phase (synchronizing on CUDA so each phase owns its kernels)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def tick(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self.last
        self.last = now


class LoopStats:
    def __init__(self, batch: int, max_spec_len: int, device: torch.device, record: bool = False):
        self.batch, self.record = batch, record
        self.clock = Clock(device)
        self.steps, self.accepted, self.verified = (torch.zeros(batch, dtype=torch.int64) for _ in range(3))
        self.pos_accepted = torch.zeros(max_spec_len, dtype=torch.int64)
        self.pos_tried = torch.zeros(max_spec_len, dtype=torch.int64)
        self.draft_positions = torch.arange(1, max_spec_len + 1, device=device)  # draft k = 1..K
        self.recall = torch.zeros(3, dtype=torch.int64)  # positions with a known target token, top-1 hits, Top-K hits
        self.records: list[dict] = []
        self.plain_steps = self.iterations = 0

    def tick(self, phase: str) -> None:
        self.clock.tick(phase)

    def step(self, block, drafted: bool, vtokens, n_acc, k_b, live, lens=None) -> None:
        """One loop iteration's outcomes: the drafts verified (k_b) and accepted (n_acc) per live
        request (`lens`: their committed tokens before the step, for the records)."""
        self.iterations += 1
        self.plain_steps += not drafted
        if self.record and drafted:
            self.records.append(_record(block, n_acc, k_b, live, self.iterations - 1, lens))
        if block.cand_ids is not None:
            self.recall += _recall(block.cand_ids, vtokens, n_acc, live)
        ar = self.draft_positions
        self.steps += live.cpu()
        self.accepted += (n_acc * live).cpu()
        self.verified += (k_b * live).cpu()
        self.pos_accepted += ((ar <= n_acc[:, None]) & live[:, None]).sum(0).cpu()
        # Block position k was tried when a verified draft sat there: a chain's first k_b, a tree's
        # deepest verified node and above.
        tried = k_b if block.tree is None else deepest(block.tree.depths, k_b)
        self.pos_tried += ((ar <= tried[:, None]) & live[:, None]).sum(0).cpu()

    def result(self, outputs: list[list[int]]) -> dict:
        clock, steps, accepted, verified = self.clock, self.steps, self.accepted, self.verified
        seconds = clock.last - clock.start
        new_tokens = sum(len(o) for o in outputs)
        total_steps = int(steps.sum())
        stats = {
            "requests": self.batch,
            "new_tokens": new_tokens,
            "steps": total_steps,
            # tau: tokens a request gains per target forward (accepted drafts + 1), over all request-steps.
            "tau": (int(accepted.sum()) + total_steps) / max(1, total_steps),
            # None for a request that took no step (its first token, from the prefill, ended it).
            "tau_per_request": [(a + n) / n if n else None for a, n in zip(accepted.tolist(), steps.tolist())],
            "steps_per_request": steps.tolist(),
            # Drafts sent to the target per request-step, and those of them rejected (verify work wasted).
            "verified_per_step": int(verified.sum()) / max(1, total_steps),
            "drafts_verified": int(verified.sum()),
            "drafts_wasted": int(verified.sum() - accepted.sum()),
            # Fraction of request-steps whose draft k (k = 1..K) was accepted, among those that verified it.
            "acceptance_per_position": (self.pos_accepted / self.pos_tried.clamp(min=1)).tolist(),
            # ... and its counts, which sum exactly over batches
            "accepted_per_position": self.pos_accepted.tolist(),
            "tried_per_position": self.pos_tried.tolist(),
            "seconds": seconds,
            "prefill_seconds": clock.seconds.get("prefill", 0.0),
            "decode_seconds": seconds - clock.seconds.get("prefill", 0.0),
            "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
            "phase_seconds": dict(clock.seconds),
            "plain_steps": self.plain_steps,  # loop iterations the scheduler ran as plain decode steps
            # Loop iterations (one target forward each, whole batch): requests finish at different
            # iterations, so there are more of these than steps per request.
            "iterations": self.iterations,
        }
        if int(self.recall[0]):
            stats["recall_top1"], stats["recall_topk"] = (self.recall[1:] / self.recall[0]).tolist()
            stats["recall_positions"] = int(self.recall[0])
        if self.record:
            stats["records"] = {
                k: torch.cat([r[k] for r in self.records]) if self.records and self.records[0][k] is not None else None
                for k in RECORD_KEYS
            }
        return stats


def deepest(depths: torch.Tensor, k_b: torch.Tensor) -> torch.Tensor:
    """[B] the depth of the deepest of each tree's first k_b draft nodes (0 for none)."""
    cols = torch.arange(depths.shape[1], device=depths.device)
    return torch.where(cols < k_b[:, None], depths, 0).max(1).values


def _recall(cand_ids, vtokens, n_acc, live) -> torch.Tensor:
    """[known, top-1 hits, Top-K hits] of the drafter's candidate lists at the block
    positions whose target token the verify step revealed (accepted drafts and the
    correction or bonus token: positions 0 .. n_acc)."""
    J = min(cand_ids.shape[1], vtokens.shape[1])
    tgt = vtokens[:, :J]
    known = (torch.arange(J, device=tgt.device) <= n_acc[:, None]) & live[:, None]
    top1 = (cand_ids[:, :J, 0] == tgt) & known
    topk = (cand_ids[:, :J] == tgt[..., None]).any(-1) & known
    return torch.stack([known.sum(), top1.sum(), topk.sum()]).cpu()


# What a record holds per live request-step (stats["records"][key], rows in decode order).
RECORD_KEYS = (
    "confidence",  # [N, K'] DSpark's calibrated per-token survival (None for other drafters)
    "signals",  # [N, K', 4] DFlash 2's path signals (the proxy's inputs)
    "num_accepted",  # [N]
    "num_verified",  # [N]
    "top2_margin",  # [N, K'] the drafter's top-1 minus top-2 log-prob (the margin baseline's input)
    "step",  # [N] the loop iteration
    "tokens",  # [N, K'] the drafted block
    "request",  # [N] the request's index in the batch
    "ctx_len",  # [N] its committed tokens before the step
)


def _record(block, n_acc, k_b, live, step: int, lens=None) -> dict:
    """The live requests' confidences / signals and outcomes of one step, on the CPU, with the
    drafter's top-2 margins, the drafted tokens, the request, its context length and the loop
    iteration (online scorers replay records step by step; traces replay them under policies)."""
    rows = live.nonzero()[:, 0]

    def pick(x):
        return None if x is None else x[rows].float().cpu()

    # DFlash returns its logits, not their margins: the margin baseline reads them all the same.
    margin = block.top2_margin
    if margin is None and block.logits is not None and block.tree is None:
        margin = top2_margin(block.logits)
    return {
        "confidence": pick(block.confidence),
        "signals": pick(block.signals),
        "num_accepted": n_acc[rows].cpu(),
        "num_verified": k_b[rows].cpu(),
        "top2_margin": pick(margin),
        "step": torch.full((rows.numel(),), step, dtype=torch.int64),
        "tokens": block.tokens[rows].cpu(),
        "request": rows.cpu(),
        "ctx_len": None if lens is None else lens[rows].cpu(),
    }
