//! The synthetic multi-hop world: determinism, disjoint splits, answers only in the corpus, cache,
//! demonstrations.

use std::collections::{HashMap, HashSet};

use kiln_search::Error;
use kiln_search::answer::normalize_answer;
use kiln_search::protocol::{Passage, PromptTemplate, ProtocolConfig};
use kiln_search::reward::{DeterministicJudge, RewardConfig, score};
use kiln_search::synthetic::{
    Split, World, WorldConfig, build_demonstrations, cache_key, demonstration_turns, generate,
    load_or_generate,
};

/// A title-word-overlap retriever over the world's corpus (a stand-in for BM25 in this crate's tests).
fn retriever(world: &World) -> impl Fn(&[String], usize) -> Result<Vec<Vec<Passage>>, Error> + '_ {
    move |qs: &[String], k: usize| {
        Ok(qs
            .iter()
            .map(|q| {
                let words: HashSet<String> = q
                    .to_lowercase()
                    .split_whitespace()
                    .map(String::from)
                    .collect();
                let mut scored: Vec<(usize, usize)> = world
                    .corpus
                    .iter()
                    .enumerate()
                    .map(|(i, d)| {
                        let s = d
                            .title
                            .to_lowercase()
                            .split_whitespace()
                            .filter(|w| words.contains(*w))
                            .count();
                        (s, i)
                    })
                    .filter(|(s, _)| *s > 0)
                    .collect();
                scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
                scored
                    .into_iter()
                    .take(k)
                    .map(|(s, i)| Passage {
                        id: world.corpus[i].id.clone(),
                        title: world.corpus[i].title.clone(),
                        text: world.corpus[i].text.clone(),
                        score: s as f32,
                    })
                    .collect()
            })
            .collect())
    }
}

#[test]
fn deterministic_and_sized() {
    let cfg = WorldConfig::default();
    let a = generate(&cfg).unwrap();
    let b = generate(&cfg).unwrap();
    assert_eq!(a, b);
    assert_eq!((a.train.len(), a.dev.len(), a.test.len()), (2000, 200, 500));
    let c = generate(&WorldConfig {
        seed: 1,
        ..cfg.clone()
    })
    .unwrap();
    assert_ne!(a.corpus, c.corpus);
    assert_ne!(
        cache_key(&cfg),
        cache_key(&WorldConfig {
            seed: 1,
            ..cfg.clone()
        })
    );
    // Question ids and texts are unique.
    for s in Split::ALL {
        let ids: HashSet<_> = a.split(s).iter().map(|q| &q.example.id).collect();
        let texts: HashSet<_> = a.split(s).iter().map(|q| &q.example.question).collect();
        assert_eq!(ids.len(), a.split(s).len());
        assert_eq!(texts.len(), a.split(s).len());
    }
    // Every kind is present in the test split.
    let kinds: HashSet<_> = a
        .test
        .iter()
        .filter_map(|q| q.example.kind.clone())
        .collect();
    assert_eq!(kinds.len(), 3, "{kinds:?}");
}

#[test]
fn splits_are_disjoint_and_answers_are_in_the_corpus() {
    let w = generate(&WorldConfig::default()).unwrap();
    let docs: HashMap<&str, &kiln_search::synthetic::Doc> =
        w.corpus.iter().map(|d| (d.id.as_str(), d)).collect();
    assert_eq!(docs.len(), w.corpus.len(), "doc ids are unique");
    let titles: HashSet<_> = w.corpus.iter().map(|d| d.title.to_lowercase()).collect();
    assert_eq!(titles.len(), w.corpus.len(), "entity names are unique");
    // Titles of each split's documents.
    let split_titles = |s: Split| -> HashSet<String> {
        w.corpus
            .iter()
            .filter(|d| d.id.starts_with(&format!("syn-{}-", s.name())))
            .map(|d| d.title.clone())
            .collect()
    };
    for s in Split::ALL {
        let own = split_titles(s);
        let others: HashSet<String> = Split::ALL
            .iter()
            .filter(|o| **o != s)
            .flat_map(|o| split_titles(*o))
            .collect();
        for q in w.split(s) {
            // Hops only use this split's documents.
            for h in &q.hops {
                assert!(
                    own.contains(&h.query),
                    "{} hop {} not in split",
                    q.example.id,
                    h.query
                );
                assert!(docs.contains_key(h.doc_id.as_str()));
            }
            // No entity of another split is mentioned.
            let qn = format!(" {} ", normalize_answer(&q.example.question));
            for t in &others {
                let tn = format!(" {} ", normalize_answer(t));
                assert!(!qn.contains(&tn), "{} mentions {t}", q.example.id);
            }
            // The answer is written in a supporting document.
            let ans = normalize_answer(&q.example.golden_answers[0]);
            assert!(
                q.example
                    .supporting_passage_ids
                    .iter()
                    .any(|id| normalize_answer(&format!(
                        "{} {}",
                        docs[id.as_str()].title,
                        docs[id.as_str()].text
                    ))
                    .contains(&ans)),
                "{}: answer {ans} not in its documents",
                q.example.id
            );
        }
    }
}

#[test]
fn cache_roundtrip_and_repair() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = WorldConfig::default();
    cfg.train.questions = 100;
    let (w1, path) = load_or_generate(&cfg, dir.path()).unwrap();
    assert!(path.ends_with(cache_key(&cfg)));
    for f in [
        "corpus.jsonl",
        "train.jsonl",
        "dev.jsonl",
        "test.jsonl",
        "params.json",
    ] {
        assert!(path.join(f).is_file(), "{f}");
    }
    let (w2, _) = load_or_generate(&cfg, dir.path()).unwrap();
    assert_eq!(w1, w2);
    // The QA files load with the generic loader; the corpus has the retriever's layout.
    let qa = kiln_search::data::load_qa(
        &path.join("test.jsonl"),
        &kiln_search::data::LoadOptions {
            strict: true,
            limit: None,
        },
    )
    .unwrap();
    assert_eq!(qa.examples, w1.examples(Split::Test));
    let line = std::fs::read_to_string(path.join("corpus.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    assert!(first["id"].is_string() && first["title"].is_string() && first["text"].is_string());
    // Damage the cache: it is regenerated.
    std::fs::write(path.join("test.jsonl"), "{\"broken\n").unwrap();
    let (w3, _) = load_or_generate(&cfg, dir.path()).unwrap();
    assert_eq!(w3, w1);
}

#[test]
fn demonstrations_search_the_right_documents_and_score_full_reward() {
    let w = generate(&WorldConfig::default()).unwrap();
    let qs = &w.train[..200];
    let search = retriever(&w);
    let (eps, dropped) = build_demonstrations(
        qs,
        &PromptTemplate::default(),
        &ProtocolConfig::default(),
        &search,
    )
    .unwrap();
    assert!(dropped < 20, "dropped {dropped}");
    let by_q: HashMap<&str, &kiln_search::synthetic::SyntheticQuestion> = qs
        .iter()
        .map(|q| (q.example.question.as_str(), q))
        .collect();
    let mut judge = DeterministicJudge::default();
    let mut partial = 0;
    for ep in &eps {
        let q = by_q
            .iter()
            .find(|(k, _)| ep.trajectory.prompt.contains(*k))
            .map(|(_, v)| *v)
            .unwrap();
        let r = score(
            &ep.trajectory,
            &q.example.question,
            &q.example.gold(),
            &RewardConfig::default(),
            &mut judge,
        )
        .unwrap();
        assert_eq!(r.em, 1.0, "{:?}", ep.trajectory.response_text());
        // Every search of a demonstration returns a supporting document, but an entity's name words are shared
        // with others (e.g. `Lodor Systems` founded by `Kasi Lodor`), so a later hop's document can already come
        // back from an earlier search: that search then counts as a duplicate (0).
        if r.r_process < 1.0 {
            partial += 1;
        }
        assert!(r.r_process > 0.0, "{:?}", ep.trajectory.response_text());
        assert_eq!(r.total, 1.0 + r.r_process);
        assert_eq!(ep.trajectory.steps.len(), q.hops.len() + 1);
    }
    assert!(
        partial * 20 < eps.len(),
        "{partial} of {} demonstrations have a search that found nothing new",
        eps.len()
    );
    let t = demonstration_turns(&qs[0]);
    assert!(t[0].starts_with("<think>") && t[0].ends_with("</search>"));
    assert!(t.last().unwrap().ends_with("</answer>"));
}

#[test]
fn renamer_is_a_consistent_bijection_on_names() {
    use kiln_search::synthetic::Renamer;
    use rand::SeedableRng;
    let w = generate(&WorldConfig::default()).unwrap();
    let (firsts, roots) = Renamer::name_words(&w);
    assert!(roots.len() >= 50 && roots.len() <= 120, "{}", roots.len());
    assert!(firsts.iter().all(|f| !roots.contains(f)));
    let ren = Renamer::random(&w, &mut rand_chacha::ChaCha8Rng::seed_from_u64(3));
    // Whole words only, punctuation kept.
    let r = &roots[0];
    let out = ren.apply(&format!("{r}, {r}x {r}."));
    let to = ren.apply(r);
    assert_eq!(out, format!("{to}, {r}x {to}."));
    // Distinct titles stay distinct; most change.
    let titles: Vec<&str> = w.corpus.iter().map(|d| d.title.as_str()).collect();
    let renamed: HashSet<String> = titles.iter().map(|t| ren.apply(t)).collect();
    assert_eq!(renamed.len(), titles.iter().collect::<HashSet<_>>().len());
    let changed = titles.iter().filter(|t| ren.apply(t) != **t).count();
    assert!(
        changed * 10 > titles.len() * 9,
        "{changed}/{}",
        titles.len()
    );
    // A renamed question is still answered by its renamed gold documents.
    let docs: HashMap<&str, &str> = w
        .corpus
        .iter()
        .map(|d| (d.id.as_str(), d.text.as_str()))
        .collect();
    for q in &w.train {
        let gold = q.example.golden_answers[0].as_str();
        let text: String = q.hops.iter().map(|h| docs[h.doc_id.as_str()]).collect();
        let rq = ren.apply(&q.example.question);
        let rg = ren.apply(gold);
        assert!(
            ren.apply(&text).contains(&rg) || rq.contains(&rg),
            "{rq} -> {rg}"
        );
    }
}
