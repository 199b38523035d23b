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
//!
//! **Line length.** A line longer than the reader's limit ([`default_max_line_bytes`]: 16 MiB unless the
//! environment variable [`MAX_LINE_BYTES_ENV`] says otherwise; `kiln index --max-line-bytes`) is always an error,
//! whatever the policy: it is detected while reading (also inside a gzip stream) after buffering at most the
//! limit, so a small compressed file holding one enormous line cannot exhaust memory.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use crate::Error;

/// How many bad lines are logged one by one before only counting them.
pub const MAX_LOGGED_BAD_LINES: usize = 20;

/// Longest line (in bytes, without its newline) read from a corpus or QA file unless configured otherwise.
pub const DEFAULT_MAX_LINE_BYTES: usize = 16 * 1024 * 1024;

/// Environment variable that overrides [`DEFAULT_MAX_LINE_BYTES`] (a byte count), for commands without a flag.
pub const MAX_LINE_BYTES_ENV: &str = "KILN_MAX_LINE_BYTES";

/// The line-length limit to use by default: [`MAX_LINE_BYTES_ENV`] if set to a positive integer, else
/// [`DEFAULT_MAX_LINE_BYTES`] (an unparsable value is ignored with a warning).
pub fn default_max_line_bytes() -> usize {
    match std::env::var(MAX_LINE_BYTES_ENV) {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                tracing::warn!(
                    "{MAX_LINE_BYTES_ENV}={v:?} is not a positive byte count; using {DEFAULT_MAX_LINE_BYTES}"
                );
                DEFAULT_MAX_LINE_BYTES
            }
        },
        Err(_) => DEFAULT_MAX_LINE_BYTES,
    }
}

/// What [`read_line_capped`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineRead {
    /// A line (with its `\n`, unless it is the last line of the file) was appended to the buffer.
    Line,
    /// End of input: nothing was read.
    Eof,
    /// The line is longer than the limit; the buffer holds at most the limit's worth of its start and the reader
    /// is left inside the line.
    TooLong,
}

/// Appends the next line of `reader` to `buf` unless it has more than `max` bytes before its newline. Reads the
/// reader's buffer chunk by chunk, so an over-long line is detected after buffering at most `max` bytes of it.
pub fn read_line_capped(
    reader: &mut (impl BufRead + ?Sized),
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<LineRead> {
    let start = buf.len();
    loop {
        let avail = match reader.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(if buf.len() == start {
                LineRead::Eof
            } else {
                LineRead::Line
            });
        }
        let (take, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (avail.len(), false),
        };
        let content = take - usize::from(done);
        if buf.len() - start + content > max {
            return Ok(LineRead::TooLong);
        }
        buf.extend_from_slice(&avail[..take]);
        reader.consume(take);
        if done {
            return Ok(LineRead::Line);
        }
    }
}

/// The message of an over-long line: the limit and how to raise it.
pub fn line_too_long_message(max: usize) -> String {
    format!(
        "line is longer than the limit of {max} bytes (is this really a JSONL file?); if its rows are this long, \
         raise the limit with `--max-line-bytes N` (kiln index) or the environment variable {MAX_LINE_BYTES_ENV}=N"
    )
}

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
    max_line_bytes: usize,
}

impl CorpusLines {
    /// Opens `path` with the line-length limit [`default_max_line_bytes`]. `wrap` lets the caller wrap the raw
    /// file reader (e.g. a progress bar counting bytes).
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
            max_line_bytes: default_max_line_bytes(),
        })
    }

    /// Sets the longest accepted line in bytes (see [`read_line_capped`]).
    pub fn with_max_line_bytes(mut self, max: usize) -> Self {
        self.max_line_bytes = max;
        self
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
    /// A line over the limit is a `file:line` error (and is never held in memory whole).
    pub fn next_line(&mut self, buf: &mut Vec<u8>) -> Result<Option<usize>, Error> {
        buf.clear();
        let read = read_line_capped(&mut self.reader, buf, self.max_line_bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        if read == LineRead::Eof {
            return Ok(None);
        }
        self.line_no += 1;
        if read == LineRead::TooLong {
            buf.clear();
            return Err(Error::BadLine {
                path: self.path.clone(),
                line: self.line_no,
                msg: line_too_long_message(self.max_line_bytes),
            });
        }
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

    #[test]
    fn capped_line_reader_keeps_lines_up_to_the_limit() {
        let mut r = std::io::Cursor::new(b"abc\nabcd\n\nxyz".to_vec());
        let mut buf = Vec::new();
        assert_eq!(
            read_line_capped(&mut r, &mut buf, 3).unwrap(),
            LineRead::Line
        );
        assert_eq!(buf, b"abc\n");
        buf.clear();
        assert_eq!(
            read_line_capped(&mut r, &mut buf, 3).unwrap(),
            LineRead::TooLong
        );
        let mut r = std::io::Cursor::new(b"\nxyz".to_vec());
        buf.clear();
        assert_eq!(
            read_line_capped(&mut r, &mut buf, 3).unwrap(),
            LineRead::Line
        );
        assert_eq!(buf, b"\n");
        buf.clear();
        assert_eq!(
            read_line_capped(&mut r, &mut buf, 3).unwrap(),
            LineRead::Line
        );
        assert_eq!(buf, b"xyz", "last line without a newline");
        buf.clear();
        assert_eq!(
            read_line_capped(&mut r, &mut buf, 3).unwrap(),
            LineRead::Eof
        );
    }

    /// A gzip holding one 5 MiB line, read with a 1 MiB limit: a `file:line` error naming the limit and the way to
    /// raise it, after buffering only about the limit (the line is never held whole).
    #[test]
    fn over_long_gzipped_line_is_an_error_without_buffering_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.jsonl.gz");
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&p).unwrap(),
            flate2::Compression::fast(),
        );
        writeln!(gz, r#"{{"id":"1","title":"A","text":"alpha"}}"#).unwrap();
        write!(gz, r#"{{"id":"2","text":""#).unwrap();
        let chunk = vec![b'a'; 1 << 20];
        for _ in 0..5 {
            gz.write_all(&chunk).unwrap();
        }
        writeln!(gz, r#""}}"#).unwrap();
        writeln!(gz, r#"{{"id":"3","title":"C","text":"gamma"}}"#).unwrap();
        gz.finish().unwrap();
        assert!(std::fs::metadata(&p).unwrap().len() < 100_000);
        let limit = 1 << 20;
        let mut lines = CorpusLines::open(&p).unwrap().with_max_line_bytes(limit);
        let mut buf = Vec::new();
        assert_eq!(lines.next_line(&mut buf).unwrap(), Some(1));
        let msg = lines.next_line(&mut buf).unwrap_err().to_string();
        assert!(
            msg.contains("c.jsonl.gz:2:")
                && msg.contains("1048576 bytes")
                && msg.contains("--max-line-bytes")
                && msg.contains(MAX_LINE_BYTES_ENV),
            "{msg}"
        );
        assert!(
            buf.capacity() <= 2 * limit + (1 << 17),
            "buffered {} bytes of a 5 MiB line",
            buf.capacity()
        );
        // The same through the index builder, whatever the bad-line policy.
        let opts = crate::BuildOptions {
            threads: 1,
            progress: false,
            max_line_bytes: limit,
            ..Default::default()
        };
        let e = crate::build_index(std::slice::from_ref(&p), &dir.path().join("idx"), &opts)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("c.jsonl.gz:2:") && e.contains("1048576 bytes"),
            "{e}"
        );
    }
}
