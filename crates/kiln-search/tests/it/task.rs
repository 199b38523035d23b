//! Rollout batches with the refiner (scripted policy and scorer), Search-R1 batches, and evaluation modes.

use kiln_search::Error;
use kiln_search::data::QaExample;
use kiln_search::eval::EvalMode;
use kiln_search::protocol::{Generated, Passage, PromptTemplate, PromptTemplates, ProtocolConfig};
use kiln_search::refiner::RefinerConfig;
use kiln_search::reward::{DeterministicJudge, RewardConfig};
use kiln_search::rollout::{FnPolicy, TurnRequest};
use kiln_search::task::{BatchConfig, RefinerRequest, RefinerScorer, evaluate, rollout_batch};
use rand::SeedableRng;

fn search(qs: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
    Ok(qs
        .iter()
        .map(|q| {
            let mut v = vec![Passage {
                id: format!("doc-{q}"),
                title: q.clone(),
                text: format!("The answer about {q} is X{}.", q.len()),
                score: 1.0,
            }];
            v.truncate(k);
            v
        })
        .collect())
}

fn ex(i: usize) -> QaExample {
    let q = format!("question number {i}");
    QaExample {
        id: i.to_string(),
        golden_answers: vec![format!("X{}", q.len())],
        question: q,
        data_source: "toy".into(),
        supporting_passage_ids: vec![],
        supporting_titles: vec![],
        kind: None,
    }
}

/// First attempt: search, then a wrong answer. After a revision: answer from the passage read.
fn policy() -> FnPolicy<impl FnMut(&TurnRequest<'_>) -> Generated> {
    FnPolicy(|r: &TurnRequest<'_>| {
        let ep = r.episode;
        let q = ep
            .trajectory
            .prompt
            .rsplit("Question: ")
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        let text = match (ep.revisions, ep.trajectory.steps.len()) {
            (_, 0) => format!("<think>look up</think><search>{q}</search>"),
            (0, _) => "<answer>wrong</answer>".to_string(),
            (_, _) => format!("<answer>X{}</answer>", q.len()),
        };
        Generated::text(text)
    })
}

/// Revises (cut at the last step) iff the trajectory answered "wrong".
struct Scorer {
    calls: usize,
}
impl RefinerScorer for Scorer {
    fn score(&mut self, reqs: &[RefinerRequest<'_>]) -> Result<Vec<Vec<f64>>, Error> {
        self.calls += 1;
        Ok(reqs
            .iter()
            .map(|r| {
                let t = r.candidates.len() - 1;
                let mut v = vec![f64::NEG_INFINITY; t + 1];
                if r.prompt.contains("<answer>wrong</answer>") {
                    v[0] = -5.0;
                    v[t] = -0.01;
                } else {
                    v[0] = 0.0;
                }
                v
            })
            .collect())
    }
}

#[test]
fn search_r2_batch_revises_and_logs() {
    let qs: Vec<QaExample> = (0..3).map(ex).collect();
    let cfg = BatchConfig {
        group_size: 2,
        ..Default::default()
    };
    let mut scorer = Scorer { calls: 0 };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let out = rollout_batch(
        &qs,
        &PromptTemplate::default(),
        &cfg,
        &mut policy(),
        &search,
        Some(&mut scorer),
        &mut DeterministicJudge::default(),
        &mut rng,
    )
    .unwrap();
    assert_eq!(out.items.len(), 6);
    assert_eq!(scorer.calls, 1, "max_revisions = 1: one scoring pass");
    for (i, it) in out.items.iter().enumerate() {
        assert_eq!(it.question, i / 2, "group order");
        assert_eq!(it.episode.revisions, 1);
        assert_eq!(it.reward_before_revision, Some(0.0));
        assert_eq!(it.reward.em, 1.0);
        assert_eq!(it.reward.r_process, 1.0, "the kept search found the answer");
        assert_eq!(it.reward.total, 2.0);
        assert_eq!(it.refiner.len(), 1);
        assert_eq!(it.refiner[0].cut, Some(2));
        assert_eq!(it.refiner[0].decision_text().as_deref(), Some(" 2"));
        // Step 1 (the search and its observation) was kept, step 2 regenerated.
        assert_eq!(it.episode.trajectory.steps.len(), 2);
    }
    let m = out.metrics();
    assert_eq!(m["refiner/intervention_volume"], 1.0);
    assert_eq!(m["refiner/trimming_gain"], 2.0);
    assert_eq!(m["refiner/cut_step_2"], 1.0);
    assert_eq!(m["reward/em"], 1.0);
    assert_eq!(
        m["rollout/search_calls"], 1.0,
        "one batched search for 6 episodes"
    );
    assert_eq!(m["rollout/queries"], 6.0);
    assert_eq!(out.totals(), vec![2.0; 6]);
}

#[test]
fn search_r1_batch_needs_no_scorer() {
    let qs: Vec<QaExample> = (0..2).map(ex).collect();
    let cfg = BatchConfig {
        group_size: 3,
        refiner: RefinerConfig {
            enabled: false,
            ..Default::default()
        },
        reward: RewardConfig { process: false },
        ..Default::default()
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let out = rollout_batch(
        &qs,
        &PromptTemplate::default(),
        &cfg,
        &mut policy(),
        &search,
        None,
        &mut DeterministicJudge::default(),
        &mut rng,
    )
    .unwrap();
    assert_eq!(out.totals(), vec![0.0; 6]);
    assert!(
        out.items
            .iter()
            .all(|i| i.refiner.is_empty() && i.episode.revisions == 0)
    );
    assert!(!out.metrics().contains_key("refiner/intervention_volume"));
    // Refiner on without a scorer is a configuration error.
    let on = BatchConfig::default();
    let e = rollout_batch(
        &qs,
        &PromptTemplate::default(),
        &on,
        &mut policy(),
        &search,
        None,
        &mut DeterministicJudge::default(),
        &mut rng,
    );
    assert!(e.is_err());
}

#[test]
fn evaluation_modes() {
    let qs: Vec<QaExample> = (0..4).map(ex).collect();
    let cfg = ProtocolConfig::default();
    // The policy answers from the documents it sees in its context, or "none".
    let mut reader = FnPolicy(|r: &TurnRequest<'_>| {
        let ctx = r.episode.context_text();
        if let Some(i) = ctx.find("is X") {
            let ans: String = ctx[i + 3..]
                .chars()
                .take_while(|c| c.is_alphanumeric())
                .collect();
            Generated::text(format!("<answer>{ans}</answer>"))
        } else if r.search_enabled {
            let q = ctx
                .rsplit("Question: ")
                .next()
                .unwrap_or("")
                .trim()
                .to_string();
            Generated::text(format!("<search>{q}</search>"))
        } else {
            Generated::text("<answer>none</answer>")
        }
    });
    let (direct, _) = evaluate(
        "toy",
        &qs,
        EvalMode::Direct,
        &cfg,
        &PromptTemplates::plain(),
        &mut reader,
        &search,
    )
    .unwrap();
    assert!(
        direct
            .iter()
            .all(|r| r.em == 0.0 && r.searches == 0 && !r.answer_in_passages)
    );
    let (rag, st) = evaluate(
        "toy",
        &qs,
        EvalMode::Rag,
        &cfg,
        &PromptTemplates::plain(),
        &mut reader,
        &search,
    )
    .unwrap();
    assert!(
        rag.iter()
            .all(|r| r.em == 1.0 && r.searches == 0 && r.answer_in_passages)
    );
    assert_eq!(st.search_calls, 1);
    let (agent, st) = evaluate(
        "toy",
        &qs,
        EvalMode::Agent,
        &cfg,
        &PromptTemplates::plain(),
        &mut reader,
        &search,
    )
    .unwrap();
    assert!(
        agent
            .iter()
            .all(|r| r.em == 1.0 && r.searches == 1 && r.answer_in_passages)
    );
    assert_eq!(st.search_calls, 1);
    assert!(
        agent
            .iter()
            .all(|r| r.mode == "agent" && r.dataset == "toy")
    );
}

/// Dynamic sampling's batch: two rollout rounds joined by `merge_rounds` with the keep flags of
/// kiln-rl's `DynamicDraw` (uniform groups dropped), question indices renumbered over the kept
/// groups, counters of every round summed, reward means over the kept trajectories.
#[test]
fn dynamic_sampling_rounds_merge_into_the_informative_groups() {
    use kiln_rl::dynamic::{DynamicDraw, DynamicSamplingConfig};
    use kiln_search::task::merge_rounds;
    // One search, then the right answer on even batch positions, a wrong one on odd positions,
    // except question 1, which every trajectory answers right (a uniform group).
    let mut pol = FnPolicy(|r: &TurnRequest<'_>| {
        let q = r
            .episode
            .trajectory
            .prompt
            .rsplit("Question: ")
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        if r.episode.trajectory.steps.is_empty() {
            return Generated::text(format!("<search>{q}</search>"));
        }
        if r.index.is_multiple_of(2) || q.ends_with(" 1") {
            Generated::text(format!("<answer>X{}</answer>", q.len()))
        } else {
            Generated::text("<answer>wrong</answer>")
        }
    });
    let cfg = BatchConfig {
        group_size: 2,
        refiner: RefinerConfig {
            enabled: false,
            ..Default::default()
        },
        reward: RewardConfig { process: false },
        ..Default::default()
    };
    let qs: Vec<QaExample> = (0..5).map(ex).collect();
    let dyn_cfg = DynamicSamplingConfig {
        enabled: true,
        max_draw_factor: 3,
    };
    let mut draw = DynamicDraw::new(&dyn_cfg, 3, 2);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let (mut outputs, mut next) = (Vec::new(), 0);
    while let Some(n) = draw.next_round() {
        let out = rollout_batch(
            &qs[next..next + n],
            &PromptTemplate::default(),
            &cfg,
            &mut pol,
            &search,
            None,
            &mut DeterministicJudge::default(),
            &mut rng,
        )
        .unwrap();
        next += n;
        draw.record(&out.totals());
        outputs.push(out);
    }
    // Round 1: questions 0, 1, 2 (1 is uniform) -> 2 kept; round 2: question 3 -> 3 kept.
    assert_eq!(next, 4, "one more question was drawn for the uniform group");
    let keep = draw.finish();
    assert_eq!(keep, vec![vec![true, false, true], vec![true]]);
    let queries: f64 = outputs.iter().map(|o| o.metrics()["rollout/queries"]).sum();
    let merged = merge_rounds(outputs.into_iter().zip(keep).collect(), 2);
    assert_eq!(merged.items.len(), 6);
    let questions: Vec<usize> = merged.items.iter().map(|i| i.question).collect();
    assert_eq!(questions, vec![0, 0, 1, 1, 2, 2]);
    let prompts: Vec<bool> = merged
        .items
        .iter()
        .map(|i| i.episode.trajectory.prompt.contains("question number 1"))
        .collect();
    assert!(!prompts.contains(&true), "the uniform group was dropped");
    assert_eq!(merged.totals(), vec![1.0, 0.0, 1.0, 0.0, 1.0, 0.0]);
    let m = merged.metrics();
    assert_eq!(
        m["rollout/queries"], queries,
        "every round's searches are counted"
    );
    assert_eq!(m["rollout/queries"], 8.0);
    assert_eq!(m["reward/em"], 0.5, "reward means of the kept trajectories");
    let dm = draw.metrics();
    assert_eq!(dm["dynamic/drawn_questions"], 4.0);
    assert_eq!(dm["dynamic/dropped_groups"], 1.0);
    assert_eq!(dm["dynamic/drawn_reward_mean"], 5.0 / 8.0);
}
