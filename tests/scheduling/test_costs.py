"""The cost model (scheduling/costs.py): a forward's time from a decoder's sizes and a hardware
description, checked against hand-computed bytes and FLOPs and against the regimes it must
show; the fit of a machine's description recovers a known one from its forwards; a table
from the model is an SPSTable the scheduler reads."""

import numpy as np
import pytest
from flashspark.models.config import DecoderConfig
from flashspark.scheduling.costs import H200, ForwardShape, Hardware, fit_hardware, forward_time, model_sps

# SmolLM2-135M's shape.
SMOLLM2 = DecoderConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
)


def test_shape_counts_bytes_and_flops():
    s = ForwardShape.of_decoder(SMOLLM2)
    layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    params = 30 * layer + 49152 * 576  # the tied LM head stands in for the embedding
    assert params + (2 * 30 + 1) * 576 == 134_515_008  # SmolLM2's count: the norms make up the rest
    assert s.weight_bytes == 2 * params
    assert s.matmul_flops_per_token == 2 * params
    assert s.kv_bytes_per_token == 2 * 30 * 2 * 192 and s.attention_flops_per_pair == 4 * 30 * 576
    assert s.logits_bytes_per_token == 4 * 49152


def test_forward_time_regimes():
    s = ForwardShape.of_decoder(SMOLLM2)
    # Batch 1, one token, 1024 context: memory-bound, the weights and the KV cache over the bandwidth.
    want = H200.overhead_s + (s.weight_bytes + 1025 * s.kv_bytes_per_token + s.logits_bytes_per_token) / 4.8e12
    assert forward_time(s, H200, 1, 1, 1024) == pytest.approx(want)
    # Memory-bound: 8 tokens cost barely more than 1; compute-bound: 64 x 32 tokens cost in proportion.
    assert forward_time(s, H200, 1, 8, 1024) < 1.05 * forward_time(s, H200, 1, 1, 1024)
    big = forward_time(s, H200, 64, 32, 1024) - H200.overhead_s
    flops = 64 * 32 * (s.matmul_flops_per_token + s.attention_flops_per_pair * 1056)
    assert big == pytest.approx(flops / 989e12)
    # Arrays broadcast.
    assert forward_time(s, H200, np.array([1, 64]), 1, 1024).shape == (2,)


def test_fit_recovers_a_known_machine():
    s = ForwardShape.of_decoder(SMOLLM2, weight_bytes_per_param=4, kv_bytes_per_value=4)
    true = Hardware("true", 20.0, 0.15, 2e-3)
    grid = [(b, k, 256) for b in (1, 2, 4, 8) for k in (1, 2, 4, 8)]
    exact = [(b, k, c, float(forward_time(s, true, b, k, c))) for b, k, c in grid]
    fit = fit_hardware(s, exact)
    assert fit.max_error < 1e-9
    assert fit.hardware.bandwidth_gbs == pytest.approx(20.0) and fit.hardware.peak_tflops == pytest.approx(0.15)
    assert fit.hardware.overhead_s == pytest.approx(2e-3)
    # Timing noise of +-3%: the fit's error stays at the noise.
    rng = np.random.default_rng(0)
    noisy = [(b, k, c, t * (1 + 0.03 * rng.uniform(-1, 1))) for b, k, c, t in exact]
    assert fit_hardware(s, noisy).max_error < 0.06
    with pytest.raises(ValueError, match="at least 3"):
        fit_hardware(s, exact[:2])


def test_fit_sets_the_layer_overhead_apart_with_a_shallower_model():
    """A machine that pays per layer (a CPU's operator dispatch): fitted on the target alone, the
    per-layer cost hides in the per-forward one and a 2-layer drafter is priced like the 30-layer
    target's overhead (1.65x its time here, where the LM head is most of it); fitted beside the drafter's passes, both are recovered."""
    from flashspark.scheduling.costs import drafter_forward

    t = ForwardShape.of_decoder(SMOLLM2, 4, 4)
    d = drafter_forward(SMOLLM2, 8, 7, layers=2, bytes_per_value=4)
    assert t.layers == 30 and d.layers == 2
    true = Hardware("true", 20.0, 0.15, 1e-3, 2e-4)
    target = [(b, k, 256, float(forward_time(t, true, b, k, 256))) for b in (1, 2, 4, 8) for k in (1, 2, 4, 8)]
    drafts = [(b, 8, c, float(forward_time(d, true, b, 8, c))) for b in (1, 2, 4, 8) for c in (64, 256)]
    alone = fit_hardware(t, target).hardware
    assert alone.layer_overhead_s == 0.0 and alone.overhead_s == pytest.approx(1e-3 + 30 * 2e-4)
    assert float(forward_time(d, alone, 1, 8, 256)) > 1.6 * float(forward_time(d, true, 1, 8, 256))
    both = fit_hardware(t, target, others=[(d, drafts)])
    assert both.max_error < 1e-7 and len(both.relative_errors) == len(target) + len(drafts)
    assert both.hardware.overhead_s == pytest.approx(1e-3) and both.hardware.layer_overhead_s == pytest.approx(2e-4)
    assert Hardware.from_dict(both.hardware.to_dict()) == both.hardware
    assert (
        Hardware.from_dict({k: v for k, v in true.to_dict().items() if k != "layer_overhead_s"}).layer_overhead_s == 0
    )


def test_model_sps_is_a_table_of_whole_steps():
    s = ForwardShape.of_decoder(SMOLLM2)
    table = model_sps(s, H200, 4, [4, 8, 32], 1024, overhead_s=1e-4)
    assert table.tokens.tolist() == [4, 8, 32]
    assert float(table(4)) == pytest.approx(1 / (float(forward_time(s, H200, 4, 1, 1024)) + 1e-4))
    assert bool((table.sps[1:] <= table.sps[:-1]).all())  # more tokens never cost less
    with pytest.raises(ValueError, match="at least one token"):
        model_sps(s, H200, 4, [2, 8], 1024)
