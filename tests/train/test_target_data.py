"""`train data` on the tiny target: what it stores is what the target computes (tokens of plain
greedy decoding, labels, feature-layer hidden states, Top-K), a run interrupted and resumed
equals an uninterrupted one shard for shard, settings cannot change under --resume, and the
drafter trainers read the data (anchors in each row's continuation, ragged held-out sets, a
shared backbone exported once)."""

import copy
import fcntl
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from flashspark.decoding.plain import generate
from flashspark.models import catalog
from flashspark.models.dflash import load_dflash, target_layer_ids
from flashspark.models.dflash2 import load_dflash2
from flashspark.models.dspark import load_dspark
from flashspark.models.io import weights_fingerprint
from flashspark.train.common import DFlashTrainArgs
from flashspark.train.dflash import train as train_dflash
from flashspark.train.dflash2 import DFlash2TrainArgs
from flashspark.train.dflash2 import train as train_dflash2
from flashspark.train.dspark import DSparkTrainArgs
from flashspark.train.dspark import train as train_dspark
from flashspark.train.target_data import DataArgs, TargetData, generate_data, sample_row_anchors
from spec_helpers import SMALL_RUN

pytestmark = pytest.mark.usefixtures("one_thread")

# A writer in another process: takes the lock the way `writer_lock` does, says so, holds it until stdin closes.
HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("locked", flush=True)
sys.stdin.read()
"""
SMALL = dict(target="tiny", kinds="code:2,prose:1", max_prompts=4, max_new_tokens=10, batch_size=3, threads=1)


@pytest.fixture(scope="module")
def tiny():
    return catalog.load_target(catalog.resolve_target("tiny"))


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "d"
    generate_data(DataArgs(out=str(out), **SMALL))
    return out


def test_stored_data_is_what_the_target_computes(generated, tiny):
    d = TargetData(generated)
    progress = json.loads((generated / "progress.json").read_text())
    assert progress["complete"] and progress["sequences"] == len(d) == 8  # 4 code + 4 prose prompts
    assert d.shards[0]["tokens"].dtype == np.uint16
    layers = target_layer_ids(tiny.config.num_hidden_layers)
    eos = catalog.eos_token_id(tiny, catalog.target_tokenizer(catalog.resolve_target("tiny")))
    rows = d.rows(list(range(len(d))), 4096)
    for b in range(len(d)):
        n, p = int(rows["length"][b]), int(rows["start"][b])
        tokens = rows["tokens"][b, :n]
        want, _ = generate(tiny, [tokens[:p].tolist()], max_new_tokens=10, eos_id=eos)
        assert tokens[p:].tolist() == want[0]
        with torch.no_grad():
            out = tiny(tokens[None, :-1], hidden_layers=layers)
        assert torch.allclose(rows["features"][b, : n - 1].float(), out.hidden[0].float(), atol=0.05, rtol=0.02)
        assert rows["labels"][b, p:n].tolist() == out.logits[0, p - 1 :].argmax(-1).tolist()
        assert bool((rows["labels"][b, :p] == -1).all())
        logp = torch.log_softmax(out.logits[0, p - 1 :], -1)
        top = logp.topk(32, -1)
        assert torch.equal(rows["topk_ids"][b, p:n], top.indices)
        assert torch.allclose(rows["topk_logp"][b, p:n].float(), top.values, atol=1e-2)


def test_resume_is_exact(generated, tmp_path):
    """Stopped after its first shard (--max-tokens), resumed: the same shards as one run."""
    out = tmp_path / "d"
    first = generate_data(DataArgs(out=str(out), max_tokens=1, **SMALL))
    assert first["shards"] == ["shard_00000"] and not first["complete"]
    with pytest.raises(ValueError, match="pass --resume"):
        generate_data(DataArgs(out=str(out), **SMALL))
    with pytest.raises(ValueError, match="other settings .*max_new_tokens"):
        generate_data(DataArgs(out=str(out), resume=True, **{**SMALL, "max_new_tokens": 11}))
    # The kinds' order sets the interleaving: another order is other data; spacing and a
    # share left at its default are not.
    with pytest.raises(ValueError, match="other settings .*kinds"):
        generate_data(DataArgs(out=str(out), resume=True, **{**SMALL, "kinds": "prose:1,code:2"}))
    # A directory written before weight fingerprints (and with its kinds as typed) resumes, and
    # does not claim this target's weights made its earlier shards.
    progress = json.loads((out / "progress.json").read_text())
    del progress["definition"]["target_weights"]
    progress["definition"]["kinds"] = "code:2, prose"
    (out / "progress.json").write_text(json.dumps(progress))
    resumed = generate_data(DataArgs(out=str(out), resume=True, **{**SMALL, "kinds": " code:2, prose"}))
    assert "target_weights" not in resumed["definition"] and resumed["definition"]["kinds"] == "code:2,prose:1"
    whole = json.loads((generated / "progress.json").read_text())
    assert resumed["shards"] == whole["shards"] and resumed["cursors"] == whole["cursors"]
    for shard in whole["shards"]:
        for f in ("tokens", "labels", "features", "topk_ids", "topk_logp", "seqs"):
            assert np.array_equal(np.load(out / shard / f"{f}.npy"), np.load(generated / shard / f"{f}.npy"))


def test_data_is_bound_to_the_weights_of_its_target(generated, tiny):
    """The fingerprint ignores the dtype a target was loaded in, and tells a retrained target of
    the same shape from the one that generated the data: training on it is refused."""
    layers = target_layer_ids(tiny.config.num_hidden_layers)
    d = TargetData(generated)
    assert d.definition["target_weights"] == weights_fingerprint(tiny)
    # An fp32 checkpoint and its bf16 copy: noise below bf16's precision (the tiny checkpoint is bf16,
    # so its fp32 load alone would not tell a fingerprint that skipped the rounding).
    fine = copy.deepcopy(tiny).float()
    with torch.no_grad():
        for w in fine.parameters():
            w += w * 2.0**-12
    assert weights_fingerprint(fine) == weights_fingerprint(copy.deepcopy(fine).bfloat16())
    assert weights_fingerprint(fine) == weights_fingerprint(tiny)
    d.check_for(tiny, layers)
    other = copy.deepcopy(tiny)
    with torch.no_grad():
        other.model.layers[-1].mlp.down_proj.weight[0, 0] += 1.0  # one value of millions, at a sampled index
    assert weights_fingerprint(other) != weights_fingerprint(tiny)
    with pytest.raises(ValueError, match="same shape but other weights"):
        d.check_for(other, layers)
    with pytest.raises(ValueError, match="features of layers"):
        d.check_for(tiny, layers[:-1])


def test_anchors_and_held_out_sets(generated):
    d = TargetData(generated)
    rows = d.rows([0, 1, 2], window=20)
    assert rows["tokens"].shape[1] <= 20 and rows["features"].shape[1] == rows["tokens"].shape[1] - 1
    full = d.index[[0, 1, 2], 2]
    assert rows["cut"].tolist() == [max(0, int(n) - 20) for n in full]  # what a target run on the row misses
    assert d.rows([0, 1, 2], window=4096)["cut"].tolist() == [0, 0, 0]
    an = sample_row_anchors(rows["start"], rows["length"], 50, 4, torch.Generator().manual_seed(0))
    assert bool((an >= rows["start"][:, None]).all() and (an + 4 <= rows["length"][:, None]).all())
    ev = d.eval_set(8, 4096, anchors_per_row=6)
    assert ev["anchors"].shape == (len(ev["start"]), 6)
    for b in range(len(ev["start"])):
        counted = ev["anchors"][b][ev["valid"][b]].tolist()
        assert counted == sorted(set(counted))  # each anchor once, in order
        assert counted[0] == ev["start"][b] and counted[-1] == ev["length"][b] - 8


def test_windows_and_held_out_sets_that_cannot_be_built_are_refused(generated):
    """A window shorter than a continuation would start past the prompt (negative anchors deep
    in training); a held-out set with no block to score would be empty."""
    d = TargetData(generated)
    longest = int((d.index[:, 2] - d.index[:, 3]).max())  # generated tokens of the longest continuation
    with pytest.raises(ValueError, match=f"--window greater than {longest}"):
        d.rows([int((d.index[:, 2] - d.index[:, 3]).argmax())], window=longest)
    d.rows([int((d.index[:, 2] - d.index[:, 3]).argmax())], window=longest + 1)
    with pytest.raises(ValueError, match="no sequence with a block of 1000"):
        d.eval_set(1000, 4096)
    with pytest.raises(ValueError, match="among its first 0"):
        d.eval_set(4, 4096, limit=0)


@pytest.mark.slow
def test_drafters_train_on_the_data_with_one_shared_backbone(generated, tmp_path):
    """DFlash, then DFlash 2 and DSpark on its frozen backbone: each trains and exports; the
    derived drafters' files hold only their own parts and load with the backbone's weights."""
    common = dict(
        SMALL_RUN,
        target="tiny",
        data_from=str(generated),
        eval_from=str(generated),
        minutes=0.05,
        threads=1,
        intermediate_size=64,
        batch_size=2,
        blocks_per_seq=2,
        block_size=4,
    )
    base = tmp_path / "dflash"
    # the backbone's head over the batch's stored Top-K plus uniform draws (--head-negatives)
    train_dflash(DFlashTrainArgs(out=str(tmp_path / "r1"), export=str(base), head_negatives=16, **common))
    derived = dict(init_from=str(base), share_backbone=True, **common)
    train_dflash2(
        DFlash2TrainArgs(out=str(tmp_path / "r2"), export=str(tmp_path / "dflash2"), selector_rank=4, **derived)
    )
    # DSpark in DeepSpec's layout starts from the backbone and fine-tunes it (its slots move by
    # one), so it cannot share it frozen; in DFlash's layout it can.
    with pytest.raises(ValueError, match="share-backbone"):
        train_dspark(DSparkTrainArgs(out=str(tmp_path / "r3"), export=str(tmp_path / "x"), **derived))
    train_dspark(
        DSparkTrainArgs(
            out=str(tmp_path / "r4"),
            export=str(tmp_path / "dspark"),
            markov_rank=4,
            calib_from=str(generated),
            **(derived | {"share_backbone": False}),
        )
    )
    tiny = catalog.load_target(catalog.resolve_target("tiny"))
    backbone = load_dflash(base, tiny).state_dict()
    # z-lab's format: self-contained, the frozen backbone saved with the convs and the selector.
    assert json.loads((tmp_path / "dflash2" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    state = load_dflash2(tmp_path / "dflash2", tiny).state_dict()
    for k, v in backbone.items():
        assert torch.equal(state[k], v), k
    spark = load_dspark(tmp_path / "dspark", tiny)  # DeepSpec's format: self-contained, γ drafts
    cfg = json.loads((tmp_path / "dspark" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["sample_from_anchor"] and "backbone" not in cfg
    assert spark.num_drafts == 4 and set(backbone) < set(spark.state_dict())


def test_one_writer_per_directory(tmp_path):
    """A live writer's lock refuses a second run, naming the writer; a dead writer's lock file
    (no lock held) is taken over, and a finished run leaves the directory unlocked."""
    out = tmp_path / "d"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out / ".lock")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline().strip() == b"locked"
        with pytest.raises(ValueError, match=f"being written by process {holder.pid}"):
            generate_data(DataArgs(out=str(out), max_tokens=1, **SMALL))
    finally:
        holder.communicate(b"")  # it exits: the kernel drops its lock, the file stays
    assert (out / ".lock").read_text() == str(holder.pid)
    assert generate_data(DataArgs(out=str(out), max_tokens=1, **SMALL))["shards"] == ["shard_00000"]
    with open(out / ".lock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again


def test_fingerprint_of_a_tensor_past_fp32_indices():
    """SmolLM2's embedding holds 28,311,552 values: positions spaced in fp32 rounded the last one
    past the end (IndexError while generating its data). Spaced in integers, the last value is read."""
    big = torch.nn.Module()
    big.w = torch.nn.Parameter(torch.zeros(2**24 + 3), requires_grad=False)
    a = weights_fingerprint(big)
    with torch.no_grad():
        big.w[-1] = 1.0
    assert weights_fingerprint(big) != a
