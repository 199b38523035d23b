//! QA report: records from scripted episodes, table, transcripts.

use kiln_search::Error;
use kiln_search::data::QaExample;
use kiln_search::eval::{QaRecord, write_report};
use kiln_search::protocol::{Episode, Passage, PromptTemplate, PromptTemplates, ProtocolConfig};
use kiln_search::rollout::{OnSearchError, ScriptedPolicy, run_episodes};

fn search(qs: &[String], _k: usize) -> Result<Vec<Vec<Passage>>, Error> {
    Ok(qs
        .iter()
        .map(|q| {
            vec![Passage {
                id: q.clone(),
                title: q.clone(),
                text: "Paris is the capital.".into(),
                score: 1.0,
            }]
        })
        .collect())
}

fn ex(i: usize, answer: &str) -> QaExample {
    QaExample {
        id: format!("q{i}"),
        question: format!("question {i}?"),
        golden_answers: vec![answer.into()],
        data_source: "toy".into(),
        supporting_passage_ids: vec![],
        supporting_titles: vec![],
        kind: None,
    }
}

#[test]
fn report_table_and_transcripts() {
    let examples = [ex(0, "Paris"), ex(1, "Lyon"), ex(2, "Paris")];
    let mut records = Vec::new();
    for (mode, scripts) in [
        (
            "agent",
            vec![
                vec!["<search>capital</search>", "<answer>Paris</answer>"],
                vec!["<search>x</search>", "<answer>Paris</answer>"],
                vec!["<answer>The Paris.</answer>"],
            ],
        ),
        (
            "direct",
            vec![
                vec!["<answer>Rome</answer>"],
                vec!["nothing"],
                vec!["<answer>paris</answer>"],
            ],
        ),
    ] {
        let mut eps: Vec<Episode> = examples
            .iter()
            .map(|e| {
                Episode::for_question(
                    &PromptTemplate::default(),
                    &e.question,
                    ProtocolConfig::default(),
                )
                .unwrap()
            })
            .collect();
        run_episodes(
            &mut eps,
            &mut ScriptedPolicy::new(scripts),
            &search,
            OnSearchError::Fail,
        )
        .unwrap();
        for (e, ep) in examples.iter().zip(&eps) {
            records.push(QaRecord::from_episode("toy", mode, e, ep));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let (sums, files) = write_report(dir.path(), "toy eval", &records, 1000, 0).unwrap();
    assert_eq!(sums.len(), 2);
    let agent = sums.iter().find(|s| s.mode == "agent").unwrap();
    assert!((agent.em.mean - 2.0 / 3.0).abs() < 1e-12);
    assert!((agent.mean_searches - 2.0 / 3.0).abs() < 1e-12);
    assert!((agent.answer_in_passages - 1.0 / 3.0).abs() < 1e-12);
    let direct = sums.iter().find(|s| s.mode == "direct").unwrap();
    assert!((direct.em.mean - 1.0 / 3.0).abs() < 1e-12);
    assert!((direct.answered - 2.0 / 3.0).abs() < 1e-12);
    let md = std::fs::read_to_string(&files.markdown).unwrap();
    assert!(md.starts_with("# toy eval"));
    assert!(md.contains("| toy | agent | 3 | 66.7 ["), "{md}");
    let lines: Vec<QaRecord> = std::fs::read_to_string(&files.transcripts)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, records);
    assert!(
        lines[0]
            .response
            .contains("<information>Doc 1(Title: capital) Paris is the capital.</information>")
    );
    let js: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files.summary).unwrap()).unwrap();
    assert_eq!(js.as_array().unwrap().len(), 2);
}

#[test]
fn baseline_modes_build_one_turn_episodes() {
    use kiln_search::eval::EvalMode;
    use kiln_search::protocol::{EndReason, Generated, Pending};
    let cfg = ProtocolConfig::default();
    let ps = search(&["capital".to_string()], 3).unwrap().remove(0);
    let mut rag = EvalMode::Rag
        .episode("Q?", Some(&ps), &cfg, &PromptTemplates::plain())
        .unwrap();
    assert!(
        rag.trajectory
            .prompt
            .contains("Doc 1(Title: capital) Paris is the capital.\nQuestion: Q?\n")
    );
    assert_eq!(
        rag.pending(),
        &Pending::Generate {
            turn: 1,
            search_enabled: false
        }
    );
    rag.push_generation(Generated::text("<search>more</search>"))
        .unwrap();
    assert_eq!(rag.end_reason(), Some(&EndReason::SearchOnLastTurn));
    assert!(
        EvalMode::Rag
            .episode("Q?", None, &cfg, &PromptTemplates::plain())
            .is_err()
    );
    let mut direct = EvalMode::Direct
        .episode("Q?", None, &cfg, &PromptTemplates::plain())
        .unwrap();
    assert!(!direct.trajectory.prompt.contains("<search>"));
    direct
        .push_generation(Generated::text("<answer>x</answer>"))
        .unwrap();
    assert_eq!(direct.end_reason(), Some(&EndReason::Answered));
    let agent = EvalMode::Agent
        .episode("Q?", None, &cfg, &PromptTemplates::plain())
        .unwrap();
    assert_eq!(agent.config.max_turns, 4);
    assert_eq!("rag".parse::<EvalMode>().unwrap(), EvalMode::Rag);
    assert!("other".parse::<EvalMode>().is_err());
}
