//! Errors of this crate.

use std::path::PathBuf;

/// Errors of kiln-search.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A data line is malformed (strict loading).
    #[error("{}:{line}: {msg}", path.display())]
    BadLine {
        /// The file.
        path: PathBuf,
        /// 1-based line number (for a JSON array file: 1-based element index).
        line: usize,
        /// What is wrong and how to fix it.
        msg: String,
    },
    /// A data file holds no usable example.
    #[error("{}: no usable example ({skipped} bad lines skipped); {hint}", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
        /// Number of bad lines skipped.
        skipped: usize,
        /// How to fix it.
        hint: String,
    },
    /// An invalid argument or configuration value.
    #[error("{0}")]
    Invalid(String),
    /// The search backend failed.
    #[error("search backend failed: {0}")]
    Search(String),
    /// The policy failed to generate.
    #[error("policy failed: {0}")]
    Policy(String),
}

impl Error {
    /// Wraps an I/O error with its path.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
