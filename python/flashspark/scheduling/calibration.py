"""Calibration metrics for per-token survival probabilities.

A confidence c_k is the probability that draft token k survives verification
given that tokens 0..k-1 of its block survived. What a scheduler uses is the
prefix survival a_k = prod_{i<=k} c_i: the probability that the whole prefix
up to k is accepted. Both DSpark's confidence head and the DFlash 2
confidence proxy are judged here by the same metrics:

* ECE of the cumulative product: bins of predicted a_k against the observed
  fraction of prefixes accepted through k;
* AUC of c_k against the conditional outcome (token k accepted, among blocks
  whose prefix survived);
* a reliability diagram (PNG).

Outcomes come as `num_accepted` per block: token k (0-based) of a block was
accepted iff k < num_accepted, and observed iff k <= num_accepted and k was
verified.
"""

from __future__ import annotations

import torch


def prefix_survival(confidence: torch.Tensor) -> torch.Tensor:
    """a [..., K] = cumulative product of per-token confidences [..., K] clamped into [0, 1], in fp64
    (non-increasing along K, also in floating point since every factor is <= 1)."""
    return confidence.double().clamp(0.0, 1.0).cumprod(-1)


def outcomes(num_accepted: torch.Tensor, num_verified: torch.Tensor, width: int):
    """Per-position outcomes of blocks.

    Returns (ok [N, K] float: token k was accepted, i.e. the prefix through k
    survived; prefix_seen [N, K] bool: position k was verified, so whether the
    prefix through k survived is known; cond_seen [N, K] bool: k was verified
    and its prefix survived, so whether token k itself survived is known).
    """
    k = torch.arange(width, device=num_accepted.device)
    acc, ver = num_accepted[:, None], num_verified[:, None]
    prefix_seen = k[None] < ver
    cond_seen = prefix_seen & (k[None] <= acc)
    return (k[None] < acc).float(), prefix_seen, cond_seen


def expected_calibration_error(pred: torch.Tensor, target: torch.Tensor, bins: int = 15) -> float:
    """ECE with equal-width bins: sum over bins of |mean pred - mean target| weighted by bin mass."""
    pred, target = pred.flatten().double(), target.flatten().double()
    if pred.numel() == 0:
        return float("nan")
    idx = (pred * bins).long().clamp(0, bins - 1)
    count = torch.bincount(idx, minlength=bins).double()
    sum_pred = torch.bincount(idx, weights=pred, minlength=bins)
    sum_true = torch.bincount(idx, weights=target, minlength=bins)
    nz = count > 0
    return float(((sum_pred[nz] - sum_true[nz]).abs()).sum() / pred.numel())


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    score, label = score.flatten().double(), label.flatten().bool()
    n_pos, n_neg = int(label.sum()), int((~label).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = torch.argsort(score)
    s = score[order]
    # average ranks over ties
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks = avg[inverse]
    pos_ranks = ranks[label[order]].sum()
    return float((pos_ranks - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def calibration_report(
    conf: torch.Tensor, num_accepted: torch.Tensor, num_verified: torch.Tensor, bins: int = 15
) -> dict:
    """ECE of the cumulative product, AUC of c_k, and the reliability curve,
    from confidences [N, K] and block outcomes [N]."""
    width = conf.shape[-1]
    ok, prefix_seen, cond_seen = outcomes(num_accepted, num_verified, width)
    a = prefix_survival(conf)
    pred, true = a[prefix_seen], ok[prefix_seen]
    idx = (pred.double() * bins).long().clamp(0, bins - 1)
    count = torch.bincount(idx, minlength=bins)
    mean_pred = torch.bincount(idx, weights=pred.double(), minlength=bins) / count.clamp(min=1)
    mean_true = torch.bincount(idx, weights=true.double(), minlength=bins) / count.clamp(min=1)
    return {
        "ece_cumulative": expected_calibration_error(pred, true, bins),
        "auc": auc(conf[cond_seen], ok[cond_seen]),
        "observations": int(prefix_seen.sum()),
        "reliability": {"mean_predicted": mean_pred.tolist(), "observed": mean_true.tolist(), "count": count.tolist()},
    }


def online_confidences(model, inputs, num_accepted, num_verified, step) -> torch.Tensor:
    """Confidences of an online model (`model(x)`, `model.observe(x, num_accepted, num_verified)`:
    the proxy, the margin logistic) over records in their time order: per loop step (a run of
    equal ids in `step`, non-decreasing), predict from what earlier steps taught, then observe
    the step's own outcomes, as the loop does; no prediction sees its own outcome.
    inputs [N, K, ...], outcomes [N], step [N] -> confidences [N, K]."""
    if step.dim() != 1 or step.shape[0] != inputs.shape[0]:
        raise ValueError(f"need one step id per record: step {tuple(step.shape)}, inputs {tuple(inputs.shape)}")
    if step.numel() > 1 and bool((step[1:] < step[:-1]).any()):
        raise ValueError("records must be in time order (non-decreasing step ids)")
    _, counts = torch.unique_consecutive(step, return_counts=True)
    out, start = [], 0
    for n in counts.tolist():
        rows = slice(start, start + n)
        x = inputs[rows]  # one tensor for both calls: the proxy reuses its features
        out.append(model(x))
        model.observe(x, num_accepted[rows], num_verified[rows])
        start += n
    return torch.cat(out) if out else inputs.new_zeros(inputs.shape[:2])


def plot_reliability(reports: dict[str, dict], path: str, title: str = "prefix survival reliability") -> None:
    """One line per named report: observed vs predicted prefix survival, with the diagonal."""
    import matplotlib  # lazy: 0.26 s to import, and only the calibration plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy, as above

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfect")
    for name, rep in reports.items():
        r = rep["reliability"]
        pts = [(p, o) for p, o, c in zip(r["mean_predicted"], r["observed"], r["count"]) if c > 0]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=f"{name} (ECE {rep['ece_cumulative']:.3f}, AUC {rep['auc']:.2f})")
    ax.set_xlabel("predicted prefix survival  prod c")
    ax.set_ylabel("observed fraction of prefixes accepted")
    ax.set_title(title)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
