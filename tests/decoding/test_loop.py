"""The speculative loop is lossless: greedy output equals plain greedy decoding
token for token; sampled output follows the target's distribution (and a
planted bug is caught). Also the Philox sampling helpers and the CLI glue."""

import argparse

import pytest
import torch
import torch.nn.functional as F
from flashspark import data, reference
from flashspark.decoding import speculative_generate
from flashspark.decoding.plain import generate
from flashspark.models import dflash as dflash_model
from flashspark.models import load_model
from flashspark.models.dflash import DFlashConfig, DFlashDrafter, load_dflash
from flashspark.ops import sampling
from flashspark.scheduling import FixedK, Scheduler
from spec_helpers import chi_square_ok, exact_joint, prompts_of, spec_joint, tiny_drafter, tiny_target

SHIPPED_TARGET = data.ASSETS_DIR / "target"
SHIPPED_DFLASH = data.ASSETS_DIR / "dflash"
HAVE_DFLASH = (SHIPPED_DFLASH / "model.safetensors").is_file()


class OracleDrafter(DFlashDrafter):
    """Drafts the known greedy continuation, wrong at a fixed pattern of
    positions: exercises long accepted prefixes, rejections at every block
    position and fully accepted blocks (bonus tokens)."""

    def __init__(self, base: DFlashDrafter, sequences: torch.Tensor, from_anchor: bool = False):
        super().__init__(base.config, use_ops=base.use_ops)
        self.load_state_dict(base.state_dict())
        self._shared = base._shared
        self.sequences = sequences  # [B, L]: prompt + greedy continuation, padded
        self.from_anchor = from_anchor  # DeepSpec's layout: γ drafts per block, not γ - 1

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.from_anchor else self.block_size - 1

    def draft_logits(self, cache, anchor, ctx_lens, num_drafts=None):
        V = self.config.vocab_size
        pos = ctx_lens[:, None] + torch.arange(1, (num_drafts or self.num_drafts) + 1)
        truth = self.sequences.gather(1, pos.clamp(max=self.sequences.shape[1] - 1))
        wrong = (pos * 7 + torch.arange(len(pos))[:, None] * 3) % 11 == 0
        return F.one_hot(torch.where(wrong, (truth + 1) % V, truth), V).float() * 10


@pytest.mark.parametrize("k", [None, 2, 0])
def test_greedy_equals_plain_tiny_random(k):
    target = tiny_target()
    drafter = tiny_drafter(target)
    prompts = prompts_of([3, 11, 1, 7], 48)
    want, _ = generate(target, prompts, max_new_tokens=30)
    got, st = speculative_generate(
        target, drafter, prompts, max_new_tokens=30, scheduler=None if k is None else FixedK(k)
    )
    assert got == want
    assert (
        st["new_tokens"] == 120 and st["tau"] >= 1.0 and len(st["acceptance_per_position"]) == (4 if k is None else k)
    )


@pytest.mark.parametrize("from_anchor", [False, True], ids=["dflash_slots", "sample_from_anchor"])
def test_greedy_equals_plain_high_acceptance_and_eos(from_anchor):
    """Long accepted prefixes and requests finishing apart (a finished request is written past its
    end while others run: with γ drafts per block that once overran the output buffer)."""
    target = tiny_target(seed=2)
    base = tiny_drafter(target, block_size=6)
    prompts = prompts_of([5, 2, 9, 4, 13], 48, seed=1)
    want, _ = generate(target, prompts, max_new_tokens=40)
    seqs = torch.zeros(len(prompts), 13 + 40 + 8, dtype=torch.int64)
    for b, (p, w) in enumerate(zip(prompts, want)):
        seqs[b, : len(p) + 40] = torch.tensor(p + w)
    drafter = OracleDrafter(base, seqs, from_anchor)
    got, st = speculative_generate(target, drafter, prompts, max_new_tokens=40)
    assert got == want
    assert st["tau"] > 3.0 and st["acceptance_per_position"][0] > 0.8
    # EOS: stop right after a token that occurs in the middle of some outputs.
    eos = want[2][17]
    want_eos, _ = generate(target, prompts, max_new_tokens=40, eos_id=eos)
    got_eos, st_eos = speculative_generate(target, drafter, prompts, max_new_tokens=40, eos_id=eos)
    assert got_eos == want_eos and any(len(w) < 40 for w in want_eos)
    # The loop runs until its last request finishes: one iteration per step of the longest request,
    # more than the mean steps per request once requests finish apart.
    steps = st_eos["steps_per_request"]
    for o, t, n in zip(got_eos, st_eos["tau_per_request"], steps):
        # a request whose first token (from the prefill) is EOS takes no step and has no τ
        assert (t is None and len(o) == 1) if n == 0 else round(len(o) / t) == n
    assert sum(steps) == st_eos["steps"]
    assert abs(st_eos["iterations"] - max(steps)) <= 1  # a last step may be cut short by max_new_tokens / EOS
    assert st_eos["iterations"] > st_eos["steps"] / len(prompts)
    # A request whose first token (from the prefill) is EOS takes no step: it has no τ, not τ = 0.
    first = want[0][0]
    got_first, st_first = speculative_generate(target, drafter, prompts, max_new_tokens=40, eos_id=first)
    assert got_first[0] == [first] and st_first["steps_per_request"][0] == 0
    assert st_first["tau_per_request"][0] is None
    assert all(t is None or t >= 1.0 for t in st_first["tau_per_request"])


class SplitOracle(OracleDrafter):
    """Request 0's drafts are always right (every step emits K + 1 tokens), the others' first
    draft always wrong (one token a step): request 0 finishes long before the rest."""

    def draft_logits(self, cache, anchor, ctx_lens, num_drafts=None):
        V = self.config.vocab_size
        pos = ctx_lens[:, None] + torch.arange(1, (num_drafts or self.num_drafts) + 1)
        truth = self.sequences.gather(1, pos.clamp(max=self.sequences.shape[1] - 1))
        wrong = torch.zeros_like(truth, dtype=torch.bool)
        wrong[1:, 0] = True
        return F.one_hot(torch.where(wrong, (truth + 1) % V, truth), V).float() * 10


@pytest.mark.parametrize("from_anchor", [False, True], ids=["dflash_slots", "sample_from_anchor"])
def test_a_finished_request_stays_inside_the_output_buffer(from_anchor):
    """A request that overruns max_new_tokens by K on its last step and then sits finished while
    another request runs on: its row is still written each step, K + 1 columns past its end."""
    target = tiny_target(seed=2)
    base = tiny_drafter(target, block_size=6)
    n = 6 if from_anchor else 5
    max_new = 2 + 3 * (n + 1)  # request 0: 1 + 3 (n + 1) tokens after 3 steps, then one more full step
    prompts = prompts_of([5, 4], 48, seed=1)
    longer, _ = generate(target, prompts, max_new_tokens=max_new + 2 * n)  # right drafts past the end too
    seqs = torch.zeros(2, 5 + max_new + 4 * n, dtype=torch.int64)
    for b, (p, w) in enumerate(zip(prompts, longer)):
        seqs[b, : len(p) + len(w)] = torch.tensor(p + w)
    got, st = speculative_generate(target, SplitOracle(base, seqs, from_anchor), prompts, max_new_tokens=max_new)
    assert got == [w[:max_new] for w in longer] and st["steps_per_request"] == [4, max_new - 1]


class RaggedK(Scheduler):
    """Request b verifies (b + step) % 4 drafts: exercises the ragged verify path."""

    max_spec_len = 4

    def __init__(self):
        self.step = 0

    def plan(self, state):
        self.step += 1
        k = (torch.arange(len(state.active)) + self.step) % 5
        return k * state.active


def test_greedy_equals_plain_ragged_scheduler():
    target = tiny_target(seed=3)
    prompts = prompts_of([6, 1, 12], 48, seed=2)
    want, _ = generate(target, prompts, max_new_tokens=25)
    seqs = torch.zeros(3, 12 + 25 + 8, dtype=torch.int64)
    for b, (p, w) in enumerate(zip(prompts, want)):
        seqs[b, : len(p) + 25] = torch.tensor(p + w)
    got, st = speculative_generate(
        target, OracleDrafter(tiny_drafter(target), seqs), prompts, max_new_tokens=25, scheduler=RaggedK()
    )
    assert got == want and st["tau"] > 1.5


def test_greedy_equals_plain_shipped_target():
    target = load_model(SHIPPED_TARGET, dtype=torch.float32)
    if HAVE_DFLASH:
        drafter = load_dflash(SHIPPED_DFLASH, target)
    else:
        cfg = DFlashConfig.for_target(target.config, num_hidden_layers=1)
        drafter = DFlashDrafter(cfg, target)
        drafter.init_weights(0)
    tok = data.load_tokenizer()
    prompts = [p[:n] for p, n in zip(data.heldout_prompts("code", 4, 48, tok), (48, 17, 33, 5))]
    want, _ = generate(target, prompts, max_new_tokens=40)
    got, st = speculative_generate(target, drafter, prompts, max_new_tokens=40)
    assert got == want
    if HAVE_DFLASH:
        assert st["tau"] > 1.5  # the shipped drafter actually drafts


# ----------------------------------------------------------- sampled decoding
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_distribution_matches_target(temperature):
    target = tiny_target(vocab=8, layers=1, seed=5, scale=3.0)
    drafter = tiny_drafter(target, block_size=4, seed=6, scale=8.0)
    prompt = [3, 5, 2]
    p = exact_joint(target, prompt, 3, temperature)
    counts = spec_joint(target, drafter, prompt, 3, temperature, samples=12000)
    assert chi_square_ok(counts, p)
    # Per-position marginals: total variation well inside the sampling noise bound.
    emp, exact = (counts / counts.sum()).view(8, 8, 8), p.double().view(8, 8, 8)
    for dims in ((1, 2), (0, 2), (0, 1)):
        assert 0.5 * float((emp.sum(dims) - exact.sum(dims)).abs().sum()) < 0.03


def test_sampled_distribution_catches_planted_bug(monkeypatch):
    """Give verify q at temperature 1 while drafts are sampled at 0.6 (a
    realistic bug): the test above must fail. (Omitting q altogether is NOT a
    bug in distribution: one-hot verification is lossless for any draft
    sampler, it only accepts less.)"""
    target = tiny_target(vocab=8, layers=1, seed=5, scale=3.0)
    drafter = tiny_drafter(target, block_size=4, seed=6, scale=8.0)
    real = sampling.sample_logits

    def buggy(logits, temperature, seeds, positions, purpose, want_probs=False):
        tokens, probs = real(logits, temperature, seeds, positions, purpose, want_probs)
        return tokens, (torch.softmax(logits, -1) if probs is not None else None)

    monkeypatch.setattr(dflash_model, "sample_logits", buggy)  # where DFlash's propose samples its drafts
    prompt = [3, 5, 2]
    p = exact_joint(target, prompt, 3, 0.6)
    counts = spec_joint(target, drafter, prompt, 3, 0.6, samples=12000)
    assert not chi_square_ok(counts, p)


def test_sampled_seeded_and_batch_independent():
    target = tiny_target(seed=7, scale=3.0)
    drafter = tiny_drafter(target)
    prompts = prompts_of([4, 9], 48, seed=3)
    a, _ = speculative_generate(target, drafter, prompts, max_new_tokens=20, temperature=1.0, seed=11)
    b, _ = speculative_generate(target, drafter, prompts, max_new_tokens=20, temperature=1.0, seed=11)
    c, _ = speculative_generate(target, drafter, prompts[:1], max_new_tokens=20, temperature=1.0, seed=11)
    d, _ = speculative_generate(target, drafter, prompts, max_new_tokens=20, temperature=1.0, seed=12)
    assert a == b and c[0] == a[0] and d != a


# ----------------------------------------------------------- sampling helpers
def test_philox_uniform_matches_reference_stream():
    seeds = torch.tensor([0, 7, (3 << 32) + 5])
    positions = torch.tensor([[0, 1, 2**33 + 4], [5, 6, 7], [9, 10, 11]])
    got = sampling.philox_uniform(seeds, positions, reference.PURPOSE_DRAFT)
    for b in range(3):
        for j in range(3):
            want = reference.uniform_open01(
                reference.philox_u32(int(seeds[b]), int(positions[b, j]), reference.PURPOSE_DRAFT, 0)
            )
            assert float(got[b, j]) == float(want)


def test_sample_probs_inverse_cdf():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.2, 0.0, 0.0, 0.8]])
    u = torch.tensor([[0.1], [0.3]]).expand(2, 1)
    assert sampling.sample_probs(probs[:, None], u).tolist() == [[1], [3]]
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sampling.sample_probs(probs[1].expand(20000, 4), u), minlength=4)
    assert counts[1] == counts[2] == 0 and abs(counts[0] / 20000 - 0.2) < 0.02


# ----------------------------------------------------------------- CLI glue
def test_cli_glue_parses_and_generates(capsys, tmp_path):
    from flashspark.cli import generate as spec_cli
    from flashspark.cli import train as train_cli

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    train_sub = sub.add_parser("train").add_subparsers(dest="what")
    train_cli.add_train(train_sub)
    args = parser.parse_args(["train", "dflash", "--minutes", "5", "--layers", "1", "--resume"])
    assert args.minutes == 5 and args.layers == 1 and args.resume and callable(args.func)

    gen = sub.add_parser("generate")
    gen.add_argument("--method", default="ar")
    gen.add_argument("--prompt")
    gen.add_argument("--prompts-file")
    for flag, default in (
        ("--model", None),
        ("--tokenizer", None),
        ("--max-new-tokens", 12),
        ("--temperature", 0.0),
        ("--top-p", 1.0),
        ("--seed", 0),
        ("--batch-size", None),
        ("--device", "cpu"),
        ("--threads", None),
    ):
        gen.add_argument(flag, default=default, type=type(default) if default is not None else None)
    gen.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None)
    gen.add_argument("--dtype", default=None)
    spec_cli.add_generate_spec_args(gen)
    drafter_dir = SHIPPED_DFLASH
    if not HAVE_DFLASH:  # a random drafter for the shipped target
        from flashspark.models.dflash import save_dflash

        target = load_model(SHIPPED_TARGET, dtype=torch.float32)
        d = DFlashDrafter(DFlashConfig.for_target(target.config, num_hidden_layers=1), target)
        d.init_weights(0)
        save_dflash(d, tmp_path / "dflash")
        drafter_dir = tmp_path / "dflash"
    args = parser.parse_args(
        [
            "generate",
            "--method",
            "dflash",
            "--prompt",
            "def f(x):\n    return",
            "--k",
            "3",
            "--drafter",
            str(drafter_dir),
        ]
    )
    assert spec_cli.run_generate_spec(args, "dflash") == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("def f(x):\n    return")
    assert "tau" in cap.err and "tokens/s" in cap.err and "speedup" in cap.err and "identical" in cap.err
    args.top_p = 0.9
    with pytest.raises(ValueError, match="top-p"):
        spec_cli.run_generate_spec(args, "dflash")
