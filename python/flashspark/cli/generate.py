"""`python -m flashspark generate`: plain decoding (`--method ar`) and speculative decoding
(`--method dflash|dflash2|dspark`), on the tiny shipped target (default), SmolLM2
(`--model smollm2`) or any GGUF file or Hugging Face directory (`--model PATH`).

Prompts go through the model's chat template when it has one (SmolLM2-Instruct does; the
tiny target and base models do not): an instruct model answers a bare continuation
poorly, and a model without a template has nothing to apply. `--no-chat` continues the raw
text instead (code completion on an instruct model); `--chat` insists on a template."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..decoding.plain import encode_prompts, generate
from ..methods import ADMISSIONS, DRAFTERS, SCHEDULERS, MethodSpec, make_decoder, method_of_drafter
from ..models import catalog
from ..models.dflash import DRAFT_CONFIG_KEY
from ..models.dflash2 import PATH_MODES
from ..models.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from ..models.io import has_weights
from .common import load_tokenizer, read_prompts

GENERATE_METHODS = ["ar", *DRAFTERS]
SPEC_METHODS = list(DRAFTERS)


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from prompts")
    p.add_argument(
        "--method",
        choices=GENERATE_METHODS,
        default=None,
        help="decoding method (default: the drafter's, from its config.json's architectures, with --drafter; else ar)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text; \\n, \\t and \\\\ stand for newline, tab, backslash")
    src.add_argument("--prompts-file", help="file with one prompt per line, same escapes as --prompt")
    p.add_argument(
        "--model",
        default=None,
        help=f"target: {' or '.join(catalog.TARGETS)} (default {catalog.DEFAULT_TARGET}: the shipped one), "
        "or a path to a GGUF file or a Hugging Face model directory",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the model's own)")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="render each prompt as a user turn of the model's chat template (default: when the model has one)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="target dtype (default on a CPU: bfloat16 for smollm2, float32 otherwise)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=None, help="requests per batch (default: all prompts)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--stop-at-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="stop a request at the model's end-of-sequence token (default on)",
    )

    add_generate_spec_args(p)
    p.set_defaults(func=run_generate)


class Run:
    """What `generate` decodes, resolved before any model loads: the target, the prompts as
    given and as the model reads them (through the chat template or raw), the tokenizer."""

    def __init__(self, args):
        self.target = catalog.resolve_target(args.model)
        self.prompts = read_prompts(args)
        self.tokenizer = load_tokenizer(args.tokenizer, self.target)
        self.chat = chat_template_for(args, self.target)
        self.texts = [self.chat.user(p) for p in self.prompts] if self.chat else self.prompts
        self.ids = encode_prompts(self.tokenizer, self.texts)

    def load_model(self, args):
        if args.threads:
            torch.set_num_threads(args.threads)
        dtype = getattr(torch, args.dtype) if args.dtype else None
        model = catalog.load_target(self.target, dtype=dtype, device=args.device)
        eos = catalog.eos_token_id(model, self.tokenizer) if args.stop_at_eos else None
        return model, eos

    def show(self, outputs: list[list[int]], eos: int | None) -> None:
        """Each prompt and its continuation (chat: the user's turn, then the reply) on stdout."""
        for i, (prompt, out) in enumerate(zip(self.prompts, outputs)):
            if len(self.prompts) > 1:
                print(f"===== prompt {i} =====")
            text = self.tokenizer.decode([t for t in out if t != eos])
            print(f"[user] {prompt}\n[assistant] {text}" if self.chat else prompt + text)


def chat_template_for(args, target: catalog.TargetRef):
    """--chat: the model's template, an error without one; --no-chat: none; neither: the model's, if any."""
    if args.chat is False:
        return None
    template = catalog.target_chat_template(target)
    if template is None and args.chat:
        raise ValueError(f"--chat: the model {target.label} has no chat template")
    return template


def run_generate(args) -> int:
    if args.method is None:
        args.method = method_of_drafter(args.drafter) if args.drafter else "ar"
    if args.method != "ar":
        return run_generate_spec(args, args.method)
    run = Run(args)
    model, eos = run.load_model(args)
    outputs, stats = generate(
        model,
        run.ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        eos_id=eos,
        batch_size=args.batch_size,
    )
    run.show(outputs, eos)
    print(
        f"\n[{args.method}] {stats['new_tokens']} new tokens in {stats['seconds']:.2f} s: "
        f"{stats['tokens_per_s']:.1f} tokens/s (prefill {stats['prefill_seconds']:.2f} s, "
        f"batch size {stats['batch_size']})",
        file=sys.stderr,
    )
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
    p.add_argument(
        "--drafter", default=None, help="drafter directory (default: the one shipped for --model and --method)"
    )
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
        "greedy at temperature 0, the reference's path; sample above)",
    )
    p.add_argument(
        "--delay", type=int, default=0, help="confidence scheduler: use confidences this many steps old (engines use 2)"
    )
    p.add_argument(
        "--tree",
        type=int,
        default=0,
        metavar="N",
        help="verify a token tree of N nodes per step (the anchor and N - 1 drafts, best first; dflash and "
        "dflash2) instead of a chain; the confidence scheduler then cuts each tree by node survival (README, Trees)",
    )
    p.add_argument(
        "--admission",
        choices=ADMISSIONS,
        default="stop",
        help="confidence scheduler's lossless admission: stop (DSpark's Algorithm 1, early stop) or budget "
        "(the engines' rule: a budget from older confidences, then the slots of highest survival) "
        "(default %(default)s)",
    )


def check_generate_spec_args(args, method: str, target: catalog.TargetRef) -> None:
    """What a speculative method adds to `flashspark.cli.check_args`, before anything loads:
    --top-p, the drafter (--drafter, else the one shipped for the target: missing, it names
    the commands that train it), and --k against its block size (from its config.json)."""

    if method not in SPEC_METHODS:
        raise ValueError(f"unknown speculative method {method!r}; expected one of {SPEC_METHODS}")
    if args.top_p < 1.0:
        raise ValueError(
            "--top-p is not supported by speculative decoding (lossless for the plain "
            "temperature distribution only); use --method ar"
        )
    if args.drafter:
        path = Path(args.drafter)
    else:
        path = catalog.drafter_dir(method, target)
        if not has_weights(path):
            raise FileNotFoundError(
                f"no {method} drafter for {target.label} at {path} (drafters fit one target only): train it "
                f"with `{catalog.train_hint(method, target.known)}`, or pass --drafter DIR"
            )
    if args.tree and (args.tree < 2 or method == "dspark" or args.k is not None):
        raise ValueError("--tree N needs N >= 2, the dflash or dflash2 method, and no --k (its bound is N - 1)")
    n = drafter_num_drafts(path)
    if args.k is not None and n is not None and not 1 <= args.k <= n:
        raise ValueError(f"--k must be in [1, {n}] (the {method} drafter's drafts per block), got {args.k}")


def drafter_num_drafts(path) -> int | None:
    """Drafts per block from a drafter directory's config.json, without its weights: γ - 1, or γ
    in DeepSpec's layout (`sample_from_anchor`); None where it cannot be read (loading the
    drafter then says what is wrong)."""

    try:
        d = json.loads((path / "config.json").read_text())
        d = {**d, **d.get(DRAFT_CONFIG_KEY, {})}  # z-lab's format nests the drafter's keys
        # DeepSpec's configs name no layout: theirs drafts from the anchor.
        from_anchor = d.get("sample_from_anchor", DSPARK_ARCHITECTURE in (d.get("architectures") or []))
        return int(d["block_size"]) - (0 if from_anchor else 1)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def greedy_note(temperature: float, same: bool, target) -> str:
    """Why greedy speculative and plain outputs agree or not: in fp32 they are the same tokens;
    in a 16-bit dtype a verify forward over k tokens rounds differently from a one-token decode
    step, so a near-tie between the two best tokens can go either way (sampling stays exact:
    each path decodes from the target's own distribution, as that dtype computes it)."""
    if temperature != 0:
        return ""
    if same:
        return " (expected at temperature 0)"
    dtype = next(target.parameters()).dtype
    if dtype == torch.float32:
        return ""
    return (
        f" (at temperature 0 in {str(dtype).removeprefix('torch.')} a k-token verify rounds differently from a "
        "one-token step, so near-ties can flip; --dtype float32 gives identical tokens)"
    )


def run_generate_spec(args, method: str) -> int:
    """Decode the prompts with `method` and with plain decoding, print the
    texts, then tau, tokens/s and the speedup over plain decoding (stderr)."""

    run = Run(args)
    check_generate_spec_args(args, method, run.target)
    target, eos = run.load_model(args)
    spec = MethodSpec(
        method,
        k=args.k,
        scheduler=args.scheduler,
        path=args.path,
        delay=args.delay,
        admission=args.admission,
        tree=args.tree,
    )
    decode = make_decoder(spec, target, drafter_dir=args.drafter)
    ids = run.ids
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

    run.show(spec_out, eos)
    new = sum(s["new_tokens"] for s in spec_stats)
    secs = sum(s["seconds"] for s in spec_stats)
    steps = sum(s["steps"] for s in spec_stats)
    tau = sum(s["tau"] * s["steps"] for s in spec_stats) / max(1, steps)
    verified = sum(s["drafts_verified"] for s in spec_stats) / max(1, steps)
    tps = new / secs if secs > 0 else 0.0
    same = "identical to" if spec_out == ar_out else "different from"
    k = decode.k_max
    what = f"a {args.tree}-node tree" if args.tree else f"K={k}"
    how = what if args.scheduler == "fixed" else f"confidence scheduler, {'nodes' if args.tree else 'K'}<={k}"
    if method == "dflash2" and not args.tree:
        how += f", {args.path} paths"
    print(
        f"\n[{method}, {how}] {new} new tokens in {secs:.2f} s: {tps:.1f} tokens/s, tau {tau:.2f} "
        f"tokens per target forward, {verified:.2f} drafts verified per step ({steps} request-steps)\n"
        f"[ar] {ar_stats['new_tokens']} new tokens in {ar_stats['seconds']:.2f} s: "
        f"{ar_stats['tokens_per_s']:.1f} tokens/s\n"
        f"speedup over plain decoding: {tps / max(ar_stats['tokens_per_s'], 1e-9):.2f}x; "
        f"output {same} plain decoding{greedy_note(args.temperature, spec_out == ar_out, target)}",
        file=sys.stderr,
    )
    return 0
