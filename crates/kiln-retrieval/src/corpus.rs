//! Reading JSONL corpora into passages.
//!
//! Two row layouts are accepted, one JSON object per line (a file may be gzipped; gzip is detected from the
//! magic bytes, whatever the file name):
//! - Search-R1 / FlashRAG: `{"id": "0", "contents": "\"Title\"\ntext"}`. The first line of `contents` is the title
//!   (one pair of surrounding double quotes is removed), the rest is the text. A `contents` without a newline is
//!   all text with an empty title.
//! - `{"id": "...", "title": "...", "text": "..."}` (`title` optional). When a row has both `text` and `contents`,
//!   `title`/`text` win.
//!
//! `id` may be a JSON string or an integer. Other keys (`sources`, `format`, ...) are ignored. Blank lines are
//! ignored.
//!
//! **Bad lines.** A line that is not valid UTF-8, not a JSON object, or lacks `id` or a text is reported as
//! `file:line: what was wrong`. With [`BadLinePolicy::Skip`] (the default of `kiln index`) such a line is skipped
//! with a warning (the first [`MAX_LOGGED_BAD_LINES`] individually, then only a count) and indexing goes on; the
//! build report says how many lines were skipped. With [`BadLinePolicy::Fail`] (`kiln index --strict`) the first bad
//! line aborts with that error. A corpus with no usable passage at all is always an error.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::Error;

/// How many bad lines are logged one by one before only counting them.
pub const MAX_LOGGED_BAD_LINES: usize = 20;

/// One passage of a corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorpusDoc {
    /// The passage id (as a string, also when the file had an integer).
    pub id: String,
    /// The title (may be empty).
    pub title: String,
    /// The passage text.
    pub text: String,
}

/// What to do with a line that cannot be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadLinePolicy {
    /// Skip it with a warning (logged via `tracing`) and count it.
    #[default]
    Skip,
    /// Stop with a `file:line` error.
    Fail,
}

/// Splits a Search-R1 `contents` string (`"Title"\ntext`) into title and text.
pub fn split_contents(contents: &str) -> (String, String) {
    match contents.split_once('\n') {
        Some((first, rest)) => {
            let first = first.trim();
            let title = first
                .strip_prefix('"')
                .and_then(|t| t.strip_suffix('"'))
                .unwrap_or(first);
            (title.to_string(), rest.to_string())
        }
        None => (String::new(), contents.to_string()),
    }
}

/// Renders title and text as Search-R1's `contents` string: `"Title"\ntext`.
pub fn render_contents(title: &str, text: &str) -> String {
    let mut s = String::with_capacity(title.len() + text.len() + 3);
    s.push('"');
    s.push_str(title);
    s.push_str("\"\n");
    s.push_str(text);
    s
}

#[derive(serde::Deserialize)]
struct RawRow {
    id: Option<serde_json::Value>,
    contents: Option<String>,
    title: Option<String>,
    text: Option<String>,
}

/// Parses one JSONL line. `Ok(None)` for a blank line; `Err(message)` says what is wrong with it.
pub fn parse_line(line: &str) -> Result<Option<CorpusDoc>, String> {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return Ok(None);
    }
    let row: RawRow = serde_json::from_str(trimmed).map_err(|e| {
        format!(
            "not a corpus row ({e}); expected a JSON object like {{\"id\":..,\"contents\":\"\\\"Title\\\"\\ntext\"}} or {{\"id\":..,\"title\":..,\"text\":..}}"
        )
    })?;
    let id = match row.id {
        Some(serde_json::Value::String(s)) => s,
        Some(serde_json::Value::Number(n)) => n.to_string(),
        Some(other) => {
            return Err(format!(
                "\"id\" must be a string or a number, found {other}"
            ));
        }
        None => return Err("missing \"id\"".to_string()),
    };
    let (title, text) = match (row.text, row.contents) {
        (Some(text), _) => (row.title.unwrap_or_default(), text),
        (None, Some(contents)) => split_contents(&contents),
        (None, None) => {
            return Err(format!(
                "row {id:?} has neither \"contents\" nor \"text\"; add one of them"
            ));
        }
    };
    Ok(Some(CorpusDoc { id, title, text }))
}

/// A JSONL file read line by line (transparently gunzipped), yielding raw lines with their 1-based numbers.
///
/// Lines are returned as bytes so that a non-UTF-8 line is reported for that line rather than ending the file.
pub struct CorpusLines {
    path: PathBuf,
    reader: Box<dyn BufRead + Send>,
    line_no: usize,
}

impl CorpusLines {
    /// Opens `path`. `wrap` lets the caller wrap the raw file reader (e.g. a progress bar counting bytes).
    pub fn open_with(
        path: &Path,
        wrap: impl FnOnce(File) -> Box<dyn Read + Send>,
    ) -> Result<Self, Error> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let mut raw = BufReader::with_capacity(1 << 16, wrap(file));
        let head = raw.fill_buf().map_err(|e| Error::io(path, e))?;
        let gz = head.len() >= 2 && head[0] == 0x1f && head[1] == 0x8b;
        let reader: Box<dyn BufRead + Send> = if gz {
            Box::new(BufReader::with_capacity(
                1 << 16,
                flate2::read::MultiGzDecoder::new(raw),
            ))
        } else {
            Box::new(raw)
        };
        Ok(CorpusLines {
            path: path.to_path_buf(),
            reader,
            line_no: 0,
        })
    }

    /// Opens `path` for reading.
    pub fn open(path: &Path) -> Result<Self, Error> {
        Self::open_with(path, |f| Box::new(f))
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the next line into `buf` (cleared first). Returns its 1-based line number, or `None` at the end.
    pub fn next_line(&mut self, buf: &mut Vec<u8>) -> Result<Option<usize>, Error> {
        buf.clear();
        let n = self
            .reader
            .read_until(b'\n', buf)
            .map_err(|e| Error::io(&self.path, e))?;
        if n == 0 {
            return Ok(None);
        }
        self.line_no += 1;
        Ok(Some(self.line_no))
    }
}

/// Parses a raw line (bytes) into a document, with the message of [`parse_line`] or a UTF-8 error.
pub fn parse_raw_line(raw: &[u8]) -> Result<Option<CorpusDoc>, String> {
    match std::str::from_utf8(raw) {
        Ok(s) => parse_line(s),
        Err(e) => Err(format!(
            "line is not valid UTF-8 ({e}); re-encode the file as UTF-8"
        )),
    }
}

/// Counts and logs bad lines according to a [`BadLinePolicy`].
#[derive(Debug, Default)]
pub struct BadLines {
    policy: BadLinePolicy,
    /// Number of lines skipped so far.
    pub skipped: usize,
}

impl BadLines {
    /// A counter applying `policy`.
    pub fn new(policy: BadLinePolicy) -> Self {
        BadLines { policy, skipped: 0 }
    }

    /// Records a bad line: returns the error under [`BadLinePolicy::Fail`], otherwise logs and counts it.
    pub fn record(&mut self, path: &Path, line: usize, msg: String) -> Result<(), Error> {
        let err = Error::BadLine {
            path: path.to_path_buf(),
            line,
            msg,
        };
        match self.policy {
            BadLinePolicy::Fail => Err(err),
            BadLinePolicy::Skip => {
                self.skipped += 1;
                if self.skipped <= MAX_LOGGED_BAD_LINES {
                    tracing::warn!("skipping bad corpus line: {err}");
                } else if self.skipped == MAX_LOGGED_BAD_LINES + 1 {
                    tracing::warn!("more bad corpus lines; only counting them from now on");
                }
                Ok(())
            }
        }
    }
}

/// Loads whole corpus files into memory. Returns the passages and the number of skipped bad lines.
pub fn load_corpus(
    paths: &[PathBuf],
    policy: BadLinePolicy,
) -> Result<(Vec<CorpusDoc>, usize), Error> {
    let mut docs = Vec::new();
    let mut bad = BadLines::new(policy);
    let mut buf = Vec::new();
    for path in paths {
        let mut lines = CorpusLines::open(path)?;
        while let Some(line_no) = lines.next_line(&mut buf)? {
            match parse_raw_line(&buf) {
                Ok(Some(doc)) => docs.push(doc),
                Ok(None) => {}
                Err(msg) => bad.record(path, line_no, msg)?,
            }
        }
    }
    if docs.is_empty() {
        return Err(Error::EmptyCorpus {
            paths: join_paths(paths),
        });
    }
    Ok((docs, bad.skipped))
}

pub(crate) fn join_paths(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn both_layouts_parse() {
        let d = parse_line(r#"{"id": 7, "contents": "\"Paris\"\nCapital of France."}"#)
            .unwrap()
            .unwrap();
        assert_eq!(
            d,
            CorpusDoc {
                id: "7".into(),
                title: "Paris".into(),
                text: "Capital of France.".into()
            }
        );
        assert_eq!(
            render_contents(&d.title, &d.text),
            "\"Paris\"\nCapital of France."
        );
        let d = parse_line(r#"{"id": "a1", "title": "T", "text": "x\ny", "sources": [1]}"#)
            .unwrap()
            .unwrap();
        assert_eq!((d.title.as_str(), d.text.as_str()), ("T", "x\ny"));
        assert_eq!(parse_line("   ").unwrap(), None);
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        assert!(
            parse_line("{not json")
                .unwrap_err()
                .contains("not a corpus row")
        );
        assert!(
            parse_line(r#"{"title":"x","text":"y"}"#)
                .unwrap_err()
                .contains("missing \"id\"")
        );
        assert!(
            parse_line(r#"{"id":"1","title":"x"}"#)
                .unwrap_err()
                .contains("neither")
        );
        assert!(
            parse_line(r#"{"id":[1],"text":"x"}"#)
                .unwrap_err()
                .contains("\"id\"")
        );
        assert!(
            parse_raw_line(b"{\"id\":\"1\",\"text\":\"\xff\"}")
                .unwrap_err()
                .contains("UTF-8")
        );
    }

    #[test]
    fn gz_and_policies() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&p).unwrap(),
            flate2::Compression::fast(),
        );
        writeln!(gz, r#"{{"id":"1","title":"A","text":"alpha"}}"#).unwrap();
        writeln!(gz, "garbage").unwrap();
        writeln!(gz).unwrap();
        writeln!(gz, r#"{{"id":"2","contents":"\"B\"\nbeta"}}"#).unwrap();
        gz.finish().unwrap();
        let (docs, skipped) = load_corpus(std::slice::from_ref(&p), BadLinePolicy::Skip).unwrap();
        assert_eq!(docs.len(), 2);
        assert_eq!(skipped, 1);
        let err = load_corpus(std::slice::from_ref(&p), BadLinePolicy::Fail).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("c.jsonl.gz:2:"), "{msg}");
    }
}
