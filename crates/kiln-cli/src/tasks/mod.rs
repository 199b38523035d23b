//! The task table: what `task:` values exist, their recipe schemas, and how `kiln train` /
//! `kiln eval` hand a validated recipe to the task's own crate.
//!
//! A task is one [`CliTask`] impl (its name, its recipe type and schema, the located range checks
//! of that recipe, and two calls into the task crate's pipeline for train and eval) plus one line
//! in [`TASKS`]. Everything else here is the binary's part of a run, shared by every task: the
//! run directory, the device of `backend:`, and [`Run`], the [`kiln_rl::Driver`] that runs
//! kiln-rl's trainer with the run's trackers, progress bar, resume and printed summary.

pub mod grpo_sequence;
pub mod sas;
pub mod search;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use burn::tensor::Device;
use kiln_rl::checkpoint::CheckpointManager;
use kiln_rl::{RlTask, TaskError, Trained, Trainer, TrainerOptions};
use schemars::JsonSchema;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::config::CommonConfig;
use crate::recipe::{RawRecipe, RecipeError, schema_of};
use crate::run;

/// One task of the binary: its recipe and how it trains and evaluates.
pub trait CliTask: Sync {
    /// The task-specific recipe fields (next to [`CommonConfig`]'s shared ones).
    type Recipe: DeserializeOwned + Serialize + JsonSchema;
    /// The `task:` value.
    fn name(&self) -> &'static str;
    /// One line for `kiln recipes`.
    fn summary(&self) -> &'static str;
    /// Range checks of the task fields, located in the recipe.
    fn validate(&self, recipe: &Self::Recipe, raw: &RawRecipe) -> Result<(), RecipeError>;
    /// `kiln train`: run the task's pipeline in `run`'s directory.
    fn train(&self, recipe: &Self::Recipe, run: &mut Run<'_>) -> anyhow::Result<()>;
    /// `kiln eval` of a checkpoint of one of this task's runs.
    fn eval(&self, recipe: &Self::Recipe, at: &EvalAt<'_>)
    -> anyhow::Result<BTreeMap<String, f64>>;
    /// A run of this task that has no checkpoints of its own may take its policy from another
    /// run (a `sas` stage-2 run's `stage2.policy_from`); `None` otherwise.
    fn policy_from(&self, _recipe: &Self::Recipe) -> Option<PathBuf> {
        None
    }
}

/// Every task the binary knows, in the order `kiln recipes` lists them.
pub static TASKS: &[&dyn Task] = &[
    &grpo_sequence::GrpoSequence,
    &sas::MdmSudoku,
    &sas::Sas,
    &search::SearchR2,
    &sas::SasGsm8k,
];

/// A [`CliTask`] seen without its recipe type (what [`TASKS`] holds).
pub trait Task: Sync {
    /// The `task:` value.
    fn name(&self) -> &'static str;
    /// One line for `kiln recipes`.
    fn summary(&self) -> &'static str;
    /// JSON schemas of the recipe (shared fields, task fields).
    fn schemas(&self) -> Vec<schemars::Schema>;
    /// Parse and check `raw` completely; the resolved recipe (defaults included) as JSON.
    fn validate(&self, raw: &RawRecipe) -> Result<serde_json::Value, RecipeError>;
    /// `kiln train`; returns the run directory.
    fn train(&self, req: &TrainRequest) -> anyhow::Result<PathBuf>;
    /// `kiln eval` of checkpoint `ckpt` of the run `run_dir` whose recipe is `raw`.
    fn eval(
        &self,
        raw: &RawRecipe,
        req: &EvalRequest,
        ckpt: &Path,
        run_dir: &Path,
    ) -> anyhow::Result<BTreeMap<String, f64>>;
    /// See [`CliTask::policy_from`].
    fn policy_from(&self, raw: &RawRecipe) -> Result<Option<PathBuf>, RecipeError>;
}

impl<T: CliTask> Task for T {
    fn name(&self) -> &'static str {
        CliTask::name(self)
    }
    fn summary(&self) -> &'static str {
        CliTask::summary(self)
    }
    fn schemas(&self) -> Vec<schemars::Schema> {
        vec![schema_of::<CommonConfig>(), schema_of::<T::Recipe>()]
    }
    fn validate(&self, raw: &RawRecipe) -> Result<serde_json::Value, RecipeError> {
        Ok(load(self, raw)?.resolved)
    }
    fn train(&self, req: &TrainRequest) -> anyhow::Result<PathBuf> {
        let l = load(self, &req.raw)?;
        let (run_dir, resume) = prepare_run_dir(req, &l.common, &l.resolved)?;
        run::announce_run(&run_dir, resume);
        let mut run = Run {
            common: &l.common,
            resolved: &l.resolved,
            run_dir: &run_dir,
            resume,
            recipe_saved: std::cell::Cell::new(!resume),
        };
        CliTask::train(self, &l.task, &mut run)?;
        run.save_resumed_recipe()?;
        Ok(run_dir)
    }
    fn eval(
        &self,
        raw: &RawRecipe,
        req: &EvalRequest,
        ckpt: &Path,
        run_dir: &Path,
    ) -> anyhow::Result<BTreeMap<String, f64>> {
        let l = load(self, raw)?;
        let at = EvalAt {
            req,
            common: &l.common,
            ckpt,
            run_dir,
        };
        CliTask::eval(self, &l.task, &at)
    }
    fn policy_from(&self, raw: &RawRecipe) -> Result<Option<PathBuf>, RecipeError> {
        Ok(CliTask::policy_from(self, &load(self, raw)?.task))
    }
}

/// The task named `name`.
pub fn find(name: &str) -> Option<&'static dyn Task> {
    TASKS.iter().copied().find(|t| t.name() == name)
}

/// JSON schemas of the recipe of `task` (common fields + task fields).
pub fn schemas(task: &str) -> Option<Vec<schemars::Schema>> {
    find(task).map(|t| t.schemas())
}

/// Resolve the task of `raw` and check its keys.
pub fn check_task(raw: &RawRecipe) -> Result<&'static dyn Task, RecipeError> {
    let task = raw.task()?;
    let Some(found) = find(&task) else {
        let names: Vec<&str> = TASKS.iter().map(|t| t.name()).collect();
        let best = names
            .iter()
            .map(|n| (strsim::jaro_winkler(&task, n), n))
            .filter(|(s, _)| *s > 0.7)
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .map(|(_, n)| format!(" (did you mean `{n}`?)"))
            .unwrap_or_default();
        return Err(RecipeError::Task {
            at: raw.origin("task"),
            msg: format!(
                "unknown task `{task}`{best}; known tasks: {}",
                names.join(", ")
            ),
        });
    };
    let schemas = found.schemas();
    raw.check_keys(&schemas)?;
    crate::resources::check(raw, &schemas)?;
    Ok(found)
}

/// A fully parsed and validated recipe.
pub struct Loaded<T> {
    /// Shared fields.
    pub common: CommonConfig,
    /// Task fields.
    pub task: T,
    /// The resolved recipe (all fields, defaults included) as JSON.
    pub resolved: serde_json::Value,
}

fn load<T: CliTask>(task: &T, raw: &RawRecipe) -> Result<Loaded<T::Recipe>, RecipeError> {
    let common: CommonConfig = raw.deserialize()?;
    common.validate(raw)?;
    let recipe: T::Recipe = raw.deserialize()?;
    task.validate(&recipe, raw)?;
    let mut resolved = serde_json::to_value(&common).unwrap_or_default();
    if let (Some(obj), Ok(serde_json::Value::Object(t))) =
        (resolved.as_object_mut(), serde_json::to_value(&recipe))
    {
        for (k, v) in t {
            obj.insert(k, v);
        }
    }
    Ok(Loaded {
        common,
        task: recipe,
        resolved,
    })
}

/// Validate a recipe completely without running it (used by `kiln train --dry-run` and tests).
pub fn validate(raw: &RawRecipe) -> Result<serde_json::Value, RecipeError> {
    check_task(raw)?.validate(raw)
}

/// How a training run starts.
pub struct TrainRequest {
    /// The recipe tree.
    pub raw: RawRecipe,
    /// The recipe file (for the run name).
    pub recipe_path: Option<PathBuf>,
    /// Continue this run directory instead of creating one.
    pub resume: Option<PathBuf>,
}

/// Train the task of `req`; returns the run directory.
pub fn train(req: TrainRequest) -> anyhow::Result<PathBuf> {
    check_task(&req.raw)?.train(&req)
}

fn prepare_run_dir(
    req: &TrainRequest,
    common: &CommonConfig,
    resolved: &serde_json::Value,
) -> anyhow::Result<(PathBuf, bool)> {
    match &req.resume {
        // A resumed run's recipe.yaml is rewritten only once its checkpoint has loaded
        // ([`Run::save_resumed_recipe`]): a resume refused (e.g. adapters for another base) leaves
        // the run's recipe as it was.
        Some(dir) => Ok((dir.clone(), true)),
        None => {
            let name = run::run_name(common, req.recipe_path.as_deref());
            let dir = run::create_run_dir(&common.output_dir, &name)?;
            run::save_recipe(&dir, resolved)?;
            Ok((dir, false))
        }
    }
}

/// One `kiln train` run as a task's pipeline sees it: the recipe's shared fields, the run
/// directory, and the trainer driver ([`kiln_rl::Driver`]).
pub struct Run<'a> {
    /// Shared recipe fields.
    pub common: &'a CommonConfig,
    /// The resolved recipe (for the trackers' run config).
    pub resolved: &'a serde_json::Value,
    /// The run directory.
    pub run_dir: &'a Path,
    /// Continuing an existing run directory (`--resume`).
    pub resume: bool,
    /// Whether the run's recipe.yaml holds this recipe (a resumed run's is written once its
    /// checkpoint has loaded).
    pub recipe_saved: std::cell::Cell<bool>,
}

impl Run<'_> {
    /// Writes the resolved recipe into a resumed run's recipe.yaml (once; called when its checkpoint has
    /// loaded, and at the end of a task that resumes without the trainer).
    pub fn save_resumed_recipe(&self) -> anyhow::Result<()> {
        if !self.recipe_saved.get() {
            run::save_recipe(self.run_dir, self.resolved)?;
            self.recipe_saved.set(true);
        }
        Ok(())
    }

    /// The device of the recipe's `backend:`.
    pub fn device(&self) -> anyhow::Result<Device> {
        run::device_for(self.common.backend)
    }

    /// The experiment trackers of the run (`resume_from_step` when it continues a run).
    pub fn open_tracker(
        &self,
        resume_from_step: Option<u64>,
    ) -> anyhow::Result<kiln_track::Tracker> {
        let name = self
            .run_dir
            .file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_default();
        kiln_track::Tracker::open(
            &self.common.logging,
            kiln_track::RunInfo {
                run_dir: self.run_dir,
                name: &name,
                config: self.resolved,
                resume_from_step,
            },
        )
        .context("opening the experiment trackers")
    }

    /// Run kiln-rl's trainer on `task` from `model` (on the autodiff `device`), resuming the run's
    /// newest checkpoint with `--resume`, with the run's trackers and progress bar; prints the
    /// run summary and returns the trained policy.
    pub fn drive<T: RlTask>(
        &self,
        task: T,
        model: T::Policy,
        device: Device,
    ) -> anyhow::Result<Trained<T::Policy>> {
        let opts = TrainerOptions {
            trainer: self.common.trainer.clone(),
            algorithm: self.common.algorithm.clone(),
            optim: self.common.optim.clone(),
            run_dir: self.run_dir.to_path_buf(),
            seed: self.common.seed,
            progress: Some(run::progress_bar(self.common.trainer.steps)),
        };
        let shared = Arc::new(Mutex::new(None));
        let mut trainer = Trainer::new(
            task,
            model,
            device,
            opts,
            Box::new(run::SharedSink(shared.clone())),
        );
        let mut from = None;
        if self.resume {
            from = trainer
                .resume()
                .context("resuming from the newest checkpoint")?;
            self.save_resumed_recipe()?;
            match from {
                Some(s) => tracing::info!("resumed from checkpoint step-{s}"),
                None => tracing::warn!(
                    "no complete checkpoint in {}; starting from step 0",
                    self.run_dir.display()
                ),
            }
        }
        let tracker = self.open_tracker(self.resume.then(|| from.unwrap_or(0)))?;
        *shared.lock().unwrap_or_else(|e| e.into_inner()) = Some(tracker);
        let result = trainer.run();
        let tracker = shared.lock().unwrap_or_else(|e| e.into_inner()).take();
        let code = if result.is_ok() { 0 } else { 1 };
        if let Some(t) = tracker
            && let Err(e) = t.finish(code)
        {
            tracing::warn!("finishing the trackers: {e}");
        }
        let summary = result?;
        print_summary(
            &summary.last,
            &summary.eval,
            summary.steps,
            summary.wall_s,
            self.run_dir,
        );
        Ok(Trained {
            policy: trainer.model().clone(),
            summary,
        })
    }
}

impl kiln_rl::Driver for Run<'_> {
    fn train<T: RlTask>(
        &mut self,
        task: T,
        policy: T::Policy,
        device: Device,
    ) -> Result<Trained<T::Policy>, TaskError> {
        self.drive(task, policy, device)
            .map_err(|e| format!("{e:#}").into())
    }

    fn progress_bar(&mut self, len: u64) -> indicatif::ProgressBar {
        run::progress_bar(len)
    }
}

fn print_summary(
    last: &BTreeMap<String, f64>,
    eval: &BTreeMap<String, f64>,
    steps: u64,
    wall: f64,
    run_dir: &Path,
) {
    println!(
        "\nrun finished: {steps} steps in {wall:.1}s -> {}",
        run_dir.display()
    );
    println!("{:<28} {:>12}", "metric", "value");
    for k in [
        "reward/mean",
        "reward/std",
        "kl/ref",
        "entropy",
        "clip_frac",
        "grad_norm",
        "lr",
    ] {
        if let Some(v) = last.get(k) {
            println!("{k:<28} {v:>12.5}");
        }
    }
    for (k, v) in eval {
        println!("{k:<28} {v:>12.5}");
    }
    if let Some(mb) = peak_rss_mib() {
        println!("{:<28} {mb:>8.1} MiB", "peak memory");
    }
}

/// Peak resident set size of this process (Linux `VmHWM`).
pub fn peak_rss_mib() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// What `kiln eval` was asked.
pub struct EvalRequest {
    /// A checkpoint directory or a run directory (its newest checkpoint).
    pub checkpoint: PathBuf,
    /// `--set` overrides of the run's recipe.
    pub sets: Vec<String>,
    /// `--task`: the evaluation task when it differs from the run's task.
    pub task: Option<String>,
    /// `--data`: a dataset name or path.
    pub data: Option<String>,
    /// `--retriever`: an index directory or a retrieval server URL (`--task qa`).
    pub retriever: Option<String>,
    /// `--mode`: `direct`, `rag`, `agent` or a comma list (`--task qa`; default all three).
    pub mode: Option<String>,
    /// `--limit`: at most this many questions per dataset.
    pub limit: Option<usize>,
}

/// A `kiln eval` as a task sees it: the request, the run's shared recipe fields, the checkpoint
/// and its run directory.
pub struct EvalAt<'a> {
    /// The command line.
    pub req: &'a EvalRequest,
    /// Shared fields of the run's recipe (with `--set` applied).
    pub common: &'a CommonConfig,
    /// The checkpoint directory.
    pub ckpt: &'a Path,
    /// The run directory (reports go to `<run>/eval/`).
    pub run_dir: &'a Path,
}

impl EvalAt<'_> {
    /// The device of the recipe's `backend:`.
    pub fn device(&self) -> anyhow::Result<Device> {
        run::device_for(self.common.backend)
    }

    /// A fresh folder `<run>/eval/eval-<UTC time>[-k]/` for this evaluation's reports, so that
    /// the training run's reports and earlier evaluations are never overwritten.
    pub fn fresh_eval_dir(&self) -> PathBuf {
        let stem = format!("eval-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ"));
        let mut out = self.run_dir.join("eval").join(&stem);
        let mut k = 2;
        while out.exists() {
            out = self.run_dir.join("eval").join(format!("{stem}-{k}"));
            k += 1;
        }
        out
    }
}

/// Find the checkpoint directory and run directory of `checkpoint`.
pub fn locate_checkpoint(checkpoint: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let ckpt = CheckpointManager::resolve(checkpoint)?;
    let run_dir = CheckpointManager::run_dir_of(&ckpt)
        .context("a checkpoint lives in <run dir>/checkpoints/step-N")?;
    Ok((ckpt, run_dir))
}

/// A run directory without checkpoints of its own whose task takes its policy from another run
/// ([`CliTask::policy_from`]): that run's newest checkpoint, and `dir` itself as the run directory.
/// None when `dir` is not such a run.
fn policy_elsewhere(dir: &Path, sets: &[String]) -> anyhow::Result<Option<(PathBuf, PathBuf)>> {
    let recipe = dir.join(run::RECIPE_FILE);
    if !recipe.is_file() {
        return Ok(None);
    }
    let raw = crate::recipe::load_raw(&recipe, sets)?;
    let Some(from) = check_task(&raw)?.policy_from(&raw)? else {
        return Ok(None);
    };
    let (ckpt, _) = locate_checkpoint(&from).with_context(|| {
        format!(
            "{} takes its policy from stage2.policy_from = {}",
            dir.display(),
            from.display()
        )
    })?;
    Ok(Some((ckpt, dir.to_path_buf())))
}

/// `kiln eval RECIPE.yaml`: the recipe's policy before any RL step (the warm / cold start, or the
/// pre-trained model), evaluated like a checkpoint, into a new run directory
/// `<output_dir>/<name>-start-<time>/` holding the recipe and the `eval/` report. This is the "SFT"
/// row of a table: the same evaluation as the RL runs' final table, without training.
fn eval_start(req: &EvalRequest) -> anyhow::Result<BTreeMap<String, f64>> {
    let raw = crate::recipe::load_raw(&req.checkpoint, &req.sets)?;
    let task = check_task(&raw)?;
    if task.name() != "search_r2" {
        anyhow::bail!(
            "`kiln eval {}`: evaluating a recipe's policy before training is supported for task \
             search_r2, not `{}`; give a checkpoint (`kiln eval runs/<run>`) instead",
            req.checkpoint.display(),
            task.name()
        );
    }
    let resolved = task.validate(&raw)?;
    let common: CommonConfig =
        serde_json::from_value(resolved.clone()).context("reading the recipe's shared fields")?;
    let name = format!("{}-start", run::run_name(&common, Some(&req.checkpoint)));
    let run_dir = run::create_run_dir(&common.output_dir, &name)?;
    run::save_recipe(&run_dir, &resolved)?;
    eprintln!(
        "[kiln] evaluating the policy of {} before training; report in {}",
        req.checkpoint.display(),
        run_dir.join("eval").display()
    );
    // No checkpoint: the task evaluates its starting policy.
    let ckpt = run_dir.join("checkpoints").join("step-0");
    task.eval(&raw, req, &ckpt, &run_dir)
}

/// `kiln eval CHECKPOINT`: evaluate a checkpoint of a run with its own recipe (or, given a recipe
/// file, its policy before training: [`eval_start`]).
pub fn eval(req: EvalRequest) -> anyhow::Result<BTreeMap<String, f64>> {
    if req.checkpoint.is_file() {
        return eval_start(&req);
    }
    let (ckpt, run_dir) = match locate_checkpoint(&req.checkpoint) {
        Ok(found) => found,
        Err(e) => policy_elsewhere(&req.checkpoint, &req.sets)?.ok_or(e)?,
    };
    let recipe = run_dir.join(run::RECIPE_FILE);
    let raw = crate::recipe::load_raw(&recipe, &req.sets)?;
    check_task(&raw)?.eval(&raw, &req, &ckpt, &run_dir)
}
