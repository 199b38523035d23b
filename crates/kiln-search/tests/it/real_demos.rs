//! `warm_start.real`: scripted demonstrations from real questions over a real tantivy BM25 index.

use std::sync::Arc;

use kiln_retrieval::{BuildOptions, IndexRetriever, build_index};
use kiln_search::agent::RetrieverBackend;
use kiln_search::data::QaExample;
use kiln_search::protocol::{PromptTemplates, ProtocolConfig};
use kiln_search::real_demos::{RealDemosConfig, build_real_demos};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

fn qa(id: &str, question: &str, answer: &str) -> QaExample {
    QaExample {
        id: id.into(),
        question: question.into(),
        golden_answers: vec![answer.into()],
        data_source: "test".into(),
        supporting_passage_ids: Vec::new(),
        supporting_titles: Vec::new(),
        kind: None,
    }
}

const CORPUS: &[(&str, &str, &str)] = &[
    (
        "p1",
        "Velmora Abbey",
        "Velmora Abbey is a ruined monastery. It was founded by the monk Oswin Tarrel in 1132. The abbey closed in 1539.",
    ),
    (
        "p2",
        "Quillon Bridge",
        "Quillon Bridge crosses the river Sarn. The bridge was designed by the engineer Maret Hollis.",
    ),
    (
        "p3",
        "Maret Hollis",
        "Maret Hollis was an engineer, raised in Dunmere. Hollis trained in Glasgow.",
    ),
    (
        "p4",
        "Sarn river",
        "The Sarn is a short river in the west. Its valley is farmland.",
    ),
];

fn search() -> (tempfile::TempDir, RetrieverBackend) {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.jsonl");
    let lines: Vec<String> = CORPUS
        .iter()
        .map(|(id, title, text)| {
            serde_json::json!({"id": id, "title": title, "text": text}).to_string()
        })
        .collect();
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    let index = dir.path().join("index");
    build_index(
        &[corpus],
        &index,
        &BuildOptions {
            progress: false,
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let r = RetrieverBackend(Arc::new(IndexRetriever::open(&index).unwrap()));
    (dir, r)
}

#[test]
fn one_and_two_search_demonstrations_quote_the_passage_that_holds_the_answer() {
    let (_dir, search) = search();
    let questions = vec![
        // One search: the question's own results hold the answer.
        qa("a", "Which monk founded Velmora Abbey?", "Oswin Tarrel"),
        // Two searches: the question finds the bridge's page, which names its engineer, whose page holds
        // the town.
        qa(
            "b",
            "In which town was the designer of Quillon Bridge born?",
            "Dunmere",
        ),
        // Skipped: yes/no, the answer in the question, no passage with the answer.
        qa("c", "Is Velmora Abbey a ruin?", "yes"),
        qa(
            "d",
            "Which river does Quillon Bridge cross, the Sarn?",
            "Sarn",
        ),
        qa("e", "Who painted the Velmora Abbey altar?", "Ilse Varga"),
    ];
    let protocol = ProtocolConfig {
        top_k: 1,
        ..ProtocolConfig::default()
    };
    let cfg = RealDemosConfig {
        max_demos: 10,
        rag_ratio: 0.5,
        ..RealDemosConfig::default()
    };
    let templates = PromptTemplates::plain();
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let d = build_real_demos(&questions, &cfg, &templates, &protocol, &search, &mut rng).unwrap();
    let s = &d.stats;
    assert_eq!(s.scanned, 5);
    assert_eq!((s.skipped_answer, s.skipped_in_question), (1, 1), "{s:?}");
    assert_eq!(
        (s.one_search, s.two_search, s.no_evidence),
        (1, 1, 1),
        "{s:?}"
    );
    assert_eq!(s.dropped_on_replay, 0);
    assert_eq!(d.episodes.len(), 2);
    for ep in &d.episodes {
        let t = &ep.trajectory;
        let searches = t.searches();
        let last = t.steps.last().unwrap();
        if searches.len() == 1 {
            assert_eq!(searches[0].query, "Which monk founded Velmora Abbey?");
            assert_eq!(t.final_answer(), Some("Oswin Tarrel"));
            assert!(
                last.policy
                    .text
                    .contains("<think>It was founded by the monk Oswin Tarrel in 1132.</think>"),
                "{}",
                last.policy.text
            );
        } else {
            assert_eq!(searches.len(), 2);
            assert_eq!(searches[1].query, "Maret Hollis");
            assert!(
                searches[1]
                    .passages
                    .iter()
                    .any(|p| p.text.contains("Dunmere"))
            );
            // The second search's think quotes where the first result names the engineer.
            assert!(
                t.steps[1].policy.text.contains(
                    "The bridge was designed by the engineer Maret Hollis. Now I need to look up Maret Hollis."
                ),
                "{}",
                t.steps[1].policy.text
            );
            assert_eq!(t.final_answer(), Some("Dunmere"));
        }
    }
    // RAG: one-search questions only, the answer turn as target, the passages in the prompt.
    assert_eq!(d.rag.len(), 1);
    assert!(
        d.rag[0].0.contains("Oswin Tarrel")
            && d.rag[0].1.contains("<answer> Oswin Tarrel </answer>")
    );
}

#[test]
fn without_two_hop_the_bridge_question_has_no_evidence() {
    let (_dir, search) = search();
    let questions = vec![qa(
        "b",
        "In which town was the designer of Quillon Bridge born?",
        "Dunmere",
    )];
    let protocol = ProtocolConfig {
        top_k: 1,
        ..ProtocolConfig::default()
    };
    let cfg = RealDemosConfig {
        two_hop: false,
        ..RealDemosConfig::default()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let d = build_real_demos(
        &questions,
        &cfg,
        &PromptTemplates::plain(),
        &protocol,
        &search,
        &mut rng,
    )
    .unwrap();
    assert!(d.episodes.is_empty());
    assert_eq!(d.stats.no_evidence, 1);
    // And two searches need room for three turns.
    let short = ProtocolConfig {
        max_turns: 2,
        ..protocol
    };
    let err = build_real_demos(
        &questions,
        &RealDemosConfig::default(),
        &PromptTemplates::plain(),
        &short,
        &search,
        &mut rng,
    )
    .unwrap_err();
    assert!(err.to_string().contains("max_turns"), "{err}");
}
