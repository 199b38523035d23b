//! Decoding a masked-diffusion denoiser on Sudoku with an unmasking schedule (METHODS,
//! SAS "Decoding" and "Heuristic schedules"): start from the puzzle (givens revealed, blanks masked); at each step choose `k`
//! masked cells (inside the current block when blocks are on), reveal the denoiser's most likely
//! digit there (greedy token choice), repeat until every cell is revealed.
//!
//! Schedules: random, confidence (highest top-1 probability), margin (largest top1 - top2),
//! entropy (lowest entropy), left-to-right, expert (the human-style solver order) and a learned
//! [`OrderPolicy`] (greedy: its most likely allowed position). Every step costs one batched
//! denoiser forward over the boards still being decoded.

use std::fmt;
use std::str::FromStr;

use crate::denoiser::SudokuDenoiser;
use burn::tensor::{Bool, Tensor, TensorData};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::denoiser::digit_log_probs;
use crate::policy::{Features, OrderPolicy, allowed_cells, cell_stats};
use crate::sudoku::{Puzzle, Shape};

/// An unmasking schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Schedule {
    /// Uniformly random masked cell.
    Random,
    /// Highest top-1 probability first.
    Confidence,
    /// Largest top1 - top2 probability margin first.
    Margin,
    /// Lowest entropy first.
    Entropy,
    /// Row-major order.
    LeftToRight,
    /// The expert solver order (naked singles, hidden singles, then search).
    Expert,
    /// The learned order policy (its most likely allowed cell).
    Learned,
}

impl Schedule {
    /// Every heuristic schedule (all but [`Schedule::Learned`]).
    pub const HEURISTICS: [Schedule; 6] = [
        Schedule::Random,
        Schedule::Confidence,
        Schedule::Margin,
        Schedule::Entropy,
        Schedule::LeftToRight,
        Schedule::Expert,
    ];

    /// The recipe / table name.
    pub fn name(self) -> &'static str {
        match self {
            Schedule::Random => "random",
            Schedule::Confidence => "confidence",
            Schedule::Margin => "margin",
            Schedule::Entropy => "entropy",
            Schedule::LeftToRight => "left_to_right",
            Schedule::Expert => "expert",
            Schedule::Learned => "learned",
        }
    }

    /// True for the schedules that read the denoiser's confidence (the "best heuristic" pool
    /// compared against the learned order: expert order uses the solver, not the model).
    pub fn is_model_heuristic(self) -> bool {
        matches!(
            self,
            Schedule::Confidence | Schedule::Margin | Schedule::Entropy
        )
    }
}

impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let all = [
            Schedule::Random,
            Schedule::Confidence,
            Schedule::Margin,
            Schedule::Entropy,
            Schedule::LeftToRight,
            Schedule::Expert,
            Schedule::Learned,
        ];
        all.into_iter().find(|x| x.name() == s).ok_or_else(|| {
            format!(
                "unknown schedule `{s}` (random, confidence, margin, entropy, left_to_right, expert, learned)"
            )
        })
    }
}

/// Decoding settings (recipe section `decode:`); logged with every evaluation.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct DecodeConfig {
    /// Cells revealed per step (1 = sequential decoding, as in the paper's Sudoku results).
    pub per_step: usize,
    /// Block length for semi-autoregressive decoding (0 = no blocks): a step may only choose
    /// cells inside the first block (in row-major order) that still has a masked cell.
    pub block_len: usize,
    /// Boards decoded together in one batched denoiser forward.
    pub batch_size: usize,
}

impl Default for DecodeConfig {
    fn default() -> Self {
        Self {
            per_step: 1,
            block_len: 0,
            batch_size: 128,
        }
    }
}

/// Result of decoding one board.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The completed cells (givens plus predicted digits).
    pub cells: Vec<u8>,
    /// Blank cells in the order they were revealed.
    pub order: Vec<usize>,
    /// Step (0-based) at which each cell was revealed; `None` for givens.
    pub step_of_cell: Vec<Option<usize>>,
    /// Number of decoding steps.
    pub steps: usize,
}

impl Decoded {
    /// Every cell equals the solution.
    pub fn board_correct(&self, p: &Puzzle) -> bool {
        self.cells == p.solution.cells()
    }

    /// (correct blank cells, blank cells).
    pub fn cell_hits(&self, p: &Puzzle) -> (usize, usize) {
        let mut hits = 0;
        let mut n = 0;
        for (i, &g) in p.puzzle.cells().iter().enumerate() {
            if g == 0 {
                n += 1;
                if self.cells[i] == p.solution.cells()[i] {
                    hits += 1;
                }
            }
        }
        (hits, n)
    }
}

/// Per-board decoding state.
struct Board {
    cells: Vec<u8>,
    masked: Vec<bool>,
    order: Vec<usize>,
    step_of_cell: Vec<Option<usize>>,
    steps: usize,
    expert_rank: Vec<usize>,
}

impl Board {
    fn done(&self) -> bool {
        !self.masked.iter().any(|m| *m)
    }
}

/// Decode `puzzles` with `schedule` (greedy digits). `policy` is required for
/// [`Schedule::Learned`]; `rng` drives [`Schedule::Random`] only.
pub fn decode(
    denoiser: &SudokuDenoiser,
    puzzles: &[Puzzle],
    schedule: Schedule,
    cfg: &DecodeConfig,
    policy: Option<&OrderPolicy>,
    rng: &mut ChaCha8Rng,
) -> Vec<Decoded> {
    let mut out = Vec::with_capacity(puzzles.len());
    for chunk in puzzles.chunks(cfg.batch_size.max(1)) {
        out.extend(decode_chunk(denoiser, chunk, schedule, cfg, policy, rng));
    }
    out
}

fn expert_rank(p: &Puzzle) -> Vec<usize> {
    let n = p.puzzle.cells().len();
    let mut rank = vec![usize::MAX; n];
    if let Ok(order) = p.expert_order() {
        for (k, c) in order.cells().into_iter().enumerate() {
            rank[c] = k;
        }
    }
    // Cells the expert order lacks (should not happen for valid puzzles) go last, row-major.
    let mut next = n;
    for r in rank.iter_mut() {
        if *r == usize::MAX {
            *r = next;
            next += 1;
        }
    }
    rank
}

fn decode_chunk(
    denoiser: &SudokuDenoiser,
    puzzles: &[Puzzle],
    schedule: Schedule,
    cfg: &DecodeConfig,
    policy: Option<&OrderPolicy>,
    rng: &mut ChaCha8Rng,
) -> Vec<Decoded> {
    let Some(first) = puzzles.first() else {
        return Vec::new();
    };
    let shape: Shape = first.puzzle.shape();
    let n = shape.n_cells();
    let side = shape.side();
    let feats = policy.map_or_else(|| Features::new(shape), |p| p.features(shape));
    let mut boards: Vec<Board> = puzzles
        .iter()
        .map(|p| {
            let cells = p.puzzle.cells().to_vec();
            let masked = cells.iter().map(|&v| v == 0).collect();
            Board {
                cells,
                masked,
                order: Vec::new(),
                step_of_cell: vec![None; n],
                steps: 0,
                expert_rank: if schedule == Schedule::Expert {
                    expert_rank(p)
                } else {
                    Vec::new()
                },
            }
        })
        .collect();
    loop {
        let active: Vec<usize> = (0..boards.len()).filter(|&b| !boards[b].done()).collect();
        if active.is_empty() {
            break;
        }
        let b = active.len();
        let tokens: Vec<u32> = active
            .iter()
            .flat_map(|&k| boards[k].cells.iter().map(|&v| v as u32))
            .collect();
        let lp = digit_log_probs(denoiser, &tokens, b, n);
        let allowed: Vec<Vec<bool>> = active
            .iter()
            .map(|&k| allowed_cells(&boards[k].masked, cfg.block_len))
            .collect();
        // Scores per active board and cell (higher = earlier).
        let scores: Vec<Vec<f32>> = match schedule {
            Schedule::Learned => {
                let policy = policy.expect("Schedule::Learned needs a policy");
                let mut f = Vec::with_capacity(b * n * feats.dim());
                for (j, &k) in active.iter().enumerate() {
                    feats.push_board(
                        &lp[j * n * side..(j + 1) * n * side],
                        &boards[k].cells,
                        &allowed[j],
                        &mut f,
                    );
                }
                let device = policy.device();
                let ft = Tensor::<3>::from_data(TensorData::new(f, [b, n, feats.dim()]), &device);
                let flat: Vec<bool> = allowed.iter().flatten().copied().collect();
                let at = Tensor::<2, Bool>::from_data(TensorData::new(flat, [b, n]), &device);
                let logp: Vec<f32> = policy
                    .log_probs(ft, at, 1.0)
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec()
                    .unwrap_or_default();
                logp.chunks(n).map(|c| c.to_vec()).collect()
            }
            _ => active
                .iter()
                .enumerate()
                .map(|(j, &k)| {
                    (0..n)
                        .map(|i| {
                            let s = cell_stats(&lp[(j * n + i) * side..(j * n + i + 1) * side]);
                            match schedule {
                                Schedule::Random => rng.random::<f32>(),
                                Schedule::Confidence => s.top1,
                                Schedule::Margin => s.margin,
                                Schedule::Entropy => -s.entropy,
                                Schedule::LeftToRight => -(i as f32),
                                Schedule::Expert => -(boards[k].expert_rank[i] as f32),
                                Schedule::Learned => unreachable!(),
                            }
                        })
                        .collect()
                })
                .collect(),
        };
        for (j, &k) in active.iter().enumerate() {
            let mut cand: Vec<usize> = (0..n).filter(|&i| allowed[j][i]).collect();
            cand.sort_by(|&a, &c| scores[j][c].total_cmp(&scores[j][a]).then(a.cmp(&c)));
            let step = boards[k].steps;
            for &i in cand.iter().take(cfg.per_step.max(1)) {
                let s = cell_stats(&lp[(j * n + i) * side..(j * n + i + 1) * side]);
                let bd = &mut boards[k];
                bd.cells[i] = (s.argmax + 1) as u8;
                bd.masked[i] = false;
                bd.order.push(i);
                bd.step_of_cell[i] = Some(step);
            }
            boards[k].steps += 1;
        }
    }
    boards
        .into_iter()
        .map(|b| Decoded {
            cells: b.cells,
            order: b.order,
            step_of_cell: b.step_of_cell,
            steps: b.steps,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::denoiser::tiny_denoiser_config;
    use crate::policy::PolicyConfig;
    use crate::sudoku::{GenParams, generate};
    use burn::tensor::Device;
    use rand::SeedableRng;

    #[test]
    fn every_schedule_fills_every_blank_once_and_keeps_givens() {
        let device = Device::flex();
        device.seed(0);
        let model = tiny_denoiser_config(Shape::NINE).init(&device);
        let pol = OrderPolicy::init(&PolicyConfig::default(), Shape::NINE, &device);
        let ps = generate(&GenParams::new(3, 60, 9)).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for sched in Schedule::HEURISTICS.into_iter().chain([Schedule::Learned]) {
            for (per_step, block_len) in [(1, 0), (3, 0), (1, 27), (2, 9)] {
                let cfg = DecodeConfig {
                    per_step,
                    block_len,
                    batch_size: 2,
                };
                let out = decode(&model, &ps, sched, &cfg, Some(&pol), &mut rng);
                for (d, p) in out.iter().zip(&ps) {
                    let blanks = p.puzzle.blanks();
                    let mut o = d.order.clone();
                    o.sort();
                    assert_eq!(o, blanks, "{sched}");
                    assert_eq!(d.steps, blanks.len().div_ceil(per_step).max(d.steps));
                    for (i, &g) in p.puzzle.cells().iter().enumerate() {
                        if g != 0 {
                            assert_eq!(d.cells[i], g);
                            assert_eq!(d.step_of_cell[i], None);
                        } else {
                            assert!(d.cells[i] >= 1 && d.cells[i] <= 9);
                        }
                    }
                    if let Some(n_blocks) = 81usize.checked_div(block_len) {
                        // Blocks are completed in order: reveal steps are non-decreasing by block.
                        let mut last = 0;
                        for blk in 0..n_blocks {
                            let steps: Vec<usize> = (blk * block_len..(blk + 1) * block_len)
                                .filter_map(|i| d.step_of_cell[i])
                                .collect();
                            if let Some(mn) = steps.iter().min() {
                                assert!(*mn >= last, "{sched}: block {blk} started early");
                                last = *steps.iter().max().unwrap();
                            }
                        }
                    }
                }
                if per_step == 1 && block_len == 0 && sched == Schedule::LeftToRight {
                    for (d, p) in out.iter().zip(&ps) {
                        assert_eq!(d.order, p.puzzle.blanks());
                    }
                }
                if per_step == 1 && block_len == 0 && sched == Schedule::Expert {
                    for (d, p) in out.iter().zip(&ps) {
                        assert_eq!(d.order, p.expert_order().unwrap().cells());
                    }
                }
            }
        }
    }
}
