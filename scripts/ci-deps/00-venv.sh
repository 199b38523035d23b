#!/usr/bin/env bash
# Creates the Python virtual environment the tests use (.venv at the repo root).
set -euo pipefail
cd "$(dirname "$0")/../.."
test -x .venv/bin/python || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
