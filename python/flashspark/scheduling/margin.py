"""Margin logistic: the simplest online confidence baseline for a drafter without a head.

For draft position k = 1..K of a block,

    c_k = sigmoid(a_k * m_k + b_k)

with m_k the drafter's top-1 minus top-2 log-probability at that position (the same number
as the top-1 minus top-2 logit: the softmax normalizer cancels) and (a_k, b_k) learned only
online, from the outcomes every verify step returns anyway ("token k accepted, given its
prefix was"), starting from a neutral prior: nothing is fitted offline. Inference engines
ship this kind of confidence for DFlash-style drafters' dynamic speculation length; here it
is the yardstick for the DFlash 2 proxy (proxy.py: four path-selector signals, fitted
offline) and DSpark's calibrated head.

Update, after each verify step and per position: an online Newton (Laplace) step. The
belief about theta_k = (a_k, b_k) is a Gaussian with mean theta_k and precision P_k (2 x 2);
the new mean maximizes that Gaussian times the step's Bernoulli likelihood (NEWTON_STEPS
Newton iterations from the old mean) and the step's Hessian adds to P_k. Before each step
P_k decays by `forget` towards the prior precision, so a drifting acceptance rate is
tracked and P_k stays invertible. Fixed-shape tensor ops only: no host synchronization in
`observe`, O(K) memory (the input checks do synchronize: `validate=False` skips them).

Shapes:
  margin        [B, K'] float, K' <= width (draft positions 1..K'), >= 0; +inf is allowed
                (a drafter whose top-2 is masked) and read as MARGIN_CAP
  num_accepted  [B] int: token k (0-based) was accepted iff k < num_accepted
  num_verified  [B] int: token k's outcome is known iff k < num_verified and k <= num_accepted
  c = model(margin)  [B, K'] in (0, 1)
  theta [width, 2] (a_k, b_k); precision [width, 2, 2]
"""

from __future__ import annotations

import torch

from .calibration import outcomes

PRIOR_SLOPE = 0.5  # a_k per nat of margin: only "a larger margin is more likely accepted"
PRIOR_BIAS = 0.0  # b_k: c = 1/2 at a tie between the top two
PRIOR_PRECISION = 1.0  # per parameter; about 4 outcomes' worth at c = 1/2 (p(1-p) = 1/4 each)
NEWTON_STEPS = 3  # per verify step: the step's MAP is a smooth 2-d problem, 3 iterations suffice
DEFAULT_FORGET = 0.999  # precision kept per step: a memory of about 1000 verify steps
MARGIN_CAP = 30.0  # nats; larger margins (and +inf) all read as "certain" already


class MarginLogistic:
    """c_k = sigmoid(a_k * margin_k + b_k), per position, updated online (module docstring)."""

    def __init__(self, width: int, device=None, forget: float = DEFAULT_FORGET, validate: bool = True):
        if width < 1:
            raise ValueError(f"width must be >= 1 draft position, got {width}")
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget must lie in (0, 1], got {forget}")
        self.width, self.forget, self.validate = width, forget, validate
        self.prior_mean = torch.tensor([PRIOR_SLOPE, PRIOR_BIAS], device=device)
        self.prior_precision = torch.eye(2, device=device) * PRIOR_PRECISION
        self.theta = self.prior_mean.repeat(width, 1)  # [width, 2]
        self.precision = self.prior_precision.repeat(width, 1, 1)  # [width, 2, 2]
        self.steps = 0

    # ------------------------------------------------------------ prediction
    def __call__(self, margin: torch.Tensor) -> torch.Tensor:
        """margin [B, K'] -> c [B, K'] in (0, 1)."""
        x = self._design(margin)
        return torch.sigmoid((x * self.theta[: x.shape[1]]).sum(-1))

    def _design(self, margin: torch.Tensor) -> torch.Tensor:
        """[B, K'] margins -> [B, K', 2] rows (m, 1), checked (module docstring)."""
        if margin.dim() != 2 or not margin.is_floating_point():
            raise ValueError(f"margin must be a float [B, K] tensor, got {margin.dtype} {tuple(margin.shape)}")
        if not 1 <= margin.shape[1] <= self.width:
            raise ValueError(f"margin has {margin.shape[1]} draft positions; this model has 1..{self.width}")
        if self.validate:
            if bool(torch.isnan(margin).any()):
                raise ValueError("margin has NaN entries")
            if bool((margin < 0).any()):
                raise ValueError("margin must be top-1 minus top-2 (>= 0); got negative entries")
        m = margin.to(self.theta.dtype).clamp(max=MARGIN_CAP)
        return torch.stack([m, torch.ones_like(m)], -1)

    # ------------------------------------------------------------ online update
    def observe(self, margin: torch.Tensor, num_accepted: torch.Tensor, num_verified: torch.Tensor) -> None:
        """One verify step's outcomes: a Newton (Laplace) update per position."""
        x = self._design(margin)
        n, k = margin.shape
        if num_accepted.shape != (n,) or num_verified.shape != (n,):
            raise ValueError(
                f"outcomes must be [{n}] per request, got {tuple(num_accepted.shape)} and {tuple(num_verified.shape)}"
            )
        # Token k teaches only where it was verified and its prefix survived (calibration.outcomes).
        label, _, seen = outcomes(num_accepted.long(), num_verified.long(), k)
        label, seen = label.to(x.dtype), seen.to(x.dtype)  # [B, K']

        # The old belief, its precision decayed towards the prior's.
        mean0 = self.theta[:k]
        prec0 = self.forget * self.precision[:k] + (1.0 - self.forget) * self.prior_precision
        theta = mean0
        for _ in range(NEWTON_STEPS):
            grad, hess = _bernoulli_terms(x, label, seen, theta)
            grad = grad + (prec0 @ (theta - mean0)[..., None])[..., 0]
            theta = theta - solve_2x2(prec0 + hess, grad)
        _, hess = _bernoulli_terms(x, label, seen, theta)
        self.theta = torch.cat([theta, self.theta[k:]])
        self.precision = torch.cat([prec0 + hess, self.precision[k:]])
        self.steps += 1

    # ------------------------------------------------------------ report
    def state(self) -> dict:
        return {
            "signal": "top-1 minus top-2 log-prob of the drafter, per draft position",
            "width": self.width,
            "slope": self.theta[:, 0].tolist(),
            "bias": self.theta[:, 1].tolist(),
            "steps_observed": self.steps,
            "prior": {"slope": PRIOR_SLOPE, "bias": PRIOR_BIAS, "precision": PRIOR_PRECISION},
            "forget": self.forget,
        }


def _bernoulli_terms(x: torch.Tensor, label: torch.Tensor, seen: torch.Tensor, theta: torch.Tensor):
    """Gradient [K', 2] and Hessian [K', 2, 2] of the step's negative log-likelihood at theta [K', 2],
    summed over the requests whose outcome at the position is known (x [B, K', 2])."""
    p = torch.sigmoid((x * theta).sum(-1))  # [B, K']
    grad = ((seen * (p - label))[..., None] * x).sum(0)
    w = seen * p * (1 - p)
    hess = torch.einsum("bk,bki,bkj->kij", w, x, x)
    return grad, hess


def solve_2x2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a^-1 b for [..., 2, 2] symmetric positive definite a and [..., 2] b, in closed form
    (batched, no factorization whose error check would synchronize the host)."""
    a00, a01, a11 = a[..., 0, 0], a[..., 0, 1], a[..., 1, 1]
    det = a00 * a11 - a01 * a01
    return torch.stack([a11 * b[..., 0] - a01 * b[..., 1], a00 * b[..., 1] - a01 * b[..., 0]], -1) / det[..., None]
