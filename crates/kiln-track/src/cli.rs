//! Command-line entry points wired into the `kiln` binary (`kiln report RUN_DIR`).

use std::path::PathBuf;

/// Errors of the tracking commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command is not available in this build yet.
    #[error("`kiln {0}` is not available yet in this build")]
    Unavailable(&'static str),
}

/// `kiln report RUN_DIR`: plots and a report of a run directory.
#[derive(clap::Args, Debug)]
pub struct ReportArgs {
    /// The run directory (`runs/<name>-<timestamp>/`).
    pub run_dir: PathBuf,
}

/// Run `kiln report`.
pub fn run_report(_args: ReportArgs) -> Result<(), CliError> {
    Err(CliError::Unavailable("report"))
}
