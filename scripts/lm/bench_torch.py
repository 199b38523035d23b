#!/usr/bin/env python3
"""PyTorch (transformers) side of the SmolLM2-135M benchmark, same workloads as
`cargo run --release -p kiln-lm --example bench_smollm2`:
batched greedy generation (batch 8, 128 new tokens, KV cache) and a train step (forward +
backward of the mean token NLL, batch 4 x 256). Same thread count (default 2). Prints JSON.

    /work/venv-torch/bin/python scripts/lm/bench_torch.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

threads = int(os.environ.get("RAYON_NUM_THREADS", "2"))
torch.set_num_threads(threads)
path = sys.argv[1]
d, f = os.path.split(path)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
g = torch.Generator().manual_seed(0)
prompts = torch.randint(100, 40000, (8, 8), generator=g)
with torch.no_grad():
    model.generate(prompts[:1], attention_mask=torch.ones_like(prompts[:1]), max_new_tokens=4, do_sample=False)
    t = time.perf_counter()
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=128, min_new_tokens=128,
                         do_sample=False, eos_token_id=None, pad_token_id=2)
    gen_s = time.perf_counter() - t
n = (out.shape[1] - 8) * 8
model.train()
toks = torch.randint(100, 40000, (4, 256), generator=g)
steps = []
for _ in range(3):
    t = time.perf_counter()
    logits = model(input_ids=toks).logits
    logp = torch.log_softmax(logits[:, :-1], -1)
    loss = -logp.gather(-1, toks[:, 1:, None]).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)
    steps.append(time.perf_counter() - t)
print(json.dumps({"impl": "pytorch", "torch": torch.__version__, "threads": threads, "gen_tokens": n,
                  "gen_s": round(gen_s, 3), "gen_tok_per_s": round(n / gen_s, 1), "train_step_s": round(min(steps), 3)}))
