//! The error type shared by the crate's library functions.

use std::path::PathBuf;

/// Errors of corpus loading, index building, search and the HTTP client/server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A line of a JSONL file could not be used.
    #[error("{path}:{line}: {msg}")]
    BadLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What was wrong and how to fix it.
        msg: String,
    },
    /// The corpus files held no usable passage.
    #[error(
        "no passages found in {paths}: expected JSONL lines like {{\"id\":..,\"contents\":\"\\\"Title\\\"\\ntext\"}} or {{\"id\":..,\"title\":..,\"text\":..}}"
    )]
    EmptyCorpus {
        /// The files read, comma-separated.
        paths: String,
    },
    /// An index directory is missing, not a kiln index, or cannot be replaced.
    #[error("index directory {path}: {msg}")]
    IndexDir {
        /// The directory.
        path: PathBuf,
        /// What was wrong and how to fix it.
        msg: String,
    },
    /// tantivy reported an error.
    #[error("tantivy: {0}")]
    Tantivy(#[from] tantivy::TantivyError),
    /// The remote retriever could not be reached or answered badly.
    #[error("retriever at {url}: {msg}")]
    Remote {
        /// The endpoint URL.
        url: String,
        /// What went wrong (after retries, if retryable).
        msg: String,
    },
    /// The HTTP server could not start or failed while serving.
    #[error("retrieval server: {0}")]
    Server(String),
    /// The sentence encoder of a dense index could not be loaded or failed.
    #[error("encoder: {0}")]
    Encoder(String),
    /// Invalid arguments passed to a library function or command.
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
