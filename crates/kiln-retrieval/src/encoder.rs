//! The query / passage encoder a dense index uses, behind a small trait so that the index code does not depend on
//! how embeddings are computed. The implementation kiln ships is [`kiln_lm::SentenceEncoder`] (a BERT-family
//! sentence-transformers folder, e.g. all-MiniLM-L6-v2, installed by `just setup-test` under the name
//! [`DEFAULT_ENCODER`]).

use std::path::Path;
use std::sync::Arc;

use crate::Error;

/// The encoder `kiln index --dense` uses when none is named.
pub const DEFAULT_ENCODER: &str = "all-minilm-l6-v2";

/// What a text is: encoders such as e5 prefix queries and passages differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextKind {
    /// A search query.
    Query,
    /// A corpus passage.
    Passage,
}

/// A text encoder producing one fixed-size vector per text.
pub trait Encoder: Send + Sync {
    /// Embedding dimension.
    fn dim(&self) -> usize;
    /// A stable id of the model and its settings: vectors of encoders with different fingerprints are not
    /// comparable.
    fn fingerprint(&self) -> String;
    /// Whether embeddings are L2-normalised.
    fn normalizes(&self) -> bool;
    /// The model folder.
    fn dir(&self) -> &Path;
    /// Row-major `texts.len() x dim` embeddings; any text (empty, huge) must be accepted.
    fn encode(&self, texts: &[&str], kind: TextKind, batch_size: usize) -> Result<Vec<f32>, Error>;
}

impl Encoder for kiln_lm::SentenceEncoder {
    fn dim(&self) -> usize {
        kiln_lm::SentenceEncoder::dim(self)
    }
    fn fingerprint(&self) -> String {
        kiln_lm::SentenceEncoder::fingerprint(self)
    }
    fn normalizes(&self) -> bool {
        kiln_lm::SentenceEncoder::normalizes(self)
    }
    fn dir(&self) -> &Path {
        kiln_lm::SentenceEncoder::dir(self)
    }
    fn encode(&self, texts: &[&str], kind: TextKind, batch_size: usize) -> Result<Vec<f32>, Error> {
        let kind = match kind {
            TextKind::Query => kiln_lm::TextKind::Query,
            TextKind::Passage => kiln_lm::TextKind::Passage,
        };
        kiln_lm::SentenceEncoder::encode(self, texts, kind, batch_size)
            .map_err(|e| Error::Encoder(e.to_string()))
    }
}

/// Loads a sentence encoder from a folder or a name recorded in `.kiln/models.json`.
pub fn load_encoder(name_or_dir: &str) -> Result<Arc<dyn Encoder>, Error> {
    let enc = kiln_lm::SentenceEncoder::load(name_or_dir)
        .map_err(|e| Error::Encoder(format!("{name_or_dir}: {e}")))?;
    Ok(Arc::new(enc))
}
