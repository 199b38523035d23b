#!/usr/bin/env python3
"""Manual check that `kiln export` output opens in transformers and gives the fixture logits.

    KILN_EXPORT_DIR=/tmp/kx cargo test --release -p kiln-lm --test parity -- --ignored export_for
    /work/venv-torch/bin/python scripts/lm/check_export.py /tmp/kx crates/kiln-lm/tests/fixtures
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM

out, fixtures = sys.argv[1], sys.argv[2]
for name in ["tiny-llama", "tiny-qwen2"]:
    model = AutoModelForCausalLM.from_pretrained(f"{out}/{name}", dtype=torch.float32).eval()
    exp = json.load(open(f"{fixtures}/{name}/expected.json"))
    with torch.no_grad():
        lg = model(input_ids=torch.tensor(exp["input_ids"])).logits
    want = torch.tensor(exp["logits"]).reshape(lg.shape)
    diff = (lg - want).abs().max().item()
    print(f"{name}: {type(model).__name__} max |diff| {diff:.2e}")
    assert diff < 1e-4, name
print("export opens in transformers: ok")
