//! One Search-R2 rollout batch and one evaluation pass, with every model call behind a trait.
//!
//! [`rollout_batch`] does what a GRPO step needs before the update: G episodes per question from the actor
//! ([`TurnPolicy`]), rewards, then (when the refiner is on) refiner scoring of every finished trajectory
//! ([`RefinerScorer`], teacher-forced log-probs of `" 0"..." T"`), cuts, regeneration of the cut episodes in one
//! batch, and the final rewards, with the diagnostics of [`RefinerStats`], [`RewardStats`] and [`RolloutStats`].
//! Items come out in group order (question `g` owns items `g*G .. (g+1)*G`), as `kiln_rl::Rollout` expects; the
//! model layer turns them into token tensors with [`crate::rollout::pack`].
//!
//! [`evaluate`] answers a list of questions in `direct`, `rag` or `agent` mode and returns [`QaRecord`]s for
//! [`crate::eval::write_report`].

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::data::QaExample;
use crate::eval::{EvalMode, QaRecord};
use crate::protocol::{Episode, PromptTemplate, ProtocolConfig};
use crate::refiner::{
    Refined, RefinerConfig, RefinerRecord, RefinerStats, candidate_texts, refine,
};
use crate::reward::{ProcessJudge, RewardBreakdown, RewardConfig, RewardStats, score};
use crate::rollout::{OnSearchError, RolloutStats, SearchBackend, TurnPolicy, run_episodes};

/// One refiner scoring request.
#[derive(Debug, Clone, Copy)]
pub struct RefinerRequest<'a> {
    /// Index of the item in the batch.
    pub index: usize,
    /// The refiner prompt ([`crate::refiner::build_refiner_prompt`]).
    pub prompt: &'a str,
    /// The continuations to score (`" 0"`, ..., `" T"`).
    pub candidates: &'a [String],
}

/// Scores refiner candidates by teacher-forced log-probability under the policy.
pub trait RefinerScorer {
    /// One vector per request with one log-probability per candidate.
    fn score(&mut self, requests: &[RefinerRequest<'_>]) -> Result<Vec<Vec<f64>>, Error>;
}

/// Settings of a rollout batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct BatchConfig {
    /// Trajectories per question (GRPO group size G, default 5).
    pub group_size: usize,
    /// Agent protocol.
    pub protocol: ProtocolConfig,
    /// Meta-refiner (`enabled: false` = Search-R1).
    pub refiner: RefinerConfig,
    /// Reward.
    pub reward: RewardConfig,
    /// What to do when the search backend fails.
    pub on_search_error: OnSearchError,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            group_size: 5,
            protocol: ProtocolConfig::default(),
            refiner: RefinerConfig::default(),
            reward: RewardConfig::default(),
            on_search_error: OnSearchError::EndEpisode,
        }
    }
}

/// One trajectory of a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutItem {
    /// Index of its question in the input.
    pub question: usize,
    /// The final episode (after any revision).
    pub episode: Episode,
    /// Its reward.
    pub reward: RewardBreakdown,
    /// Refiner records, one per refiner pass that looked at it.
    pub refiner: Vec<RefinerRecord>,
    /// Reward of the trajectory before its first revision (when revised).
    pub reward_before_revision: Option<f64>,
}

/// A rollout batch.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchOutput {
    /// Items in group order.
    pub items: Vec<RolloutItem>,
    /// Actor generation and search counters (all passes).
    pub rollout: RolloutStats,
    /// Reward means of the final trajectories.
    pub rewards: RewardStats,
    /// Refiner diagnostics.
    pub refiner: RefinerStats,
    /// Wall time spent in [`RefinerScorer::score`].
    pub refiner_seconds: f64,
}

impl BatchOutput {
    /// Final rewards in group order.
    pub fn totals(&self) -> Vec<f64> {
        self.items.iter().map(|i| i.reward.total).collect()
    }

    /// All metrics: `rollout/...`, `reward/...`, `refiner/...` and `time/refiner_seconds`.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = self.rollout.metrics();
        m.extend(self.rewards.metrics());
        m.extend(self.refiner.metrics());
        m.insert("time/refiner_seconds".into(), self.refiner_seconds);
        m
    }
}

/// Joins the rounds of one step's rollout (dynamic sampling) into one batch: of each round the groups
/// of G whose `keep` flag is set, in order, with their question indices renumbered over the kept
/// groups; the generation, search and refiner counters of every round (kept or not) are summed, the
/// reward means are those of the kept trajectories.
pub fn merge_rounds(rounds: Vec<(BatchOutput, Vec<bool>)>, group_size: usize) -> BatchOutput {
    let g = group_size.max(1);
    let mut items = Vec::new();
    let mut rollout = RolloutStats::default();
    let mut refiner = RefinerStats::default();
    let mut refiner_seconds = 0.0;
    let mut next_question = 0;
    for (out, keep) in rounds {
        rollout.add(&out.rollout);
        refiner.merge(&out.refiner);
        refiner_seconds += out.refiner_seconds;
        let mut it = out.items.into_iter();
        for k in keep {
            let group: Vec<RolloutItem> = it.by_ref().take(g).collect();
            if k {
                for mut item in group {
                    item.question = next_question;
                    items.push(item);
                }
                next_question += 1;
            }
        }
    }
    let mut rewards = RewardStats::default();
    for it in &items {
        rewards.add(&it.reward);
    }
    BatchOutput {
        items,
        rollout,
        rewards,
        refiner,
        refiner_seconds,
    }
}

fn reward_of(
    ep: &Episode,
    ex: &QaExample,
    cfg: &RewardConfig,
    judge: &mut dyn ProcessJudge,
) -> Result<RewardBreakdown, Error> {
    score(&ep.trajectory, &ex.question, &ex.gold(), cfg, judge)
}

/// Runs one rollout batch (see the module docs). `scorer` is needed when `config.refiner.enabled`.
#[allow(clippy::too_many_arguments)]
pub fn rollout_batch<R: Rng + ?Sized>(
    questions: &[QaExample],
    template: &PromptTemplate,
    config: &BatchConfig,
    policy: &mut dyn TurnPolicy,
    search: &dyn SearchBackend,
    scorer: Option<&mut dyn RefinerScorer>,
    judge: &mut dyn ProcessJudge,
    rng: &mut R,
) -> Result<BatchOutput, Error> {
    if config.group_size == 0 {
        return Err(Error::Invalid("group_size must be at least 1".into()));
    }
    let g = config.group_size;
    let mut episodes = Vec::with_capacity(questions.len() * g);
    for q in questions {
        for _ in 0..g {
            episodes.push(Episode::for_question(
                template,
                &q.question,
                config.protocol.clone(),
            )?);
        }
    }
    let mut rollout = run_episodes(&mut episodes, policy, search, config.on_search_error)?;
    let mut items = Vec::with_capacity(episodes.len());
    for (i, ep) in episodes.into_iter().enumerate() {
        let ex = &questions[i / g];
        let reward = reward_of(&ep, ex, &config.reward, judge)?;
        items.push(RolloutItem {
            question: i / g,
            episode: ep,
            reward,
            refiner: Vec::new(),
            reward_before_revision: None,
        });
    }
    let mut refiner = RefinerStats::default();
    let mut refiner_seconds = 0.0;
    if config.refiner.enabled && config.refiner.max_revisions > 0 {
        let scorer = scorer.ok_or_else(|| {
            Error::Invalid("the refiner is enabled but no RefinerScorer was given".into())
        })?;
        // Accepted trajectories are final; revised ones are looked at again while revisions remain.
        let mut accepted = vec![false; items.len()];
        for _pass in 0..config.refiner.max_revisions {
            let todo: Vec<usize> = (0..items.len())
                .filter(|&i| {
                    let ep = &items[i].episode;
                    !accepted[i]
                        && ep.revisions < config.refiner.max_revisions
                        && !ep.trajectory.steps.is_empty()
                })
                .collect();
            if todo.is_empty() {
                break;
            }
            let prompts: Vec<(String, Vec<String>)> = todo
                .iter()
                .map(|&i| {
                    let it = &items[i];
                    (
                        crate::refiner::build_refiner_prompt(
                            &questions[it.question].question,
                            &it.episode.trajectory,
                        ),
                        candidate_texts(it.episode.trajectory.steps.len()),
                    )
                })
                .collect();
            let requests: Vec<RefinerRequest<'_>> = todo
                .iter()
                .zip(&prompts)
                .map(|(&index, (p, c))| RefinerRequest {
                    index,
                    prompt: p,
                    candidates: c,
                })
                .collect();
            let t = std::time::Instant::now();
            let scores = scorer.score(&requests)?;
            refiner_seconds += t.elapsed().as_secs_f64();
            if scores.len() != todo.len() {
                return Err(Error::Invalid(format!(
                    "the refiner scorer returned {} score vectors for {} requests",
                    scores.len(),
                    todo.len()
                )));
            }
            let mut revised_idx = Vec::new();
            let mut revised_eps = Vec::new();
            for (&i, logps) in todo.iter().zip(&scores) {
                let it = &items[i];
                match refine(
                    &questions[it.question].question,
                    &it.episode,
                    logps,
                    &config.refiner,
                    rng,
                )? {
                    Refined::Accept(rec) => {
                        refiner.record(&rec);
                        items[i].refiner.push(rec);
                        accepted[i] = true;
                    }
                    Refined::Revise(rec, ep) => {
                        refiner.record(&rec);
                        items[i].refiner.push(rec);
                        revised_idx.push(i);
                        revised_eps.push(*ep);
                    }
                }
            }
            if revised_eps.is_empty() {
                break;
            }
            let st = run_episodes(&mut revised_eps, policy, search, config.on_search_error)?;
            rollout.add(&st);
            for (i, ep) in revised_idx.into_iter().zip(revised_eps) {
                let before = items[i].reward.total;
                let after = reward_of(&ep, &questions[items[i].question], &config.reward, judge)?;
                refiner.record_rewards(before, after.total);
                if items[i].reward_before_revision.is_none() {
                    items[i].reward_before_revision = Some(before);
                }
                items[i].episode = ep;
                items[i].reward = after;
            }
        }
    }
    let mut rewards = RewardStats::default();
    for it in &items {
        rewards.add(&it.reward);
    }
    Ok(BatchOutput {
        items,
        rollout,
        rewards,
        refiner,
        refiner_seconds,
    })
}

/// Answers `examples` in `mode` with the mode's prompt from `templates` (greedy decoding is the policy's
/// business) and scores them. In `rag` mode the
/// questions are searched in one batched call first.
pub fn evaluate(
    dataset: &str,
    examples: &[QaExample],
    mode: EvalMode,
    protocol: &ProtocolConfig,
    templates: &crate::protocol::PromptTemplates,
    policy: &mut dyn TurnPolicy,
    search: &dyn SearchBackend,
) -> Result<(Vec<QaRecord>, RolloutStats), Error> {
    let mut stats = RolloutStats::default();
    let rag: Option<Vec<Vec<crate::protocol::Passage>>> = if mode == EvalMode::Rag {
        let qs: Vec<String> = examples.iter().map(|e| e.question.clone()).collect();
        let t = std::time::Instant::now();
        let r = search.search_batch(&qs, protocol.top_k)?;
        stats.search_seconds += t.elapsed().as_secs_f64();
        stats.search_calls += 1;
        stats.queries += qs.len();
        if r.len() != qs.len() {
            return Err(Error::Search(format!(
                "{} result lists for {} questions",
                r.len(),
                qs.len()
            )));
        }
        Some(
            r.into_iter()
                .map(|mut v| {
                    v.truncate(protocol.top_k);
                    v
                })
                .collect(),
        )
    } else {
        None
    };
    let mut eps = examples
        .iter()
        .enumerate()
        .map(|(i, e)| {
            mode.episode(
                &e.question,
                rag.as_ref().map(|r| r[i].as_slice()),
                protocol,
                templates,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    stats.add(&run_episodes(
        &mut eps,
        policy,
        search,
        OnSearchError::EndEpisode,
    )?);
    let mut records: Vec<QaRecord> = examples
        .iter()
        .zip(&eps)
        .map(|(e, ep)| QaRecord::from_episode(dataset, mode.name(), e, ep))
        .collect();
    if let Some(r) = rag {
        // The retrieved passages are part of the prompt: count them for answer-in-passages.
        for (rec, ps) in records.iter_mut().zip(r) {
            rec.answer_in_passages |= ps
                .iter()
                .any(|p| crate::reward::passage_contains_answer(p, &rec.golden_answers));
        }
    }
    Ok((records, stats))
}
