//! The Sudoku pipelines of `kiln train` / `kiln eval`:
//!
//! - `task: mdm_sudoku` ([`train_mdm`]): pre-train the masked-diffusion denoiser and save it to
//!   `denoiser_dir`;
//! - `task: sas` ([`train_sas`]), the whole chain: the frozen denoiser ([`resolve_denoiser`]: the
//!   one in `denoiser_dir`, pre-trained first when absent), the order policy trained with GRPO and
//!   the self-aware reward ([`crate::task::SasTask`] through the binary's [`kiln_rl::Driver`]),
//!   optionally stage 2 ([`crate::stage2`]), and the evaluation table ([`super::table`]);
//! - `kiln eval` of a `sas` run ([`eval_sas`], [`eval_sudoku_file`]).

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::Device;
use kiln_rl::{Context, Driver, PipelineError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::table::{EvalSetConfig, FinalEvalConfig, final_eval};
use crate::denoiser::{
    DenoiserConfig, MetricsFn, PRETRAIN_RECORD_FILE, PretrainConfig, PretrainRecord,
    PretrainSummary, SudokuDenoiser, check_denoiser_source, denoiser_exists, load_denoiser,
    pretrain, record_denoiser_source,
};
use crate::policy::{OrderPolicy, PolicyConfig};
use crate::stage2::{Stage2Config, stage2};
use crate::sudoku::Shape;
use crate::task::{SasConfig, SasTask};

type Result<T> = std::result::Result<T, PipelineError>;

/// Where `mdm_sudoku` writes its denoiser and `sas` reads it, unless the recipe says otherwise.
pub fn default_denoiser_dir() -> PathBuf {
    PathBuf::from("runs/sas/denoiser-9x9")
}

/// The board shape of a side (4 or 9; recipes are validated before).
pub fn shape_of(side: usize) -> Shape {
    Shape::from_side(side).unwrap_or(Shape::NINE)
}

/// The task-specific part of an `mdm_sudoku` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct MdmRecipe {
    /// The denoiser: a bidirectional transformer encoder with absolute cell/row/column/box
    /// embeddings over the Sudoku tokens (0 = mask, 1..=side = digits).
    pub model: DenoiserConfig,
    /// Masked-diffusion pre-training (LLaDA objective: t ~ U(t_min, 1), blanks masked with
    /// probability t, givens never masked, 1/t-weighted cross-entropy on masked cells).
    pub pretrain: PretrainConfig,
    /// Where the denoiser is written (`denoiser.bpk` + `denoiser.json`); the `sas` recipe reads
    /// it from the same place.
    pub denoiser_dir: PathBuf,
}

impl Default for MdmRecipe {
    fn default() -> Self {
        Self {
            model: DenoiserConfig::default(),
            pretrain: PretrainConfig::default(),
            denoiser_dir: default_denoiser_dir(),
        }
    }
}

/// The task-specific part of a `sas` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct SasRecipe {
    /// The frozen denoiser: read from here; pre-trained with `model` + `pretrain` when absent.
    pub denoiser_dir: PathBuf,
    /// Denoiser architecture used when it must be pre-trained (see `kiln recipes --explain
    /// mdm_sudoku`).
    pub model: DenoiserConfig,
    /// Denoiser pre-training used when `denoiser_dir` has no denoiser.
    pub pretrain: PretrainConfig,
    /// The order policy (MLP over per-position denoiser features).
    pub policy: PolicyConfig,
    /// GRPO rollouts: puzzles per step, group size, training / periodic-evaluation puzzles.
    pub sas: SasConfig,
    /// Stage 2: fine-tune the denoiser along orders from the trained policy (`sas_sudoku_stage2`).
    pub stage2: Stage2Config,
    /// The evaluation table printed at the end.
    pub final_eval: FinalEvalConfig,
}

impl Default for SasRecipe {
    fn default() -> Self {
        Self {
            denoiser_dir: default_denoiser_dir(),
            model: DenoiserConfig::default(),
            pretrain: PretrainConfig::default(),
            policy: PolicyConfig::default(),
            sas: SasConfig::default(),
            stage2: Stage2Config::default(),
            final_eval: FinalEvalConfig::default(),
        }
    }
}

/// Pre-train the denoiser of an `mdm_sudoku` recipe (run seed `seed`), sending its metrics rows
/// to `metrics` (the run's trackers), and print its summary.
pub fn train_mdm(
    recipe: &MdmRecipe,
    device: &Device,
    seed: u64,
    metrics: &mut MetricsFn<'_>,
) -> Result<PretrainSummary> {
    let (_, summary) = pretrain_denoiser(
        &recipe.model,
        &recipe.pretrain,
        &recipe.denoiser_dir,
        device,
        seed,
        metrics,
    )?;
    println!(
        "\ndenoiser pre-trained: {} steps in {:.1}s ({:.3} steps/s), final loss {:.4}, {} parameters -> {}",
        summary.steps,
        summary.wall_s,
        summary.steps_per_s,
        summary.final_loss,
        summary.params,
        recipe.denoiser_dir.display()
    );
    Ok(summary)
}

/// Load or generate the pre-training puzzles of `cfg` and pre-train a denoiser into `dir`.
fn pretrain_denoiser(
    model: &DenoiserConfig,
    cfg: &PretrainConfig,
    dir: &Path,
    device: &Device,
    seed: u64,
    metrics: &mut MetricsFn<'_>,
) -> Result<(SudokuDenoiser, PretrainSummary)> {
    let t = std::time::Instant::now();
    let puzzles = cfg
        .data
        .load()
        .context("loading the pre-training puzzles")?;
    tracing::info!(
        "denoiser pre-training: {} puzzles ({:.1}s to load/generate), {} steps x {} boards",
        puzzles.len(),
        t.elapsed().as_secs_f64(),
        cfg.steps,
        cfg.batch_size
    );
    Ok(pretrain(model, cfg, &puzzles, device, seed, dir, metrics)?)
}

/// The frozen denoiser of a `sas` recipe: the one in `denoiser_dir` when its pre-training record
/// matches the recipe's `model:` / `pretrain:` (a different run seed is accepted), else
/// pre-trained there first (also when an earlier pre-training was interrupted).
pub fn resolve_denoiser(r: &SasRecipe, device: &Device, seed: u64) -> Result<SudokuDenoiser> {
    let shape = shape_of(r.pretrain.data.side);
    let dir = &r.denoiser_dir;
    if denoiser_exists(dir) {
        match PretrainRecord::load(dir)? {
            None => {
                tracing::info!(
                    "{}: a denoiser without a pre-training record ({PRETRAIN_RECORD_FILE}); using it as is",
                    dir.display()
                );
                return Ok(load_denoiser(dir, shape, device)?);
            }
            Some(rec) if rec.complete => {
                let diff = rec.differences(&r.model, &r.pretrain, seed);
                let (seed, other): (Vec<_>, Vec<_>) =
                    diff.into_iter().partition(|d| d.starts_with("seed:"));
                if !other.is_empty() {
                    return Err(PipelineError(format!(
                        "{} holds a denoiser pre-trained under other settings than this recipe's \
                         `model:` / `pretrain:` (recorded -> recipe):\n  {}\nPoint `denoiser_dir` \
                         to another folder (a denoiser is pre-trained there first) or delete {}.",
                        dir.display(),
                        other.join("\n  "),
                        dir.display()
                    )));
                }
                if let Some(s) = seed.first() {
                    tracing::info!(
                        "{}: denoiser pre-trained with another run seed ({s}); the settings match, using it",
                        dir.display()
                    );
                }
                return Ok(load_denoiser(dir, shape, device)?);
            }
            Some(rec) => tracing::warn!(
                "{} holds an interrupted pre-training (weights of step {} of {}); pre-training again from scratch",
                dir.display(),
                rec.steps_done,
                r.pretrain.steps
            ),
        }
    } else {
        tracing::info!(
            "no denoiser in {}: pre-training one first (recipes/mdm_sudoku.yaml does the same alone)",
            dir.display()
        );
    }
    {
        let mut no_metrics = |_: u64, _: &[(&str, f64)]| {};
        let (m, s) = pretrain_denoiser(
            &r.model,
            &r.pretrain,
            &r.denoiser_dir,
            device,
            seed,
            &mut no_metrics,
        )?;
        tracing::info!(
            "denoiser pre-trained in {:.1}s ({:.3} steps/s, final loss {:.4})",
            s.wall_s,
            s.steps_per_s,
            s.final_loss
        );
        Ok(m)
    }
}

/// The order policy of a checkpoint, or of the newest checkpoint of a run directory.
fn load_policy(r: &SasRecipe, path: &Path, device: &Device) -> Result<OrderPolicy> {
    let ckpt = kiln_rl::checkpoint::CheckpointManager::resolve(path)?;
    let mp = ckpt.join(kiln_rl::checkpoint::MODEL_FILE);
    OrderPolicy::init(&r.policy, shape_of(r.pretrain.data.side), device)
        .try_load_file(&mp)
        .map_err(|e| {
            PipelineError(format!(
                "{}: cannot load the order policy: {e}",
                mp.display()
            ))
        })
}

/// Run the `sas` chain of `r` on `device` with the run seed `seed` into `run_dir` (a resumed run
/// when `resume`): the frozen denoiser, the order policy (trained through `driver`, or taken from
/// `stage2.policy_from`), stage 2 when enabled, then the evaluation table (printed and written to
/// `run_dir/eval`).
pub fn train_sas(
    r: &SasRecipe,
    device: &Device,
    seed: u64,
    run_dir: &Path,
    resume: bool,
    driver: &mut impl Driver,
) -> Result<()> {
    let started = std::time::Instant::now();
    device.seed(seed);
    let denoiser = resolve_denoiser(r, device, seed)?;
    if resume {
        check_denoiser_source(run_dir, &r.denoiser_dir)?;
    }
    record_denoiser_source(run_dir, &r.denoiser_dir)?;
    let t_pre = started.elapsed().as_secs_f64();
    let policy = if !r.stage2.policy_from.as_os_str().is_empty() {
        check_denoiser_source(&r.stage2.policy_from, &r.denoiser_dir)?;
        load_policy(r, &r.stage2.policy_from, device)?
    } else {
        let train = r
            .sas
            .train
            .load()
            .context("loading the SAS training puzzles")?;
        let eval = r
            .sas
            .eval
            .load()
            .context("loading the SAS evaluation puzzles")?;
        let ad = device.clone().autodiff();
        ad.seed(seed);
        let policy = OrderPolicy::init(&r.policy, shape_of(r.pretrain.data.side), &ad);
        tracing::info!(
            "sas: order policy with {} parameters; {} training / {} evaluation puzzles; run directory {}",
            policy.num_params(),
            train.len(),
            eval.len(),
            run_dir.display()
        );
        let task = SasTask::new(
            denoiser.clone(),
            r.sas.clone(),
            r.policy.clone(),
            train,
            eval,
            seed,
        );
        driver.train(task, policy, ad)?.policy.valid()
    };
    let t_rl = started.elapsed().as_secs_f64() - t_pre;
    let stage2_denoiser = if r.stage2.enabled {
        let mut train = r.sas.train.load().map_err(PipelineError::msg)?;
        if r.stage2.puzzles > 0 {
            train.truncate(r.stage2.puzzles);
        }
        let dir = run_dir.join("denoiser-stage2");
        let mut sink = |_s: u64, _m: &[(&str, f64)]| {};
        Some(stage2(
            &denoiser,
            &policy,
            &r.stage2,
            &train,
            r.sas.decode.block_len,
            r.policy.temperature,
            device,
            seed,
            &dir,
            &mut sink,
        )?)
    } else {
        None
    };
    let t_s2 = started.elapsed().as_secs_f64() - t_pre - t_rl;
    final_eval(
        &r.final_eval,
        &denoiser,
        &policy,
        stage2_denoiser.as_ref(),
        &run_dir.join("eval"),
    )?;
    let t_eval = started.elapsed().as_secs_f64() - t_pre - t_rl - t_s2;
    println!(
        "\nwall time: pre-training {t_pre:.0}s, policy {t_rl:.0}s, stage 2 {t_s2:.0}s, evaluation {t_eval:.0}s, total {:.0}s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// `kiln eval` of a `sas` run: the final-evaluation table with the run's denoiser (the stage-2
/// denoiser when the run has one) and the checkpoint's policy, written to `out_dir`.
pub fn eval_sas(
    r: &SasRecipe,
    device: &Device,
    ckpt: &Path,
    run_dir: &Path,
    out_dir: &Path,
) -> Result<()> {
    let shape = shape_of(r.pretrain.data.side);
    check_denoiser_source(run_dir, &r.denoiser_dir)?;
    let denoiser = load_denoiser(&r.denoiser_dir, shape, device)?;
    let s2dir = run_dir.join("denoiser-stage2");
    let s2 = if denoiser_exists(&s2dir) {
        Some(load_denoiser(&s2dir, shape, device)?)
    } else {
        None
    };
    let policy = load_policy(r, ckpt, device)?;
    final_eval(&r.final_eval, &denoiser, &policy, s2.as_ref(), out_dir)
}

/// `kiln eval CHECKPOINT --task sudoku --data PATH`: the evaluation table of a `sas` run's
/// policy (and its denoiser) on one puzzle file instead of the recipe's `final_eval.sets`.
pub fn eval_sudoku_file(
    r: &SasRecipe,
    device: &Device,
    ckpt: &Path,
    run_dir: &Path,
    out_dir: &Path,
    data: &Path,
) -> Result<()> {
    let mut r = r.clone();
    let name = data
        .file_stem()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "data".into());
    r.final_eval.sets = vec![EvalSetConfig {
        name,
        path: data.to_path_buf(),
        limit: 0,
        ..Default::default()
    }];
    eval_sas(&r, device, ckpt, run_dir, out_dir)
}
