//! kiln-rl: the algorithm layer (group advantages, PPO-clip / GRPO / Dr.GRPO losses, KL
//! estimators, optimiser and LR schedule, the generic on-policy trainer loop, checkpoints).
//! Knows nothing of search or Sudoku: a task plugs in through [`trainer::RlTask`].

pub mod advantage;
pub mod checkpoint;
pub mod digest;
pub mod driver;
pub mod loss;
pub mod optim;
pub mod sampler;
#[cfg(feature = "sequence-task")]
pub mod sequence;
pub mod stats;
pub mod trainer;

pub use advantage::AdvantageEstimator;
pub use driver::{Context, Driver, PipelineError, Trained};
pub use loss::{KlEstimator, LossAgg, LossConfig};
pub use optim::{LrSchedule, OptimConfig};
pub use sampler::{EpochSampler, SamplerState};
pub use trainer::{
    MetricsSink, NullSink, RlTask, Rollout, Scored, TaskError, TrainSummary, Trainer,
    TrainerConfig, TrainerOptions,
};

/// Errors of the training loop.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The task failed (rollout, evaluation, state restore).
    #[error("task error: {0}")]
    Task(String),
    /// The task returned a malformed rollout batch (a bug in the task).
    #[error("invalid rollout batch: {0}")]
    InvalidRollout(String),
    /// Too many non-finite updates, or non-finite parameters at checkpoint time.
    #[error("non-finite values: {0}")]
    NonFinite(String),
    /// Reading or writing a checkpoint failed.
    #[error("checkpoint error: {0}")]
    Checkpoint(String),
}
