"""`python -m flashspark`: plain decoding from the shipped model, and one-line
errors with a non-zero exit status on bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashspark import data
from flashspark.cli import build_parser, main, unescape

SHIPPED = data.ASSETS_DIR / "target"
needs_shipped = pytest.mark.skipif(not (SHIPPED / "model.safetensors").is_file(),
                                   reason="shipped target not exported yet")


pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@needs_shipped
def test_generate_ar(capsys):
    code, out, err = run(capsys, "generate", "--method", "ar", "--prompt", "import os\n",
                         "--max-new-tokens", "8")
    assert code == 0
    assert out.startswith("import os\n") and len(out) > len("import os\n")
    assert "tokens/s" in err


@needs_shipped
def test_generate_prompts_file_batched_sampling(capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("def main():\\n    \nclass Parser:\n\nimport sys\n")
    args = ["generate", "--prompts-file", str(f), "--max-new-tokens", "6", "--temperature", "0.8",
            "--top-p", "0.9", "--seed", "1", "--batch-size", "2"]
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
    assert a.method == "ar" and a.temperature == 0.0
    a = p.parse_args(["train", "target", "--minutes", "1"])
    assert a.what == "target" and a.minutes == 1.0
    with pytest.raises(SystemExit):
        p.parse_args(["generate"])  # needs a prompt


def test_module_entry_point():
    env = dict(os.environ)
    pkg_root = str(Path(data.__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "flashspark", "generate", "--prompt", "x", "--model", "/nonexistent"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2
    assert "error: model directory" in r.stderr and "Traceback" not in r.stderr
