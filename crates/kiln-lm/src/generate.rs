//! Batched autoregressive generation with a KV cache, and re-scoring of given tokens.
//!
//! [`generate`] left-pads the prompts, runs one prefill and then one cached decode step per new
//! token. Sampling (temperature, top-k, top-p, greedy) happens on the host from the step's
//! logits with a seeded RNG, so a run is reproducible. Each sequence finishes on its own (stop
//! token ids, stop strings, `max_new_tokens`); finished rows leave the batch. The generated
//! token ids and their log-probs are returned exactly as sampled: the RL trainer never
//! re-tokenizes.
//!
//! [`score_tokens`] is the train-time counterpart: log-probs of given tokens under the current
//! parameters, as a differentiable tensor computed with the full (uncached) forward.

use burn::tensor::{Bool, Int, Tensor, TensorData};
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::model::{DecodeWeights, KvCache, Transformer};

/// Sampling settings of [`generate`].
#[derive(Clone, Debug, Serialize, Deserialize, schemars::JsonSchema, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingConfig {
    /// Maximum number of generated tokens per sequence. Default 64.
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 means greedy. Default 1.0.
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = off). Default 0.
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p
    /// (1.0 = off). Default 1.0.
    pub top_p: f32,
    /// Greedy decoding (argmax, ties to the lowest id), whatever the temperature. Default false.
    pub greedy: bool,
    /// Token ids that end a sequence (included in the output). Default: none (the model
    /// config's `eos_token_id` is added by [`SamplingConfig::with_model_stops`]).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end a sequence once the decoded continuation contains them (the token
    /// completing the string is included). Needs a decoder. Default: none.
    pub stop_strings: Vec<String>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            greedy: false,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
        }
    }
}

impl SamplingConfig {
    /// Greedy decoding of `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self {
            max_new_tokens,
            greedy: true,
            ..Self::default()
        }
    }

    /// Add the model's `eos_token_id`(s) to the stop tokens.
    pub fn with_model_stops(mut self, model: &Transformer) -> Self {
        if let Some(eos) = &model.config().eos_token_id {
            for id in eos.to_vec() {
                if !self.stop_token_ids.contains(&id) {
                    self.stop_token_ids.push(id);
                }
            }
        }
        self
    }

    fn is_greedy(&self) -> bool {
        self.greedy || self.temperature <= 0.0
    }

    /// The temperature the returned log-probs use (1 for greedy).
    pub fn effective_temperature(&self) -> f32 {
        if self.is_greedy() {
            1.0
        } else {
            self.temperature
        }
    }
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// A stop token id was generated (it is the last token).
    StopToken,
    /// A stop string appeared in the decoded continuation.
    StopString,
    /// `max_new_tokens` reached.
    Length,
}

/// Output of [`generate`], one entry per prompt, in prompt order.
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated token ids (prompt excluded; stop token included).
    pub tokens: Vec<Vec<u32>>,
    /// Log-prob of each generated token under `log_softmax(logits / T)` (T = the effective
    /// temperature, 1 for greedy), before top-k / top-p truncation: the same quantity
    /// [`score_tokens`] computes with that temperature.
    pub logprobs: Vec<Vec<f32>>,
    /// Why each sequence stopped.
    pub finish: Vec<FinishReason>,
    /// Wall time of the prefill (the prompts' forward up to the first sampled token), seconds.
    pub prefill_seconds: f64,
    /// Prompt tokens the prefill ran (padding excluded).
    pub prefill_tokens: usize,
    /// Wall time of packing the weights for the decode steps ([`Transformer::decode_weights`];
    /// 0 where the packed path does not apply), seconds.
    pub pack_seconds: f64,
}

/// Turns token ids into text (for stop strings); implemented by the tokenizers of this crate.
pub trait Detokenize {
    /// Decode ids to text.
    fn decode_ids(&self, ids: &[u32]) -> String;
}

impl<F: Fn(&[u32]) -> String> Detokenize for F {
    fn decode_ids(&self, ids: &[u32]) -> String {
        self(ids)
    }
}

fn int2(device: &burn::tensor::Device, data: Vec<i64>, shape: [usize; 2]) -> Tensor<2, Int> {
    Tensor::from_data(TensorData::new(data, shape), device)
}

fn bool2(device: &burn::tensor::Device, data: Vec<bool>, shape: [usize; 2]) -> Tensor<2, Bool> {
    Tensor::from_data(TensorData::new(data, shape), device)
}

/// What sampling needs of one row of logits at temperature `t`, from one pass over it:
/// `log p_i = (x_i - max) / t - lse`. Computed for all rows of a step in parallel
/// ([`RowStats::of_rows`]) before the sequential draws, which share one RNG.
#[derive(Debug, Clone)]
struct RowStats {
    /// Largest logit.
    max: f32,
    /// Its (lowest) id: the greedy choice.
    best: usize,
    /// `ln sum_i exp((x_i - max) / t)` (summed in f64).
    lse: f64,
    /// `1 / t`.
    inv_t: f64,
}

impl RowStats {
    /// One pass for the max and argmax, one (vectorised) for the sum: `exp` in f32 of a value
    /// <= 0 (its relative error, ~1e-7, is below what an f32 log-prob keeps), accumulated in f64.
    fn new(row: &[f32], t: f32) -> Self {
        let mut best = 0usize;
        for (i, &x) in row.iter().enumerate() {
            if x > row[best] {
                best = i;
            }
        }
        let max = row.get(best).copied().unwrap_or(0.0);
        let inv_t = 1.0 / t as f64;
        let scale = inv_t as f32;
        let sum = crate::vmath::sum_exp_f64(row, max, scale);
        Self {
            max,
            best,
            lse: sum.ln(),
            inv_t,
        }
    }

    /// The stats of every `vocab`-wide row of `logits`, rows split over the rayon pool.
    fn of_rows(logits: &[f32], vocab: usize, t: f32) -> Vec<Self> {
        use rayon::prelude::*;
        logits
            .par_chunks(vocab.max(1))
            .map(|row| Self::new(row, t))
            .collect()
    }

    /// `log p` of logit `x`.
    fn logp(&self, x: f32) -> f64 {
        (x as f64 - self.max as f64) * self.inv_t - self.lse
    }
}

/// Pick the next token from one row of logits. Returns (token, log-prob under
/// `log_softmax(logits / T_eff)`).
pub fn sample_row(row: &[f32], cfg: &SamplingConfig, rng: &mut impl Rng) -> (u32, f32) {
    sample_with(
        row,
        &RowStats::new(row, cfg.effective_temperature()),
        cfg,
        rng,
    )
}

/// [`sample_row`] with the row's [`RowStats`] already computed.
fn sample_with(row: &[f32], st: &RowStats, cfg: &SamplingConfig, rng: &mut impl Rng) -> (u32, f32) {
    if cfg.is_greedy() {
        return (st.best as u32, st.logp(row[st.best]) as f32);
    }
    // Candidates sorted by probability (descending; ties by id), truncated by top-k / top-p.
    // Logits order the candidates as log-probs do (a positive temperature keeps the order).
    let cmp = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
    let k = if cfg.top_k > 0 {
        cfg.top_k.min(row.len())
    } else {
        row.len()
    };
    let p = |i: usize| st.logp(row[i]).exp();
    let chosen = if k == row.len() && cfg.top_p >= 1.0 {
        // Every token a candidate: one scan in id order, no index vector. The probabilities
        // sum to 1 up to rounding; should `u` outrun their sum, the last token with a nonzero
        // probability is drawn.
        let mut u = rng.random::<f64>();
        let mut chosen = st.best;
        for i in 0..row.len() {
            let pi = p(i);
            if pi > 0.0 {
                chosen = i;
                u -= pi;
                if u <= 0.0 {
                    break;
                }
            }
        }
        chosen
    } else {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        if k < row.len() {
            idx.select_nth_unstable_by(k - 1, cmp);
            idx.truncate(k);
        }
        if cfg.top_p < 1.0 {
            idx.sort_unstable_by(cmp);
            let mut cum = 0.0f64;
            let mut keep = idx.len();
            for (j, &i) in idx.iter().enumerate() {
                cum += p(i);
                if cum >= cfg.top_p as f64 {
                    keep = j + 1;
                    break;
                }
            }
            idx.truncate(keep.max(1));
        }
        let total: f64 = idx.iter().map(|&i| p(i)).sum();
        let mut u = rng.random::<f64>() * total;
        let mut chosen = *idx.last().expect("at least one candidate");
        for &i in &idx {
            u -= p(i);
            if u <= 0.0 {
                chosen = i;
                break;
            }
        }
        chosen
    };
    (chosen as u32, st.logp(row[chosen]) as f32)
}

/// Check that `prompts` can be generated from by a model of `vocab_size` ids: none is empty
/// and every id has an embedding row. [`generate`] panics on what this rejects, so callers with
/// ids from outside (a tokenizer that may not match the model) check first.
pub fn check_prompts(vocab_size: usize, prompts: &[Vec<u32>]) -> Result<(), String> {
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(format!("prompt {i} has no tokens"));
        }
        if let Some(t) = p.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(format!(
                "prompt {i} has token id {t}, outside the model's vocabulary of {vocab_size} ids: the tokenizer and the model do not match"
            ));
        }
    }
    Ok(())
}

/// Generate continuations of `prompts` (token ids, any lengths >= 1) with a KV cache.
///
/// Prompts are left-padded into one batch; positions count real tokens only, so a padded
/// prompt gives the same tokens as the same prompt alone (up to float rounding). `detok` is
/// needed only for stop strings. The RNG makes sampling reproducible for a given seed.
///
/// # Panics
/// Panics if a prompt is empty or a token id is outside the vocabulary; [`check_prompts`] tells
/// beforehand.
pub fn generate(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    rng: &mut impl Rng,
    detok: Option<&dyn Detokenize>,
) -> Generation {
    generate_inner(model, prompts, cfg, rng, detok, None, Packing::PerCall).0
}

/// Where the decode steps' packed weights come from.
#[derive(Debug, Clone, Copy)]
enum Packing<'a> {
    /// Packed for this call ([`Transformer::decode_weights`]).
    PerCall,
    /// Packed by the caller from the same weights (`None`: burn's matmul).
    Given(Option<&'a DecodeWeights>),
}

/// [`generate`] with decode weights the caller packed once ([`Transformer::decode_weights`] of
/// this `model`, with these weights) for many calls: a multi-turn rollout or an evaluation
/// packs once instead of once per call. `None` decodes with burn's matmul.
///
/// # Panics
/// As [`generate`]; also if `weights` belong to a model of another depth.
pub fn generate_packed(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    rng: &mut impl Rng,
    detok: Option<&dyn Detokenize>,
    weights: Option<&DecodeWeights>,
) -> Generation {
    generate_inner(
        model,
        prompts,
        cfg,
        rng,
        detok,
        None,
        Packing::Given(weights),
    )
    .0
}

/// A sequence's token ids and the keys/values of those ids (a one-row [`KvCache`]), kept between
/// [`generate_reusing`] calls: a multi-turn rollout continues each episode from it instead of
/// re-reading the whole transcript at every turn.
#[derive(Debug, Clone)]
pub struct SeqCache {
    /// The ids whose keys and values are cached (prompt + generated tokens that were fed back).
    pub ids: Vec<u32>,
    cache: KvCache,
}

impl SeqCache {
    /// Bytes its keys and values hold for a model of `cfg`'s shape (f32).
    pub fn bytes(&self, cfg: &crate::TransformerConfig) -> usize {
        self.ids.len() * cfg.num_hidden_layers * 2 * cfg.kv_heads() * cfg.head_dim() * 4
    }

    /// Length of the common prefix of its ids and `prompt`.
    pub fn common_prefix(&self, prompt: &[u32]) -> usize {
        self.ids
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
    }
}

/// [`generate`], continuing each prompt from `reuse[i]` where given: the longest common prefix of
/// the cached ids and the prompt (at most all but the prompt's last token) is taken from the cache
/// and only the rest is prefilled. The cache must come from the same model weights. Returns the
/// generation (its `prefill_tokens` counts the tokens actually prefilled) and, per prompt, the
/// cache of `prompt + generated tokens except the last` (the last sampled token is never fed).
///
/// Same tokens and log-probs as [`generate`] up to float rounding (tested); what it saves is the
/// re-prefill of the transcript, quadratic over the turns of a multi-turn rollout.
///
/// # Panics
/// As [`generate`]; also if `reuse.len() != prompts.len()`.
pub fn generate_reusing(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    rng: &mut impl Rng,
    detok: Option<&dyn Detokenize>,
    reuse: &[Option<&SeqCache>],
) -> (Generation, Vec<SeqCache>) {
    generate_reusing_inner(model, prompts, cfg, rng, detok, reuse, Packing::PerCall)
}

/// [`generate_reusing`] with decode weights the caller packed once, as [`generate_packed`].
///
/// # Panics
/// As [`generate_reusing`] and [`generate_packed`].
pub fn generate_reusing_packed(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    rng: &mut impl Rng,
    detok: Option<&dyn Detokenize>,
    reuse: &[Option<&SeqCache>],
    weights: Option<&DecodeWeights>,
) -> (Generation, Vec<SeqCache>) {
    generate_reusing_inner(
        model,
        prompts,
        cfg,
        rng,
        detok,
        reuse,
        Packing::Given(weights),
    )
}

fn generate_reusing_inner(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    rng: &mut impl Rng,
    detok: Option<&dyn Detokenize>,
    reuse: &[Option<&SeqCache>],
    packing: Packing<'_>,
) -> (Generation, Vec<SeqCache>) {
    assert_eq!(reuse.len(), prompts.len(), "one reuse entry per prompt");
    let (g, caches) = generate_inner(model, prompts, cfg, rng, detok, Some(reuse), packing);
    let caches = caches
        .into_iter()
        .zip(prompts)
        .map(|(c, p)| {
            c.unwrap_or_else(|| SeqCache {
                ids: p.clone(),
                cache: KvCache::new(0),
            })
        })
        .collect();
    (g, caches)
}

fn generate_inner(
    model: &Transformer,
    prompts: &[Vec<u32>],
    cfg: &SamplingConfig,
    rng: &mut impl Rng,
    detok: Option<&dyn Detokenize>,
    reuse: Option<&[Option<&SeqCache>]>,
    packing: Packing<'_>,
) -> (Generation, Vec<Option<SeqCache>>) {
    let n = prompts.len();
    let mut out = Generation {
        tokens: vec![Vec::new(); n],
        logprobs: vec![Vec::new(); n],
        finish: vec![FinishReason::Length; n],
        prefill_seconds: 0.0,
        prefill_tokens: 0,
        pack_seconds: 0.0,
    };
    let mut kept: Vec<Option<SeqCache>> = vec![None; n];
    if n == 0 || cfg.max_new_tokens == 0 {
        return (out, kept);
    }
    let vocab = model.config().vocab_size;
    if let Err(e) = check_prompts(vocab, prompts) {
        panic!("generate: {e}");
    }
    let device = model.device();
    let pad = model.config().pad_token_id.unwrap_or(0) as i64;
    let n_layers = model.layers.len();

    // Reused prefix of each prompt (at least its last token is prefilled: its logits start the
    // decoding), and the rest to prefill.
    let reused: Vec<usize> = (0..n)
        .map(|i| match reuse.and_then(|r| r[i]) {
            Some(c) if c.cache.n_layers() == n_layers => {
                c.common_prefix(&prompts[i]).min(prompts[i].len() - 1)
            }
            _ => 0,
        })
        .collect();
    let lc = reused.iter().copied().max().unwrap_or(0);
    let fresh: Vec<&[u32]> = prompts.iter().zip(&reused).map(|(p, &c)| &p[c..]).collect();
    let max_len = fresh.iter().map(|p| p.len()).max().unwrap_or(0);

    // Prefill: [cached prefix, left-padded to lc | fresh tokens, left-padded to max_len].
    let t_prefill = std::time::Instant::now();
    let mut toks = Vec::with_capacity(n * max_len);
    let mut mask = Vec::with_capacity(n * (lc + max_len));
    let mut positions = Vec::with_capacity(n * max_len);
    for (p, &c) in fresh.iter().zip(&reused) {
        let padn = max_len - p.len();
        toks.extend(std::iter::repeat_n(pad, padn));
        toks.extend(p.iter().map(|&t| t as i64));
        mask.extend(std::iter::repeat_n(false, lc - c));
        mask.extend(std::iter::repeat_n(true, c));
        mask.extend(std::iter::repeat_n(false, padn));
        mask.extend(std::iter::repeat_n(true, p.len()));
        positions.extend(std::iter::repeat_n(0, padn));
        positions.extend(c as i64..(c + p.len()) as i64);
    }
    let mut cache = if lc > 0 {
        let rows: Vec<Option<KvCache>> = (0..n)
            .map(|i| {
                (reused[i] > 0).then(|| {
                    reuse
                        .and_then(|r| r[i])
                        .map(|c| c.cache.truncated(reused[i]))
                })?
            })
            .collect();
        let like = rows.iter().flatten().next().cloned().unwrap_or_default();
        let refs: Vec<Option<&KvCache>> = rows.iter().map(Option::as_ref).collect();
        KvCache::stack_left_padded(&refs, lc, &like)
    } else {
        KvCache::new(n_layers)
    };
    // Room for the prefill and every decode step: no buffer is reallocated while decoding.
    cache.reserve(max_len + cfg.max_new_tokens);
    // Decode steps multiply a few rows by every weight: on the CPU they run on packed copies
    // of the projections (`crate::skinny`), built once here.
    let t_pack = std::time::Instant::now();
    let own;
    let packed = match packing {
        Packing::PerCall => {
            own = model.decode_weights();
            out.pack_seconds = t_pack.elapsed().as_secs_f64();
            own.as_ref()
        }
        Packing::Given(w) => w,
    };
    let hidden = model.forward_cached(
        int2(&device, toks, [n, max_len]),
        int2(&device, positions, [n, max_len]),
        bool2(&device, mask.clone(), [n, lc + max_len]),
        &mut cache,
    );
    let d = model.config().hidden_size;
    let last = hidden.slice([0..n, max_len - 1..max_len, 0..d]);
    let head = packed.is_none().then(|| model.inference_head());
    let to_host = |logits: Tensor<3>| {
        logits
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("float logits")
    };
    // The host copy also forces the prefill's lazy work to finish inside its timer.
    let mut rows: Vec<f32> = match (packed, &head) {
        (Some(p), _) => p.logits(
            &last
                .into_data()
                .try_into_vec_as::<f32>()
                .expect("float hidden states"),
        ),
        (None, Some(head)) => to_host(model.logits_with_head(last, head)),
        (None, None) => unreachable!("a head is made when nothing is packed"),
    };
    out.prefill_seconds = t_prefill.elapsed().as_secs_f64();
    out.prefill_tokens = fresh.iter().map(|p| p.len()).sum();

    // Active rows: index into `prompts`, next position, key mask so far.
    let mut active: Vec<usize> = (0..n).collect();
    let mut next_pos: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
    let mut key_mask: Vec<Vec<bool>> = mask.chunks(lc + max_len).map(|c| c.to_vec()).collect();
    // Keeps the cache of finished row `r` (batch index) of sequence `seq`: its real keys.
    let keep_row = |kept: &mut Vec<Option<SeqCache>>,
                    cache: &KvCache,
                    r: usize,
                    seq: usize,
                    km: &[bool],
                    tokens: &[u32]| {
        if reuse.is_none() {
            return;
        }
        let real: Vec<usize> = (0..km.len()).filter(|&j| km[j]).collect();
        let mut ids = prompts[seq].clone();
        ids.extend_from_slice(&tokens[..tokens.len().saturating_sub(1)]);
        debug_assert_eq!(ids.len(), real.len());
        kept[seq] = Some(SeqCache {
            ids,
            cache: cache.extract_row(r, &real),
        });
    };

    loop {
        let mut step_tokens = Vec::with_capacity(active.len());
        let mut keep = Vec::with_capacity(active.len());
        let stats = RowStats::of_rows(&rows, vocab, cfg.effective_temperature());
        for (r, &seq) in active.iter().enumerate() {
            let row = &rows[r * vocab..(r + 1) * vocab];
            let (tok, lp) = sample_with(row, &stats[r], cfg, rng);
            out.tokens[seq].push(tok);
            out.logprobs[seq].push(lp);
            let mut done = None;
            if cfg.stop_token_ids.contains(&tok) {
                done = Some(FinishReason::StopToken);
            } else if !cfg.stop_strings.is_empty()
                && let Some(dt) = detok
            {
                let text = dt.decode_ids(&out.tokens[seq]);
                if cfg.stop_strings.iter().any(|s| text.contains(s.as_str())) {
                    done = Some(FinishReason::StopString);
                }
            }
            if done.is_none() && out.tokens[seq].len() >= cfg.max_new_tokens {
                done = Some(FinishReason::Length);
            }
            match done {
                Some(reason) => {
                    out.finish[seq] = reason;
                    keep_row(&mut kept, &cache, r, seq, &key_mask[r], &out.tokens[seq]);
                }
                None => {
                    keep.push(r);
                    step_tokens.push(tok);
                }
            }
        }
        if keep.is_empty() {
            break;
        }
        if keep.len() != active.len() {
            let rows_t = Tensor::<1, Int>::from_data(
                TensorData::new(keep.iter().map(|&r| r as i64).collect(), [keep.len()]),
                &device,
            );
            cache.select_rows(rows_t);
            active = keep.iter().map(|&r| active[r]).collect();
            key_mask = keep.iter().map(|&r| key_mask[r].clone()).collect();
            next_pos = keep.iter().map(|&r| next_pos[r]).collect();
        }
        let b = active.len();
        for m in key_mask.iter_mut() {
            m.push(true);
        }
        let klen = key_mask[0].len();
        let keys = key_mask.concat();
        rows = match (packed, &head) {
            (Some(p), _) => model.forward_decode(&step_tokens, &next_pos, &keys, &mut cache, p),
            (None, Some(head)) => to_host(model.logits_with_head(
                model.forward_cached(
                    int2(
                        &device,
                        step_tokens.iter().map(|&t| t as i64).collect(),
                        [b, 1],
                    ),
                    int2(&device, next_pos.clone(), [b, 1]),
                    bool2(&device, keys, [b, klen]),
                    &mut cache,
                ),
                head,
            )),
            (None, None) => unreachable!("a head is made when nothing is packed"),
        };
        for p in next_pos.iter_mut() {
            *p += 1;
        }
    }
    (out, kept)
}

/// Log-probs of `tokens[:, 1:]` under the model given their prefixes, at `temperature`:
/// `log_softmax(logits[:, :-1] / temperature)` gathered at the next tokens, shape `[B, T-1]`.
/// Left padding via `attention_mask` (true = real token), as in [`Transformer::forward_masked`];
/// entries whose target is padding are meaningless (mask them in the loss).
///
/// This is the train-time forward: the result is differentiable (use it in a loss on an
/// autodiff device). It matches [`generate`]'s log-probs up to float rounding.
pub fn score_tokens(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    attention_mask: Tensor<2, Bool>,
    temperature: f32,
) -> Tensor<2> {
    score_next(model, tokens, attention_mask, temperature, false).0
}

/// [`score_tokens`] plus the entropy `[B, T-1]` of each next-token distribution (the same
/// `log_softmax(logits / temperature)`), computed from one forward. The entropy is detached:
/// differentiating it would keep a second `[B, T-1, vocab]` tensor alive for the backward pass,
/// so it is for logging, not for an entropy bonus.
pub fn score_tokens_with_entropy(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    attention_mask: Tensor<2, Bool>,
    temperature: f32,
) -> (Tensor<2>, Tensor<2>) {
    let (logp, entropy) = score_next(model, tokens, attention_mask, temperature, true);
    (logp, entropy.expect("asked for"))
}

/// [`score_tokens_with_entropy`] at chosen positions only: `at` `[B, K]` holds, per row, the
/// positions `p >= 1` of the tokens to score (entry `[i, k]` = log p(tokens[i, p] | tokens[i, ..p]),
/// from the hidden state at `p - 1`), and the output projection and softmax run on those `B x K`
/// hidden states alone instead of all `B x T`. Returns `(logp, entropy)`, each `[B, K]`; the
/// log-probs are differentiable, the entropy is detached. Positions must be in `1..T`; callers pad
/// unused columns with any valid position and mask them out.
///
/// Why: the re-scoring of an RL step needs the log-probs of the generated tokens only (not of the
/// prompt, observations or padding), and a refiner decision is one or two tokens after a prompt as
/// long as the trajectory. With a large vocabulary (SmolLM2: 49,152) the projection and the
/// `[B, T, V]` log-softmax are a large part of the forward and most of its memory.
pub fn score_tokens_at(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    attention_mask: Tensor<2, Bool>,
    at: Tensor<2, Int>,
    temperature: f32,
) -> (Tensor<2>, Tensor<2>) {
    let [b, k] = at.dims();
    let hidden = model.hidden_masked(tokens.clone(), attention_mask); // [b, t, h]
    let h = hidden.dims()[2];
    let src = at
        .clone()
        .sub_scalar(1)
        .reshape([b, k, 1])
        .expand([b, k, h]);
    let logits = model.logits(hidden.gather(1, src)); // [b, k, v]
    let (logp, entropy) = scored(logits, tokens.gather(1, at), temperature, true);
    (logp, entropy.expect("asked for"))
}

/// `(logp, entropy if with_entropy)` `[B, T-1]` of each next token of `tokens` under
/// `log_softmax(logits[:, :-1] / temperature)` (entry `p`: token `p + 1`).
fn score_next(
    model: &Transformer,
    tokens: Tensor<2, Int>,
    attention_mask: Tensor<2, Bool>,
    temperature: f32,
    with_entropy: bool,
) -> (Tensor<2>, Option<Tensor<2>>) {
    let [b, t] = tokens.dims();
    let logits = model.forward_masked(tokens.clone(), attention_mask);
    let v = logits.dims()[2];
    scored(
        logits.slice([0..b, 0..t - 1, 0..v]),
        tokens.slice([0..b, 1..t]),
        temperature,
        with_entropy,
    )
}

/// `(logp, entropy)` `[B, K]`: `log_softmax(logits / temperature)` (`logits` `[B, K, V]`)
/// gathered at `targets` `[B, K]` (differentiable), and, when `with_entropy`, each
/// distribution's entropy (detached), by [`crate::fused::target_logprobs`].
fn scored(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    temperature: f32,
    with_entropy: bool,
) -> (Tensor<2>, Option<Tensor<2>>) {
    let [b, k, v] = logits.dims();
    let logits = if temperature != 1.0 {
        logits.div_scalar(temperature)
    } else {
        logits
    };
    let (logp, entropy) = crate::fused::target_logprobs(
        logits.reshape([b * k, v]),
        targets.reshape([b * k]),
        with_entropy,
    );
    (logp.reshape([b, k]), entropy.map(|e| e.reshape([b, k])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TransformerConfig;
    use burn::tensor::Device;
    use rand::SeedableRng;

    fn model() -> Transformer {
        let device = Device::flex();
        device.seed(11);
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

    /// A multi-turn continuation from kept caches (full, partial and no reuse in one batch, rows
    /// finishing at different steps) gives the tokens and log-probs of re-prefilling every
    /// transcript, and prefills only the new tokens.
    ///
    /// Which rows draw a stop id depends on the last bits of the logits, which differ between SIMD
    /// paths (AVX2 / AVX-512), so the check runs once per stop id of the vocabulary and requires
    /// that some of those runs had rows finishing at different steps.
    #[test]
    fn reusing_kept_caches_equals_reprefilling() {
        let m = model();
        let uneven = (0..40u32)
            .filter(|&stop| kept_caches_equal_reprefilling(&m, stop))
            .count();
        assert!(
            uneven > 0,
            "no stop id made rows finish at different steps: the check never covered it"
        );
    }

    /// One run of the check above with `stop` as the stop id; returns whether the second turn's
    /// rows finished at different steps.
    fn kept_caches_equal_reprefilling(m: &Transformer, stop: u32) -> bool {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let first: Vec<Vec<u32>> = vec![vec![3, 4, 5, 6, 7], vec![8, 9], vec![10, 11, 12]];
        let cfg = SamplingConfig {
            temperature: 0.9,
            greedy: false,
            stop_token_ids: vec![stop],
            ..SamplingConfig::greedy(6)
        };
        let none = vec![None; first.len()];
        let (g1, kept) = generate_reusing(m, &first, &cfg, &mut rng, None, &none);
        for (i, k) in kept.iter().enumerate() {
            let mut want = first[i].clone();
            want.extend_from_slice(&g1.tokens[i][..g1.tokens[i].len() - 1]);
            assert_eq!(k.ids, want, "stop {stop}, row {i}");
        }
        // Turn 2: row 0 continues its transcript plus an "observation"; row 1 diverges inside
        // its cached prefix (partial reuse); row 2 is new (no cache).
        let mut second = Vec::new();
        let mut t0 = first[0].clone();
        t0.extend(&g1.tokens[0]);
        t0.extend([20, 21, 22]);
        second.push(t0);
        second.push(vec![8, 30, 31, 32]);
        second.push(vec![13, 14]);
        let reuse = vec![Some(&kept[0]), Some(&kept[1]), None];
        let mut r1 = rand::rngs::StdRng::seed_from_u64(5);
        let (a, kept2) = generate_reusing(m, &second, &cfg, &mut r1, None, &reuse);
        let mut r2 = rand::rngs::StdRng::seed_from_u64(5);
        let b = generate(m, &second, &cfg, &mut r2, None);
        assert_eq!(a.tokens, b.tokens, "stop {stop}");
        for (x, y) in a.logprobs.iter().flatten().zip(b.logprobs.iter().flatten()) {
            assert!((x - y).abs() < 1e-4, "stop {stop}: {x} vs {y}");
        }
        // Only what was not cached is prefilled: row 0's last generated token (never fed back)
        // and the 3 new ones, row 1 after its first id, all of row 2.
        let want = (1 + 3) + 3 + 2;
        assert_eq!(a.prefill_tokens, want, "stop {stop}");
        assert_eq!(b.prefill_tokens, second.iter().map(Vec::len).sum::<usize>());
        assert_eq!(kept2[2].ids[..2], [13, 14]);
        let lens: std::collections::BTreeSet<usize> = a.tokens.iter().map(Vec::len).collect();
        lens.len() > 1
    }

    #[test]
    fn batched_padded_greedy_equals_single() {
        let m = model();
        let prompts = vec![vec![1, 2, 3, 4, 5], vec![7, 8]];
        let cfg = SamplingConfig::greedy(8);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
        let batched = generate(&m, &prompts, &cfg, &mut rng, None);
        for (i, p) in prompts.iter().enumerate() {
            let single = generate(&m, std::slice::from_ref(p), &cfg, &mut rng, None);
            assert_eq!(single.tokens[0], batched.tokens[i]);
            for (a, b) in single.logprobs[0].iter().zip(&batched.logprobs[i]) {
                assert!((a - b).abs() < 1e-4);
            }
        }
    }

    #[test]
    fn scoring_with_entropy_matches_scoring_and_a_flat_distribution_has_ln_v() {
        let m = model();
        let device = m.device();
        let toks = int2(&device, vec![1, 2, 3, 4, 5, 6], [1, 6]);
        let mask = bool2(&device, vec![true; 6], [1, 6]);
        let plain: Vec<f32> = score_tokens(&m, toks.clone(), mask.clone(), 0.7)
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap();
        let (lp, ent) = score_tokens_with_entropy(&m, toks.clone(), mask.clone(), 0.7);
        let lp: Vec<f32> = lp.into_data().try_into_vec_as::<f32>().unwrap();
        assert_eq!(lp, plain);
        let ent: Vec<f32> = ent.into_data().try_into_vec_as::<f32>().unwrap();
        let ln_v = (m.config().vocab_size as f32).ln();
        assert!(ent.iter().all(|e| *e > 0.0 && *e < ln_v), "{ent:?}");
        // At a huge temperature every next-token distribution is flat: entropy = ln V.
        let (_, flat) = score_tokens_with_entropy(&m, toks, mask, 1e6);
        for e in flat.into_data().try_into_vec_as::<f32>().unwrap() {
            assert!((e - ln_v).abs() < 1e-3, "{e} vs ln V = {ln_v}");
        }
    }

    /// Scoring at chosen positions equals the full scoring at those positions (log-prob and
    /// entropy), on a right-padded batch: the output projection at K positions is the same
    /// computation as at all T.
    #[test]
    fn scoring_at_positions_equals_full_scoring_there() {
        let m = model();
        let device = m.device();
        // Two rows, the second right-padded by two.
        let toks = int2(&device, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0], [2, 6]);
        let mask = bool2(
            &device,
            vec![
                true, true, true, true, true, true, true, true, true, true, false, false,
            ],
            [2, 6],
        );
        let (full, full_ent) = score_tokens_with_entropy(&m, toks.clone(), mask.clone(), 0.7);
        let full: Vec<f32> = full.into_data().try_into_vec_as::<f32>().unwrap();
        let full_ent: Vec<f32> = full_ent.into_data().try_into_vec_as::<f32>().unwrap();
        // Row 0: positions 5, 2, 3; row 1: 1, 3, 3 (a repeated column).
        let at_v = [5usize, 2, 3, 1, 3, 3];
        let at = int2(&device, at_v.iter().map(|&p| p as i64).collect(), [2, 3]);
        let (lp, ent) = score_tokens_at(&m, toks, mask, at, 0.7);
        let lp: Vec<f32> = lp.into_data().try_into_vec_as::<f32>().unwrap();
        let ent: Vec<f32> = ent.into_data().try_into_vec_as::<f32>().unwrap();
        for (k, &p) in at_v.iter().enumerate() {
            let row = k / 3;
            let want = full[row * 5 + p - 1];
            assert!(
                (lp[k] - want).abs() < 1e-5,
                "[{row}, {p}]: {} vs {want}",
                lp[k]
            );
            let want_e = full_ent[row * 5 + p - 1];
            assert!(
                (ent[k] - want_e).abs() < 1e-5,
                "entropy {} vs {want_e}",
                ent[k]
            );
        }
    }

    #[test]
    fn logprobs_match_rescoring_and_seed_reproduces() {
        let m = model();
        let prompts = vec![vec![1, 2, 3], vec![4, 5, 6, 7]];
        let cfg = SamplingConfig {
            max_new_tokens: 6,
            temperature: 0.8,
            top_k: 10,
            top_p: 0.95,
            stop_token_ids: vec![3],
            ..Default::default()
        };
        let run = |seed| {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            generate(&m, &prompts, &cfg, &mut rng, None)
        };
        let g = run(5);
        assert_eq!(g.tokens, run(5).tokens);
        assert_eq!(g.prefill_tokens, 7, "the prompts' tokens, padding excluded");
        assert!(g.prefill_seconds > 0.0);
        let device = m.device();
        for (p, (toks, lps)) in prompts.iter().zip(g.tokens.iter().zip(&g.logprobs)) {
            assert!(toks.len() <= 6);
            if toks.len() < 6 {
                assert_eq!(*toks.last().unwrap(), 3);
            }
            let full: Vec<i64> = p.iter().chain(toks).map(|&t| t as i64).collect();
            let t = full.len();
            let tokens = int2(&device, full, [1, t]);
            let mask = bool2(&device, vec![true; t], [1, t]);
            let scored: Vec<f32> = score_tokens(&m, tokens, mask, 0.8)
                .into_data()
                .try_into_vec_as::<f32>()
                .unwrap();
            let tail = &scored[p.len() - 1..];
            for (a, b) in tail.iter().zip(lps) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn stop_strings_end_sequences() {
        let m = model();
        let detok = |ids: &[u32]| ids.iter().map(|i| format!("<{i}>")).collect::<String>();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let first = generate(
            &m,
            &[vec![1, 2]],
            &SamplingConfig::greedy(4),
            &mut rng,
            None,
        );
        let stop = format!("<{}>", first.tokens[0][1]);
        let cfg = SamplingConfig {
            stop_strings: vec![stop],
            ..SamplingConfig::greedy(4)
        };
        let g = generate(&m, &[vec![1, 2]], &cfg, &mut rng, Some(&detok));
        assert!(g.tokens[0].len() <= 2);
        assert_eq!(g.finish[0], FinishReason::StopString);
    }
}
