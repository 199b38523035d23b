#!/usr/bin/env bash
# kiln vs PyTorch, side by side on the same workloads (issue 17's targets): SmolLM2-135M generation 8 x 128 and
# 32 x 64, train step 4 x 256 full and LoRA r = 16, the tiny agent's generation at batch 20 and 64, and the
# compute of one default Search-R1 GRPO step (rollouts + update, LoRA). Both at the same thread count
# (THREADS, default 2), back to back, each workload in both before the next table row is read.
# Prints a table of seconds, ratios (PyTorch time / kiln time: > 1 = kiln faster) and matmul GFLOP/s next to
# the machine's f32 matmul peak (PyTorch BLAS, 2048^3).
#
#   bash scripts/bench/side_by_side.sh [OUT_DIR] [WORKLOAD,...]
#
# The PyTorch side runs in a venv of its own (BENCH_VENV, default .venv-bench): torch, transformers, peft
# and gguf from PyPI, installed on first use.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$root/target/bench-side}"
only="${2:-}"
threads="${THREADS:-2}"
venv="${BENCH_VENV:-$root/.venv-bench}"
mkdir -p "$out"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, transformers, peft, gguf" 2>/dev/null; then
    echo "installing the PyTorch side into $venv (torch, transformers, peft, gguf) ..."
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q torch transformers peft gguf
fi
gguf=$(python3 -c "import json; print(json.load(open('$root/.kiln/models.json'))['smollm2-135m'])") || {
    echo "SmolLM2 is not installed: run \`just setup\` first" >&2; exit 1; }
(cd "$root" && cargo build --release -q -p kiln-lm --example bench_side)
echo "kiln side ($threads threads) ..."
RAYON_NUM_THREADS=$threads "${CARGO_TARGET_DIR:-$root/target}/release/examples/bench_side" "$out" $only | tee "$out/kiln.jsonl"
echo "PyTorch side ($threads threads) ..."
RAYON_NUM_THREADS=$threads "$venv/bin/python" "$root/scripts/bench/side_by_side.py" "$gguf" "$out" $only \
    | tee "$out/pytorch.jsonl"
python3 "$root/scripts/bench/side_by_side_table.py" "$out"
