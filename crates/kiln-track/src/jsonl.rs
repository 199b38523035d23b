//! `metrics.jsonl`: one JSON object per training step, and its reader.
//!
//! Each line is `{"step": N, "<metric>": value, ...}` with the metric keys sorted. JSON has no representation for
//! non-finite numbers, and dropping or nulling them would hide a diverging run, so kiln writes them as the bare
//! tokens `NaN`, `Infinity` and `-Infinity` (the convention of JavaScript's number syntax, which Python's `json`
//! module and pandas read back as floats). [`read_metrics`] reads that convention too.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::TrackError;

/// One row of `metrics.jsonl`.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsRow {
    /// The training step.
    pub step: u64,
    /// Metric values by key (may be non-finite).
    pub values: BTreeMap<String, f64>,
}

/// Format a float as a JSON number, or as a bare `NaN` / `Infinity` / `-Infinity` token.
pub fn json_number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else {
        // serde_json writes the shortest representation that round-trips (ryu).
        serde_json::Number::from_f64(v)
            .map(|n| n.to_string())
            .unwrap_or_else(|| "NaN".to_string())
    }
}

/// Format a JSON string literal (with escapes).
pub(crate) fn json_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// One `metrics.jsonl` line (without the newline).
pub fn format_row(step: u64, metrics: &BTreeMap<String, f64>) -> String {
    let mut line = String::with_capacity(32 + metrics.len() * 24);
    line.push_str("{\"step\": ");
    line.push_str(&step.to_string());
    for (k, v) in metrics {
        if k == "step" {
            continue;
        }
        line.push_str(", ");
        line.push_str(&json_string(k));
        line.push_str(": ");
        line.push_str(&json_number(*v));
    }
    line.push('}');
    line
}

/// The JSONL sink.
pub(crate) struct JsonlSink {
    path: PathBuf,
    file: File,
}

impl JsonlSink {
    /// Open `<run_dir>/metrics.jsonl`. With `resume_from_step = Some(s)`, rows with step > s are removed first and
    /// new rows are appended; otherwise the file is created fresh.
    pub(crate) fn open(
        run_dir: &Path,
        resume_from_step: Option<u64>,
    ) -> Result<JsonlSink, TrackError> {
        let path = run_dir.join("metrics.jsonl");
        let io = |e| TrackError::io(&path, e);
        let file = match resume_from_step {
            None => File::create(&path).map_err(io)?,
            Some(s) => {
                let mut file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(&path)
                    .map_err(io)?;
                let keep = kept_prefix_len(&mut file, s).map_err(io)?;
                file.set_len(keep).map_err(io)?;
                file.seek(SeekFrom::End(0)).map_err(io)?;
                file
            }
        };
        Ok(JsonlSink { path, file })
    }

    pub(crate) fn log(
        &mut self,
        step: u64,
        metrics: &BTreeMap<String, f64>,
    ) -> Result<(), TrackError> {
        let mut line = format_row(step, metrics);
        line.push('\n');
        // One write per line and a flush: a crash leaves at most a partial last line, which the reader skips.
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .map_err(|e| TrackError::io(&self.path, e))
    }

    pub(crate) fn finish(&mut self) -> Result<(), TrackError> {
        self.file
            .sync_data()
            .map_err(|e| TrackError::io(&self.path, e))
    }
}

/// Byte length of the leading lines whose step is <= `max_step`. Stops at the first line with a larger step or
/// a line that does not parse (e.g. a partial line left by a crash).
fn kept_prefix_len(file: &mut File, max_step: u64) -> std::io::Result<u64> {
    file.seek(SeekFrom::Start(0))?;
    let mut reader = BufReader::new(&mut *file);
    let mut keep = 0u64;
    let mut buf = String::new();
    loop {
        buf.clear();
        let n = reader.read_line(&mut buf)?;
        if n == 0 || !buf.ends_with('\n') {
            break;
        }
        match parse_line(buf.trim_end()) {
            Ok(row) if row.step <= max_step => keep += n as u64,
            _ => break,
        }
    }
    Ok(keep)
}

/// Read every row of a `metrics.jsonl` file. Blank lines are skipped; a partial last line (a crash mid-write) is
/// ignored; any other malformed line is an error naming `file:line`.
pub fn read_metrics(path: &Path) -> Result<Vec<MetricsRow>, TrackError> {
    let text = std::fs::read_to_string(path).map_err(|e| TrackError::io(path, e))?;
    let complete = text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut rows = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line) {
            Ok(row) => rows.push(row),
            Err(_) if i + 1 == lines.len() && !complete => break,
            Err(msg) => {
                return Err(TrackError::Parse {
                    path: path.to_path_buf(),
                    line: i + 1,
                    msg,
                });
            }
        }
    }
    Ok(rows)
}

/// Parse one line: a flat JSON object whose values are numbers, `NaN`/`Infinity`/`-Infinity` tokens, or other
/// JSON values (which are ignored; only numbers are metrics). Needs a `step` key with a non-negative integer.
pub fn parse_line(line: &str) -> Result<MetricsRow, String> {
    // serde_json rejects the bare tokens, so first replace them (outside string literals) with unique strings.
    // JSON text of the markers (a NUL character cannot occur in a metric line's own values).
    const NAN: &str = r#""\u0000kiln:NaN""#;
    const INF: &str = r#""\u0000kiln:Inf""#;
    const NINF: &str = r#""\u0000kiln:-Inf""#;
    let mut out = String::with_capacity(line.len() + 16);
    let mut in_str = false;
    let mut escaped = false;
    let mut rest = line;
    while let Some(c) = rest.chars().next() {
        if in_str {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_str = false;
            }
            rest = &rest[c.len_utf8()..];
            continue;
        }
        if c == '"' {
            in_str = true;
        } else if let Some(r) = rest.strip_prefix("NaN") {
            out.push_str(NAN);
            rest = r;
            continue;
        } else if let Some(r) = rest.strip_prefix("-Infinity") {
            out.push_str(NINF);
            rest = r;
            continue;
        } else if let Some(r) = rest.strip_prefix("Infinity") {
            out.push_str(INF);
            rest = r;
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    let obj: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&out).map_err(|e| format!("not a JSON object: {e}"))?;
    let step = obj
        .get("step")
        .and_then(|v| v.as_u64())
        .ok_or_else(|| "missing or invalid \"step\" (a non-negative integer)".to_string())?;
    let mut values = BTreeMap::new();
    for (k, v) in obj {
        if k == "step" {
            continue;
        }
        let x = match &v {
            serde_json::Value::Number(n) => n.as_f64(),
            serde_json::Value::String(s) if s == "\u{0}kiln:NaN" => Some(f64::NAN),
            serde_json::Value::String(s) if s == "\u{0}kiln:Inf" => Some(f64::INFINITY),
            serde_json::Value::String(s) if s == "\u{0}kiln:-Inf" => Some(f64::NEG_INFINITY),
            _ => None,
        };
        if let Some(x) = x {
            values.insert(k, x);
        }
    }
    Ok(MetricsRow { step, values })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn row_format_sorted_and_non_finite_tokens() {
        let row = format_row(
            7,
            &m(&[
                ("z", 1.5),
                ("a/b", f64::NAN),
                ("inf", f64::INFINITY),
                ("ninf", f64::NEG_INFINITY),
                ("one", 1.0),
            ]),
        );
        assert_eq!(
            row,
            r#"{"step": 7, "a/b": NaN, "inf": Infinity, "ninf": -Infinity, "one": 1.0, "z": 1.5}"#
        );
        let back = parse_line(&row).unwrap();
        assert_eq!(back.step, 7);
        assert!(back.values["a/b"].is_nan());
        assert_eq!(back.values["inf"], f64::INFINITY);
        assert_eq!(back.values["ninf"], f64::NEG_INFINITY);
        assert_eq!(back.values["z"], 1.5);
    }

    #[test]
    fn tokens_inside_strings_are_left_alone() {
        let row = parse_line(r#"{"step": 1, "NaN Infinity": 2, "note": "NaN", "x": NaN}"#).unwrap();
        assert_eq!(row.values["NaN Infinity"], 2.0);
        assert!(!row.values.contains_key("note"));
        assert!(row.values["x"].is_nan());
    }

    #[test]
    fn float_round_trip() {
        for v in [0.1, 3e-7, 1e300, -2.5e-300, 123456789.0] {
            let r = parse_line(&format_row(0, &m(&[("v", v)]))).unwrap();
            assert_eq!(r.values["v"], v);
        }
    }

    #[test]
    fn resume_truncates_later_rows_and_appends() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut s = JsonlSink::open(dir.path(), None).unwrap();
            for step in 1..=10 {
                s.log(step, &m(&[("x", step as f64)])).unwrap();
            }
        }
        // a crash left a partial line
        let path = dir.path().join("metrics.jsonl");
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(b"{\"step\": 11, \"x\"").unwrap();
        drop(f);
        assert_eq!(read_metrics(&path).unwrap().len(), 10);
        {
            let mut s = JsonlSink::open(dir.path(), Some(6)).unwrap();
            for step in 7..=8 {
                s.log(step, &m(&[("x", 100.0 + step as f64)])).unwrap();
            }
        }
        let rows = read_metrics(&path).unwrap();
        let steps: Vec<u64> = rows.iter().map(|r| r.step).collect();
        assert_eq!(steps, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(rows[6].values["x"], 107.0);
    }

    #[test]
    fn malformed_line_reports_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(&path, "{\"step\": 1}\n{oops}\n{\"step\": 3}\n").unwrap();
        let err = read_metrics(&path).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl:2"), "{err}");
    }
}
