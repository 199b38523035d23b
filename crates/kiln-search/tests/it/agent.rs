//! The model-driven layer with real components: a byte-level BPE trained on a synthetic world, a kiln-lm
//! transformer (random init), a real tantivy index of the world's corpus, and kiln-rl's trainer.
//!
//! Checked: token-in/token-out (the ids scored at train time are exactly the ids sampled, and the re-scored
//! log-probs equal the sampling log-probs); the action mask is 1 on generated tokens and refiner decision
//! tokens and 0 on observations; the refiner's single-token fast path equals teacher-forced scoring; a failing
//! retriever ends episodes without killing a GRPO step; the warm start lowers the loss and writes a loadable
//! model.

use std::sync::{Arc, OnceLock};

use burn::tensor::Device;
use kiln_lm::{SamplingConfig, Tokenizer, Transformer, TransformerConfig};
use kiln_retrieval::{BuildOptions, IndexRetriever, build_index};
use kiln_rl::RlTask;
use kiln_search::agent::{
    LmActor, LmRefiner, RetrieverBackend, context_ids, continuation_logprobs, tokenize_episode,
};
use kiln_search::grpo::{SearchTask, SearchTaskConfig};
use kiln_search::protocol::{
    Episode, PromptTemplate, PromptTemplates, ProtocolConfig, SegmentKind,
};
use kiln_search::rollout::{OnSearchError, run_episodes};
use kiln_search::synthetic::{Split, SplitConfig, World, WorldConfig, generate};
use kiln_search::task::{RefinerRequest, RefinerScorer};
use kiln_search::warmstart::{WarmStartConfig, train_tokenizer, warm_start};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

struct Fixture {
    world: World,
    _dir: tempfile::TempDir,
    tok: Tokenizer,
    search: RetrieverBackend,
}

fn small_world() -> WorldConfig {
    let s = |countries, cities, persons, companies, questions| SplitConfig {
        countries,
        cities,
        persons,
        companies,
        questions,
    };
    WorldConfig {
        seed: 3,
        train: s(4, 10, 40, 20, 120),
        dev: s(2, 4, 12, 6, 20),
        test: s(2, 4, 12, 6, 20),
        ..WorldConfig::default()
    }
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let world = generate(&small_world()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        world.write(dir.path()).unwrap();
        let index = dir.path().join("index");
        build_index(
            &[dir.path().join("corpus.jsonl")],
            &index,
            &BuildOptions {
                progress: false,
                threads: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let search = RetrieverBackend(Arc::new(IndexRetriever::open(&index).unwrap()));
        let tok = train_tokenizer(&world, 600, &dir.path().join("tok")).unwrap();
        Fixture {
            world,
            _dir: dir,
            tok,
            search,
        }
    })
}

fn model(vocab: usize, seed: u64) -> Transformer {
    model_on(vocab, seed, &Device::flex())
}

/// A tiny random model whose weights depend on `seed` alone. The device RNG is one per process,
/// shared by the tests that run in parallel threads (and by library code that initialises or
/// samples on the device), so seeding it does not pin the draws: every matrix is redrawn here
/// from a host RNG of its own (normal, std 0.5 as `initializer_range`); the norms' gains are
/// ones either way.
fn model_on(vocab: usize, seed: u64, device: &Device) -> Transformer {
    use burn::module::{Module, ModuleMapper, Param};
    use burn::tensor::{Tensor, TensorData};
    use rand::Rng;
    struct HostInit(ChaCha8Rng);
    impl ModuleMapper for HostInit {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if D != 2 {
                return param;
            }
            let rng = &mut self.0;
            param.map(|t| {
                let dims = t.dims();
                let n: usize = dims.iter().product();
                // Box-Muller: two uniforms per normal draw.
                let v: Vec<f32> = (0..n)
                    .map(|_| {
                        let (u1, u2): (f64, f64) = (rng.random(), rng.random());
                        let z = (-2.0 * (1.0 - u1).ln()).sqrt()
                            * (2.0 * std::f64::consts::PI * u2).cos();
                        (0.5 * z) as f32
                    })
                    .collect();
                Tensor::from_data(TensorData::new(v, dims), &t.device())
            })
        }
    }
    TransformerConfig {
        vocab_size: vocab,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        max_position_embeddings: 1024,
        initializer_range: 0.5,
        ..Default::default()
    }
    .init(device)
    .map(&mut HostInit(ChaCha8Rng::seed_from_u64(seed)))
}

#[test]
fn tokenizer_round_trips_and_tags_are_single_tokens() {
    let f = fixture();
    for t in [
        "<search>",
        "</search>",
        "<answer>",
        "</answer>",
        "<information>",
    ] {
        let ids = f.tok.encode(t, false).unwrap();
        assert_eq!(ids.len(), 1, "{t} -> {ids:?}");
    }
    for s in [
        f.world.corpus[0].text.as_str(),
        "  odd   spacing\n\nand ünïcödé ✓ <search> x </search>",
        "",
    ] {
        let ids = f.tok.encode(s, false).unwrap();
        assert_eq!(f.tok.decode(&ids, false).unwrap(), s);
    }
}

#[test]
fn rescoring_reproduces_sampling_logprobs_and_masks_observations() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 7);
    let cfg = SearchTaskConfig {
        questions_per_step: 2,
        sampling: SamplingConfig {
            max_new_tokens: 24,
            temperature: 1.0,
            ..Default::default()
        },
        ..SearchTaskConfig::default()
    };
    let mut cfg = cfg;
    cfg.batch.group_size = 3;
    cfg.batch.protocol.max_turns = 3;
    let mut task = SearchTask::new(
        cfg,
        f.tok.clone(),
        PromptTemplates::plain(),
        f.search.clone(),
        f.world.examples(Split::Train),
        f.world.examples(Split::Dev),
        1,
    )
    .unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let r = task.rollout(&m, 0, &mut rng).unwrap();
    assert_eq!(r.rewards.len(), 6);
    let t = r.max_actions;
    assert_eq!(r.action_mask.len(), 6 * t);
    let scored = task.score(&m, &r.data, &(0..6).collect::<Vec<_>>());
    let lp: Vec<f32> = scored.logp.into_data().try_into_vec_as::<f32>().unwrap();
    assert_eq!(lp.len(), 6 * t);
    assert!(lp.iter().all(|x| x.is_finite() && *x <= 1e-5));
    let mut policy_tokens = 0;
    for row in 0..6 {
        let mask = &r.action_mask[row * t..(row + 1) * t];
        policy_tokens += mask.iter().filter(|x| **x > 0.0).count();
    }
    assert!(policy_tokens > 0);
    // Deterministic re-check of masking on an episode we build ourselves.
    let q = &f.world.train[0];
    let mut ep = Episode::for_question(
        &PromptTemplate::search_r1(),
        &q.example.question,
        ProtocolConfig::default(),
    )
    .unwrap();
    let mut arng = ChaCha8Rng::seed_from_u64(9);
    let mut actor = LmActor::new(&m, &f.tok, SamplingConfig::greedy(16), &mut arng);
    let mut eps = vec![ep.clone()];
    run_episodes(&mut eps, &mut actor, &f.search, OnSearchError::Fail).unwrap();
    ep = eps.pop().unwrap();
    // Context ids = prompt ids + all segment ids, each segment tokenized on its own.
    let ctx = context_ids(&f.tok, &ep).unwrap();
    let mut tr = ep.trajectory.clone();
    tokenize_episode(&f.tok, &mut tr).unwrap();
    let (ids, mask) = tr.ids_and_loss_mask().unwrap();
    let prompt = tr.prompt_token_ids.clone().unwrap();
    assert_eq!(ctx, [prompt.clone(), ids.clone()].concat());
    let mut k = 0;
    for seg in tr.segments() {
        let n = seg.token_ids.as_ref().unwrap().len();
        let want = if seg.kind == SegmentKind::Policy {
            1.0
        } else {
            0.0
        };
        assert!(mask[k..k + n].iter().all(|x| *x == want));
        if seg.kind == SegmentKind::Policy {
            // Sampling log-probs (greedy: temperature 1) equal teacher-forced log-probs of the same ids.
            let row: Vec<u32> = [prompt.clone(), ids[..k + n].to_vec()].concat();
            let sampled = seg.logprobs.as_ref().unwrap();
            for (j, lp) in sampled.iter().enumerate() {
                let upto = prompt.len() + k + j + 1;
                let full = continuation_logprobs(&m, &[row[..upto].to_vec()], &[upto - 1])[0];
                assert!((full - *lp as f64).abs() < 1e-3, "{full} vs {lp}");
            }
        }
        k += n;
    }
}

/// Multi-turn sampled rollouts continue each episode from its kept KV cache: the same episodes
/// (texts, ids, recorded log-probs within 1e-4) as re-prefilling every transcript, with fewer
/// context tokens prefilled.
#[test]
fn actor_reusing_kept_caches_samples_the_same_episodes() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 13);
    let protocol = ProtocolConfig {
        max_turns: 3,
        ..ProtocolConfig::default()
    };
    let sampling = SamplingConfig {
        temperature: 1.0,
        greedy: false,
        ..SamplingConfig::greedy(12)
    };
    let run = |reuse: bool| {
        let mut eps: Vec<Episode> = f.world.train[..3]
            .iter()
            .flat_map(|q| {
                let protocol = protocol.clone();
                (0..2).map(move |_| {
                    Episode::for_question(
                        &PromptTemplate::search_r1(),
                        &q.example.question,
                        protocol.clone(),
                    )
                    .unwrap()
                })
            })
            .collect();
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let mut actor = LmActor::new(&m, &f.tok, sampling.clone(), &mut rng);
        actor.reuse_kv = reuse;
        actor.max_batch = 4; // two generation calls per round
        run_episodes(&mut eps, &mut actor, &f.search, OnSearchError::EndEpisode).unwrap();
        (eps, actor.prefill_tokens)
    };
    let (a, with_cache) = run(true);
    let (b, without) = run(false);
    let turns: usize = a.iter().map(|e| e.trajectory.steps.len()).sum();
    assert!(turns > a.len(), "some episodes need several turns: {turns}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.trajectory.steps.len(), y.trajectory.steps.len());
        for (sx, sy) in x.trajectory.steps.iter().zip(&y.trajectory.steps) {
            assert_eq!(sx.policy.text, sy.policy.text);
            assert_eq!(sx.policy.token_ids, sy.policy.token_ids);
            let (lx, ly) = (
                sx.policy.logprobs.as_ref().unwrap(),
                sy.policy.logprobs.as_ref().unwrap(),
            );
            for (p, q) in lx.iter().zip(ly) {
                assert!((p - q).abs() < 1e-4, "{p} vs {q}");
            }
        }
    }
    assert!(with_cache < without, "{with_cache} vs {without}");
}

#[test]
fn refiner_fast_path_equals_teacher_forcing() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 11);
    let prompt = "Question: who?\nASSISTANT_STEP_1: <search> x </search>\nProblematic step index (0 = no issue):";
    let cands: Vec<String> = (0..3).map(|j| format!(" {j}")).collect();
    let multi = vec![" 0 ok".to_string(), " 1".to_string()];
    let mut r = LmRefiner {
        model: &m,
        tokenizer: &f.tok,
        max_batch: 4,
    };
    let out = r
        .score(&[
            RefinerRequest {
                index: 0,
                prompt,
                candidates: &cands,
            },
            RefinerRequest {
                index: 1,
                prompt,
                candidates: &multi,
            },
        ])
        .unwrap();
    let p = f.tok.encode(prompt, false).unwrap();
    for (c, got) in cands.iter().zip(&out[0]) {
        let row: Vec<u32> = [p.clone(), f.tok.encode(c, false).unwrap()].concat();
        let want = continuation_logprobs(&m, &[row], &[p.len()])[0];
        assert!((want - got).abs() < 1e-4, "{c}: {want} vs {got}");
    }
    assert_eq!(out[1].len(), 2);
    // " 0 ok" has more tokens than " 0": strictly lower log-probability.
    assert!(out[1][0] < out[0][0]);
    // Candidates sharing all but their last token (SmolLM2 splits " 0" into " " and "0"): one forward of
    // prompt + shared part, scored exactly like teacher forcing of each whole candidate.
    // (the fixture's tokenizer splits some digits from the space and merges others: keep the split ones)
    let split = |j: usize| {
        let ids = f.tok.encode(&format!(" answer {j}"), false).unwrap();
        (ids.len() == 3).then_some((format!(" answer {j}"), ids))
    };
    let (shared, ids): (Vec<String>, Vec<Vec<u32>>) = (0..10).filter_map(split).unzip();
    let l = ids[0].len();
    assert!(
        ids.len() >= 2
            && ids
                .iter()
                .all(|c| c.len() == l && c[..l - 1] == ids[0][..l - 1]),
        "{ids:?}"
    );
    let out = r
        .score(&[RefinerRequest {
            index: 0,
            prompt,
            candidates: &shared,
        }])
        .unwrap();
    for (c, got) in ids.iter().zip(&out[0]) {
        let row: Vec<u32> = [p.clone(), c.clone()].concat();
        let want = continuation_logprobs(&m, &[row], &[p.len()])[0];
        assert!((want - got).abs() < 1e-4, "{c:?}: {want} vs {got}");
    }
}

#[test]
fn failing_retriever_ends_episodes_but_the_step_goes_on() {
    #[derive(Clone)]
    struct Broken;
    impl kiln_retrieval::Retriever for Broken {
        fn search_batch(
            &self,
            _q: &[String],
            _k: usize,
        ) -> Result<Vec<Vec<kiln_retrieval::Passage>>, kiln_retrieval::Error> {
            Ok(vec![]) // garbage: no result list at all
        }
    }
    let f = fixture();
    // A policy that always searches: the warm start teaches that; here a scripted model would do, but the
    // real path is what matters: use the actor with a model and check the backend error is contained.
    let m = model(f.tok.vocab_size(), 3);
    let mut cfg = SearchTaskConfig {
        questions_per_step: 1,
        ..SearchTaskConfig::default()
    };
    cfg.batch.group_size = 2;
    cfg.sampling.max_new_tokens = 8;
    let mut task = SearchTask::new(
        cfg,
        f.tok.clone(),
        PromptTemplates::plain(),
        RetrieverBackend(Arc::new(Broken)),
        f.world.examples(Split::Train),
        vec![],
        0,
    )
    .unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let r = task.rollout(&m, 0, &mut rng).unwrap();
    assert_eq!(r.rewards.len(), 2);
    // And directly: every pending search ends its episode with SearchFailed.
    let q = &f.world.train[0];
    let mut eps = vec![
        Episode::for_question(
            &PromptTemplate::search_r1(),
            &q.example.question,
            ProtocolConfig::default(),
        )
        .unwrap(),
    ];
    let mut policy = kiln_search::rollout::ScriptedPolicy::new(vec![vec!["<search> x </search>"]]);
    let st = run_episodes(
        &mut eps,
        &mut policy,
        &RetrieverBackend(Arc::new(Broken)),
        OnSearchError::EndEpisode,
    )
    .unwrap();
    assert_eq!(st.failed_searches, 1);
    assert!(matches!(
        eps[0].end_reason(),
        Some(kiln_search::protocol::EndReason::SearchFailed(_))
    ));
}

#[test]
fn warm_start_learns_and_saves_a_loadable_model() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("ws");
    let cfg = WarmStartConfig {
        vocab_size: 600,
        steps: 40,
        batch_size: 8,
        lr: 3e-3,
        rename_copies: 2,
        context_weight: 0.5,
        ..WarmStartConfig::default()
    };
    let mc = TransformerConfig {
        hidden_size: 48,
        intermediate_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(4),
        max_position_embeddings: 1024,
        tie_word_embeddings: true,
        ..TransformerConfig::default()
    };
    let device = Device::flex().autodiff();
    let mut steps = 0;
    let report = warm_start(
        &f.world,
        &cfg,
        &mc,
        &ProtocolConfig::default(),
        &f.search,
        &out,
        &device,
        0,
        |_, _| steps += 1,
    )
    .unwrap();
    assert_eq!(steps, 40);
    assert!(report.examples["agent"] > 50, "{:?}", report.examples);
    assert!(report.examples["refiner"] > 10);
    assert!(
        report.loss_last < report.loss_first - 1.0,
        "loss {} -> {}",
        report.loss_first,
        report.loss_last
    );
    let tok = Tokenizer::from_hf_dir(&out).unwrap();
    let m = kiln_lm::load_hf_dir(&out, &Device::flex()).unwrap();
    assert_eq!(m.config().vocab_size, tok.vocab_size());
    assert!(out.join("warm_start.json").is_file());
}

/// The cold start of a "pre-trained" model (here a random tiny one with the fixture's tokenizer): the
/// demonstrations use the given (wrapped) templates for every role, the refiner's demonstrations are still
/// built (their questions are found although the prompt no longer ends with the question: the old
/// tail-of-prompt lookup found none), LoRA SFT lowers the loss, and the saved folder holds the merged
/// weights (no adapters, changed from the base) and a report naming the base.
#[test]
fn cold_start_uses_the_given_templates_and_saves_merged_weights() {
    use kiln_search::warmstart::{build_examples, cold_start};
    let f = fixture();
    let wrapped =
        PromptTemplates::plain().map(|t| format!("<<user>>\n{t}<<end>>\n<<assistant>>\n"));
    let cfg = WarmStartConfig {
        steps: 30,
        batch_size: 4,
        lr: 1e-2,
        max_questions: 40,
        ..WarmStartConfig::default()
    };
    let mut rng = <rand_chacha::ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0);
    let (examples, _) = build_examples(
        &f.world,
        &cfg,
        &f.tok,
        &wrapped,
        &ProtocolConfig::default(),
        &f.search,
        &mut rng,
    )
    .unwrap();
    let count = |role: &str| examples.iter().filter(|e| e.role == role).count();
    assert!(
        count("agent") >= 30 && count("refiner") >= 10,
        "{}",
        count("refiner")
    );
    assert!(count("direct") >= 3 && count("rag") >= 3);
    for e in examples.iter().filter(|e| e.role != "refiner") {
        let text = f.tok.decode(&e.ids, false).unwrap();
        assert!(text.starts_with("<<user>>"), "{}: {text}", e.role);
        assert!(text.contains("<<assistant>>"), "{}: {text}", e.role);
    }
    let base = model_on(f.tok.vocab_size(), 1, &Device::flex().autodiff());
    let before = burn::module::Module::valid(&base);
    let lora = kiln_lm::LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cold");
    let report = cold_start(
        &f.world,
        &cfg,
        base,
        &f.tok,
        &wrapped,
        Some(&lora),
        "tiny-base",
        &ProtocolConfig::default(),
        &f.search,
        None,
        &out,
        0,
        |_, _| {},
    )
    .unwrap();
    assert_eq!(report.base.as_deref(), Some("tiny-base"));
    assert!(report.mean_tokens > 20.0, "{}", report.mean_tokens);
    assert!(
        report.loss_last < report.loss_first - 0.2,
        "loss {} -> {}",
        report.loss_first,
        report.loss_last
    );
    let saved = kiln_lm::load_hf_dir(&out, &Device::flex()).unwrap();
    assert!(!saved.has_lora());
    assert!(!out.join("tokenizer.json").exists());
    // The adapters were trained and merged: the saved logits differ from the base's.
    let x = burn::tensor::Tensor::<2, burn::tensor::Int>::from_data(
        burn::tensor::TensorData::new(vec![1i64, 5, 9, 13], [1, 4]),
        &Device::flex(),
    );
    let d = (saved.forward(x.clone()) - before.forward(x))
        .abs()
        .max()
        .into_scalar::<f32>();
    assert!(d > 1e-3, "merged weights equal the base: {d}");
}

#[test]
fn llm_judge_scores_fresh_searches_and_zeroes_duplicates() {
    use kiln_search::agent::LmJudge;
    use kiln_search::protocol::{Passage, SearchCall};
    use kiln_search::reward::{Gold, ProcessJudge};
    let f = fixture();
    let m = model(f.tok.vocab_size(), 21);
    let p = |id: &str| Passage {
        id: id.into(),
        title: "T".into(),
        text: "Some text.".into(),
        score: 1.0,
    };
    let a = SearchCall {
        query: "a".into(),
        passages: vec![p("1"), p("2")],
    };
    let dup = a.clone();
    let gold = Gold {
        answers: vec!["x".into()],
        supporting_passage_ids: vec![],
        supporting_titles: vec![],
    };
    let mut j = LmJudge {
        model: &m,
        tokenizer: &f.tok,
    };
    let u = j.judge("q?", &gold, &[&a, &dup]).unwrap();
    assert_eq!(u.len(), 2);
    assert!(u[0] == 0.0 || u[0] == 1.0);
    assert_eq!(u[1], 0.0, "a duplicate search is never useful");
    // The verdict is the model's: yes iff log p(" yes") > log p(" no") after the judge prompt.
    let prompt = kiln_search::agent::JUDGE_TEMPLATE
        .replacen("{question}", "q?", 1)
        .replacen("{answer}", "x", 1)
        .replacen(
            "{documents}",
            &kiln_search::protocol::format_documents(&a.passages),
            1,
        );
    let pi = f.tok.encode(&prompt, false).unwrap();
    let lp = |c: &str| {
        let row: Vec<u32> = [pi.clone(), f.tok.encode(c, false).unwrap()].concat();
        continuation_logprobs(&m, &[row], &[pi.len()])[0]
    };
    assert_eq!(u[0] == 1.0, lp(" yes") > lp(" no"));
}

/// A Search-R2 task over the fixture with G = 3, the refiner on and cutting every trajectory it
/// sees (margin -1e9), `joint` as given, `questions` per step, `max_turns` turns and `sampling`.
fn revising_task(
    f: &Fixture,
    sampling: SamplingConfig,
    questions: usize,
    max_turns: usize,
    joint: bool,
    seed: u64,
) -> SearchTask {
    search_task(f, sampling, questions, max_turns, Some(joint), seed)
}

/// [`revising_task`] with the refiner off when `refiner` is `None` (else `Some(joint)`).
fn search_task(
    f: &Fixture,
    sampling: SamplingConfig,
    questions: usize,
    max_turns: usize,
    refiner: Option<bool>,
    seed: u64,
) -> SearchTask {
    let mut cfg = SearchTaskConfig {
        questions_per_step: questions,
        sampling,
        ..SearchTaskConfig::default()
    };
    cfg.batch.group_size = 3;
    cfg.batch.protocol.max_turns = max_turns;
    cfg.batch.refiner.enabled = refiner.is_some();
    cfg.batch.refiner.joint = refiner.unwrap_or(false);
    cfg.batch.refiner.margin = -1e9;
    task_from(f, cfg, seed)
}

/// A Search-R2 task over the fixture's world, tokenizer and index with the settings `cfg`.
fn task_from(f: &Fixture, cfg: SearchTaskConfig, seed: u64) -> SearchTask {
    SearchTask::new(
        cfg,
        f.tok.clone(),
        PromptTemplates::plain(),
        f.search.clone(),
        f.world.examples(Split::Train),
        f.world.examples(Split::Dev),
        seed,
    )
    .unwrap()
}

/// The task-level guard of the policy ratio: batched, left-padded, multi-turn rollouts with
/// observations and refiner revisions (margin -1e9: every trajectory the refiner sees is cut and
/// regenerated), sampled at T = 1 and T = 0.7; the re-scored log-prob of every policy token
/// equals the one recorded while sampling within 1e-4 (kiln-rl's trainer fails a step past
/// `trainer.ratio_tolerance` on the same comparison).
#[test]
fn rescored_policy_tokens_match_sampling_at_the_sampling_temperature_with_revisions() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 11);
    for temperature in [1.0f32, 0.7] {
        let sampling = SamplingConfig {
            max_new_tokens: 20,
            temperature,
            ..Default::default()
        };
        let mut task = revising_task(f, sampling, 3, 3, true, 2);
        let mut rng = ChaCha8Rng::seed_from_u64(17);
        let r = task.rollout(&m, 0, &mut rng).unwrap();
        let n = r.rewards.len();
        let t = r.max_actions;
        assert!(
            r.metrics
                .get("refiner/intervention_volume")
                .copied()
                .unwrap_or(0.0)
                > 0.0,
            "no revision happened: {:?}",
            r.metrics
        );
        let sampled = r.sampled_logp.as_ref().expect("sampled log-probs recorded");
        let scored = task.score(&m, &r.data, &(0..n).collect::<Vec<_>>());
        let lp: Vec<f32> = scored.logp.into_data().try_into_vec_as::<f32>().unwrap();
        let ent: Vec<f32> = scored
            .entropy
            .expect("the search task reports the policy entropy")
            .into_data()
            .try_into_vec_as::<f32>()
            .unwrap();
        let max_ent = (f.tok.vocab_size() as f32).ln() + 1e-3;
        for (k, e) in ent.iter().enumerate() {
            if r.action_mask[k] > 0.0 {
                assert!((-1e-4..=max_ent).contains(e), "entropy {e} at {k}");
            }
        }
        let (mut checked, mut worst) = (0usize, 0f32);
        for k in 0..n * t {
            if r.action_mask[k] > 0.0 && sampled[k].is_finite() {
                worst = worst.max((lp[k] - sampled[k]).abs());
                checked += 1;
            }
        }
        assert!(checked > 50, "only {checked} policy tokens compared");
        assert!(
            worst < 1e-4,
            "T={temperature}: max |rescored - sampled| = {worst}"
        );
    }
}

/// The refiner columns of the action axis: with `joint: true` every trajectory the refiner decided
/// on carries its decision tokens (`" 0"` / `" j"`) after the actor part, under mask 1 (and mask 0
/// past them); with `joint: false` there is no refiner part at all.
#[test]
fn refiner_decision_tokens_are_in_the_loss_only_with_joint_optimisation() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 13);
    for joint in [true, false] {
        let sampling = SamplingConfig {
            max_new_tokens: 16,
            ..Default::default()
        };
        let mut task = revising_task(f, sampling, 2, 2, joint, 4);
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        let r = task.rollout(&m, 0, &mut rng).unwrap();
        let (ta, td) = r.data.widths();
        assert_eq!(r.max_actions, ta + td);
        let t = r.max_actions;
        if !joint {
            assert_eq!(td, 0, "joint: false must leave the refiner out of the loss");
            assert!((0..r.data.len()).all(|i| r.data.refiner_row(i).is_none()));
            continue;
        }
        assert!(td > 0);
        let mut decided = 0;
        for i in 0..r.data.len() {
            let mask = &r.action_mask[i * t + ta..(i + 1) * t];
            match r.data.refiner_row(i) {
                Some((row, s)) => {
                    decided += 1;
                    let text = f.tok.decode(&row[s..], false).unwrap();
                    let j: usize = text
                        .strip_prefix(' ')
                        .and_then(|x| x.parse().ok())
                        .unwrap_or_else(|| panic!("decision {text:?} is not \" j\""));
                    assert!(j <= 2, "cut step {j} past max_turns");
                    let k = row.len() - s;
                    assert!(mask[..k].iter().all(|x| *x == 1.0), "{mask:?}");
                    assert!(mask[k..].iter().all(|x| *x == 0.0), "{mask:?}");
                    let prompt = f.tok.decode(&row[..s], false).unwrap();
                    assert!(prompt.contains("ASSISTANT_STEP_1"), "{prompt}");
                }
                None => assert!(mask.iter().all(|x| *x == 0.0)),
            }
        }
        assert!(decided > 0, "the refiner decided on no trajectory");
    }
}

/// A revised row is the kept prefix, id for id as first sampled, followed by the regenerated
/// steps. The refiner's first pass sees the same trajectories as a run without the refiner (same
/// seed: the actor's sampler is seeded before the refiner runs), so the refiner-off rollout is the
/// original of every revised trajectory: the revised row must equal it up to the end of step
/// `j - 1` (`j` = the refiner's cut, read from its decision tokens) and continue with freshly
/// sampled tokens (each with the log-prob recorded by the sampler) whose step `j` differs from the
/// original's.
#[test]
fn a_revised_row_is_the_kept_prefix_ids_then_the_regenerated_suffix_ids() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 19);
    let sampling = SamplingConfig {
        max_new_tokens: 20,
        ..Default::default()
    };
    let (mut checked, mut differ, mut cut_late) = (0, 0, 0);
    // Rollouts until a cut after step 1 was seen (a random policy often ends after one step).
    for seed in 29..45u64 {
        if cut_late > 0 && checked >= 6 {
            break;
        }
        let mut revised = search_task(f, sampling.clone(), 3, 3, Some(true), seed);
        let mut original = search_task(f, sampling.clone(), 3, 3, None, seed);
        let ra = revised
            .rollout(&m, 0, &mut ChaCha8Rng::seed_from_u64(seed))
            .unwrap();
        let rb = original
            .rollout(&m, 0, &mut ChaCha8Rng::seed_from_u64(seed))
            .unwrap();
        check_revised_rows(f, &ra, &rb, &mut checked, &mut differ, &mut cut_late);
    }
    assert!(checked >= 6, "only {checked} revised trajectories");
    assert_eq!(
        differ, checked,
        "a cut step came back unchanged: it was kept, not regenerated"
    );
    assert!(
        cut_late > 0,
        "no cut after step 1: the kept prefix was never more than the prompt"
    );
}

/// The checks of [`a_revised_row_is_the_kept_prefix_ids_then_the_regenerated_suffix_ids`] on one
/// pair of rollouts (`ra` with the refiner, `rb` the same seed without), counting what was checked.
fn check_revised_rows(
    f: &Fixture,
    ra: &kiln_rl::Rollout<kiln_search::grpo::SearchData>,
    rb: &kiln_rl::Rollout<kiln_search::grpo::SearchData>,
    checked: &mut usize,
    differ: &mut usize,
    cut_late: &mut usize,
) {
    assert_eq!(ra.data.len(), rb.data.len());
    assert!((0..rb.data.len()).all(|i| rb.data.regenerated_from(i).is_none()));
    let sampled = ra.sampled_logp.as_ref().expect("sampled log-probs");
    let t = ra.max_actions;
    for i in 0..ra.data.len() {
        let (row_a, start_a) = ra.data.actor_row(i);
        let (row_b, start_b) = rb.data.actor_row(i);
        assert_eq!(start_a, start_b, "same prompt");
        let Some(k) = ra.data.regenerated_from(i) else {
            // Only an empty trajectory escapes a refiner that cuts everything.
            assert!(
                rb.data.step_ends(i).is_empty(),
                "trajectory {i} was not revised"
            );
            continue;
        };
        let (row, s) = ra
            .data
            .refiner_row(i)
            .expect("joint: the decision is in the row");
        let j: usize = f
            .tok
            .decode(&row[s..], false)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(j >= 1);
        let ends_b = rb.data.step_ends(i);
        let want = if j == 1 { start_b } else { ends_b[j - 2] };
        assert_eq!(
            k, want,
            "trajectory {i}: cut {j}, original step ends {ends_b:?}"
        );
        assert_eq!(
            &row_a[..k],
            &row_b[..k],
            "trajectory {i}: kept prefix ids differ"
        );
        // The revised row's own step boundaries agree on the kept steps.
        assert_eq!(&ra.data.step_ends(i)[..j - 1], &ends_b[..j - 1]);
        // The suffix is the regenerated steps: every policy token of it was sampled.
        let mut policy = 0;
        for p in k..row_a.len() {
            let a = i * t + (p - start_a);
            if ra.action_mask[a] > 0.0 {
                assert!(
                    sampled[a].is_finite(),
                    "trajectory {i}: unsampled id at {p}"
                );
                policy += 1;
            }
        }
        assert!(policy > 0, "trajectory {i}: nothing regenerated");
        // Step j itself was regenerated, not kept: its ids differ from the original step j (a
        // kept step would be identical; 20 tokens sampled at T = 1 do not repeat by chance).
        let step_a = &row_a[k..ra.data.step_ends(i)[j - 1]];
        let step_b = &row_b[k..ends_b[j - 1]];
        *differ += usize::from(step_a != step_b);
        *cut_late += usize::from(j > 1);
        *checked += 1;
    }
}

/// Dynamic sampling at the task level: a random policy never answers right, so every group is
/// uniform; the task draws `max_draw_factor x questions_per_step` questions in rounds, logs the
/// draw, and (nothing informative) trains on the last round whole. With it off: one round, no
/// `dynamic/` metrics.
#[test]
fn dynamic_sampling_draws_up_to_its_budget_and_logs_the_draw() {
    let f = fixture();
    let m = model(f.tok.vocab_size(), 31);
    let mut cfg = SearchTaskConfig {
        questions_per_step: 2,
        sampling: SamplingConfig {
            max_new_tokens: 12,
            ..Default::default()
        },
        ..SearchTaskConfig::default()
    };
    cfg.batch.group_size = 3;
    cfg.batch.protocol.max_turns = 2;
    cfg.batch.refiner.enabled = false;
    let mut off = task_from(f, cfg.clone(), 5);
    let r = off
        .rollout(&m, 0, &mut ChaCha8Rng::seed_from_u64(3))
        .unwrap();
    assert_eq!(r.rewards.len(), 6);
    assert!(!r.metrics.keys().any(|k| k.starts_with("dynamic/")));
    // Every turn's prefill re-reads its transcript: at least the 6 prompts' tokens.
    assert!(
        r.metrics["rollout/prefill_tokens"] > 6.0 * 10.0,
        "{:?}",
        r.metrics
    );

    cfg.dynamic_sampling.enabled = true;
    cfg.dynamic_sampling.max_draw_factor = 2;
    let mut on = task_from(f, cfg.clone(), 5);
    let r = on
        .rollout(&m, 0, &mut ChaCha8Rng::seed_from_u64(3))
        .unwrap();
    assert!(
        r.rewards.iter().all(|x| *x == 0.0),
        "a random policy answered"
    );
    assert_eq!(r.metrics["dynamic/drawn_questions"], 4.0);
    assert_eq!(r.metrics["dynamic/rounds"], 2.0);
    assert_eq!(r.metrics["dynamic/kept_groups"], 2.0);
    assert_eq!(r.metrics["dynamic/dropped_groups"], 2.0);
    assert_eq!(r.rewards.len(), 6, "the last round, kept whole");
    assert_eq!(r.data.len(), 6);
    assert_eq!(
        r.sampled_logp.as_ref().map(Vec::len),
        Some(6 * r.max_actions)
    );
    // The sampler moved past every drawn question: the next step starts at question 5.
    assert_eq!(on.state()["cursor"], 4);

    cfg.dynamic_sampling.max_draw_factor = 0;
    let e = SearchTask::new(
        cfg,
        f.tok.clone(),
        PromptTemplates::plain(),
        f.search.clone(),
        f.world.examples(Split::Train),
        f.world.examples(Split::Dev),
        5,
    );
    assert!(e.err().unwrap().to_string().contains("max_draw_factor"));
}

/// The supervised loss projects only the trained positions (`sft_losses` without a context term); the
/// context-term path projects every position: their policy terms must agree, also when a row's trained
/// tokens are split by untrained ones (an observation between two turns) and rows differ in length.
#[test]
fn sft_loss_at_trained_positions_equals_the_full_projection() {
    use kiln_search::warmstart::{SftExample, sft_losses};
    let m = model(97, 11);
    let a = SftExample {
        ids: (1..=20).collect(),
        mask: (0..20)
            .map(|i| {
                if (4..8).contains(&i) || (14..18).contains(&i) {
                    1.0
                } else {
                    0.0
                }
            })
            .collect(),
        role: "agent",
    };
    let b = SftExample {
        ids: (30..42).collect(),
        mask: (0..12).map(|i| if i >= 9 { 1.0 } else { 0.0 }).collect(),
        role: "rag",
    };
    let batch = [&a, &b];
    let at_trained: f32 = sft_losses(&m, &batch, 0.0).1.into_scalar();
    let full: f32 = sft_losses(&m, &batch, 0.5).1.into_scalar();
    assert!(at_trained.is_finite() && at_trained > 0.0, "{at_trained}");
    assert!((at_trained - full).abs() < 1e-5, "{at_trained} vs {full}");
}
