"""Corpus and tokenizer helpers.

The corpus is the `.py` source of the running interpreter's standard library.
A fixed 5% of files, chosen by a hash of their relative path, is held out of
training and used for every evaluation (loss, prompts for benchmarks). The
prompt sets for an instruct target (chat, code and prose prompts, split by the
same rule into train, calibration and held-out files) are built here too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import json
import os
import re
import string
import sys
import sysconfig
import tempfile
import tokenize as pytokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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
        atomic_write(path, lambda f: np.save(f, ids))
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


def atomic_write(path: str | Path, write) -> None:
    """Write `path` whole or not at all: `write(f)` fills a binary file open on a temporary
    sibling, which then replaces `path` (one rename: a reader, or a run killed mid-write,
    never sees half a file). A failed `write` leaves `path` as it was and no temporary."""
    path = Path(path)
    # A name of its own: two writers of one path (a shared cache) never write into one temporary.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make a shared cache file private
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj) -> None:
    """Pretty, stable JSON (sorted keys) ending in a newline, written atomically (progress
    records say which hours-long shards are complete)."""
    text = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(path, lambda f: f.write(text))


# --------------------------------------------------------- prompt sets for an instruct target
#
# Prompts for a real (instruct) target, all from the stdlib: chat instructions built from the
# docstrings and signatures of functions, classes and modules; code completions (the start of
# a def or class); prose (the start of a docstring, comment block or long text string). Split by
# file: the held-out files as above, the calibration files as above, training = the rest, so no
# held-out file yields a training prompt; a text that also occurs in an earlier split of
# (heldout, calibration, train) is dropped from the later one.

PROMPT_SPLITS = ("train", "calibration", "heldout")
PROMPT_KINDS = ("chat", "code", "prose")
# Test suites are over half the stdlib's bytes but mostly assertions with few docstrings:
# parsing them would double the build time for few chat or prose prompts. The codecs of
# encodings/ are generated tables, a hundred near-copies of one file.
PROMPT_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "encodings"})
# Caps in characters (about 4 per token of English or Python for a GPT-2-style BPE).
CHAT_MAX_CHARS = 1200
CODE_MAX_CHARS = 800
PROSE_MAX_CHARS = 600
SIGNATURE_MAX_CHARS = 100
SUMMARY_MAX_CHARS = 240
DOC_MIN_WORDS = 25  # for the templates that quote the documentation

# (key, what it applies to, template). A template applies to an object when every field it
# names is available (code and stub only when the source fits) and the text fits the cap.
CHAT_TEMPLATES = (
    ("explain", ("function", "method"), "Explain what `{qualcall}` does in Python."),
    ("implement", ("function", "method"), "Write a Python {what} `{call}` that does the following: {summary}"),
    ("implement_doc", ("function", "method"), "Implement `{call}` in Python from its documentation:\n\n{doc}"),
    (
        "summarize",
        ("function", "method"),
        "Summarize the following documentation of `{qualname}` in one or two sentences.\n\n{doc}",
    ),
    ("example", ("function", "method"), "Show a short example that calls `{qualcall}` and explain the result."),
    ("parameters", ("function", "method"), "What is each parameter of `{qualcall}` for?"),
    (
        "tests",
        ("function", "method"),
        "Write unit tests with `unittest` for `{qualcall}`, which is documented as: {summary}",
    ),
    (
        "walkthrough",
        ("function", "method", "class"),
        "Here is a {what} from Python's `{module}` module:\n\n```python\n{code}\n```\n\nExplain step by step how it works.",
    ),
    (
        "docstring",
        ("function", "method", "class"),
        "Write a docstring for this Python {what}:\n\n```python\n{stub}\n```",
    ),
    ("review", ("function", "method"), "Review this Python code and suggest improvements:\n\n```python\n{code}\n```"),
    ("beginner", ("function", "method", "class"), "Explain this documentation to a beginner in plain words:\n\n{doc}"),
    ("explain_class", ("class",), "Explain the purpose of the class `{qualname}` and how it is used."),
    ("implement_class", ("class",), "Write a Python class `{call}` that does the following: {summary}"),
    ("summarize_class", ("class",), "Summarize the following documentation of the class `{qualname}`:\n\n{doc}"),
    ("example_class", ("class",), "Give an example of creating and using `{qualcall}`."),
    ("summarize_module", ("module",), "Summarize the following description of Python's `{module}` module:\n\n{doc}"),
    ("explain_module", ("module",), "What is Python's `{module}` module for? Give an example of using it."),
    (
        "tutorial_module",
        ("module",),
        "Write a short tutorial introduction to the `{module}` module based on its documentation:\n\n{doc}",
    ),
)
_TEMPLATE_FIELDS = {key: {f for _, f, _, _ in string.Formatter().parse(t) if f} for key, _, t in CHAT_TEMPLATES}


@dataclass(frozen=True)
class Prompt:
    """One prompt. `text` is the user's message (`chat`) or raw text for the model to
    continue (`code`, `prose`); `file` the stdlib path it came from, `name` the dotted name of
    the object (the module for comments), `line` its first source line, `template` the chat
    template's key ('' for raw text)."""

    text: str
    kind: str
    file: str
    name: str
    line: int
    template: str = ""

    @property
    def messages(self) -> list[dict[str, str]] | None:
        """The chat turn for a chat template ([{'role': 'user', 'content': text}]); None for
        raw text. A new list each time, so a caller's edits never reach the cache."""
        return [{"role": "user", "content": self.text}] if self.kind == "chat" else None


def prompt_files(split: str, root: Path | None = None) -> list[str]:
    """Files of a prompt split: `heldout` (the held-out files), `calibration` (every
    CALIBRATION_STRIDE-th training file, the calibration set above) or `train` (the other
    training files); test suites (PROMPT_SKIP_DIRS) left out."""
    if split not in PROMPT_SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; expected one of {PROMPT_SPLITS}")
    if split == "heldout":
        files = split_files("heldout", root)
    else:
        train = split_files("train", root)
        calibration = set(train[::CALIBRATION_STRIDE])
        files = [f for f in train if (f in calibration) == (split == "calibration")]
    return [f for f in files if not PROMPT_SKIP_DIRS & set(f.split("/")[:-1])]


def prompt_set(split: str, kind: str, n: int | None = None, root: Path | None = None) -> list[Prompt]:
    """The prompts of one split and kind, in a fixed pseudo-random order (by a hash of file
    and text) so that any prefix samples every part of the stdlib; `n`: the first n.
    Built once per process (a few seconds for `train`, well under one for the others)."""
    if kind not in PROMPT_KINDS:
        raise ValueError(f"unknown prompt kind {kind!r}; expected one of {PROMPT_KINDS}")
    prompts = _prompt_split(split, str(Path(root) if root is not None else stdlib_root()))[kind]
    if n is None:
        return list(prompts)
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if n > len(prompts):
        raise ValueError(f"the {split} {kind} prompt set has only {len(prompts)} prompts; asked for {n}")
    return list(prompts[:n])


def prompt_set_sizes(root: Path | None = None) -> dict[str, dict[str, int]]:
    """{split: {kind: number of prompts}}."""
    return {s: {k: len(prompt_set(s, k, root=root)) for k in PROMPT_KINDS} for s in PROMPT_SPLITS}


def render_prompt(prompt: Prompt, chat_template: Callable[[list[dict[str, str]]], str] | None = None) -> str:
    """The text the model reads: a chat prompt through `chat_template` (messages -> the prompt
    text up to where the assistant's reply starts), raw text as it is."""
    if prompt.kind not in PROMPT_KINDS:
        raise ValueError(f"unknown prompt kind {prompt.kind!r}; expected one of {PROMPT_KINDS}")
    if prompt.kind != "chat":
        return prompt.text
    if chat_template is None:
        raise ValueError("a chat prompt needs a chat_template (messages -> prompt text)")
    text = chat_template(prompt.messages)
    if not isinstance(text, str):
        raise ValueError(f"chat_template must return the prompt text (a str), not {type(text).__name__}")
    return text


def render_prompts(prompts, chat_template: Callable[[list[dict[str, str]]], str] | None = None) -> list[str]:
    """`render_prompt` of each."""
    return [render_prompt(p, chat_template) for p in prompts]


@functools.lru_cache(maxsize=None)
def _prompt_split(split: str, root: str) -> dict[str, tuple[Prompt, ...]]:
    # Texts of the earlier splits are removed from the later ones, so a held-out text never
    # reaches calibration or training, even when two files share it.
    order = ("heldout", "calibration", "train")
    if split not in PROMPT_SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; expected one of {PROMPT_SPLITS}")
    taken: set[str] = set()
    for earlier in order[: order.index(split)]:
        taken.update(p.text for ps in _prompt_split(earlier, root).values() for p in ps)
    out: dict[str, list[Prompt]] = {k: [] for k in PROMPT_KINDS}
    for f in prompt_files(split, Path(root)):
        for p in file_prompts(read_source(f, Path(root)), f):
            if p.text not in taken:
                taken.add(p.text)
                out[p.kind].append(p)
    return {k: tuple(sorted(ps, key=_prompt_order)) for k, ps in out.items()}


def _prompt_order(p: Prompt) -> bytes:
    return hashlib.sha256(f"{p.kind}\0{p.file}\0{p.text}".encode()).digest()


def module_name(relpath: str) -> str:
    """Dotted module name of a stdlib path: 'json/__init__.py' -> 'json'."""
    parts = relpath[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def file_prompts(source: str, relpath: str) -> list[Prompt]:
    """Every chat, code and prose prompt of one source file, in source order (not
    deduplicated: `prompt_set` does that over a split)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    # ast counts lines at \n, \r\n and \r only (str.splitlines also splits at \f, which
    # stdlib files contain).
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    module = module_name(relpath)
    out: list[Prompt] = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        out += _chat_prompts(_ChatObject("module", module, "", None, doc, None, None), relpath, 1)
    defs = list(_definitions(tree.body, "", None, False))
    for node, local, cls, nested in defs:
        if nested:
            continue  # a function's inner helpers: their docstrings are prose, below
        seg = _dedented(lines, node)
        out += _code_prompt(node, seg, relpath, f"{module}.{local}")
        doc = ast.get_docstring(node, clean=True)
        # Instructions about private helpers (`_cc`, `_Helper.run`) would read oddly.
        private = any(x.startswith("_") and not x.endswith("__") for x in local.split("."))
        if doc and not private:
            out += _chat_prompts(_chat_object(node, local, module, cls, doc, seg), relpath, node.lineno)
    out += _prose_prompts(tree, defs, lines, relpath, module)
    out.sort(key=lambda p: p.line)
    return out


def _definitions(body, prefix: str, cls, nested: bool):
    """(node, dotted local name, enclosing class, whether inside a function) of every def and
    class, under if / try / with / match too (platform and import fallbacks)."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield node, prefix + node.name, None, nested
            yield from _definitions(node.body, f"{prefix}{node.name}.", node, nested)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, prefix + node.name, cls, nested
            yield from _definitions(node.body, f"{prefix}{node.name}.", None, True)
            continue
        for field in ("body", "orelse", "finalbody"):
            sub = getattr(node, field, None)
            if isinstance(sub, list):
                yield from _definitions(sub, prefix, cls, nested)
        for part in getattr(node, "handlers", []) + getattr(node, "cases", []):
            yield from _definitions(part.body, prefix, cls, nested)


def _dedented(lines: list[str], node) -> list[str] | None:
    """The node's source lines (decorators included) without its indentation; None when a
    line (inside a string) is less indented than the def."""
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    seg = lines[start - 1 : node.end_lineno]
    indent = seg[0][: node.col_offset]
    if indent.strip() or not all(x.startswith(indent) or not x.strip() for x in seg):
        return None
    return [x[len(indent) :] for x in seg]


def _code_prompt(node, seg: list[str] | None, relpath: str, name: str) -> list[Prompt]:
    # The header (decorators, signature) and about half of the body, whole lines, capped.
    if seg is None:
        return []
    header = node.body[0].lineno - min([node.lineno] + [d.lineno for d in node.decorator_list])
    body = len(seg) - header
    if header < 1 or body < 3:
        return []
    keep = header + max(1, body // 2)
    while keep > header + 1 and len("\n".join(seg[:keep])) > CODE_MAX_CHARS:
        keep -= 1
    # No trailing newline: byte-level BPE merges a newline with the next line's indent, so a
    # prompt ending at the newline would force an unnatural split of that token.
    text = "\n".join(seg[:keep]).rstrip()
    if len(text) > CODE_MAX_CHARS or text.count("\n") < 1 or not "".join(seg[keep:]).strip():
        return []
    return [Prompt(text, "code", relpath, name, node.lineno)]


class _ChatObject(NamedTuple):
    what: str  # function, method, class or module
    module: str
    local: str  # dotted name inside the module ('' for the module)
    sig: str | None  # parameters; None when unknown (a class without __init__) or too long
    doc: str
    code: str | None
    stub: str | None  # code without its docstring


def _chat_object(node, local: str, module: str, cls, doc: str, seg: list[str] | None) -> _ChatObject:
    if isinstance(node, ast.ClassDef):
        what = "class"
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
        sig = _signature(init.args, drop_first=True) if init is not None else None
    else:
        what = "method" if cls is not None else "function"
        static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)
        sig = _signature(node.args, drop_first=what == "method" and not static)
    code = stub = None
    if seg is not None:
        code = "\n".join(seg).strip("\n")
        first = node.body[0]
        if isinstance(first, ast.Expr) and len(node.body) > 1 and first.lineno > node.lineno:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            stub = "\n".join(seg[: first.lineno - start] + seg[first.end_lineno - start + 1 :]).strip("\n")
    return _ChatObject(what, module, local, sig, doc, code, stub)


def _signature(args: ast.arguments, drop_first: bool) -> str | None:
    """Parameters as Python's docs write them ('obj, *, skipkeys=False'), without self or cls;
    None when longer than SIGNATURE_MAX_CHARS."""

    def param(a: ast.arg, default) -> str:
        s = a.arg + (f": {ast.unparse(a.annotation)}" if a.annotation is not None else "")
        if default is not None:
            s += (" = " if a.annotation is not None else "=") + ast.unparse(default)
        return s

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parts = []
    for i, (a, d) in enumerate(zip(positional, defaults)):
        if not (i == 0 and drop_first):
            parts.append(param(a, d))
        if i == len(args.posonlyargs) - 1 and parts:
            parts.append("/")
    if args.vararg is not None:
        parts.append("*" + param(args.vararg, None))
    elif args.kwonlyargs:
        parts.append("*")
    parts += [param(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg is not None:
        parts.append("**" + param(args.kwarg, None))
    sig = ", ".join(parts)
    return sig if len(sig) <= SIGNATURE_MAX_CHARS else None


_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]'\"`])[.!?](?=\s|$)")


def _summary(doc: str, name: str) -> str | None:
    """The docstring's first sentence, when it reads as one (not a signature line)."""
    para = " ".join(re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0].split())
    m = _SENTENCE_END.search(para)
    first = para[: m.end()] if m else para
    if len(first) > SUMMARY_MAX_CHARS or "->" in first or first.startswith(name + "(") or not _is_prose(first):
        return None
    return first


def _fit(doc: str, budget: int) -> str | None:
    """Whole paragraphs of `doc` within `budget` characters, else its sentences that fit."""
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]
    out = ""
    for p in paras:
        joined = f"{out}\n\n{p}" if out else p
        if len(joined) > budget:
            break
        out = joined
    if not out and paras:
        ends = [m.end() for m in _SENTENCE_END.finditer(paras[0]) if m.end() <= budget]
        out = paras[0][: ends[-1]] if ends else ""
    return out or None


def _chat_prompts(obj: _ChatObject, relpath: str, line: int) -> list[Prompt]:
    # One prompt per object, its template picked by a hash among those that apply.
    qualname = f"{obj.module}.{obj.local}" if obj.local else obj.module
    summary = _summary(obj.doc, obj.local.rsplit(".", 1)[-1])
    if summary is None and obj.what != "module":
        return []  # a signature-only or non-prose docstring: nothing to ask from
    call = obj.local if obj.sig is None else f"{obj.local}({obj.sig})"
    fields = {
        "what": obj.what,
        "module": obj.module,
        "qualname": qualname,
        "call": call,
        "qualcall": f"{obj.module}.{call}",
        "summary": summary,
        "code": obj.code if obj.code and obj.code.count("\n") >= 2 else None,
        "stub": obj.stub,
    }
    texts = []
    for key, applies, template in CHAT_TEMPLATES:
        need = _TEMPLATE_FIELDS[key]
        if obj.what not in applies or any(f != "doc" and fields[f] is None for f in need):
            continue
        if key == "parameters" and not obj.sig:
            continue  # nothing to ask about
        values = {f: fields[f] for f in need if f != "doc"}
        if "doc" in need:
            doc = _fit(obj.doc, CHAT_MAX_CHARS - len(template.format(doc="", **values)))
            if doc is None or len(doc.split()) < DOC_MIN_WORDS:
                continue  # a one-line docstring is too little to summarize or explain
            values["doc"] = doc
        text = template.format(**values)
        if len(text) <= CHAT_MAX_CHARS:
            texts.append((key, text))
    if not texts:
        return []
    h = int.from_bytes(hashlib.sha256(f"{relpath}\0{qualname}\0{line}".encode()).digest()[:8], "big")
    key, text = texts[h % len(texts)]
    return [Prompt(text, "chat", relpath, qualname, line, key)]


_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[,.;:!?)]?")


def _is_plain_prose(text: str) -> bool:
    """Mostly words (not code, tables or markup): >= 60% of whitespace-separated tokens."""
    tokens = text.split()
    return bool(tokens) and sum(bool(_WORD.fullmatch(t)) for t in tokens) / len(tokens) >= 0.6


# A comment or a string literal (any prefix, any quotes): one pass of this regex finds the
# comments, skipping a '#' inside a string, far faster than walking the tree or tokenizing.
_COMMENT_OR_STRING = re.compile(
    r"#[^\n]*"
    r'|[rRbBuUfF]{0,2}(?:"""(?:\\.|[^\\])*?"""'
    r"|'''(?:\\.|[^\\])*?'''"
    r'|"(?:\\.|[^"\\\n])*"'
    r"|'(?:\\.|[^'\\\n])*')",
    re.S,
)


def _prose_pieces(tree, defs, lines: list[str], module: str) -> list[tuple[int, str, str]]:
    """(line, dotted name, text) of the docstrings, the long text strings assigned at module
    level (pydoc's topics, usage texts) and the whole-line comment blocks of a file."""
    pieces = []
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        pieces.append((tree.body[0].lineno, module, doc.strip()))
    for node, local, _, _ in defs:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            pieces.append((node.body[0].lineno, f"{module}.{local}", doc.strip()))
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            for c in ast.walk(node.value):
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and len(c.value.split()) >= 40:
                    pieces.append((c.lineno, module, inspect.cleandoc(c.value)))
    # Whole-line comments; consecutive ones form a block, an empty one separates paragraphs.
    text = "\n".join(lines)
    blocks: list[tuple[int, list[list[str]]]] = []
    line, pos, last = 1, 0, -1
    for m in _COMMENT_OR_STRING.finditer(text):
        if not m.group().startswith("#"):
            continue
        line += text.count("\n", pos, m.start())
        pos = m.start()
        if text[text.rfind("\n", 0, m.start()) + 1 : m.start()].strip():
            continue  # a comment after code
        words = m.group().lstrip("#").strip()
        if line != last + 1:
            blocks.append((line, [[]]))
        last = line
        if not words:
            blocks[-1][1].append([])
        elif not words.startswith(("!", "-*-")):
            blocks[-1][1][-1].append(words)
    for start, paras in blocks:
        body = "\n\n".join(" ".join(p) for p in paras if p)
        if body:
            pieces.append((start, module, body))
    return pieces


def _prose_prompts(tree, defs, lines: list[str], relpath: str, module: str) -> list[Prompt]:
    # Each piece in windows of whole paragraphs (up to twice the cap); a window's prompt is its
    # first half, cut at a sentence end when one falls late enough, else at a word.
    out = []
    for line, name, text in _prose_pieces(tree, defs, lines, module):
        window: list[str] = []
        for para in [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()] + [None]:
            if window and (para is None or len("\n\n".join(window + [para])) > 2 * PROSE_MAX_CHARS):
                prefix = _prose_prefix("\n\n".join(window))
                if prefix is not None:
                    out.append(Prompt(prefix, "prose", relpath, name, line))
                window = []
            if para is not None:
                window.append(para)
    return out


def _prose_prefix(text: str) -> str | None:
    if len(text.split()) < 16:
        return None
    limit = min(len(text) // 2, PROSE_MAX_CHARS)
    ends = [m.end() for m in _SENTENCE_END.finditer(text) if m.end() <= limit and len(text[: m.end()].split()) >= 6]
    cut = ends[-1] if ends else max(text.rfind(" ", 0, limit + 1), text.rfind("\n", 0, limit + 1))
    prefix = text[:cut].rstrip() if cut > 0 else ""
    if len(prefix.split()) < 6 or not _is_prose(prefix) or not _is_plain_prose(prefix):
        return None
    return prefix
