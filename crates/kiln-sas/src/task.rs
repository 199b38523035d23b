//! SAS training on Sudoku: the order policy trained with GRPO and the self-aware reward through
//! kiln-rl's [`kiln_rl::Trainer`] (METHODS, SAS "Order policy and training"). Stage 2 (fine-tuning the
//! denoiser along the learned orders) is [`crate::stage2`].
//!
//! **Self-aware reward** ([`crate::reward`]). For a puzzle with solution `x` and an order
//! `sigma = (i_1..i_n)` of its blank cells, teacher-forced:
//! `R(x, sigma) = sum_t log p(x_{i_t} | state_{t-1})`, where `state_{t-1}` is the puzzle with the
//! ground-truth digits of `i_1..i_{t-1}` revealed. No digit is sampled during training: one
//! denoiser forward per step, batched over every order of the step.
//!
//! **Rollout.** `puzzles_per_step` puzzles x `group_size` orders each; at step t all `P x G`
//! boards go through ONE denoiser forward, the policy samples one allowed cell per board from
//! the features of that forward, the reward is read off the same forward, and the cell is
//! revealed with its true digit. The features, allowed masks and actions are kept so that
//! [`RlTask::score`] re-scores the actions under the current policy parameters (the denoiser is
//! frozen and never receives gradients).

use std::collections::BTreeMap;
use std::time::Instant;

use crate::denoiser::SudokuDenoiser;
use burn::tensor::{Bool, Tensor, TensorData};
use kiln_rl::{EpochSampler, RlTask, Rollout, Scored, TaskError};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::denoiser::digit_log_probs;
use crate::policy::{Features, OrderPolicy, PolicyConfig, allowed_cells};
use crate::reward::{StoredSteps, TfRollout, sample_allowed, score_steps, step_reward};
use crate::schedule::{DecodeConfig, Schedule, decode};
use crate::sudoku::{Puzzle, PuzzleSetConfig};

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
    let mut out = TfRollout::new(nb, t_max, store.then_some((n, fd)));
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
            let inputs = store.then(|| (&f[j * n * fd..(j + 1) * n * fd], allowed));
            out.reveal(k, t, i, digit_log_prob(&lp, j, n, side, i, digit), inputs);
            cells[k][i] = digit;
            masked[k][i] = false;
        }
    }
    out
}

/// The log-probability of `digit` at cell `i` of board `j` in [`digit_log_probs`]' layout
/// (`[boards, n, side]`, digits `1..=side`).
fn digit_log_prob(lp: &[f32], j: usize, n: usize, side: usize, i: usize, digit: u8) -> f32 {
    lp[(j * n + i) * side + digit as usize - 1]
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
            out[k].push(step_reward(digit_log_prob(&lp, j, n, side, i, d)));
            cells[k][i] = d;
        }
    }
    out
}

/// Rollout data kept for re-scoring.
pub struct SasData {
    steps: StoredSteps,
    /// The sampled orders (for inspection and tests).
    pub orders: Vec<Vec<usize>>,
    /// The per-step rewards (for inspection and tests).
    pub step_rewards: Vec<Vec<f64>>,
    /// Indices (into the training set) of each trajectory's puzzle.
    pub puzzle_ids: Vec<usize>,
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
    sampler: EpochSampler,
    baseline: Option<BTreeMap<String, f64>>,
}

/// Epoch-shuffle constant of the SAS tasks' [`EpochSampler`] (Sudoku and text).
pub(crate) const SAS_EPOCH_MIX: u64 = 0x9e37;

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
        SasTask {
            denoiser,
            cfg,
            policy_cfg,
            sampler: EpochSampler::new(train.len(), data_seed, SAS_EPOCH_MIX),
            train,
            eval,
            baseline: None,
        }
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
        let ids = self.sampler.take_groups(self.cfg.puzzles_per_step, g);
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
        let per_step: Vec<f64> = ro.step_rewards.iter().flatten().copied().collect();
        let step_exact = per_step.iter().filter(|r| **r > (0.5f64).ln()).count() as f64
            / per_step.len().max(1) as f64;
        let calls = ro.denoiser_calls as f64;
        let n = self.train[0].puzzle.shape().n_cells();
        let fd = Features::new(self.train[0].puzzle.shape()).dim();
        let mut out = ro.into_rollout(g, wall, |steps, orders, step_rewards| SasData {
            steps,
            orders,
            step_rewards: step_rewards.to_vec(),
            puzzle_ids: ids,
            n,
            fd,
        });
        out.metrics.insert("sas/step_exact".into(), step_exact);
        out.metrics.insert("sas/denoiser_calls".into(), calls);
        Ok(out)
    }

    fn score(&self, policy: &OrderPolicy, data: &SasData, indices: &[usize]) -> Scored {
        score_steps(
            policy,
            &data.steps,
            indices,
            data.n,
            data.fd,
            self.policy_cfg.temperature,
        )
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
        self.sampler.state().to_json()
    }

    fn load_state(&mut self, state: &serde_json::Value) -> Result<(), TaskError> {
        Ok(self.sampler.load_json(state)?)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::denoiser::tiny_denoiser_config;
    use crate::sudoku::{GenParams, Shape, generate};
    use burn::tensor::Device;

    /// A tiny seeded denoiser, a default order policy and three generated puzzles.
    pub(crate) fn setup() -> (SudokuDenoiser, OrderPolicy, Vec<Puzzle>) {
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
