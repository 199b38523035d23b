//! The "expert" fill order: the order in which a human-style solver fills the blank cells.
//!
//! The solver works in rounds. In each round it applies the easiest technique that makes
//! progress:
//! 1. **naked singles**: every blank cell with exactly one candidate (given the digits already
//!    in its row, column and box) is filled, all of them in one round, in ascending cell order;
//! 2. otherwise **hidden singles**: every (unit, digit) pair where the digit fits in exactly one
//!    cell of the unit, scanning rows, then columns, then boxes, digits ascending; all found in
//!    one round are filled in that scan order;
//! 3. otherwise a **search** step: the blank cell with the fewest candidates (lowest index on
//!    ties) is filled with its value in the solution, as the first forced cell of a
//!    backtracking search would be.
//!
//! The resulting list covers every blank exactly once; it is the "expert" schedule for
//! masked-diffusion decoding, and the hardest technique it needs grades the puzzle's
//! [`Difficulty`].

use serde::{Deserialize, Serialize};

use super::board::{Board, MAX_SIDE};
use super::solver::{State, solve};

/// The technique that filled a cell, from easiest to hardest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Technique {
    /// The cell had a single candidate.
    NakedSingle,
    /// The digit had a single possible cell in a row, column or box.
    HiddenSingle,
    /// Neither applied anywhere: the cell with the fewest candidates was filled from the solution.
    Search,
}

/// Puzzle difficulty: the hardest technique the expert solver needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Difficulty {
    /// Naked singles alone solve it.
    NakedSingles,
    /// Naked and hidden singles solve it (hidden singles are needed).
    HiddenSingles,
    /// Singles get stuck at least once: a search step is needed.
    Search,
}

impl From<Technique> for Difficulty {
    fn from(t: Technique) -> Difficulty {
        match t {
            Technique::NakedSingle => Difficulty::NakedSingles,
            Technique::HiddenSingle => Difficulty::HiddenSingles,
            Technique::Search => Difficulty::Search,
        }
    }
}

/// One filled cell of the expert order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fill {
    /// Row-major cell index.
    pub cell: usize,
    /// The digit written (always the solution's digit).
    pub value: u8,
    /// How the cell was found.
    pub technique: Technique,
    /// The round (0-based) in which it was filled; all fills of one round were available at
    /// the same time.
    pub round: usize,
}

/// The expert fill order of a puzzle: one [`Fill`] per blank cell, in fill order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertOrder {
    /// The fills, in order.
    pub fills: Vec<Fill>,
}

impl ExpertOrder {
    /// The cell indices in fill order.
    pub fn cells(&self) -> Vec<usize> {
        self.fills.iter().map(|f| f.cell).collect()
    }

    /// Number of cells filled with `technique`.
    pub fn count(&self, technique: Technique) -> usize {
        self.fills
            .iter()
            .filter(|f| f.technique == technique)
            .count()
    }

    /// Number of rounds.
    pub fn n_rounds(&self) -> usize {
        self.fills.last().map_or(0, |f| f.round + 1)
    }

    /// The hardest technique used (`NakedSingles` for a puzzle with no blanks).
    pub fn difficulty(&self) -> Difficulty {
        self.fills
            .iter()
            .map(|f| f.technique)
            .max()
            .map_or(Difficulty::NakedSingles, Difficulty::from)
    }

    /// Per-cell step at which each cell was filled (`None` for givens), indexed by cell: the
    /// position in the fill order. Useful for Kendall tau against another schedule.
    pub fn step_of_cell(&self, n_cells: usize) -> Vec<Option<usize>> {
        let mut out = vec![None; n_cells];
        for (step, f) in self.fills.iter().enumerate() {
            out[f.cell] = Some(step);
        }
        out
    }
}

/// Why an expert order could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExpertError {
    /// The solution does not complete the puzzle.
    #[error(
        "the solution does not complete the puzzle (different shape, a blank, or a given that differs)"
    )]
    SolutionMismatch,
    /// The puzzle has no solution.
    #[error("the puzzle has no solution")]
    NoSolution,
}

/// The expert fill order of `puzzle`, using `solution` for search steps. Any solution of a
/// puzzle with several solutions works: singles are forced in every solution.
pub fn expert_order(puzzle: &Board, solution: &Board) -> Result<ExpertOrder, ExpertError> {
    if !puzzle.is_solved_by(solution) {
        return Err(ExpertError::SolutionMismatch);
    }
    let shape = puzzle.shape();
    let g = shape.geometry();
    let mut state = State::from_board(puzzle).ok_or(ExpertError::SolutionMismatch)?;
    let sol = solution.cells();
    let mut fills = Vec::with_capacity(puzzle.n_cells_blank());
    let mut remaining = puzzle.n_cells_blank();
    let mut round = 0;
    let mut batch: Vec<(usize, u8)> = Vec::with_capacity(g.n_cells);
    while remaining > 0 {
        batch.clear();
        // 1. Naked singles.
        for i in 0..g.n_cells {
            if state.cells[i] == 0 {
                let c = state.candidates(g, i);
                if c.count_ones() == 1 {
                    batch.push((i, c.trailing_zeros() as u8 + 1));
                }
            }
        }
        let mut technique = Technique::NakedSingle;
        // 2. Hidden singles.
        if batch.is_empty() {
            technique = Technique::HiddenSingle;
            for unit in &g.units[..3 * g.side] {
                let unit = &unit[..g.side];
                let (mut once, mut twice) = (0u16, 0u16);
                for &cell in unit {
                    if state.cells[cell as usize] == 0 {
                        let c = state.candidates(g, cell as usize);
                        twice |= once & c;
                        once |= c;
                    }
                }
                let mut singles = once & !twice;
                while singles != 0 {
                    let bit = singles & singles.wrapping_neg();
                    singles &= singles - 1;
                    if let Some(&cell) = unit.iter().find(|&&cell| {
                        state.cells[cell as usize] == 0
                            && state.candidates(g, cell as usize) & bit != 0
                    }) && !batch.iter().any(|&(c, _)| c == cell as usize)
                    {
                        batch.push((cell as usize, bit.trailing_zeros() as u8 + 1));
                    }
                }
            }
        }
        // 3. Search step: the MRV cell, filled from the solution.
        if batch.is_empty() {
            technique = Technique::Search;
            let mut best = (u32::MAX, usize::MAX);
            for i in 0..g.n_cells {
                if state.cells[i] == 0 {
                    let n = state.candidates(g, i).count_ones();
                    if n < best.0 {
                        best = (n, i);
                    }
                }
            }
            batch.push((best.1, sol[best.1]));
        }
        for &(cell, value) in &batch {
            // Singles are forced, so they agree with any solution; a mismatch means the puzzle
            // and solution are inconsistent, which `is_solved_by` above rules out.
            if value != sol[cell] || state.candidates(g, cell) & (1 << (value - 1)) == 0 {
                return Err(ExpertError::SolutionMismatch);
            }
            state.place(g, cell, value);
            fills.push(Fill {
                cell,
                value,
                technique,
                round,
            });
            remaining -= 1;
        }
        round += 1;
    }
    debug_assert!(MAX_SIDE >= g.side);
    Ok(ExpertOrder { fills })
}

/// Solves `puzzle` and returns its expert order (with the first solution found if the puzzle
/// has several).
pub fn expert_order_solving(puzzle: &Board) -> Result<ExpertOrder, ExpertError> {
    let solution = solve(puzzle).board.ok_or(ExpertError::NoSolution)?;
    expert_order(puzzle, &solution)
}

/// The difficulty of `puzzle` given its `solution`.
pub fn grade(puzzle: &Board, solution: &Board) -> Result<Difficulty, ExpertError> {
    Ok(expert_order(puzzle, solution)?.difficulty())
}

impl Board {
    fn n_cells_blank(&self) -> usize {
        self.cells().iter().filter(|&&v| v == 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hard_puzzle_needs_search() {
        let p = Board::parse(
            "4...3.......6..8..........1....5..9..8....6...7.2........1.27..5.3....4.9........",
        )
        .unwrap();
        let o = expert_order_solving(&p).unwrap();
        assert_eq!(o.fills.len(), 81 - 18);
        assert_eq!(o.difficulty(), Difficulty::Search);
        let mut cells = o.cells();
        cells.sort();
        assert_eq!(cells, p.blanks());
    }

    #[test]
    fn one_blank_is_a_naked_single() {
        let sol = Board::parse(
            "468931527751624839392578461134756298289413675675289314846192753513867942927345186",
        )
        .unwrap();
        let p = sol.with_cleared(40);
        let o = expert_order(&p, &sol).unwrap();
        assert_eq!(
            o.fills,
            vec![Fill {
                cell: 40,
                value: sol.get(40),
                technique: Technique::NakedSingle,
                round: 0
            }]
        );
        assert_eq!(o.difficulty(), Difficulty::NakedSingles);
    }

    #[test]
    fn mismatched_solution_is_an_error() {
        let sol = Board::parse(
            "468931527751624839392578461134756298289413675675289314846192753513867942927345186",
        )
        .unwrap();
        let other = Board::parse(
            "728946315934251678516738249147593826369482157852167493293615784481379562675824931",
        )
        .unwrap();
        assert_eq!(
            expert_order(&sol.with_cleared(0), &other),
            Err(ExpertError::SolutionMismatch)
        );
    }
}
