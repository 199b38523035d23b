#!/usr/bin/env bash
# Issue 16, item 3: does DAPO's dynamic sampling turn the sparse search reward into held-out gains?
# From the recipes' 2,000-step warm start (created on first use), 100 GRPO steps each, same
# questions_per_step (4 x G = 5), lr 3e-4, KL 0.001; then the final table on the 200 held-out test
# questions (direct / RAG / agent).
#   warm-start      1 step at lr 1e-12: the warm start's own table (the control all rows pair with)
#   r1              Search-R1 as in the recipe (uniform groups skipped)
#   r1-dynamic      + search.dynamic_sampling (up to 3 x 4 questions drawn per step)
#   r2-dynamic      Search-R2 (refiner, process reward, joint) + dynamic sampling
# SET=ablation (one lane) runs instead, same warm start and budget:
#   r2              Search-R2 without dynamic sampling (is the draw what makes r2-dynamic hold?)
#   r2-lr1e-4, r2-dynamic-lr1e-4, r1-lr1e-4   the same at a third of the step size
# SET=long: r2-lr1e-4-120 and r1-lr1e-4-120, 120 steps at lr 1e-4 (twice the budget).
# SET=smollm2: the default (pre-trained) recipes: warm-start = the SmolLM2 cold start's own table
# (recipes/search_r1.yaml, 1 step at lr 1e-12; it creates the cold start), r2 and r1 = recipes/search_r2.yaml
# and recipes/search_r1.yaml as shipped (STEPS unset: the recipes' own step count); EVAL_LIMIT=0 skips
# the 500-question pass (the recipes' final table has 100 questions).
# Two lanes of one thread each (RAYON_NUM_THREADS=1); re-running continues unfinished runs from their
# newest checkpoint (`kiln train --resume`) and skips finished ones.
# Usage (from a directory holding recipes/ and configs/): bash scripts/bench/search_dynamic.sh [OUT]
# then: python3 scripts/bench/search_dynamic_table.py OUT (STEPS=60 is what the README reports).
set -euo pipefail
KILN=${KILN:-target/release/kiln}
OUT=${1:-runs/dynamic}
STEPS=${STEPS:-100}
ONLY=${ONLY:-}
mkdir -p "$OUT"
common=(--set "output_dir=$OUT" --set logging.plots=false --set trainer.keep_checkpoints=1)
if [ "${SET:-dynamic}" != smollm2 ]; then
  common+=(--set "trainer.steps=$STEPS" --set trainer.checkpoint_every=10)
fi

run() { # name, recipe, extra --set args...
  local name=$1 recipe=$2; shift 2
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local dir
  dir=$(ls -d "$OUT/$name"-2* 2>/dev/null | head -1 || true)
  local steps=$STEPS
  for a in "$@"; do case $a in trainer.steps=*) steps=${a#trainer.steps=} ;; esac; done
  if [ -n "$dir" ] && ls "$dir"/eval/qa-step-"$steps"/summary.json >/dev/null 2>&1; then
    echo "$name: done ($dir)"; return
  fi
  if [ -n "$dir" ] && ls -d "$dir"/checkpoints/step-* >/dev/null 2>&1; then
    echo "$name: resuming $dir"
    RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1} "$KILN" train --resume "$dir" >> "$OUT/$name.log" 2>&1
  else
    [ -n "$dir" ] && rm -rf "$dir"
    echo "$name: starting"
    RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-1} "$KILN" train "$recipe" "${common[@]}" --set "name=$name" "$@" \
      > "$OUT/$name.log" 2>&1
  fi
  echo "$name: finished"
}

dyn=(--set search.dynamic_sampling.enabled=true --set search.dynamic_sampling.max_draw_factor=3)
if [ "${SET:-dynamic}" = smollm2 ]; then
  STEPS='*'   # the recipes' own step count
  RAYON_NUM_THREADS=${WARM_THREADS:-2} run warm-start recipes/search_r1.yaml --set optim.lr=1e-12 \
    --set trainer.steps=1 --set trainer.checkpoint_every=1
  ( run r2 recipes/search_r2.yaml ) &
  ( run r1 recipes/search_r1.yaml ) &
  wait
  EVAL_LIMIT=${EVAL_LIMIT:-0}
else
# The warm start first, alone (it creates the shared warm-start folder when missing).
RAYON_NUM_THREADS=${WARM_THREADS:-2} run warm-start recipes/search_r1_tiny.yaml --set optim.lr=1e-12 --set trainer.steps=1
fi
if [ "${SET:-dynamic}" = smollm2 ]; then
  :
elif [ "${SET:-dynamic}" = long ]; then
  run r1-lr1e-4-120 recipes/search_r1_tiny.yaml --set optim.lr=1e-4 --set trainer.steps=120
  run r2-lr1e-4-120 recipes/search_r2_tiny.yaml --set optim.lr=1e-4 --set trainer.steps=120
elif [ "${SET:-dynamic}" = ablation ]; then
  run r2 recipes/search_r2_tiny.yaml
  run r2-lr1e-4 recipes/search_r2_tiny.yaml --set optim.lr=1e-4
  run r1-lr1e-4 recipes/search_r1_tiny.yaml --set optim.lr=1e-4
  run r2-dynamic-lr1e-4 recipes/search_r2_tiny.yaml "${dyn[@]}" --set optim.lr=1e-4
else
  ( run r1 recipes/search_r1_tiny.yaml; run r2-dynamic recipes/search_r2_tiny.yaml "${dyn[@]}" ) &
  ( run r1-dynamic recipes/search_r1_tiny.yaml "${dyn[@]}" ) &
  wait
fi
# Agent EM of every run on the whole test split (500 questions; the final table has 200).
[ "${EVAL_LIMIT:-500}" = 0 ] && exit 0
for d in "$OUT"/*-2*/; do
  ls -d "$d"eval/*-synthetic-test >/dev/null 2>&1 && continue
  RAYON_NUM_THREADS=${EVAL_THREADS:-2} "$KILN" eval "$d" --task qa --data synthetic --mode agent --limit 500 \
    > "$OUT/eval500-$(basename "$d").log" 2>&1
done
python3 "$(dirname "$0")/search_dynamic_table.py" "$OUT"
