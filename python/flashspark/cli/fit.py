"""`python -m flashspark fit-proxy` and `fit-prior`: the confidence proxy and the scheduler's
prior, measured in the loop on the calibration prompts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .. import data
from ..methods import PRIOR_FILE, PROXY_FILES, load_proxy, make_decoder
from ..models import catalog
from ..scheduling.calibration import calibration_report, prefix_survival
from ..scheduling.confidence import ConfidenceStats
from ..scheduling.proxy import ConfidenceProxy


def add_fit_proxy(sub) -> None:
    """`python -m flashspark fit-proxy ...`"""
    p = sub.add_parser(
        "fit-proxy",
        help="fit the DFlash 2 confidence proxy on the target's verify outcomes over "
        "the calibration prompts, and save it with the drafter",
    )
    p.add_argument("--drafter", default=None, help="DFlash 2 drafter directory (default: the shipped one)")
    add_calibration_run_args(p, "one proxy per temperature (default: 0 and 1)")
    p.set_defaults(func=run_fit_proxy)


def add_calibration_run_args(p, temperatures_help: str) -> None:
    """Options of a run over the calibration prompts (fit-proxy, fit-prior)."""
    p.add_argument(
        "--model",
        default=None,
        help=f"target: {' or '.join(catalog.TARGETS)} (default tiny) or a path; its drafter is the default",
    )
    p.add_argument("--prompts", type=int, default=64, help="calibration prompts per task (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help=temperatures_help)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the target's dtype (default: its CPU dtype; float32 where bf16 matmuls are slow)",
    )
    p.add_argument("--device", default="cpu", help="where the target and drafter run: cpu (default) or cuda")


def add_fit_prior(sub) -> None:
    """`python -m flashspark fit-prior ...`"""
    p = sub.add_parser(
        "fit-prior",
        help="measure a drafter's confidences against its verify outcomes in the loop on "
        "the calibration prompts, and save them as its confidence scheduler's prior",
    )
    p.add_argument(
        "drafter",
        choices=["dflash2", "dspark"],
        help="whose confidences: DSpark's head or the DFlash 2 proxy (fit the proxy first: fit-proxy)",
    )
    p.add_argument("--drafter-dir", default=None, help="drafter directory (default: the shipped one)")
    add_calibration_run_args(p, "one prior per temperature (default: 0 and 1)")
    p.set_defaults(func=run_fit_prior)


def calibration_prompts(per_task: int, prompt_tokens: int, target: catalog.TargetRef | None = None) -> list[list[int]]:
    """The calibration prompts: for the tiny target, `prompt_tokens`-token windows of every task
    (see `data.heldout_prompts`); for a target with a chat template, the first `per_task` chat,
    code and prose prompts of the calibration split (`data.prompt_set`), chat ones through the
    template, as the drafters' data was made."""

    if target is None or target.known is catalog.TARGETS[catalog.DEFAULT_TARGET]:
        tok = data.load_tokenizer()
        return [
            p
            for task in data.TASKS
            for p in data.heldout_prompts(task, per_task, prompt_tokens, tok, prompt_set="calibration")
        ]
    tok = catalog.target_tokenizer(target)
    chat = catalog.target_chat_template(target)
    kinds = data.PROMPT_KINDS if chat is not None else ("code", "prose")
    texts = [data.render_prompt(p, chat) for k in kinds for p in data.prompt_set("calibration", k, per_task)]
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


def fit_setup(args, method: str, drafter_dir: str | None):
    """The target, its `method` drafter's directory (--drafter, else the one shipped for it), a
    decoder for the method, the calibration prompts and where requests stop."""
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = catalog.resolve_target(args.model)
    directory = Path(drafter_dir) if drafter_dir else catalog.drafter_dir(method, ref)
    prompts = calibration_prompts(args.prompts, args.prompt_tokens, ref)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    target = catalog.load_target(ref, dtype=dtype, device=args.device)
    # The tiny target's shipped fits decoded without a stop token; an instruct target stops at its EOS.
    tiny = ref.known is catalog.TARGETS[catalog.DEFAULT_TARGET]
    eos = None if tiny else catalog.eos_token_id(target, catalog.target_tokenizer(ref))
    return target, directory, make_decoder(method, target, drafter_dir=directory), prompts, eos


def run_fit_prior(args) -> int:
    """Decode the calibration prompts with fixed K = γ - 1 (every draft verified, so every outcome
    is seen) and keep, per temperature, the confidence stats a scheduler starts from: mean predicted
    prefix survival and predicted against observed survival (`ConfidenceStats`)."""

    target, drafter_dir, decode, prompts, eos = fit_setup(args, args.drafter, args.drafter_dir)
    report = {
        "command": getattr(args, "command_line", ""),
        "prompts": len(prompts),
        "prompt_set": "calibration",
        "max_new_tokens": args.max_new_tokens,
        "temperatures": {},
    }
    for t in args.temperatures:
        rec = collect_records(decode, prompts, args.max_new_tokens, t, args.batch_size, eos_id=eos)
        conf = rec["confidence"] if args.drafter == "dspark" else load_proxy(drafter_dir, t)(rec["signals"])
        survival = prefix_survival(conf.double())
        stats = ConfidenceStats(survival.shape[1])
        stats.add_rows(survival)
        stats.add_outcomes(survival, rec["num_accepted"], rec["num_verified"])
        predicted, observed = stats.survival / stats.rows, stats.observed / stats.rows
        report["temperatures"][f"{t:g}"] = {
            "stats": stats.to_dict(),
            "mean_survival_predicted": predicted.tolist(),
            "mean_survival_observed": observed.tolist(),
        }
        print(
            f"T={t:g}: {stats.rows} request-steps; expected accepted drafts per block "
            f"{float(predicted.sum()):.2f} predicted, {float(observed.sum()):.2f} observed",
            file=sys.stderr,
        )
    (drafter_dir / PRIOR_FILE).write_text(json.dumps(report, indent=2) + "\n")
    print(f"saved {drafter_dir / PRIOR_FILE}", file=sys.stderr)
    return 0


def collect_records(
    decode,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int = 0,
    eos_id: int | None = None,
    lengths: list[int] | None = None,
) -> dict:
    """Per request-step confidences / signals, the drafter's top-2 margins and verify outcomes of
    `decode` over `prompts`, in decode order; "step" numbers the loop steps across batches and
    "request" the prompts. `lengths`, if given, receives each request's emitted tokens."""

    parts, steps_before = [], 0
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"verify outcomes T={temperature:g}", leave=False):
        out, st = decode(prompts[i : i + batch_size], max_new_tokens, temperature, seed + i, eos_id=eos_id, record=True)
        if lengths is not None:
            lengths += [len(o) for o in out]
        rec = dict(st["records"])
        if rec.get("step") is not None:  # batches run one after another: later steps, later ids
            rec["step"] = rec["step"] + steps_before
        if rec.get("request") is not None:  # request ids over all prompts
            rec["request"] = rec["request"] + i
        steps_before += st["iterations"]
        parts.append(rec)

    # On the CPU: the fits and their reports are small and run there whatever decoded.
    return {k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]).cpu() for k in parts[0]}


def run_fit_proxy(args) -> int:
    """Fit one proxy per temperature with fixed K = γ - 1 (every draft verified, so every
    outcome is seen), report ECE / AUC before (raw selector probability) and after."""

    target, drafter_dir, decode, prompts, eos = fit_setup(args, "dflash2", args.drafter)
    width = decode.drafter.num_drafts
    report = {
        "command": getattr(args, "command_line", ""),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "prompt_set": "calibration",
        "temperatures": {},
    }
    for t in args.temperatures:
        key = min(PROXY_FILES, key=lambda x: abs(x - t))
        rec = collect_records(decode, prompts, args.max_new_tokens, t, args.batch_size, eos_id=eos)
        signals, n_acc, n_ver = rec["signals"], rec["num_accepted"], rec["num_verified"]
        before = calibration_report(signals[..., 0], n_acc, n_ver)
        proxy = ConfidenceProxy(width)
        proxy.fit(signals, n_acc, n_ver)
        after = calibration_report(proxy(signals), n_acc, n_ver)
        proxy.save(drafter_dir / PROXY_FILES[key])
        report["temperatures"][f"{t:g}"] = {
            "file": PROXY_FILES[key],
            "request_steps": int(n_acc.numel()),
            "before": before,
            "after": after,
            "proxy": proxy.state(),
        }
        print(
            f"T={t:g}: {n_acc.numel()} request-steps; ECE of the cumulative product "
            f"{before['ece_cumulative']:.3f} (raw selector probability) -> {after['ece_cumulative']:.3f}, "
            f"AUC {before['auc']:.3f} -> {after['auc']:.3f}; saved {drafter_dir / PROXY_FILES[key]}",
            file=sys.stderr,
        )
    (drafter_dir / "proxy_fit.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0
