"""The target a benchmark runs on, and its held-out prompts: one place for every benchmark.

`--model` takes a known target (`tiny`, the default: the shipped stdlib model; `smollm2`) or a
path (`models.catalog.resolve_target`). The tiny target's prompts are windows of exactly
`--prompt-tokens` tokens over the held-out stdlib files, tasks `code` and `prose`
(`data.heldout_prompts`). Any other target reads the held-out prompt sets
(`data.prompt_set("heldout", kind)`), tasks `chat`, `code` and `prose`: chat instructions
through the model's chat template, code and prose raw, in the sets' fixed order, skipping
those longer than MAX_PROMPT_TOKENS (as `train data` does, so a drafter's held-out data and
its benchmarks read the same prompts).

A target with a chat template has one more task, `general`, outside its default tasks:
general-purpose chat requests that the target writes itself on the held-out topics of
`train.self_instruct` (none shared with the training requests), sampled with a fixed seed and
answered as ordinary user turns. It is the held-out general-chat set of issue 30's bar;
`general` rows never enter a benchmark's aggregate over the default tasks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from flashspark import data
from flashspark.models import catalog

MAX_PROMPT_TOKENS = 384  # train data's --max-prompt-tokens default
GENERAL = "general"  # the self-written general-chat task (module docstring)
GENERAL_SEED = 0  # the generator the requests are sampled with: the same prompts in every run
GENERAL_CHUNK = 16  # seeds whose requests are written together


@dataclass
class BenchTarget:
    ref: catalog.TargetRef
    model: torch.nn.Module
    tokenizer: object
    chat: catalog.ChatTemplate | None  # None: the model has no template (tiny, base models)

    @property
    def label(self) -> str:
        return self.ref.label

    @property
    def tiny(self) -> bool:
        return self.ref.known is not None and self.ref.known.name == catalog.DEFAULT_TARGET

    @property
    def tasks(self) -> tuple[str, ...]:
        """The default tasks (what a benchmark runs and aggregates without --tasks)."""
        return data.TASKS if self.tiny else data.PROMPT_KINDS

    @property
    def extra_tasks(self) -> tuple[str, ...]:
        """Tasks run only when named: `general` for a real target with a chat template."""
        return () if self.tiny or self.chat is None else (GENERAL,)

    def eos_id(self) -> int | None:
        return catalog.eos_token_id(self.model, self.tokenizer)

    def heldout_prompts(self, task: str, n: int, prompt_tokens: int = 64) -> list[list[int]]:
        """`n` held-out prompts of `task` as token ids (module docstring)."""
        if self.tiny:
            return data.heldout_prompts(task, n, prompt_tokens, self.tokenizer)
        if task not in self.tasks + self.extra_tasks:
            raise ValueError(f"unknown task {task!r} for {self.label}; expected one of {self.tasks + self.extra_tasks}")
        if task == GENERAL:
            return self.general_prompts(n)
        if task == "chat" and self.chat is None:
            raise ValueError(f"the model {self.label} has no chat template: use the code or prose prompts")
        out = []
        for prompt in data.prompt_set("heldout", task):
            ids = self.tokenizer.encode(data.render_prompt(prompt, self.chat), add_special_tokens=False).ids
            if 0 < len(ids) <= MAX_PROMPT_TOKENS:
                out.append(ids)
                if len(out) == n:
                    return out
        raise ValueError(
            f"the held-out {task} prompt set has only {len(out)} prompts of at most "
            f"{MAX_PROMPT_TOKENS} tokens; asked for {n}"
        )

    def general_prompts(self, n: int) -> list[list[int]]:
        """`n` general-chat prompts: requests the target writes on the held-out self-instruct
        seeds, in their fixed order (skipping seeds it wrote nothing usable for), through the
        chat template."""
        from flashspark.train import self_instruct, target_data

        seeds = self_instruct.seed_set("heldout")
        stop_ids = target_data.stop_token_ids(self.model, self.tokenizer)
        gen = torch.Generator(device=self.model.model.embed_tokens.weight.device).manual_seed(GENERAL_SEED)
        out, start = [], 0
        while len(out) < n and start < len(seeds):
            chunk = seeds[start : start + GENERAL_CHUNK]  # a fixed size: the first n prompts of any larger n
            start += len(chunk)
            written = self_instruct.write_requests(
                self.model, self.tokenizer, self.chat, chunk, stop_ids, gen, target_data.continue_batch
            )
            for request in written:
                if request is None:
                    continue
                text = self.chat([{"role": "user", "content": request}])
                ids = self.tokenizer.encode(text, add_special_tokens=False).ids
                if len(ids) <= MAX_PROMPT_TOKENS and len(out) < n:
                    out.append(ids)
        if len(out) < n:
            raise ValueError(f"the target wrote only {len(out)} general-chat requests of the {n} asked")
        return out


def add_target_args(p) -> None:
    """--model and --dtype, as `python -m flashspark generate` takes them."""
    p.add_argument(
        "--model",
        default=None,
        help=f"target: {' or '.join(catalog.TARGETS)} (default {catalog.DEFAULT_TARGET}) or a GGUF file / HF directory",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="target dtype (default on a CPU: the target's own, bfloat16 for smollm2, float32 otherwise)",
    )


def add_tasks_arg(p) -> None:
    """--tasks: a subset of the target's tasks (checked once the target is known: `check_tasks`)."""
    p.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        help="code and prose (tiny target), chat, code and prose (others; with a chat template also general); "
        "default: all but general",
    )


def load_bench_target(args, device: str | torch.device = "cpu") -> BenchTarget:
    """The target of --model / --dtype with its tokenizer and chat template."""
    ref = catalog.resolve_target(getattr(args, "model", None))
    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    model = catalog.load_target(ref, dtype=dtype, device=device)
    return BenchTarget(ref, model, catalog.target_tokenizer(ref), catalog.target_chat_template(ref))


def check_tasks(target: BenchTarget, tasks) -> None:
    """ValueError naming the target's tasks for any task it does not have (argparse cannot
    check them: they depend on the target)."""
    known = target.tasks + target.extra_tasks
    bad = [t for t in tasks if t not in known]
    if bad:
        raise ValueError(
            f"unknown task {', '.join(map(repr, bad))} for the target {target.label}; expected {' or '.join(known)}"
        )


def result_tag(model_arg: str | None) -> str:
    """What a benchmark's default result file names add for --model: nothing for the tiny
    target (its results keep their names), `_<name>` for another known target, `_<file or
    directory name>` for a path."""
    ref = catalog.resolve_target(model_arg)
    if ref.known is not None:
        return "" if ref.known.name == catalog.DEFAULT_TARGET else f"_{ref.known.name}"
    return "_" + re.sub(r"[^A-Za-z0-9.-]+", "_", ref.path.stem if ref.path.is_file() else ref.path.name)
