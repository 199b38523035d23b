#!/usr/bin/env python3
"""Peer benchmark: PyPI `bm25s` on the same corpus and questions as `kiln bench-retriever`.

Same preprocessing as kiln's `kiln_en` analyzer as far as bm25s allows: Lucene's English stop words
(bm25s `stopwords="en"`), Snowball English stemmer (PyStemmer), lower-casing; BM25 with k1=1.2, b=0.75 (tantivy's
fixed values); one field = title + "\\n" + text; duplicate ids dropped (first kept) as `kiln index` does.

bm25s's default (numpy) retrieval backend is used unless --backend numba.
Reports index build time (tokenize + index), single-thread QPS (bm25s's batch API with n_threads=1, query
tokenization included, top k), all-threads QPS (n_threads=-1) and recall@3/@10 of the supporting passages
(mean fraction per question, as kiln computes it). Single-thread QPS is also reported per CPU-second of the
process (time.process_time), steadier than wall-clock on a shared machine. Writes JSON with --out for `kiln bench-retriever --peer`.
"""
import argparse
import gzip
import json
import os
import sys
import time

try:
    import bm25s
    import Stemmer
except ImportError as e:  # pragma: no cover
    sys.exit(f"bench_bm25s.py: {e}; run `just setup-test` (scripts/ci-deps/kiln-retrieval.sh) first")


def open_text(path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rt", encoding="utf-8") if magic == b"\x1f\x8b" else open(path, encoding="utf-8")


def load_corpus(paths):
    ids, texts, seen = [], [], set()
    for p in paths:
        with open_text(p) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                doc_id = str(row.get("id"))
                if doc_id in seen:
                    continue
                if "text" in row:
                    title, text = row.get("title", ""), row["text"]
                elif "contents" in row:
                    first, _, rest = row["contents"].partition("\n")
                    title, text = first.strip().strip('"'), rest
                else:
                    continue
                seen.add(doc_id)
                ids.append(doc_id)
                texts.append(f"{title}\n{text}")
    return ids, texts


def recall(qa, retrieved, k):
    s, n = 0.0, 0
    for item, got in zip(qa, retrieved):
        sup = item["supporting_passage_ids"]
        if not sup:
            continue
        top = set(got[:k])
        s += sum(1 for x in sup if x in top) / len(sup)
        n += 1
    return s / max(n, 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", action="append", required=True)
    ap.add_argument("--queries", required=True)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--backend",
        default="numpy",
        choices=["numpy", "numba"],
        help="bm25s retrieval backend (numpy is bm25s's default; numba needs the numba package)",
    )
    args = ap.parse_args()

    stemmer = Stemmer.Stemmer("english")
    ids, texts = load_corpus(args.corpus)
    qa = [json.loads(l) for l in open(args.queries, encoding="utf-8") if l.strip()]
    questions = [q["question"] for q in qa]

    t0 = time.perf_counter()
    corpus_tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False)
    retriever = bm25s.BM25(k1=1.2, b=0.75, backend=args.backend)
    retriever.index(corpus_tokens, show_progress=False)
    index_seconds = time.perf_counter() - t0

    def search(n_threads):
        qt = bm25s.tokenize(questions, stopwords="en", stemmer=stemmer, show_progress=False)
        docs, _scores = retriever.retrieve(qt, k=args.k, n_threads=n_threads, show_progress=False)
        return docs

    search(1)  # warm-up (and numba JIT compilation)
    t = time.perf_counter()
    c = time.process_time()
    for _ in range(args.rounds):
        docs = search(1)
    qps_single = args.rounds * len(questions) / (time.perf_counter() - t)
    qps_single_cpu = args.rounds * len(questions) / max(time.process_time() - c, 1e-9)
    n_all = os.cpu_count() or 1
    search(-1)  # warm-up of the parallel path
    t = time.perf_counter()
    for _ in range(args.rounds):
        search(-1)
    qps_batch = args.rounds * len(questions) / (time.perf_counter() - t)

    retrieved = [[ids[j] for j in row] for row in docs.tolist()]
    report = {
        "name": f"bm25s {bm25s.__version__}" + ("" if args.backend == "numpy" else f" ({args.backend})"),
        "num_docs": len(ids),
        "questions": len(questions),
        "index_seconds": index_seconds,
        "qps_single": qps_single,
        "qps_single_cpu": qps_single_cpu,
        "qps_batch": qps_batch,
        "batch_threads": n_all,
        "recall_at_3": recall(qa, retrieved, 3),
        "recall_at_10": recall(qa, retrieved, 10),
    }
    print(
        f"bm25s ({args.backend}): {len(ids)} docs indexed in {index_seconds:.2f} s; k={args.k}: {qps_single:.0f} q/s "
        f"single-thread ({qps_single_cpu:.0f} q/CPU-s), "
        f"{qps_batch:.0f} q/s on {n_all} threads; recall@3 {report['recall_at_3']:.4f}, "
        f"recall@10 {report['recall_at_10']:.4f}"
    )
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
