//! Sudoku evaluation of a denoiser under every schedule: board and cell accuracy with 95%
//! bootstrap confidence intervals, Kendall tau-b of each schedule's reveal order against the
//! expert order, paired bootstrap CIs of accuracy differences (learned vs best heuristic), the
//! markdown table, and a PNG of the unmasking order of a few puzzles.

use std::path::Path;

use crate::denoiser::SudokuDenoiser;
use kiln_rl::stats::{Bootstrap, Quantile, paired_bootstrap_ci};
use plotters::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::policy::OrderPolicy;
use crate::schedule::{DecodeConfig, Decoded, Schedule, decode};
use crate::sudoku::Puzzle;
use crate::sudoku::tokens::kendall_tau_b;

/// Bootstrap resamples of the confidence intervals.
pub const BOOTSTRAP_SAMPLES: usize = 2000;

pub use kiln_rl::stats::Ci;

/// The tables' bootstrap: 95% level, [`BOOTSTRAP_SAMPLES`] resamples, nearest-rank percentiles.
fn boot(seed: u64) -> Bootstrap {
    Bootstrap {
        resamples: BOOTSTRAP_SAMPLES,
        level: 0.95,
        seed,
        quantile: Quantile::Nearest,
    }
}

/// 95% percentile bootstrap CI of the mean of `values` (seeded, so reports are reproducible).
pub fn bootstrap_ci(values: &[f64], seed: u64) -> Ci {
    kiln_rl::stats::bootstrap_ci(values, &boot(seed))
}

/// Paired bootstrap CI of `mean(a - b)` (the same puzzles under two schedules); `None` when the
/// two schedules were not run on the same number of puzzles.
pub fn paired_diff_ci(a: &[f64], b: &[f64], seed: u64) -> Option<Ci> {
    paired_bootstrap_ci(a, b, &boot(seed)).ok()
}

/// Per-puzzle outcomes of one schedule.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScheduleOutcome {
    /// Schedule name.
    pub schedule: String,
    /// 1.0 where the whole board is right.
    pub board: Vec<f64>,
    /// Share of blank cells right, per puzzle.
    pub cell: Vec<f64>,
    /// Kendall tau-b of the reveal steps against the expert order, per puzzle (NaN if undefined).
    pub tau: Vec<f64>,
    /// The decodings (not serialized).
    #[serde(skip)]
    pub decoded: Vec<Decoded>,
}

/// One table row.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// Schedule name.
    pub schedule: String,
    /// Board accuracy.
    pub board_acc: Ci,
    /// Cell accuracy (blank cells).
    pub cell_acc: Ci,
    /// Mean Kendall tau-b vs the expert order.
    pub tau_expert: f64,
}

/// A dataset's evaluation: rows per schedule plus the learned-vs-best-heuristic comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Dataset label.
    pub dataset: String,
    /// Puzzles.
    pub n: usize,
    /// Decoding protocol.
    pub decode: DecodeConfig,
    /// One row per schedule.
    pub rows: Vec<Row>,
    /// The model-confidence heuristic with the best board accuracy.
    pub best_heuristic: Option<String>,
    /// Board accuracy of learned minus best heuristic (paired bootstrap CI), when both exist.
    pub learned_minus_best: Option<Ci>,
    /// Board accuracy of `learned+stage2` minus `learned` (paired bootstrap CI), when both exist.
    #[serde(default)]
    pub stage2_minus_learned: Option<Ci>,
}

/// Decode `puzzles` with each of `schedules` and collect per-puzzle outcomes.
pub fn run_schedules(
    denoiser: &SudokuDenoiser,
    policy: Option<&OrderPolicy>,
    puzzles: &[Puzzle],
    schedules: &[Schedule],
    cfg: &DecodeConfig,
    seed: u64,
) -> Vec<ScheduleOutcome> {
    let expert: Vec<Vec<Option<usize>>> = puzzles
        .iter()
        .map(|p| {
            p.expert_order()
                .map(|o| o.step_of_cell(p.puzzle.cells().len()))
                .unwrap_or_default()
        })
        .collect();
    let mut out = Vec::new();
    for &s in schedules {
        if s == Schedule::Learned && policy.is_none() {
            continue;
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let t = std::time::Instant::now();
        let dec = decode(denoiser, puzzles, s, cfg, policy, &mut rng);
        tracing::info!(
            "decoded {} puzzles with {s} in {:.1}s",
            puzzles.len(),
            t.elapsed().as_secs_f64()
        );
        let mut o = ScheduleOutcome {
            schedule: s.name().to_string(),
            board: Vec::new(),
            cell: Vec::new(),
            tau: Vec::new(),
            decoded: Vec::new(),
        };
        for ((d, p), e) in dec.iter().zip(puzzles).zip(&expert) {
            o.board.push(d.board_correct(p) as u8 as f64);
            let (h, n) = d.cell_hits(p);
            o.cell.push(h as f64 / n.max(1) as f64);
            let (mut x, mut y) = (Vec::new(), Vec::new());
            for (a, b) in d.step_of_cell.iter().zip(e) {
                if let (Some(a), Some(b)) = (a, b) {
                    x.push(*a as f64);
                    y.push(*b as f64);
                }
            }
            o.tau.push(kendall_tau_b(&x, &y).unwrap_or(f64::NAN));
        }
        o.decoded = dec;
        out.push(o);
    }
    out
}

/// Summarise outcomes into a [`Report`].
pub fn report(
    dataset: &str,
    outcomes: &[ScheduleOutcome],
    cfg: &DecodeConfig,
    seed: u64,
) -> Report {
    let rows: Vec<Row> = outcomes
        .iter()
        .map(|o| {
            let taus: Vec<f64> = o.tau.iter().copied().filter(|t| t.is_finite()).collect();
            Row {
                schedule: o.schedule.clone(),
                board_acc: bootstrap_ci(&o.board, seed),
                cell_acc: bootstrap_ci(&o.cell, seed + 1),
                tau_expert: taus.iter().sum::<f64>() / taus.len().max(1) as f64,
            }
        })
        .collect();
    let best = outcomes
        .iter()
        .filter(|o| {
            o.schedule
                .parse::<Schedule>()
                .is_ok_and(Schedule::is_model_heuristic)
        })
        .max_by(|a, b| {
            let ma = a.board.iter().sum::<f64>() + 1e-6 * a.cell.iter().sum::<f64>();
            let mb = b.board.iter().sum::<f64>() + 1e-6 * b.cell.iter().sum::<f64>();
            ma.total_cmp(&mb)
        });
    let learned = outcomes.iter().find(|o| o.schedule == "learned");
    let learned_minus_best = match (learned, best) {
        (Some(l), Some(b)) => paired_diff_ci(&l.board, &b.board, seed + 2),
        _ => None,
    };
    let stage2 = outcomes.iter().find(|o| o.schedule == "learned+stage2");
    let stage2_minus_learned = match (stage2, learned) {
        (Some(s), Some(l)) => paired_diff_ci(&s.board, &l.board, seed + 3),
        _ => None,
    };
    Report {
        stage2_minus_learned,
        dataset: dataset.to_string(),
        n: outcomes.first().map_or(0, |o| o.board.len()),
        decode: cfg.clone(),
        rows,
        best_heuristic: best.map(|b| b.schedule.clone()),
        learned_minus_best,
    }
}

fn pct(c: &Ci) -> String {
    format!(
        "{:.1}% [{:.1}, {:.1}]",
        100.0 * c.mean,
        100.0 * c.lo,
        100.0 * c.hi
    )
}

/// The report as a markdown table (plus the learned-vs-best line).
pub fn markdown(r: &Report) -> String {
    let mut s = format!(
        "{} ({} puzzles; {} cell(s) per step, block length {}; greedy digits; 95% bootstrap CIs)\n\n",
        r.dataset,
        r.n,
        r.decode.per_step,
        if r.decode.block_len == 0 {
            "none".to_string()
        } else {
            r.decode.block_len.to_string()
        }
    );
    s.push_str("| schedule | board accuracy | cell accuracy | Kendall tau vs expert |\n");
    s.push_str("|---|---|---|---|\n");
    for row in &r.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.3} |\n",
            row.schedule,
            pct(&row.board_acc),
            pct(&row.cell_acc),
            row.tau_expert
        ));
    }
    let diff_line = |label: &str, better: &str, d: &Ci| {
        format!(
            "{label}, board accuracy: {:+.1} points, 95% CI [{:+.1}, {:+.1}]{}\n",
            100.0 * d.mean,
            100.0 * d.lo,
            100.0 * d.hi,
            if d.lo > 0.0 {
                format!(" (excludes 0: {better} is better)")
            } else if d.hi < 0.0 {
                format!(" (excludes 0: {better} is worse)")
            } else {
                " (includes 0)".to_string()
            }
        )
    };
    if let (Some(b), Some(d)) = (&r.best_heuristic, &r.learned_minus_best) {
        s.push('\n');
        s.push_str(&diff_line(
            &format!("learned - best heuristic ({b})"),
            "learned",
            d,
        ));
    }
    if let Some(d) = &r.stage2_minus_learned {
        s.push_str(&diff_line("learned+stage2 - learned", "stage 2", d));
    }
    s
}

/// Draw the unmasking order of `puzzles` (rows) under each outcome (columns) into a PNG:
/// givens grey, blank cells coloured by the step at which they were revealed (dark = early,
/// yellow = late), with the decoded digit, red outline where it is wrong.
pub fn draw_orders(
    path: &Path,
    puzzles: &[Puzzle],
    outcomes: &[&ScheduleOutcome],
) -> Result<(), String> {
    let rows = puzzles.len().min(4);
    let cols = outcomes.len();
    if rows == 0 || cols == 0 {
        return Err("nothing to draw".into());
    }
    register_fonts();
    let side = puzzles[0].puzzle.shape().side();
    let cell = 26i32;
    let pad = 30i32;
    let panel = cell * side as i32;
    let w = (cols as i32 * (panel + pad) + pad) as u32;
    let h = (rows as i32 * (panel + pad) + pad) as u32;
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let title = ("sans-serif", 14).into_font();
    let digit_font = ("sans-serif", 14).into_font();
    for (c, o) in outcomes.iter().enumerate() {
        let x0 = pad + c as i32 * (panel + pad);
        root.draw(&Text::new(o.schedule.clone(), (x0, 8), title.clone()))
            .map_err(|e| e.to_string())?;
        for (r, p) in puzzles.iter().take(rows).enumerate() {
            let y0 = pad + r as i32 * (panel + pad);
            let Some(d) = o.decoded.get(r) else { continue };
            let max_step = d.steps.max(1) as f64;
            for i in 0..side * side {
                let (rr, cc) = ((i / side) as i32, (i % side) as i32);
                let (x, y) = (x0 + cc * cell, y0 + rr * cell);
                let color = match d.step_of_cell[i] {
                    None => RGBColor(200, 200, 200),
                    Some(s) => viridis(s as f64 / max_step),
                };
                root.draw(&Rectangle::new(
                    [(x, y), (x + cell, y + cell)],
                    color.filled(),
                ))
                .map_err(|e| e.to_string())?;
                let wrong = p.puzzle.cells()[i] == 0 && d.cells[i] != p.solution.cells()[i];
                let border = if wrong {
                    RED.stroke_width(2)
                } else {
                    WHITE.stroke_width(1)
                };
                root.draw(&Rectangle::new([(x, y), (x + cell, y + cell)], border))
                    .map_err(|e| e.to_string())?;
                let txt_color = match d.step_of_cell[i] {
                    Some(s) if (s as f64 / max_step) > 0.6 => BLACK,
                    Some(_) => WHITE,
                    None => BLACK,
                };
                root.draw(&Text::new(
                    d.cells[i].to_string(),
                    (x + cell / 2 - 4, y + cell / 2 - 7),
                    digit_font.clone().color(&txt_color),
                ))
                .map_err(|e| e.to_string())?;
            }
            // Box lines.
            let b = puzzles[0].puzzle.shape().box_size() as i32;
            for k in 0..=side as i32 / b {
                let off = k * b * cell;
                root.draw(&PathElement::new(
                    vec![(x0 + off, y0), (x0 + off, y0 + panel)],
                    BLACK.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?;
                root.draw(&PathElement::new(
                    vec![(x0, y0 + off), (x0 + panel, y0 + off)],
                    BLACK.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?;
            }
        }
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

fn register_fonts() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        );
    });
}

/// A viridis-like colour ramp for `t` in [0, 1].
fn viridis(t: f64) -> RGBColor {
    let stops = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = t.clamp(0.0, 1.0) * (stops.len() - 1) as f64;
    let i = (t.floor() as usize).min(stops.len() - 2);
    let f = t - i as f64;
    let (a, b) = (stops[i], stops[i + 1]);
    let mix = |x: f64, y: f64| (x + (y - x) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_ci_brackets_the_mean() {
        let v: Vec<f64> = (0..200).map(|i| (i % 4 == 0) as u8 as f64).collect();
        let c = bootstrap_ci(&v, 1);
        assert!((c.mean - 0.25).abs() < 1e-12);
        assert!(c.lo < 0.25 && c.hi > 0.25);
        // Binomial standard error ~ 0.031: the 95% CI half-width is about 0.06.
        assert!((c.hi - c.lo) > 0.08 && (c.hi - c.lo) < 0.16, "{c:?}");
        let d = paired_diff_ci(&v, &v, 1).unwrap();
        assert_eq!((d.mean, d.lo, d.hi), (0.0, 0.0, 0.0));
    }

    fn outcome(name: &str, board: Vec<f64>) -> ScheduleOutcome {
        ScheduleOutcome {
            schedule: name.into(),
            cell: board.clone(),
            tau: vec![f64::NAN; board.len()],
            board,
            decoded: Vec::new(),
        }
    }

    #[test]
    fn report_compares_learned_with_the_best_heuristic_and_stage2_with_learned() {
        // 100 puzzles: margin solves 50, confidence 40, learned the 50 of margin plus 20 more,
        // learned+stage2 10 fewer than learned.
        let b = |k: usize| -> Vec<f64> { (0..100).map(|i| (i < k) as u8 as f64).collect() };
        let outs = vec![
            outcome("random", b(0)),
            outcome("confidence", b(40)),
            outcome("margin", b(50)),
            outcome("learned", b(70)),
            outcome("learned+stage2", b(60)),
        ];
        let r = report("set", &outs, &DecodeConfig::default(), 3);
        assert_eq!(r.best_heuristic.as_deref(), Some("margin"));
        let d = r.learned_minus_best.unwrap();
        assert!((d.mean - 0.2).abs() < 1e-12 && d.lo > 0.0, "{d:?}");
        let d2 = r.stage2_minus_learned.unwrap();
        assert!((d2.mean + 0.1).abs() < 1e-12 && d2.hi < 0.0, "{d2:?}");
        let md = markdown(&r);
        assert!(
            md.contains("learned - best heuristic (margin), board accuracy: +20.0 points"),
            "{md}"
        );
        assert!(md.contains("(excludes 0: learned is better)"), "{md}");
        assert!(
            md.contains("learned+stage2 - learned, board accuracy: -10.0 points"),
            "{md}"
        );
        assert!(md.contains("(excludes 0: stage 2 is worse)"), "{md}");
        // Without a stage-2 row there is no stage-2 line.
        let r = report("set", &outs[..4], &DecodeConfig::default(), 3);
        assert!(r.stage2_minus_learned.is_none());
        assert!(!markdown(&r).contains("stage2"));
    }
}
