//! Generated puzzle sets of a recipe (`pretrain.data`, `sas.train`, `sas.eval`,
//! `final_eval.sets.N.generated`): one seeded generator run per number of givens, cached.

use std::path::Path;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{GenParams, Puzzle, Shape};
use crate::denoiser::DenoiserError;

/// Training data of the denoiser: generated puzzles, one dataset per entry of `givens`.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct PuzzleSetConfig {
    /// Board side: 9 (9x9, 3x3 boxes) or 4 (4x4).
    pub side: usize,
    /// Puzzles per entry of `givens`.
    pub count: usize,
    /// Numbers of givens; one generated dataset per value (e.g. `[28, 34, 40]` mixes
    /// difficulties). The generator needs roughly >= 22 givens for 9x9.
    pub givens: Vec<usize>,
    /// Generator seed (held-out sets must use a different seed).
    pub seed: u64,
}

impl Default for PuzzleSetConfig {
    fn default() -> Self {
        Self {
            side: 9,
            count: 2000,
            givens: vec![30, 36, 42],
            seed: 1,
        }
    }
}

impl PuzzleSetConfig {
    /// Board shape (`None` for an unsupported side).
    pub fn shape(&self) -> Option<Shape> {
        Shape::from_side(self.side)
    }

    /// Load the puzzles from the default generator cache, generating missing sets.
    pub fn load(&self) -> Result<Vec<Puzzle>, DenoiserError> {
        self.load_in(&crate::sudoku::default_cache_dir())
    }

    /// Load the puzzles from the generator cache in `cache_dir`, generating missing sets.
    pub fn load_in(&self, cache_dir: &Path) -> Result<Vec<Puzzle>, DenoiserError> {
        let shape = self
            .shape()
            .ok_or_else(|| DenoiserError::Config(format!("side {} (use 4 or 9)", self.side)))?;
        let mut out = Vec::new();
        for (k, &g) in self.givens.iter().enumerate() {
            let mut p = GenParams::new(self.count, g, self.seed.wrapping_add(k as u64 * 7919));
            p.shape = shape;
            let set = crate::sudoku::load_or_generate_in(&p, cache_dir)
                .map_err(|e| DenoiserError::Data(e.to_string()))?;
            out.extend(set);
        }
        Ok(out)
    }
}

/// Range checks of a [`PuzzleSetConfig`] at recipe path `at`.
pub fn check_puzzle_set(d: &PuzzleSetConfig, at: &str) -> Result<(), (String, String)> {
    let Some(shape) = d.shape() else {
        return Err((
            format!("{at}.side"),
            format!("must be 4 or 9, got {}", d.side),
        ));
    };
    if d.count == 0 {
        return Err((format!("{at}.count"), "must be >= 1".into()));
    }
    if d.givens.is_empty() {
        return Err((format!("{at}.givens"), "needs at least one value".into()));
    }
    for &g in &d.givens {
        let lo = if shape == Shape::NINE { 22 } else { 4 };
        if g < lo || g >= shape.n_cells() {
            return Err((
                format!("{at}.givens"),
                format!(
                    "{g} is out of range: use {lo}..{} givens for {shape} (the generator rarely reaches fewer)",
                    shape.n_cells()
                ),
            ));
        }
    }
    Ok(())
}
