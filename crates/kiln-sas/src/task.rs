//! SAS training: the self-aware reward and the order policy trained with GRPO through kiln-rl's
//! [`kiln_rl::Trainer`] (METHODS.md section 2), plus stage 2 (fine-tuning the denoiser along the
//! learned orders).
//!
//! **Self-aware reward.** For a puzzle with solution `x` and an order `sigma = (i_1..i_n)` of its
//! blank cells, teacher-forced: `R(x, sigma) = sum_t log p(x_{i_t} | state_{t-1})`, where
//! `state_{t-1}` is the puzzle with the ground-truth digits of `i_1..i_{t-1}` revealed. The
//! per-step rewards `r_t` are passed to the trainer as dense rewards (used when
//! `algorithm.reward_to_go` is on); the total is the trajectory reward. No digit is sampled
//! during training: one denoiser forward per step, batched over every order of the step.
//!
//! **Rollout.** `puzzles_per_step` puzzles x `group_size` orders each; at step t all `P x G`
//! boards go through ONE denoiser forward, the policy samples one allowed cell per board from
//! the features of that forward, the reward is read off the same forward, and the cell is
//! revealed with its true digit. The features, allowed masks and actions are kept so that
//! [`RlTask::score`] re-scores the actions under the current policy parameters (the denoiser is
//! frozen and never receives gradients).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use crate::denoiser::SudokuDenoiser;
use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_rl::{RlTask, Rollout, Scored, TaskError};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::denoiser::{DenoiserError, PuzzleSetConfig, digit_log_probs, save_denoiser};
use crate::policy::{Features, OrderPolicy, PolicyConfig, allowed_cells};
use crate::schedule::{DecodeConfig, Schedule, decode};
use crate::sudoku::Puzzle;

/// The task section of a `sas` recipe (`sas:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct SasConfig {
    /// Distinct puzzles per training step.
    pub puzzles_per_step: usize,
    /// Orders sampled per puzzle (the GRPO group size G).
    pub group_size: usize,
    /// The puzzles the policy is trained on (the paper uses 1,000).
    pub train: PuzzleSetConfig,
    /// Held-out puzzles decoded by the periodic evaluation (greedy learned order).
    pub eval: PuzzleSetConfig,
    /// Decoding settings of training and evaluation (block length restricts the policy too).
    pub decode: DecodeConfig,
}

impl Default for SasConfig {
    fn default() -> Self {
        Self {
            puzzles_per_step: 8,
            group_size: 8,
            train: PuzzleSetConfig {
                count: 1000,
                givens: vec![30],
                seed: 101,
                ..Default::default()
            },
            eval: PuzzleSetConfig {
                count: 200,
                givens: vec![30],
                seed: 202,
                ..Default::default()
            },
            decode: DecodeConfig::default(),
        }
    }
}

/// Orders, rewards and (optionally) the policy inputs of a teacher-forced rollout.
#[derive(Debug, Clone, Default)]
pub struct TfRollout {
    /// Blank cells of each board in the order chosen.
    pub orders: Vec<Vec<usize>>,
    /// Per-step self-aware rewards `log p(x_{i_t} | state_{t-1})` of each board.
    pub step_rewards: Vec<Vec<f64>>,
    /// Policy features `[boards, t_max, n, F]` (empty unless stored).
    pub features: Vec<f32>,
    /// Allowed masks `[boards, t_max, n]` (all true on padding steps).
    pub allowed: Vec<bool>,
    /// Chosen cells `[boards, t_max]` (0 on padding steps).
    pub actions: Vec<i64>,
    /// Padded number of steps.
    pub t_max: usize,
    /// Seconds spent in denoiser forwards.
    pub denoiser_s: f64,
    /// Denoiser forward calls.
    pub denoiser_calls: usize,
}

/// Sample one order per puzzle of `puzzles` from `policy` (temperature `temperature`) with
/// teacher forcing, recording the self-aware per-step rewards. With `store`, the policy inputs
/// are kept for re-scoring. One denoiser forward per step over all boards still decoding.
pub fn teacher_forced_rollout(
    denoiser: &SudokuDenoiser,
    policy: &OrderPolicy,
    puzzles: &[&Puzzle],
    block_len: usize,
    temperature: f64,
    rng: &mut ChaCha8Rng,
    store: bool,
) -> TfRollout {
    let nb = puzzles.len();
    let Some(first) = puzzles.first() else {
        return TfRollout::default();
    };
    let shape = first.puzzle.shape();
    let n = shape.n_cells();
    let side = shape.side();
    let feats = policy.features(shape);
    let fd = feats.dim();
    let mut cells: Vec<Vec<u8>> = puzzles.iter().map(|p| p.puzzle.cells().to_vec()).collect();
    let mut masked: Vec<Vec<bool>> = cells
        .iter()
        .map(|c| c.iter().map(|&v| v == 0).collect())
        .collect();
    let t_max = masked
        .iter()
        .map(|m| m.iter().filter(|x| **x).count())
        .max()
        .unwrap_or(0);
    let mut out = TfRollout {
        orders: vec![Vec::new(); nb],
        step_rewards: vec![Vec::new(); nb],
        t_max,
        ..Default::default()
    };
    if store {
        out.features = vec![0f32; nb * t_max * n * fd];
        out.allowed = vec![true; nb * t_max * n];
        out.actions = vec![0i64; nb * t_max];
    }
    let device = policy.device();
    for t in 0..t_max {
        let active: Vec<usize> = (0..nb).filter(|&k| masked[k].iter().any(|m| *m)).collect();
        if active.is_empty() {
            break;
        }
        let b = active.len();
        let tokens: Vec<u32> = active
            .iter()
            .flat_map(|&k| cells[k].iter().map(|&v| v as u32))
            .collect();
        let t0 = Instant::now();
        let lp = digit_log_probs(denoiser, &tokens, b, n);
        out.denoiser_s += t0.elapsed().as_secs_f64();
        out.denoiser_calls += 1;
        let mut f = Vec::with_capacity(b * n * fd);
        let mut al = Vec::with_capacity(b * n);
        for (j, &k) in active.iter().enumerate() {
            let a = allowed_cells(&masked[k], block_len);
            feats.push_board(&lp[j * n * side..(j + 1) * n * side], &cells[k], &a, &mut f);
            al.extend(a);
        }
        let ft = Tensor::<3>::from_data(TensorData::new(f.clone(), [b, n, fd]), &device);
        let at = Tensor::<2, Bool>::from_data(TensorData::new(al.clone(), [b, n]), &device);
        let logp: Vec<f32> = policy
            .log_probs(ft, at, temperature)
            .into_data()
            .convert::<f32>()
            .try_into_vec()
            .unwrap_or_default();
        for (j, &k) in active.iter().enumerate() {
            let row = &logp[j * n..(j + 1) * n];
            let allowed = &al[j * n..(j + 1) * n];
            let i = sample_allowed(row, allowed, rng);
            let digit = puzzles[k].solution.cells()[i];
            let r = lp[(j * n + i) * side + digit as usize - 1] as f64;
            out.step_rewards[k].push(r);
            out.orders[k].push(i);
            cells[k][i] = digit;
            masked[k][i] = false;
            if store {
                let at = k * t_max + t;
                out.features[at * n * fd..(at + 1) * n * fd]
                    .copy_from_slice(&f[j * n * fd..(j + 1) * n * fd]);
                out.allowed[at * n..(at + 1) * n].copy_from_slice(allowed);
                out.actions[at] = i as i64;
            }
        }
    }
    out
}

/// Sample an allowed index from log-probabilities (inverse CDF over allowed entries).
pub(crate) fn sample_allowed(logp: &[f32], allowed: &[bool], rng: &mut ChaCha8Rng) -> usize {
    let total: f64 = logp
        .iter()
        .zip(allowed)
        .filter(|(_, a)| **a)
        .map(|(l, _)| (*l as f64).exp())
        .sum();
    let u = rng.random::<f64>() * total;
    let mut acc = 0.0;
    let mut last = None;
    for (i, (l, a)) in logp.iter().zip(allowed).enumerate() {
        if *a {
            acc += (*l as f64).exp();
            last = Some(i);
            if u < acc {
                return i;
            }
        }
    }
    last.unwrap_or(0)
}

/// The self-aware per-step rewards of given `orders` (one per puzzle), teacher-forced, with one
/// denoiser forward per step batched over the boards.
pub fn self_aware_rewards(
    denoiser: &SudokuDenoiser,
    puzzles: &[&Puzzle],
    orders: &[Vec<usize>],
) -> Vec<Vec<f64>> {
    let nb = puzzles.len();
    let Some(first) = puzzles.first() else {
        return Vec::new();
    };
    let n = first.puzzle.shape().n_cells();
    let side = first.puzzle.shape().side();
    let mut cells: Vec<Vec<u8>> = puzzles.iter().map(|p| p.puzzle.cells().to_vec()).collect();
    let t_max = orders.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = vec![Vec::new(); nb];
    for t in 0..t_max {
        let active: Vec<usize> = (0..nb).filter(|&k| t < orders[k].len()).collect();
        let tokens: Vec<u32> = active
            .iter()
            .flat_map(|&k| cells[k].iter().map(|&v| v as u32))
            .collect();
        let lp = digit_log_probs(denoiser, &tokens, active.len(), n);
        for (j, &k) in active.iter().enumerate() {
            let i = orders[k][t];
            let d = puzzles[k].solution.cells()[i];
            out[k].push(lp[(j * n + i) * side + d as usize - 1] as f64);
            cells[k][i] = d;
        }
    }
    out
}

/// Rollout data kept for re-scoring.
pub struct SasData {
    features: Vec<f32>,
    allowed: Vec<bool>,
    actions: Vec<i64>,
    /// The sampled orders (for inspection and tests).
    pub orders: Vec<Vec<usize>>,
    /// The per-step rewards (for inspection and tests).
    pub step_rewards: Vec<Vec<f64>>,
    /// Indices (into the training set) of each trajectory's puzzle.
    pub puzzle_ids: Vec<usize>,
    t_max: usize,
    n: usize,
    fd: usize,
}

/// The SAS task: frozen denoiser, trainable [`OrderPolicy`].
pub struct SasTask {
    denoiser: SudokuDenoiser,
    cfg: SasConfig,
    policy_cfg: PolicyConfig,
    train: Vec<Puzzle>,
    eval: Vec<Puzzle>,
    perm: Vec<usize>,
    cursor: usize,
    epoch: u64,
    data_seed: u64,
    baseline: Option<BTreeMap<String, f64>>,
}

impl SasTask {
    /// A task over `train` / `eval` puzzles with a frozen `denoiser` (inference device).
    pub fn new(
        denoiser: SudokuDenoiser,
        cfg: SasConfig,
        policy_cfg: PolicyConfig,
        train: Vec<Puzzle>,
        eval: Vec<Puzzle>,
        data_seed: u64,
    ) -> SasTask {
        let mut t = SasTask {
            denoiser,
            cfg,
            policy_cfg,
            perm: (0..train.len()).collect(),
            train,
            eval,
            cursor: 0,
            epoch: 0,
            data_seed,
            baseline: None,
        };
        t.shuffle();
        t
    }

    fn shuffle(&mut self) {
        let mut rng = ChaCha8Rng::seed_from_u64(self.data_seed ^ self.epoch.wrapping_mul(0x9e37));
        self.perm = (0..self.train.len()).collect();
        self.perm.shuffle(&mut rng);
    }

    fn next_puzzles(&mut self, k: usize) -> Vec<usize> {
        let mut out = Vec::with_capacity(k);
        while out.len() < k {
            if self.cursor >= self.perm.len() {
                self.epoch += 1;
                self.cursor = 0;
                self.shuffle();
            }
            out.push(self.perm[self.cursor]);
            self.cursor += 1;
        }
        out
    }

    /// The frozen denoiser.
    pub fn denoiser(&self) -> &SudokuDenoiser {
        &self.denoiser
    }
}

impl RlTask for SasTask {
    type Policy = OrderPolicy;
    type Data = SasData;

    fn rollout(
        &mut self,
        policy: &OrderPolicy,
        _step: u64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Rollout<SasData>, TaskError> {
        if self.train.is_empty() {
            return Err("no training puzzles".into());
        }
        let g = self.cfg.group_size;
        let ids: Vec<usize> = self
            .next_puzzles(self.cfg.puzzles_per_step)
            .into_iter()
            .flat_map(|i| std::iter::repeat_n(i, g))
            .collect();
        let puzzles: Vec<&Puzzle> = ids.iter().map(|&i| &self.train[i]).collect();
        let t0 = Instant::now();
        let ro = teacher_forced_rollout(
            &self.denoiser,
            policy,
            &puzzles,
            self.cfg.decode.block_len,
            self.policy_cfg.temperature,
            rng,
            true,
        );
        let wall = t0.elapsed().as_secs_f64();
        let nb = puzzles.len();
        let t_max = ro.t_max;
        let mut action_mask = vec![0f32; nb * t_max];
        for (k, o) in ro.orders.iter().enumerate() {
            for t in 0..o.len() {
                action_mask[k * t_max + t] = 1.0;
            }
        }
        let rewards: Vec<f64> = ro.step_rewards.iter().map(|r| r.iter().sum()).collect();
        let mut metrics = BTreeMap::new();
        let per_step: Vec<f64> = ro.step_rewards.iter().flatten().copied().collect();
        metrics.insert(
            "sas/reward_per_step".into(),
            per_step.iter().sum::<f64>() / per_step.len().max(1) as f64,
        );
        metrics.insert(
            "sas/step_exact".into(),
            per_step.iter().filter(|r| **r > (0.5f64).ln()).count() as f64
                / per_step.len().max(1) as f64,
        );
        metrics.insert("time/denoiser_s".into(), ro.denoiser_s);
        metrics.insert(
            "time/denoiser_share_of_rollout".into(),
            ro.denoiser_s / wall.max(1e-9),
        );
        metrics.insert("sas/denoiser_calls".into(), ro.denoiser_calls as f64);
        let n = self.train[0].puzzle.shape().n_cells();
        let fd = Features::new(self.train[0].puzzle.shape()).dim();
        Ok(Rollout {
            data: SasData {
                features: ro.features,
                allowed: ro.allowed,
                actions: ro.actions,
                orders: ro.orders,
                step_rewards: ro.step_rewards.clone(),
                puzzle_ids: ids,
                t_max,
                n,
                fd,
            },
            group_size: g,
            rewards,
            step_rewards: Some(ro.step_rewards),
            max_actions: t_max,
            action_mask,
            metrics,
        })
    }

    fn score(&self, policy: &OrderPolicy, data: &SasData, indices: &[usize]) -> Scored {
        let (t, n, fd) = (data.t_max, data.n, data.fd);
        let b = indices.len();
        let mut f = Vec::with_capacity(b * t * n * fd);
        let mut al = Vec::with_capacity(b * t * n);
        let mut act = Vec::with_capacity(b * t);
        for &k in indices {
            f.extend_from_slice(&data.features[k * t * n * fd..(k + 1) * t * n * fd]);
            al.extend_from_slice(&data.allowed[k * t * n..(k + 1) * t * n]);
            act.extend_from_slice(&data.actions[k * t..(k + 1) * t]);
        }
        let device = policy.device();
        let ft = Tensor::<3>::from_data(TensorData::new(f, [b * t, n, fd]), &device);
        let at = Tensor::<2, Bool>::from_data(TensorData::new(al, [b * t, n]), &device);
        let idx = Tensor::<2, Int>::from_data(TensorData::new(act, [b * t, 1]), &device);
        let lp = policy.log_probs(ft, at, self.policy_cfg.temperature);
        let logp = lp.clone().gather(1, idx).reshape([b, t]);
        let entropy = (lp.clone().exp() * lp).sum_dim(1).neg().reshape([b, t]);
        Scored {
            logp,
            entropy: Some(entropy),
        }
    }

    fn evaluate(
        &mut self,
        policy: &OrderPolicy,
        _step: u64,
    ) -> Result<BTreeMap<String, f64>, TaskError> {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut m = BTreeMap::new();
        if self.eval.is_empty() {
            return Ok(m);
        }
        let acc = |out: &[crate::schedule::Decoded], ps: &[Puzzle]| {
            let mut boards = 0usize;
            let (mut hits, mut total) = (0usize, 0usize);
            for (d, p) in out.iter().zip(ps) {
                boards += d.board_correct(p) as usize;
                let (h, n) = d.cell_hits(p);
                hits += h;
                total += n;
            }
            (
                boards as f64 / ps.len() as f64,
                hits as f64 / total.max(1) as f64,
            )
        };
        if self.baseline.is_none() {
            let mut b = BTreeMap::new();
            for s in [Schedule::Margin, Schedule::Confidence] {
                let out = decode(
                    &self.denoiser,
                    &self.eval,
                    s,
                    &self.cfg.decode,
                    None,
                    &mut rng,
                );
                let (ba, _) = acc(&out, &self.eval);
                b.insert(format!("eval/board_acc_{s}"), ba);
            }
            self.baseline = Some(b);
        }
        let out = decode(
            &self.denoiser,
            &self.eval,
            Schedule::Learned,
            &self.cfg.decode,
            Some(policy),
            &mut rng,
        );
        let (ba, ca) = acc(&out, &self.eval);
        m.insert("eval/board_acc".into(), ba);
        m.insert("eval/cell_acc".into(), ca);
        if let Some(b) = &self.baseline {
            m.extend(b.clone());
        }
        Ok(m)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({"cursor": self.cursor, "epoch": self.epoch})
    }

    fn load_state(&mut self, state: &serde_json::Value) -> Result<(), TaskError> {
        if state.is_null() {
            return Ok(());
        }
        let cursor = state["cursor"]
            .as_u64()
            .ok_or("task state lacks `cursor`")? as usize;
        let epoch = state["epoch"].as_u64().ok_or("task state lacks `epoch`")?;
        self.epoch = epoch;
        self.shuffle();
        self.cursor = cursor.min(self.perm.len());
        Ok(())
    }
}

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
    sym: Option<&crate::denoiser::Symmetry>,
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
    metrics: &mut crate::denoiser::MetricsFn<'_>,
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
            let sym = cfg
                .augment
                .then(|| crate::denoiser::Symmetry::random(shape, &mut rng));
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
    use crate::denoiser::tiny_denoiser_config;
    use crate::sudoku::{GenParams, Shape, generate};

    fn setup() -> (SudokuDenoiser, OrderPolicy, Vec<Puzzle>) {
        let device = Device::flex();
        device.seed(11);
        let model = tiny_denoiser_config(Shape::NINE).init(&device);
        let pol = OrderPolicy::init(&PolicyConfig::default(), Shape::NINE, &device);
        let ps = generate(&GenParams::new(3, 70, 4)).unwrap();
        (model, pol, ps)
    }

    /// The batched rollout's rewards equal per-step teacher-forced log-probs computed one board
    /// and one step at a time (no batching shortcut changes the value).
    #[test]
    fn self_aware_reward_equals_stepwise_log_probs() {
        let (model, pol, ps) = setup();
        let refs: Vec<&Puzzle> = vec![&ps[0], &ps[1], &ps[2], &ps[0]];
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let ro = teacher_forced_rollout(&model, &pol, &refs, 0, 1.0, &mut rng, true);
        for (k, p) in refs.iter().enumerate() {
            let order = &ro.orders[k];
            let mut o = order.clone();
            o.sort();
            assert_eq!(o, p.puzzle.blanks());
            // One step at a time, batch of one.
            let mut cells = p.puzzle.cells().to_vec();
            let mut total = 0.0;
            for (t, &i) in order.iter().enumerate() {
                let toks: Vec<u32> = cells.iter().map(|&v| v as u32).collect();
                let lp = digit_log_probs(&model, &toks, 1, 81);
                let d = p.solution.cells()[i];
                let r = lp[i * 9 + d as usize - 1] as f64;
                assert!(
                    (r - ro.step_rewards[k][t]).abs() < 1e-4,
                    "step {t}: {r} vs {}",
                    ro.step_rewards[k][t]
                );
                total += r;
                cells[i] = d;
            }
            let sum: f64 = ro.step_rewards[k].iter().sum();
            assert!((sum - total).abs() < 1e-3);
        }
        // The standalone batched reward agrees too.
        let again = self_aware_rewards(&model, &refs, &ro.orders);
        for (a, b) in again.iter().flatten().zip(ro.step_rewards.iter().flatten()) {
            assert!((a - b).abs() < 1e-4);
        }
    }

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
        for sym in [
            None,
            Some(crate::denoiser::Symmetry::random(
                p.puzzle.shape(),
                &mut rng,
            )),
        ] {
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

    #[test]
    fn rollout_and_score_agree_and_groups_share_puzzles() {
        let (model, pol, ps) = setup();
        let cfg = SasConfig {
            puzzles_per_step: 2,
            group_size: 3,
            ..Default::default()
        };
        let mut task = SasTask::new(model, cfg, PolicyConfig::default(), ps.clone(), ps, 1);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let ro = task.rollout(&pol, 0, &mut rng).unwrap();
        assert_eq!(ro.len(), 6);
        assert_eq!(ro.data.puzzle_ids[0], ro.data.puzzle_ids[2]);
        assert_ne!(ro.data.puzzle_ids[0], ro.data.puzzle_ids[3]);
        let idx: Vec<usize> = (0..6).collect();
        let s = task.score(&pol, &ro.data, &idx);
        let lp: Vec<f32> = s.logp.into_data().convert::<f32>().try_into_vec().unwrap();
        let t = ro.max_actions;
        for k in 0..6 {
            for step in 0..t {
                let v = lp[k * t + step];
                if ro.action_mask[k * t + step] > 0.0 {
                    assert!(v <= 1e-6 && v > -20.0, "log-prob {v}");
                }
            }
        }
        // Group advantages of the outcome rewards sum to ~0.
        let adv =
            kiln_rl::advantage::batch_advantages(&ro.rewards, 3, kiln_rl::AdvantageEstimator::Grpo);
        for g in adv.chunks(3) {
            assert!(g.iter().sum::<f64>().abs() < 1e-9);
        }
    }
}
