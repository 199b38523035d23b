//! kiln-retrieval: corpus loading, tantivy BM25 index build/search, the Search-R1-compatible
//! HTTP retrieval server and its client. Knows nothing of models.
//!
//! The pieces:
//! - [`corpus`]: JSONL corpora (Search-R1/FlashRAG `{"id","contents"}` and `{"id","title","text"}`, optionally
//!   gzipped) read into [`corpus::CorpusDoc`]s, with `file:line` errors for bad lines.
//! - [`index`]: building a tantivy index ([`index::build_index`]) and searching it in-process
//!   ([`index::IndexRetriever`]) with BM25 over untrusted query strings.
//! - [`retriever`]: the [`Retriever`] trait every rollout worker talks to, and the [`Passage`] it returns.
//! - [`remote`]: [`remote::RemoteRetriever`], the HTTP client of a Search-R1-compatible `/retrieve` server.
//! - [`server`]: the axum server behind `kiln serve-retriever`, usable as a library (tests bind port 0).
//! - [`eval`]: QA files with supporting passage ids and recall@k.
//! - [`bench`]: `kiln bench-retriever` (index build time, QPS, server latency, side by side with `bm25s`).

pub mod bench;
pub mod cli;
pub mod corpus;
pub mod error;
pub mod eval;
pub mod index;
pub mod remote;
pub mod retriever;
pub mod server;

pub use error::Error;
pub use index::{BuildOptions, BuildStats, IndexRetriever, build_index};
pub use remote::{RemoteOptions, RemoteRetriever};
pub use retriever::{Passage, Retriever};
