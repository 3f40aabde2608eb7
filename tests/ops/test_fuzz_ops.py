"""Property-based fuzz of every flashspark op against the project's bad-input contract.

Design:
  * hypothesis (fixed seed, no database, generate phase only; tests/fuzz_bases.py) draws
    BASES_PER_OP small valid calls per op: sizes, dtypes, modes and a tensor seed, as JSON;
  * each mutation of fuzz_child.MUTATIONS[op] changes one argument of such a call:
    dtype, rank, shape, stride (wider buffers, every other row, column-major, stride-0
    expansion), device (meta), Python-int sizes (0, -1, 2**31, 2**32 + 3, ...), values
    inside index tensors (-2, the bound, 2**32 + 3, 2**32 + a valid id), non-finite
    floats (NaN, +-inf, 1e38) and scalars, empty dimensions, and aliasing between
    arguments. Every mutation runs on MUTATION_BASES different bases. Ops that take a
    ``status`` tensor also run their valid / value / non-finite / empty cases with one
    (the contract's "Status" section: CPU with status fills it instead of raising, a
    failed request emits the documented fill values, the others are unaffected, and
    raise_on_status raises the CPU's own text);
  * the cases run in child processes (tests/fuzz_child.py), a batch per child, under a
    watchdog (a case making no progress for CASE_TIMEOUT_S is a hang); the child logs each
    case before running it, so when one dies (signal, exit, hang) the case it was running
    is rerun alone in a fresh child to confirm it, the rest of the batch goes on in
    another child, and the test fails naming that case (test_crash_and_hang_are_named
    checks this machinery on a planted segfault and a planted hang);
  * the oracle (fuzz_child.run_case): an invalid call must raise a clear error (text
    with "flashspark" or the argument's name in quotes), never crash or hang, and a
    valid one must return outputs with the documented shapes and dtypes that pass the
    op's invariants and match flashspark.reference where it is exact for the inputs;
    where the contract is silent either is accepted;
  * test_planted_bugs_are_found runs the same oracle on deliberately broken variants
    (a removed range check, int64 ids narrowed to int32, a wrong padding, a wrong stream
    position in verify and in tree_verify, a swallowed status, NaN-blind Top-K and softmax,
    a stray cache write, the finish conv's taps from the wrong half of the projection), so
    the fuzz cannot pass vacuously.

CPU only: the cases build CPU tensors (CUDA reads bad values only through status, which
the CPU path implements the same way). Run ``python tests/test_fuzz_ops.py`` for the
full report: every violation grouped by op and mutation class, plus notes where an
error's text misses the contract's form (not failures).
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fuzz_child
import pytest

pytestmark = pytest.mark.slow

# ---------------------------------------------------------------- budgets

BASES_PER_OP = 8  # hypothesis-drawn valid calls per op (each also runs unmutated)
MUTATION_BASES = 3  # every mutation runs on this many different bases
BATCH_SIZE = 400  # cases per child process
CHILDREN = 2  # child processes at once (one per core)
CASE_TIMEOUT_S = 20  # a case takes milliseconds; one running this long hangs
START_TIMEOUT_S = 60  # a child's import of torch and the extension (slow when the machine is busy)
WATCHDOG_POLL_S = 0.05
IMPORT_RETRIES = 3  # a child that cannot import the extension (a rebuild under way) is retried
IMPORT_RETRY_WAIT_S = 5
PLANTED_BASES = 3
PLANTED_MAX_CASES = 60
HARNESS_CASE_TIMEOUT_S = 3  # the planted hang costs two of these

CHILD = Path(__file__).with_name("fuzz_child.py")
BASES = Path(__file__).with_name("fuzz_bases.py")
OPS = list(fuzz_child.MUTATIONS)

# ---------------------------------------------------------------- hypothesis: valid base calls


@functools.lru_cache(maxsize=None)
def _bases(count):
    """fuzz_bases.draw_all in a process that loads no project module: hypothesis mixes literals of the
    loaded modules into its draws, so drawing here would depend on what else the session imported."""
    with tempfile.TemporaryDirectory() as tmp:  # the working directory takes hypothesis' cache directory
        out = subprocess.run(
            [sys.executable, str(BASES), str(count)],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=True,
        )
    return json.loads(out.stdout)


def draw_bases(op, count=BASES_PER_OP):
    """count distinct valid base calls of op, the same in every run (fixed seed, no database)."""
    return _bases(count)[op]


def make_cases(
    ops=OPS, bases_per_op=BASES_PER_OP, mutation_bases=MUTATION_BASES, impl=None, only=None, status_twins=True
):
    """Every mutation of every op on mutation_bases bases, plus each base unmutated; with status_twins, the
    value / non-finite / empty / valid cases of ops that take a status tensor also run with one."""
    cases = []
    for op in ops:
        bases = draw_bases(op, bases_per_op)
        mids = [m for m in fuzz_child.MUTATIONS[op] if only is None or only(m)]
        for j, mid in enumerate(mids):
            picks = range(len(bases)) if mid == "valid" else [(j + s) % len(bases) for s in range(mutation_bases)]
            twin = (
                status_twins
                and op in fuzz_child.STATUS_OPS
                and mutation_class(mid) in fuzz_child.STATUS_CLASSES
                and fuzz_child.MUTATIONS[op][mid].arg != "status"
            )
            for i in sorted(set(picks)):
                case = dict(id=f"{impl or op}/{mid}/b{i}", op=op, impl=impl or op, base=bases[i], mutation=mid)
                cases.append(case)
                if twin:
                    cases.append(dict(case, id=case["id"] + "/status", status=True))
    return cases


# ---------------------------------------------------------------- child processes


def read_report(path):
    """(results by id, id of the case started last and not finished) from a child's report."""
    results, running = {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the child's death
            if "start" in rec:
                running = rec["start"]
            else:
                results[rec["id"]] = rec
                running = None
    return results, running


def run_child(cases, case_timeout):
    """Runs cases in one child; returns (results by id, id of a case started but not finished, failure or None).

    A watchdog kills the child when its report stops growing: START_TIMEOUT_S until the first case
    starts (the import), then case_timeout per case."""
    with tempfile.TemporaryDirectory() as tmp:
        cases_path, report_path, err_path = Path(tmp, "cases.json"), Path(tmp, "report.jsonl"), Path(tmp, "stderr")
        cases_path.write_text(json.dumps(cases))
        failure = None
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, str(CHILD), str(cases_path), str(report_path)],
                cwd=CHILD.parent,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
            size, last_change = -1, time.monotonic()
            while proc.poll() is None:
                now_size = report_path.stat().st_size if report_path.exists() else 0
                if now_size != size:
                    size, last_change = now_size, time.monotonic()
                limit = START_TIMEOUT_S if size <= 0 else case_timeout
                if time.monotonic() - last_change > limit:
                    proc.kill()
                    proc.wait()
                    failure = f"timed out: no progress for {limit} s (hang)"
                    break
                time.sleep(WATCHDOG_POLL_S)
        if failure is None and proc.returncode < 0:
            failure = f"killed by {signal.Signals(-proc.returncode).name}"
        elif failure is None and proc.returncode > 0:
            failure = f"exit status {proc.returncode}: {err_path.read_text().strip()[-400:]}"
        results, running = read_report(report_path)
    return results, running, failure


def crash_record(case, message):
    return dict(
        id=case["id"],
        op=case["op"],
        impl=case["impl"],
        mutation=case["mutation"],
        expect="no crash",
        outcome="crash",
        message=message,
        notes=[],
    )


def run_batch(cases, case_timeout=CASE_TIMEOUT_S):
    """Results of every case. When a child dies (signal, exit, timeout), the case it was running (the
    last one it started) is rerun alone in a fresh child to confirm it, recorded as a crash either way,
    and the rest of the batch goes on in another child."""
    results = {}
    todo = list(cases)
    retries = 0
    while todo:
        got, running, failure = run_child(todo, case_timeout)
        results.update(got)
        if failure is None:
            break
        by_id = {c["id"]: c for c in todo}
        if running is None and not got:  # died before its first case: an import failure, say
            retries += 1
            if retries > IMPORT_RETRIES:
                for c in todo:
                    results[c["id"]] = crash_record(c, f"child failed before its first case: {failure}")
                break
            time.sleep(IMPORT_RETRY_WAIT_S)
            continue
        if running is not None:
            suspect = by_id[running]
            alone, _, alone_failure = run_child([suspect], case_timeout)
            if alone_failure is not None and suspect["id"] not in alone:
                results[suspect["id"]] = crash_record(suspect, f"crash: {failure}; alone: {alone_failure}")
            else:
                results[suspect["id"]] = crash_record(
                    suspect,
                    f"crash: {failure}, after the earlier cases of its batch (alone: "
                    f"{alone.get(suspect['id'], {}).get('outcome', alone_failure)})",
                )
        todo = [c for c in todo if c["id"] not in results]
    return results


def run_cases(cases, **timeouts):
    batches = [cases[i : i + BATCH_SIZE] for i in range(0, len(cases), BATCH_SIZE)]
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=CHILDREN) as pool:
        for got in pool.map(lambda batch: run_batch(batch, **timeouts), batches):
            results.update(got)
    for c in cases:
        results.setdefault(c["id"], crash_record(c, "no result from the child"))
    return [results[c["id"]] for c in cases]


# ---------------------------------------------------------------- reporting

FAILING = ("violation", "crash", "harness-error")


def mutation_class(mutation):
    return mutation.split(":")[0]


def record_class(r):
    """A record's group in the report: the mutation class, "status/<class>" for the status twins."""
    return ("status/" if r.get("status") else "") + mutation_class(r["mutation"])


def format_failures(records, per_group=3):
    """Violations grouped by (op, mutation class): a count and a few examples each."""
    groups = collections.defaultdict(list)
    for r in records:
        if r["outcome"] in FAILING:
            groups[(r["impl"], record_class(r))].append(r)
    lines = []
    for (op, cls), rs in sorted(groups.items()):
        mids = sorted({r["mutation"] for r in rs})
        lines.append(f"{op} / {cls}: {len(mids)} mutations ({len(rs)} cases)")
        for mid in mids[: per_group if per_group else None]:
            r = next(x for x in rs if x["mutation"] == mid)
            lines.append(f"    {r['outcome']}: {mid} [expect {r['expect']}] {r['id']}: {r['message'][:240]}")
        if per_group and len(mids) > per_group:
            rest = ", ".join(m.split(":", 1)[1] for m in mids[per_group:])
            lines.append(f"    ... and {len(mids) - per_group} more: {rest}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def fuzz_records():
    return run_cases(make_cases())


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("op", OPS)
def test_fuzz_op(fuzz_records, op):
    records = [r for r in fuzz_records if r["op"] == op]
    assert records, f"no cases for {op}"
    failures = [r for r in records if r["outcome"] in FAILING]
    if failures:
        pytest.fail(
            f"{len(failures)} of {len(records)} fuzz cases of {op} fail:\n" + format_failures(failures), pytrace=False
        )


def test_fuzz_covers_every_mutation(fuzz_records):
    """Each mutation applies to at least one of its bases (a table entry that never runs tests nothing)."""
    ran = collections.defaultdict(set)
    for r in fuzz_records:
        if not r.get("status"):
            ran[(r["op"], r["mutation"])].add(r["outcome"])
    never = sorted(f"{op}/{mid}" for (op, mid), outcomes in ran.items() if outcomes == {"skip"})
    if never:
        pytest.fail("mutations that never applied: " + ", ".join(never), pytrace=False)
    assert len(ran) == sum(len(t) for t in fuzz_child.MUTATIONS.values())


# A sampled batch whose draws decide the output (for the planted wrong stream position).
SAMPLED_VERIFY_BASE = dict(
    seed=11,
    num_draft=[4, 4, 4],
    V=30,
    q_mode="dense",
    K=2,
    dtype="float32",
    temps=[1.0, 1.0, 1.0, 1.0],
    extra_spec=0,
    index64=False,
)

# Sampled trees whose draws decide the walks (for the planted wrong stream position of tree_verify).
SAMPLED_TREE_VERIFY_BASE = dict(
    seed=11,
    num_nodes=[6, 6, 6, 6],
    V=30,
    dtype="float32",
    temps=[1.0, 1.0, 1.0, 1.0],
    extra_depth=0,
    index64=False,
)

# A conv that projects the finish conv's taps too (for the planted wrong half of delta_weight).
FINISH_CONV_BASE = dict(
    seed=5,
    rows=6,
    C=33,
    block_size=3,
    group=8,
    taps="finish",
    ragged=False,
    residual=True,
    norm=True,
    dtype="float32",
    lead=False,
    index64=False,
)

PLANTED = {
    # impl: (op, mutations it runs on, the mutations where it must be caught, fixed base or None, with status)
    "planted_verify_clamped": (
        "verify",
        ["valid", "value:draft_tokens:-2", "value:draft_tokens:upper"],
        ["value:draft_tokens:-2", "value:draft_tokens:upper"],
        None,
        False,
    ),
    "planted_verify_wrap32": (
        "verify",
        ["value:draft_tokens:2**32+valid", "value:cu_num_draft:wrap"],
        ["value:draft_tokens:2**32+valid", "value:cu_num_draft:wrap"],
        None,
        False,
    ),
    "planted_verify_tail_zero": ("verify", ["size:max_spec_len:above"], ["size:max_spec_len:above"], None, False),
    "planted_verify_offsets": ("verify", ["valid"], ["valid"], SAMPLED_VERIFY_BASE, False),
    "planted_tree_verify_offsets": ("tree_verify", ["valid"], ["valid"], SAMPLED_TREE_VERIFY_BASE, False),
    "planted_verify_status_swallowed": (
        "verify",
        ["value:draft_tokens:upper"],
        ["value:draft_tokens:upper"],
        None,
        True,
    ),
    "planted_topk_raw": (
        "topk_select",
        ["nonfinite:logits:nan", "nonfinite:logits:nan-row"],
        ["nonfinite:logits:nan", "nonfinite:logits:nan-row"],
        None,
        False,
    ),
    "planted_markov_plain_softmax": (
        "markov_step",
        ["nonfinite:base_logits:nan-row"],
        ["nonfinite:base_logits:nan-row"],
        None,
        False,
    ),
    "planted_inject_stray_write": ("inject_context_kv", ["valid"], ["valid"], None, False),
    "planted_conv_finish_wrong_half": ("two_tap_conv", ["valid"], ["valid"], FINISH_CONV_BASE, False),
}


def planted_cases():
    cases = []
    for impl, (op, mids, _, base, with_status) in PLANTED.items():
        if base is not None:
            cases += [dict(id=f"{impl}/{mid}/fixed", op=op, impl=impl, base=base, mutation=mid) for mid in mids]
            continue
        for case in make_cases(
            [op], PLANTED_BASES, PLANTED_BASES, impl=impl, only=lambda m, mids=mids: m in mids, status_twins=with_status
        ):
            if case.get("status") or not with_status:
                cases.append(case)
    return cases


def test_planted_bugs_are_found():
    """The oracle on deliberately broken variants (fuzz_child.planted_*): each must be caught."""
    cases = planted_cases()
    assert len(cases) <= PLANTED_MAX_CASES
    records = run_cases(cases)
    missed = []
    for impl, (op, _, must, _, _) in PLANTED.items():
        for mid in must:
            found = [r for r in records if r["impl"] == impl and r["mutation"] == mid and r["outcome"] == "violation"]
            if not found:
                missed.append(f"{impl} on {mid}")
    if missed:
        pytest.fail("planted bugs the fuzz did not find: " + ", ".join(missed), pytrace=False)


def test_crash_and_hang_are_named():
    """The harness: a case that kills its child or hangs is named, and the cases around it still run."""
    base = draw_bases("topk_select", 1)[0]
    impls = ["topk_select", "planted_segfault", "topk_select", "planted_hang", "topk_select"]
    cases = [
        dict(id=f"{impl}/{i}", op="topk_select", impl=impl, base=base, mutation="valid") for i, impl in enumerate(impls)
    ]
    records = {r["id"]: r for r in run_cases(cases, case_timeout=HARNESS_CASE_TIMEOUT_S)}
    assert records["planted_segfault/1"]["outcome"] == "crash"
    assert "SIGSEGV" in records["planted_segfault/1"]["message"]
    assert records["planted_hang/3"]["outcome"] == "crash"
    assert "timed out" in records["planted_hang/3"]["message"]
    assert [records[f"topk_select/{i}"]["outcome"] for i in (0, 2, 4)] == ["ok"] * 3


if __name__ == "__main__":
    start = time.time()
    all_records = run_cases(make_cases())
    counts = collections.Counter((r["op"], r["outcome"]) for r in all_records)
    print(f"{len(all_records)} cases in {time.time() - start:.1f} s")
    for op in OPS:
        print(f"  {op}: " + ", ".join(f"{o} {n}" for (o_op, o), n in sorted(counts.items()) if o_op == op))
    print("\nViolations:\n" + format_failures(all_records, per_group=0))
    notes = collections.defaultdict(list)
    for r in all_records:
        for n in r.get("notes", []):
            notes[(r["op"], n)].append(r)
    if notes:
        print("\nContract notes on error texts (not failures):")
        for (op, n), rs in sorted(notes.items()):
            print(f"  {op}: {n} ({len(rs)} cases), e.g. {rs[0]['mutation']}: {rs[0]['message'][:160]}")
