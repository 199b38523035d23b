//! `task: search_r2`: the Search-R2 / Search-R1 recipe (types in [`kiln_search::pipeline`]) with
//! its located range checks, and the calls into kiln-search's pipeline for `kiln train` and
//! `kiln eval --task qa`.

use std::collections::BTreeMap;

use kiln_lm::TransformerConfig;
use kiln_search::eval::EvalMode;
use kiln_search::pipeline::{self, SearchRecipe};

use super::{CliTask, EvalAt, Run};
use crate::recipe::{RawRecipe, RecipeError};

/// Range checks of a `search_r2` recipe's task fields, located in the recipe.
fn validate_search_r2(r: &SearchRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
    let bad = |path: &str, msg: String| RecipeError::Invalid {
        at: raw.origin(path),
        path: path.to_string(),
        msg,
    };
    if r.search.questions_per_step == 0 {
        return Err(bad(
            "search.questions_per_step",
            "search.questions_per_step must be at least 1".into(),
        ));
    }
    if r.search.batch.group_size < 2 {
        return Err(bad(
            "search.batch.group_size",
            "search.batch.group_size must be at least 2 (GRPO needs a group to compare)".into(),
        ));
    }
    if r.search.batch.protocol.max_turns == 0 {
        return Err(bad(
            "search.batch.protocol.max_turns",
            "search.batch.protocol.max_turns must be at least 1".into(),
        ));
    }
    if r.search.batch.protocol.top_k == 0 {
        return Err(bad(
            "search.batch.protocol.top_k",
            "search.batch.protocol.top_k must be at least 1".into(),
        ));
    }
    if r.search.sampling.max_new_tokens == 0 {
        return Err(bad(
            "search.sampling.max_new_tokens",
            "search.sampling.max_new_tokens must be at least 1".into(),
        ));
    }
    let common: crate::config::CommonConfig = raw.deserialize()?;
    if common.algorithm.entropy_coef != 0.0 {
        return Err(bad(
            "algorithm.entropy_coef",
            "search_r2 logs the policy entropy but does not differentiate it (the gradient would \
             keep a positions x vocabulary tensor per minibatch alive); set algorithm.entropy_coef: 0"
                .into(),
        ));
    }
    if let Err(e) = kiln_search::grpo::check_training_sampling(&r.search.sampling) {
        let field = if r.search.sampling.top_k > 0 {
            "search.sampling.top_k"
        } else if r.search.sampling.top_p < 1.0 {
            "search.sampling.top_p"
        } else if r.search.sampling.greedy {
            "search.sampling.greedy"
        } else {
            "search.sampling.temperature"
        };
        return Err(bad(field, e.to_string()));
    }
    if r.search.max_batch == 0 {
        return Err(bad(
            "search.max_batch",
            "search.max_batch must be at least 1".into(),
        ));
    }
    if let Err(e) = r.search.dynamic_sampling.validate() {
        return Err(bad(
            "search.dynamic_sampling.max_draw_factor",
            format!("search.{e}"),
        ));
    }
    if let Some(l) = &r.lora
        && let Err(e) = l.validate()
    {
        return Err(bad("lora", e));
    }
    if let Err(e) = r.refiner_start.validate() {
        return Err(bad("refiner_start", e.to_string()));
    }
    if r.train_reachable_k > 1000 {
        return Err(bad(
            "train_reachable_k",
            format!(
                "train_reachable_k = {} asks the retriever for that many passages per training question; \
                 use 1..=1000 (3-10 is typical) or 0 to keep every question",
                r.train_reachable_k
            ),
        ));
    }
    if !(r.search.batch.refiner.margin.is_finite()) {
        return Err(bad(
            "search.batch.refiner.margin",
            "search.batch.refiner.margin must be a finite number".into(),
        ));
    }
    for m in &r.final_eval.modes {
        if m.parse::<EvalMode>().is_err() {
            return Err(bad(
                "final_eval.modes",
                format!("unknown mode `{m}`; use direct, rag or agent"),
            ));
        }
    }
    if r.pretrained.is_empty() {
        if r.warm_start.steps == 0 || r.warm_start.batch_size == 0 {
            return Err(bad(
                "warm_start",
                "warm_start.steps and warm_start.batch_size must be at least 1".into(),
            ));
        }
        if r.warm_start.vocab_size < 300 {
            return Err(bad(
                "warm_start.vocab_size",
                "warm_start.vocab_size must be at least 300 (256 bytes + merges + tags)".into(),
            ));
        }
        if let Err(e) = (TransformerConfig {
            vocab_size: r.warm_start.vocab_size,
            ..r.model.clone()
        })
        .validate()
        {
            return Err(bad("model", format!("model: {e}")));
        }
    }
    if !r.pretrained.is_empty() && r.warm_start.steps > 0 {
        // The cold start of a pre-trained policy: demonstrations of the synthetic world.
        if r.warm_start.batch_size == 0 {
            return Err(bad(
                "warm_start.batch_size",
                "warm_start.batch_size must be at least 1".into(),
            ));
        }
    }
    r.world
        .validate()
        .map_err(|e| bad("world", e.to_string()))?;
    Ok(())
}

/// `task: search_r2`.
pub struct SearchR2;

impl CliTask for SearchR2 {
    type Recipe = SearchRecipe;
    fn name(&self) -> &'static str {
        "search_r2"
    }
    fn summary(&self) -> &'static str {
        "Search-R2 / Search-R1: multi-turn search agent (+ meta-refiner) trained with joint GRPO over a BM25 retriever"
    }
    fn validate(&self, r: &SearchRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
        validate_search_r2(r, raw)
    }
    fn train(&self, r: &SearchRecipe, run: &mut Run<'_>) -> anyhow::Result<()> {
        let device = run.device()?;
        let (seed, run_dir) = (run.common.seed, run.run_dir);
        Ok(pipeline::train(r, &device, seed, run_dir, run)?)
    }
    fn eval(&self, r: &SearchRecipe, at: &EvalAt<'_>) -> anyhow::Result<BTreeMap<String, f64>> {
        let q = at.req;
        if !at.ckpt.exists() {
            // `kiln eval RECIPE.yaml`: the policy before training, made first when it is missing.
            pipeline::make_start(
                r,
                &at.device()?,
                at.common.seed,
                &mut crate::run::progress_bar,
            )?;
        }
        match q.task.as_deref() {
            None | Some("qa") | Some("search_r2") => pipeline::eval_qa(
                r,
                &at.device()?,
                at.common.seed,
                at.ckpt,
                at.run_dir,
                q.data.as_deref(),
                q.retriever.as_deref(),
                q.mode.as_deref(),
                q.limit,
            )?,
            Some(other) => anyhow::bail!(
                "`kiln eval` of a `search_r2` run supports --task qa; `{other}` does not apply"
            ),
        }
        Ok(BTreeMap::new())
    }
}
