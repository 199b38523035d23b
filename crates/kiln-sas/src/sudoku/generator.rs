//! Seeded generator of Sudoku puzzles with a unique solution, and the on-disk dataset cache.
//!
//! Puzzle `i` of a dataset is generated from its own ChaCha8 stream (seed = `params.seed`,
//! stream = `i`), so a dataset does not depend on the number of threads, and the first `n`
//! puzzles of a larger dataset equal a dataset of `n`.
//!
//! One attempt: draw a random complete grid (randomised solver on an empty board), visit the
//! cells in random order and blank each one if the puzzle keeps a unique solution (and, with
//! `max_difficulty` below `search`, stays solvable by the allowed singles), until
//! `givens` givens are left. The attempt fails if the givens cannot be reduced that far or the
//! final puzzle is easier than `min_difficulty`; then a new grid is drawn, up to
//! `max_attempts` times.
//!
//! [`load_or_generate`] caches datasets as JSONL under `datasets/cache/sudoku/<hash>.jsonl`,
//! where `<hash>` is a stable hash of the parameters and [`GENERATOR_VERSION`].

use std::fs;
use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::board::Shape;
use super::dataset::{LoadError, Puzzle, load_puzzles, write_jsonl};
use super::expert::{Difficulty, grade};
use super::solver::{has_unique_solution, random_solution};

/// Bumped whenever the generator's output for given parameters changes; part of the cache key.
pub const GENERATOR_VERSION: u32 = 1;

/// Environment variable that overrides the cache directory of [`load_or_generate`].
pub const CACHE_DIR_ENV: &str = "KILN_SUDOKU_CACHE";

/// Parameters of a generated dataset.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenParams {
    /// Board shape, serialized as the side length (`4` or `9`).
    #[serde(default = "default_shape")]
    pub shape: Shape,
    /// Number of puzzles.
    pub count: usize,
    /// Base seed; puzzle `i` uses ChaCha8 stream `i` of this seed.
    #[serde(default)]
    pub seed: u64,
    /// Exact number of givens of every puzzle (e.g. 30 for 9x9; the known minimum for a unique
    /// 9x9 puzzle is 17 and below ~22 the generator rarely succeeds; 4 for 4x4).
    pub givens: usize,
    /// The easiest technique mix accepted (e.g. `search` to require a search step).
    #[serde(default = "default_min")]
    pub min_difficulty: Difficulty,
    /// The hardest technique mix accepted (e.g. `hidden_singles` for singles-only puzzles).
    #[serde(default = "default_max")]
    pub max_difficulty: Difficulty,
    /// Fresh grids tried per puzzle before giving up.
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
}

fn default_shape() -> Shape {
    Shape::NINE
}
fn default_min() -> Difficulty {
    Difficulty::NakedSingles
}
fn default_max() -> Difficulty {
    Difficulty::Search
}
fn default_attempts() -> u32 {
    200
}

impl GenParams {
    /// `count` 9x9 puzzles with `givens` givens, any difficulty, from `seed`.
    pub fn new(count: usize, givens: usize, seed: u64) -> GenParams {
        GenParams {
            shape: Shape::NINE,
            count,
            seed,
            givens,
            min_difficulty: default_min(),
            max_difficulty: default_max(),
            max_attempts: default_attempts(),
        }
    }

    /// Checks the parameters.
    pub fn validate(&self) -> Result<(), GenerateError> {
        let bad = |m: String| Err(GenerateError::InvalidParams(m));
        if self.givens > self.shape.n_cells() {
            return bad(format!(
                "givens = {} exceeds the {} cells of a {} board",
                self.givens,
                self.shape.n_cells(),
                self.shape
            ));
        }
        if self.min_difficulty > self.max_difficulty {
            return bad(format!(
                "min_difficulty {:?} is harder than max_difficulty {:?}",
                self.min_difficulty, self.max_difficulty
            ));
        }
        if self.max_attempts == 0 {
            return bad("max_attempts must be at least 1".into());
        }
        Ok(())
    }

    /// A stable 64-bit hash of the parameters and [`GENERATOR_VERSION`], as 16 hex digits.
    pub fn cache_key(&self) -> String {
        // FNV-1a over the canonical JSON: stable across Rust versions and platforms, unlike
        // std's DefaultHasher; a cryptographic hash is not needed for a cache key.
        let json = serde_json::to_string(&(GENERATOR_VERSION, self)).expect("params serialize");
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in json.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        format!("{h:016x}")
    }
}

/// Why generation failed.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The parameters are inconsistent.
    #[error("invalid Sudoku generator parameters: {0}")]
    InvalidParams(String),
    /// No puzzle met the constraints within `max_attempts` grids.
    #[error(
        "puzzle {index}: no {shape} puzzle with {givens} givens and difficulty {min:?}..={max:?} found in {attempts} attempts (fewest givens reached: {best}); raise `givens`, widen the difficulty range or raise `max_attempts`"
    )]
    Unreachable {
        /// Index of the puzzle in the dataset.
        index: usize,
        /// Board shape.
        shape: Shape,
        /// Requested givens.
        givens: usize,
        /// Requested minimum difficulty.
        min: Difficulty,
        /// Requested maximum difficulty.
        max: Difficulty,
        /// Attempts made.
        attempts: u32,
        /// Fewest givens any attempt reached.
        best: usize,
    },
    /// The cache could not be written.
    #[error("cannot write the Sudoku dataset cache {}: {source}", path.display())]
    CacheWrite {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Generates puzzle `index` of the dataset described by `params`.
pub fn generate_one(params: &GenParams, index: usize) -> Result<Puzzle, GenerateError> {
    params.validate()?;
    let mut rng = ChaCha8Rng::seed_from_u64(params.seed);
    rng.set_stream(index as u64);
    let mut best = usize::MAX;
    for _ in 0..params.max_attempts {
        match attempt(params, &mut rng) {
            Ok(p) => return Ok(p),
            Err(reached) => best = best.min(reached),
        }
    }
    Err(GenerateError::Unreachable {
        index,
        shape: params.shape,
        givens: params.givens,
        min: params.min_difficulty,
        max: params.max_difficulty,
        attempts: params.max_attempts,
        best,
    })
}

/// One attempt; `Err(givens reached)` on failure.
fn attempt<R: Rng>(params: &GenParams, rng: &mut R) -> Result<Puzzle, usize> {
    let shape = params.shape;
    let solution = random_solution(shape, rng);
    let mut order: Vec<usize> = (0..shape.n_cells()).collect();
    order.shuffle(rng);
    let mut puzzle = solution.clone();
    let mut givens = shape.n_cells();
    for &cell in &order {
        if givens == params.givens {
            break;
        }
        let candidate = puzzle.with_cleared(cell);
        let ok = if params.max_difficulty < Difficulty::Search {
            // Solvable by singles alone implies a unique solution.
            grade(&candidate, &solution).is_ok_and(|d| d <= params.max_difficulty)
        } else {
            has_unique_solution(&candidate)
        };
        if ok {
            puzzle = candidate;
            givens -= 1;
        }
    }
    if givens != params.givens {
        return Err(givens);
    }
    match grade(&puzzle, &solution) {
        Ok(d) if d >= params.min_difficulty && d <= params.max_difficulty => Ok(Puzzle {
            puzzle,
            solution,
            unique: true,
        }),
        _ => Err(givens),
    }
}

/// Generates the whole dataset, in parallel on rayon's pool; the result is independent of the
/// number of threads.
pub fn generate(params: &GenParams) -> Result<Vec<Puzzle>, GenerateError> {
    params.validate()?;
    (0..params.count)
        .into_par_iter()
        .map(|i| generate_one(params, i))
        .collect()
}

/// The cache directory: `$KILN_SUDOKU_CACHE` if set, else `datasets/cache/sudoku` under the
/// current directory (the repository root when run through `just`/`kiln`).
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os(CACHE_DIR_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("datasets/cache/sudoku"))
}

/// The cache file of `params` in `cache_dir`: `<cache_dir>/<params.cache_key()>.jsonl`.
pub fn cache_path(params: &GenParams, cache_dir: &Path) -> PathBuf {
    cache_dir.join(format!("{}.jsonl", params.cache_key()))
}

/// [`load_or_generate_in`] with [`default_cache_dir`].
pub fn load_or_generate(params: &GenParams) -> Result<Vec<Puzzle>, GenerateError> {
    load_or_generate_in(params, &default_cache_dir())
}

/// Loads the dataset from `cache_dir` if it is cached and intact, else generates it and writes
/// `<key>.jsonl` plus `<key>.params.json` (the parameters, for humans) atomically.
pub fn load_or_generate_in(
    params: &GenParams,
    cache_dir: &Path,
) -> Result<Vec<Puzzle>, GenerateError> {
    params.validate()?;
    if params.count == 0 {
        return Ok(Vec::new());
    }
    let path = cache_path(params, cache_dir);
    if path.exists() {
        match load_cached(&path, params) {
            Ok(puzzles) => {
                tracing::debug!(
                    "loaded {} Sudoku puzzles from {}",
                    puzzles.len(),
                    path.display()
                );
                return Ok(puzzles);
            }
            Err(e) => tracing::warn!("regenerating the Sudoku dataset cache: {e}"),
        }
    }
    let start = std::time::Instant::now();
    let puzzles = generate(params)?;
    tracing::info!(
        "generated {} Sudoku puzzles ({} givens) in {:.2}s -> {}",
        puzzles.len(),
        params.givens,
        start.elapsed().as_secs_f64(),
        path.display()
    );
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| GenerateError::CacheWrite { path: p, source }
    };
    fs::create_dir_all(cache_dir).map_err(io(cache_dir))?;
    let tmp = cache_dir.join(format!(
        ".{}.{}.tmp",
        params.cache_key(),
        std::process::id()
    ));
    write_jsonl(&tmp, &puzzles).map_err(io(&tmp))?;
    fs::rename(&tmp, &path).map_err(io(&path))?;
    let meta = cache_dir.join(format!("{}.params.json", params.cache_key()));
    let json = serde_json::to_string_pretty(&serde_json::json!({
        "generator_version": GENERATOR_VERSION,
        "params": params,
    }))
    .expect("params serialize");
    fs::write(&meta, json + "\n").map_err(io(&meta))?;
    Ok(puzzles)
}

#[derive(Debug, thiserror::Error)]
enum CacheError {
    #[error(transparent)]
    Load(#[from] LoadError),
    #[error("{path}: holds {found} puzzles, expected {expected} {shape} puzzles with {givens} givens", path = .path.display())]
    Mismatch {
        path: PathBuf,
        found: usize,
        expected: usize,
        shape: Shape,
        givens: usize,
    },
}

fn load_cached(path: &Path, params: &GenParams) -> Result<Vec<Puzzle>, CacheError> {
    let puzzles = load_puzzles(path)?;
    let fits =
        |p: &Puzzle| p.puzzle.shape() == params.shape && p.n_givens() == params.givens && p.unique;
    if puzzles.len() != params.count || !puzzles.iter().all(fits) {
        return Err(CacheError::Mismatch {
            path: path.to_path_buf(),
            found: puzzles.len(),
            expected: params.count,
            shape: params.shape,
            givens: params.givens,
        });
    }
    Ok(puzzles)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_is_stable_and_sensitive() {
        let p = GenParams::new(10, 30, 7);
        assert_eq!(p.cache_key(), p.clone().cache_key());
        assert_ne!(p.cache_key(), GenParams::new(10, 30, 8).cache_key());
        assert_eq!(p.cache_key().len(), 16);
    }

    #[test]
    fn params_from_json_with_defaults() {
        let p: GenParams = serde_json::from_str(r#"{"count": 5, "givens": 30}"#).unwrap();
        assert_eq!(p, GenParams::new(5, 30, 0));
        let p: GenParams = serde_json::from_str(
            r#"{"shape": 4, "count": 5, "givens": 6, "max_difficulty": "hidden_singles"}"#,
        )
        .unwrap();
        assert_eq!(p.shape, Shape::FOUR);
        assert!(
            serde_json::from_str::<GenParams>(r#"{"count": 5, "givens": 30, "x": 1}"#).is_err()
        );
    }

    #[test]
    fn invalid_params() {
        let mut p = GenParams::new(1, 90, 0);
        assert!(matches!(p.validate(), Err(GenerateError::InvalidParams(_))));
        p.givens = 30;
        p.min_difficulty = Difficulty::Search;
        p.max_difficulty = Difficulty::HiddenSingles;
        assert!(matches!(generate(&p), Err(GenerateError::InvalidParams(_))));
    }
}
