"""Every trainer end to end at toy budgets: data, training steps, checkpoint, resume, export, model
card. The drafters chain as in the shipped recipe: DFlash 2 and DSpark start from the DFlash run's
backbone and reuse its generated data."""

import json

import pytest
import torch
from flashspark.models import load_model
from flashspark.models.dflash import load_dflash
from flashspark.models.dflash2 import load_dflash2
from flashspark.models.dspark import load_dspark
from flashspark.train.common import DFlashTrainArgs
from flashspark.train.dflash import train as train_dflash
from flashspark.train.dflash2 import DFlash2TrainArgs
from flashspark.train.dflash2 import train as train_dflash2
from flashspark.train.dspark import DSparkTrainArgs
from flashspark.train.dspark import train as train_dspark
from flashspark.train.target import TrainArgs
from flashspark.train.target import train as train_target
from spec_helpers import SMALL_RUN

pytestmark = pytest.mark.slow

# Small enough for seconds per run: a few generated sequences, a one-layer drafter, no export reserve.
# The budget leaves training time even when generating the 32 sequences takes 4x its usual few
# seconds (a loaded 2-core machine): a run that spends its budget generating trains 0 steps.
# One chunk of 32: generation is time-budgeted, and on a loaded machine a second chunk of 16
# could miss the budget, which would change the pool the summaries are checked against.
TINY = dict(
    SMALL_RUN,
    minutes=0.6,
    gen_frac=0.3,
    max_sequences=32,
    gen_batch=32,
    prompt_tokens=32,
    gen_tokens=64,
    batch_size=4,
    blocks_per_seq=4,
    eval_sequences=4,
    ckpt_every_min=0.05,
)


def summary_of(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def check_summary(s: dict, steps_at_least: int = 1) -> None:
    assert s["step"] >= steps_at_least
    assert 0 < s["train_minutes"] <= s["wall_minutes"]
    assert s["history"] and all("tau" in r for r in s["history"])
    assert (s["sequences"], s["seq_len"]) == (32, 96)  # the pool: one chunk of 32, 32 + 64 tokens


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    a = DFlashTrainArgs(out=str(root / "run"), export=str(root / "export"), **TINY)
    train_dflash(a)
    return root, a


def test_dflash_trains_exports_and_resumes(dflash_run):
    root, a = dflash_run
    first = summary_of(root / "run")
    check_summary(first)
    assert (root / "export" / "MODEL_CARD.md").is_file()
    target = load_model(a.target, dtype=torch.float32)
    assert load_dflash(root / "export", target).config.num_hidden_layers == 1
    # --resume continues the step count and adds this session's wall time to the earlier one's
    again = DFlashTrainArgs(**{**a.__dict__, "resume": True, "minutes": 1.0})
    train_dflash(again)
    second = summary_of(root / "run")
    assert second["step"] > first["step"]
    assert second["wall_minutes"] > first["wall_minutes"]
    assert second["history"][: len(first["history"])] == first["history"]
    # the model card lists every session's command line
    assert second["commands"] == first["commands"] + [again.command] and len(second["commands"]) == 2


@pytest.mark.parametrize(
    "args_cls, train, load",
    [(DFlash2TrainArgs, train_dflash2, load_dflash2), (DSparkTrainArgs, train_dspark, load_dspark)],
)
def test_derived_drafters_start_from_the_dflash_run(dflash_run, tmp_path, args_cls, train, load):
    root, base = dflash_run
    # DSpark with the Top-K bound of the TV (the exact TV, DeepSpec's, is the default)
    extra = (
        dict(selector_top_k=4, selector_rank=8)
        if args_cls is DFlash2TrainArgs
        else dict(calib_sequences=4, exact_tv=False)
    )
    a = args_cls(
        out=str(tmp_path / "run"),
        export=str(tmp_path / "export"),
        init_from=str(root / "export"),
        data_from=base.out,
        **{**TINY, "minutes": 0.3},  # on the fixture's data: no generation in the budget
        **extra,
    )
    train(a)
    check_summary(summary_of(tmp_path / "run"))
    assert "reusing 32 generated sequences" in (tmp_path / "run" / "train.log.txt").read_text()
    assert not (tmp_path / "run" / "data").exists() or not list((tmp_path / "run" / "data").glob("chunk_*"))
    target = load_model(a.target, dtype=torch.float32)
    assert load(tmp_path / "export", target).config.block_size == 8


def test_derived_drafter_rejects_a_backbone_of_another_shape(dflash_run, tmp_path):
    root, base = dflash_run
    a = DFlash2TrainArgs(
        out=str(tmp_path / "run"), export=str(tmp_path / "export"), init_from=str(root / "export"), data_from=base.out
    )
    a.__dict__.update({**TINY, "layers": 2})
    with pytest.raises(ValueError, match="has block size 8 and 1 layers; this run wants 8 and 2"):
        train_dflash2(a)


def test_target_trains_and_exports(tmp_path):
    a = TrainArgs(
        out=str(tmp_path / "run"),
        export=str(tmp_path / "export"),
        minutes=0.1,
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=128,
        eval_every_min=0.05,
        eval_windows=4,
        seq_len=64,
        batch_size=4,
    )
    train_target(a)
    s = summary_of(tmp_path / "run")
    assert s["step"] >= 1 and s["config"]["hidden_size"] == 64 and s["config"]["num_attention_heads"] == 4
    model = load_model(tmp_path / "export", dtype=torch.float32)
    assert model.config.num_hidden_layers == 1


def test_model_card_commands():
    """Every session's command line in order; a run recorded before sessions were kept: its one."""
    from flashspark.train.common import command_lines

    assert command_lines({"commands": ["a --minutes 5", "a --resume"], "args": {}}, "d") == "a --minutes 5\na --resume"
    assert command_lines({"args": {"command": "b"}}, "d") == "b"
    assert command_lines({"commands": [""], "args": {"command": ""}}, "d") == "d"
