//! Run directories (`runs/<name>-<UTC timestamp>/`), device selection, the tracker adapter and the
//! console progress bar.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, bail};
use burn::tensor::Device;

use crate::config::{Backend, CommonConfig};

/// The resolved recipe file inside a run directory.
pub const RECIPE_FILE: &str = "recipe.yaml";

/// Create a fresh run directory `<output_dir>/<name>-<UTC timestamp>[-k]`.
pub fn create_run_dir(output_dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(output_dir)
        .with_context(|| format!("creating the output directory {}", output_dir.display()))?;
    let ts = chrono::Utc::now().format("%Y%m%dT%H%M%SZ");
    let safe: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    for k in 0..1000 {
        let dir = if k == 0 {
            output_dir.join(format!("{safe}-{ts}"))
        } else {
            output_dir.join(format!("{safe}-{ts}-{k}"))
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e).with_context(|| format!("creating {}", dir.display())),
        }
    }
    bail!(
        "could not create a unique run directory under {}",
        output_dir.display()
    )
}

/// Write the resolved recipe (every field, defaults included) into the run directory, atomically.
pub fn save_recipe(run_dir: &Path, resolved: &serde_json::Value) -> anyhow::Result<()> {
    let yaml = serde_norway::to_string(resolved).context("serialising the resolved recipe")?;
    let tmp = run_dir.join(".recipe.yaml.tmp");
    std::fs::write(&tmp, format!("# Resolved recipe written by kiln {}; `kiln train --resume {}` continues this run.\n{yaml}", env!("CARGO_PKG_VERSION"), run_dir.display()))
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, run_dir.join(RECIPE_FILE))
        .with_context(|| format!("writing {}", run_dir.join(RECIPE_FILE).display()))?;
    Ok(())
}

/// The burn device for `backend`, with autodiff when `train`.
pub fn device_for(backend: Backend) -> anyhow::Result<Device> {
    match backend {
        Backend::Cpu => Ok(Device::flex()),
        Backend::Cuda => {
            #[cfg(feature = "cuda")]
            {
                Ok(Device::cuda(0))
            }
            #[cfg(not(feature = "cuda"))]
            {
                bail!(
                    "this kiln binary was built without CUDA support; rebuild with \
                     `cargo build --release -p kiln-cli --features cuda` or set `backend: cpu` \
                     (`kiln doctor` shows what the machine has)"
                )
            }
        }
        Backend::Wgpu => {
            #[cfg(feature = "wgpu")]
            {
                Ok(Device::wgpu(Default::default()))
            }
            #[cfg(not(feature = "wgpu"))]
            {
                bail!(
                    "this kiln binary was built without wgpu support; rebuild with `just build-wgpu` \
                     (`cargo build --release -p kiln-cli --features wgpu`) or set `backend: cpu` \
                     (`kiln doctor` shows what the machine has)"
                )
            }
        }
    }
}

static PROGRESS: OnceLock<Mutex<Option<indicatif::ProgressBar>>> = OnceLock::new();

/// The run directory of the `kiln train` in progress, for the Ctrl-C handler.
static ACTIVE_RUN: OnceLock<Mutex<Option<PathBuf>>> = OnceLock::new();

/// Print the run directory and arm the Ctrl-C / SIGTERM handler: an interrupted `kiln train` says
/// where the run is and the command that continues it from its newest complete checkpoint
/// (checkpoints are written atomically, so stopping between two is safe), then exits with 130.
pub fn announce_run(run_dir: &Path, resumed: bool) {
    let verb = if resumed {
        "continuing"
    } else {
        "run directory"
    };
    eprintln!("{verb}: {}", run_dir.display());
    *ACTIVE_RUN
        .get_or_init(|| Mutex::new(None))
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(run_dir.to_path_buf());
    static ARMED: OnceLock<()> = OnceLock::new();
    ARMED.get_or_init(|| {
        if let Err(e) = ctrlc::set_handler(on_interrupt) {
            tracing::warn!(
                "no Ctrl-C handler ({e}); an interrupted run still resumes with --resume"
            );
        }
    });
}

/// The `kiln train --resume` command line of `run_dir`.
pub fn resume_command(run_dir: &Path) -> String {
    let p = run_dir.display().to_string();
    let quoted = if p
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_./".contains(c))
    {
        p
    } else {
        format!("'{}'", p.replace('\'', r"'\''"))
    };
    format!("kiln train --resume {quoted}")
}

fn on_interrupt() {
    if let Some(pb) = PROGRESS
        .get()
        .and_then(|m| m.lock().ok().and_then(|g| g.clone()))
    {
        pb.abandon();
    }
    let dir = ACTIVE_RUN
        .get()
        .and_then(|m| m.lock().ok().and_then(|g| g.clone()));
    match dir {
        Some(d) => eprintln!(
            "\ninterrupted: the run is in {}\ncontinue it from its newest checkpoint with:\n  {}",
            d.display(),
            resume_command(&d)
        ),
        None => eprintln!("\ninterrupted"),
    }
    std::process::exit(130);
}

/// Whether log lines on stderr may carry ANSI colours: stderr is a terminal and `NO_COLOR`
/// (<https://no-color.org>) is unset or empty.
pub fn stderr_colours() -> bool {
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    !no_color && std::io::stderr().is_terminal()
}

/// A progress bar on stderr (hidden when stderr is not a terminal); log lines are printed above it.
pub fn progress_bar(steps: u64) -> indicatif::ProgressBar {
    let pb = if std::io::stderr().is_terminal() {
        let pb = indicatif::ProgressBar::new(steps);
        pb.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} step {pos}/{len} [{bar:30}] {msg} | {elapsed} elapsed, ETA {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        pb
    } else {
        indicatif::ProgressBar::hidden()
    };
    *PROGRESS
        .get_or_init(|| Mutex::new(None))
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(pb.clone());
    pb
}

/// A stderr writer for tracing that suspends the progress bar while a line is written.
pub struct SuspendingStderr;

impl std::io::Write for SuspendingStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let guard = PROGRESS
            .get()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()));
        match guard.as_ref().and_then(|g| g.as_ref()) {
            Some(pb) if !pb.is_hidden() => pb.suspend(|| std::io::stderr().write(buf)),
            _ => std::io::stderr().write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// A metrics sink shared between the trainer and the command (which finishes the tracker).
pub struct SharedSink(pub std::sync::Arc<Mutex<Option<kiln_track::Tracker>>>);

impl kiln_rl::MetricsSink for SharedSink {
    fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        if let Some(t) = self.0.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            t.log(step, metrics);
        }
    }
}

/// Run name: the recipe's `name`, else the recipe file stem, else the task.
pub fn run_name(common: &CommonConfig, recipe_path: Option<&Path>) -> String {
    if !common.name.is_empty() {
        return common.name.clone();
    }
    recipe_path
        .and_then(|p| p.file_stem())
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| common.task.clone())
}
