//! kiln's Search-R2 task, model-independent part: answer metrics, the Search-R1 agent protocol as a pure state
//! machine over text segments, the meta-refiner's text side, rewards, QA data loaders, the synthetic multi-hop
//! world, and evaluation helpers.
//!
//! The model-driven layer (generation with kiln-lm, retrieval with kiln-retrieval, GRPO with kiln-rl) plugs in
//! through [`rollout::TurnPolicy`] and [`rollout::SearchBackend`]; everything here is deterministic text/data logic.

pub mod answer;
pub mod cli;
pub mod data;
pub mod error;
pub mod eval;
pub mod protocol;
pub mod refiner;
pub mod reward;
pub mod rollout;
pub mod synthetic;
pub mod task;

pub use error::Error;
