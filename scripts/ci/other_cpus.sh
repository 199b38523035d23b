#!/usr/bin/env bash
# One binary for every x86-64 CPU: the default build carries gemm's AVX-512 kernels (burn's x86-v4
# feature) beside the AVX2/FMA and portable ones and picks one at run time. This runs the release
# build's model-parity tests (kiln-lm/tests/parity.rs: logits against transformers fixtures) and
# `kiln doctor` under QEMU's user-mode emulator with CPUs that lack AVX-512 (Haswell: AVX2 + FMA)
# and lack AVX altogether (qemu64), so that a build that only runs on AVX-512 machines, or computes
# differently without them, fails CI. Needs `just test`'s build first. x86-64 hosts only.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$(uname -m)" != x86_64 ]; then
  echo "other_cpus: not an x86-64 host, skipped"
  exit 0
fi
if ! command -v qemu-x86_64 >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user >/dev/null) \
    || { echo "other_cpus: could not install qemu-user"; exit 1; }
fi
target="${CARGO_TARGET_DIR:-target}"
parity=$(ls -t "$target"/release/deps/parity-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
if [ -z "$parity" ]; then
  echo "other_cpus: no parity test binary under $target/release/deps (run just test first)"
  exit 1
fi
for cpu in Haswell qemu64; do
  want="AVX2 + FMA"
  [ "$cpu" = qemu64 ] && want="portable"
  got=$(qemu-x86_64 -cpu "$cpu" "$target/release/kiln" doctor 2>/dev/null | grep '^  matmul' | sed 's/^ *//' || true)
  case "$got" in
    *"$want"*) ;;
    *) echo "other_cpus: kiln doctor under -cpu $cpu says '$got', expected '$want'"; exit 1 ;;
  esac
  echo "other_cpus: -cpu $cpu: $got"
  (cd crates/kiln-lm && qemu-x86_64 -cpu "$cpu" "../../$parity" -q 2>&1 | grep -v '^qemu-x86_64: warning') \
    | tail -3
done
echo "other_cpus: ok"
