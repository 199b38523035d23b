//! The Search-R1-compatible retrieval server behind `kiln serve-retriever` (tokio + hyper + axum), usable as a
//! library.
//!
//! API (the one Search-R1's trainer and its `retrieval_server.py` use):
//! - `POST /retrieve` with `{"queries": ["..", ..], "topk": 3, "return_scores": true}` answers
//!   `{"result": [[{"document": {"id": "..", "contents": "\"Title\"\ntext"}, "score": 12.3}, ..], ..]}`;
//!   with `"return_scores": false` (the default, as in Search-R1) each inner list holds the documents themselves.
//!   A missing, null or 0 `topk` means [`ServerConfig::default_topk`].
//! - `GET /health` answers `{"status": "ok", "num_docs": N}` (never requires the token).
//!
//! Every failure is a JSON `{"error": "..."}` naming the limit or field concerned: 401 (missing/wrong bearer token
//! when one is configured; checked before a byte of the body is read), 408 (body not received within
//! [`ServerConfig::body_timeout`]), 413 (body over [`ServerConfig::max_body_bytes`]), 400 (not JSON / not UTF-8 /
//! wrong shape), 422 (topk above [`ServerConfig::max_topk`] or negative, more than [`ServerConfig::max_queries`]
//! queries, a query over [`ServerConfig::max_query_bytes`], queries x topk over [`ServerConfig::max_results`], an
//! answer over [`ServerConfig::max_response_bytes`]), 503 (answers waiting for slow clients already hold
//! [`ServerConfig::max_pending_response_bytes`]; retry later), 404/405 for other routes and methods; 500 only if
//! the retriever fails.
//!
//! **Connections.** [`serve`] runs its own accept loop over hyper's HTTP/1.1 connection driver (instead of
//! `axum::serve`, which has no timers and no connection limit):
//! - a request head must arrive within [`ServerConfig::header_read_timeout`] of the server starting to wait for
//!   it (hyper's timer). That wait also covers a fresh or keep-alive connection on which nothing is sent, so a
//!   slowloris client or an idle connection is closed after this time;
//! - a connection on which no request is being handled and no byte has moved for [`ServerConfig::idle_timeout`]
//!   is closed (e.g. a client that never reads its answer);
//! - at most [`ServerConfig::max_connections`] connections are open. A new connection beyond the cap closes the
//!   open connection that has been idle longest (no request being handled), so idle or slowloris connections
//!   cannot lock clients out; if every connection is busy, the newcomer gets a 503 and is closed. Keep the cap
//!   below the open-file limit (`ulimit -n`): [`serve`] warns when it is not.
//!
//! **Searching.** Searches run on tokio's blocking thread pool (the async workers never search), at most
//! [`ServerConfig::max_concurrent_searches`] requests at a time; further requests wait asynchronously. Large
//! batches are searched and encoded in chunks, so the memory of one request stays within about
//! [`ServerConfig::max_response_bytes`] whatever it asks for.
//!
//! [`serve`] stops gracefully when its shutdown future resolves; [`shutdown_signal`] is SIGINT/SIGTERM.
//! [`spawn`] runs a server on its own runtime thread and returns the bound address (bind port 0 in tests).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use crate::{Error, Passage, Retriever};

/// Limits and options of the server. Every limit has a default fit for a trainer on the same machine or network;
/// `kiln serve-retriever` exposes each as a flag of the same name (`--max-connections`, ...).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// If set, `POST /retrieve` requires `Authorization: Bearer <token>` (checked before the body is read).
    pub token: Option<String>,
    /// Largest accepted request body in bytes (8 MiB).
    pub max_body_bytes: usize,
    /// Largest accepted `topk` (100).
    pub max_topk: usize,
    /// `topk` used when the request has none (or 0), as Search-R1's `retrieval_topk` (3).
    pub default_topk: usize,
    /// Most queries in one request (4,096).
    pub max_queries: usize,
    /// Longest accepted query in bytes ([`crate::index::MAX_QUERY_BYTES`]).
    pub max_query_bytes: usize,
    /// Most passages one request may ask for: number of queries x topk (16,384; e.g. 4,096 queries at topk 4).
    pub max_results: usize,
    /// Largest answer in bytes (32 MiB); a request whose passages would not fit gets a 422 (ask for fewer queries
    /// or a smaller topk). Must not exceed `max_pending_response_bytes`.
    pub max_response_bytes: usize,
    /// Bytes of answers held in memory at once, mostly those still being sent to clients (256 MiB). A request
    /// that would go over it gets a 503 so that clients that do not read cannot pile up memory.
    pub max_pending_response_bytes: usize,
    /// Requests searched at the same time (0 = 2 x CPUs).
    pub max_concurrent_searches: usize,
    /// Open connections at most (512). Keep it below the open-file limit (`ulimit -n`).
    pub max_connections: usize,
    /// Time for a request head (request line and headers) to arrive, counted from when the server starts waiting
    /// for it, so it also bounds how long a connection may stay open without sending a request (10 s).
    pub header_read_timeout: Duration,
    /// Time for the whole request body to arrive once its handler reads it (30 s); a slower body gets a 408.
    pub body_timeout: Duration,
    /// A connection with no request being handled and no byte moving in either direction for this long is
    /// closed, e.g. one whose client does not read its answer (30 s).
    pub idle_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            token: None,
            max_body_bytes: 8 * 1024 * 1024,
            max_topk: 100,
            default_topk: 3,
            max_queries: 4096,
            max_query_bytes: crate::index::MAX_QUERY_BYTES,
            max_results: 16_384,
            max_response_bytes: 32 * 1024 * 1024,
            max_pending_response_bytes: 256 * 1024 * 1024,
            max_concurrent_searches: 0,
            max_connections: 512,
            header_read_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

impl ServerConfig {
    /// Checks that the limits are usable (durations and caps above zero, budgets consistent).
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |what: &str| Err(Error::Invalid(format!("server config: {what}")));
        if self.max_connections == 0 {
            return bad("max_connections (--max-connections) must be at least 1");
        }
        for (name, d) in [
            (
                "header_read_timeout (--header-read-timeout)",
                self.header_read_timeout,
            ),
            ("body_timeout (--body-timeout)", self.body_timeout),
            ("idle_timeout (--idle-timeout)", self.idle_timeout),
        ] {
            if d.is_zero() {
                return bad(&format!("{name} must be above 0"));
            }
        }
        if self.max_pending_response_bytes > u32::MAX as usize {
            return bad(&format!(
                "max_pending_response_bytes (--max-pending-response-bytes) must be at most {} bytes",
                u32::MAX
            ));
        }
        if self.max_response_bytes > self.max_pending_response_bytes {
            return bad(&format!(
                "max_response_bytes ({}) exceeds max_pending_response_bytes ({}): no answer of the largest allowed \
                 size could ever be sent; raise --max-pending-response-bytes or lower --max-response-bytes",
                self.max_response_bytes, self.max_pending_response_bytes
            ));
        }
        Ok(())
    }
}

struct AppState {
    retriever: Arc<dyn Retriever>,
    cfg: ServerConfig,
    permits: Arc<Semaphore>,
    /// One permit per byte of answers held in memory ([`ServerConfig::max_pending_response_bytes`]).
    response_bytes: Arc<Semaphore>,
}

#[derive(serde::Deserialize)]
struct RetrieveRequest {
    queries: Vec<String>,
    #[serde(default)]
    topk: Option<i64>,
    #[serde(default)]
    return_scores: bool,
}

#[derive(serde::Serialize)]
struct DocOut<'a> {
    id: &'a str,
    contents: String,
}

#[derive(serde::Serialize)]
struct ScoredOut<'a> {
    document: DocOut<'a>,
    score: f32,
}

fn doc_out(p: &Passage) -> DocOut<'_> {
    DocOut {
        id: &p.id,
        contents: p.contents(),
    }
}

fn json_response(status: StatusCode, body: impl Into<Body>) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.into(),
    )
        .into_response()
}

fn err(status: StatusCode, msg: impl Into<String>) -> Response {
    let body = serde_json::to_vec(&serde_json::json!({"error": msg.into()})).unwrap_or_default();
    json_response(status, body)
}

/// An error answered before (all of) the body was read: the unread rest makes the connection unusable, so tell
/// the client not to reuse it (else its next request on this connection races with the server closing it).
fn err_closing(status: StatusCode, msg: impl Into<String>) -> Response {
    let mut resp = err(status, msg);
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    resp
}

fn authorized(cfg: &ServerConfig, headers: &HeaderMap) -> bool {
    let Some(token) = &cfg.token else {
        return true;
    };
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        return false;
    };
    // Constant-time comparison (no crate needed for this one loop).
    let (a, b) = (given.as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

enum BodyError {
    TooLarge,
    Read(axum::Error),
}

/// Reads the body up to `limit` bytes; never buffers more than `limit`.
async fn read_body(mut body: Body, limit: usize) -> Result<Vec<u8>, BodyError> {
    let hint = body.size_hint().lower() as usize;
    let mut buf = Vec::with_capacity(hint.min(limit).min(64 * 1024));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(BodyError::Read)?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf)
}

/// Why a search could not produce an answer.
enum SearchFail {
    TooLarge(usize),
    Retriever(Error),
}

/// Passages searched (and then dropped) per chunk of a batch, so a batch never holds all its passages at once.
const RESULTS_PER_CHUNK: usize = 1024;

/// Searches `queries` and encodes the answer exactly as `serde_json` encodes `{"result": [[..], ..]}`, chunk by
/// chunk, failing as soon as the encoded answer passes `max_bytes`.
fn search_and_encode(
    retriever: &dyn Retriever,
    queries: &[String],
    topk: usize,
    scores: bool,
    max_bytes: usize,
) -> Result<Vec<u8>, SearchFail> {
    let per_chunk = (RESULTS_PER_CHUNK / topk.max(1)).max(1);
    let mut out = Vec::with_capacity(1024);
    out.extend_from_slice(b"{\"result\":[");
    let mut first = true;
    for chunk in queries.chunks(per_chunk) {
        let lists = retriever
            .search_batch(chunk, topk)
            .map_err(SearchFail::Retriever)?;
        for list in &lists {
            if !first {
                out.push(b',');
            }
            first = false;
            let written = if scores {
                let v: Vec<ScoredOut> = list
                    .iter()
                    .map(|p| ScoredOut {
                        document: doc_out(p),
                        score: p.score,
                    })
                    .collect();
                serde_json::to_writer(&mut out, &v)
            } else {
                let v: Vec<DocOut> = list.iter().map(doc_out).collect();
                serde_json::to_writer(&mut out, &v)
            };
            written.map_err(|e| {
                SearchFail::Retriever(Error::Server(format!("encoding failed: {e}")))
            })?;
            if out.len() > max_bytes {
                return Err(SearchFail::TooLarge(out.len()));
            }
        }
    }
    out.extend_from_slice(b"]}");
    if out.len() > max_bytes {
        return Err(SearchFail::TooLarge(out.len()));
    }
    Ok(out)
}

/// An answer's bytes together with their share of [`ServerConfig::max_pending_response_bytes`], released when
/// hyper drops them (sent, or the connection closed).
struct PendingAnswer {
    bytes: Vec<u8>,
    _permit: OwnedSemaphorePermit,
}

impl AsRef<[u8]> for PendingAnswer {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

async fn retrieve(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let cfg = &st.cfg;
    // Authentication and the declared length are checked on the head alone, before reading the body.
    if !authorized(cfg, &parts.headers) {
        return err_closing(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (send `Authorization: Bearer <token>`)",
        );
    }
    let too_large = || {
        err_closing(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "request body exceeds max_body_bytes = {} bytes (server flag --max-body-bytes); send fewer \
                 queries per request",
                cfg.max_body_bytes
            ),
        )
    };
    if body.size_hint().lower() > cfg.max_body_bytes as u64 {
        return too_large();
    }
    let body = match tokio::time::timeout(cfg.body_timeout, read_body(body, cfg.max_body_bytes))
        .await
    {
        Ok(Ok(b)) => b,
        Ok(Err(BodyError::TooLarge)) => return too_large(),
        Ok(Err(BodyError::Read(e))) => {
            return err_closing(
                StatusCode::BAD_REQUEST,
                format!("cannot read the request body: {e}"),
            );
        }
        Err(_) => {
            return err_closing(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body not received within body_timeout = {:?} (server flag --body-timeout)",
                    cfg.body_timeout
                ),
            );
        }
    };
    let req: RetrieveRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return err(
                StatusCode::BAD_REQUEST,
                format!(
                    "invalid request ({e}); expected {{\"queries\": [\"...\"], \"topk\": 3, \"return_scores\": true}}"
                ),
            );
        }
    };
    drop(body);
    if req.queries.len() > cfg.max_queries {
        return err(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "{} queries in one request; at most max_queries = {} allowed (server flag --max-queries)",
                req.queries.len(),
                cfg.max_queries
            ),
        );
    }
    if let Some((i, q)) = req
        .queries
        .iter()
        .enumerate()
        .find(|(_, q)| q.len() > cfg.max_query_bytes)
    {
        return err(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "query {i} is {} bytes; at most max_query_bytes = {} allowed (server flag --max-query-bytes)",
                q.len(),
                cfg.max_query_bytes
            ),
        );
    }
    let topk = match req.topk {
        None | Some(0) => cfg.default_topk,
        Some(k) if k < 0 => {
            return err(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("topk must be >= 0, got {k}"),
            );
        }
        Some(k) if k as u64 > cfg.max_topk as u64 => {
            return err(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "topk {k} exceeds the limit max_topk = {} (server flag --max-topk)",
                    cfg.max_topk
                ),
            );
        }
        Some(k) => k as usize,
    };
    let results = req.queries.len().saturating_mul(topk);
    if results > cfg.max_results {
        return err(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "{} queries x topk {topk} = {results} passages; at most max_results = {} per request (server flag \
                 --max-results): send fewer queries per request or a smaller topk",
                req.queries.len(),
                cfg.max_results
            ),
        );
    }
    let Ok(_permit) = st.permits.clone().acquire_owned().await else {
        return err(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down");
    };
    let retriever = st.retriever.clone();
    let queries = req.queries;
    let scores = req.return_scores;
    let max_bytes = cfg.max_response_bytes;
    let found = tokio::task::spawn_blocking(move || {
        search_and_encode(&*retriever, &queries, topk, scores, max_bytes)
    })
    .await;
    let bytes = match found {
        Ok(Ok(b)) => b,
        Ok(Err(SearchFail::TooLarge(n))) => {
            return err(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!(
                    "the answer would exceed max_response_bytes = {max_bytes} bytes (server flag \
                     --max-response-bytes; stopped at {n} bytes): send fewer queries per request or a smaller topk"
                ),
            );
        }
        Ok(Err(SearchFail::Retriever(e))) => {
            return err(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("search failed: {e}"),
            );
        }
        Err(e) => {
            return err(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("search task failed: {e}"),
            );
        }
    };
    // `validate` keeps max_response_bytes (>= len) within u32 and within the budget.
    let n = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    let Ok(permit) = st.response_bytes.clone().try_acquire_many_owned(n) else {
        let mut resp = err(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "answers not yet read by their clients hold max_pending_response_bytes = {} bytes (server flag \
                 --max-pending-response-bytes); retry shortly",
                cfg.max_pending_response_bytes
            ),
        );
        resp.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return resp;
    };
    json_response(
        StatusCode::OK,
        Bytes::from_owner(PendingAnswer {
            bytes,
            _permit: permit,
        }),
    )
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    let body = serde_json::json!({"status": "ok", "num_docs": st.retriever.passage_count()});
    json_response(StatusCode::OK, body.to_string().into_bytes())
}

async fn not_found() -> Response {
    err(
        StatusCode::NOT_FOUND,
        "no such endpoint; use POST /retrieve or GET /health",
    )
}

async fn method_not_allowed() -> Response {
    err(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed; use POST /retrieve or GET /health",
    )
}

/// The axum router of the server (the request-level limits; the connection-level ones live in [`serve`]).
pub fn router(retriever: Arc<dyn Retriever>, cfg: ServerConfig) -> Router {
    let n = if cfg.max_concurrent_searches == 0 {
        2 * std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        cfg.max_concurrent_searches
    };
    let budget = cfg.max_pending_response_bytes.max(cfg.max_response_bytes);
    let state = Arc::new(AppState {
        retriever,
        cfg,
        permits: Arc::new(Semaphore::new(n)),
        response_bytes: Arc::new(Semaphore::new(budget.min(Semaphore::MAX_PERMITS))),
    });
    Router::new()
        .route("/retrieve", post(retrieve))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// What the accept loop knows of one open connection.
struct ConnState {
    /// Requests being handled (from the head parsed to the response produced).
    in_flight: AtomicUsize,
    /// Last time (ms since [`Connections::epoch`]) a byte moved or a request ended.
    last_progress_ms: AtomicU64,
    /// Set when the connection is evicted to make room for a new one.
    evict: Notify,
}

/// The open connections, for the cap and for evicting the longest-idle one.
struct Connections {
    max: usize,
    epoch: tokio::time::Instant,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
}

impl Connections {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnState>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Closes the connection that has been idle longest (none being handled); false if every one is busy.
    fn evict_idlest(open: &mut HashMap<u64, Arc<ConnState>>) -> bool {
        let victim = open
            .iter()
            .filter(|(_, c)| c.in_flight.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, c)| c.last_progress_ms.load(Ordering::Relaxed))
            .map(|(id, _)| *id);
        match victim.and_then(|id| open.remove(&id)) {
            Some(c) => {
                c.evict.notify_one();
                true
            }
            None => false,
        }
    }

    /// Registers a new connection, evicting the idlest one at the cap; `None` if all are busy.
    fn admit(&self) -> Option<(u64, Arc<ConnState>)> {
        let mut open = self.lock();
        if open.len() >= self.max && !Self::evict_idlest(&mut open) {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState {
            in_flight: AtomicUsize::new(0),
            last_progress_ms: AtomicU64::new(self.now_ms()),
            evict: Notify::new(),
        });
        open.insert(id, state.clone());
        Some((id, state))
    }
}

/// Removes a connection from [`Connections`] when its task ends.
struct Registered {
    conns: Arc<Connections>,
    id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.conns.lock().remove(&self.id);
    }
}

/// Counts a request as being handled while alive.
struct InFlight {
    conn: Arc<ConnState>,
    conns: Arc<Connections>,
}

impl InFlight {
    fn enter(conn: &Arc<ConnState>, conns: &Arc<Connections>) -> Self {
        conn.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            conn: conn.clone(),
            conns: conns.clone(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn
            .last_progress_ms
            .store(self.conns.now_ms(), Ordering::Relaxed);
        self.conn.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A TCP stream that records when bytes last moved (for [`ServerConfig::idle_timeout`]).
struct TrackedStream {
    inner: tokio::net::TcpStream,
    conn: Arc<ConnState>,
    conns: Arc<Connections>,
}

impl TrackedStream {
    fn progress(&self) {
        self.conn
            .last_progress_ms
            .store(self.conns.now_ms(), Ordering::Relaxed);
    }
}

impl AsyncRead for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.progress();
        }
        r
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.progress();
        }
        r
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.progress();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The soft open-file limit of this process (Linux `/proc/self/limits`; `None` elsewhere or if unlimited).
fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// The answer sent, on a best-effort single write, to a connection refused because every connection is busy.
fn busy_response() -> Vec<u8> {
    let body = r#"{"error":"all max_connections connections are busy (server flag --max-connections); retry shortly"}"#;
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n\
         retry-after: 1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Serves on `listener` until `shutdown` resolves, then finishes in-flight requests and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    retriever: Arc<dyn Retriever>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    cfg.validate()?;
    if let Some(limit) = open_file_limit()
        && (cfg.max_connections as u64).saturating_add(64) > limit
    {
        tracing::warn!(
            "max_connections {} is close to or above the open-file limit {limit} (ulimit -n): new connections may \
             fail with \"Too many open files\"; raise `ulimit -n` or lower --max-connections",
            cfg.max_connections
        );
    }
    let app = router(retriever, cfg.clone());
    let conns = Arc::new(Connections {
        max: cfg.max_connections,
        epoch: tokio::time::Instant::now(),
        next_id: AtomicU64::new(0),
        open: Mutex::new(HashMap::new()),
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(cfg.header_read_timeout)
        .keep_alive(true);
    // Connection tasks hold a receiver: `send(true)` asks them to stop, `closed()` says they all have.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut refused = 0u64;
    let busy = busy_response();
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    if !matches!(
                        e.kind(),
                        io::ErrorKind::ConnectionRefused
                            | io::ErrorKind::ConnectionAborted
                            | io::ErrorKind::ConnectionReset
                    ) {
                        // Most likely out of file descriptors: free one and retry soon.
                        tracing::warn!("accept failed: {e}; closing the idlest connection and retrying");
                        Connections::evict_idlest(&mut conns.lock());
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    continue;
                }
            },
        };
        let Some((id, state)) = conns.admit() else {
            refused += 1;
            if refused.is_power_of_two() {
                tracing::warn!(
                    "refused {refused} connection(s) so far: all {} connections busy (--max-connections)",
                    cfg.max_connections
                );
            }
            let _ = stream.try_write(&busy);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let registered = Registered {
            conns: conns.clone(),
            id,
        };
        let io = TokioIo::new(TrackedStream {
            inner: stream,
            conn: state.clone(),
            conns: conns.clone(),
        });
        let svc = {
            let (app, state, conns) = (app.clone(), state.clone(), conns.clone());
            hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let guard = InFlight::enter(&state, &conns);
                let call = app.clone().oneshot(req.map(Body::new));
                async move {
                    let resp = call.await;
                    drop(guard);
                    resp
                }
            })
        };
        let conn = http.serve_connection(io, svc);
        let mut stop = stop_rx.clone();
        let idle = cfg.idle_timeout;
        let conns = conns.clone();
        tokio::spawn(async move {
            let _registered = registered;
            let mut conn = std::pin::pin!(conn);
            let mut stopping = false;
            // While a request is being handled the idle check is pushed back to this time.
            let mut busy_until = conns.epoch;
            loop {
                let last = state.last_progress_ms.load(Ordering::Relaxed);
                let check_at = (conns.epoch + Duration::from_millis(last) + idle).max(busy_until);
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!("connection ended: {e}");
                        }
                        break;
                    }
                    _ = state.evict.notified() => {
                        tracing::debug!("connection closed to stay within max_connections");
                        break;
                    }
                    _ = stop.changed(), if !stopping => {
                        stopping = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ = tokio::time::sleep_until(check_at) => {
                        if state.in_flight.load(Ordering::Acquire) > 0 {
                            // A request is being handled: its own limits apply; look again later.
                            busy_until = tokio::time::Instant::now() + idle;
                            continue;
                        }
                        let quiet = conns
                            .now_ms()
                            .saturating_sub(state.last_progress_ms.load(Ordering::Relaxed));
                        if quiet >= idle.as_millis() as u64 {
                            tracing::debug!("closing a connection idle for {quiet} ms (idle_timeout)");
                            break;
                        }
                    }
                }
            }
            drop(stop);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(stop_rx);
    stop_tx.closed().await;
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or, on Unix, SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received; finishing in-flight requests");
}

/// A server running on its own thread and tokio runtime; stops when [`ServerHandle::shutdown`] is called or the
/// handle is dropped.
pub struct ServerHandle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), Error>>>,
}

impl ServerHandle {
    /// The address the server is bound to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/retrieve`.
    pub fn retrieve_url(&self) -> String {
        format!("http://{}/retrieve", self.addr)
    }

    /// Stops the server gracefully and waits for it.
    pub fn shutdown(mut self) -> Result<(), Error> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), Error> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| Error::Server("server thread panicked".into()))?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// Binds `addr` (use port 0 for any free port) and serves on a new thread with a multi-threaded runtime of
/// `worker_threads` threads (0 = tokio's default).
pub fn spawn(
    retriever: Arc<dyn Retriever>,
    cfg: ServerConfig,
    addr: SocketAddr,
    worker_threads: usize,
) -> Result<ServerHandle, Error> {
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if worker_threads > 0 {
        rt.worker_threads(worker_threads);
    }
    let rt = rt
        .build()
        .map_err(|e| Error::Server(format!("cannot start tokio runtime: {e}")))?;
    let std_listener = std::net::TcpListener::bind(addr)
        .map_err(|e| Error::Server(format!("cannot bind {addr}: {e}")))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| Error::Server(e.to_string()))?;
    let bound = std_listener
        .local_addr()
        .map_err(|e| Error::Server(e.to_string()))?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("kiln-retriever-server".into())
        .spawn(move || {
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener)
                    .map_err(|e| Error::Server(e.to_string()))?;
                serve(listener, retriever, cfg, async {
                    let _ = rx.await;
                })
                .await
            })
        })
        .map_err(|e| Error::Server(format!("cannot spawn server thread: {e}")))?;
    Ok(ServerHandle {
        addr: bound,
        stop: Some(tx),
        thread: Some(thread),
    })
}
