//! Command-line entry points wired into the `kiln` binary (`kiln index`, `kiln serve-retriever`,
//! `kiln bench-retriever`). The binary only parses these argument structs and calls `run_*`.

use std::path::PathBuf;

/// Errors of the retrieval commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command is not available in this build yet.
    #[error("`kiln {0}` is not available yet in this build")]
    Unavailable(&'static str),
}

/// `kiln index --corpus PATH --out INDEX_DIR`: build a BM25 index from JSONL corpora.
#[derive(clap::Args, Debug)]
pub struct IndexArgs {
    /// Corpus file(s): JSONL (optionally .gz) in Search-R1 `{"id","contents"}` or `{"id","title","text"}` layout.
    #[arg(long, required = true)]
    pub corpus: Vec<PathBuf>,
    /// Output index directory.
    #[arg(long)]
    pub out: PathBuf,
}

/// `kiln serve-retriever --index INDEX_DIR`: serve Search-R1's `/retrieve` API.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Index directory built by `kiln index`.
    #[arg(long)]
    pub index: PathBuf,
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
}

/// `kiln bench-retriever`: index build time, QPS, server latency.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Corpus file(s) to index and query.
    #[arg(long)]
    pub corpus: Vec<PathBuf>,
}

/// Run `kiln index`.
pub fn run_index(_args: IndexArgs) -> Result<(), CliError> {
    Err(CliError::Unavailable("index"))
}

/// Run `kiln serve-retriever`.
pub fn run_serve(_args: ServeArgs) -> Result<(), CliError> {
    Err(CliError::Unavailable("serve-retriever"))
}

/// Run `kiln bench-retriever`.
pub fn run_bench(_args: BenchArgs) -> Result<(), CliError> {
    Err(CliError::Unavailable("bench-retriever"))
}
