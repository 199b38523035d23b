# kiln: the user's entry points. `just --list` shows them all.

set shell := ["bash", "-euo", "pipefail", "-c"]

# Extra cargo features for every build, e.g. `KILN_FEATURES=kiln-cli/wgpu just setup` (wgpu and
# cuda are opt-in: a default build is the CPU backend only). Keep it set for later `just` commands,
# so that they all build one dependency tree.
features := env_var_or_default("KILN_FEATURES", "")
feat := if features == "" { "" } else { "--features " + features }
cargo_release := "cargo build --release -p kiln-cli " + feat
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

# Later `just` commands rebuild without it unless KILN_FEATURES=kiln-cli/wgpu is exported.
# Build the release binary with the wgpu backend (Vulkan / Metal / DX12; Mesa lavapipe on a CPU).
build-wgpu:
    KILN_FEATURES="kiln-cli/wgpu{{ if features == "" { "" } else { "," + features } }}" just build
    @echo "built with wgpu; export KILN_FEATURES=kiln-cli/wgpu so that later just commands keep it"

# For a cold measurement: `cargo clean` first (the registry cache stays).
# Where the release build spends its time: cargo's --timings report plus the slowest crates.
build-timings:
    {{cargo_release}} --timings
    python3 scripts/ci/timings_top.py target/cargo-timings/cargo-timing.html

# What this machine and build have and lack for each backend and recipe (a few seconds).
doctor: build
    {{kiln}} doctor

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

# BM25 index of the shared Wikipedia corpus into runs/index/wiki: the retriever of the real-data
# evaluation (`kiln eval ... --retriever runs/index/wiki`) and of recipes/search_r1_real.yaml.
index-wiki DATASETS="../shared/datasets": build
    {{kiln}} index --corpus {{DATASETS}}/corpus/wiki_passages_14k.jsonl --corpus {{DATASETS}}/corpus/gold_context_union.jsonl --out runs/index/wiki

# Run the test suite (release build: numerics in debug are 10-50x slower). One build of every
# target (binary included, which the end-to-end tests drive), then the tests.
test: setup-test
    cargo build --release --workspace --all-targets {{feat}}
    cargo test --release --workspace --no-fail-fast {{feat}}

# Benchmarks (long; not part of `just test`).
bench: build
    bash scripts/bench/grpo_sequence.sh
    bash scripts/retrieval/bench.sh
    bash scripts/bench/search_r2.sh
    cargo run --release -p kiln-sas --example sudoku_stats
    cargo run --release -p kiln-search --example synthetic_world
    cargo run --release -p kiln-sas --example sas_bench
    cargo run --release -p kiln-lm --example bench_smollm2
    cargo run --release -p kiln-lm --example bench_encoder
    @echo "sentence-transformers side of the encoder bench: RAYON_NUM_THREADS=N python scripts/lm/bench_st.py (needs torch, sentence-transformers)"
    @echo "PyTorch side of the SmolLM2 bench: python scripts/lm/bench_torch.py GGUF_PATH (path in .kiln/models.json; needs torch, transformers, gguf)"

# Format the code.
fmt:
    cargo fmt --all

# Lints (warnings are errors).
lint:
    cargo fmt --all -- --check
    cargo clippy --release --workspace --all-targets {{feat}} -- -D warnings

# Keep the CUDA path compiling without a GPU or the LLVM download (see STACK.md).
# `--release` reuses the build scripts and proc-macros `just test` compiled.
check-cuda:
    DOCS_RS=1 cargo check --release -p kiln-cli --features cuda

# With KILN_FEATURES=kiln-cli/wgpu (as CI sets it) this build is a no-op after `just test`.
# A few GRPO steps on the wgpu backend (Mesa lavapipe on a CPU-only machine).
smoke-wgpu:
    cargo build --release --workspace --all-targets --features kiln-cli/wgpu{{ if features == "" { "" } else { "," + features } }}
    d=$(mktemp -d) && cp -r configs recipes "$d" && cd "$d" && \
      {{kiln}} train recipes/grpo_sequence.yaml \
      --set backend=wgpu --set trainer.steps=3 --set trainer.eval_every=0 \
      --set sequence.eval_prompts=16 --set logging.plots=false && \
      test -s runs/*/metrics.jsonl && echo "wgpu smoke test passed"
