"""bench/e2e_bench.py's rounds: the methods take turns batch by batch in balanced orders, and
every (concurrency, round) cell starts the decoders untaught."""

import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import e2e_bench  # noqa: E402  (bench/ is not a package)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
def test_balanced_orders_give_every_place_and_predecessor_equally(n):
    items = [f"m{i}" for i in range(n)]
    rows = [e2e_bench.balanced_order(items, k) for k in range(n if n % 2 == 0 else 2 * n)]
    assert all(sorted(row) == items for row in rows)
    places = Counter((m, i) for row in rows for i, m in enumerate(row))
    after = Counter(pair for row in rows for pair in zip(row, row[1:]))
    assert len(places) == n * n and len(set(places.values())) == 1
    assert len(after) == n * (n - 1) and len(set(after.values())) <= 1
    assert e2e_bench.balanced_order(items, len(rows) + 1) == rows[1]  # cyclic


class Stub:
    """A decoder that logs its calls and times every batch at `seconds`."""

    def __init__(self, name, log, seconds=1.0):
        self.name, self.log, self.seconds = name, log, seconds
        self.taught = 0  # batches decoded since the last forget

    def __call__(self, prompts, max_new_tokens, temperature, seed):
        self.log.append((self.name, prompts[0][2], self.taught))
        self.taught += 1
        stats = {"seconds": self.seconds, "decode_seconds": self.seconds, "new_tokens": max_new_tokens * len(prompts)}
        return [[7] * max_new_tokens for _ in prompts], stats | {"tau": 1.0, "steps": 0, "forwards": max_new_tokens}

    def prepare(self, batch_size, temperature):
        pass

    def forget(self):
        self.taught = 0


def test_rounds_interleave_batches_and_start_each_cell_untaught():
    args = e2e_bench.parser().parse_args(["--concurrency", "1", "2", "--min-prompts", "4", "--repeats", "2"])
    args.max_new_tokens = 4
    target = e2e_bench.load_target(args)
    log = []
    methods = {name: Stub(name, log, seconds) for name, seconds in (("ar", 2.0), ("a", 1.0), ("b", 4.0))}
    prompts = [[1, 2, p] for p in range(4)]
    result = e2e_bench.run(args, target, methods, prompts)
    timed = log[3:]  # after one warm-up call each
    names = list(methods)
    # concurrency 1: batch i of round r runs every method once, in the balanced order r * 4 + i
    for k in range(8):
        calls = timed[3 * k : 3 * k + 3]
        assert [name for name, _, _ in calls] == e2e_bench.balanced_order(names, k)
        assert {batch for _, batch, _ in calls} == {k % 4}
    # every (concurrency, round) cell starts untaught
    assert [t for name, _, t in timed if name == "a"] == [0, 1, 2, 3] * 2 + [0, 1] * 2
    assert result["interleave"].startswith("batch") and result["untaught"] == "cell"
    rows = {(r["method"], r["concurrency"]): r for r in result["results"]}
    assert rows[("a", 2)]["speedup_paired"] == pytest.approx(2.0) and rows[("b", 1)]["speedup"] == pytest.approx(0.5)
