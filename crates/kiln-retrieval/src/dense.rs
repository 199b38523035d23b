//! Dense retrieval: passage embeddings from a sentence encoder, searched exactly (a SIMD matrix product over the
//! whole embedding matrix) or approximately (HNSW), behind the same [`Retriever`] trait as BM25.
//!
//! On disk, `kiln index --dense` adds a `dense/` folder to a BM25 index directory (the BM25 part is always built:
//! it costs seconds and hybrid search needs it):
//!
//! ```text
//! INDEX_DIR/dense/dense.json         DenseMeta: encoder (name, folder, fingerprint), dim, rows, dtype, ...
//! INDEX_DIR/dense/embeddings.f32     rows x dim little-endian f32, row-major (or embeddings.f16)
//! INDEX_DIR/dense/passages.jsonl     {"id","title","text"} of row i on line i + 1
//! ```
//!
//! The folder is written beside the index under a temporary name and renamed into place when complete, so an
//! interrupted build never leaves a half-written `dense/` that looks valid. Opening checks every size against
//! `dense.json` and refuses an encoder whose fingerprint differs from the one the passages were embedded with.
//!
//! Exact search scores every passage: `scores = Q E^T` (queries x rows) in blocks of [`BLOCK_ROWS`] rows, one
//! gemm call per block (the `gemm` crate's AVX-512 / AVX2 / portable kernels, chosen at run time), blocks in
//! parallel on rayon, a top-k per query per block, merged. On the 26k-passage corpus this is ~10 M multiply-adds
//! per query. HNSW (the `hnsw_rs` crate) is built from the validated embedding matrix when the index is opened
//! (`ann: hnsw`), for corpora where scoring every row per query costs too much; it needs L2-normalised embeddings
//! (inner product = cosine) and reports its recall against the exact search in `kiln bench-retriever --dense`.

use std::collections::HashMap;
use std::io::{BufRead, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::corpus::{BadLinePolicy, CorpusDoc, load_corpus};
use crate::encoder::{Encoder, TextKind};
use crate::index::{MAX_QUERY_BYTES, truncate_str};
use crate::{Error, Passage, Retriever};

/// Sub-folder of an index directory holding the dense part.
pub const DENSE_DIR: &str = "dense";
/// Metadata file inside [`DENSE_DIR`].
pub const META_FILE: &str = "dense.json";
/// Passages file inside [`DENSE_DIR`].
pub const PASSAGES_FILE: &str = "passages.jsonl";
/// Version of the on-disk layout; bumped when it changes.
pub const FORMAT_VERSION: u32 = 1;
/// Rows scored by one gemm call of the exact search (bounds the score buffer to queries x this).
pub const BLOCK_ROWS: usize = 4096;
/// Most rows a dense index may hold (the embedding matrix must fit in memory; 50 M x 384 f32 = 77 GB).
pub const MAX_ROWS: usize = 50_000_000;
/// Largest embedding dimension accepted from an index or encoder.
pub const MAX_DIM: usize = 16_384;

/// Storage type of the embedding matrix on disk (searched as f32 in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 4 bytes per value.
    #[default]
    F32,
    /// 2 bytes per value (IEEE half); halves the file, converted to f32 when opened.
    F16,
}

impl Dtype {
    fn file_name(self) -> &'static str {
        match self {
            Dtype::F32 => "embeddings.f32",
            Dtype::F16 => "embeddings.f16",
        }
    }
    fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 => 2,
        }
    }
}

/// `dense/dense.json`: what was embedded, with which encoder, and how it is stored.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DenseMeta {
    /// [`FORMAT_VERSION`] of the writer.
    pub format: u32,
    /// The encoder as named on the command line (a `.kiln/models.json` name or a folder).
    pub encoder: String,
    /// The encoder folder the passages were embedded with.
    pub encoder_dir: PathBuf,
    /// The encoder's fingerprint ([`Encoder::fingerprint`]); queries must be encoded by the same encoder.
    pub fingerprint: String,
    /// Embedding dimension.
    pub dim: usize,
    /// Number of passages (rows).
    pub rows: usize,
    /// Storage type of the matrix.
    pub dtype: Dtype,
    /// Whether the encoder L2-normalises its embeddings (needed for HNSW).
    pub normalized: bool,
    /// Seconds spent reading, encoding and writing.
    pub seconds: f64,
    /// `rows / seconds`.
    pub passages_per_sec: f64,
    /// Corpus files read.
    pub corpus: Vec<PathBuf>,
    /// Bad corpus lines skipped.
    pub skipped_lines: usize,
    /// Passages skipped because their id had been seen before (the first one is kept, as in the BM25 index).
    pub duplicate_ids: usize,
}

/// Options of [`build_dense`].
#[derive(Debug, Clone)]
pub struct DenseBuildOptions {
    /// Storage type of the matrix.
    pub dtype: Dtype,
    /// Passages per encoder batch.
    pub batch_size: usize,
    /// What to do with unparsable corpus lines.
    pub bad_lines: BadLinePolicy,
    /// Show a progress bar (passages/s) on stderr when it is a terminal.
    pub progress: bool,
}

impl Default for DenseBuildOptions {
    fn default() -> Self {
        DenseBuildOptions {
            dtype: Dtype::F32,
            batch_size: 32,
            bad_lines: BadLinePolicy::Skip,
            progress: true,
        }
    }
}

/// Passages handed to the encoder per call (the encoder sorts each call's texts by length, so larger calls pad
/// less; the progress bar advances per call).
const ENCODE_CHUNK: usize = 1024;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// Embeds the passages of `corpus` with `encoder` into `index_dir/dense/` (replacing a previous dense part).
/// `index_dir` must be a kiln index (build the BM25 part first with [`crate::build_index`]); `encoder_name` is
/// recorded so that opening the index finds the same encoder again.
pub fn build_dense(
    corpus: &[PathBuf],
    index_dir: &Path,
    encoder: &dyn Encoder,
    encoder_name: &str,
    opts: &DenseBuildOptions,
) -> Result<DenseMeta, Error> {
    if !index_dir.join(crate::index::MARKER_FILE).is_file() {
        return Err(Error::IndexDir {
            path: index_dir.to_path_buf(),
            msg: "not a kiln index: build the BM25 part first (`kiln index --corpus C --out DIR --dense` does both)"
                .into(),
        });
    }
    if opts.batch_size == 0 || opts.batch_size > 4096 {
        return Err(Error::Invalid(format!(
            "encoder batch size {} is out of range: give 1..=4096 (default 32)",
            opts.batch_size
        )));
    }
    let dim = encoder.dim();
    if dim == 0 || dim > MAX_DIM {
        return Err(Error::Invalid(format!(
            "encoder {encoder_name} has embedding dimension {dim}; expected 1..={MAX_DIM}"
        )));
    }
    let start = Instant::now();
    let (docs, skipped_lines) = load_corpus(corpus, opts.bad_lines)?;
    let mut seen = std::collections::HashSet::with_capacity(docs.len());
    let mut duplicate_ids = 0usize;
    let docs: Vec<CorpusDoc> = docs
        .into_iter()
        .filter(|d| {
            let fresh = seen.insert(d.id.clone());
            duplicate_ids += usize::from(!fresh);
            fresh
        })
        .collect();
    drop(seen);
    if docs.len() > MAX_ROWS {
        return Err(Error::Invalid(format!(
            "{} passages is more than a dense index holds ({MAX_ROWS}); split the corpus",
            docs.len()
        )));
    }

    let dense = index_dir.join(DENSE_DIR);
    let tmp = index_dir.join(format!(".{DENSE_DIR}.kiln-tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir_all(&tmp).map_err(io_err(&tmp))?;
    let result = write_dense(&tmp, &docs, encoder, opts).and_then(|()| {
        let seconds = start.elapsed().as_secs_f64();
        let meta = DenseMeta {
            format: FORMAT_VERSION,
            encoder: encoder_name.to_string(),
            encoder_dir: encoder.dir().to_path_buf(),
            fingerprint: encoder.fingerprint(),
            dim,
            rows: docs.len(),
            dtype: opts.dtype,
            normalized: encoder.normalizes(),
            seconds,
            passages_per_sec: docs.len() as f64 / seconds.max(1e-9),
            corpus: corpus.to_vec(),
            skipped_lines,
            duplicate_ids,
        };
        let path = tmp.join(META_FILE);
        let json = serde_json::to_vec_pretty(&meta).map_err(|e| Error::Invalid(e.to_string()))?;
        std::fs::write(&path, json).map_err(io_err(&path))?;
        Ok(meta)
    });
    let meta = match result {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if dense.exists() {
        let old = index_dir.join(format!(".{DENSE_DIR}.kiln-old-{}", std::process::id()));
        std::fs::rename(&dense, &old).map_err(io_err(&dense))?;
        std::fs::rename(&tmp, &dense).map_err(io_err(&dense))?;
        std::fs::remove_dir_all(&old).map_err(io_err(&old))?;
    } else {
        std::fs::rename(&tmp, &dense).map_err(io_err(&dense))?;
    }
    Ok(meta)
}

fn write_dense(
    dir: &Path,
    docs: &[CorpusDoc],
    encoder: &dyn Encoder,
    opts: &DenseBuildOptions,
) -> Result<(), Error> {
    let ppath = dir.join(PASSAGES_FILE);
    let mut passages = BufWriter::new(std::fs::File::create(&ppath).map_err(io_err(&ppath))?);
    for d in docs {
        let line = serde_json::json!({"id": d.id, "title": d.title, "text": d.text});
        serde_json::to_writer(&mut passages, &line).map_err(|e| Error::Invalid(e.to_string()))?;
        passages.write_all(b"\n").map_err(io_err(&ppath))?;
    }
    passages.flush().map_err(io_err(&ppath))?;

    let epath = dir.join(opts.dtype.file_name());
    let mut out = BufWriter::new(std::fs::File::create(&epath).map_err(io_err(&epath))?);
    let bar = progress_bar(docs.len() as u64, opts.progress);
    let dim = encoder.dim();
    for chunk in docs.chunks(ENCODE_CHUNK) {
        let texts: Vec<String> = chunk
            .iter()
            .map(|d| crate::corpus::render_contents(&d.title, &d.text))
            .collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let emb = encoder.encode(&refs, TextKind::Passage, opts.batch_size)?;
        if emb.len() != chunk.len() * dim {
            return Err(Error::Invalid(format!(
                "encoder returned {} values for {} passages of dimension {dim}",
                emb.len(),
                chunk.len()
            )));
        }
        if let Some(i) = emb.iter().position(|v| !v.is_finite()) {
            return Err(Error::Invalid(format!(
                "encoder produced a non-finite value for passage {:?}",
                chunk[i / dim].id
            )));
        }
        let bytes: Vec<u8> = match opts.dtype {
            Dtype::F32 => emb.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Dtype::F16 => emb
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        out.write_all(&bytes).map_err(io_err(&epath))?;
        if let Some(b) = &bar {
            b.inc(chunk.len() as u64);
        }
    }
    out.flush().map_err(io_err(&epath))?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(())
}

fn progress_bar(len: u64, enabled: bool) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !enabled || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "embedding {bar:40} {pos}/{len} passages [{elapsed_precise} < {eta}] {per_sec}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    Some(bar)
}

// ---------------------------------------------------------------------------------------------------------------
// Exact search
// ---------------------------------------------------------------------------------------------------------------

/// An in-memory embedding matrix searched exactly by inner product.
#[derive(Debug, Clone)]
pub struct ExactIndex {
    dim: usize,
    rows: usize,
    data: Vec<f32>,
}

impl ExactIndex {
    /// Wraps a row-major `rows x dim` matrix.
    pub fn new(dim: usize, data: Vec<f32>) -> Result<Self, Error> {
        if dim == 0 || !data.len().is_multiple_of(dim) {
            return Err(Error::Invalid(format!(
                "embedding matrix of {} values is not a whole number of rows of dimension {dim}",
                data.len()
            )));
        }
        Ok(ExactIndex {
            dim,
            rows: data.len() / dim,
            data,
        })
    }

    /// Embedding dimension.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.dim..(i + 1) * self.dim]
    }

    /// Top-`k` rows by inner product for each query of the row-major `queries` (n x dim): `(row, score)` best
    /// first, ties broken by the lower row.
    pub fn search(&self, queries: &[f32], k: usize) -> Vec<Vec<(u32, f32)>> {
        let d = self.dim;
        let nq = queries.len() / d;
        let k = k.min(self.rows);
        if nq == 0 || k == 0 {
            return vec![Vec::new(); nq];
        }
        let queries = &queries[..nq * d];
        let blocks: Vec<Vec<Vec<(u32, f32)>>> = (0..self.rows.div_ceil(BLOCK_ROWS))
            .into_par_iter()
            .map(|b| {
                let r0 = b * BLOCK_ROWS;
                let r1 = (r0 + BLOCK_ROWS).min(self.rows);
                let n = r1 - r0;
                let mut scores = vec![0f32; nq * n];
                scores_block(queries, &self.data[r0 * d..r1 * d], d, nq, n, &mut scores);
                (0..nq)
                    .map(|q| top_k(&scores[q * n..(q + 1) * n], r0 as u32, k))
                    .collect()
            })
            .collect();
        (0..nq)
            .map(|q| {
                let mut all: Vec<(u32, f32)> =
                    blocks.iter().flat_map(|b| b[q].iter().copied()).collect();
                sort_hits(&mut all);
                all.truncate(k);
                all
            })
            .collect()
    }
}

/// `scores (nq x n) = queries (nq x d) * rows (n x d)^T`, one gemm call.
fn scores_block(queries: &[f32], rows: &[f32], d: usize, nq: usize, n: usize, scores: &mut [f32]) {
    assert!(queries.len() == nq * d && rows.len() == n * d && scores.len() == nq * n);
    // SAFETY: the three buffers have exactly the sizes asserted above, and the strides describe them:
    // queries row-major (row stride d, column stride 1); the right-hand side is rows^T, element (l, j) at
    // rows[j * d + l] (row stride 1, column stride d); scores row-major (row stride n, column stride 1).
    // `read_dst = false`: dst = 1 * lhs * rhs, nothing is read from `scores`.
    unsafe {
        gemm::gemm(
            nq,
            n,
            d,
            scores.as_mut_ptr(),
            1,
            n as isize,
            false,
            queries.as_ptr(),
            1,
            d as isize,
            rows.as_ptr(),
            d as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// Orders hits best first: higher score, then lower row (NaN last).
fn sort_hits(v: &mut [(u32, f32)]) {
    v.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
}

/// The `k` best of one score row, rows numbered from `offset`.
fn top_k(scores: &[f32], offset: u32, k: usize) -> Vec<(u32, f32)> {
    let mut v: Vec<(u32, f32)> = scores
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            (
                offset + i as u32,
                if s.is_nan() { f32::NEG_INFINITY } else { s },
            )
        })
        .collect();
    if k < v.len() {
        v.select_nth_unstable_by(k, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(k);
    }
    sort_hits(&mut v);
    v
}

/// Inner product with eight independent accumulators (the compiler vectorises it; a single running sum would
/// force strict left-to-right order and scalar adds).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

// ---------------------------------------------------------------------------------------------------------------
// HNSW
// ---------------------------------------------------------------------------------------------------------------

/// HNSW parameters (Malkov & Yashunin): `m` links per node and layer, `ef_construction` candidates while
/// building, `ef_search` candidates while searching (raised to k when smaller).
#[derive(
    Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(deny_unknown_fields, default)]
pub struct HnswParams {
    /// Links per node and layer (2..=128).
    pub m: usize,
    /// Candidate list size while building (>= m, at most 4096).
    pub ef_construction: usize,
    /// Candidate list size while searching (1..=4096; raised to k).
    pub ef_search: usize,
}

impl Default for HnswParams {
    fn default() -> Self {
        HnswParams {
            m: 16,
            ef_construction: 200,
            ef_search: 128,
        }
    }
}

impl HnswParams {
    /// Checks the ranges (hnsw_rs exits the process on some out-of-range values, so they never reach it).
    pub fn validate(&self) -> Result<(), Error> {
        if !(2..=128).contains(&self.m) {
            return Err(Error::Invalid(format!(
                "hnsw m = {} is out of range: give 2..=128 (default 16)",
                self.m
            )));
        }
        if self.ef_construction < self.m || self.ef_construction > 4096 {
            return Err(Error::Invalid(format!(
                "hnsw ef_construction = {} is out of range: give m..=4096 (default 200)",
                self.ef_construction
            )));
        }
        if !(1..=4096).contains(&self.ef_search) {
            return Err(Error::Invalid(format!(
                "hnsw ef_search = {} is out of range: give 1..=4096 (default 128)",
                self.ef_search
            )));
        }
        Ok(())
    }
}

/// `max(0, 1 - <a, b>)`: cosine distance for L2-normalised vectors. Clamped at 0: rounding puts `<a, b>` of
/// identical passages (corpora hold duplicates under different ids) a little above 1, and hnsw_rs asserts that
/// distances are not negative (its own `DistDot` asserts `<a, b> <= 1`).
#[derive(Debug, Clone, Copy, Default)]
struct InnerProduct;

impl hnsw_rs::prelude::Distance<f32> for InnerProduct {
    fn eval(&self, va: &[f32], vb: &[f32]) -> f32 {
        (1.0 - dot(va, vb)).max(0.0)
    }
}

/// An HNSW graph over an [`ExactIndex`]'s rows.
pub struct HnswIndex {
    hnsw: hnsw_rs::hnsw::Hnsw<'static, f32, InnerProduct>,
    params: HnswParams,
    build_seconds: f64,
}

impl std::fmt::Debug for HnswIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HnswIndex")
            .field("params", &self.params)
            .field("build_seconds", &self.build_seconds)
            .finish()
    }
}

impl HnswIndex {
    /// Builds the graph (in parallel on rayon's pool). The rows must be L2-normalised.
    pub fn build(exact: &ExactIndex, params: HnswParams) -> Result<Self, Error> {
        params.validate()?;
        if let Some(i) = (0..exact.rows()).find(|&i| {
            let r = exact.row(i);
            (dot(r, r) - 1.0).abs() > 1e-3
        }) {
            return Err(Error::Invalid(format!(
                "HNSW needs L2-normalised embeddings (inner product = cosine), but row {i} has norm {:.4}; \
                 search this index exactly (ann: exact) or use an encoder that normalises",
                dot(exact.row(i), exact.row(i)).sqrt()
            )));
        }
        let start = Instant::now();
        let hnsw = hnsw_rs::hnsw::Hnsw::new(
            params.m,
            exact.rows().max(1),
            16,
            params.ef_construction,
            InnerProduct,
        );
        let data: Vec<(&[f32], usize)> = (0..exact.rows()).map(|i| (exact.row(i), i)).collect();
        hnsw.parallel_insert_slice(&data);
        let mut hnsw = hnsw;
        hnsw.set_searching_mode(true);
        Ok(HnswIndex {
            hnsw,
            params,
            build_seconds: start.elapsed().as_secs_f64(),
        })
    }

    /// Seconds the build took.
    pub fn build_seconds(&self) -> f64 {
        self.build_seconds
    }

    /// Parameters the graph was built with.
    pub fn params(&self) -> HnswParams {
        self.params
    }

    /// Approximate top-`k` `(row, inner product)` per query (row-major `queries`, n x dim), best first.
    pub fn search(&self, queries: &[f32], dim: usize, k: usize) -> Vec<Vec<(u32, f32)>> {
        let n = self.hnsw.get_nb_point();
        let k = k.min(n);
        let one = |q: &[f32]| -> Vec<(u32, f32)> {
            if k == 0 {
                return Vec::new();
            }
            let ef = self.params.ef_search.max(k);
            let mut hits: Vec<(u32, f32)> = self
                .hnsw
                .search(q, k, ef)
                .into_iter()
                .map(|nb| (nb.d_id as u32, 1.0 - nb.distance))
                .collect();
            sort_hits(&mut hits);
            hits.truncate(k);
            hits
        };
        let qs: Vec<&[f32]> = queries.chunks_exact(dim).collect();
        if qs.len() <= 1 {
            qs.into_iter().map(one).collect()
        } else {
            qs.into_par_iter().map(one).collect()
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The dense retriever
// ---------------------------------------------------------------------------------------------------------------

/// How a dense index is searched.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase", tag = "kind", deny_unknown_fields)]
pub enum Ann {
    /// Score every passage (exact).
    #[default]
    Exact,
    /// HNSW graph built when the index is opened.
    Hnsw(#[serde(default)] HnswParams),
}

/// Reads and validates `dense/dense.json`.
pub fn read_meta(index_dir: &Path) -> Result<DenseMeta, Error> {
    let dir = index_dir.join(DENSE_DIR);
    let path = dir.join(META_FILE);
    if !path.is_file() {
        return Err(Error::IndexDir {
            path: index_dir.to_path_buf(),
            msg: format!(
                "has no dense part ({DENSE_DIR}/{META_FILE} missing); build it with `kiln index --corpus CORPUS --out {} --dense`",
                index_dir.display()
            ),
        });
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let meta: DenseMeta = serde_json::from_str(&text).map_err(|e| Error::IndexDir {
        path: path.clone(),
        msg: format!("unreadable ({e}); rebuild the dense part with `kiln index ... --dense`"),
    })?;
    if meta.format != FORMAT_VERSION {
        return Err(Error::IndexDir {
            path,
            msg: format!(
                "dense format {} but this kiln reads {FORMAT_VERSION}; rebuild with `kiln index ... --dense`",
                meta.format
            ),
        });
    }
    if meta.dim == 0 || meta.dim > MAX_DIM || meta.rows > MAX_ROWS {
        return Err(Error::IndexDir {
            path,
            msg: format!(
                "dim {} / rows {} out of range (dim 1..={MAX_DIM}, rows <= {MAX_ROWS}); the file is corrupt, rebuild it",
                meta.dim, meta.rows
            ),
        });
    }
    Ok(meta)
}

/// Reads the embedding matrix, checking its size against `meta` before reading it.
pub fn read_embeddings(index_dir: &Path, meta: &DenseMeta) -> Result<Vec<f32>, Error> {
    let path = index_dir.join(DENSE_DIR).join(meta.dtype.file_name());
    let expected = (meta.rows as u64) * (meta.dim as u64) * meta.dtype.bytes() as u64;
    let len = std::fs::metadata(&path).map_err(io_err(&path))?.len();
    if len != expected {
        return Err(Error::IndexDir {
            path,
            msg: format!(
                "{len} bytes, but dense.json says {} rows x {} dims x {} bytes = {expected}; the file is truncated or \
                 foreign: rebuild with `kiln index ... --dense`",
                meta.rows,
                meta.dim,
                meta.dtype.bytes()
            ),
        });
    }
    let bytes = std::fs::read(&path).map_err(io_err(&path))?;
    let data: Vec<f32> = match meta.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
    };
    if let Some(i) = data.iter().position(|v| !v.is_finite()) {
        return Err(Error::IndexDir {
            path,
            msg: format!(
                "row {} holds a non-finite value; the file is corrupt, rebuild it",
                i / meta.dim
            ),
        });
    }
    Ok(data)
}

/// Reads `dense/passages.jsonl` (one passage per row).
pub fn read_passages(index_dir: &Path, meta: &DenseMeta) -> Result<Vec<Passage>, Error> {
    let path = index_dir.join(DENSE_DIR).join(PASSAGES_FILE);
    let file = std::fs::File::open(&path).map_err(io_err(&path))?;
    let mut out = Vec::with_capacity(meta.rows.min(1 << 20));
    #[derive(serde::Deserialize)]
    struct Line {
        id: String,
        title: String,
        text: String,
    }
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.map_err(io_err(&path))?;
        let l: Line = serde_json::from_str(&line).map_err(|e| Error::BadLine {
            path: path.clone(),
            line: i + 1,
            msg: format!(
                "{e}; the dense part is corrupt, rebuild it with `kiln index ... --dense`"
            ),
        })?;
        out.push(Passage {
            id: l.id,
            title: l.title,
            text: l.text,
            score: 0.0,
        });
        if out.len() > meta.rows {
            break;
        }
    }
    if out.len() != meta.rows {
        return Err(Error::IndexDir {
            path,
            msg: format!(
                "{} passages but dense.json says {} rows; rebuild with `kiln index ... --dense`",
                out.len(),
                meta.rows
            ),
        });
    }
    Ok(out)
}

/// A dense index opened for search: the passages, their embeddings, an optional HNSW graph and the query encoder.
pub struct DenseRetriever {
    meta: DenseMeta,
    encoder: Arc<dyn Encoder>,
    passages: Vec<Passage>,
    by_id: HashMap<String, u32>,
    exact: ExactIndex,
    hnsw: Option<HnswIndex>,
}

impl DenseRetriever {
    /// Opens `index_dir/dense` with `encoder` (which must be the one the passages were embedded with: same
    /// fingerprint) and builds the HNSW graph when `ann` asks for it.
    pub fn open(index_dir: &Path, encoder: Arc<dyn Encoder>, ann: Ann) -> Result<Self, Error> {
        let meta = read_meta(index_dir)?;
        if encoder.fingerprint() != meta.fingerprint || encoder.dim() != meta.dim {
            return Err(Error::IndexDir {
                path: index_dir.to_path_buf(),
                msg: format!(
                    "its passages were embedded with encoder {} ({}, {} dims, fingerprint {}), but queries would be \
                     encoded with {} ({} dims, fingerprint {}): vectors of different encoders are not comparable. Name \
                     the index's encoder, or rebuild with `kiln index ... --dense --encoder {}`",
                    meta.encoder,
                    meta.encoder_dir.display(),
                    meta.dim,
                    short(&meta.fingerprint),
                    encoder.dir().display(),
                    encoder.dim(),
                    short(&encoder.fingerprint()),
                    encoder.dir().display()
                ),
            });
        }
        let data = read_embeddings(index_dir, &meta)?;
        let passages = read_passages(index_dir, &meta)?;
        let by_id = passages
            .iter()
            .enumerate()
            .map(|(i, p)| (p.id.clone(), i as u32))
            .collect();
        let exact = ExactIndex::new(meta.dim, data)?;
        let hnsw = match ann {
            Ann::Exact => None,
            Ann::Hnsw(p) => {
                if !meta.normalized {
                    return Err(Error::Invalid(format!(
                        "HNSW needs an encoder that L2-normalises, and {} does not; search this index exactly",
                        meta.encoder
                    )));
                }
                let h = HnswIndex::build(&exact, p)?;
                tracing::info!(
                    "HNSW over {} passages built in {:.1} s (m {}, ef_construction {})",
                    exact.rows(),
                    h.build_seconds(),
                    p.m,
                    p.ef_construction
                );
                Some(h)
            }
        };
        Ok(DenseRetriever {
            meta,
            encoder,
            passages,
            by_id,
            exact,
            hnsw,
        })
    }

    /// The index's metadata.
    pub fn meta(&self) -> &DenseMeta {
        &self.meta
    }

    /// The query encoder.
    pub fn encoder(&self) -> &Arc<dyn Encoder> {
        &self.encoder
    }

    /// The exact index (for recall measurements).
    pub fn exact(&self) -> &ExactIndex {
        &self.exact
    }

    /// The HNSW graph, when opened with one.
    pub fn hnsw(&self) -> Option<&HnswIndex> {
        self.hnsw.as_ref()
    }

    /// Passage of row `row`.
    pub fn passage(&self, row: u32) -> &Passage {
        &self.passages[row as usize]
    }

    /// Row of a passage id.
    pub fn row_of(&self, id: &str) -> Option<u32> {
        self.by_id.get(id).copied()
    }

    /// Encodes queries in one encoder call (each cut at [`MAX_QUERY_BYTES`] first). Row-major, n x dim.
    pub fn encode_queries(&self, queries: &[String]) -> Result<Vec<f32>, Error> {
        let refs: Vec<&str> = queries
            .iter()
            .map(|q| truncate_str(q, MAX_QUERY_BYTES))
            .collect();
        let emb = self.encoder.encode(&refs, TextKind::Query, 64)?;
        if emb.len() != queries.len() * self.meta.dim {
            return Err(Error::Invalid(format!(
                "encoder returned {} values for {} queries of dimension {}",
                emb.len(),
                queries.len(),
                self.meta.dim
            )));
        }
        Ok(emb)
    }

    /// Top-`k` rows per encoded query: through HNSW when the index was opened with it, else exact.
    pub fn search_vectors(&self, queries: &[f32], k: usize) -> Vec<Vec<(u32, f32)>> {
        match &self.hnsw {
            Some(h) => h.search(queries, self.meta.dim, k),
            None => self.exact.search(queries, k),
        }
    }

    /// Top-`k` `(row, score)` per query text: the non-blank queries encoded in one batch and searched together;
    /// a blank query (nothing but whitespace) finds nothing, as in BM25.
    pub fn search_texts(
        &self,
        queries: &[String],
        k: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>, Error> {
        let live: Vec<usize> = (0..queries.len())
            .filter(|&i| !queries[i].trim().is_empty())
            .collect();
        let mut out = vec![Vec::new(); queries.len()];
        if live.is_empty() || k == 0 {
            return Ok(out);
        }
        let texts: Vec<String> = live.iter().map(|&i| queries[i].clone()).collect();
        let q = self.encode_queries(&texts)?;
        for (i, hits) in live.into_iter().zip(self.search_vectors(&q, k)) {
            out[i] = hits;
        }
        Ok(out)
    }

    fn passages_of(&self, hits: Vec<(u32, f32)>) -> Vec<Passage> {
        hits.into_iter()
            .map(|(r, s)| Passage {
                score: s,
                ..self.passages[r as usize].clone()
            })
            .collect()
    }
}

fn short(fp: &str) -> &str {
    &fp[..fp.len().min(12)]
}

impl Retriever for DenseRetriever {
    /// Encodes all queries in one batch, then searches them together.
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        Ok(self
            .search_texts(queries, k)?
            .into_iter()
            .map(|h| self.passages_of(h))
            .collect())
    }

    fn passage_count(&self) -> Option<u64> {
        Some(self.meta.rows as u64)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Hybrid: reciprocal rank fusion of BM25 and dense
// ---------------------------------------------------------------------------------------------------------------

/// Weights and depth of the reciprocal rank fusion (Cormack et al. 2009): a passage's fused score is
/// `sum over rankings r of weight_r / (rrf_k + rank_r)` (rank 1 = best; absent from a ranking = no term).
#[derive(
    Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(deny_unknown_fields, default)]
pub struct FusionConfig {
    /// Weight of the BM25 ranking.
    pub bm25_weight: f32,
    /// Weight of the dense ranking.
    pub dense_weight: f32,
    /// The RRF constant (60 in the paper; larger flattens the rank discount).
    pub rrf_k: f32,
    /// Passages taken from each ranking before fusing (at least the k asked for).
    pub depth: usize,
}

impl Default for FusionConfig {
    fn default() -> Self {
        FusionConfig {
            bm25_weight: 1.0,
            dense_weight: 1.0,
            rrf_k: 60.0,
            depth: 50,
        }
    }
}

impl FusionConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), Error> {
        let ok_w = |w: f32| w.is_finite() && w >= 0.0;
        if !ok_w(self.bm25_weight)
            || !ok_w(self.dense_weight)
            || self.bm25_weight + self.dense_weight <= 0.0
        {
            return Err(Error::Invalid(format!(
                "hybrid weights bm25 {} / dense {}: give finite weights >= 0, not both 0",
                self.bm25_weight, self.dense_weight
            )));
        }
        if !(self.rrf_k.is_finite() && self.rrf_k >= 0.0) {
            return Err(Error::Invalid(format!(
                "rrf_k = {} must be a finite number >= 0 (default 60)",
                self.rrf_k
            )));
        }
        if !(1..=10_000).contains(&self.depth) {
            return Err(Error::Invalid(format!(
                "fusion depth = {} is out of range: give 1..=10000 (default 50)",
                self.depth
            )));
        }
        Ok(())
    }
}

/// Reciprocal rank fusion of rankings (ids best first) with weights: the `k` best `(id, fused score)`, ties
/// broken by the id's first appearance (earlier ranking, then earlier rank).
pub fn rrf(rankings: &[(&[String], f32)], rrf_k: f32, k: usize) -> Vec<(String, f32)> {
    let mut score: HashMap<&str, (f32, usize)> = HashMap::new();
    let mut order = 0usize;
    for (ranking, w) in rankings {
        for (i, id) in ranking.iter().enumerate() {
            let e = score.entry(id.as_str()).or_insert_with(|| {
                order += 1;
                (0.0, order)
            });
            e.0 += w / (rrf_k + (i + 1) as f32);
        }
    }
    let mut v: Vec<(&str, f32, usize)> = score.into_iter().map(|(id, (s, o))| (id, s, o)).collect();
    v.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.2.cmp(&b.2)));
    v.truncate(k);
    v.into_iter()
        .map(|(id, s, _)| (id.to_string(), s))
        .collect()
}

/// BM25 and dense rankings of the same passages fused by [`rrf`].
pub struct HybridRetriever {
    bm25: crate::IndexRetriever,
    dense: DenseRetriever,
    fusion: FusionConfig,
}

impl HybridRetriever {
    /// Combines a BM25 index and a dense index of the same corpus (built together by `kiln index --dense`).
    pub fn new(
        bm25: crate::IndexRetriever,
        dense: DenseRetriever,
        fusion: FusionConfig,
    ) -> Result<Self, Error> {
        fusion.validate()?;
        if bm25.num_docs() != dense.meta().rows as u64 {
            return Err(Error::Invalid(format!(
                "the BM25 index holds {} passages and the dense one {}: they were not built from the same corpus; \
                 rebuild both with `kiln index ... --dense`",
                bm25.num_docs(),
                dense.meta().rows
            )));
        }
        Ok(HybridRetriever {
            bm25,
            dense,
            fusion,
        })
    }

    /// The dense half.
    pub fn dense(&self) -> &DenseRetriever {
        &self.dense
    }
}

impl Retriever for HybridRetriever {
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        if queries.is_empty() {
            return Ok(Vec::new());
        }
        let depth = self.fusion.depth.max(k);
        let sparse = self.bm25.search_batch(queries, depth)?;
        let dense = self.dense.search_texts(queries, depth)?;
        Ok(sparse
            .into_iter()
            .zip(dense)
            .map(|(s, d)| {
                let s_ids: Vec<String> = s.iter().map(|p| p.id.clone()).collect();
                let d_ids: Vec<String> = d
                    .iter()
                    .map(|(r, _)| self.dense.passage(*r).id.clone())
                    .collect();
                rrf(
                    &[
                        (&s_ids, self.fusion.bm25_weight),
                        (&d_ids, self.fusion.dense_weight),
                    ],
                    self.fusion.rrf_k,
                    k,
                )
                .into_iter()
                .filter_map(|(id, score)| {
                    let p = match self.dense.row_of(&id) {
                        Some(r) => self.dense.passage(r).clone(),
                        None => s.iter().find(|p| p.id == id)?.clone(),
                    };
                    Some(Passage { score, ..p })
                })
                .collect()
            })
            .collect())
    }

    fn passage_count(&self) -> Option<u64> {
        Some(self.dense.meta().rows as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_unit(rng: &mut rand_chacha::ChaCha8Rng, n: usize, d: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n * d).map(|_| rng.random::<f32>() - 0.5).collect();
        for r in v.chunks_exact_mut(d) {
            let norm = dot(r, r).sqrt();
            r.iter_mut().for_each(|x| *x /= norm);
        }
        v
    }

    /// The reference: every dot product in f64, sorted.
    fn naive(data: &[f32], q: &[f32], d: usize, k: usize) -> Vec<(u32, f64)> {
        let mut v: Vec<(u32, f64)> = data
            .chunks_exact(d)
            .enumerate()
            .map(|(i, r)| {
                (
                    i as u32,
                    r.iter().zip(q).map(|(a, b)| *a as f64 * *b as f64).sum(),
                )
            })
            .collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(k);
        v
    }

    #[test]
    fn exact_search_matches_f64_dot_products_across_blocks() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (n, d) = (BLOCK_ROWS * 2 + 123, 37);
        let data = random_unit(&mut rng, n, d);
        let idx = ExactIndex::new(d, data.clone()).unwrap();
        let queries = random_unit(&mut rng, 5, d);
        let got = idx.search(&queries, 10);
        assert_eq!(got.len(), 5);
        for (qi, hits) in got.iter().enumerate() {
            let want = naive(&data, &queries[qi * d..(qi + 1) * d], d, 10);
            assert_eq!(hits.len(), 10);
            for (h, w) in hits.iter().zip(&want) {
                assert_eq!(h.0, w.0, "query {qi}: rows differ: {hits:?} vs {want:?}");
                assert!((h.1 as f64 - w.1).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn exact_search_edge_cases() {
        let idx = ExactIndex::new(2, vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]).unwrap();
        // k larger than the rows, ties broken by the lower row.
        let hits = idx.search(&[1.0, 0.0], 10);
        assert_eq!(
            hits[0].iter().map(|h| h.0).collect::<Vec<_>>(),
            vec![0, 2, 1]
        );
        assert!(idx.search(&[1.0, 0.0], 0)[0].is_empty());
        assert!(idx.search(&[], 3).is_empty());
        assert!(ExactIndex::new(3, vec![1.0; 4]).is_err());
        assert!(ExactIndex::new(0, vec![]).is_err());
    }

    #[test]
    fn hnsw_recall_against_exact_on_random_unit_vectors() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let (n, d) = (3000, 32);
        let data = random_unit(&mut rng, n, d);
        let exact = ExactIndex::new(d, data).unwrap();
        let h = HnswIndex::build(&exact, HnswParams::default()).unwrap();
        let queries = random_unit(&mut rng, 50, d);
        let a = exact.search(&queries, 10);
        let b = h.search(&queries, d, 10);
        let found: usize = a
            .iter()
            .zip(&b)
            .map(|(x, y)| x.iter().filter(|e| y.iter().any(|f| f.0 == e.0)).count())
            .sum();
        let recall = found as f64 / 500.0;
        assert!(recall > 0.95, "HNSW recall@10 {recall}");
        // Scores are inner products, best first.
        for (qi, hits) in b.iter().enumerate() {
            for w in hits.windows(2) {
                assert!(w[0].1 >= w[1].1);
            }
            let q = &queries[qi * d..(qi + 1) * d];
            assert!((hits[0].1 - dot(q, exact.row(hits[0].0 as usize))).abs() < 1e-5);
        }
    }

    #[test]
    fn hnsw_builds_over_duplicate_rows_whose_dot_rounds_above_one() {
        // The real corpus holds the same passage under several ids: identical rows, and a dot product of a
        // row with itself that rounds to 1 + 1e-7. hnsw_rs asserts that distances are not negative.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let d = 384;
        let base = random_unit(&mut rng, 200, d);
        let over: Vec<f32> = base.iter().map(|x| x * 1.000_000_2).collect();
        assert!((0..200).any(|i| dot(&over[i * d..(i + 1) * d], &over[i * d..(i + 1) * d]) > 1.0));
        let mut data = over.clone();
        data.extend_from_slice(&over);
        let exact = ExactIndex::new(d, data).unwrap();
        let h = HnswIndex::build(&exact, HnswParams::default()).unwrap();
        let hits = &h.search(&over[..d], d, 2)[0];
        assert_eq!(hits[0].1, 1.0);
        assert_eq!(
            hits.iter().map(|x| x.0 % 200).collect::<Vec<_>>(),
            vec![0, 0]
        );
    }

    #[test]
    fn hnsw_refuses_unnormalised_rows_and_bad_parameters() {
        let exact = ExactIndex::new(2, vec![3.0, 0.0, 0.0, 1.0]).unwrap();
        let e = HnswIndex::build(&exact, HnswParams::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("L2-normalised"), "{e}");
        let unit = ExactIndex::new(2, vec![1.0, 0.0]).unwrap();
        for p in [
            HnswParams {
                m: 300,
                ..Default::default()
            },
            HnswParams {
                ef_construction: 1,
                ..Default::default()
            },
            HnswParams {
                ef_search: 0,
                ..Default::default()
            },
        ] {
            assert!(HnswIndex::build(&unit, p).is_err(), "{p:?}");
        }
    }

    #[test]
    fn rrf_sums_weighted_reciprocal_ranks() {
        let a: Vec<String> = ["x", "y", "z"].iter().map(|s| s.to_string()).collect();
        let b: Vec<String> = ["z", "w"].iter().map(|s| s.to_string()).collect();
        let got = rrf(&[(&a, 1.0), (&b, 1.0)], 60.0, 10);
        // z: 1/63 + 1/61 beats x: 1/61.
        assert_eq!(got[0].0, "z");
        assert!((got[0].1 - (1.0 / 63.0 + 1.0 / 61.0)).abs() < 1e-7);
        assert_eq!(got[1].0, "x");
        // w (1/62) ties y (1/62): y appeared first.
        assert_eq!(got[2].0, "y");
        assert_eq!(got[3].0, "w");
        // A zero weight removes a ranking's influence on the order.
        let only_b = rrf(&[(&a, 0.0), (&b, 1.0)], 60.0, 2);
        assert_eq!(
            only_b.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(),
            ["z", "w"]
        );
        assert_eq!(rrf(&[(&a, 1.0)], 60.0, 1).len(), 1);
    }

    #[test]
    fn fusion_config_ranges() {
        assert!(FusionConfig::default().validate().is_ok());
        for f in [
            FusionConfig {
                bm25_weight: -1.0,
                ..Default::default()
            },
            FusionConfig {
                bm25_weight: 0.0,
                dense_weight: 0.0,
                ..Default::default()
            },
            FusionConfig {
                rrf_k: f32::NAN,
                ..Default::default()
            },
            FusionConfig {
                depth: 0,
                ..Default::default()
            },
        ] {
            assert!(f.validate().is_err(), "{f:?}");
        }
    }

    #[test]
    fn dot_matches_naive_sum_for_every_remainder() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for n in 0..40 {
            let a: Vec<f32> = (0..n).map(|_| rng.random::<f32>()).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.random::<f32>()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-4, "n {n}");
        }
    }
}
