"""Valid base calls of the op fuzz (test_fuzz_ops.py), drawn by hypothesis.

Each base is a JSON object of sizes, dtypes, modes and a tensor seed, from which
fuzz_child.BUILDERS makes a small valid call of the op. The draws use a fixed seed, no
database and the generate phase only. This module imports nothing of the project: run as
``python fuzz_bases.py COUNT`` it prints ``{op: [COUNT bases]}`` as JSON, and in a process
that loads no project module hypothesis draws the same examples every time (it mixes
literals of loaded modules into its draws).
"""

from __future__ import annotations

import json
import sys

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

FUZZ_SEED = 20250607
DRAWS_PER_BASE = 4  # examples hypothesis generates per distinct base wanted

SEEDS = st.integers(0, 2**31 - 1)
FLOATS = st.sampled_from(["float32", "bfloat16", "float16"])
TEMPS = st.lists(st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0]), min_size=4, max_size=4)

VERIFY_BASE = st.fixed_dictionaries(
    dict(
        seed=SEEDS,
        num_draft=st.lists(st.integers(0, 4), min_size=1, max_size=4),
        V=st.integers(1, 40),
        q_mode=st.sampled_from(["onehot", "dense", "sparse"]),
        K=st.integers(1, 4),
        dtype=FLOATS,
        temps=TEMPS,
        extra_spec=st.integers(0, 2),
        index64=st.booleans(),
    )
)

# Trees: B requests of 1..6 nodes; the builder (fuzz_child.build_tree_verify) grows each tree from
# the seed: parents earlier in the request, children's tokens mostly their parent row's argmax (the
# walks go deep), now and then a sibling's token again or a padding node (parents -1 on a later node).
TREE_VERIFY_BASE = st.fixed_dictionaries(
    dict(
        seed=SEEDS,
        num_nodes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
        V=st.integers(1, 40),
        dtype=FLOATS,
        temps=TEMPS,
        extra_depth=st.integers(0, 2),
        index64=st.booleans(),
    )
)

BASE_STRATEGIES = {
    "verify": VERIFY_BASE,
    "verify_out": VERIFY_BASE,
    "block_diffusion_attention": st.fixed_dictionaries(
        dict(
            seed=SEEDS,
            B=st.integers(1, 3),
            G=st.integers(1, 4),
            Hkv=st.integers(1, 2),
            group=st.integers(1, 2),
            D=st.sampled_from([2, 4, 8, 16]),
            ctx=st.lists(st.integers(0, 6), min_size=3, max_size=3),
            S_extra=st.integers(0, 3),
            dtype=FLOATS,
            index64=st.booleans(),
        )
    ),
    "inject_context_kv": st.fixed_dictionaries(
        dict(
            seed=SEEDS,
            N=st.integers(1, 6),
            B=st.integers(1, 3),
            Hkv=st.integers(1, 2),
            D=st.sampled_from([2, 4, 8, 16]),
            S=st.integers(1, 8),
            dtype=FLOATS,
            pos_extra=st.integers(0, 2),
            index64=st.booleans(),
        )
    ),
    "two_tap_conv": st.fixed_dictionaries(
        dict(
            seed=SEEDS,
            rows=st.integers(1, 12),
            C=st.sampled_from([1, 5, 16, 17, 33]),
            block_size=st.integers(1, 5),
            group=st.sampled_from([16, 1, 3, 8, 32]),
            taps=st.sampled_from(["delta", "delta_weight", "finish"]),
            ragged=st.booleans(),
            residual=st.booleans(),
            norm=st.booleans(),
            dtype=FLOATS,
            lead=st.booleans(),
            index64=st.booleans(),
        )
    ),
    "topk_select": st.fixed_dictionaries(
        dict(
            seed=SEEDS,
            rows=st.integers(1, 4),
            V=st.integers(1, 40),
            k=st.integers(1, 16),
            dtype=FLOATS,
            lead=st.booleans(),
        )
    ),
    "path_select": st.fixed_dictionaries(
        dict(
            seed=SEEDS,
            R=st.integers(1, 3),
            P=st.integers(1, 4),
            K=st.integers(1, 6),
            V=st.integers(1, 40),
            r=st.integers(1, 8),
            mode=st.sampled_from(["backtrack", "greedy", "sample"]),
            temps=TEMPS,
            fused_g=st.booleans(),
            Dh=st.integers(1, 8),
            dtype=st.sampled_from(["float32", "bfloat16"]),
            index64=st.booleans(),
        )
    ),
    "markov_step": st.fixed_dictionaries(
        dict(
            seed=SEEDS,
            B=st.integers(1, 4),
            V=st.integers(1, 40),
            r=st.integers(1, 8),
            H=st.integers(1, 8),
            bias=st.booleans(),
            temps=TEMPS,
            dtype=FLOATS,
            index64=st.booleans(),
        )
    ),
    # last: an op's draws are seeded by its position here, so the others keep their seeds (the literals
    # of this file, which hypothesis mixes in, still move a few of their draws)
    "tree_verify": TREE_VERIFY_BASE,
    "tree_verify_out": TREE_VERIFY_BASE,
}


OPS = list(BASE_STRATEGIES)


def draw_bases(op, count):
    """count distinct bases of op (fewer if hypothesis finds no more)."""
    found = []

    @seed(FUZZ_SEED + OPS.index(op))
    @settings(
        max_examples=DRAWS_PER_BASE * count,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(BASE_STRATEGIES[op])
    def collect(base):
        if base not in found and len(found) < count:
            found.append(base)

    collect()
    return found


def draw_all(count):
    return {op: draw_bases(op, count) for op in OPS}


if __name__ == "__main__":
    print(json.dumps(draw_all(int(sys.argv[1]))))
