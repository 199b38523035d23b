//! `kiln bench-retriever`: index build time, single-thread and batch QPS, recall@k, and server p50/p99 latency
//! under concurrent clients; optionally side by side with the Python peer `bm25s`
//! (`scripts/retrieval/bench_bm25s.py --out FILE`, then `--peer FILE`). It measures and prints; it asserts nothing.
//!
//! With `--url` only the latency measurement runs, against an already running server (e.g. another build of
//! `kiln serve-retriever`); with `--idle-connections N` it first opens N idle connections and reports how fast
//! `/health` answers a new client while they are open.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::eval::{QaItem, RecallAt, load_qa, recall_at};
use crate::index::{BuildOptions, BuildStats, IndexRetriever, build_index};
use crate::server::{ServerConfig, spawn};
use crate::{Error, Retriever};

/// What to benchmark.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Corpus files.
    pub corpus: Vec<PathBuf>,
    /// QA file with `question` and `supporting_passage_ids`.
    pub queries: PathBuf,
    /// Where to build the index (replaced if it is a kiln index).
    pub index_dir: PathBuf,
    /// Indexing threads (0 = auto).
    pub index_threads: usize,
    /// k for the QPS measurements.
    pub topk: usize,
    /// Passes over the question set for the single-thread QPS measurement.
    pub rounds: usize,
    /// Concurrent HTTP clients.
    pub clients: usize,
    /// Requests per client (one query each, topk 3 with scores, as Search-R1's trainer sends).
    pub requests_per_client: usize,
    /// Results of the bm25s peer script (one file per run, e.g. per bm25s backend), printed side by side.
    pub peers: Vec<PathBuf>,
    /// Bearer token the server requires and the clients send.
    pub token: Option<String>,
    /// Measure only the latency of this running server's `/retrieve` (no index build, no QPS).
    pub url: Option<String>,
    /// Idle connections held open during the latency measurement.
    pub idle_connections: usize,
}

/// Server latency figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LatencyReport {
    /// Concurrent clients.
    pub clients: usize,
    /// Requests sent in all.
    pub requests: usize,
    /// Requests answered 2xx.
    pub ok: usize,
    /// Median latency in milliseconds.
    pub p50_ms: f64,
    /// 99th percentile latency in milliseconds.
    pub p99_ms: f64,
    /// Requests per second over the whole run.
    pub rps: f64,
    /// Whether the clients sent a bearer token.
    pub token: bool,
    /// Idle connections opened before the run.
    pub idle_connections: usize,
    /// Of those, how many the server still held open after the run (it closes the longest-idle ones beyond its
    /// connection cap).
    pub idle_connections_kept: usize,
    /// `/health` latency of a new client while the idle connections were open: median and maximum of
    /// [`HEALTH_PROBES`] probes in milliseconds (`None` without idle connections or if a probe failed).
    pub health_p50_ms: Option<f64>,
    /// See `health_p50_ms`.
    pub health_max_ms: Option<f64>,
}

/// `/health` probes made while the idle connections are open.
pub const HEALTH_PROBES: usize = 20;

/// One `GET /health` on a new connection; its latency in milliseconds, or `None` if it failed or took over 10 s.
pub fn health_probe(addr: SocketAddr) -> Option<f64> {
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: kiln\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    out.starts_with(b"HTTP/1.1 200")
        .then(|| t.elapsed().as_secs_f64() * 1e3)
}

/// Opens `n` connections to `addr` that send nothing (stops early if the client runs out of file descriptors).
pub fn open_idle_connections(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => out.push(s),
            Err(e) => {
                println!("idle connections: stopped after {i} of {n}: {e} (raise `ulimit -n`?)");
                break;
            }
        }
    }
    out
}

/// How many of `conns` the server has not closed (a non-blocking read finds neither EOF nor an error).
pub fn still_open(conns: &[TcpStream]) -> usize {
    conns
        .iter()
        .filter(|s| {
            let _ = s.set_nonblocking(true);
            let mut b = [0u8; 1];
            matches!((&**s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count()
}

/// Everything `kiln bench-retriever` measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchReport {
    /// Index build statistics.
    pub build: BuildStats,
    /// Questions used.
    pub questions: usize,
    /// Single-thread queries/s (wall clock), full passages returned (top `topk`).
    pub qps_single: f64,
    /// Single-thread queries per CPU-second of the searching thread, full passages returned.
    pub qps_single_cpu: Option<f64>,
    /// Single-thread queries/s, ids and scores only (no stored-text loading).
    pub qps_single_ids: f64,
    /// Single-thread queries per CPU-second, ids and scores only (what `bm25s` returns).
    pub qps_single_ids_cpu: Option<f64>,
    /// Queries/s of one `search_batch` over all questions on all cores.
    pub qps_batch: f64,
    /// Threads available to the batch measurement.
    pub batch_threads: usize,
    /// recall@3 and recall@10.
    pub recall: Vec<RecallAt>,
    /// Server latency under concurrent clients.
    pub server: LatencyReport,
}

/// The figures the bm25s peer script writes (`--out`).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct PeerReport {
    /// Peer name and version.
    pub name: String,
    /// Index build seconds.
    pub index_seconds: f64,
    /// Single-thread queries/s (wall clock).
    pub qps_single: f64,
    /// Single-thread queries per CPU-second of the process, if measured.
    #[serde(default)]
    pub qps_single_cpu: Option<f64>,
    /// Queries/s with all threads, if measured.
    #[serde(default)]
    pub qps_batch: Option<f64>,
    /// recall@3.
    pub recall_at_3: f64,
    /// recall@10.
    pub recall_at_10: f64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Fires `clients` x `per_client` single-query requests at `url` (with `token` as bearer token, if any) and
/// measures latency. With `idle_connections > 0` it first opens that many idle connections, probes `/health` while
/// they are open, and keeps them open during the run.
pub fn load_test(
    url: &str,
    token: Option<&str>,
    questions: &[String],
    clients: usize,
    per_client: usize,
    idle_connections: usize,
) -> LatencyReport {
    let addr = url
        .strip_prefix("http://")
        .and_then(|rest| rest.split('/').next())
        .and_then(|hp| hp.to_socket_addrs().ok())
        .and_then(|mut a| a.next());
    let idle = match (addr, idle_connections) {
        (Some(a), n) if n > 0 => open_idle_connections(a, n),
        _ => Vec::new(),
    };
    let mut health: Vec<f64> = Vec::new();
    if let (Some(a), false) = (addr, idle.is_empty()) {
        std::thread::sleep(Duration::from_millis(200));
        health = (0..HEALTH_PROBES).filter_map(|_| health_probe(a)).collect();
        health.sort_by(|a, b| a.total_cmp(b));
    }
    let health_ok = !idle.is_empty() && health.len() == HEALTH_PROBES;
    let start = Instant::now();
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            let url = url.to_string();
            let token = token.map(|t| format!("Bearer {t}"));
            let qs: Vec<String> = questions.to_vec();
            std::thread::spawn(move || {
                let client = reqwest::blocking::Client::builder()
                    .timeout(Duration::from_secs(60))
                    .build();
                let mut lat = Vec::with_capacity(per_client);
                let mut ok = 0usize;
                let Ok(client) = client else {
                    return (lat, ok);
                };
                for i in 0..per_client {
                    let q = &qs[(c * per_client + i) % qs.len().max(1)];
                    let body =
                        serde_json::json!({"queries": [q], "topk": 3, "return_scores": true});
                    let t = Instant::now();
                    let mut req = client.post(&url).json(&body);
                    if let Some(t) = &token {
                        req = req.header("authorization", t);
                    }
                    let r = req.send().and_then(|r| {
                        let s = r.status();
                        r.bytes().map(|_| s)
                    });
                    lat.push(t.elapsed().as_secs_f64() * 1e3);
                    if matches!(r, Ok(s) if s.is_success()) {
                        ok += 1;
                    }
                }
                (lat, ok)
            })
        })
        .collect();
    let mut all = Vec::new();
    let mut ok = 0;
    for h in handles {
        if let Ok((l, o)) = h.join() {
            all.extend(l);
            ok += o;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    all.sort_by(|a, b| a.total_cmp(b));
    let kept = still_open(&idle);
    LatencyReport {
        clients,
        requests: clients * per_client,
        ok,
        p50_ms: percentile(&all, 50.0),
        p99_ms: percentile(&all, 99.0),
        rps: all.len() as f64 / secs.max(1e-9),
        token: token.is_some(),
        idle_connections: idle.len(),
        idle_connections_kept: kept,
        health_p50_ms: health_ok.then(|| percentile(&health, 50.0)),
        health_max_ms: health_ok.then(|| health[health.len() - 1]),
    }
}

fn print_latency(lat: &LatencyReport, per_client: usize) {
    println!(
        "server: {} clients x {per_client} requests{}: {}/{} ok ({} errors), p50 {:.2} ms, p99 {:.2} ms, {:.0} req/s",
        lat.clients,
        if lat.token { " with a token" } else { "" },
        lat.ok,
        lat.requests,
        lat.requests - lat.ok,
        lat.p50_ms,
        lat.p99_ms,
        lat.rps
    );
    if lat.idle_connections > 0 {
        match (lat.health_p50_ms, lat.health_max_ms) {
            (Some(p50), Some(max)) => println!(
                "/health with {} idle connections open: p50 {p50:.2} ms, max {max:.2} ms over {HEALTH_PROBES} \
                 probes; the server kept {} of them open",
                lat.idle_connections, lat.idle_connections_kept
            ),
            _ => println!(
                "/health with {} idle connections open: a probe FAILED or took over 10 s",
                lat.idle_connections
            ),
        }
    }
}

/// Only the latency measurement, against the running server at `url` (`kiln bench-retriever --url`).
pub fn run_load_only(cfg: &BenchConfig, url: &str) -> Result<LatencyReport, Error> {
    let qa = load_qa(&cfg.queries)?;
    if qa.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: no questions",
            cfg.queries.display()
        )));
    }
    let queries: Vec<String> = qa.into_iter().map(|q| q.question).collect();
    let lat = load_test(
        url,
        cfg.token.as_deref(),
        &queries,
        cfg.clients,
        cfg.requests_per_client,
        cfg.idle_connections,
    );
    print_latency(&lat, cfg.requests_per_client);
    Ok(lat)
}

/// CPU time consumed by the calling thread, in nanoseconds (Linux `/proc/thread-self/schedstat`; `None` elsewhere).
/// On a shared machine this is steadier than wall-clock time.
pub fn thread_cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Single-thread QPS: (wall-clock, CPU-time if measurable).
fn qps_single(
    r: &IndexRetriever,
    qa: &[QaItem],
    k: usize,
    rounds: usize,
    ids_only: bool,
) -> Result<(f64, Option<f64>), Error> {
    // Warm-up pass (page cache, allocator).
    for q in qa {
        r.search_hits(&q.question, k)?;
    }
    let t = Instant::now();
    let cpu0 = thread_cpu_ns();
    let mut n = 0usize;
    for _ in 0..rounds.max(1) {
        for q in qa {
            if ids_only {
                std::hint::black_box(r.search_hits(&q.question, k)?);
            } else {
                std::hint::black_box(r.search_one(&q.question, k)?);
            }
            n += 1;
        }
    }
    let wall = n as f64 / t.elapsed().as_secs_f64().max(1e-9);
    let cpu = match (cpu0, thread_cpu_ns()) {
        (Some(a), Some(b)) if b > a => Some(n as f64 / ((b - a) as f64 * 1e-9)),
        _ => None,
    };
    Ok((wall, cpu))
}

/// Runs the whole benchmark and prints a report to stdout.
pub fn run(cfg: &BenchConfig) -> Result<BenchReport, Error> {
    let qa = load_qa(&cfg.queries)?;
    if qa.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: no questions",
            cfg.queries.display()
        )));
    }
    let opts = BuildOptions {
        threads: cfg.index_threads,
        ..Default::default()
    };
    let build = build_index(&cfg.corpus, &cfg.index_dir, &opts)?;
    println!(
        "index build: {} docs in {:.2} s ({:.0} docs/s, {} threads)",
        build.docs, build.seconds, build.docs_per_sec, build.threads
    );
    let r = Arc::new(IndexRetriever::open(&cfg.index_dir)?);
    let (qps1, qps1_cpu) = qps_single(&r, &qa, cfg.topk, cfg.rounds, false)?;
    let (qps1_ids, qps1_ids_cpu) = qps_single(&r, &qa, cfg.topk, cfg.rounds, true)?;
    let queries: Vec<String> = qa.iter().map(|q| q.question.clone()).collect();
    let t = Instant::now();
    let mut n = 0;
    for _ in 0..cfg.rounds.max(1) {
        std::hint::black_box(r.search_batch(&queries, cfg.topk)?);
        n += queries.len();
    }
    let qps_b = n as f64 / t.elapsed().as_secs_f64().max(1e-9);
    let batch_threads = rayon::current_num_threads();
    let recall = recall_at(&*r, &qa, &[3, 10])?;
    println!(
        "search (k={}): single-thread {qps1:.0} q/s wall{} (passages), {qps1_ids:.0} q/s (ids only); batch {qps_b:.0} q/s on {batch_threads} threads",
        cfg.topk,
        qps1_cpu
            .map(|c| format!(", {c:.0} q/CPU-s"))
            .unwrap_or_default()
    );
    for x in &recall {
        println!(
            "recall@{}: {:.4} (all supporting found: {:.4}) over {} questions",
            x.k, x.recall, x.all, x.questions
        );
    }
    let server = spawn(
        r.clone() as Arc<dyn Retriever>,
        ServerConfig {
            token: cfg.token.clone(),
            ..Default::default()
        },
        SocketAddr::from(([127, 0, 0, 1], 0)),
        0,
    )?;
    let lat = load_test(
        &server.retrieve_url(),
        cfg.token.as_deref(),
        &queries,
        cfg.clients,
        cfg.requests_per_client,
        cfg.idle_connections,
    );
    server.shutdown()?;
    print_latency(&lat, cfg.requests_per_client);
    let report = BenchReport {
        build,
        questions: qa.len(),
        qps_single: qps1,
        qps_single_cpu: qps1_cpu,
        qps_single_ids: qps1_ids,
        qps_single_ids_cpu: qps1_ids_cpu,
        qps_batch: qps_b,
        batch_threads,
        recall,
        server: lat,
    };
    for p in &cfg.peers {
        print_side_by_side(&report, p)?;
    }
    Ok(report)
}

fn print_side_by_side(k: &BenchReport, peer_path: &Path) -> Result<(), Error> {
    let text = std::fs::read_to_string(peer_path).map_err(|e| Error::io(peer_path, e))?;
    let p: PeerReport = serde_json::from_str(&text).map_err(|e| Error::BadLine {
        path: peer_path.to_path_buf(),
        line: e.line(),
        msg: format!("not a bench_bm25s.py report: {e}"),
    })?;
    let r3 = k
        .recall
        .iter()
        .find(|x| x.k == 3)
        .map(|x| x.recall)
        .unwrap_or(f64::NAN);
    let r10 = k
        .recall
        .iter()
        .find(|x| x.k == 10)
        .map(|x| x.recall)
        .unwrap_or(f64::NAN);
    println!();
    println!("{:<28} {:>14} {:>14} {:>10}", "", "kiln", &p.name, "ratio");
    println!(
        "{:<28} {:>14.2} {:>14.2} {:>10.2}",
        "index build (s)",
        k.build.seconds,
        p.index_seconds,
        p.index_seconds / k.build.seconds.max(1e-9)
    );
    println!(
        "{:<28} {:>14.0} {:>14.0} {:>9.2}x",
        "QPS single-thread (wall)",
        k.qps_single,
        p.qps_single,
        k.qps_single / p.qps_single.max(1e-9)
    );
    let cpu_ratio = match (k.qps_single_cpu, p.qps_single_cpu) {
        (Some(kc), Some(pc)) => {
            println!(
                "{:<28} {:>14.0} {:>14.0} {:>9.2}x",
                "QPS single-thread (CPU time)",
                kc,
                pc,
                kc / pc.max(1e-9)
            );
            if let Some(ki) = k.qps_single_ids_cpu {
                println!(
                    "{:<28} {:>14.0} {:>14.0} {:>9.2}x",
                    "  ids only (CPU time)",
                    ki,
                    pc,
                    ki / pc.max(1e-9)
                );
            }
            Some(kc / pc.max(1e-9))
        }
        _ => None,
    };
    if let Some(pb) = p.qps_batch {
        println!(
            "{:<28} {:>14.0} {:>14.0} {:>9.2}x",
            "QPS batch (all threads)",
            k.qps_batch,
            pb,
            k.qps_batch / pb.max(1e-9)
        );
    }
    println!(
        "{:<28} {:>14.4} {:>14.4} {:>+10.4}",
        "recall@3",
        r3,
        p.recall_at_3,
        r3 - p.recall_at_3
    );
    println!(
        "{:<28} {:>14.4} {:>14.4} {:>+10.4}",
        "recall@10",
        r10,
        p.recall_at_10,
        r10 - p.recall_at_10
    );
    let ratio = k.qps_single / p.qps_single.max(1e-9);
    let recall_ok = r10 >= p.recall_at_10 - 0.02;
    let verdict = |r: f64| {
        if r >= 2.0 && recall_ok {
            "met"
        } else {
            "NOT met"
        }
    };
    println!(
        "target (single-thread QPS >= 2x {} at recall@10 >= peer - 2 pts): wall clock {}{}",
        p.name,
        verdict(ratio),
        cpu_ratio
            .map(|r| format!(", CPU time {}", verdict(r)))
            .unwrap_or_default()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// Dense and hybrid (`kiln bench-retriever --dense`)
// ---------------------------------------------------------------------------------------------------------------

/// What `kiln bench-retriever --dense` measures, over an index directory whose BM25 part exists.
#[derive(Debug, Clone)]
pub struct DenseBenchConfig {
    /// Corpus files (embedded when the index has no dense part for `encoder`).
    pub corpus: Vec<PathBuf>,
    /// QA file with `question` and `supporting_passage_ids`.
    pub queries: PathBuf,
    /// Index directory (BM25 built; the dense part is built here when missing).
    pub index_dir: PathBuf,
    /// Sentence encoder (name or folder).
    pub encoder: String,
    /// Passages per encoder batch.
    pub encode_batch: usize,
    /// Re-embed even when a dense part with this encoder exists.
    pub rebuild: bool,
    /// A folder keeping a copy of the dense part between runs (the BM25 build of the benchmark replaces the
    /// index directory, dense part included): reused when it holds embeddings of the same encoder and corpus files.
    pub cache: Option<PathBuf>,
    /// HNSW parameters of the approximate row.
    pub hnsw: crate::dense::HnswParams,
    /// Fusion of the hybrid row.
    pub fusion: crate::dense::FusionConfig,
    /// Concurrent HTTP clients.
    pub clients: usize,
    /// Requests per client.
    pub requests_per_client: usize,
}

/// One retriever's row of the dense benchmark.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DenseRow {
    /// `bm25`, `dense (exact)`, `dense (HNSW)`, `hybrid`.
    pub name: String,
    /// recall@3 and recall@10.
    pub recall: Vec<RecallAt>,
    /// Queries/s of one `search_batch` over all questions (query encoding included).
    pub qps_batch: f64,
    /// Server latency under concurrent clients (one query per request, query encoding included).
    pub server: LatencyReport,
}

/// Everything `kiln bench-retriever --dense` measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DenseBenchReport {
    /// The dense part's metadata (rows, dim, encoder, embedding seconds and passages/s when built here).
    pub meta: crate::dense::DenseMeta,
    /// Whether the embeddings were computed by this run (else `meta` holds the figures of the earlier build).
    pub embedded_here: bool,
    /// HNSW build seconds.
    pub hnsw_build_seconds: f64,
    /// Share of the exact top-10 that HNSW returns (same query vectors).
    pub hnsw_recall_at_10_vs_exact: f64,
    /// One row per retriever.
    pub rows: Vec<DenseRow>,
}

/// Builds the dense part if needed, then measures BM25, dense (exact), dense (HNSW) and hybrid side by side.
pub fn run_dense(cfg: &DenseBenchConfig) -> Result<DenseBenchReport, Error> {
    use crate::dense::{
        Ann, DenseBuildOptions, DenseRetriever, HybridRetriever, build_dense, read_meta,
    };
    let qa = load_qa(&cfg.queries)?;
    let encoder = crate::encoder::load_encoder(&cfg.encoder)?;
    let dense_dir = cfg.index_dir.join(crate::dense::DENSE_DIR);
    if let Some(cache) = &cfg.cache
        && !cfg.rebuild
        && !dense_dir.exists()
    {
        let fits = std::fs::read_to_string(cache.join(crate::dense::META_FILE))
            .ok()
            .and_then(|t| serde_json::from_str::<crate::dense::DenseMeta>(&t).ok())
            .is_some_and(|m| m.fingerprint == encoder.fingerprint() && m.corpus == cfg.corpus);
        if fits {
            copy_files(cache, &dense_dir)?;
            println!("dense part reused from {}", cache.display());
        }
    }
    let have = read_meta(&cfg.index_dir)
        .ok()
        .filter(|m| m.fingerprint == encoder.fingerprint());
    let embedded_here = cfg.rebuild || have.is_none();
    if embedded_here {
        let m = build_dense(
            &cfg.corpus,
            &cfg.index_dir,
            &*encoder,
            &cfg.encoder,
            &DenseBuildOptions {
                batch_size: cfg.encode_batch,
                ..Default::default()
            },
        )?;
        println!(
            "dense build: {} passages embedded with {} ({} dims) in {:.1} s: {:.1} passages/s on {} threads",
            m.rows,
            cfg.encoder,
            m.dim,
            m.seconds,
            m.passages_per_sec,
            rayon::current_num_threads()
        );
        if let Some(cache) = &cfg.cache {
            if cache.exists() {
                std::fs::remove_dir_all(cache).map_err(|e| Error::io(cache, e))?;
            }
            copy_files(&dense_dir, cache)?;
        }
    }
    let meta = read_meta(&cfg.index_dir)?;
    let exact = DenseRetriever::open(&cfg.index_dir, encoder.clone(), Ann::Exact)?;
    let hnsw = DenseRetriever::open(&cfg.index_dir, encoder.clone(), Ann::Hnsw(cfg.hnsw))?;
    let hnsw_build_seconds = hnsw.hnsw().map(|h| h.build_seconds()).unwrap_or(0.0);
    println!(
        "HNSW (m {}, ef_construction {}, ef_search {}) built in {hnsw_build_seconds:.1} s",
        cfg.hnsw.m, cfg.hnsw.ef_construction, cfg.hnsw.ef_search
    );
    let queries: Vec<String> = qa.iter().map(|q| q.question.clone()).collect();
    let qv = exact.encode_queries(&queries)?;
    let a = exact.search_vectors(&qv, 10);
    let b = hnsw.search_vectors(&qv, 10);
    let (found, total) = a.iter().zip(&b).fold((0usize, 0usize), |(f, t), (x, y)| {
        (
            f + x.iter().filter(|e| y.iter().any(|g| g.0 == e.0)).count(),
            t + x.len(),
        )
    });
    let hnsw_recall = found as f64 / total.max(1) as f64;
    let hybrid = HybridRetriever::new(
        IndexRetriever::open(&cfg.index_dir)?,
        DenseRetriever::open(&cfg.index_dir, encoder.clone(), Ann::Exact)?,
        cfg.fusion,
    )?;
    let retrievers: Vec<(&str, Arc<dyn Retriever>)> = vec![
        ("bm25", Arc::new(IndexRetriever::open(&cfg.index_dir)?)),
        ("dense (exact)", Arc::new(exact)),
        ("dense (HNSW)", Arc::new(hnsw)),
        ("hybrid (RRF)", Arc::new(hybrid)),
    ];
    let mut rows = Vec::new();
    for (name, r) in retrievers {
        let recall = recall_at(&*r, &qa, &[3, 10])?;
        let t = Instant::now();
        std::hint::black_box(r.search_batch(&queries, 10)?);
        let qps_batch = queries.len() as f64 / t.elapsed().as_secs_f64().max(1e-9);
        let server = spawn(
            r.clone(),
            ServerConfig::default(),
            SocketAddr::from(([127, 0, 0, 1], 0)),
            0,
        )?;
        let lat = load_test(
            &server.retrieve_url(),
            None,
            &queries,
            cfg.clients,
            cfg.requests_per_client,
            0,
        );
        server.shutdown()?;
        rows.push(DenseRow {
            name: name.to_string(),
            recall,
            qps_batch,
            server: lat,
        });
    }
    let report = DenseBenchReport {
        meta,
        embedded_here,
        hnsw_build_seconds,
        hnsw_recall_at_10_vs_exact: hnsw_recall,
        rows,
    };
    print_dense(&report, qa.len(), cfg);
    Ok(report)
}

/// Copies the files of `from` (one level) into a new folder `to`.
fn copy_files(from: &Path, to: &Path) -> Result<(), Error> {
    std::fs::create_dir_all(to).map_err(|e| Error::io(to, e))?;
    for e in std::fs::read_dir(from).map_err(|e| Error::io(from, e))? {
        let e = e.map_err(|e| Error::io(from, e))?;
        if e.path().is_file() {
            let dst = to.join(e.file_name());
            std::fs::copy(e.path(), &dst).map_err(|err| Error::io(&dst, err))?;
        }
    }
    Ok(())
}

fn print_dense(r: &DenseBenchReport, questions: usize, cfg: &DenseBenchConfig) {
    let get = |row: &DenseRow, k: usize| {
        row.recall
            .iter()
            .find(|x| x.k == k)
            .map(|x| x.recall)
            .unwrap_or(f64::NAN)
    };
    println!();
    println!(
        "{} passages, {questions} questions, encoder {} ({} dims); server: {} clients x {} requests, k = 3",
        r.meta.rows, r.meta.encoder, r.meta.dim, cfg.clients, cfg.requests_per_client
    );
    println!(
        "{:<16} {:>9} {:>10} {:>12} {:>9} {:>9} {:>9}",
        "retriever", "recall@3", "recall@10", "batch q/s", "p50 ms", "p99 ms", "req/s"
    );
    for row in &r.rows {
        println!(
            "{:<16} {:>9.4} {:>10.4} {:>12.0} {:>9.2} {:>9.2} {:>9.0}",
            row.name,
            get(row, 3),
            get(row, 10),
            row.qps_batch,
            row.server.p50_ms,
            row.server.p99_ms,
            row.server.rps
        );
    }
    let bm25 = r.rows.iter().find(|x| x.name == "bm25").map(|x| get(x, 10));
    let hybrid = r
        .rows
        .iter()
        .find(|x| x.name.starts_with("hybrid"))
        .map(|x| get(x, 10));
    let exact = r
        .rows
        .iter()
        .find(|x| x.name == "dense (exact)")
        .map(|x| get(x, 10));
    let ann = r
        .rows
        .iter()
        .find(|x| x.name == "dense (HNSW)")
        .map(|x| get(x, 10));
    println!(
        "HNSW: {:.1} s to build, recall@10 vs exact (same query vectors) {:.4}",
        r.hnsw_build_seconds, r.hnsw_recall_at_10_vs_exact
    );
    if let (Some(b), Some(h), Some(e), Some(a)) = (bm25, hybrid, exact, ann) {
        let verdict = |ok: bool| if ok { "met" } else { "NOT met" };
        println!(
            "targets: hybrid recall@10 >= BM25 + 3 pts: {:+.1} pts, {}; HNSW recall@10 within 1 pt of exact: {:+.1} pts, {}",
            (h - b) * 100.0,
            verdict(h - b >= 0.03),
            (a - e) * 100.0,
            verdict(a - e >= -0.01)
        );
    }
    if r.embedded_here {
        println!(
            "embedding: {:.1} passages/s ({:.1} s for {} passages)",
            r.meta.passages_per_sec, r.meta.seconds, r.meta.rows
        );
    }
}
