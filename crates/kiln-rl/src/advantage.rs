//! Group-relative advantage estimators.
//!
//! A rollout batch holds `n_groups * group_size` trajectories; trajectories `g*G .. (g+1)*G` answer the
//! same prompt. Each estimator turns the scalar rewards of one group into one advantage per trajectory,
//! which the loss broadcasts over every action (token / position) of the trajectory.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Which group baseline turns rewards into advantages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// GRPO (Shao et al. 2024, DeepSeekMath): `(r - mean(group)) / (std(group) + eps)`, with the unbiased
    /// (n-1) standard deviation as `torch.std` computes it.
    #[default]
    Grpo,
    /// Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): `r - mean(group)`, no std
    /// normalisation (pair it with `loss_agg: seq_mean_token_sum_norm`).
    DrGrpo,
    /// RLOO (Ahmadian et al. 2024): leave-one-out baseline `r_i - mean_{j != i} r_j`.
    Rloo,
}

/// Epsilon added to the group standard deviation (METHODS, Search-R2 "Joint GRPO": `group std + 1e-6`).
pub const STD_EPS: f64 = 1e-6;

/// Advantages of one group of rewards.
///
/// Groups of size 1 get advantage 0 (no baseline can be formed). Non-finite rewards propagate as NaN
/// so the trainer's non-finite guard sees them instead of silently training on garbage.
pub fn group_advantages(rewards: &[f64], estimator: AdvantageEstimator) -> Vec<f64> {
    let n = rewards.len();
    if n <= 1 {
        return vec![0.0; n];
    }
    let nf = n as f64;
    let mean = rewards.iter().sum::<f64>() / nf;
    match estimator {
        AdvantageEstimator::Grpo => {
            let var = rewards.iter().map(|r| (r - mean) * (r - mean)).sum::<f64>() / (nf - 1.0);
            let std = var.sqrt();
            rewards
                .iter()
                .map(|r| (r - mean) / (std + STD_EPS))
                .collect()
        }
        AdvantageEstimator::DrGrpo => rewards.iter().map(|r| r - mean).collect(),
        AdvantageEstimator::Rloo => {
            let total: f64 = rewards.iter().sum();
            rewards
                .iter()
                .map(|r| r - (total - r) / (nf - 1.0))
                .collect()
        }
    }
}

/// Advantages for a whole batch laid out group after group (`rewards.len()` must be a multiple of
/// `group_size`; the trainer checks this before calling).
pub fn batch_advantages(
    rewards: &[f64],
    group_size: usize,
    estimator: AdvantageEstimator,
) -> Vec<f64> {
    let group_size = group_size.max(1);
    rewards
        .chunks(group_size)
        .flat_map(|g| group_advantages(g, estimator))
        .collect()
}

/// Per-step advantages from dense per-action rewards (the "reward-to-go" variant).
///
/// `step_rewards[i]` holds the rewards of trajectory `i`, one per action. The return-to-go
/// `G_{i,t} = sum_{s >= t} r_{i,s}` is normalised across the group at each step `t` with the chosen
/// estimator, over the trajectories of the group that have a step `t`. Returns one advantage per action.
pub fn batch_reward_to_go_advantages(
    step_rewards: &[Vec<f64>],
    group_size: usize,
    estimator: AdvantageEstimator,
) -> Vec<Vec<f64>> {
    let group_size = group_size.max(1);
    let rtg: Vec<Vec<f64>> = step_rewards
        .iter()
        .map(|rs| {
            let mut acc = 0.0;
            let mut out = vec![0.0; rs.len()];
            for t in (0..rs.len()).rev() {
                acc += rs[t];
                out[t] = acc;
            }
            out
        })
        .collect();
    let mut out: Vec<Vec<f64>> = rtg.iter().map(|r| vec![0.0; r.len()]).collect();
    for g0 in (0..rtg.len()).step_by(group_size) {
        let g1 = (g0 + group_size).min(rtg.len());
        let max_len = rtg[g0..g1].iter().map(Vec::len).max().unwrap_or(0);
        for t in 0..max_len {
            let members: Vec<usize> = (g0..g1).filter(|&i| t < rtg[i].len()).collect();
            let vals: Vec<f64> = members.iter().map(|&i| rtg[i][t]).collect();
            let adv = group_advantages(&vals, estimator);
            for (k, &i) in members.iter().enumerate() {
                out[i][t] = adv[k];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn grpo_matches_torch_std_reference() {
        // torch.tensor([1.,0.,0.,1.,1.]).std() == 0.5477225575051661 (unbiased).
        let r = [1.0, 0.0, 0.0, 1.0, 1.0];
        let a = group_advantages(&r, AdvantageEstimator::Grpo);
        let std = 0.547_722_557_505_166_1;
        let mean = 0.6;
        for (ai, ri) in a.iter().zip(r) {
            assert!(close(*ai, (ri - mean) / (std + STD_EPS)), "{ai}");
        }
        assert!(a.iter().sum::<f64>().abs() < 1e-9);
    }

    #[test]
    fn constant_group_has_zero_advantage() {
        for est in [
            AdvantageEstimator::Grpo,
            AdvantageEstimator::DrGrpo,
            AdvantageEstimator::Rloo,
        ] {
            let a = group_advantages(&[0.7; 4], est);
            assert!(a.iter().all(|x| x.abs() < 1e-12), "{est:?} {a:?}");
        }
    }

    #[test]
    fn dr_grpo_and_rloo_closed_form() {
        let r = [3.0, 1.0, 2.0, 6.0];
        let d = group_advantages(&r, AdvantageEstimator::DrGrpo);
        assert_eq!(d, vec![0.0, -2.0, -1.0, 3.0]);
        let l = group_advantages(&r, AdvantageEstimator::Rloo);
        // r_i - mean of the other three
        let expect = [3.0 - 3.0, 1.0 - 11.0 / 3.0, 2.0 - 10.0 / 3.0, 6.0 - 2.0];
        for (x, y) in l.iter().zip(expect) {
            assert!(close(*x, y));
        }
        // RLOO = G/(G-1) * Dr.GRPO
        for (x, y) in l.iter().zip(&d) {
            assert!(close(*x, y * 4.0 / 3.0));
        }
    }

    #[test]
    fn singleton_groups_and_batches() {
        assert_eq!(
            group_advantages(&[5.0], AdvantageEstimator::Grpo),
            vec![0.0]
        );
        let b = batch_advantages(&[1.0, 0.0, 2.0, 2.0], 2, AdvantageEstimator::DrGrpo);
        assert_eq!(b, vec![0.5, -0.5, 0.0, 0.0]);
    }

    #[test]
    fn reward_to_go_is_normalised_per_step() {
        let sr = vec![vec![1.0, 0.0, 1.0], vec![0.0, 0.0, 0.0]];
        let a = batch_reward_to_go_advantages(&sr, 2, AdvantageEstimator::DrGrpo);
        // RTG: [2,1,1] and [0,0,0]; group means per step: [1, .5, .5]
        assert_eq!(a[0], vec![1.0, 0.5, 0.5]);
        assert_eq!(a[1], vec![-1.0, -0.5, -0.5]);
    }

    #[test]
    fn nan_reward_propagates() {
        let a = group_advantages(&[1.0, f64::NAN], AdvantageEstimator::Grpo);
        assert!(a.iter().all(|x| x.is_nan()));
    }
}
