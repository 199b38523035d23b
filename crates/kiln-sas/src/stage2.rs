//! Stage 2 of SAS on Sudoku: fine-tune the denoiser along orders drawn from the trained order
//! policy (METHODS, SAS "Order policy and training": stage 2). Each example is a random step `t` of a drawn
//! order: the state reveals the true digits of `i_1..i_{t-1}`, the loss is
//! `-log p(x_{i_t} | state)` plus `aux_weight` x the mean NLL over every masked cell of that state
//! ([`stage2_example`] builds it, [`stage2`] trains on it).

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

use crate::denoiser::{DenoiserError, MetricsFn, SudokuDenoiser, save_denoiser};
use crate::policy::OrderPolicy;
use crate::sudoku::{Puzzle, Symmetry};
use crate::task::teacher_forced_rollout;

/// Stage-2 hyper-parameters (recipe section `stage2:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct Stage2Config {
    /// Run stage 2 after the policy is trained (the `sas_sudoku_stage2` recipe turns it on).
    pub enabled: bool,
    /// Skip GRPO and take the order policy from this `sas` run directory or checkpoint (empty =
    /// train the policy in this run first).
    pub policy_from: std::path::PathBuf,
    /// Optimiser steps of the denoiser fine-tuning.
    pub steps: u64,
    /// (puzzle, step) examples per optimiser step.
    pub batch_size: usize,
    /// Peak AdamW learning rate (cosine decay, 5% warm-up).
    pub lr: f64,
    /// Training puzzles whose policy orders are used (0 = all of `sas.train`).
    pub puzzles: usize,
    /// Orders drawn from the policy per training puzzle (before fine-tuning, with the frozen
    /// stage-1 denoiser's features).
    pub orders_per_puzzle: usize,
    /// Weight of the auxiliary masked-diffusion NLL over every still-masked cell of the state
    /// (keeps the denoiser a good denoiser for positions the policy picks later).
    pub aux_weight: f64,
    /// Global gradient-norm clipping (0 = off).
    pub max_grad_norm: f64,
    /// Apply a random Sudoku symmetry (digit relabelling, transposition, row/column and
    /// band/stack permutations) to each example, as in pre-training: the order's cells move
    /// with the board, so the example stays the same teacher-forced step.
    pub augment: bool,
    /// Log a progress line every N steps (0 = never).
    pub log_every: u64,
}

impl Default for Stage2Config {
    fn default() -> Self {
        Self {
            enabled: false,
            policy_from: std::path::PathBuf::new(),
            steps: 300,
            batch_size: 64,
            puzzles: 0,
            lr: 2e-4,
            orders_per_puzzle: 2,
            aux_weight: 0.5,
            max_grad_norm: 1.0,
            augment: true,
            log_every: 25,
        }
    }
}

/// One stage-2 example: step `t` of `order` on puzzle `p`. Returns the input cells (givens and the
/// true digits of `order[..t]` revealed, the rest masked), the solution, and the loss weight of each
/// cell (1 on `order[t]`, plus `aux_weight / (order.len() - t)` on every masked cell). With `sym` the
/// whole example is mapped through that board symmetry (cells move together with their weights).
pub(crate) fn stage2_example(
    p: &Puzzle,
    order: &[usize],
    t: usize,
    aux_weight: f64,
    sym: Option<&Symmetry>,
) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let mut cells = p.puzzle.cells().to_vec();
    for &i in &order[..t] {
        cells[i] = p.solution.cells()[i];
    }
    let still = order.len() - t;
    let w: Vec<f32> = cells
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let mut wi = 0.0;
            if c == 0 {
                wi += aux_weight / still as f64;
            }
            if i == order[t] {
                wi += 1.0;
            }
            wi as f32
        })
        .collect();
    match sym {
        Some(sym) => (
            sym.apply(&cells),
            sym.apply(p.solution.cells()),
            sym.permute(&w),
        ),
        None => (cells, p.solution.cells().to_vec(), w),
    }
}

/// Stage 2: fine-tune `denoiser` with teacher-forced NLL along orders drawn from `policy`
/// (sampled at `temperature`). Each example is a random step `t` of a drawn order: the state
/// reveals the true digits of `i_1..i_{t-1}`, the loss is `-log p(x_{i_t} | state)` plus
/// `aux_weight` x the mean NLL over every masked cell of that state. Saves the fine-tuned
/// denoiser to `out_dir` and returns it (inference).
#[allow(clippy::too_many_arguments)]
pub fn stage2(
    denoiser: &SudokuDenoiser,
    policy: &OrderPolicy,
    cfg: &Stage2Config,
    puzzles: &[Puzzle],
    block_len: usize,
    temperature: f64,
    device: &Device,
    seed: u64,
    out_dir: &Path,
    metrics: &mut MetricsFn<'_>,
) -> Result<SudokuDenoiser, DenoiserError> {
    if puzzles.is_empty() {
        return Err(DenoiserError::Data("stage 2 needs training puzzles".into()));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x57a9e2);
    // 1. Draw the orders with the frozen stage-1 denoiser.
    let t0 = Instant::now();
    let mut examples: Vec<(usize, Vec<usize>)> = Vec::new();
    let refs: Vec<&Puzzle> = puzzles.iter().collect();
    for _ in 0..cfg.orders_per_puzzle.max(1) {
        for (c, chunk) in refs.chunks(256).enumerate() {
            let ro = teacher_forced_rollout(
                denoiser,
                policy,
                chunk,
                block_len,
                temperature,
                &mut rng,
                false,
            );
            for (j, o) in ro.orders.into_iter().enumerate() {
                examples.push((c * 256 + j, o));
            }
        }
    }
    tracing::info!(
        "stage 2: {} policy orders drawn in {:.1}s",
        examples.len(),
        t0.elapsed().as_secs_f64()
    );
    // 2. Fine-tune.
    let ad = device.clone().autodiff();
    // A fresh autodiff module (tracked leaves) loaded with the stage-1 weights.
    let mut model = denoiser
        .config()
        .init(&ad)
        .load_record(denoiser.clone().into_record());
    let optim_cfg = kiln_rl::OptimConfig {
        lr: cfg.lr,
        weight_decay: 0.0,
        max_grad_norm: cfg.max_grad_norm,
        warmup_ratio: 0.05,
        schedule: kiln_rl::LrSchedule::Cosine,
        min_lr_ratio: 0.1,
        ..Default::default()
    };
    let mut optim = optim_cfg.build();
    let shape = puzzles[0].puzzle.shape();
    let n = shape.n_cells();
    let started = Instant::now();
    let mut window = (0.0f64, 0usize);
    for step in 0..cfg.steps {
        let b = cfg.batch_size.max(1);
        let mut tokens = Vec::with_capacity(b * n);
        let mut targets = Vec::with_capacity(b * n);
        let mut w = Vec::with_capacity(b * n);
        for _ in 0..b {
            let (pi, order) = &examples[rng.random_range(0..examples.len())];
            let p = &puzzles[*pi];
            if order.is_empty() {
                continue;
            }
            let t = rng.random_range(0..order.len());
            let sym = cfg.augment.then(|| Symmetry::random(shape, &mut rng));
            let (cells, sol, ex_w) = stage2_example(p, order, t, cfg.aux_weight, sym.as_ref());
            tokens.extend(cells.iter().map(|&c| c as i64));
            targets.extend(sol.iter().map(|&c| c as i64));
            w.extend(ex_w);
        }
        let bb = tokens.len() / n;
        if bb == 0 {
            continue;
        }
        let tt = Tensor::<2, Int>::from_data(TensorData::new(tokens, [bb, n]), &ad);
        let tg = Tensor::<3, Int>::from_data(TensorData::new(targets, [bb, n, 1]), &ad);
        let wt = Tensor::<2>::from_data(TensorData::new(w, [bb, n]), &ad);
        let logp = log_softmax(model.forward(tt), 2)
            .gather(2, tg)
            .reshape([bb, n]);
        let loss = (logp * wt).sum().neg().div_scalar(bb as f64);
        let lv = loss.clone().into_scalar::<f32>() as f64;
        if !lv.is_finite() {
            return Err(DenoiserError::NonFinite(format!(
                "stage-2 loss {lv} at step {step}; lower stage2.lr"
            )));
        }
        let grads = loss.backward();
        let mut gp = GradientsParams::from_grads(grads, &model);
        let gn = kiln_rl::optim::clip_grad_norm(&model, &mut gp, cfg.max_grad_norm);
        let lr = optim_cfg.lr_at(step, cfg.steps);
        model = optim.step(lr, model, gp);
        window.0 += lv;
        window.1 += 1;
        let done = step + 1;
        if cfg.log_every > 0 && (done % cfg.log_every == 0 || done == cfg.steps) {
            let mean = window.0 / window.1.max(1) as f64;
            tracing::info!(
                "stage 2 step {done}/{} loss {mean:.4} grad_norm {gn:.3} ({:.2} steps/s)",
                cfg.steps,
                done as f64 / started.elapsed().as_secs_f64().max(1e-9)
            );
            metrics(done, &[("stage2/loss", mean), ("stage2/grad_norm", gn)]);
            window = (0.0, 0);
        }
    }
    let model = model.valid().fork(device);
    save_denoiser(&model, out_dir)?;
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::denoiser::digit_log_probs;
    use crate::task::tests::setup;

    #[test]
    fn stage2_examples_are_teacher_forced_steps_also_under_a_symmetry() {
        let (_, _, ps) = setup();
        let p = &ps[0];
        let order: Vec<usize> = (0..81).filter(|&i| p.puzzle.cells()[i] == 0).collect();
        let givens = 81 - order.len();
        let t = 7;
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let plain = stage2_example(p, &order, t, 0.5, None);
        assert_eq!(plain.2[order[t]], 1.0 + 0.5 / (order.len() - t) as f32);
        for sym in [None, Some(Symmetry::random(p.puzzle.shape(), &mut rng))] {
            let (cells, sol, w) = stage2_example(p, &order, t, 0.5, sym.as_ref());
            // givens + the t revealed cells carry their true digit; the rest is masked
            assert_eq!(cells.iter().filter(|&&c| c != 0).count(), givens + t);
            for i in 0..81 {
                if cells[i] != 0 {
                    assert_eq!(
                        cells[i], sol[i],
                        "a revealed cell is not the solution digit"
                    );
                    assert_eq!(w[i], 0.0, "a revealed cell carries loss");
                } else {
                    assert!(w[i] > 0.0, "a masked cell carries no loss");
                }
            }
            // exactly one target cell (weight > 1), masked; the weights sum to 1 + aux
            let target: Vec<usize> = (0..81).filter(|&i| w[i] > 1.0).collect();
            assert_eq!(target.len(), 1);
            assert_eq!(cells[target[0]], 0);
            assert!((w.iter().sum::<f32>() - 1.5).abs() < 1e-5);
            if sym.is_none() {
                assert_eq!(target[0], order[t]);
                assert_eq!(w, plain.2);
            }
        }
    }

    #[test]
    fn stage2_fine_tunes_and_saves_the_denoiser() {
        let (model, pol, ps) = setup();
        let dir = tempfile::tempdir().unwrap();
        let cfg = Stage2Config {
            enabled: true,
            steps: 3,
            batch_size: 4,
            lr: 1e-2,
            log_every: 0,
            ..Default::default()
        };
        let mut sink = |_s: u64, _m: &[(&str, f64)]| {};
        let tuned = stage2(
            &model,
            &pol,
            &cfg,
            &ps,
            0,
            1.0,
            &Device::flex(),
            0,
            dir.path(),
            &mut sink,
        )
        .unwrap();
        let toks = vec![0u32; 81];
        let a = digit_log_probs(&model, &toks, 1, 81);
        let b = digit_log_probs(&tuned, &toks, 1, 81);
        assert!(
            a.iter().zip(&b).any(|(x, y)| (x - y).abs() > 1e-6),
            "stage 2 changed nothing"
        );
        assert!(crate::denoiser::denoiser_exists(dir.path()));
    }
}
