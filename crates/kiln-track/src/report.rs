//! Run reports: `plots/` and `report.md` from a run directory's `metrics.jsonl` and `recipe.yaml`.
//!
//! Called by [`crate::Tracker::finish`] at the end of a run and by `kiln report RUN_DIR` at any time (also on a
//! run that is still going or crashed: a partial last line of `metrics.jsonl` is ignored).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::TrackError;
use crate::console::short;
use crate::jsonl::read_metrics;
use crate::plots::{PlotFile, key_stats, write_plots};

/// What [`write_report`] produced.
#[derive(Debug, Clone)]
pub struct Report {
    /// `<run_dir>/report.md`.
    pub report: PathBuf,
    /// The plots, in report order (paths relative to the run directory).
    pub plots: Vec<PlotFile>,
    /// Rows read from `metrics.jsonl`.
    pub rows: usize,
}

/// Most recipe settings listed in the report's summary table.
const MAX_RECIPE_ROWS: usize = 80;

/// Write `<run_dir>/plots/` and `<run_dir>/report.md` from `<run_dir>/metrics.jsonl` (and `recipe.yaml` when
/// present).
pub fn write_report(run_dir: &Path) -> Result<Report, TrackError> {
    let metrics = run_dir.join("metrics.jsonl");
    if !metrics.is_file() {
        return Err(TrackError::Config(format!(
            "{} has no metrics.jsonl: is it a kiln run directory (runs/<name>-<timestamp>/) with \
             logging.jsonl enabled?",
            run_dir.display()
        )));
    }
    let rows = read_metrics(&metrics)?;
    let recipe_path = run_dir.join("recipe.yaml");
    let recipe: Option<serde_json::Value> = std::fs::read_to_string(&recipe_path)
        .ok()
        .and_then(|t| serde_norway::from_str(&t).ok());

    // The recipe's `name` (empty means "the recipe file's name", which only the run directory
    // `<name>-<UTC time>` still carries), else the directory's name.
    let name = recipe
        .as_ref()
        .and_then(|r| r.get("name"))
        .and_then(|v| v.as_str())
        .filter(|n| !n.trim().is_empty())
        .map(str::to_string)
        .or_else(|| {
            run_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "run".into());
    let plots = write_plots(run_dir, &rows, &name)?;
    let mut md = String::new();
    let _ = writeln!(md, "# Run report: {}\n", md_escape(&name));
    let _ = writeln!(md, "- Run directory: `{}`", run_dir.display());
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let _ = writeln!(
            md,
            "- Steps: {} to {} ({} rows)",
            first.step,
            last.step,
            rows.len()
        );
    } else {
        let _ = writeln!(md, "- No metrics logged yet");
    }
    let _ = writeln!(
        md,
        "- Generated: {} by kiln-track {}\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M:%S UTC"),
        env!("CARGO_PKG_VERSION")
    );

    let _ = writeln!(md, "## Recipe\n");
    match &recipe {
        Some(r) => {
            let mut flat = Vec::new();
            flatten("", r, &mut flat);
            let _ = writeln!(md, "| setting | value |\n| --- | --- |");
            for (k, v) in flat.iter().take(MAX_RECIPE_ROWS) {
                let _ = writeln!(md, "| `{}` | {} |", k, md_escape(v));
            }
            if flat.len() > MAX_RECIPE_ROWS {
                let _ = writeln!(
                    md,
                    "\n({} more settings in `recipe.yaml`)",
                    flat.len() - MAX_RECIPE_ROWS
                );
            }
            let _ = writeln!(md);
        }
        None => {
            let _ = writeln!(md, "No readable `recipe.yaml` in the run directory.\n");
        }
    }

    let _ = writeln!(md, "## Final metrics\n");
    let stats = key_stats(&rows);
    if stats.is_empty() {
        let _ = writeln!(md, "No metrics.\n");
    } else {
        let _ = writeln!(
            md,
            "| metric | final | min | max | mean | non-finite |\n| --- | ---: | ---: | ---: | ---: | ---: |"
        );
        for key in crate::plots::plot_order(&rows) {
            let s = &stats[&key];
            let _ = writeln!(
                md,
                "| `{}` | {} | {} | {} | {} | {} |",
                key,
                short(s.last),
                fmt_opt(s.min),
                fmt_opt(s.max),
                fmt_opt(s.mean),
                s.non_finite
            );
        }
        let _ = writeln!(md);
    }

    if !plots.is_empty() {
        let _ = writeln!(md, "## Plots\n");
        for p in &plots {
            let _ = writeln!(
                md,
                "### {}\n\n![{}]({}) ([svg]({}))\n",
                md_escape(&p.key),
                md_escape(&p.key),
                p.png.display(),
                p.svg.display()
            );
        }
    }
    let report = run_dir.join("report.md");
    std::fs::write(&report, md).map_err(|e| TrackError::io(&report, e))?;
    Ok(Report {
        report,
        plots,
        rows: rows.len(),
    })
}

fn fmt_opt(v: f64) -> String {
    if v.is_finite() { short(v) } else { "-".into() }
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// Dotted paths of the scalar leaves of a recipe (`rl.lr: 3e-6`); short lists are shown inline.
fn flatten(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&p, v, out);
            }
        }
        serde_json::Value::Array(a) if a.iter().all(|x| !x.is_object() && !x.is_array()) => {
            let s = serde_json::to_string(a).unwrap_or_default();
            let s = if s.len() > 120 {
                format!(
                    "{}... ({} items)",
                    &s[..s.floor_char_boundary(100)],
                    a.len()
                )
            } else {
                s
            };
            out.push((prefix.to_string(), s));
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                flatten(&format!("{prefix}[{i}]"), v, out);
            }
        }
        serde_json::Value::String(s) => out.push((prefix.to_string(), s.clone())),
        other => out.push((prefix.to_string(), other.to_string())),
    }
}
