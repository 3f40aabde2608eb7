"""Confidence proxy: per-token survival probabilities for a DFlash 2 drafter.

DSpark's scheduler needs c_k, the probability that draft token k survives
verification given that its prefix survived. A DFlash 2 drafter has no
confidence head; its path selector leaves signals from which c_k is predicted:

  top_prob         softmax probability of the best candidate in the selector's score row
  top_margin       the row's best score minus its second best
  unary_top1_prob  the backbone's top-1 probability at that position
  entropy          entropy of the selector's distribution over the K candidates
  position         k (a learned bias per block position)

Every signal of position k is known before draft k is drawn (the score row is
S_k(x_{k-1}, ·), given the drafts before k): a scheduler may decide whether to
verify draft k from them and stay lossless at T > 0. The drawn candidate's own
probability or margin would make that decision read the draft it judges
(scheduling/confidence.py says why that is biased).

The proxy is a logistic model on those signals, fitted offline on
verification outcomes of a calibration split, and updated online from the
outcomes every verify step returns anyway: observations go into a fixed-size
ring buffer on the loop's device (bounded memory, masked writes, no host
synchronization), and every `refit_every` steps a fixed number of gradient
steps runs on the buffer (no data-dependent control flow, so no sync either).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.tree import node_survival
from .confidence import conditional

SIGNALS = ("top_prob", "top_margin", "unary_top1_prob", "entropy")


MARGIN_CAP = 30.0  # logit units: a single candidate's margin is +inf


def _features(signals: torch.Tensor) -> torch.Tensor:
    """[..., 4] raw signals -> [..., 4] features on a logit-like scale."""
    eps = 1e-6
    top = signals[..., 0].clamp(eps, 1 - eps)
    top1 = signals[..., 2].clamp(eps, 1 - eps)
    margin = signals[..., 1].clamp(max=MARGIN_CAP)
    return torch.stack(
        [torch.log(top) - torch.log1p(-top), margin, torch.log(top1) - torch.log1p(-top1), signals[..., 3]], dim=-1
    )


class ConfidenceProxy:
    """c_k = sigmoid(w · features(signals_k) + bias[k])."""

    def __init__(
        self,
        width: int,
        device=None,
        capacity: int = 4096,
        refit_every: int = 32,
        refit_steps: int = 10,
        lr: float = 0.5,
    ):
        self.width = width
        self.weight = torch.zeros(len(SIGNALS), device=device)
        self.bias = torch.zeros(width, device=device)
        self.capacity, self.refit_every, self.refit_steps, self.lr = capacity, refit_every, refit_steps, lr
        self._feats = torch.zeros(capacity, len(SIGNALS), device=device)
        self._pos = torch.zeros(capacity, dtype=torch.long, device=device)
        self._label = torch.zeros(capacity, device=device)
        self._mask = torch.zeros(capacity, device=device)
        self._head = 0
        self._calls = 0
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # (signals, their features)

    # ------------------------------------------------------------ prediction
    def __call__(self, signals: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """signals [B, K, 4] -> c [B, K] in (0, 1); the bias of column k, or of `positions` [B, K]
        (0-based block positions: a tree's node depths - 1, past the width clamped to its last)."""
        if positions is None:
            return torch.sigmoid(self._features_of(signals) @ self.weight + self.bias[: signals.shape[-2]])
        bias = self.bias[positions.clamp(0, self.width - 1)]
        return torch.sigmoid(self._features_of(signals) @ self.weight + bias)

    def _features_of(self, signals: torch.Tensor) -> torch.Tensor:
        # The loop scores a step's signals, then observes the same tensor: compute once.
        if self._last is None or self._last[0] is not signals:
            self._last = (signals, _features(signals))
        return self._last[1]

    # ------------------------------------------------------------ fitting
    def _observations(self, signals, num_accepted, num_verified):
        """(features [N*K, 4], positions, labels, mask): token k's outcome is
        known when it was verified and its prefix survived (k <= accepted)."""
        n, k = signals.shape[:2]
        pos = torch.arange(k, device=signals.device)
        seen = (pos[None] < num_verified[:, None]) & (pos[None] <= num_accepted[:, None])
        label = (pos[None] < num_accepted[:, None]).float()
        return (
            self._features_of(signals).reshape(n * k, -1),
            pos.repeat(n),
            label.reshape(-1),
            seen.float().reshape(-1),
        )

    def _loss(self, feats, pos, label, mask, weight, bias):
        logits = feats @ weight + bias[pos]
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, label, reduction="none")
        return (bce * mask).sum() / mask.sum().clamp(min=1) + 1e-4 * (weight.pow(2).sum() + bias.pow(2).sum())

    def fit(
        self, signals: torch.Tensor, num_accepted: torch.Tensor, num_verified: torch.Tensor, max_iter: int = 200
    ) -> float:
        """Offline fit on a calibration split: signals [N, K, 4], outcomes [N]. Returns the final loss."""
        feats, pos, label, mask = self._observations(signals, num_accepted.long(), num_verified.long())
        w = self.weight.clone().requires_grad_(True)
        b = self.bias.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

        @torch.enable_grad()
        def closure():
            opt.zero_grad()
            loss = self._loss(feats, pos, label, mask, w, b)
            loss.backward()
            return loss

        loss = opt.step(closure)
        self.weight, self.bias = w.detach(), b.detach()
        return float(loss.detach())

    def observe(self, signals: torch.Tensor, num_accepted: torch.Tensor, num_verified: torch.Tensor) -> None:
        """Online update from one verify step's outcomes (no host synchronization)."""
        self.observe_rows(*self._observations(signals, num_accepted.long(), num_verified.long()))

    def observe_tree(self, signals: torch.Tensor, tree, num_verified: torch.Tensor) -> None:
        """Online update from a tree step: a verified node of rank 0 whose parent was accepted
        is an observation of its row's c (the proxy's event: the target's token is the row's
        best candidate), labelled by whether it was accepted."""
        M = tree.parents.shape[1]
        verified = torch.arange(M, device=signals.device) < num_verified.long()[:, None]
        on = torch.cat((torch.ones_like(tree.accepted[:, :1]), tree.accepted), 1)
        seen = verified & (tree.rank == 0) & on.gather(1, tree.parents)
        self.observe_rows(
            self._features_of(signals).reshape(-1, len(SIGNALS)),
            (tree.depths - 1).clamp(0, self.width - 1).reshape(-1),
            tree.accepted.float().reshape(-1),
            seen.float().reshape(-1),
        )

    def observe_rows(self, feats, pos, label, mask) -> None:
        """Observations (features [N, 4], 0-based positions, labels, mask) into the ring; a refit
        every `refit_every` calls."""
        rows = (feats, pos, label, mask)
        total = rows[0].shape[0]
        n = min(total, self.capacity)  # more rows than the ring holds: the last ones
        start = (self._head + total - n) % self.capacity  # row i of the step goes to (head + i) % capacity
        # Into the ring as at most two slices (the head is a host int: no synchronization).
        first = min(n, self.capacity - start)
        for buf, r in zip((self._feats, self._pos, self._label, self._mask), rows):
            r = r[total - n :]
            buf[start : start + first] = r[:first]
            buf[: n - first] = r[first:]
        self._head = (self._head + total) % self.capacity
        self._calls += 1
        if self._calls % self.refit_every == 0:
            self._refit()

    def _refit(self) -> None:
        """A fixed number of gradient steps on the ring buffer, warm-started (also
        when called from inside the loop's no_grad)."""
        w = self.weight.clone().requires_grad_(True)
        b = self.bias.clone().requires_grad_(True)
        for _ in range(self.refit_steps):
            with torch.enable_grad():
                loss = self._loss(self._feats, self._pos, self._label, self._mask, w, b)
                gw, gb = torch.autograd.grad(loss, (w, b))
            with torch.no_grad():
                w -= self.lr * gw
                b -= self.lr * gb
        self.weight, self.bias = w.detach(), b.detach()

    def for_scheduler(self, online: bool = True) -> "ProxyConfidence":
        """This proxy as a `ConfidenceScheduler` confidence source (`confidence_fn`)."""
        return ProxyConfidence(self, online)

    # ------------------------------------------------------------ persistence
    def state(self) -> dict:
        return {
            "signals": list(SIGNALS),
            "width": self.width,
            "weight": self.weight.tolist(),
            "bias": self.bias.tolist(),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.state(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path, device=None, **kw) -> "ConfidenceProxy":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"confidence proxy {path} not found")
        d = json.loads(path.read_text())
        if d.get("signals") != list(SIGNALS):
            raise ValueError(f"{path}: proxy signals {d.get('signals')} differ from {list(SIGNALS)}")
        proxy = cls(d["width"], device=device, **kw)
        proxy.weight = torch.tensor(d["weight"], device=device)
        proxy.bias = torch.tensor(d["bias"], device=device)
        return proxy


class ProxyConfidence:
    """`ConfidenceScheduler(confidence_fn=...)` glue: confidences from the step's DFlash 2
    signals, and (when `online`) the proxy updated from every step's verify outcomes."""

    wants_signals = True

    def __init__(self, proxy: ConfidenceProxy, online: bool = True):
        self.proxy, self.online = proxy, online

    def __call__(self, state) -> torch.Tensor:
        """Per-draft confidences [B, K']; of a tree, per node in column order, the conditional
        c_k = a_k / a_(k-1) of its node survivals a (`models.tree.node_survival`), so that the
        scheduler's prefix products are those survivals."""
        if state.signals is None:
            raise ValueError("the confidence proxy needs a DFlash 2 drafter's path signals")
        if state.tree is None:
            return self.proxy(state.signals)
        return conditional(node_survival(self.proxy(state.signals, state.tree.depths - 1), state.tree))

    def observe(self, block, num_accepted: torch.Tensor, num_verified: torch.Tensor) -> None:
        if not self.online:
            return
        if block.tree is None:
            self.proxy.observe(block.signals, num_accepted, num_verified)
        else:
            self.proxy.observe_tree(block.signals, block.tree, num_verified)
