//! The order policy v_phi(i | state) of SAS (METHODS, SAS "Order policy and training"): a small MLP over per-position
//! features computed from the frozen denoiser's outputs, giving one logit per position; positions
//! that may not be chosen (givens, revealed cells, cells outside the current block) are masked out
//! before the softmax, so their probability is exactly 0.
//!
//! Features of position `i` ([`N_BASE_FEATURES`] + 3 x side one-hots):
//! - from the denoiser's digit distribution: top-1 probability, top1 - top2 margin,
//!   entropy / ln(side), log top-1 probability / 10, top-1 and margin relative to the best
//!   allowed position;
//! - a masked flag and the revealed fraction of the board;
//! - Sudoku-constraint features of the current board (givens + revealed digits), which the
//!   denoiser-only heuristics do not see ([`PolicyConfig::constraint_features`]; zeros when
//!   off): number of candidate digits consistent with the revealed cells / side, a naked-single
//!   flag, whether the denoiser's top digit is a legal candidate, whether the cell is forced
//!   (naked or hidden single), whether the forced digit is the denoiser's top digit, and the
//!   probability mass the denoiser puts on legal digits;
//! - one-hot row, column and box.

use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::activation::{log_softmax, relu};
use burn::tensor::{Bool, Device, Tensor, TensorData};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::sudoku::Shape;

/// Number of non-positional features per position.
pub const N_BASE_FEATURES: usize = 14;
/// Index of the top-1 probability feature.
pub const F_TOP1: usize = 0;
/// Index of the top1 - top2 margin feature.
pub const F_MARGIN: usize = 1;
/// Index of the first Sudoku-constraint feature (six of them).
pub const F_CONSTRAINTS: usize = 8;
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
    /// Initial weight of the linear skip path on the top1 - top2 margin feature (a positive
    /// value starts near the margin schedule).
    pub init_margin_weight: f64,
    /// Feed the Sudoku-constraint features (candidate count, naked/hidden single, legality of
    /// the denoiser's top digit, legal probability mass); false = denoiser-confidence and
    /// positional features only (the constraint columns are zeros).
    pub constraint_features: bool,
    /// Sampling temperature of rollouts (the re-scoring pass uses the same temperature).
    pub temperature: f64,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        Self {
            hidden: 64,
            init_confidence_weight: 0.0,
            init_margin_weight: 0.0,
            constraint_features: true,
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
    /// Whether the Sudoku-constraint feature columns are filled (see [`Features`]).
    #[module(skip)]
    pub constraint_features: bool,
}

impl OrderPolicy {
    /// A fresh policy for boards of `shape` (seed the device for reproducibility).
    pub fn init(cfg: &PolicyConfig, shape: Shape, device: &Device) -> OrderPolicy {
        let f = n_features(shape);
        let h = cfg.hidden.max(1);
        let mut skip = LinearConfig::new(f, 1).init(device);
        // Start the skip path at zero except the confidence weight.
        let mut w = vec![0f32; f];
        w[F_TOP1] = cfg.init_confidence_weight as f32;
        w[F_MARGIN] = cfg.init_margin_weight as f32;
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
            constraint_features: cfg.constraint_features,
        }
    }

    /// The feature builder this policy expects for boards of `shape`.
    pub fn features(&self, shape: Shape) -> Features {
        Features::with_constraints(shape, self.constraint_features)
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
    constraints: bool,
}

impl Features {
    /// For boards of `shape`, with the Sudoku-constraint features.
    pub fn new(shape: Shape) -> Features {
        Features::with_constraints(shape, true)
    }

    /// For boards of `shape`; `constraints` = false leaves the constraint columns at zero.
    pub fn with_constraints(shape: Shape, constraints: bool) -> Features {
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
        Features {
            shape,
            positional,
            constraints,
        }
    }

    /// Features per position.
    pub fn dim(&self) -> usize {
        n_features(self.shape)
    }

    /// Append the features `[n, F]` of one board to `out`: `lp` are the digit log-probabilities
    /// `[n, side]`, `cells[i]` the board (0 = still masked, else the given or revealed digit),
    /// `allowed[i]` whether cell `i` may be chosen now.
    pub fn push_board(&self, lp: &[f32], cells: &[u8], allowed: &[bool], out: &mut Vec<f32>) {
        let side = self.shape.side();
        let n = self.shape.n_cells();
        let ln_side = (side as f32).ln();
        let revealed = cells.iter().filter(|c| **c != 0).count() as f32 / n as f32;
        let cons = if self.constraints {
            Some(Constraints::of(self.shape, cells))
        } else {
            None
        };
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
            if cells[i] == 0 {
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
                match &cons {
                    Some(c) => {
                        let cand = c.cand[i];
                        let n_cand = cand.count_ones();
                        let top = 1u16 << (s.argmax + 1);
                        let forced = c.forced[i];
                        let legal_mass: f32 = (1..=side)
                            .filter(|d| cand & (1 << d) != 0)
                            .map(|d| lp[i * side + d - 1].exp())
                            .sum();
                        out.extend_from_slice(&[
                            n_cand as f32 / side as f32,
                            (n_cand == 1) as u8 as f32,
                            (cand & top != 0) as u8 as f32,
                            (forced != 0) as u8 as f32,
                            (forced & top != 0) as u8 as f32,
                            legal_mass,
                        ]);
                    }
                    None => out.extend_from_slice(&[0.0; 6]),
                }
            } else {
                out.extend_from_slice(&[0.0, 0.0, 0.0, 0.0, -1.0, -1.0, 0.0, revealed]);
                out.extend_from_slice(&[0.0; 6]);
            }
            out.extend_from_slice(&self.positional[i * 3 * side..(i + 1) * 3 * side]);
        }
    }
}

/// Candidate digits of every cell of a partially filled board (bit `d` set = digit `d` is not
/// yet used in the cell's row, column or box) and the digits that are forced there (naked
/// single: the only candidate; hidden single: the only cell of a row, column or box that can
/// take the digit). Filled cells have no candidates.
#[derive(Debug, Clone, PartialEq)]
pub struct Constraints {
    /// Candidate bitmask per cell (bit `d` for digit `d`, 1-based).
    pub cand: Vec<u16>,
    /// Forced-digit bitmask per cell (a subset of `cand`).
    pub forced: Vec<u16>,
}

impl Constraints {
    /// Candidates and forced digits of `cells` (0 = empty).
    pub fn of(shape: Shape, cells: &[u8]) -> Constraints {
        let side = shape.side();
        let b = shape.box_size();
        let n = shape.n_cells();
        let unit = |i: usize| {
            let (r, c) = (i / side, i % side);
            [r, side + c, 2 * side + (r / b) * b + c / b]
        };
        let mut used = vec![0u16; 3 * side];
        for (i, &v) in cells.iter().enumerate() {
            if v != 0 {
                for u in unit(i) {
                    used[u] |= 1 << v;
                }
            }
        }
        let full: u16 = ((1u32 << (side + 1)) - 2) as u16;
        let cand: Vec<u16> = (0..n)
            .map(|i| {
                if cells[i] != 0 {
                    0
                } else {
                    let [a, bb, c] = unit(i);
                    full & !(used[a] | used[bb] | used[c])
                }
            })
            .collect();
        // Cells of each unit that can take each digit.
        let mut count = vec![0u8; 3 * side * (side + 1)];
        for (i, &cm) in cand.iter().enumerate() {
            for d in 1..=side {
                if cm & (1 << d) != 0 {
                    for u in unit(i) {
                        count[u * (side + 1) + d] += 1;
                    }
                }
            }
        }
        let forced = (0..n)
            .map(|i| {
                let cm = cand[i];
                if cm == 0 {
                    return 0;
                }
                if cm.count_ones() == 1 {
                    return cm;
                }
                let mut f = 0u16;
                for d in 1..=side {
                    if cm & (1 << d) != 0 && unit(i).iter().any(|&u| count[u * (side + 1) + d] == 1)
                    {
                        f |= 1 << d;
                    }
                }
                f
            })
            .collect();
        Constraints { cand, forced }
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

    /// On a board whose filled cells agree with the solution, every cell's candidates contain
    /// its solution digit and a forced digit is always the solution digit; a board with one
    /// blank has a naked single there; the expert's singles are forced.
    #[test]
    fn constraints_are_sound_on_consistent_boards() {
        use crate::sudoku::{GenParams, generate};
        let ps = generate(&GenParams::new(4, 30, 17)).unwrap();
        let mut n_forced = 0;
        for p in &ps {
            let sol = p.solution.cells();
            let mut cells = p.puzzle.cells().to_vec();
            let fills = p.expert_order().unwrap().fills;
            for f in &fills {
                let i = f.cell;
                let c = Constraints::of(Shape::NINE, &cells);
                for j in 0..81 {
                    if cells[j] == 0 {
                        assert!(
                            c.cand[j] & (1 << sol[j]) != 0,
                            "solution digit not a candidate"
                        );
                        assert!(c.forced[j] == 0 || c.forced[j] == 1 << sol[j]);
                        n_forced += (c.forced[j] != 0) as usize;
                    } else {
                        assert_eq!((c.cand[j], c.forced[j]), (0, 0));
                    }
                }
                if f.technique != crate::sudoku::Technique::Search {
                    assert_eq!(c.forced[i], 1 << sol[i], "an expert single is forced");
                }
                cells[i] = sol[i];
            }
            // One blank left: a naked single.
            let mut one = sol.to_vec();
            one[40] = 0;
            let c = Constraints::of(Shape::NINE, &one);
            assert_eq!(c.cand[40], 1 << sol[40]);
            assert_eq!(c.forced[40], 1 << sol[40]);
        }
        assert!(n_forced > 100);
        // A contradictory digit placement removes candidates: a row holding 1..8 leaves only 9.
        let mut cells = vec![0u8; 81];
        for (c, d) in (1..=8u8).enumerate() {
            cells[c] = d;
        }
        let c = Constraints::of(Shape::NINE, &cells);
        assert_eq!(c.cand[8], 1 << 9);
        let fb = Features::new(Shape::NINE);
        let lp = vec![(1.0f32 / 9.0).ln(); 81 * 9];
        let allowed: Vec<bool> = cells.iter().map(|&v| v == 0).collect();
        let mut f = Vec::new();
        fb.push_board(&lp, &cells, &allowed, &mut f);
        let row = &f[8 * fb.dim()..9 * fb.dim()];
        assert!(
            (row[F_CONSTRAINTS] - 1.0 / 9.0).abs() < 1e-6,
            "one candidate"
        );
        assert_eq!(row[F_CONSTRAINTS + 1], 1.0, "naked single");
        assert_eq!(row[F_CONSTRAINTS + 3], 1.0, "forced");
        assert!(
            (row[F_CONSTRAINTS + 5] - 1.0 / 9.0).abs() < 1e-5,
            "legal mass"
        );
        // Without constraint features the columns are zeros.
        let mut g = Vec::new();
        Features::with_constraints(Shape::NINE, false).push_board(&lp, &cells, &allowed, &mut g);
        assert!(
            g[8 * fb.dim() + F_CONSTRAINTS..8 * fb.dim() + F_CONSTRAINTS + 6]
                .iter()
                .all(|x| *x == 0.0)
        );
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
            let cfg = PolicyConfig { hidden: 16, init_confidence_weight: scale, ..Default::default() };
            let pol = OrderPolicy::init(&cfg, Shape::NINE, &device);
            let fb = Features::new(Shape::NINE);
            // Random-ish digit distributions.
            let lp: Vec<f32> = (0..81 * 9)
                .map(|k| -(((k as u64 * 2654435761 + seed) % 1000) as f32) / 100.0)
                .collect();
            let allowed = allowed_cells(&masked_bits, block);
            let mut feats = Vec::new();
            let cells: Vec<u8> = masked_bits
                .iter()
                .enumerate()
                .map(|(i, m)| if *m { 0 } else { (i % 9 + 1) as u8 })
                .collect();
            fb.push_board(&lp, &cells, &allowed, &mut feats);
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
