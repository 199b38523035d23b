//! The few `wandb_internal` protobuf messages kiln writes into a `.wandb` file.
//!
//! Written by hand with `prost` derives instead of generated from `wandb_internal.proto`: kiln needs seven
//! messages out of hundreds, and code generation would need `protoc` and the W&B proto tree at build time. Field
//! numbers and types follow `wandb/proto/wandb_internal.proto` (wandb 0.31.0); see docs/WANDB.md. Fields kiln
//! does not write are simply absent (protobuf readers treat them as unset).

/// `wandb_internal.Record`: one entry of the transaction log.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Record {
    /// Sequence number, 1, 2, 3, ... (the header has none).
    #[prost(int64, tag = "1")]
    pub num: i64,
    /// The payload.
    #[prost(oneof = "RecordType", tags = "2, 3, 5, 17, 18, 21")]
    pub record_type: Option<RecordType>,
}

/// `Record.record_type` (the subset kiln writes).
#[derive(Clone, PartialEq, prost::Oneof)]
#[allow(clippy::large_enum_variant)] // one short-lived record at a time
pub enum RecordType {
    /// One row of metrics.
    #[prost(message, tag = "2")]
    History(HistoryRecord),
    /// Summary update.
    #[prost(message, tag = "3")]
    Summary(SummaryRecord),
    /// Config update.
    #[prost(message, tag = "5")]
    Config(ConfigRecord),
    /// The run's identity and metadata.
    #[prost(message, tag = "17")]
    Run(RunRecord),
    /// End of the run.
    #[prost(message, tag = "18")]
    Exit(RunExitRecord),
    /// File header record.
    #[prost(message, tag = "21")]
    Header(HeaderRecord),
}

/// `google.protobuf.Timestamp`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Timestamp {
    /// Seconds since the Unix epoch.
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    /// Nanoseconds within the second.
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// `wandb_internal.RunRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunRecord {
    /// 8 characters of `[a-z0-9]`.
    #[prost(string, tag = "1")]
    pub run_id: String,
    /// Entity (may be empty: the server's default).
    #[prost(string, tag = "2")]
    pub entity: String,
    /// Project.
    #[prost(string, tag = "3")]
    pub project: String,
    /// Initial config.
    #[prost(message, optional, tag = "4")]
    pub config: Option<ConfigRecord>,
    /// Group.
    #[prost(string, tag = "6")]
    pub run_group: String,
    /// Job type.
    #[prost(string, tag = "7")]
    pub job_type: String,
    /// Display name.
    #[prost(string, tag = "8")]
    pub display_name: String,
    /// Notes.
    #[prost(string, tag = "9")]
    pub notes: String,
    /// Tags.
    #[prost(string, repeated, tag = "10")]
    pub tags: Vec<String>,
    /// Host name.
    #[prost(string, tag = "13")]
    pub host: String,
    /// Start time.
    #[prost(message, optional, tag = "17")]
    pub start_time: Option<Timestamp>,
    /// Whether this continues an earlier run.
    #[prost(bool, tag = "18")]
    pub resumed: bool,
}

/// `wandb_internal.ConfigItem` / `SummaryItem` (same layout).
#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyValueItem {
    /// Key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// Nested key path (unused by kiln).
    #[prost(string, repeated, tag = "2")]
    pub nested_key: Vec<String>,
    /// The value as JSON text (`NaN`/`Infinity` tokens for non-finite numbers).
    #[prost(string, tag = "16")]
    pub value_json: String,
}

/// `wandb_internal.ConfigRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigRecord {
    /// Keys set.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<KeyValueItem>,
    /// Keys removed.
    #[prost(message, repeated, tag = "2")]
    pub remove: Vec<KeyValueItem>,
}

/// `wandb_internal.SummaryRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryRecord {
    /// Keys set.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<KeyValueItem>,
    /// Keys removed.
    #[prost(message, repeated, tag = "2")]
    pub remove: Vec<KeyValueItem>,
}

/// `wandb_internal.HistoryItem` (kiln only uses key + value_json).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistoryItem {
    /// Metric key.
    #[prost(string, tag = "1")]
    pub key: String,
    /// The value as JSON text.
    #[prost(string, tag = "16")]
    pub value_json: String,
}

/// `wandb_internal.HistoryStep`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistoryStep {
    /// The step.
    #[prost(int64, tag = "1")]
    pub num: i64,
}

/// `wandb_internal.HistoryRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HistoryRecord {
    /// The row's values, including `_step`, `_runtime` and `_timestamp`.
    #[prost(message, repeated, tag = "1")]
    pub item: Vec<HistoryItem>,
    /// The step.
    #[prost(message, optional, tag = "2")]
    pub step: Option<HistoryStep>,
}

/// `wandb_internal.RunExitRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunExitRecord {
    /// Process exit code (0 = success).
    #[prost(int32, tag = "1")]
    pub exit_code: i32,
    /// Runtime in whole seconds.
    #[prost(int32, tag = "2")]
    pub runtime: i32,
}

/// `wandb_internal.VersionInfo`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct VersionInfo {
    /// The writer, e.g. `kiln-track 0.1.0`.
    #[prost(string, tag = "1")]
    pub producer: String,
    /// Oldest reader version that understands the file.
    #[prost(string, tag = "2")]
    pub min_consumer: String,
}

/// `wandb_internal.HeaderRecord`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderRecord {
    /// Who wrote the file.
    #[prost(message, optional, tag = "1")]
    pub version_info: Option<VersionInfo>,
}
