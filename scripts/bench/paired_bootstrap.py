#!/usr/bin/env python3
"""EM with 95% bootstrap CIs, and paired differences, from `kiln eval` / final-table transcripts.

Each argument is LABEL=PATH, PATH a `transcripts.jsonl` (or a folder holding one, searched
recursively: every file found is read). Rows are keyed by (dataset, mode, question id); a system's
row for a (dataset, mode) is its EM over the questions it answered, with a bootstrap CI over
questions. With --base LABEL[:MODE], each other system's agent row is compared with the base on the
questions both have (paired bootstrap over questions; won / lost = questions only one got right).

  python3 scripts/bench/paired_bootstrap.py cold=runs/A/eval r2=runs/B/eval --base cold:agent

A training run's final table names its set `heldout`; `kiln eval --data synthetic` names the same
questions `synthetic-test`: --alias heldout=synthetic-test pairs the two.

Resamples: --resamples (2,000), seed 0. Standard library only.
"""
import argparse
import collections
import json
import pathlib
import random


def load(path, alias):
    p = pathlib.Path(path)
    files = [p] if p.is_file() else sorted(p.rglob("transcripts.jsonl"))
    if not files:
        raise SystemExit(f"{path}: no transcripts.jsonl here (give a file or a folder holding one)")
    rows = {}
    for f in files:
        for n, line in enumerate(f.open(encoding="utf-8"), 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
                ds = alias.get(r["dataset"], r["dataset"])
                rows[(ds, r["mode"], str(r["id"]))] = float(r["em"])
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{f}:{n}: not a transcript record ({e})")
    return rows


def ci(values, resamples, rng):
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("systems", nargs="+", help="LABEL=PATH")
    ap.add_argument("--base", help="LABEL[:MODE] to compare every other system's agent row with")
    ap.add_argument("--resamples", type=int, default=2000)
    ap.add_argument("--alias", action="append", default=[], metavar="NAME=NAME",
                    help="read the dataset NAME as the other NAME (e.g. heldout=synthetic-test)")
    args = ap.parse_args()
    alias = {}
    for a in args.alias:
        src, _, dst = a.partition("=")
        if not src or not dst:
            raise SystemExit(f"--alias {a!r}: expected NAME=NAME")
        alias[src] = dst
    systems = {}
    for s in args.systems:
        label, _, path = s.partition("=")
        if not path:
            raise SystemExit(f"{s!r}: expected LABEL=PATH")
        systems[label] = load(path, alias)
    rng = random.Random(0)
    print("| system | dataset | mode | n | EM % (95% CI) |")
    print("|---|---|---|---:|---|")
    for label, rows in systems.items():
        groups = collections.defaultdict(list)
        for (ds, mode, _), em in rows.items():
            groups[(ds, mode)].append(em)
        for (ds, mode), v in sorted(groups.items()):
            lo, hi = ci(v, args.resamples, rng)
            print(f"| {label} | {ds} | {mode} | {len(v)} | {100 * sum(v) / len(v):.1f} [{100 * lo:.1f}, {100 * hi:.1f}] |")
    if not args.base:
        return
    base_label, _, base_mode = args.base.partition(":")
    base_mode = base_mode or "agent"
    if base_label not in systems:
        raise SystemExit(f"--base {base_label!r}: not one of {list(systems)}")
    base = systems[base_label]
    print()
    print(f"| system (agent) - {base_label} ({base_mode}) | dataset | n paired | diff, points (95% CI) | won / lost |")
    print("|---|---|---:|---|---|")
    for label, rows in systems.items():
        if label == base_label:
            continue
        by_ds = collections.defaultdict(list)
        for (ds, mode, qid), em in rows.items():
            if mode == "agent" and (ds, base_mode, qid) in base:
                by_ds[ds].append(em - base[(ds, base_mode, qid)])
        for ds, d in sorted(by_ds.items()):
            lo, hi = ci(d, args.resamples, rng)
            won = sum(x > 0 for x in d)
            lost = sum(x < 0 for x in d)
            print(f"| {label} | {ds} | {len(d)} | {100 * sum(d) / len(d):+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] | {won} / {lost} |")


if __name__ == "__main__":
    main()
