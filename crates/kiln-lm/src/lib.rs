//! kiln-lm: models in burn (causal decoder compatible with Llama / Qwen2, bidirectional
//! masked-diffusion denoiser compatible with LLaDA), weight loading, tokenizers and generation.
//! Knows nothing of RL.

pub mod cli;
pub mod config;
pub mod model;

pub use config::{ConfigError, RopeScaling, TokenIds, TransformerConfig};
pub use model::{KvCache, Transformer, positions_from_mask};
