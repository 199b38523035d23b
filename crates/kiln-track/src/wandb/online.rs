//! Live streaming of a run to a W&B server (online mode), in a background thread.
//!
//! Two calls (docs/WANDB.md): `UpsertBucket` (GraphQL) creates the run with its config, then `file_stream` posts
//! batches of history lines (`wandb-history.jsonl` with the offset of the first line) and the current summary;
//! the last batch adds `"complete": true, "exitcode": N`. Failures are retried with exponential backoff and
//! warned about once; training never waits for the network except for a bounded time at the end
//! (`finish_timeout_secs`). The offline `.wandb` file is written independently, so nothing is lost.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use base64::Engine;

use super::{WandbSettings, hostname};

/// Most history lines per request.
const MAX_LINES_PER_REQUEST: usize = 1000;
/// First retry delay; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

const UPSERT_BUCKET: &str = "mutation UpsertBucket($id: String, $name: String, $project: String, \
$entity: String, $groupName: String, $description: String, $displayName: String, $notes: String, \
$commit: String, $config: JSONString, $host: String, $debug: Boolean, $program: String, $repo: String, \
$jobType: String, $state: String, $sweep: String, $tags: [String!], $summaryMetrics: JSONString) { \
upsertBucket(input: {id: $id, name: $name, groupName: $groupName, modelName: $project, entityName: $entity, \
description: $description, displayName: $displayName, notes: $notes, config: $config, commit: $commit, \
host: $host, debug: $debug, jobProgram: $program, jobRepo: $repo, jobType: $jobType, state: $state, \
sweep: $sweep, tags: $tags, summaryMetrics: $summaryMetrics}) { bucket { id name displayName description \
config sweepName historyLineCount project { id name entity { id name } } } inserted } }";

#[derive(Default)]
struct State {
    /// History lines not yet acknowledged by the server.
    pending: VecDeque<String>,
    /// Latest summary JSON.
    summary: Option<String>,
    /// Set by `finish`: the exit code and when finishing began.
    finish: Option<(i32, Instant)>,
}

/// Handle to the background streaming thread.
pub(crate) struct Streamer {
    shared: Arc<(Mutex<State>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

struct Ctx {
    settings: WandbSettings,
    run_id: String,
    config_json: String,
    offline_dir: PathBuf,
    auth: String,
    client: Result<reqwest::blocking::Client, String>,
    warned: bool,
    start_offset: Option<usize>,
}

impl Streamer {
    /// Start streaming run `run_id` (its config as (key, JSON) pairs). `start_offset`: the history line the
    /// first new row goes to when resuming (the rows kept from before); otherwise the server's line count.
    pub(crate) fn start(
        s: &WandbSettings,
        run_id: &str,
        config: &[(String, String)],
        offline_dir: &Path,
        start_offset: Option<usize>,
    ) -> Streamer {
        let mut cfg = String::from("{");
        for (i, (k, v)) in config.iter().enumerate() {
            if i > 0 {
                cfg.push(',');
            }
            cfg.push_str(&crate::jsonl::json_string(k));
            cfg.push_str(":{\"value\":");
            cfg.push_str(v);
            cfg.push('}');
        }
        cfg.push('}');
        let key = s.api_key.clone().unwrap_or_default();
        let auth = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("api:{key}"))
        );
        if let Some(entity) = &s.entity {
            tracing::info!("W&B run: {}", s.run_url(entity, run_id));
        }
        let ctx = Ctx {
            settings: s.clone(),
            run_id: run_id.to_string(),
            config_json: cfg,
            offline_dir: offline_dir.to_path_buf(),
            auth,
            // built on the streaming thread: reqwest's blocking client must not be created or dropped inside
            // an async runtime, which the caller might be running
            client: Err("not started".into()),
            warned: false,
            start_offset,
        };
        let shared = Arc::new((Mutex::new(State::default()), Condvar::new()));
        let sh = shared.clone();
        // Warnings from the thread go to the subscriber that is current for the trainer.
        let dispatch = tracing::dispatcher::get_default(|d| d.clone());
        let handle = std::thread::Builder::new()
            .name("kiln-wandb-stream".into())
            .spawn(move || tracing::dispatcher::with_default(&dispatch, || run(ctx, &sh)))
            .map_err(|e| tracing::warn!("W&B online streaming could not start a thread: {e}"))
            .ok();
        Streamer { shared, handle }
    }

    /// Queue one history line (JSON object text) and the summary after it.
    pub(crate) fn push_history(&self, line: String, summary: String) {
        let (m, _) = &*self.shared;
        if let Ok(mut st) = m.lock() {
            st.pending.push_back(line);
            st.summary = Some(summary);
        }
    }

    /// Send what is left plus the final summary and exit code, waiting at most `finish_timeout`.
    pub(crate) fn finish(mut self, summary: String, exit_code: i32) {
        self.finish_inner(Some(summary), exit_code);
    }

    fn finish_inner(&mut self, summary: Option<String>, exit_code: i32) {
        let (m, cv) = &*self.shared;
        if let Ok(mut st) = m.lock() {
            if summary.is_some() {
                st.summary = summary;
            }
            if st.finish.is_none() {
                st.finish = Some((exit_code, Instant::now()));
            }
        }
        cv.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        if self.handle.is_some() {
            self.finish_inner(None, 1);
        }
    }
}

fn run(mut ctx: Ctx, shared: &(Mutex<State>, Condvar)) {
    ctx.client = reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(15))
        .connect_timeout(Duration::from_secs(5))
        .user_agent(concat!("kiln-track/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| e.to_string());
    let (m, cv) = shared;
    let interval = ctx.settings.stream_interval;
    let finish_timeout = ctx.settings.finish_timeout;
    let mut backoff = MIN_BACKOFF;
    let mut wait = Duration::ZERO; // the first attempt (UpsertBucket) goes out at once
    let mut run_path: Option<String> = None;
    let mut offset = 0usize;
    let mut finish_seen = false;
    loop {
        // Wait for the next batch (or retry), unless finishing.
        let (lines, summary, finish) = {
            let Ok(mut st) = m.lock() else { return };
            let mut until = Instant::now() + wait;
            loop {
                if let Some((_, since)) = st.finish {
                    if !finish_seen {
                        // React to the end of the run at once, then keep the backoff while retrying.
                        finish_seen = true;
                        break;
                    }
                    until = until.min(since + finish_timeout + Duration::from_millis(1));
                }
                let now = Instant::now();
                if now >= until {
                    break;
                }
                st = match cv.wait_timeout(st, until - now) {
                    Ok((g, _)) => g,
                    Err(_) => return,
                };
            }
            if let Some((_, since)) = st.finish
                && since.elapsed() > finish_timeout
            {
                let left = st.pending.len();
                drop(st);
                tracing::warn!(
                    "W&B: gave up streaming after {:.0} s at the end of the run; {left} history line(s) and the \
                     final state did not reach {}. Nothing is lost: upload with `wandb sync {}`",
                    finish_timeout.as_secs_f64(),
                    ctx.settings.base_url,
                    ctx.offline_dir.display()
                );
                return;
            }
            let lines: Vec<String> = st
                .pending
                .iter()
                .take(MAX_LINES_PER_REQUEST)
                .cloned()
                .collect();
            let all = lines.len() == st.pending.len();
            (
                lines,
                st.summary.clone(),
                st.finish.filter(|_| all).map(|(c, _)| c),
            )
        };
        let result = (|| -> Result<(), String> {
            let path = match &run_path {
                Some(p) => p.clone(),
                None => {
                    let (entity, history_lines) = upsert_bucket(&ctx)?;
                    if ctx.settings.entity.is_none() {
                        tracing::info!("W&B run: {}", ctx.settings.run_url(&entity, &ctx.run_id));
                    }
                    offset = ctx.start_offset.unwrap_or(history_lines);
                    let p = format!(
                        "{}/files/{entity}/{}/{}/file_stream",
                        ctx.settings.base_url, ctx.settings.project, ctx.run_id
                    );
                    run_path = Some(p.clone());
                    p
                }
            };
            if lines.is_empty() && finish.is_none() {
                return Ok(());
            }
            let mut files = serde_json::Map::new();
            if !lines.is_empty() {
                files.insert(
                    "wandb-history.jsonl".into(),
                    serde_json::json!({"offset": offset, "content": lines}),
                );
            }
            if let Some(s) = &summary {
                files.insert(
                    "wandb-summary.json".into(),
                    serde_json::json!({"offset": 0, "content": [s]}),
                );
            }
            let mut body = serde_json::json!({ "files": files });
            if let Some(code) = finish {
                body["complete"] = true.into();
                body["exitcode"] = code.into();
            }
            post(&ctx, &path, &body)?;
            Ok(())
        })();
        match result {
            Ok(()) => {
                if let Ok(mut st) = m.lock() {
                    let n = lines.len().min(st.pending.len());
                    st.pending.drain(..n);
                }
                offset += lines.len();
                if ctx.warned && backoff > MIN_BACKOFF {
                    tracing::info!("W&B: streaming to {} works again", ctx.settings.base_url);
                }
                backoff = MIN_BACKOFF;
                wait = if finish_seen {
                    Duration::ZERO
                } else {
                    interval
                };
                if finish.is_some() {
                    return;
                }
            }
            Err(e) => {
                if !ctx.warned {
                    ctx.warned = true;
                    tracing::warn!(
                        "W&B: streaming to {} failed ({e}); training continues and kiln retries in the \
                         background. The offline run {} has everything (upload with `wandb sync`)",
                        ctx.settings.base_url,
                        ctx.offline_dir.display()
                    );
                } else {
                    tracing::debug!("W&B: streaming failed again: {e}");
                }
                wait = backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Create (or continue) the run; returns its entity and the number of history lines the server has.
fn upsert_bucket(ctx: &Ctx) -> Result<(String, usize), String> {
    let s = &ctx.settings;
    let opt = |v: &str| {
        if v.is_empty() {
            serde_json::Value::Null
        } else {
            v.into()
        }
    };
    let body = serde_json::json!({
        "operationName": "UpsertBucket",
        "query": UPSERT_BUCKET,
        "variables": {
            "name": ctx.run_id,
            "project": s.project,
            "entity": s.entity,
            "displayName": s.name,
            "groupName": opt(&s.group),
            "jobType": opt(&s.job_type),
            "notes": opt(&s.notes),
            "tags": s.tags,
            "host": hostname(),
            "config": ctx.config_json,
        }
    });
    let resp = post(ctx, &format!("{}/graphql", s.base_url), &body)?;
    if let Some(errs) = resp.get("errors").filter(|e| !e.is_null()) {
        return Err(format!("UpsertBucket: {errs}"));
    }
    let bucket = &resp["data"]["upsertBucket"]["bucket"];
    let entity = bucket["project"]["entity"]["name"]
        .as_str()
        .map(str::to_string)
        .or_else(|| s.entity.clone())
        .ok_or_else(|| "the server named no entity for the run; set WANDB_ENTITY".to_string())?;
    let lines = bucket["historyLineCount"].as_u64().unwrap_or(0) as usize;
    Ok((entity, lines))
}

fn post(ctx: &Ctx, url: &str, body: &serde_json::Value) -> Result<serde_json::Value, String> {
    let client = ctx
        .client
        .as_ref()
        .map_err(|e| format!("HTTP client: {e}"))?;
    let resp = client
        .post(url)
        .header("Authorization", &ctx.auth)
        .json(body)
        .send()
        .map_err(|e| format!("POST {url}: {e}"))?;
    let status = resp.status();
    let text = resp.text().unwrap_or_default();
    if !status.is_success() {
        let snippet: String = text.chars().take(200).collect();
        return Err(format!("POST {url}: HTTP {status}: {snippet}"));
    }
    Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
}
