"""How well do per-token confidences predict verification? DSpark's calibrated
head, the DFlash 2 confidence proxy (offline fit alone, and with its online
updates), the raw selector probability of the best candidate (known before the
draw) it starts from, and the baseline engines ship: a per-position logistic on the drafter's top-2 margin learned online only
(scheduling/margin.py), on both drafters, on held-out prompts of the target's tasks.

Every draft is verified (fixed K = γ - 1), so every outcome is observed. Online
sources replay the records in decode order, step by step: predict a step's
confidences, then observe its outcomes; no prediction sees its own outcome.
Reports, per temperature, the ECE of the cumulative product (prefix survival ∏c
against whether the whole prefix was accepted) and the AUC of c_k for "token k
survives given its prefix did"; writes bench/results/calibration.json
(calibration_<target>.json for a target other than tiny) and a reliability
diagram per temperature beside it (calibration_t0.png, ...).

    python bench/calibration_bench.py [--model smollm2] [--prompts 24] [--temperatures 0 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import targets
import timing
import torch
from flashspark.cli.common import check_args
from flashspark.cli.fit import collect_records
from flashspark.methods import drafter_dir_of, load_proxy, make_decoder
from flashspark.scheduling.calibration import calibration_report, online_confidences, plot_reliability
from flashspark.scheduling.margin import MarginLogistic

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_STEM = "calibration"

# Row names (the JSON's keys; the first four are those of earlier results).
DSPARK_HEAD = "DSpark head (calibrated)"
DSPARK_MARGIN = "DSpark margin logistic (online)"
PROXY = "DFlash 2 proxy"  # the shipped offline fit, frozen
PROXY_ONLINE = "DFlash 2 proxy + online updates"
SELECTOR = "DFlash 2 raw selector top prob"
DFLASH2_MARGIN = "DFlash 2 margin logistic (online)"


def default_out(target) -> Path:
    """bench/results/calibration.json for tiny, calibration_<name>.json for any other target."""
    if target.tiny:
        return RESULTS / f"{DEFAULT_STEM}.json"
    name = target.ref.known.name if target.ref.known else target.ref.path.stem
    return RESULTS / f"{DEFAULT_STEM}_{name}.json"


def margin_report(rec: dict) -> tuple[dict, dict]:
    """The online margin logistic over one drafter's records: (calibration report, final state)."""
    model = MarginLogistic(rec["top2_margin"].shape[1])
    conf = online_confidences(model, rec["top2_margin"], rec["num_accepted"], rec["num_verified"], rec["step"])
    return calibration_report(conf, rec["num_accepted"], rec["num_verified"]), model.state()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    targets.add_target_args(p)
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts per task (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the tiny target's windows")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--dflash2", default=None, help="DFlash 2 drafter directory (default: the target's shipped one)")
    p.add_argument("--dspark", default=None, help="DSpark drafter directory (default: the target's shipped one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/calibration[_<target>].json)")
    args = p.parse_args(argv)
    try:
        check_args(args)
        torch.set_num_threads(args.threads)
        target = targets.load_bench_target(args)
        dflash2_dir = drafter_dir_of("dflash2", args.dflash2, target.model)
        dspark = make_decoder("dspark", target.model, drafter_dir=args.dspark)
        dflash2 = make_decoder("dflash2", target.model, drafter_dir=dflash2_dir)
        prompts = [q for task in target.tasks for q in target.heldout_prompts(task, args.prompts, args.prompt_tokens)]
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out(target)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The tiny target's shipped fits decoded without a stop token; an instruct target stops at its EOS.
    eos = None if target.tiny else target.eos_id()
    result = {
        **timing.result_header("calibration", "calibration_bench.py", argv, target.model.lm_head.weight.device),
        "target": target.label,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens if target.tiny else None,
        "max_new_tokens": args.max_new_tokens,
        "prompt_set": f"heldout ({', '.join(target.tasks)})",
        "online": "records replayed in decode order, one loop step at a time: predict, then observe",
        "margin_logistic": "c_k = sigmoid(a_k m_k + b_k), m_k = the drafter's top-1 minus top-2 log-prob "
        "(DFlash 2: the backbone's unary; DSpark: the Markov head along the drafted chain), "
        "(a_k, b_k) from a neutral prior by an online Newton step per verify step, no offline fit",
        "temperatures": {},
    }
    print(f"{'T':>4} {'confidence source':>34} {'ECE(prod c)':>12} {'AUC':>6} {'observations':>13}")
    for t in args.temperatures:
        rec_s = collect_records(dspark, prompts, args.max_new_tokens, t, args.batch_size, eos_id=eos)
        rec_2 = collect_records(dflash2, prompts, args.max_new_tokens, t, args.batch_size, eos_id=eos)
        outcome_s = (rec_s["num_accepted"], rec_s["num_verified"])
        outcome_2 = (rec_2["num_accepted"], rec_2["num_verified"])
        reports, states = {DSPARK_HEAD: calibration_report(rec_s["confidence"], *outcome_s)}, {}
        reports[DSPARK_MARGIN], states[DSPARK_MARGIN] = margin_report(rec_s)
        try:
            frozen = load_proxy(dflash2_dir, t)  # as shipped: the offline fit, no updates
            online = load_proxy(dflash2_dir, t)  # the same fit, updated as a decoder would
        except FileNotFoundError as e:
            print(f"note: no DFlash 2 proxy rows at T = {t:g}: {e} (fit one: python -m flashspark fit-proxy)")
        else:
            reports[PROXY] = calibration_report(frozen(rec_2["signals"]), *outcome_2)
            conf = online_confidences(online, rec_2["signals"], *outcome_2, rec_2["step"])
            reports[PROXY_ONLINE] = calibration_report(conf, *outcome_2)
            states[PROXY_ONLINE] = online.state()
        reports[SELECTOR] = calibration_report(rec_2["signals"][..., 0], *outcome_2)
        reports[DFLASH2_MARGIN], states[DFLASH2_MARGIN] = margin_report(rec_2)
        png = out.with_name(f"{out.stem}_t{t:g}.png")
        plot_reliability(reports, str(png), title=f"prefix survival reliability, held-out, T = {t:g}")
        result["temperatures"][f"{t:g}"] = {"reports": reports, "online_final_state": states, "plot": png.name}
        for name, r in reports.items():
            print(f"{t:>4g} {name:>34} {r['ece_cumulative']:>12.4f} {r['auc']:>6.3f} {r['observations']:>13}")
    timing.save_result(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
