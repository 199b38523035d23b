//! The order policy v_phi(i | state) of SAS (METHODS.md section 2): a small MLP over per-position
//! features computed from the frozen denoiser's outputs, giving one logit per position; positions
//! that may not be chosen (givens, revealed cells, cells outside the current block) are masked out
//! before the softmax, so their probability is exactly 0.
//!
//! Features of position `i` ([`N_BASE_FEATURES`] + 3 x side one-hots):
//! top-1 probability, top1 - top2 margin, entropy / ln(side), log top-1 probability / 10,
//! top-1 and margin relative to the best allowed position, a masked flag, the revealed
//! fraction of the board, and one-hot row, column and box.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::sudoku::Shape;

/// Number of non-positional features per position.
pub const N_BASE_FEATURES: usize = 8;
/// Logit given to positions that may not be chosen (finite so that `0 * logit` stays 0).
pub const MASKED_LOGIT: f32 = -1.0e9;

/// Number of features per position for boards of `shape`.
pub fn n_features(shape: Shape) -> usize {
    N_BASE_FEATURES + 3 * shape.side()
}

/// Order-policy hyper-parameters (recipe section `policy:`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct PolicyConfig {
    /// Width of the two hidden layers of the MLP.
    pub hidden: usize,
    /// Initial weight of the linear skip path on the top-1 probability feature. 0 starts from a
    /// (near) uniform random order; a positive value starts near the confidence schedule, which
    /// GRPO then improves (the policy stays free to move away from it).
    pub init_confidence_weight: f64,
    /// Sampling temperature of rollouts (the re-scoring pass uses the same temperature).
    pub temperature: f64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            hidden: 64,
            init_confidence_weight: 0.0,
            temperature: 1.0,
        }
    }
}

/// The order policy: `logit(i) = out(relu(l2(relu(l1(f_i))))) + skip(f_i)`.
#[derive(Module, Debug)]
pub struct OrderPolicy {
    /// First hidden layer `[F, hidden]`.
    pub l1: Linear,
    /// Second hidden layer `[hidden, hidden]`.
    pub l2: Linear,
    /// Output layer `[hidden, 1]`.
    pub out: Linear,
    /// Linear skip path `[F, 1]`.
    pub skip: Linear,
}

impl OrderPolicy {
    /// A fresh policy for boards of `shape` (seed the device for reproducibility).
    pub fn init(cfg: &PolicyConfig, shape: Shape, device: &Device) -> OrderPolicy {
        let f = n_features(shape);
        let h = cfg.hidden.max(1);
        let mut skip = LinearConfig::new(f, 1).init(device);
        // Start the skip path at zero except the confidence weight.
        let mut w = vec![0f32; f];
        w[0] = cfg.init_confidence_weight as f32;
        skip.weight = Param::from_tensor(Tensor::from_data(TensorData::new(w, [f, 1]), device));
        skip.bias = Some(Param::from_tensor(Tensor::zeros([1], device)));
        let mut out = LinearConfig::new(h, 1).init(device);
        // Small output layer: the initial policy is dominated by the skip path.
        out.weight = Param::from_tensor(out.weight.val().mul_scalar(0.1).detach());
        OrderPolicy {
            l1: LinearConfig::new(f, h).init(device),
            l2: LinearConfig::new(h, h).init(device),
            out,
            skip,
        }
    }

    /// features `[N, P, F]` -> logits `[N, P]` (unmasked).
    pub fn forward(&self, features: Tensor<3>) -> Tensor<2> {
        let [n, p, _] = features.dims();
        let h = relu(self.l1.forward(features.clone()));
        let h = relu(self.l2.forward(h));
        let y = self.out.forward(h) + self.skip.forward(features);
        y.reshape([n, p])
    }

    /// Masked log-probabilities `[N, P]` over positions: `allowed` `[N, P]` true where a position
    /// may be chosen; other positions get log-probability ~ -1e9 (probability 0).
    pub fn log_probs(
        &self,
        features: Tensor<3>,
        allowed: Tensor<2, Bool>,
        temperature: f64,
    ) -> Tensor<2> {
        let logits = self.forward(features).div_scalar(temperature);
        log_softmax(logits.mask_fill(allowed.bool_not(), MASKED_LOGIT), 1)
    }

    /// The device of the weights.
    pub fn device(&self) -> Device {
        self.l1.weight.val().device()
    }
}

/// Host-side feature builder for boards of one shape (precomputes the positional one-hots).
#[derive(Debug, Clone)]
pub struct Features {
    shape: Shape,
    positional: Vec<f32>,
}

impl Features {
    /// For boards of `shape`.
    pub fn new(shape: Shape) -> Features {
        let side = shape.side();
        let b = shape.box_size();
        let n = shape.n_cells();
        let mut positional = vec![0f32; n * 3 * side];
        for i in 0..n {
            let (r, c) = (i / side, i % side);
            let bx = (r / b) * b + c / b;
            let row = &mut positional[i * 3 * side..(i + 1) * 3 * side];
            row[r] = 1.0;
            row[side + c] = 1.0;
            row[2 * side + bx] = 1.0;
        }
        Features { shape, positional }
    }

    /// Features per position.
    pub fn dim(&self) -> usize {
        n_features(self.shape)
    }

    /// Append the features `[n, F]` of one board to `out`: `lp` are the digit log-probabilities
    /// `[n, side]`, `masked[i]` whether cell `i` is still masked, `allowed[i]` whether it may be
    /// chosen now.
    pub fn push_board(&self, lp: &[f32], masked: &[bool], allowed: &[bool], out: &mut Vec<f32>) {
        let side = self.shape.side();
        let n = self.shape.n_cells();
        let ln_side = (side as f32).ln();
        let revealed = masked.iter().filter(|m| !**m).count() as f32 / n as f32;
        let mut stats = Vec::with_capacity(n);
        let (mut best_top, mut best_margin) = (0f32, 0f32);
        for i in 0..n {
            let s = cell_stats(&lp[i * side..(i + 1) * side]);
            if allowed[i] {
                best_top = best_top.max(s.top1);
                best_margin = best_margin.max(s.margin);
            }
            stats.push(s);
        }
        for (i, s) in stats.iter().enumerate() {
            if masked[i] {
                out.extend_from_slice(&[
                    s.top1,
                    s.margin,
                    s.entropy / ln_side,
                    s.log_top1.max(-10.0) / 10.0,
                    s.top1 - best_top,
                    s.margin - best_margin,
                    1.0,
                    revealed,
                ]);
            } else {
                out.extend_from_slice(&[0.0, 0.0, 0.0, 0.0, -1.0, -1.0, 0.0, revealed]);
            }
            out.extend_from_slice(&self.positional[i * 3 * side..(i + 1) * 3 * side]);
        }
    }
}

/// Confidence statistics of one cell's digit distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CellStats {
    /// Highest probability.
    pub top1: f32,
    /// Highest minus second-highest probability.
    pub margin: f32,
    /// Entropy in nats.
    pub entropy: f32,
    /// Log of the highest probability.
    pub log_top1: f32,
    /// Index (digit - 1) of the most likely digit.
    pub argmax: usize,
}

/// [`CellStats`] of a log-probability vector.
pub fn cell_stats(lp: &[f32]) -> CellStats {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    let mut arg = 0;
    let mut entropy = 0f32;
    for (k, &l) in lp.iter().enumerate() {
        if l > a {
            b = a;
            a = l;
            arg = k;
        } else if l > b {
            b = l;
        }
        let p = l.exp();
        if p > 0.0 {
            entropy -= p * l;
        }
    }
    let top1 = a.exp();
    let top2 = if b.is_finite() { b.exp() } else { 0.0 };
    CellStats {
        top1,
        margin: top1 - top2,
        entropy,
        log_top1: a,
        argmax: arg,
    }
}

/// Cells a step may choose: masked cells, restricted to the current block when `block_len > 0`
/// (the first block, in cell order, that still holds a masked cell).
pub fn allowed_cells(masked: &[bool], block_len: usize) -> Vec<bool> {
    if block_len == 0 {
        return masked.to_vec();
    }
    let first = masked.iter().position(|m| *m);
    let mut out = vec![false; masked.len()];
    if let Some(f) = first {
        let start = f / block_len * block_len;
        let end = (start + block_len).min(masked.len());
        out[start..end].copy_from_slice(&masked[start..end]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cell_stats_of_a_distribution() {
        let lp: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|p| p.ln()).collect();
        let s = cell_stats(&lp);
        assert!((s.top1 - 0.5).abs() < 1e-6);
        assert!((s.margin - 0.2).abs() < 1e-6);
        let h = -(0.5f32 * 0.5f32.ln() + 0.3 * 0.3f32.ln() + 0.2 * 0.2f32.ln());
        assert!((s.entropy - h).abs() < 1e-5);
        assert_eq!(s.argmax, 0);
    }

    #[test]
    fn initialises_on_an_autodiff_device() {
        let device = Device::flex().autodiff();
        let pol = OrderPolicy::init(&PolicyConfig::default(), Shape::NINE, &device);
        let f = Tensor::<3>::ones([2, 81, n_features(Shape::NINE)], &device);
        let loss = pol.forward(f).sum();
        let grads = loss.backward();
        assert!(pol.l1.weight.grad(&grads).is_some());
        assert!(pol.skip.weight.grad(&grads).is_some());
    }

    #[test]
    fn blocks_restrict_to_the_first_unfinished_block() {
        let mut masked = vec![false; 12];
        masked[5] = true;
        masked[7] = true;
        masked[9] = true;
        let a = allowed_cells(&masked, 4);
        assert_eq!(a.iter().filter(|x| **x).count(), 2);
        assert!(a[5] && a[7] && !a[9]);
        assert_eq!(allowed_cells(&masked, 0), masked);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// The policy never gives probability to a given, revealed or out-of-block position,
        /// whatever its weights and inputs.
        #[test]
        fn masked_positions_have_zero_probability(
            seed in 0u64..1000,
            masked_bits in proptest::collection::vec(any::<bool>(), 81),
            block in prop_oneof![Just(0usize), Just(9), Just(27)],
            scale in 0.1f64..50.0,
        ) {
            prop_assume!(masked_bits.iter().any(|m| *m));
            let device = Device::flex();
            device.seed(seed);
            let cfg = PolicyConfig { hidden: 16, init_confidence_weight: scale, temperature: 1.0 };
            let pol = OrderPolicy::init(&cfg, Shape::NINE, &device);
            let fb = Features::new(Shape::NINE);
            // Random-ish digit distributions.
            let lp: Vec<f32> = (0..81 * 9)
                .map(|k| -(((k as u64 * 2654435761 + seed) % 1000) as f32) / 100.0)
                .collect();
            let allowed = allowed_cells(&masked_bits, block);
            let mut feats = Vec::new();
            fb.push_board(&lp, &masked_bits, &allowed, &mut feats);
            let f = Tensor::<3>::from_data(TensorData::new(feats, [1, 81, fb.dim()]), &device);
            let a = Tensor::<2, Bool>::from_data(TensorData::new(allowed.clone(), [1, 81]), &device);
            let logp: Vec<f32> = pol.log_probs(f, a, 1.0).into_data().convert::<f32>().try_into_vec().unwrap();
            let total: f32 = logp.iter().map(|l| l.exp()).sum();
            prop_assert!((total - 1.0).abs() < 1e-4);
            for i in 0..81 {
                if !allowed[i] {
                    prop_assert!(logp[i].exp() == 0.0, "position {} has probability {}", i, logp[i].exp());
                }
            }
        }
    }
}
