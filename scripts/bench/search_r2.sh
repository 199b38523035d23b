#!/usr/bin/env bash
# Benchmark of Search-R1 vs Search-R2 GRPO steps on the synthetic world (CPU): rollout tokens/s, retrieval
# calls/s, step-time shares and the refiner's overhead per step. Runs in a scratch directory (the warm start
# is built there once and shared by both runs, as in the real recipes).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
kiln="${CARGO_TARGET_DIR:-$root/target}/release/kiln"
steps="${BENCH_STEPS:-8}"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cp -r "$root/configs" "$root/recipes" "$d"
cd "$d"
if [ -d "$root/runs/search/warm-start" ]; then mkdir -p runs/search && cp -r "$root/runs/search/warm-start" runs/search/; fi
common=(--set trainer.steps="$steps" --set trainer.eval_every=0 --set final_eval.questions=0
        --set logging.plots=false --set trainer.checkpoint_every=0)
echo "search_r2 bench: $steps GRPO steps each, $(nproc) cores"
KILN_LOG=warn "$kiln" train recipes/search_r1_tiny.yaml "${common[@]}" > r1.txt
KILN_LOG=warn "$kiln" train recipes/search_r2_tiny.yaml "${common[@]}" > r2.txt
python3 "$root/scripts/bench/search_r2.py" runs/search_r1-*/ runs/search_r2-*/ --skip 1
