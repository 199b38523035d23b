//! The batched multi-turn loop over [`Episode`]s, with the policy and the search engine behind traits.
//!
//! [`run_episodes`] advances a whole rollout batch together: each round it asks the policy for one turn of every
//! episode that waits for generation (finished episodes consume nothing), then sends every pending query of the
//! round to the search backend in ONE batched call. The model-driven layer implements [`TurnPolicy`] with a
//! kiln-lm model (exact token ids and log-probs in [`Generated`]) and [`SearchBackend`] with a kiln-retrieval
//! `Retriever`; tests use [`ScriptedPolicy`] and a closure.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::protocol::{Episode, Generated, Passage, Pending};

/// One generation request: continue `episode` (its [`Episode::context_text`] / [`Episode::context_token_ids`]).
#[derive(Debug, Clone, Copy)]
pub struct TurnRequest<'a> {
    /// Index of the episode in the batch.
    pub index: usize,
    /// 1-based turn number.
    pub turn: usize,
    /// False on the last turn (the protocol ignores a search there).
    pub search_enabled: bool,
    /// The episode to continue.
    pub episode: &'a Episode,
}

/// Generates one assistant turn for each request (stop strings: [`crate::protocol::STOP_STRINGS`]).
pub trait TurnPolicy {
    /// Returns exactly one [`Generated`] per request, in order.
    fn generate(&mut self, requests: &[TurnRequest<'_>]) -> Result<Vec<Generated>, Error>;
}

/// Runs a batch of queries; `result[i]` holds at most `k` passages for `queries[i]`.
pub trait SearchBackend {
    /// Searches all queries of one round.
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error>;
}

impl<F> SearchBackend for F
where
    F: Fn(&[String], usize) -> Result<Vec<Vec<Passage>>, Error>,
{
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        self(queries, k)
    }
}

/// What to do when the search backend fails or returns garbage (a wrong number of result lists).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum OnSearchError {
    /// End the affected episodes with [`crate::protocol::EndReason::SearchFailed`] (logged; the caller skips or
    /// zero-rewards them) and go on.
    #[default]
    EndEpisode,
    /// Return the error.
    Fail,
}

/// Counters of one [`run_episodes`] call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutStats {
    /// Rounds (turn index of the longest episode).
    pub rounds: usize,
    /// Calls to [`TurnPolicy::generate`].
    pub generate_calls: usize,
    /// Turns generated in total.
    pub turns: usize,
    /// Calls to [`SearchBackend::search_batch`].
    pub search_calls: usize,
    /// Queries searched in total.
    pub queries: usize,
    /// Searches that failed (episodes ended with `SearchFailed`).
    pub failed_searches: usize,
    /// Wall time spent in [`TurnPolicy::generate`].
    pub generate_seconds: f64,
    /// Wall time spent in [`SearchBackend::search_batch`].
    pub search_seconds: f64,
    /// Of `generate_seconds`, the prefills (each turn's context forward before its first token), as
    /// far as the policy reports them (the model actor does; scripted policies leave 0).
    pub prefill_seconds: f64,
    /// Context tokens the prefills ran: with `LmActor::reuse_kv` (the default) a turn prefills only
    /// what was appended since the episode's previous turn (its observation); without it, every turn
    /// re-reads its whole transcript.
    pub prefill_tokens: usize,
    /// Of `generate_seconds`, packing the weights for the decode steps (the model actor does it once
    /// per rollout round; `kiln_lm::Transformer::decode_weights`).
    #[serde(default)]
    pub pack_seconds: f64,
}

impl RolloutStats {
    /// The counters as metrics (`rollout/...`).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("rollout/rounds".into(), self.rounds as f64),
            ("rollout/turns".into(), self.turns as f64),
            ("rollout/search_calls".into(), self.search_calls as f64),
            ("rollout/queries".into(), self.queries as f64),
            (
                "rollout/failed_searches".into(),
                self.failed_searches as f64,
            ),
            ("rollout/generate_seconds".into(), self.generate_seconds),
            ("rollout/search_seconds".into(), self.search_seconds),
            ("rollout/prefill_seconds".into(), self.prefill_seconds),
            ("rollout/prefill_tokens".into(), self.prefill_tokens as f64),
            ("rollout/pack_seconds".into(), self.pack_seconds),
        ])
    }

    /// Adds another call's counters.
    pub fn add(&mut self, o: &RolloutStats) {
        self.rounds += o.rounds;
        self.generate_calls += o.generate_calls;
        self.turns += o.turns;
        self.search_calls += o.search_calls;
        self.queries += o.queries;
        self.failed_searches += o.failed_searches;
        self.generate_seconds += o.generate_seconds;
        self.search_seconds += o.search_seconds;
        self.prefill_seconds += o.prefill_seconds;
        self.prefill_tokens += o.prefill_tokens;
        self.pack_seconds += o.pack_seconds;
    }
}

/// Runs every episode to the end: generation rounds for all unfinished episodes, one batched search per round.
///
/// A policy that returns the wrong number of outputs is an error. Search failures follow `on_error`.
pub fn run_episodes(
    episodes: &mut [Episode],
    policy: &mut dyn TurnPolicy,
    search: &dyn SearchBackend,
    on_error: OnSearchError,
) -> Result<RolloutStats, Error> {
    let mut stats = RolloutStats::default();
    loop {
        // Generation round.
        let requests: Vec<TurnRequest<'_>> = episodes
            .iter()
            .enumerate()
            .filter_map(|(index, ep)| match ep.pending() {
                Pending::Generate {
                    turn,
                    search_enabled,
                } => Some(TurnRequest {
                    index,
                    turn: *turn,
                    search_enabled: *search_enabled,
                    episode: ep,
                }),
                _ => None,
            })
            .collect();
        if requests.is_empty() {
            break;
        }
        stats.rounds += 1;
        stats.generate_calls += 1;
        let indices: Vec<usize> = requests.iter().map(|r| r.index).collect();
        let t = std::time::Instant::now();
        let outs = policy.generate(&requests)?;
        stats.generate_seconds += t.elapsed().as_secs_f64();
        drop(requests);
        if outs.len() != indices.len() {
            return Err(Error::Policy(format!(
                "the policy returned {} outputs for {} requests",
                outs.len(),
                indices.len()
            )));
        }
        stats.turns += outs.len();
        for (i, g) in indices.into_iter().zip(outs) {
            episodes[i].push_generation(g)?;
        }
        // Search round: every pending query in one call.
        let (idx, queries): (Vec<usize>, Vec<String>) = episodes
            .iter()
            .enumerate()
            .filter_map(|(i, ep)| match ep.pending() {
                Pending::Search { query } => Some((i, query.clone())),
                _ => None,
            })
            .unzip();
        if queries.is_empty() {
            continue;
        }
        let k = episodes[idx[0]].config.top_k;
        stats.search_calls += 1;
        stats.queries += queries.len();
        let t = std::time::Instant::now();
        let result = search.search_batch(&queries, k);
        stats.search_seconds += t.elapsed().as_secs_f64();
        let result = result.and_then(|r| {
            if r.len() == queries.len() {
                Ok(r)
            } else {
                Err(Error::Search(format!(
                    "{} result lists for {} queries",
                    r.len(),
                    queries.len()
                )))
            }
        });
        match result {
            Ok(lists) => {
                for (i, passages) in idx.into_iter().zip(lists) {
                    episodes[i].push_search_results(passages)?;
                }
            }
            Err(e) => match on_error {
                OnSearchError::Fail => return Err(e),
                OnSearchError::EndEpisode => {
                    tracing::warn!(
                        "search failed for {} queries; ending those episodes: {e}",
                        idx.len()
                    );
                    stats.failed_searches += idx.len();
                    for i in idx {
                        episodes[i].fail_search(e.to_string())?;
                    }
                }
            },
        }
    }
    Ok(stats)
}

/// A policy from a closure over each request (tests: outputs that depend on the episode's content rather than
/// its position in the batch).
pub struct FnPolicy<F>(pub F);

impl<F> TurnPolicy for FnPolicy<F>
where
    F: FnMut(&TurnRequest<'_>) -> Generated,
{
    fn generate(&mut self, requests: &[TurnRequest<'_>]) -> Result<Vec<Generated>, Error> {
        Ok(requests.iter().map(&mut self.0).collect())
    }
}

type ToyTokenizer = Box<dyn FnMut(&str) -> Vec<u32>>;

/// A test policy that plays fixed turn outputs: `scripts[i]` are the turns of episode `i`, in order. When a
/// script runs out it plays an empty turn (an invalid action).
///
/// With a tokenizer it also returns token ids (one per byte by default: see [`ScriptedPolicy::with_tokenizer`]),
/// so token-in/token-out code paths can be tested.
pub struct ScriptedPolicy {
    scripts: Vec<std::collections::VecDeque<String>>,
    tokenizer: Option<ToyTokenizer>,
    /// Every request seen: `(episode index, turn, search_enabled)`.
    pub log: Vec<(usize, usize, bool)>,
}

impl ScriptedPolicy {
    /// A policy playing `scripts[i]` for episode `i`.
    pub fn new<S: Into<String>>(scripts: Vec<Vec<S>>) -> Self {
        ScriptedPolicy {
            scripts: scripts
                .into_iter()
                .map(|s| s.into_iter().map(Into::into).collect())
                .collect(),
            tokenizer: None,
            log: Vec::new(),
        }
    }

    /// Also returns `tokenize(text)` as the token ids of each turn (the turn text is cut at the first stop
    /// string before tokenizing, as a real generator stops there).
    pub fn with_tokenizer(mut self, tokenize: impl FnMut(&str) -> Vec<u32> + 'static) -> Self {
        self.tokenizer = Some(Box::new(tokenize));
        self
    }
}

impl TurnPolicy for ScriptedPolicy {
    fn generate(&mut self, requests: &[TurnRequest<'_>]) -> Result<Vec<Generated>, Error> {
        let mut out = Vec::with_capacity(requests.len());
        for r in requests {
            self.log.push((r.index, r.turn, r.search_enabled));
            let text = self
                .scripts
                .get_mut(r.index)
                .and_then(|s| s.pop_front())
                .unwrap_or_default();
            match &mut self.tokenizer {
                None => out.push(Generated::text(text)),
                Some(tok) => {
                    let kept = crate::protocol::parse_turn(&text, usize::MAX)
                        .kept
                        .to_string();
                    let ids = tok(&kept);
                    let logprobs = vec![-1.0; ids.len()];
                    out.push(Generated {
                        text: kept,
                        token_ids: Some(ids),
                        logprobs: Some(logprobs),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// Response token ids of a batch, padded into the row-major `n x T` layout of `kiln_rl::Rollout`.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedBatch {
    /// Response ids per trajectory (unpadded).
    pub ids: Vec<Vec<u32>>,
    /// `T`: the longest response.
    pub max_actions: usize,
    /// `n * T`: 1.0 for policy tokens, 0.0 for observation tokens and padding.
    pub action_mask: Vec<f32>,
    /// `n * T` sampling log-probabilities of policy tokens (0.0 elsewhere), when every policy segment has them.
    pub old_logprobs: Option<Vec<f32>>,
}

/// Packs trajectories whose segments all carry token ids (see
/// [`crate::protocol::Trajectory::tokenize_observations`]).
pub fn pack(trajectories: &[&crate::protocol::Trajectory]) -> Result<PackedBatch, Error> {
    let mut ids = Vec::with_capacity(trajectories.len());
    let mut masks = Vec::with_capacity(trajectories.len());
    let mut have_lp = true;
    let mut lps: Vec<Vec<f32>> = Vec::with_capacity(trajectories.len());
    for (i, t) in trajectories.iter().enumerate() {
        let (x, m) = t
            .ids_and_loss_mask()
            .map_err(|e| Error::Invalid(format!("trajectory {i}: {e}")))?;
        let mut lp = Vec::with_capacity(x.len());
        for seg in t.segments() {
            let n = seg.token_ids.as_ref().map_or(0, Vec::len);
            match (&seg.kind, &seg.logprobs) {
                (crate::protocol::SegmentKind::Policy, Some(l)) if l.len() == n => {
                    lp.extend_from_slice(l)
                }
                (crate::protocol::SegmentKind::Policy, _) => {
                    have_lp = false;
                    lp.extend(std::iter::repeat_n(0.0, n));
                }
                _ => lp.extend(std::iter::repeat_n(0.0, n)),
            }
        }
        ids.push(x);
        masks.push(m);
        lps.push(lp);
    }
    let t = ids.iter().map(Vec::len).max().unwrap_or(0);
    let mut action_mask = vec![0.0; ids.len() * t];
    let mut old = vec![0.0; ids.len() * t];
    for (r, (m, lp)) in masks.iter().zip(&lps).enumerate() {
        action_mask[r * t..r * t + m.len()].copy_from_slice(m);
        old[r * t..r * t + lp.len()].copy_from_slice(lp);
    }
    Ok(PackedBatch {
        ids,
        max_actions: t,
        action_mask,
        old_logprobs: have_lp.then_some(old),
    })
}
