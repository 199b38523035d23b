//! Command-line entry points wired into the `kiln` binary (`kiln index`, `kiln serve-retriever`,
//! `kiln bench-retriever`). The binary only parses these argument structs and calls `run_*`.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::bench::BenchConfig;
use crate::corpus::{BadLinePolicy, DEFAULT_MAX_LINE_BYTES, MAX_LINE_BYTES_ENV};
use crate::dense::{Ann, DenseBuildOptions, Dtype, FusionConfig, HnswParams, build_dense};
use crate::encoder::{DEFAULT_ENCODER, load_encoder};
use crate::index::{BuildOptions, build_index};
use crate::open::{LocalRetrieverConfig, RetrieverKind, open_local};
use crate::server::{ServerConfig, serve, shutdown_signal};
use crate::{Error, Retriever};

/// Errors of the retrieval commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// A library error (corpus, index, server).
    #[error(transparent)]
    Retrieval(#[from] Error),
    /// A bad command-line value.
    #[error("{0}")]
    Usage(String),
}

/// `kiln index --corpus PATH --out INDEX_DIR [--dense]`: build a BM25 index from JSONL corpora, and with `--dense`
/// the passages' sentence-encoder embeddings beside it (for `dense` and `hybrid` retrieval).
#[derive(clap::Args, Debug)]
pub struct IndexArgs {
    /// Corpus file(s): JSONL (optionally .gz) in Search-R1 `{"id","contents"}` or `{"id","title","text"}` layout.
    /// Repeat the flag for several files.
    #[arg(long, required = true)]
    pub corpus: Vec<PathBuf>,
    /// Output index directory (an existing kiln index there is replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// Indexing threads (0 = number of CPUs, at most 8).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Writer memory budget per thread in MiB (at least 15).
    #[arg(long, default_value_t = 64)]
    pub heap_mb: usize,
    /// Stop at the first bad corpus line instead of skipping it with a warning.
    #[arg(long)]
    pub strict: bool,
    /// Keep tantivy's segments instead of merging them into one.
    #[arg(long)]
    pub no_merge: bool,
    /// Longest accepted corpus line in bytes; a longer line stops with a `file:line` error.
    #[arg(long, env = MAX_LINE_BYTES_ENV, default_value_t = DEFAULT_MAX_LINE_BYTES)]
    pub max_line_bytes: usize,
    /// Also embed every passage with a sentence encoder (`--encoder`) for dense and hybrid retrieval
    /// (written to INDEX_DIR/dense/; the BM25 index is built as well).
    #[arg(long)]
    pub dense: bool,
    /// Same as `--dense`: hybrid retrieval needs both the BM25 index and the embeddings.
    #[arg(long)]
    pub hybrid: bool,
    /// Sentence encoder for `--dense`: a name recorded in .kiln/models.json or a sentence-transformers folder.
    #[arg(long, default_value = DEFAULT_ENCODER)]
    pub encoder: String,
    /// Store the embeddings as f16 (half the file; searched as f32).
    #[arg(long)]
    pub f16: bool,
    /// Passages per encoder batch.
    #[arg(long, default_value_t = 32)]
    pub encode_batch: usize,
}

/// How a local index is searched (`kiln serve-retriever`, `kiln bench-retriever`).
#[derive(clap::Args, Debug, Clone)]
pub struct SearchArgs {
    /// Ranking: bm25, dense (needs `kiln index --dense`) or hybrid (reciprocal rank fusion of both).
    #[arg(long, value_enum, default_value_t = RetrieverKind::Bm25)]
    pub kind: RetrieverKind,
    /// Query encoder for dense / hybrid (default: the one the index was built with; must be the same model).
    #[arg(long)]
    pub encoder: Option<String>,
    /// Dense search through an HNSW graph (built when the index is opened) instead of exactly.
    #[arg(long)]
    pub hnsw: bool,
    /// HNSW links per node.
    #[arg(long, default_value_t = 16)]
    pub hnsw_m: usize,
    /// HNSW candidate list while building.
    #[arg(long, default_value_t = 200)]
    pub ef_construction: usize,
    /// HNSW candidate list while searching.
    #[arg(long, default_value_t = 128)]
    pub ef_search: usize,
    /// Hybrid: weight of the BM25 ranking.
    #[arg(long, default_value_t = 1.0)]
    pub bm25_weight: f32,
    /// Hybrid: weight of the dense ranking.
    #[arg(long, default_value_t = 1.0)]
    pub dense_weight: f32,
    /// Hybrid: the reciprocal-rank-fusion constant.
    #[arg(long, default_value_t = 60.0)]
    pub rrf_k: f32,
    /// Hybrid: passages taken from each ranking before fusing.
    #[arg(long, default_value_t = 50)]
    pub fusion_depth: usize,
}

impl SearchArgs {
    /// The retriever these flags describe over `index`.
    pub fn config(&self, index: &std::path::Path) -> LocalRetrieverConfig {
        LocalRetrieverConfig {
            kind: self.kind,
            index: index.to_path_buf(),
            encoder: self.encoder.clone(),
            ann: if self.hnsw {
                Ann::Hnsw(HnswParams {
                    m: self.hnsw_m,
                    ef_construction: self.ef_construction,
                    ef_search: self.ef_search,
                })
            } else {
                Ann::Exact
            },
            fusion: FusionConfig {
                bm25_weight: self.bm25_weight,
                dense_weight: self.dense_weight,
                rrf_k: self.rrf_k,
                depth: self.fusion_depth,
            },
        }
    }
}

/// Parses a duration in seconds (`10`, `0.5`).
fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v > 0.0 && v <= 86_400.0) {
        return Err(format!(
            "{s:?}: give a number of seconds above 0 and at most 86400"
        ));
    }
    Ok(Duration::from_secs_f64(v))
}

/// `kiln serve-retriever --index INDEX_DIR`: serve Search-R1's `/retrieve` API.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Index directory built by `kiln index`.
    #[arg(long)]
    pub index: PathBuf,
    /// Ranking and its settings.
    #[command(flatten)]
    pub search: SearchArgs,
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer TOKEN` on /retrieve.
    #[arg(long, env = "KILN_RETRIEVER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// topk when a request gives none (Search-R1's `retrieval_topk`).
    #[arg(long, default_value_t = 3)]
    pub default_topk: usize,
    /// Largest accepted topk.
    #[arg(long, default_value_t = 100)]
    pub max_topk: usize,
    /// Most queries in one request.
    #[arg(long, default_value_t = 4096)]
    pub max_queries: usize,
    /// Longest accepted query in bytes.
    #[arg(long, default_value_t = crate::index::MAX_QUERY_BYTES)]
    pub max_query_bytes: usize,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Most passages per request (queries x topk); more is refused with a 422.
    #[arg(long, default_value_t = 16_384)]
    pub max_results: usize,
    /// Largest answer in bytes; a request whose passages would not fit is refused with a 422.
    #[arg(long, default_value_t = 32 * 1024 * 1024)]
    pub max_response_bytes: usize,
    /// Bytes of answers held in memory at once (mostly not yet read by their clients); beyond it, 503.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    pub max_pending_response_bytes: usize,
    /// Requests searched at the same time (0 = 2 x CPUs).
    #[arg(long, default_value_t = 0)]
    pub max_concurrent_searches: usize,
    /// Open connections at most; beyond it the longest-idle connection is closed (keep it below `ulimit -n`).
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Seconds for a request head to arrive (also how long a connection may stay open without a request).
    #[arg(long, value_parser = parse_secs, default_value = "10")]
    pub header_read_timeout: Duration,
    /// Seconds for a request body to arrive (else 408).
    #[arg(long, value_parser = parse_secs, default_value = "30")]
    pub body_timeout: Duration,
    /// Seconds after which a connection with no request being handled and no bytes moving is closed.
    #[arg(long, value_parser = parse_secs, default_value = "30")]
    pub idle_timeout: Duration,
}

impl ServeArgs {
    /// The server configuration these flags describe.
    pub fn server_config(&self) -> ServerConfig {
        ServerConfig {
            token: self.token.clone().filter(|t| !t.is_empty()),
            max_body_bytes: self.max_body_bytes,
            max_topk: self.max_topk,
            default_topk: self.default_topk,
            max_queries: self.max_queries,
            max_query_bytes: self.max_query_bytes,
            max_results: self.max_results,
            max_response_bytes: self.max_response_bytes,
            max_pending_response_bytes: self.max_pending_response_bytes,
            max_concurrent_searches: self.max_concurrent_searches,
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            body_timeout: self.body_timeout,
            idle_timeout: self.idle_timeout,
        }
    }
}

/// `kiln bench-retriever`: index build time, QPS, recall, server latency.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Corpus file(s) to index and query.
    #[arg(long, required_unless_present = "url")]
    pub corpus: Vec<PathBuf>,
    /// QA file with `question` and `supporting_passage_ids` (e.g. gold_context_union_qa.jsonl).
    #[arg(long)]
    pub queries: PathBuf,
    /// Index directory to build (default: a temporary directory, removed afterwards).
    #[arg(long)]
    pub index_dir: Option<PathBuf>,
    /// Indexing threads (0 = auto).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// k for the QPS measurements.
    #[arg(long, default_value_t = 10)]
    pub topk: usize,
    /// Passes over the questions for the QPS measurements.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Concurrent HTTP clients for the latency measurement.
    #[arg(long, default_value_t = 32)]
    pub clients: usize,
    /// Requests per client.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// JSON written by `scripts/retrieval/bench_bm25s.py --out FILE`, printed side by side (repeatable).
    #[arg(long)]
    pub peer: Vec<PathBuf>,
    /// Write the kiln figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Bearer token: the benchmark's server requires it and its clients send it.
    #[arg(long, env = "KILN_RETRIEVER_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Only run the latency measurement, against this running server (`http://HOST:PORT/retrieve`), instead of
    /// building an index and starting a server (`--corpus` is then not read).
    #[arg(long)]
    pub url: Option<String>,
    /// Idle connections to open to the server before the latency measurement (kept open during it); the
    /// benchmark reports how fast `/health` answers a new client meanwhile. Needs `ulimit -n` above twice this
    /// when the benchmark starts its own server.
    #[arg(long, default_value_t = 0)]
    pub idle_connections: usize,
    /// Also measure dense (exact and HNSW) and hybrid retrieval on the same index and questions: the passages are
    /// embedded with `--encoder` (reused when `--index-dir` already holds them), then recall@3/@10, batch QPS and
    /// server latency of BM25, dense and hybrid side by side.
    #[arg(long)]
    pub dense: bool,
    /// Re-embed the passages even when `--index-dir` holds embeddings of this encoder.
    #[arg(long)]
    pub rebuild_dense: bool,
    /// Keep a copy of the embeddings here and reuse it in later runs (`--dense`; the benchmark's BM25 build
    /// replaces the index directory).
    #[arg(long)]
    pub dense_cache: Option<PathBuf>,
    /// Passages per encoder batch (`--dense`).
    #[arg(long, default_value_t = 32)]
    pub encode_batch: usize,
    /// Settings of the dense / hybrid rows (`--dense`); `--kind` is ignored here.
    #[command(flatten)]
    pub search: SearchArgs,
    /// Write the dense figures as JSON here (`--dense`).
    #[arg(long)]
    pub dense_json: Option<PathBuf>,
}

/// Run `kiln index`.
pub fn run_index(args: IndexArgs) -> Result<(), CliError> {
    let opts = BuildOptions {
        threads: args.threads,
        heap_mb_per_thread: args.heap_mb,
        bad_lines: if args.strict {
            BadLinePolicy::Fail
        } else {
            BadLinePolicy::Skip
        },
        progress: true,
        merge: !args.no_merge,
        max_line_bytes: args.max_line_bytes,
    };
    let dense = args.dense || args.hybrid;
    // Load the encoder first: a wrong name fails before minutes of indexing.
    let encoder = if dense {
        Some(load_encoder(&args.encoder)?)
    } else {
        None
    };
    let s = build_index(&args.corpus, &args.out, &opts)?;
    println!(
        "indexed {} passages into {} in {:.2} s ({:.0} docs/s, {} threads); skipped {} bad lines, {} duplicate ids",
        s.docs,
        args.out.display(),
        s.seconds,
        s.docs_per_sec,
        s.threads,
        s.skipped_lines,
        s.duplicate_ids
    );
    if let Some(encoder) = encoder {
        let d = build_dense(
            &args.corpus,
            &args.out,
            &*encoder,
            &args.encoder,
            &DenseBuildOptions {
                dtype: if args.f16 { Dtype::F16 } else { Dtype::F32 },
                batch_size: args.encode_batch,
                bad_lines: opts.bad_lines,
                progress: true,
            },
        )?;
        println!(
            "embedded {} passages with {} ({} dims, {}) in {:.1} s ({:.1} passages/s); search with --kind dense|hybrid",
            d.rows,
            args.encoder,
            d.dim,
            if args.f16 { "f16" } else { "f32" },
            d.seconds,
            d.passages_per_sec
        );
    }
    Ok(())
}

/// Run `kiln serve-retriever` until SIGINT/SIGTERM.
pub fn run_serve(args: ServeArgs) -> Result<(), CliError> {
    let ip: IpAddr = args.host.parse().map_err(|e| {
        CliError::Usage(format!("--host {:?} is not an IP address: {e}", args.host))
    })?;
    if !ip.is_loopback() {
        tracing::warn!(
            "binding {ip}: the retriever is reachable from other machines{}",
            if args.token.is_some() {
                ""
            } else {
                " and has no --token"
            }
        );
    }
    let cfg = args.server_config();
    cfg.validate()?;
    let retriever = open_local(&args.search.config(&args.index))?;
    let num_docs = retriever.passage_count().unwrap_or(0);
    let kind = args.search.kind;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Usage(format!("cannot start tokio runtime: {e}")))?;
    rt.block_on(async move {
        let addr = SocketAddr::new(ip, args.port);
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::Server(format!("cannot bind {addr}: {e}")))?;
        let bound = listener.local_addr().map_err(|e| Error::Server(e.to_string()))?;
        println!(
            "serving {num_docs} passages ({kind}) on http://{bound}/retrieve (GET /health){}; Ctrl-C to stop",
            if cfg.token.is_some() { ", bearer token required" } else { "" }
        );
        serve(listener, retriever, cfg, shutdown_signal()).await
    })?;
    println!("retriever stopped");
    Ok(())
}

/// Run `kiln bench-retriever`.
pub fn run_bench(args: BenchArgs) -> Result<(), CliError> {
    let tmp;
    let index_dir = match &args.index_dir {
        _ if args.url.is_some() => PathBuf::new(),
        Some(d) => d.clone(),
        None => {
            tmp = tempfile_dir()?;
            tmp.join("index")
        }
    };
    let cfg = BenchConfig {
        corpus: args.corpus,
        queries: args.queries,
        index_dir: index_dir.clone(),
        index_threads: args.threads,
        topk: args.topk,
        rounds: args.rounds,
        clients: args.clients,
        requests_per_client: args.requests,
        peers: args.peer,
        token: args.token.filter(|t| !t.is_empty()),
        url: args.url,
        idle_connections: args.idle_connections,
    };
    if let Some(url) = &cfg.url {
        let lat = crate::bench::run_load_only(&cfg, url)?;
        if let Some(p) = args.json {
            let text =
                serde_json::to_string_pretty(&lat).map_err(|e| CliError::Usage(e.to_string()))?;
            std::fs::write(&p, text).map_err(|e| Error::io(&p, e))?;
        }
        return Ok(());
    }
    let result = crate::bench::run(&cfg).and_then(|r| {
        if !args.dense {
            return Ok((r, None));
        }
        let sc = args.search.config(&index_dir);
        let d = crate::bench::run_dense(&crate::bench::DenseBenchConfig {
            corpus: cfg.corpus.clone(),
            queries: cfg.queries.clone(),
            index_dir: index_dir.clone(),
            encoder: args
                .search
                .encoder
                .clone()
                .unwrap_or_else(|| DEFAULT_ENCODER.to_string()),
            encode_batch: args.encode_batch,
            rebuild: args.rebuild_dense,
            cache: args.dense_cache.clone(),
            hnsw: match sc.ann {
                Ann::Hnsw(p) => p,
                Ann::Exact => HnswParams {
                    m: args.search.hnsw_m,
                    ef_construction: args.search.ef_construction,
                    ef_search: args.search.ef_search,
                },
            },
            fusion: sc.fusion,
            clients: cfg.clients,
            requests_per_client: cfg.requests_per_client,
        })?;
        Ok((r, Some(d)))
    });
    if let (None, Some(parent)) = (&args.index_dir, index_dir.parent()) {
        let _ = std::fs::remove_dir_all(parent);
    }
    let (report, dense) = result?;
    if let (Some(p), Some(d)) = (&args.dense_json, &dense) {
        let text = serde_json::to_string_pretty(d).map_err(|e| CliError::Usage(e.to_string()))?;
        std::fs::write(p, text).map_err(|e| Error::io(p, e))?;
    }
    if let Some(p) = args.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| CliError::Usage(e.to_string()))?;
        std::fs::write(&p, text).map_err(|e| Error::io(&p, e))?;
    }
    Ok(())
}

fn tempfile_dir() -> Result<PathBuf, CliError> {
    let dir = std::env::temp_dir().join(format!("kiln-bench-retriever-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IndexRetriever;
    use std::io::Write;

    fn args(corpus: PathBuf, out: PathBuf, strict: bool) -> IndexArgs {
        IndexArgs {
            corpus: vec![corpus],
            out,
            threads: 1,
            heap_mb: 15,
            strict,
            no_merge: false,
            max_line_bytes: DEFAULT_MAX_LINE_BYTES,
            dense: false,
            hybrid: false,
            encoder: DEFAULT_ENCODER.into(),
            f16: false,
            encode_batch: 32,
        }
    }

    #[test]
    fn index_command_on_gzipped_search_r1_corpus() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("wiki.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&corpus).unwrap(),
            flate2::Compression::default(),
        );
        for i in 0..50 {
            writeln!(
                gz,
                r#"{{"id": "{i}", "contents": "\"Topic {i}\"\nPassage number {i} about subject{i}."}}"#
            )
            .unwrap();
        }
        writeln!(gz, "{{\"id\": \"x\"").unwrap();
        gz.finish().unwrap();
        let out = dir.path().join("index");
        run_index(args(corpus.clone(), out.clone(), false)).unwrap();
        // Idempotent: a second run replaces the first.
        run_index(args(corpus.clone(), out.clone(), false)).unwrap();
        let r = IndexRetriever::open(&out).unwrap();
        assert_eq!(r.num_docs(), 50);
        let hit = &r.search("subject7", 1).unwrap()[0];
        assert_eq!((hit.id.as_str(), hit.title.as_str()), ("7", "Topic 7"));
        let e = run_index(args(corpus, dir.path().join("strict"), true)).unwrap_err();
        assert!(e.to_string().contains("wiki.jsonl.gz:51:"), "{e}");
        let e = run_index(args(dir.path().join("missing.jsonl"), out, false)).unwrap_err();
        assert!(e.to_string().contains("missing.jsonl"), "{e}");
    }

    #[derive(clap::Parser)]
    enum TestCli {
        Index(IndexArgs),
        ServeRetriever(ServeArgs),
        BenchRetriever(BenchArgs),
    }

    #[test]
    fn clap_definitions_are_valid_and_parse() {
        use clap::{CommandFactory, Parser};
        TestCli::command().debug_assert();
        let c = TestCli::try_parse_from([
            "kiln",
            "serve-retriever",
            "--index",
            "i",
            "--port",
            "0",
            "--token",
            "t",
        ])
        .unwrap();
        assert!(
            matches!(c, TestCli::ServeRetriever(a) if a.token.as_deref() == Some("t") && a.host == "127.0.0.1")
        );
        let c = TestCli::try_parse_from([
            "kiln",
            "bench-retriever",
            "--corpus",
            "a",
            "--corpus",
            "b",
            "--queries",
            "q",
        ])
        .unwrap();
        assert!(matches!(c, TestCli::BenchRetriever(a) if a.corpus.len() == 2 && a.clients == 32));
    }

    /// The flags' defaults are [`ServerConfig::default`] (so the documented defaults hold for the command too).
    #[test]
    fn serve_flag_defaults_match_server_config_defaults() {
        use clap::Parser;
        let TestCli::ServeRetriever(a) =
            TestCli::try_parse_from(["kiln", "serve-retriever", "--index", "i"]).unwrap()
        else {
            panic!("parsed another command")
        };
        assert_eq!(
            format!("{:?}", a.server_config()),
            format!("{:?}", ServerConfig::default())
        );
        let TestCli::ServeRetriever(a) = TestCli::try_parse_from([
            "kiln",
            "serve-retriever",
            "--index",
            "i",
            "--header-read-timeout",
            "0.25",
            "--max-connections",
            "7",
        ])
        .unwrap() else {
            panic!("parsed another command")
        };
        let c = a.server_config();
        assert_eq!(c.header_read_timeout, Duration::from_millis(250));
        assert_eq!(c.max_connections, 7);
        let e = TestCli::try_parse_from([
            "kiln",
            "serve-retriever",
            "--index",
            "i",
            "--idle-timeout",
            "0",
        ])
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("above 0"), "{e}");
    }

    #[test]
    fn index_command_stops_at_an_over_long_line() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = dir.path().join("c.jsonl");
        let mut f = std::fs::File::create(&corpus).unwrap();
        writeln!(f, r#"{{"id": "1", "text": "fine"}}"#).unwrap();
        writeln!(f, r#"{{"id": "2", "text": "{}"}}"#, "x".repeat(5000)).unwrap();
        drop(f);
        let mut a = args(corpus, dir.path().join("index"), false);
        a.max_line_bytes = 1000;
        let e = run_index(a).unwrap_err().to_string();
        assert!(
            e.contains("c.jsonl:2:") && e.contains("1000 bytes") && e.contains("--max-line-bytes"),
            "{e}"
        );
    }

    #[test]
    fn serve_rejects_bad_host() {
        use clap::Parser;
        let e = run_serve(ServeArgs {
            index: PathBuf::from("/nonexistent"),
            search: TestCli::try_parse_from(["t", "serve-retriever", "--index", "x"])
                .map(|c| match c {
                    TestCli::ServeRetriever(a) => a.search,
                    _ => unreachable!(),
                })
                .unwrap(),
            host: "not-an-ip".into(),
            port: 0,
            token: None,
            default_topk: 3,
            max_topk: 100,
            max_queries: 10,
            max_query_bytes: 100,
            max_body_bytes: 1000,
            max_results: 100,
            max_response_bytes: 1000,
            max_pending_response_bytes: 1000,
            max_concurrent_searches: 0,
            max_connections: 10,
            header_read_timeout: Duration::from_secs(1),
            body_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
        })
        .unwrap_err();
        assert!(e.to_string().contains("--host"), "{e}");
    }
}
