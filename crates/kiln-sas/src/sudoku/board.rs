//! The [`Board`] type (4x4 and 9x9 Sudoku grids), its [`Shape`], parsing and validation.

use std::fmt;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

/// Largest supported side length (9x9).
pub(crate) const MAX_SIDE: usize = 9;
/// Largest supported number of cells (81).
pub(crate) const MAX_CELLS: usize = MAX_SIDE * MAX_SIDE;

/// The geometry of a Sudoku grid: a `side x side` grid of `box_size x box_size` boxes, with
/// `side = box_size^2`. Supported: box size 2 (4x4 grids, digits 1-4) and 3 (9x9 grids, digits 1-9).
///
/// Serialized as the side length (`4` or `9`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub struct Shape {
    box_size: u8,
}

impl Shape {
    /// 4x4 Sudoku: 2x2 boxes, digits 1-4.
    pub const FOUR: Shape = Shape { box_size: 2 };
    /// 9x9 Sudoku: 3x3 boxes, digits 1-9.
    pub const NINE: Shape = Shape { box_size: 3 };

    /// The shape with the given box size (2 or 3); `None` for anything else.
    pub fn from_box_size(box_size: usize) -> Option<Shape> {
        match box_size {
            2 => Some(Shape::FOUR),
            3 => Some(Shape::NINE),
            _ => None,
        }
    }

    /// The shape with the given side length (4 or 9); `None` for anything else.
    pub fn from_side(side: usize) -> Option<Shape> {
        match side {
            4 => Some(Shape::FOUR),
            9 => Some(Shape::NINE),
            _ => None,
        }
    }

    /// The shape whose board has `n_cells` cells (16 or 81); `None` for anything else.
    pub fn from_cell_count(n_cells: usize) -> Option<Shape> {
        match n_cells {
            16 => Some(Shape::FOUR),
            81 => Some(Shape::NINE),
            _ => None,
        }
    }

    /// Side length of a box (2 or 3).
    pub fn box_size(self) -> usize {
        self.box_size as usize
    }

    /// Side length of the grid, which is also the largest digit (4 or 9).
    pub fn side(self) -> usize {
        self.box_size() * self.box_size()
    }

    /// Number of cells (16 or 81).
    pub fn n_cells(self) -> usize {
        self.side() * self.side()
    }

    /// Precomputed row/column/box tables.
    pub(crate) fn geometry(self) -> &'static Geometry {
        static FOUR: OnceLock<Geometry> = OnceLock::new();
        static NINE: OnceLock<Geometry> = OnceLock::new();
        match self.box_size {
            2 => FOUR.get_or_init(|| Geometry::new(2)),
            _ => NINE.get_or_init(|| Geometry::new(3)),
        }
    }
}

impl TryFrom<u8> for Shape {
    type Error = String;
    fn try_from(side: u8) -> Result<Self, Self::Error> {
        Shape::from_side(side as usize)
            .ok_or_else(|| format!("unsupported Sudoku side length {side}: expected 4 or 9"))
    }
}

impl From<Shape> for u8 {
    fn from(s: Shape) -> u8 {
        s.side() as u8
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{0}x{0}", self.side())
    }
}

/// Row/column/box lookup tables for one [`Shape`].
#[derive(Debug)]
pub(crate) struct Geometry {
    pub side: usize,
    pub n_cells: usize,
    /// Row of each cell.
    pub row: [u8; MAX_CELLS],
    /// Column of each cell.
    pub col: [u8; MAX_CELLS],
    /// Box of each cell (boxes numbered row-major).
    pub bx: [u8; MAX_CELLS],
    /// The `3 * side` units: rows `0..side`, columns `side..2*side`, boxes `2*side..3*side`;
    /// each lists its `side` cells in row-major order.
    pub units: [[u8; MAX_SIDE]; 3 * MAX_SIDE],
}

impl Geometry {
    fn new(box_size: usize) -> Geometry {
        let side = box_size * box_size;
        let mut g = Geometry {
            side,
            n_cells: side * side,
            row: [0; MAX_CELLS],
            col: [0; MAX_CELLS],
            bx: [0; MAX_CELLS],
            units: [[0; MAX_SIDE]; 3 * MAX_SIDE],
        };
        let mut fill = [0usize; 3 * MAX_SIDE];
        for i in 0..side * side {
            let (r, c) = (i / side, i % side);
            let b = (r / box_size) * box_size + c / box_size;
            g.row[i] = r as u8;
            g.col[i] = c as u8;
            g.bx[i] = b as u8;
            for u in [r, side + c, 2 * side + b] {
                g.units[u][fill[u]] = i as u8;
                fill[u] += 1;
            }
        }
        g
    }
}

/// Which kind of unit (row, column or box) a constraint refers to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitKind {
    /// A row.
    Row,
    /// A column.
    Column,
    /// A box.
    Box,
}

impl fmt::Display for UnitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            UnitKind::Row => "row",
            UnitKind::Column => "column",
            UnitKind::Box => "box",
        })
    }
}

/// Why a string or a cell vector is not a valid Sudoku board.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BoardError {
    /// The string has the wrong number of cells.
    #[error(
        "wrong length: {found} cells, expected {expected} (a 4x4 board has 16 cells, a 9x9 board 81; blanks are '.' or '0')"
    )]
    WrongLength {
        /// What was expected, e.g. "81" or "16 or 81".
        expected: String,
        /// Number of cells found.
        found: usize,
    },
    /// A character that is neither a digit of this board size nor a blank.
    #[error(
        "illegal character {ch:?} at position {position} (1-based): a {shape} board accepts digits 1-{max} and '.' or '0' for blanks"
    )]
    IllegalChar {
        /// The offending character.
        ch: char,
        /// 1-based position in the string.
        position: usize,
        /// Shape of the board being parsed.
        shape: Shape,
        /// Largest digit allowed.
        max: usize,
    },
    /// A cell value outside `0..=side` (from a numeric cell vector).
    #[error("cell {cell} holds {value}, outside 0..={max} for a {shape} board")]
    ValueOutOfRange {
        /// 0-based cell index.
        cell: usize,
        /// The offending value.
        value: u32,
        /// Shape of the board.
        shape: Shape,
        /// Largest digit allowed.
        max: usize,
    },
    /// The same digit is given twice in a row, column or box.
    #[error(
        "contradictory givens: digit {digit} appears twice in {unit} {unit_number} (cells r{}c{} and r{}c{}); fix or drop one of them",
        first.0, first.1, second.0, second.1
    )]
    Contradiction {
        /// The repeated digit.
        digit: u8,
        /// Row, column or box.
        unit: UnitKind,
        /// 1-based number of the unit.
        unit_number: usize,
        /// 1-based (row, column) of the first occurrence.
        first: (usize, usize),
        /// 1-based (row, column) of the second occurrence.
        second: (usize, usize),
    },
}

/// A Sudoku board: `shape.n_cells()` cells in row-major order, each `0` (blank) or a digit
/// `1..=shape.side()`. A `Board` never holds two equal digits in one row, column or box.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Board {
    shape: Shape,
    cells: Vec<u8>,
}

impl Board {
    /// An all-blank board.
    pub fn empty(shape: Shape) -> Board {
        Board {
            shape,
            cells: vec![0; shape.n_cells()],
        }
    }

    /// A board from row-major cell values (`0` = blank). Checks the length, the value range and
    /// that no digit repeats in a row, column or box.
    pub fn from_cells(shape: Shape, cells: Vec<u8>) -> Result<Board, BoardError> {
        if cells.len() != shape.n_cells() {
            return Err(BoardError::WrongLength {
                expected: shape.n_cells().to_string(),
                found: cells.len(),
            });
        }
        if let Some((cell, &value)) = cells
            .iter()
            .enumerate()
            .find(|(_, v)| **v as usize > shape.side())
        {
            return Err(BoardError::ValueOutOfRange {
                cell,
                value: value as u32,
                shape,
                max: shape.side(),
            });
        }
        let board = Board { shape, cells };
        board.check_contradictions()?;
        Ok(board)
    }

    /// Parses a board, inferring the shape from the length (16 cells: 4x4, 81 cells: 9x9).
    /// Blanks are `.` or `0`; surrounding whitespace is ignored.
    pub fn parse(s: &str) -> Result<Board, BoardError> {
        let s = s.trim();
        let n = s.chars().count();
        let shape = Shape::from_cell_count(n).ok_or_else(|| BoardError::WrongLength {
            expected: "16 or 81".to_string(),
            found: n,
        })?;
        Board::parse_shape(s, shape)
    }

    /// Parses a board of a known shape. Blanks are `.` or `0`; surrounding whitespace is ignored.
    pub fn parse_shape(s: &str, shape: Shape) -> Result<Board, BoardError> {
        let s = s.trim();
        let n = s.chars().count();
        if n != shape.n_cells() {
            return Err(BoardError::WrongLength {
                expected: shape.n_cells().to_string(),
                found: n,
            });
        }
        let mut cells = Vec::with_capacity(n);
        for (i, ch) in s.chars().enumerate() {
            let v = match ch {
                '.' | '0' => 0,
                '1'..='9' if (ch as usize - '0' as usize) <= shape.side() => ch as u8 - b'0',
                _ => {
                    return Err(BoardError::IllegalChar {
                        ch,
                        position: i + 1,
                        shape,
                        max: shape.side(),
                    });
                }
            };
            cells.push(v);
        }
        let board = Board { shape, cells };
        board.check_contradictions()?;
        Ok(board)
    }

    fn check_contradictions(&self) -> Result<(), BoardError> {
        let g = self.shape.geometry();
        for (u, unit) in g.units[..3 * g.side].iter().enumerate() {
            let mut seen = [usize::MAX; MAX_SIDE + 1];
            for &cell in &unit[..g.side] {
                let cell = cell as usize;
                let d = self.cells[cell] as usize;
                if d == 0 {
                    continue;
                }
                if seen[d] != usize::MAX {
                    let rc = |i: usize| (i / g.side + 1, i % g.side + 1);
                    return Err(BoardError::Contradiction {
                        digit: d as u8,
                        unit: [UnitKind::Row, UnitKind::Column, UnitKind::Box][u / g.side],
                        unit_number: u % g.side + 1,
                        first: rc(seen[d]),
                        second: rc(cell),
                    });
                }
                seen[d] = cell;
            }
        }
        Ok(())
    }

    /// The board's shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Row-major cell values, `0` = blank.
    pub fn cells(&self) -> &[u8] {
        &self.cells
    }

    /// Value of cell `i` (`0` = blank). Panics if `i` is out of range.
    pub fn get(&self, i: usize) -> u8 {
        self.cells[i]
    }

    /// Number of filled cells.
    pub fn n_givens(&self) -> usize {
        self.cells.iter().filter(|&&v| v != 0).count()
    }

    /// Indices of the blank cells, ascending.
    pub fn blanks(&self) -> Vec<usize> {
        (0..self.cells.len())
            .filter(|&i| self.cells[i] == 0)
            .collect()
    }

    /// Whether every cell is filled (a filled `Board` is always a valid solution grid, since a
    /// `Board` never holds a repeated digit in a unit).
    pub fn is_complete(&self) -> bool {
        self.cells.iter().all(|&v| v != 0)
    }

    /// Whether `solution` is a complete board of the same shape that agrees with every given of `self`.
    pub fn is_solved_by(&self, solution: &Board) -> bool {
        solution.shape == self.shape
            && solution.is_complete()
            && self
                .cells
                .iter()
                .zip(&solution.cells)
                .all(|(&p, &s)| p == 0 || p == s)
    }

    /// Whether digit `d` can be written in blank cell `i` without repeating a digit in its units.
    /// Panics if `i` is out of range.
    pub fn can_place(&self, i: usize, d: u8) -> bool {
        let g = self.shape.geometry();
        if self.cells[i] != 0 || d == 0 || d as usize > g.side {
            return false;
        }
        let (r, c, b) = (g.row[i], g.col[i], g.bx[i]);
        !(0..g.n_cells)
            .any(|j| self.cells[j] == d && (g.row[j] == r || g.col[j] == c || g.bx[j] == b))
    }

    /// A copy of the board with cell `i` blanked. Panics if `i` is out of range.
    pub fn with_cleared(&self, i: usize) -> Board {
        let mut b = self.clone();
        b.cells[i] = 0;
        b
    }

    /// Builds a board from cells that are known to be valid (internal use).
    pub(crate) fn from_trusted(shape: Shape, cells: Vec<u8>) -> Board {
        debug_assert_eq!(cells.len(), shape.n_cells());
        Board { shape, cells }
    }

    /// The board as a one-line string with `blank` for empty cells (e.g. `'.'` or `'0'`).
    pub fn to_line(&self, blank: char) -> String {
        self.cells
            .iter()
            .map(|&v| if v == 0 { blank } else { (b'0' + v) as char })
            .collect()
    }

    /// A multi-line human-readable grid with box separators.
    pub fn pretty(&self) -> String {
        let side = self.shape.side();
        let bs = self.shape.box_size();
        let mut out = String::new();
        for r in 0..side {
            if r > 0 && r % bs == 0 {
                let seg = "-".repeat(2 * bs);
                out.push_str(&vec![seg; bs].join("+"));
                out.push('\n');
            }
            for c in 0..side {
                if c > 0 && c % bs == 0 {
                    out.push_str("| ");
                }
                let v = self.cells[r * side + c];
                out.push(if v == 0 { '.' } else { (b'0' + v) as char });
                out.push(' ');
            }
            out.push('\n');
        }
        out
    }
}

/// Displays the board as a one-line string with `.` for blanks (the magictour layout).
impl fmt::Display for Board {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_line('.'))
    }
}

/// Serialized as the one-line string with `.` blanks.
impl Serialize for Board {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_line('.'))
    }
}

/// Deserialized from a 16- or 81-character string (blanks `.` or `0`), validated like [`Board::parse`].
impl<'de> Deserialize<'de> for Board {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Board, D::Error> {
        let s = String::deserialize(deserializer)?;
        Board::parse(&s).map_err(serde::de::Error::custom)
    }
}

impl std::str::FromStr for Board {
    type Err = BoardError;
    fn from_str(s: &str) -> Result<Board, BoardError> {
        Board::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_units() {
        let g = Shape::NINE.geometry();
        assert_eq!(&g.units[0][..9], &[0, 1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&g.units[9][..9], &[0, 9, 18, 27, 36, 45, 54, 63, 72]);
        assert_eq!(&g.units[18 + 4][..9], &[30, 31, 32, 39, 40, 41, 48, 49, 50]);
        let g4 = Shape::FOUR.geometry();
        assert_eq!(&g4.units[8 + 3][..4], &[10, 11, 14, 15]);
    }

    #[test]
    fn parse_roundtrip_and_errors() {
        let s = "4...3.......6..8..........1....5..9..8....6...7.2........1.27..5.3....4.9........";
        let b = Board::parse(s).unwrap();
        assert_eq!(b.shape(), Shape::NINE);
        assert_eq!(b.n_givens(), 18);
        assert_eq!(b.to_string(), s);
        assert_eq!(Board::parse(&s.replace('.', "0")).unwrap(), b);
        assert!(matches!(
            Board::parse(&s[1..]),
            Err(BoardError::WrongLength { found: 80, .. })
        ));
        assert!(matches!(
            Board::parse(&s.replacen('.', "x", 1)),
            Err(BoardError::IllegalChar {
                ch: 'x',
                position: 2,
                ..
            })
        ));
        // '5' is illegal on a 4x4 board.
        assert!(matches!(
            Board::parse("5000000000000000"),
            Err(BoardError::IllegalChar { ch: '5', .. })
        ));
        let e = Board::parse(&s.replacen('.', "4", 1)).unwrap_err();
        assert_eq!(
            e,
            BoardError::Contradiction {
                digit: 4,
                unit: UnitKind::Row,
                unit_number: 1,
                first: (1, 1),
                second: (1, 2)
            }
        );
        assert!(e.to_string().contains("row 1"));
    }

    #[test]
    fn shape_serde() {
        assert_eq!(serde_json::to_string(&Shape::NINE).unwrap(), "9");
        assert_eq!(serde_json::from_str::<Shape>("4").unwrap(), Shape::FOUR);
        assert!(serde_json::from_str::<Shape>("5").is_err());
        let b = Board::parse("1.3.............").unwrap();
        let j = serde_json::to_string(&b).unwrap();
        assert_eq!(j, "\"1.3.............\"");
        assert_eq!(serde_json::from_str::<Board>(&j).unwrap(), b);
        assert!(serde_json::from_str::<Board>("\"11..............\"").is_err());
    }
}
