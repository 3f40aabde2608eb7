"""Command-line glue for speculative decoding: `train dflash`, `fit-proxy`, `fit-prior` and
`generate --method dflash|dflash2|dspark`, registered from `flashspark.cli`."""

from __future__ import annotations

import argparse
import sys

from .loop import PATH_MODES
from .methods import DRAFTERS, SCHEDULERS

SPEC_METHODS = list(DRAFTERS)


def add_train_dflash(train_sub) -> None:
    """`python -m flashspark train dflash ...`"""
    from ..train.dflash import DFlashTrainArgs

    d = DFlashTrainArgs()
    p = train_sub.add_parser("dflash", help="distil the DFlash drafter from the target")
    p.add_argument("--out", default=d.out, help="run directory: data, checkpoint, metrics (default %(default)s)")
    p.add_argument("--export", default=None, help="where the final drafter goes (default: the package assets)")
    p.add_argument("--target", default=None, help="target model directory (default: the shipped one)")
    p.add_argument(
        "--minutes",
        type=float,
        default=d.minutes,
        help="budget of the whole run: data, training, evaluation, export (default %(default)s)",
    )
    p.add_argument(
        "--gen-frac",
        type=float,
        default=d.gen_frac,
        help="share of the budget for generating target continuations (default %(default)s)",
    )
    p.add_argument("--max-sequences", type=int, default=d.max_sequences)
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt with OUT/data")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--layers", type=int, default=d.layers, help="drafter decoder layers (default %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="gamma (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per step")
    p.add_argument("--blocks-per-seq", type=int, default=d.blocks_per_seq, help="random anchors per sequence")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--init-layers",
        action=argparse.BooleanOptionalAction,
        default=d.init_layers,
        help="start the drafter layers from the target's top layers",
    )
    p.add_argument("--no-bf16", action="store_true", help="train in plain fp32 (slower)")
    p.add_argument("--eval-every", type=float, default=d.eval_every_min, help="minutes between held-out evals")
    p.set_defaults(func=run_train_dflash)


def run_train_dflash(args) -> int:
    from ..train.dflash import DFlashTrainArgs, train

    a = DFlashTrainArgs(
        out=args.out,
        minutes=args.minutes,
        gen_frac=args.gen_frac,
        max_sequences=args.max_sequences,
        resume=args.resume,
        threads=args.threads,
        seed=args.seed,
        layers=args.layers,
        block_size=args.block_size,
        batch_size=args.batch_size,
        blocks_per_seq=args.blocks_per_seq,
        lr=args.lr,
        init_layers=args.init_layers,
        bf16=not args.no_bf16,
        eval_every_min=args.eval_every,
        command=getattr(args, "command_line", ""),
    )
    if args.export:
        a.export = args.export
    if args.target:
        a.target = args.target
    train(a)
    return 0


def add_generate_spec_args(p) -> None:
    """Options of `generate` that only speculative methods read."""
    p.add_argument(
        "--k",
        type=int,
        default=None,
        help="draft tokens verified per step (fixed scheduler), or their bound (confidence "
        "scheduler); default: block size - 1",
    )
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one for --method)")
    p.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        default="fixed",
        help="fixed K, or DSpark's confidence scheduler (dspark: its head; dflash2: the "
        "confidence proxy) (default %(default)s)",
    )
    p.add_argument(
        "--path",
        choices=PATH_MODES,
        default="auto",
        help="DFlash 2 path mode; sample paths are verified with their sparse q (default %(default)s: "
        "backtrack at temperature 0, sample above)",
    )
    p.add_argument(
        "--delay", type=int, default=0, help="confidence scheduler: use confidences this many steps old (engines use 2)"
    )


def check_generate_spec_args(args, method: str) -> None:
    """What a speculative method adds to `flashspark.cli.check_args`, before anything loads:
    --top-p, and --k against the drafter's block size (from its config.json)."""
    from pathlib import Path

    from .. import data

    if method not in SPEC_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {SPEC_METHODS}")
    if args.top_p < 1.0:
        raise ValueError(
            "--top-p is not supported by speculative decoding (lossless for the plain "
            "temperature distribution only); use --method ar"
        )
    gamma = drafter_block_size(Path(args.drafter) if args.drafter else data.ASSETS_DIR / method)
    if args.k is not None and gamma is not None and not 1 <= args.k <= gamma - 1:
        raise ValueError(f"--k must be in [1, {gamma - 1}] (the {method} drafter's block size - 1), got {args.k}")


def drafter_block_size(path) -> int | None:
    """γ from a drafter directory's config.json, without its weights; None where it cannot be
    read (loading the drafter then says what is wrong)."""
    import json

    try:
        return int(json.loads((path / "config.json").read_text())["block_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_generate_spec(args, method: str) -> int:
    """Decode the prompts with `method` and with plain decoding, print the
    texts, then tau, tokens/s and the speedup over plain decoding (stderr)."""
    import torch

    from .. import data
    from ..cli import load_tokenizer, read_prompts
    from ..generate import generate
    from ..models import load_model
    from .methods import MethodSpec, make_decoder

    check_generate_spec_args(args, method)
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = read_prompts(args)
    tok = load_tokenizer(args.tokenizer)
    dtype = torch.float32 if args.device == "cpu" else None
    target = load_model(args.model or data.ASSETS_DIR / "target", dtype=dtype, device=args.device)
    spec = MethodSpec(method, k=args.k, scheduler=args.scheduler, path=args.path, delay=args.delay)
    decode = make_decoder(spec, target, drafter_dir=args.drafter)
    eos = data.special_token_ids(tok)["eot"] if args.stop_at_eos else None
    ids = []
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        ids.append(tok.encode(p, add_special_tokens=False).ids)
    batch = args.batch_size or len(ids)
    chunks = [ids[i : i + batch] for i in range(0, len(ids), batch)]
    common = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed, eos_id=eos)

    # Warm both paths up once so neither pays first-call costs in the timing.
    decode(ids[:1], **{**common, "max_new_tokens": min(4, args.max_new_tokens)})
    generate(target, ids[:1], **{**common, "max_new_tokens": min(4, args.max_new_tokens)})
    spec_out, spec_stats = [], []
    for c in chunks:
        out, st = decode(c, **common)
        spec_out += out
        spec_stats.append(st)
    ar_out, ar_stats = generate(target, ids, top_p=1.0, batch_size=batch, **common)

    for i, (prompt, out) in enumerate(zip(prompts, spec_out)):
        if len(prompts) > 1:
            print(f"===== prompt {i} =====")
        print(prompt + tok.decode([t for t in out if t != eos]))
    new = sum(s["new_tokens"] for s in spec_stats)
    secs = sum(s["seconds"] for s in spec_stats)
    steps = sum(s["steps"] for s in spec_stats)
    tau = sum(s["tau"] * s["steps"] for s in spec_stats) / max(1, steps)
    verified = sum(s["drafts_verified"] for s in spec_stats) / max(1, steps)
    tps = new / secs if secs > 0 else 0.0
    same = "identical to" if spec_out == ar_out else "different from"
    k = decode.drafter.block_size - 1 if args.k is None else args.k
    how = f"K={k}" if args.scheduler == "fixed" else f"confidence scheduler, K<={k}"
    if method == "dflash2":
        how += f", {args.path} paths"
    print(
        f"\n[{method}, {how}] {new} new tokens in {secs:.2f} s: {tps:.1f} tokens/s, tau {tau:.2f} "
        f"tokens per target forward, {verified:.2f} drafts verified per step ({steps} request-steps)\n"
        f"[ar] {ar_stats['new_tokens']} new tokens in {ar_stats['seconds']:.2f} s: "
        f"{ar_stats['tokens_per_s']:.1f} tokens/s\n"
        f"speedup over plain decoding: {tps / max(ar_stats['tokens_per_s'], 1e-9):.2f}x; "
        f"output {same} plain decoding{' (expected at temperature 0)' if args.temperature == 0 else ''}",
        file=sys.stderr,
    )
    return 0


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
    p.add_argument("--model", default=None, help="target model directory (default: the shipped one)")
    p.add_argument("--prompts", type=int, default=64, help="calibration prompts per task (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help=temperatures_help)
    p.add_argument("--threads", type=int, default=None)


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


def calibration_prompts(per_task: int, prompt_tokens: int) -> list[list[int]]:
    """The calibration prompt set of every task (see `data.heldout_prompts`)."""
    from .. import data

    tok = data.load_tokenizer()
    return [
        p
        for task in data.TASKS
        for p in data.heldout_prompts(task, per_task, prompt_tokens, tok, prompt_set="calibration")
    ]


def run_fit_prior(args) -> int:
    """Decode the calibration prompts with fixed K = γ - 1 (every draft verified, so every outcome
    is seen) and keep, per temperature, the confidence stats a scheduler starts from: mean predicted
    prefix survival and predicted against observed survival (`ConfidenceStats`)."""
    import json
    from pathlib import Path

    import torch

    from .. import data
    from ..models import load_model
    from .calibration import prefix_survival
    from .confidence import ConfidenceStats
    from .methods import PRIOR_FILE, load_proxy, make_decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    drafter_dir = Path(args.drafter_dir) if args.drafter_dir else data.ASSETS_DIR / args.drafter
    target = load_model(args.model or data.ASSETS_DIR / "target", dtype=torch.float32)
    decode = make_decoder(args.drafter, target, drafter_dir=drafter_dir)
    prompts = calibration_prompts(args.prompts, args.prompt_tokens)
    report = {
        "command": getattr(args, "command_line", ""),
        "prompts": len(prompts),
        "prompt_set": "calibration",
        "max_new_tokens": args.max_new_tokens,
        "temperatures": {},
    }
    for t in args.temperatures:
        rec = collect_records(decode, prompts, args.max_new_tokens, t, args.batch_size)
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
    decode, prompts: list[list[int]], max_new_tokens: int, temperature: float, batch_size: int, seed: int = 0
) -> dict:
    """Per request-step confidences / signals and verify outcomes of `decode` over `prompts`."""
    from tqdm import tqdm

    parts = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=f"verify outcomes T={temperature:g}", leave=False):
        _, st = decode(prompts[i : i + batch_size], max_new_tokens, temperature, seed + i, record=True)
        parts.append(st["records"])
    import torch

    return {k: None if parts[0][k] is None else torch.cat([p[k] for p in parts]) for k in parts[0]}


def run_fit_proxy(args) -> int:
    """Fit one proxy per temperature with fixed K = γ - 1 (every draft verified, so every
    outcome is seen), report ECE / AUC before (raw selector probability) and after."""
    import json
    from pathlib import Path

    import torch

    from .. import data
    from ..models import load_model
    from .calibration import calibration_report
    from .methods import PROXY_FILES, make_decoder
    from .proxy import ConfidenceProxy

    if args.threads:
        torch.set_num_threads(args.threads)
    drafter_dir = Path(args.drafter) if args.drafter else data.ASSETS_DIR / "dflash2"
    target = load_model(args.model or data.ASSETS_DIR / "target", dtype=torch.float32)
    decode = make_decoder("dflash2", target, drafter_dir=drafter_dir)
    width = decode.drafter.block_size - 1
    prompts = calibration_prompts(args.prompts, args.prompt_tokens)
    report = {
        "command": getattr(args, "command_line", ""),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "prompt_set": "calibration",
        "temperatures": {},
    }
    for t in args.temperatures:
        key = min(PROXY_FILES, key=lambda x: abs(x - t))
        rec = collect_records(decode, prompts, args.max_new_tokens, t, args.batch_size)
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
