//! `task: grpo_sequence`, the trainer's smoke task: GRPO alone, from random initialisation, on a
//! verifiable digit-string transformation. The prompt is `BOS d1..dL SEP`; the policy (a kiln-lm
//! causal transformer) writes L tokens; the reward is the share of positions equal to the
//! transformed string (copy, reverse or increment mod 10). Chance is 0.1 per position, so a reward
//! near 1 on held-out prompts proves the loop learns end to end with no data and no other task.
//!
//! The whole prompt set is `10^L` strings; the evaluation prompts are drawn once from
//! `eval_seed` and never used for training (the training sampler rejects them).
//!
//! Behind the `sequence-task` feature (it needs kiln-lm's transformer); kiln-cli turns it on.

use std::collections::{BTreeMap, HashSet};

use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::path::Path;

use burn::module::Module;
use kiln_lm::{Transformer, TransformerConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{CheckpointManager, MODEL_FILE};
use crate::{Driver, PipelineError, RlTask, Rollout, Scored, TaskError, Trained};

/// Token id of the beginning-of-sequence marker (digits are tokens 0..=9).
pub const BOS: u32 = 10;
/// Token id separating prompt and response.
pub const SEP: u32 = 11;
/// Smallest vocabulary the task needs.
pub const MIN_VOCAB: usize = 12;

/// The transformation the policy must learn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Transform {
    /// Reproduce the prompt.
    #[default]
    Copy,
    /// Reverse the prompt.
    Reverse,
    /// Add one to every digit, modulo 10.
    Increment,
}

impl Transform {
    /// The target response for `prompt` digits.
    pub fn apply(self, digits: &[u32]) -> Vec<u32> {
        match self {
            Transform::Copy => digits.to_vec(),
            Transform::Reverse => digits.iter().rev().copied().collect(),
            Transform::Increment => digits.iter().map(|d| (d + 1) % 10).collect(),
        }
    }
}

/// The task section of a `grpo_sequence` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct SequenceConfig {
    /// copy | reverse | increment.
    pub transform: Transform,
    /// Digits per prompt (and response tokens per trajectory).
    pub length: usize,
    /// Distinct prompts per training step.
    pub prompts_per_step: usize,
    /// Sampled responses per prompt (the GRPO group size G).
    pub group_size: usize,
    /// Sampling temperature of rollouts (the re-scoring pass uses the same temperature).
    pub temperature: f64,
    /// Held-out prompts for evaluation (greedy decoding).
    pub eval_prompts: usize,
    /// Seed of the held-out prompt set (independent of the run seed so runs share it).
    pub eval_seed: u64,
}

impl Default for SequenceConfig {
    fn default() -> Self {
        Self {
            transform: Transform::Copy,
            length: 6,
            prompts_per_step: 16,
            group_size: 8,
            temperature: 1.0,
            eval_prompts: 256,
            eval_seed: 1234,
        }
    }
}

/// Rollout data: full token rows `[BOS, prompt, SEP, response]` for each trajectory.
pub struct SeqData {
    tokens: Vec<u32>,
    width: usize,
}

/// The task.
pub struct SequenceTask {
    cfg: SequenceConfig,
    device: Device,
    eval_set: Vec<Vec<u32>>,
    eval_lookup: HashSet<Vec<u32>>,
}

impl SequenceTask {
    /// Build the task; `device` is where token tensors are created (the model's device).
    pub fn new(cfg: SequenceConfig, device: Device) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(cfg.eval_seed);
        let mut eval_lookup = HashSet::new();
        let mut eval_set = Vec::new();
        while eval_set.len() < cfg.eval_prompts {
            let p: Vec<u32> = (0..cfg.length).map(|_| rng.random_range(0..10)).collect();
            if eval_lookup.insert(p.clone()) {
                eval_set.push(p);
            }
        }
        Self {
            cfg,
            device,
            eval_set,
            eval_lookup,
        }
    }

    fn prompt_width(&self) -> usize {
        self.cfg.length + 2
    }

    fn sample_prompt(&self, rng: &mut ChaCha8Rng) -> Vec<u32> {
        loop {
            let p: Vec<u32> = (0..self.cfg.length)
                .map(|_| rng.random_range(0..10))
                .collect();
            if !self.eval_lookup.contains(&p) {
                return p;
            }
        }
    }

    fn tokens_tensor(&self, device: &Device, rows: &[u32], b: usize, w: usize) -> Tensor<2, Int> {
        let data: Vec<i64> = rows.iter().map(|&x| x as i64).collect();
        Tensor::from_data(TensorData::new(data, [b, w]), device)
    }

    /// Decode `length` tokens after the prompts: sampled at `temperature` (with `rng`) or greedy.
    /// Also returns, per row, the log-prob of each sampled token under the sampling softmax
    /// (empty when greedy).
    fn decode(
        &self,
        policy: &Transformer,
        prompts: &[Vec<u32>],
        mut rng: Option<&mut ChaCha8Rng>,
    ) -> (Vec<Vec<u32>>, Vec<Vec<f32>>) {
        let mut logps: Vec<Vec<f32>> = vec![Vec::new(); prompts.len()];
        let b = prompts.len();
        let pw = self.prompt_width();
        let mut rows: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut r = Vec::with_capacity(pw + self.cfg.length);
                r.push(BOS);
                r.extend_from_slice(p);
                r.push(SEP);
                r
            })
            .collect();
        let device = policy_device(policy, &self.device);
        for _ in 0..self.cfg.length {
            let w = rows[0].len();
            let flat: Vec<u32> = rows.iter().flatten().copied().collect();
            let tokens = self.tokens_tensor(&device, &flat, b, w);
            let logits = policy.forward(tokens); // [b, w, V]
            let v = logits.dims()[2];
            let last = logits.slice([0..b, (w - 1)..w]).reshape([b, v]);
            match rng.as_deref_mut() {
                Some(rng) => {
                    let logp = log_softmax(last.div_scalar(self.cfg.temperature), 1);
                    let host: Vec<f32> = logp
                        .into_data()
                        .convert::<f32>()
                        .try_into_vec()
                        .unwrap_or_default();
                    for (i, row) in rows.iter_mut().enumerate() {
                        let lp = &host[i * v..(i + 1) * v];
                        let tok = sample_categorical(lp, rng);
                        logps[i].push(lp[tok as usize]);
                        row.push(tok);
                    }
                }
                None => {
                    let am: Vec<i64> = last
                        .argmax(1)
                        .into_data()
                        .convert::<i64>()
                        .try_into_vec()
                        .unwrap_or_default();
                    for (row, a) in rows.iter_mut().zip(am) {
                        row.push(a as u32);
                    }
                }
            }
        }
        (rows, logps)
    }

    fn score_rows(&self, row: &[u32]) -> f64 {
        let pw = self.prompt_width();
        let prompt = &row[1..pw - 1];
        let target = self.cfg.transform.apply(prompt);
        let resp = &row[pw..];
        let hits = target.iter().zip(resp).filter(|(a, b)| a == b).count();
        hits as f64 / self.cfg.length as f64
    }
}

fn policy_device(policy: &Transformer, fallback: &Device) -> Device {
    policy
        .devices()
        .into_iter()
        .next()
        .unwrap_or_else(|| fallback.clone())
}

/// Sample an index from log-probabilities with inverse-CDF sampling.
pub fn sample_categorical(logp: &[f32], rng: &mut ChaCha8Rng) -> u32 {
    let u: f64 = rng.random();
    let mut acc = 0.0f64;
    let mut last_valid = 0;
    for (i, lp) in logp.iter().enumerate() {
        let p = (*lp as f64).exp();
        if p.is_finite() && p > 0.0 {
            last_valid = i;
        }
        acc += if p.is_finite() { p } else { 0.0 };
        if u < acc {
            return i as u32;
        }
    }
    last_valid as u32
}

impl RlTask for SequenceTask {
    type Policy = Transformer;
    type Data = SeqData;

    fn name(&self) -> &str {
        "grpo_sequence"
    }

    fn rollout(
        &mut self,
        policy: &Transformer,
        _step: u64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Rollout<SeqData>, TaskError> {
        let g = self.cfg.group_size;
        let mut prompts = Vec::with_capacity(self.cfg.prompts_per_step * g);
        for _ in 0..self.cfg.prompts_per_step {
            let p = self.sample_prompt(rng);
            for _ in 0..g {
                prompts.push(p.clone());
            }
        }
        let (rows, logps) = self.decode(policy, &prompts, Some(rng));
        let rewards: Vec<f64> = rows.iter().map(|r| self.score_rows(r)).collect();
        let width = rows[0].len();
        let exact = rewards.iter().filter(|r| **r >= 1.0).count() as f64 / rewards.len() as f64;
        let mut metrics = BTreeMap::new();
        metrics.insert("reward/exact".to_string(), exact);
        Ok(Rollout {
            data: SeqData {
                tokens: rows.into_iter().flatten().collect(),
                width,
            },
            group_size: g,
            rewards,
            step_rewards: None,
            max_actions: self.cfg.length,
            action_mask: vec![1.0; prompts.len() * self.cfg.length],
            metrics,
            sampled_logp: Some(logps.into_iter().flatten().collect()),
        })
    }

    fn score(&self, policy: &Transformer, data: &SeqData, indices: &[usize]) -> Scored {
        let b = indices.len();
        let w = data.width;
        let l = self.cfg.length;
        let pw = self.prompt_width();
        let mut rows = Vec::with_capacity(b * w);
        let mut targets = Vec::with_capacity(b * l);
        for &i in indices {
            let r = &data.tokens[i * w..(i + 1) * w];
            rows.extend_from_slice(r);
            targets.extend(r[pw..].iter().map(|&t| t as i64));
        }
        let device = policy_device(policy, &self.device);
        let tokens = self.tokens_tensor(&device, &rows, b, w);
        let logits = policy.forward(tokens); // [b, w, V]
        let v = logits.dims()[2];
        // Position p predicts token p + 1: responses at pw..w are predicted from pw-1..w-1.
        let logits = logits
            .slice([0..b, (pw - 1)..(w - 1)])
            .div_scalar(self.cfg.temperature);
        let logp_all = log_softmax(logits, 2); // [b, l, V]
        let idx: Tensor<3, Int> = Tensor::from_data(TensorData::new(targets, [b, l, 1]), &device);
        let logp = logp_all.clone().gather(2, idx).reshape([b, l]);
        let entropy = (logp_all.clone().exp() * logp_all)
            .sum_dim(2)
            .reshape([b, l])
            .neg();
        let _ = v;
        Scored {
            logp,
            entropy: Some(entropy),
        }
    }

    fn evaluate(
        &mut self,
        policy: &Transformer,
        _step: u64,
    ) -> Result<BTreeMap<String, f64>, TaskError> {
        let mut acc = 0.0;
        let mut exact = 0.0;
        let n = self.eval_set.len();
        for chunk in self.eval_set.chunks(256) {
            let (rows, _) = self.decode(policy, chunk, None);
            for r in &rows {
                let s = self.score_rows(r);
                acc += s;
                if s >= 1.0 {
                    exact += 1.0;
                }
            }
        }
        let mut m = BTreeMap::new();
        m.insert("eval/accuracy".into(), acc / n as f64);
        m.insert("eval/exact".into(), exact / n as f64);
        Ok(m)
    }
}

/// Train the smoke task: a fresh causal transformer of `model` (initialised after seeding
/// `device` with the run seed `seed`) on `cfg`, through `driver`; returns the trained policy.
pub fn train(
    model: &TransformerConfig,
    cfg: &SequenceConfig,
    device: &Device,
    seed: u64,
    driver: &mut impl Driver,
) -> Result<Trained<Transformer>, PipelineError> {
    device.seed(seed);
    let ad = device.clone().autodiff();
    let policy = model.init(&ad);
    tracing::info!("grpo_sequence: {} parameters", policy.num_params());
    let task = SequenceTask::new(cfg.clone(), ad.clone());
    Ok(driver.train(task, policy, ad)?)
}

/// The held-out evaluation ([`RlTask::evaluate`]) of the policy in checkpoint directory `ckpt`
/// (a transformer of `model`), on `device`; returns the checkpoint's step and the metrics.
pub fn evaluate_checkpoint(
    model: &TransformerConfig,
    cfg: &SequenceConfig,
    ckpt: &Path,
    device: &Device,
) -> Result<(u64, BTreeMap<String, f64>), PipelineError> {
    let mp = ckpt.join(MODEL_FILE);
    let policy = model
        .init(device)
        .try_load_file(&mp)
        .map_err(|e| PipelineError(format!("{}: cannot load the model: {e}", mp.display())))?;
    let mut task = SequenceTask::new(cfg.clone(), device.clone());
    let step = CheckpointManager::read_state(ckpt)
        .map(|s| s.step)
        .unwrap_or(0);
    let m = task
        .evaluate(&policy, step)
        .map_err(|e| PipelineError(format!("evaluation failed: {e}")))?;
    Ok((step, m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transforms() {
        assert_eq!(Transform::Copy.apply(&[1, 2, 3]), vec![1, 2, 3]);
        assert_eq!(Transform::Reverse.apply(&[1, 2, 3]), vec![3, 2, 1]);
        assert_eq!(Transform::Increment.apply(&[1, 9, 0]), vec![2, 0, 1]);
    }

    #[test]
    fn sampling_follows_probabilities() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let lp = [0.7f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        let mut counts = [0usize; 3];
        for _ in 0..20000 {
            counts[sample_categorical(&lp, &mut rng) as usize] += 1;
        }
        assert!((counts[0] as f64 / 20000.0 - 0.7).abs() < 0.02);
        assert!((counts[2] as f64 / 20000.0 - 0.1).abs() < 0.02);
    }

    #[test]
    fn eval_prompts_are_held_out() {
        let t = SequenceTask::new(SequenceConfig::default(), Device::flex());
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for _ in 0..2000 {
            let p = t.sample_prompt(&mut rng);
            assert!(!t.eval_lookup.contains(&p));
        }
    }

    #[test]
    fn rewards_count_matching_positions() {
        let t = SequenceTask::new(
            SequenceConfig {
                length: 4,
                transform: Transform::Reverse,
                ..Default::default()
            },
            Device::flex(),
        );
        let row = [BOS, 1, 2, 3, 4, SEP, 4, 3, 0, 0];
        assert!((t.score_rows(&row) - 0.5).abs() < 1e-12);
    }
}
