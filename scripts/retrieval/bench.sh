#!/usr/bin/env bash
# kiln's BM25 retriever side by side with the Python peer `bm25s` on the real corpora (26k passages, 402 questions):
# index build time, single-thread and all-thread QPS, recall@3/@10, and kiln's server p50/p99 under 32 clients;
# then (`--dense`) BM25, dense exact, dense HNSW and hybrid side by side on the same index and questions: recall@3/@10,
# HNSW recall vs exact, batch QPS and server latency. The index (with its embeddings, ~30 CPU-minutes to compute
# with all-MiniLM-L6-v2) are kept in target/bench/retrieval/dense-cache and reused by later runs.
# Needs target/release/kiln (`just build`) and the venv (`just setup-test`; numba there adds a bm25s-numba row). Extra arguments go to
# `kiln bench-retriever` (e.g. --clients 64 --requests 500). Results: target/bench/retrieval/{bm25s,kiln}.json.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KILN="${KILN:-$REPO/target/release/kiln}"
PY="${KILN_PYTHON:-$REPO/.venv/bin/python}"
D="${KILN_DATASETS:-$REPO/../shared/datasets}/corpus"
OUT="$REPO/target/bench/retrieval"
mkdir -p "$OUT"
CORPUS=(--corpus "$D/gold_context_union.jsonl" --corpus "$D/wiki_passages_14k.jsonl")
"$PY" "$REPO/scripts/retrieval/bench_bm25s.py" "${CORPUS[@]}" --queries "$D/gold_context_union_qa.jsonl" \
  --out "$OUT/bm25s.json"
PEERS=(--peer "$OUT/bm25s.json")
# bm25s's optional numba backend is much faster than its default numpy one: compare against it too.
if "$PY" -c 'import numba' 2>/dev/null; then
  "$PY" "$REPO/scripts/retrieval/bench_bm25s.py" "${CORPUS[@]}" --queries "$D/gold_context_union_qa.jsonl" \
    --backend numba --out "$OUT/bm25s_numba.json"
  PEERS+=(--peer "$OUT/bm25s_numba.json")
fi
"$KILN" bench-retriever "${CORPUS[@]}" --queries "$D/gold_context_union_qa.jsonl" \
  "${PEERS[@]}" --json "$OUT/kiln.json" --dense --dense-cache "$OUT/dense-cache" --dense-json "$OUT/kiln_dense.json" "$@"
