"""Corpus and tokenizer helpers.

The corpus is the `.py` source of the running interpreter's standard library.
A fixed 5% of files, chosen by a hash of their relative path, is held out of
training and used for every evaluation (loss, prompts for benchmarks).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import json
import os
import sys
import sysconfig
import tokenize as pytokenize
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
TOKENIZER_PATH = ASSETS_DIR / "tokenizer.json"

EOT_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [EOT_TOKEN, MASK_TOKEN]

HELDOUT_PERCENT = 5
TASKS = ("code", "prose")


# ---------------------------------------------------------------- corpus files


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """All `.py` files under the stdlib, as sorted posix relative paths.

    `site-packages` is skipped: it depends on what happens to be installed.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into installed packages.
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        for name in filenames:
            if name.endswith(".py"):
                out.append(Path(dirpath, name).relative_to(root).as_posix())
    out.sort()
    return out


def is_heldout(relpath: str) -> bool:
    """Fixed file-level split: sha256 of the posix relative path mod 100 < 5."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h % 100 < HELDOUT_PERCENT


def split_files(split: str, root: Path | None = None) -> list[str]:
    """Relative paths of the `train` or `heldout` split, in sorted order."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}; expected 'train' or 'heldout'")
    want = split == "heldout"
    return [f for f in corpus_files(root) if is_heldout(f) == want]


def read_source(relpath: str, root: Path | None = None) -> str:
    """File text. A few stdlib test files are deliberately not UTF-8; replace
    undecodable bytes so that every machine reads the same text."""
    root = Path(root) if root is not None else stdlib_root()
    return Path(root, relpath).read_bytes().decode("utf-8", errors="replace")


def corpus_manifest(split: str = "train", root: Path | None = None) -> dict:
    """File list plus one sha256 over all contents (in order) of a split."""
    files = split_files(split, root)
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.encode("utf-8") + b"\0")
        digest.update(read_source(f, root).encode("utf-8") + b"\0")
    return {
        "source": "python standard library (.py files, site-packages skipped)",
        "python_version": sys.version.split()[0],
        "split": split,
        "heldout_rule": f"sha256(posix relative path) mod 100 < {HELDOUT_PERCENT}",
        "num_files": len(files),
        "sha256": digest.hexdigest(),
        "files": files,
    }


# ------------------------------------------------------------------- tokenizer


def train_tokenizer(texts, vocab_size: int = 4096):
    """Byte-level BPE over `texts` with the project's special tokens first
    (ids 0 and 1)."""
    tok = Tokenizer(BPE())
    # No prefix space: code must round-trip byte for byte.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path | None = None):
    """The shipped tokenizer (or the one at `path`)."""
    path = Path(path) if path is not None else TOKENIZER_PATH
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file {path} not found")
    return Tokenizer.from_file(str(path))


def special_token_ids(tokenizer) -> dict[str, int]:
    """{'eot': id of <|endoftext|>, 'mask': id of <|mask|>}."""
    ids = {"eot": tokenizer.token_to_id(EOT_TOKEN), "mask": tokenizer.token_to_id(MASK_TOKEN)}
    for name, i in ids.items():
        if i is None:
            raise ValueError(f"tokenizer lacks the special token for {name!r}")
    return ids


def token_byte_lengths(tokenizer) -> np.ndarray:
    """UTF-8 byte length of each token id (0 for special tokens); used for
    bits per byte. In byte-level BPE every character of a token's string
    stands for exactly one byte."""
    n = tokenizer.get_vocab_size()
    out = np.zeros(n, dtype=np.int64)
    specials = set(SPECIAL_TOKENS)
    for i in range(n):
        s = tokenizer.id_to_token(i)
        if s is not None and s not in specials:
            out[i] = len(s)
    return out


def encode_texts(tokenizer, texts: list[str], eot: bool = True) -> np.ndarray:
    """Token ids of all texts, concatenated, each followed by <|endoftext|>."""
    eot_id = special_token_ids(tokenizer)["eot"]
    parts = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        if eot:
            parts.append(np.array([eot_id], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def split_token_ids(split: str, tokenizer, cache_dir: str | Path | None = None) -> np.ndarray:
    """Token ids (uint16) of a whole split, cached as .npy in `cache_dir`.

    The cache name carries a hash of the tokenizer and the split manifest so a
    new tokenizer or interpreter never reuses stale ids.
    """
    files = split_files(split)
    key = hashlib.sha256()
    key.update(tokenizer.to_str().encode("utf-8"))
    key.update("\n".join(files).encode("utf-8"))
    key.update(sys.version.encode("utf-8"))
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"tokens_{split}_{key.hexdigest()[:16]}.npy"
        if path.is_file():
            return np.load(path)
    ids = encode_texts(tokenizer, [read_source(f) for f in files])
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, ids)
        os.replace(tmp, path)
    return ids


# ------------------------------------------------------------ held-out prompts


def extract_prose(source: str) -> list[str]:
    """Docstrings and comment blocks of one source file, in source order."""
    pieces: list[tuple[int, str]] = []
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and doc.strip():
                    line = node.body[0].lineno if node.body else 0
                    pieces.append((line, doc.strip()))
    # Consecutive whole-line comments form one block of prose.
    block: list[str] = []
    block_line = 0
    last_line = -2
    try:
        for tok in pytokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != pytokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            line = tok.start[0]
            if not tok.line.lstrip().startswith("#"):
                # A comment after code stands alone.
                pieces.append((line, text))
                continue
            if line != last_line + 1 and block:
                pieces.append((block_line, " ".join(block)))
                block = []
            if not block:
                block_line = line
            if text and not text.startswith("!") and not text.startswith("-*-"):
                block.append(text)
            last_line = line
    except (pytokenize.TokenError, SyntaxError, IndentationError):
        pass
    if block:
        pieces.append((block_line, " ".join(block)))
    pieces.sort(key=lambda p: p[0])
    return [text for _, text in pieces if _is_prose(text)]


def _is_prose(text: str) -> bool:
    """Short comments ("# noqa") and tables ("0x00ec -> ARABIC LETTER AIN")
    are not prose: keep pieces of >= 4 words that are mostly lowercase letters."""
    chars = [c for c in text if not c.isspace()]
    if len(text.split()) < 4 or not chars:
        return False
    return sum(c.islower() for c in chars) / len(chars) >= 0.5


# Prompt sets: the held-out files, and a calibration set of training-split files
# (every CALIBRATION_STRIDE-th) for fitting confidence models on the target's
# verification outcomes without touching the held-out files.
PROMPT_SETS = ("heldout", "calibration")
CALIBRATION_STRIDE = 20


@functools.lru_cache(maxsize=2)
def _sources(prompt_set: str) -> tuple[str, ...]:
    # Read once per process: benchmarks and tests ask for prompts repeatedly.
    if prompt_set == "heldout":
        files = split_files("heldout")
    elif prompt_set == "calibration":
        files = split_files("train")[::CALIBRATION_STRIDE]
    else:
        raise ValueError(f"unknown prompt set {prompt_set!r}; expected one of {PROMPT_SETS}")
    return tuple(read_source(f) for f in files)


def heldout_documents(task: str, prompt_set: str = "heldout") -> list[str]:
    """Documents of a task: whole files (`code`) or docstrings and comment
    blocks (`prose`), of the held-out files (or of the calibration set)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return list(_documents(task, prompt_set))


@functools.lru_cache(maxsize=None)
def _documents(task: str, prompt_set: str) -> tuple[str, ...]:
    sources = _sources(prompt_set)
    if task == "code":
        return sources
    return tuple(p for src in sources for p in extract_prose(src))


def heldout_prompts(task: str, n: int, prompt_tokens: int, tokenizer, prompt_set: str = "heldout") -> list[list[int]]:
    """`n` deterministic prompts of exactly `prompt_tokens` tokens from the
    held-out files (`prompt_set="calibration"`: from the calibration set).

    `code` prompts start at a line that opens a `def` or `class` so that the
    continuation is ordinary code; `prose` prompts are windows over the stream
    of held-out docstrings and comments, each starting at a document start.
    Starts are spread evenly over all candidates.
    """
    if n <= 0 or prompt_tokens <= 0:
        raise ValueError("n and prompt_tokens must be positive")
    docs = heldout_documents(task, prompt_set)
    candidates: list[list[int]] = []
    if task == "code":
        for src, enc in zip(docs, tokenizer.encode_batch(docs, add_special_tokens=False)):
            lines = src.splitlines(keepends=True)
            offsets = np.cumsum([0] + [len(x) for x in lines])
            starts = [i for i, x in enumerate(lines) if x.lstrip().startswith(("def ", "class "))]
            ids = enc.ids  # each access builds a new list: take it once
            # Map each start line to the first token that begins at or after it.
            tok_starts = np.array([o[0] for o in enc.offsets])
            for li in starts:
                t = int(np.searchsorted(tok_starts, offsets[li]))
                # Only lines where a token boundary falls exactly at the line
                # start, so the prompt text begins with the whole line.
                if t < len(ids) and tok_starts[t] == offsets[li] and t + prompt_tokens <= len(ids):
                    candidates.append(ids[t : t + prompt_tokens])
    else:
        encs = tokenizer.encode_batch([d + "\n\n" for d in docs], add_special_tokens=False)
        stream: list[int] = []
        doc_starts = []
        for e in encs:
            doc_starts.append(len(stream))
            stream.extend(e.ids)
        for s in doc_starts:
            if s + prompt_tokens <= len(stream):
                candidates.append(stream[s : s + prompt_tokens])
    if len(candidates) < n:
        raise ValueError(
            f"{prompt_set} {task} set has only {len(candidates)} prompts of {prompt_tokens} tokens; asked for {n}"
        )
    picks = np.linspace(0, len(candidates) - 1, n).round().astype(int)
    return [list(candidates[i]) for i in picks]


def write_json(path: str | Path, obj) -> None:
    """Pretty, stable JSON (sorted keys) ending in a newline."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
