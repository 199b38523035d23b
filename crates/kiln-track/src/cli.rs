//! Command-line entry points wired into the `kiln` binary (`kiln report RUN_DIR`).

use std::path::PathBuf;

use crate::TrackError;

/// Errors of the tracking commands.
pub type CliError = TrackError;

/// `kiln report RUN_DIR`: (re)draw `plots/` and write `report.md` from a run directory's `metrics.jsonl` and
/// `recipe.yaml`. Works on finished, running and crashed runs.
#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// The run directory (`runs/<name>-<timestamp>/`).
    pub run_dir: PathBuf,
}

/// Run `kiln report`.
pub fn run_report(args: ReportArgs) -> Result<(), CliError> {
    let r = crate::report::write_report(&args.run_dir)?;
    println!(
        "{} ({} rows, {} plots in {})",
        r.report.display(),
        r.rows,
        r.plots.len(),
        args.run_dir.join("plots").display()
    );
    Ok(())
}
