//! Puzzle files: the [`Puzzle`] record and loaders for the formats in `shared/datasets/sudoku`.
//!
//! Formats ([`Format`]):
//! - **lines**: one puzzle per line, 81 (9x9) or 16 (4x4) characters, blanks `.` or `0`; blank
//!   lines and lines starting with `#` are skipped, and anything after the first whitespace on a
//!   line (e.g. a rating) is ignored;
//! - **JSONL**: one object per line, `{"puzzle", "solution"?, "n_givens"?, "unique"?}` (the
//!   magictour layout, also what [`write_jsonl`] writes);
//! - **CSV**: `Puzzle,Solution` rows (the 4x4 d1 test set), `0` = blank; a header line is skipped;
//!   the solution column may be absent.
//!
//! Every puzzle is checked when loaded: its givens must not contradict each other, it must have a
//! solution, a solution given in the file must complete it, and `n_givens`/`unique` fields must be
//! right. Errors name the file and 1-based line. In `lenient` mode a bad line is skipped with a
//! warning and counted instead.

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::board::{Board, BoardError};
use super::expert::{ExpertError, ExpertOrder, expert_order};
use super::solver::solve;

/// A puzzle with its solution.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Puzzle {
    /// The puzzle (blanks are `0`).
    pub puzzle: Board,
    /// A solution (the only one when `unique`).
    pub solution: Board,
    /// Whether the puzzle has exactly one solution.
    pub unique: bool,
}

impl Puzzle {
    /// Solves `puzzle` and wraps it with its solution. Errors if it has no solution.
    pub fn from_board(puzzle: Board) -> Result<Puzzle, LineError> {
        let s = solve(&puzzle);
        let solution = s.board.ok_or(LineError::NoSolution)?;
        Ok(Puzzle {
            puzzle,
            solution,
            unique: s.count == 1,
        })
    }

    /// Number of givens.
    pub fn n_givens(&self) -> usize {
        self.puzzle.n_givens()
    }

    /// The expert fill order of this puzzle (see [`expert_order`]).
    pub fn expert_order(&self) -> Result<ExpertOrder, ExpertError> {
        expert_order(&self.puzzle, &self.solution)
    }

    /// The JSONL record (`'.'` for blanks, like the magictour file).
    pub fn to_record(&self) -> PuzzleRecord {
        PuzzleRecord {
            puzzle: self.puzzle.to_line('.'),
            solution: Some(self.solution.to_line('.')),
            n_givens: Some(self.n_givens()),
            unique: Some(self.unique),
        }
    }
}

/// One JSONL line: `{"puzzle","solution","n_givens","unique"}`. Only `puzzle` is required when
/// reading.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PuzzleRecord {
    /// The puzzle string, blanks `.` or `0`.
    pub puzzle: String,
    /// The solution string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub solution: Option<String>,
    /// Number of givens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_givens: Option<usize>,
    /// Whether the solution is unique.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unique: Option<bool>,
}

/// What is wrong with one line of a puzzle file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// The puzzle string is not a valid board.
    #[error("bad puzzle: {0}")]
    Puzzle(BoardError),
    /// The solution string is not a valid board of the puzzle's size.
    #[error("bad solution: {0}")]
    Solution(BoardError),
    /// The solution string has blanks or disagrees with a given.
    #[error(
        "the solution does not complete the puzzle (it has a blank or disagrees with a given); check that the columns are not swapped"
    )]
    SolutionMismatch,
    /// The puzzle's givens are consistent but admit no solution.
    #[error("the puzzle has no solution")]
    NoSolution,
    /// The `n_givens` field disagrees with the puzzle.
    #[error("n_givens is {stated} but the puzzle has {actual} givens")]
    NGivensMismatch {
        /// Value in the file.
        stated: usize,
        /// Counted from the puzzle.
        actual: usize,
    },
    /// The `unique` field disagrees with the solver.
    #[error("unique is {stated} but the solver finds {}", if *actual { "exactly one solution" } else { "several solutions" })]
    UniqueMismatch {
        /// Value in the file.
        stated: bool,
        /// What the solver found.
        actual: bool,
    },
    /// The line is not valid JSON or lacks the `puzzle` field.
    #[error("invalid JSON record: {0} (expected {{\"puzzle\": \"...\", \"solution\": \"...\"}})")]
    Json(String),
    /// A CSV row with the wrong number of fields.
    #[error("expected 1 or 2 comma-separated fields (Puzzle,Solution), found {0}")]
    CsvFields(usize),
}

/// Why a puzzle file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A bad line (strict mode).
    #[error("{}:{line}: {kind}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        kind: LineError,
    },
    /// The file holds no usable puzzle.
    #[error("{}: no puzzles found ({skipped} bad lines skipped)", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
        /// Bad lines skipped in lenient mode.
        skipped: usize,
    },
}

/// A puzzle file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// One 81- or 16-character puzzle per line.
    Lines,
    /// JSONL records (see [`PuzzleRecord`]).
    Jsonl,
    /// `Puzzle,Solution` CSV with `0` blanks.
    Csv,
}

impl Format {
    /// The format implied by the file extension: `.jsonl`/`.json` -> JSONL, `.csv` -> CSV,
    /// anything else -> lines.
    pub fn detect(path: &Path) -> Format {
        match path
            .extension()
            .and_then(|e| e.to_str())
            .map(|e| e.to_ascii_lowercase())
            .as_deref()
        {
            Some("jsonl") | Some("json") => Format::Jsonl,
            Some("csv") => Format::Csv,
            _ => Format::Lines,
        }
    }
}

/// Options for [`load_file`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Skip bad lines (with a warning each and a count) instead of failing on the first one.
    pub lenient: bool,
    /// Force a format instead of detecting it from the extension.
    pub format: Option<Format>,
}

impl LoadOptions {
    /// Strict loading with the format detected from the extension.
    pub fn strict() -> LoadOptions {
        LoadOptions::default()
    }

    /// Lenient loading with the format detected from the extension.
    pub fn lenient() -> LoadOptions {
        LoadOptions {
            lenient: true,
            format: None,
        }
    }
}

/// The result of loading a file.
#[derive(Debug)]
pub struct Loaded {
    /// The puzzles, in file order.
    pub puzzles: Vec<Puzzle>,
    /// The errors of the lines skipped in lenient mode (empty in strict mode).
    pub skipped: Vec<LoadError>,
}

/// Loads all puzzles of a file strictly (the first bad line is an error).
pub fn load_puzzles(path: impl AsRef<Path>) -> Result<Vec<Puzzle>, LoadError> {
    Ok(load_file(path, LoadOptions::strict())?.puzzles)
}

/// Loads a puzzle file.
pub fn load_file(path: impl AsRef<Path>, opts: LoadOptions) -> Result<Loaded, LoadError> {
    let path = path.as_ref();
    let text = fs::read_to_string(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let format = opts.format.unwrap_or_else(|| Format::detect(path));
    parse_text(&text, path, format, opts.lenient)
}

/// Parses the content of a puzzle file; `path` is only used in error messages.
pub fn parse_text(
    text: &str,
    path: &Path,
    format: Format,
    lenient: bool,
) -> Result<Loaded, LoadError> {
    let mut puzzles = Vec::new();
    let mut skipped = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if format == Format::Csv && i == 0 && line.to_ascii_lowercase().starts_with("puzzle") {
            continue; // header
        }
        let result = match format {
            Format::Lines => parse_lines_line(line),
            Format::Jsonl => parse_jsonl_line(line),
            Format::Csv => parse_csv_line(line),
        };
        match result {
            Ok(p) => puzzles.push(p),
            Err(kind) => {
                let err = LoadError::Line {
                    path: path.to_path_buf(),
                    line: i + 1,
                    kind,
                };
                if !lenient {
                    return Err(err);
                }
                tracing::warn!("skipping {err}");
                skipped.push(err);
            }
        }
    }
    if !skipped.is_empty() {
        tracing::warn!(
            "{}: skipped {} bad lines, loaded {} puzzles",
            path.display(),
            skipped.len(),
            puzzles.len()
        );
    }
    if puzzles.is_empty() {
        return Err(LoadError::Empty {
            path: path.to_path_buf(),
            skipped: skipped.len(),
        });
    }
    Ok(Loaded { puzzles, skipped })
}

fn parse_lines_line(line: &str) -> Result<Puzzle, LineError> {
    let first = line.split_whitespace().next().unwrap_or(line);
    let board = Board::parse(first).map_err(LineError::Puzzle)?;
    Puzzle::from_board(board)
}

fn parse_jsonl_line(line: &str) -> Result<Puzzle, LineError> {
    let rec: PuzzleRecord =
        serde_json::from_str(line).map_err(|e| LineError::Json(e.to_string()))?;
    check_record(rec)
}

fn parse_csv_line(line: &str) -> Result<Puzzle, LineError> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let rec = match fields.as_slice() {
        [p] => PuzzleRecord {
            puzzle: p.to_string(),
            solution: None,
            n_givens: None,
            unique: None,
        },
        [p, s] => PuzzleRecord {
            puzzle: p.to_string(),
            solution: Some(s.to_string()),
            n_givens: None,
            unique: None,
        },
        _ => return Err(LineError::CsvFields(fields.len())),
    };
    check_record(rec)
}

/// Validates a record: parses both boards, solves the puzzle and checks the stated fields.
pub fn check_record(rec: PuzzleRecord) -> Result<Puzzle, LineError> {
    let puzzle = Board::parse(&rec.puzzle).map_err(LineError::Puzzle)?;
    let stated_solution = rec
        .solution
        .as_deref()
        .map(|s| Board::parse_shape(s, puzzle.shape()).map_err(LineError::Solution))
        .transpose()?;
    if let Some(sol) = &stated_solution
        && !puzzle.is_solved_by(sol)
    {
        return Err(LineError::SolutionMismatch);
    }
    if let Some(stated) = rec.n_givens
        && stated != puzzle.n_givens()
    {
        return Err(LineError::NGivensMismatch {
            stated,
            actual: puzzle.n_givens(),
        });
    }
    let solved = Puzzle::from_board(puzzle)?;
    if let Some(stated) = rec.unique
        && stated != solved.unique
    {
        return Err(LineError::UniqueMismatch {
            stated,
            actual: solved.unique,
        });
    }
    Ok(Puzzle {
        solution: stated_solution.unwrap_or(solved.solution),
        ..solved
    })
}

/// Writes puzzles as JSONL records (`{"puzzle","solution","n_givens","unique"}`).
pub fn write_jsonl(path: impl AsRef<Path>, puzzles: &[Puzzle]) -> std::io::Result<()> {
    let mut w = BufWriter::new(fs::File::create(path)?);
    for p in puzzles {
        serde_json::to_writer(&mut w, &p.to_record())?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str =
        "4...3.......6..8..........1....5..9..8....6...7.2........1.27..5.3....4.9........";
    const S: &str =
        "468931527751624839392578461134756298289413675675289314846192753513867942927345186";

    #[test]
    fn record_roundtrip() {
        let p = check_record(PuzzleRecord {
            puzzle: P.into(),
            solution: Some(S.into()),
            n_givens: Some(18),
            unique: Some(true),
        })
        .unwrap();
        let line = serde_json::to_string(&p.to_record()).unwrap();
        assert_eq!(
            line,
            format!(r#"{{"puzzle":"{P}","solution":"{S}","n_givens":18,"unique":true}}"#)
        );
        assert_eq!(parse_jsonl_line(&line).unwrap(), p);
    }

    #[test]
    fn format_detection() {
        assert_eq!(Format::detect(Path::new("a/b.JSONL")), Format::Jsonl);
        assert_eq!(Format::detect(Path::new("x.csv")), Format::Csv);
        assert_eq!(Format::detect(Path::new("x.txt")), Format::Lines);
        assert_eq!(Format::detect(Path::new("x")), Format::Lines);
    }
}
