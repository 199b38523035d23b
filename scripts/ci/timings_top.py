#!/usr/bin/env python3
"""Print the slowest crates of a `cargo build --timings` report (target/cargo-timings/*.html).

Usage: timings_top.py [REPORT.html] [N]. cargo embeds the per-unit data as a JavaScript array
(`const UNIT_DATA = [...]`); each unit has a name, version, target and duration in seconds.
"""
import json
import re
import sys


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "target/cargo-timings/cargo-timing.html"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    html = open(path, encoding="utf-8").read()
    m = re.search(r"const\s+UNIT_DATA\s*=\s*(\[.*?\]);\s*\n", html, re.S)
    if not m:
        sys.exit(f"{path}: no UNIT_DATA array (not a cargo --timings report?)")
    units = json.loads(m.group(1))
    total = max((u["start"] + u["duration"] for u in units), default=0.0)
    busy = sum(u["duration"] for u in units)
    print(f"{len(units)} units, wall {total:.0f} s, sum of unit times {busy:.0f} s")
    print(f"{'crate':<40} {'target':<18} {'s':>7}")
    for u in sorted(units, key=lambda u: -u["duration"])[:n]:
        name = f"{u['name']} {u['version']}"
        print(f"{name:<40} {u.get('target', '').strip():<18} {u['duration']:>7.1f}")


if __name__ == "__main__":
    main()
