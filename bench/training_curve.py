"""Held-out τ of a drafter's training run against training minutes and tokens, with its trend.

    python bench/training_curve.py runs/smollm2/dflash --target-tau 3.0
    python bench/training_curve.py runs/smollm2/dflash runs/smollm2/lever_distill --labels final lever

Reads each run's metrics.jsonl (one held-out evaluation per line: step, minutes, τ) and its
checkpoint's options (sequences per step, blocks per sequence, γ), so that "tokens" counts the
block positions trained on: steps x batch x blocks x (γ - 1). Fits τ = a + b ln(minutes) to the
second half of each run's evaluations and, labelled a projection, the minutes at which that
trend would reach `--target-tau`. Writes bench/results/training_curve[_<name>].json and a PNG.

An exported drafter directory (its MODEL_CARD.md's progress table and training commands, its
config's γ) stands in for a run whose directory is gone:

    python bench/training_curve.py python/flashspark/assets/smollm2/dflash --target-tau 3.0 --name smollm2
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import timing
import torch

RESULTS = Path(__file__).resolve().parent / "results"


def load_card(path: Path) -> dict:
    """A run as its exported drafter's model card records it: the rows of the progress table
    (| step | minutes | train loss | held-out τ |) and, from the last training command and the
    config's γ, the block positions a step trains on."""
    from flashspark.models.dflash import DFlashConfig

    text = (path / "MODEL_CARD.md").read_text()
    rows, in_table = [], False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["step", "minutes"] and cells[-1] == "held-out τ":
            in_table = True
        elif in_table and line.startswith("|") and cells[0].replace(",", "").isdigit():
            rows.append({"step": int(cells[0].replace(",", "")), "minutes": float(cells[1]), "tau": float(cells[-1])})
        elif in_table and not line.startswith("|"):
            in_table = False
    if not rows:
        raise ValueError(f"{path}/MODEL_CARD.md has no progress table (| step | minutes | ... | held-out τ |)")
    commands = [line for line in text.splitlines() if line.startswith("python -m flashspark train ")]
    opts = re.findall(r"--(batch-size|blocks-per-seq) (\d+)", commands[-1]) if commands else []
    per_step = None
    if len(dict(opts)) == 2:
        gamma = DFlashConfig.from_file(path / "config.json").block_size
        per_step = int(dict(opts)["batch-size"]) * int(dict(opts)["blocks-per-seq"]) * (gamma - 1)
    return {"rows": rows, "positions_per_step": per_step}


def load_run(path: Path) -> dict:
    if not (path / "metrics.jsonl").is_file() and (path / "MODEL_CARD.md").is_file():
        return load_card(path)
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}/metrics.jsonl holds no evaluation")
    per_step = None
    ckpt = path / "ckpt.pt"
    if ckpt.is_file():
        ck = torch.load(ckpt, map_location="cpu", weights_only=False)
        a, cfg = ck.get("args", {}), ck.get("config", {})
        if a and cfg:
            per_step = a["batch_size"] * a["blocks_per_seq"] * (cfg["block_size"] - 1)
    return {"rows": rows, "positions_per_step": per_step}


def trend(minutes: np.ndarray, tau: np.ndarray, target: float) -> dict:
    """τ = a + b ln(minutes) over the later half of the evaluations, and where it reaches `target`."""
    half = max(2, len(minutes) // 2)
    x, y = np.log(minutes[-half:]), tau[-half:]
    if len(x) < 2 or np.ptp(x) == 0:
        return {"a": None, "b": None, "minutes_to_target": None}
    b, a = np.polyfit(x, y, 1)
    reach = math.exp((target - a) / b) if b > 0 else None
    return {"a": float(a), "b": float(b), "fitted_on": int(half), "minutes_to_target": reach}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "runs", nargs="+", help="training run directories (metrics.jsonl) or exported drafters (MODEL_CARD.md)"
    )
    p.add_argument("--labels", nargs="+", default=None)
    p.add_argument("--target-tau", type=float, default=3.0)
    p.add_argument("--name", default="", help="suffix of the result files")
    args = p.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        p.error("--labels takes one label per run")
    try:
        runs = {label: load_run(Path(r)) for label, r in zip(labels, args.runs)}
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {
        **timing.result_header("training_curve", "training_curve.py", argv, "cpu"),
        "target_tau": args.target_tau,
        "trend": "tau = a + b ln(minutes), least squares on each run's later half; minutes_to_target is a "
        "PROJECTION of that trend, not a measurement",
        "runs": {},
    }
    print(
        f"{'run':>12} {'evals':>5} {'minutes':>8} {'tau':>6} {'b/ln':>6}  minutes to tau {args.target_tau:g} (projection)"
    )
    for label, run in runs.items():
        m = np.array([r["minutes"] for r in run["rows"]])
        tau = np.array([r["tau"] for r in run["rows"]])
        steps = [r["step"] for r in run["rows"]]
        per = run["positions_per_step"]
        t = trend(m, tau, args.target_tau)
        result["runs"][label] = {
            "minutes": m.tolist(),
            "tau": tau.tolist(),
            "steps": steps,
            "positions_trained": None if per is None else [s * per for s in steps],
            "trend": t,
        }
        reach = "-" if t["minutes_to_target"] is None else f"{t['minutes_to_target']:.0f}"
        b = "-" if t["b"] is None else f"{t['b']:.3f}"
        print(f"{label:>12} {len(m):>5} {m[-1]:>8.1f} {tau[-1]:>6.2f} {b:>6}  {reach}")
    suffix = f"_{args.name}" if args.name else ""
    timing.save_result(result, RESULTS / f"training_curve{suffix}.json", plot)
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, run in result["runs"].items():
        axes[0].plot(run["minutes"], run["tau"], marker=".", label=label)
        t = run["trend"]
        if t["b"] is not None:
            xs = np.geomspace(run["minutes"][0], max(run["minutes"][-1], t["minutes_to_target"] or 0) * 1.05, 50)
            axes[0].plot(xs, t["a"] + t["b"] * np.log(xs), linestyle=":", color=axes[0].lines[-1].get_color(),
                         label=f"{label} trend (projection)")  # fmt: skip
        if run["positions_trained"] is not None:
            axes[1].plot(run["positions_trained"], run["tau"], marker=".", label=label)
    axes[0].axhline(
        result["target_tau"], color="grey", linestyle="--", linewidth=1, label=f"τ = {result['target_tau']:g}"
    )
    axes[0].set_xscale("log")
    axes[0].set_xlabel("training minutes")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("block positions trained on")
    for ax in axes:
        ax.set_ylabel("held-out τ")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.suptitle("held-out τ during training")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
