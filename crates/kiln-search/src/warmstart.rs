//! The warm start of a policy trained from random initialisation: a byte-level BPE tokenizer trained on the
//! synthetic world's text, a small Llama-layout transformer, and supervised fine-tuning on scripted
//! demonstrations of every role the policy plays:
//! - the agent (Search-R1 protocol): the gold trajectory of a training question, one search per hop
//!   ([`crate::synthetic::build_demonstrations`]); loss on the policy tokens only;
//! - the meta-refiner: refiner prompts over demonstration trajectories with the index of their first bad step:
//!   `" 0"` for a gold trajectory, `" j"` when step j's search was replaced by a wrong one (and its
//!   observation re-retrieved), `" T"` when the final answer was swapped for a wrong one;
//! - the baselines' formats (direct answer, retrieve-once RAG) so that `kiln eval --mode direct|rag` asks the
//!   same weights a question in a format they know.
//!
//! With `rename_copies: N` the whole set is tokenized N times, each copy under its own random renaming of the
//! entity names ([`crate::synthetic::Renamer`]). Without it a small model lowers its loss by memorising the
//! 2,000 training questions' answers and never learns to copy a name from the passages (measured: held-out EM 0
//! after 1,000 steps; in RAG mode 94% of its answers are names absent from its context, although the answer is there
//! for 65% of the questions).
//!
//! The warm start is deliberately short: it teaches the formats and the basic search skill; GRPO has to make
//! the policy reliable. Search-R1 and Search-R2 recipes start from the same warm-start folder.

use std::path::Path;
use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor, TensorData};
use kiln_lm::{Tokenizer, Transformer, TransformerConfig, score_tokens};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::agent::{encode, encode_prompt, padded, tokenize_episode};
use crate::data::QaExample;
use crate::protocol::{
    ANSWER_CLOSE, ANSWER_OPEN, DIRECT_TEMPLATE, INFO_CLOSE, INFO_OPEN, INVALID_ACTION_OBSERVATION,
    PromptTemplates, ProtocolConfig, RAG_TEMPLATE, SEARCH_CLOSE, SEARCH_OPEN, SEARCH_R1_TEMPLATE,
    THINK_CLOSE, THINK_OPEN, format_documents,
};
use crate::real_demos::{RealDemoStats, RealDemosConfig, build_real_demos};
use crate::refiner::build_refiner_prompt;
use crate::rollout::SearchBackend;
use crate::synthetic::{
    Renamer, SyntheticQuestion, World, build_demonstrations, demonstration_turns,
};

/// Settings of the warm start (the recipe's `warm_start` section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WarmStartConfig {
    /// BPE vocabulary size (byte-level; the tags `<search>` etc. are single tokens). Default 2048.
    pub vocab_size: usize,
    /// Supervised steps. Default 300.
    pub steps: usize,
    /// Sequences per step. Default 16.
    pub batch_size: usize,
    /// Peak learning rate (AdamW, linear warmup over 10% of the steps, cosine to 10%). Default 2e-3.
    pub lr: f64,
    /// Training questions turned into agent demonstrations (0 = all). Default 0.
    pub max_questions: usize,
    /// Refiner demonstrations per agent demonstration (split between gold, bad-search and bad-answer
    /// trajectories). Default 0.5.
    pub refiner_ratio: f64,
    /// Direct-answer and RAG demonstrations per agent demonstration (each). Default 0.15.
    pub baseline_ratio: f64,
    /// Copies of the demonstration set, each under its own random renaming of the entity names (a bijection
    /// on first names and name roots, consistent within a demonstration). 0 = the demonstrations as
    /// generated. Renamed copies take memorising the training split away as a way to lower the loss: the
    /// policy has to copy names from the question and the passages, which is what held-out questions need.
    /// Default 0.
    pub rename_copies: usize,
    /// Weight of an auxiliary next-token loss on the context tokens (prompt, retrieved passages, refiner
    /// prompts), each term averaged over its own tokens. The policy tokens alone are a thin signal (~50 per
    /// demonstration); the passages repeat every entity name, which teaches copying. Default 0.
    pub context_weight: f64,
    /// Demonstrations from real multi-hop questions over a real index, added to the synthetic ones
    /// ([`crate::real_demos`]; cold starts of a pre-trained model only). Absent by default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub real: Option<RealDemosConfig>,
}

impl Default for WarmStartConfig {
    fn default() -> Self {
        WarmStartConfig {
            vocab_size: 2048,
            steps: 300,
            batch_size: 16,
            lr: 2e-3,
            max_questions: 0,
            refiner_ratio: 0.5,
            baseline_ratio: 0.15,
            rename_copies: 0,
            context_weight: 0.0,
            real: None,
        }
    }
}

/// One supervised sequence: ids and the loss mask of each id (1 = predicted and trained on).
#[derive(Debug, Clone, PartialEq)]
pub struct SftExample {
    /// Token ids (prompt + target).
    pub ids: Vec<u32>,
    /// Per-id loss mask.
    pub mask: Vec<f32>,
    /// Which role (`agent`, `refiner`, `direct`, `rag`).
    pub role: &'static str,
}

/// What the warm start did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WarmStartReport {
    /// Demonstrations per role.
    pub examples: std::collections::BTreeMap<String, usize>,
    /// Agent demonstrations dropped (their search did not return the hop document).
    pub dropped: usize,
    /// Mean loss over the first and the last 10% of the steps.
    pub loss_first: f64,
    /// See `loss_first`.
    pub loss_last: f64,
    /// Parameters of the model.
    pub parameters: usize,
    /// Wall time.
    pub seconds: f64,
    /// Mean tokens per demonstration.
    #[serde(default)]
    pub mean_tokens: f64,
    /// The pre-trained model a cold start fine-tuned (its tokenizer is the policy's); `None` for the
    /// from-scratch warm start.
    #[serde(default)]
    pub base: Option<String>,
    /// What the real-data demonstrations' scan found (`warm_start.real`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub real: Option<RealDemoStats>,
}

/// Special (added) tokens of the warm-start tokenizer: the protocol tags as single tokens, and an EOS.
pub const EOS: &str = "<|endoftext|>";

/// Trains a byte-level BPE tokenizer of `vocab_size` on the training split's documents, questions and
/// demonstration turns plus the prompt templates (never on dev/test text), and writes `tokenizer.json` (+ `tokenizer_config.json`) into `dir`.
pub fn train_tokenizer(world: &World, vocab_size: usize, dir: &Path) -> Result<Tokenizer, Error> {
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, TokenizerBuilder};
    let err =
        |e: Box<dyn std::error::Error + Send + Sync>| Error::Invalid(format!("tokenizer: {e}"));
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut texts: Vec<String> = Vec::new();
    // Training-split text only: held-out entities must not shape the vocabulary.
    for d in world
        .corpus
        .iter()
        .filter(|d| d.id.starts_with("syn-train-"))
    {
        texts.push(format!("Doc 1(Title: {}) {}", d.title, d.text));
    }
    for q in &world.train {
        texts.push(q.example.question.clone());
        texts.extend(demonstration_turns(q));
    }
    for t in [
        SEARCH_R1_TEMPLATE,
        DIRECT_TEMPLATE,
        RAG_TEMPLATE,
        INVALID_ACTION_OBSERVATION,
    ] {
        texts.push(t.to_string());
    }
    texts.push(build_refiner_prompt(
        "",
        &crate::protocol::Trajectory::new(""),
    ));
    for j in 0..10 {
        texts.push(format!(" {j}"));
    }
    let tags = [
        SEARCH_OPEN,
        SEARCH_CLOSE,
        ANSWER_OPEN,
        ANSWER_CLOSE,
        THINK_OPEN,
        THINK_CLOSE,
        INFO_OPEN,
        INFO_CLOSE,
    ];
    let byte_level = ByteLevel::new(false, true, true);
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![AddedToken::from(EOS, true)])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<tokenizers::NormalizerWrapper>)
        .with_pre_tokenizer(Some(byte_level))
        .with_post_processor(None::<tokenizers::PostProcessorWrapper>)
        .with_decoder(Some(byte_level))
        .build()
        .map_err(err)?;
    tok.train(&mut trainer, texts.iter()).map_err(err)?;
    tok.add_tokens(
        tags.iter()
            .map(|t| AddedToken::from(*t, false).normalized(false)),
    )
    .map_err(err)?;
    let path = dir.join("tokenizer.json");
    tok.save(&path, false).map_err(err)?;
    let cfg = serde_json::json!({ "eos_token": EOS, "add_bos_token": false });
    let cpath = dir.join("tokenizer_config.json");
    std::fs::write(&cpath, cfg.to_string()).map_err(|e| Error::io(&cpath, e))?;
    Tokenizer::from_hf_dir(dir).map_err(|e| Error::Invalid(format!("tokenizer: {e}")))
}

/// One supervised sequence: `prompt_ids` (not trained on) followed by the tokens of `target` (trained on).
pub fn example_from(
    tok: &Tokenizer,
    prompt_ids: Vec<u32>,
    target: &str,
    role: &'static str,
) -> Result<SftExample, Error> {
    let t = encode(tok, target)?;
    let mut mask = vec![0.0; prompt_ids.len()];
    mask.extend(std::iter::repeat_n(1.0, t.len()));
    let mut ids = prompt_ids;
    ids.extend(t);
    Ok(SftExample { ids, mask, role })
}

/// The first gold alias of a question (the demonstrations' answer).
fn gold_of(q: &SyntheticQuestion) -> String {
    q.example
        .golden_answers
        .first()
        .cloned()
        .unwrap_or_default()
}

fn answer_turn(q: &SyntheticQuestion, answer: &str) -> String {
    format!(
        "{THINK_OPEN}{}{THINK_CLOSE}\n{ANSWER_OPEN} {answer} {ANSWER_CLOSE}",
        q.conclusion
    )
}

/// Builds the demonstrations of every role (see the module docs). Returns them and the number of agent
/// demonstrations dropped.
pub fn build_examples(
    world: &World,
    cfg: &WarmStartConfig,
    tok: &Tokenizer,
    templates: &PromptTemplates,
    protocol: &ProtocolConfig,
    search: &dyn SearchBackend,
    rng: &mut ChaCha8Rng,
) -> Result<(Vec<SftExample>, usize), Error> {
    let mut questions: Vec<SyntheticQuestion> = world.train.clone();
    questions.shuffle(rng);
    if cfg.max_questions > 0 {
        questions.truncate(cfg.max_questions);
    }
    let (demos, dropped) = build_demonstrations(&questions, &templates.agent, protocol, search)?;
    // (prompt, target, role) of the non-agent demonstrations, as text until the renaming below.
    let mut texts: Vec<(String, String, &'static str)> = Vec::new();
    // Map demos back to their questions by their rendered prompt (the template may wrap the question in a
    // chat template, so the question is not simply the prompt's tail).
    let by_prompt: std::collections::HashMap<String, &SyntheticQuestion> = questions
        .iter()
        .map(|q| (templates.agent.render(&q.example.question), q))
        .collect();
    let n_ref = (demos.len() as f64 * cfg.refiner_ratio).round() as usize;
    let all_answers: Vec<&str> = world
        .train
        .iter()
        .filter_map(|q| q.example.golden_answers.first().map(String::as_str))
        .collect();
    let all_queries: Vec<&str> = world
        .train
        .iter()
        .flat_map(|q| q.hops.iter().map(|h| h.query.as_str()))
        .collect();
    let mut bad_searches = Vec::new();
    for (k, ep) in demos.iter().take(n_ref).enumerate() {
        let Some(q) = by_prompt.get(&ep.trajectory.prompt) else {
            continue;
        };
        let t = ep.trajectory.steps.len();
        match k % 3 {
            0 => {
                let p = build_refiner_prompt(&q.example.question, &ep.trajectory);
                texts.push((p, " 0".into(), "refiner"));
            }
            1 => {
                // Wrong final answer: the last step is the first bad one.
                let gold = gold_of(q);
                let wrong = loop {
                    let w = all_answers.choose(rng).copied().unwrap_or("unknown");
                    if w != gold || all_answers.len() < 2 {
                        break w;
                    }
                };
                let mut tr = ep.trajectory.clone();
                if let Some(last) = tr.steps.last_mut() {
                    last.policy = crate::protocol::Segment::policy(answer_turn(q, wrong));
                }
                let p = build_refiner_prompt(&q.example.question, &tr);
                texts.push((p, format!(" {t}"), "refiner"));
            }
            _ => {
                // A wrong search at step j (< T): its query replaced and re-run.
                if t < 2 {
                    continue;
                }
                let j = rng.random_range(1..t);
                let wrong = all_queries.choose(rng).copied().unwrap_or("unknown");
                bad_searches.push((q, ep.trajectory.clone(), j, wrong.to_string()));
            }
        }
    }
    if !bad_searches.is_empty() {
        let queries: Vec<String> = bad_searches.iter().map(|b| b.3.clone()).collect();
        let results = search.search_batch(&queries, protocol.top_k)?;
        for ((q, mut tr, j, wrong), mut ps) in bad_searches.into_iter().zip(results) {
            ps.truncate(protocol.top_k);
            let step = &mut tr.steps[j - 1];
            let think = step
                .policy
                .text
                .split(SEARCH_OPEN)
                .next()
                .unwrap_or_default()
                .to_string();
            step.policy = crate::protocol::Segment::policy(format!(
                "{think}{SEARCH_OPEN} {wrong} {SEARCH_CLOSE}"
            ));
            step.observation = Some(crate::protocol::Segment::observation(
                crate::protocol::format_observation(&ps),
            ));
            let p = build_refiner_prompt(&q.example.question, &tr);
            texts.push((p, format!(" {j}"), "refiner"));
        }
    }
    // Baseline formats.
    let n_base = (demos.len() as f64 * cfg.baseline_ratio).round() as usize;
    for q in questions.iter().take(n_base) {
        let gold = gold_of(q);
        let p = templates.direct.render(&q.example.question);
        texts.push((p, answer_turn(q, &gold), "direct"));
    }
    let rag_qs: Vec<&SyntheticQuestion> = questions.iter().rev().take(n_base).collect();
    let qs: Vec<String> = rag_qs.iter().map(|q| q.example.question.clone()).collect();
    let results = search.search_batch(&qs, protocol.top_k)?;
    for (q, mut ps) in rag_qs.into_iter().zip(results) {
        ps.truncate(protocol.top_k);
        let gold = gold_of(q);
        let p = templates
            .rag
            .render_with_context(&q.example.question, &format_documents(&ps));
        texts.push((p, answer_turn(q, &gold), "rag"));
    }
    // Tokenize: once as generated, or `rename_copies` times, each copy under its own random renaming of the
    // entity names (see [`Renamer`]).
    let mut out = Vec::new();
    for _ in 0..cfg.rename_copies.max(1) {
        let ren = (cfg.rename_copies > 0).then(|| Renamer::random(world, rng));
        let r = |s: &str| match &ren {
            Some(x) => x.apply(s),
            None => s.to_string(),
        };
        for ep in &demos {
            let mut tr = ep.trajectory.clone();
            if ren.is_some() {
                tr.prompt = r(&tr.prompt);
                tr.prompt_token_ids = None;
                for st in &mut tr.steps {
                    st.policy.text = r(&st.policy.text);
                    st.policy.token_ids = None;
                    if let Some(o) = &mut st.observation {
                        o.text = r(&o.text);
                        o.token_ids = None;
                    }
                }
            }
            out.push(agent_example(tok, tr, "agent")?);
        }
        for (p, target, role) in &texts {
            out.push(example_from(
                tok,
                encode_prompt(tok, &r(p))?,
                &r(target),
                role,
            )?);
        }
    }
    Ok((out, dropped))
}

/// A finished agent episode as one supervised sequence: prompt ids (not trained on), then every segment,
/// trained on where the protocol's loss mask says so (the policy turns, not the observations).
fn agent_example(
    tok: &Tokenizer,
    mut tr: crate::protocol::Trajectory,
    role: &'static str,
) -> Result<SftExample, Error> {
    tokenize_episode(tok, &mut tr)?;
    let (ids, m) = tr.ids_and_loss_mask()?;
    let p = tr.prompt_token_ids.clone().unwrap_or_default();
    let mut mask = vec![0.0; p.len()];
    mask.extend(m);
    let mut row = p;
    row.extend(ids);
    Ok(SftExample {
        ids: row,
        mask,
        role,
    })
}

/// The real questions and retriever of `warm_start.real` (see [`crate::real_demos`]).
pub struct RealSource<'a> {
    /// Training questions.
    pub questions: &'a [QaExample],
    /// The real retriever.
    pub search: &'a dyn SearchBackend,
}

/// The real-data demonstrations as supervised sequences (`agent-real`, `rag-real`) and the scan's counters.
fn real_examples(
    cfg: &RealDemosConfig,
    real: &RealSource<'_>,
    tok: &Tokenizer,
    templates: &PromptTemplates,
    protocol: &ProtocolConfig,
    rng: &mut ChaCha8Rng,
) -> Result<(Vec<SftExample>, RealDemoStats), Error> {
    let demos = build_real_demos(real.questions, cfg, templates, protocol, real.search, rng)?;
    let mut out = Vec::with_capacity(demos.episodes.len() + demos.rag.len());
    for ep in demos.episodes {
        out.push(agent_example(tok, ep.trajectory, "agent-real")?);
    }
    for (p, t) in &demos.rag {
        out.push(example_from(tok, encode_prompt(tok, p)?, t, "rag-real")?);
    }
    let mut stats = demos.stats;
    let before = out.len();
    out.retain(|e| e.ids.len() <= cfg.max_tokens);
    stats.too_long = before - out.len();
    Ok((out, stats))
}

/// Mean masked negative log-likelihood of `batch` (differentiable when `model` is on an autodiff device).
pub fn sft_loss(model: &Transformer, batch: &[&SftExample]) -> Tensor<1> {
    sft_losses(model, batch, 0.0).0
}

/// The supervised loss with an auxiliary language-modelling term on the context tokens: returns
/// `(policy + context_weight * context, policy)`, each term a mean over its own tokens (the context term over
/// the prompt, observations and refiner prompts, i.e. every non-padding token outside the loss mask, the first
/// token excepted). With `context_weight = 0` the context term is not computed.
pub fn sft_losses(
    model: &Transformer,
    batch: &[&SftExample],
    context_weight: f64,
) -> (Tensor<1>, Tensor<1>) {
    let device = model.device();
    let rows: Vec<Vec<u32>> = batch.iter().map(|e| e.ids.clone()).collect();
    let (toks, mask, w) = padded(&rows, &device);
    let b = rows.len();
    if context_weight <= 0.0 {
        // Only the trained tokens need the output projection: score those positions alone (with a 49k
        // vocabulary the head over the prompt, or over the retrieved passages between two trained turns,
        // is a large part of the step and most of its memory).
        let trained: Vec<Vec<usize>> = batch
            .iter()
            .map(|e| (1..e.ids.len()).filter(|&p| e.mask[p] > 0.0).collect())
            .collect();
        let width = trained.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut at = Vec::with_capacity(b * width);
        let mut m = vec![0.0f32; b * width];
        for (i, (e, ps)) in batch.iter().zip(&trained).enumerate() {
            for k in 0..width {
                match ps.get(k) {
                    Some(&p) => {
                        at.push(p as i64);
                        m[i * width + k] = e.mask[p];
                    }
                    None => at.push(1),
                }
            }
        }
        let total: f32 = m.iter().sum::<f32>().max(1.0);
        let at =
            Tensor::<2, burn::tensor::Int>::from_data(TensorData::new(at, [b, width]), &device);
        let (lp, _) = kiln_lm::score_tokens_at(model, toks, mask, at, 1.0);
        let m = Tensor::<2>::from_data(TensorData::new(m, [b, width]), &device);
        let policy = (lp * m).sum().neg().div_scalar(total);
        return (policy.clone(), policy);
    }
    let lp = score_tokens(model, toks, mask, 1.0); // [b, w-1]
    let mut m = vec![0.0f32; b * (w - 1)];
    let mut c = vec![0.0f32; b * (w - 1)];
    for (i, e) in batch.iter().enumerate() {
        for p in 1..e.ids.len() {
            m[i * (w - 1) + p - 1] = e.mask[p];
            c[i * (w - 1) + p - 1] = 1.0 - e.mask[p];
        }
    }
    let total: f32 = m.iter().sum::<f32>().max(1.0);
    let m = Tensor::<2>::from_data(TensorData::new(m, [b, w - 1]), &device);
    let policy = (lp.clone() * m).sum().neg().div_scalar(total);
    let n_ctx: f32 = c.iter().sum::<f32>().max(1.0);
    let c = Tensor::<2>::from_data(TensorData::new(c, [b, w - 1]), &device);
    let context = (lp * c).sum().neg().div_scalar(n_ctx);
    (policy.clone() + context.mul_scalar(context_weight), policy)
}

/// One epoch of batches of `batch_size` example indices, grouped by similar length (see [`warm_start`]).
/// Every batch is full: the epoch is padded with a second draw when `examples.len()` is not a multiple.
fn length_bucketed_batches(
    examples: &[SftExample],
    batch_size: usize,
    rng: &mut ChaCha8Rng,
) -> Vec<Vec<usize>> {
    let mut idx: Vec<usize> = (0..examples.len()).collect();
    idx.shuffle(rng);
    while !idx.len().is_multiple_of(batch_size) {
        idx.push(idx[rng.random_range(0..examples.len())]);
    }
    let mut batches = Vec::with_capacity(idx.len() / batch_size);
    for window in idx.chunks_mut(batch_size * 16) {
        window.sort_by_key(|&i| examples[i].ids.len());
        batches.extend(window.chunks(batch_size).map(|b| b.to_vec()));
    }
    batches.shuffle(rng);
    batches
}

/// Runs the whole warm start into `dir` (tokenizer, model, SFT; writes `config.json`, `model.safetensors`,
/// the tokenizer files and `warm_start.json`). `device` must be an autodiff device. `on_step(step, loss)` is
/// called after every step (progress bars).
#[allow(clippy::too_many_arguments)]
pub fn warm_start(
    world: &World,
    cfg: &WarmStartConfig,
    model_cfg: &TransformerConfig,
    protocol: &ProtocolConfig,
    search: &dyn SearchBackend,
    dir: &Path,
    device: &Device,
    seed: u64,
    on_step: impl FnMut(usize, f64),
) -> Result<WarmStartReport, Error> {
    let start = Instant::now();
    check_steps(cfg)?;
    if cfg.real.is_some() {
        return Err(Error::Invalid(
            "warm_start.real needs a pre-trained model (`pretrained:`): the from-scratch warm start's \
             tokenizer is trained on the synthetic world only"
                .into(),
        ));
    }
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    let tok = train_tokenizer(world, cfg.vocab_size, &tmp)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (examples, dropped) = build_examples(
        world,
        cfg,
        &tok,
        &PromptTemplates::plain(),
        protocol,
        search,
        &mut rng,
    )?;
    let examples = fitting(examples, model_cfg.max_position_embeddings)?;
    let mut mc = model_cfg.clone();
    mc.vocab_size = tok.vocab_size();
    mc.eos_token_id = tok.token_to_id(EOS).map(kiln_lm::TokenIds::One);
    mc.validate()
        .map_err(|e| Error::Invalid(format!("model: {e}")))?;
    device.seed(seed);
    let model = mc.init(device);
    let parameters = model.num_params();
    let (model, losses) = supervised(model, &examples, cfg, &mut rng, on_step)?;
    let report = report_of(&examples, dropped, &losses, parameters, start, None);
    save_atomically(&model, &report, dir)?;
    Ok(report)
}

/// The supervised cold start of a pre-trained policy (`model`, with its tokenizer `tok`): the same
/// demonstrations as [`warm_start`] (every role, prompts from `templates`, e.g. inside the model's chat
/// template), fine-tuned with `lora` adapters when given (merged before saving) or every weight, into `dir`
/// (`config.json`, `model.safetensors`, `warm_start.json`; the tokenizer stays the base model's, named
/// by `base` in the report). The entities of the synthetic world are fictional, so the model cannot answer
/// from memory: it learns the protocol, when to search and to copy the answer from the passages.
#[allow(clippy::too_many_arguments)]
pub fn cold_start(
    world: &World,
    cfg: &WarmStartConfig,
    model: Transformer,
    tok: &Tokenizer,
    templates: &PromptTemplates,
    lora: Option<&kiln_lm::LoraConfig>,
    base: &str,
    protocol: &ProtocolConfig,
    search: &dyn SearchBackend,
    real: Option<&RealSource<'_>>,
    dir: &Path,
    seed: u64,
    on_step: impl FnMut(usize, f64),
) -> Result<WarmStartReport, Error> {
    let start = Instant::now();
    check_steps(cfg)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (mut examples, dropped) =
        build_examples(world, cfg, tok, templates, protocol, search, &mut rng)?;
    let mut real_stats = None;
    match (&cfg.real, real) {
        (Some(rc), Some(src)) => {
            let (ex, stats) = real_examples(rc, src, tok, templates, protocol, &mut rng)?;
            if ex.is_empty() {
                return Err(Error::Invalid(format!(
                    "warm_start.real: no demonstration could be built from {} (scanned {}, {} without a \
                     passage holding the answer in {}): is the index built over the corpus these \
                     questions come from?",
                    rc.questions,
                    stats.scanned,
                    stats.no_evidence,
                    rc.index.display()
                )));
            }
            examples.extend(ex);
            real_stats = Some(stats);
        }
        (Some(_), None) => {
            return Err(Error::Invalid(
                "warm_start.real is set but no real questions and retriever were given".into(),
            ));
        }
        (None, _) => {}
    }
    let examples = fitting(examples, model.config().max_position_embeddings)?;
    let parameters = model.num_params();
    let model = match lora {
        Some(l) => {
            model.device().seed(seed ^ 0x10_4a);
            model.with_lora(l)
        }
        None => model,
    };
    let (model, losses) = supervised(model, &examples, cfg, &mut rng, on_step)?;
    let mut report = report_of(&examples, dropped, &losses, parameters, start, Some(base));
    report.real = real_stats;
    save_atomically(&model, &report, dir)?;
    Ok(report)
}

fn check_steps(cfg: &WarmStartConfig) -> Result<(), Error> {
    if cfg.steps == 0 || cfg.batch_size == 0 {
        return Err(Error::Invalid(
            "warm_start.steps and warm_start.batch_size must be at least 1".into(),
        ));
    }
    Ok(())
}

/// The demonstrations that fit the model's window (and have something to predict).
fn fitting(examples: Vec<SftExample>, window: usize) -> Result<Vec<SftExample>, Error> {
    if examples.is_empty() {
        return Err(Error::Invalid(
            "no warm-start demonstration could be built (does the retriever index the world's corpus?)".into(),
        ));
    }
    let examples: Vec<SftExample> = examples
        .into_iter()
        .filter(|e| e.ids.len() <= window && e.ids.len() >= 2)
        .collect();
    if examples.is_empty() {
        return Err(Error::Invalid(format!(
            "every warm-start demonstration is longer than the model window ({window} tokens): raise \
             model.max_position_embeddings"
        )));
    }
    Ok(examples)
}

/// Supervised fine-tuning of `model` (on an autodiff device) on `examples` for `cfg.steps` steps of
/// `cfg.batch_size`: AdamW, linear warmup over 10% of the steps, cosine to 10% of `cfg.lr`, gradient
/// norm clipped at 1. Returns the model and the policy-token loss of every step.
pub fn supervised(
    mut model: Transformer,
    examples: &[SftExample],
    cfg: &WarmStartConfig,
    rng: &mut ChaCha8Rng,
    mut on_step: impl FnMut(usize, f64),
) -> Result<(Transformer, Vec<f64>), Error> {
    let optim_cfg = kiln_rl::OptimConfig {
        lr: cfg.lr,
        warmup_ratio: 0.1,
        schedule: kiln_rl::LrSchedule::Cosine,
        min_lr_ratio: 0.1,
        max_grad_norm: 1.0,
        ..kiln_rl::OptimConfig::default()
    };
    let mut optim = optim_cfg.build();
    let mut losses = Vec::with_capacity(cfg.steps);
    // Length-bucketed batches: each epoch, shuffle, sort windows of 16 batches by length, cut them into
    // batches and shuffle the batch order (much less padding than random batches: refiner prompts are long,
    // direct prompts short).
    let mut queue: Vec<Vec<usize>> = Vec::new();
    for step in 0..cfg.steps {
        if queue.is_empty() {
            queue = length_bucketed_batches(examples, cfg.batch_size, rng);
        }
        let batch: Vec<&SftExample> = queue
            .pop()
            .unwrap_or_default()
            .into_iter()
            .map(|i| &examples[i])
            .collect();
        let (loss, policy_loss) = sft_losses(&model, &batch, cfg.context_weight);
        // Logged and reported: the policy-token loss (comparable with or without the context term).
        let v = policy_loss.into_scalar::<f32>() as f64;
        let total = loss.clone().into_scalar::<f32>() as f64;
        if !v.is_finite() || !total.is_finite() {
            return Err(Error::Invalid(format!(
                "warm start: non-finite loss at step {step}; lower warm_start.lr"
            )));
        }
        let grads = loss.backward();
        let mut gp = GradientsParams::from_grads(grads, &model);
        kiln_rl::optim::clip_grad_norm(&model, &mut gp, optim_cfg.max_grad_norm);
        let lr = optim_cfg.lr_at(step as u64, cfg.steps as u64);
        model = optim.step(lr, model, gp);
        losses.push(v);
        on_step(step + 1, v);
    }
    Ok((model, losses))
}

fn report_of(
    examples: &[SftExample],
    dropped: usize,
    losses: &[f64],
    parameters: usize,
    start: Instant,
    base: Option<&str>,
) -> WarmStartReport {
    let k = (losses.len() / 10).max(1);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
    let mut examples_by_role = std::collections::BTreeMap::new();
    for e in examples {
        *examples_by_role.entry(e.role.to_string()).or_insert(0) += 1;
    }
    let tokens = examples.iter().map(|e| e.ids.len()).sum::<usize>();
    WarmStartReport {
        examples: examples_by_role,
        dropped,
        loss_first: mean(&losses[..k.min(losses.len())]),
        loss_last: mean(&losses[losses.len().saturating_sub(k)..]),
        parameters,
        seconds: start.elapsed().as_secs_f64(),
        mean_tokens: tokens as f64 / examples.len().max(1) as f64,
        base: base.map(str::to_string),
        real: None,
    }
}

/// Writes the model (adapters merged) and the report into a temporary folder beside `dir`, then renames
/// it into place: an interrupted warm start never leaves a half-written `dir` that would be reused.
fn save_atomically(model: &Transformer, report: &WarmStartReport, dir: &Path) -> Result<(), Error> {
    let tmp = dir.with_extension("tmp");
    kiln_lm::save_hf_dir(&model.valid(), &tmp)
        .map_err(|e| Error::Invalid(format!("saving the warm-start model: {e}")))?;
    let rp = tmp.join("warm_start.json");
    std::fs::write(
        &rp,
        serde_json::to_string_pretty(report).map_err(|e| Error::Invalid(e.to_string()))?,
    )
    .map_err(|e| Error::io(&rp, e))?;
    let _ = std::fs::remove_dir_all(dir);
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    Ok(())
}
