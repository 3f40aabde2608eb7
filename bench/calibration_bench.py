"""How well do per-token confidences predict verification? DSpark's calibrated
head beside the DFlash 2 confidence proxy (and the raw selector probability
the proxy starts from), on held-out prompts of both tasks.

Every draft is verified (fixed K = γ - 1), so every outcome is observed.
Reports, per temperature, the ECE of the cumulative product (prefix survival
∏c against whether the whole prefix was accepted) and the AUC of c_k for
"token k survives given its prefix did"; writes bench/results/calibration.json
and a reliability diagram per temperature (calibration_t0.png, ...).

    python bench/calibration_bench.py [--prompts 24] [--temperatures 0 1]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
from flashspark import data
from flashspark.cli.fit import collect_records
from flashspark.methods import load_proxy, make_decoder
from flashspark.models import load_model
from flashspark.scheduling.calibration import calibration_report, plot_reliability
from flashspark.train.common import hardware_string

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts per task (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--dflash2", default=None, help="DFlash 2 drafter directory (default: shipped)")
    p.add_argument("--dspark", default=None, help="DSpark drafter directory (default: shipped)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/calibration.json)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else RESULTS / "calibration.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        target = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
        dflash2_dir = Path(args.dflash2) if args.dflash2 else data.ASSETS_DIR / "dflash2"
        dspark = make_decoder("dspark", target, drafter_dir=args.dspark)
        dflash2 = make_decoder("dflash2", target, drafter_dir=dflash2_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = data.load_tokenizer()
    prompts = [q for task in data.TASKS for q in data.heldout_prompts(task, args.prompts, args.prompt_tokens, tok)]
    result = {
        "benchmark": "calibration",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware_string(),
        "command": "python bench/calibration_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "prompt_set": "heldout (code and prose)",
        "temperatures": {},
    }
    print(f"{'T':>4} {'confidence source':>34} {'ECE(prod c)':>12} {'AUC':>6} {'observations':>13}")
    for t in args.temperatures:
        rec_s = collect_records(dspark, prompts, args.max_new_tokens, t, args.batch_size)
        rec_2 = collect_records(dflash2, prompts, args.max_new_tokens, t, args.batch_size)
        proxy = load_proxy(dflash2_dir, t)  # as shipped: the offline fit, no online updates here
        outcome = (rec_2["num_accepted"], rec_2["num_verified"])
        reports = {
            "DSpark head (calibrated)": calibration_report(
                rec_s["confidence"], rec_s["num_accepted"], rec_s["num_verified"]
            ),
            "DFlash 2 proxy": calibration_report(proxy(rec_2["signals"]), *outcome),
            "DFlash 2 raw selector prob": calibration_report(rec_2["signals"][..., 0], *outcome),
        }
        png = out.with_name(f"{out.stem}_t{t:g}.png")
        plot_reliability(reports, str(png), title=f"prefix survival reliability, held-out, T = {t:g}")
        result["temperatures"][f"{t:g}"] = {"reports": reports, "plot": png.name}
        for name, r in reports.items():
            print(f"{t:>4g} {name:>34} {r['ece_cumulative']:>12.4f} {r['auc']:>6.3f} {r['observations']:>13}")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
