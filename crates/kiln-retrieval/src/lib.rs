//! kiln-retrieval: corpus loading, tantivy BM25 index build/search, the Search-R1-compatible
//! HTTP retrieval server and its client; dense and hybrid retrieval over a sentence encoder's embeddings.
//!
//! The pieces:
//! - [`corpus`]: JSONL corpora (Search-R1/FlashRAG `{"id","contents"}` and `{"id","title","text"}`, optionally
//!   gzipped) read into [`corpus::CorpusDoc`]s, with `file:line` errors for bad lines.
//! - [`index`]: building a tantivy index ([`index::build_index`]) and searching it in-process
//!   ([`index::IndexRetriever`]) with BM25 over untrusted query strings.
//! - [`dense`]: `kiln index --dense` (passage embeddings beside the BM25 index), exact inner-product search,
//!   HNSW, and reciprocal rank fusion of BM25 and dense ([`dense::HybridRetriever`]).
//! - [`encoder`]: the [`encoder::Encoder`] trait dense indexes embed with (kiln-lm's BERT sentence encoder).
//! - [`open`]: a local index opened as a BM25, dense or hybrid [`Retriever`] ([`open::open_local`]).
//! - [`retriever`]: the [`Retriever`] trait every rollout worker talks to, and the [`Passage`] it returns.
//! - [`remote`]: [`remote::RemoteRetriever`], the HTTP client of a Search-R1-compatible `/retrieve` server.
//! - [`server`]: the axum server behind `kiln serve-retriever`, usable as a library (tests bind port 0).
//! - [`eval`]: QA files with supporting passage ids and recall@k.
//! - [`bench`]: `kiln bench-retriever` (index build time, QPS, server latency, side by side with `bm25s`).

pub mod bench;
pub mod cli;
pub mod corpus;
pub mod dense;
pub mod encoder;
pub mod error;
pub mod eval;
pub mod index;
pub mod open;
pub mod remote;
pub mod retriever;
pub mod server;

pub use dense::{Ann, DenseRetriever, FusionConfig, HnswParams, HybridRetriever};
pub use error::Error;
pub use index::{BuildOptions, BuildStats, IndexRetriever, build_index};
pub use open::{LocalRetrieverConfig, RetrieverKind, open_local};
pub use remote::{RemoteOptions, RemoteRetriever};
pub use retriever::{Passage, Retriever};
