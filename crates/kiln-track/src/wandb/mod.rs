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
    /// Last value (JSON) of every history key, replayed rows included: the W&B summary.
    summary: BTreeMap<String, String>,
    /// `_runtime` of the last replayed row: a resumed run's runtime continues from there.
    runtime_offset: f64,
}

impl WandbSink {
    /// Create `<dir>/wandb/offline-run-<YYYYmmdd_HHMMSS>-<id>/run-<id>.wandb` and `files/`, write the header,
    /// run and config records, and start streaming in online mode.
    ///
    /// Resuming from step `s`: the same run id is used, and the history rows with step <= s of the previous
    /// offline directory of this run are copied into the new one first, so the newest directory always holds the
    /// whole run (`wandb sync` uploads history from line 0 and does not resume); the previous directory is
    /// renamed `superseded-offline-run-...` so that `wandb sync --sync-all` skips it.
    pub(crate) fn open(
        s: &WandbSettings,
        run_dir: &Path,
        config: &serde_json::Value,
        resume_from_step: Option<u64>,
    ) -> Result<WandbSink, TrackError> {
        let run_id = match &s.run_id {
            Some(id) => id.clone(),
            None => stored_or_new_run_id(run_dir, resume_from_step.is_some())?,
        };
        let wandb_dir = s.dir.join("wandb");
        let replay = match resume_from_step {
            Some(step) => previous_history(&wandb_dir, &run_id, step),
            None => Replay::default(),
        };
        let ts = chrono::Local::now().format("%Y%m%d_%H%M%S");
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
            summary: BTreeMap::new(),
            runtime_offset: 0.0,
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
                resumed: resume_from_step.is_some(),
            }),
            true,
        )?;
        let replayed = replay.rows.len();
        for h in replay.rows {
            for it in &h.item {
                if it.key == "_runtime"
                    && let Ok(r) = it.value_json.parse::<f64>()
                {
                    sink.runtime_offset = r;
                }
                sink.summary.insert(it.key.clone(), it.value_json.clone());
            }
            sink.write(RecordType::History(h), true)?;
        }
        for old in replay.superseded {
            if let Some(name) = old.file_name() {
                let to = old.with_file_name(format!("superseded-{}", name.to_string_lossy()));
                if let Err(e) = std::fs::rename(&old, &to) {
                    tracing::warn!(
                        "W&B: could not rename the previous offline run {}: {e}",
                        old.display()
                    );
                }
            }
        }
        tracing::info!("W&B offline run: {}", sink.offline_dir.display());
        if s.mode == WandbMode::Online {
            sink.online = Some(online::Streamer::start(
                s,
                &run_id,
                &cfg_items,
                &sink.offline_dir,
                resume_from_step.map(|_| replayed),
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

    fn summary_items(&self) -> Vec<(String, String)> {
        self.summary
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

impl Sink for WandbSink {
    fn name(&self) -> &'static str {
        "wandb"
    }

    fn log(&mut self, row: &Row<'_>) -> Result<(), TrackError> {
        let shifted = Row {
            step: row.step,
            metrics: row.metrics,
            runtime: row.runtime + self.runtime_offset,
            timestamp: row.timestamp,
        };
        let items = history_items(&shifted);
        for (k, v) in &items {
            self.summary.insert(k.clone(), v.clone());
        }
        if let Some(on) = &self.online {
            on.push_history(json_object(&items), json_object(&self.summary_items()));
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

    fn finish(&mut self, end: &End) -> Result<(), TrackError> {
        let items = self.summary_items();
        let runtime = end.runtime + self.runtime_offset;
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
                        runtime: runtime.round().clamp(0.0, i32::MAX as f64) as i32,
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

/// What a resumed run takes over from its previous offline directory.
#[derive(Default)]
struct Replay {
    /// History records with step <= the resume step, in order.
    rows: Vec<HistoryRecord>,
    /// Earlier offline directories of the same run id.
    superseded: Vec<PathBuf>,
}

/// Read the newest `offline-run-*-<run_id>` directory's history up to `max_step` (up to the first corrupt
/// chunk, e.g. the tail of a crashed run).
fn previous_history(wandb_dir: &Path, run_id: &str, max_step: u64) -> Replay {
    let Ok(entries) = std::fs::read_dir(wandb_dir) else {
        return Replay::default();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.join(format!("run-{run_id}.wandb")).is_file()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("offline-run-"))
        })
        .collect();
    dirs.sort();
    let Some(newest) = dirs.last() else {
        return Replay::default();
    };
    let file = newest.join(format!("run-{run_id}.wandb"));
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!("W&B: could not read {} to resume it: {e}", file.display());
            return Replay::default();
        }
    };
    let (records, err) = log::read_records_lenient(&bytes);
    if let Some(e) = err {
        tracing::info!(
            "W&B: resuming from {} up to a damaged tail ({e})",
            file.display()
        );
    }
    let rows = records
        .iter()
        .filter_map(|r| Record::decode(r.as_slice()).ok())
        .filter_map(|r| match r.record_type {
            Some(RecordType::History(h)) => Some(h),
            _ => None,
        })
        .filter(|h| {
            h.step
                .as_ref()
                .is_some_and(|s| s.num >= 0 && s.num as u64 <= max_step)
        })
        .collect();
    Replay {
        rows,
        superseded: dirs,
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
