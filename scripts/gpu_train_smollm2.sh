#!/usr/bin/env bash
# The whole SmolLM2 drafter pipeline on one GPU, sized to finish in under 8 minutes on an H200:
# the target generates its data at a large batch (held-out, calibration and training sets), then
# the DFlash backbone trains, then DFlash 2 and DSpark on it, each exported into OUT_DIR in its
# reference format, in safetensors shards of at most 16 MiB. Both keep the backbone frozen and
# read its tensors from OUT_DIR/dflash (index paths with its sha256): the repository carries the
# backbone once (its 60 MB cap). DSPARK_OWN_BACKBONE=1 fine-tunes DSpark's own copy in DeepSpec's
# layout instead. `python -m flashspark export OUT_DIR/dflash2 DIR` writes a self-contained copy.
#
#   bash scripts/gpu_train_smollm2.sh OUT_DIR              # on a GPU machine
#   TOY=1 bash scripts/gpu_train_smollm2.sh OUT_DIR        # CPU, the tiny target, seconds per step:
#                                                          # what CI runs (tests/train/test_gpu_script.py)
#
# OUT_DIR gets dflash/, dflash2/, dspark/ (drafter directories: config.json, shards and their
# index, MODEL_CARD.md; DFlash 2's proxy and both schedulers' priors, fit last) and pipeline.json
# (each step's wall seconds and held-out τ).
# Generated data and checkpoints go to WORK (default runs/gpu_<target>), never to OUT_DIR. Every
# step that finished is skipped when the script runs again (WORK/<step>.done), and an interrupted
# one resumes from its data or checkpoint.
#
# Every budget and shape is an environment variable (defaults below); the recipe is the one
# docs/smollm2.md's lever table chose.
set -euo pipefail
OUT=${1:?usage: gpu_train_smollm2.sh OUT_DIR}
cd "${ROOT:-$(dirname "$0")/..}"
PY=${PY:-.venv/bin/python}
if [[ ${TOY:-0} == 1 ]]; then
  # CI: every code path of the pipeline at a toy size, on the CPU, on the tiny target (no chat template).
  : "${DEVICE:=cpu}" "${TARGET:=tiny}" "${KINDS:=code:1,prose:1}" "${HELD_KINDS:=code:1,prose:1}"
  : "${HELD_PROMPTS:=2}" "${GEN_BATCH:=4}" "${MAX_NEW:=24}" "${DATA_MIN:=1}" "${DATA_TOKENS:=600}"
  : "${DFLASH_MIN:=0.05}" "${DFLASH2_MIN:=0.05}" "${DSPARK_MIN:=0.05}" "${BATCH:=2}" "${BLOCKS:=4}"
  : "${EVAL_SEQ:=4}" "${THREADS:=1}" "${BF16:=0}" "${LAYERS:=1}" "${INTERMEDIATE:=0}" "${GEN_DTYPE:=float32}"
  : "${EXPORT_RESERVE:=0}" "${SHARD_MIB:=1}"  # 1 MiB: the toy drafters are sharded too
  : "${FIT_PROMPTS:=1}" "${FIT_NEW:=8}" "${FIT_BATCH:=16}"
fi
DEVICE=${DEVICE:-cuda}
TARGET=${TARGET:-smollm2}
WORK=${WORK:-runs/gpu_$TARGET}
THREADS=${THREADS:-8}
# Data: prompts per batch and the mix (general chat the target writes itself, then the stdlib kinds).
KINDS=${KINDS:-self:2,chat:1,code:1,prose:1}
HELD_KINDS=${HELD_KINDS:-chat:1,code:1,prose:1,self:1}
HELD_PROMPTS=${HELD_PROMPTS:-24}  # per kind, for each of the held-out and calibration sets
GEN_BATCH=${GEN_BATCH:-256}
MAX_NEW=${MAX_NEW:-256}
DATA_MIN=${DATA_MIN:-2}
DATA_TOKENS=${DATA_TOKENS:-1500000}  # 5.6 KiB of stored features per token: 8 GiB of disk
GEN_DTYPE=${GEN_DTYPE:-}             # "": the target's checkpoint dtype on a GPU
# Training: minutes per drafter, sequences per step, random blocks per sequence.
DFLASH_MIN=${DFLASH_MIN:-2.5}
DFLASH2_MIN=${DFLASH2_MIN:-1}
DSPARK_MIN=${DSPARK_MIN:-1.5}
BATCH=${BATCH:-64}
BLOCKS=${BLOCKS:-32}
EVAL_SEQ=${EVAL_SEQ:-96}
EVAL_EVERY=${EVAL_EVERY:-1}  # minutes between held-out evaluations
LR=${LR:-1e-3}               # the backbone's peak learning rate; DFlash 2 takes DERIVED_LR
DERIVED_LR=${DERIVED_LR:-5e-4}
# DSpark on the shared (frozen) backbone trains its heads alone: at DERIVED_LR its confidence
# head was still far from fitting after 40 steps (AUC 0.55); resumed at 3e-3 for 57 more steps
# it reached 0.68 (docs/smollm2.md). Its own backbone (DSPARK_OWN_BACKBONE=1) takes DERIVED_LR.
DSPARK_LR=${DSPARK_LR:-3e-3}
HEAD_NEG=${HEAD_NEG:-0}      # > 0: the backbone's LM head over the stored Top-32 plus this many random tokens
BF16=${BF16:-1}
EXPORT_RESERVE=${EXPORT_RESERVE:-0.5}
# The drafter's shape and recipe.
LAYERS=${LAYERS:-2}
INTERMEDIATE=${INTERMEDIATE:-1024}  # 0: the target's MLP width
DISTILL=${DISTILL:-0.5}  # the lever table's winner (docs/smollm2.md)
DSPARK_OWN_BACKBONE=${DSPARK_OWN_BACKBONE:-0}
# DFlash 2's selector and DSpark's Markov head each hold two vocabulary-sized matrices: 3.1 MB in
# bf16 at rank 16, 12.6 MB at the trainers' default 64, which would put the repository's tracked
# files over their 60 MB cap once exported into it (docs/smollm2.md).
SELECTOR_RANK=${SELECTOR_RANK:-16}
MARKOV_RANK=${MARKOV_RANK:-16}
SHARD_MIB=${SHARD_MIB:-16}
# Fits: calibration prompts per kind, new tokens per prompt, prompts per batch.
FIT_PROMPTS=${FIT_PROMPTS:-24}
FIT_NEW=${FIT_NEW:-64}
FIT_BATCH=${FIT_BATCH:-72}

mkdir -p "$WORK" "$OUT"
TIMES=$WORK/times.tsv
touch "$TIMES"

step() { # step NAME RESUME_MARKER COMMAND...: run unless done, with --resume once the run has state
  local name=$1 marker=$2
  shift 2
  if [[ -f $WORK/$name.done ]]; then
    echo "== $name: done"
    return
  fi
  local resume=()
  [[ -e $marker ]] && resume=(--resume)
  echo "== $name: $* ${resume[*]}"
  local t0=$SECONDS
  "$@" "${resume[@]}"
  printf '%s\t%s\n' "$name" $((SECONDS - t0)) >>"$TIMES"
  touch "$WORK/$name.done"
}

data_opts=(--target "$TARGET" --device "$DEVICE" --threads "$THREADS" --batch-size "$GEN_BATCH" --max-new-tokens "$MAX_NEW")
[[ -n $GEN_DTYPE ]] && data_opts+=(--dtype "$GEN_DTYPE")
for split in heldout calibration; do
  step "data_$split" "$WORK/data_$split/progress.json" $PY -m flashspark train data "${data_opts[@]}" \
    --split $split --kinds "$HELD_KINDS" --max-prompts "$HELD_PROMPTS" --minutes 10 --out "$WORK/data_$split"
done
step data "$WORK/data/progress.json" $PY -m flashspark train data "${data_opts[@]}" --kinds "$KINDS" \
  --minutes "$DATA_MIN" --max-tokens "$DATA_TOKENS" --out "$WORK/data"

train_opts=(--target "$TARGET" --device "$DEVICE" --threads "$THREADS" --batch-size "$BATCH" --blocks-per-seq "$BLOCKS"
  --layers "$LAYERS" --data-from "$WORK/data" --eval-from "$WORK/data_heldout" --eval-sequences "$EVAL_SEQ"
  --shard-mib "$SHARD_MIB" --eval-every "$EVAL_EVERY" --export-reserve "$EXPORT_RESERVE")
[[ $INTERMEDIATE != 0 ]] && train_opts+=(--intermediate-size "$INTERMEDIATE")
[[ $BF16 == 1 ]] || train_opts+=(--no-bf16)
dflash_opts=(--distill "$DISTILL" --lr "$LR" --head-negatives "$HEAD_NEG")
[[ $INTERMEDIATE == 0 ]] && dflash_opts+=(--init-layers)  # the target's own top layers fit only at its width
step dflash "$WORK/dflash/ckpt.pt" $PY -m flashspark train dflash "${train_opts[@]}" "${dflash_opts[@]}" \
  --minutes "$DFLASH_MIN" --out "$WORK/dflash" --export "$OUT/dflash"

# DFlash 2 and DSpark read the exported backbone: one exported after either started makes that run
# (and the fits on it) stale. It starts over; the stale run is kept beside it.
BACKBONE=$(ls "$OUT"/dflash/*.safetensors | head -1)
for derived in dflash2 dspark; do
  if [[ -e $WORK/$derived/ckpt.pt && $BACKBONE -nt $WORK/$derived/ckpt.pt && ! -f $WORK/$derived.done ]] ||
    [[ -f $WORK/$derived.done && $BACKBONE -nt $WORK/$derived.done ]]; then
    stale=$WORK/$derived.stale-$(date -u +%Y%m%dT%H%M%S)
    echo "== $derived: the backbone changed since it started; restarting it ($stale keeps the old run)"
    [[ -e $WORK/$derived ]] && mv "$WORK/$derived" "$stale"
    rm -f "$WORK/$derived.done" "$WORK"/fit_*.done
  fi
done
step dflash2 "$WORK/dflash2/ckpt.pt" $PY -m flashspark train dflash2 "${train_opts[@]}" --init-from "$OUT/dflash" \
  --share-backbone --share-weights-with "$OUT/dflash" --lr "$DERIVED_LR" --minutes "$DFLASH2_MIN" \
  --selector-rank "$SELECTOR_RANK" --out "$WORK/dflash2" --export "$OUT/dflash2"
dspark_opts=(--share-backbone --no-sample-from-anchor --share-weights-with "$OUT/dflash")
dspark_lr=$DSPARK_LR
[[ $DSPARK_OWN_BACKBONE == 1 ]] && dspark_opts=(--sample-from-anchor) && dspark_lr=$DERIVED_LR
dspark_opts+=(--markov-rank "$MARKOV_RANK")
step dspark "$WORK/dspark/ckpt.pt" $PY -m flashspark train dspark "${train_opts[@]}" --init-from "$OUT/dflash" \
  "${dspark_opts[@]}" --lr "$dspark_lr" \
  --calib-from "$WORK/data_calibration" --calib-sequences "$EVAL_SEQ" --minutes "$DSPARK_MIN" \
  --out "$WORK/dspark" --export "$OUT/dspark"

# The DFlash 2 confidence proxy and both schedulers' priors, in the loop on the calibration prompts.
fit_opts=(--model "$TARGET" --device "$DEVICE" --threads "$THREADS" --prompts "$FIT_PROMPTS"
  --max-new-tokens "$FIT_NEW" --batch-size "$FIT_BATCH")
[[ -n $GEN_DTYPE ]] && fit_opts+=(--dtype "$GEN_DTYPE")
step fit_proxy /nonexistent $PY -m flashspark fit-proxy "${fit_opts[@]}" --drafter "$OUT/dflash2"
step fit_prior_dflash2 /nonexistent $PY -m flashspark fit-prior dflash2 "${fit_opts[@]}" --drafter-dir "$OUT/dflash2"
step fit_prior_dspark /nonexistent $PY -m flashspark fit-prior dspark "${fit_opts[@]}" --drafter-dir "$OUT/dspark"

# pipeline.json: what ran, how long each step took, and each drafter's held-out τ.
$PY - "$OUT" "$TIMES" "$DEVICE" "$TARGET" "$WORK" <<'EOF'
import json, sys
from pathlib import Path

import torch

out, times, device, target, work = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
steps = dict(line.split("\t") for line in times.read_text().splitlines() if line)
result = {
    "target": target,
    "device": torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device,
    "step_seconds": {k: int(v) for k, v in steps.items()},
    "total_seconds": sum(int(v) for v in steps.values()),
    "held_out_tau": {},
}
for name in ("dflash", "dflash2", "dspark"):
    summary = Path(work) / name / "summary.json"
    if summary.is_file():
        result["held_out_tau"][name] = json.loads(summary.read_text())["final"]["tau"]
(out / "pipeline.json").write_text(json.dumps(result, indent=2) + "\n")
print(f"{'step':<18}{'seconds':>8}")
for k, v in result["step_seconds"].items():
    print(f"{k:<18}{v:>8}")
print(f"{'total':<18}{result['total_seconds']:>8}")
print("held-out tau:", ", ".join(f"{k} {v:.2f}" for k, v in result["held_out_tau"].items()))
EOF
