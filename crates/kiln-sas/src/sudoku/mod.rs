//! Sudoku for the SAS experiments (METHODS, SAS).
//!
//! - [`Board`] / [`Shape`]: 4x4 (2x2 boxes) and 9x9 (3x3 boxes) boards, parsing with clear errors;
//! - [`solve`]: bitmask solver with propagation and MRV search, counting solutions up to 2;
//! - [`expert_order`]: the human-style fill order (naked singles, hidden singles, search) and
//!   the [`Difficulty`] grade;
//! - [`generate`] / [`load_or_generate`]: seeded generator of unique-solution puzzles, cached
//!   as JSONL under `datasets/cache/sudoku/`;
//! - [`load_file`]: loaders for 81-char lines, JSONL with solutions and the 4x4 CSV;
//! - [`tokens`]: the token encoding for the denoiser and Kendall tau between orders;
//! - [`PuzzleSetConfig`]: a recipe's generated puzzle sets; [`Symmetry`]: the board symmetries
//!   that augment denoiser training.

mod board;
mod dataset;
mod expert;
mod generator;
mod sets;
mod solver;
mod symmetry;
pub mod tokens;

pub use board::{Board, BoardError, Shape, UnitKind};
pub use dataset::{
    Format, LineError, LoadError, LoadOptions, Loaded, Puzzle, PuzzleRecord, check_record,
    load_file, load_puzzles, parse_text, write_jsonl,
};
pub use expert::{
    Difficulty, ExpertError, ExpertOrder, Fill, Technique, expert_order, expert_order_solving,
    grade,
};
pub use generator::{
    CACHE_DIR_ENV, GENERATOR_VERSION, GenParams, GenerateError, cache_path, default_cache_dir,
    generate, generate_one, load_or_generate, load_or_generate_in,
};
pub use sets::{PuzzleSetConfig, check_puzzle_set};
pub use solver::{
    Solution, count_solutions, has_unique_solution, random_solution, solve, solve_with_limit,
};
pub use symmetry::Symmetry;
