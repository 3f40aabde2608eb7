#!/usr/bin/env bash
# The SmolLM2 drafters on this machine's CPU: scripts/gpu_train_smollm2.sh (the one pipeline)
# with CPU budgets, exporting into the shipped assets (python/flashspark/assets/smollm2) and
# keeping its data and runs in runs/smollm2. Resumable: run it again (same budgets) after an
# interruption and it skips the finished steps and resumes the interrupted one exactly
# (generated data per batch, training from its last checkpoint, every 5 minutes).
#
#   nice bash scripts/train_smollm2_drafters.sh            # 2 threads
#   THREADS=1 nice bash scripts/train_smollm2_drafters.sh  # when other jobs share the cores
#
# Budgets (minutes of each step over all sessions; docs/smollm2.md has what they gave). Any of the
# pipeline's variables can be set the same way (LAYERS, INTERMEDIATE, DISTILL, ...).
set -euo pipefail
cd "${ROOT:-$(dirname "$0")/..}"
export DEVICE=cpu TARGET=smollm2 WORK=${WORK:-runs/smollm2} THREADS=${THREADS:-2}
# bf16 matmuls run 10-20x slower than fp32 on these CPUs: fp32 throughout.
export GEN_DTYPE=float32 BF16=0
export GEN_BATCH=${GEN_BATCH:-32} HELD_PROMPTS=${HELD_PROMPTS:-16}
export DATA_MIN=${DATA_MIN:-600} DATA_TOKENS=${DATA_TOKENS:-2000000}
export DFLASH_MIN=${DFLASH_MIN:-240} DFLASH2_MIN=${DFLASH2_MIN:-60} DSPARK_MIN=${DSPARK_MIN:-60}
export BATCH=${BATCH:-8} EVAL_SEQ=${EVAL_SEQ:-72} EVAL_EVERY=${EVAL_EVERY:-10} EXPORT_RESERVE=${EXPORT_RESERVE:-2.5}
# The LM head over the stored Top-32 plus 2048 random tokens: 2.85x the steps per minute (docs/smollm2.md).
export HEAD_NEG=${HEAD_NEG:-2048}
export FIT_PROMPTS=${FIT_PROMPTS:-24} FIT_NEW=${FIT_NEW:-64} FIT_BATCH=${FIT_BATCH:-16}
exec bash scripts/gpu_train_smollm2.sh python/flashspark/assets/smollm2
