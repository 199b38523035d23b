//! The Search-R2 / Search-R1 pipeline of `kiln train` and `kiln eval` for a `search_r2` recipe
//! (METHODS, Search-R2: an actor and a meta-refiner with the same weights, joint GRPO).
//!
//! The chain on a fresh machine:
//! 1. the environment ([`env`]): the synthetic multi-hop world (cached under
//!    `datasets/cache/synthetic/`) and a tantivy BM25 index of its corpus (cached beside it), unless
//!    the recipe names its own data and retriever ([`open_retriever`]);
//! 2. the policy ([`load_policy`]): a pre-trained model (`pretrained:`, an HF folder, a GGUF file or
//!    a zoo name), or the tiny transformer of `model:` warm-started by supervised training on
//!    scripted demonstrations into `init_dir` (reused when present, so Search-R1 and Search-R2
//!    runs start from the same weights); with `refiner_start:` (Search-R2), the meta-refiner is then
//!    fine-tuned on the actor's own labelled trajectories into a folder of its own
//!    ([`crate::refiner_start`]), which becomes the policy, and its calibrated margin the refiner's;
//! 3. joint GRPO through kiln-rl ([`crate::grpo::SearchTask`], run by the binary's
//!    [`kiln_rl::Driver`]); 4. a held-out evaluation table, direct / RAG / agent
//!    ([`eval_checkpoint`]), which `kiln eval --task qa` also runs ([`eval_qa`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::module::Module;
use burn::tensor::Device;
use kiln_lm::{Tokenizer, Transformer, TransformerConfig};
use kiln_rl::{Context, Driver, PipelineError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::agent::RetrieverBackend;
use crate::data::{LoadOptions, QaExample, load_qa, resolve_dataset};
use crate::eval::{EvalMode, QaRecord, write_report};
use crate::grpo::{SearchTask, SearchTaskConfig, evaluate_examples};
use crate::protocol::PromptTemplates;
use crate::refiner_start::{RefinerStartConfig, RefinerStartInputs};
use crate::synthetic::{Split, World, WorldConfig, default_cache_root, load_or_generate};
use crate::warmstart::{WarmStartConfig, warm_start};

type Result<T> = std::result::Result<T, PipelineError>;

/// The task-specific part of a `search_r2` recipe.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct SearchRecipe {
    /// A pre-trained policy: HF folder, GGUF file or zoo name (e.g. `smollm2` after `just setup`). Empty: the
    /// tiny `model` trained from random initialisation with the warm start into `init_dir`.
    pub pretrained: String,
    /// The LLM judge of the process reward when `search.judge: llm` (HF folder, GGUF or zoo name; empty = the
    /// policy itself, same weights).
    pub judge_model: String,
    /// Wrap every prompt (agent, direct and RAG baselines; in training, the warm start and every
    /// evaluation) in the tokenizer's chat template as one user message (instruct models).
    pub chat_template: bool,
    /// Train LoRA adapters instead of every weight (absent = full fine-tuning): rank, alpha,
    /// dropout (keep 0 for GRPO: the ratio check compares re-scored and sampled log-probs) and
    /// target modules. The base weights are frozen (optimiser state for the adapters only), the
    /// KL reference is the base model, and checkpoints hold base + adapters.
    pub lora: Option<kiln_lm::LoraConfig>,
    /// Where the warm-started policy lives (created when absent; shared by Search-R1 and Search-R2 runs).
    /// With `pretrained:` it holds the cold-started weights (the tokenizer stays the pre-trained one's).
    pub init_dir: PathBuf,
    /// Architecture of the from-scratch policy (its `vocab_size` is set from the trained tokenizer).
    pub model: TransformerConfig,
    /// Supervised warm start on scripted demonstrations: trains the from-scratch policy, or, with
    /// `pretrained:`, cold-starts the pre-trained one (with `lora:` adapters when given, merged into the
    /// saved weights). `warm_start: {steps: 0}` with `pretrained:` starts GRPO from the model as it is.
    pub warm_start: WarmStartConfig,
    /// Search-R2's refiner start after the warm / cold start (off unless `questions > 0` and the refiner
    /// is enabled): the refiner fine-tuned on the actor's own trajectories, labelled with their first bad
    /// step, and its decision margin calibrated on held-out ones (README, "A refiner that sees").
    pub refiner_start: RefinerStartConfig,
    /// The synthetic multi-hop world (used when `train_data`, `eval_data` or `retriever` say `synthetic`).
    pub world: WorldConfig,
    /// Training questions: `synthetic` (the world's train split) or a dataset name / JSONL path.
    pub train_data: String,
    /// Keep only the training questions whose gold answer occurs (normalised, whole words) in the top
    /// `train_reachable_k` passages the retriever returns for the question itself; 0 = keep every question
    /// (default). For real questions over a small corpus: most of R1-Searcher's training questions have no
    /// evidence in the shared 26k-passage corpus, and a question no search can answer gives every trajectory
    /// reward 0 (a uniform group, no signal). Questions whose every alias is `yes` / `no` are dropped too (a
    /// passage that contains the word says nothing). How many were kept is logged.
    pub train_reachable_k: usize,
    /// Held-out questions for the periodic and final evaluation: `synthetic` (the world's test split; `dev`
    /// during training) or a dataset name / path.
    pub eval_data: String,
    /// Search engine: `synthetic` (a BM25 index of the world's corpus, built on first use), a kiln index
    /// directory (`kiln index`; BM25, or `dense:DIR` / `hybrid:DIR` for one built with `--dense`), the URL of a
    /// `kiln serve-retriever` / Search-R1 retrieval server, or `{kind: bm25 | dense | hybrid, index: DIR,
    /// encoder, ann: {kind: exact | hnsw, ...}, fusion: {bm25_weight, dense_weight, rrf_k, depth}}`.
    pub retriever: RetrieverSpec,
    /// Root of the shared datasets (for dataset names).
    pub datasets_root: PathBuf,
    /// GRPO rollouts: questions per step, group size, protocol, refiner, reward, sampling.
    pub search: SearchTaskConfig,
    /// Final evaluation after training: modes and number of held-out questions (0 = skip).
    pub final_eval: FinalEval,
}

/// The evaluation table printed at the end of training.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct FinalEval {
    /// Held-out questions (0 = no final evaluation). Default 200.
    pub questions: usize,
    /// Modes: any of `direct`, `rag`, `agent`.
    pub modes: Vec<String>,
    /// Bootstrap resamples of the confidence intervals. Default 2000.
    pub resamples: usize,
}

impl Default for FinalEval {
    fn default() -> Self {
        FinalEval {
            questions: 200,
            modes: vec!["direct".into(), "rag".into(), "agent".into()],
            resamples: 2000,
        }
    }
}

impl Default for SearchRecipe {
    fn default() -> Self {
        SearchRecipe {
            pretrained: String::new(),
            lora: None,
            judge_model: String::new(),
            chat_template: false,
            init_dir: PathBuf::from("runs/search/warm-start"),
            model: TransformerConfig {
                vocab_size: 2048,
                hidden_size: 128,
                intermediate_size: 384,
                num_hidden_layers: 4,
                num_attention_heads: 4,
                num_key_value_heads: Some(4),
                max_position_embeddings: 1024,
                tie_word_embeddings: true,
                ..TransformerConfig::default()
            },
            warm_start: WarmStartConfig::default(),
            refiner_start: RefinerStartConfig::default(),
            world: WorldConfig::default(),
            train_data: "synthetic".into(),
            train_reachable_k: 0,
            eval_data: "synthetic".into(),
            retriever: RetrieverSpec::Name("synthetic".into()),
            datasets_root: PathBuf::from("../shared/datasets"),
            search: SearchTaskConfig::default(),
            final_eval: FinalEval::default(),
        }
    }
}

impl SearchRecipe {
    /// True when the policy starts from weights this pipeline makes into `init_dir` (the warm start
    /// of the tiny model, or the cold start of `pretrained`), not from the pre-trained model as is.
    pub fn makes_start(&self) -> bool {
        self.pretrained.is_empty() || self.warm_start.steps > 0
    }

    /// True when the refiner start runs (see `refiner_start`).
    pub fn refiner_start_active(&self) -> bool {
        self.refiner_start.questions > 0 && self.search.batch.refiner.enabled && self.makes_start()
    }

    /// The folder of the refiner start (`refiner_start.dir`, default `init_dir` + `-refiner`).
    pub fn refiner_start_dir(&self) -> PathBuf {
        self.refiner_start.dir.clone().unwrap_or_else(|| {
            let mut s = self.init_dir.clone().into_os_string();
            s.push("-refiner");
            PathBuf::from(s)
        })
    }

    /// Where the policy's weights before GRPO live: the refiner start's folder when it runs, else
    /// `init_dir`.
    pub fn policy_dir(&self) -> PathBuf {
        if self.refiner_start_active() {
            self.refiner_start_dir()
        } else {
            self.init_dir.clone()
        }
    }

    /// True when the world is used (data or retriever `synthetic`).
    pub fn uses_world(&self) -> bool {
        self.retriever.is_synthetic()
            || [&self.train_data, &self.eval_data]
                .iter()
                .any(|s| s.as_str() == "synthetic")
    }
}

/// `retriever:` of a search recipe: a string, or a local index with the kind of search to run on it.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum RetrieverSpec {
    /// `synthetic`, an index directory (BM25), `bm25:DIR` / `dense:DIR` / `hybrid:DIR`, or a server URL.
    Name(String),
    /// `{kind: bm25 | dense | hybrid, index: DIR, encoder, ann, fusion}`.
    Local(kiln_retrieval::LocalRetrieverConfig),
}

/// By hand rather than `#[serde(untagged)]`: a mistake inside the map form (`indx:`) is then reported as
/// that field's error instead of "did not match any variant".
impl<'de> Deserialize<'de> for RetrieverSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RetrieverSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a string (`synthetic`, an index folder, `dense:DIR`, `hybrid:DIR`, a server URL) or \
                     {kind: bm25 | dense | hybrid, index: DIR, ...}",
                )
            }
            fn visit_str<E: serde::de::Error>(
                self,
                v: &str,
            ) -> std::result::Result<RetrieverSpec, E> {
                Ok(RetrieverSpec::Name(v.to_string()))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> std::result::Result<RetrieverSpec, A::Error> {
                kiln_retrieval::LocalRetrieverConfig::deserialize(
                    serde::de::value::MapAccessDeserializer::new(m),
                )
                .map(RetrieverSpec::Local)
            }
        }
        d.deserialize_any(V)
    }
}

impl RetrieverSpec {
    /// True for the synthetic world's own index.
    pub fn is_synthetic(&self) -> bool {
        matches!(self, RetrieverSpec::Name(s) if s == "synthetic")
    }
}

impl std::fmt::Display for RetrieverSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RetrieverSpec::Name(s) => f.write_str(s),
            RetrieverSpec::Local(c) => write!(f, "{}:{}", c.kind, c.index.display()),
        }
    }
}

/// Everything a run needs besides the model.
pub struct Env {
    /// The world, when used (by the data, the retriever, or a warm / cold start still to be made).
    pub world: Option<World>,
    /// The world's folder (its corpus and BM25 index), when loaded.
    pub world_dir: Option<PathBuf>,
    /// The search engine.
    pub search: RetrieverBackend,
    /// Training questions.
    pub train: Vec<QaExample>,
    /// Held-out questions used during training.
    pub dev: Vec<QaExample>,
    /// Held-out questions of the final table.
    pub test: Vec<QaExample>,
}

/// Opens (building on first use) the BM25 index of the world's corpus in `<world dir>/index`.
fn world_index(world_dir: &Path) -> Result<kiln_retrieval::IndexRetriever> {
    let index = world_dir.join("index");
    if let Ok(r) = kiln_retrieval::IndexRetriever::open(&index) {
        return Ok(r);
    }
    let corpus = world_dir.join("corpus.jsonl");
    kiln_retrieval::build_index(
        std::slice::from_ref(&corpus),
        &index,
        &kiln_retrieval::BuildOptions::default(),
    )
    .with_context(|| format!("indexing {}", corpus.display()))?;
    kiln_retrieval::IndexRetriever::open(&index)
        .with_context(|| format!("opening {}", index.display()))
}

/// Opens a retriever from a recipe's `retriever:` (`synthetic` needs `world_dir`).
pub fn open_retriever(spec: &RetrieverSpec, world_dir: Option<&Path>) -> Result<RetrieverBackend> {
    let spec = match spec {
        RetrieverSpec::Name(s) => s.as_str(),
        RetrieverSpec::Local(c) => return open_local(c),
    };
    let r: Arc<dyn kiln_retrieval::Retriever> = if spec == "synthetic" {
        let dir = world_dir.context("the synthetic retriever needs the synthetic world")?;
        Arc::new(world_index(dir)?)
    } else if spec.starts_with("http://") || spec.starts_with("https://") {
        Arc::new(
            kiln_retrieval::RemoteRetriever::new(spec, kiln_retrieval::RemoteOptions::default())
                .with_context(|| format!("retriever {spec}"))?,
        )
    } else {
        let c = kiln_retrieval::LocalRetrieverConfig::parse(spec).unwrap_or_else(|| {
            kiln_retrieval::LocalRetrieverConfig::new(kiln_retrieval::RetrieverKind::Bm25, spec)
        });
        return open_local(&c);
    };
    Ok(RetrieverBackend(r))
}

fn open_local(c: &kiln_retrieval::LocalRetrieverConfig) -> Result<RetrieverBackend> {
    let r = kiln_retrieval::open_local(c).with_context(|| {
        format!(
            "opening the {} index {} (build one with `kiln index --corpus CORPUS --out DIR{}`)",
            c.kind,
            c.index.display(),
            if c.kind == kiln_retrieval::RetrieverKind::Bm25 {
                ""
            } else {
                " --dense"
            }
        )
    })?;
    Ok(RetrieverBackend(r))
}

fn load_set(spec: &str, root: &Path, limit: Option<usize>) -> Result<Vec<QaExample>> {
    let path = resolve_dataset(spec, root).map_err(PipelineError::msg)?;
    let l = load_qa(
        &path,
        &LoadOptions {
            strict: false,
            limit,
        },
    )
    .map_err(PipelineError::msg)?;
    if l.skipped > 0 {
        tracing::warn!("{}: skipped {} bad lines", path.display(), l.skipped);
    }
    Ok(l.examples)
}

/// Builds the environment of a recipe.
pub fn env(r: &SearchRecipe) -> Result<Env> {
    // A warm / cold start still to be made trains on the world's scripted demonstrations, whatever
    // `train_data` says.
    let start_to_make = r.makes_start() && !r.init_dir.join("config.json").is_file();
    let (world, dir) = if r.uses_world() || start_to_make {
        let (w, d) =
            load_or_generate(&r.world, &default_cache_root()).map_err(PipelineError::msg)?;
        (Some(w), Some(d))
    } else {
        (None, None)
    };
    let search = open_retriever(&r.retriever, dir.as_deref())?;
    let split = |s: Split| world.as_ref().map(|w| w.examples(s)).unwrap_or_default();
    let mut train = if r.train_data == "synthetic" {
        split(Split::Train)
    } else {
        load_set(&r.train_data, &r.datasets_root, None)?
    };
    if r.train_reachable_k > 0 {
        let all = train.len();
        train = reachable(train, &search, r.train_reachable_k)?;
        tracing::info!(
            "train_reachable_k = {}: {} of {} training questions have a gold answer in the top {} passages \
             retrieved for the question",
            r.train_reachable_k,
            train.len(),
            all,
            r.train_reachable_k
        );
        if train.is_empty() {
            return Err(PipelineError(format!(
                "train_reachable_k = {}: none of the {all} training questions of {} has its answer in the top {} \
                 passages of {}; use a corpus that covers them, a larger k, or train_reachable_k: 0",
                r.train_reachable_k, r.train_data, r.train_reachable_k, r.retriever
            )));
        }
    }
    let (dev, test) = if r.eval_data == "synthetic" {
        (split(Split::Dev), split(Split::Test))
    } else {
        let all = load_set(&r.eval_data, &r.datasets_root, None)?;
        (all.clone(), all)
    };
    Ok(Env {
        world,
        world_dir: dir,
        search,
        train,
        dev,
        test,
    })
}

/// The questions of `examples` with a gold alias (not `yes` / `no`) in the top `k` passages `search` returns
/// for the question (searched in batches of 256).
pub fn reachable(
    examples: Vec<QaExample>,
    search: &RetrieverBackend,
    k: usize,
) -> Result<Vec<QaExample>> {
    use crate::rollout::SearchBackend;
    let mut kept = Vec::new();
    for chunk in examples.chunks(256) {
        let queries: Vec<String> = chunk.iter().map(|e| e.question.clone()).collect();
        let results = search
            .search_batch(&queries, k)
            .map_err(PipelineError::msg)?;
        for (e, passages) in chunk.iter().zip(results) {
            let golds: Vec<&String> = e
                .golden_answers
                .iter()
                .filter(|g| {
                    let n = crate::answer::normalize_answer(g);
                    !n.is_empty() && n != "yes" && n != "no"
                })
                .collect();
            if !golds.is_empty()
                && passages
                    .iter()
                    .any(|p| crate::reward::passage_contains_answer(p, &golds))
            {
                kept.push(e.clone());
            }
        }
    }
    Ok(kept)
}

/// The search engine of the world's scripted demonstrations (warm / cold start): the run's own when it is
/// the world's index, else the world's index opened beside it (a run on real data and a real index).
fn world_search(r: &SearchRecipe, env: &Env) -> Result<RetrieverBackend> {
    if r.retriever.is_synthetic() {
        return Ok(env.search.clone());
    }
    let dir = env
        .world_dir
        .as_deref()
        .context("the warm / cold start needs the synthetic world's folder")?;
    Ok(RetrieverBackend(Arc::new(world_index(dir)?)))
}

/// The prompt templates of every role (chat-wrapped when the recipe asks for it).
pub fn templates(r: &SearchRecipe, tok: &Tokenizer) -> PromptTemplates {
    let plain = PromptTemplates::plain();
    if r.chat_template {
        plain.map(|t| tok.apply_chat_template(&[kiln_lm::ChatMessage::user(t.to_string())], true))
    } else {
        plain
    }
}

/// The policy with the recipe's LoRA adapters attached (seeded), or as it is without `lora:`.
/// An evaluation attaches them too, so that the checkpoint's adapter tensors have a place to load.
fn with_lora(r: &SearchRecipe, model: Transformer, device: &Device, seed: u64) -> Transformer {
    match &r.lora {
        Some(cfg) => {
            device.seed(seed ^ 0x10_4a);
            let m = model.with_lora(cfg);
            tracing::info!(
                "LoRA r={} alpha={} on {}: {} trainable parameters of {}",
                cfg.rank,
                cfg.alpha,
                cfg.target_modules.join(", "),
                m.lora_parameter_count(),
                m.num_params()
            );
            m
        }
        None => model,
    }
}

/// A progress bar of `len` steps for a supervised stage (the binary's draws on the terminal).
pub type ProgressBars<'a> = dyn FnMut(u64) -> indicatif::ProgressBar + 'a;

/// Loads the policy (pre-trained, or the warm / cold start and the refiner start, creating each
/// when absent) on the autodiff `device`; the start stages draw their progress on `bar(len)`.
pub fn load_policy(
    r: &SearchRecipe,
    env: &Env,
    device: &Device,
    seed: u64,
    bar: &mut ProgressBars<'_>,
) -> Result<(Transformer, Tokenizer)> {
    if !r.pretrained.is_empty() {
        if r.warm_start.steps == 0 {
            return start_policy(r, device);
        }
        let dir = &r.init_dir;
        let key = warm_start_key(r, seed);
        if !dir.join("config.json").is_file() {
            // The pre-trained weights are read only to make the cold start (afterwards the policy
            // is the cold start's weights with the pre-trained tokenizer: `start_policy`).
            let (model, tok) = kiln_lm::zoo::load_with_tokenizer(&r.pretrained, device)
                .with_context(|| format!("loading the pre-trained policy {}", r.pretrained))?;
            let world = env
                .world
                .as_ref()
                .context("the cold start needs the synthetic world, and it was not loaded")?;
            let world_search = world_search(r, env)?;
            tracing::info!(
                "cold start: supervised fine-tuning of {} ({}) on scripted demonstrations -> {}",
                r.pretrained,
                match &r.lora {
                    Some(l) => format!("LoRA r={}", l.rank),
                    None => "every weight".into(),
                },
                dir.display()
            );
            // `warm_start.real`: real training questions and the real index their searches run on.
            let real = match &r.warm_start.real {
                Some(rc) => {
                    let questions = load_set(&rc.questions, &r.datasets_root, None)
                        .with_context(|| format!("warm_start.real.questions: {}", rc.questions))?;
                    let spec = RetrieverSpec::Name(rc.index.to_string_lossy().into_owned());
                    let search = open_retriever(&spec, None).context("warm_start.real.index")?;
                    Some((questions, search))
                }
                None => None,
            };
            let real_source = real.as_ref().map(|(q, s)| crate::warmstart::RealSource {
                questions: q,
                search: s,
            });
            let pb = bar(r.warm_start.steps as u64);
            pb.set_message("cold start");
            let report = crate::warmstart::cold_start(
                world,
                &r.warm_start,
                model,
                &tok,
                &templates(r, &tok),
                r.lora.as_ref(),
                &r.pretrained,
                &r.search.batch.protocol,
                &world_search,
                real_source.as_ref(),
                dir,
                seed,
                sft_progress(&pb, "cold start", 10),
            )
            .map_err(PipelineError::msg)?;
            pb.finish_and_clear();
            if let Some(st) = &report.real {
                tracing::info!(
                    "real-data demonstrations: {} one-search + {} two-search from {} questions scanned \
                     ({} yes/no or long answers, {} answers in the question, {} without evidence, {} dropped on replay, \
                     {} over max_tokens)",
                    st.one_search,
                    st.two_search,
                    st.scanned,
                    st.skipped_answer,
                    st.skipped_in_question,
                    st.no_evidence,
                    st.dropped_on_replay,
                    st.too_long
                );
            }
            tracing::info!(
                "cold start done in {:.0}s: demonstrations {:?} ({:.0} tokens each), loss {:.3} -> {:.3}",
                report.seconds,
                report.examples,
                report.mean_tokens,
                report.loss_first,
                report.loss_last
            );
            let key_path = dir.join("warm_start.key");
            std::fs::write(&key_path, &key)
                .with_context(|| format!("writing {}", key_path.display()))?;
        } else {
            check_key(dir, &key)?;
        }
        return finish_start(r, env, device, seed, &key, bar);
    }
    let dir = &r.init_dir;
    let key_path = dir.join("warm_start.key");
    let key = warm_start_key(r, seed);
    if !dir.join("config.json").is_file() {
        let world = env
            .world
            .as_ref()
            .context("the warm start needs the synthetic world, and it was not loaded")?;
        let world_search = world_search(r, env)?;
        tracing::info!(
            "warm start: training a tokenizer and a {}-layer transformer on scripted demonstrations -> {}",
            r.model.num_hidden_layers,
            dir.display()
        );
        let pb = bar(r.warm_start.steps as u64);
        pb.set_message("warm start");
        let ad = device.clone().autodiff();
        let report = warm_start(
            world,
            &r.warm_start,
            &r.model,
            &r.search.batch.protocol,
            &world_search,
            dir,
            &ad,
            seed,
            sft_progress(&pb, "warm start", 50),
        )
        .map_err(PipelineError::msg)?;
        pb.finish_and_clear();
        tracing::info!(
            "warm start done in {:.0}s: {} parameters, demonstrations {:?}, loss {:.3} -> {:.3}",
            report.seconds,
            report.parameters,
            report.examples,
            report.loss_first,
            report.loss_last
        );
        std::fs::write(&key_path, &key)
            .with_context(|| format!("writing {}", key_path.display()))?;
    } else {
        check_key(dir, &key)?;
    }
    finish_start(r, env, device, seed, &key, bar)
}

/// The key of the refiner start made from the start policy with key `start_key` under `r`'s settings.
fn refiner_start_key(r: &SearchRecipe, start_key: &str) -> String {
    let text = serde_json::to_string(&(
        start_key,
        &r.refiner_start.questions,
        &r.refiner_start.group_size,
        &r.refiner_start.holdout,
        &r.refiner_start.epochs,
        &r.refiner_start.batch_size,
        &r.refiner_start.lr,
        &r.search.sampling,
        // The labels read EM only, which the reward settings do not change: the default stands
        // in for them, so that Search-R2 and its `process: false` ablation share one refiner
        // start, and folders made before keep their key (it was the recipe's reward, default).
        &crate::reward::RewardConfig::default(),
        &r.train_data,
    ))
    .unwrap_or_default();
    kiln_rl::digest::fnv1a_hex(text.as_bytes())
}

/// The last part of [`load_policy`]: the refiner start when the recipe has one (made when its folder
/// is missing, refused when it was made under other settings), then the policy.
fn finish_start(
    r: &SearchRecipe,
    env: &Env,
    device: &Device,
    seed: u64,
    start_key: &str,
    bar: &mut ProgressBars<'_>,
) -> Result<(Transformer, Tokenizer)> {
    if !r.refiner_start_active() {
        return start_policy(r, device);
    }
    let dir = r.refiner_start_dir();
    let key = refiner_start_key(r, start_key);
    let key_path = dir.join(crate::refiner_start::KEY_FILE);
    if dir.join("config.json").is_file() {
        match std::fs::read_to_string(&key_path) {
            Ok(found) if found.trim() == key => {
                tracing::info!("using the refiner start in {}", dir.display());
                return start_policy(r, device);
            }
            _ => {
                return Err(PipelineError(format!(
                    "{} was made by a refiner start under other settings (the start policy, refiner_start, \
                     search.sampling or the training data differ from this recipe): delete that \
                     folder to redo it, or set refiner_start.dir to a new folder",
                    dir.display()
                )));
            }
        }
    }
    let (model, tok) = load_from(r, device, &r.init_dir)?;
    let c = &r.refiner_start;
    let n = c.questions.min(env.train.len());
    tracing::info!(
        "refiner start: {} trajectories of the actor on {n} training questions ({} held out), labelled, \
         then {} epochs of refiner fine-tuning -> {}",
        n * c.group_size,
        (n as f64 * c.holdout).round() as usize,
        c.epochs,
        dir.display()
    );
    let pb = bar((n * c.group_size) as u64);
    pb.set_message("refiner start: sampling");
    let inputs = RefinerStartInputs {
        config: c,
        questions: &env.train,
        tokenizer: &tok,
        templates: &templates(r, &tok),
        protocol: &r.search.batch.protocol,
        reward: &r.search.batch.reward,
        sampling: &r.search.sampling,
        max_batch: r.search.max_batch,
        on_search_error: r.search.batch.on_search_error,
        search: &env.search,
        lora: r.lora.as_ref(),
        margin: r.search.batch.refiner.margin,
        seed,
        key: &key,
    };
    let mut phase = String::new();
    let report =
        crate::refiner_start::refiner_start(&inputs, model, &dir, |what, i, total, loss| {
            if phase != what {
                phase = what.to_string();
                pb.set_length(total as u64);
                pb.set_position(0);
            }
            pb.set_position(i as u64);
            if loss.is_finite() {
                pb.set_message(format!("refiner start: {what} loss {loss:.3}"));
                if i % 10 == 0 {
                    tracing::info!("refiner start {what} step {i}/{total}: loss {loss:.3}");
                }
            } else {
                pb.set_message(format!("refiner start: {what}"));
                tracing::info!("refiner start {what}: {i}/{total}");
            }
        })
        .map_err(PipelineError::msg)?;
    pb.finish_and_clear();
    tracing::info!(
        "refiner start done in {:.0}s (sampling {:.0}s, fine-tuning {:.0}s): {} of {} trajectories right, \
         {} demonstrations, loss {:.3} -> {:.3}; held-out AUC {:.3} -> {:.3}, margin {}, revised right / \
         wrong {:.2} / {:.2} -> {:.2} / {:.2}",
        report.seconds,
        report.sample_seconds,
        report.train_seconds,
        report.right,
        report.trajectories,
        report.examples,
        report.loss_first,
        report.loss_last,
        report.auc_before,
        report.auc_after,
        report
            .margin
            .map(|m| format!("{m:.3}"))
            .unwrap_or_else(|| "not calibrated".into()),
        report.revise_right_before,
        report.revise_wrong_before,
        report.revise_right_after,
        report.revise_wrong_after
    );
    start_policy(r, device)
}

/// The refiner margin GRPO uses: the refiner start's calibrated one when the recipe has a refiner
/// start with `calibrate: true` and the calibration found one, else `search.batch.refiner.margin`.
pub fn refiner_margin(r: &SearchRecipe) -> Result<f64> {
    if r.refiner_start_active() && r.refiner_start.calibrate {
        let report = crate::refiner_start::read_report(&r.refiner_start_dir())
            .map_err(PipelineError::msg)?;
        if let Some(m) = report.margin {
            return Ok(m);
        }
    }
    Ok(r.search.batch.refiner.margin)
}

/// The per-step callback of a warm or cold start: the loss on the bar, and in the log every `every`
/// steps.
fn sft_progress<'a>(
    pb: &'a indicatif::ProgressBar,
    what: &'static str,
    every: usize,
) -> impl FnMut(usize, f64) + 'a {
    move |step, loss| {
        pb.set_message(format!("{what} loss {loss:.3}"));
        pb.inc(1);
        if step % every == 0 {
            tracing::info!("{what} step {step}: loss {loss:.3}");
        }
    }
}

/// Refuses a warm-start folder made under other settings than `key` (see [`warm_start_key`]).
fn check_key(dir: &Path, key: &str) -> Result<()> {
    match std::fs::read_to_string(dir.join("warm_start.key")) {
        Ok(found) if found.trim() != key => Err(PipelineError(format!(
            "{} was warm-started with other settings (world, warm_start, model, pretrained, lora, \
             chat_template, protocol or seed differ from this recipe): delete that folder to warm-start again, \
             or set `init_dir:` to a new folder",
            dir.display()
        ))),
        Ok(_) => {
            tracing::info!("using the warm-started policy in {}", dir.display());
            Ok(())
        }
        Err(_) => {
            tracing::info!(
                "using the policy in {} (not made by kiln's warm start: no warm_start.key)",
                dir.display()
            );
            Ok(())
        }
    }
}

/// What a warm start depends on (the world, its settings, the architecture, the protocol and the seed;
/// for a cold start the pre-trained model, LoRA and chat framing instead of the architecture), as a stable
/// hex digest: a warm-start folder made under other settings is never silently reused.
fn warm_start_key(r: &SearchRecipe, seed: u64) -> String {
    // The recipe's world config, not the loaded world (loaded only when used or when a start is made):
    // the same key either way (a loaded world's config is the recipe's), so a start made on the world
    // is found again by a run whose data and retriever are real.
    let world = crate::synthetic::cache_key(&r.world);
    let text = if r.pretrained.is_empty() {
        serde_json::to_string(&(
            world,
            &r.warm_start,
            &r.model,
            &r.search.batch.protocol,
            seed,
        ))
    } else {
        serde_json::to_string(&(
            world,
            &r.warm_start,
            (&r.pretrained, &r.lora, r.chat_template),
            &r.search.batch.protocol,
            seed,
        ))
    }
    .unwrap_or_default();
    kiln_rl::digest::fnv1a_hex(text.as_bytes())
}

/// With `lora:`, what the frozen base of the adapters is: the model it was loaded from (the warm or
/// cold start in `init_dir`, or the pre-trained file) with the SHA-256 of its weights, and the LoRA
/// settings. Adapter-only checkpoints record it and load only over the same base.
fn lora_base(r: &SearchRecipe) -> Result<Option<String>> {
    let Some(l) = &r.lora else {
        return Ok(None);
    };
    let weights = if r.makes_start() {
        r.policy_dir().join("model.safetensors")
    } else {
        match kiln_lm::zoo::resolve(&r.pretrained).map_err(PipelineError::msg)? {
            // One file stands for the folder: the weights, or the shard index of a sharded one.
            kiln_lm::zoo::ModelSource::HfDir(d) => {
                ["model.safetensors", "model.safetensors.index.json"]
                    .iter()
                    .map(|f| d.join(f))
                    .find(|p| p.is_file())
                    .unwrap_or_else(|| d.join("config.json"))
            }
            kiln_lm::zoo::ModelSource::Gguf(f) => f,
        }
    };
    let (bytes, sha) = kiln_rl::checkpoint::file_digest(&weights)
        .with_context(|| format!("hashing the LoRA base {}", weights.display()))?;
    let name = if r.pretrained.is_empty() {
        "the warm start".to_string()
    } else if r.warm_start.steps > 0 {
        format!("the cold start of {}", r.pretrained)
    } else {
        r.pretrained.clone()
    };
    let name = if r.refiner_start_active() {
        format!("{name} + refiner start")
    } else {
        name
    };
    let file = weights
        .file_name()
        .map(|f| f.to_string_lossy().to_string())
        .unwrap_or_default();
    Ok(Some(format!(
        "{name} ({file}: {bytes} bytes, sha256 {sha}) + LoRA r={} alpha={} on {}",
        l.rank,
        l.alpha,
        l.target_modules.join(",")
    )))
}

/// Makes what the recipe's policy starts from and is missing (the warm / cold start in `init_dir`,
/// then the refiner start), exactly as `kiln train` with run seed `seed` would, so that `kiln eval
/// RECIPE.yaml` can evaluate it before any training run; a no-op when both exist with this recipe's
/// settings, an error when they were made under other settings.
pub fn make_start(
    r: &SearchRecipe,
    device: &Device,
    seed: u64,
    bar: &mut ProgressBars<'_>,
) -> Result<()> {
    let missing = !r.init_dir.join("config.json").is_file()
        || (r.refiner_start_active() && !r.refiner_start_dir().join("config.json").is_file());
    if !r.makes_start() || !missing {
        return Ok(());
    }
    device.seed(seed);
    let env = env(r)?;
    load_policy(r, &env, &device.clone().autodiff(), seed, bar).map(|_| ())
}

/// The policy's weights and tokenizer before GRPO: the warm start in `init_dir`, the pre-trained
/// model, or its cold start in `init_dir` with the pre-trained tokenizer (see [`load_policy`], which
/// creates what is missing and then calls this; `kiln eval` calls it directly).
pub fn start_policy(r: &SearchRecipe, device: &Device) -> Result<(Transformer, Tokenizer)> {
    load_from(r, device, &r.policy_dir())
}

/// [`start_policy`] with the weights of `dir` (the warm / cold start's `init_dir`, or the refiner
/// start's folder); the from-scratch tokenizer always comes from `init_dir`.
fn load_from(r: &SearchRecipe, device: &Device, dir: &Path) -> Result<(Transformer, Tokenizer)> {
    if r.makes_start() && !dir.join("config.json").is_file() {
        let what = if dir == r.init_dir {
            if r.pretrained.is_empty() {
                "the warm start".to_string()
            } else {
                format!("the cold start of {}", r.pretrained)
            }
        } else {
            "the refiner start".to_string()
        };
        return Err(PipelineError(format!(
            "{what} is not in {} (no config.json): `kiln train` or `kiln eval` of the recipe makes it \
             (or point init_dir / refiner_start.dir at the folder that holds it)",
            dir.display()
        )));
    }
    if r.pretrained.is_empty() {
        let tok = Tokenizer::from_hf_dir(&r.init_dir)
            .with_context(|| format!("loading the tokenizer of {}", r.init_dir.display()))?;
        let model = kiln_lm::load_hf_dir(dir, device)
            .with_context(|| format!("loading {}", dir.display()))?;
        Ok((model, tok))
    } else if r.warm_start.steps == 0 {
        kiln_lm::zoo::load_with_tokenizer(&r.pretrained, device)
            .with_context(|| format!("loading the pre-trained policy {}", r.pretrained))
    } else {
        let tok = kiln_lm::zoo::load_tokenizer(&r.pretrained)
            .with_context(|| format!("loading the tokenizer of {}", r.pretrained))?;
        let model = kiln_lm::load_hf_dir(dir, device).with_context(|| {
            format!(
                "loading the cold start of {} from {}",
                r.pretrained,
                dir.display()
            )
        })?;
        Ok((model, tok))
    }
}

/// `kiln train` of a `search_r2` recipe on `device` with the run seed `seed`: the environment,
/// the policy, joint GRPO through `driver`, then the final table of the newest checkpoint of
/// `run_dir` (when `final_eval.questions > 0`).
pub fn train(
    r: &SearchRecipe,
    device: &Device,
    seed: u64,
    run_dir: &Path,
    driver: &mut impl Driver,
) -> Result<()> {
    device.seed(seed);
    let env = env(r)?;
    if env.train.is_empty() {
        return Err(PipelineError(format!(
            "no training questions (train_data: {})",
            r.train_data
        )));
    }
    let ad = device.clone().autodiff();
    let (model, tok) = load_policy(r, &env, &ad, seed, &mut |n| driver.progress_bar(n))?;
    let model = with_lora(r, model, &ad, seed);
    tracing::info!(
        "search_r2: policy {} parameters, {} training questions, refiner {}, process reward {}",
        model.num_params(),
        env.train.len(),
        if r.search.batch.refiner.enabled {
            "on"
        } else {
            "off"
        },
        if r.search.batch.reward.process {
            "on"
        } else {
            "off"
        }
    );
    let mut search_cfg = r.search.clone();
    let margin = refiner_margin(r)?;
    if margin != search_cfg.batch.refiner.margin {
        tracing::info!(
            "refiner margin {margin:.3} (calibrated by the refiner start; the recipe says {})",
            search_cfg.batch.refiner.margin
        );
        search_cfg.batch.refiner.margin = margin;
    }
    let mut task = SearchTask::new(
        search_cfg,
        tok.clone(),
        templates(r, &tok),
        env.search.clone(),
        env.train.clone(),
        env.dev.clone(),
        seed,
    )
    .map_err(PipelineError::msg)?;
    if let Some(base) = lora_base(r)? {
        task = task.with_lora_base(base);
    }
    if !r.judge_model.is_empty() {
        let (jm, jt) = kiln_lm::zoo::load_with_tokenizer(&r.judge_model, device)
            .with_context(|| format!("loading the judge model {}", r.judge_model))?;
        task = task.with_judge_model(jm, jt);
    }
    driver.train(task, model, ad)?;
    // The final table needs a fraction of training's memory: hand the kept pages back to the kernel.
    kiln_lm::malloc::release_freed_memory();
    if r.final_eval.questions > 0 {
        let ckpt = kiln_rl::checkpoint::CheckpointManager::resolve(run_dir)?;
        let n = r.final_eval.questions.min(env.test.len());
        let modes: Vec<EvalMode> = r
            .final_eval
            .modes
            .iter()
            .filter_map(|m| m.parse().ok())
            .collect();
        eval_checkpoint(
            r,
            device,
            seed,
            &ckpt,
            run_dir,
            &[("heldout".to_string(), env.test[..n].to_vec())],
            &env.search,
            &modes,
            r.final_eval.resamples,
        )?;
    }
    Ok(())
}

/// Evaluates a checkpoint on `sets` in `modes` (greedy, [`evaluate_examples`]); writes
/// `<run>/eval/qa-step-N/` (bootstrap seeded with `seed`) and prints the table.
#[allow(clippy::too_many_arguments)]
pub fn eval_checkpoint(
    r: &SearchRecipe,
    device: &Device,
    seed: u64,
    ckpt: &Path,
    run_dir: &Path,
    sets: &[(String, Vec<QaExample>)],
    search: &RetrieverBackend,
    modes: &[EvalMode],
    resamples: usize,
) -> Result<Vec<QaRecord>> {
    let (model, tok) = start_policy(r, device)?;
    let model = with_lora(r, model, device, 0);
    let templates = templates(r, &tok);
    let mp = ckpt.join(kiln_rl::checkpoint::MODEL_FILE);
    let model = if mp.is_file() {
        let stored = kiln_rl::checkpoint::CheckpointManager::read_state(ckpt)
            .ok()
            .and_then(|s| s.policy_subset);
        let current = if stored.is_some() {
            lora_base(r)?
        } else {
            None
        };
        kiln_rl::checkpoint::load_model(model, &mp, stored.as_deref(), current.as_deref())
            .map_err(|e| PipelineError(format!("cannot load the model: {e}")))?
    } else {
        model
    };
    // Greedy evaluation needs no gradient: fold the adapters into the weights (faster generation).
    let model = if model.has_lora() {
        model.merge_lora()
    } else {
        model
    };
    let step = kiln_rl::checkpoint::CheckpointManager::read_state(ckpt)
        .map(|s| s.step)
        .unwrap_or(0);
    let mut records = Vec::new();
    let mut timing = BTreeMap::new();
    for (name, examples) in sets {
        for &mode in modes {
            let t = std::time::Instant::now();
            let (recs, stats) = evaluate_examples(
                &model,
                &tok,
                &r.search,
                &templates,
                search,
                name,
                examples,
                mode,
                r.search.sampling.max_new_tokens,
            )
            .map_err(PipelineError::msg)?;
            timing.insert(
                format!("{name}/{}", mode.name()),
                serde_json::json!({"seconds": t.elapsed().as_secs_f64(), "rollout": stats}),
            );
            records.extend(recs);
        }
    }
    // The final table of a training run goes to qa-step-N; `kiln eval` reports are named after their data.
    let names: Vec<&str> = sets.iter().map(|(n, _)| n.as_str()).collect();
    let label = if names == ["heldout"] {
        String::new()
    } else {
        format!("-{}", names.join("+"))
    };
    let dir = run_dir.join("eval").join(format!("qa-step-{step}{label}"));
    let (summaries, files) = write_report(
        &dir,
        &format!("QA evaluation of {} (step {step})", ckpt.display()),
        &records,
        resamples,
        seed,
    )
    .map_err(PipelineError::msg)?;
    std::fs::write(dir.join("timing.json"), serde_json::to_vec_pretty(&timing)?)?;
    println!("\n{}", crate::eval::markdown_table(&summaries));
    println!("report: {}", files.markdown.display());
    Ok(records)
}

/// `kiln eval RUN --task qa --data NAME_OR_PATH [--retriever INDEX_OR_URL] [--mode M]`.
#[allow(clippy::too_many_arguments)]
pub fn eval_qa(
    r: &SearchRecipe,
    device: &Device,
    seed: u64,
    ckpt: &Path,
    run_dir: &Path,
    data: Option<&str>,
    retriever: Option<&str>,
    mode: Option<&str>,
    limit: Option<usize>,
) -> Result<()> {
    let mut rr = r.clone();
    if let Some(x) = retriever {
        rr.retriever = RetrieverSpec::Name(x.to_string());
    }
    let data = data.unwrap_or("synthetic");
    let sets: Vec<(String, Vec<QaExample>)> = if data == "synthetic" || data == "synthetic:test" {
        rr.eval_data = "synthetic".into();
        let e = env(&rr)?;
        let mut t = e.test;
        if let Some(n) = limit {
            t.truncate(n);
        }
        let search = e.search;
        let modes = parse_modes(mode)?;
        eval_checkpoint(
            &rr,
            device,
            seed,
            ckpt,
            run_dir,
            &[("synthetic-test".into(), t)],
            &search,
            &modes,
            r.final_eval.resamples,
        )?;
        return Ok(());
    } else {
        data.split(',')
            .map(|d| {
                let ex = load_set(d.trim(), &rr.datasets_root, limit)?;
                let name = Path::new(d.trim())
                    .file_stem()
                    .map(|s| s.to_string_lossy().to_string())
                    .unwrap_or_else(|| d.to_string());
                Ok((name, ex))
            })
            .collect::<Result<_>>()?
    };
    let world_dir = if rr.retriever.is_synthetic() {
        Some(
            load_or_generate(&rr.world, &default_cache_root())
                .map_err(PipelineError::msg)?
                .1,
        )
    } else {
        None
    };
    let search = open_retriever(&rr.retriever, world_dir.as_deref())?;
    let modes = parse_modes(mode)?;
    eval_checkpoint(
        &rr,
        device,
        seed,
        ckpt,
        run_dir,
        &sets,
        &search,
        &modes,
        r.final_eval.resamples,
    )?;
    Ok(())
}

fn parse_modes(mode: Option<&str>) -> Result<Vec<EvalMode>> {
    match mode {
        None | Some("all") => Ok(vec![EvalMode::Direct, EvalMode::Rag, EvalMode::Agent]),
        Some(m) => m
            .split(',')
            .map(|x| x.trim().parse::<EvalMode>().map_err(PipelineError::msg))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The refiner start's key ignores the reward settings (its labels read EM only) and is the key
    /// the default recipe's folders already hold: c48c04ab218c56f4 is what the previous code wrote
    /// for these settings (FNV-1a of the settings' JSON, recomputed independently in Python).
    #[test]
    fn refiner_start_key_is_stable_and_ignores_the_reward() {
        let recipe = |process: bool, questions: usize| -> SearchRecipe {
            serde_json::from_value(serde_json::json!({
                "train_data": "synthetic",
                "refiner_start": {"questions": questions, "group_size": 4, "holdout": 0.25, "epochs": 3,
                                  "batch_size": 4, "lr": 0.0005},
                "search": {"sampling": {"max_new_tokens": 48, "temperature": 1.0},
                           "batch": {"reward": {"process": process}}},
            }))
            .unwrap()
        };
        let start = "8adaf7803071ba38";
        assert_eq!(
            refiner_start_key(&recipe(true, 48), start),
            "c48c04ab218c56f4"
        );
        assert_eq!(
            refiner_start_key(&recipe(false, 48), start),
            "c48c04ab218c56f4"
        );
        assert_ne!(
            refiner_start_key(&recipe(true, 47), start),
            "c48c04ab218c56f4"
        );
        assert_ne!(
            refiner_start_key(&recipe(true, 48), "other"),
            "c48c04ab218c56f4"
        );
    }

    #[test]
    fn retriever_is_a_string_or_a_local_index_with_its_kind() {
        let r: SearchRecipe =
            serde_json::from_value(serde_json::json!({"retriever": "hybrid:idx"})).unwrap();
        assert_eq!(r.retriever, RetrieverSpec::Name("hybrid:idx".into()));
        assert!(!r.retriever.is_synthetic());
        let r: SearchRecipe = serde_json::from_value(serde_json::json!({
            "retriever": {"kind": "dense", "index": "idx", "ann": {"kind": "hnsw", "m": 8}}
        }))
        .unwrap();
        let RetrieverSpec::Local(c) = &r.retriever else {
            panic!("{:?}", r.retriever)
        };
        assert_eq!(c.kind, kiln_retrieval::RetrieverKind::Dense);
        assert_eq!(r.retriever.to_string(), "dense:idx");
        assert!(SearchRecipe::default().retriever.is_synthetic());
        // A misspelt field of the map form is refused, not read as a string.
        let bad = serde_json::json!({"retriever": {"kind": "dense", "indx": "idx"}});
        let e = serde_json::from_value::<SearchRecipe>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `indx`"), "{e}");
        let e = serde_json::from_value::<SearchRecipe>(serde_json::json!({"retriever": 3}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hybrid:DIR"), "{e}");
    }
}
