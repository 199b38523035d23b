//! kiln-lm: models in burn (causal decoder compatible with Llama / Qwen2, bidirectional
//! masked-diffusion denoiser compatible with LLaDA, BERT-family sentence encoder for dense
//! retrieval), weight loading, tokenizers and generation.
//! Knows nothing of RL.

pub mod bert;
pub mod cli;
pub mod config;
pub mod diffusion;
pub mod fused;
pub mod generate;
pub mod gguf;
pub mod lora;
pub mod malloc;
pub mod model;
pub mod skinny;
pub mod tokenizer;
mod vmath;
pub mod weights;
pub mod zoo;

pub use bert::{EncoderError, Pooling, SentenceEncoder, TextKind};
pub use config::{ConfigError, RopeScaling, TokenIds, TransformerConfig};
pub use generate::{
    FinishReason, Generation, SamplingConfig, SeqCache, generate, generate_packed,
    generate_reusing, generate_reusing_packed, score_tokens, score_tokens_at,
    score_tokens_with_entropy,
};
pub use gguf::load_gguf;
pub use lora::{LoraAdapter, LoraConfig};
pub use model::{DecodeWeights, KvCache, Transformer, positions_from_mask};
pub use tokenizer::{ChatMessage, ChatTemplate, Tokenizer, TokenizerError};
pub use weights::{WeightsError, load_hf_dir, save_hf_dir};
