//! kiln-search integration tests, built as one binary: each file used to be its own test binary, and
//! every one of them re-instantiated and re-linked the burn / tantivy graph in release mode (CI time
//! for no isolation the tests need). Each file is a module; `cargo test -p kiln-search rollout::` runs one.

mod agent;
mod data;
mod eval;
mod normalize_python;
mod real_demos;
mod refiner;
mod rollout;
mod synthetic;
mod synthetic_bm25;
mod task;
