#!/usr/bin/env python3
"""Table of scripts/bench/side_by_side.sh: OUT_DIR/{kiln,pytorch}.jsonl and the two models' configs ->
markdown with seconds, the ratio PyTorch time / kiln time (> 1 = kiln faster), issue 17's target, and the
matmul GFLOP/s each reaches (weight matmuls only, attention left out) next to the machine's f32 matmul peak."""
import json
import os
import sys

out = sys.argv[1]
rows = lambda f: {r["workload"]: r for r in map(json.loads, open(os.path.join(out, f))) if r.get("workload")}
kiln, torch = rows("kiln.jsonl"), rows("pytorch.jsonl")


def matmul_params(c):
    h, i, L, V = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c.get("num_key_value_heads", c["num_attention_heads"]) * (h // c["num_attention_heads"])
    return L * (2 * h * h + 2 * h * kv + 3 * h * i) + h * V


smol = matmul_params(json.load(open(os.path.join(out, "smollm2_config.json"))))
tiny = matmul_params(json.load(open(os.path.join(out, "tiny_config.json"))))


def flops(w, r):
    if w.startswith("smollm2_gen"):
        b = int(w.split("_")[-1].split("x")[0])
        return 2 * smol * (r["tokens"] + 8 * b)
    if w == "smollm2_train_full_4x256":
        return 6 * smol * r["tokens"]
    if w == "smollm2_train_lora_4x256":
        return 4 * smol * r["tokens"]  # no weight gradients for the frozen base
    if w.startswith("tiny_gen"):
        b = int(w.split("_b")[-1])
        return 2 * tiny * (r["tokens"] + 64 * b)
    if w == "grpo_step":
        prefill = 20 * sum(400 + t * (48 + 150) for t in range(4))
        return 2 * smol * (prefill + r["tokens"]) + 4 * smol * 20 * r["row_len"]
    return None


target = {"smollm2_gen_8x128": ">= 2x", "smollm2_gen_32x64": ">= 2x", "smollm2_train_full_4x256": ">= 1.2x",
          "smollm2_train_lora_4x256": ">= 2x PyTorch full", "tiny_gen_b20": ">= 4x", "tiny_gen_b64": "",
          "grpo_step": ""}
peak = torch.get("matmul_peak", {}).get("gflops")
print(f"\nmachine f32 matmul peak (PyTorch BLAS, 2048^3, same threads): {peak} GFLOP/s\n")
print("| workload | kiln s | PyTorch s | PyTorch s / kiln s | target | kiln GFLOP/s | PyTorch GFLOP/s |")
print("|---|---:|---:|---:|---|---:|---:|")
for w in target:
    k, t = kiln.get(w), torch.get(w)
    if not k or not t:
        continue
    f = flops(w, k)
    ratio = t["seconds"] / k["seconds"]
    note = target[w]
    if w == "smollm2_train_lora_4x256" and "smollm2_train_full_4x256" in torch:
        note += f" (= {torch['smollm2_train_full_4x256']['seconds'] / k['seconds']:.2f}x)"
    print(f"| {w} | {k['seconds']:.3f} | {t['seconds']:.3f} | {ratio:.2f}x | {note} | {f / k['seconds'] / 1e9:.1f} | "
          f"{f / t['seconds'] / 1e9:.1f} |")
for w in ("grpo_step",):
    if w in kiln and w in torch:
        k, t = kiln[w], torch[w]
        print(f"\n{w}: rollout kiln {k['rollout_s']:.1f} s vs PyTorch {t['rollout_s']:.1f} s; update kiln "
              f"{k['update_s']:.1f} s vs PyTorch {t['update_s']:.1f} s (rows of {k['row_len']} tokens)")
