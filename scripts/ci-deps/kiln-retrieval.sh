#!/usr/bin/env bash
# Python packages for kiln-retrieval: `requests` (the Search-R1-style interop client test) and the peer
# benchmark's `bm25s` + `PyStemmer` + `numba` (bm25s's fast backend; scripts/retrieval/bench.sh, run by
# `just bench`). Idempotent.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${KILN_PYTHON:-$REPO/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  python3 -m venv "$REPO/.venv"
  PY="$REPO/.venv/bin/python"
fi
if ! "$PY" -c 'import requests, bm25s, Stemmer, numba' 2>/dev/null; then
  "$PY" -m pip install -q --disable-pip-version-check "requests==2.34.2" "bm25s==0.3.16" "PyStemmer==3.1.0" \
    "numba==0.68.1"
fi
