#!/usr/bin/env python3
"""Table of scripts/bench/search_dynamic.sh: per run, the held-out EM of the final table (agent mode;
direct and RAG beside it) with 95% bootstrap CIs over questions, the paired bootstrap difference of
agent EM to the warm start (same questions), the train reward at the start and end of training (with
dynamic sampling: the mean over every drawn trajectory, `dynamic/drawn_reward_mean`, not the kept
groups' mean), updates, questions drawn, share of uniform groups and seconds per step.
Where a run also has a `kiln eval ... --data synthetic --mode agent --limit 500` report (all 500 test
questions), a second table pairs those with the warm start's.
Usage: search_dynamic_table.py OUT_DIR [--window 20]"""
import glob
import json
import math
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from search_diagnostic_table import RESAMPLES, ci, mean, rows  # noqa: E402  (shared helpers)


def jsonl(path):
    return rows(path) if os.path.isfile(path) else []


def boot(xs, rng):
    if not xs:
        return float("nan"), float("nan")
    return ci([mean([rng.choice(xs) for _ in xs]) for _ in range(RESAMPLES)])


def paired(a, b, rng):
    """CI of mean(b - a) over the shared keys, questions resampled together."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return float("nan"), (float("nan"), float("nan")), 0
    d = [b[k] - a[k] for k in keys]
    return mean(d), boot(d, rng), len(keys)


def final_eval(run_dir, pattern="qa-step-*"):
    """{mode: {question id: em}} and {mode: [f1]} of the newest eval folder matching `pattern`
    (default: the final table, qa-step-N)."""
    evs = sorted(glob.glob(os.path.join(run_dir, "eval", pattern)),
                 key=lambda p: int(p.rsplit("-", 1)[1]) if p.rsplit("-", 1)[1].isdigit() else -1)
    if not evs:
        return None, None
    em, f1 = {}, {}
    for r in jsonl(os.path.join(evs[-1], "transcripts.jsonl")):
        em.setdefault(r["mode"], {})[r["id"]] = r["em"]
        f1.setdefault(r["mode"], []).append(r["f1"])
    return em, f1


def main():
    args = sys.argv[1:]
    window = 20
    if "--window" in args:
        i = args.index("--window")
        window = int(args[i + 1])
        del args[i:i + 2]
    out = args[0] if args else "runs/dynamic"
    rng = random.Random(0)
    runs = {}
    for d in sorted(glob.glob(os.path.join(out, "*-2*"))):
        if os.path.isdir(d):
            runs[os.path.basename(d).rsplit("-2", 1)[0]] = d
    base_em, _ = final_eval(runs["warm-start"]) if "warm-start" in runs else (None, None)
    base = (base_em or {}).get("agent", {})
    print(f"{out}: {len(runs)} runs; CIs: 95% bootstrap, {RESAMPLES} resamples\n")
    print("| run | agent EM (95% CI) | F1 | direct EM | RAG EM | agent EM - warm start (paired) "
          f"| train reward steps 1-{window} -> last {window} | updates | questions drawn "
          "| uniform groups | s/step |")
    print("|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|")
    for name, d in runs.items():
        em, f1 = final_eval(d)
        rows = [r for r in jsonl(os.path.join(d, "metrics.jsonl")) if "reward/mean" in r]
        if em is None:
            print(f"| {name} | (no final table yet: {len(rows)} steps) |||||||||")
            continue
        ag = em.get("agent", {})
        lo, hi = boot(list(ag.values()), rng)
        cell = f"{100 * mean(list(ag.values())):.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
        if name != "warm-start" and base:
            dm, (dlo, dhi), n = paired(base, ag, rng)
            diff = f"{100 * dm:+.1f} [{100 * dlo:+.1f}, {100 * dhi:+.1f}] (n={n})"
        else:
            diff = ""
        rw = [r.get("dynamic/drawn_reward_mean", r.get("reward/mean")) for r in rows]
        first, last = mean(rw[:window]), mean(rw[-window:])
        train = f"{first:.3f} -> {last:.3f}" if len(rows) > 1 else f"{first:.3f}"
        upd = sum(1 for r in rows if r.get("updates", 0) > 0)
        drawn = sum(r.get("dynamic/drawn_questions", 0) for r in rows)
        drawn = f"{drawn:.0f}" if drawn else "-"
        uni = mean([r.get("groups/uniform_frac") for r in rows])
        sps = mean([r.get("time/step_s") for r in rows])
        direct = 100 * mean(list(em.get("direct", {}).values()))
        rag = 100 * mean(list(em.get("rag", {}).values()))
        print(f"| {name} | {cell} | {100 * mean(f1.get('agent', [])):.1f} | {direct:.1f} | {rag:.1f} "
              f"| {diff} | {train} | {upd} | {drawn} | {uni:.2f} | {sps:.1f} |")

    # `kiln eval RUN --task qa --data synthetic --mode agent --limit 500` of each run, where made.
    base500 = (final_eval(runs["warm-start"], "*-synthetic-test")[0] or {}).get("agent", {}) \
        if "warm-start" in runs else {}
    if base500:
        print(f"\nAgent EM on the whole test split (kiln eval --limit 500), paired with the warm start:\n")
        print("| run | agent EM (95% CI) | - warm start (paired, 95% CI) | questions won / lost |")
        print("|---|---|---|---|")
        for name, d in runs.items():
            em, _ = final_eval(d, "*-synthetic-test")
            ag = (em or {}).get("agent", {})
            if not ag:
                continue
            lo, hi = boot(list(ag.values()), rng)
            cell = f"{100 * mean(list(ag.values())):.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"
            keys = sorted(set(ag) & set(base500))
            won = sum(1 for k in keys if ag[k] > base500[k])
            lost = sum(1 for k in keys if ag[k] < base500[k])
            if name == "warm-start":
                print(f"| {name} | {cell} | | |")
                continue
            dm, (dlo, dhi), n = paired(base500, ag, rng)
            print(f"| {name} | {cell} | {100 * dm:+.1f} [{100 * dlo:+.1f}, {100 * dhi:+.1f}] (n={n}) "
                  f"| {won} / {lost} |")


if __name__ == "__main__":
    main()
