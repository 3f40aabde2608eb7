"""DFlash drafter: feature layers, the inference form (KV injection + block
attention through the ops) against the plain training form, packed-block
masks, and checkpoint I/O."""

import dataclasses

import pytest
import torch
from flashspark import data, reference
from flashspark.models import DecoderConfig, DecoderForCausalLM, load_model
from flashspark.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_attention_sdpa,
    block_mask,
    load_dflash,
    packed_blocks,
    save_dflash,
    target_layer_ids,
)

SHIPPED_TARGET = data.ASSETS_DIR / "target"
SHIPPED_DFLASH = data.ASSETS_DIR / "dflash"


def tiny_target(seed=0, vocab=101, layers=3) -> DecoderForCausalLM:
    cfg = DecoderConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=5000.0,
        max_position_embeddings=96,
        torch_dtype="float32",
    )
    m = DecoderForCausalLM(cfg)
    m.init_weights(seed)
    return m.eval()


def tiny_drafter(target, seed=1, layers=2, block_size=4, use_ops=True) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        target.config, num_hidden_layers=layers, block_size=block_size, mask_token_id=1, num_features=3
    )
    d = DFlashDrafter(cfg, target, use_ops=use_ops)
    d.init_weights(seed)
    with torch.no_grad():  # non-trivial norms and larger weights so every piece matters
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.mul_(5)
    return d.eval()


def test_target_layer_ids():
    assert target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as in the DFlash release
    assert target_layer_ids(2, 3) == [1, 0, 0]  # clamped into range for tiny test targets
    assert all(0 <= i < 3 for i in target_layer_ids(3, 5))


def test_parameter_names_exclude_shared_weights():
    d = tiny_drafter(tiny_target(), layers=1)
    names = set(d.state_dict())
    assert "fc.weight" in names and "hidden_norm.weight" in names and "norm.weight" in names
    assert "layers.0.self_attn.q_proj.weight" in names and "layers.0.self_attn.k_norm.weight" in names
    assert "layers.0.mlp.gate_proj.weight" in names and "layers.0.input_layernorm.weight" in names
    assert not any("embed" in n or "lm_head" in n or "cos_sin" in n for n in names)
    assert d.fc.weight.shape == (64, 3 * 64)


@pytest.mark.parametrize("use_ops", [True, False])
def test_inference_form_equals_training_form(use_ops):
    """Inject context features in two rounds, then draft ragged blocks: equal to
    the plain forward over whole sequences with the packed-block mask."""
    torch.manual_seed(0)
    target = tiny_target()
    d = tiny_drafter(target, use_ops=use_ops)
    B, S, g = 3, 40, d.block_size
    tokens = torch.randint(0, 101, (B, S))
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d.config.target_layer_ids).hidden  # [B, S, n, D]
        anchors = torch.tensor([[5, 17], [30, 1], [12, 36]])
        block_tokens, positions = packed_blocks(tokens, anchors, g, 1)
        want = d(hidden, block_tokens, positions, block_mask(anchors, S, g))  # [B, 2g, D]

        for j in range(anchors.shape[1]):
            ctx = anchors[:, j]
            cache = d.new_cache(B, S + g)
            # Round 1: the first half of every context; round 2: the rest (ragged), like the loop.
            for lo, hi in ((torch.zeros_like(ctx), ctx // 2), (ctx // 2, ctx)):
                rows = [(b, t) for b in range(B) for t in range(int(lo[b]), int(hi[b]))]
                if not rows:
                    continue
                bs, ts = torch.tensor(rows).T
                d.inject(cache, hidden[bs, ts], ts, bs)
            got = d.draft_hidden(cache, tokens.gather(1, ctx[:, None])[:, 0], ctx)
            torch.testing.assert_close(got, want[:, j * g : (j + 1) * g], atol=1e-5, rtol=1e-5)
            logits = d.draft_logits(cache, tokens.gather(1, ctx[:, None])[:, 0], ctx)
            assert logits.shape == (B, g - 1, 101) and logits.dtype == torch.float32


def test_block_mask_isolates_blocks():
    """Blocks packed in one forward equal the same blocks run one at a time."""
    target = tiny_target(seed=3)
    d = tiny_drafter(target, seed=4, block_size=5)
    tokens = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[3, 10, 25], [20, 20, 7]])
    with torch.no_grad():
        hidden = target(tokens, hidden_layers=d.config.target_layer_ids).hidden
        bt, pos = packed_blocks(tokens, anchors, 5, 1)
        packed = d(hidden, bt, pos, block_mask(anchors, 30, 5))
        for j in range(3):
            a = anchors[:, j : j + 1]
            bt1, pos1 = packed_blocks(tokens, a, 5, 1)
            one = d(hidden, bt1, pos1, block_mask(a, 30, 5))
            torch.testing.assert_close(packed[:, 5 * j : 5 * j + 5], one, atol=1e-5, rtol=1e-5)
    assert bt[0, 0] == tokens[0, 3] and (bt[0, 1:5] == 1).all() and pos[0, :5].tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("ctx_lens", [[0, 5, 17], [9, 9, 9]])
def test_block_attention_sdpa_matches_oracle(ctx_lens):
    g = torch.Generator().manual_seed(0)
    B, G, Hq, Hkv, D, Smax = 3, 4, 4, 2, 16, 20
    q = torch.randn(B, G, Hq, D, generator=g)
    kc, vc = torch.randn(B, Hkv, Smax, D, generator=g), torch.randn(B, Hkv, Smax, D, generator=g)
    kb, vb = torch.randn(B, G, Hkv, D, generator=g), torch.randn(B, G, Hkv, D, generator=g)
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    want = reference.block_diffusion_attention_reference(q, kc, vc, lens, kb, vb, 0.25)
    torch.testing.assert_close(block_attention_sdpa(q, kc, vc, lens, kb, vb, 0.25), want, atol=1e-5, rtol=1e-5)


def test_head_dtype_runs_the_head_in_that_dtype_at_inference():
    """head_dtype = bf16: inference logits are those of bf16 inputs and weights (close to fp32),
    the weight copy follows in-place updates of the shared head, and with gradients the
    head stays in the hidden dtype (training is unaffected)."""
    target = tiny_target()
    d = tiny_drafter(target)
    h = torch.randn(3, 5, target.config.hidden_size)
    full = d.logits(h)
    d.head_dtype = torch.bfloat16
    with torch.no_grad():
        half = d.logits(h)
        want = torch.nn.functional.linear(h.bfloat16(), target.lm_head.weight.bfloat16()).float()
        assert half.dtype == torch.float32 and torch.equal(half, want) and not torch.equal(half, full)
        torch.testing.assert_close(half, full, atol=0.05 * float(full.abs().max()), rtol=0)
        # A batch of one, sliced as the loop slices block states (computed as one 2-D product).
        h1 = torch.randn(1, 6, target.config.hidden_size)[:, 1:]
        want1 = torch.nn.functional.linear(h1[0].bfloat16(), target.lm_head.weight.bfloat16()).float()
        assert torch.equal(d.logits(h1), want1[None])
        target.lm_head.weight.mul_(2)  # the cached bf16 copy must not go stale
        torch.testing.assert_close(d.logits(h), 2 * half, atol=1e-2 * float(half.abs().max()), rtol=0)
        target.lm_head.weight.div_(2)
    h.requires_grad_(True)
    torch.testing.assert_close(d.logits(h), full)


def test_save_load_round_trip(tmp_path):
    target = tiny_target()
    d = tiny_drafter(target)
    save_dflash(d, tmp_path, dtype=torch.float32)
    from safetensors.torch import load_file

    assert set(load_file(str(tmp_path / "model.safetensors"))) == set(d.state_dict())
    d2 = load_dflash(tmp_path, target)
    assert dataclasses.replace(d2.config, torch_dtype="x") == dataclasses.replace(d.config, torch_dtype="x")
    for (n, a), (_, b) in zip(d.state_dict().items(), d2.state_dict().items()):
        torch.testing.assert_close(a, b, msg=n)
    assert d2.embed_weight is target.model.embed_tokens.weight


def test_load_errors(tmp_path):
    target = tiny_target()
    with pytest.raises(FileNotFoundError):
        load_dflash(tmp_path / "missing", target)
    save_dflash(tiny_drafter(target), tmp_path)
    with pytest.raises(ValueError, match="does not fit"):
        load_dflash(tmp_path, tiny_target(vocab=50))


@pytest.mark.skipif(not (SHIPPED_DFLASH / "model.safetensors").is_file(), reason="no shipped drafter")
def test_shipped_drafter_fits_shipped_target():
    target = load_model(SHIPPED_TARGET, dtype=torch.float32)
    d = load_dflash(SHIPPED_DFLASH, target)
    tok = data.load_tokenizer()
    c = d.config
    assert c.mask_token_id == data.special_token_ids(tok)["mask"]
    assert c.target_layer_ids == target_layer_ids(target.config.num_hidden_layers, len(c.target_layer_ids))
    assert d.fc.weight.dtype == torch.float32 and d.num_parameters() < target.num_parameters()
