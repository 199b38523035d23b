//! The Search-R1-compatible retrieval server behind `kiln serve-retriever` (tokio + axum), usable as a library.
//!
//! API (the one Search-R1's trainer and its `retrieval_server.py` use):
//! - `POST /retrieve` with `{"queries": ["..", ..], "topk": 3, "return_scores": true}` answers
//!   `{"result": [[{"document": {"id": "..", "contents": "\"Title\"\ntext"}, "score": 12.3}, ..], ..]}`;
//!   with `"return_scores": false` (the default, as in Search-R1) each inner list holds the documents themselves.
//!   A missing, null or 0 `topk` means [`ServerConfig::default_topk`].
//! - `GET /health` answers `{"status": "ok", "num_docs": N}` (never requires the token).
//!
//! Every failure is a JSON `{"error": "..."}` with a 4xx status: 401 (missing/wrong bearer token when one is
//! configured), 413 (body over [`ServerConfig::max_body_bytes`]), 400 (not JSON / not UTF-8 / wrong shape),
//! 422 (topk above [`ServerConfig::max_topk`] or negative, more than [`ServerConfig::max_queries`] queries, a query
//! over [`ServerConfig::max_query_bytes`]), 404/405 for other routes and methods; 500 only if the retriever fails.
//!
//! Searches run on tokio's blocking thread pool (the async workers never search), at most
//! [`ServerConfig::max_concurrent_searches`] requests at a time; further requests wait asynchronously.
//! [`serve`] stops gracefully when its shutdown future resolves; [`shutdown_signal`] is SIGINT/SIGTERM.
//! [`spawn`] runs a server on its own runtime thread and returns the bound address (bind port 0 in tests).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio::sync::Semaphore;

use crate::{Error, Passage, Retriever};

/// Limits and options of the server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// If set, `POST /retrieve` requires `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Largest accepted request body in bytes.
    pub max_body_bytes: usize,
    /// Largest accepted `topk`.
    pub max_topk: usize,
    /// `topk` used when the request has none (or 0), as Search-R1's `retrieval_topk`.
    pub default_topk: usize,
    /// Most queries in one request.
    pub max_queries: usize,
    /// Longest accepted query in bytes.
    pub max_query_bytes: usize,
    /// Requests searched at the same time (0 = 2 x CPUs).
    pub max_concurrent_searches: usize,
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
            max_concurrent_searches: 0,
        }
    }
}

struct AppState {
    retriever: Arc<dyn Retriever>,
    cfg: ServerConfig,
    permits: Arc<Semaphore>,
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
struct DocOut {
    id: String,
    contents: String,
}

#[derive(serde::Serialize)]
struct ScoredOut {
    document: DocOut,
    score: f32,
}

#[derive(serde::Serialize)]
struct ResultOut<T> {
    result: Vec<Vec<T>>,
}

fn doc_out(p: Passage) -> DocOut {
    DocOut {
        contents: p.contents(),
        id: p.id,
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn err(status: StatusCode, msg: impl Into<String>) -> Response {
    let body = serde_json::to_vec(&serde_json::json!({"error": msg.into()})).unwrap_or_default();
    json_response(status, body)
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

async fn retrieve(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    if !authorized(&st.cfg, &headers) {
        return err(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token (send `Authorization: Bearer <token>`)",
        );
    }
    let body = match body {
        Ok(b) => b,
        Err(rej) => {
            let status = rej.status();
            let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
                format!(
                    "request body exceeds {} bytes; send fewer queries per request",
                    st.cfg.max_body_bytes
                )
            } else {
                rej.body_text()
            };
            let status = if status.is_client_error() {
                status
            } else {
                StatusCode::BAD_REQUEST
            };
            // The unread rest of the body makes the connection unusable: tell the client not to reuse it (else its
            // next request on this connection races with the server closing it).
            let mut resp = err(status, msg);
            resp.headers_mut().insert(
                header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
            return resp;
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
    let cfg = &st.cfg;
    if req.queries.len() > cfg.max_queries {
        return err(
            StatusCode::UNPROCESSABLE_ENTITY,
            format!(
                "{} queries in one request; at most {} allowed",
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
                "query {i} is {} bytes; at most {} allowed",
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
                format!("topk {k} exceeds the limit {}", cfg.max_topk),
            );
        }
        Some(k) => k as usize,
    };
    let Ok(_permit) = st.permits.clone().acquire_owned().await else {
        return err(StatusCode::SERVICE_UNAVAILABLE, "server is shutting down");
    };
    let retriever = st.retriever.clone();
    let queries = req.queries;
    let found = tokio::task::spawn_blocking(move || retriever.search_batch(&queries, topk)).await;
    let lists = match found {
        Ok(Ok(lists)) => lists,
        Ok(Err(e)) => {
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
    let body = if req.return_scores {
        serde_json::to_vec(&ResultOut {
            result: lists
                .into_iter()
                .map(|l| {
                    l.into_iter()
                        .map(|p| ScoredOut {
                            score: p.score,
                            document: doc_out(p),
                        })
                        .collect()
                })
                .collect(),
        })
    } else {
        serde_json::to_vec(&ResultOut {
            result: lists
                .into_iter()
                .map(|l| l.into_iter().map(doc_out).collect())
                .collect(),
        })
    };
    match body {
        Ok(b) => json_response(StatusCode::OK, b),
        Err(e) => err(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding failed: {e}"),
        ),
    }
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

/// The axum router of the server.
pub fn router(retriever: Arc<dyn Retriever>, cfg: ServerConfig) -> Router {
    let n = if cfg.max_concurrent_searches == 0 {
        2 * std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    } else {
        cfg.max_concurrent_searches
    };
    let limit = cfg.max_body_bytes;
    let state = Arc::new(AppState {
        retriever,
        cfg,
        permits: Arc::new(Semaphore::new(n)),
    });
    Router::new()
        .route("/retrieve", post(retrieve))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves, then finishes in-flight requests and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    retriever: Arc<dyn Retriever>,
    cfg: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    axum::serve(listener, router(retriever, cfg))
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| Error::Server(e.to_string()))
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
