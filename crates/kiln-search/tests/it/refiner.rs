//! Meta-refiner: prompt layout, byte-for-byte cut, regeneration, max_revisions.

use kiln_search::Error;
use kiln_search::protocol::{Episode, Passage, PromptTemplate, ProtocolConfig};
use kiln_search::refiner::{Refined, RefinerConfig, build_refiner_prompt, refine};
use kiln_search::rollout::{OnSearchError, ScriptedPolicy, run_episodes};
use rand::SeedableRng;

fn search(qs: &[String], _k: usize) -> Result<Vec<Vec<Passage>>, Error> {
    Ok(qs
        .iter()
        .map(|q| {
            vec![Passage {
                id: format!("id-{q}"),
                title: q.clone(),
                text: format!("About {q}: ünïcödé \u{1F600} text.\r\n  tail "),
                score: 1.0,
            }]
        })
        .collect())
}

fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

fn finished_episode() -> Episode {
    let mut eps = vec![
        Episode::for_question(
            &PromptTemplate::default(),
            "Where?",
            ProtocolConfig::default(),
        )
        .unwrap(),
    ];
    let mut policy = ScriptedPolicy::new(vec![vec![
        "<think>first</think><search>alpha</search>",
        "garbled",
        "<think>x</think><search>beta</search>",
        "<answer>wrong</answer>",
    ]])
    .with_tokenizer(bytes);
    run_episodes(&mut eps, &mut policy, &search, OnSearchError::Fail).unwrap();
    eps[0].trajectory.tokenize_observations(bytes);
    eps.pop().unwrap()
}

#[test]
fn refiner_prompt_layout() {
    let ep = finished_episode();
    let p = build_refiner_prompt("Where?", &ep.trajectory);
    let tail = p.split("Question: Where?\n\n").nth(1).unwrap();
    let lines: Vec<&str> = tail.lines().collect();
    assert!(lines[0].starts_with("ASSISTANT_STEP_1: <think>first</think><search>alpha</search>"));
    assert!(lines[1].starts_with("TOOL: <information>Doc 1(Title: alpha) About alpha"));
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("ASSISTANT_STEP_2: garbled"))
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("TOOL: My previous action is invalid."))
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("ASSISTANT_STEP_4: <answer>wrong</answer>"))
    );
    assert_eq!(
        *lines.last().unwrap(),
        "Problematic step index (0 = no issue):"
    );
    assert_eq!(p.matches("ASSISTANT_STEP_").count(), 4);
    assert_eq!(p.matches("TOOL: ").count(), 3);
}

#[test]
fn cut_keeps_prefix_byte_for_byte_and_regenerates() {
    let ep = finished_episode();
    let cfg = RefinerConfig::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    // All cut mass on step 3.
    let ninf = f64::NEG_INFINITY;
    let logps = [-5.0, ninf, ninf, -0.1, ninf];
    let Refined::Revise(rec, cut) = refine("Where?", &ep, &logps, &cfg, &mut rng).unwrap() else {
        panic!("expected a revision");
    };
    assert_eq!(rec.cut, Some(3));
    assert_eq!(cut.revisions, 1);
    assert_eq!(cut.trajectory.steps.len(), 2);
    // Byte for byte: segments (text, ids, logprobs) and the response prefix.
    assert_eq!(cut.trajectory.steps[..], ep.trajectory.steps[..2]);
    let kept: String = ep.trajectory.steps[..2]
        .iter()
        .map(|s| {
            format!(
                "{}{}",
                s.policy.text,
                s.observation.as_ref().map_or("", |o| o.text.as_str())
            )
        })
        .collect();
    assert_eq!(cut.trajectory.response_text(), kept);
    assert!(
        ep.trajectory
            .response_text()
            .as_bytes()
            .starts_with(kept.as_bytes())
    );
    assert_eq!(cut.trajectory.prompt, ep.trajectory.prompt);
    let (ids_cut, _) = cut.trajectory.ids_and_loss_mask().unwrap();
    let (ids_full, _) = ep.trajectory.ids_and_loss_mask().unwrap();
    assert!(ids_full.starts_with(&ids_cut));

    // The actor regenerates from step 3.
    let mut eps = vec![*cut];
    let mut policy = ScriptedPolicy::new(vec![vec![
        "<search>gamma</search>",
        "<answer>right</answer>",
    ]]);
    run_episodes(&mut eps, &mut policy, &search, OnSearchError::Fail).unwrap();
    assert_eq!(policy.log, [(0, 3, true), (0, 4, false)]);
    assert_eq!(eps[0].trajectory.steps.len(), 4);
    assert_eq!(eps[0].trajectory.final_answer(), Some("right"));
    assert!(eps[0].trajectory.response_text().starts_with(&kept));

    // max_revisions = 1: a revised episode is accepted whatever the scores.
    let again = refine("Where?", &eps[0], &[-9.0, 0.0, 0.0, 0.0], &cfg, &mut rng).unwrap();
    assert!(matches!(again, Refined::Accept(r) if r.decision.is_none()));
}

#[test]
fn cut_at_step_one_keeps_nothing_and_accept_keeps_everything() {
    let ep = finished_episode();
    let cut = ep.cut_before_step(1).unwrap();
    assert!(cut.trajectory.steps.is_empty());
    assert!(ep.cut_before_step(0).is_err());
    assert!(ep.cut_before_step(5).is_err());
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let r = refine(
        "Where?",
        &ep,
        &[0.0, -9.0, -9.0, -9.0, -9.0],
        &RefinerConfig::default(),
        &mut rng,
    )
    .unwrap();
    assert!(matches!(r, Refined::Accept(rec) if !rec.decision.unwrap().revise));
    // Wrong number of scores is an error, not a panic.
    assert!(
        refine(
            "Where?",
            &ep,
            &[0.0, 0.0],
            &RefinerConfig::default(),
            &mut rng
        )
        .is_err()
    );
}
