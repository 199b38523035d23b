#!/usr/bin/env python3
"""Step-time breakdown of Search-R1 vs Search-R2 runs from their metrics.jsonl.

Usage: scripts/bench/search_r2.py RUN_R1 RUN_R2 [--skip N]
Prints rollout tokens/s, retrieval calls/s, the share of step time in generation / retrieval / refiner /
re-scoring / updates, and the refiner's overhead per step (R2 step time / R1 step time - 1).
"""
import json
import sys


def load(run, skip):
    rows = [json.loads(l.replace("NaN", "null")) for l in open(f"{run}/metrics.jsonl") if l.strip()]
    return rows[skip:] or rows


def mean(rows, k):
    v = [r[k] for r in rows if r.get(k) is not None]
    return sum(v) / len(v) if v else 0.0


def summary(rows):
    st = mean(rows, "time/step_s")
    gen = mean(rows, "rollout/generate_seconds")
    ret = mean(rows, "rollout/search_seconds")
    ref = mean(rows, "time/refiner_seconds")
    return {
        "step time (s)": st,
        "rollout tokens/s (generated)": mean(rows, "rollout/generated_tokens_per_s"),
        "retrieval queries/s (retriever)": mean(rows, "rollout/queries") / max(ret, 1e-9),
        "batched retrieval calls / step": mean(rows, "rollout/search_calls"),
        "queries per step": mean(rows, "rollout/queries"),
        "share: generation": gen / st,
        "share: of which prefill": mean(rows, "rollout/prefill_seconds") / st,
        "prefill tokens / step (k)": mean(rows, "rollout/prefill_tokens") / 1000,
        "share: retrieval": ret / st,
        "share: refiner scoring": ref / st,
        "share: old/ref log-probs": mean(rows, "time/score_s") / st,
        "share: updates": mean(rows, "time/update_s") / st,
        "response tokens / trajectory": mean(rows, "rollout/response_tokens"),
    }


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    skip = 2
    if "--skip" in sys.argv:
        skip = int(sys.argv[sys.argv.index("--skip") + 1])
        args = [a for a in args if a != str(skip)]
    r1, r2 = (summary(load(a, skip)) for a in args[:2])
    print(f"{'metric':<32}{'Search-R1':>12}{'Search-R2':>12}")
    for k in r1:
        a, b = r1[k], r2[k]
        if k.startswith("share"):
            print(f"{k:<32}{a:>12.1%}{b:>12.1%}")
        else:
            print(f"{k:<32}{a:>12.2f}{b:>12.2f}")
    print(f"{'refiner overhead per step':<32}{'':>12}{r2['step time (s)'] / r1['step time (s)'] - 1:>12.1%}")


if __name__ == "__main__":
    main()
