//! Joint GRPO for Search-R2 through kiln-rl's [`RlTask`] seam (METHODS, Search-R2 "Joint GRPO").
//!
//! One rollout batch = `questions_per_step` training questions x G trajectories from the actor, then the
//! meta-refiner (same weights) and regeneration of the cut ones ([`crate::task::rollout_batch`]). Each
//! trajectory becomes one row of actions: its response tokens (policy tokens mask 1, observation tokens mask 0,
//! so observations are excluded from the loss and from the KL term), followed, under joint optimisation, by the
//! refiner's decision tokens (`" 0"` or `" j"` after the refiner prompt, mask 1). The trajectory's reward
//! (after revision) is broadcast to all of them by kiln-rl's group advantage. [`SearchTask::score`]
//! re-scores exactly the stored ids: one forward over `prompt + response` rows and one over
//! `refiner prompt + decision` rows.

use std::collections::BTreeMap;

use burn::tensor::{Int, Tensor, TensorData};
use kiln_lm::{SamplingConfig, Tokenizer, Transformer, score_tokens_with_entropy};
use kiln_rl::{EpochSampler, RlTask, Rollout, Scored, TaskError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::agent::{
    LmActor, LmJudge, LmRefiner, RetrieverBackend, encode, padded, tokenize_episode,
};
use crate::data::QaExample;
use crate::eval::EvalMode;
use crate::protocol::{PromptTemplate, Trajectory};
use crate::reward::DeterministicJudge;
use crate::task::{BatchConfig, RolloutItem, evaluate, rollout_batch};

/// Settings of the GRPO task (the recipe's `search` section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct SearchTaskConfig {
    /// Training questions per GRPO step (each gets `batch.group_size` trajectories). Default 8.
    pub questions_per_step: usize,
    /// Sampling of the actor during training rollouts (temperature 1, at most 48 new tokens per turn).
    pub sampling: SamplingConfig,
    /// Rollout batch: group size G, protocol (max_turns, top_k), refiner, reward.
    pub batch: BatchConfig,
    /// Held-out questions evaluated (greedy, actor alone) at `trainer.eval_every` and at the end. Default 100.
    pub eval_questions: usize,
    /// Sequences per forward pass when re-scoring (memory bound). Default 64.
    pub max_batch: usize,
    /// Process-reward judge: `deterministic` (a passage contains a gold alias or is a gold supporting
    /// passage) or `llm` (a kiln-lm model answers yes/no, see [`crate::agent::LmJudge`]; the policy itself
    /// unless the recipe's `judge_model` names another model).
    pub judge: JudgeKind,
}

/// Which process judge scores the searches.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum JudgeKind {
    /// Gold alias / supporting passage match.
    #[default]
    Deterministic,
    /// Teacher-forced yes/no of a language model.
    Llm,
}

impl Default for SearchTaskConfig {
    fn default() -> Self {
        SearchTaskConfig {
            questions_per_step: 8,
            sampling: SamplingConfig {
                max_new_tokens: 48,
                temperature: 1.0,
                ..SamplingConfig::default()
            },
            batch: BatchConfig::default(),
            eval_questions: 100,
            max_batch: 64,
            judge: JudgeKind::Deterministic,
        }
    }
}

/// The packed rows of a rollout batch ([`SearchTask::pack_rows`]).
#[derive(Default)]
struct PackedRows {
    data: SearchData,
    action_mask: Vec<f32>,
    /// Response tokens (policy and observation) over all rows.
    response_tokens: usize,
    /// Policy tokens (mask 1) of the responses over all rows.
    policy_tokens: usize,
    /// `n * T` log-probs the actor's tokens were sampled with (NaN where unknown: observation
    /// and refiner entries, policy segments without recorded log-probs), when any is known.
    sampled_logp: Option<Vec<f32>>,
}

/// Rollout data kept for re-scoring.
#[derive(Default)]
pub struct SearchData {
    /// `prompt + response` ids per trajectory.
    actor_rows: Vec<Vec<u32>>,
    /// Index of the first response token in each actor row.
    actor_start: Vec<usize>,
    /// `refiner prompt + decision` ids and the decision's start, when the refiner decided on this trajectory
    /// and joint optimisation is on.
    refiner_rows: Vec<Option<(Vec<u32>, usize)>>,
    /// Width of the actor part of the action axis.
    ta: usize,
    /// Width of the refiner part.
    td: usize,
    /// Sampling temperature of the actor's tokens (their re-scoring temperature).
    temperature: f32,
}

impl SearchData {
    /// Number of trajectories.
    pub fn len(&self) -> usize {
        self.actor_rows.len()
    }

    /// True when the batch holds no trajectory.
    pub fn is_empty(&self) -> bool {
        self.actor_rows.is_empty()
    }

    /// `prompt + response` ids of trajectory `i` and the index of its first response token.
    pub fn actor_row(&self, i: usize) -> (&[u32], usize) {
        (&self.actor_rows[i], self.actor_start[i])
    }

    /// `refiner prompt + decision` ids of trajectory `i` and the decision's start, when its
    /// refiner decision is in the loss (joint optimisation and the refiner decided).
    pub fn refiner_row(&self, i: usize) -> Option<(&[u32], usize)> {
        self.refiner_rows[i]
            .as_ref()
            .map(|(r, s)| (r.as_slice(), *s))
    }

    /// Widths of the action axis: (actor part, refiner part); the refiner part follows the actor's.
    pub fn widths(&self) -> (usize, usize) {
        (self.ta, self.td)
    }
}

/// The Search-R2 / Search-R1 GRPO task.
pub struct SearchTask {
    cfg: SearchTaskConfig,
    tokenizer: Tokenizer,
    template: PromptTemplate,
    search: RetrieverBackend,
    train: Vec<QaExample>,
    eval: Vec<QaExample>,
    sampler: EpochSampler,
    judge_model: Option<(Transformer, Tokenizer)>,
}

/// Epoch-shuffle constant of the training questions' [`EpochSampler`].
const EPOCH_MIX: u64 = 0x9E37_79B9;

fn task_err(e: impl std::fmt::Display) -> TaskError {
    e.to_string().into()
}

impl SearchTask {
    /// A task over `train` questions (shuffled each epoch with `seed`) and `eval` questions.
    pub fn new(
        cfg: SearchTaskConfig,
        tokenizer: Tokenizer,
        template: PromptTemplate,
        search: RetrieverBackend,
        train: Vec<QaExample>,
        eval: Vec<QaExample>,
        seed: u64,
    ) -> Result<Self, Error> {
        if train.is_empty() {
            return Err(Error::Invalid("no training questions".into()));
        }
        if cfg.questions_per_step == 0 {
            return Err(Error::Invalid(
                "search.questions_per_step must be at least 1".into(),
            ));
        }
        template.validate()?;
        cfg.batch.protocol.validate()?;
        check_training_sampling(&cfg.sampling)?;
        Ok(SearchTask {
            cfg,
            tokenizer,
            template,
            search,
            sampler: EpochSampler::new(train.len(), seed, EPOCH_MIX),
            train,
            eval,
            judge_model: None,
        })
    }

    /// Uses `model` as the LLM judge (with `judge: llm`) instead of the policy itself.
    pub fn with_judge_model(mut self, model: Transformer, tokenizer: Tokenizer) -> Self {
        self.judge_model = Some((model, tokenizer));
        self
    }

    fn next_questions(&mut self) -> Vec<QaExample> {
        self.sampler
            .take(self.cfg.questions_per_step)
            .into_iter()
            .map(|i| self.train[i].clone())
            .collect()
    }

    /// The re-scoring rows of a rollout batch: per trajectory the `prompt + response` ids (cut to
    /// the model's `window`) with the response's loss mask, and under joint optimisation the
    /// `refiner prompt + decision` ids of its last refiner decision; plus the action mask over
    /// the action axis `[actor part | refiner part]`.
    fn pack_rows(&self, items: &[RolloutItem], window: usize) -> Result<PackedRows, TaskError> {
        let joint = self.cfg.batch.refiner.enabled && self.cfg.batch.refiner.joint;
        let n = items.len();
        let mut p = PackedRows::default();
        let mut actor_masks = Vec::with_capacity(n);
        let mut actor_lps: Vec<Vec<f32>> = Vec::with_capacity(n);
        let mut any_lp = false;
        for it in items {
            let mut traj: Trajectory = it.episode.trajectory.clone();
            tokenize_episode(&self.tokenizer, &mut traj).map_err(task_err)?;
            let (ids, mut m) = traj.ids_and_loss_mask().map_err(task_err)?;
            let mut lp: Vec<f32> = Vec::with_capacity(ids.len());
            for seg in traj.segments() {
                let k = seg.token_ids.as_ref().map_or(0, Vec::len);
                match (&seg.kind, &seg.logprobs) {
                    (crate::protocol::SegmentKind::Policy, Some(l)) if l.len() == k => {
                        any_lp = true;
                        lp.extend_from_slice(l);
                    }
                    _ => lp.extend(std::iter::repeat_n(f32::NAN, k)),
                }
            }
            let prompt = traj.prompt_token_ids.clone().unwrap_or_default();
            let mut row = prompt.clone();
            row.extend_from_slice(&ids);
            // Tokens past the window cannot be scored: drop them (and their mask).
            if row.len() > window {
                row.truncate(window);
                m.truncate(window.saturating_sub(prompt.len()));
            }
            lp.truncate(m.len());
            actor_lps.push(lp);
            p.response_tokens += m.len();
            p.policy_tokens += m.iter().filter(|x| **x > 0.0).count();
            p.data.actor_start.push(prompt.len());
            p.data.actor_rows.push(row);
            actor_masks.push(m);
            let rr = if joint {
                self.refiner_row(it, window)?
            } else {
                None
            };
            p.data.refiner_rows.push(rr);
        }
        let ta = actor_masks.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let td = p
            .data
            .refiner_rows
            .iter()
            .flatten()
            .map(|(r, s)| r.len() - s)
            .max()
            .unwrap_or(0);
        let t = ta + td;
        p.action_mask = vec![0.0f32; n * t];
        let mut sampled = vec![f32::NAN; n * t];
        for (i, m) in actor_masks.iter().enumerate() {
            p.action_mask[i * t..i * t + m.len()].copy_from_slice(m);
            let lp = &actor_lps[i];
            sampled[i * t..i * t + lp.len()].copy_from_slice(lp);
            if let Some((r, s)) = &p.data.refiner_rows[i] {
                for k in 0..r.len() - s {
                    p.action_mask[i * t + ta + k] = 1.0;
                }
            }
        }
        p.sampled_logp = any_lp.then_some(sampled);
        p.data.ta = ta;
        p.data.td = td;
        p.data.temperature = self.cfg.sampling.temperature;
        Ok(p)
    }

    /// `refiner prompt + decision` ids of the last refiner decision on `it` and the decision's
    /// start (the prompt left-trimmed to fit `window`); `None` when the refiner did not decide.
    fn refiner_row(
        &self,
        it: &RolloutItem,
        window: usize,
    ) -> Result<Option<(Vec<u32>, usize)>, TaskError> {
        let Some((p, d)) = it
            .refiner
            .iter()
            .rev()
            .find_map(|r| r.decision_text().map(|d| (r.prompt.clone(), d)))
        else {
            return Ok(None);
        };
        let d_ids = encode(&self.tokenizer, &d).map_err(task_err)?;
        let p_ids = fit_window(
            encode(&self.tokenizer, &p).map_err(task_err)?,
            d_ids.len(),
            window,
        );
        let start = p_ids.len();
        let mut row = p_ids;
        row.extend(d_ids);
        Ok((start >= 1).then_some((row, start)))
    }
}

/// Greedy evaluation of the actor `policy` alone on `examples` in `mode`, with the protocol and
/// re-scoring batch of `cfg`: the periodic evaluation of [`SearchTask`] and the checkpoint
/// evaluation of `kiln eval` ([`crate::pipeline::eval_checkpoint`]) both run this.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_examples(
    policy: &Transformer,
    tokenizer: &Tokenizer,
    cfg: &SearchTaskConfig,
    search: &RetrieverBackend,
    dataset: &str,
    examples: &[QaExample],
    mode: EvalMode,
    max_new_tokens: usize,
) -> Result<(Vec<crate::eval::QaRecord>, crate::rollout::RolloutStats), Error> {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let sampling = SamplingConfig::greedy(max_new_tokens);
    let mut actor = LmActor::new(policy, tokenizer, sampling, &mut rng);
    actor.max_batch = cfg.max_batch;
    evaluate(
        dataset,
        examples,
        mode,
        &cfg.batch.protocol,
        &mut actor,
        search,
    )
}

/// The training rollouts must be sampled from the distribution the loss re-scores: the full
/// softmax of `logits / temperature` ([`gather_actions`]). Greedy decoding has no such
/// distribution (every token has probability 1), and top-k / top-p sample from a truncated one
/// whose log-probs differ from the re-scored ones, so the PPO ratio would not start at 1.
pub fn check_training_sampling(s: &SamplingConfig) -> Result<(), Error> {
    if s.greedy || !(s.temperature > 0.0 && s.temperature.is_finite()) {
        return Err(Error::Invalid(format!(
            "search.sampling: training rollouts must be sampled (temperature > 0, greedy: false), \
             got temperature {} and greedy {}; greedy decoding is what evaluation uses",
            s.temperature, s.greedy
        )));
    }
    if s.top_k > 0 || s.top_p < 1.0 {
        return Err(Error::Invalid(format!(
            "search.sampling: top_k {} / top_p {} truncate the sampling distribution, but the \
             training log-probs are those of the full softmax at the temperature, so the policy \
             ratio would be wrong from the first update; set top_k: 0 and top_p: 1.0 for training",
            s.top_k, s.top_p
        )));
    }
    Ok(())
}

/// Left-trims `ids` so that `ids.len() + extra <= window` (the refiner decision follows the prompt's end).
fn fit_window(mut ids: Vec<u32>, extra: usize, window: usize) -> Vec<u32> {
    if ids.len() + extra > window {
        let cut = (ids.len() + extra - window).min(ids.len());
        ids.drain(..cut);
    }
    ids
}

/// Log-probs `[b, width]` of the tokens `rows[i][start[i] + k]`, `k < width` (0 where the row is
/// shorter), under `log_softmax(logits / temperature)`: the distribution the tokens were drawn
/// from (the sampling temperature for the actor's tokens, 1 for the refiner's decision); and the
/// entropy of that distribution at the same positions, detached (see
/// [`score_tokens_with_entropy`]).
fn gather_actions(
    model: &Transformer,
    rows: &[Vec<u32>],
    start: &[usize],
    width: usize,
    temperature: f32,
) -> (Tensor<2>, Tensor<2>) {
    let device = model.device();
    let b = rows.len();
    let (toks, mask, w) = padded(rows, &device);
    if w < 2 || width == 0 {
        let z = Tensor::zeros([b, width.max(1)], &device).slice([0..b, 0..width]);
        return (z.clone(), z);
    }
    // [b, w-1]: entry p = log p(token p+1), and the entropy of that distribution.
    let (lp, ent) = score_tokens_with_entropy(model, toks, mask, temperature);
    let mut idx = Vec::with_capacity(b * width);
    for (r, &s) in rows.iter().zip(start) {
        for k in 0..width {
            let pos = s + k; // the token's position in the row
            let e = if pos >= 1 && pos < r.len() {
                pos - 1
            } else {
                0
            };
            idx.push(e as i64);
        }
    }
    let idx = Tensor::<2, Int>::from_data(TensorData::new(idx, [b, width]), &device);
    (lp.gather(1, idx.clone()), ent.gather(1, idx))
}

impl RlTask for SearchTask {
    type Policy = Transformer;
    type Data = SearchData;

    fn name(&self) -> &str {
        "search_r2"
    }

    fn rollout(
        &mut self,
        policy: &Transformer,
        _step: u64,
        rng: &mut ChaCha8Rng,
    ) -> Result<Rollout<SearchData>, TaskError> {
        let questions = self.next_questions();
        let window = policy.config().max_position_embeddings;
        let mut actor_rng = ChaCha8Rng::seed_from_u64(rng.random());
        let mut actor = LmActor::new(
            policy,
            &self.tokenizer,
            self.cfg.sampling.clone(),
            &mut actor_rng,
        );
        actor.max_batch = self.cfg.max_batch;
        let mut refiner = LmRefiner {
            model: policy,
            tokenizer: &self.tokenizer,
            max_batch: self.cfg.max_batch,
        };
        let mut det = DeterministicJudge::default();
        let mut llm = match &self.judge_model {
            Some((m, t)) => LmJudge {
                model: m,
                tokenizer: t,
            },
            None => LmJudge {
                model: policy,
                tokenizer: &self.tokenizer,
            },
        };
        let judge: &mut dyn crate::reward::ProcessJudge = match self.cfg.judge {
            JudgeKind::Deterministic => &mut det,
            JudgeKind::Llm => &mut llm,
        };
        let scorer: Option<&mut dyn crate::task::RefinerScorer> = if self.cfg.batch.refiner.enabled
        {
            Some(&mut refiner)
        } else {
            None
        };
        let out = rollout_batch(
            &questions,
            &self.template,
            &self.cfg.batch,
            &mut actor,
            &self.search,
            scorer,
            judge,
            rng,
        )
        .map_err(task_err)?;
        let n = out.items.len();
        let packed = self.pack_rows(&out.items, window)?;
        let mut metrics = out.metrics();
        let policy_tokens = packed.policy_tokens as f64;
        metrics.insert(
            "rollout/response_tokens".into(),
            packed.response_tokens as f64 / n as f64,
        );
        metrics.insert("rollout/policy_tokens".into(), policy_tokens / n as f64);
        metrics.insert(
            "rollout/generated_tokens_per_s".into(),
            policy_tokens / out.rollout.generate_seconds.max(1e-9),
        );
        metrics.insert(
            "rollout/retrieval_calls_per_s".into(),
            out.rollout.search_calls as f64 / out.rollout.search_seconds.max(1e-9),
        );
        let answered = out
            .items
            .iter()
            .filter(|i| i.reward.answer.is_some())
            .count();
        metrics.insert("rollout/answered".into(), answered as f64 / n as f64);
        let max_actions = packed.data.ta + packed.data.td;
        Ok(Rollout {
            data: packed.data,
            group_size: self.cfg.batch.group_size,
            rewards: out.totals(),
            step_rewards: None,
            max_actions,
            action_mask: packed.action_mask,
            metrics,
            sampled_logp: packed.sampled_logp,
        })
    }

    fn score(&self, policy: &Transformer, data: &SearchData, indices: &[usize]) -> Scored {
        let rows: Vec<Vec<u32>> = indices
            .iter()
            .map(|&i| data.actor_rows[i].clone())
            .collect();
        let start: Vec<usize> = indices.iter().map(|&i| data.actor_start[i]).collect();
        let (actor, actor_ent) = gather_actions(policy, &rows, &start, data.ta, data.temperature);
        let (logp, entropy) = if data.td == 0 {
            (actor, actor_ent)
        } else {
            let (rows, start): (Vec<Vec<u32>>, Vec<usize>) = indices
                .iter()
                .map(|&i| match &data.refiner_rows[i] {
                    Some((r, s)) => (r.clone(), *s),
                    None => (vec![0, 0], 1),
                })
                .unzip();
            let (refiner, refiner_ent) = gather_actions(policy, &rows, &start, data.td, 1.0);
            (
                Tensor::cat(vec![actor, refiner], 1),
                Tensor::cat(vec![actor_ent, refiner_ent], 1),
            )
        };
        // Logged as `entropy` (mean over the policy tokens); detached, so an entropy bonus has
        // no gradient here: search_r2 recipes refuse `algorithm.entropy_coef` != 0.
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
        let n = self.cfg.eval_questions.min(self.eval.len());
        if n == 0 {
            return Ok(BTreeMap::new());
        }
        let examples = self.eval[..n].to_vec();
        let (records, stats) = evaluate_examples(
            policy,
            &self.tokenizer,
            &self.cfg,
            &self.search,
            "eval",
            &examples,
            EvalMode::Agent,
            self.cfg.sampling.max_new_tokens,
        )
        .map_err(task_err)?;
        let k = records.len().max(1) as f64;
        let mut m = BTreeMap::new();
        m.insert(
            "eval/em".into(),
            records.iter().map(|r| r.em).sum::<f64>() / k,
        );
        m.insert(
            "eval/f1".into(),
            records.iter().map(|r| r.f1).sum::<f64>() / k,
        );
        m.insert(
            "eval/searches".into(),
            records.iter().map(|r| r.searches as f64).sum::<f64>() / k,
        );
        m.insert(
            "eval/answer_in_passages".into(),
            records
                .iter()
                .map(|r| f64::from(u8::from(r.answer_in_passages)))
                .sum::<f64>()
                / k,
        );
        m.insert("eval/generate_seconds".into(), stats.generate_seconds);
        Ok(m)
    }

    fn state(&self) -> serde_json::Value {
        self.sampler.state().to_json()
    }

    fn load_state(&mut self, state: &serde_json::Value) -> Result<(), TaskError> {
        Ok(self.sampler.load_json(state)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;
    use kiln_lm::TransformerConfig;

    fn tiny() -> Transformer {
        let device = Device::flex();
        device.seed(3);
        TransformerConfig {
            vocab_size: 40,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: Some(2),
            initializer_range: 0.2,
            ..Default::default()
        }
        .init(&device)
    }

    /// The actor's tokens are re-scored at the temperature they were sampled with: batched,
    /// left-padded prompts of different lengths, sampled at T = 0.7 and T = 1; the log-probs
    /// `gather_actions` computes match the ones recorded while sampling within 1e-4. Scoring the
    /// T = 0.7 samples at T = 1 (the old behaviour) is far off, so the test can fail.
    #[test]
    fn rescored_actor_logprobs_match_the_sampling_distribution() {
        let m = tiny();
        let prompts = vec![vec![1, 2, 3], vec![4, 5, 6, 7, 8, 9], vec![10]];
        for temperature in [0.7f32, 1.0] {
            let cfg = SamplingConfig {
                max_new_tokens: 8,
                temperature,
                ..Default::default()
            };
            let mut rng = ChaCha8Rng::seed_from_u64(9);
            let g = kiln_lm::generate(&m, &prompts, &cfg, &mut rng, None);
            let rows: Vec<Vec<u32>> = prompts
                .iter()
                .zip(&g.tokens)
                .map(|(p, t)| p.iter().chain(t).copied().collect())
                .collect();
            let start: Vec<usize> = prompts.iter().map(Vec::len).collect();
            let width = g.tokens.iter().map(Vec::len).max().unwrap();
            let got: Vec<f32> = gather_actions(&m, &rows, &start, width, temperature)
                .0
                .into_data()
                .try_into_vec_as::<f32>()
                .unwrap();
            let at_one: Vec<f32> = gather_actions(&m, &rows, &start, width, 1.0)
                .0
                .into_data()
                .try_into_vec_as::<f32>()
                .unwrap();
            let mut off = 0f32;
            for (i, lps) in g.logprobs.iter().enumerate() {
                for (k, want) in lps.iter().enumerate() {
                    let v = got[i * width + k];
                    assert!(
                        (v - want).abs() < 1e-4,
                        "T={temperature} row {i} tok {k}: {v} vs {want}"
                    );
                    off = off.max((at_one[i * width + k] - want).abs());
                }
            }
            if temperature != 1.0 {
                assert!(
                    off > 1e-2,
                    "scoring at T=1 should differ from T={temperature}"
                );
            }
        }
    }

    #[test]
    fn greedy_and_truncated_training_sampling_are_refused() {
        let ok = SearchTaskConfig::default().sampling;
        assert!(check_training_sampling(&ok).is_ok());
        for bad in [
            SamplingConfig {
                top_k: 20,
                ..ok.clone()
            },
            SamplingConfig {
                top_p: 0.9,
                ..ok.clone()
            },
            SamplingConfig {
                temperature: 0.0,
                ..ok.clone()
            },
            SamplingConfig {
                greedy: true,
                ..ok.clone()
            },
            SamplingConfig {
                temperature: f32::NAN,
                ..ok.clone()
            },
        ] {
            let e = check_training_sampling(&bad).unwrap_err().to_string();
            assert!(e.contains("search.sampling"), "{e}");
        }
    }
}
