//! The self-aware reward, and the teacher-forced rollout record that Sudoku ([`crate::task`])
//! and text ([`crate::text`]) both fill and hand to kiln-rl.
//!
//! **Self-aware reward** (METHODS, SAS "The self-aware reward": the reward of an order is
//! the frozen denoiser's own log-likelihood of the truth along it). For a target `x` and an order
//! `sigma = (i_1..i_n)` of its masked positions, teacher-forced:
//!
//! `R(x, sigma) = sum_t r_t`, `r_t = log p(x_{i_t} | state_{t-1})`,
//!
//! where `state_{t-1}` reveals the ground-truth tokens of `i_1..i_{t-1}`. [`step_reward`] is `r_t`
//! and [`trajectory_reward`] is `R`; both tasks call these two and nothing else computes the
//! reward. The per-step `r_t` go to the trainer as dense rewards (used with
//! `algorithm.reward_to_go`), `R` is the outcome reward of the GRPO group.
//!
//! [`TfRollout`] records the chosen positions, the `r_t` and (for re-scoring) the policy inputs of
//! every step; [`TfRollout::into_rollout`] turns it into kiln-rl's [`Rollout`] and
//! [`score_steps`] re-scores the stored actions under the current policy parameters.

use std::collections::BTreeMap;

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_rl::{Rollout, Scored};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// The self-aware reward of one step: the denoiser's log-probability of the true token at the
/// revealed position, given the state before it is revealed.
pub fn step_reward(target_log_prob: f32) -> f64 {
    target_log_prob as f64
}

/// The self-aware reward of a whole order: the sum of its step rewards.
pub fn trajectory_reward(step_rewards: &[f64]) -> f64 {
    step_rewards.iter().sum()
}

/// An order policy over positions: masked log-probabilities `[N, P]` from features `[N, P, F]`.
pub trait PositionPolicy {
    /// Log-probabilities over positions (`allowed` false = probability 0) at `temperature`.
    fn position_log_probs(
        &self,
        features: Tensor<3>,
        allowed: Tensor<2, Bool>,
        temperature: f64,
    ) -> Tensor<2>;
    /// The device of the weights.
    fn weights_device(&self) -> Device;
}

impl PositionPolicy for crate::policy::OrderPolicy {
    fn position_log_probs(&self, f: Tensor<3>, a: Tensor<2, Bool>, temperature: f64) -> Tensor<2> {
        self.log_probs(f, a, temperature)
    }
    fn weights_device(&self) -> Device {
        self.device()
    }
}

impl PositionPolicy for crate::text::TextOrderPolicy {
    fn position_log_probs(&self, f: Tensor<3>, a: Tensor<2, Bool>, temperature: f64) -> Tensor<2> {
        self.log_probs(f, a, temperature)
    }
    fn weights_device(&self) -> Device {
        self.device()
    }
}

/// Orders, rewards and (optionally) the policy inputs of a teacher-forced rollout.
#[derive(Debug, Clone, Default)]
pub struct TfRollout {
    /// Positions of each row in the order chosen.
    pub orders: Vec<Vec<usize>>,
    /// Per-step self-aware rewards ([`step_reward`]) of each row.
    pub step_rewards: Vec<Vec<f64>>,
    /// Policy features `[rows, t_max, positions, F]` (empty unless stored).
    pub features: Vec<f32>,
    /// Allowed masks `[rows, t_max, positions]` (all true on padding steps).
    pub allowed: Vec<bool>,
    /// Chosen positions `[rows, t_max]` (0 on padding steps).
    pub actions: Vec<i64>,
    /// Padded number of steps.
    pub t_max: usize,
    /// Seconds spent in denoiser forwards.
    pub denoiser_s: f64,
    /// Denoiser forward calls.
    pub denoiser_calls: usize,
}

impl TfRollout {
    /// An empty record of `rows` rows and at most `t_max` steps; with `store`, room for the policy
    /// inputs of `positions` positions with `fd` features each.
    pub fn new(rows: usize, t_max: usize, store: Option<(usize, usize)>) -> TfRollout {
        let mut out = TfRollout {
            orders: vec![Vec::new(); rows],
            step_rewards: vec![Vec::new(); rows],
            t_max,
            ..Default::default()
        };
        if let Some((positions, fd)) = store {
            out.features = vec![0f32; rows * t_max * positions * fd];
            out.allowed = vec![true; rows * t_max * positions];
            out.actions = vec![0i64; rows * t_max];
        }
        out
    }

    /// Row `k` reveals position `i` at step `t`; the denoiser gave its true token log-probability
    /// `target_log_prob`. With stored inputs, `features` / `allowed` are the step's policy inputs
    /// of this row (`positions x fd` and `positions`).
    pub fn reveal(
        &mut self,
        k: usize,
        t: usize,
        i: usize,
        target_log_prob: f32,
        inputs: Option<(&[f32], &[bool])>,
    ) {
        self.step_rewards[k].push(step_reward(target_log_prob));
        self.orders[k].push(i);
        if let Some((f, a)) = inputs
            && !self.actions.is_empty()
        {
            let (p, fd) = (a.len(), f.len() / a.len().max(1));
            let at = k * self.t_max + t;
            self.features[at * p * fd..(at + 1) * p * fd].copy_from_slice(f);
            self.allowed[at * p..(at + 1) * p].copy_from_slice(a);
            self.actions[at] = i as i64;
        }
    }

    /// The kiln-rl rollout of groups of `group_size` rows: trajectory rewards
    /// ([`trajectory_reward`]), dense step rewards, the action mask of each row's steps, and the
    /// metrics `sas/reward_per_step`, `time/denoiser_s` and `time/denoiser_share_of_rollout`
    /// (`wall_s` = the rollout's wall time). `data` builds the task's re-scoring data from the
    /// stored inputs.
    pub fn into_rollout<D>(
        self,
        group_size: usize,
        wall_s: f64,
        data: impl FnOnce(StoredSteps, Vec<Vec<usize>>, &[Vec<f64>]) -> D,
    ) -> Rollout<D> {
        let rows = self.orders.len();
        let t_max = self.t_max;
        let mut action_mask = vec![0f32; rows * t_max];
        for (k, o) in self.orders.iter().enumerate() {
            for t in 0..o.len() {
                action_mask[k * t_max + t] = 1.0;
            }
        }
        let rewards: Vec<f64> = self
            .step_rewards
            .iter()
            .map(|r| trajectory_reward(r))
            .collect();
        let mut metrics = BTreeMap::new();
        let per_step: Vec<f64> = self.step_rewards.iter().flatten().copied().collect();
        metrics.insert(
            "sas/reward_per_step".into(),
            per_step.iter().sum::<f64>() / per_step.len().max(1) as f64,
        );
        metrics.insert("time/denoiser_s".into(), self.denoiser_s);
        metrics.insert(
            "time/denoiser_share_of_rollout".into(),
            self.denoiser_s / wall_s.max(1e-9),
        );
        let stored = StoredSteps {
            features: self.features,
            allowed: self.allowed,
            actions: self.actions,
            t_max,
        };
        let data = data(stored, self.orders, &self.step_rewards);
        Rollout {
            data,
            group_size,
            rewards,
            step_rewards: Some(self.step_rewards),
            max_actions: t_max,
            action_mask,
            metrics,
            // The order policy's sampled log-probs are not recorded yet; the trainer still checks
            // the first minibatch against the rollout snapshot.
            sampled_logp: None,
        }
    }
}

/// The policy inputs and actions of every step of every row, kept for re-scoring.
#[derive(Debug, Clone, Default)]
pub struct StoredSteps {
    /// Features `[rows, t_max, positions, F]`.
    pub features: Vec<f32>,
    /// Allowed masks `[rows, t_max, positions]`.
    pub allowed: Vec<bool>,
    /// Chosen positions `[rows, t_max]`.
    pub actions: Vec<i64>,
    /// Padded number of steps.
    pub t_max: usize,
}

/// Log-probabilities `[indices.len(), t_max]` (and entropies) of the stored actions of rows
/// `indices` under `policy`: one policy forward over every (row, step) state. `positions` and
/// `fd` give the shape of one state's features.
pub fn score_steps<P: PositionPolicy>(
    policy: &P,
    s: &StoredSteps,
    indices: &[usize],
    positions: usize,
    fd: usize,
    temperature: f64,
) -> Scored {
    let (t, n) = (s.t_max, positions);
    let b = indices.len();
    let mut f = Vec::with_capacity(b * t * n * fd);
    let mut al = Vec::with_capacity(b * t * n);
    let mut act = Vec::with_capacity(b * t);
    for &k in indices {
        f.extend_from_slice(&s.features[k * t * n * fd..(k + 1) * t * n * fd]);
        al.extend_from_slice(&s.allowed[k * t * n..(k + 1) * t * n]);
        act.extend_from_slice(&s.actions[k * t..(k + 1) * t]);
    }
    let device = policy.weights_device();
    let ft = Tensor::<3>::from_data(TensorData::new(f, [b * t, n, fd]), &device);
    let at = Tensor::<2, Bool>::from_data(TensorData::new(al, [b * t, n]), &device);
    let idx = Tensor::<2, Int>::from_data(TensorData::new(act, [b * t, 1]), &device);
    let lp = policy.position_log_probs(ft, at, temperature);
    let logp = lp.clone().gather(1, idx).reshape([b, t]);
    let entropy = (lp.clone().exp() * lp).sum_dim(1).neg().reshape([b, t]);
    Scored {
        logp,
        entropy: Some(entropy),
    }
}

/// Sample an allowed index from log-probabilities (inverse CDF over allowed entries).
pub fn sample_allowed(logp: &[f32], allowed: &[bool], rng: &mut ChaCha8Rng) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rollout_sums_step_rewards_and_masks_padding() {
        let mut ro = TfRollout::new(2, 3, None);
        ro.reveal(0, 0, 4, -0.5, None);
        ro.reveal(0, 1, 2, -1.0, None);
        ro.reveal(1, 0, 1, -0.25, None);
        let r = ro.into_rollout(2, 1.0, |_, orders, _| orders);
        assert_eq!(r.rewards, vec![-1.5, -0.25]);
        assert_eq!(r.action_mask, vec![1.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
        assert_eq!(r.data, vec![vec![4, 2], vec![1]]);
        assert!((r.metrics["sas/reward_per_step"] + 1.75 / 3.0).abs() < 1e-12);
    }
}
