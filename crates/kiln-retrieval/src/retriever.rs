//! The [`Retriever`] trait rollout workers search through, and the [`Passage`] it returns.

use std::sync::Arc;

use crate::Error;

/// One retrieved passage with its BM25 score.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Passage {
    /// Passage id from the corpus.
    pub id: String,
    /// Title (may be empty).
    pub title: String,
    /// Passage text.
    pub text: String,
    /// Retrieval score (BM25 for the in-process index; whatever the server sent for a remote one, 0 if none).
    pub score: f32,
}

impl Passage {
    /// Search-R1's `contents` string for this passage: `"Title"\ntext`.
    pub fn contents(&self) -> String {
        crate::corpus::render_contents(&self.title, &self.text)
    }
}

/// A searchable passage collection. Implementations are cheap to share across rollout threads (`Send + Sync`,
/// usually behind an [`Arc`]).
///
/// Queries are untrusted text (they come from a model): any string, including empty ones, must produce a
/// (possibly empty) list, never an error. Errors are reserved for failures of the retriever itself (I/O, network).
pub trait Retriever: Send + Sync {
    /// Searches each query; `result[i]` holds at most `k` passages for `queries[i]`, best first.
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error>;

    /// Searches one query.
    fn search(&self, query: &str, k: usize) -> Result<Vec<Passage>, Error> {
        let mut out = self.search_batch(&[query.to_string()], k)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Number of passages searchable, when known (reported by the server's `/health`).
    fn passage_count(&self) -> Option<u64> {
        None
    }
}

impl<T: Retriever + ?Sized> Retriever for Arc<T> {
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        (**self).search_batch(queries, k)
    }
    fn search(&self, query: &str, k: usize) -> Result<Vec<Passage>, Error> {
        (**self).search(query, k)
    }
    fn passage_count(&self) -> Option<u64> {
        (**self).passage_count()
    }
}

impl<T: Retriever + ?Sized> Retriever for Box<T> {
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        (**self).search_batch(queries, k)
    }
    fn search(&self, query: &str, k: usize) -> Result<Vec<Passage>, Error> {
        (**self).search(query, k)
    }
    fn passage_count(&self) -> Option<u64> {
        (**self).passage_count()
    }
}
