//! kiln-rl: the algorithm layer (group advantages, PPO-clip / GRPO / Dr.GRPO losses, KL
//! estimators, optimiser and LR schedule, the generic on-policy trainer loop, checkpoints).
//! Knows nothing of search or Sudoku: a task plugs in through [`trainer::RlTask`].

pub mod advantage;
pub mod checkpoint;
pub mod digest;
pub mod driver;
pub mod dynamic;
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
    /// The policy ratio did not start at 1: the training log-probs of the actions differ from the
    /// ones they were sampled with (a task that scores another distribution than it samples).
    #[error(
        "policy ratio check failed at step {step} for task `{task}`: max |log p(train) - log p({against})| \
         = {diff:.3e} over the policy tokens, above trainer.ratio_tolerance = {tolerance:.1e}. The \
         gradient would be that of another distribution; check that the task re-scores its actions with \
         the sampling settings (temperature, no top-k/top-p) and the exact token ids it sampled \
         (set trainer.ratio_tolerance: 0 to turn the check off)"
    )]
    RatioCheck {
        /// [`crate::RlTask::name`].
        task: String,
        /// The step.
        step: u64,
        /// What the training log-probs were compared with (`sampling` or `the rollout snapshot`).
        against: &'static str,
        /// The largest absolute log-prob difference.
        diff: f64,
        /// The tolerance.
        tolerance: f64,
    },
}
