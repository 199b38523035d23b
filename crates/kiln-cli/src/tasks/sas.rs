//! The SAS tasks' recipes (types in [`kiln_sas::pipeline`]) with their located range checks, and
//! the calls into kiln-sas's pipelines:
//!
//! - `task: mdm_sudoku`: pre-train the Sudoku masked-diffusion denoiser
//!   ([`kiln_sas::pipeline::sudoku::train_mdm`]);
//! - `task: sas`: the chain ([`kiln_sas::pipeline::sudoku::train_sas`]): denoiser, GRPO order
//!   policy, optional stage 2, evaluation table;
//! - `task: sas_gsm8k`: the text order policy and GSM8K pass@1
//!   ([`kiln_sas::pipeline::gsm8k::run_gsm8k`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_sas::denoiser::{DenoiserConfig, check_denoiser_config, check_pretrain};
use kiln_sas::pipeline::gsm8k::{self, GsmRecipe};
use kiln_sas::pipeline::sudoku::{self, MdmRecipe, SasRecipe};
use kiln_sas::schedule::Schedule;
use kiln_sas::sudoku::{Shape, check_puzzle_set};

use super::{CliTask, EvalAt, Run};
use crate::config::Checker;
use crate::recipe::{RawRecipe, RecipeError};

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

fn check_model(raw: &RawRecipe, model: &DenoiserConfig, side: usize) -> Result<(), RecipeError> {
    let shape = Shape::from_side(side)
        .ok_or_else(|| invalid(raw, "pretrain.data.side", "must be 4 or 9"))?;
    check_denoiser_config(model, shape).map_err(|m| invalid(raw, "model", m))
}

/// Range checks of a `mdm_sudoku` recipe's task fields.
fn validate_mdm_sudoku(r: &MdmRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
    check_pair(raw, check_pretrain(&r.pretrain))?;
    check_model(raw, &r.model, r.pretrain.data.side)?;
    Checker::new(raw).require(
        !r.denoiser_dir.as_os_str().is_empty(),
        "denoiser_dir",
        "must not be empty",
    )
}

/// Range checks of a `sas` recipe's task fields.
fn validate_sas(r: &SasRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
    let c = Checker::new(raw);
    check_pair(raw, check_pretrain(&r.pretrain))?;
    check_model(raw, &r.model, r.pretrain.data.side)?;
    check_pair(raw, check_puzzle_set(&r.sas.train, "sas.train"))?;
    check_pair(raw, check_puzzle_set(&r.sas.eval, "sas.eval"))?;
    c.require(
        r.sas.train.side == r.pretrain.data.side && r.sas.eval.side == r.pretrain.data.side,
        "sas.train.side",
        "training, evaluation and pre-training puzzles must have the same side",
    )?;
    c.require(
        r.sas.puzzles_per_step >= 1,
        "sas.puzzles_per_step",
        "must be >= 1",
    )?;
    c.require(
        r.sas.group_size >= 2,
        "sas.group_size",
        format!(
            "must be >= 2 (a group baseline needs two orders), got {}",
            r.sas.group_size
        ),
    )?;
    for (p, d) in [
        ("sas.decode", &r.sas.decode),
        ("final_eval.decode", &r.final_eval.decode),
    ] {
        c.require(d.per_step >= 1, &format!("{p}.per_step"), "must be >= 1")?;
        c.require(
            d.batch_size >= 1,
            &format!("{p}.batch_size"),
            "must be >= 1",
        )?;
    }
    c.require(
        r.sas.decode.per_step == 1,
        "sas.decode.per_step",
        "the policy is trained choosing one cell per step; set 1 (k per step is for final_eval.decode)",
    )?;
    c.require(
        r.policy.hidden >= 1 && r.policy.hidden <= 4096,
        "policy.hidden",
        "must be in 1..=4096",
    )?;
    c.positive(r.policy.temperature, "policy.temperature")?;
    c.require(
        r.policy.init_confidence_weight.is_finite(),
        "policy.init_confidence_weight",
        "must be finite",
    )?;
    c.require(
        r.policy.init_margin_weight.is_finite(),
        "policy.init_margin_weight",
        "must be finite",
    )?;
    let s2 = &r.stage2;
    if r.stage2.enabled {
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
    for (k, s) in r.final_eval.sets.iter().enumerate() {
        if s.path.as_os_str().is_empty() {
            check_pair(
                raw,
                check_puzzle_set(&s.generated, &format!("final_eval.sets.{k}.generated")),
            )?;
        }
    }
    c.require(
        !r.final_eval.schedules.is_empty(),
        "final_eval.schedules",
        "needs at least one schedule",
    )?;
    Ok(())
}

/// Range checks of a `sas_gsm8k` recipe's task fields.
fn validate_sas_gsm8k(r: &GsmRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
    let c = Checker::new(raw);
    if r.model_path.is_empty() {
        r.model
            .validate()
            .map_err(|e| invalid(raw, "model", e.to_string()))?;
        c.require(
            !r.model.causal,
            "model.causal",
            "a masked diffusion LM is bidirectional: set causal: false",
        )?;
        c.require(
            r.model.mask_token_id.is_some(),
            "model.mask_token_id",
            "a masked diffusion LM needs a mask token id",
        )?;
        c.require(
            r.model.vocab_size >= 256,
            "model.vocab_size",
            "the byte-level tokenizer needs >= 256",
        )?;
    }
    check_pair(raw, r.decode.check())?;
    check_pair(raw, r.policy.check())?;
    c.require(r.batch_size >= 1, "batch_size", "must be >= 1")?;
    c.require(
        r.max_prompt_tokens >= 1,
        "max_prompt_tokens",
        "must be >= 1",
    )?;
    c.require(
        r.prompt.contains("{question}"),
        "prompt",
        "must contain `{question}`",
    )?;
    c.require(
        !r.eval_schedules.contains(&Schedule::Expert),
        "eval_schedules",
        "expert is Sudoku-only",
    )?;
    if r.train.enabled {
        c.require(
            r.train.prompts_per_step >= 1,
            "train.prompts_per_step",
            "must be >= 1",
        )?;
        c.require(
            r.train.group_size >= 2,
            "train.group_size",
            "must be >= 2 (a group baseline needs two orders)",
        )?;
    }
    Ok(())
}

/// `task: mdm_sudoku`.
pub struct MdmSudoku;

impl CliTask for MdmSudoku {
    type Recipe = MdmRecipe;
    fn name(&self) -> &'static str {
        "mdm_sudoku"
    }
    fn summary(&self) -> &'static str {
        "pre-train the masked-diffusion Sudoku denoiser (1/t-weighted masked cross-entropy)"
    }
    fn validate(&self, r: &MdmRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
        validate_mdm_sudoku(r, raw)
    }
    fn train(&self, r: &MdmRecipe, run: &mut Run<'_>) -> anyhow::Result<()> {
        let device = run.device()?;
        let mut tracker = run.open_tracker(None)?;
        let mut sink = |step: u64, m: &[(&str, f64)]| {
            let row: BTreeMap<String, f64> = m.iter().map(|(k, v)| (k.to_string(), *v)).collect();
            tracker.log(step, &row);
        };
        let result = sudoku::train_mdm(r, &device, run.common.seed, &mut sink);
        let code = if result.is_ok() { 0 } else { 1 };
        if let Err(e) = tracker.finish(code) {
            tracing::warn!("finishing the trackers: {e}");
        }
        result?;
        Ok(())
    }
    fn eval(&self, _r: &MdmRecipe, _at: &EvalAt<'_>) -> anyhow::Result<BTreeMap<String, f64>> {
        anyhow::bail!(
            "`kiln eval` evaluates `sas` runs (their order policy checkpoints); `mdm_sudoku` \
             saves a denoiser, evaluate it through a `sas` run"
        )
    }
}

/// `task: sas`.
pub struct Sas;

impl CliTask for Sas {
    type Recipe = SasRecipe;
    fn name(&self) -> &'static str {
        "sas"
    }
    fn summary(&self) -> &'static str {
        "SAS: learn the unmasking order of a frozen Sudoku denoiser with GRPO and the self-aware reward"
    }
    fn validate(&self, r: &SasRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
        validate_sas(r, raw)
    }
    fn train(&self, r: &SasRecipe, run: &mut Run<'_>) -> anyhow::Result<()> {
        let device = run.device()?;
        let (seed, run_dir, resume) = (run.common.seed, run.run_dir, run.resume);
        Ok(sudoku::train_sas(r, &device, seed, run_dir, resume, run)?)
    }
    fn eval(&self, r: &SasRecipe, at: &EvalAt<'_>) -> anyhow::Result<BTreeMap<String, f64>> {
        let device = at.device()?;
        match (at.req.task.as_deref(), at.req.data.as_deref()) {
            (None | Some("sudoku") | Some("sas"), Some(data)) => sudoku::eval_sudoku_file(
                r,
                &device,
                at.ckpt,
                at.run_dir,
                &at.fresh_eval_dir(),
                Path::new(data),
            )?,
            (None | Some("sudoku") | Some("sas"), None) => {
                sudoku::eval_sas(r, &device, at.ckpt, at.run_dir, &at.fresh_eval_dir())?
            }
            (Some(other), _) => anyhow::bail!(
                "`kiln eval` of a `sas` run supports --task sudoku (with --data PATH for a puzzle \
                 file); for --task gsm8k evaluate a `sas_gsm8k` run (recipes/sas_gsm8k_llada.yaml); \
                 `{other}` is not available for it"
            ),
        }
        Ok(BTreeMap::new())
    }
    fn policy_from(&self, r: &SasRecipe) -> Option<PathBuf> {
        let from = &r.stage2.policy_from;
        (r.stage2.enabled && !from.as_os_str().is_empty()).then(|| from.clone())
    }
}

/// `task: sas_gsm8k`.
pub struct SasGsm8k;

impl CliTask for SasGsm8k {
    type Recipe = GsmRecipe;
    fn name(&self) -> &'static str {
        "sas_gsm8k"
    }
    fn summary(&self) -> &'static str {
        "GSM8K pass@1 of a masked diffusion LM with LLaDA-style decoding"
    }
    fn validate(&self, r: &GsmRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
        validate_sas_gsm8k(r, raw)
    }
    fn train(&self, r: &GsmRecipe, run: &mut Run<'_>) -> anyhow::Result<()> {
        let device = run.device()?;
        let (seed, run_dir) = (run.common.seed, run.run_dir);
        Ok(gsm8k::run_gsm8k(r, &device, seed, run_dir, run)?)
    }
    fn eval(&self, r: &GsmRecipe, at: &EvalAt<'_>) -> anyhow::Result<BTreeMap<String, f64>> {
        match at.req.task.as_deref() {
            None | Some("gsm8k") | Some("sas_gsm8k") => gsm8k::eval_gsm8k(
                r,
                &at.device()?,
                at.common.seed,
                at.ckpt,
                at.run_dir,
                at.req.data.as_deref().map(Path::new),
            )?,
            Some(other) => anyhow::bail!(
                "`kiln eval` of a `sas_gsm8k` run supports --task gsm8k (with --data PATH); \
                 `{other}` is not available for it"
            ),
        }
        Ok(BTreeMap::new())
    }
}
