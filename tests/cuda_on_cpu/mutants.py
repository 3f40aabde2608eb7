"""Plant known CUDA bugs, one at a time, in a copy of the kernels and show that the
cuda_on_cpu comparisons fail on each.

    python tests/cuda_on_cpu/mutants.py [--build DIR] [--only NAME ...] [--jobs N]

Each mutant names the file, the text it replaces (which must occur exactly once), the
replacement, and the suite that must fail. A mutant that survives fails the run unless it is
listed in SURVIVORS with the reason it cannot change a result. The build is configured once
with COC_KERNEL_DIR pointing at the copy, so each mutant recompiles only what includes the
file it changes; suites stop at their first failed check (COC_FAIL_FAST).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# name: (file under csrc/, old, new, suite)
MUTANTS = {
    # --- a removed __syncthreads()
    "attn-tile-barrier": (
        "include/flashspark/cuda/dflash.cuh",
        "  for (int32_t tile = j0; tile < j1; tile += kAttnTile) {\n    __syncthreads();\n",
        "  for (int32_t tile = j0; tile < j1; tile += kAttnTile) {\n",
        "dflash",
    ),
    "markov-staging-barrier": (
        "include/flashspark/cuda/dspark.cuh",
        "      __syncthreads();\n      if (v >= p.vocab) continue;\n",
        "      if (v >= p.vocab) continue;\n",
        "dspark",
    ),
    "path-pair-barrier": (
        "include/flashspark/cuda/dflash2.cuh",
        "    __syncthreads();  // the lattice rows are read by the leader next\n",
        "",
        "dflash2",
    ),
    # --- an off-by-one loop bound
    "attn-last-key": (
        "include/flashspark/cuda/dflash.cuh",
        "j1 = min(ctx + p.gamma, j0 + p.split_keys);",
        "j1 = min(ctx + p.gamma - 1, j0 + p.split_keys);",
        "dflash",
    ),
    "conv-last-quad": (
        "include/flashspark/cuda/dflash2.cuh",
        "  if (idx >= p.rows * quads) return;\n",
        "  if (idx >= p.rows * quads - 1) return;\n",
        "dflash2",
    ),
    "markov-normalize-bound": (
        "include/flashspark/cuda/dspark.cuh",
        "  if (idx >= int64_t(p.batch) * p.vocab) return;\n",
        "  if (idx >= int64_t(p.batch) * p.vocab - 1) return;\n",
        "dspark",
    ),
    # --- a split merged out of order or dropped
    "attn-split-dropped": (
        "include/flashspark/cuda/dflash.cuh",
        "const dim3 grid(unsigned(p.num_splits),",
        "const dim3 grid(unsigned(p.num_splits > 1 ? p.num_splits - 1 : 1),",
        "dflash",
    ),
    "markov-partial-dropped": (
        "include/flashspark/cuda/dspark.cuh",
        "  for (int32_t i = threadIdx.x; i < p.num_partials; i += blockDim.x)\n",
        "  for (int32_t i = threadIdx.x; i < p.num_partials - 1; i += blockDim.x)\n",
        "dspark",
    ),
    "markov-partials-reversed": (
        "include/flashspark/cuda/dspark.cuh",
        "  for (int32_t i = threadIdx.x; i < p.num_partials; i += blockDim.x)\n"
        "    acc = markov_partial_merge(acc, markov_load_partial(p.partial + (int64_t(i) * p.batch + b) * kMarkovSlot), inv_t);",
        "  for (int32_t i = p.num_partials - 1 - int32_t(threadIdx.x); i >= 0; i -= int32_t(blockDim.x))\n"
        "    acc = markov_partial_merge(markov_load_partial(p.partial + (int64_t(i) * p.batch + b) * kMarkovSlot), acc, inv_t);",
        "dspark",
    ),
    # --- the probabilities mode read as logits by the CUDA greedy walk (a p outside [0, 1] unseen)
    # --- verify's two phases: a tile short of its chunk, a lane's merge left out, a chunk of a
    # stop row never merged, the prefill racing the walk's writes, a scratch reused unsynchronized,
    # the probabilities' greedy walk reading them as logits, a tile taken from thread 1
    "verify-tile-short": (
        "include/flashspark/cuda/verify.cuh",
        "  const int64_t begin = c * kVerifyChunk, end = min(int64_t(p.vocab), begin + kVerifyChunk);\n"
        "  for (int64_t r = blockIdx.y;",
        "  const int64_t begin = c * kVerifyChunk, end = min(int64_t(p.vocab), begin + kVerifyChunk - 4);\n"
        "  for (int64_t r = blockIdx.y;",
        "verify",
    ),
    "verify-butterfly-short": (
        "include/flashspark/cuda/verify.cuh",
        "  for (int o = 16; o > 0; o >>= 1) x = merge(x, shfl_xor(x, o));",
        "  for (int o = 16; o > 1; o >>= 1) x = merge(x, shfl_xor(x, o));",
        "verify",
    ),
    "verify-finish-lane-stride": (
        "include/flashspark/cuda/verify.cuh",
        "  for (int32_t c = lane; c < chunks; c += 32) r = race_merge(",
        "  for (int32_t c = lane; c < chunks; c += 64) r = race_merge(",
        "verify",
    ),
    "verify-walk-prefill-unsynced": (
        "include/flashspark/cuda/verify.cuh",
        "  for (int32_t i = lane; i <= p.max_spec_len; i += 32) out[i] = -1;\n  __syncwarp();\n",
        "  for (int32_t i = lane; i <= p.max_spec_len; i += 32) out[i] = -1;\n",
        "verify",
    ),
    "verify-tiles-scratch-unsynced": (
        "include/flashspark/cuda/verify.cuh",
        "    __syncthreads();                                        // the scratch is reused next row\n",
        "",
        "verify",
    ),
    "verify-probs-greedy-as-logits": (
        "include/flashspark/cuda/verify.cuh",
        "argmax_add(a, p.target_probs ? greedy_prob(v[j]) : greedy_logit(v[j]), int32_t(base + j));",
        "argmax_add(a, greedy_logit(v[j]), int32_t(base + j));",
        "verify",
    ),
    "verify-cub-thread1": (
        "include/flashspark/cuda/verify.cuh",
        "    if (threadIdx.x == 0) ws.races[int64_t(b) * chunks + c] = total;",
        "    if (threadIdx.x == 1) ws.races[int64_t(b) * chunks + c] = total;",
        "verify",
    ),
    # --- tree_verify's own kernels and the ones it shares with verify: the walk's partials read
    # from the wrong base, the prefill racing the walk's writes, racing requests finished by the
    # walk as well, the tiles short a row; the shared race and finish kernels (a lane's chunks left
    # out of the merge, a block's race taken from thread 1) seen through tree_verify's suite
    "tree-walk-rows-base": (
        "include/flashspark/cuda/tree_verify.cuh",
        "VerifyMergedBackend<T> be{ws.rows + first * chunks, chunks, lane};",
        "VerifyMergedBackend<T> be{ws.rows + first, chunks, lane};",
        "tree_verify",
    ),
    "tree-walk-prefill-unsynced": (
        "include/flashspark/cuda/tree_verify.cuh",
        "  for (int64_t i = lane; i < width; i += 32) nodes[i] = tokens[i] = -1;\n  __syncwarp();\n",
        "  for (int64_t i = lane; i < width; i += 32) nodes[i] = tokens[i] = -1;\n",
        "tree_verify",
    ),
    "tree-walk-finishes-racing": (
        "include/flashspark/cuda/tree_verify.cuh",
        "  if (w.status != Status::kOk || !w.race) tree_finish(",
        "  if (true) tree_finish(",
        "tree_verify",
    ),
    "tree-tiles-rows-short": (
        "include/flashspark/cuda/tree_verify.cuh",
        "  const int64_t num_rows = p.num_nodes;",
        "  const int64_t num_rows = p.num_nodes - 1;",
        "tree_verify",
    ),
    "tree-finish-lane-stride": (
        "include/flashspark/cuda/verify.cuh",
        "  for (int32_t c = lane; c < chunks; c += 32) r = race_merge(",
        "  for (int32_t c = lane; c < chunks; c += 64) r = race_merge(",
        "tree_verify",
    ),
    "tree-cub-thread1": (
        "include/flashspark/cuda/verify.cuh",
        "    if (threadIdx.x == 0) ws.races[int64_t(b) * chunks + c] = total;",
        "    if (threadIdx.x == 1) ws.races[int64_t(b) * chunks + c] = total;",
        "tree_verify",
    ),
    # --- two_tap_conv's group size and the finish conv's taps: the group taken as the default 16,
    # the finish taps projected from the conv's own rows (the wrong half of delta_weight), never
    # projected (the launch sized for 2G taps), or left finite when the call failed
    "conv-group-default": (
        "include/flashspark/cuda/dflash2.cuh",
        "  const int32_t G = p.groups(), S = p.group_size;\n",
        "  const int32_t G = p.groups(), S = kConvGroup;\n",
        "dflash2",
    ),
    "conv-finish-wrong-half": (
        "include/flashspark/cuda/dflash2.cuh",
        "  float acc = two_tap_delta_dot(p, t, p.norm_weight ? p.row_scale_ws[t] : 1.f, i, lane, 32);",
        "  float acc = two_tap_delta_dot(p, t, p.norm_weight ? p.row_scale_ws[t] : 1.f, i % J, lane, 32);",
        "dflash2",
    ),
    "conv-finish-not-launched": (
        "include/flashspark/cuda/dflash2.cuh",
        "    const int64_t warps = p.rows * p.projected_taps();",
        "    const int64_t warps = p.rows * 2 * p.groups();",
        "dflash2",
    ),
    "conv-finish-not-failed": (
        "include/flashspark/cuda/dflash2.cuh",
        "from_float<T>(failed ? NAN : acc);",
        "from_float<T>(acc);",
        "dflash2",
    ),
    # --- a CUB result read from a thread other than thread 0
    "topk-cub-thread1": (
        "include/flashspark/cuda/dflash2.cuh",
        "  if (threadIdx.x == 0) topk_write(",
        "  if (threadIdx.x == 1) topk_write(",
        "dflash2",
    ),
    "markov-cub-thread1": (
        "include/flashspark/cuda/dspark.cuh",
        "  if (threadIdx.x == 0) {\n    const MarkovOutcome o = markov_outcome(sc, acc, st);",
        "  if (threadIdx.x == 1) {\n    const MarkovOutcome o = markov_outcome(sc, acc, st);",
        "dspark",
    ),
    # --- a wrong shared-memory index
    "attn-unpadded-key-tile": (
        "include/flashspark/cuda/dflash.cuh",
        "dot += qs[local * D + d] * ks[lane * (D + 1) + d];",
        "dot += qs[local * D + d] * ks[lane * D + d];",
        "dflash",
    ),
    "markov-staged-row": (
        "include/flashspark/cuda/dspark.cuh",
        "if (i < R) d += w[e] * e_smem[bb * R + i];",
        "if (i < R) d += w[e] * e_smem[bb * R + i + 1];",
        "dspark",
    ),
    # --- a launch past a limit: rank > 384 without raising the dynamic shared-memory limit
    "markov-no-smem-attribute": (
        "include/flashspark/cuda/dspark.cuh",
        "  if (smem > 48 * 1024) {  // rank > 384",
        "  if (false) {  // rank > 384",
        "dspark",
    ),
}

# Mutants that cannot change a result, and why (the README lists them too).
SURVIVORS = {
    "markov-partials-reversed": "the partial merge is order-independent by design: the race keeps the "
    "largest (key, lowest index) under a total order and the softmax merge commutes, so a reversed "
    "order changes only the rounding of the normalizer, inside the comparison's tolerance",
}


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=None, help="build directory (default: a temporary one)")
    ap.add_argument("--only", nargs="+", default=None, help="these mutants only")
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    names = args.only or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        ap.error(f"unknown mutants {unknown}; known: {', '.join(MUTANTS)}")

    work = Path(tempfile.mkdtemp(prefix="flashspark-mutants-"))
    kernels = work / "csrc"
    shutil.copytree(ROOT / "csrc" / "include" / "flashspark" / "cuda", kernels / "include" / "flashspark" / "cuda")
    shutil.copytree(ROOT / "csrc" / "kernels", kernels / "kernels")
    build = Path(args.build) if args.build else work / "build"
    configure = run(
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DFLASHSPARK_CUDA=OFF", f"-DCOC_KERNEL_DIR={kernels}"]
    )
    if configure.returncode:
        print(configure.stdout + configure.stderr)
        return 1
    env = {**os.environ, "COC_FAIL_FAST": "1"}
    rows, bad = [], []
    suites = sorted({MUTANTS[n][3] for n in names})
    built = run(["cmake", "--build", str(build), "-j", str(args.jobs), "--target", *[f"coc_{s}" for s in suites]])
    if built.returncode:
        print(built.stdout[-4000:] + built.stderr[-4000:])
        return 1
    for name in names:
        rel, old, new, suite = MUTANTS[name]
        path = kernels / rel
        pristine = (ROOT / "csrc" / rel).read_text()
        if pristine.count(old) != 1:
            rows.append((name, suite, "STALE", "its text no longer occurs exactly once; update the mutant"))
            bad.append(name)
            continue
        t0 = time.time()
        path.write_text(pristine.replace(old, new))
        try:
            b = run(["cmake", "--build", str(build), "-j", str(args.jobs), "--target", f"coc_{suite}"])
            if b.returncode:
                verdict, detail = "caught", "does not compile"
            else:
                exe = build / "tests" / "cuda_on_cpu" / f"coc_{suite}"
                try:
                    r = run([str(exe)], env=env, timeout=600)
                    out = (r.stdout + r.stderr).strip().splitlines()
                    verdict = "caught" if r.returncode else "SURVIVED"
                    detail = next((line for line in out if line.startswith("FAIL")), out[-1] if out else "")
                except subprocess.TimeoutExpired:
                    verdict, detail = "caught", "hangs (timeout)"
        finally:
            path.write_text(pristine)
        if verdict == "SURVIVED" and name in SURVIVORS:
            verdict, detail = "survives (expected)", SURVIVORS[name]
        elif verdict == "SURVIVED" or (verdict == "caught" and name in SURVIVORS):
            bad.append(name)
        rows.append((name, suite, verdict, f"{time.time() - t0:.0f} s  {detail[:150]}"))
        print(f"{name:28s} {suite:8s} {verdict:20s} {rows[-1][3]}", flush=True)
    # a caller's build directory is pointed back at the sources, as it was found (a copy of the
    # kernels left in its cache would go stale); then the copy goes
    if args.build:
        run(["cmake", "-S", str(ROOT), "-B", str(build), f"-DCOC_KERNEL_DIR={ROOT / 'csrc'}"])
    shutil.rmtree(work, ignore_errors=True)
    if bad:
        print(f"{len(bad)} mutant(s) not as expected: {', '.join(bad)}")
        return 1
    print(f"all {len(rows)} mutants as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
