//! Loaders on the real shared datasets and on bad input.

use std::io::Write;
use std::path::PathBuf;

use kiln_search::Error;
use kiln_search::data::{LoadOptions, SHARED_DATASETS, load_qa, resolve_dataset, write_qa};

fn shared() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/datasets")
}

fn strict() -> LoadOptions {
    LoadOptions {
        strict: true,
        limit: None,
    }
}

#[test]
fn loads_every_shared_dataset_strictly() {
    let root = shared();
    assert!(
        root.is_dir(),
        "{} is missing: the shared datasets must sit beside the repository",
        root.display()
    );
    let want = [
        ("hotpotqa_dev500", 500),
        ("musique_dev500", 500),
        ("nq_open_dev", 3610),
        ("train_questions_8k", 8148),
        ("hotpotqa_dev_distractor100", 100),
        ("musique_dev100_paragraphs", 100),
        ("gold_context_union_qa", 402),
    ];
    assert_eq!(want.len(), SHARED_DATASETS.len());
    for (name, n) in want {
        let path = resolve_dataset(name, &root).unwrap();
        let d = load_qa(&path, &strict()).unwrap();
        assert_eq!(d.examples.len(), n, "{name}");
        assert_eq!(d.skipped, 0);
        assert!(
            d.examples
                .iter()
                .all(|e| !e.question.is_empty() && !e.golden_answers.is_empty())
        );
    }
    // Spot checks of each layout.
    let hp = load_qa(
        &resolve_dataset("hotpotqa_dev500", &root).unwrap(),
        &strict(),
    )
    .unwrap();
    assert_eq!(hp.examples[1].id, "2");
    assert_eq!(hp.examples[1].golden_answers, ["The Home Rule League"]);
    assert_eq!(hp.examples[1].data_source, "hotpotqa_dev500");
    let nq = load_qa(&resolve_dataset("nq_open_dev", &root).unwrap(), &strict()).unwrap();
    assert_eq!(
        nq.examples[0].golden_answers,
        ["14 December 1972 UTC", "December 1972"]
    );
    assert_eq!(nq.examples[0].id, "nq_open_dev-1");
    let dis = load_qa(
        &resolve_dataset("hotpotqa_dev_distractor100", &root).unwrap(),
        &strict(),
    )
    .unwrap();
    assert_eq!(dis.examples[0].id, "5a7613c15542994ccc9186bf");
    assert_eq!(
        dis.examples[0].supporting_titles,
        ["VIVA Media", "Gesellschaft mit beschränkter Haftung"]
    );
    assert_eq!(dis.examples[0].kind.as_deref(), Some("bridge"));
    let mu = load_qa(
        &resolve_dataset("musique_dev100_paragraphs", &root).unwrap(),
        &strict(),
    )
    .unwrap();
    let m0 = &mu.examples[0];
    assert_eq!(m0.id, "2hop__82713_84616");
    assert_eq!(
        m0.golden_answers[0],
        "for Best Performance by a Leading Actress in a Play in Ondine"
    );
    assert!(m0.golden_answers.contains(&"leading actress".to_string()));
    assert!(
        m0.supporting_titles
            .contains(&"My Fair Lady (film)".to_string())
    );
    let gc = load_qa(
        &resolve_dataset("gold_context_union_qa", &root).unwrap(),
        &strict(),
    )
    .unwrap();
    assert_eq!(gc.examples[0].data_source, "hotpotqa");
    assert_eq!(
        gc.examples[0].supporting_passage_ids,
        ["17a73739ab567a00", "ec3ece6b67b7375f"]
    );
    assert!(resolve_dataset("no_such_set", &root).is_err());
}

const BAD: &str = r#"{"question": "ok one", "golden_answers": ["a", "b"], "id": "x1", "data_source": "nq"}
{"golden_answers": ["a"]}
{"question": "no answer"}
{"question": "empty answer", "answer": ""}
{"question": "blank list", "golden_answers": ["  "]}
{"question": "non-string", "golden_answers": [42]}
{"question": 7, "answer": "x"}
not json at all

{"question": "ok two", "answer": "c", "idx": 9}
["an", "array"]
{"question": "", "answer": "x"}
"#;

#[test]
fn bad_lines_strict_and_lenient() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.jsonl");
    std::fs::write(&p, BAD).unwrap();
    let e = load_qa(&p, &strict()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::BadLine { line: 2, .. }), "{msg}");
    assert!(msg.contains("bad.jsonl:2: missing \"question\""), "{msg}");
    let d = load_qa(&p, &LoadOptions::default()).unwrap();
    assert_eq!(d.examples.len(), 2);
    assert_eq!(d.skipped, 9);
    assert_eq!(d.examples[0].id, "x1");
    assert_eq!(d.examples[0].data_source, "nq");
    assert_eq!(d.examples[1].id, "9");
    // Each bad line's message, strictly, line by line.
    let lines: Vec<&str> = BAD.lines().collect();
    let expect = [
        (2, "missing \"question\""),
        (3, "missing the gold answer"),
        (4, "has no non-empty answer"),
        (5, "has no non-empty answer"),
        (6, "must hold strings"),
        (7, "\"question\" must be a string"),
        (8, "not JSON"),
        (11, "expected a JSON object"),
        (12, "\"question\" is empty"),
    ];
    for (line, want) in expect {
        let q = dir.path().join(format!("l{line}.jsonl"));
        std::fs::write(&q, format!("{}\n", lines[line - 1])).unwrap();
        let e = load_qa(&q, &strict()).unwrap_err().to_string();
        assert!(e.contains(want), "line {line}: {e}");
    }
    // Non-UTF-8.
    let q = dir.path().join("bin.jsonl");
    std::fs::write(
        &q,
        b"\xff\xfe{\"question\"\n{\"question\":\"q\",\"answer\":\"a\"}\n",
    )
    .unwrap();
    assert!(
        load_qa(&q, &strict())
            .unwrap_err()
            .to_string()
            .contains("bin.jsonl:1: not valid UTF-8")
    );
    assert_eq!(load_qa(&q, &LoadOptions::default()).unwrap().skipped, 1);
    // Nothing usable.
    let q = dir.path().join("empty.jsonl");
    std::fs::write(&q, "\n\n").unwrap();
    assert!(matches!(
        load_qa(&q, &LoadOptions::default()),
        Err(Error::Empty { .. })
    ));
    assert!(matches!(
        load_qa(&dir.path().join("missing.jsonl"), &strict()),
        Err(Error::Io { .. })
    ));
}

#[test]
fn gzip_array_limit_and_roundtrip() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&p).unwrap(),
        flate2::Compression::fast(),
    );
    for i in 0..5 {
        writeln!(gz, r#"{{"question": "q{i}", "golden_answers": ["a{i}"]}}"#).unwrap();
    }
    gz.finish().unwrap();
    let d = load_qa(
        &p,
        &LoadOptions {
            strict: true,
            limit: Some(3),
        },
    )
    .unwrap();
    assert_eq!(d.examples.len(), 3);
    assert_eq!(d.examples[2].golden_answers, ["a2"]);
    assert_eq!(d.examples[0].data_source, "d");

    let a = dir.path().join("arr.json");
    std::fs::write(
        &a,
        r#"  [{"question": "q", "answer": "x", "answer_aliases": ["y", "x"]},
             {"question": "u", "answer": "z", "answerable": false},
             {"question": "p", "reward_model": {"ground_truth": {"target": ["t"]}}}]"#,
    )
    .unwrap();
    let e = load_qa(&a, &strict()).unwrap_err().to_string();
    assert!(
        e.contains("arr.json:2: array element 2") && e.contains("answerable"),
        "{e}"
    );
    let d = load_qa(&a, &LoadOptions::default()).unwrap();
    assert_eq!(d.examples[0].golden_answers, ["x", "y"]);
    assert_eq!(d.examples[1].golden_answers, ["t"]);
    assert_eq!(d.skipped, 1);

    let out = dir.path().join("out.jsonl");
    write_qa(&out, &d.examples).unwrap();
    let back = load_qa(&out, &strict()).unwrap();
    assert_eq!(back.examples, d.examples);
}
