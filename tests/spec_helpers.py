"""Tiny models and statistics shared by the speculative-loop tests."""

import math

import torch
from flashspark.decoding import speculative_generate
from flashspark.models import DecoderConfig, DecoderForCausalLM
from flashspark.models.dflash import DFlashConfig, DFlashDrafter
from flashspark.models.dflash2 import DFlash2Config, DFlash2Drafter
from flashspark.models.dspark import DSparkConfig, DSparkDrafter

# The arguments every seconds-long drafter training run of the tests shares: one fp32 layer,
# evaluations every step or so, the whole budget for training (no export reserve).
SMALL_RUN = dict(layers=1, eval_every_min=0.01, export_reserve_min=0.0, bf16=False)


def tiny_target(vocab=48, layers=2, seed=0, scale=30.0) -> DecoderForCausalLM:
    cfg = DecoderConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=160,
        torch_dtype="float32",
    )
    m = DecoderForCausalLM(cfg)
    m.init_weights(seed)
    with torch.no_grad():  # spread the logits: a near-uniform target makes every test weak
        m.model.embed_tokens.weight.mul_(scale)
    return m.eval()


def tiny_drafter(target, block_size=5, seed=1, scale=5.0) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        target.config, num_hidden_layers=1, block_size=block_size, mask_token_id=1, num_features=2
    )
    d = DFlashDrafter(cfg, target)
    d.init_weights(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(scale)
    return d.eval()


def _perturb(d, seed, scale, special):
    """Non-trivial weights everywhere: norms near 1, `special(name)` -> std for head tensors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            std = special(name)
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif std is not None:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.mul_(scale)
    return d.eval()


def tiny_dflash2(target, block_size=5, topk=6, seed=1, scale=5.0) -> DFlash2Drafter:
    cfg = DFlash2Config.for_target(
        target.config,
        num_hidden_layers=1,
        block_size=block_size,
        mask_token_id=1,
        num_features=2,
        selector_rank=8,
        selector_top_k=topk,
    )
    d = DFlash2Drafter(cfg, target)
    d.init_weights(seed)
    return _perturb(
        d, seed, scale, lambda n: 0.3 if "_conv." in n else 1.0 if n.startswith("candidate_selector.") else None
    )


def tiny_dspark(target, block_size=5, seed=1, scale=5.0, from_anchor=True) -> DSparkDrafter:
    """A DSpark drafter in DeepSpec's slot layout (γ drafts), or DFlash's (`from_anchor=False`)."""
    cfg = DSparkConfig.for_target(
        target.config,
        num_hidden_layers=1,
        block_size=block_size,
        mask_token_id=1,
        num_features=2,
        markov_rank=8,
        sample_from_anchor=from_anchor,
    )
    d = DSparkDrafter(cfg, target)
    d.init_weights(seed)
    d = _perturb(
        d,
        seed,
        scale,
        lambda n: 2.0 if n.startswith("markov_head.") else 0.3 if n.startswith("confidence_head.") else None,
    )
    with torch.no_grad():
        d.confidence_head.proj.bias.fill_(1.5)  # confidences around 0.7-0.9: the confidence scheduler's K varies
    return d


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def exact_joint(target, prompt, n, temperature):
    """p(x_1..x_n | prompt) over all V^n continuations, flattened [V^n]."""
    V = target.config.vocab_size
    seqs = torch.cartesian_prod(*[torch.arange(V)] * n)  # [V^n, n]
    x = torch.cat((torch.tensor(prompt).expand(len(seqs), -1), seqs), 1)
    with torch.no_grad():
        logp = torch.log_softmax(target(x).logits[:, len(prompt) - 1 : -1] / temperature, -1)
    return logp.gather(2, seqs[..., None]).sum((1, 2)).exp()


def spec_joint(target, drafter, prompt, n, temperature, samples, seed=0, decode=None, **loop_kw):
    """Counts [V^n] of the first n tokens of `samples` speculative continuations of `prompt`,
    `decode` tokens long (default n: a longer decode keeps its first steps' blocks whole, where
    the loop shortens the last blocks to the tokens still wanted)."""
    out, _ = speculative_generate(
        target, drafter, [prompt] * samples, max_new_tokens=decode or n, temperature=temperature, seed=seed, **loop_kw
    )
    V = target.config.vocab_size
    idx = torch.tensor([o[:n] for o in out]) @ (V ** torch.arange(n - 1, -1, -1))
    return torch.bincount(idx, minlength=V**n).double()


def chi_square_ok(counts, probs, p_value=1e-4) -> bool:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat((counts[~small], counts[small].sum()[None]))
    exp = torch.cat((expected[~small], expected[small].sum()[None]))
    stat = float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum())
    df = len(obs) - 1
    z = {1e-4: 3.719, 1e-3: 3.090}[p_value]  # Wilson-Hilferty approximation of the chi-square quantile
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < limit
