//! Opening a local index as a [`Retriever`] of a chosen kind: BM25, dense or hybrid (recipes'
//! `retriever: {kind, index, ...}`, `kiln serve-retriever --kind`, and `kiln eval --retriever KIND:DIR`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dense::{Ann, DenseRetriever, FusionConfig, HybridRetriever, read_meta};
use crate::encoder::{Encoder, load_encoder};
use crate::{Error, IndexRetriever, Retriever};

/// Which ranking a local index is searched with.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum RetrieverKind {
    /// tantivy BM25 (`kiln index`).
    #[default]
    Bm25,
    /// Sentence-encoder embeddings (`kiln index --dense`), exact or HNSW.
    Dense,
    /// BM25 and dense fused by reciprocal rank fusion.
    Hybrid,
}

impl std::fmt::Display for RetrieverKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RetrieverKind::Bm25 => "bm25",
            RetrieverKind::Dense => "dense",
            RetrieverKind::Hybrid => "hybrid",
        })
    }
}

/// A local index and how to search it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LocalRetrieverConfig {
    /// `bm25`, `dense` or `hybrid`.
    #[serde(default)]
    pub kind: RetrieverKind,
    /// Index directory built by `kiln index` (with `--dense` for the dense and hybrid kinds).
    pub index: PathBuf,
    /// Query encoder (a `.kiln/models.json` name or a folder); default: the one the index was built with. It must
    /// be the same model (checked by fingerprint).
    #[serde(default)]
    pub encoder: Option<String>,
    /// Dense search: `{kind: exact}` (default) or `{kind: hnsw, m, ef_construction, ef_search}`.
    #[serde(default)]
    pub ann: Ann,
    /// Hybrid fusion: `{bm25_weight, dense_weight, rrf_k, depth}`.
    #[serde(default)]
    pub fusion: FusionConfig,
}

impl LocalRetrieverConfig {
    /// A config of `kind` over `index` with the defaults.
    pub fn new(kind: RetrieverKind, index: impl Into<PathBuf>) -> Self {
        LocalRetrieverConfig {
            kind,
            index: index.into(),
            encoder: None,
            ann: Ann::default(),
            fusion: FusionConfig::default(),
        }
    }

    /// Parses `KIND:DIR` (`bm25:`, `dense:`, `hybrid:`) or a plain `DIR` (BM25). `None` for URLs.
    pub fn parse(spec: &str) -> Option<Self> {
        if spec.starts_with("http://") || spec.starts_with("https://") {
            return None;
        }
        for kind in [
            RetrieverKind::Bm25,
            RetrieverKind::Dense,
            RetrieverKind::Hybrid,
        ] {
            if let Some(dir) = spec.strip_prefix(&format!("{kind}:")) {
                return Some(Self::new(kind, dir));
            }
        }
        Some(Self::new(RetrieverKind::Bm25, spec))
    }
}

/// Loads the query encoder of a dense index: `name` when given, else the name the index was built with, else the
/// folder it was built from.
pub fn index_encoder(index: &Path, name: Option<&str>) -> Result<Arc<dyn Encoder>, Error> {
    if let Some(n) = name {
        return load_encoder(n);
    }
    let meta = read_meta(index)?;
    load_encoder(&meta.encoder).or_else(|first| {
        load_encoder(&meta.encoder_dir.to_string_lossy()).map_err(|_| {
            Error::Encoder(format!(
                "the index {} was embedded with {} ({}), which cannot be loaded here ({first}); install it \
                 (`just setup-test` installs all-minilm-l6-v2) or name its folder with `encoder:` / `--encoder`",
                index.display(),
                meta.encoder,
                meta.encoder_dir.display()
            ))
        })
    })
}

/// Opens a dense index (for the dense and hybrid kinds).
pub fn open_dense(cfg: &LocalRetrieverConfig) -> Result<DenseRetriever, Error> {
    let encoder = index_encoder(&cfg.index, cfg.encoder.as_deref())?;
    DenseRetriever::open(&cfg.index, encoder, cfg.ann)
}

/// Opens `cfg.index` as a retriever of `cfg.kind`.
pub fn open_local(cfg: &LocalRetrieverConfig) -> Result<Arc<dyn Retriever>, Error> {
    Ok(match cfg.kind {
        RetrieverKind::Bm25 => Arc::new(IndexRetriever::open(&cfg.index)?),
        RetrieverKind::Dense => Arc::new(open_dense(cfg)?),
        RetrieverKind::Hybrid => {
            cfg.fusion.validate()?;
            let bm25 = IndexRetriever::open(&cfg.index)?;
            Arc::new(HybridRetriever::new(bm25, open_dense(cfg)?, cfg.fusion)?)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_kind_prefixes() {
        let c = LocalRetrieverConfig::parse("hybrid:runs/idx").unwrap();
        assert_eq!(
            (c.kind, c.index.as_path()),
            (RetrieverKind::Hybrid, Path::new("runs/idx"))
        );
        let c = LocalRetrieverConfig::parse("dense:/a/b").unwrap();
        assert_eq!(c.kind, RetrieverKind::Dense);
        let c = LocalRetrieverConfig::parse("runs/idx").unwrap();
        assert_eq!(c.kind, RetrieverKind::Bm25);
        assert!(LocalRetrieverConfig::parse("http://127.0.0.1:8000/retrieve").is_none());
    }

    #[test]
    fn recipe_form_reads_with_defaults_and_refuses_unknown_fields() {
        let c: LocalRetrieverConfig = serde_norway::from_str(
            "kind: hybrid\nindex: idx\nann: {kind: hnsw, ef_search: 32}\nfusion: {dense_weight: 2}",
        )
        .unwrap();
        assert_eq!(c.kind, RetrieverKind::Hybrid);
        match c.ann {
            Ann::Hnsw(p) => assert_eq!((p.m, p.ef_search), (16, 32)),
            Ann::Exact => panic!("expected hnsw"),
        }
        assert_eq!((c.fusion.dense_weight, c.fusion.bm25_weight), (2.0, 1.0));
        assert!(
            serde_norway::from_str::<LocalRetrieverConfig>("kind: dense\nindex: i\nencodr: x")
                .is_err()
        );
        assert!(serde_norway::from_str::<LocalRetrieverConfig>("kind: sparse\nindex: i").is_err());
    }
}
