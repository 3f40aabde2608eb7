"""General chat the target writes itself (`train data --kinds self`): the seeds' topics never
cross splits, the request is the template cut at the user's turn plus the seed and what the
target sampled until its end of turn (unfinished or empty requests are dropped), and the data
holds each request rendered as an ordinary user turn, resumed exactly."""

import json

import numpy as np
import pytest
import torch
from flashspark.models import catalog
from flashspark.train import self_instruct, target_data
from flashspark.train.target_data import DataArgs, TargetData, generate_data

pytestmark = pytest.mark.usefixtures("one_thread")


def template(messages):
    return "<|sys|>be brief\n<|user|>" + messages[0]["content"] + "<|end|>\n<|bot|>"


def test_seed_topics_never_cross_splits():
    sets = {s: self_instruct.seed_set(s) for s in ("train", "calibration", "heldout")}
    topics = {s: {x.topic for x in v} for s, v in sets.items()}
    assert not topics["train"] & topics["heldout"] and not topics["train"] & topics["calibration"]
    assert not topics["heldout"] & topics["calibration"]
    assert set().union(*topics.values()) == set(self_instruct.TOPICS)
    for s, v in sets.items():
        grid = len(self_instruct.OPENERS) * len(topics[s])
        assert len(v) == grid * self_instruct.ROUNDS[s] and len(set(v)) == len(v)
        assert len({x.topic for x in v[: 2 * len(topics[s])]}) > len(topics[s]) // 2  # a prefix mixes topics
    assert self_instruct.seed_set("train") == sets["train"]
    with pytest.raises(ValueError, match="unknown split"):
        self_instruct.seed_set("test")


def test_the_request_is_what_the_target_wrote_until_its_end_of_turn():
    assert self_instruct.pre_query(template) == "<|sys|>be brief\n<|user|>"
    with pytest.raises(ValueError, match="does not quote"):
        self_instruct.pre_query(lambda m: "fixed")
    tok = catalog.target_tokenizer(catalog.resolve_target("tiny"))
    seeds = self_instruct.seed_set("train")[:4]
    stop = 7
    written = {0: " of cheese?", 1: " now", 2: "", 3: " never ends"}
    seen = []

    def fake_continue(target, prompts, max_new, layer_ids, stop_ids, top_k, temperature, gen):
        assert max_new == self_instruct.REQUEST_MAX_TOKENS and temperature == self_instruct.REQUEST_TEMPERATURE
        seen.extend(prompts)
        rows = []
        for i, p in enumerate(prompts):
            new = tok.encode(written[i], add_special_tokens=False).ids + ([stop] if i != 3 else [])
            rows.append({"tokens": torch.tensor(p + new)})
        return rows

    got = self_instruct.write_requests(None, tok, template, seeds, {stop}, None, fake_continue)
    assert [tok.decode(p) for p in seen] == ["<|sys|>be brief\n<|user|>" + s.text for s in seeds]
    assert got[0] == seeds[0].text + " of cheese?"
    assert got[1] == seeds[1].text + " now"
    assert got[2] == seeds[2].text  # the seed alone is a request too
    assert got[3] is None  # not finished within REQUEST_MAX_TOKENS


def test_self_instruct_data_on_the_tiny_target(tmp_path, monkeypatch):
    """With a chat template and an end of turn the tiny target emits often (a space), the data
    holds requests rendered as user turns (kind `self`), and a resumed run equals a whole one."""
    tok = catalog.target_tokenizer(catalog.resolve_target("tiny"))
    space = tok.encode(" the", add_special_tokens=False).ids[0]
    monkeypatch.setattr(catalog, "target_chat_template", lambda ref: template)
    monkeypatch.setattr(catalog, "eos_token_id", lambda model, tokenizer: space)
    small = dict(target="tiny", kinds="self:2,code:1", max_prompts=6, max_new_tokens=8, batch_size=3, threads=1)
    whole = generate_data(DataArgs(out=str(tmp_path / "whole"), **small))
    d = TargetData(tmp_path / "whole")
    kinds = np.concatenate([np.load(tmp_path / "whole" / s / "seqs.npy")[:, 3] for s in whole["shards"]])
    assert set(kinds.tolist()) == {target_data.KIND_IDS["self"], target_data.KIND_IDS["code"]}
    seeds = self_instruct.seed_set("train")
    rows = d.rows(list(range(len(d))), 4096)
    n_self = 0
    for b, kind in enumerate(kinds):
        if kind != target_data.KIND_IDS["self"]:
            continue
        n_self += 1
        prompt = tok.decode(rows["tokens"][b, : int(rows["start"][b])].tolist())
        assert prompt.startswith("<|sys|>be brief\n<|user|>") and prompt.endswith("<|end|>\n<|bot|>")
        assert any(prompt[len("<|sys|>be brief\n<|user|>") :].startswith(s.text) for s in seeds[:6])
    assert n_self >= 1
    out = tmp_path / "resumed"
    generate_data(DataArgs(out=str(out), max_tokens=1, **small))
    resumed = generate_data(DataArgs(out=str(out), resume=True, **small))
    assert resumed["shards"] == whole["shards"] and resumed["cursors"] == whole["cursors"]
    for shard in whole["shards"]:
        for f in ("tokens", "seqs"):
            assert np.array_equal(np.load(out / shard / f"{f}.npy"), np.load(tmp_path / "whole" / shard / f"{f}.npy"))
    assert json.loads((out / "progress.json").read_text())["definition"]["kinds"] == "self:2,code:1"


def test_self_needs_a_chat_template(tmp_path):
    with pytest.raises(ValueError, match="no chat template"):
        generate_data(DataArgs(out=str(tmp_path / "d"), target="tiny", kinds="self:1", max_prompts=1, threads=1))
