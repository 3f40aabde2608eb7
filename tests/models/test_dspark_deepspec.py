"""DSpark checkpoints in DeepSpec's format (deepseek-ai/DeepSpec, the DSpark paper's reference).

The tests write checkpoints as DeepSpec writes them (random weights, odd sizes): a Qwen3
config.json with `architectures` Qwen3DSparkModel and the DSpark keys (and DeepSpec's own extra
keys), a model.safetensors that also carries the target's `embed_tokens` / `lm_head` copies.
flashspark loads them and must draft what `deepspec_block` drafts: an independent PyTorch
implementation of DeepSpec's documented forward, written here from its semantics (not from
our model code):

* context c = hidden_norm(fc(concat of the target layers' outputs at positions < a));
* block inputs embed([x_a, MASK × (γ-1)]) at positions a .. a + γ - 1; every layer is a Qwen3
  pre-norm layer whose queries come from the block and whose keys / values are
  k_norm(k_proj([c ; x])) and v_proj([c ; x]) (the context unnormed), RoPE at absolute
  positions, no mask;
* slot k (the anchor's included) predicts a + k + 1: U_k = lm_head(norm(h_k)),
  logits_k = U_k + W2(W1[x_prev]), x_prev the anchor then each greedy draft;
  confidence σ(proj([norm(h_k) ; W1[x_prev]])).

Loading the same checkpoint with the other layout flag must change the drafts (a loader
that read the layout wrong is caught), and the head variants DeepSpec has but flashspark
does not implement are refused by name.
"""

import json
import math

import pytest
import torch
from flashspark.models import DecoderConfig, DecoderForCausalLM
from flashspark.models.dspark import load_dspark
from safetensors.torch import save_file

pytestmark = pytest.mark.usefixtures("one_thread")


def make_target(V=97, H=48, heads=3, kv=1, head_dim=16, layers=4, seed=0) -> DecoderForCausalLM:
    cfg = DecoderConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=80,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    m = DecoderForCausalLM(cfg)
    m.init_weights(seed)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(10)
    return m.eval()


def deepspec_checkpoint(path, target, block_size=5, rank=7, draft_layers=2, layer_ids=(0, 2), seed=1, **extra):
    """A DeepSpec-format DSpark directory with random weights for `target`; returns its tensors."""
    c = target.config
    H, hd, nq, nkv, inter = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, 72
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    with_markov = extra.get("confidence_head_with_markov", True)
    t = {
        "embed_tokens.weight": target.model.embed_tokens.weight.detach().clone(),
        "lm_head.weight": target.lm_head.weight.detach().clone(),
        "fc.weight": w(H, len(layer_ids) * H),
        "hidden_norm.weight": 1 + w(H, std=0.1),
        "norm.weight": 1 + w(H, std=0.1),
        "markov_head.markov_w1.weight": w(c.vocab_size, rank, std=1.0),
        "markov_head.markov_w2.weight": w(c.vocab_size, rank, std=1.0),
        "confidence_head.proj.weight": w(1, H + rank if with_markov else H, std=0.3),
        "confidence_head.proj.bias": w(1, std=0.3),
    }
    for i in range(draft_layers):
        p = f"layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": w(nq * hd, H),
            p + "self_attn.k_proj.weight": w(nkv * hd, H),
            p + "self_attn.v_proj.weight": w(nkv * hd, H),
            p + "self_attn.o_proj.weight": w(H, nq * hd),
            p + "self_attn.q_norm.weight": 1 + w(hd, std=0.1),
            p + "self_attn.k_norm.weight": 1 + w(hd, std=0.1),
            p + "mlp.gate_proj.weight": w(inter, H),
            p + "mlp.up_proj.weight": w(inter, H),
            p + "mlp.down_proj.weight": w(H, inter),
            p + "input_layernorm.weight": 1 + w(H, std=0.1),
            p + "post_attention_layernorm.weight": 1 + w(H, std=0.1),
        }
    config = {  # as DeepSpec's build_draft_config writes it: the target's Qwen3 config, overridden
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "vocab_size": c.vocab_size,
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "num_hidden_layers": draft_layers,
        "num_target_layers": c.num_hidden_layers,
        "layer_types": ["full_attention"] * draft_layers,
        "block_size": block_size,
        "target_layer_ids": list(layer_ids),
        "mask_token_id": 5,
        "num_anchors": 512,
        "markov_rank": rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "_attn_implementation": "sdpa",
    } | extra
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return t, config


# ----------------------------------------------------------------- the reference, from DeepSpec's semantics
def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    """Rotate-half RoPE of x [..., S, heads, d] at positions pos [S]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None].float(), torch.cat([ang.sin()] * 2, -1)[:, None].float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def deepspec_block(t, config, target_hidden, tokens, a):
    """Greedy drafts and confidences of one block at anchor index a: (drafts [γ], conf [γ])."""
    eps, theta, g = config["rms_norm_eps"], config["rope_theta"], config["block_size"]
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    ctx = rms(target_hidden[:a].flatten(1) @ t["fc.weight"].T, t["hidden_norm.weight"], eps)  # [a, H]
    block = torch.tensor([int(tokens[a])] + [config["mask_token_id"]] * (g - 1))
    h = t["embed_tokens.weight"][block]
    pos_c, pos_b = torch.arange(a), torch.arange(a, a + g)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        x = rms(h, t[p + "input_layernorm.weight"], eps)
        q = rms((x @ t[p + "self_attn.q_proj.weight"].T).view(g, nq, hd), t[p + "self_attn.q_norm.weight"], eps)
        kv_in = torch.cat([ctx, x])
        k = rms((kv_in @ t[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), t[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = rope(q, pos_b, theta), rope(k, torch.cat([pos_c, pos_b]), theta)
        k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), -1)
        h = h + torch.einsum("hqk,khd->qhd", att, v).reshape(g, nq * hd) @ t[p + "self_attn.o_proj.weight"].T
        x = rms(h, t[p + "post_attention_layernorm.weight"], eps)
        mlp = torch.nn.functional.silu(x @ t[p + "mlp.gate_proj.weight"].T) * (x @ t[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ t[p + "mlp.down_proj.weight"].T
    h = rms(h, t["norm.weight"], eps)
    base = h @ t["lm_head.weight"].T
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    proj_w, proj_b = t["confidence_head.proj.weight"][0], t["confidence_head.proj.bias"][0]
    prev, drafts, conf = int(tokens[a]), [], []
    for k in range(g):  # sample_from_anchor: every slot drafts, slot k the token at a + k + 1
        e = w1[prev]
        feats = torch.cat([h[k], e]) if proj_w.numel() > h.shape[-1] else h[k]
        conf.append(torch.sigmoid(feats @ proj_w + proj_b))
        prev = int((base[k] + w2 @ e).argmax())
        drafts.append(prev)
    return torch.tensor(drafts), torch.stack(conf)


# ----------------------------------------------------------------- flashspark against it
def flashspark_block(d, target_hidden, tokens, anchors):
    """Greedy drafts and confidences of flashspark's loaded drafter at each anchor (batch = anchors)."""
    B = len(anchors)
    S = int(max(anchors))
    cache = d.new_cache(B, S + 2 * d.block_size)
    rows = [(b, p) for b, a in enumerate(anchors) for p in range(a)]
    bs, ps = torch.tensor(rows).T
    d.inject(cache, target_hidden[ps], ps, bs)
    anchor_tokens = tokens[torch.tensor(anchors)]
    drafts, _, conf = d.draft_markov(cache, anchor_tokens, torch.tensor(anchors))
    return drafts, conf


def run_both(tmp_path, target, use_ops=True, **ckpt):
    t, config = deepspec_checkpoint(tmp_path / "ckpt", target, **ckpt)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(6, target.config.vocab_size, (40,), generator=gen)
    with torch.no_grad():
        feats = target(tokens[None], hidden_layers=config["target_layer_ids"]).hidden[0]  # [S, n, H]
    anchors = [9, 17, 31]
    d = load_dspark(tmp_path / "ckpt", target, use_ops=use_ops)
    got = flashspark_block(d, feats, tokens, anchors)
    want = [deepspec_block(t, config, feats, tokens, a) for a in anchors]
    return d, got, torch.stack([w[0] for w in want]), torch.stack([w[1] for w in want])


@pytest.mark.parametrize("use_ops", [True, False], ids=["ops", "torch"])
@pytest.mark.parametrize(
    "shape",
    [
        dict(block_size=5, rank=7),
        dict(block_size=3, rank=256, draft_layers=1, layer_ids=(1, 2, 3)),  # the published rank
        dict(block_size=6, rank=5, confidence_head_with_markov=False),
    ],
    ids=["r7", "r256", "conf-no-markov"],
)
def test_deepspec_checkpoint_drafts_as_deepspec(tmp_path, use_ops, shape):
    target = make_target()
    d, (drafts, conf), want_drafts, want_conf = run_both(tmp_path, target, use_ops=use_ops, **shape)
    assert d.num_drafts == shape["block_size"] and d.config.sample_from_anchor
    assert torch.equal(drafts, want_drafts)
    torch.testing.assert_close(conf, want_conf, atol=2e-5, rtol=1e-4)


def test_gqa_shapes(tmp_path):
    target = make_target(V=131, H=64, heads=4, kv=2, head_dim=16, layers=5)
    _, (drafts, conf), want_drafts, want_conf = run_both(tmp_path, target, layer_ids=(0, 1, 3))
    assert torch.equal(drafts, want_drafts)
    torch.testing.assert_close(conf, want_conf, atol=2e-5, rtol=1e-4)


def test_wrong_layout_flag_is_caught(tmp_path):
    """The same weights read in DFlash's layout draft from the masks' slots, one position off:
    the drafts no longer match DeepSpec's (and there is one fewer)."""
    target = make_target()
    _, (drafts, _), want, _ = run_both(tmp_path, target, sample_from_anchor=False)
    assert drafts.shape[1] == want.shape[1] - 1
    assert not torch.equal(drafts, want[:, : drafts.shape[1]]) and not torch.equal(drafts, want[:, 1:])


def test_embed_and_head_are_the_targets(tmp_path):
    """The checkpoint's copies of the target's embedding and head are not loaded; copies shaped for
    another target are refused."""
    target = make_target()
    t, config = deepspec_checkpoint(tmp_path / "a", target)
    d = load_dspark(tmp_path / "a", target)
    assert "embed_tokens.weight" not in d.state_dict() and d.embed_weight is target.model.embed_tokens.weight
    t["lm_head.weight"] = torch.zeros(5, 48)
    save_file(t, str(tmp_path / "a" / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight has shape"):
        load_dspark(tmp_path / "a", target)


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"markov_head_type": "gated"}, "gated.*not supported"),
        ({"markov_head_type": "RNN"}, "rnn.*not supported"),
        ({"enable_confidence_head": False}, "confidence head"),
        ({"markov_rank": 0}, "markov_rank"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"architectures": ["DFlashDraftModel"]}, "not a DSpark drafter config"),
    ],
)
def test_unsupported_checkpoints_are_refused(tmp_path, extra, match):
    target = make_target()
    deepspec_checkpoint(tmp_path / "c", target, **extra)
    with pytest.raises(ValueError, match=match):
        load_dspark(tmp_path / "c", target)


def test_saved_in_deepspec_format_round_trip(tmp_path):
    """What flashspark saves is DeepSpec's format: the keys DeepSpec's loader reads, its tensor
    names, and it loads back to the same drafts."""
    from flashspark.models.dspark import save_dspark  # noqa: PLC0415 (the function under test)
    from safetensors.torch import load_file  # noqa: PLC0415

    target = make_target()
    t, _ = deepspec_checkpoint(tmp_path / "a", target)
    d = load_dspark(tmp_path / "a", target)
    save_dspark(d, tmp_path / "b", dtype=torch.float32)
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    for key in ("block_size", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type"):
        assert key in cfg
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["enable_confidence_head"] and cfg["confidence_head_with_markov"] and cfg["sample_from_anchor"]
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(saved) == set(t) - {"embed_tokens.weight", "lm_head.weight"}
    for k, v in saved.items():
        assert torch.equal(v, t[k]), k


def test_deepspec_checkpoint_generates_from_the_cli(tmp_path, capsys):
    """`python -m flashspark generate --method dspark --drafter DIR` runs a DeepSpec-format
    checkpoint written for the tiny shipped target, greedy output equal to plain decoding, with
    the confidence scheduler too."""
    from flashspark.cli import main  # noqa: PLC0415 (the entry point under test)
    from flashspark.models import catalog  # noqa: PLC0415

    target = catalog.load_target(catalog.resolve_target("tiny"))
    deepspec_checkpoint(tmp_path / "ds", target, block_size=4, rank=16, layer_ids=(1, 3), draft_layers=1)
    for extra in ([], ["--scheduler", "confidence"]):
        argv = ["generate", "--method", "dspark", "--drafter", str(tmp_path / "ds"), "--prompt", "def f(x):"]
        assert main(argv + ["--max-new-tokens", "12", "--threads", "1"] + extra) == 0
        err = capsys.readouterr().err
        assert "identical to plain decoding" in err, err
