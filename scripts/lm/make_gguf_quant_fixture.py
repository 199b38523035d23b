#!/usr/bin/env python3
"""Small GGUF with one tensor per supported ggml type, and the values the `gguf` Python package
dequantises them to (the reference for kiln's hand-written dequantisation).

    /work/venv-torch/bin/python scripts/lm/make_gguf_quant_fixture.py crates/kiln-lm/tests/fixtures/gguf

F32/F16/BF16/Q4_0/Q4_1/Q8_0 are quantised from random floats by gguf-py; Q4_K and Q6_K (which
gguf-py can only dequantise) are random block bytes with sane f16 scales.
"""

import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

rng = np.random.default_rng(0)


def main(out):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "quants.gguf")
    w = GGUFWriter(path, arch="llama")
    expected = {}
    rows, cols = 2, 512
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    for name, qt in [("f32", T.F32), ("f16", T.F16), ("bf16", T.BF16), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1), ("q8_0", T.Q8_0)]:
        if qt == T.F32:
            w.add_tensor(name, x)
            expected[name] = x.reshape(-1).tolist()
            continue
        if qt == T.F16:
            data = x.astype(np.float16)
            w.add_tensor(name, data)
            expected[name] = data.astype(np.float32).reshape(-1).tolist()
            continue
        q = quantize(x, qt)
        w.add_tensor(name, q, raw_dtype=qt)
        expected[name] = dequantize(q, qt).reshape(-1).tolist()
    for name, qt in [("q4_k", T.Q4_K), ("q6_k", T.Q6_K)]:
        block, size = GGML_QUANT_SIZES[qt]
        nblocks = rows * cols // block
        raw = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
        d = (rng.random(nblocks) * 0.01 + 0.001).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
        if qt == T.Q4_K:  # d, dmin at the start
            raw[:, 0:2] = d
            raw[:, 2:4] = (rng.random(nblocks) * 0.01).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
        else:  # d at the end
            raw[:, size - 2:size] = d
        raw = raw.reshape(rows, cols // block * size)
        w.add_tensor(name, raw, raw_dtype=qt)
        expected[name] = dequantize(raw, qt).reshape(-1).tolist()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with open(os.path.join(out, "quants_expected.json"), "w") as f:
        json.dump({"shape": [rows, cols], "values": expected}, f)
    print("wrote", path, os.path.getsize(path), "bytes")


if __name__ == "__main__":
    main(sys.argv[1])
