#!/usr/bin/env python3
"""Records NAME -> PATH in .kiln/models.json (merging with the names already there), where `kiln` and the
tests look models up (kiln_lm::zoo). Used by setup_smollm2.sh and setup_minilm.sh.
Usage: record_model.py MODELS_JSON NAME PATH"""
import json
import os
import sys

path, name, target = sys.argv[1], sys.argv[2], sys.argv[3]
models = {}
if os.path.exists(path):
    try:
        models = json.load(open(path))
    except ValueError:
        models = {}
models[name] = target
os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
tmp = path + ".tmp"
with open(tmp, "w") as f:
    json.dump(models, f, indent=2, sort_keys=True)
os.replace(tmp, path)
