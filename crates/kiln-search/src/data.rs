//! Question-answering data: loaders for Search-R1 style JSONL and the multi-hop formats in
//! `../shared/datasets/`, with strict (`file:line` error) and lenient (skip and count) handling of bad lines.
//!
//! One reader covers every layout: a file is JSONL (gzip detected from the magic bytes) or, if its first
//! non-blank character is `[`, a JSON array. Each record is an object with
//! - `question`: a non-empty string (required);
//! - the gold answers, from the first present of `golden_answers` (Search-R1 / FlashRAG), `answers`
//!   (`gold_context_union_qa.jsonl`), `answer` (R1-Searcher samples, NQ-open, HotpotQA, MuSiQue) or
//!   `reward_model.ground_truth.target` (Search-R1's parquet rows exported to JSONL): a string or a list of
//!   strings; `answer_aliases` (MuSiQue) are appended. Blank aliases are dropped; no alias left, or an alias that
//!   is not a string, is a bad line;
//! - optional `id` (string or integer; else `idx`; else `<file stem>-<line>`), `data_source` (else `dataset`,
//!   else the file stem), `type`;
//! - optional supporting evidence: `supporting_passage_ids`, `supporting_titles`, HotpotQA's `supporting_facts`
//!   (HF `{"title": [...], "sent_id": [...]}` or the original `[[title, sent], ...]`), MuSiQue's `paragraphs`
//!   with `is_supporting`;
//! - MuSiQue's `answerable: false` makes the record a bad line (no gold answer to score).
//!
//! Line length: a JSONL line longer than [`kiln_retrieval::corpus::default_max_line_bytes`] (16 MiB unless the
//! environment variable `KILN_MAX_LINE_BYTES` raises it) is an error, detected while reading (also through gzip)
//! without holding the line; a JSON array file is read whole and may be at most [`MAX_JSON_ARRAY_BYTES`].
//!
//! Parquet is not supported (no small maintained pure-Rust reader in the workspace; convert with
//! `pandas.read_parquet(p).to_json(out, orient="records", lines=True)`).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Error;
use crate::reward::Gold;

/// How many bad lines are logged one by one before only counting them.
pub const MAX_LOGGED_BAD_LINES: usize = 10;

/// Largest JSON array file (bytes, after gunzip) that [`load_qa`] reads whole; convert bigger ones to JSONL.
pub const MAX_JSON_ARRAY_BYTES: u64 = 1 << 30;

/// One question with its gold answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QaExample {
    /// Example id.
    pub id: String,
    /// The question.
    pub question: String,
    /// Gold answer aliases (at least one, none blank).
    pub golden_answers: Vec<String>,
    /// Dataset name.
    pub data_source: String,
    /// Ids of corpus passages supporting the answer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub supporting_passage_ids: Vec<String>,
    /// Titles of supporting passages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub supporting_titles: Vec<String>,
    /// Question type (`bridge`, `comparison`, `1hop`, ...), when known.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

impl QaExample {
    /// The gold answers and evidence for the reward.
    pub fn gold(&self) -> Gold {
        Gold {
            answers: self.golden_answers.clone(),
            supporting_passage_ids: self.supporting_passage_ids.clone(),
            supporting_titles: self.supporting_titles.clone(),
        }
    }
}

/// Loader settings.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoadOptions {
    /// Stop at the first bad line with a `file:line` error (default: skip, log and count).
    pub strict: bool,
    /// Keep at most this many examples.
    pub limit: Option<usize>,
}

/// A loaded dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    /// The file.
    pub path: PathBuf,
    /// The usable examples, in file order.
    pub examples: Vec<QaExample>,
    /// Bad lines skipped (lenient mode).
    pub skipped: usize,
}

fn str_list(v: &Value, field: &str) -> Result<Vec<String>, String> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) => a
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.clone()),
                other => Err(format!(
                    "\"{field}\" must hold strings, found {}",
                    short(other)
                )),
            })
            .collect(),
        other => Err(format!(
            "\"{field}\" must be a string or a list of strings, found {}",
            short(other)
        )),
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        let mut end = 60;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    } else {
        s
    }
}

fn id_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Parses one record. `default_source` names the dataset when the record does not; `line` makes default ids.
pub fn parse_record(v: &Value, default_source: &str, line: usize) -> Result<QaExample, String> {
    let Value::Object(o) = v else {
        return Err(format!("expected a JSON object, found {}", short(v)));
    };
    let question = match o.get("question") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_string(),
        Some(Value::String(_)) => return Err("\"question\" is empty".into()),
        Some(other) => {
            return Err(format!(
                "\"question\" must be a string, found {}",
                short(other)
            ));
        }
        None => return Err("missing \"question\"".into()),
    };
    if o.get("answerable") == Some(&Value::Bool(false)) {
        return Err("the record is marked \"answerable\": false (no gold answer)".into());
    }
    let nested = o
        .get("reward_model")
        .and_then(|r| r.get("ground_truth"))
        .and_then(|g| g.get("target"));
    let (field, raw) = ["golden_answers", "answers", "answer"]
        .iter()
        .find_map(|k| o.get(*k).map(|v| (*k, v)))
        .or(nested.map(|v| ("reward_model.ground_truth.target", v)))
        .ok_or_else(|| {
            "missing the gold answer: add \"golden_answers\" (list of strings), \"answers\" or \"answer\"".to_string()
        })?;
    let mut answers = str_list(raw, field)?;
    if let Some(al) = o.get("answer_aliases") {
        answers.extend(str_list(al, "answer_aliases")?);
    }
    let mut golden_answers: Vec<String> = Vec::new();
    for a in answers {
        let a = a.trim().to_string();
        if !a.is_empty() && !golden_answers.contains(&a) {
            golden_answers.push(a);
        }
    }
    if golden_answers.is_empty() {
        return Err(format!("\"{field}\" has no non-empty answer"));
    }
    let id = o
        .get("id")
        .and_then(id_string)
        .or_else(|| o.get("idx").and_then(id_string))
        .unwrap_or_else(|| format!("{default_source}-{line}"));
    let data_source = ["data_source", "dataset"]
        .iter()
        .find_map(|k| o.get(*k).and_then(Value::as_str))
        .unwrap_or(default_source)
        .to_string();
    let supporting_passage_ids = match o.get("supporting_passage_ids") {
        Some(v) => str_list(v, "supporting_passage_ids")?,
        None => Vec::new(),
    };
    let mut supporting_titles = match o.get("supporting_titles") {
        Some(v) => str_list(v, "supporting_titles")?,
        None => Vec::new(),
    };
    match o.get("supporting_facts") {
        Some(Value::Object(sf)) => {
            if let Some(t) = sf.get("title") {
                supporting_titles.extend(str_list(t, "supporting_facts.title")?);
            }
        }
        Some(Value::Array(pairs)) => {
            for p in pairs {
                if let Some(t) = p.get(0).and_then(Value::as_str) {
                    supporting_titles.push(t.to_string());
                }
            }
        }
        _ => {}
    }
    if let Some(Value::Array(ps)) = o.get("paragraphs") {
        for p in ps {
            if p.get("is_supporting") == Some(&Value::Bool(true))
                && let Some(t) = p.get("title").and_then(Value::as_str)
            {
                supporting_titles.push(t.to_string());
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    supporting_titles.retain(|t| seen.insert(t.clone()));
    let kind = o.get("type").and_then(Value::as_str).map(str::to_string);
    Ok(QaExample {
        id,
        question,
        golden_answers,
        data_source,
        supporting_passage_ids,
        supporting_titles,
        kind,
    })
}

fn open_maybe_gz(path: &Path) -> Result<Box<dyn BufRead>, Error> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic).map_err(|e| Error::io(path, e))?;
    drop(f);
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    if n == 2 && magic == [0x1f, 0x8b] {
        Ok(Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(
            f,
        ))))
    } else {
        Ok(Box::new(BufReader::new(f)))
    }
}

struct BadLines<'a> {
    path: &'a Path,
    strict: bool,
    count: usize,
}

impl BadLines<'_> {
    fn record(&mut self, line: usize, msg: String) -> Result<(), Error> {
        if self.strict {
            return Err(Error::BadLine {
                path: self.path.to_path_buf(),
                line,
                msg,
            });
        }
        self.count += 1;
        if self.count <= MAX_LOGGED_BAD_LINES {
            tracing::warn!("{}:{line}: skipped: {msg}", self.path.display());
        }
        Ok(())
    }
}

/// Loads a QA file (JSONL, gzipped JSONL or JSON array; see the module docs).
pub fn load_qa(path: &Path, options: &LoadOptions) -> Result<Loaded, Error> {
    load_qa_with_max_line(
        path,
        options,
        kiln_retrieval::corpus::default_max_line_bytes(),
    )
}

/// [`load_qa`] with an explicit longest accepted JSONL line in bytes.
pub fn load_qa_with_max_line(
    path: &Path,
    options: &LoadOptions,
    max_line_bytes: usize,
) -> Result<Loaded, Error> {
    let stem = path
        .file_name()
        .and_then(|s| s.to_str())
        .map(|s| s.split('.').next().unwrap_or(s).to_string())
        .unwrap_or_else(|| "data".into());
    let mut reader = open_maybe_gz(path)?;
    let mut bad = BadLines {
        path,
        strict: options.strict,
        count: 0,
    };
    let limit = options.limit.unwrap_or(usize::MAX);
    let mut examples = Vec::new();
    // Peek the first non-blank byte to tell a JSON array from JSONL.
    let first = loop {
        let buf = reader.fill_buf().map_err(|e| Error::io(path, e))?;
        if buf.is_empty() {
            break None;
        }
        match buf.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => break Some(buf[i]),
            None => {
                let n = buf.len();
                reader.consume(n);
            }
        }
    };
    if first == Some(b'[') {
        let mut text = String::new();
        (&mut reader)
            .take(MAX_JSON_ARRAY_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|e| Error::io(path, e))?;
        if text.len() as u64 > MAX_JSON_ARRAY_BYTES {
            return Err(Error::Invalid(format!(
                "{}: a JSON array file over {MAX_JSON_ARRAY_BYTES} bytes; convert it to JSONL (one object per line)",
                path.display()
            )));
        }
        let arr: Vec<Value> = serde_json::from_str(&text).map_err(|e| Error::BadLine {
            path: path.to_path_buf(),
            line: e.line(),
            msg: format!("not a JSON array of question objects: {e}"),
        })?;
        for (i, v) in arr.iter().enumerate() {
            if examples.len() >= limit {
                break;
            }
            match parse_record(v, &stem, i + 1) {
                Ok(ex) => examples.push(ex),
                Err(m) => bad.record(i + 1, format!("array element {}: {m}", i + 1))?,
            }
        }
    } else {
        let mut buf = Vec::new();
        let mut line = 0usize;
        while examples.len() < limit {
            buf.clear();
            use kiln_retrieval::corpus::{LineRead, line_too_long_message, read_line_capped};
            let read = read_line_capped(&mut reader, &mut buf, max_line_bytes)
                .map_err(|e| Error::io(path, e))?;
            if read == LineRead::Eof {
                break;
            }
            line += 1;
            if read == LineRead::TooLong {
                return Err(Error::BadLine {
                    path: path.to_path_buf(),
                    line,
                    msg: line_too_long_message(max_line_bytes),
                });
            }
            let Ok(s) = std::str::from_utf8(&buf) else {
                bad.record(line, "not valid UTF-8".into())?;
                continue;
            };
            let s = s.trim();
            if s.is_empty() {
                continue;
            }
            match serde_json::from_str::<Value>(s) {
                Err(e) => bad.record(line, format!("not JSON ({e})"))?,
                Ok(v) => match parse_record(&v, &stem, line) {
                    Ok(ex) => examples.push(ex),
                    Err(m) => bad.record(line, m)?,
                },
            }
        }
    }
    if bad.count > MAX_LOGGED_BAD_LINES {
        tracing::warn!(
            "{}: skipped {} bad lines in total",
            path.display(),
            bad.count
        );
    }
    if examples.is_empty() {
        return Err(Error::Empty {
            path: path.to_path_buf(),
            skipped: bad.count,
            hint: "each line needs a \"question\" string and gold answers (\"golden_answers\", \"answers\" or \"answer\")".into(),
        });
    }
    Ok(Loaded {
        path: path.to_path_buf(),
        examples,
        skipped: bad.count,
    })
}

/// Writes examples as Search-R1 style JSONL (`id`, `question`, `golden_answers`, `data_source`, ...).
pub fn write_qa(path: &Path, examples: &[QaExample]) -> Result<(), Error> {
    let mut s = String::new();
    for ex in examples {
        s.push_str(&serde_json::to_string(ex).map_err(|e| Error::Invalid(e.to_string()))?);
        s.push('\n');
    }
    std::fs::write(path, s).map_err(|e| Error::io(path, e))
}

/// Named evaluation sets under the shared datasets folder: `(name, relative path)`.
pub const SHARED_DATASETS: &[(&str, &str)] = &[
    ("hotpotqa_dev500", "multihop/hotpotqa_dev500.jsonl"),
    ("musique_dev500", "multihop/musique_dev500.jsonl"),
    ("nq_open_dev", "multihop/nq_open_dev.jsonl"),
    ("train_questions_8k", "multihop/train_questions_8k.jsonl"),
    (
        "hotpotqa_dev_distractor100",
        "multihop/hotpotqa_dev_distractor100.jsonl",
    ),
    (
        "musique_dev100_paragraphs",
        "multihop/musique_dev100_paragraphs.json",
    ),
    (
        "gold_context_union_qa",
        "corpus/gold_context_union_qa.jsonl",
    ),
];

/// Resolves a dataset argument: an existing file path, or a name of [`SHARED_DATASETS`] under `datasets_root`
/// (e.g. `../shared/datasets`).
pub fn resolve_dataset(name_or_path: &str, datasets_root: &Path) -> Result<PathBuf, Error> {
    let p = Path::new(name_or_path);
    if p.is_file() {
        return Ok(p.to_path_buf());
    }
    if let Some((_, rel)) = SHARED_DATASETS.iter().find(|(n, _)| *n == name_or_path) {
        let full = datasets_root.join(rel);
        if full.is_file() {
            return Ok(full);
        }
        return Err(Error::Invalid(format!(
            "dataset {name_or_path} should be at {}, which does not exist; point --datasets-root at the shared datasets folder",
            full.display()
        )));
    }
    let names: Vec<&str> = SHARED_DATASETS.iter().map(|(n, _)| *n).collect();
    Err(Error::Invalid(format!(
        "{name_or_path} is neither a file nor a known dataset ({})",
        names.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A gzip holding one 5 MiB line, read with a 1 MiB limit: a `file:line` error naming the limit.
    #[test]
    fn over_long_gzipped_line_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("qa.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&p).unwrap(),
            flate2::Compression::fast(),
        );
        writeln!(gz, r#"{{"question": "q", "golden_answers": ["a"]}}"#).unwrap();
        write!(gz, r#"{{"question": ""#).unwrap();
        gz.write_all(&vec![b'a'; 5 << 20]).unwrap();
        writeln!(gz, r#"", "answer": "x"}}"#).unwrap();
        gz.finish().unwrap();
        let e = load_qa_with_max_line(&p, &LoadOptions::default(), 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("qa.jsonl.gz:2:")
                && e.contains("1048576 bytes")
                && e.contains("KILN_MAX_LINE_BYTES"),
            "{e}"
        );
        assert_eq!(
            load_qa(&p, &LoadOptions::default()).unwrap().examples.len(),
            2
        );
    }
}
