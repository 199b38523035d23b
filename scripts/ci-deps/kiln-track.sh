#!/usr/bin/env bash
# Python packages that kiln-track's tests use to validate its output with the real libraries:
# wandb (pinned, `wandb leet inspect` / `wandb sync`) and tensorboard (EventAccumulator). Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${KILN_PYTHON:-$REPO/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  python3 -m venv "$REPO/.venv"
  PY="$REPO/.venv/bin/python"
fi
if ! "$PY" -c 'import wandb, sys; sys.exit(0 if wandb.__version__ == "0.31.0" else 1)' 2>/dev/null \
   || ! "$PY" -c 'import tensorboard' 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check "wandb==0.31.0" tensorboard
fi
