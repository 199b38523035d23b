#!/usr/bin/env python3
"""PyTorch side of scripts/bench/side_by_side.sh: the workloads of
`cargo run --release -p kiln-lm --example bench_side` (see its doc), same shapes, same thread count, eager
transformers (+ peft for LoRA). Prints one JSON line per workload.

    python scripts/bench/side_by_side.py GGUF_PATH CONFIG_DIR [WORKLOAD,...]

CONFIG_DIR holds the tiny agent's `tiny_config.json` written by the kiln side.
"""
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

threads = int(os.environ.get("RAYON_NUM_THREADS", "2"))
torch.set_num_threads(threads)
gguf, cfg_dir = sys.argv[1], sys.argv[2]
only = [w for w in sys.argv[3].split(",") if w] if len(sys.argv) > 3 else []
want = lambda w: not only or w in only
g = torch.Generator().manual_seed(0)


def emit(name, seconds, tokens, **extra):
    print(json.dumps({"impl": "pytorch", "workload": name, "seconds": round(seconds, 4), "tokens": tokens,
                      "torch": torch.__version__, **extra}), flush=True)


def gen(model, b, plen, new, vocab, sample=False):
    prompts = torch.randint(3, vocab, (b, plen), generator=g)
    kw = dict(do_sample=sample, eos_token_id=None, pad_token_id=0, max_new_tokens=new, min_new_tokens=new)
    if sample:
        kw.update(temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        model.generate(prompts[:1], attention_mask=torch.ones_like(prompts[:1]), **{**kw, "max_new_tokens": 2,
                                                                                    "min_new_tokens": 2})
        t = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
    return time.perf_counter() - t, (out.shape[1] - plen) * b


def fwd_bwd(model, rows, micro):
    for i in range(0, rows.shape[0], micro):
        toks = rows[i:i + micro]
        logits = model(input_ids=toks).logits
        logp = torch.log_softmax(logits[:, :-1], -1)
        loss = -logp.gather(-1, toks[:, 1:, None]).mean()
        loss.backward()
    model.zero_grad(set_to_none=True)


def train(model, rows, micro):
    model.train()
    fwd_bwd(model, rows[:1], 1)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fwd_bwd(model, rows, micro)
        best = min(best, time.perf_counter() - t)
    return best


if True:  # always: the roofline every other figure is read against
    # The machine's f32 matmul roofline as PyTorch's BLAS reaches it: 2048^3 products.
    a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    s = time.perf_counter() - t
    emit("matmul_peak", s, 0, gflops=round(10 * 2 * 2048 ** 3 / s / 1e9, 1))

d, f = os.path.split(gguf)
smol = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
V = smol.config.vocab_size
for name, b, new in [("smollm2_gen_8x128", 8, 128), ("smollm2_gen_32x64", 32, 64)]:
    if want(name):
        s, n = gen(smol, b, 8, new, V)
        emit(name, s, n)
rows = torch.randint(3, V, (4, 256), generator=g)
if want("smollm2_train_full_4x256"):
    emit("smollm2_train_full_4x256", train(smol, rows, 4), 4 * 256)
from peft import LoraConfig, get_peft_model  # noqa: E402

targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
lora = get_peft_model(smol, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
# B starts at zero; give it values so the adapters' backward is the general case (as after a few steps).
with torch.no_grad():
    for n_, p in lora.named_parameters():
        if "lora_B" in n_:
            p.normal_(0, 1e-3, generator=g)
if want("smollm2_train_lora_4x256"):
    emit("smollm2_train_lora_4x256", train(lora, rows, 4), 4 * 256,
         lora_params=sum(p.numel() for p in lora.parameters() if p.requires_grad))
if want("grpo_step"):
    lora.eval()
    lora.merge_adapter()  # sample on merged weights, as kiln's actor does; unmerged for the update
    merged = lora
    ctx = torch.randint(3, V, (20, 400), generator=g)
    t = time.perf_counter()
    generated = 0
    with torch.no_grad():
        for turn in range(4):
            out = merged.generate(input_ids=ctx, attention_mask=torch.ones_like(ctx), do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=48, min_new_tokens=48, eos_token_id=None,
                                  pad_token_id=0)
            generated += (out.shape[1] - ctx.shape[1]) * ctx.shape[0]
            ctx = out
            if turn < 3:
                ctx = torch.cat([ctx, torch.randint(3, V, (20, 150), generator=g)], 1)
    rollout_s = time.perf_counter() - t
    lora.unmerge_adapter()
    lora.train()
    t = time.perf_counter()
    fwd_bwd(lora, ctx, 2)
    update_s = time.perf_counter() - t
    emit("grpo_step", rollout_s + update_s, generated, rollout_s=round(rollout_s, 3), update_s=round(update_s, 3),
         row_len=ctx.shape[1])
del smol, lora
tiny_cfg = json.load(open(os.path.join(cfg_dir, "tiny_config.json")))
tiny = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in tiny_cfg.items() if k != "architectures"})).eval()
for name, b in [("tiny_gen_b20", 20), ("tiny_gen_b64", 64)]:
    if want(name):
        s, n = gen(tiny, b, 64, 48, tiny.config.vocab_size)
        emit(name, s, n)
