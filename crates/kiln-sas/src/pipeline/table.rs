//! The evaluation table at the end of a `sas` run and of `kiln eval`: every schedule of
//! `final_eval` decoded on each held-out set ([`crate::eval::run_schedules`]), the stage-2
//! denoiser's rows (`<schedule>+stage2`), board / cell accuracy with bootstrap CIs, the markdown
//! table, a JSON report per set and (optionally) the unmasking-order image.

use std::path::{Path, PathBuf};

use kiln_rl::{Context, PipelineError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::denoiser::SudokuDenoiser;
use crate::eval::{ScheduleOutcome, draw_orders, markdown, report, run_schedules};
use crate::policy::OrderPolicy;
use crate::schedule::{DecodeConfig, Schedule};
use crate::sudoku::{LoadOptions, Puzzle, PuzzleSetConfig, load_file};

type Result<T> = std::result::Result<T, PipelineError>;

/// One held-out evaluation set.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct EvalSetConfig {
    /// Label in the tables.
    pub name: String,
    /// A puzzle file (81-char lines, JSONL with solutions, or the 4x4 CSV); empty = generate.
    pub path: PathBuf,
    /// Generated puzzles (used when `path` is empty); use a seed no training set uses.
    pub generated: PuzzleSetConfig,
    /// Use at most this many puzzles (0 = all).
    pub limit: usize,
    /// Schedules decoded on this set (empty = `final_eval.schedules`); lets a large, slow set
    /// run only the rows that matter (e.g. random, the best heuristic and learned).
    pub schedules: Vec<Schedule>,
}

impl Default for EvalSetConfig {
    fn default() -> Self {
        Self {
            name: "generated".into(),
            path: PathBuf::new(),
            generated: PuzzleSetConfig {
                count: 1000,
                givens: vec![30],
                seed: 303,
                ..Default::default()
            },
            limit: 0,
            schedules: Vec::new(),
        }
    }
}

impl EvalSetConfig {
    /// The set's puzzles (generated or read), truncated to `limit`.
    pub fn load(&self) -> Result<Vec<Puzzle>> {
        let mut ps = if self.path.as_os_str().is_empty() {
            self.generated.load().map_err(PipelineError::msg)?
        } else {
            let l = load_file(&self.path, LoadOptions::strict())
                .with_context(|| format!("loading evaluation set `{}`", self.name))?;
            l.puzzles
        };
        if self.limit > 0 {
            ps.truncate(self.limit);
        }
        Ok(ps)
    }
}

/// The evaluation table at the end of a `sas` run (and of `kiln eval`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct FinalEvalConfig {
    /// Held-out sets (the paper's protocol: 1,000 generated puzzles plus magictour_top1465).
    pub sets: Vec<EvalSetConfig>,
    /// Schedules in the table (`learned` = the trained policy).
    pub schedules: Vec<Schedule>,
    /// Schedules also run with the stage-2 denoiser (rows `<schedule>+stage2`).
    pub stage2_schedules: Vec<Schedule>,
    /// Decoding protocol of the table.
    pub decode: DecodeConfig,
    /// Puzzles drawn in the unmasking-order image (0 = no image).
    pub image_puzzles: usize,
    /// Seed of the random schedule and of the bootstrap.
    pub seed: u64,
}

impl Default for FinalEvalConfig {
    fn default() -> Self {
        Self {
            sets: vec![
                EvalSetConfig::default(),
                EvalSetConfig {
                    name: "magictour_top1465".into(),
                    path: PathBuf::from("../shared/datasets/sudoku/magictour_top1465.jsonl"),
                    ..Default::default()
                },
            ],
            schedules: vec![
                Schedule::Random,
                Schedule::LeftToRight,
                Schedule::Expert,
                Schedule::Confidence,
                Schedule::Margin,
                Schedule::Entropy,
                Schedule::Learned,
            ],
            stage2_schedules: vec![Schedule::Margin, Schedule::Confidence, Schedule::Learned],
            decode: DecodeConfig::default(),
            image_puzzles: 3,
            seed: 7,
        }
    }
}

/// Run the evaluation table of `fe`, print it and write it to `out_dir`.
pub fn final_eval(
    fe: &FinalEvalConfig,
    denoiser: &SudokuDenoiser,
    policy: &OrderPolicy,
    stage2: Option<&SudokuDenoiser>,
    out_dir: &Path,
) -> Result<()> {
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut all_md = String::new();
    for set in &fe.sets {
        let puzzles = set.load()?;
        if puzzles.is_empty() {
            tracing::warn!("evaluation set `{}` is empty; skipped", set.name);
            continue;
        }
        let t = std::time::Instant::now();
        let schedules = if set.schedules.is_empty() {
            &fe.schedules
        } else {
            &set.schedules
        };
        let mut outcomes = run_schedules(
            denoiser,
            Some(policy),
            &puzzles,
            schedules,
            &fe.decode,
            fe.seed,
        );
        if let Some(d2) = stage2 {
            // Stage 2: the fine-tuned denoiser under the learned order and the best heuristics.
            let s2: Vec<Schedule> = fe
                .stage2_schedules
                .iter()
                .copied()
                .filter(|s| *s != Schedule::Random && schedules.contains(s))
                .collect();
            for mut o in run_schedules(d2, Some(policy), &puzzles, &s2, &fe.decode, fe.seed) {
                o.schedule = format!("{}+stage2", o.schedule);
                outcomes.push(o);
            }
        }
        let rep = report(&set.name, &outcomes, &fe.decode, fe.seed);
        let md = markdown(&rep);
        println!("\n{md}(evaluated in {:.0}s)", t.elapsed().as_secs_f64());
        all_md.push_str(&md);
        all_md.push('\n');
        let safe: String = set
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let jp = out_dir.join(format!("sudoku-{safe}.json"));
        let json = serde_json::json!({
            "report": rep,
            "outcomes": outcomes,
        });
        std::fs::write(&jp, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", jp.display()))?;
        if fe.image_puzzles > 0 {
            let pick: Vec<&ScheduleOutcome> = outcomes
                .iter()
                .filter(|o| {
                    ["expert", "margin", "learned", "learned+stage2"].contains(&o.schedule.as_str())
                })
                .collect();
            let png = out_dir.join(format!("orders-{safe}.png"));
            let n = fe.image_puzzles.min(puzzles.len());
            match draw_orders(&png, &puzzles[..n], &pick) {
                Ok(()) => println!("unmasking orders: {}", png.display()),
                Err(e) => tracing::warn!("could not draw {}: {e}", png.display()),
            }
        }
    }
    let mp = out_dir.join("sudoku.md");
    std::fs::write(&mp, &all_md).with_context(|| format!("writing {}", mp.display()))?;
    println!("tables: {}", mp.display());
    Ok(())
}
