//! DAPO's dynamic sampling (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning
//! system at scale", section 3.2: over-sample and filter out prompts whose group accuracy is 0 or 1).
//!
//! A group whose G rewards are all equal has zero advantage under every group baseline (GRPO,
//! Dr.GRPO, RLOO): it carries no policy-gradient signal, yet it costs rollout time and, under
//! token-mean aggregation, dilutes the loss of the informative groups. With sparse rewards (a
//! search agent that answers 3-5% of its training questions) most groups are uniform, so most
//! steps would make no update at all.
//!
//! [`DynamicDraw`] is the pure decision rule a task's `rollout` runs: draw questions in rounds
//! (round 1: the batch's `target` groups; each later round: the number of informative groups still
//! missing), keep the informative groups of each round, and stop when `target` groups are kept or
//! `max_draw_factor x target` questions were drawn. The batch may end with fewer than `target`
//! groups when the draw budget runs out; when no group of any round was informative, the last
//! round is kept whole (the trainer then skips or zeroes the update, as without dynamic sampling),
//! so that a step always has a batch to log.
//!
//! Bookkeeping for the logs ([`DynamicDraw::metrics`]): questions drawn, rounds, groups kept and
//! dropped, and the mean reward over every drawn trajectory (the policy's unbiased train reward;
//! the kept groups' mean is biased towards 0.5 by construction).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The recipe's `dynamic_sampling` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct DynamicSamplingConfig {
    /// Turn dynamic sampling on. Default false (every drawn group is trained on).
    pub enabled: bool,
    /// Most questions drawn per step, as a multiple of the batch's questions (>= 1; 1 = draw one
    /// batch and only drop its uniform groups). Default 3.
    pub max_draw_factor: usize,
}

impl Default for DynamicSamplingConfig {
    fn default() -> Self {
        DynamicSamplingConfig {
            enabled: false,
            max_draw_factor: 3,
        }
    }
}

impl DynamicSamplingConfig {
    /// Checks the settings; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_draw_factor == 0 {
            return Err(
                "dynamic_sampling.max_draw_factor must be at least 1 (1 = draw one batch of \
                 questions and only drop its uniform groups; 3 = draw up to three batches)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// True when the rewards of a group are not all equal, i.e. some group baseline gives it a
/// non-zero advantage. An empty group is not informative; NaN rewards count as different.
pub fn is_informative(group: &[f64]) -> bool {
    match group.first() {
        Some(&first) => group.iter().any(|&r| !(r == first)),
        None => false,
    }
}

/// The state of one step's draw (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicDraw {
    enabled: bool,
    target: usize,
    max_drawn: usize,
    group_size: usize,
    drawn: usize,
    kept: usize,
    rounds: usize,
    reward_sum: f64,
    rewards_seen: usize,
    // Per round: which of its groups are kept.
    keep: Vec<Vec<bool>>,
}

impl DynamicDraw {
    /// A draw of `target` groups of `group_size` trajectories. Disabled: one round of `target`
    /// questions, every group kept.
    pub fn new(cfg: &DynamicSamplingConfig, target: usize, group_size: usize) -> DynamicDraw {
        DynamicDraw {
            enabled: cfg.enabled,
            target,
            max_drawn: target.saturating_mul(cfg.max_draw_factor.max(1)),
            group_size: group_size.max(1),
            drawn: 0,
            kept: 0,
            rounds: 0,
            reward_sum: 0.0,
            rewards_seen: 0,
            keep: Vec::new(),
        }
    }

    /// How many questions the next round draws, or `None` when the draw is over.
    pub fn next_round(&self) -> Option<usize> {
        if self.rounds == 0 {
            return (self.target > 0).then_some(self.target);
        }
        if !self.enabled || self.kept >= self.target || self.drawn >= self.max_drawn {
            return None;
        }
        Some((self.target - self.kept).min(self.max_drawn - self.drawn))
    }

    /// Records a round's rewards (`questions x group_size`, in group order) and returns which of
    /// its groups are kept.
    pub fn record(&mut self, rewards: &[f64]) -> Vec<bool> {
        let g = self.group_size;
        self.rounds += 1;
        self.drawn += rewards.len().div_ceil(g);
        self.reward_sum += rewards.iter().sum::<f64>();
        self.rewards_seen += rewards.len();
        let keep: Vec<bool> = rewards
            .chunks(g)
            .map(|grp| !self.enabled || is_informative(grp))
            .collect();
        self.kept += keep.iter().filter(|k| **k).count();
        self.keep.push(keep.clone());
        keep
    }

    /// The keep flags of every round, once the draw is over. When nothing informative was drawn,
    /// the last round is kept whole (a step always trains on, or at least logs, a batch).
    pub fn finish(&mut self) -> Vec<Vec<bool>> {
        if self.kept == 0
            && let Some(last) = self.keep.last_mut()
        {
            last.iter_mut().for_each(|k| *k = true);
            self.kept = last.len();
        }
        self.keep.clone()
    }

    /// `dynamic/drawn_questions`, `dynamic/rounds`, `dynamic/kept_groups`, `dynamic/dropped_groups`
    /// and `dynamic/drawn_reward_mean` (empty when disabled).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        if !self.enabled {
            return m;
        }
        let kept: usize = self.keep.iter().flatten().filter(|k| **k).count();
        m.insert("dynamic/drawn_questions".into(), self.drawn as f64);
        m.insert("dynamic/rounds".into(), self.rounds as f64);
        m.insert("dynamic/kept_groups".into(), kept as f64);
        m.insert(
            "dynamic/dropped_groups".into(),
            self.drawn.saturating_sub(kept) as f64,
        );
        m.insert(
            "dynamic/drawn_reward_mean".into(),
            self.reward_sum / self.rewards_seen.max(1) as f64,
        );
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(enabled: bool, factor: usize) -> DynamicSamplingConfig {
        DynamicSamplingConfig {
            enabled,
            max_draw_factor: factor,
        }
    }

    /// Runs a draw whose rounds return the given rewards (`g` per group) in turn.
    fn run(mut d: DynamicDraw, rounds: &[&[f64]]) -> (DynamicDraw, Vec<usize>, Vec<Vec<bool>>) {
        let mut asked = Vec::new();
        let mut it = rounds.iter();
        while let Some(n) = d.next_round() {
            asked.push(n);
            let r = it
                .next()
                .expect("the draw asked for more rounds than scripted");
            assert_eq!(
                r.len(),
                n * d.group_size,
                "scripted round of the wrong size"
            );
            d.record(r);
        }
        let keep = d.finish();
        (d, asked, keep)
    }

    #[test]
    fn informative_means_not_all_equal() {
        assert!(!is_informative(&[]));
        assert!(!is_informative(&[0.0, 0.0, 0.0]));
        assert!(!is_informative(&[1.5, 1.5]));
        assert!(is_informative(&[0.0, 1.0, 0.0]));
        assert!(is_informative(&[1.0, 1.0 + 1e-9]));
        assert!(is_informative(&[0.0, f64::NAN]));
    }

    #[test]
    fn disabled_is_one_round_with_every_group_kept() {
        let d = DynamicDraw::new(&cfg(false, 3), 2, 2);
        let (d, asked, keep) = run(d, &[&[0.0, 0.0, 1.0, 0.0]]);
        assert_eq!(asked, vec![2]);
        assert_eq!(keep, vec![vec![true, true]]);
        assert!(d.metrics().is_empty());
    }

    #[test]
    fn draws_the_missing_groups_until_the_batch_is_informative() {
        // target 3 groups of 2: round 1 has one informative group, round 2 (2 asked) one more,
        // round 3 (1 asked) the last.
        let d = DynamicDraw::new(&cfg(true, 3), 3, 2);
        let (d, asked, keep) = run(
            d,
            &[
                &[0.0, 0.0, 1.0, 0.0, 1.0, 1.0],
                &[0.0, 0.0, 0.0, 2.0],
                &[1.0, 0.0],
            ],
        );
        assert_eq!(asked, vec![3, 2, 1]);
        assert_eq!(
            keep,
            vec![vec![false, true, false], vec![false, true], vec![true]]
        );
        let m = d.metrics();
        assert_eq!(m["dynamic/drawn_questions"], 6.0);
        assert_eq!(m["dynamic/rounds"], 3.0);
        assert_eq!(m["dynamic/kept_groups"], 3.0);
        assert_eq!(m["dynamic/dropped_groups"], 3.0);
        assert!((m["dynamic/drawn_reward_mean"] - 6.0 / 12.0).abs() < 1e-12);
    }

    #[test]
    fn the_budget_bounds_the_number_of_questions_drawn() {
        // target 2 groups of 3, factor 2: at most 4 questions; only one informative group is
        // ever drawn, so the batch ends with 1 group.
        let d = DynamicDraw::new(&cfg(true, 2), 2, 3);
        let (d, asked, keep) = run(
            d,
            &[
                &[0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
                &[1.0, 1.0, 1.0],
                &[0.0, 0.0, 0.0],
            ],
        );
        assert_eq!(asked, vec![2, 1, 1]);
        assert_eq!(keep, vec![vec![true, false], vec![false], vec![false]]);
        assert_eq!(d.metrics()["dynamic/drawn_questions"], 4.0);
        assert_eq!(d.metrics()["dynamic/kept_groups"], 1.0);
    }

    #[test]
    fn nothing_informative_keeps_the_last_round_whole() {
        let d = DynamicDraw::new(&cfg(true, 2), 2, 2);
        let (d, asked, keep) = run(d, &[&[0.0; 4], &[1.0; 4]]);
        assert_eq!(asked, vec![2, 2]);
        assert_eq!(keep, vec![vec![false, false], vec![true, true]]);
        let m = d.metrics();
        assert_eq!(m["dynamic/kept_groups"], 2.0);
        assert_eq!(m["dynamic/dropped_groups"], 2.0);
        assert_eq!(m["dynamic/drawn_reward_mean"], 0.5);
    }

    #[test]
    fn factor_one_only_filters() {
        let d = DynamicDraw::new(&cfg(true, 1), 3, 2);
        let (_, asked, keep) = run(d, &[&[0.0, 1.0, 0.0, 0.0, 2.0, 2.0]]);
        assert_eq!(asked, vec![3]);
        assert_eq!(keep, vec![vec![true, false, false]]);
        assert!(cfg(true, 0).validate().is_err());
        assert!(cfg(true, 1).validate().is_ok());
    }
}
