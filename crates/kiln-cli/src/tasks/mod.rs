//! The task registry: what `task:` values exist, their config schemas, and how each trains and
//! evaluates. Adding a task = one entry here plus its module.

pub mod grpo_sequence;
pub mod sas;
pub mod search;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use burn::module::Module;
use kiln_rl::{Trainer, TrainerOptions};

use crate::config::CommonConfig;
use crate::recipe::{RawRecipe, RecipeError, schema_of};
use crate::run;

/// A registered task.
pub struct TaskInfo {
    /// The `task:` value.
    pub name: &'static str,
    /// One line.
    pub summary: &'static str,
}

/// Every task the binary knows.
pub const TASKS: &[TaskInfo] = &[
    TaskInfo {
        name: "grpo_sequence",
        summary: "GRPO from random init on a verifiable digit-string transformation (copy / reverse / increment)",
    },
    TaskInfo {
        name: "mdm_sudoku",
        summary: "pre-train the masked-diffusion Sudoku denoiser (1/t-weighted masked cross-entropy)",
    },
    TaskInfo {
        name: "sas",
        summary: "SAS: learn the unmasking order of a frozen Sudoku denoiser with GRPO and the self-aware reward",
    },
    TaskInfo {
        name: "search_r2",
        summary: "Search-R2 / Search-R1: multi-turn search agent (+ meta-refiner) trained with joint GRPO over a BM25 retriever",
    },
    TaskInfo {
        name: "sas_gsm8k",
        summary: "GSM8K pass@1 of a masked diffusion LM with LLaDA-style decoding",
    },
];

/// JSON schemas of the recipe of `task` (common fields + task fields).
pub fn schemas(task: &str) -> Option<Vec<schemars::Schema>> {
    let common = schema_of::<CommonConfig>();
    match task {
        "grpo_sequence" => Some(vec![common, schema_of::<grpo_sequence::SequenceRecipe>()]),
        "mdm_sudoku" => Some(vec![common, schema_of::<sas::MdmRecipe>()]),
        "sas" => Some(vec![common, schema_of::<sas::SasRecipe>()]),
        "sas_gsm8k" => Some(vec![common, schema_of::<sas::GsmRecipe>()]),
        "search_r2" => Some(vec![common, schema_of::<search::SearchRecipe>()]),
        _ => None,
    }
}

/// Resolve the task of `raw` and check its keys; returns the task name.
pub fn check_task(raw: &RawRecipe) -> Result<&'static str, RecipeError> {
    let task = raw.task()?;
    let Some(info) = TASKS.iter().find(|t| t.name == task) else {
        let names: Vec<&str> = TASKS.iter().map(|t| t.name).collect();
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
    let schemas = schemas(info.name).expect("registered task has schemas");
    raw.check_keys(&schemas)?;
    Ok(info.name)
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

fn load_typed<T>(raw: &RawRecipe) -> Result<Loaded<T>, RecipeError>
where
    T: serde::de::DeserializeOwned + serde::Serialize,
{
    let common: CommonConfig = raw.deserialize()?;
    common.validate(raw)?;
    let task: T = raw.deserialize()?;
    let mut resolved = serde_json::to_value(&common).unwrap_or_default();
    if let (Some(obj), Ok(serde_json::Value::Object(t))) =
        (resolved.as_object_mut(), serde_json::to_value(&task))
    {
        for (k, v) in t {
            obj.insert(k, v);
        }
    }
    Ok(Loaded {
        common,
        task,
        resolved,
    })
}

/// Validate a recipe completely without running it (used by `kiln train --dry-run` and tests).
pub fn validate(raw: &RawRecipe) -> Result<serde_json::Value, RecipeError> {
    match check_task(raw)? {
        "grpo_sequence" => {
            let l = load_typed::<grpo_sequence::SequenceRecipe>(raw)?;
            l.task.validate(raw)?;
            Ok(l.resolved)
        }
        "mdm_sudoku" => {
            let l = load_typed::<sas::MdmRecipe>(raw)?;
            l.task.validate(raw)?;
            Ok(l.resolved)
        }
        "sas" => {
            let l = load_typed::<sas::SasRecipe>(raw)?;
            l.task.validate(raw)?;
            Ok(l.resolved)
        }
        "sas_gsm8k" => {
            let l = load_typed::<sas::GsmRecipe>(raw)?;
            l.task.validate(raw)?;
            Ok(l.resolved)
        }
        "search_r2" => {
            let l = load_typed::<search::SearchRecipe>(raw)?;
            l.task.validate(raw)?;
            Ok(l.resolved)
        }
        other => unreachable!("task {other} registered without a loader"),
    }
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
    match check_task(&req.raw)? {
        "grpo_sequence" => {
            let l = load_typed::<grpo_sequence::SequenceRecipe>(&req.raw)?;
            l.task.validate(&req.raw)?;
            let (run_dir, resumed_from) = prepare_run_dir(&req, &l.common, &l.resolved)?;
            let device = run::device_for(l.common.backend)?;
            device.seed(l.common.seed);
            let ad = device.clone().autodiff();
            let model = grpo_sequence::build_model(&l.task, &ad);
            tracing::info!(
                "grpo_sequence: {} parameters, run directory {}",
                model.num_params(),
                run_dir.display()
            );
            let task = grpo_sequence::SequenceTask::new(l.task.sequence.clone(), ad.clone());
            drive(
                task,
                model,
                ad,
                &l.common,
                &l.resolved,
                &run_dir,
                resumed_from,
            )?;
            Ok(run_dir)
        }
        "mdm_sudoku" => {
            let l = load_typed::<sas::MdmRecipe>(&req.raw)?;
            l.task.validate(&req.raw)?;
            let (run_dir, _) = prepare_run_dir(&req, &l.common, &l.resolved)?;
            sas::train_mdm(&l.common, &l.task, &l.resolved, &run_dir)?;
            Ok(run_dir)
        }
        "sas" => {
            let l = load_typed::<sas::SasRecipe>(&req.raw)?;
            l.task.validate(&req.raw)?;
            let (run_dir, resumed) = prepare_run_dir(&req, &l.common, &l.resolved)?;
            sas::train_sas(&l.common, &l.task, &l.resolved, &run_dir, resumed)?;
            Ok(run_dir)
        }
        "sas_gsm8k" => {
            let l = load_typed::<sas::GsmRecipe>(&req.raw)?;
            l.task.validate(&req.raw)?;
            let (run_dir, resumed) = prepare_run_dir(&req, &l.common, &l.resolved)?;
            sas::run_gsm8k(&l.common, &l.task, &l.resolved, &run_dir, resumed)?;
            Ok(run_dir)
        }
        "search_r2" => {
            let l = load_typed::<search::SearchRecipe>(&req.raw)?;
            l.task.validate(&req.raw)?;
            let (run_dir, resumed) = prepare_run_dir(&req, &l.common, &l.resolved)?;
            search::train(&l.common, &l.task, &l.resolved, &run_dir, resumed)?;
            Ok(run_dir)
        }
        other => unreachable!("task {other} registered without a trainer"),
    }
}

fn prepare_run_dir(
    req: &TrainRequest,
    common: &CommonConfig,
    resolved: &serde_json::Value,
) -> anyhow::Result<(PathBuf, bool)> {
    match &req.resume {
        Some(dir) => {
            run::save_recipe(dir, resolved)?;
            Ok((dir.clone(), true))
        }
        None => {
            let name = run::run_name(common, req.recipe_path.as_deref());
            let dir = run::create_run_dir(&common.output_dir, &name)?;
            run::save_recipe(&dir, resolved)?;
            Ok((dir, false))
        }
    }
}

/// Trainer options of a run from its shared recipe fields (with a console progress bar).
fn trainer_options(common: &CommonConfig, run_dir: &Path) -> TrainerOptions {
    TrainerOptions {
        trainer: common.trainer.clone(),
        algorithm: common.algorithm.clone(),
        optim: common.optim.clone(),
        run_dir: run_dir.to_path_buf(),
        seed: common.seed,
        progress: Some(run::progress_bar(common.trainer.steps)),
    }
}

/// Run the generic trainer on a task and finish the tracker.
fn drive<T: kiln_rl::RlTask>(
    task: T,
    model: T::Policy,
    device: burn::tensor::Device,
    common: &CommonConfig,
    resolved: &serde_json::Value,
    run_dir: &Path,
    resume: bool,
) -> anyhow::Result<()> {
    let opts = trainer_options(common, run_dir);
    let shared = Arc::new(Mutex::new(None));
    let mut trainer = Trainer::new(
        task,
        model,
        device,
        opts,
        Box::new(run::SharedSink(shared.clone())),
    );
    let mut from = None;
    if resume {
        from = trainer
            .resume()
            .context("resuming from the newest checkpoint")?;
        match from {
            Some(s) => tracing::info!("resumed from checkpoint step-{s}"),
            None => tracing::warn!(
                "no complete checkpoint in {}; starting from step 0",
                run_dir.display()
            ),
        }
    }
    let name = run_dir
        .file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    let tracker = kiln_track::Tracker::open(
        &common.logging,
        kiln_track::RunInfo {
            run_dir,
            name: &name,
            config: resolved,
            resume_from_step: if resume {
                Some(from.unwrap_or(0))
            } else {
                None
            },
        },
    )
    .context("opening the experiment trackers")?;
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
        run_dir,
    );
    Ok(())
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

/// Find the checkpoint directory and run directory of `checkpoint`.
pub fn locate_checkpoint(checkpoint: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let ckpt = if checkpoint.join(kiln_rl::checkpoint::MODEL_FILE).is_file() {
        checkpoint.to_path_buf()
    } else {
        let mgr = kiln_rl::checkpoint::CheckpointManager::new(checkpoint, 1);
        match mgr.latest() {
            Some((_, p)) => p,
            None => anyhow::bail!(
                "{} is neither a checkpoint directory (with {}) nor a run directory with checkpoints",
                checkpoint.display(),
                kiln_rl::checkpoint::MODEL_FILE
            ),
        }
    };
    let run_dir = ckpt
        .parent()
        .and_then(Path::parent)
        .context("a checkpoint lives in <run dir>/checkpoints/step-N")?
        .to_path_buf();
    Ok((ckpt, run_dir))
}

/// A `sas` stage-2 run that took its policy from another run (`stage2.policy_from`) has no
/// checkpoints of its own: its policy checkpoint is the newest one of `policy_from`, and the run
/// directory (its stage-2 denoiser, its reports) is `dir` itself. None when `dir` is not such a run.
fn stage2_run_policy(dir: &Path, sets: &[String]) -> anyhow::Result<Option<(PathBuf, PathBuf)>> {
    let recipe = dir.join(run::RECIPE_FILE);
    if !recipe.is_file() {
        return Ok(None);
    }
    let raw = crate::recipe::load_raw(&recipe, sets)?;
    if check_task(&raw)? != "sas" {
        return Ok(None);
    }
    let l = load_typed::<sas::SasRecipe>(&raw)?;
    let from = &l.task.stage2.policy_from;
    if !l.task.stage2.enabled || from.as_os_str().is_empty() {
        return Ok(None);
    }
    let (ckpt, _) = locate_checkpoint(from).with_context(|| {
        format!(
            "{} takes its policy from stage2.policy_from = {}",
            dir.display(),
            from.display()
        )
    })?;
    Ok(Some((ckpt, dir.to_path_buf())))
}

/// `kiln eval CHECKPOINT`: evaluate a checkpoint of a run with its own recipe.
pub fn eval(req: EvalRequest) -> anyhow::Result<BTreeMap<String, f64>> {
    let (ckpt, run_dir) = match locate_checkpoint(&req.checkpoint) {
        Ok(found) => found,
        Err(e) => stage2_run_policy(&req.checkpoint, &req.sets)?.ok_or(e)?,
    };
    let recipe = run_dir.join(run::RECIPE_FILE);
    let raw = crate::recipe::load_raw(&recipe, &req.sets)?;
    match check_task(&raw)? {
        "grpo_sequence" => {
            if req.data.is_some() || req.task.as_deref().is_some_and(|t| t != "grpo_sequence") {
                anyhow::bail!(
                    "grpo_sequence checkpoints are evaluated on their own held-out prompts; \
                     --task/--data do not apply (use --set sequence.eval_prompts=N)"
                );
            }
            let l = load_typed::<grpo_sequence::SequenceRecipe>(&raw)?;
            l.task.validate(&raw)?;
            let device = run::device_for(l.common.backend)?;
            let model = grpo_sequence::build_model(&l.task, &device);
            let mp = ckpt.join(kiln_rl::checkpoint::MODEL_FILE);
            let model = model
                .try_load_file(&mp)
                .map_err(|e| anyhow::anyhow!("{}: cannot load the model: {e}", mp.display()))?;
            let mut task = grpo_sequence::SequenceTask::new(l.task.sequence.clone(), device);
            let step = kiln_rl::checkpoint::CheckpointManager::read_state(&ckpt)
                .map(|s| s.step)
                .unwrap_or(0);
            let m = kiln_rl::RlTask::evaluate(&mut task, &model, step)
                .map_err(|e| anyhow::anyhow!("evaluation failed: {e}"))?;
            let out = run_dir.join("eval");
            std::fs::create_dir_all(&out)?;
            let report = serde_json::json!({"checkpoint": ckpt, "step": step, "metrics": m});
            let path = out.join(format!("step-{step}.json"));
            std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
            println!("checkpoint {} (step {step})", ckpt.display());
            println!("{:<20} {:>10}", "metric", "value");
            for (k, v) in &m {
                println!("{k:<20} {v:>10.4}");
            }
            println!("report: {}", path.display());
            Ok(m)
        }
        "sas" => {
            let l = load_typed::<sas::SasRecipe>(&raw)?;
            l.task.validate(&raw)?;
            match (req.task.as_deref(), req.data.as_deref()) {
                (None | Some("sudoku") | Some("sas"), Some(data)) => {
                    sas::eval_sudoku_file(&l.task, &l.common, &ckpt, &run_dir, Path::new(data))?
                }
                (None | Some("sudoku") | Some("sas"), None) => {
                    sas::eval_sas(&l.task, &l.common, &ckpt, &run_dir)?
                }
                (Some(other), _) => anyhow::bail!(
                    "`kiln eval` of a `sas` run supports --task sudoku (with --data PATH for a puzzle \
                     file); for --task gsm8k evaluate a `sas_gsm8k` run (recipes/sas_gsm8k_llada.yaml); \
                     `{other}` is not available for it"
                ),
            }
            Ok(BTreeMap::new())
        }
        "search_r2" => {
            let l = load_typed::<search::SearchRecipe>(&raw)?;
            l.task.validate(&raw)?;
            match req.task.as_deref() {
                None | Some("qa") | Some("search_r2") => search::eval_qa(
                    &l.common,
                    &l.task,
                    &ckpt,
                    &run_dir,
                    req.data.as_deref(),
                    req.retriever.as_deref(),
                    req.mode.as_deref(),
                    req.limit,
                )?,
                Some(other) => anyhow::bail!(
                    "`kiln eval` of a `search_r2` run supports --task qa; `{other}` does not apply"
                ),
            }
            Ok(BTreeMap::new())
        }
        "sas_gsm8k" => {
            let l = load_typed::<sas::GsmRecipe>(&raw)?;
            l.task.validate(&raw)?;
            match req.task.as_deref() {
                None | Some("gsm8k") | Some("sas_gsm8k") => sas::eval_gsm8k(
                    &l.task,
                    &l.common,
                    &ckpt,
                    &run_dir,
                    req.data.as_deref().map(Path::new),
                )?,
                Some(other) => anyhow::bail!(
                    "`kiln eval` of a `sas_gsm8k` run supports --task gsm8k (with --data PATH); \
                     `{other}` is not available for it"
                ),
            }
            Ok(BTreeMap::new())
        }
        "mdm_sudoku" => anyhow::bail!(
            "`kiln eval` evaluates `sas` runs (their order policy checkpoints); `mdm_sudoku` \
             saves a denoiser, evaluate it through a `sas` run"
        ),
        other => unreachable!("task {other} registered without an evaluator"),
    }
}
