#!/usr/bin/env python3
"""A retrieval client written the way Search-R1's trainer calls its retriever.

Search-R1 (search_r1/llm_agent/generation.py) posts a batch of queries with `requests.post(url, json=payload)`
and formats each hit from `result[i][j]["document"]["contents"]` (first line = title, rest = text). This script
does exactly that against a running `kiln serve-retriever`, checks the shape of the answers (also with
`return_scores: false`, where each hit is the document itself), and prints a JSON summary (the retrieved ids)
on stdout so the caller can compare them with its own search. Exits non-zero on any protocol mismatch.

Usage: searchr1_client.py --url http://127.0.0.1:8000/retrieve --qa gold_context_union_qa.jsonl [--n 64] [--topk 3]
"""
import argparse
import json
import sys

import requests


def batch_search(url, queries, topk, headers=None):
    # As Search-R1's `_batch_search`.
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    return requests.post(url, json=payload, headers=headers, timeout=60).json()["result"]


def passages2string(retrieval_result):
    # As Search-R1's `_passages2string`.
    format_reference = ""
    for idx, doc_item in enumerate(retrieval_result):
        content = doc_item["document"]["contents"]
        title = content.split("\n")[0]
        text = "\n".join(content.split("\n")[1:])
        format_reference += f"Doc {idx+1}(Title: {title}) {text}\n"
    return format_reference


def fail(msg):
    print(f"searchr1_client: {msg}", file=sys.stderr)
    sys.exit(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--qa", required=True)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--topk", type=int, default=3)
    ap.add_argument("--token", default=None)
    args = ap.parse_args()

    questions = []
    with open(args.qa, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                questions.append(json.loads(line)["question"])
            if len(questions) >= args.n:
                break
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else None

    results = batch_search(args.url, questions, args.topk, headers)
    if len(results) != len(questions):
        fail(f"{len(questions)} queries but {len(results)} result lists")
    ids, formatted = [], []
    for i, hits in enumerate(results):
        if len(hits) != args.topk:
            fail(f"query {i}: expected {args.topk} hits, got {len(hits)}")
        scores = [h["score"] for h in hits]
        if scores != sorted(scores, reverse=True):
            fail(f"query {i}: scores not descending: {scores}")
        for h in hits:
            c = h["document"]["contents"]
            if not (c.startswith('"') and "\n" in c and c.split("\n")[0].endswith('"')):
                fail(f"query {i}: contents not in '\"Title\"\\ntext' form: {c[:80]!r}")
        ids.append([h["document"]["id"] for h in hits])
        formatted.append(passages2string(hits))

    # return_scores false: Search-R1's server returns the documents themselves.
    plain = requests.post(
        args.url, json={"queries": questions[:4], "topk": args.topk}, headers=headers, timeout=60
    ).json()["result"]
    for i, hits in enumerate(plain):
        if [d["id"] for d in hits] != ids[i]:
            fail(f"query {i}: return_scores=false gave other documents")
        if any("score" in d or "contents" not in d for d in hits):
            fail(f"query {i}: return_scores=false hits must be bare documents: {hits[0]}")

    health = requests.get(args.url.rsplit("/", 1)[0] + "/health", timeout=10).json()
    print(json.dumps({"ids": ids, "formatted": formatted, "health": health}))


if __name__ == "__main__":
    main()
