#!/usr/bin/env bash
# The SmolLM2 drafters from scratch, resumable: run it again (same budgets) after an
# interruption and it skips the finished steps and resumes the interrupted one exactly
# (generated data per shard, training from its last checkpoint, every 5 minutes).
#
#   bash scripts/train_smollm2_drafters.sh            # 2 threads; logs in runs/smollm2/*.log
#   THREADS=1 bash scripts/train_smollm2_drafters.sh  # when other jobs share the cores: two threads
#                                                     # then wait on each other (a batch of data took
#                                                     # 14x as long; with one thread about 2x)
#
# Budgets (minutes of each step, over all sessions; docs/smollm2.md has the numbers):
#   held-out and calibration continuations  ~2 each (72 prompts each)
#   training data                           until DATA_TOKENS (1,000,000) are stored, at most DATA_MIN (240)
#   DFlash backbone                         DFLASH_MIN (180; its LM head over the batch's stored
#                                           Top-32 plus 2048 uniform tokens: 3x the steps per minute)
#   DFlash 2 on the frozen backbone         DFLASH2_MIN (60)
#   DSpark on the frozen backbone           DSPARK_MIN (60)
#   fit-proxy, fit-prior (dflash2, dspark)  ~15 together
set -euo pipefail
# The repository root (ROOT= when a copy of this script runs, so that editing it cannot disturb a run).
cd "${ROOT:-$(dirname "$0")/..}"
PY=${PY:-.venv/bin/python}
THREADS=${THREADS:-2}
DATA_MIN=${DATA_MIN:-240}
DATA_TOKENS=${DATA_TOKENS:-1000000}
DFLASH_MIN=${DFLASH_MIN:-180}
DFLASH2_MIN=${DFLASH2_MIN:-60}
DSPARK_MIN=${DSPARK_MIN:-60}
RUNS=runs/smollm2
# The drafters' shape: 2 layers with a 1024-wide MLP, rank 16 for the path selector and the
# Markov head: 20.9 MB of bf16 weights for the three (the issue's limit: 25 MB).
SHAPE=(--layers 2 --intermediate-size 1024)
mkdir -p "$RUNS"

step() {  # step NAME RESUME_MARKER COMMAND...: run unless done, with --resume once the run has state
  local name=$1 marker=$2; shift 2
  if [[ -f $RUNS/$name.done ]]; then echo "== $name: done"; return; fi
  for attempt in 1 2 3 4 5; do  # a failed start or a crash (e.g. the extension rebuilt under it): resume
    local resume=()
    [[ -e $marker ]] && resume=(--resume)
    echo "== $name (attempt $attempt): $* ${resume[*]}" | tee -a "$RUNS/$name.log"
    if "$@" "${resume[@]}" >>"$RUNS/$name.log" 2>&1; then
      touch "$RUNS/$name.done"
      return
    fi
    sleep 60
  done
  echo "== $name failed; see $RUNS/$name.log" >&2
  exit 1
}

step data_heldout $RUNS/data_heldout/progress.json $PY -m flashspark train data --target smollm2 \
  --split heldout --max-prompts 24 --minutes 30 --threads "$THREADS"
step data_calibration $RUNS/data_calibration/progress.json $PY -m flashspark train data --target smollm2 \
  --split calibration --max-prompts 24 --minutes 30 --threads "$THREADS"
step data $RUNS/data/progress.json $PY -m flashspark train data --target smollm2 --minutes "$DATA_MIN" \
  --max-tokens "$DATA_TOKENS" --threads "$THREADS"
step dflash $RUNS/dflash/ckpt.pt $PY -m flashspark train dflash --target smollm2 "${SHAPE[@]}" \
  --minutes "$DFLASH_MIN" --threads "$THREADS" --batch-size 8 --lr 1e-3 --eval-every 10 --eval-sequences 72 \
  --head-negatives 2048

# DFlash 2 and DSpark are trained on the exported backbone and ship only their own parts: a
# backbone exported after one of them started (trained on) makes that run stale. It starts over,
# the stale run kept beside it.
BACKBONE=python/flashspark/assets/smollm2/dflash/model.safetensors
for derived in dflash2 dspark; do
  if [[ -e $RUNS/$derived/ckpt.pt && $BACKBONE -nt $RUNS/$derived/ckpt.pt && ! -f $RUNS/$derived.done ]] ||
     [[ -f $RUNS/$derived.done && $BACKBONE -nt $RUNS/$derived.done ]]; then
    stale=$RUNS/$derived.stale-$(date -u +%Y%m%dT%H%M%S)
    echo "== $derived: the backbone changed since it started; restarting it ($stale keeps the old run)"
    mv "$RUNS/$derived" "$stale"
    rm -f "$RUNS/$derived.done" "$RUNS"/fit_*.done
  fi
done
step dflash2 $RUNS/dflash2/ckpt.pt $PY -m flashspark train dflash2 --target smollm2 "${SHAPE[@]}" \
  --selector-rank 16 --minutes "$DFLASH2_MIN" --threads "$THREADS" --batch-size 8 --lr 5e-4 --eval-every 10 \
  --eval-sequences 72
step dspark $RUNS/dspark/ckpt.pt $PY -m flashspark train dspark --target smollm2 "${SHAPE[@]}" \
  --markov-rank 16 --minutes "$DSPARK_MIN" --threads "$THREADS" --batch-size 8 --lr 5e-4 --eval-every 10 \
  --eval-sequences 72 --calib-sequences 72
# 24 calibration prompts of each kind (chat, code, prose), 64 new tokens: a few minutes per fit.
FIT=(--model smollm2 --prompts 24 --max-new-tokens 64 --threads "$THREADS")
step fit_proxy /nonexistent $PY -m flashspark fit-proxy "${FIT[@]}"
step fit_prior_dflash2 /nonexistent $PY -m flashspark fit-prior dflash2 "${FIT[@]}"
step fit_prior_dspark /nonexistent $PY -m flashspark fit-prior dspark "${FIT[@]}"
echo "== all done: python/flashspark/assets/smollm2/"
