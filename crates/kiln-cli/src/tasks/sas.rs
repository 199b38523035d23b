//! SAS tasks (METHODS.md section 2):
//!
//! - `task: mdm_sudoku`: pre-train the Sudoku masked-diffusion denoiser (supervised loop) and
//!   save it to `denoiser_dir`;
//! - `task: sas`: the whole chain: pre-train the denoiser if `denoiser_dir` has none, train the
//!   order policy with GRPO and the self-aware reward (denoiser frozen), optionally stage 2
//!   (fine-tune the denoiser along the learned orders), and end with the evaluation table of
//!   every schedule on the held-out sets;
//! - `task: sas_gsm8k`: GSM8K pass@1 of a masked-diffusion LM with LLaDA-style decoding (on CPU
//!   with a tiny byte-level denoiser as a smoke test).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::Context;
use burn::module::Module;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use kiln_lm::TransformerConfig;
use kiln_rl::Trainer;
use kiln_sas::denoiser::{
    DENOISER_FILE, DenoiserConfig, PRETRAIN_RECORD_FILE, PretrainConfig, PretrainRecord,
    PuzzleSetConfig, SudokuDenoiser, check_denoiser_config, check_pretrain, check_puzzle_set,
    denoiser_exists, load_denoiser, pretrain,
};
use kiln_sas::eval::{ScheduleOutcome, draw_orders, markdown, report, run_schedules};
use kiln_sas::gsm8k::{
    LladaDecodeConfig, answers_match, extract_answer, llada_generate, load_gsm8k,
};
use kiln_sas::policy::{OrderPolicy, PolicyConfig};
use kiln_sas::schedule::{DecodeConfig, Schedule};
use kiln_sas::sudoku::{LoadOptions, Puzzle, Shape, load_file};
use kiln_sas::task::{SasConfig, SasTask, Stage2Config, stage2};
use kiln_sas::text::{
    PosStats, TextExample, TextOrderPolicy, TextPolicyConfig, TextSasSettings, TextSasTask,
    left_pad,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::config::{Checker, CommonConfig};
use crate::recipe::{RawRecipe, RecipeError};
use crate::run;

fn invalid(raw: &RawRecipe, path: &str, msg: impl Into<String>) -> RecipeError {
    RecipeError::Invalid {
        at: raw.origin(path),
        path: path.to_string(),
        msg: msg.into(),
    }
}

fn check_pair(raw: &RawRecipe, r: Result<(), (String, String)>) -> Result<(), RecipeError> {
    r.map_err(|(p, m)| invalid(raw, &p, m))
}

fn default_denoiser_dir() -> PathBuf {
    PathBuf::from("runs/sas/denoiser-9x9")
}

// ---------------------------------------------------------------------------------------------
// mdm_sudoku

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

fn check_model(raw: &RawRecipe, model: &DenoiserConfig, side: usize) -> Result<(), RecipeError> {
    let shape = Shape::from_side(side)
        .ok_or_else(|| invalid(raw, "pretrain.data.side", "must be 4 or 9"))?;
    check_denoiser_config(model, shape).map_err(|m| invalid(raw, "model", m))
}

impl MdmRecipe {
    /// Range checks.
    pub fn validate(&self, raw: &RawRecipe) -> Result<(), RecipeError> {
        check_pair(raw, check_pretrain(&self.pretrain))?;
        check_model(raw, &self.model, self.pretrain.data.side)?;
        Checker::new(raw).require(
            !self.denoiser_dir.as_os_str().is_empty(),
            "denoiser_dir",
            "must not be empty",
        )
    }
}

fn open_tracker(
    common: &CommonConfig,
    resolved: &serde_json::Value,
    run_dir: &Path,
) -> anyhow::Result<kiln_track::Tracker> {
    let name = run_dir
        .file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    kiln_track::Tracker::open(
        &common.logging,
        kiln_track::RunInfo {
            run_dir,
            name: &name,
            config: resolved,
            resume_from_step: None,
        },
    )
    .context("opening the experiment trackers")
}

/// Pre-train the denoiser of an `mdm_sudoku` recipe, logging to the run's trackers.
pub fn train_mdm(
    common: &CommonConfig,
    recipe: &MdmRecipe,
    resolved: &serde_json::Value,
    run_dir: &Path,
) -> anyhow::Result<()> {
    let device = run::device_for(common.backend)?;
    let mut tracker = open_tracker(common, resolved, run_dir)?;
    let result = pretrain_denoiser(
        common,
        &recipe.model,
        &recipe.pretrain,
        &recipe.denoiser_dir,
        &device,
        Some(&mut tracker),
    );
    let code = if result.is_ok() { 0 } else { 1 };
    if let Err(e) = tracker.finish(code) {
        tracing::warn!("finishing the trackers: {e}");
    }
    let (_, summary) = result?;
    println!(
        "\ndenoiser pre-trained: {} steps in {:.1}s ({:.3} steps/s), final loss {:.4}, {} parameters -> {}",
        summary.steps,
        summary.wall_s,
        summary.steps_per_s,
        summary.final_loss,
        summary.params,
        recipe.denoiser_dir.display()
    );
    Ok(())
}

fn pretrain_denoiser(
    common: &CommonConfig,
    model: &DenoiserConfig,
    cfg: &PretrainConfig,
    dir: &Path,
    device: &Device,
    mut tracker: Option<&mut kiln_track::Tracker>,
) -> anyhow::Result<(SudokuDenoiser, kiln_sas::denoiser::PretrainSummary)> {
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
    let mut sink = |step: u64, m: &[(&str, f64)]| {
        if let Some(tr) = tracker.as_deref_mut() {
            let row: BTreeMap<String, f64> = m.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            tr.log(step, &row);
        }
    };
    let out = pretrain(model, cfg, &puzzles, device, common.seed, dir, &mut sink)?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// sas

/// One held-out evaluation set.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct EvalSetConfig {
    /// Label in the tables.
    pub name: String,
    /// A puzzle file (81-char lines, JSONL with solutions, or the 4x4 CSV); empty = generate.
    pub path: PathBuf,
    /// Generated puzzles (used when `path` is empty); use a seed no training set uses.
    pub generated: PuzzleSetConfig,
    /// Use at most this many puzzles (0 = all).
    pub limit: usize,
    /// Schedules decoded on this set (empty = `final_eval.schedules`); lets a large, slow set
    /// run only the rows that matter (e.g. random, the best heuristic and learned).
    pub schedules: Vec<Schedule>,
}

impl Default for EvalSetConfig {
    fn default() -> Self {
        Self {
            name: "generated".into(),
            path: PathBuf::new(),
            generated: PuzzleSetConfig {
                count: 1000,
                givens: vec![30],
                seed: 303,
                ..Default::default()
            },
            limit: 0,
            schedules: Vec::new(),
        }
    }
}

impl EvalSetConfig {
    fn load(&self) -> anyhow::Result<Vec<Puzzle>> {
        let mut ps = if self.path.as_os_str().is_empty() {
            self.generated.load()?
        } else {
            let l = load_file(&self.path, LoadOptions::strict())
                .with_context(|| format!("loading evaluation set `{}`", self.name))?;
            l.puzzles
        };
        if self.limit > 0 {
            ps.truncate(self.limit);
        }
        Ok(ps)
    }
}

/// The evaluation table at the end of a `sas` run (and of `kiln eval`).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct FinalEvalConfig {
    /// Held-out sets (the paper's protocol: 1,000 generated puzzles plus magictour_top1465).
    pub sets: Vec<EvalSetConfig>,
    /// Schedules in the table (`learned` = the trained policy).
    pub schedules: Vec<Schedule>,
    /// Schedules also run with the stage-2 denoiser (rows `<schedule>+stage2`).
    pub stage2_schedules: Vec<Schedule>,
    /// Decoding protocol of the table.
    pub decode: DecodeConfig,
    /// Puzzles drawn in the unmasking-order image (0 = no image).
    pub image_puzzles: usize,
    /// Seed of the random schedule and of the bootstrap.
    pub seed: u64,
}

impl Default for FinalEvalConfig {
    fn default() -> Self {
        Self {
            sets: vec![
                EvalSetConfig::default(),
                EvalSetConfig {
                    name: "magictour_top1465".into(),
                    path: PathBuf::from("../shared/datasets/sudoku/magictour_top1465.jsonl"),
                    ..Default::default()
                },
            ],
            schedules: vec![
                Schedule::Random,
                Schedule::LeftToRight,
                Schedule::Expert,
                Schedule::Confidence,
                Schedule::Margin,
                Schedule::Entropy,
                Schedule::Learned,
            ],
            stage2_schedules: vec![Schedule::Margin, Schedule::Confidence, Schedule::Learned],
            decode: DecodeConfig::default(),
            image_puzzles: 3,
            seed: 7,
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

impl SasRecipe {
    /// Range checks.
    pub fn validate(&self, raw: &RawRecipe) -> Result<(), RecipeError> {
        let c = Checker::new(raw);
        check_pair(raw, check_pretrain(&self.pretrain))?;
        check_model(raw, &self.model, self.pretrain.data.side)?;
        check_pair(raw, check_puzzle_set(&self.sas.train, "sas.train"))?;
        check_pair(raw, check_puzzle_set(&self.sas.eval, "sas.eval"))?;
        c.require(
            self.sas.train.side == self.pretrain.data.side
                && self.sas.eval.side == self.pretrain.data.side,
            "sas.train.side",
            "training, evaluation and pre-training puzzles must have the same side",
        )?;
        c.require(
            self.sas.puzzles_per_step >= 1,
            "sas.puzzles_per_step",
            "must be >= 1",
        )?;
        c.require(
            self.sas.group_size >= 2,
            "sas.group_size",
            format!(
                "must be >= 2 (a group baseline needs two orders), got {}",
                self.sas.group_size
            ),
        )?;
        for (p, d) in [
            ("sas.decode", &self.sas.decode),
            ("final_eval.decode", &self.final_eval.decode),
        ] {
            c.require(d.per_step >= 1, &format!("{p}.per_step"), "must be >= 1")?;
            c.require(
                d.batch_size >= 1,
                &format!("{p}.batch_size"),
                "must be >= 1",
            )?;
        }
        c.require(
            self.sas.decode.per_step == 1,
            "sas.decode.per_step",
            "the policy is trained choosing one cell per step; set 1 (k per step is for final_eval.decode)",
        )?;
        c.require(
            self.policy.hidden >= 1 && self.policy.hidden <= 4096,
            "policy.hidden",
            "must be in 1..=4096",
        )?;
        c.positive(self.policy.temperature, "policy.temperature")?;
        c.require(
            self.policy.init_confidence_weight.is_finite(),
            "policy.init_confidence_weight",
            "must be finite",
        )?;
        c.require(
            self.policy.init_margin_weight.is_finite(),
            "policy.init_margin_weight",
            "must be finite",
        )?;
        let s2 = &self.stage2;
        if self.stage2.enabled {
            c.require(s2.steps >= 1, "stage2.steps", "must be >= 1")?;
            c.require(s2.batch_size >= 1, "stage2.batch_size", "must be >= 1")?;
            c.positive(s2.lr, "stage2.lr")?;
            c.non_negative(s2.aux_weight, "stage2.aux_weight")?;
            c.require(
                s2.orders_per_puzzle >= 1,
                "stage2.orders_per_puzzle",
                "must be >= 1",
            )?;
        }
        for (k, s) in self.final_eval.sets.iter().enumerate() {
            if s.path.as_os_str().is_empty() {
                check_pair(
                    raw,
                    check_puzzle_set(&s.generated, &format!("final_eval.sets.{k}.generated")),
                )?;
            }
        }
        c.require(
            !self.final_eval.schedules.is_empty(),
            "final_eval.schedules",
            "needs at least one schedule",
        )?;
        Ok(())
    }
}

fn shape_of(side: usize) -> Shape {
    Shape::from_side(side).unwrap_or(Shape::NINE)
}

/// The denoiser of a `sas` recipe: loaded, or pre-trained first when absent.
fn resolve_denoiser(
    common: &CommonConfig,
    r: &SasRecipe,
    device: &Device,
) -> anyhow::Result<SudokuDenoiser> {
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
                let diff = rec.differences(&r.model, &r.pretrain, common.seed);
                let (seed, other): (Vec<_>, Vec<_>) =
                    diff.into_iter().partition(|d| d.starts_with("seed:"));
                if !other.is_empty() {
                    anyhow::bail!(
                        "{} holds a denoiser pre-trained under other settings than this recipe's \
                         `model:` / `pretrain:` (recorded -> recipe):\n  {}\nPoint `denoiser_dir` \
                         to another folder (a denoiser is pre-trained there first) or delete {}.",
                        dir.display(),
                        other.join("\n  "),
                        dir.display()
                    );
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
        let (m, s) =
            pretrain_denoiser(common, &r.model, &r.pretrain, &r.denoiser_dir, device, None)?;
        tracing::info!(
            "denoiser pre-trained in {:.1}s ({:.3} steps/s, final loss {:.4})",
            s.wall_s,
            s.steps_per_s,
            s.final_loss
        );
        Ok(m)
    }
}

/// File in a `sas` run directory naming the frozen denoiser the policy was trained against.
const DENOISER_SOURCE_FILE: &str = "denoiser_source.json";

/// A digest of the denoiser weights in `dir` (FNV-1a of the weights file, hex).
fn denoiser_digest(dir: &Path) -> anyhow::Result<String> {
    let p = dir.join(DENOISER_FILE);
    let bytes = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    Ok(format!("{:016x}", kiln_search::synthetic::fnv1a(&bytes)))
}

/// Check that the denoiser in `denoiser_dir` is the one the run in `run_dir` recorded (runs
/// made before the record existed pass), so that a policy is never evaluated or continued
/// against a denoiser that was re-trained in the same folder since.
fn check_denoiser_source(run_dir: &Path, denoiser_dir: &Path) -> anyhow::Result<()> {
    let Some(p) = run_dir
        .ancestors()
        .take(4)
        .map(|d| d.join(DENOISER_SOURCE_FILE))
        .find(|p| p.is_file())
    else {
        return Ok(());
    };
    let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let rec: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))?;
    let want = rec
        .get("weights_fnv1a")
        .and_then(|v| v.as_str())
        .unwrap_or_default();
    let have = denoiser_digest(denoiser_dir)?;
    if want != have {
        anyhow::bail!(
            "the denoiser in {} (weights digest {have}) is not the one this run's policy was trained \
             against ({} records {want}): it was re-trained or replaced since. Restore those weights, \
             point `denoiser_dir` at them, or train the policy again.",
            denoiser_dir.display(),
            p.display()
        );
    }
    Ok(())
}

fn record_denoiser_source(run_dir: &Path, denoiser_dir: &Path) -> anyhow::Result<()> {
    let rec = serde_json::json!({
        "denoiser_dir": denoiser_dir.display().to_string(),
        "weights_fnv1a": denoiser_digest(denoiser_dir)?,
    });
    std::fs::create_dir_all(run_dir)?;
    let p = run_dir.join(DENOISER_SOURCE_FILE);
    std::fs::write(&p, serde_json::to_vec_pretty(&rec)?)
        .with_context(|| format!("writing {}", p.display()))
}

fn load_policy(r: &SasRecipe, path: &Path, device: &Device) -> anyhow::Result<OrderPolicy> {
    let ckpt = resolve_checkpoint(path)?;
    let mp = ckpt.join(kiln_rl::checkpoint::MODEL_FILE);
    OrderPolicy::init(&r.policy, shape_of(r.pretrain.data.side), device)
        .try_load_file(&mp)
        .map_err(|e| anyhow::anyhow!("{}: cannot load the order policy: {e}", mp.display()))
}

/// A checkpoint directory from a checkpoint or a run directory.
pub fn resolve_checkpoint(path: &Path) -> anyhow::Result<PathBuf> {
    if path.join(kiln_rl::checkpoint::MODEL_FILE).is_file() {
        return Ok(path.to_path_buf());
    }
    let mgr = kiln_rl::checkpoint::CheckpointManager::new(path, 1);
    mgr.latest().map(|(_, p)| p).with_context(|| {
        format!(
            "{} is neither a checkpoint directory nor a run directory with checkpoints",
            path.display()
        )
    })
}

/// Train the `sas` chain; returns nothing (tables are printed and written to `run_dir/eval`).
pub fn train_sas(
    common: &CommonConfig,
    r: &SasRecipe,
    resolved: &serde_json::Value,
    run_dir: &Path,
    resume: bool,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let device = run::device_for(common.backend)?;
    device.seed(common.seed);
    let denoiser = resolve_denoiser(common, r, &device)?;
    if resume {
        check_denoiser_source(run_dir, &r.denoiser_dir)?;
    }
    record_denoiser_source(run_dir, &r.denoiser_dir)?;
    let t_pre = started.elapsed().as_secs_f64();
    let policy = if !r.stage2.policy_from.as_os_str().is_empty() {
        check_denoiser_source(&r.stage2.policy_from, &r.denoiser_dir)?;
        load_policy(r, &r.stage2.policy_from, &device)?
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
        ad.seed(common.seed);
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
            common.seed,
        );
        let opts = super::trainer_options(common, run_dir);
        let shared = Arc::new(Mutex::new(None));
        let mut trainer = Trainer::new(
            task,
            policy,
            ad,
            opts,
            Box::new(run::SharedSink(shared.clone())),
        );
        let mut from = None;
        if resume {
            from = trainer
                .resume()
                .context("resuming from the newest checkpoint")?;
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
        if let Some(t) = tracker
            && let Err(e) = t.finish(if result.is_ok() { 0 } else { 1 })
        {
            tracing::warn!("finishing the trackers: {e}");
        }
        let summary = result?;
        println!(
            "\nGRPO finished: {} steps in {:.1}s; last reward {:.3}",
            summary.steps,
            summary.wall_s,
            summary.last.get("reward/mean").copied().unwrap_or(f64::NAN)
        );
        for (k, v) in &summary.eval {
            println!("  {k:<28} {v:.4}");
        }
        trainer.model().valid()
    };
    let t_rl = started.elapsed().as_secs_f64() - t_pre;
    let stage2_denoiser = if r.stage2.enabled {
        let mut train = r.sas.train.load()?;
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
            &device,
            common.seed,
            &dir,
            &mut sink,
        )?)
    } else {
        None
    };
    let t_s2 = started.elapsed().as_secs_f64() - t_pre - t_rl;
    final_eval(
        r,
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

/// Run the evaluation table of `r.final_eval`, print it and write it to `out_dir`.
fn final_eval(
    r: &SasRecipe,
    denoiser: &SudokuDenoiser,
    policy: &OrderPolicy,
    stage2: Option<&SudokuDenoiser>,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let fe = &r.final_eval;
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let mut all_md = String::new();
    for set in &fe.sets {
        let puzzles = set.load()?;
        if puzzles.is_empty() {
            tracing::warn!("evaluation set `{}` is empty; skipped", set.name);
            continue;
        }
        let t = std::time::Instant::now();
        let schedules = if set.schedules.is_empty() {
            &fe.schedules
        } else {
            &set.schedules
        };
        let mut outcomes = run_schedules(
            denoiser,
            Some(policy),
            &puzzles,
            schedules,
            &fe.decode,
            fe.seed,
        );
        if let Some(d2) = stage2 {
            // Stage 2: the fine-tuned denoiser under the learned order and the best heuristics.
            let s2: Vec<Schedule> = r
                .final_eval
                .stage2_schedules
                .iter()
                .copied()
                .filter(|s| *s != Schedule::Random && schedules.contains(s))
                .collect();
            for mut o in run_schedules(d2, Some(policy), &puzzles, &s2, &fe.decode, fe.seed) {
                o.schedule = format!("{}+stage2", o.schedule);
                outcomes.push(o);
            }
        }
        let rep = report(&set.name, &outcomes, &fe.decode, fe.seed);
        let md = markdown(&rep);
        println!("\n{md}(evaluated in {:.0}s)", t.elapsed().as_secs_f64());
        all_md.push_str(&md);
        all_md.push('\n');
        let safe: String = set
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "-_".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let jp = out_dir.join(format!("sudoku-{safe}.json"));
        let json = serde_json::json!({
            "report": rep,
            "outcomes": outcomes,
        });
        std::fs::write(&jp, serde_json::to_vec_pretty(&json)?)
            .with_context(|| format!("writing {}", jp.display()))?;
        if fe.image_puzzles > 0 {
            let pick: Vec<&ScheduleOutcome> = outcomes
                .iter()
                .filter(|o| {
                    ["expert", "margin", "learned", "learned+stage2"].contains(&o.schedule.as_str())
                })
                .collect();
            let png = out_dir.join(format!("orders-{safe}.png"));
            let n = fe.image_puzzles.min(puzzles.len());
            match draw_orders(&png, &puzzles[..n], &pick) {
                Ok(()) => println!("unmasking orders: {}", png.display()),
                Err(e) => tracing::warn!("could not draw {}: {e}", png.display()),
            }
        }
    }
    let mp = out_dir.join("sudoku.md");
    std::fs::write(&mp, &all_md).with_context(|| format!("writing {}", mp.display()))?;
    println!("tables: {}", mp.display());
    Ok(())
}

/// `kiln eval` of a `sas` run: the final-evaluation table with the run's denoiser (the stage-2
/// denoiser when the run has one) and the checkpoint's policy.
pub fn eval_sas(
    r: &SasRecipe,
    common: &CommonConfig,
    ckpt: &Path,
    run_dir: &Path,
) -> anyhow::Result<()> {
    let device = run::device_for(common.backend)?;
    let shape = shape_of(r.pretrain.data.side);
    check_denoiser_source(run_dir, &r.denoiser_dir)?;
    let denoiser = load_denoiser(&r.denoiser_dir, shape, &device)?;
    let s2dir = run_dir.join("denoiser-stage2");
    let s2 = if denoiser_exists(&s2dir) {
        Some(load_denoiser(&s2dir, shape, &device)?)
    } else {
        None
    };
    let policy = load_policy(r, ckpt, &device)?;
    // A folder of its own per `kiln eval`: the training run's table in `<run>/eval/` and earlier
    // evaluations (other sets or schedules) are never overwritten.
    let stem = format!("eval-{}", chrono::Utc::now().format("%Y%m%dT%H%M%SZ"));
    let mut out = run_dir.join("eval").join(&stem);
    let mut k = 2;
    while out.exists() {
        out = run_dir.join("eval").join(format!("{stem}-{k}"));
        k += 1;
    }
    final_eval(r, &denoiser, &policy, s2.as_ref(), &out)
}

/// `kiln eval CHECKPOINT --task sudoku --data PATH`: the evaluation table of a `sas` run's
/// policy (and its denoiser) on one puzzle file instead of the recipe's `final_eval.sets`.
#[allow(dead_code)] // called once main.rs grows `kiln eval --task sudoku --data PATH`
pub fn eval_sudoku_file(
    r: &SasRecipe,
    common: &CommonConfig,
    ckpt: &Path,
    run_dir: &Path,
    data: &Path,
) -> anyhow::Result<()> {
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
    eval_sas(&r, common, ckpt, run_dir)
}

// ---------------------------------------------------------------------------------------------
// sas_gsm8k

/// Training of the text order policy (section `train:` of a `sas_gsm8k` recipe).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct GsmTrainConfig {
    /// Train the order policy with GRPO and the self-aware reward before evaluating
    /// (`trainer.steps` steps); false = evaluate the heuristic schedules only.
    pub enabled: bool,
    /// GSM8K JSONL whose reference answers are the teacher-forcing targets.
    pub data: PathBuf,
    /// Use at most this many training problems (0 = all).
    pub limit: usize,
    /// Distinct problems per GRPO step.
    pub prompts_per_step: usize,
    /// Orders per problem (GRPO group size); one batched denoiser forward per step.
    pub group_size: usize,
    /// Token that pads a reference answer to `decode.gen_length` (LLaDA pads with its EOS).
    /// None = the model's `eos_token_id`, else `pad_token_id`, else 0.
    pub answer_pad_token: Option<u32>,
}

impl Default for GsmTrainConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            data: PathBuf::from("../shared/datasets/gsm8k/train.jsonl"),
            limit: 0,
            prompts_per_step: 2,
            group_size: 4,
            answer_pad_token: None,
        }
    }
}

/// The task-specific part of a `sas_gsm8k` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct GsmRecipe {
    /// The masked-diffusion LM to load: an HF folder (config.json + safetensors +
    /// tokenizer.json, e.g. a local copy of LLaDA-8B-Instruct), a `.gguf` file or a name in
    /// `.kiln/models.json`. Empty = the tiny randomly initialised byte-level preset `model`
    /// (a CPU smoke test of the pipeline; its pass@1 is ~0 by construction).
    pub model_path: String,
    /// The tiny preset (used when `model_path` is empty): vocab 256 bytes, mask id 255.
    pub model: TransformerConfig,
    /// GSM8K JSONL evaluated (`question`, `answer` ending in `#### N`).
    pub data: PathBuf,
    /// Problems evaluated (0 = all).
    pub limit: usize,
    /// Prompt template; `{question}` is replaced by the question.
    pub prompt: String,
    /// Longest prompt in tokens (longer prompts keep their last tokens).
    pub max_prompt_tokens: usize,
    /// LLaDA-style decoding protocol (logged with the result); its `gen_length` and
    /// `block_length` also shape the training rollouts.
    pub decode: LladaDecodeConfig,
    /// Schedules evaluated, one pass@1 row each (`learned` needs a trained policy); empty =
    /// `decode.schedule` only.
    pub eval_schedules: Vec<Schedule>,
    /// Problems decoded together.
    pub batch_size: usize,
    /// The text order policy (one transformer layer over per-position features).
    pub policy: TextPolicyConfig,
    /// GRPO training of the policy (self-aware reward, denoiser frozen).
    pub train: GsmTrainConfig,
}

impl Default for GsmRecipe {
    fn default() -> Self {
        Self {
            model_path: String::new(),
            model: TransformerConfig {
                model_type: "llada".into(),
                vocab_size: 256,
                hidden_size: 64,
                intermediate_size: 128,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                num_key_value_heads: Some(4),
                max_position_embeddings: 1024,
                causal: false,
                mask_token_id: Some(255),
                ..TransformerConfig::default()
            },
            data: PathBuf::from("../shared/datasets/gsm8k/test.jsonl"),
            limit: 8,
            prompt: "Question: {question}\nAnswer:".into(),
            max_prompt_tokens: 192,
            decode: LladaDecodeConfig {
                gen_length: 32,
                steps: 32,
                block_length: 16,
                schedule: Schedule::Confidence,
            },
            eval_schedules: Vec::new(),
            batch_size: 8,
            policy: TextPolicyConfig::default(),
            train: GsmTrainConfig::default(),
        }
    }
}

impl GsmRecipe {
    /// Range checks.
    pub fn validate(&self, raw: &RawRecipe) -> Result<(), RecipeError> {
        let c = Checker::new(raw);
        if self.model_path.is_empty() {
            self.model
                .validate()
                .map_err(|e| invalid(raw, "model", e.to_string()))?;
            c.require(
                !self.model.causal,
                "model.causal",
                "a masked diffusion LM is bidirectional: set causal: false",
            )?;
            c.require(
                self.model.mask_token_id.is_some(),
                "model.mask_token_id",
                "a masked diffusion LM needs a mask token id",
            )?;
            c.require(
                self.model.vocab_size >= 256,
                "model.vocab_size",
                "the byte-level tokenizer needs >= 256",
            )?;
        }
        check_pair(raw, self.decode.check())?;
        check_pair(raw, self.policy.check())?;
        c.require(self.batch_size >= 1, "batch_size", "must be >= 1")?;
        c.require(
            self.max_prompt_tokens >= 1,
            "max_prompt_tokens",
            "must be >= 1",
        )?;
        c.require(
            self.prompt.contains("{question}"),
            "prompt",
            "must contain `{question}`",
        )?;
        c.require(
            !self.eval_schedules.contains(&Schedule::Expert),
            "eval_schedules",
            "expert is Sudoku-only",
        )?;
        if self.train.enabled {
            c.require(
                self.train.prompts_per_step >= 1,
                "train.prompts_per_step",
                "must be >= 1",
            )?;
            c.require(
                self.train.group_size >= 2,
                "train.group_size",
                "must be >= 2 (a group baseline needs two orders)",
            )?;
        }
        Ok(())
    }

    fn schedules(&self) -> Vec<Schedule> {
        if self.eval_schedules.is_empty() {
            vec![self.decode.schedule]
        } else {
            self.eval_schedules.clone()
        }
    }
}

/// The masked-diffusion LM of a `sas_gsm8k` run and how text becomes tokens.
struct TextLm {
    model: kiln_lm::Transformer,
    tokenizer: Option<kiln_lm::Tokenizer>,
    mask: u32,
    /// Token that left-pads prompts and pads answers.
    pad: u32,
}

impl TextLm {
    fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match &self.tokenizer {
            Some(t) => Ok(t.encode(text, false)?),
            None => Ok(byte_tokens(text, self.mask)),
        }
    }

    fn decode(&self, ids: &[u32]) -> String {
        match &self.tokenizer {
            Some(t) => t.decode(ids, true).unwrap_or_default(),
            None => ids.iter().map(|&b| (b.min(255) as u8) as char).collect(),
        }
    }

    fn vocab(&self) -> usize {
        self.model.config().vocab_size
    }
}

/// Where the tiny preset's weights are kept inside a run (so `kiln eval` reloads the same ones).
const TINY_LM_FILE: &str = "denoiser-lm.bpk";

/// Load the LM of `r`: the HF folder / GGUF of `model_path`, or the tiny preset (initialised
/// from the run's seed and saved to `run_dir`, or reloaded from there when it exists).
fn load_text_lm(
    r: &GsmRecipe,
    device: &Device,
    run_dir: &Path,
    seed: u64,
) -> anyhow::Result<TextLm> {
    let (model, tokenizer) = if r.model_path.is_empty() {
        let path = run_dir.join(TINY_LM_FILE);
        let m = if path.is_file() {
            r.model.init(device).try_load_file(&path).map_err(|e| {
                anyhow::anyhow!("{}: cannot load the tiny denoiser: {e}", path.display())
            })?
        } else {
            device.seed(seed);
            let m = r.model.init(device);
            std::fs::create_dir_all(run_dir)?;
            m.clone()
                .save_file(&path)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            m
        };
        (m, None)
    } else {
        let (m, t) = kiln_lm::zoo::load_with_tokenizer(&r.model_path, device)
            .with_context(|| format!("loading the masked-diffusion LM `{}`", r.model_path))?;
        (m, Some(t))
    };
    let cfg = model.config();
    let mask = cfg.mask_token_id.ok_or_else(|| {
        anyhow::anyhow!(
            "`{}` has no mask_token_id: SAS needs a masked-diffusion LM (LLaDA)",
            if r.model_path.is_empty() {
                "model"
            } else {
                &r.model_path
            }
        )
    })?;
    anyhow::ensure!(
        !cfg.causal,
        "`{}` is a causal LM; SAS needs a bidirectional masked-diffusion LM",
        r.model_path
    );
    let pad = r
        .train
        .answer_pad_token
        .or_else(|| {
            cfg.eos_token_id
                .as_ref()
                .and_then(|e| e.to_vec().first().copied())
        })
        .or(cfg.pad_token_id)
        .unwrap_or(0);
    Ok(TextLm {
        model,
        tokenizer,
        mask,
        pad,
    })
}

/// True-on-real-token mask of `b` rows of `len` tokens whose leading run of `pad` tokens is
/// left padding; `None` when no row is padded (the plain forward is then the same and cheaper).
/// A row made only of `pad` tokens is left unmasked (masking every key would be undefined).
fn left_padding_mask(toks: &[u32], b: usize, len: usize, pad: u32) -> Option<Vec<bool>> {
    let mut any = false;
    let mut m = vec![true; b * len];
    for (r, row) in toks.chunks(len.max(1)).take(b).enumerate() {
        let lead = row.iter().take_while(|&&t| t == pad).count();
        if lead > 0 && lead < row.len() {
            any = true;
            m[r * len..r * len + lead].fill(false);
        }
    }
    any.then_some(m)
}

/// The [`StatsForward`] of a kiln-lm transformer: everything is reduced on the device (top-2
/// probabilities, entropy, argmax, target log-prob), so only 5 numbers per position reach the
/// host whatever the vocabulary; the mask token is never a prediction.
///
/// Prompts of a batch are left-padded with `pad` ([`left_pad`]): the leading run of `pad`
/// tokens of each row is masked out of attention (and positions start at the first real token),
/// so a padded row gets the same predictions as the same row alone. `pad` tokens after the first
/// real token are real (LLaDA pads answers with its EOS and was trained to predict them).
fn stats_forward(
    model: &kiln_lm::Transformer,
    mask: u32,
    pad: u32,
) -> impl FnMut(&[u32], usize, usize, Option<&[u32]>) -> Vec<PosStats> + '_ {
    let device = model.device();
    let v = model.config().vocab_size;
    let mut bias = vec![0f32; v];
    if (mask as usize) < v {
        bias[mask as usize] = -1.0e9;
    }
    let bias = Tensor::<1>::from_data(TensorData::new(bias, [v]), &device);
    move |toks: &[u32], b: usize, len: usize, targets: Option<&[u32]>| {
        let host = |t: &[u32]| -> Vec<i64> { t.iter().map(|&x| x as i64).collect() };
        let tt = Tensor::<2, Int>::from_data(TensorData::new(host(toks), [b, len]), &device);
        let real = left_padding_mask(toks, b, len, pad);
        let logits = match real {
            Some(m) => {
                let m = Tensor::<2, Bool>::from_data(TensorData::new(m, [b, len]), &device);
                model.forward_masked(tt, m)
            }
            None => model.forward(tt),
        } + bias.clone().reshape([1, 1, v]);
        let lp = log_softmax(logits, 2);
        let top2 = lp.clone().topk(2, 2);
        let arg = lp.clone().argmax(2);
        let ent = (lp.clone().exp() * lp.clone()).sum_dim(2).neg();
        let tgt = targets.map(|t| {
            let ti = Tensor::<3, Int>::from_data(TensorData::new(host(t), [b, len, 1]), &device);
            lp.clone().gather(2, ti)
        });
        let f = |t: Tensor<3>| -> Vec<f32> {
            t.into_data()
                .convert::<f32>()
                .try_into_vec()
                .unwrap_or_default()
        };
        let top2 = f(top2);
        let ent = f(ent);
        let arg: Vec<i64> = arg
            .into_data()
            .convert::<i64>()
            .try_into_vec()
            .unwrap_or_default();
        let tgt = tgt.map(f);
        (0..b * len)
            .map(|i| {
                let (a, c) = (top2[2 * i].exp(), top2[2 * i + 1].exp());
                PosStats {
                    top1: a,
                    margin: a - c,
                    entropy: ent[i],
                    argmax: arg[i] as u32,
                    target_lp: tgt.as_ref().map_or(0.0, |t| t[i]),
                }
            })
            .collect()
    }
}

/// Byte-level tokenizer of the CPU smoke preset: bytes are tokens; the mask id never occurs in
/// text (bytes equal to it are replaced by a space).
fn byte_tokens(text: &str, mask: u32) -> Vec<u32> {
    text.bytes()
        .map(|b| if b as u32 == mask { 32 } else { b as u32 })
        .collect()
}

fn prompt_tokens(r: &GsmRecipe, lm: &TextLm, question: &str) -> anyhow::Result<Vec<u32>> {
    let mut toks = lm.encode(&r.prompt.replace("{question}", question))?;
    if toks.len() > r.max_prompt_tokens {
        toks.drain(..toks.len() - r.max_prompt_tokens);
    }
    Ok(toks)
}

/// `sas_gsm8k`: train the text order policy (when `train.enabled`), then GSM8K pass@1 of every
/// schedule of `eval_schedules`; writes `run_dir/eval/gsm8k.json` (protocol included).
pub fn run_gsm8k(
    common: &CommonConfig,
    r: &GsmRecipe,
    resolved: &serde_json::Value,
    run_dir: &Path,
    resume: bool,
) -> anyhow::Result<()> {
    let device = run::device_for(common.backend)?;
    let lm = load_text_lm(r, &device, run_dir, common.seed)?;
    let policy = if r.train.enabled && common.trainer.steps > 0 {
        let mut problems = load_gsm8k(&r.train.data)?;
        if r.train.limit > 0 {
            problems.truncate(r.train.limit);
        }
        let mut examples = Vec::with_capacity(problems.len());
        for p in &problems {
            let mut target = lm.encode(&p.answer)?;
            target.truncate(r.decode.gen_length);
            target.resize(r.decode.gen_length, lm.pad);
            examples.push(TextExample {
                prompt: prompt_tokens(r, &lm, &p.question)?,
                target,
            });
        }
        tracing::info!(
            "sas_gsm8k: training the text order policy on {} problems ({} x {} orders per step, gen_length {}, block_length {})",
            examples.len(),
            r.train.prompts_per_step,
            r.train.group_size,
            r.decode.gen_length,
            r.decode.block_length
        );
        let settings = TextSasSettings {
            prompts_per_step: r.train.prompts_per_step,
            group_size: r.train.group_size,
            block_length: r.decode.block_length,
            mask_id: lm.mask,
            pad_id: lm.pad,
            vocab: lm.vocab(),
            temperature: r.policy.temperature,
            seed: common.seed,
        };
        let task = TextSasTask::new(
            Box::new(stats_forward(&lm.model, lm.mask, lm.pad)),
            examples,
            settings,
        );
        let ad = device.clone().autodiff();
        ad.seed(common.seed);
        let policy = r.policy.init(&ad);
        super::drive(task, policy, ad, common, resolved, run_dir, resume)?;
        Some(load_text_policy(r, run_dir, &device)?)
    } else {
        None
    };
    gsm8k_eval(r, common, &lm, policy.as_ref(), &r.data, run_dir)
}

fn load_text_policy(
    r: &GsmRecipe,
    ckpt: &Path,
    device: &Device,
) -> anyhow::Result<TextOrderPolicy> {
    let ckpt = resolve_checkpoint(ckpt)?;
    let mp = ckpt.join(kiln_rl::checkpoint::MODEL_FILE);
    r.policy
        .init(device)
        .try_load_file(&mp)
        .map_err(|e| anyhow::anyhow!("{}: cannot load the text order policy: {e}", mp.display()))
}

/// GSM8K pass@1 per schedule on `data`; prints the table and writes `run_dir/eval/gsm8k.json`.
fn gsm8k_eval(
    r: &GsmRecipe,
    common: &CommonConfig,
    lm: &TextLm,
    policy: Option<&TextOrderPolicy>,
    data: &Path,
    run_dir: &Path,
) -> anyhow::Result<()> {
    let mut problems = load_gsm8k(data)?;
    if r.limit > 0 {
        problems.truncate(r.limit);
    }
    let vocab = lm.vocab();
    let mut forward = stats_forward(&lm.model, lm.mask, lm.pad);
    let mut results = Vec::new();
    println!(
        "GSM8K {} ({} problems), LLaDA-style decoding: gen_length {}, steps {}, block_length {}, greedy tokens, model {}",
        data.display(),
        problems.len(),
        r.decode.gen_length,
        r.decode.steps,
        r.decode.block_length,
        if r.model_path.is_empty() {
            "tiny random-init preset (smoke test)"
        } else {
            &r.model_path
        }
    );
    println!("| schedule | pass@1 | correct | seconds |\n|---|---|---|---|");
    for schedule in r.schedules() {
        if schedule == Schedule::Learned && policy.is_none() {
            tracing::warn!("schedule `learned` skipped: no trained text order policy");
            continue;
        }
        let dc = LladaDecodeConfig {
            schedule,
            ..r.decode.clone()
        };
        let mut rng = ChaCha8Rng::seed_from_u64(common.seed);
        let t = std::time::Instant::now();
        let mut rows = Vec::new();
        let mut correct = 0usize;
        for chunk in problems.chunks(r.batch_size) {
            let prompts: Vec<Vec<u32>> = chunk
                .iter()
                .map(|p| prompt_tokens(r, lm, &p.question))
                .collect::<anyhow::Result<_>>()?;
            let refs: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            let prompts = left_pad(&refs, lm.pad);
            let outs = llada_generate(
                &mut forward,
                vocab,
                &prompts,
                &dc,
                lm.mask,
                policy,
                &mut rng,
            );
            for (p, o) in chunk.iter().zip(outs) {
                let text = lm.decode(&o);
                let pred = extract_answer(&text);
                let ok = answers_match(pred, p.gold);
                correct += ok as usize;
                rows.push(serde_json::json!({"gold": p.gold, "pred": pred, "correct": ok, "output": text}));
            }
        }
        let n = problems.len().max(1);
        let secs = t.elapsed().as_secs_f64();
        println!(
            "| {schedule} | {:.1}% | {correct}/{} | {secs:.1} |",
            100.0 * correct as f64 / n as f64,
            problems.len()
        );
        results.push(serde_json::json!({
            "schedule": schedule,
            "pass@1": correct as f64 / n as f64,
            "correct": correct,
            "seconds": secs,
            "rows": rows,
        }));
    }
    let out_dir = run_dir.join("eval");
    std::fs::create_dir_all(&out_dir)?;
    let path = out_dir.join("gsm8k.json");
    let json = serde_json::json!({
        "data": data,
        "problems": problems.len(),
        "protocol": {
            "decode": r.decode,
            "prompt": r.prompt,
            "max_prompt_tokens": r.max_prompt_tokens,
            "greedy_tokens": true,
            "model_path": r.model_path,
            "model": if r.model_path.is_empty() { serde_json::to_value(&r.model)? } else { serde_json::Value::Null },
            "policy": if policy.is_some() { serde_json::to_value(&r.policy)? } else { serde_json::Value::Null },
        },
        "results": results,
    });
    std::fs::write(&path, serde_json::to_vec_pretty(&json)?)?;
    println!("report: {}", path.display());
    Ok(())
}

/// `kiln eval CHECKPOINT --task gsm8k [--data PATH]` of a `sas_gsm8k` run: pass@1 of the run's
/// schedules (with the checkpoint's learned order policy) on `data` (default: the recipe's).
pub fn eval_gsm8k(
    r: &GsmRecipe,
    common: &CommonConfig,
    ckpt: &Path,
    run_dir: &Path,
    data: Option<&Path>,
) -> anyhow::Result<()> {
    let device = run::device_for(common.backend)?;
    let lm = load_text_lm(r, &device, run_dir, common.seed)?;
    let policy = load_text_policy(r, ckpt, &device)?;
    let mut r = r.clone();
    if !r.schedules().contains(&Schedule::Learned) {
        let mut s = r.schedules();
        s.push(Schedule::Learned);
        r.eval_schedules = s;
    }
    gsm8k_eval(
        &r,
        common,
        &lm,
        Some(&policy),
        data.unwrap_or(&r.data),
        run_dir,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn left_padding_mask_covers_the_leading_pad_run_only() {
        let pad = 9;
        // Row 0 unpadded, row 1 padded by two (and a pad token later on, which is real).
        let toks = [1, 2, 3, 9, 9, 9, 1, 9];
        let m = left_padding_mask(&toks, 2, 4, pad).unwrap();
        assert_eq!(m, vec![true, true, true, true, false, false, true, true]);
        assert!(left_padding_mask(&[1, 9, 2, 9], 2, 2, pad).is_none());
        // A row of padding only stays unmasked.
        assert!(left_padding_mask(&[9, 9, 1, 2], 2, 2, pad).is_none());
    }

    /// A left-padded prompt must get the predictions it gets alone; the plain forward (what
    /// decoding did before) does not, so this test fails without the padding mask.
    #[test]
    fn stats_of_a_left_padded_row_match_the_row_alone() {
        let device = Device::flex();
        device.seed(3);
        let model = GsmRecipe::default().model.init(&device);
        let (mask, pad) = (255u32, 0u32);
        let row: Vec<u32> = vec![72, 105, 33, 255, 255, 255, 10, 255];
        let len = row.len();
        let mut fwd = stats_forward(&model, mask, pad);
        let alone = fwd(&row, 1, len, Some(&row));
        // Batch: another unpadded row of length len + 3, and `row` left-padded by 3.
        let other: Vec<u32> = (0..len as u32 + 3).map(|i| 40 + i).collect();
        let mut padded = vec![pad; 3];
        padded.extend_from_slice(&row);
        let toks: Vec<u32> = other.iter().chain(&padded).copied().collect();
        let both = fwd(&toks, 2, len + 3, Some(&toks));
        for (i, a) in alone.iter().enumerate() {
            let p = &both[len + 3 + 3 + i];
            assert!((a.top1 - p.top1).abs() < 1e-5, "pos {i}: {a:?} vs {p:?}");
            assert!((a.margin - p.margin).abs() < 1e-5, "pos {i}");
            assert!((a.entropy - p.entropy).abs() < 1e-4, "pos {i}");
            assert!((a.target_lp - p.target_lp).abs() < 1e-4, "pos {i}");
            assert_eq!(a.argmax, p.argmax, "pos {i}");
        }
        // The unpadded row of the batch is unaffected by the mask of its neighbour.
        let other_alone = fwd(&other, 1, len + 3, Some(&other));
        for (a, p) in other_alone.iter().zip(&both[..len + 3]) {
            assert!((a.entropy - p.entropy).abs() < 1e-4);
        }
        // Control: attending to the padding changes the predictions of this model.
        let pt = Tensor::<2, Int>::from_data(
            TensorData::new(
                padded.iter().map(|&x| x as i64).collect::<Vec<_>>(),
                [1, len + 3],
            ),
            &device,
        );
        let at = Tensor::<2, Int>::from_data(
            TensorData::new(row.iter().map(|&x| x as i64).collect::<Vec<_>>(), [1, len]),
            &device,
        );
        let lp = model.forward(pt).slice([0..1, 3..len + 3]);
        let la = model.forward(at);
        let d = (lp - la).abs().max().into_scalar::<f32>();
        assert!(d > 1e-3, "padding should matter without the mask ({d})");
    }
}
