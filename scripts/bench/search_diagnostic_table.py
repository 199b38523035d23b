#!/usr/bin/env python3
"""Table of the search GRPO diagnostic (scripts/bench/search_diagnostic.sh): per run, the sampled
train reward (the training questions are the evaluation questions, so this is the reward on
questions the policy may memorise) in the first and last 10 steps with 95% bootstrap CIs over
steps, their difference with its CI, the share of uniform groups, the number of updates, and the
greedy EM on the 16 questions at each evaluation (the warm-start run: its one step at lr 1e-12).
Usage: search_diagnostic_table.py OUT_DIR [OUT_DIR ...] (several directories: one table each,
then the pooled difference of every run name across them)."""
import glob
import json
import math
import os
import random
import sys

RESAMPLES = 2000


def rows(path):
    out = []
    for line in open(path):
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a torn last line of a killed run
    return out


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def ci(samples):
    s = sorted(samples)
    return s[int(0.025 * len(s))], s[int(0.975 * len(s)) - 1]


def boot_mean(xs, rng):
    return ci([mean([rng.choice(xs) for _ in xs]) for _ in range(RESAMPLES)])


def boot_diff(a, b, rng):
    """CI of mean(b) - mean(a), the two windows resampled independently."""
    return ci([mean([rng.choice(b) for _ in b]) - mean([rng.choice(a) for _ in a]) for _ in range(RESAMPLES)])


def runs(out):
    for d in sorted(glob.glob(os.path.join(out, "*-2*"))):
        m = os.path.join(d, "metrics.jsonl")
        if os.path.isfile(m):
            name = os.path.basename(d).rsplit("-2", 1)[0]
            yield name, rows(m)


def table(out, pooled):
    rng = random.Random(0)
    print(f"\n{out}\n")
    print("| run | train reward steps 1-10 | last 10 steps | change (95% CI) | uniform groups | updates | greedy EM on the 16 at steps 10, 20, ..., 60 |")
    print("|---|---|---|---|---:|---:|---|")
    for name, r in runs(out):
        train = [x["reward/mean"] for x in r if "reward/mean" in x]
        if not train:
            continue
        ev = ", ".join(f"{x['eval/em']:.3f}" for x in r if "eval/em" in x)
        uni = mean([x.get("groups/uniform_frac") for x in r if "reward/mean" in x])
        upd = sum(x.get("updates", 0) for x in r)
        if len(train) < 20:
            print(f"| {name} | {mean(train):.3f} ({len(train)} step) | | | {uni:.2f} | {upd:.0f} | {ev} |")
            continue
        a, b = train[:10], train[-10:]
        (la, ha), (lb, hb), (ld, hd) = boot_mean(a, rng), boot_mean(b, rng), boot_diff(a, b, rng)
        pooled.setdefault(name, []).append((a, b))
        print(
            f"| {name} | {mean(a):.3f} [{la:.3f}, {ha:.3f}] | {mean(b):.3f} [{lb:.3f}, {hb:.3f}] "
            f"| {mean(b) - mean(a):+.3f} [{ld:+.3f}, {hd:+.3f}] | {uni:.2f} | {upd:.0f} | {ev} |"
        )


def main():
    outs = sys.argv[1:] or ["runs/diagnostic"]
    pooled = {}
    for out in outs:
        table(out, pooled)
    if len(outs) > 1:
        rng = random.Random(1)
        print("\nPooled over the question sets (steps resampled within each set and window):\n")
        print("| run | sets | mean change of the train reward, last 10 - first 10 steps (95% CI) |")
        print("|---|---:|---|")
        for name, sets in sorted(pooled.items()):
            point = mean([mean(b) - mean(a) for a, b in sets])
            boots = []
            for _ in range(RESAMPLES):
                boots.append(mean([
                    mean([rng.choice(b) for _ in b]) - mean([rng.choice(a) for _ in a]) for a, b in sets
                ]))
            lo, hi = ci(boots)
            print(f"| {name} | {len(sets)} | {point:+.3f} [{lo:+.3f}, {hi:+.3f}] |")


if __name__ == "__main__":
    main()
