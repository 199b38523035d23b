#!/usr/bin/env python3
"""sentence-transformers (PyTorch) side of the sentence-encoder benchmark, same workload as
`cargo run --release -p kiln-lm --example bench_encoder`: encode the first N passages (the `text`
field) of a corpus JSONL file with all-MiniLM-L6-v2 and print passages/s (wall) and passages per
CPU-second (process time, steadier on a shared machine) as one JSON line.

    RAYON_NUM_THREADS=1 /tmp/stvenv/bin/python scripts/lm/bench_st.py \
        [--model .kiln/models/all-minilm-l6-v2] [--corpus ../shared/datasets/corpus/gold_context_union.jsonl] \
        [--n 2000] [--batch-size 32] [--threads N]

Threads: --threads, else RAYON_NUM_THREADS (the variable the kiln side reads), else 2.
Needs torch and sentence-transformers (a throwaway venv: `python3 -m venv /tmp/stvenv &&
/tmp/stvenv/bin/pip install torch sentence-transformers`); never a CI dependency.
"""
import argparse
import json
import os
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(REPO, ".kiln/models/all-minilm-l6-v2"))
    ap.add_argument("--corpus", default=os.path.join(REPO, "../shared/datasets/corpus/gold_context_union.jsonl"))
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("RAYON_NUM_THREADS", "2")))
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    texts = []
    with open(args.corpus) as f:
        for line in f:
            if len(texts) >= args.n:
                break
            texts.append(json.loads(line)["text"])
    model = SentenceTransformer(args.model, device="cpu")
    with torch.inference_mode():
        model.encode(texts[:64], batch_size=args.batch_size)  # warm-up
        t, cpu0 = time.perf_counter(), time.process_time()
        emb = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
        s, cpu = time.perf_counter() - t, time.process_time() - cpu0
    tok = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
    n_tokens = sum(len(x) for x in tok)
    print(json.dumps({
        "impl": "sentence-transformers",
        "torch": torch.__version__,
        "threads": args.threads,
        "batch_size": args.batch_size,
        "passages": len(texts),
        "tokens": n_tokens,
        "dim": int(emb.shape[1]),
        "seconds": round(s, 3),
        "cpu_seconds": round(cpu, 2),
        "passages_per_s": round(len(texts) / s, 1),
        "tokens_per_s": round(n_tokens / s, 1),
        "passages_per_cpu_s": round(len(texts) / cpu, 1),
    }))


if __name__ == "__main__":
    main()
