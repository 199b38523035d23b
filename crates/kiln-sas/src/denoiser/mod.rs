//! The Sudoku masked-diffusion denoiser: the model (this file), its pre-training with the
//! masked-diffusion objective ([`pretrain`](mod@pretrain)), and its store on disk with the provenance
//! records ([`store`]).
//!
//! **Model.** A bidirectional pre-norm transformer encoder (no attention mask; attention through
//! burn's fused `attention` kernel, which batches far better on the CPU than `burn::nn`'s
//! multi-head attention: measured 11-40 vs ~300 board-forwards/s at batch 64) over the Sudoku tokens (0 = mask, 1..=side = digits) with learned absolute
//! cell, row, column and box embeddings added to the token embedding. Sudoku's constraints are
//! defined by absolute rows and boxes, which a rotary (relative-only) position encoding such as
//! kiln-lm's LLaDA blocks cannot express directly; measured here, the absolute embeddings are what
//! lets a model of ~0.6M parameters learn the rules in minutes on a CPU. (kiln-lm's LLaDA-style
//! transformer serves the text side: see [`crate::gsm8k`].)

pub mod pretrain;
pub mod store;

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Int, Tensor, TensorData};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::sudoku::Shape;

pub use pretrain::{
    MdmBatch, MetricsFn, PretrainConfig, PretrainSummary, check_pretrain, mdm_batch, mdm_loss,
    pretrain,
};
pub use store::{
    DENOISER_CONFIG_FILE, DENOISER_FILE, DENOISER_SOURCE_FILE, PRETRAIN_RECORD_FILE,
    PretrainRecord, check_denoiser_source, denoiser_digest, denoiser_exists, load_denoiser,
    record_denoiser_source, save_denoiser,
};

/// Errors of denoiser training and checkpoint I/O.
#[derive(Debug, thiserror::Error)]
pub enum DenoiserError {
    /// Reading or writing a file failed.
    #[error("{path}: {msg}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        msg: String,
    },
    /// The checkpoint does not fit the expected model (vocabulary, shapes).
    #[error("{path}: {msg}")]
    Shape {
        /// The file.
        path: PathBuf,
        /// What does not fit, and how to fix it.
        msg: String,
    },
    /// Bad configuration.
    #[error("invalid denoiser configuration: {0}")]
    Config(String),
    /// Generating the training data failed.
    #[error("generating Sudoku training data: {0}")]
    Data(String),
    /// Training diverged.
    #[error("denoiser training diverged: {0}")]
    NonFinite(String),
    /// The denoiser is not the one a run recorded (re-trained or replaced since).
    #[error("{0}")]
    Source(String),
}

/// Shape of the Sudoku denoiser (recipe section `model:` of `mdm_sudoku`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DenoiserConfig {
    /// Board side: 9 (vocabulary 10 = mask + 9 digits, 81 cells) or 4.
    pub side: usize,
    /// Model width.
    pub d_model: usize,
    /// SudokuDenoiser layers.
    pub n_layers: usize,
    /// Attention heads (must divide `d_model`).
    pub n_heads: usize,
    /// Width of the feed-forward blocks.
    pub d_ff: usize,
}

impl Default for DenoiserConfig {
    fn default() -> Self {
        Self {
            side: 9,
            d_model: 128,
            n_layers: 3,
            n_heads: 4,
            d_ff: 512,
        }
    }
}

impl DenoiserConfig {
    /// Board shape (`None` for an unsupported side).
    pub fn shape(&self) -> Option<Shape> {
        Shape::from_side(self.side)
    }

    /// Vocabulary size (mask + digits).
    pub fn vocab_size(&self) -> usize {
        self.side + 1
    }

    /// Consistency checks.
    pub fn validate(&self) -> Result<(), String> {
        if self.shape().is_none() {
            return Err(format!("side must be 4 or 9, got {}", self.side));
        }
        for (k, v) in [
            ("d_model", self.d_model),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("d_ff", self.d_ff),
        ] {
            if v == 0 || v > 8192 {
                return Err(format!("{k} must be in 1..=8192, got {v}"));
            }
        }
        if !self.d_model.is_multiple_of(self.n_heads) {
            return Err(format!(
                "d_model {} is not divisible by n_heads {}",
                self.d_model, self.n_heads
            ));
        }
        Ok(())
    }

    /// A freshly initialised denoiser (seed the device for reproducibility).
    ///
    /// # Panics
    /// If the config is invalid (call [`Self::validate`] first for untrusted configs).
    pub fn init(&self, device: &Device) -> SudokuDenoiser {
        if let Err(e) = self.validate() {
            panic!("{e}");
        }
        let d = self.d_model;
        let side = self.side;
        let emb = |n: usize| {
            EmbeddingConfig::new(n, d)
                .with_initializer(Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                })
                .init(device)
        };
        SudokuDenoiser {
            tok: emb(side + 1),
            cell: emb(side * side),
            row: emb(side),
            col: emb(side),
            bx: emb(side),
            blocks: (0..self.n_layers)
                .map(|_| Block {
                    ln1: LayerNormConfig::new(d).init(device),
                    qkv: LinearConfig::new(d, 3 * d).init(device),
                    out: LinearConfig::new(d, d).init(device),
                    ln2: LayerNormConfig::new(d).init(device),
                    ff1: LinearConfig::new(d, self.d_ff).init(device),
                    ff2: LinearConfig::new(self.d_ff, d).init(device),
                    n_heads: self.n_heads,
                })
                .collect(),
            norm: LayerNormConfig::new(d).init(device),
            head: LinearConfig::new(d, side + 1).init(device),
            config: self.clone(),
        }
    }
}

/// A tiny denoiser for tests and smoke runs (width 32, 1 layer).
pub fn tiny_denoiser_config(shape: Shape) -> DenoiserConfig {
    DenoiserConfig {
        side: shape.side(),
        d_model: 32,
        n_layers: 1,
        n_heads: 2,
        d_ff: 64,
    }
}

/// The Sudoku masked-diffusion denoiser.
#[derive(Module, Debug)]
pub struct SudokuDenoiser {
    /// Token embedding `[side + 1, d]`.
    pub tok: Embedding,
    /// Cell embedding `[n_cells, d]`.
    pub cell: Embedding,
    /// Row embedding `[side, d]`.
    pub row: Embedding,
    /// Column embedding `[side, d]`.
    pub col: Embedding,
    /// Box embedding `[side, d]`.
    pub bx: Embedding,
    /// Bidirectional pre-norm blocks.
    pub blocks: Vec<Block>,
    /// Final norm.
    pub norm: LayerNorm,
    /// Output projection `[d, side + 1]`.
    pub head: Linear,
    /// The configuration.
    #[module(skip)]
    pub config: DenoiserConfig,
}

impl SudokuDenoiser {
    /// The configuration.
    pub fn config(&self) -> &DenoiserConfig {
        &self.config
    }

    /// The device of the weights.
    pub fn device(&self) -> Device {
        self.tok.weight.val().device()
    }

    /// tokens `[B, n]` (Int; 0 = mask) -> logits `[B, n, side + 1]`.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, n] = tokens.dims();
        let device = tokens.device();
        let side = self.config.side;
        let bs = self.config.shape().map_or(3, Shape::box_size);
        let idx = |f: &dyn Fn(usize) -> usize| {
            let v: Vec<i64> = (0..n).map(|i| f(i) as i64).collect();
            Tensor::<2, Int>::from_data(TensorData::new(v, [1, n]), &device)
        };
        let pos = self.cell.forward(idx(&|i| i))
            + self.row.forward(idx(&|i| i / side))
            + self.col.forward(idx(&|i| i % side))
            + self
                .bx
                .forward(idx(&|i| (i / side) / bs * bs + (i % side) / bs));
        let x = self.tok.forward(tokens) + pos.expand([b, n, self.config.d_model]);
        let mut h = x;
        for blk in &self.blocks {
            h = blk.forward(h);
        }
        self.head.forward(self.norm.forward(h))
    }
}

/// One pre-norm encoder block: `x + attn(ln1(x))`, then `x + ff2(gelu(ff1(ln2(x))))`.
#[derive(Module, Debug)]
pub struct Block {
    /// Norm before attention.
    pub ln1: LayerNorm,
    /// Fused q/k/v projection `[d, 3d]`.
    pub qkv: Linear,
    /// Attention output projection `[d, d]`.
    pub out: Linear,
    /// Norm before the feed-forward block.
    pub ln2: LayerNorm,
    /// Feed-forward in `[d, d_ff]`.
    pub ff1: Linear,
    /// Feed-forward out `[d_ff, d]`.
    pub ff2: Linear,
    /// Attention heads.
    pub n_heads: usize,
}

impl Block {
    /// `[B, T, d]` -> `[B, T, d]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, t, d] = x.dims();
        let nh = self.n_heads;
        let hd = d / nh;
        let qkv = self.qkv.forward(self.ln1.forward(x.clone()));
        let part = |k: usize| {
            qkv.clone()
                .slice([0..b, 0..t, k * d..(k + 1) * d])
                .reshape([b, t, nh, hd])
                .swap_dims(1, 2)
        };
        let options = AttentionModuleOptions {
            scale: None,
            softcap: None,
            is_causal: false,
        };
        let a = attention(part(0), part(1), part(2), None, None, options)
            .swap_dims(1, 2)
            .reshape([b, t, d]);
        let x = x + self.out.forward(a);
        let h = gelu(self.ff1.forward(self.ln2.forward(x.clone())));
        x + self.ff2.forward(h)
    }
}

/// Check that `cfg` can serve as a Sudoku denoiser of `shape`.
pub fn check_denoiser_config(cfg: &DenoiserConfig, shape: Shape) -> Result<(), String> {
    cfg.validate()?;
    if cfg.side != shape.side() {
        return Err(format!(
            "the denoiser is for side {} but the puzzles have side {} (vocab_size {} vs {})",
            cfg.side,
            shape.side(),
            cfg.vocab_size(),
            shape.side() + 1
        ));
    }
    Ok(())
}

/// Digit log-probabilities `[b, n, side]` (renormalised over the digits, the mask token
/// excluded) of the denoiser for token rows `tokens` (`b * n`, row-major), on the host.
pub fn digit_log_probs(model: &SudokuDenoiser, tokens: &[u32], b: usize, n: usize) -> Vec<f32> {
    let device = model.device();
    let v = model.config().vocab_size();
    let data: Vec<i64> = tokens.iter().map(|&x| x as i64).collect();
    let t = Tensor::<2, Int>::from_data(TensorData::new(data, [b, n]), &device);
    let logits = model.forward(t).slice([0..b, 0..n, 1..v]);
    log_softmax(logits, 2)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap_or_default()
}
