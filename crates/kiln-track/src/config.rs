//! The `logging:` section of a recipe: which tracking sinks a run writes to and how they are set up.

use serde::{Deserialize, Serialize};

/// The `logging:` section of a recipe: which tracking sinks receive the per-step metrics.
///
/// Every sink is fed the same metrics (one row per training step), the resolved recipe as config, and the final
/// summary (last value of every metric).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// Write `<run dir>/metrics.jsonl`: one JSON object per step, `{"step": N, "<metric>": value, ...}` with keys
    /// sorted and each line flushed. Non-finite values are written as the bare tokens `NaN`, `Infinity` and
    /// `-Infinity` (the convention of JavaScript and of Python's `json` module, which reads them back).
    /// Default: true. `kiln report` reads this file.
    pub jsonl: bool,
    /// Write TensorBoard scalar event files into `<run dir>/tensorboard/` (`tensorboard --logdir runs/`).
    /// Default: false.
    pub tensorboard: bool,
    /// Weights & Biases: a genuine offline run directory (upload later with `wandb sync`) and, in online mode, live
    /// streaming to the W&B server. Default: disabled unless `WANDB_MODE` says otherwise.
    pub wandb: WandbConfig,
    /// At the end of the run, draw PNG + SVG curves of the metrics into `<run dir>/plots/` and write
    /// `<run dir>/report.md` (recipe summary, final metrics, plots), drawn from `metrics.jsonl` (so it needs
    /// `jsonl`). `kiln report RUN_DIR` redraws them at any time. Default: true.
    pub plots: bool,
    /// Progress lines on the console (through `tracing` at INFO level).
    pub console: ConsoleConfig,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            jsonl: true,
            tensorboard: false,
            wandb: WandbConfig::default(),
            plots: true,
            console: ConsoleConfig::default(),
        }
    }
}

/// Console progress lines.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// Print a progress line at all. Default: true.
    pub enabled: bool,
    /// Print every this many steps (and always the first step). Default: 10; 0 means only the first step.
    pub every: u64,
    /// Metric keys to show, in order; keys a step does not have are skipped. Default: empty, meaning a curated
    /// set (`reward/mean`, `kl/approx`, `entropy`, `loss/policy`, `clip_frac`, `response_len/mean`, `lr`, eval/*).
    pub keys: Vec<String>,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            enabled: true,
            every: 10,
            keys: Vec::new(),
        }
    }
}

/// Where W&B data goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WandbMode {
    /// No W&B output at all.
    Disabled,
    /// Only the offline run directory (`wandb sync <dir>` uploads it later).
    Offline,
    /// The offline run directory plus live streaming to `WANDB_BASE_URL` (needs `WANDB_API_KEY`).
    Online,
}

impl WandbMode {
    /// Parse a `WANDB_MODE` value (`online`/`run`, `offline`/`dryrun`, `disabled`), case-insensitively.
    pub fn parse(s: &str) -> Option<WandbMode> {
        match s.trim().to_ascii_lowercase().as_str() {
            "online" | "run" => Some(WandbMode::Online),
            "offline" | "dryrun" => Some(WandbMode::Offline),
            "disabled" | "off" | "false" => Some(WandbMode::Disabled),
            _ => None,
        }
    }
}

/// Weights & Biases settings. Every field left out falls back to its `WANDB_*` environment variable (named in each
/// field's doc), then to the default; a value given in the recipe overrides the environment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct WandbConfig {
    /// `disabled`, `offline` or `online` (env `WANDB_MODE`). Default: disabled. `online` without `WANDB_API_KEY`
    /// falls back to offline with a warning.
    pub mode: Option<WandbMode>,
    /// Project name (env `WANDB_PROJECT`). Default: `kiln`.
    pub project: Option<String>,
    /// Entity (user or team) (env `WANDB_ENTITY`). Default: the API key's default entity.
    pub entity: Option<String>,
    /// Display name of the run (env `WANDB_NAME`). Default: the kiln run name.
    pub name: Option<String>,
    /// Run group (env `WANDB_RUN_GROUP`). Default: none.
    pub group: Option<String>,
    /// Job type (env `WANDB_JOB_TYPE`). Default: `train`.
    pub job_type: Option<String>,
    /// Tags (env `WANDB_TAGS`, comma-separated). Default: none.
    pub tags: Option<Vec<String>>,
    /// Notes, a longer description of the run (env `WANDB_NOTES`). Default: none.
    pub notes: Option<String>,
    /// Run id, 8 characters of `[a-z0-9]` (env `WANDB_RUN_ID`). Default: random, kept in
    /// `<run dir>/wandb/kiln-run-id` so that a resumed run continues the same W&B run.
    pub run_id: Option<String>,
    /// Folder that receives `wandb/offline-run-*` (env `WANDB_DIR`). Default: the run directory.
    pub dir: Option<String>,
    /// Server URL (env `WANDB_BASE_URL`). Default: `https://api.wandb.ai`.
    pub base_url: Option<String>,
    /// Online mode: seconds between batches of history lines sent to the server. Default: 2.
    pub stream_interval_secs: Option<f64>,
    /// Online mode: how long the end of the run waits for the last batch to reach the server before giving up
    /// (the offline file is complete either way; `wandb sync` uploads it later). Default: 30.
    pub finish_timeout_secs: Option<f64>,
}
