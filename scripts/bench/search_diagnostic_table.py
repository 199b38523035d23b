#!/usr/bin/env python3
"""Table of the search GRPO diagnostic (scripts/bench/search_diagnostic.sh): per run, the train
reward in the first and last 10 steps, the share of uniform groups, the number of updates, and the
greedy EM on the 16 memorisable questions at each evaluation (step 0 = the warm start)."""
import glob
import json
import math
import os
import sys


def rows(path):
    out = []
    for line in open(path):
        line = line.strip()
        if line:
            out.append(json.loads(line))
    return out


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "runs/diagnostic"
    print("| run | train reward steps 1-10 -> last 10 | uniform groups | updates | eval EM at steps (0, 10, ..., end) |")
    print("|---|---|---:|---:|---|")
    for d in sorted(glob.glob(os.path.join(out, "*-2*"))):
        m = os.path.join(d, "metrics.jsonl")
        if not os.path.isfile(m):
            continue
        r = rows(m)
        train = [x for x in r if "reward/mean" in x]
        if not train:
            continue
        first = mean([x["reward/mean"] for x in train[:10]])
        last = mean([x["reward/mean"] for x in train[-10:]])
        uni = mean([x.get("groups/uniform_frac") for x in train])
        upd = sum(x.get("updates", 0) for x in train)
        ev = [(x["step"], x["eval/em"]) for x in r if "eval/em" in x]
        evs = ", ".join(f"{e:.3f}" for _, e in ev)
        name = os.path.basename(d).rsplit("-2", 1)[0]
        print(f"| {name} | {first:.3f} -> {last:.3f} ({len(train)} steps) | {uni:.2f} | {upd:.0f} | {evs} |")


if __name__ == "__main__":
    main()
