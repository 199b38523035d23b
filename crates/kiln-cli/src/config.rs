//! The recipe fields every task shares (top level of a recipe), and their validation.

use std::path::PathBuf;

use kiln_rl::{LossConfig, OptimConfig, TrainerConfig};
use kiln_track::LoggingConfig;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::recipe::{RawRecipe, RecipeError};

/// Compute backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// burn-flex, the pure-Rust CPU backend (SIMD + rayon). The default: fastest measured CPU backend.
    #[default]
    Cpu,
    /// burn-cuda on GPU 0 (build with `--features cuda`).
    Cuda,
    /// burn-wgpu on the default adapter: Vulkan / Metal / DX12, or Mesa lavapipe on CPU
    /// (build with `--features wgpu`, or `just build-wgpu`).
    Wgpu,
}

/// Top-level recipe fields shared by every task.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct CommonConfig {
    /// The task this recipe runs (`kiln recipes` lists the tasks).
    pub task: String,
    /// One-line description shown by `kiln recipes`.
    pub description: String,
    /// Run name; the run directory is `<output_dir>/<name>-<UTC timestamp>`. Empty = the recipe's
    /// file name.
    pub name: String,
    /// Seed of every random number generator of the run (model init, rollouts, data order). A run
    /// with the same seed on the same backend is reproducible.
    pub seed: u64,
    /// Compute backend: cpu | cuda | wgpu.
    pub backend: Backend,
    /// Parent directory of run directories.
    pub output_dir: PathBuf,
    /// The on-policy loop.
    pub trainer: TrainerConfig,
    /// Advantage estimator and policy loss (PPO-clip, KL, entropy).
    pub algorithm: LossConfig,
    /// AdamW and the learning-rate schedule.
    pub optim: OptimConfig,
    /// Experiment tracking sinks (JSONL, Weights & Biases, TensorBoard, plots).
    pub logging: LoggingConfig,
}

impl Default for CommonConfig {
    fn default() -> Self {
        Self {
            task: String::new(),
            description: String::new(),
            name: String::new(),
            seed: 0,
            backend: Backend::Cpu,
            output_dir: PathBuf::from("runs"),
            trainer: TrainerConfig::default(),
            algorithm: LossConfig::default(),
            optim: OptimConfig::default(),
            logging: LoggingConfig::default(),
        }
    }
}

/// Collects range errors with their recipe locations.
pub struct Checker<'a> {
    raw: &'a RawRecipe,
}

impl<'a> Checker<'a> {
    /// A checker over `raw` (used for error locations).
    pub fn new(raw: &'a RawRecipe) -> Self {
        Self { raw }
    }

    /// Fail with `msg` at `path` unless `ok`.
    pub fn require(&self, ok: bool, path: &str, msg: impl Into<String>) -> Result<(), RecipeError> {
        if ok {
            Ok(())
        } else {
            Err(RecipeError::Invalid {
                at: self.raw.origin(path),
                path: path.to_string(),
                msg: msg.into(),
            })
        }
    }

    /// `value` must be finite and > 0.
    pub fn positive(&self, value: f64, path: &str) -> Result<(), RecipeError> {
        self.require(
            value.is_finite() && value > 0.0,
            path,
            format!("must be a positive number, got {value}"),
        )
    }

    /// `value` must be finite and >= 0.
    pub fn non_negative(&self, value: f64, path: &str) -> Result<(), RecipeError> {
        self.require(
            value.is_finite() && value >= 0.0,
            path,
            format!("must be >= 0, got {value}"),
        )
    }

    /// `lo <= value <= hi`.
    pub fn in_range(&self, value: f64, lo: f64, hi: f64, path: &str) -> Result<(), RecipeError> {
        self.require(
            value.is_finite() && value >= lo && value <= hi,
            path,
            format!("must be in [{lo}, {hi}], got {value}"),
        )
    }
}

impl CommonConfig {
    /// Range checks of the shared fields.
    pub fn validate(&self, raw: &RawRecipe) -> Result<(), RecipeError> {
        let c = Checker::new(raw);
        let t = &self.trainer;
        c.require(t.steps >= 1, "trainer.steps", "must be >= 1")?;
        c.require(t.ppo_epochs >= 1, "trainer.ppo_epochs", "must be >= 1")?;
        c.require(
            t.keep_checkpoints >= 1,
            "trainer.keep_checkpoints",
            "must be >= 1 (the newest checkpoint is always kept)",
        )?;
        c.require(
            t.max_nonfinite_updates >= 1,
            "trainer.max_nonfinite_updates",
            "must be >= 1",
        )?;
        let o = &self.optim;
        c.positive(o.lr, "optim.lr")?;
        c.require(
            o.beta1.is_finite() && (0.0..1.0).contains(&o.beta1),
            "optim.beta1",
            format!("must be in [0, 1), got {}", o.beta1),
        )?;
        c.require(
            o.beta2.is_finite() && (0.0..1.0).contains(&o.beta2),
            "optim.beta2",
            format!("must be in [0, 1), got {}", o.beta2),
        )?;
        c.positive(o.eps, "optim.eps")?;
        c.non_negative(o.weight_decay, "optim.weight_decay")?;
        c.non_negative(o.max_grad_norm, "optim.max_grad_norm")?;
        c.in_range(o.warmup_ratio, 0.0, 1.0, "optim.warmup_ratio")?;
        c.in_range(o.min_lr_ratio, 0.0, 1.0, "optim.min_lr_ratio")?;
        let a = &self.algorithm;
        c.require(
            a.clip_eps.is_finite() && a.clip_eps > 0.0 && a.clip_eps < 1.0,
            "algorithm.clip_eps",
            format!("must be in (0, 1), got {}", a.clip_eps),
        )?;
        c.positive(a.clip_eps_high, "algorithm.clip_eps_high")?;
        c.non_negative(a.kl_beta, "algorithm.kl_beta")?;
        c.require(
            a.entropy_coef.is_finite(),
            "algorithm.entropy_coef",
            "must be a finite number",
        )?;
        c.require(
            !self.output_dir.as_os_str().is_empty(),
            "output_dir",
            "must not be empty",
        )?;
        Ok(())
    }
}
