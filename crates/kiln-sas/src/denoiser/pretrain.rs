//! Pre-training of the Sudoku denoiser with the masked-diffusion objective (LLaDA's
//! estimator of the negative ELBO; METHODS, SAS "Decoding" describes the model it trains).
//!
//! **Objective.** For each training board draw a mask ratio `t ~ U(t_min, 1)`, mask every blank
//! cell of the puzzle independently with probability `t` (givens are never masked), and minimise
//! the cross-entropy of the solution digit on the masked cells weighted by `1/t`, normalised by the
//! number of blank cells (LLaDA's estimator of the negative ELBO). Boards are augmented with the
//! validity-preserving Sudoku symmetries (digit relabelling, transposition, row/column permutations
//! within bands/stacks, band/stack permutations), so a few thousand generated puzzles give an
//! effectively unlimited training stream.

use std::path::Path;
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::store::{PretrainRecord, save_denoiser};
use super::{DenoiserConfig, DenoiserError, SudokuDenoiser, check_denoiser_config};
use crate::sudoku::tokens::MASK_TOKEN;
use crate::sudoku::{Puzzle, PuzzleSetConfig, Symmetry, check_puzzle_set};

/// Pre-training hyper-parameters (recipe section `pretrain:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct PretrainConfig {
    /// Optimiser steps.
    pub steps: u64,
    /// Boards per step.
    pub batch_size: usize,
    /// Peak AdamW learning rate.
    pub lr: f64,
    /// Share of the steps spent in linear warm-up.
    pub warmup_ratio: f64,
    /// Cosine decay to `lr * min_lr_ratio`.
    pub min_lr_ratio: f64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clipping (0 = off).
    pub max_grad_norm: f64,
    /// Smallest mask ratio t (t ~ U(t_min, 1)); bounds the 1/t weight.
    pub t_min: f64,
    /// Apply random validity-preserving Sudoku symmetries to every training board.
    pub augment: bool,
    /// The training puzzles.
    pub data: PuzzleSetConfig,
    /// Log a progress line every N steps (0 = never).
    pub log_every: u64,
    /// Save the weights every N steps (0 = only at the end), so an interrupted run keeps its
    /// progress.
    pub save_every: u64,
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self {
            steps: 1500,
            batch_size: 64,
            lr: 1e-3,
            warmup_ratio: 0.03,
            min_lr_ratio: 0.05,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            t_min: 0.05,
            augment: true,
            data: PuzzleSetConfig::default(),
            log_every: 50,
            save_every: 250,
        }
    }
}

/// Range checks of a [`PretrainConfig`]: `Err((field path, message))`.
pub fn check_pretrain(c: &PretrainConfig) -> Result<(), (String, String)> {
    let e = |p: &str, m: String| Err((p.to_string(), m));
    if c.steps == 0 {
        return e("pretrain.steps", "must be >= 1".into());
    }
    if c.batch_size == 0 || c.batch_size > 4096 {
        return e(
            "pretrain.batch_size",
            format!("must be in 1..=4096, got {}", c.batch_size),
        );
    }
    if !(c.lr.is_finite() && c.lr > 0.0) {
        return e("pretrain.lr", format!("must be > 0, got {}", c.lr));
    }
    if !(0.0..=1.0).contains(&c.warmup_ratio) {
        return e("pretrain.warmup_ratio", "must be in [0, 1]".into());
    }
    if !(0.0..=1.0).contains(&c.min_lr_ratio) {
        return e("pretrain.min_lr_ratio", "must be in [0, 1]".into());
    }
    if !(c.t_min > 0.0 && c.t_min < 1.0) {
        return e(
            "pretrain.t_min",
            format!("must be in (0, 1), got {}", c.t_min),
        );
    }
    if !(c.weight_decay.is_finite() && c.weight_decay >= 0.0) {
        return e("pretrain.weight_decay", "must be >= 0".into());
    }
    check_puzzle_set(&c.data, "pretrain.data")
}

/// One masked-diffusion training batch on the host.
#[derive(Debug, Clone)]
pub struct MdmBatch {
    /// Input tokens `[b, n]` (givens, unmasked blanks with their solution digit, mask tokens).
    pub tokens: Vec<i64>,
    /// Solution digit of every cell `[b, n]`.
    pub targets: Vec<i64>,
    /// Loss weight of every cell `[b, n]`: `1 / (t * n_blanks)` on masked cells, else 0.
    pub weights: Vec<f32>,
    /// Boards.
    pub b: usize,
    /// Cells per board.
    pub n: usize,
    /// Masked cells in the batch.
    pub n_masked: usize,
}

/// Build a masked-diffusion batch from `puzzles` (already augmented if wanted).
pub fn mdm_batch<R: Rng + ?Sized>(
    puzzles: &[(Vec<u8>, Vec<u8>)],
    t_min: f64,
    rng: &mut R,
) -> MdmBatch {
    let b = puzzles.len();
    let n = puzzles.first().map_or(0, |p| p.0.len());
    let mut tokens = Vec::with_capacity(b * n);
    let mut targets = Vec::with_capacity(b * n);
    let mut weights = Vec::with_capacity(b * n);
    let mut n_masked = 0;
    for (puzzle, solution) in puzzles {
        let t: f64 = rng.random_range(t_min..=1.0);
        let blanks = puzzle.iter().filter(|&&v| v == 0).count().max(1);
        let w = (1.0 / (t * blanks as f64)) as f32;
        for (&p, &s) in puzzle.iter().zip(solution) {
            targets.push(s as i64);
            if p != 0 {
                tokens.push(p as i64);
                weights.push(0.0);
            } else if rng.random_bool(t) {
                tokens.push(MASK_TOKEN as i64);
                weights.push(w);
                n_masked += 1;
            } else {
                tokens.push(s as i64);
                weights.push(0.0);
            }
        }
    }
    MdmBatch {
        tokens,
        targets,
        weights,
        b,
        n,
        n_masked,
    }
}

/// The masked-diffusion loss of `batch` (mean over boards of the 1/t-weighted masked NLL).
pub fn mdm_loss(model: &SudokuDenoiser, batch: &MdmBatch, device: &Device) -> Tensor<1> {
    let (b, n) = (batch.b, batch.n);
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(batch.tokens.clone(), [b, n]), device);
    let targets =
        Tensor::<3, Int>::from_data(TensorData::new(batch.targets.clone(), [b, n, 1]), device);
    let weights = Tensor::<2>::from_data(TensorData::new(batch.weights.clone(), [b, n]), device);
    let logp = log_softmax(model.forward(tokens), 2)
        .gather(2, targets)
        .reshape([b, n]);
    (logp * weights).sum().neg().div_scalar(b.max(1) as f64)
}

/// Figures of a finished pre-training run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PretrainSummary {
    /// Steps done.
    pub steps: u64,
    /// Mean loss over the last 10% of steps.
    pub final_loss: f64,
    /// Training wall time in seconds.
    pub wall_s: f64,
    /// Optimiser steps per second.
    pub steps_per_s: f64,
    /// Parameters of the denoiser.
    pub params: usize,
}

/// Receives one metrics row per logged pre-training step.
pub type MetricsFn<'a> = dyn FnMut(u64, &[(&str, f64)]) + 'a;

/// Pre-train a denoiser of `model_cfg` from scratch on `puzzles` (usually `cfg.data.load()`) on
/// `device` (non-autodiff; autodiff is added here), saving the weights to `out_dir` (every `save_every` steps and at the end). Returns the
/// trained model (inference, no autodiff) and a summary.
pub fn pretrain(
    model_cfg: &DenoiserConfig,
    cfg: &PretrainConfig,
    puzzles: &[Puzzle],
    device: &Device,
    seed: u64,
    out_dir: &Path,
    metrics: &mut MetricsFn<'_>,
) -> Result<(SudokuDenoiser, PretrainSummary), DenoiserError> {
    let shape = cfg
        .data
        .shape()
        .ok_or_else(|| DenoiserError::Config(format!("side {}", cfg.data.side)))?;
    check_denoiser_config(model_cfg, shape).map_err(DenoiserError::Config)?;
    check_pretrain(cfg).map_err(|(p, m)| DenoiserError::Config(format!("{p}: {m}")))?;
    if puzzles.is_empty() {
        return Err(DenoiserError::Data("no training puzzles".into()));
    }
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = puzzles
        .iter()
        .map(|p| (p.puzzle.cells().to_vec(), p.solution.cells().to_vec()))
        .collect();
    let ad = device.clone().autodiff();
    ad.seed(seed);
    let mut model = model_cfg.init(&ad);
    let params = model.num_params();
    tracing::info!("denoiser: {params} parameters");
    let optim_cfg = kiln_rl::OptimConfig {
        lr: cfg.lr,
        weight_decay: cfg.weight_decay,
        max_grad_norm: cfg.max_grad_norm,
        warmup_ratio: cfg.warmup_ratio,
        schedule: kiln_rl::LrSchedule::Cosine,
        min_lr_ratio: cfg.min_lr_ratio,
        ..Default::default()
    };
    let mut optim = optim_cfg.build();
    // Mark the folder as holding an unfinished pre-training before any weights are written: a
    // crash from here on never leaves new weights behind an old "complete" record.
    PretrainRecord::new(model_cfg, cfg, seed, 0, None).save(out_dir)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_d1ff);
    let started = Instant::now();
    let mut losses = Vec::with_capacity(cfg.steps as usize);
    let mut window = (0.0f64, 0usize, Instant::now());
    for step in 0..cfg.steps {
        let batch_src: Vec<(Vec<u8>, Vec<u8>)> = (0..cfg.batch_size)
            .map(|_| {
                let (p, s) = &pairs[rng.random_range(0..pairs.len())];
                if cfg.augment {
                    let sym = Symmetry::random(shape, &mut rng);
                    (sym.apply(p), sym.apply(s))
                } else {
                    (p.clone(), s.clone())
                }
            })
            .collect();
        let batch = mdm_batch(&batch_src, cfg.t_min, &mut rng);
        let loss = mdm_loss(&model, &batch, &ad);
        let lv = loss.clone().into_scalar::<f32>() as f64;
        if !lv.is_finite() {
            return Err(DenoiserError::NonFinite(format!(
                "loss {lv} at step {step}; lower pretrain.lr"
            )));
        }
        let grads = loss.backward();
        let mut gp = GradientsParams::from_grads(grads, &model);
        let gn = kiln_rl::optim::clip_grad_norm(&model, &mut gp, cfg.max_grad_norm);
        let lr = optim_cfg.lr_at(step, cfg.steps);
        model = optim.step(lr, model, gp);
        losses.push(lv);
        window.0 += lv;
        window.1 += 1;
        let done = step + 1;
        if cfg.log_every > 0 && (done % cfg.log_every == 0 || done == cfg.steps) {
            let sps = window.1 as f64 / window.2.elapsed().as_secs_f64().max(1e-9);
            let mean = window.0 / window.1.max(1) as f64;
            let eta = (cfg.steps - done) as f64 / sps.max(1e-9);
            tracing::info!(
                "denoiser step {done}/{} loss {mean:.4} grad_norm {gn:.3} lr {lr:.2e} {sps:.2} steps/s ETA {eta:.0}s",
                cfg.steps
            );
            metrics(
                done,
                &[
                    ("pretrain/loss", mean),
                    ("pretrain/grad_norm", gn),
                    ("pretrain/lr", lr),
                    ("pretrain/steps_per_s", sps),
                ],
            );
            window = (0.0, 0, Instant::now());
        }
        if cfg.save_every > 0 && done % cfg.save_every == 0 && done < cfg.steps {
            save_denoiser(&model.valid(), out_dir)?;
            PretrainRecord::new(model_cfg, cfg, seed, done, None).save(out_dir)?;
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let tail = (losses.len() / 10).max(1);
    let final_loss = losses[losses.len() - tail..].iter().sum::<f64>() / tail as f64;
    let model = model.valid();
    save_denoiser(&model, out_dir)?;
    PretrainRecord::new(model_cfg, cfg, seed, cfg.steps, Some(final_loss)).save(out_dir)?;
    let summary = PretrainSummary {
        steps: cfg.steps,
        final_loss,
        wall_s: wall,
        steps_per_s: cfg.steps as f64 / wall.max(1e-9),
        params,
    };
    let sp = out_dir.join("pretrain_summary.json");
    std::fs::write(&sp, serde_json::to_vec_pretty(&summary).unwrap_or_default()).map_err(|e| {
        DenoiserError::Io {
            path: sp.clone(),
            msg: e.to_string(),
        }
    })?;
    Ok((model, summary))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::denoiser::store::{PRETRAIN_RECORD_FILE, denoiser_exists, load_denoiser};
    use crate::denoiser::{digit_log_probs, tiny_denoiser_config};
    use crate::sudoku::{GenParams, Shape, generate};

    #[test]
    fn batches_never_mask_givens_and_weight_by_inverse_t() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let ps = generate(&GenParams::new(4, 30, 2)).unwrap();
        let pairs: Vec<_> = ps
            .iter()
            .map(|p| (p.puzzle.cells().to_vec(), p.solution.cells().to_vec()))
            .collect();
        for _ in 0..20 {
            let b = mdm_batch(&pairs, 0.1, &mut rng);
            for (k, (p, s)) in pairs.iter().enumerate() {
                let row = &b.tokens[k * 81..(k + 1) * 81];
                let w = &b.weights[k * 81..(k + 1) * 81];
                let mut wsum = 0.0;
                for i in 0..81 {
                    if p[i] != 0 {
                        assert_eq!(row[i], p[i] as i64, "a given was changed");
                        assert_eq!(w[i], 0.0);
                    } else if row[i] == 0 {
                        assert!(w[i] > 0.0);
                        wsum += w[i];
                    } else {
                        assert_eq!(row[i], s[i] as i64);
                    }
                }
                // sum of weights = (#masked / #blanks) / t, whose expectation is 1.
                assert!(wsum < 1.0 / 0.1 + 1e-3);
            }
        }
    }

    #[test]
    fn pretrain_lowers_the_loss_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = PretrainConfig {
            steps: 30,
            batch_size: 8,
            lr: 3e-3,
            data: PuzzleSetConfig {
                count: 16,
                givens: vec![40],
                ..Default::default()
            },
            log_every: 0,
            save_every: 0,
            ..Default::default()
        };
        let puzzles = cfg.data.load_in(&dir.path().join("cache")).unwrap();
        let device = Device::flex();
        let mut sink = |_s: u64, _m: &[(&str, f64)]| {};
        let mcfg = tiny_denoiser_config(Shape::NINE);
        let (model, summary) =
            pretrain(&mcfg, &cfg, &puzzles, &device, 7, dir.path(), &mut sink).unwrap();
        // ln(10) ~ 2.3 at init; 30 steps of a tiny model must get below it.
        assert!(summary.final_loss < 2.2, "loss {}", summary.final_loss);
        let loaded = load_denoiser(dir.path(), Shape::NINE, &device).unwrap();
        let toks = vec![0u32; 81];
        let a = digit_log_probs(&model, &toks, 1, 81);
        let b = digit_log_probs(&loaded, &toks, 1, 81);
        assert_eq!(a.len(), 81 * 9);
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() < 1e-5);
        }
        // The folder records a finished pre-training under exactly these settings.
        let rec = PretrainRecord::load(dir.path())
            .unwrap()
            .expect("pretrain.json");
        assert!(rec.complete);
        assert_eq!(rec.steps_done, 30);
        assert_eq!(rec.final_loss, Some(summary.final_loss));
        assert!(rec.differences(&mcfg, &cfg, 7).is_empty());
        // Logging and snapshot cadence do not change the weights: not a difference.
        let quiet = PretrainConfig {
            log_every: 5,
            save_every: 10,
            ..cfg.clone()
        };
        assert!(rec.differences(&mcfg, &quiet, 7).is_empty());
        let longer = PretrainConfig {
            steps: 60,
            data: PuzzleSetConfig {
                givens: vec![36],
                ..cfg.data.clone()
            },
            ..cfg.clone()
        };
        let d = rec.differences(&mcfg, &longer, 8);
        assert_eq!(
            d,
            vec![
                "seed: 7 -> 8".to_string(),
                "pretrain.data.givens: [40] -> [36]".to_string(),
                "pretrain.steps: 30 -> 60".to_string(),
            ]
        );
        let wider = DenoiserConfig {
            d_model: 64,
            ..mcfg.clone()
        };
        assert_eq!(
            rec.differences(&wider, &cfg, 7),
            vec!["model.d_model: 32 -> 64".to_string()]
        );
    }

    #[test]
    fn interrupted_pretraining_is_recorded_as_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = PretrainConfig {
            steps: 4,
            batch_size: 4,
            data: PuzzleSetConfig {
                count: 8,
                givens: vec![40],
                ..Default::default()
            },
            log_every: 0,
            save_every: 2,
            ..Default::default()
        };
        let puzzles = cfg.data.load_in(&dir.path().join("cache")).unwrap();
        let device = Device::flex();
        let mcfg = tiny_denoiser_config(Shape::NINE);
        // "Interrupt" after the step-2 snapshot: the metrics callback of step 3 panics.
        let out = dir.path().join("den");
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut sink = |s: u64, _m: &[(&str, f64)]| {
                if s >= 3 {
                    panic!("interrupted");
                }
            };
            let cfg = PretrainConfig {
                log_every: 1,
                ..cfg.clone()
            };
            pretrain(&mcfg, &cfg, &puzzles, &device, 7, &out, &mut sink)
        }));
        assert!(r.is_err());
        assert!(denoiser_exists(&out), "the step-2 snapshot is on disk");
        let rec = PretrainRecord::load(&out).unwrap().unwrap();
        assert!(!rec.complete);
        assert_eq!(rec.steps_done, 2);
        assert_eq!(rec.final_loss, None);
        // A record that is not JSON is a clear error naming the file.
        std::fs::write(out.join(PRETRAIN_RECORD_FILE), "{not json").unwrap();
        let e = PretrainRecord::load(&out).unwrap_err().to_string();
        assert!(
            e.contains(PRETRAIN_RECORD_FILE) && e.contains("delete"),
            "{e}"
        );
    }
}
