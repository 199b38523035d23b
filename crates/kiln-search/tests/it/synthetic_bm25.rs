//! The synthetic world with kiln's real BM25 index (kiln-retrieval): searching each hop's entity name finds the
//! hop's document, so the scripted demonstrations are consistent with what the agent reads.

use kiln_retrieval::{BuildOptions, IndexRetriever, Retriever, build_index};
use kiln_search::Error;
use kiln_search::protocol::{Passage, PromptTemplate, ProtocolConfig};
use kiln_search::synthetic::{Split, WorldConfig, build_demonstrations, generate};

#[test]
fn hops_are_retrievable_with_bm25_and_demonstrations_survive() {
    let world = generate(&WorldConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    world.write(dir.path()).unwrap();
    let index_dir = dir.path().join("index");
    build_index(
        &[dir.path().join("corpus.jsonl")],
        &index_dir,
        &BuildOptions {
            progress: false,
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let retriever = IndexRetriever::open(&index_dir).unwrap();
    assert_eq!(retriever.num_docs() as usize, world.corpus.len());
    let search = |qs: &[String], k: usize| -> Result<Vec<Vec<Passage>>, Error> {
        let res = retriever
            .search_batch(qs, k)
            .map_err(|e| Error::Search(e.to_string()))?;
        Ok(res
            .into_iter()
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
    };
    for split in [Split::Train, Split::Test] {
        let qs = world.split(split);
        let (mut hops, mut found_top1, mut found_top3) = (0usize, 0usize, 0usize);
        for q in qs {
            for h in &q.hops {
                let res = search(std::slice::from_ref(&h.query), 3).unwrap().remove(0);
                hops += 1;
                found_top1 += usize::from(res.first().is_some_and(|p| p.id == h.doc_id));
                found_top3 += usize::from(res.iter().any(|p| p.id == h.doc_id));
            }
        }
        let (r1, r3) = (
            found_top1 as f64 / hops as f64,
            found_top3 as f64 / hops as f64,
        );
        eprintln!(
            "{}: {hops} hops, recall@1 {r1:.3}, recall@3 {r3:.3}",
            split.name()
        );
        assert!(r3 >= 0.95, "{}: hop recall@3 {r3}", split.name());
        let (eps, dropped) = build_demonstrations(
            qs,
            &PromptTemplate::default(),
            &ProtocolConfig::default(),
            &search,
        )
        .unwrap();
        eprintln!(
            "{}: {} demonstrations kept, {dropped} dropped",
            split.name(),
            eps.len()
        );
        assert!(
            dropped * 20 <= qs.len(),
            "{}: {dropped} of {} dropped",
            split.name(),
            qs.len()
        );
    }
    // The question alone (RAG-style retrieve once) rarely finds the second hop of a bridge question.
    let bridge: Vec<_> = world
        .test
        .iter()
        .filter(|q| q.example.kind.as_deref() == Some("bridge"))
        .collect();
    let second_hop_found = bridge
        .iter()
        .filter(|q| {
            let res = search(std::slice::from_ref(&q.example.question), 3)
                .unwrap()
                .remove(0);
            res.iter().any(|p| p.id == q.hops[1].doc_id)
        })
        .count();
    eprintln!(
        "test bridge questions: second-hop document in the top 3 for the question alone: {second_hop_found}/{}",
        bridge.len()
    );
    assert!(
        second_hop_found * 10 <= bridge.len(),
        "the question alone should not find the second hop"
    );
    // Retrieve-once (RAG) ceiling per question kind: is a gold answer in the top 3 for the question alone?
    for kind in ["1hop", "bridge", "comparison"] {
        let qs: Vec<_> = world
            .test
            .iter()
            .filter(|q| q.example.kind.as_deref() == Some(kind))
            .collect();
        let hit = qs
            .iter()
            .filter(|q| {
                let res = search(std::slice::from_ref(&q.example.question), 3)
                    .unwrap()
                    .remove(0);
                res.iter().any(|p| {
                    kiln_search::reward::passage_contains_answer(p, &q.example.golden_answers)
                })
            })
            .count();
        eprintln!(
            "test {kind}: gold answer in the question-only top 3 for {hit}/{}",
            qs.len()
        );
        if kind == "bridge" {
            assert!(
                hit * 4 <= qs.len(),
                "bridge answers should need a second search ({hit}/{})",
                qs.len()
            );
        }
    }
}
