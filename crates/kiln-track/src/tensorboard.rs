//! TensorBoard scalar event files (`<run dir>/tensorboard/events.out.tfevents.<secs>.<host>.<pid>.0`).
//!
//! Hand-written: the only Rust crate (`tensorboard-rs`) is unmaintained, and a scalar event file is a TFRecord
//! stream of tiny protobuf `Event`s. TFRecord framing: `u64 LE length | masked CRC32C(length) | data |
//! masked CRC32C(data)`, mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8. The first event carries
//! `file_version = "brain.Event:2"`. Values are stored as 32-bit floats (TensorBoard's `simple_value`); NaN and
//! infinities are kept.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

use crate::{End, Row, Sink, TrackError};

/// `tensorflow.Event` (the fields kiln writes).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Event {
    /// Unix time in seconds.
    #[prost(double, tag = "1")]
    pub wall_time: f64,
    /// Global step.
    #[prost(int64, tag = "2")]
    pub step: i64,
    /// `"brain.Event:2"` in the first event of a file.
    #[prost(string, optional, tag = "3")]
    pub file_version: Option<String>,
    /// Scalars of this step.
    #[prost(message, optional, tag = "5")]
    pub summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    /// One value per tag.
    #[prost(message, repeated, tag = "1")]
    pub value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` (scalar only).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SummaryValue {
    /// Metric name.
    #[prost(string, tag = "1")]
    pub tag: String,
    /// The value.
    #[prost(float, optional, tag = "2")]
    pub simple_value: Option<f32>,
}

/// The TFRecord CRC mask.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// One TFRecord frame around `data`.
pub fn tfrecord(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// The TensorBoard sink.
pub(crate) struct TensorBoardSink {
    path: PathBuf,
    file: File,
}

impl TensorBoardSink {
    /// Create a new event file in `<run_dir>/tensorboard/` and write the version event.
    pub(crate) fn open(run_dir: &Path) -> Result<TensorBoardSink, TrackError> {
        let dir = run_dir.join("tensorboard");
        std::fs::create_dir_all(&dir).map_err(|e| TrackError::io(&dir, e))?;
        let now = crate::unix_now();
        let base = format!(
            "events.out.tfevents.{}.{}.{}",
            now as u64,
            crate::wandb::hostname(),
            std::process::id()
        );
        // A resumed run in the same second gets the next free suffix.
        let mut n = 0;
        let path = loop {
            let p = dir.join(format!("{base}.{n}"));
            if !p.exists() {
                break p;
            }
            n += 1;
        };
        let file = File::create(&path).map_err(|e| TrackError::io(&path, e))?;
        let mut sink = TensorBoardSink { path, file };
        sink.write(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(sink)
    }

    fn write(&mut self, ev: &Event) -> Result<(), TrackError> {
        self.file
            .write_all(&tfrecord(&ev.encode_to_vec()))
            .and_then(|_| self.file.flush())
            .map_err(|e| TrackError::io(&self.path, e))
    }
}

impl Sink for TensorBoardSink {
    fn name(&self) -> &'static str {
        "tensorboard"
    }

    fn log(&mut self, row: &Row<'_>) -> Result<(), TrackError> {
        let value = row
            .metrics
            .iter()
            .map(|(k, v)| SummaryValue {
                tag: k.clone(),
                simple_value: Some(*v as f32),
            })
            .collect();
        self.write(&Event {
            wall_time: row.timestamp,
            step: row.step as i64,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    fn finish(&mut self, _end: &End) -> Result<(), TrackError> {
        self.file
            .sync_all()
            .map_err(|e| TrackError::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_mask_known_value() {
        // CRC32C("123456789") = 0xE3069283 (the standard check value)
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, worked out by hand for the check value
        assert_eq!(
            masked_crc32c(b"123456789"),
            0x2507_c60du32.wrapping_add(0xa282_ead8)
        );
    }
}
