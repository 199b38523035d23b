//! kiln-retrieval: corpus loading, tantivy BM25 index build/search, the Search-R1-compatible
//! HTTP retrieval server and its client. Knows nothing of models.

pub mod cli;
