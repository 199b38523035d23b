//! A fast exact Sudoku solver: bitmask candidates, constraint propagation (naked and hidden
//! singles) and depth-first search on the cell with the fewest candidates (MRV).
//!
//! It counts solutions up to a limit (2 is enough to decide uniqueness) and returns the first
//! solution found. Hand-written rather than taken from a crate: the Rust Sudoku crates do not
//! support 4x4 boards together with solution counting and randomised search (for the
//! generator) on one small fixed-size state.

use rand::Rng;
use rand::seq::SliceRandom;

use super::board::{Board, Geometry, MAX_CELLS, MAX_SIDE, Shape};

/// The outcome of [`solve`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Solution {
    /// Number of solutions found, capped at the limit (2 for [`solve`]): `0` = no solution,
    /// `1` = unique, `2` = two or more.
    pub count: usize,
    /// The first solution found, if any.
    pub board: Option<Board>,
}

impl Solution {
    /// Whether the puzzle has exactly one solution (only meaningful with a limit >= 2).
    pub fn is_unique(&self) -> bool {
        self.count == 1
    }
}

/// Solves `board`, counting solutions up to 2 (enough to tell "none", "unique" and "several").
pub fn solve(board: &Board) -> Solution {
    solve_with_limit(board, 2)
}

/// Solves `board`, counting solutions up to `limit` (at least 1).
pub fn solve_with_limit(board: &Board, limit: usize) -> Solution {
    let mut search = Search::new(board.shape(), limit.max(1));
    if let Some(state) = State::from_board(board) {
        search.run::<rand_chacha::ChaCha8Rng>(state, None);
    }
    Solution {
        count: search.count,
        board: search.first.map(|cells| {
            Board::from_trusted(board.shape(), cells[..board.shape().n_cells()].to_vec())
        }),
    }
}

/// Number of solutions of `board`, counted up to `limit`.
pub fn count_solutions(board: &Board, limit: usize) -> usize {
    solve_with_limit(board, limit).count
}

/// Whether `board` has exactly one solution.
pub fn has_unique_solution(board: &Board) -> bool {
    count_solutions(board, 2) == 1
}

/// A random complete grid: the search on an empty board, trying candidates in random order.
pub fn random_solution<R: Rng + ?Sized>(shape: Shape, rng: &mut R) -> Board {
    let mut search = Search::new(shape, 1);
    let state = State::from_board(&Board::empty(shape)).expect("an empty board is consistent");
    search.run(state, Some(rng));
    let cells = search.first.expect("an empty board always has a solution");
    Board::from_trusted(shape, cells[..shape.n_cells()].to_vec())
}

/// The search state: cell values and the digits already used in each row, column and box.
#[derive(Clone, Copy)]
pub(crate) struct State {
    pub(crate) cells: [u8; MAX_CELLS],
    rows: [u16; MAX_SIDE],
    cols: [u16; MAX_SIDE],
    boxes: [u16; MAX_SIDE],
}

impl State {
    /// `None` if the givens contradict each other (cannot happen for a valid [`Board`]).
    pub(crate) fn from_board(board: &Board) -> Option<State> {
        let g = board.shape().geometry();
        let mut s = State {
            cells: [0; MAX_CELLS],
            rows: [0; MAX_SIDE],
            cols: [0; MAX_SIDE],
            boxes: [0; MAX_SIDE],
        };
        for (i, &v) in board.cells().iter().enumerate() {
            if v != 0 {
                if s.candidates(g, i) & (1 << (v - 1)) == 0 {
                    return None;
                }
                s.place(g, i, v);
            }
        }
        Some(s)
    }

    #[inline]
    pub(crate) fn candidates(&self, g: &Geometry, i: usize) -> u16 {
        let full = ((1u32 << g.side) - 1) as u16;
        full & !(self.rows[g.row[i] as usize]
            | self.cols[g.col[i] as usize]
            | self.boxes[g.bx[i] as usize])
    }

    #[inline]
    pub(crate) fn place(&mut self, g: &Geometry, i: usize, d: u8) {
        let bit = 1u16 << (d - 1);
        self.cells[i] = d;
        self.rows[g.row[i] as usize] |= bit;
        self.cols[g.col[i] as usize] |= bit;
        self.boxes[g.bx[i] as usize] |= bit;
    }

    /// Fills naked and hidden singles until none are left. Returns `false` on a contradiction.
    fn propagate(&mut self, g: &Geometry) -> bool {
        let full = ((1u32 << g.side) - 1) as u16;
        loop {
            let mut changed = false;
            // Naked singles: a blank cell with one candidate.
            for i in 0..g.n_cells {
                if self.cells[i] != 0 {
                    continue;
                }
                let c = self.candidates(g, i);
                if c == 0 {
                    return false;
                }
                if c & (c - 1) == 0 {
                    self.place(g, i, c.trailing_zeros() as u8 + 1);
                    changed = true;
                }
            }
            // Hidden singles: a digit with one possible cell in a unit.
            for unit in &g.units[..3 * g.side] {
                let unit = &unit[..g.side];
                let (mut once, mut twice, mut used) = (0u16, 0u16, 0u16);
                for &cell in unit {
                    let cell = cell as usize;
                    let v = self.cells[cell];
                    if v != 0 {
                        used |= 1 << (v - 1);
                    } else {
                        let c = self.candidates(g, cell);
                        twice |= once & c;
                        once |= c;
                    }
                }
                if (once | used) != full {
                    return false; // some digit has no place left in this unit
                }
                let mut singles = once & !twice & !used;
                while singles != 0 {
                    let bit = singles & singles.wrapping_neg();
                    singles &= singles - 1;
                    let Some(&cell) = unit.iter().find(|&&cell| {
                        self.cells[cell as usize] == 0
                            && self.candidates(g, cell as usize) & bit != 0
                    }) else {
                        return false; // an earlier placement in this unit took its only cell
                    };
                    self.place(g, cell as usize, bit.trailing_zeros() as u8 + 1);
                    changed = true;
                }
            }
            if !changed {
                return true;
            }
        }
    }
}

/// Depth-first search with a solution counter.
struct Search {
    geometry: &'static Geometry,
    limit: usize,
    count: usize,
    first: Option<[u8; MAX_CELLS]>,
}

impl Search {
    fn new(shape: Shape, limit: usize) -> Search {
        Search {
            geometry: shape.geometry(),
            limit,
            count: 0,
            first: None,
        }
    }

    fn run<R: Rng + ?Sized>(&mut self, mut state: State, mut rng: Option<&mut R>) {
        let g = self.geometry;
        if !state.propagate(g) {
            return;
        }
        // MRV: the blank cell with the fewest candidates.
        let mut best = usize::MAX;
        let mut best_count = u32::MAX;
        for i in 0..g.n_cells {
            if state.cells[i] == 0 {
                let n = state.candidates(g, i).count_ones();
                if n < best_count {
                    best_count = n;
                    best = i;
                    if n == 2 {
                        break;
                    }
                }
            }
        }
        if best == usize::MAX {
            self.count += 1;
            if self.first.is_none() {
                self.first = Some(state.cells);
            }
            return;
        }
        let mut digits = [0u8; MAX_SIDE];
        let mut n = 0;
        let mut c = state.candidates(g, best);
        while c != 0 {
            digits[n] = c.trailing_zeros() as u8 + 1;
            n += 1;
            c &= c - 1;
        }
        if let Some(r) = rng.as_deref_mut() {
            digits[..n].shuffle(r);
        }
        for &d in &digits[..n] {
            let mut next = state;
            next.place(g, best, d);
            self.run(next, rng.as_deref_mut());
            if self.count >= self.limit {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn solves_hard_puzzle() {
        let p = Board::parse(
            "4...3.......6..8..........1....5..9..8....6...7.2........1.27..5.3....4.9........",
        )
        .unwrap();
        let s = solve(&p);
        assert_eq!(s.count, 1);
        assert_eq!(
            s.board.unwrap().to_string(),
            "468931527751624839392578461134756298289413675675289314846192753513867942927345186"
        );
    }

    #[test]
    fn empty_board_has_many_solutions() {
        assert_eq!(count_solutions(&Board::empty(Shape::NINE), 2), 2);
        // 4x4 Sudoku has exactly 288 grids.
        assert_eq!(count_solutions(&Board::empty(Shape::FOUR), 1000), 288);
    }

    #[test]
    fn unsolvable_board() {
        // Consistent givens but no solution: cell r1c9 has no candidate left.
        let p = Board::parse(
            "12345678.........9...............................................................",
        )
        .unwrap();
        assert_eq!(solve(&p).count, 0);
        assert!(solve(&p).board.is_none());
    }

    #[test]
    fn random_grids_are_complete_and_differ() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let a = random_solution(Shape::NINE, &mut rng);
        let b = random_solution(Shape::NINE, &mut rng);
        assert!(a.is_complete() && b.is_complete());
        assert_ne!(a, b);
        let c = random_solution(Shape::FOUR, &mut rng);
        assert!(c.is_complete());
        Board::from_cells(Shape::NINE, a.cells().to_vec()).unwrap();
    }
}
