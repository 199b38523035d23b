//! `task: grpo_sequence`: the recipe of kiln-rl's digit-string smoke task
//! ([`kiln_rl::sequence`]) and its range checks.

use std::collections::BTreeMap;

use kiln_lm::TransformerConfig;
use kiln_rl::sequence::{self, MIN_VOCAB, SequenceConfig};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{CliTask, EvalAt, Run};
use crate::config::Checker;
use crate::recipe::{RawRecipe, RecipeError};

/// The task-specific part of a `grpo_sequence` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct SequenceRecipe {
    /// The policy: a causal transformer (kiln-lm; HF config.json field names). Its vocabulary must
    /// hold the 10 digits, BOS and SEP (vocab_size >= 12).
    pub model: TransformerConfig,
    /// The digit-string task.
    pub sequence: SequenceConfig,
}

impl Default for SequenceRecipe {
    fn default() -> Self {
        let model = TransformerConfig {
            vocab_size: MIN_VOCAB,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(4),
            max_position_embeddings: 64,
            tie_word_embeddings: false,
            causal: true,
            ..TransformerConfig::default()
        };
        Self {
            model,
            sequence: SequenceConfig::default(),
        }
    }
}

/// `task: grpo_sequence`.
pub struct GrpoSequence;

impl CliTask for GrpoSequence {
    type Recipe = SequenceRecipe;
    fn name(&self) -> &'static str {
        "grpo_sequence"
    }
    fn summary(&self) -> &'static str {
        "GRPO from random init on a verifiable digit-string transformation (copy / reverse / increment)"
    }
    fn validate(&self, r: &SequenceRecipe, raw: &RawRecipe) -> Result<(), RecipeError> {
        r.validate(raw)
    }
    fn train(&self, r: &SequenceRecipe, run: &mut Run<'_>) -> anyhow::Result<()> {
        let device = run.device()?;
        let seed = run.common.seed;
        sequence::train(&r.model, &r.sequence, &device, seed, run)?;
        Ok(())
    }
    fn eval(&self, r: &SequenceRecipe, at: &EvalAt<'_>) -> anyhow::Result<BTreeMap<String, f64>> {
        if at.req.data.is_some() || at.req.task.as_deref().is_some_and(|t| t != "grpo_sequence") {
            anyhow::bail!(
                "grpo_sequence checkpoints are evaluated on their own held-out prompts; \
                 --task/--data do not apply (use --set sequence.eval_prompts=N)"
            );
        }
        let (step, m) =
            sequence::evaluate_checkpoint(&r.model, &r.sequence, at.ckpt, &at.device()?)?;
        let out = at.run_dir.join("eval");
        std::fs::create_dir_all(&out)?;
        let report = serde_json::json!({"checkpoint": at.ckpt, "step": step, "metrics": m});
        let path = out.join(format!("step-{step}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
        println!("checkpoint {} (step {step})", at.ckpt.display());
        println!("{:<20} {:>10}", "metric", "value");
        for (k, v) in &m {
            println!("{k:<20} {v:>10.4}");
        }
        println!("report: {}", path.display());
        Ok(m)
    }
}

impl SequenceRecipe {
    /// Range checks.
    pub fn validate(&self, raw: &RawRecipe) -> Result<(), RecipeError> {
        let c = Checker::new(raw);
        let s = &self.sequence;
        c.require(
            s.length >= 1 && s.length <= 64,
            "sequence.length",
            format!("must be in 1..=64, got {}", s.length),
        )?;
        c.require(
            s.prompts_per_step >= 1,
            "sequence.prompts_per_step",
            "must be >= 1",
        )?;
        c.require(
            s.group_size >= 2,
            "sequence.group_size",
            format!(
                "must be >= 2 (a group baseline needs at least two samples), got {}",
                s.group_size
            ),
        )?;
        c.positive(s.temperature, "sequence.temperature")?;
        c.require(s.eval_prompts >= 1, "sequence.eval_prompts", "must be >= 1")?;
        let space = 10f64.powi(s.length as i32);
        c.require(
            (s.eval_prompts as f64) < space / 2.0,
            "sequence.eval_prompts",
            format!(
                "must be less than half of the 10^{} possible prompts",
                s.length
            ),
        )?;
        c.require(
            self.model.vocab_size >= MIN_VOCAB,
            "model.vocab_size",
            format!(
                "must be >= {MIN_VOCAB} (10 digits, BOS, SEP), got {}",
                self.model.vocab_size
            ),
        )?;
        c.require(
            self.model.causal,
            "model.causal",
            "the policy generates left to right: set causal: true",
        )?;
        c.require(
            self.model.max_position_embeddings >= 2 * s.length + 2,
            "model.max_position_embeddings",
            format!("must be >= 2 * sequence.length + 2 = {}", 2 * s.length + 2),
        )?;
        if let Err(e) = self.model.validate() {
            return Err(RecipeError::Invalid {
                at: raw.origin("model"),
                path: "model".into(),
                msg: e.to_string(),
            });
        }
        Ok(())
    }
}
