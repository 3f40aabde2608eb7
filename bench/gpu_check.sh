#!/usr/bin/env bash
# One script for a machine with an NVIDIA GPU (H200 class) whose python3
# already holds a CUDA build of torch, pytest and ninja: build the extension
# with CUDA and the torch-free kernels with CMake, run the CUDA tests, run the
# kernel benchmarks, and write every result into DIR (summary.txt with hardware,
# step statuses and benchmark tables; build.log; pytest_cuda.log;
# sanitizer_bad_input.log; sanitizer_<tool>_<suite>.log for the CUDA-vs-CPU
# comparison drivers of tests/cuda_on_cpu built with nvcc; kernel_bench_cuda.txt;
# verify_roofline.{md,json}; verify_vs_flashinfer.json; verify_bench_cuda.json; tree_verify_bench_cuda.json;
# drafter_ops_bench_cuda.json; parity_cuda.log: z-lab's reference DFlash / DFlash 2 on the
# GPU against our ops on the GPU, tests/models/test_zlab_parity.py).
# Downloads nothing. The parity case needs the test oracles (transformers 5.23.0, dflash 0.1.0):
# where the machine lacks them, WHEELS=DIR names a directory of wheels to install them from,
# without dependencies (made elsewhere with `pip download --no-deps -d DIR transformers==5.23.0
# dflash==0.1.0 regex==2026.11.15 huggingface-hub tokenizers safetensors`).
# Budget: under 8 minutes.
#   [WHEELS=DIR] bash bench/gpu_check.sh DIR
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=$(mkdir -p "${1:-bench/results/gpu}" && cd "${1:-bench/results/gpu}" && pwd)
PY=${PY:-python3}
export MAX_JOBS=${MAX_JOBS:-16} PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FLASHSPARK_CUDA=1 FLASHSPARK_CUDA_ARCHS=${FLASHSPARK_CUDA_ARCHS:-9.0a}
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
log() { echo "== $*" | tee -a "$SUMMARY"; }

log "date $(date -u +%Y-%m-%dT%H:%M:%SZ)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -2;
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } 2>&1 | tee -a "$SUMMARY"

log "build: extension with CUDA kernels, then the torch-free CMake build"
timeout 300 $PY setup.py build_ext --inplace > "$OUT_DIR/build.log" 2>&1
log "build_ext exit $?"
( cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90a \
  && cmake --build build/cmake -j "$MAX_JOBS" && ctest --test-dir build/cmake ) >> "$OUT_DIR/build.log" 2>&1
log "cmake build + ctest exit $?"

if [ -n "${WHEELS:-}" ]; then
  $PY -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" transformers==5.23.0 dflash==0.1.0 \
    regex huggingface-hub tokenizers safetensors >> "$OUT_DIR/build.log" 2>&1
  log "test oracles from $WHEELS: pip exit $?"
fi

log "parity with z-lab's reference on CUDA (its drafter on the GPU against our ops on the GPU)"
timeout 120 $PY -m pytest -q tests/models/test_zlab_parity.py -k cuda -p no:cacheprovider -rs > "$OUT_DIR/parity_cuda.log" 2>&1
log "parity exit $? ($(tail -1 "$OUT_DIR/parity_cuda.log"))"

log "CUDA tests (every op test parametrized on cuda)"
timeout 200 $PY -m pytest -q tests -k cuda -p no:cacheprovider > "$OUT_DIR/pytest_cuda.log" 2>&1
log "pytest exit $? ($(tail -1 "$OUT_DIR/pytest_cuda.log"))"

log "bad-input CUDA tests under compute-sanitizer memcheck (failed requests must read nothing out of bounds)"
if command -v compute-sanitizer > /dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $PY -m pytest -q tests/ops/test_bad_input.py -k cuda \
    -p no:cacheprovider > "$OUT_DIR/sanitizer_bad_input.log" 2>&1
  log "compute-sanitizer exit $? ($(grep -c 'Invalid' "$OUT_DIR/sanitizer_bad_input.log") invalid accesses)"
else
  log "compute-sanitizer not found: skipped"
fi

log "CUDA-vs-CPU comparison drivers (tests/cuda_on_cpu, built with nvcc) under compute-sanitizer"
# What the CPU layer cannot check: real CUB, 32-lane lockstep, the memory model, shared-memory races.
SAN_DEADLINE=$((SECONDS + 150))
for suite in verify tree_verify dflash dflash2 dspark; do
  exe=build/cmake/tests/cuda_on_cpu/coc_gpu_$suite
  [ -x "$exe" ] || { log "$exe missing: skipped"; continue; }
  for tool in memcheck racecheck synccheck; do
    left=$((SAN_DEADLINE - SECONDS))
    if [ "$left" -lt 10 ]; then log "sanitizer budget spent: $tool $suite skipped"; continue; fi
    if command -v compute-sanitizer > /dev/null; then
      timeout "$left" compute-sanitizer --tool "$tool" --error-exitcode 9 "$exe" > "$OUT_DIR/sanitizer_${tool}_$suite.log" 2>&1
    else
      timeout "$left" "$exe" > "$OUT_DIR/sanitizer_${tool}_$suite.log" 2>&1
    fi
    log "$tool $suite exit $? ($(grep -E 'checks (passed|failed)' "$OUT_DIR/sanitizer_${tool}_$suite.log" | tail -1))"
  done
done

log "raw CUDA verify kernel: bytes, µs, the roofline µs of those bytes, GB/s, fraction of 4.8 TB/s"
$PY bench/verify_roofline.py --out "$OUT_DIR/verify_roofline" > /dev/null 2>&1
timeout 90 ./build/cmake/flashspark_bench_cuda > "$OUT_DIR/kernel_bench_cuda.txt" 2>&1
log "flashspark_bench_cuda exit $?"
cat "$OUT_DIR/kernel_bench_cuda.txt" >> "$SUMMARY"

log "verify vs softmax + FlashInfer's chain_speculative_sampling (where flashinfer is importable)"
timeout 60 $PY bench/verify_vs_flashinfer.py --quick --out "$OUT_DIR/verify_vs_flashinfer.json" 2>&1 | tee -a "$SUMMARY"
log "verify_vs_flashinfer exit ${PIPESTATUS[0]}"

log "verify through torch, op vs reference"
timeout 150 $PY bench/verify_bench.py --device cuda --quick --out "$OUT_DIR/verify_bench_cuda.json" 2>&1 \
  | tee -a "$SUMMARY"
log "verify_bench exit ${PIPESTATUS[0]}"

log "tree_verify through torch, op vs reference and vs verify on the same chain"
timeout 60 $PY bench/tree_verify_bench.py --device cuda --quick --repeats 5 \
  --out "$OUT_DIR/tree_verify_bench_cuda.json" 2>&1 | tee -a "$SUMMARY"
log "tree_verify_bench exit ${PIPESTATUS[0]}"

log "drafter ops through torch: attention vs SDPA, injection, two-tap conv, Top-K vs torch.topk, path, Markov step"
timeout 150 $PY bench/drafter_ops_bench.py --device cuda --out "$OUT_DIR/drafter_ops_bench_cuda.json" 2>&1 \
  | tee -a "$SUMMARY"
log "drafter_ops_bench exit ${PIPESTATUS[0]}"
