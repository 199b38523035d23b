#!/usr/bin/env python3
"""Guard: `just test` reuses the dependency tree `just setup` compiled.

Runs the two cargo builds of the Justfile one after the other (`just build`'s, then the one
`just test` starts with) with `--message-format=json` and fails when the second rebuilds any
dependency unit the first built: a feature that unifies differently between the two (a
dev-dependency turning on a feature of burn, say) would recompile the burn stack, ~20 minutes on
2 cores, on every `just test` after `just setup`. Dev-only dependencies (compiled by the second
build alone) are allowed and listed. Extra cargo flags (e.g. `--features kiln-cli/wgpu`) come
from KILN_FEATURES, as in the Justfile.
"""
import json
import os
import subprocess
import sys


def build(args):
    feats = os.environ.get("KILN_FEATURES", "").strip()
    cmd = ["cargo", "build", "--release", *args, "--message-format=json"]
    if feats:
        cmd += ["--features", feats]
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, check=True).stdout
    units = {}
    for line in out.decode("utf-8", "replace").splitlines():
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact":
            continue
        pid = m["package_id"]
        if pid.startswith("path+file://"):
            continue  # the workspace's own crates
        key = (pid, m["target"]["name"], tuple(m["target"]["kind"]))
        units[key] = m["fresh"]
    return units


def name(key):
    pid = key[0]
    # registry+https://github.com/rust-lang/crates.io-index#burn-core@0.22.1
    return pid.rsplit("#", 1)[-1] + ("" if key[1] == pid else f" ({key[1]} {','.join(key[2])})")


def main():
    setup = build(["-p", "kiln-cli"])
    test = build(["--workspace", "--all-targets"])
    rebuilt = sorted(k for k, fresh in test.items() if not fresh and k in setup)
    new = sorted(k for k, fresh in test.items() if not fresh and k not in setup)
    print(f"dependency units: {len(setup)} built by `just build`, {len(test)} used by `just test`")
    for k in new:
        print(f"  compiled for the tests only: {name(k)}")
    if rebuilt:
        for k in rebuilt:
            print(f"  REBUILT: {name(k)}")
        print(f"error: `just test` recompiled {len(rebuilt)} dependency units of `just build` "
              "(features unify differently between the two builds)", file=sys.stderr)
        return 1
    print("ok: `just test` recompiled no dependency of `just build`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
