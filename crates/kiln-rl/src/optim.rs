//! Optimiser, learning-rate schedule and global gradient-norm clipping.
//!
//! AdamW comes from burn (`burn::optim::AdamWConfig`). Gradient clipping is global over all
//! parameters (like `torch.nn.utils.clip_grad_norm_`), which burn's per-tensor clipping is not, so it
//! is done here before the optimiser step. The same pass computes the gradient norm that the
//! non-finite guard inspects.

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::Tensor;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Learning-rate decay after warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LrSchedule {
    /// Constant after warm-up (verl / Search-R1 default).
    #[default]
    Constant,
    /// Half-cosine decay from `lr` to `lr * min_lr_ratio` over the remaining steps.
    Cosine,
}

/// Optimiser hyper-parameters (recipe section `optim:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct OptimConfig {
    /// Peak learning rate of AdamW (Loshchilov & Hutter 2019). Search-R2 paper scale: 1e-6.
    pub lr: f64,
    /// AdamW beta1.
    pub beta1: f64,
    /// AdamW beta2.
    pub beta2: f64,
    /// AdamW epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clipping threshold; 0 disables clipping (the norm is still logged).
    pub max_grad_norm: f64,
    /// Share of the training steps spent in linear warm-up from 0 (Search-R2: 0.285).
    pub warmup_ratio: f64,
    /// Decay after warm-up: constant | cosine.
    pub schedule: LrSchedule,
    /// Final learning rate of the cosine schedule as a fraction of `lr`.
    pub min_lr_ratio: f64,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 1e-6,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: 1.0,
            warmup_ratio: 0.0,
            schedule: LrSchedule::Constant,
            min_lr_ratio: 0.0,
        }
    }
}

impl OptimConfig {
    /// Learning rate at training step `step` (0-based) of `total` steps.
    ///
    /// Warm-up is linear over `ceil(warmup_ratio * total)` steps, reaching the peak at the last
    /// warm-up step: `lr * (step + 1) / warmup_steps` (no step is wasted at lr = 0).
    pub fn lr_at(&self, step: u64, total: u64) -> f64 {
        let total = total.max(1);
        let warm = (self.warmup_ratio * total as f64).ceil() as u64;
        if step < warm {
            return self.lr * (step + 1) as f64 / warm as f64;
        }
        match self.schedule {
            LrSchedule::Constant => self.lr,
            LrSchedule::Cosine => {
                let span = total.saturating_sub(warm + 1).max(1) as f64;
                let progress = ((step - warm) as f64 / span).clamp(0.0, 1.0);
                let min = self.lr * self.min_lr_ratio;
                min + (self.lr - min) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    /// Build the burn AdamW optimiser.
    pub fn build(&self) -> ModuleOptimizer {
        AdamWConfig::new()
            .with_beta_1(self.beta1 as f32)
            .with_beta_2(self.beta2 as f32)
            .with_epsilon(self.eps as f32)
            .with_weight_decay(self.weight_decay as f32)
            .init()
    }
}

struct ParamIds(Vec<(ParamId, usize)>);

impl ModuleVisitor for ParamIds {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push((param.id, D));
    }
}

fn ids_of<M: Module>(module: &M) -> Vec<(ParamId, usize)> {
    let mut v = ParamIds(Vec::new());
    module.visit(&mut v);
    v.0
}

fn sq_norm<const D: usize>(grads: &GradientsParams, id: ParamId) -> Option<Tensor<1>> {
    grads.get::<D>(id).map(|g| g.square().sum())
}

fn scale<const D: usize>(grads: &mut GradientsParams, id: ParamId, factor: f64) {
    if let Some(g) = grads.remove::<D>(id) {
        grads.register::<D>(id, g.mul_scalar(factor));
    }
}

macro_rules! by_rank {
    ($rank:expr, $f:ident, $($arg:expr),*) => {
        match $rank {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            4 => $f::<4>($($arg),*),
            5 => $f::<5>($($arg),*),
            _ => $f::<6>($($arg),*),
        }
    };
}

/// Global L2 norm of all gradients of `module` (non-finite if any gradient is).
pub fn global_grad_norm<M: Module>(module: &M, grads: &GradientsParams) -> f64 {
    let mut total: Option<Tensor<1>> = None;
    for (id, rank) in ids_of(module) {
        if let Some(s) = by_rank!(rank, sq_norm, grads, id) {
            total = Some(match total {
                Some(t) => t + s,
                None => s,
            });
        }
    }
    match total {
        Some(t) => (t.into_scalar::<f32>() as f64).sqrt(),
        None => 0.0,
    }
}

/// Scale all gradients so their global norm is at most `max_norm`; returns the norm before clipping.
/// `max_norm <= 0` only measures.
pub fn clip_grad_norm<M: Module>(module: &M, grads: &mut GradientsParams, max_norm: f64) -> f64 {
    let norm = global_grad_norm(module, grads);
    if max_norm > 0.0 && norm.is_finite() && norm > max_norm {
        let factor = max_norm / (norm + 1e-6);
        for (id, rank) in ids_of(module) {
            by_rank!(rank, scale, grads, id, factor);
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_constant() {
        let c = OptimConfig {
            lr: 1.0,
            warmup_ratio: 0.25,
            ..Default::default()
        };
        let lrs: Vec<f64> = (0..8).map(|s| c.lr_at(s, 8)).collect();
        assert_eq!(lrs, vec![0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn cosine_reaches_min() {
        let c = OptimConfig {
            lr: 2.0,
            schedule: LrSchedule::Cosine,
            min_lr_ratio: 0.1,
            ..Default::default()
        };
        assert!((c.lr_at(0, 11) - 2.0).abs() < 1e-12);
        assert!((c.lr_at(5, 11) - (0.2 + 1.8 * 0.5)).abs() < 1e-12);
        assert!((c.lr_at(10, 11) - 0.2).abs() < 1e-12);
        // monotone non-increasing
        let v: Vec<f64> = (0..11).map(|s| c.lr_at(s, 11)).collect();
        assert!(v.windows(2).all(|w| w[1] <= w[0] + 1e-15));
    }
}
