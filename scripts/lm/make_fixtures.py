#!/usr/bin/env python3
"""Generate the kiln-lm parity fixtures (tiny random Llama, Qwen2 and a bidirectional
LLaDA-style model) with PyTorch + transformers as the reference implementation.

Run once, by hand, in a scratch venv (CI never runs it; the Rust tests read the committed output):

    python3 -m venv /work/venv-torch
    /work/venv-torch/bin/pip install torch transformers safetensors numpy
    /work/venv-torch/bin/python scripts/lm/make_fixtures.py crates/kiln-lm/tests/fixtures

For each model it writes `<out>/<name>/`:
  config.json, model.safetensors (or sharded + model.safetensors.index.json), expected.json with
  - `input_ids` [B, T] and `logits` (flat, [B, T, V]) of an unpadded forward in float32,
  - `padded`: a left-padded batch (`input_ids`, `attention_mask`, `logits` at real positions),
  - `greedy`: prompts and the 20 greedy tokens transformers' `generate` returns (causal models),
  - `llada`: LLaDA-style masked-diffusion decoding (bidirectional model) following the published
    `generate` of GSAI-ML/LLaDA (low-confidence remasking, temperature 0).
Weights saved as bf16 / f16 are rounded first, and the reference runs in float32 on the rounded
values, so the Rust side (which upcasts to f32) must match to 1e-4.
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(2)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


def round_to(model, dtype):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))


def flat(t):
    return [float(x) for x in t.reshape(-1).tolist()]


def logits_of(model, ids, mask=None, bidirectional=False):
    with torch.no_grad():
        if bidirectional:
            b, t = ids.shape
            keep = torch.ones(b, t, dtype=torch.bool) if mask is None else mask.bool()
            # 4D boolean mask (True = may attend): every query sees every real key.
            m4 = keep[:, None, None, :].expand(b, 1, t, t)
            return model(input_ids=ids, attention_mask=m4).logits.float()
        if mask is None:
            return model(input_ids=ids).logits.float()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


def greedy(model, prompts, n_new, pad_id):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad_id,
            )
        new = g[0, len(p):].tolist()
        # Smallest top-1/top-2 logit gap along the path: a tiny gap would make the fixture
        # fragile against 1e-6 numerical differences.
        full = g[:, :-1]
        lg = logits_of(model, full)[0, len(p) - 1:]
        top2 = lg.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        out.append({"prompt": p, "tokens": new, "min_top2_gap": gap})
    return out


def num_transfer_tokens(mask_index, steps):
    # LLaDA: spread the masked count of the block evenly over the steps, remainder first.
    n = mask_index.sum(dim=1, keepdim=True)
    base = n // steps
    rem = n % steps
    out = torch.zeros(n.size(0), steps, dtype=torch.int64) + base
    for i in range(n.size(0)):
        out[i, : rem[i]] += 1
    return out


def llada_generate(model, prompt, steps, gen_length, block_length, mask_id, remasking):
    """LLaDA's published `generate` semantics, temperature 0, no CFG (reference for kiln)."""
    x = torch.full((1, prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt
    lp = prompt.shape[1]
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    g = torch.Generator().manual_seed(0)
    for b in range(num_blocks):
        s, e = lp + b * block_length, lp + (b + 1) * block_length
        block_mask = x[:, s:e] == mask_id
        ntt = num_transfer_tokens(block_mask, steps_per_block)
        for i in range(steps_per_block):
            mask_index = x == mask_id
            logits = logits_of(model, x, bidirectional=True)
            x0 = logits.argmax(dim=-1)
            if remasking == "low_confidence":
                p = F.softmax(logits.to(torch.float64), dim=-1)
                x0_p = torch.gather(p, -1, x0.unsqueeze(-1)).squeeze(-1)
            else:
                x0_p = torch.rand(x0.shape, generator=g, dtype=torch.float64)
            x0_p[:, e:] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p, torch.tensor(-float("inf"), dtype=torch.float64))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(conf.shape[0]):
                _, idx = torch.topk(conf[j], k=int(ntt[j, i]))
                transfer[j, idx] = True
            x[transfer] = x0[transfer]
    return x[0, lp:].tolist()


def write(out_dir, name, model, dtype, cfg_patch, expected, shard=None):
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    save = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    save.save_pretrained(d, **kwargs)
    model.to(torch.float32)
    for f in ("generation_config.json",):
        p = os.path.join(d, f)
        if os.path.exists(p):
            os.remove(p)
    cp = os.path.join(d, "config.json")
    with open(cp) as f:
        cfg = json.load(f)
    cfg.update(cfg_patch)
    with open(cp, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(d, "expected.json"), "w") as f:
        json.dump(expected, f)


def main(out_dir):
    torch.manual_seed(0)
    vocab = 128
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 100, 127], [1, 77, 3, 45, 12, 8, 99, 64]])
    pad_ids = torch.tensor([[0, 0, 0, 1, 17, 40, 88, 3], [1, 5, 9, 17, 33, 65, 100, 127]])
    pad_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    prompts = [[1, 17, 40, 88, 3], [1, 100, 2 + 3, 7, 7, 64, 90, 11, 23], [1, 42]]

    models = [
        (
            "tiny-llama",
            LlamaForCausalLM(
                LlamaConfig(
                    num_key_value_heads=2,
                    tie_word_embeddings=True,
                    rope_parameters={
                        "rope_type": "llama3",
                        "rope_theta": 10000.0,
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16,
                    },
                    **common,
                )
            ),
            torch.float32,
            {},
            None,
        ),
        (
            "tiny-qwen2",
            Qwen2ForCausalLM(
                Qwen2Config(
                    num_key_value_heads=2,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                    **common,
                )
            ),
            torch.bfloat16,
            {},
            "60KB",
        ),
        (
            "tiny-llada",
            LlamaForCausalLM(
                LlamaConfig(
                    num_key_value_heads=4,
                    tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                    **common,
                )
            ),
            torch.float16,
            {"model_type": "llada", "architectures": ["LLaDAModelLM"], "mask_token_id": 126},
            None,
        ),
    ]
    for seed, (name, model, dtype, patch, shard) in enumerate(models):
        bidir = name == "tiny-llada"
        model.eval()
        randomize(model, 1000 + seed)
        round_to(model, dtype)
        if bidir:
            for layer in model.model.layers:
                layer.self_attn.is_causal = False
        lg = logits_of(model, ids, bidirectional=bidir)
        plg = logits_of(model, pad_ids, pad_mask, bidirectional=bidir)
        exp = {
            "reference": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, float32",
            "input_ids": ids.tolist(),
            "logits_shape": list(lg.shape),
            "logits": flat(lg),
            "padded": {
                "input_ids": pad_ids.tolist(),
                "attention_mask": pad_mask.tolist(),
                "logits": flat(plg),
            },
        }
        if bidir:
            prompt = torch.tensor([[1, 17, 40, 88, 3, 9]])
            exp["llada"] = [
                {
                    "prompt": prompt[0].tolist(),
                    "steps": steps,
                    "gen_length": 16,
                    "block_length": bl,
                    "remasking": "low_confidence",
                    "tokens": llada_generate(model, prompt, steps, 16, bl, 126, "low_confidence"),
                }
                for steps, bl in [(16, 16), (8, 8), (16, 4)]
            ]
        else:
            exp["greedy"] = greedy(model, prompts, 20, 0)
            # Batched left-padded greedy must give the same tokens as one-by-one.
        write(out_dir, name, model, dtype, patch, exp, shard)
        print(name, "ok", {k: v for k, v in exp.items() if k in ("greedy",)} if not bidir else exp["llada"])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "crates/kiln-lm/tests/fixtures")
