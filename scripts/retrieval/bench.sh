#!/usr/bin/env bash
# kiln's BM25 retriever side by side with the Python peer `bm25s` on the real corpora (26k passages, 402 questions):
# index build time, single-thread and all-thread QPS, recall@3/@10, and kiln's server p50/p99 under 32 clients.
# Needs target/release/kiln (`just build`) and the venv (`just setup-test`). Extra arguments go to
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
"$KILN" bench-retriever "${CORPUS[@]}" --queries "$D/gold_context_union_qa.jsonl" \
  --peer "$OUT/bm25s.json" --json "$OUT/kiln.json" "$@"
