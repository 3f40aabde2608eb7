"""Prompt sets for an instruct target: chat, code and prose prompts from the stdlib, split by file."""

import ast
import hashlib
import os
import re
import string
import subprocess
import sys

import pytest
from flashspark import data

CAPS = {"chat": data.CHAT_MAX_CHARS, "code": data.CODE_MAX_CHARS, "prose": data.PROSE_MAX_CHARS}


@pytest.fixture(scope="module")
def sets():
    return {(s, k): data.prompt_set(s, k) for s in data.PROMPT_SPLITS for k in data.PROMPT_KINDS}


def chatml(messages):
    """A stand-in for the instruct target's ChatML template."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + "<|im_start|>assistant\n"


def template_pattern(template: str) -> re.Pattern:
    """The template with each field as a non-empty wildcard: a text it fullmatches was filled from it."""
    parts = [re.escape(lit) + ("(.+?)" if field else "") for lit, field, _, _ in string.Formatter().parse(template)]
    return re.compile("".join(parts), re.S)


def digest(prompts) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(repr((p.text, p.kind, p.file, p.name, p.line, p.template)).encode())
    return h.hexdigest()


# ---------------------------------------------------------------- the stdlib's sets


def test_every_kind_in_every_split(sets):
    for (split, kind), prompts in sets.items():
        assert len(prompts) >= 100, (split, kind, len(prompts))
        assert all(p.kind == kind for p in prompts)
    assert data.prompt_set_sizes() == {s: {k: len(sets[s, k]) for k in data.PROMPT_KINDS} for s in data.PROMPT_SPLITS}


def test_split_by_file_and_disjoint_by_text(sets):
    files = {s: data.prompt_files(s) for s in data.PROMPT_SPLITS}
    assert all(data.is_heldout(f) for f in files["heldout"])
    assert not any(data.is_heldout(f) for s in ("train", "calibration") for f in files[s])
    assert set(files["calibration"]) <= set(data.split_files("train")[:: data.CALIBRATION_STRIDE])
    texts = {}
    for s in data.PROMPT_SPLITS:
        used = {p.file for k in data.PROMPT_KINDS for p in sets[s, k]}
        assert used <= set(files[s])
        texts[s] = [p.text for k in data.PROMPT_KINDS for p in sets[s, k]]
        assert len(set(texts[s])) == len(texts[s]), f"duplicates in {s}"
    for a, b in [("train", "heldout"), ("train", "calibration"), ("calibration", "heldout")]:
        assert not set(files[a]) & set(files[b])
        assert not set(texts[a]) & set(texts[b])
    assert not any(set(f.split("/")[:-1]) & data.PROMPT_SKIP_DIRS for s in files.values() for f in s)


def test_caps_and_shapes(sets):
    for (split, kind), prompts in sets.items():
        for p in prompts:
            assert 0 < len(p.text) <= CAPS[kind] and p.text == p.text.strip(), (p.file, p.name)
            assert p.name.startswith(data.module_name(p.file)) and p.line >= 1
        if kind == "code":
            assert all(p.text.startswith(("def ", "async def ", "class ", "@")) for p in prompts)
            assert all("\n" in p.text for p in prompts)
        if kind == "prose":
            assert all(len(p.text.split()) >= 6 for p in prompts)


def test_chat_templates_filled_and_varied(sets):
    patterns = {key: template_pattern(t) for key, _, t in data.CHAT_TEMPLATES}
    for split in data.PROMPT_SPLITS:
        chats = sets[split, "chat"]
        for p in chats:
            assert patterns[p.template].fullmatch(p.text), (p.template, p.text[:200])
            assert p.messages == [{"role": "user", "content": p.text}]
        assert sets[split, "code"][0].messages is None
    used = {p.template for p in sets["train", "chat"]}
    assert used == {key for key, _, _ in data.CHAT_TEMPLATES}


def test_deterministic_within_and_across_processes(sets):
    assert data.prompt_set("heldout", "chat") == sets["heldout", "chat"]
    # The data module alone, under another hash seed: no set or dict order leaks into the prompts.
    script = (
        "import importlib.util, sys, hashlib\n"
        "spec = importlib.util.spec_from_file_location('fsdata', sys.argv[1])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['fsdata'] = m; spec.loader.exec_module(m)\n"
        "h = hashlib.sha256()\n"
        "for s in ('heldout', 'calibration'):\n"
        "    for k in m.PROMPT_KINDS:\n"
        "        for p in m.prompt_set(s, k):\n"
        "            h.update(repr((p.text, p.kind, p.file, p.name, p.line, p.template)).encode())\n"
        "print(h.hexdigest())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", script, data.__file__], env=env, capture_output=True, text=True, check=True
    )
    want = digest(p for s in ("heldout", "calibration") for k in data.PROMPT_KINDS for p in sets[s, k])
    assert out.stdout.strip() == want


def test_first_n_and_bad_arguments(sets):
    assert data.prompt_set("heldout", "code", n=5) == sets["heldout", "code"][:5]
    with pytest.raises(ValueError, match="unknown prompt split"):
        data.prompt_set("test", "chat")
    with pytest.raises(ValueError, match="unknown prompt split"):
        data.prompt_files("validation")
    with pytest.raises(ValueError, match="unknown prompt kind"):
        data.prompt_set("heldout", "poetry")
    with pytest.raises(ValueError, match="positive"):
        data.prompt_set("heldout", "chat", n=0)
    with pytest.raises(ValueError, match="has only"):
        data.prompt_set("heldout", "chat", n=10**6)


def test_render_through_a_chat_template(sets):
    chat, code = sets["heldout", "chat"][0], sets["heldout", "code"][0]
    text = data.render_prompt(chat, chatml)
    assert text == f"<|im_start|>user\n{chat.text}<|im_end|>\n<|im_start|>assistant\n"
    assert data.render_prompt(code, chatml) == code.text == data.render_prompt(code)
    assert data.render_prompts([chat, code], chatml) == [text, code.text]
    with pytest.raises(ValueError, match="needs a chat_template"):
        data.render_prompt(chat)
    with pytest.raises(ValueError, match="must return the prompt text"):
        data.render_prompt(chat, lambda messages: [1, 2])
    chat.messages.append({"role": "user", "content": "edited"})  # a fresh list: the cache is unchanged
    assert len(chat.messages) == 1


# ------------------------------------------------------------------ a tree of our own

MODULE = '''"""Tools for measuring the WORD of widgets in a small and friendly way.

This module exists only for the tests: it has a documented function, a
documented class with a method, and comments, so that every kind of
prompt comes out of it, each with enough words to be used by them.
"""

# The widgets are measured in whole units; a fraction of a unit is rounded
# down, because the tests want integers and nothing else at all here.
UNIT = 1


def measure_WORD(widget, *, scale=2):
    """Return the WORD of a widget, scaled by the given factor.

    The widget must have a size attribute. The result is the size multiplied
    by the scale, rounded down to a whole number of units for every caller.
    """
    size = widget.size
    value = size * scale
    return int(value) // UNIT


class Gauge_WORD:
    """A gauge that remembers every WORD it has measured so far, in order.

    Each call to read appends to the history and returns the new value,
    so that the callers can replay the measurements later if they need to.
    """

    def __init__(self, scale=2):
        self.scale = scale
        self.history = []

    def read(self, widget):
        """Measure one widget and remember the result in the history list."""
        value = measure_WORD(widget, scale=self.scale)
        self.history.append(value)
        return value


def _private_WORD(x):
    """Return the value unchanged, a helper that no instruction should name."""
    y = x
    z = y
    return z


def shared(x):
    """Return twice the value given, for the tests of duplicate texts."""
    y = x + x
    z = y
    return z
'''


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A stdlib of six modules: one held out, one calibration file (the first training file),
    the rest training; plus a test suite that is left out. `shared` is in every module."""
    root = tmp_path_factory.mktemp("stdlib")
    names = [f"mod{i}.py" for i in range(200)]
    held = [n for n in names if data.is_heldout(n)][:1]
    train = sorted(n for n in names if not data.is_heldout(n))[:5]
    for n in held + train:
        (root / n).write_text(MODULE.replace("WORD", n[:-3]))
    (root / "test").mkdir()
    (root / "test" / "test_mod.py").write_text(MODULE.replace("WORD", "suite"))
    return root, held, train


def test_own_tree_splits(tree):
    root, held, train = tree
    assert data.prompt_files("heldout", root) == held
    assert data.prompt_files("calibration", root) == train[:1]
    assert data.prompt_files("train", root) == train[1:]
    sizes = data.prompt_set_sizes(root)
    assert all(n > 0 for split in sizes.values() for n in split.values())
    everything = [p for s in data.PROMPT_SPLITS for k in data.PROMPT_KINDS for p in data.prompt_set(s, k, root=root)]
    assert "{" not in "".join(p.text for p in everything) and "WORD" not in "".join(p.text for p in everything)
    assert not any(p.file.startswith("test/") or "suite" in p.text for p in everything)
    # `shared`'s code is the same text in every file: only the held-out file keeps it.
    shared = [p for p in everything if p.kind == "code" and p.text.startswith("def shared(")]
    assert [p.file for p in shared] == held


def test_own_tree_prompts(tree):
    root, held, _ = tree
    source = (root / held[0]).read_text()
    prompts = data.file_prompts(source, held[0])
    word = held[0][:-3]
    chats = {p.name: p for p in prompts if p.kind == "chat"}
    assert set(chats) == {
        word,
        f"{word}.measure_{word}",
        f"{word}.Gauge_{word}",
        f"{word}.Gauge_{word}.read",
        f"{word}.shared",
    }
    code = {p.name: p.text for p in prompts if p.kind == "code"}
    assert code[f"{word}.Gauge_{word}.read"] == (
        "def read(self, widget):\n"
        '    """Measure one widget and remember the result in the history list."""\n'
        f"    value = measure_{word}(widget, scale=self.scale)"
    )
    assert code[f"{word}.measure_{word}"].startswith(f"def measure_{word}(widget, *, scale=2):\n")
    assert all(text in source or text.replace("\n", "\n    ") in source for text in code.values())
    prose = [p.text for p in prompts if p.kind == "prose"]
    assert f"Tools for measuring the {word} of widgets in a small and friendly way." in prose
    assert any(t.startswith("The widgets are measured in whole units;") and "\n" not in t for t in prose)
    assert data.file_prompts("def broken(:\n", "bad.py") == []


def test_signatures_as_the_docs_write_them():
    def sig(src, drop_first=True):
        return data._signature(ast.parse(src).body[0].args, drop_first)

    assert sig("def f(self, a, /, b: int = 1, *c, d=2, **e): pass") == "a, /, b: int = 1, *c, d=2, **e"
    assert sig("def f(self, /, x): pass") == "x"
    assert sig("def f(self, x=1): pass") == "x=1"
    assert sig("def f(obj, *, skipkeys=False): pass", drop_first=False) == "obj, *, skipkeys=False"
    assert sig("def f(" + ", ".join(f"a{i}" for i in range(60)) + "): pass") is None


def test_module_names():
    assert data.module_name("json/__init__.py") == "json"
    assert data.module_name("os.py") == "os"
    assert data.module_name("email/mime/text.py") == "email.mime.text"
