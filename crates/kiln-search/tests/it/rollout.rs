//! The multi-turn loop on scripted model outputs with a fake retriever.

use std::cell::RefCell;
use std::rc::Rc;

use kiln_search::Error;
use kiln_search::protocol::{
    EndReason, Episode, INVALID_ACTION_OBSERVATION, Passage, PromptTemplate, ProtocolConfig,
    SegmentKind, Trajectory, loss_mask,
};
use kiln_search::rollout::{OnSearchError, ScriptedPolicy, run_episodes};
use proptest::strategy::Strategy as _;

/// A tiny keyword retriever: passages whose title words all occur in the query, best (longest title) first.
fn corpus() -> Vec<Passage> {
    [
        ("d1", "Acme", "Acme was founded by Tom Brant."),
        ("d2", "Tom Brant", "Tom Brant was born in Velno."),
        ("d3", "Velno", "Velno is a city in Ostavia."),
    ]
    .into_iter()
    .map(|(id, t, x)| Passage {
        id: id.into(),
        title: t.into(),
        text: x.into(),
        score: 1.0,
    })
    .collect()
}

fn fake_search(queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
    let c = corpus();
    Ok(queries
        .iter()
        .map(|q| {
            let q = q.to_lowercase();
            c.iter()
                .filter(|p| {
                    p.title
                        .to_lowercase()
                        .split(' ')
                        .all(|w| q.split_whitespace().any(|x| x == w))
                })
                .take(k)
                .cloned()
                .collect()
        })
        .collect())
}

fn episodes(n: usize) -> Vec<Episode> {
    (0..n)
        .map(|i| {
            Episode::for_question(
                &PromptTemplate::default(),
                &format!("question {i}"),
                ProtocolConfig::default(),
            )
            .unwrap()
        })
        .collect()
}

#[test]
fn multi_search_then_answer() {
    let mut eps = episodes(1);
    let mut policy = ScriptedPolicy::new(vec![vec![
        "<think>who founded Acme</think><search> Acme </search>",
        "<think>Tom Brant</think><search>Tom Brant</search>",
        "<think>Velno</think><answer> Velno </answer>",
    ]]);
    let stats = run_episodes(&mut eps, &mut policy, &fake_search, OnSearchError::Fail).unwrap();
    let ep = &eps[0];
    assert_eq!(ep.end_reason(), Some(&EndReason::Answered));
    assert_eq!(ep.trajectory.steps.len(), 3);
    assert_eq!(ep.trajectory.final_answer(), Some("Velno"));
    let qs: Vec<&str> = ep
        .trajectory
        .searches()
        .iter()
        .map(|s| s.query.as_str())
        .collect();
    assert_eq!(qs, ["Acme", "Tom Brant"]);
    assert_eq!(
        ep.trajectory.steps[1].search.as_ref().unwrap().passages[0].id,
        "d2"
    );
    assert!(ep.trajectory.response_text().contains(
        "<search>Tom Brant</search>\n\n<information>Doc 1(Title: Tom Brant) Tom Brant was born in Velno.</information>\n\n<think>Velno</think>"
    ));
    assert_eq!(stats.search_calls, 2);
    assert_eq!(stats.turns, 3);
    assert_eq!(
        kiln_search::answer::extract_answer(&ep.trajectory.response_text()),
        Some("Velno")
    );
}

#[test]
fn untrusted_outputs_never_panic() {
    let big = format!("<search>{}</search>", "x".repeat(10_240));
    let scripts: Vec<Vec<String>> = vec![
        // malformed tags, then an answer without think
        vec![
            "<serch>Acme</serch>".into(),
            "<answer>Velno</answer>".into(),
        ],
        // text after </answer>
        vec!["<answer>Velno</answer> and then <search>Acme</search> more".into()],
        // empty query
        vec!["<search></search>".into(), "<answer>x</answer>".into()],
        // 10 kB query
        vec![big, "<answer>y</answer>".into()],
        // <search> inside <answer>
        vec![
            "<answer>maybe <search>Acme</search> Velno</answer>".into(),
            "<answer>z</answer>".into(),
        ],
        // nothing ever: runs out of turns
        vec![
            "".into(),
            "\u{0}\u{ffff}".into(),
            "</answer".into(),
            "still nothing".into(),
        ],
        // nested answer tags
        vec!["<answer><answer>a</answer></answer>".into()],
    ];
    let n = scripts.len();
    let mut eps = episodes(n);
    let seen: Rc<RefCell<Vec<String>>> = Rc::default();
    let seen2 = seen.clone();
    let search = move |qs: &[String], k: usize| {
        seen2.borrow_mut().extend(qs.iter().cloned());
        fake_search(qs, k)
    };
    let mut policy = ScriptedPolicy::new(scripts);
    run_episodes(&mut eps, &mut policy, &search, OnSearchError::Fail).unwrap();

    // malformed -> invalid observation, then answered
    assert_eq!(eps[0].end_reason(), Some(&EndReason::Answered));
    assert_eq!(
        eps[0].trajectory.steps[0]
            .observation
            .as_ref()
            .unwrap()
            .text,
        INVALID_ACTION_OBSERVATION
    );
    // text after </answer> is cut and never searched
    assert_eq!(eps[1].trajectory.response_text(), "<answer>Velno</answer>");
    assert_eq!(eps[1].trajectory.steps.len(), 1);
    // empty query is an invalid action, not a search
    assert!(eps[2].trajectory.steps[0].search.is_none());
    assert_eq!(
        eps[2].trajectory.steps[0]
            .observation
            .as_ref()
            .unwrap()
            .text,
        INVALID_ACTION_OBSERVATION
    );
    // 10 kB query searched, bounded
    let q = &eps[3].trajectory.steps[0].search.as_ref().unwrap().query;
    assert_eq!(q.len(), 512);
    // <search> inside <answer>: the search closes first and runs
    assert_eq!(
        eps[4].trajectory.steps[0].search.as_ref().unwrap().query,
        "Acme"
    );
    assert_eq!(eps[4].trajectory.final_answer(), Some("z"));
    // never a valid action: 4 turns, the last without observation
    assert_eq!(eps[5].end_reason(), Some(&EndReason::NoAnswer));
    assert_eq!(eps[5].trajectory.steps.len(), 4);
    assert!(eps[5].trajectory.steps[3].observation.is_none());
    // nested answer tags
    assert_eq!(
        kiln_search::answer::extract_answer(&eps[6].trajectory.response_text()),
        Some("<answer>a")
    );
    // The retriever only ever saw non-empty, bounded queries.
    assert!(
        seen.borrow()
            .iter()
            .all(|q| !q.is_empty() && q.len() <= 512)
    );
}

#[test]
fn finished_episodes_stop_and_searches_are_batched() {
    let mut eps = episodes(3);
    let mut policy = ScriptedPolicy::new(vec![
        vec!["<answer>a</answer>"],
        vec!["<search>Acme</search>", "<answer>b</answer>"],
        vec![
            "<search>Velno</search>",
            "<search>Tom Brant</search>",
            "<answer>c</answer>",
        ],
    ]);
    let calls: Rc<RefCell<Vec<usize>>> = Rc::default();
    let c2 = calls.clone();
    let search = move |qs: &[String], k: usize| {
        c2.borrow_mut().push(qs.len());
        fake_search(qs, k)
    };
    let stats = run_episodes(&mut eps, &mut policy, &search, OnSearchError::Fail).unwrap();
    assert_eq!(*calls.borrow(), vec![2, 1]);
    assert_eq!(stats.rounds, 3);
    assert_eq!(stats.queries, 3);
    // episode 0 is asked once, episode 1 twice, episode 2 three times
    let count = |i| policy.log.iter().filter(|(e, _, _)| *e == i).count();
    assert_eq!((count(0), count(1), count(2)), (1, 2, 3));
    assert!(
        eps.iter()
            .all(|e| e.end_reason() == Some(&EndReason::Answered))
    );
}

#[test]
fn last_turn_is_search_disabled() {
    let mut eps = episodes(1);
    let mut policy = ScriptedPolicy::new(vec![vec!["<search>Acme</search>"; 6]]);
    let calls = RefCell::new(0usize);
    let search = |qs: &[String], k: usize| {
        *calls.borrow_mut() += 1;
        fake_search(qs, k)
    };
    run_episodes(&mut eps, &mut policy, &search, OnSearchError::Fail).unwrap();
    assert_eq!(eps[0].end_reason(), Some(&EndReason::SearchOnLastTurn));
    assert_eq!(eps[0].trajectory.steps.len(), 4);
    assert_eq!(*calls.borrow(), 3);
    let enabled: Vec<bool> = policy.log.iter().map(|l| l.2).collect();
    assert_eq!(enabled, [true, true, true, false]);
}

#[test]
fn search_failures_end_episodes_or_fail() {
    let script = || {
        ScriptedPolicy::new(vec![
            vec!["<search>Acme</search>", "<answer>x</answer>"],
            vec!["<answer>y</answer>"],
        ])
    };
    let failing = |_: &[String], _: usize| -> Result<Vec<Vec<Passage>>, Error> {
        Err(Error::Search("timed out".into()))
    };
    let mut eps = episodes(2);
    let stats = run_episodes(&mut eps, &mut script(), &failing, OnSearchError::EndEpisode).unwrap();
    assert_eq!(stats.failed_searches, 1);
    assert!(
        matches!(eps[0].end_reason(), Some(EndReason::SearchFailed(m)) if m.contains("timed out"))
    );
    assert_eq!(eps[1].end_reason(), Some(&EndReason::Answered));

    let mut eps = episodes(2);
    assert!(run_episodes(&mut eps, &mut script(), &failing, OnSearchError::Fail).is_err());

    // Garbage: wrong number of result lists.
    let garbage = |_: &[String], _: usize| -> Result<Vec<Vec<Passage>>, Error> { Ok(vec![]) };
    let mut eps = episodes(2);
    run_episodes(&mut eps, &mut script(), &garbage, OnSearchError::EndEpisode).unwrap();
    assert!(matches!(
        eps[0].end_reason(),
        Some(EndReason::SearchFailed(_))
    ));
}

/// Byte-level toy tokenizer.
fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

/// Observation byte ranges found independently in the response text.
fn observation_ranges(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(i) = text[pos..].find("\n\n<information>") {
        let s = pos + i;
        let e = s + text[s..].find("</information>\n\n").unwrap() + "</information>\n\n".len();
        out.push(s..e);
        pos = e;
    }
    let mut pos = 0;
    while let Some(i) = text[pos..].find(INVALID_ACTION_OBSERVATION) {
        out.push(pos + i..pos + i + INVALID_ACTION_OBSERVATION.len());
        pos += i + INVALID_ACTION_OBSERVATION.len();
    }
    out
}

#[test]
fn loss_mask_covers_exactly_the_observation_tokens() {
    let mut eps = episodes(1);
    let mut policy = ScriptedPolicy::new(vec![vec![
        "<think>a</think><search>Acme</search>",
        "bad turn",
        "<search>Tom Brant</search>",
        "<answer>Velno</answer>",
    ]]);
    run_episodes(&mut eps, &mut policy, &fake_search, OnSearchError::Fail).unwrap();
    let traj = &eps[0].trajectory;
    let text = traj.response_text();
    let mask = loss_mask(traj.segments(), bytes);
    assert_eq!(mask.len(), text.len());
    let ranges = observation_ranges(&text);
    assert_eq!(ranges.len(), 3);
    for (i, m) in mask.iter().enumerate() {
        let in_obs = ranges.iter().any(|r| r.contains(&i));
        assert_eq!(*m == 0.0, in_obs, "byte {i} of {text:?}");
    }
    // Same through attached ids.
    let mut t2: Trajectory = traj.clone();
    assert!(t2.ids_and_loss_mask().is_err());
    t2.tokenize_missing(bytes);
    let (ids, m2) = t2.ids_and_loss_mask().unwrap();
    assert_eq!(m2, mask);
    assert_eq!(ids, bytes(&text));
}

#[test]
fn token_in_token_out_never_retokenizes() {
    // A tokenizer that is not concatenation-invariant: one id per 2-byte chunk.
    fn words(s: &str) -> Vec<u32> {
        s.as_bytes()
            .chunks(2)
            .map(|c| c.iter().fold(7u32, |h, b| h * 257 + u32::from(*b)))
            .collect()
    }
    let mut eps = episodes(1);
    eps[0].trajectory.prompt_token_ids = Some(words(&eps[0].trajectory.prompt));
    let mut policy = ScriptedPolicy::new(vec![vec![
        "<search>Acme</search>",
        "<answer>Velno</answer>",
    ]])
    .with_tokenizer(words);
    run_episodes(&mut eps, &mut policy, &fake_search, OnSearchError::Fail).unwrap();
    let traj = &mut eps[0].trajectory;
    traj.tokenize_observations(words);
    let (ids, mask) = traj.ids_and_loss_mask().unwrap();
    let mut expect = Vec::new();
    let mut expect_mask = Vec::new();
    for seg in traj.segments() {
        let t = words(&seg.text);
        expect_mask.extend(std::iter::repeat_n(
            if seg.kind == SegmentKind::Policy {
                1.0
            } else {
                0.0
            },
            t.len(),
        ));
        expect.extend(t);
    }
    assert_eq!(ids, expect);
    assert_eq!(mask, expect_mask);
    // Re-tokenizing the whole transcript would differ (chunks straddle segment boundaries).
    assert_ne!(words(&traj.response_text()), ids);
    // Log-probs travel with policy segments.
    assert!(
        traj.steps
            .iter()
            .all(|s| s.policy.logprobs.as_ref().map(Vec::len)
                == s.policy.token_ids.as_ref().map(Vec::len))
    );
    let ctx = eps[0].context_token_ids().unwrap();
    assert!(ctx.ends_with(&ids));
}

proptest::proptest! {
    /// Arbitrary model text (biased towards protocol tags) never panics the state machine, and every episode
    /// ends within max_turns.
    #[test]
    fn arbitrary_turns_never_panic(turns in proptest::collection::vec(
        proptest::collection::vec(proptest::prop_oneof![
            proptest::strategy::Just("<search>".to_string()),
            proptest::strategy::Just("</search>".to_string()),
            proptest::strategy::Just("<answer>".to_string()),
            proptest::strategy::Just("</answer>".to_string()),
            proptest::strategy::Just("<think>".to_string()),
            proptest::strategy::Just("</information>".to_string()),
            "\\PC{0,12}",
        ], 0..8).prop_map(|v| v.concat()),
        0..6,
    ), max_turns in 1usize..5) {
        let cfg = ProtocolConfig { max_turns, max_query_chars: 16, ..Default::default() };
        let mut eps = vec![Episode::new("P", cfg).unwrap()];
        let mut policy = ScriptedPolicy::new(vec![turns.clone()]);
        run_episodes(&mut eps, &mut policy, &fake_search, OnSearchError::Fail).unwrap();
        proptest::prop_assert!(eps[0].is_done());
        proptest::prop_assert!(eps[0].trajectory.steps.len() <= max_turns);
        for s in eps[0].trajectory.searches() {
            proptest::prop_assert!(!s.query.is_empty() && s.query.chars().count() <= 16);
        }
        let _ = kiln_search::answer::extract_answer(&eps[0].trajectory.response_text());
    }
}

#[test]
fn pack_pads_into_rollout_layout() {
    let mut eps = episodes(2);
    let mut policy = ScriptedPolicy::new(vec![
        vec!["<search>Acme</search>", "<answer>Velno</answer>"],
        vec!["<answer>x</answer>"],
    ])
    .with_tokenizer(bytes);
    run_episodes(&mut eps, &mut policy, &fake_search, OnSearchError::Fail).unwrap();
    let trajs: Vec<&Trajectory> = eps.iter().map(|e| &e.trajectory).collect();
    assert!(
        kiln_search::rollout::pack(&trajs).is_err(),
        "observations not tokenized yet"
    );
    for e in &mut eps {
        e.trajectory.tokenize_observations(bytes);
    }
    let trajs: Vec<&Trajectory> = eps.iter().map(|e| &e.trajectory).collect();
    let p = kiln_search::rollout::pack(&trajs).unwrap();
    let t0 = eps[0].trajectory.response_text().len();
    let t1 = eps[1].trajectory.response_text().len();
    assert_eq!(p.max_actions, t0.max(t1));
    assert_eq!(p.action_mask.len(), 2 * p.max_actions);
    let row1 = &p.action_mask[p.max_actions..];
    assert!(row1[..t1].iter().all(|m| *m == 1.0));
    assert!(row1[t1..].iter().all(|m| *m == 0.0));
    let row0 = &p.action_mask[..p.max_actions];
    let policy_tokens: usize = eps[0]
        .trajectory
        .steps
        .iter()
        .map(|s| s.policy.text.len())
        .sum();
    assert_eq!(row0.iter().filter(|m| **m == 1.0).count(), policy_tokens);
    let lp = p.old_logprobs.unwrap();
    assert_eq!(
        lp.iter().filter(|x| **x == -1.0).count(),
        policy_tokens + t1
    );
}
