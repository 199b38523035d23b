#!/usr/bin/env bash
# Benchmark of the GRPO loop on recipes/grpo_sequence.yaml: steps/s, generated tokens/s and the
# peak resident memory of the training process. Runs in a scratch directory; prints one table.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
kiln="${CARGO_TARGET_DIR:-$root/target}/release/kiln"
steps="${BENCH_STEPS:-40}"
d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
cp -r "$root/configs" "$root/recipes" "$d"
cd "$d"
echo "grpo_sequence bench: $steps steps, $(nproc) cores"
KILN_LOG=warn "$kiln" train recipes/grpo_sequence.yaml --set trainer.steps="$steps" \
  --set trainer.eval_every=0 --set logging.plots=false --set trainer.checkpoint_every=0 > out.txt
run=$(ls -d runs/*/ | head -n1)
python3 - "$run/metrics.jsonl" out.txt <<'PY'
import json, sys, re
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows = rows[2:] or rows  # skip warm-up steps
st = sum(r["time/step_s"] for r in rows) / len(rows)
tok = sum(r["throughput/actions_per_s"] for r in rows) / len(rows)
ro = sum(r["time/rollout_s"] for r in rows) / len(rows)
up = sum(r["time/update_s"] for r in rows) / len(rows)
sc = sum(r["time/score_s"] for r in rows) / len(rows)
out = open(sys.argv[2]).read()
m = re.search(r"peak memory\s+([0-9.]+) MiB", out)
print(f"{'metric':<34}{'value':>12}")
print(f"{'GRPO steps/s':<34}{1/st:>12.2f}")
print(f"{'generated tokens/s (policy actions)':<34}{tok:>12.0f}")
print(f"{'share of step: rollout':<34}{ro/st:>12.1%}")
print(f"{'share of step: old-logp scoring':<34}{sc/st:>12.1%}")
print(f"{'share of step: updates':<34}{up/st:>12.1%}")
print(f"{'peak RSS (MiB)':<34}{(m.group(1) if m else 'n/a'):>12}")
PY
