//! BERT-family sentence encoders (all-MiniLM-L6-v2, e5, bge and other `model_type: bert`
//! folders) for dense retrieval: a sentence-transformers folder (or a plain HF BERT folder) in,
//! one embedding per text out, computed in burn on the CPU.
//!
//! The model is HF `BertModel`: word + absolute position + token-type embeddings, LayerNorm, then
//! post-LN encoder layers (self-attention with the padded keys masked out, output projection,
//! residual, LayerNorm; GELU MLP, residual, LayerNorm). The sentence-transformers modules around
//! it are read from the folder: pooling (`1_Pooling/config.json`: mean, CLS or max over the real
//! tokens; mean for a plain HF folder), L2 normalisation (a `Normalize` module in `modules.json`),
//! `max_seq_length` (`sentence_bert_config.json`) and the query / passage prompts
//! (`config_sentence_transformers.json` `prompts`). Parity with `SentenceTransformer.encode` is
//! tested on 200 passages (`tests/bert.rs`, fixture from `scripts/lm/make_bert_fixture.py`).
//!
//! Speed (all-MiniLM-L6-v2 on one thread: ~1.5x the passages/s of sentence-transformers on
//! PyTorch, see `examples/bench_encoder.rs`): [`SentenceEncoder::encode`] tokenises the whole
//! input once, sorts the texts by token count and cuts the sorted list into passes of at most
//! [`MAX_PASS_TOKENS`] tokens, so a pass carries almost no padding. burn runs the matmuls, every
//! one a 2-D `[tokens, d] x [d, d]` product: q, k and v separately and the MLP in blocks of `d`
//! intermediate units (burn-flex's gemm runs these ~1.4x faster per FLOP than one `[d, 3d]` or
//! `[d, 4d]` product at 512 rows). Everything between two matmuls is one in-place host pass over
//! the fresh output (zero-copy through `TensorData`, see `kernels`): bias + GELU, bias +
//! residual + LayerNorm, and attention, a fused kernel per head (scores, softmax over the real
//! keys, weighted values) in place of burn's `attention` op, whose CPU softmax uses a scalar
//! `expf`, and of batched matmuls with `k` = head width, which gemm runs at ~12 GFLOP/s. Pooling
//! runs on the host over the final hidden states.
//!
//! Files are untrusted input, as in [`crate::weights`]: configs are read up to a size ceiling,
//! sizes are held to [`crate::config::limits`], every tensor's shape (from the safetensors
//! headers) is checked against config.json before any weight is read, so memory is bounded by what
//! the files hold, and the tokenizer's ids must fit the embedding table. Encoding never panics on
//! any input text.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use burn::tensor::module::linear;
use burn::tensor::{Device, Tensor, TensorData};
use rayon::prelude::*;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};

use crate::config::{MAX_CONFIG_BYTES, limits, read_text_bounded};
use crate::tokenizer::MAX_TOKENIZER_BYTES;
use crate::weights::{SafetensorsSource, TensorSource, WeightsError, transpose};

/// Most tokens (rows x padded length) one forward pass takes (at least one text): a larger
/// batch is split. Small passes are faster on the CPU: the activations stay in cache and
/// burn-flex's per-op output buffers are recycled by malloc instead of being mapped afresh
/// (all-MiniLM-L6-v2, one thread: 512 tokens per pass took ~17% less CPU than 32 passages of
/// ~120 tokens).
pub const MAX_PASS_TOKENS: usize = 512;

/// What a text is, for the prompt an asymmetric model (e5: `query: ` / `passage: `) puts in front.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TextKind {
    /// A search query.
    Query,
    /// A passage (document) of the corpus.
    Passage,
}

/// How token vectors become one sentence vector (sentence-transformers `Pooling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pooling {
    /// Mean over the real (non-padding) tokens, special tokens included.
    Mean,
    /// The first token (`[CLS]`).
    Cls,
    /// Element-wise maximum over the real tokens.
    Max,
}

impl Pooling {
    fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Max => "max",
        }
    }
}

/// Errors of loading and running a sentence encoder.
#[derive(Debug, thiserror::Error)]
pub enum EncoderError {
    /// The spec is neither a folder nor a name recorded in `.kiln/models.json`.
    #[error(
        "sentence encoder `{0}` not found: not a folder, and not a name recorded in .kiln/models.json (`just setup-test` installs all-minilm-l6-v2; or pass a sentence-transformers / HF BERT folder)"
    )]
    NotFound(String),
    /// The folder lacks files an encoder needs.
    #[error(
        "{dir}: not a complete sentence-encoder folder, missing {missing} (needs config.json, tokenizer.json and model.safetensors or model.safetensors.index.json; `just setup-test` installs all-minilm-l6-v2)"
    )]
    MissingFiles {
        /// The folder.
        dir: String,
        /// The missing files, comma-separated.
        missing: String,
    },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A config file is malformed, inconsistent or describes an unsupported model.
    #[error("{path}: {message}")]
    Config {
        /// The file.
        path: String,
        /// What was wrong (with the field where known).
        message: String,
    },
    /// The weights are missing, malformed or disagree with config.json.
    #[error("{path}: {source}")]
    Weights {
        /// The weight file (or folder, for sharded weights).
        path: String,
        /// What was wrong.
        source: WeightsError,
    },
    /// `tokenizer.json` is invalid or does not fit the model.
    #[error("{path}: {message}")]
    Tokenizer {
        /// The tokenizer file.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// Tokenisation of the input failed.
    #[error("tokenizer: {0}")]
    Encode(String),
}

fn config_err(path: &Path, message: impl Into<String>) -> EncoderError {
    EncoderError::Config {
        path: path.display().to_string(),
        message: message.into(),
    }
}

/// Read a small JSON file (bounded) into `T`, with the failing field in the message.
fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, EncoderError> {
    let text = read_text_bounded(path, MAX_CONFIG_BYTES).map_err(|source| EncoderError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let de = &mut serde_json::Deserializer::from_str(&text);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let field = e.path().to_string();
        if field == "." {
            config_err(path, e.into_inner().to_string())
        } else {
            config_err(path, format!("field `{field}`: {}", e.into_inner()))
        }
    })
}

fn default_model_type() -> String {
    "bert".into()
}
fn default_hidden_act() -> String {
    "gelu".into()
}
fn default_max_positions() -> usize {
    512
}
fn default_type_vocab() -> usize {
    2
}
fn default_ln_eps() -> f64 {
    1e-12
}
fn default_position_type() -> Option<String> {
    Some("absolute".into())
}

/// The architecture fields of a BERT `config.json` (HF names; other keys are ignored).
#[derive(Deserialize, Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// HF `model_type`; only `bert` is supported. Default `bert`.
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Rows of the word-embedding table.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads (`hidden_size` must be a multiple).
    pub num_attention_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// MLP activation: `gelu` (exact, erf) or `gelu_new` / `gelu_pytorch_tanh` / `gelu_fast`
    /// (tanh approximation). Default `gelu`.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Rows of the position-embedding table. Default 512.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// Rows of the token-type table. Default 2.
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    /// LayerNorm epsilon. Default 1e-12.
    #[serde(default = "default_ln_eps")]
    pub layer_norm_eps: f64,
    /// Padding id. Default 0.
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Only `absolute` is supported. Default `absolute`.
    #[serde(default = "default_position_type")]
    pub position_embedding_type: Option<String>,
}

/// Activations a BERT config may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    /// Exact GELU, `0.5 x (1 + erf(x / sqrt 2))` (HF `gelu`).
    Gelu,
    /// Tanh approximation (HF `gelu_new`, `gelu_pytorch_tanh`, `gelu_fast`).
    GeluTanh,
}

impl BertConfig {
    /// Parse `config.json` text; `path` names the file in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self, EncoderError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let cfg: Self = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            config_err(path, format!("field `{field}`: {}", e.into_inner()))
        })?;
        cfg.validate(path)?;
        Ok(cfg)
    }

    /// Read and validate a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self, EncoderError> {
        let text =
            read_text_bounded(path, MAX_CONFIG_BYTES).map_err(|source| EncoderError::Io {
                path: path.display().to_string(),
                source,
            })?;
        Self::from_json(&text, path)
    }

    fn act(&self) -> Act {
        match self.hidden_act.as_str() {
            "gelu" => Act::Gelu,
            _ => Act::GeluTanh,
        }
    }

    /// Supported architecture and sizes within [`limits`].
    fn validate(&self, path: &Path) -> Result<(), EncoderError> {
        let bad = |m: String| Err(config_err(path, m));
        if self.model_type != "bert" {
            return bad(format!(
                "model_type `{}` is not supported by the sentence encoder: only `bert` (BERT, MiniLM, e5, bge and other BertModel checkpoints)",
                self.model_type
            ));
        }
        if let Some(p) = &self.position_embedding_type
            && p != "absolute"
        {
            return bad(format!(
                "field `position_embedding_type`: `{p}` is not supported: only `absolute` position embeddings"
            ));
        }
        if !matches!(
            self.hidden_act.as_str(),
            "gelu" | "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast"
        ) {
            return bad(format!(
                "field `hidden_act`: `{}` is not supported: gelu, gelu_new, gelu_pytorch_tanh or gelu_fast",
                self.hidden_act
            ));
        }
        let checks: [(&str, usize, usize); 7] = [
            ("vocab_size", self.vocab_size, limits::MAX_VOCAB),
            ("hidden_size", self.hidden_size, limits::MAX_HIDDEN),
            (
                "num_hidden_layers",
                self.num_hidden_layers,
                limits::MAX_LAYERS,
            ),
            (
                "num_attention_heads",
                self.num_attention_heads,
                limits::MAX_HEADS,
            ),
            (
                "intermediate_size",
                self.intermediate_size,
                limits::MAX_INTERMEDIATE,
            ),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                limits::MAX_POSITIONS,
            ),
            ("type_vocab_size", self.type_vocab_size, 1 << 16),
        ];
        for (name, v, max) in checks {
            if v == 0 || v > max {
                return bad(format!("field `{name}`: {v} is out of range 1..={max}"));
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return bad(format!(
                "field `layer_norm_eps`: {} must be a positive number",
                self.layer_norm_eps
            ));
        }
        if let Some(p) = self.pad_token_id
            && p as usize >= self.vocab_size
        {
            return bad(format!(
                "field `pad_token_id`: {p} is not below vocab_size {}",
                self.vocab_size
            ));
        }
        Ok(())
    }
}

/// The sentence-transformers settings around the transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct SentenceSettings {
    /// Pooling of the token vectors.
    pub pooling: Pooling,
    /// L2-normalise the pooled vector (a `Normalize` module).
    pub normalize: bool,
    /// Longest token sequence (special tokens included); longer texts are truncated.
    pub max_seq_len: usize,
    /// Lowercase texts before tokenising (`sentence_bert_config.json` `do_lower_case`).
    pub lowercase: bool,
    /// Prompt put in front of queries.
    pub query_prompt: String,
    /// Prompt put in front of passages.
    pub passage_prompt: String,
}

#[derive(Deserialize)]
struct StModule {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct PoolingConfig {
    pooling_mode_cls_token: bool,
    pooling_mode_mean_tokens: bool,
    pooling_mode_max_tokens: bool,
    pooling_mode_mean_sqrt_len_tokens: bool,
    pooling_mode_weightedmean_tokens: bool,
    pooling_mode_lasttoken: bool,
    include_prompt: Option<bool>,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StTransformerConfig {
    max_seq_length: Option<usize>,
    do_lower_case: bool,
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct StConfig {
    prompts: std::collections::BTreeMap<String, String>,
}

/// A relative module path from `modules.json`, refused if it could leave the folder.
fn module_dir(dir: &Path, rel: &str, modules: &Path) -> Result<PathBuf, EncoderError> {
    let p = Path::new(rel);
    if p.components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(config_err(
            modules,
            format!("module path `{rel}` is not a plain relative path inside the folder"),
        ));
    }
    Ok(dir.join(p))
}

impl SentenceSettings {
    /// Read the settings of folder `dir` (see the module docs). Returns them with the folder of
    /// the transformer itself (`dir`, or the `Transformer` module's sub-folder in old layouts).
    pub fn read(dir: &Path, max_positions: usize) -> Result<(Self, PathBuf), EncoderError> {
        let mut settings = SentenceSettings {
            pooling: Pooling::Mean,
            normalize: false,
            max_seq_len: max_positions.min(512),
            lowercase: false,
            query_prompt: String::new(),
            passage_prompt: String::new(),
        };
        let mut model_dir = dir.to_path_buf();
        let modules_path = dir.join("modules.json");
        if modules_path.exists() {
            let modules: Vec<StModule> = read_json(&modules_path)?;
            for m in &modules {
                let kind = m.kind.rsplit('.').next().unwrap_or("");
                match kind {
                    "Transformer" => model_dir = module_dir(dir, &m.path, &modules_path)?,
                    "Pooling" => {
                        let p = module_dir(dir, &m.path, &modules_path)?.join("config.json");
                        settings.pooling = Self::pooling_from(&p)?;
                    }
                    "Normalize" => settings.normalize = true,
                    _ => {
                        return Err(config_err(
                            &modules_path,
                            format!(
                                "module `{}` is not supported: the sentence encoder runs Transformer (BERT), Pooling and Normalize only",
                                m.kind
                            ),
                        ));
                    }
                }
            }
        }
        let sbert = model_dir.join("sentence_bert_config.json");
        if sbert.exists() {
            let c: StTransformerConfig = read_json(&sbert)?;
            if let Some(n) = c.max_seq_length {
                if n < 3 {
                    return Err(config_err(
                        &sbert,
                        format!("field `max_seq_length`: {n} leaves no room for text (at least 3)"),
                    ));
                }
                settings.max_seq_len = n.min(max_positions);
            }
            settings.lowercase = c.do_lower_case;
        }
        let st = dir.join("config_sentence_transformers.json");
        if st.exists() {
            let c: StConfig = read_json(&st)?;
            let get = |keys: &[&str]| {
                keys.iter()
                    .find_map(|k| c.prompts.get(*k).cloned())
                    .unwrap_or_default()
            };
            settings.query_prompt = get(&["query"]);
            settings.passage_prompt = get(&["passage", "document"]);
        }
        Ok((settings, model_dir))
    }

    fn pooling_from(path: &Path) -> Result<Pooling, EncoderError> {
        let c: PoolingConfig = read_json(path)?;
        let unsupported = |what: &str| {
            Err(config_err(
                path,
                format!(
                    "{what} is not supported: the sentence encoder pools with exactly one of mean, cls or max"
                ),
            ))
        };
        if c.include_prompt == Some(false) {
            return unsupported("`include_prompt: false`");
        }
        for (on, name) in [
            (c.pooling_mode_mean_sqrt_len_tokens, "mean_sqrt_len_tokens"),
            (c.pooling_mode_weightedmean_tokens, "weightedmean_tokens"),
            (c.pooling_mode_lasttoken, "lasttoken"),
        ] {
            if on {
                return unsupported(&format!("pooling mode `{name}`"));
            }
        }
        match (
            c.pooling_mode_mean_tokens,
            c.pooling_mode_cls_token,
            c.pooling_mode_max_tokens,
        ) {
            (true, false, false) => Ok(Pooling::Mean),
            (false, true, false) => Ok(Pooling::Cls),
            (false, false, true) => Ok(Pooling::Max),
            (false, false, false) => unsupported("no pooling mode"),
            _ => unsupported("several pooling modes at once (concatenated)"),
        }
    }

    fn prompt(&self, kind: TextKind) -> &str {
        match kind {
            TextKind::Query => &self.query_prompt,
            TextKind::Passage => &self.passage_prompt,
        }
    }
}

/// LayerNorm parameters (host vectors: the fused kernels read them).
#[derive(Debug)]
struct Norm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

/// One block of the MLP's intermediate units: `gelu(x w_in + b_in) w_out`, summed over blocks.
#[derive(Debug)]
struct MlpBlock {
    /// `[d, width]`.
    w_in: Tensor<2>,
    b_in: Vec<f32>,
    /// `[width, d]`.
    w_out: Tensor<2>,
}

/// One post-LN encoder layer: matmul weights as burn tensors `[d_in, d_out]`; the output biases
/// and the norms as host vectors, applied by the fused kernels after each matmul.
#[derive(Debug)]
struct Layer {
    /// q, k, v projections `[d, d]` and biases `[d]`.
    q_w: Tensor<2>,
    q_b: Tensor<1>,
    k_w: Tensor<2>,
    k_b: Tensor<1>,
    v_w: Tensor<2>,
    v_b: Tensor<1>,
    attn_out_w: Tensor<2>,
    attn_out_b: Vec<f32>,
    ln1: Norm,
    /// The intermediate units in blocks of `d` (one block when `d` does not divide them).
    mlp: Vec<MlpBlock>,
    out_b: Vec<f32>,
    ln2: Norm,
}

/// HF `BertModel` without the pooler, inference only.
#[derive(Debug)]
struct BertModel {
    /// Word embeddings `[vocab, d]`, gathered on the host.
    word: Vec<f32>,
    /// Position embeddings plus token type 0, `[max_positions, d]`.
    pos_type: Vec<f32>,
    ln: Norm,
    layers: Vec<Layer>,
    cfg: BertConfig,
    device: Device,
}

/// Resolve HF tensor names with an optional `bert.` prefix and old `gamma` / `beta` LayerNorm
/// names.
struct Names<'a> {
    src: &'a SafetensorsSource,
    prefix: &'static str,
}

impl Names<'_> {
    fn get(&self, name: &str) -> String {
        let full = format!("{}{name}", self.prefix);
        if !self.src.contains(&full) {
            let old = full
                .strip_suffix("LayerNorm.weight")
                .map(|p| format!("{p}LayerNorm.gamma"))
                .or_else(|| {
                    full.strip_suffix("LayerNorm.bias")
                        .map(|p| format!("{p}LayerNorm.beta"))
                });
            if let Some(old) = old
                && self.src.contains(&old)
            {
                return old;
            }
        }
        full
    }
}

impl BertModel {
    fn load(
        cfg: &BertConfig,
        src: &SafetensorsSource,
        device: &Device,
    ) -> Result<Self, WeightsError> {
        let prefix = if src.contains("bert.embeddings.word_embeddings.weight") {
            "bert."
        } else {
            ""
        };
        let names = Names { src, prefix };
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        // Every tensor must exist with the shape config.json implies (the headers say so)
        // before anything is read or allocated: the first that does not is named.
        let mut specs: Vec<(String, Vec<usize>)> = vec![
            (
                "embeddings.word_embeddings.weight".into(),
                vec![cfg.vocab_size, d],
            ),
            (
                "embeddings.position_embeddings.weight".into(),
                vec![cfg.max_position_embeddings, d],
            ),
            (
                "embeddings.token_type_embeddings.weight".into(),
                vec![cfg.type_vocab_size, d],
            ),
            ("embeddings.LayerNorm.weight".into(), vec![d]),
            ("embeddings.LayerNorm.bias".into(), vec![d]),
        ];
        for i in 0..cfg.num_hidden_layers {
            for (s, shape) in [
                ("attention.self.query.weight", vec![d, d]),
                ("attention.self.query.bias", vec![d]),
                ("attention.self.key.weight", vec![d, d]),
                ("attention.self.key.bias", vec![d]),
                ("attention.self.value.weight", vec![d, d]),
                ("attention.self.value.bias", vec![d]),
                ("attention.output.dense.weight", vec![d, d]),
                ("attention.output.dense.bias", vec![d]),
                ("attention.output.LayerNorm.weight", vec![d]),
                ("attention.output.LayerNorm.bias", vec![d]),
                ("intermediate.dense.weight", vec![inter, d]),
                ("intermediate.dense.bias", vec![inter]),
                ("output.dense.weight", vec![d, inter]),
                ("output.dense.bias", vec![d]),
                ("output.LayerNorm.weight", vec![d]),
                ("output.LayerNorm.bias", vec![d]),
            ] {
                specs.push((format!("encoder.layer.{i}.{s}"), shape));
            }
        }
        for (name, expected) in &specs {
            let name = names.get(name);
            match src.shape(&name) {
                None => {
                    return Err(WeightsError::Missing {
                        name,
                        files: src.describe(),
                    });
                }
                Some(found) if found != expected.as_slice() => {
                    return Err(WeightsError::Shape {
                        name,
                        expected: expected.clone(),
                        found: found.to_vec(),
                    });
                }
                Some(_) => {}
            }
        }
        let read = |name: &str, shape: &[usize]| src.read_f32(&names.get(name), shape);
        let t1 = |data: Vec<f32>| {
            let n = data.len();
            Tensor::<1>::from_data(TensorData::new(data, [n]), device)
        };
        let t2 = |data: Vec<f32>, shape: [usize; 2]| {
            Tensor::<2>::from_data(TensorData::new(data, shape), device)
        };
        // HF linear `[out, in]` -> burn `[in, out]`.
        let lin = |name: &str, d_in: usize, d_out: usize| -> Result<_, WeightsError> {
            let w = read(&format!("{name}.weight"), &[d_out, d_in])?;
            let b = read(&format!("{name}.bias"), &[d_out])?;
            Ok((t2(transpose(&w, d_out, d_in), [d_in, d_out]), b))
        };
        let norm = |name: &str| -> Result<Norm, WeightsError> {
            Ok(Norm {
                gamma: read(&format!("{name}.weight"), &[d])?,
                beta: read(&format!("{name}.bias"), &[d])?,
            })
        };
        let word = read("embeddings.word_embeddings.weight", &[cfg.vocab_size, d])?;
        let mut pos = read(
            "embeddings.position_embeddings.weight",
            &[cfg.max_position_embeddings, d],
        )?;
        let types = read(
            "embeddings.token_type_embeddings.weight",
            &[cfg.type_vocab_size, d],
        )?;
        // token_type_ids are all 0: fold type row 0 into the position table.
        for row in pos.chunks_exact_mut(d) {
            row.iter_mut().zip(&types[..d]).for_each(|(p, t)| *p += t);
        }
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("encoder.layer.{i}");
            let (q_w, q_b) = lin(&format!("{p}.attention.self.query"), d, d)?;
            let (k_w, k_b) = lin(&format!("{p}.attention.self.key"), d, d)?;
            let (v_w, v_b) = lin(&format!("{p}.attention.self.value"), d, d)?;
            let (attn_out_w, attn_out_b) = lin(&format!("{p}.attention.output.dense"), d, d)?;
            // The MLP in blocks of `width` intermediate units: HF `[inter, d]` rows of the
            // up-projection and `[d, inter]` columns of the down-projection.
            let w_up = read(&format!("{p}.intermediate.dense.weight"), &[inter, d])?;
            let b_up = read(&format!("{p}.intermediate.dense.bias"), &[inter])?;
            let w_down = transpose(
                &read(&format!("{p}.output.dense.weight"), &[d, inter])?,
                d,
                inter,
            );
            let width = if inter.is_multiple_of(d) { d } else { inter };
            let mlp = (0..inter / width)
                .map(|j| {
                    let rows = j * width..(j + 1) * width;
                    MlpBlock {
                        w_in: t2(
                            transpose(&w_up[rows.start * d..rows.end * d], width, d),
                            [d, width],
                        ),
                        b_in: b_up[rows.clone()].to_vec(),
                        w_out: t2(w_down[rows.start * d..rows.end * d].to_vec(), [width, d]),
                    }
                })
                .collect();
            layers.push(Layer {
                q_w,
                q_b: t1(q_b),
                k_w,
                k_b: t1(k_b),
                v_w,
                v_b: t1(v_b),
                attn_out_w,
                attn_out_b,
                ln1: norm(&format!("{p}.attention.output.LayerNorm"))?,
                mlp,
                out_b: read(&format!("{p}.output.dense.bias"), &[d])?,
                ln2: norm(&format!("{p}.output.LayerNorm"))?,
            });
        }
        Ok(BertModel {
            word,
            pos_type: pos,
            ln: norm("embeddings.LayerNorm")?,
            layers,
            cfg: cfg.clone(),
            device: device.clone(),
        })
    }

    /// Token ids `[b, t]` (row-major, every id below `vocab_size`, `t <= max_positions`) and
    /// each row's real length (`1..=t`, the rest padding) -> last hidden states `[b * t, d]`
    /// (row-major; rows of padding positions are meaningless).
    fn forward(&self, ids: &[u32], b: usize, t: usize, lens: &[usize]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (d, h) = (cfg.hidden_size, cfg.num_attention_heads);
        let hd = d / h;
        let eps = cfg.layer_norm_eps as f32;
        let scale = 1.0 / (hd as f32).sqrt();
        // Embeddings on the host: word row + (position + type 0) row, LayerNorm.
        let mut x0 = vec![0.0f32; b * t * d];
        for (i, (row, &id)) in x0.chunks_exact_mut(d).zip(ids).enumerate() {
            let w = &self.word[id as usize * d..(id as usize + 1) * d];
            let p = &self.pos_type[(i % t) * d..(i % t + 1) * d];
            row.iter_mut()
                .zip(w.iter().zip(p))
                .for_each(|(o, (w, p))| *o = w + p);
        }
        par_rows(&mut x0, d, |x| {
            kernels::add_layer_norm(x, None, None, &self.ln.gamma, &self.ln.beta, eps)
        });
        let mut x = Tensor::<2>::from_data(TensorData::new(x0, [b * t, d]), &self.device);
        for l in &self.layers {
            let q = linear(x.clone(), l.q_w.clone(), Some(l.q_b.clone())).into_data();
            let k = linear(x.clone(), l.k_w.clone(), Some(l.k_b.clone())).into_data();
            let v = linear(x.clone(), l.v_w.clone(), Some(l.v_b.clone())).into_data();
            let mut att = vec![0.0f32; b * t * d];
            {
                let (q, k, v) = (f32s(&q), f32s(&k), f32s(&v));
                att.par_chunks_mut(t * d)
                    .zip(lens)
                    .enumerate()
                    .for_each(|(bi, (out, &len))| {
                        let rows = bi * t * d..(bi + 1) * t * d;
                        let (q, k, v) = (&q[rows.clone()], &k[rows.clone()], &v[rows]);
                        for head in 0..h {
                            kernels::attention_head(q, k, v, out, d, head * hd, hd, len, scale);
                        }
                    });
            }
            drop((q, k, v));
            let a = Tensor::<2>::from_data(TensorData::new(att, [b * t, d]), &self.device);
            // Output projection, then bias + residual + LayerNorm in one pass.
            let a = a.matmul(l.attn_out_w.clone());
            let x1 = map_host2(a, x, |y, res| {
                par_rows2(y, res, d, |y, res| {
                    kernels::add_layer_norm(
                        y,
                        Some(&l.attn_out_b),
                        Some(res),
                        &l.ln1.gamma,
                        &l.ln1.beta,
                        eps,
                    )
                })
            });
            // MLP block by block (matmuls of width d run faster than one of width 4d, and the
            // block's activations stay in cache), summed.
            let mut y: Option<Tensor<2>> = None;
            for blk in &l.mlp {
                let m = x1.clone().matmul(blk.w_in.clone());
                let m = map_host(m, |m| {
                    par_rows(m, blk.b_in.len(), |m| match cfg.act() {
                        Act::Gelu => kernels::bias_gelu(m, &blk.b_in),
                        Act::GeluTanh => kernels::bias_gelu_tanh(m, &blk.b_in),
                    })
                });
                let part = m.matmul(blk.w_out.clone());
                y = Some(match y {
                    None => part,
                    Some(y) => y + part,
                });
            }
            let y = y.expect("an MLP has at least one block");
            x = map_host2(y, x1, |y, res| {
                par_rows2(y, res, d, |y, res| {
                    kernels::add_layer_norm(
                        y,
                        Some(&l.out_b),
                        Some(res),
                        &l.ln2.gamma,
                        &l.ln2.beta,
                        eps,
                    )
                })
            });
        }
        x.into_data()
            .try_into_vec_as::<f32>()
            .expect("the hidden states are f32")
    }
}

/// Run `f` over a float tensor's values in place and return the tensor: zero-copy for a unique,
/// contiguous tensor (every fresh op output is one).
fn map_host<const D: usize>(x: Tensor<D>, f: impl FnOnce(&mut [f32])) -> Tensor<D> {
    let device = x.device();
    let mut data = x.into_data();
    f(data.as_mut_slice::<f32>().expect("activations are f32"));
    Tensor::from_data(data, &device)
}

/// The values of a float tensor's data.
fn f32s(x: &TensorData) -> &[f32] {
    x.as_slice::<f32>().expect("activations are f32")
}

/// Rows per rayon task of the host kernels.
const ROWS_PER_TASK: usize = 64;

/// Run `f` over blocks of [`ROWS_PER_TASK`] rows of width `d`, in parallel (rayon).
fn par_rows(xs: &mut [f32], d: usize, f: impl Fn(&mut [f32]) + Sync) {
    xs.par_chunks_mut(ROWS_PER_TASK * d).for_each(&f);
}

/// [`par_rows`] with a read-only companion of the same shape.
fn par_rows2(xs: &mut [f32], other: &[f32], d: usize, f: impl Fn(&mut [f32], &[f32]) + Sync) {
    xs.par_chunks_mut(ROWS_PER_TASK * d)
        .zip(other.par_chunks(ROWS_PER_TASK * d))
        .for_each(|(x, o)| f(x, o));
}

/// [`map_host`] with a second, read-only tensor of the same shape (a residual).
fn map_host2<const D: usize>(
    x: Tensor<D>,
    other: Tensor<D>,
    f: impl FnOnce(&mut [f32], &[f32]),
) -> Tensor<D> {
    let other = other.into_data();
    map_host(x, |x| {
        f(x, other.as_slice::<f32>().expect("activations are f32"))
    })
}

/// The host kernels the forward pass runs between burn's matmuls, each one pass over a fresh
/// matmul output: bias + GELU and bias + residual + LayerNorm (in place), and attention per
/// head. burn-flex computes GELU with a scalar libm `erff` and its attention softmax with a
/// scalar `expf` (together ~30% of a MiniLM forward when this encoder used them), and a bias
/// add, a residual add and a LayerNorm are three passes and two allocations there. The
/// element-wise loops are branch-free so that LLVM vectorises them, compiled for AVX-512 and for
/// AVX2 + FMA and picked at run time; the attention tiles use AVX-512 intrinsics where the CPU
/// has them and portable loops elsewhere. The erf is the Abramowitz-Stegun 7.1.26 form that
/// PyTorch's vectorised CPU GELU uses.
mod kernels {
    use crate::vmath::{dispatch, exp};

    /// `erf(x)`, |error| < 5e-7 in f32 (Abramowitz-Stegun 7.1.26).
    #[inline(always)]
    fn erf(x: f32) -> f32 {
        let a = x.abs();
        let t = 1.0 / (1.0 + 0.327_591_1 * a);
        let poly = ((((1.061_405_4 * t - 1.453_152_1) * t + 1.421_413_8) * t - 0.284_496_72) * t
            + 0.254_829_6)
            * t;
        (1.0 - poly * exp(-a * a)).copysign(x)
    }

    /// Rows of `xs` (width `bias.len()`): `x <- gelu(x + bias)`.
    #[inline(always)]
    fn bias_gelu_generic(xs: &mut [f32], bias: &[f32]) {
        for row in xs.chunks_exact_mut(bias.len()) {
            for (x, b) in row.iter_mut().zip(bias) {
                let v = *x + b;
                *x = 0.5 * v * (1.0 + erf(v * std::f32::consts::FRAC_1_SQRT_2));
            }
        }
    }

    #[inline(always)]
    fn bias_gelu_tanh_generic(xs: &mut [f32], bias: &[f32]) {
        const K: f32 = 0.797_884_6; // sqrt(2 / pi)
        for row in xs.chunks_exact_mut(bias.len()) {
            for (x, b) in row.iter_mut().zip(bias) {
                let v = *x + b;
                let u = K * (v + 0.044_715 * v * v * v);
                let tanh = 1.0 - 2.0 / (exp(2.0 * u) + 1.0);
                *x = 0.5 * v * (1.0 + tanh);
            }
        }
    }

    /// Rows of `ys` (width `gamma.len()`): `y <- LayerNorm(y + bias + residual)` (biased
    /// variance, as torch), either addend optional.
    #[inline(always)]
    fn add_layer_norm_generic(
        ys: &mut [f32],
        bias: Option<&[f32]>,
        residual: Option<&[f32]>,
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
    ) {
        let d = gamma.len();
        for (i, y) in ys.chunks_exact_mut(d).enumerate() {
            if let Some(b) = bias {
                y.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
            if let Some(r) = residual {
                y.iter_mut()
                    .zip(&r[i * d..(i + 1) * d])
                    .for_each(|(y, r)| *y += r);
            }
            let mean = lane_sum(y) / d as f32;
            y.iter_mut().for_each(|v| *v -= mean);
            let var = lane_sum_sq(y) / d as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for ((v, g), b) in y.iter_mut().zip(gamma).zip(beta) {
                *v = *v * inv * g + b;
            }
        }
    }

    const L: usize = 16;

    /// Sum with 16 lane accumulators (vectorises; the order differs from a serial sum).
    #[inline(always)]
    fn lane_sum(xs: &[f32]) -> f32 {
        let mut acc = [0.0f32; L];
        let mut chunks = xs.chunks_exact(L);
        for c in &mut chunks {
            for j in 0..L {
                acc[j] += c[j];
            }
        }
        chunks.remainder().iter().sum::<f32>() + acc.iter().sum::<f32>()
    }

    #[inline(always)]
    fn lane_sum_sq(xs: &[f32]) -> f32 {
        let mut acc = [0.0f32; L];
        let mut chunks = xs.chunks_exact(L);
        for c in &mut chunks {
            for j in 0..L {
                acc[j] += c[j] * c[j];
            }
        }
        chunks.remainder().iter().map(|x| x * x).sum::<f32>() + acc.iter().sum::<f32>()
    }

    /// Query rows, keys and head columns per tile of the attention kernel.
    const ROWS: usize = 4;
    const TILE: usize = 32;

    /// The two inner tiles of [`attention_head`]: portable loops, or AVX-512 intrinsics.
    trait Tiles {
        /// `s[r * n + jb..][..TILE] = qs[r * hd..][..hd] . kt[.., jb..jb + TILE]` for the
        /// `ROWS` query rows of `qs`; `kt` is K^T `[hd, n]`.
        fn qk(qs: &[f32], hd: usize, kt: &[f32], n: usize, jb: usize, s: &mut [f32]);
        /// `acc[r] = sum_{j < len} s[r * n + j] * vs[j * hp + cb..][..TILE]`.
        fn pv(
            s: &[f32],
            n: usize,
            len: usize,
            vs: &[f32],
            hp: usize,
            cb: usize,
        ) -> [[f32; TILE]; ROWS];
    }

    struct Portable;

    impl Tiles for Portable {
        #[inline(always)]
        fn qk(qs: &[f32], hd: usize, kt: &[f32], n: usize, jb: usize, s: &mut [f32]) {
            for r in 0..ROWS {
                let row = &mut s[r * n + jb..r * n + jb + TILE];
                row.fill(0.0);
                for c in 0..hd {
                    let qv = qs[r * hd + c];
                    for (x, k) in row.iter_mut().zip(&kt[c * n + jb..c * n + jb + TILE]) {
                        *x = qv.mul_add(*k, *x);
                    }
                }
            }
        }

        #[inline(always)]
        fn pv(
            s: &[f32],
            n: usize,
            len: usize,
            vs: &[f32],
            hp: usize,
            cb: usize,
        ) -> [[f32; TILE]; ROWS] {
            let mut acc = [[0.0f32; TILE]; ROWS];
            for (r, a) in acc.iter_mut().enumerate() {
                for j in 0..len {
                    let p = s[r * n + j];
                    for (x, v) in a.iter_mut().zip(&vs[j * hp + cb..j * hp + cb + TILE]) {
                        *x = p.mul_add(*v, *x);
                    }
                }
            }
            acc
        }
    }

    #[cfg(target_arch = "x86_64")]
    struct Avx512;

    #[cfg(target_arch = "x86_64")]
    impl Tiles for Avx512 {
        #[inline(always)]
        fn qk(qs: &[f32], hd: usize, kt: &[f32], n: usize, jb: usize, s: &mut [f32]) {
            use std::arch::x86_64::*;
            assert!(
                qs.len() >= ROWS * hd
                    && kt.len() >= hd * n
                    && jb + TILE <= n
                    && s.len() >= ROWS * n
            );
            // SAFETY: `Avx512` is used only by `attention_v4`, which runs only on CPUs with
            // AVX-512F; every pointer below is in bounds by the assertion above.
            unsafe {
                let mut acc = [_mm512_setzero_ps(); 2 * ROWS];
                for c in 0..hd {
                    let k0 = _mm512_loadu_ps(kt.as_ptr().add(c * n + jb));
                    let k1 = _mm512_loadu_ps(kt.as_ptr().add(c * n + jb + 16));
                    for r in 0..ROWS {
                        let q = _mm512_set1_ps(*qs.get_unchecked(r * hd + c));
                        acc[2 * r] = _mm512_fmadd_ps(q, k0, acc[2 * r]);
                        acc[2 * r + 1] = _mm512_fmadd_ps(q, k1, acc[2 * r + 1]);
                    }
                }
                for r in 0..ROWS {
                    let dst = s.as_mut_ptr().add(r * n + jb);
                    _mm512_storeu_ps(dst, acc[2 * r]);
                    _mm512_storeu_ps(dst.add(16), acc[2 * r + 1]);
                }
            }
        }

        #[inline(always)]
        fn pv(
            s: &[f32],
            n: usize,
            len: usize,
            vs: &[f32],
            hp: usize,
            cb: usize,
        ) -> [[f32; TILE]; ROWS] {
            use std::arch::x86_64::*;
            assert!(len <= n && s.len() >= ROWS * n && vs.len() >= len * hp && cb + TILE <= hp);
            let mut out = [[0.0f32; TILE]; ROWS];
            // SAFETY: as in `qk`.
            unsafe {
                let mut acc = [_mm512_setzero_ps(); 2 * ROWS];
                for j in 0..len {
                    let v0 = _mm512_loadu_ps(vs.as_ptr().add(j * hp + cb));
                    let v1 = _mm512_loadu_ps(vs.as_ptr().add(j * hp + cb + 16));
                    for r in 0..ROWS {
                        let p = _mm512_set1_ps(*s.get_unchecked(r * n + j));
                        acc[2 * r] = _mm512_fmadd_ps(p, v0, acc[2 * r]);
                        acc[2 * r + 1] = _mm512_fmadd_ps(p, v1, acc[2 * r + 1]);
                    }
                }
                for (r, o) in out.iter_mut().enumerate() {
                    _mm512_storeu_ps(o.as_mut_ptr(), acc[2 * r]);
                    _mm512_storeu_ps(o.as_mut_ptr().add(16), acc[2 * r + 1]);
                }
            }
            out
        }
    }

    /// One head of self-attention over one sequence, written into `out`. `q`, `k`, `v`, `out`
    /// are `[t, d]` row-major; the head is columns `col..col + hd`; the first `len` rows are
    /// real tokens. Real queries attend to the real keys only (`softmax(q k^T * scale) v`);
    /// padded query rows of `out` are left as they are. The head's scaled Q, K^T and V are
    /// gathered into zero-padded scratch, then tiles of 4 query rows x 32 keys (scores) and
    /// 4 query rows x 32 columns (values) are computed with every loaded vector serving 4 rows.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_head(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        d: usize,
        col: usize,
        hd: usize,
        len: usize,
        scale: f32,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            fn v4(
                q: &[f32],
                k: &[f32],
                v: &[f32],
                out: &mut [f32],
                d: usize,
                col: usize,
                hd: usize,
                len: usize,
                scale: f32,
            ) {
                attention_impl::<Avx512>(q, k, v, out, d, col, hd, len, scale)
            }
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            fn v3(
                q: &[f32],
                k: &[f32],
                v: &[f32],
                out: &mut [f32],
                d: usize,
                col: usize,
                hd: usize,
                len: usize,
                scale: f32,
            ) {
                attention_impl::<Portable>(q, k, v, out, d, col, hd, len, scale)
            }
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has the features `v4` is compiled for.
                return unsafe { v4(q, k, v, out, d, col, hd, len, scale) };
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                // SAFETY: as above, for `v3`.
                return unsafe { v3(q, k, v, out, d, col, hd, len, scale) };
            }
        }
        attention_impl::<Portable>(q, k, v, out, d, col, hd, len, scale)
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn attention_impl<T: Tiles>(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        out: &mut [f32],
        d: usize,
        col: usize,
        hd: usize,
        len: usize,
        scale: f32,
    ) {
        let n = len.next_multiple_of(TILE); // keys, padded
        let hp = hd.next_multiple_of(TILE); // head width, padded
        let m = len.next_multiple_of(ROWS); // query rows, padded
        let mut qs = vec![0.0f32; m * hd];
        let mut kt = vec![0.0f32; hd * n];
        let mut vs = vec![0.0f32; len * hp];
        for j in 0..len {
            let src = j * d + col..j * d + col + hd;
            for (dst, &x) in qs[j * hd..(j + 1) * hd].iter_mut().zip(&q[src.clone()]) {
                *dst = x * scale;
            }
            for (c, &x) in k[src.clone()].iter().enumerate() {
                kt[c * n + j] = x;
            }
            vs[j * hp..j * hp + hd].copy_from_slice(&v[src]);
        }
        let mut s = vec![0.0f32; ROWS * n];
        for i0 in (0..m).step_by(ROWS) {
            let qb = &qs[i0 * hd..(i0 + ROWS) * hd];
            for jb in (0..n).step_by(TILE) {
                T::qk(qb, hd, &kt, n, jb, &mut s);
            }
            // Unnormalised softmax over the real keys; padded keys weigh 0.
            let mut inv = [0.0f32; ROWS];
            for (r, inv) in inv.iter_mut().enumerate() {
                let (keys, pad) = s[r * n..(r + 1) * n].split_at_mut(len);
                pad.fill(0.0);
                let max = lane_max(keys);
                *inv = 1.0 / crate::vmath::exp_shift_sum(keys, max);
            }
            for cb in (0..hp).step_by(TILE) {
                let acc = T::pv(&s, n, len, &vs, hp, cb);
                let w = (hd - cb).min(TILE);
                for (r, a) in acc.iter().enumerate() {
                    let i = i0 + r;
                    if i < len {
                        let o = &mut out[i * d + col + cb..i * d + col + cb + w];
                        for (o, a) in o.iter_mut().zip(a) {
                            *o = a * inv[r];
                        }
                    }
                }
            }
        }
    }

    /// Max with 16 lane accumulators.
    #[inline(always)]
    fn lane_max(xs: &[f32]) -> f32 {
        let mut m = [f32::NEG_INFINITY; L];
        let mut chunks = xs.chunks_exact(L);
        for c in &mut chunks {
            for l in 0..L {
                m[l] = m[l].max(c[l]);
            }
        }
        chunks.remainder().iter().fold(
            m.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)),
            |a, &b| a.max(b),
        )
    }

    dispatch!(
        /// Bias then exact GELU in place, `0.5 v (1 + erf(v / sqrt 2))`, `v = x + bias` (HF
        /// `gelu`), over rows of width `bias.len()`.
        pub bias_gelu, bias_gelu_generic, (xs: &mut [f32], bias: &[f32])
    );
    dispatch!(
        /// Bias then tanh-approximate GELU in place (HF `gelu_new`, `gelu_pytorch_tanh`).
        pub bias_gelu_tanh, bias_gelu_tanh_generic, (xs: &mut [f32], bias: &[f32])
    );
    dispatch!(
        /// See `add_layer_norm_generic`.
        pub add_layer_norm, add_layer_norm_generic,
        (ys: &mut [f32], bias: Option<&[f32]>, residual: Option<&[f32]>, gamma: &[f32], beta: &[f32], eps: f32)
    );

    #[cfg(test)]
    mod tests {
        use super::*;

        /// erf in f64 from its Taylor series (accurate to ~1e-10 on [-4, 4]; +-1 beyond).
        fn erf_ref(x: f64) -> f64 {
            if x.abs() > 4.0 {
                return x.signum();
            }
            let (mut term, mut sum) = (x, x);
            for n in 1..200 {
                term *= -x * x / n as f64;
                sum += term / (2 * n + 1) as f64;
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        }

        #[test]
        fn exp_and_erf_are_accurate() {
            let mut worst_exp = 0.0f64;
            let mut worst_erf = 0.0f64;
            for i in -87_000..=20_000 {
                let x = i as f32 / 1000.0;
                let want = (x as f64).exp();
                worst_exp = worst_exp.max(((exp(x) as f64) - want).abs() / want);
            }
            for i in -6000..=6000 {
                let x = i as f32 / 1000.0;
                let want = erf_ref(x as f64);
                worst_erf = worst_erf.max(((erf(x) as f64) - want).abs());
            }
            assert!(worst_exp < 3e-7, "exp relative error {worst_exp}");
            assert!(worst_erf < 6e-7, "erf error {worst_erf}");
        }

        #[test]
        fn gelu_matches_the_erf_definition() {
            let xs: Vec<f32> = (-800..=800).map(|i| i as f32 / 100.0).collect();
            let mut got = xs.clone();
            bias_gelu(&mut got, &[0.0]);
            let mut portable = xs.clone();
            bias_gelu_generic(&mut portable, &[0.0]);
            assert_eq!(got, portable);
            for (x, g) in xs.iter().zip(&got) {
                let want = 0.5 * *x as f64 * (1.0 + erf_ref(*x as f64 / 2f64.sqrt()));
                assert!(
                    (*g as f64 - want).abs() < 1e-6,
                    "gelu({x}) = {g}, want {want}"
                );
            }
            let mut t = xs.clone();
            bias_gelu_tanh(&mut t, &[0.0]);
            for (x, g) in xs.iter().zip(&t) {
                let x = *x as f64;
                let want = 0.5
                    * x
                    * (1.0
                        + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3)))
                            .tanh());
                assert!(
                    (*g as f64 - want).abs() < 1e-5,
                    "gelu_tanh({x}) = {g}, want {want}"
                );
            }
        }

        #[test]
        fn add_layer_norm_matches_the_definition() {
            let d = 40;
            let y0: Vec<f32> = (0..2 * d).map(|i| ((i * 37) % 11) as f32 - 4.0).collect();
            let res: Vec<f32> = (0..2 * d).map(|i| (i % 5) as f32 * 0.5).collect();
            let bias: Vec<f32> = (0..d).map(|i| i as f32 * 0.01).collect();
            let gamma: Vec<f32> = (0..d).map(|i| 1.0 + i as f32 * 0.1).collect();
            let beta: Vec<f32> = (0..d).map(|i| -(i as f32) * 0.2).collect();
            let mut y = y0.clone();
            add_layer_norm(&mut y, Some(&bias), Some(&res), &gamma, &beta, 1e-12);
            let mut portable = y0.clone();
            add_layer_norm_generic(&mut portable, Some(&bias), Some(&res), &gamma, &beta, 1e-12);
            for (a, b) in y.iter().zip(&portable) {
                assert!((a - b).abs() < 1e-5);
            }
            for r in 0..2 {
                let v: Vec<f64> = (0..d)
                    .map(|j| (y0[r * d + j] + bias[j] + res[r * d + j]) as f64)
                    .collect();
                let mean = v.iter().sum::<f64>() / d as f64;
                let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / d as f64;
                for j in 0..d {
                    let want =
                        (v[j] - mean) / (var + 1e-12).sqrt() * gamma[j] as f64 + beta[j] as f64;
                    assert!((y[r * d + j] as f64 - want).abs() < 1e-5, "{r},{j}");
                }
            }
        }

        /// Reference attention in f64 for one head.
        #[allow(clippy::too_many_arguments)]
        fn attention_ref(
            q: &[f32],
            k: &[f32],
            v: &[f32],
            d: usize,
            col: usize,
            hd: usize,
            len: usize,
            scale: f64,
        ) -> Vec<f64> {
            let mut out = vec![0.0; len * hd];
            for i in 0..len {
                let sc: Vec<f64> = (0..len)
                    .map(|j| {
                        (0..hd)
                            .map(|c| q[i * d + col + c] as f64 * k[j * d + col + c] as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for c in 0..hd {
                    out[i * hd + c] = (0..len).map(|j| e[j] / z * v[j * d + col + c] as f64).sum();
                }
            }
            out
        }

        #[test]
        fn attention_matches_the_definition_and_ignores_padding() {
            // d = 2 heads of width 20 (not a multiple of 16), t = 23 rows of which 21 are real.
            let (d, hd, t, len) = (40, 20, 23, 21);
            let val = |i: usize, m: usize| ((i * m) % 17) as f32 / 8.0 - 1.0;
            let q: Vec<f32> = (0..t * d).map(|i| val(i, 7)).collect();
            let k: Vec<f32> = (0..t * d).map(|i| val(i, 11)).collect();
            let mut v: Vec<f32> = (0..t * d).map(|i| val(i, 13)).collect();
            let mut out = vec![7.0f32; t * d];
            let mut portable = out.clone();
            for head in 0..2 {
                attention_head(&q, &k, &v, &mut out, d, head * hd, hd, len, 0.3);
                // The portable tiles (what CPUs without AVX-512 run) agree.
                attention_impl::<Portable>(&q, &k, &v, &mut portable, d, head * hd, hd, len, 0.3);
            }
            for head in 0..2 {
                let want = attention_ref(&q, &k, &v, d, head * hd, hd, len, 0.3);
                for i in 0..len {
                    for c in 0..hd {
                        let j = i * d + head * hd + c;
                        assert!(
                            (out[j] as f64 - want[i * hd + c]).abs() < 1e-5,
                            "{head} {i} {c}"
                        );
                        assert!((portable[j] - out[j]).abs() < 1e-5, "{head} {i} {c}");
                    }
                }
            }
            // Padded query rows are untouched; padded keys do not matter.
            assert!(out[len * d..].iter().all(|&x| x == 7.0));
            v[(len + 1) * d] = 1e6;
            let mut again = vec![7.0f32; t * d];
            for head in 0..2 {
                attention_head(&q, &k, &v, &mut again, d, head * hd, hd, len, 0.3);
            }
            assert_eq!(out, again);
        }
    }
}

/// Pool the hidden states of one padded batch into `out` (`lens.len() x d`, row-major), then
/// L2-normalise each row when `normalize` (as torch `F.normalize`, eps 1e-12). `hidden` is
/// `[lens.len(), t, d]`; row `i` has `lens[i] >= 1` real tokens at the front, the rest padding.
pub fn pool(
    hidden: &[f32],
    lens: &[usize],
    t: usize,
    d: usize,
    pooling: Pooling,
    normalize: bool,
    out: &mut [f32],
) {
    for (i, (&len, o)) in lens.iter().zip(out.chunks_exact_mut(d)).enumerate() {
        let rows = &hidden[i * t * d..(i * t + len.clamp(1, t)) * d];
        match pooling {
            Pooling::Cls => o.copy_from_slice(&rows[..d]),
            Pooling::Mean => {
                o.fill(0.0);
                for r in rows.chunks_exact(d) {
                    o.iter_mut().zip(r).for_each(|(a, x)| *a += x);
                }
                let n = (rows.len() / d) as f32;
                o.iter_mut().for_each(|a| *a /= n);
            }
            Pooling::Max => {
                o.fill(f32::NEG_INFINITY);
                for r in rows.chunks_exact(d) {
                    o.iter_mut().zip(r).for_each(|(a, x)| *a = a.max(*x));
                }
            }
        }
        if normalize {
            let norm = o.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
            o.iter_mut().for_each(|x| *x /= norm);
        }
    }
}

/// A BERT-family sentence encoder loaded from a sentence-transformers (or plain HF) folder.
/// `Send + Sync` (burn's tensors are): share it as `Arc<SentenceEncoder>`; concurrent
/// [`Self::encode`] calls run side by side on the shared, read-only weights.
pub struct SentenceEncoder {
    model: BertModel,
    tokenizer: tokenizers::Tokenizer,
    settings: SentenceSettings,
    dim: usize,
    pad_id: u32,
    dir: PathBuf,
    fingerprint: String,
}

impl std::fmt::Debug for SentenceEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentenceEncoder")
            .field("dir", &self.dir)
            .field("dim", &self.dim())
            .field("settings", &self.settings)
            .finish()
    }
}

impl SentenceEncoder {
    /// Load an encoder: `dir` is a folder (sentence-transformers layout or a plain HF BERT
    /// folder) or a name recorded in `.kiln/models.json` (`all-minilm-l6-v2`, installed by
    /// `just setup-test`).
    pub fn load(dir: impl AsRef<Path>) -> Result<Self, EncoderError> {
        let spec = dir.as_ref();
        let dir = if spec.is_dir() {
            spec.to_path_buf()
        } else {
            let name = spec.to_string_lossy();
            match crate::zoo::lookup_name(&name) {
                Ok(Some(p)) if p.is_dir() => p,
                Ok(_) => return Err(EncoderError::NotFound(name.into_owned())),
                Err(e) => return Err(config_err(Path::new(".kiln/models.json"), e.to_string())),
            }
        };
        // The transformer's folder: `dir`, or the Transformer module's sub-folder. The sequence
        // length is capped by max_position_embeddings once config.json is read.
        let (mut settings, model_dir) = SentenceSettings::read(&dir, limits::MAX_POSITIONS)?;
        let missing: Vec<&str> = [
            ("config.json", model_dir.join("config.json").exists()),
            ("tokenizer.json", model_dir.join("tokenizer.json").exists()),
            (
                "model.safetensors",
                model_dir.join("model.safetensors").exists()
                    || model_dir.join("model.safetensors.index.json").exists(),
            ),
        ]
        .into_iter()
        .filter(|(_, ok)| !ok)
        .map(|(f, _)| f)
        .collect();
        if !missing.is_empty() {
            return Err(EncoderError::MissingFiles {
                dir: model_dir.display().to_string(),
                missing: missing.join(", "),
            });
        }
        let cfg_path = model_dir.join("config.json");
        let cfg_text =
            read_text_bounded(&cfg_path, MAX_CONFIG_BYTES).map_err(|source| EncoderError::Io {
                path: cfg_path.display().to_string(),
                source,
            })?;
        let cfg = BertConfig::from_json(&cfg_text, &cfg_path)?;
        settings.max_seq_len = settings.max_seq_len.min(cfg.max_position_embeddings);

        let tok_path = model_dir.join("tokenizer.json");
        let tok_err = |message: String| EncoderError::Tokenizer {
            path: tok_path.display().to_string(),
            message,
        };
        let tok_text = read_text_bounded(&tok_path, MAX_TOKENIZER_BYTES)
            .map_err(|e| tok_err(e.to_string()))?;
        let mut tokenizer: tokenizers::Tokenizer =
            tok_text.parse().map_err(|e| tok_err(format!("{e}")))?;
        let n_special = tokenizer
            .get_post_processor()
            .map_or(0, |p| tokenizers::PostProcessor::added_tokens(p, false));
        if settings.max_seq_len <= n_special {
            return Err(tok_err(format!(
                "max_seq_length {} leaves no room for text after {n_special} special tokens",
                settings.max_seq_len
            )));
        }
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length: settings.max_seq_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| tok_err(format!("{e}")))?;
        // Every id the tokenizer can produce must have an embedding row.
        if let Some((tok, id)) = tokenizer
            .get_vocab(true)
            .into_iter()
            .max_by_key(|(_, id)| *id)
            && id as usize >= cfg.vocab_size
        {
            return Err(tok_err(format!(
                "token `{tok}` has id {id} but the model's vocab_size (config.json) is {}: the tokenizer and the model do not belong together",
                cfg.vocab_size
            )));
        }
        let pad_id = cfg
            .pad_token_id
            .or_else(|| tokenizer.token_to_id("[PAD]"))
            .unwrap_or(0);

        let weights_path = if model_dir.join("model.safetensors").exists() {
            model_dir.join("model.safetensors")
        } else {
            model_dir.clone()
        };
        let weights_err = |source| EncoderError::Weights {
            path: weights_path.display().to_string(),
            source,
        };
        let src = SafetensorsSource::open_dir(&model_dir).map_err(weights_err)?;
        let device = Device::flex();
        let model = BertModel::load(&cfg, &src, &device).map_err(weights_err)?;
        let fingerprint = fingerprint(cfg_text.as_bytes(), tok_text.as_bytes(), &settings, &src);
        Ok(SentenceEncoder {
            model,
            tokenizer,
            settings,
            dim: cfg.hidden_size,
            pad_id,
            dir,
            fingerprint,
        })
    }

    /// Width of the embeddings.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Longest token sequence (special tokens included); longer texts are truncated.
    pub fn max_seq_len(&self) -> usize {
        self.settings.max_seq_len
    }

    /// The pooling of token vectors into the sentence vector.
    pub fn pooling(&self) -> Pooling {
        self.settings.pooling
    }

    /// Whether embeddings are L2-normalised.
    pub fn normalizes(&self) -> bool {
        self.settings.normalize
    }

    /// The folder the encoder was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// All settings read from the folder.
    pub fn settings(&self) -> &SentenceSettings {
        &self.settings
    }

    /// A stable hex id of the encoder (SHA-256): the same model in two folders gives the same
    /// id, a different model, tokenizer or setting gives another. It covers config.json,
    /// tokenizer.json, pooling / normalisation / max_seq_len / lowercasing / prompts, the
    /// safetensors headers (names, dtypes, shapes) and 16 evenly spaced 4 KiB samples of each
    /// weight file's data (so two fine-tunes of one architecture differ), not every weight byte.
    pub fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    /// Token count of each text as [`Self::encode`] feeds it to the model (prompt and special
    /// tokens included, truncated to [`Self::max_seq_len`]).
    pub fn token_counts(&self, texts: &[&str], kind: TextKind) -> Result<Vec<usize>, EncoderError> {
        Ok(self
            .tokenize(texts, kind)?
            .iter()
            .map(|e| e.len())
            .collect())
    }

    /// Prompt, optional lowercasing, then one batched tokenisation (truncated, unpadded).
    fn tokenize(
        &self,
        texts: &[&str],
        kind: TextKind,
    ) -> Result<Vec<tokenizers::Encoding>, EncoderError> {
        let prompt = self.settings.prompt(kind);
        let inputs: Vec<Cow<'_, str>> = texts
            .iter()
            .map(|&t| {
                let t: Cow<'_, str> = if prompt.is_empty() {
                    Cow::Borrowed(t)
                } else {
                    Cow::Owned(format!("{prompt}{t}"))
                };
                if self.settings.lowercase {
                    Cow::Owned(t.to_lowercase())
                } else {
                    t
                }
            })
            .collect();
        self.tokenizer
            .encode_batch_fast(inputs, true)
            .map_err(|e| EncoderError::Encode(e.to_string()))
    }

    /// Embed `texts` (the query or passage prompt of the folder in front of each): a row-major
    /// `texts.len() x dim` matrix in input order. Texts are truncated to [`Self::max_seq_len`]
    /// tokens; any string works (empty, huge, any Unicode). `batch_size` texts go through the
    /// model at once (0 counts as 1; at most [`MAX_PASS_TOKENS`] tokens per pass); the result
    /// does not depend on it beyond float rounding.
    pub fn encode(
        &self,
        texts: &[&str],
        kind: TextKind,
        batch_size: usize,
    ) -> Result<Vec<f32>, EncoderError> {
        if texts.is_empty() {
            return Ok(Vec::new());
        }
        let encodings = self.tokenize(texts, kind)?;
        let ids: Vec<&[u32]> = encodings.iter().map(|e| e.get_ids()).collect();
        let model = &self.model;
        let d = model.cfg.hidden_size;
        let mut out = vec![0.0f32; texts.len() * d];
        // Longest first, so each batch's neighbours have (nearly) the same length.
        let mut order: Vec<usize> = (0..ids.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(ids[i].len()));
        let batch_size = batch_size.max(1);
        let mut start = 0;
        while start < order.len() {
            // The tokenizer bounds every length by max_seq_len (<= max_positions); an empty
            // encoding (no special tokens) is one pad token.
            let t = ids[order[start]].len().clamp(1, self.settings.max_seq_len);
            let rows = batch_size
                .min(MAX_PASS_TOKENS / t)
                .clamp(1, order.len() - start);
            let chunk = &order[start..start + rows];
            let mut flat = Vec::with_capacity(rows * t);
            let mut lens = Vec::with_capacity(rows);
            for &i in chunk {
                let row = &ids[i][..ids[i].len().min(t)];
                flat.extend_from_slice(row);
                flat.extend(std::iter::repeat_n(self.pad_id, t - row.len()));
                lens.push(row.len().max(1));
            }
            let hidden = model.forward(&flat, rows, t, &lens);
            let mut pooled = vec![0.0f32; rows * d];
            pool(
                &hidden,
                &lens,
                t,
                d,
                self.settings.pooling,
                self.settings.normalize,
                &mut pooled,
            );
            for (&i, v) in chunk.iter().zip(pooled.chunks_exact(d)) {
                out[i * d..(i + 1) * d].copy_from_slice(v);
            }
            start += rows;
        }
        Ok(out)
    }
}

/// See [`SentenceEncoder::fingerprint`].
fn fingerprint(
    config: &[u8],
    tokenizer: &[u8],
    s: &SentenceSettings,
    src: &SafetensorsSource,
) -> String {
    let mut h = Sha256::new();
    let mut field = |tag: &str, bytes: &[u8]| {
        h.update(tag.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    field("kiln-sentence-encoder/v1", b"");
    field("config.json", config);
    field("tokenizer.json", tokenizer);
    let settings = format!(
        "pooling={} normalize={} max_seq_len={} lowercase={}",
        s.pooling.name(),
        s.normalize,
        s.max_seq_len,
        s.lowercase
    );
    field("settings", settings.as_bytes());
    field("query_prompt", s.query_prompt.as_bytes());
    field("passage_prompt", s.passage_prompt.as_bytes());
    for bytes in src.file_bytes() {
        // The safetensors layout: u64 header length, JSON header, data.
        let n = bytes.get(..8).map_or(0, |b| {
            u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize
        });
        let header_end = 8usize.saturating_add(n).min(bytes.len());
        field("header", &bytes[..header_end]);
        let data = &bytes[header_end..];
        const SAMPLES: usize = 16;
        const CHUNK: usize = 4096;
        for k in 0..SAMPLES {
            let at = (data.len().saturating_sub(CHUNK)) * k / (SAMPLES - 1);
            field("sample", &data[at..(at + CHUNK).min(data.len())]);
        }
    }
    format!("{:x}", h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, rel: &str, text: &str) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    const MINI: &str = r#"{"model_type":"bert","vocab_size":100,"hidden_size":8,"num_hidden_layers":1,
        "num_attention_heads":2,"intermediate_size":16,"max_position_embeddings":64}"#;

    #[test]
    fn mean_pooling_ignores_padding_and_normalises() {
        // Two rows, t = 3, d = 2: row 0 has 2 real tokens, row 1 has 3.
        let hidden = [
            1.0, 2.0, 3.0, 4.0, 100.0, 100.0, // row 0 (last is padding)
            1.0, 1.0, 2.0, 2.0, 3.0, 3.0, // row 1
        ];
        let mut out = [0.0; 4];
        pool(&hidden, &[2, 3], 3, 2, Pooling::Mean, false, &mut out);
        assert_eq!(out, [2.0, 3.0, 2.0, 2.0]);
        pool(&hidden, &[2, 3], 3, 2, Pooling::Max, false, &mut out);
        assert_eq!(out, [3.0, 4.0, 3.0, 3.0]);
        pool(&hidden, &[2, 3], 3, 2, Pooling::Cls, false, &mut out);
        assert_eq!(out, [1.0, 2.0, 1.0, 1.0]);
        pool(&hidden, &[2, 3], 3, 2, Pooling::Mean, true, &mut out);
        let n0 = (4.0f32 + 9.0).sqrt();
        assert!((out[0] - 2.0 / n0).abs() < 1e-6 && (out[1] - 3.0 / n0).abs() < 1e-6);
        assert!((out[2] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        // A zero vector stays zero (no NaN).
        let mut z = [1.0; 2];
        pool(&[0.0, 0.0], &[1], 1, 2, Pooling::Mean, true, &mut z);
        assert_eq!(z, [0.0, 0.0]);
    }

    #[test]
    fn settings_of_a_sentence_transformers_folder() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        write(
            d,
            "modules.json",
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
        );
        write(
            d,
            "1_Pooling/config.json",
            r#"{"word_embedding_dimension":8,"pooling_mode_cls_token":true,"pooling_mode_mean_tokens":false}"#,
        );
        write(
            d,
            "sentence_bert_config.json",
            r#"{"max_seq_length":1000,"do_lower_case":false}"#,
        );
        write(
            d,
            "config_sentence_transformers.json",
            r#"{"prompts":{"query":"query: ","document":"passage: "},"default_prompt_name":null}"#,
        );
        let (s, model_dir) = SentenceSettings::read(d, 512).unwrap();
        assert_eq!(model_dir, d);
        assert_eq!(s.pooling, Pooling::Cls);
        assert!(s.normalize);
        assert_eq!(s.max_seq_len, 512, "capped by max_position_embeddings");
        assert_eq!(s.prompt(TextKind::Query), "query: ");
        assert_eq!(s.prompt(TextKind::Passage), "passage: ");
    }

    #[test]
    fn a_plain_hf_folder_means_mean_pooling_without_normalisation() {
        let tmp = tempfile::tempdir().unwrap();
        let (s, _) = SentenceSettings::read(tmp.path(), 128).unwrap();
        assert_eq!(s.pooling, Pooling::Mean);
        assert!(!s.normalize);
        assert_eq!(s.max_seq_len, 128);
        assert_eq!(s.prompt(TextKind::Query), "");
    }

    #[test]
    fn unsupported_sentence_transformers_modules_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        write(
            d,
            "modules.json",
            r#"[{"path":"","type":"sentence_transformers.models.Transformer"},
                {"path":"2_Dense","type":"sentence_transformers.models.Dense"}]"#,
        );
        let e = SentenceSettings::read(d, 512).unwrap_err().to_string();
        assert!(e.contains("modules.json") && e.contains("Dense"), "{e}");
        write(
            d,
            "modules.json",
            r#"[{"path":"../x","type":"sentence_transformers.models.Pooling"}]"#,
        );
        let e = SentenceSettings::read(d, 512).unwrap_err().to_string();
        assert!(e.contains("not a plain relative path"), "{e}");
        write(
            d,
            "modules.json",
            r#"[{"path":"1_Pooling","type":"sentence_transformers.models.Pooling"}]"#,
        );
        write(
            d,
            "1_Pooling/config.json",
            r#"{"pooling_mode_cls_token":true,"pooling_mode_mean_tokens":true}"#,
        );
        let e = SentenceSettings::read(d, 512).unwrap_err().to_string();
        assert!(e.contains("several pooling modes"), "{e}");
    }

    #[test]
    fn bad_configs_are_located_errors() {
        let p = Path::new("m/config.json");
        let c = BertConfig::from_json(MINI, p).unwrap();
        assert_eq!(c.act(), Act::Gelu);
        assert_eq!(c.layer_norm_eps, 1e-12);
        let e = BertConfig::from_json(&MINI.replace("\"bert\"", "\"xlm-roberta\""), p)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("m/config.json: model_type `xlm-roberta`"),
            "{e}"
        );
        assert!(e.contains("only `bert`"), "{e}");
        let e = BertConfig::from_json(
            &MINI.replace(
                "\"bert\"",
                "\"bert\",\"position_embedding_type\":\"relative_key\"",
            ),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("position_embedding_type") && e.contains("absolute"),
            "{e}"
        );
        let e = BertConfig::from_json(
            &MINI.replace("\"hidden_size\":8", "\"hidden_size\":\"x\""),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("m/config.json: field `hidden_size`"), "{e}");
        let e = BertConfig::from_json(&MINI.replace("\"hidden_size\":8", "\"hidden_size\":9"), p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a multiple"), "{e}");
        let e = BertConfig::from_json(
            &MINI.replace(
                "\"num_hidden_layers\":1",
                "\"num_hidden_layers\":100000000000",
            ),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("num_hidden_layers") && e.contains("out of range"),
            "{e}"
        );
        let e = BertConfig::from_json(
            &MINI.replace("\"bert\"", "\"bert\",\"hidden_act\":\"relu\""),
            p,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("hidden_act"), "{e}");
        let e = BertConfig::from_json(r#"{"model_type":"bert"}"#, p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("vocab_size"), "{e}");
    }

    #[test]
    fn the_encoder_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<SentenceEncoder>();
    }
}
