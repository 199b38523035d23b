//! [`RemoteRetriever`]: the HTTP client of a Search-R1-compatible `POST /retrieve` server (`kiln serve-retriever`,
//! or Search-R1's own FastAPI `retrieval_server.py`).
//!
//! Uses reqwest's blocking client: call it from ordinary threads (rollout workers), not from inside an async
//! runtime. Queries are sent in batches of at most [`RemoteOptions::batch_size`]; each request has a timeout and
//! is retried on connection errors, timeouts, HTTP 429 and 5xx with exponential backoff, at most
//! [`RemoteOptions::retries`] times. Other 4xx answers are not retried (the request itself is wrong).

use std::time::Duration;

use crate::corpus::split_contents;
use crate::{Error, Passage, Retriever};

/// Settings of a [`RemoteRetriever`].
#[derive(Debug, Clone)]
pub struct RemoteOptions {
    /// Per-request timeout.
    pub timeout: Duration,
    /// Retries after the first attempt for retryable failures.
    pub retries: u32,
    /// Delay before the first retry; doubled on each further retry.
    pub backoff: Duration,
    /// Most queries sent in one request.
    pub batch_size: usize,
    /// Bearer token, if the server requires one.
    pub token: Option<String>,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            timeout: Duration::from_secs(30),
            retries: 3,
            backoff: Duration::from_millis(100),
            batch_size: 512,
            token: None,
        }
    }
}

/// A retriever behind HTTP. `Send + Sync`; the connection pool is shared by clones of the inner client.
pub struct RemoteRetriever {
    url: String,
    client: reqwest::blocking::Client,
    opts: RemoteOptions,
}

#[derive(serde::Deserialize)]
struct Doc {
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default)]
    contents: Option<String>,
    #[serde(default)]
    title: Option<String>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Item {
    Scored { document: Doc, score: f32 },
    Plain(Doc),
}

#[derive(serde::Deserialize)]
struct Response {
    result: Vec<Vec<Item>>,
}

impl Doc {
    fn into_passage(self, score: f32) -> Passage {
        let id = match self.id {
            Some(serde_json::Value::String(s)) => s,
            Some(v) => v.to_string(),
            None => String::new(),
        };
        let (title, text) = match (self.text, self.contents) {
            (Some(text), _) => (self.title.unwrap_or_default(), text),
            (None, Some(c)) => split_contents(&c),
            (None, None) => (self.title.unwrap_or_default(), String::new()),
        };
        Passage {
            id,
            title,
            text,
            score,
        }
    }
}

enum Attempt {
    Retry(String),
    Fatal(String),
}

impl RemoteRetriever {
    /// A client of the `/retrieve` endpoint at `url` (e.g. `http://127.0.0.1:8000/retrieve`).
    pub fn new(url: impl Into<String>, opts: RemoteOptions) -> Result<Self, Error> {
        let url = url.into();
        let client = reqwest::blocking::Client::builder()
            .timeout(opts.timeout)
            .build()
            .map_err(|e| Error::Remote {
                url: url.clone(),
                msg: format!("cannot build HTTP client: {e}"),
            })?;
        if opts.batch_size == 0 {
            return Err(Error::Invalid(
                "RemoteOptions::batch_size must be >= 1".into(),
            ));
        }
        Ok(RemoteRetriever { url, client, opts })
    }

    /// The endpoint URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn attempt(&self, body: &serde_json::Value, n: usize) -> Result<Vec<Vec<Passage>>, Attempt> {
        let mut req = self.client.post(&self.url).json(body);
        if let Some(t) = &self.opts.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().map_err(|e| {
            if e.is_timeout() || e.is_connect() || e.is_request() {
                Attempt::Retry(format!("request failed: {e}"))
            } else {
                Attempt::Fatal(format!("request failed: {e}"))
            }
        })?;
        let status = resp.status();
        let text = resp
            .text()
            .map_err(|e| Attempt::Retry(format!("reading the answer failed: {e}")))?;
        if status.as_u16() == 429 || status.is_server_error() {
            return Err(Attempt::Retry(format!("HTTP {status}: {}", clip(&text))));
        }
        if !status.is_success() {
            return Err(Attempt::Fatal(format!("HTTP {status}: {}", clip(&text))));
        }
        let parsed: Response = serde_json::from_str(&text).map_err(|e| {
            Attempt::Fatal(format!(
                "answer is not Search-R1's {{\"result\": [[...]]}} ({e}): {}",
                clip(&text)
            ))
        })?;
        if parsed.result.len() != n {
            return Err(Attempt::Fatal(format!(
                "sent {n} queries but got {} result lists",
                parsed.result.len()
            )));
        }
        Ok(parsed
            .result
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|it| match it {
                        Item::Scored { document, score } => document.into_passage(score),
                        Item::Plain(d) => d.into_passage(0.0),
                    })
                    .collect()
            })
            .collect())
    }

    fn post_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        let body = serde_json::json!({"queries": queries, "topk": k, "return_scores": true});
        let mut delay = self.opts.backoff;
        let mut tries = 0u32;
        loop {
            match self.attempt(&body, queries.len()) {
                Ok(r) => return Ok(r),
                Err(Attempt::Fatal(msg)) => {
                    return Err(Error::Remote {
                        url: self.url.clone(),
                        msg,
                    });
                }
                Err(Attempt::Retry(msg)) => {
                    if tries >= self.opts.retries {
                        return Err(Error::Remote {
                            url: self.url.clone(),
                            msg: format!("{msg} (gave up after {} attempts)", tries + 1),
                        });
                    }
                    tracing::warn!("retriever {}: {msg}; retrying in {delay:?}", self.url);
                    std::thread::sleep(delay);
                    delay = delay.saturating_mul(2);
                    tries += 1;
                }
            }
        }
    }
}

fn clip(s: &str) -> &str {
    crate::index::truncate_str(s, 300)
}

impl Retriever for RemoteRetriever {
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        if k == 0 {
            return Ok(vec![Vec::new(); queries.len()]);
        }
        let mut out = Vec::with_capacity(queries.len());
        for chunk in queries.chunks(self.opts.batch_size) {
            out.extend(self.post_batch(chunk, k)?);
        }
        Ok(out)
    }
}
