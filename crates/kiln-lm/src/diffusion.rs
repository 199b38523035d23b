//! Masked-diffusion primitives for bidirectional denoisers (LLaDA-style, `causal: false`).
//!
//! - [`denoise_log_probs`]: per-position log-distributions of a partially masked sequence (the
//!   train-time forward; differentiable).
//! - [`llada_generate`]: a reference implementation of LLaDA's published `generate` (semi-
//!   autoregressive blocks, a fixed number of unmasking steps per block, `low_confidence` or
//!   `random` remasking, Gumbel-max sampling at temperature > 0; classifier-free guidance is not
//!   implemented). Checked against a PyTorch port on a tiny model (see the fixtures).

use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::model::Transformer;

/// How the tokens to commit at a step are chosen among the still-masked positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Remasking {
    /// Commit the positions whose predicted token has the highest probability.
    LowConfidence,
    /// Commit uniformly random positions.
    Random,
}

/// Settings of [`llada_generate`] (LLaDA's `generate` arguments).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DiffusionConfig {
    /// Number of generated positions. Default 128.
    pub gen_length: usize,
    /// Total denoising steps (split evenly over the blocks). Default 128.
    pub steps: usize,
    /// Block length of semi-autoregressive decoding (`gen_length` = one block). Default 32.
    pub block_length: usize,
    /// Gumbel-max sampling temperature; 0 = argmax. Default 0.
    pub temperature: f64,
    /// Remasking strategy. Default `low_confidence`.
    pub remasking: Remasking,
}

impl Default for DiffusionConfig {
    fn default() -> Self {
        Self {
            gen_length: 128,
            steps: 128,
            block_length: 32,
            temperature: 0.0,
            remasking: Remasking::LowConfidence,
        }
    }
}

/// Errors of diffusion decoding.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DiffusionError {
    /// The model has no mask token.
    #[error("the model config has no mask_token_id (needed for masked diffusion)")]
    NoMaskToken,
    /// `gen_length`, `block_length` and `steps` do not divide as LLaDA requires.
    #[error(
        "gen_length {gen_length} must be a multiple of block_length {block_length}, and steps {steps} a multiple of the block count"
    )]
    Shape {
        /// Generated length.
        gen_length: usize,
        /// Block length.
        block_length: usize,
        /// Steps.
        steps: usize,
    },
    /// Prompts of a batch must have equal lengths.
    #[error("all prompts of a batch must have the same length")]
    RaggedPrompts,
}

/// Per-position log-probabilities `[B, T, vocab]` of a (partially masked) sequence under a
/// bidirectional denoiser. Differentiable; `attention_mask` (true = real token) handles padding.
pub fn denoise_log_probs(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    attention_mask: Option<Tensor<2, Bool>>,
) -> Tensor<3> {
    let logits = match attention_mask {
        Some(m) => model.forward_masked(tokens, m),
        None => model.forward(tokens),
    };
    log_softmax(logits, 2)
}

/// How many tokens to commit at each of `steps` steps for `masked` masked positions (LLaDA's
/// `get_num_transfer_tokens`: even split, remainder on the first steps).
pub fn num_transfer_tokens(masked: usize, steps: usize) -> Vec<usize> {
    let base = masked / steps;
    let rem = masked % steps;
    (0..steps).map(|i| base + usize::from(i < rem)).collect()
}

/// LLaDA-style generation for a batch of equal-length prompts; returns the `gen_length`
/// generated ids per prompt. `rng` drives Gumbel noise (temperature > 0) and random remasking.
pub fn llada_generate(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &DiffusionConfig,
    rng: &mut impl Rng,
) -> Result<Vec<Vec<u32>>, DiffusionError> {
    let mask_id = model
        .config()
        .mask_token_id
        .ok_or(DiffusionError::NoMaskToken)?;
    let shape_err = DiffusionError::Shape {
        gen_length: cfg.gen_length,
        block_length: cfg.block_length,
        steps: cfg.steps,
    };
    if cfg.block_length == 0 || !cfg.gen_length.is_multiple_of(cfg.block_length) {
        return Err(shape_err);
    }
    let n_blocks = cfg.gen_length / cfg.block_length;
    if n_blocks == 0 || cfg.steps == 0 || !cfg.steps.is_multiple_of(n_blocks) {
        return Err(shape_err);
    }
    let steps_per_block = cfg.steps / n_blocks;
    let b = prompts.len();
    if b == 0 {
        return Ok(Vec::new());
    }
    let lp = prompts[0].len();
    if prompts.iter().any(|p| p.len() != lp) {
        return Err(DiffusionError::RaggedPrompts);
    }
    let total = lp + cfg.gen_length;
    let vocab = model.config().vocab_size;
    let device = model.device();
    let mut x: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut r = p.clone();
            r.resize(total, mask_id);
            r
        })
        .collect();

    for blk in 0..n_blocks {
        let (s, e) = (
            lp + blk * cfg.block_length,
            lp + (blk + 1) * cfg.block_length,
        );
        let transfer: Vec<Vec<usize>> = x
            .iter()
            .map(|row| {
                let masked = row[s..e].iter().filter(|&&t| t == mask_id).count();
                num_transfer_tokens(masked, steps_per_block)
            })
            .collect();
        #[allow(clippy::needless_range_loop)] // `step` indexes the per-row schedules
        for step in 0..steps_per_block {
            let flat: Vec<i64> = x.iter().flatten().map(|&t| t as i64).collect();
            let tokens = Tensor::<2, Int>::from_data(TensorData::new(flat, [b, total]), &device);
            let logits: Vec<f32> = model
                .forward(tokens)
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("float logits");
            for (j, row) in x.iter_mut().enumerate() {
                // Candidates: masked positions of the current block (later blocks get -inf
                // confidence in LLaDA, so they are never chosen).
                let mut cand: Vec<(f64, usize, u32)> = Vec::new();
                for pos in s..e {
                    if row[pos] != mask_id {
                        continue;
                    }
                    let l = &logits[(j * total + pos) * vocab..(j * total + pos + 1) * vocab];
                    let x0 = if cfg.temperature > 0.0 {
                        // Gumbel-max as LLaDA writes it: exp(logits) / (-ln u)^T, in f64.
                        let mut best = (f64::NEG_INFINITY, 0usize);
                        for (k, &v) in l.iter().enumerate() {
                            let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                            let score = (v as f64).exp() / (-u.ln()).powf(cfg.temperature);
                            if score > best.0 {
                                best = (score, k);
                            }
                        }
                        best.1
                    } else {
                        let mut best = 0usize;
                        for (k, &v) in l.iter().enumerate() {
                            if v > l[best] {
                                best = k;
                            }
                        }
                        best
                    };
                    let conf = match cfg.remasking {
                        Remasking::LowConfidence => {
                            let max = l.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v)) as f64;
                            let z: f64 = l.iter().map(|&v| (v as f64 - max).exp()).sum();
                            (l[x0] as f64 - max).exp() / z
                        }
                        Remasking::Random => rng.random::<f64>(),
                    };
                    cand.push((conf, pos, x0 as u32));
                }
                // Highest confidence first; ties to the lower position.
                cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                for &(_, pos, tok) in cand.iter().take(transfer[j][step]) {
                    row[pos] = tok;
                }
            }
        }
    }
    Ok(x.into_iter().map(|r| r[lp..].to_vec()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfer_schedule_matches_llada() {
        assert_eq!(num_transfer_tokens(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(num_transfer_tokens(8, 8), vec![1; 8]);
        assert_eq!(num_transfer_tokens(3, 5), vec![1, 1, 1, 0, 0]);
    }
}
