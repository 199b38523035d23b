//! Weights & Biases: a genuine offline run directory (`wandb sync` uploads it) and live streaming to a W&B server.
//!
//! No maintained Rust W&B client exists (docs/WANDB.md), so kiln writes the `.wandb` transaction log itself
//! ([`log`] framing + [`proto`] messages) and speaks the two HTTP calls a run needs ([`online`]). The offline file
//! is always written, in online mode too: a network failure never loses data.

pub mod log;
pub mod online;
pub mod proto;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Duration;

use prost::Message;

use crate::config::{WandbConfig, WandbMode};
use crate::jsonl::json_number;
use crate::{End, Row, Sink, TrackError};
use proto::{
    ConfigRecord, HeaderRecord, HistoryItem, HistoryRecord, HistoryStep, KeyValueItem, Record,
    RecordType, RunExitRecord, RunRecord, SummaryRecord, Timestamp, VersionInfo,
};

/// The default server.
pub const DEFAULT_BASE_URL: &str = "https://api.wandb.ai";

/// W&B settings after applying the environment (`WANDB_*`) and the recipe (which overrides it).
#[derive(Debug, Clone, PartialEq)]
pub struct WandbSettings {
    /// Resolved mode (online only when an API key is present).
    pub mode: WandbMode,
    /// Project.
    pub project: String,
    /// Entity; `None` = the server's default for the API key.
    pub entity: Option<String>,
    /// Display name.
    pub name: String,
    /// Group (empty = none).
    pub group: String,
    /// Job type.
    pub job_type: String,
    /// Tags.
    pub tags: Vec<String>,
    /// Notes.
    pub notes: String,
    /// Explicit run id (recipe or `WANDB_RUN_ID`), if any.
    pub run_id: Option<String>,
    /// Folder that receives `wandb/`.
    pub dir: PathBuf,
    /// Server base URL, without a trailing slash.
    pub base_url: String,
    /// API key (env only).
    pub api_key: Option<String>,
    /// Interval between file_stream batches.
    pub stream_interval: Duration,
    /// How long finishing waits for the server.
    pub finish_timeout: Duration,
}

fn non_empty(s: Option<String>) -> Option<String> {
    s.map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

impl WandbSettings {
    /// Resolve the settings: recipe value, else environment variable, else default. `env` looks up a variable
    /// (`|k| std::env::var(k).ok()` in production). Online mode without `WANDB_API_KEY` falls back to offline
    /// with a warning.
    pub fn resolve(
        cfg: &WandbConfig,
        run_dir: &Path,
        run_name: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<WandbSettings, TrackError> {
        let var = |k: &str| non_empty(env(k));
        let mode = match cfg.mode {
            Some(m) => m,
            None => match var("WANDB_MODE") {
                None => WandbMode::Disabled,
                Some(v) => WandbMode::parse(&v).ok_or_else(|| {
                    TrackError::Config(format!(
                        "WANDB_MODE={v:?} is not a mode; use online, offline or disabled"
                    ))
                })?,
            },
        };
        let api_key = var("WANDB_API_KEY");
        let mode = if mode == WandbMode::Online && api_key.is_none() {
            tracing::warn!(
                "W&B online mode needs WANDB_API_KEY (from https://wandb.ai/authorize); writing the offline run \
                 only (upload it later with `wandb sync`)"
            );
            WandbMode::Offline
        } else {
            mode
        };
        let tags = match &cfg.tags {
            Some(t) => t.clone(),
            None => var("WANDB_TAGS")
                .map(|t| {
                    t.split(',')
                        .map(|s| s.trim().to_string())
                        .filter(|s| !s.is_empty())
                        .collect()
                })
                .unwrap_or_default(),
        };
        let run_id = non_empty(cfg.run_id.clone()).or_else(|| var("WANDB_RUN_ID"));
        if let Some(id) = &run_id
            && (id.is_empty()
                || id.len() > 64
                || !id
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            return Err(TrackError::Config(format!(
                "W&B run id {id:?} (logging.wandb.run_id / WANDB_RUN_ID) must be 1-64 characters of [a-z0-9_-]"
            )));
        }
        let secs = |v: Option<f64>, default: f64, what: &str| -> Result<Duration, TrackError> {
            let s = v.unwrap_or(default);
            if (0.0..1e6).contains(&s) {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(TrackError::Config(format!(
                    "logging.wandb.{what} = {s} must be between 0 and 1e6 seconds"
                )))
            }
        };
        Ok(WandbSettings {
            mode,
            project: non_empty(cfg.project.clone())
                .or_else(|| var("WANDB_PROJECT"))
                .unwrap_or_else(|| "kiln".into()),
            entity: non_empty(cfg.entity.clone()).or_else(|| var("WANDB_ENTITY")),
            name: non_empty(cfg.name.clone())
                .or_else(|| var("WANDB_NAME"))
                .unwrap_or_else(|| run_name.to_string()),
            group: non_empty(cfg.group.clone())
                .or_else(|| var("WANDB_RUN_GROUP"))
                .unwrap_or_default(),
            job_type: non_empty(cfg.job_type.clone())
                .or_else(|| var("WANDB_JOB_TYPE"))
                .unwrap_or_else(|| "train".into()),
            tags,
            notes: non_empty(cfg.notes.clone())
                .or_else(|| var("WANDB_NOTES"))
                .unwrap_or_default(),
            run_id,
            dir: non_empty(cfg.dir.clone())
                .or_else(|| var("WANDB_DIR"))
                .map(PathBuf::from)
                .unwrap_or_else(|| run_dir.to_path_buf()),
            base_url: non_empty(cfg.base_url.clone())
                .or_else(|| var("WANDB_BASE_URL"))
                .unwrap_or_else(|| DEFAULT_BASE_URL.into())
                .trim_end_matches('/')
                .to_string(),
            api_key,
            stream_interval: secs(cfg.stream_interval_secs, 2.0, "stream_interval_secs")?,
            finish_timeout: secs(cfg.finish_timeout_secs, 30.0, "finish_timeout_secs")?,
        })
    }

    /// The web URL of a run.
    pub fn run_url(&self, entity: &str, run_id: &str) -> String {
        let app = if self.base_url == DEFAULT_BASE_URL {
            "https://wandb.ai".to_string()
        } else {
            self.base_url.clone()
        };
        format!("{app}/{entity}/{}/runs/{run_id}", self.project)
    }
}

/// A new random run id: 8 characters of `[a-z0-9]`.
pub fn new_run_id() -> String {
    use rand::Rng;
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..8)
        .map(|_| CHARS[rng.random_range(0..CHARS.len())] as char)
        .collect()
}

/// The machine's host name (for the run record and TensorBoard file names).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// JSON text of a config/summary value, with non-finite floats as bare tokens.
pub(crate) fn value_json(v: &serde_json::Value) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "null".into())
}

/// Config items: one per top-level key of the resolved recipe (a non-object config becomes `{"config": ...}`).
pub(crate) fn config_items(config: &serde_json::Value) -> Vec<(String, String)> {
    match config {
        serde_json::Value::Object(m) => m.iter().map(|(k, v)| (k.clone(), value_json(v))).collect(),
        serde_json::Value::Null => Vec::new(),
        other => vec![("config".into(), value_json(other))],
    }
}

/// The history row as W&B sees it: the metrics plus `_step`, `_runtime`, `_timestamp`, as (key, JSON) pairs.
pub(crate) fn history_items(row: &Row<'_>) -> Vec<(String, String)> {
    let mut items: Vec<(String, String)> = row
        .metrics
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "_step" | "_runtime" | "_timestamp"))
        .map(|(k, v)| (k.clone(), json_number(*v)))
        .collect();
    items.push(("_step".into(), row.step.to_string()));
    items.push(("_runtime".into(), json_number(row.runtime)));
    items.push(("_timestamp".into(), json_number(row.timestamp)));
    items
}

/// `{"k": v, ...}` from (key, JSON) pairs.
pub(crate) fn json_object(items: &[(String, String)]) -> String {
    let mut s = String::from("{");
    for (i, (k, v)) in items.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&crate::jsonl::json_string(k));
        s.push(':');
        s.push_str(v);
    }
    s.push('}');
    s
}

/// Summary items: every key's last value (the summary map already holds `_step`, `_runtime`, `_timestamp`).
pub(crate) fn summary_items(summary: &BTreeMap<String, f64>) -> Vec<(String, String)> {
    summary
        .iter()
        .map(|(k, v)| {
            let j = if k == "_step" {
                format!("{}", *v as u64)
            } else {
                json_number(*v)
            };
            (k.clone(), j)
        })
        .collect()
}

fn kv(items: &[(String, String)]) -> Vec<KeyValueItem> {
    items
        .iter()
        .map(|(k, v)| KeyValueItem {
            key: k.clone(),
            nested_key: Vec::new(),
            value_json: v.clone(),
        })
        .collect()
}

/// The offline `.wandb` writer (and, in online mode, the live stream beside it).
pub(crate) struct WandbSink {
    path: PathBuf,
    offline_dir: PathBuf,
    writer: log::LogWriter<File>,
    num: i64,
    online: Option<online::Streamer>,
}

impl WandbSink {
    /// Create `<dir>/wandb/offline-run-<YYYYmmdd_HHMMSS>-<id>/run-<id>.wandb` and `files/`, write the header,
    /// run and config records, and start streaming in online mode.
    pub(crate) fn open(
        s: &WandbSettings,
        run_dir: &Path,
        config: &serde_json::Value,
        resumed: bool,
    ) -> Result<WandbSink, TrackError> {
        let run_id = match &s.run_id {
            Some(id) => id.clone(),
            None => stored_or_new_run_id(run_dir, resumed)?,
        };
        let ts = chrono::Local::now().format("%Y%m%d_%H%M%S");
        let wandb_dir = s.dir.join("wandb");
        let mut offline_dir = wandb_dir.join(format!("offline-run-{ts}-{run_id}"));
        if offline_dir.exists() {
            // A resumed run started within the same second: keep both directories.
            offline_dir =
                wandb_dir.join(format!("offline-run-{ts}-{run_id}-{}", std::process::id()));
        }
        let files = offline_dir.join("files");
        std::fs::create_dir_all(&files).map_err(|e| TrackError::io(&files, e))?;
        let path = offline_dir.join(format!("run-{run_id}.wandb"));
        let file = File::create(&path).map_err(|e| TrackError::io(&path, e))?;
        let writer = log::LogWriter::new(file).map_err(|e| TrackError::io(&path, e))?;
        let mut sink = WandbSink {
            path,
            offline_dir,
            writer,
            num: 0,
            online: None,
        };
        sink.write(
            RecordType::Header(HeaderRecord {
                version_info: Some(VersionInfo {
                    producer: format!("kiln-track {}", env!("CARGO_PKG_VERSION")),
                    min_consumer: String::new(),
                }),
            }),
            false,
        )?;
        let now = chrono::Utc::now();
        let cfg_items = config_items(config);
        sink.write(
            RecordType::Run(RunRecord {
                run_id: run_id.clone(),
                entity: s.entity.clone().unwrap_or_default(),
                project: s.project.clone(),
                config: Some(ConfigRecord {
                    update: kv(&cfg_items),
                    remove: Vec::new(),
                }),
                run_group: s.group.clone(),
                job_type: s.job_type.clone(),
                display_name: s.name.clone(),
                notes: s.notes.clone(),
                tags: s.tags.clone(),
                host: hostname(),
                start_time: Some(Timestamp {
                    seconds: now.timestamp(),
                    nanos: now.timestamp_subsec_nanos() as i32,
                }),
                resumed,
            }),
            true,
        )?;
        tracing::info!("W&B offline run: {}", sink.offline_dir.display());
        if s.mode == WandbMode::Online {
            sink.online = Some(online::Streamer::start(
                s,
                &run_id,
                &cfg_items,
                &sink.offline_dir,
            ));
        }
        Ok(sink)
    }

    fn write(&mut self, rt: RecordType, numbered: bool) -> Result<(), TrackError> {
        let num = if numbered {
            self.num += 1;
            self.num
        } else {
            0
        };
        let rec = Record {
            num,
            record_type: Some(rt),
        };
        self.writer
            .add_record(&rec.encode_to_vec())
            .map_err(|e| TrackError::io(&self.path, e))
    }
}

impl Sink for WandbSink {
    fn name(&self) -> &'static str {
        "wandb"
    }

    fn log(&mut self, row: &Row<'_>) -> Result<(), TrackError> {
        let items = history_items(row);
        if let Some(on) = &self.online {
            on.push_history(json_object(&items));
        }
        self.write(
            RecordType::History(HistoryRecord {
                item: items
                    .into_iter()
                    .map(|(key, value_json)| HistoryItem { key, value_json })
                    .collect(),
                step: Some(HistoryStep {
                    num: row.step as i64,
                }),
            }),
            true,
        )
    }

    fn finish(&mut self, end: &End<'_>) -> Result<(), TrackError> {
        let items = summary_items(end.summary);
        let res = self
            .write(
                RecordType::Summary(SummaryRecord {
                    update: kv(&items),
                    remove: Vec::new(),
                }),
                true,
            )
            .and_then(|_| {
                self.write(
                    RecordType::Exit(RunExitRecord {
                        exit_code: end.exit_code,
                        runtime: end.runtime.round().clamp(0.0, i32::MAX as f64) as i32,
                    }),
                    true,
                )
            })
            .and_then(|_| {
                self.writer
                    .get_mut()
                    .sync_all()
                    .map_err(|e| TrackError::io(&self.path, e))
            });
        if let Some(on) = self.online.take() {
            on.finish(json_object(&items), end.exit_code);
        } else if end.exit_code == 0 {
            tracing::info!(
                "W&B offline run written; upload it with `wandb sync {}`",
                self.offline_dir.display()
            );
        }
        res
    }
}

/// The run id kept in `<run_dir>/wandb/kiln-run-id` (so a resumed run continues the same W&B run); a new one is
/// created and stored when there is none.
fn stored_or_new_run_id(run_dir: &Path, resumed: bool) -> Result<String, TrackError> {
    let path = run_dir.join("wandb").join("kiln-run-id");
    if resumed && let Ok(s) = std::fs::read_to_string(&path) {
        let s = s.trim().to_string();
        if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric()) {
            return Ok(s);
        }
    }
    let id = new_run_id();
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| TrackError::io(parent, e))?;
    }
    std::fs::write(&path, format!("{id}\n")).map_err(|e| TrackError::io(&path, e))?;
    Ok(id)
}
