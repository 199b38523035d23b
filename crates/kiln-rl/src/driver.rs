//! The seam between a task's pipeline and the program that runs it.
//!
//! A pipeline (kiln-sas's chain, kiln-search's training) builds its [`RlTask`] and initial policy,
//! then hands them to a [`Driver`]; the driver owns everything that is the program's business
//! rather than the method's: the trainer options of the run, resuming from the newest checkpoint,
//! the experiment trackers, the progress bar and the printed summary. kiln-cli implements it;
//! tests can implement it with a plain [`crate::Trainer`] and a [`crate::NullSink`].

use burn::tensor::Device;

use crate::{RlTask, TaskError, TrainSummary};

/// A trained policy and the figures of its run.
pub struct Trained<P> {
    /// The policy after the last step (on the training, autodiff, device).
    pub policy: P,
    /// Steps, last metrics, last evaluation, wall time.
    pub summary: TrainSummary,
}

/// Runs kiln-rl's trainer for a pipeline.
pub trait Driver {
    /// Train `policy` (on the autodiff `device`) on `task` for the run's configured steps,
    /// continuing the run's newest checkpoint when the run is resumed; returns the trained policy.
    fn train<T: RlTask>(
        &mut self,
        task: T,
        policy: T::Policy,
        device: Device,
    ) -> Result<Trained<T::Policy>, TaskError>;

    /// A progress bar of `len` steps for a supervised stage of the pipeline (a warm start); the
    /// binary's draws on the terminal, the default draws nothing.
    fn progress_bar(&mut self, len: u64) -> indicatif::ProgressBar {
        let _ = len;
        indicatif::ProgressBar::hidden()
    }
}

/// An error of a task pipeline (loading data, a model, a checkpoint; training; writing a report):
/// which step failed and, after `: `, why (the cause's own message and its sources).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct PipelineError(pub String);

impl PipelineError {
    /// An error with this message.
    pub fn msg(msg: impl std::fmt::Display) -> PipelineError {
        PipelineError(msg.to_string())
    }
}

impl From<TaskError> for PipelineError {
    fn from(e: TaskError) -> PipelineError {
        PipelineError(e.to_string())
    }
}

impl From<std::io::Error> for PipelineError {
    fn from(e: std::io::Error) -> PipelineError {
        PipelineError(e.to_string())
    }
}

impl From<serde_json::Error> for PipelineError {
    fn from(e: serde_json::Error) -> PipelineError {
        PipelineError(e.to_string())
    }
}

impl From<crate::TrainError> for PipelineError {
    fn from(e: crate::TrainError) -> PipelineError {
        PipelineError(e.to_string())
    }
}

/// `what: cause: its source: ...` of an error and its chain of sources.
fn chain(what: impl std::fmt::Display, e: &dyn std::error::Error) -> String {
    let mut s = format!("{what}: {e}");
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// Says which pipeline step an error (or a missing value) comes from.
pub trait Context<T> {
    /// Prefix the error with `what`.
    fn context(self, what: impl std::fmt::Display) -> Result<T, PipelineError>;
    /// Prefix the error with `what()` (evaluated only on error).
    fn with_context<D: std::fmt::Display>(
        self,
        what: impl FnOnce() -> D,
    ) -> Result<T, PipelineError>;
}

impl<T, E: std::error::Error> Context<T> for Result<T, E> {
    fn context(self, what: impl std::fmt::Display) -> Result<T, PipelineError> {
        self.map_err(|e| PipelineError(chain(what, &e)))
    }
    fn with_context<D: std::fmt::Display>(
        self,
        what: impl FnOnce() -> D,
    ) -> Result<T, PipelineError> {
        self.map_err(|e| PipelineError(chain(what(), &e)))
    }
}

impl<T> Context<T> for Option<T> {
    fn context(self, what: impl std::fmt::Display) -> Result<T, PipelineError> {
        self.ok_or_else(|| PipelineError(what.to_string()))
    }
    fn with_context<D: std::fmt::Display>(
        self,
        what: impl FnOnce() -> D,
    ) -> Result<T, PipelineError> {
        self.ok_or_else(|| PipelineError(what().to_string()))
    }
}
