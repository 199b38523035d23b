//! The policy loss: PPO-clip over per-action log-probabilities with an action mask, plus the KL
//! penalty to a frozen reference policy and an optional entropy bonus. This file is "the loss":
//! everything that turns log-probabilities and advantages into the scalar that is back-propagated.
//!
//! Shapes: every per-action tensor is `[batch, actions]` (batch = trajectories of the minibatch,
//! actions = the padded number of policy actions, i.e. generated tokens or chosen positions).
//! `mask` is 1.0 for real policy actions and 0.0 for padding and observation tokens, so masked
//! actions contribute neither to the loss nor to its gradient.

use burn::tensor::Tensor;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How per-action losses are reduced to one scalar.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LossAgg {
    /// Mean over all unmasked actions of the minibatch (DAPO / verl `token-mean`; the default of METHODS' "Joint GRPO").
    #[default]
    TokenMean,
    /// Mean over trajectories of the per-trajectory mean over its actions (original GRPO / verl
    /// `seq-mean-token-mean`).
    SeqMeanTokenMean,
    /// Sum over actions divided by a constant length `norm_len`, then mean over trajectories
    /// (Dr.GRPO / verl `seq-mean-token-sum-norm`): removes the length bias of per-sequence means.
    SeqMeanTokenSumNorm,
}

/// Estimator of KL(policy || reference) per action, from `log r = logp_ref - logp` (Schulman 2020,
/// "Approximating KL divergence").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum KlEstimator {
    /// k1 = -log r = logp - logp_ref (unbiased, high variance, can be negative).
    K1,
    /// k2 = (log r)^2 / 2 (biased, low variance).
    K2,
    /// k3 = (r - 1) - log r (unbiased, low variance, always >= 0; GRPO's choice). Clamped to
    /// [-10, 10] like verl's `low_var_kl` for numerical safety.
    #[default]
    K3,
}

/// Hyper-parameters of the advantage estimator and the policy loss (recipe section `algorithm:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct LossConfig {
    /// Group baseline: grpo | dr_grpo | rloo.
    pub advantage: crate::advantage::AdvantageEstimator,
    /// Use per-step reward-to-go advantages when the task provides dense per-action rewards
    /// (SAS); otherwise the trajectory reward is broadcast to every action.
    pub reward_to_go: bool,
    /// Lower PPO clip range epsilon: the ratio is clipped to `[1 - clip_eps, 1 + clip_eps_high]`
    /// (Schulman et al. 2017; METHODS' "Joint GRPO": 0.2).
    pub clip_eps: f64,
    /// Upper clip range epsilon (DAPO's "clip-higher" when larger than `clip_eps`). Default 0.2.
    pub clip_eps_high: f64,
    /// Reduction of per-action losses (token_mean | seq_mean_token_mean | seq_mean_token_sum_norm).
    pub loss_agg: LossAgg,
    /// Constant normaliser of `seq_mean_token_sum_norm`; 0 = the padded number of actions of the batch.
    pub norm_len: usize,
    /// KL penalty coefficient beta of `beta * KL(policy || reference)` as a loss term (GRPO; METHODS'
    /// "Joint GRPO" default 0.001). 0 disables the reference policy entirely (no reference forward passes).
    pub kl_beta: f64,
    /// KL estimator (k1 | k2 | k3).
    pub kl_estimator: KlEstimator,
    /// Entropy bonus coefficient (loss -= coef * entropy). Off (0) by default, as in METHODS' "Joint GRPO".
    pub entropy_coef: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            advantage: crate::advantage::AdvantageEstimator::Grpo,
            reward_to_go: false,
            clip_eps: 0.2,
            clip_eps_high: 0.2,
            loss_agg: LossAgg::TokenMean,
            norm_len: 0,
            kl_beta: 0.001,
            kl_estimator: KlEstimator::K3,
            entropy_coef: 0.0,
        }
    }
}

/// Inputs of one minibatch loss evaluation. All tensors are `[batch, actions]`.
pub struct LossInputs {
    /// Log-probabilities of the taken actions under the current parameters (differentiable).
    pub logp: Tensor<2>,
    /// Log-probabilities under the parameters that generated the rollout (constant).
    pub old_logp: Tensor<2>,
    /// Log-probabilities under the frozen reference policy (constant); `None` when `kl_beta == 0`.
    pub ref_logp: Option<Tensor<2>>,
    /// Advantage of each action (the trajectory advantage broadcast, or a per-step advantage).
    pub advantages: Tensor<2>,
    /// 1.0 for policy actions, 0.0 for padding / observation tokens.
    pub mask: Tensor<2>,
    /// Per-action entropy of the current policy (differentiable), if the task provides it.
    pub entropy: Option<Tensor<2>>,
}

/// The loss and its diagnostics for one minibatch.
pub struct LossOutput {
    /// Scalar loss to back-propagate (shape `[1]`).
    pub loss: Tensor<1>,
    /// Detached scalar diagnostics.
    pub stats: LossStats,
}

/// Scalar diagnostics of a loss evaluation (host values).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossStats {
    /// The aggregated PPO-clip term.
    pub policy_loss: f64,
    /// The aggregated KL estimate to the reference (before multiplying by beta); 0 without reference.
    pub kl_ref: f64,
    /// Share of actions where the clipped objective was active.
    pub clip_frac: f64,
    /// k3 estimate of KL(old || current) over the actions: how far the update moved the policy.
    pub approx_kl: f64,
    /// Mean per-action entropy (NaN when the task does not provide it).
    pub entropy: f64,
    /// Number of unmasked actions.
    pub n_actions: f64,
}

/// Reduce per-action values `[B, T]` with `mask` according to `agg`.
pub fn aggregate(values: Tensor<2>, mask: Tensor<2>, agg: LossAgg, norm_len: usize) -> Tensor<1> {
    let [b, t] = values.dims();
    let masked = values * mask.clone();
    match agg {
        LossAgg::TokenMean => {
            let denom = mask.sum().clamp_min(1.0);
            masked.sum() / denom
        }
        LossAgg::SeqMeanTokenMean => {
            let per_seq = masked.sum_dim(1) / mask.sum_dim(1).clamp_min(1.0); // [B, 1]
            per_seq.mean().reshape([1])
        }
        LossAgg::SeqMeanTokenSumNorm => {
            let norm = if norm_len == 0 { t } else { norm_len };
            masked.sum().div_scalar((b.max(1) * norm.max(1)) as f64)
        }
    }
}

/// Per-action KL estimate from `logp` (current, differentiable) and `ref_logp` (constant).
pub fn kl_per_action(logp: Tensor<2>, ref_logp: Tensor<2>, estimator: KlEstimator) -> Tensor<2> {
    let log_r = ref_logp - logp; // log(pi_ref / pi)
    match estimator {
        KlEstimator::K1 => log_r.neg(),
        KlEstimator::K2 => log_r.square().mul_scalar(0.5),
        KlEstimator::K3 => {
            let log_r = log_r.clamp(-20.0, 20.0);
            (log_r.clone().exp() - log_r)
                .sub_scalar(1.0)
                .clamp(-10.0, 10.0)
        }
    }
}

fn scalar(t: Tensor<1>) -> f64 {
    t.into_scalar::<f32>() as f64
}

/// The PPO-clip policy loss with KL and entropy terms.
///
/// `loss = agg(max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)))
///        + beta * agg(KL_est(pi || pi_ref)) - entropy_coef * agg(entropy)`
/// with `ratio = exp(logp - old_logp)`.
pub fn policy_loss(inputs: LossInputs, cfg: &LossConfig) -> LossOutput {
    let LossInputs {
        logp,
        old_logp,
        ref_logp,
        advantages,
        mask,
        entropy,
    } = inputs;
    let agg = |v: Tensor<2>| aggregate(v, mask.clone(), cfg.loss_agg, cfg.norm_len);

    let log_ratio = (logp.clone() - old_logp).clamp(-20.0, 20.0);
    let ratio = log_ratio.clone().exp();
    let pg1 = advantages.clone().neg() * ratio.clone();
    let pg2 = advantages.neg()
        * ratio
            .clone()
            .clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high);
    let clipped_active = pg2.clone().greater(pg1.clone()).float();
    let pg = pg1.max_pair(pg2);
    let policy = agg(pg);

    let n_actions = scalar(mask.clone().sum());
    let denom = n_actions.max(1.0);
    let clip_frac = scalar((clipped_active * mask.clone()).sum().detach()) / denom;
    let lr_d = log_ratio.detach();
    let approx_kl = scalar(
        (lr_d.clone().exp().sub_scalar(1.0) - lr_d)
            .mul(mask.clone())
            .sum(),
    ) / denom;

    let mut loss = policy.clone();
    let mut kl_ref = 0.0;
    if let Some(ref_logp) = ref_logp
        && cfg.kl_beta != 0.0
    {
        let kl = agg(kl_per_action(logp, ref_logp, cfg.kl_estimator));
        kl_ref = scalar(kl.clone().detach());
        loss = loss + kl.mul_scalar(cfg.kl_beta);
    }
    let mut entropy_mean = f64::NAN;
    if let Some(ent) = entropy {
        let e = agg(ent);
        entropy_mean = scalar(e.clone().detach());
        if cfg.entropy_coef != 0.0 {
            loss = loss - e.mul_scalar(cfg.entropy_coef);
        }
    }
    let policy_loss = scalar(policy.detach());
    LossOutput {
        loss,
        stats: LossStats {
            policy_loss,
            kl_ref,
            clip_frac,
            approx_kl,
            entropy: entropy_mean,
            n_actions,
        },
    }
}
