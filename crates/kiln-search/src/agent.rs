//! The model-driven layer: a kiln-lm [`Transformer`] as the actor ([`LmActor`], a [`TurnPolicy`]) and as the
//! meta-refiner ([`LmRefiner`], a [`RefinerScorer`]), and a kiln-retrieval `Retriever` as the search engine
//! ([`RetrieverBackend`]).
//!
//! Token-in/token-out: the actor continues from the exact ids of the episode so far: the prompt's ids, the ids
//! each earlier turn generated, and each observation tokenized once on its own ([`context_ids`]). The same
//! segment-wise tokenization is used at train time ([`tokenize_episode`]), so the ids that are scored are the
//! ids that were sampled.
//!
//! Model text is untrusted: a context longer than the model's window is never fed to it (the turn comes back
//! empty, which the protocol treats as an invalid action), queries are bounded by the protocol, and nothing here
//! panics on odd text.

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, Int, Tensor, TensorData};
use kiln_lm::DecodeWeights;
use kiln_lm::generate::{
    Detokenize, SamplingConfig, SeqCache, generate_packed, generate_reusing_packed,
};
use kiln_lm::{Tokenizer, Transformer};
use rand_chacha::ChaCha8Rng;

use crate::Error;
use crate::protocol::{Episode, Generated, Passage, STOP_STRINGS, Trajectory};
use crate::rollout::{SearchBackend, TurnPolicy, TurnRequest};
use crate::task::{RefinerRequest, RefinerScorer};

/// Encodes text from outside the model (observations, passages, questions) as plain text: special-token strings
/// in it are never control tokens (the protocol tags, non-special added tokens, still match); no BOS. Errors
/// become [`Error::Policy`].
pub fn encode(tok: &Tokenizer, text: &str) -> Result<Vec<u32>, Error> {
    tok.encode(text, false)
        .map_err(|e| Error::Policy(format!("tokenizer: {e}")))
}

/// Encodes a rendered prompt: the chat template's framing (when the prompt template was chat-wrapped) becomes
/// its control ids, everything else (the question, passages) plain text ([`Tokenizer::encode_prompt`]).
pub fn encode_prompt(tok: &Tokenizer, prompt: &str) -> Result<Vec<u32>, Error> {
    tok.encode_prompt(prompt)
        .map_err(|e| Error::Policy(format!("tokenizer: {e}")))
}

/// Sets the prompt's ids (once) and tokenizes every segment that has no ids yet (observations; policy segments
/// of text-only turns), each on its own.
pub fn tokenize_episode(tok: &Tokenizer, t: &mut Trajectory) -> Result<(), Error> {
    if t.prompt_token_ids.is_none() {
        t.prompt_token_ids = Some(encode_prompt(tok, &t.prompt)?);
    }
    let mut err = None;
    t.tokenize_missing(|s| match encode(tok, s) {
        Ok(ids) => ids,
        Err(e) => {
            err = Some(e);
            Vec::new()
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The ids the actor continues from: prompt ids + every segment's ids (segments without ids, such as fresh
/// observations, are tokenized on their own, exactly as [`tokenize_episode`] will store them).
pub fn context_ids(tok: &Tokenizer, ep: &Episode) -> Result<Vec<u32>, Error> {
    let t = &ep.trajectory;
    let mut ids = match &t.prompt_token_ids {
        Some(p) => p.clone(),
        None => encode_prompt(tok, &t.prompt)?,
    };
    for seg in t.segments() {
        match &seg.token_ids {
            Some(s) => ids.extend_from_slice(s),
            None => ids.extend(encode(tok, &seg.text)?),
        }
    }
    Ok(ids)
}

struct Detok<'a>(&'a Tokenizer);

impl Detokenize for Detok<'_> {
    fn decode_ids(&self, ids: &[u32]) -> String {
        self.0.decode(ids, true).unwrap_or_default()
    }
}

/// The actor: one batched, KV-cached generation call per round for every episode that waits for a turn.
pub struct LmActor<'a> {
    /// The policy (a no-grad snapshot).
    pub model: &'a Transformer,
    /// Its tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Sampling settings (the stop strings `</search>`, `</answer>` are added).
    pub sampling: SamplingConfig,
    /// Sampling RNG.
    pub rng: &'a mut ChaCha8Rng,
    /// Requests per generation call (memory bound; 0 = all at once).
    pub max_batch: usize,
    /// Prefill wall time so far (seconds), summed over generation calls.
    pub prefill_seconds: f64,
    /// Context tokens prefilled so far.
    pub prefill_tokens: usize,
    /// Continue each episode from the keys/values kept from its previous turn (default on): a turn
    /// prefills only what was appended since (the observation), not the whole transcript. Same
    /// tokens and log-probs up to float rounding.
    pub reuse_kv: bool,
    /// At most this many bytes of kept keys/values (oldest dropped first; default 2 GiB).
    pub kv_budget_bytes: usize,
    /// Wall time of packing the weights for the decode steps (seconds; once per actor).
    pub pack_seconds: f64,
    /// Kept caches of the sequences generated so far (the actor lives for one rollout round, one
    /// set of weights).
    kv: Vec<SeqCache>,
    /// The weights packed for decode steps ([`Transformer::decode_weights`]), made at the first
    /// call and kept for the actor's life: it borrows the model, so they cannot go stale.
    packed: Option<Option<DecodeWeights>>,
}

impl<'a> LmActor<'a> {
    /// An actor with `sampling` (the protocol's stop strings and the model's EOS are added).
    pub fn new(
        model: &'a Transformer,
        tokenizer: &'a Tokenizer,
        mut sampling: SamplingConfig,
        rng: &'a mut ChaCha8Rng,
    ) -> Self {
        for s in STOP_STRINGS {
            if !sampling.stop_strings.iter().any(|x| x == s) {
                sampling.stop_strings.push(s.to_string());
            }
        }
        let sampling = sampling.with_model_stops(model);
        LmActor {
            model,
            tokenizer,
            sampling,
            rng,
            max_batch: 0,
            prefill_seconds: 0.0,
            prefill_tokens: 0,
            reuse_kv: true,
            kv_budget_bytes: 2 << 30,
            pack_seconds: 0.0,
            kv: Vec::new(),
            packed: None,
        }
    }
}

impl TurnPolicy for LmActor<'_> {
    fn generate(&mut self, requests: &[TurnRequest<'_>]) -> Result<Vec<Generated>, Error> {
        let window = self.model.config().max_position_embeddings;
        let vocab = self.model.config().vocab_size;
        let mut out: Vec<Option<Generated>> = vec![None; requests.len()];
        // (request index, context ids, token budget); contexts that do not fit get an empty turn.
        let mut todo: Vec<(usize, Vec<u32>, usize)> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let ids = context_ids(self.tokenizer, r.episode)?;
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::Policy(format!(
                    "token id {bad} is outside the model's vocabulary ({vocab}): tokenizer and model do not match"
                )));
            }
            let room = window.saturating_sub(ids.len());
            if ids.is_empty() || room < 2 {
                out[i] = Some(Generated {
                    text: String::new(),
                    token_ids: Some(Vec::new()),
                    logprobs: Some(Vec::new()),
                });
            } else {
                todo.push((i, ids, room.min(self.sampling.max_new_tokens)));
            }
        }
        if self.packed.is_none() && !todo.is_empty() {
            let t = std::time::Instant::now();
            self.packed = Some(self.model.decode_weights());
            self.pack_seconds += t.elapsed().as_secs_f64();
        }
        let packed = self.packed.as_ref().and_then(Option::as_ref);
        // Group by budget so that no sequence outgrows the window; usually one group.
        todo.sort_by_key(|t| std::cmp::Reverse(t.2));
        let chunk = if self.max_batch == 0 {
            usize::MAX
        } else {
            self.max_batch
        };
        let mut start = 0;
        while start < todo.len() {
            let budget = todo[start].2;
            let mut end = start;
            while end < todo.len() && todo[end].2 == budget && end - start < chunk {
                end += 1;
            }
            let group = &todo[start..end];
            let prompts: Vec<Vec<u32>> = group.iter().map(|t| t.1.clone()).collect();
            let cfg = SamplingConfig {
                max_new_tokens: budget,
                ..self.sampling.clone()
            };
            let g = if self.reuse_kv {
                // Each prompt continues the kept cache it shares the longest prefix with.
                let src: Vec<Option<usize>> = prompts
                    .iter()
                    .map(|p| {
                        (0..self.kv.len())
                            .map(|j| (self.kv[j].common_prefix(p), j))
                            .max()
                            .filter(|(n, _)| *n > 1)
                            .map(|(_, j)| j)
                    })
                    .collect();
                let reuse: Vec<Option<&SeqCache>> =
                    src.iter().map(|j| j.map(|j| &self.kv[j])).collect();
                let (g, kept) = generate_reusing_packed(
                    self.model,
                    &prompts,
                    &cfg,
                    self.rng,
                    Some(&Detok(self.tokenizer)),
                    &reuse,
                    packed,
                );
                // The new caches supersede the ones they continued.
                let used: std::collections::BTreeSet<usize> = src.into_iter().flatten().collect();
                let mut j = 0;
                self.kv.retain(|_| {
                    j += 1;
                    !used.contains(&(j - 1))
                });
                self.kv.extend(kept);
                let cfg = self.model.config();
                let mut total: usize = self.kv.iter().map(|c| c.bytes(cfg)).sum();
                while total > self.kv_budget_bytes && !self.kv.is_empty() {
                    total -= self.kv.remove(0).bytes(cfg);
                }
                g
            } else {
                generate_packed(
                    self.model,
                    &prompts,
                    &cfg,
                    self.rng,
                    Some(&Detok(self.tokenizer)),
                    packed,
                )
            };
            self.prefill_seconds += g.prefill_seconds;
            self.prefill_tokens += g.prefill_tokens;
            for (k, t) in group.iter().enumerate() {
                let ids = g.tokens[k].clone();
                let text = self
                    .tokenizer
                    .decode(&ids, true)
                    .map_err(|e| Error::Policy(format!("tokenizer: {e}")))?;
                out[t.0] = Some(Generated {
                    text,
                    token_ids: Some(ids),
                    logprobs: Some(g.logprobs[k].clone()),
                });
            }
            start = end;
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}

/// The meta-refiner: teacher-forced log-probabilities of `" 0"..." T"` after the refiner prompt, under the same
/// weights as the actor. When the candidates differ only in their last token (one token each, or a shared
/// space token then the digit) one forward per prompt suffices; otherwise each prompt+candidate row is scored.
pub struct LmRefiner<'a> {
    /// The policy (a no-grad snapshot).
    pub model: &'a Transformer,
    /// Its tokenizer.
    pub tokenizer: &'a Tokenizer,
    /// Rows per forward (memory bound).
    pub max_batch: usize,
}

/// Right-padded `[B, W]` token and mask tensors of `rows`.
pub fn padded(
    rows: &[Vec<u32>],
    device: &burn::tensor::Device,
) -> (Tensor<2, Int>, Tensor<2, Bool>, usize) {
    let w = rows.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let b = rows.len();
    let mut toks = Vec::with_capacity(b * w);
    let mut mask = Vec::with_capacity(b * w);
    for r in rows {
        toks.extend(r.iter().map(|&t| t as i64));
        toks.extend(std::iter::repeat_n(0i64, w - r.len()));
        mask.extend(std::iter::repeat_n(true, r.len()));
        mask.extend(std::iter::repeat_n(false, w - r.len()));
    }
    (
        Tensor::from_data(TensorData::new(toks, [b, w]), device),
        Tensor::from_data(TensorData::new(mask, [b, w]), device),
        w,
    )
}

/// Log-probabilities `[B, V]` of the token following each row (rows are right-padded; the last real position
/// of each row is used). Rows must be non-empty and fit the model's window.
pub fn next_token_logprobs(model: &Transformer, rows: &[Vec<u32>]) -> Vec<Vec<f32>> {
    logprobs_at_end(model, rows, 1)
        .into_iter()
        .map(|mut r| r.pop().unwrap_or_default())
        .collect()
}

/// Log-probabilities `[B][K][V]` of the tokens following each of the last `k` positions of each row (the
/// output projection runs at those `k` positions only, not at every position). Rows are right-padded; a
/// row shorter than `k` repeats its first position. Rows must be non-empty and fit the model's window.
pub fn logprobs_at_end(model: &Transformer, rows: &[Vec<u32>], k: usize) -> Vec<Vec<Vec<f32>>> {
    let device = model.device();
    let k = k.max(1);
    let (toks, mask, _) = padded(rows, &device);
    let b = rows.len();
    let hidden = model.hidden_masked(toks, mask); // [b, w, h]
    let h = hidden.dims()[2];
    let idx: Vec<i64> = rows
        .iter()
        .flat_map(|r| {
            let last = r.len().max(1) - 1;
            (0..k)
                .flat_map(move |i| std::iter::repeat_n((last + 1 + i).saturating_sub(k) as i64, h))
        })
        .collect();
    let idx = Tensor::<3, Int>::from_data(TensorData::new(idx, [b, k, h]), &device);
    let logits = model.logits(hidden.gather(1, idx)); // [b, k, v]
    let v = logits.dims()[2];
    let lp: Vec<f32> = log_softmax(logits.reshape([b * k, v]), 1)
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap_or_default();
    lp.chunks(v * k)
        .map(|row| row.chunks(v).map(<[f32]>::to_vec).collect())
        .collect()
}

/// Sum of the log-probabilities of `rows[i][from[i]..]` given their prefixes (teacher forcing), one forward.
pub fn continuation_logprobs(model: &Transformer, rows: &[Vec<u32>], from: &[usize]) -> Vec<f64> {
    let device = model.device();
    let (toks, mask, w) = padded(rows, &device);
    let b = rows.len();
    if w < 2 {
        return vec![0.0; b];
    }
    let lp = kiln_lm::generate::score_tokens(model, toks, mask, 1.0); // [b, w-1]
    let host: Vec<f32> = lp.into_data().try_into_vec_as::<f32>().unwrap_or_default();
    rows.iter()
        .zip(from)
        .enumerate()
        .map(|(i, (r, &f))| {
            (f.max(1)..r.len())
                .map(|p| host[i * (w - 1) + p - 1] as f64)
                .sum()
        })
        .collect()
}

/// Candidates of equal length that differ only in their last token (`" 0"`.. `" 9"` under a tokenizer that
/// splits the space from the digit, e.g. SmolLM2's): their shared first tokens and their last tokens.
fn shared_prefix(cands: &[Vec<u32>]) -> Option<(Vec<u32>, Vec<u32>)> {
    let first = cands.first()?;
    let l = first.len();
    if l == 0
        || cands
            .iter()
            .any(|c| c.len() != l || c[..l - 1] != first[..l - 1])
    {
        return None;
    }
    Some((
        first[..l - 1].to_vec(),
        cands.iter().map(|c| c[l - 1]).collect(),
    ))
}

/// A request of the one-forward path: its index, prompt ids, shared candidate part and last tokens.
type SharedRequest = (usize, Vec<u32>, Vec<u32>, Vec<u32>);

impl RefinerScorer for LmRefiner<'_> {
    /// One forward per prompt when the candidates share all but their last token (single-token candidates
    /// are the case of an empty shared part): the row is `prompt + shared part`, and the output projection
    /// runs only at its last `1 + shared` positions; a candidate's score is the shared part's log-prob plus
    /// its last token's. Other candidate sets score every `prompt + candidate` row.
    fn score(&mut self, requests: &[RefinerRequest<'_>]) -> Result<Vec<Vec<f64>>, Error> {
        let window = self.model.config().max_position_embeddings;
        let chunk = self.max_batch.max(1);
        let mut out = vec![Vec::new(); requests.len()];
        // Fast path, grouped by the shared part's length: (request, prompt, shared part, last tokens).
        let mut shared: BTreeMap<usize, Vec<SharedRequest>> = BTreeMap::new();
        let mut multi: Vec<(usize, Vec<u32>, Vec<Vec<u32>>)> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            let mut p = encode(self.tokenizer, r.prompt)?;
            let cands: Vec<Vec<u32>> = r
                .candidates
                .iter()
                .map(|c| encode(self.tokenizer, c))
                .collect::<Result<_, _>>()?;
            let longest = cands.iter().map(Vec::len).max().unwrap_or(0);
            if p.len() + longest > window {
                // Keep the end of the prompt (the steps and the question line): the decision follows it.
                let cut = p.len() + longest - window;
                p.drain(..cut);
            }
            if p.is_empty() {
                out[i] = vec![0.0; cands.len()];
                continue;
            }
            match shared_prefix(&cands) {
                Some((s, last)) => shared.entry(s.len()).or_default().push((i, p, s, last)),
                None => multi.push((i, p, cands)),
            }
        }
        for (len, items) in shared {
            for group in items.chunks(chunk) {
                let rows: Vec<Vec<u32>> = group
                    .iter()
                    .map(|g| g.1.iter().chain(&g.2).copied().collect())
                    .collect();
                let lps = logprobs_at_end(self.model, &rows, len + 1);
                for (g, lp) in group.iter().zip(lps) {
                    let at = |pos: usize, tok: u32| {
                        lp[pos]
                            .get(tok as usize)
                            .copied()
                            .unwrap_or(f32::NEG_INFINITY) as f64
                    };
                    let prefix: f64 = g.2.iter().enumerate().map(|(pos, &t)| at(pos, t)).sum();
                    out[g.0] = g.3.iter().map(|&c| prefix + at(len, c)).collect();
                }
            }
        }
        for (i, p, cands) in multi {
            let rows: Vec<Vec<u32>> = cands
                .iter()
                .map(|c| p.iter().chain(c).copied().collect())
                .collect();
            let from = vec![p.len(); rows.len()];
            out[i] = continuation_logprobs(self.model, &rows, &from);
        }
        Ok(out)
    }
}

/// A kiln-retrieval `Retriever` (in-process index or remote server) as the search backend.
#[derive(Clone)]
pub struct RetrieverBackend(pub Arc<dyn kiln_retrieval::Retriever>);

impl SearchBackend for RetrieverBackend {
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        let r = self
            .0
            .search_batch(queries, k)
            .map_err(|e| Error::Search(e.to_string()))?;
        Ok(r.into_iter()
            .map(|ps| {
                ps.into_iter()
                    .map(|p| Passage {
                        id: p.id,
                        title: p.title,
                        text: p.text,
                        score: p.score,
                    })
                    .collect()
            })
            .collect())
    }
}

/// The judge prompt of [`LmJudge`]; `{question}`, `{answer}` and `{documents}` are filled in.
pub const JUDGE_TEMPLATE: &str = "You check whether retrieved documents help answer a question.\nQuestion: {question}\nGold answer: {answer}\nDocuments:\n{documents}\nDo these documents contain information that helps identify the gold answer? Answer yes or no:";

/// The LLM-judge mode of the process reward (METHODS, Search-R2 "Reward": the paper's judge is an LLM): a kiln-lm model
/// compares the teacher-forced log-probabilities of `" yes"` and `" no"` after [`JUDGE_TEMPLATE`];
/// `u_i = 1` iff `log p(yes) > log p(no)` and the search returned a passage no earlier search returned
/// (duplicates count 0, as with the deterministic judge).
pub struct LmJudge<'a> {
    /// The judge model (any causal LM; often a larger frozen model than the policy).
    pub model: &'a Transformer,
    /// Its tokenizer.
    pub tokenizer: &'a Tokenizer,
}

impl crate::reward::ProcessJudge for LmJudge<'_> {
    fn judge(
        &mut self,
        question: &str,
        gold: &crate::reward::Gold,
        searches: &[&crate::protocol::SearchCall],
    ) -> Result<Vec<f64>, Error> {
        let answer = gold.answers.first().map(String::as_str).unwrap_or("");
        let mut seen = std::collections::HashSet::new();
        let mut fresh = Vec::with_capacity(searches.len());
        let mut prompts = Vec::new();
        for s in searches {
            let new = s
                .passages
                .iter()
                .any(|p| !seen.contains(&(p.id.clone(), p.text.clone())));
            seen.extend(s.passages.iter().map(|p| (p.id.clone(), p.text.clone())));
            fresh.push(new);
            if new {
                prompts.push(
                    JUDGE_TEMPLATE
                        .replacen("{question}", question.trim(), 1)
                        .replacen("{answer}", answer, 1)
                        .replacen(
                            "{documents}",
                            &crate::protocol::format_documents(&s.passages),
                            1,
                        ),
                );
            }
        }
        let cands = vec![" yes".to_string(), " no".to_string()];
        let reqs: Vec<RefinerRequest<'_>> = prompts
            .iter()
            .enumerate()
            .map(|(index, p)| RefinerRequest {
                index,
                prompt: p,
                candidates: &cands,
            })
            .collect();
        let mut scorer = LmRefiner {
            model: self.model,
            tokenizer: self.tokenizer,
            max_batch: 16,
        };
        let scores = scorer.score(&reqs)?;
        let mut it = scores.into_iter();
        Ok(fresh
            .into_iter()
            .map(|new| {
                if !new {
                    return 0.0;
                }
                match it.next() {
                    Some(s) if s.len() == 2 && s[0] > s[1] => 1.0,
                    _ => 0.0,
                }
            })
            .collect())
    }
}
