#!/usr/bin/env python3
"""Generate the LoRA parity fixture of kiln-lm (crates/kiln-lm/tests/lora.rs) with PyTorch +
transformers + peft as the reference implementation.

Run once, by hand, in a scratch venv (CI never runs it; the Rust test reads the committed output):

    python3 -m venv /tmp/tvenv
    /tmp/tvenv/bin/pip install torch transformers peft safetensors numpy
    /tmp/tvenv/bin/python scripts/lm/make_lora_fixture.py crates/kiln-lm/tests/fixtures/tiny-llama

On the tiny random Llama of the parity fixtures (`<dir>/config.json`, `<dir>/model.safetensors`) it
attaches peft LoRA adapters (r = 4, alpha = 8, no dropout) to all seven projections, sets their
factors to seeded random values (B != 0, so that both factors get gradients), and takes two AdamW
steps (lr 1e-2, betas 0.9 / 0.999, eps 1e-8, no weight decay) on the mean next-token
cross-entropy of a fixed batch, training the adapters only. It writes into `<dir>`:
  lora_init.safetensors   the initial factors in kiln's layout: `layers.{i}.{module}.a` [d_in, r]
                          (peft's lora_A.weight transposed) and `.b` [r, d_out] (lora_B.weight^T)
  lora_expected.json      input_ids, the loss and logits before the first step, the gradients of
                          every factor at the first step (kiln layout, flat), the factors after each
                          step, the loss at the second step and the logits after both steps
"""

import json
import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

torch.set_num_threads(2)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 4, 8.0, 1e-2


def flat(t):
    return [float(x) for x in t.detach().reshape(-1).tolist()]


def adapters(model):
    """(layer, module) -> (lora_A Linear, lora_B Linear) of the peft model."""
    out = {}
    for i, layer in enumerate(model.base_model.model.model.layers):
        for m in MODULES:
            parent = layer.self_attn if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else layer.mlp
            lin = getattr(parent, m)
            out[(i, m)] = (lin.lora_A["default"], lin.lora_B["default"])
    return out


def loss_of(model, ids):
    logits = model(input_ids=ids).logits  # [B, T, V]
    lp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return nll.mean(), logits


def main():
    d = sys.argv[1] if len(sys.argv) > 1 else "crates/kiln-lm/tests/fixtures/tiny-llama"
    base = LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.float32, attn_implementation="eager")
    cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=MODULES, bias="none")
    model = get_peft_model(base, cfg)
    model.train()
    g = torch.Generator().manual_seed(7)
    init = {}
    ads = adapters(model)
    with torch.no_grad():
        for (i, m), (a, b) in ads.items():
            a.weight.copy_(0.1 * torch.randn(a.weight.shape, generator=g))
            b.weight.copy_(0.1 * torch.randn(b.weight.shape, generator=g))
            init[f"layers.{i}.{m}.a"] = a.weight.t().contiguous().clone()
            init[f"layers.{i}.{m}.b"] = b.weight.t().contiguous().clone()
    save_file(init, os.path.join(d, "lora_init.safetensors"))

    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 12), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == 2 * len(ads), "only the adapters train"
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    loss0, logits0 = loss_of(model, ids)
    opt.zero_grad()
    loss0.backward()
    grads = {}
    for (i, m), (a, b) in ads.items():
        grads[f"layers.{i}.{m}.a"] = flat(a.weight.grad.t())
        grads[f"layers.{i}.{m}.b"] = flat(b.weight.grad.t())
    opt.step()
    after1 = {}
    for (i, m), (a, b) in ads.items():
        after1[f"layers.{i}.{m}.a"] = flat(a.weight.t())
        after1[f"layers.{i}.{m}.b"] = flat(b.weight.t())
    loss1, _ = loss_of(model, ids)
    opt.zero_grad()
    loss1.backward()
    opt.step()
    after2 = {}
    for (i, m), (a, b) in ads.items():
        after2[f"layers.{i}.{m}.a"] = flat(a.weight.t())
        after2[f"layers.{i}.{m}.b"] = flat(b.weight.t())
    with torch.no_grad():
        _, logits2 = loss_of(model, ids)
    out = {
        "reference": f"peft {__import__('peft').__version__}, torch {torch.__version__}",
        "rank": RANK,
        "alpha": ALPHA,
        "lr": LR,
        "input_ids": ids.tolist(),
        "loss0": loss0.item(),
        "logits0": flat(logits0),
        "grads0": grads,
        "after1": after1,
        "loss1": loss1.item(),
        "after2": after2,
        "logits2": flat(logits2),
    }
    with open(os.path.join(d, "lora_expected.json"), "w") as f:
        json.dump(out, f)
    print(f"loss {loss0.item():.6f} -> {loss1.item():.6f}; wrote lora_init.safetensors, lora_expected.json to {d}")


if __name__ == "__main__":
    main()
