"""Corpus split, tokenizer and held-out prompt sets."""

import hashlib

import numpy as np
import pytest
from flashspark import data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer()


def test_corpus_files_sorted_and_clean():
    files = data.corpus_files()
    assert len(files) > 500
    assert files == sorted(files)
    assert all(f.endswith(".py") and "site-packages" not in f.split("/") for f in files)
    assert "os.py" in files


def test_heldout_split_fixed_by_path_hash():
    files = data.corpus_files()
    train, held = data.split_files("train"), data.split_files("heldout")
    assert sorted(train + held) == files and not set(train) & set(held)
    assert 0.02 < len(held) / len(files) < 0.09
    for f in files[:50]:
        h = int.from_bytes(hashlib.sha256(f.encode()).digest()[:8], "big")
        assert data.is_heldout(f) == (h % 100 < 5)
    with pytest.raises(ValueError, match="unknown split"):
        data.split_files("test")


def test_corpus_root_missing(tmp_path):
    with pytest.raises(FileNotFoundError):
        data.corpus_files(tmp_path / "absent")


def test_tokenizer_shipped(tok):
    assert tok.get_vocab_size() == 4096
    ids = data.special_token_ids(tok)
    assert ids == {"eot": 0, "mask": 1}
    assert tok.encode("<|mask|><|endoftext|>", add_special_tokens=False).ids == [1, 0]


@pytest.mark.parametrize("text", ["def f(x):\n    return x  # café ☃\n", "\t\r\n  \x00 ünï", "class A:\n\tpass"])
def test_tokenizer_round_trip(tok, text):
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids) == text
    assert data.token_byte_lengths(tok)[enc.ids].sum() == len(text.encode("utf-8"))


def test_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        data.load_tokenizer(tmp_path / "tokenizer.json")


def test_train_tokenizer_small():
    t = data.train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    assert data.special_token_ids(t) == {"eot": 0, "mask": 1}
    assert t.decode(t.encode("return x").ids) == "return x"


def test_encode_texts_separates_files(tok):
    ids = data.encode_texts(tok, ["a = 1\n", "b = 2\n"])
    assert ids.dtype == np.uint16
    assert (ids == 0).sum() == 2 and ids[-1] == 0


def test_extract_prose():
    src = (
        '"""Module doc about things here."""\n# a comment that explains\n# over two lines\nx = 1  # noqa\n'
        'def f():\n    """Return nothing useful at all."""\n'
    )
    assert data.extract_prose(src) == [
        "Module doc about things here.",
        "a comment that explains over two lines",
        "Return nothing useful at all.",
    ]


@pytest.mark.parametrize("task", ["code", "prose"])
def test_heldout_prompts_deterministic(tok, task):
    a = data.heldout_prompts(task, 8, 64, tok)
    b = data.heldout_prompts(task, 8, 64, tok)
    assert a == b and len(a) == 8
    assert all(len(p) == 64 for p in a)
    assert len({tuple(p) for p in a}) == 8
    if task == "code":
        assert all(tok.decode(p).lstrip().startswith(("def ", "class ")) for p in a)


def test_heldout_prompts_bad_args(tok):
    with pytest.raises(ValueError, match="unknown task"):
        data.heldout_prompts("poetry", 2, 16, tok)
    with pytest.raises(ValueError, match="only"):
        data.heldout_prompts("code", 10**6, 64, tok)


def test_atomic_write_is_whole_or_nothing(tmp_path):
    """A write that fails midway leaves the old file as it was and no temporary beside it; one
    that succeeds replaces it, under its own name (np.save adds no suffix through a file)."""
    path = tmp_path / "ids.npy"
    data.atomic_write(path, lambda f: np.save(f, np.arange(3)))
    assert np.array_equal(np.load(path), np.arange(3))

    def half_then_fail(f):
        f.write(b"\x93NUMPY half a header")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        data.atomic_write(path, half_then_fail)
    assert np.array_equal(np.load(path), np.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.npy"]
    data.write_json(tmp_path / "p.json", {"b": 1, "a": [2]})
    assert (tmp_path / "p.json").read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
