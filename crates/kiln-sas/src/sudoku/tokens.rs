//! What a masked-diffusion denoiser sees of a Sudoku board, and order-agreement metrics.
//!
//! **Token encoding.** A board of `n` cells is a sequence of `n` tokens in row-major order:
//! token `0` is [`MASK_TOKEN`] (a blank / masked cell) and tokens `1..=side` are the digits, so
//! the vocabulary has `side + 1` entries ([`vocab_size`]: 10 for 9x9, 5 for 4x4) and a digit's
//! token is the digit itself. Givens are the non-mask tokens of the puzzle ([`givens_mask`]); a
//! denoiser must never mask or overwrite them.
//!
//! **Kendall tau.** [`kendall_tau`] compares two unmasking orders of the same cells (e.g. a
//! schedule against the expert order); [`kendall_tau_b`] compares per-cell reveal steps with
//! ties (several cells revealed in one step).

use std::collections::HashMap;
use std::hash::Hash;

use super::board::{Board, BoardError, Shape};

/// The mask token: a blank cell.
pub const MASK_TOKEN: u32 = 0;

/// Vocabulary size of the encoding: the mask plus one token per digit (10 for 9x9, 5 for 4x4).
pub fn vocab_size(shape: Shape) -> usize {
    shape.side() + 1
}

/// The board as tokens: `0` = mask for blanks, digit `d` = token `d`; length `shape.n_cells()`.
pub fn encode(board: &Board) -> Vec<u32> {
    board.cells().iter().map(|&v| v as u32).collect()
}

/// `true` at the givens (filled cells) of `puzzle`: positions that are never masked or chosen.
pub fn givens_mask(puzzle: &Board) -> Vec<bool> {
    puzzle.cells().iter().map(|&v| v != 0).collect()
}

/// Why a token sequence is not a board.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Wrong sequence length.
    #[error("token sequence of length {found}, expected {expected} for a {shape} board")]
    WrongLength {
        /// Expected length.
        expected: usize,
        /// Actual length.
        found: usize,
        /// Board shape.
        shape: Shape,
    },
    /// A token outside the vocabulary.
    #[error("token {token} at position {position} is outside the vocabulary 0..{vocab}")]
    BadToken {
        /// 0-based position.
        position: usize,
        /// The token.
        token: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The tokens form a board with a repeated digit in a unit.
    #[error("tokens do not form a valid board: {0}")]
    Board(BoardError),
}

/// Cell values (`0` = blank) from tokens, checking length and vocabulary but not the Sudoku
/// rules (use this to score a model's possibly-wrong completion cell by cell).
pub fn decode_cells(tokens: &[u32], shape: Shape) -> Result<Vec<u8>, TokenError> {
    if tokens.len() != shape.n_cells() {
        return Err(TokenError::WrongLength {
            expected: shape.n_cells(),
            found: tokens.len(),
            shape,
        });
    }
    let vocab = vocab_size(shape);
    tokens
        .iter()
        .enumerate()
        .map(|(position, &token)| {
            if (token as usize) < vocab {
                Ok(token as u8)
            } else {
                Err(TokenError::BadToken {
                    position,
                    token,
                    vocab,
                })
            }
        })
        .collect()
}

/// The board encoded by `tokens` (inverse of [`encode`]); errors on a bad length or token or a
/// repeated digit in a row, column or box.
pub fn decode(tokens: &[u32], shape: Shape) -> Result<Board, TokenError> {
    let cells = decode_cells(tokens, shape)?;
    Board::from_cells(shape, cells).map_err(TokenError::Board)
}

/// Why two orders cannot be compared.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TauError {
    /// The orders have different lengths.
    #[error("orders of different lengths: {0} and {1}")]
    LengthMismatch(usize, usize),
    /// An item occurs twice in one order, or an item of the first order is missing in the second.
    #[error(
        "the orders are not permutations of the same items (repeated or missing item at position {0})"
    )]
    NotPermutation(usize),
    /// Fewer than two items: tau is undefined.
    #[error("Kendall tau needs at least two items")]
    TooFew,
}

/// Kendall's tau between two orders of the same items (e.g. cell indices in unmasking order):
/// `(concordant - discordant) / (n (n - 1) / 2)`, `1` for identical orders, `-1` for reversed.
pub fn kendall_tau<T: Eq + Hash>(a: &[T], b: &[T]) -> Result<f64, TauError> {
    if a.len() != b.len() {
        return Err(TauError::LengthMismatch(a.len(), b.len()));
    }
    let n = a.len();
    if n < 2 {
        return Err(TauError::TooFew);
    }
    let mut pos_in_b = HashMap::with_capacity(n);
    for (i, item) in b.iter().enumerate() {
        if pos_in_b.insert(item, i).is_some() {
            return Err(TauError::NotPermutation(i));
        }
    }
    let mut seen = vec![false; n];
    let mut seq = Vec::with_capacity(n);
    for (i, item) in a.iter().enumerate() {
        match pos_in_b.get(item) {
            Some(&p) if !seen[p] => {
                seen[p] = true;
                seq.push(p);
            }
            _ => return Err(TauError::NotPermutation(i)),
        }
    }
    // O(n^2) pair count: n is at most a few hundred positions here.
    let mut discordant = 0i64;
    for i in 0..n {
        for j in i + 1..n {
            if seq[i] > seq[j] {
                discordant += 1;
            }
        }
    }
    let pairs = (n * (n - 1) / 2) as i64;
    Ok((pairs - 2 * discordant) as f64 / pairs as f64)
}

/// Kendall's tau-b between two score vectors over the same items, with ties (e.g. the step at
/// which each cell was revealed by two schedules that reveal several cells per step).
/// `None` if the lengths differ, there are fewer than two items, or one vector is constant.
pub fn kendall_tau_b(x: &[f64], y: &[f64]) -> Option<f64> {
    if x.len() != y.len() || x.len() < 2 {
        return None;
    }
    let n = x.len();
    let (mut conc, mut disc, mut tie_x, mut tie_y) = (0i64, 0i64, 0i64, 0i64);
    for i in 0..n {
        for j in i + 1..n {
            let dx = x[i].partial_cmp(&x[j])?;
            let dy = y[i].partial_cmp(&y[j])?;
            use std::cmp::Ordering::Equal;
            match (dx, dy) {
                (Equal, Equal) => {
                    tie_x += 1;
                    tie_y += 1;
                }
                (Equal, _) => tie_x += 1,
                (_, Equal) => tie_y += 1,
                (a, b) if a == b => conc += 1,
                _ => disc += 1,
            }
        }
    }
    let n0 = (n * (n - 1) / 2) as i64;
    let denom = (((n0 - tie_x) * (n0 - tie_y)) as f64).sqrt();
    if denom == 0.0 {
        return None;
    }
    Some((conc - disc) as f64 / denom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_roundtrip() {
        let b = Board::parse("1.3.............").unwrap();
        let t = encode(&b);
        assert_eq!(&t[..4], &[1, MASK_TOKEN, 3, MASK_TOKEN]);
        assert_eq!(decode(&t, Shape::FOUR).unwrap(), b);
        assert_eq!(&givens_mask(&b)[..3], &[true, false, true]);
        assert_eq!(vocab_size(Shape::NINE), 10);
        assert!(matches!(
            decode(&t[1..], Shape::FOUR),
            Err(TokenError::WrongLength { .. })
        ));
        let mut bad = t.clone();
        bad[5] = 5;
        assert!(matches!(
            decode(&bad, Shape::FOUR),
            Err(TokenError::BadToken { position: 5, .. })
        ));
        bad[5] = 1; // cell 5 is r2c2, in the box of the 1 at r1c1
        assert!(matches!(
            decode(&bad, Shape::FOUR),
            Err(TokenError::Board(BoardError::Contradiction { .. }))
        ));
        assert_eq!(decode_cells(&bad, Shape::FOUR).unwrap()[5], 1);
    }
}
