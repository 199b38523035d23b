# kiln: the user's entry points. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

cargo_release := "cargo build --release -p kiln-cli"
target_dir := env_var_or_default("CARGO_TARGET_DIR", justfile_directory() + "/target")
kiln := target_dir + "/release/kiln"

# Show the recipes.
default:
    @just --list

# Build kiln (release) and install the Python helpers the tests and benchmarks use.
setup: build setup-test
    @echo "kiln is ready: {{kiln}} --help"

# Build the release binary.
build:
    {{cargo_release}}

# Create .venv and install the Python packages tests use (idempotent).
setup-test:
    @test -x .venv/bin/python || python3 -m venv .venv
    @for f in scripts/ci-deps/*.sh; do [ -e "$f" ] || continue; echo "ci-deps: $f"; bash "$f"; done

# Train with a recipe: just train recipes/grpo_sequence.yaml --set optim.lr=1e-3
train RECIPE *ARGS: build
    {{kiln}} train {{RECIPE}} {{ARGS}}

# Evaluate a checkpoint or run directory: just eval runs/<run>
eval *ARGS: build
    {{kiln}} eval {{ARGS}}

# Run the test suite (release build: numerics in debug are 10-50x slower). One build of every
# target (binary included, which the end-to-end tests drive), then the tests.
test: setup-test
    cargo build --release --workspace --all-targets
    cargo test --release --workspace --no-fail-fast

# Benchmarks (long; not part of `just test`).
bench: build
    bash scripts/bench/grpo_sequence.sh
    bash scripts/retrieval/bench.sh
    bash scripts/bench/search_r2.sh
    cargo run --release -p kiln-sas --example sudoku_stats
    cargo run --release -p kiln-search --example synthetic_world
    cargo run --release -p kiln-sas --example sas_bench
    cargo run --release -p kiln-lm --example bench_smollm2
    @echo "PyTorch side of the SmolLM2 bench: python scripts/lm/bench_torch.py GGUF_PATH (path in .kiln/models.json; needs torch, transformers, gguf)"

# Format the code.
fmt:
    cargo fmt --all

# Lints (warnings are errors).
lint:
    cargo fmt --all -- --check
    cargo clippy --release --workspace --all-targets -- -D warnings

# Keep the CUDA path compiling without a GPU or the LLVM download (see STACK.md).
# `--release` reuses the build scripts and proc-macros `just test` compiled.
check-cuda:
    DOCS_RS=1 cargo check --release -p kiln-cli --features cuda

# A few GRPO steps on the wgpu backend (Mesa lavapipe on a CPU-only machine). wgpu is a default
# feature of kiln-cli, so after `just test` this build is a no-op (same command, same features).
smoke-wgpu:
    cargo build --release --workspace --all-targets
    d=$(mktemp -d) && cp -r configs recipes "$d" && cd "$d" && \
      {{kiln}} train recipes/grpo_sequence.yaml \
      --set backend=wgpu --set trainer.steps=3 --set trainer.eval_every=0 \
      --set sequence.eval_prompts=16 --set logging.plots=false && \
      test -s runs/*/metrics.jsonl && echo "wgpu smoke test passed"
