#!/usr/bin/env bash
# The decisive diagnostic of Search-R1/R2 GRPO (README, "Can GRPO raise reward at all?"): 16 fixed
# training questions of the synthetic world used as both the training and the evaluation data,
# G = 8, 60 steps, KL 0, lr swept over three values, plus the placebo control (each group trained
# on another group's rewards: same sparsity, same number of updates). A correct GRPO must raise the
# reward on questions it may memorise; under the placebo it must not.
#
# Runs in two lanes of one thread each (RAYON_NUM_THREADS=1). Re-running the script continues
# unfinished runs from their newest checkpoint (`kiln train --resume`) and skips finished ones.
# Needs the warm start of recipes/search_r1_tiny.yaml (created on first use, ~40-60 min on 2 cores).
# Usage: bash scripts/bench/search_diagnostic.sh [OUT_DIR]   (from the directory holding recipes/)
# Replications on other questions: OFFSET=16 (questions 17-32 of the train split), and ONLY="warm-start
# lr3e-4 placebo-lr3e-4" to run a subset of the runs.
set -euo pipefail
KILN=${KILN:-target/release/kiln}
OUT=${1:-runs/diagnostic}
STEPS=${STEPS:-60}
OFFSET=${OFFSET:-0}
ONLY=${ONLY:-}
mkdir -p "$OUT"

# 1. The 16 questions: the first 16 of the cached world's train split (same world as the recipes).
if [ ! -s "$OUT/q16.jsonl" ]; then
  train=$(ls datasets/cache/synthetic/*/train.jsonl 2>/dev/null | head -1 || true)
  if [ -z "$train" ]; then
    "$KILN" synthetic-world >/dev/null
    train=$(ls datasets/cache/synthetic/*/train.jsonl | head -1)
  fi
  sed -n "$((OFFSET + 1)),$((OFFSET + 16))p" "$train" > "$OUT/q16.jsonl"
fi

common=(--set "train_data=$OUT/q16.jsonl" --set "eval_data=$OUT/q16.jsonl"
  --set search.questions_per_step=4 --set search.batch.group_size=8 --set trainer.mini_batch_size=32
  --set "trainer.steps=$STEPS" --set algorithm.kl_beta=0 --set trainer.eval_every=10
  --set trainer.checkpoint_every=10 --set search.eval_questions=16
  --set final_eval.questions=16 --set "final_eval.modes=[agent]" --set "output_dir=$OUT"
  --set logging.plots=false)

run() { # name, extra --set args...
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local dir
  dir=$(ls -d "$OUT/$name"-* 2>/dev/null | head -1 || true)
  local steps=$STEPS
  for a in "$@"; do case $a in trainer.steps=*) steps=${a#trainer.steps=} ;; esac; done
  if [ -n "$dir" ] && [ -f "$dir/checkpoints/step-$steps/state.json" ]; then
    echo "$name: done ($dir)"; return
  fi
  if [ -n "$dir" ] && ls -d "$dir"/checkpoints/step-* >/dev/null 2>&1; then
    echo "$name: resuming $dir"
    RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1} "$KILN" train --resume "$dir" > "$OUT/$name.log" 2>&1
  else
    [ -n "$dir" ] && rm -rf "$dir"
    echo "$name: starting"
    RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1} "$KILN" train recipes/search_r1_tiny.yaml "${common[@]}" --set "name=$name" "$@" \
      > "$OUT/$name.log" 2>&1
  fi
  echo "$name: finished"
}

# 2. "warm-start" is one step at lr 1e-12 (the recipe refuses 0): its evaluation is the warm-started
# policy's EM on the 16 questions (step 0). It runs first and alone, with every thread: when the
# recipe's warm-start folder is missing it creates it, which the other runs then share.
RAYON_NUM_THREADS=${WARM_THREADS:-2} run warm-start --set optim.lr=1e-12 --set trainer.steps=1
# 3. Two lanes of one thread each: (lr 3e-4, placebo at lr 3e-4), (lr 1e-4, lr 1e-3).
( run lr3e-4 --set optim.lr=3e-4; run placebo-lr3e-4 --set optim.lr=3e-4 --set trainer.placebo_rewards=true ) &
( run lr1e-4 --set optim.lr=1e-4; run lr1e-3 --set optim.lr=1e-3 ) &
wait

# 4. The table.
python3 scripts/bench/search_diagnostic_table.py "$OUT"
