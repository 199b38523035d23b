//! kiln-track: experiment tracking (Weights & Biases offline/online, TensorBoard, JSONL, console),
//! plots and run reports.
//!
//! The trainer opens one [`Tracker`] per run with the recipe's [`LoggingConfig`] and feeds it one row of metrics
//! per step; the tracker fans the row out to every enabled sink. Logging never fails training: a sink that errors
//! is reported once (`tracing::warn`) and then skipped. [`Tracker::finish`] writes the summary and exit records,
//! closes the files and draws `plots/` and `report.md`; dropping a tracker without finishing it (an error or a
//! panic in the trainer) still closes every sink with a non-zero exit code.

pub mod cli;
pub mod config;
mod console;
pub mod jsonl;
pub mod plots;
pub mod report;
pub mod tensorboard;
pub mod wandb;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub use config::{ConsoleConfig, LoggingConfig, WandbConfig, WandbMode};
pub use jsonl::{MetricsRow, read_metrics};

/// Errors of the tracking sinks, plots and reports.
#[derive(Debug, thiserror::Error)]
pub enum TrackError {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A line of a data file is malformed.
    #[error("{}:{line}: {msg}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        msg: String,
    },
    /// A setting is invalid.
    #[error("invalid logging setting: {0}")]
    Config(String),
    /// Drawing a plot failed.
    #[error("plot {}: {msg}", path.display())]
    Plot {
        /// The output file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// The W&B server could not be reached or answered an error.
    #[error("W&B server: {0}")]
    Http(String),
}

impl TrackError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> TrackError {
        TrackError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What the trainer tells the tracker about the run.
#[derive(Debug, Clone, Copy)]
pub struct RunInfo<'a> {
    /// The run directory (`runs/<name>-<timestamp>/`); created if missing.
    pub run_dir: &'a Path,
    /// The run name (W&B display name unless the recipe sets one).
    pub name: &'a str,
    /// The resolved recipe, logged as the run's config.
    pub config: &'a serde_json::Value,
    /// `Some(step)` when resuming from a checkpoint at `step`: logs after that step are discarded and continued.
    pub resume_from_step: Option<u64>,
}

/// One step's row, as given to every sink.
pub(crate) struct Row<'a> {
    pub step: u64,
    pub metrics: &'a BTreeMap<String, f64>,
    /// Seconds since the tracker opened (plus the runtime of the run being resumed, if any).
    pub runtime: f64,
    /// Unix time in seconds.
    pub timestamp: f64,
}

/// The end of a run, as given to every sink.
pub(crate) struct End {
    pub exit_code: i32,
    pub runtime: f64,
}

/// A tracking sink.
pub(crate) trait Sink: Send {
    /// Short name for warnings (`jsonl`, `wandb`, `tensorboard`).
    fn name(&self) -> &'static str;
    fn log(&mut self, row: &Row<'_>) -> Result<(), TrackError>;
    fn finish(&mut self, end: &End) -> Result<(), TrackError>;
}

impl Sink for jsonl::JsonlSink {
    fn name(&self) -> &'static str {
        "jsonl"
    }
    fn log(&mut self, row: &Row<'_>) -> Result<(), TrackError> {
        jsonl::JsonlSink::log(self, row.step, row.metrics)
    }
    fn finish(&mut self, _end: &End) -> Result<(), TrackError> {
        jsonl::JsonlSink::finish(self)
    }
}

struct Slot {
    sink: Box<dyn Sink>,
    /// Set after the first error: the sink is skipped from then on.
    failed: bool,
}

/// The run's tracker: fans each step's metrics out to the enabled sinks.
pub struct Tracker {
    run_dir: PathBuf,
    sinks: Vec<Slot>,
    console: console::Console,
    plots: bool,
    started: Instant,
    summary: BTreeMap<String, f64>,
    finished: bool,
}

impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker")
            .field("run_dir", &self.run_dir)
            .field(
                "sinks",
                &self.sinks.iter().map(|s| s.sink.name()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

pub(crate) fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Tracker {
    /// Open every sink the config enables. Fails only on local problems (the run directory or a file cannot be
    /// created, an invalid setting); network problems of W&B online mode never fail here.
    pub fn open(cfg: &LoggingConfig, info: RunInfo<'_>) -> Result<Tracker, TrackError> {
        Self::open_with_env(cfg, info, &|k| std::env::var(k).ok())
    }

    /// [`Tracker::open`] with the `WANDB_*` environment looked up through `env` instead of the process
    /// environment (for tests, or a CLI that takes these settings from elsewhere).
    pub fn open_with_env(
        cfg: &LoggingConfig,
        info: RunInfo<'_>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Tracker, TrackError> {
        std::fs::create_dir_all(info.run_dir).map_err(|e| TrackError::io(info.run_dir, e))?;
        let mut sinks: Vec<Slot> = Vec::new();
        if cfg.jsonl {
            sinks.push(Slot {
                sink: Box::new(jsonl::JsonlSink::open(info.run_dir, info.resume_from_step)?),
                failed: false,
            });
        }
        if cfg.tensorboard {
            sinks.push(Slot {
                sink: Box::new(tensorboard::TensorBoardSink::open(info.run_dir)?),
                failed: false,
            });
        }
        let ws = wandb::WandbSettings::resolve(&cfg.wandb, info.run_dir, info.name, env)?;
        if ws.mode != WandbMode::Disabled {
            sinks.push(Slot {
                sink: Box::new(wandb::WandbSink::open(
                    &ws,
                    info.run_dir,
                    info.config,
                    info.resume_from_step,
                )?),
                failed: false,
            });
        }
        Ok(Tracker {
            run_dir: info.run_dir.to_path_buf(),
            sinks,
            console: console::Console::new(&cfg.console),
            plots: cfg.plots,
            started: Instant::now(),
            summary: BTreeMap::new(),
            finished: false,
        })
    }

    /// The run directory.
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    /// Log one row of metrics for `step`. Never fails: a sink error is warned about once and that sink is then
    /// skipped for the rest of the run.
    pub fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        let runtime = self.started.elapsed().as_secs_f64();
        let timestamp = unix_now();
        let row = Row {
            step,
            metrics,
            runtime,
            timestamp,
        };
        for slot in self.sinks.iter_mut().filter(|s| !s.failed) {
            if let Err(e) = slot.sink.log(&row) {
                slot.failed = true;
                tracing::warn!(
                    "tracking sink `{}` failed and is disabled for the rest of this run: {e}",
                    slot.sink.name()
                );
            }
        }
        for (k, v) in metrics {
            self.summary.insert(k.clone(), *v);
        }
        self.summary.insert("_step".into(), step as f64);
        self.summary.insert("_runtime".into(), runtime);
        self.summary.insert("_timestamp".into(), timestamp);
        self.console.log(step, metrics);
    }

    /// The last value logged for every metric key.
    pub fn summary(&self) -> &BTreeMap<String, f64> {
        &self.summary
    }

    /// Finish the run: summary and exit records, close the files, then draw `plots/` and `report.md` (when
    /// `plots` is enabled). Returns the first error of a sink; a plot error is only warned about.
    pub fn finish(mut self, exit_code: i32) -> Result<(), TrackError> {
        let res = self.close(exit_code);
        if self.plots {
            match report::write_report(&self.run_dir) {
                Ok(r) => tracing::info!("report: {} ({} plots)", r.report.display(), r.plots.len()),
                Err(e) => tracing::warn!(
                    "could not write plots/report for {}: {e}",
                    self.run_dir.display()
                ),
            }
        }
        res
    }

    fn close(&mut self, exit_code: i32) -> Result<(), TrackError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        let end = End {
            exit_code,
            runtime: self.started.elapsed().as_secs_f64(),
        };
        let mut first_err = None;
        for slot in self.sinks.iter_mut().filter(|s| !s.failed) {
            if let Err(e) = slot.sink.finish(&end) {
                tracing::warn!("tracking sink `{}` failed to finish: {e}", slot.sink.name());
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        if !self.finished {
            // The trainer returned an error or panicked: still close every sink, with a non-zero exit code.
            let _ = self.close(1);
        }
    }
}

// The trainer may hand the tracker to another thread (e.g. behind an `Arc<Mutex<Option<Tracker>>>`).
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<Tracker>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    struct Failing(Arc<Mutex<(usize, usize)>>);

    impl Sink for Failing {
        fn name(&self) -> &'static str {
            "failing"
        }
        fn log(&mut self, _row: &Row<'_>) -> Result<(), TrackError> {
            self.0.lock().unwrap().0 += 1;
            Err(TrackError::Http("disk on fire".into()))
        }
        fn finish(&mut self, _end: &End) -> Result<(), TrackError> {
            self.0.lock().unwrap().1 += 1;
            Ok(())
        }
    }

    #[test]
    fn a_failing_sink_is_warned_about_once_and_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let calls = Arc::new(Mutex::new((0, 0)));
        let logs = Arc::new(Mutex::new(Vec::<u8>::new()));
        #[derive(Clone)]
        struct W(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for W {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let w = W(logs.clone());
        let sub = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::with_default(sub, || {
            let cfg = LoggingConfig {
                plots: false,
                ..LoggingConfig::default()
            };
            let mut t = Tracker::open(
                &cfg,
                RunInfo {
                    run_dir: dir.path(),
                    name: "t",
                    config: &serde_json::Value::Null,
                    resume_from_step: None,
                },
            )
            .unwrap();
            t.sinks.push(Slot {
                sink: Box::new(Failing(calls.clone())),
                failed: false,
            });
            for step in 1..=20 {
                t.log(step, &BTreeMap::from([("x".to_string(), step as f64)]));
            }
            t.finish(0).unwrap();
        });
        assert_eq!(
            *calls.lock().unwrap(),
            (1, 0),
            "called once, then skipped (not finished either)"
        );
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
        assert_eq!(text.matches("`failing` failed").count(), 1, "{text}");
        // the healthy JSONL sink kept every row
        assert_eq!(
            read_metrics(&dir.path().join("metrics.jsonl"))
                .unwrap()
                .len(),
            20
        );
    }
}
