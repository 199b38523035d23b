//! kiln's Search-R2 task (METHODS, Search-R2; where each formula lives: the repository's `ARCHITECTURE.md`).
//!
//! Text and data layer (no model): answer metrics ([`answer`]), the Search-R1 agent protocol as a pure state
//! machine over text segments ([`protocol`]), the batched multi-turn loop ([`rollout`]), the meta-refiner's text
//! side ([`refiner`]), rewards ([`reward`]), QA loaders ([`data`]), the synthetic multi-hop world
//! ([`synthetic`]), one rollout batch / evaluation pass ([`task`]) and reports ([`eval`]).
//!
//! Model layer: a kiln-lm transformer as actor and refiner and a kiln-retrieval retriever as the search engine
//! ([`agent`]), joint GRPO through kiln-rl ([`grpo`]), and the supervised warm start of a policy trained from
//! random initialisation ([`warmstart`]).
//!
//! Pipeline: what `kiln train` / `kiln eval` run for a `search_r2` recipe ([`pipeline`]): environment setup
//! (world, index, data), policy loading or warm start, training through a [`kiln_rl::Driver`], checkpoint
//! evaluation.

pub mod agent;
pub mod answer;
pub mod cli;
pub mod data;
pub mod error;
pub mod eval;
pub mod grpo;
pub mod pipeline;
pub mod protocol;
pub mod real_demos;
pub mod refiner;
pub mod refiner_start;
pub mod reward;
pub mod rollout;
pub mod synthetic;
pub mod task;
pub mod warmstart;

pub use error::Error;
