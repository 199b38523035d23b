//! Building a tantivy BM25 index from corpora, and searching it in-process.
//!
//! **Schema.** `id` (raw string, stored), `title` and `text` (stored only) and `body` (title + text, indexed with
//! term frequencies, not stored). Ranking is tantivy's BM25 over `body`, the same "one contents field" setup as
//! pyserini's Search-R1/FlashRAG indexes.
//!
//! **BM25 parameters.** tantivy 0.27 hard-codes `k1 = 1.2` and `b = 0.75` (`tantivy::query::bm25`); they cannot be
//! configured, so kiln does not offer a knob for them. IDF is Lucene's `ln(1 + (N - n + 0.5) / (n + 0.5))`.
//!
//! **Analyzer** (`kiln_en`): tantivy's `SimpleTokenizer` (splits on non-alphanumeric characters), tokens over 40
//! bytes dropped, lower-cased, Lucene's 33 English stop words removed, Snowball English stemmer. The same analyzer
//! tokenizes queries.
//!
//! **Untrusted queries.** Queries are never parsed by tantivy's query parser: [`IndexRetriever`] runs the analyzer
//! over the text and scores the resulting terms itself (a disjunction of the terms: term-at-a-time BM25 for
//! segments up to [`TAAT_MAX_DOCS`] documents, else a `BooleanQuery` of `TermQuery` SHOULD clauses), so no string
//! can cause a syntax error. A query is cut at [`MAX_QUERY_BYTES`] (on a character boundary) and at [`MAX_QUERY_TERMS`] distinct
//! terms; a query without terms gives an empty list; `k` is capped at the number of documents.
//!
//! **Building.** [`build_index`] parses lines in parallel (rayon), feeds tantivy's multi-threaded writer, shows an
//! indicatif progress bar (bytes read) on a terminal, commits, merges everything into one segment (faster search
//! for a read-only index), and reports docs/s. It builds into a temporary sibling directory and then replaces
//! `out`, so re-indexing into an existing index directory replaces it cleanly; a directory that is not a kiln index
//! (and not empty) is never deleted. Duplicate ids (first occurrence wins) and bad lines are skipped and counted.
//! With more than one indexing thread the internal document order can differ between builds of the same corpus,
//! so passages with exactly equal scores may come back in a different order (scores and contents are identical).
//!
//! **Speed.** On a 26k-passage corpus the term-at-a-time path answers a 10-15-term question in about 36 µs of
//! CPU (ids only; ~40 µs with the passages, which a small index keeps in memory, see
//! [`MEMORY_PASSAGES_MAX_BYTES`]), about ten times faster than tantivy's block-max WAND here; its scoring mirrors
//! tantivy's BM25 formula and a test checks that both give the same scores.

use std::collections::HashSet;
use std::hash::BuildHasher;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use tantivy::collector::TopDocs;
use tantivy::query::{BooleanQuery, Occur, Query, TermQuery};
use tantivy::schema::{
    Field, IndexRecordOption, STORED, STRING, Schema, TextFieldIndexing, TextOptions, Value,
};
use tantivy::tokenizer::{
    Language, LowerCaser, RemoveLongFilter, SimpleTokenizer, Stemmer, StopWordFilter, TextAnalyzer,
};
use tantivy::{DocAddress, Index, IndexReader, ReloadPolicy, Searcher, TantivyDocument, Term};

use crate::corpus::{BadLinePolicy, BadLines, CorpusDoc, CorpusLines, join_paths, parse_raw_line};
use crate::{Error, Passage, Retriever};

/// Name under which the analyzer is registered in the index schema.
pub const ANALYZER_NAME: &str = "kiln_en";
/// File written into every kiln index directory (build statistics); its presence marks the directory as ours.
pub const MARKER_FILE: &str = "kiln-index.json";
/// Queries longer than this many bytes are cut (on a character boundary) before analysis.
pub const MAX_QUERY_BYTES: usize = 16 * 1024;
/// At most this many distinct terms of a query are used.
pub const MAX_QUERY_TERMS: usize = 256;

/// The `kiln_en` analyzer used for passages and queries.
pub fn analyzer() -> TextAnalyzer {
    let stop = StopWordFilter::new(Language::English)
        .unwrap_or_else(|| StopWordFilter::remove(Vec::new()));
    TextAnalyzer::builder(SimpleTokenizer::default())
        .filter(RemoveLongFilter::limit(40))
        .filter(LowerCaser)
        .filter(stop)
        .filter(Stemmer::new(Language::English))
        .build()
}

struct Fields {
    id: Field,
    title: Field,
    text: Field,
    body: Field,
}

fn schema() -> (Schema, Fields) {
    let mut b = Schema::builder();
    let id = b.add_text_field("id", STRING | STORED);
    let title = b.add_text_field("title", STORED);
    let text = b.add_text_field("text", STORED);
    let body_opts = TextOptions::default().set_indexing_options(
        TextFieldIndexing::default()
            .set_tokenizer(ANALYZER_NAME)
            .set_index_option(IndexRecordOption::WithFreqs),
    );
    let body = b.add_text_field("body", body_opts);
    (
        b.build(),
        Fields {
            id,
            title,
            text,
            body,
        },
    )
}

fn fields_of(schema: &Schema, dir: &Path) -> Result<Fields, Error> {
    let get = |name: &str| {
        schema.get_field(name).map_err(|_| Error::IndexDir {
            path: dir.to_path_buf(),
            msg: format!("schema has no field {name:?}; rebuild it with `kiln index`"),
        })
    };
    Ok(Fields {
        id: get("id")?,
        title: get("title")?,
        text: get("text")?,
        body: get("body")?,
    })
}

/// Options of [`build_index`].
#[derive(Debug, Clone)]
pub struct BuildOptions {
    /// tantivy indexing threads (0 = number of CPUs, at most 8).
    pub threads: usize,
    /// Writer memory budget per indexing thread in MiB (tantivy needs at least 15).
    pub heap_mb_per_thread: usize,
    /// What to do with unparsable lines.
    pub bad_lines: BadLinePolicy,
    /// Show a progress bar on stderr (drawn only when stderr is a terminal).
    pub progress: bool,
    /// Merge all segments into one after the commit (recommended for a read-only index).
    pub merge: bool,
    /// Longest accepted corpus line in bytes; a longer line stops the build with a `file:line` error
    /// (default [`crate::corpus::default_max_line_bytes`], 16 MiB).
    pub max_line_bytes: usize,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            threads: 0,
            heap_mb_per_thread: 64,
            bad_lines: BadLinePolicy::Skip,
            progress: true,
            merge: true,
            max_line_bytes: crate::corpus::default_max_line_bytes(),
        }
    }
}

/// What [`build_index`] did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct BuildStats {
    /// Passages indexed.
    pub docs: u64,
    /// Bad lines skipped.
    pub skipped_lines: usize,
    /// Passages skipped because their id was already indexed.
    pub duplicate_ids: usize,
    /// Wall-clock seconds for reading, indexing, committing and merging.
    pub seconds: f64,
    /// `docs / seconds`.
    pub docs_per_sec: f64,
    /// Indexing threads used.
    pub threads: usize,
    /// Corpus files read.
    pub corpus: Vec<PathBuf>,
    /// Analyzer name.
    pub analyzer: String,
}

fn tmp_sibling(out: &Path, tag: &str) -> Result<PathBuf, Error> {
    let name = out
        .file_name()
        .ok_or_else(|| Error::Invalid(format!("--out {} has no directory name", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok(parent.join(format!(
        ".{}.kiln-{tag}-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

fn check_replaceable(out: &Path) -> Result<(), Error> {
    if !out.exists() {
        return Ok(());
    }
    if !out.is_dir() {
        return Err(Error::IndexDir {
            path: out.to_path_buf(),
            msg: "exists and is not a directory; choose another --out".into(),
        });
    }
    if out.join(MARKER_FILE).is_file() {
        return Ok(());
    }
    let empty = std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .next()
        .is_none();
    if empty {
        Ok(())
    } else {
        Err(Error::IndexDir {
            path: out.to_path_buf(),
            msg: format!(
                "exists, is not empty and is not a kiln index (no {MARKER_FILE}); refusing to replace it. Choose another --out or delete it"
            ),
        })
    }
}

fn id_hash(state: &std::hash::RandomState, id: &str) -> u64 {
    state.hash_one(id)
}

/// Builds an index of the corpus files `corpus` into `out` (replacing a previous kiln index there).
pub fn build_index(
    corpus: &[PathBuf],
    out: &Path,
    opts: &BuildOptions,
) -> Result<BuildStats, Error> {
    if corpus.is_empty() {
        return Err(Error::Invalid(
            "no corpus file given (--corpus PATH)".into(),
        ));
    }
    check_replaceable(out)?;
    let start = Instant::now();
    let tmp = tmp_sibling(out, "tmp")?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let result = build_into(corpus, &tmp, opts, start);
    let stats = match result {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    // Swap the new index into place.
    if out.exists() {
        let old = tmp_sibling(out, "old")?;
        if old.exists() {
            std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
        }
        std::fs::rename(out, &old).map_err(|e| Error::io(out, e))?;
        std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))?;
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    } else {
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        std::fs::rename(&tmp, out).map_err(|e| Error::io(out, e))?;
    }
    Ok(stats)
}

fn build_into(
    corpus: &[PathBuf],
    dir: &Path,
    opts: &BuildOptions,
    start: Instant,
) -> Result<BuildStats, Error> {
    let (schema, f) = schema();
    let index = Index::create_in_dir(dir, schema)?;
    index.tokenizers().register(ANALYZER_NAME, analyzer());
    let threads = if opts.threads == 0 {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(8)
    } else {
        opts.threads
    };
    let heap = opts.heap_mb_per_thread.max(15) * threads * 1024 * 1024;
    let mut writer = index.writer_with_num_threads::<TantivyDocument>(threads, heap)?;

    let total_bytes: u64 = corpus
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum();
    let pb = if opts.progress {
        let pb = indicatif::ProgressBar::new(total_bytes);
        pb.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} indexing [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    } else {
        indicatif::ProgressBar::hidden()
    };

    let mut bad = BadLines::new(opts.bad_lines);
    let hasher = std::hash::RandomState::new();
    let mut seen: HashSet<u64> = HashSet::new();
    let mut docs: u64 = 0;
    let mut duplicates = 0usize;
    // Lines are parsed in parallel chunks of at most CHUNK lines and about CHUNK_BYTES bytes.
    const CHUNK: usize = 4096;
    const CHUNK_BYTES: usize = 64 * 1024 * 1024;
    for path in corpus {
        let pbc = pb.clone();
        let mut lines = CorpusLines::open_with(path, move |file| -> Box<dyn Read + Send> {
            Box::new(pbc.wrap_read(file))
        })?
        .with_max_line_bytes(opts.max_line_bytes);
        loop {
            let mut chunk: Vec<(usize, Vec<u8>)> = Vec::with_capacity(CHUNK);
            let mut chunk_bytes = 0usize;
            let mut buf = Vec::new();
            while chunk.len() < CHUNK && chunk_bytes < CHUNK_BYTES {
                match lines.next_line(&mut buf)? {
                    Some(n) => {
                        chunk_bytes += buf.len();
                        chunk.push((n, std::mem::take(&mut buf)));
                    }
                    None => break,
                }
            }
            if chunk.is_empty() {
                break;
            }
            let parsed: Vec<(usize, Result<Option<CorpusDoc>, String>)> = chunk
                .par_iter()
                .map(|(n, raw)| (*n, parse_raw_line(raw)))
                .collect();
            for (line_no, res) in parsed {
                match res {
                    Ok(Some(d)) => {
                        if !seen.insert(id_hash(&hasher, &d.id)) {
                            duplicates += 1;
                            if duplicates <= 5 {
                                tracing::warn!(
                                    "{}:{line_no}: duplicate id {:?} skipped (first occurrence kept)",
                                    path.display(),
                                    d.id
                                );
                            }
                            continue;
                        }
                        let mut doc = TantivyDocument::default();
                        let mut body = String::with_capacity(d.title.len() + d.text.len() + 1);
                        body.push_str(&d.title);
                        body.push('\n');
                        body.push_str(&d.text);
                        doc.add_text(f.body, body);
                        doc.add_text(f.id, d.id);
                        doc.add_text(f.title, d.title);
                        doc.add_text(f.text, d.text);
                        writer.add_document(doc)?;
                        docs += 1;
                    }
                    Ok(None) => {}
                    Err(msg) => bad.record(path, line_no, msg)?,
                }
            }
            let secs = start.elapsed().as_secs_f64().max(1e-9);
            pb.set_message(format!("{docs} docs, {:.0} docs/s", docs as f64 / secs));
        }
    }
    if docs == 0 {
        pb.finish_and_clear();
        return Err(Error::EmptyCorpus {
            paths: join_paths(corpus),
        });
    }
    pb.set_message(format!("{docs} docs, committing"));
    writer.commit()?;
    if opts.merge {
        let ids = index.searchable_segment_ids()?;
        if ids.len() > 1 {
            pb.set_message(format!("{docs} docs, merging {} segments", ids.len()));
            writer.merge(&ids).wait()?;
        }
    }
    writer.garbage_collect_files().wait()?;
    writer.wait_merging_threads()?;
    pb.finish_and_clear();
    let seconds = start.elapsed().as_secs_f64();
    let stats = BuildStats {
        docs,
        skipped_lines: bad.skipped,
        duplicate_ids: duplicates,
        seconds,
        docs_per_sec: docs as f64 / seconds.max(1e-9),
        threads,
        corpus: corpus.to_vec(),
        analyzer: ANALYZER_NAME.to_string(),
    };
    let marker = dir.join(MARKER_FILE);
    let json = serde_json::to_string_pretty(&stats).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(&marker, json).map_err(|e| Error::io(&marker, e))?;
    Ok(stats)
}

/// Cuts `s` to at most `max` bytes on a character boundary.
pub fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// An index opened read-only for in-process search. `Send + Sync`: share one behind an `Arc` across threads.
pub struct IndexRetriever {
    _index: Index,
    _reader: IndexReader,
    searcher: Searcher,
    fields: Fields,
    analyzer: TextAnalyzer,
    num_docs: u64,
    /// BM25 statistics of the `body` field, fixed for a read-only index (as tantivy computes them).
    total_docs: u64,
    /// Per segment: BM25 length normalisation of every document (empty for segments over [`TAAT_MAX_DOCS`]).
    seg_norms: Vec<Vec<f32>>,
    /// Stored passages of a single-segment index held in memory (see [`MEMORY_PASSAGES_MAX_BYTES`]).
    in_memory: Option<Vec<Passage>>,
    stats: Option<BuildStats>,
}

impl IndexRetriever {
    /// Opens an index directory built by [`build_index`] (`kiln index`).
    pub fn open(dir: &Path) -> Result<Self, Error> {
        let marker = dir.join(MARKER_FILE);
        if !marker.is_file() {
            return Err(Error::IndexDir {
                path: dir.to_path_buf(),
                msg: format!(
                    "not a kiln index (no {MARKER_FILE}); build one with `kiln index --corpus CORPUS.jsonl --out {}`",
                    dir.display()
                ),
            });
        }
        let stats = std::fs::read_to_string(&marker)
            .ok()
            .and_then(|s| serde_json::from_str::<BuildStats>(&s).ok());
        let index = Index::open_in_dir(dir)?;
        index.tokenizers().register(ANALYZER_NAME, analyzer());
        let fields = fields_of(&index.schema(), dir)?;
        let reader = index
            .reader_builder()
            .reload_policy(ReloadPolicy::Manual)
            .doc_store_cache_num_blocks(DOC_STORE_CACHE_BLOCKS)
            .try_into()?;
        let searcher = reader.searcher();
        let num_docs = searcher.num_docs();
        let total_docs = tantivy::query::Bm25StatisticsProvider::total_num_docs(&searcher)?;
        let total_tokens =
            tantivy::query::Bm25StatisticsProvider::total_num_tokens(&searcher, fields.body)?;
        let avg_fieldnorm = total_tokens as f32 / total_docs.max(1) as f32;
        let seg_norms = searcher
            .segment_readers()
            .iter()
            .map(|seg| {
                if seg.max_doc() as usize <= TAAT_MAX_DOCS {
                    segment_norms(seg, fields.body, avg_fieldnorm)
                } else {
                    Ok(Vec::new())
                }
            })
            .collect::<Result<Vec<_>, Error>>()?;
        let in_memory = match searcher.segment_readers() {
            [seg] if seg.alive_bitset().is_none() => {
                load_passages(&searcher, &fields, seg.max_doc(), MEMORY_PASSAGES_MAX_BYTES)?
            }
            _ => None,
        };
        Ok(IndexRetriever {
            _index: index,
            _reader: reader,
            searcher,
            fields,
            analyzer: analyzer(),
            num_docs,
            total_docs,
            seg_norms,
            in_memory,
            stats,
        })
    }

    /// Number of passages in the index.
    pub fn num_docs(&self) -> u64 {
        self.num_docs
    }

    /// The statistics written when the index was built, if readable.
    pub fn build_stats(&self) -> Option<&BuildStats> {
        self.stats.as_ref()
    }

    /// The distinct analyzed terms of a query (after the length caps), in order of first occurrence.
    pub fn query_terms(&self, query: &str) -> Vec<String> {
        let query = truncate_str(query, MAX_QUERY_BYTES);
        ANALYZER.with(|cell| {
            let mut slot = cell.borrow_mut();
            let analyzer = slot.get_or_insert_with(|| self.analyzer.clone());
            let mut stream = analyzer.token_stream(query);
            let mut terms: Vec<String> = Vec::new();
            while stream.advance() {
                let t = &stream.token().text;
                if !terms.iter().any(|x| x == t) {
                    terms.push(t.clone());
                    if terms.len() >= MAX_QUERY_TERMS {
                        break;
                    }
                }
            }
            terms
        })
    }

    /// Top-`k` hits of a query as (score, address), best first (ties: lower address first), without loading the
    /// stored passages.
    ///
    /// Segments of at most [`TAAT_MAX_DOCS`] documents are scored term-at-a-time into a per-thread dense
    /// accumulator (exhaustive, exact BM25 with tantivy's `Bm25Weight`, so the same scores as the `BooleanQuery`
    /// path); on a corpus of this size that is several times faster than tantivy's block-max WAND, which spends its
    /// time re-sorting scorers. Larger segments use tantivy's `BooleanQuery` + `TopDocs` (block-max WAND).
    pub fn search_hits(&self, query: &str, k: usize) -> Result<Vec<(f32, DocAddress)>, Error> {
        let k = k.min(self.num_docs as usize);
        if k == 0 {
            return Ok(Vec::new());
        }
        let terms = self.query_terms(query);
        if terms.is_empty() {
            return Ok(Vec::new());
        }
        let terms: Vec<Term> = terms
            .iter()
            .map(|t| Term::from_field_text(self.fields.body, t))
            .collect();
        let small = self
            .searcher
            .segment_readers()
            .iter()
            .all(|s| (s.max_doc() as usize) <= TAAT_MAX_DOCS);
        if small {
            self.taat_hits(&terms, k)
        } else {
            self.wand_hits(&terms, k)
        }
    }

    /// [`search_hits`](Self::search_hits) through tantivy's `BooleanQuery` of `TermQuery` SHOULD clauses and
    /// `TopDocs` (block-max WAND), whatever the segment sizes. Used for large segments and to cross-check.
    pub fn search_hits_wand(&self, query: &str, k: usize) -> Result<Vec<(f32, DocAddress)>, Error> {
        let k = k.min(self.num_docs as usize);
        let terms: Vec<Term> = self
            .query_terms(query)
            .iter()
            .map(|t| Term::from_field_text(self.fields.body, t))
            .collect();
        if k == 0 || terms.is_empty() {
            return Ok(Vec::new());
        }
        self.wand_hits(&terms, k)
    }

    fn wand_hits(&self, terms: &[Term], k: usize) -> Result<Vec<(f32, DocAddress)>, Error> {
        let mut clauses: Vec<(Occur, Box<dyn Query>)> = terms
            .iter()
            .map(|t| {
                let q: Box<dyn Query> =
                    Box::new(TermQuery::new(t.clone(), IndexRecordOption::WithFreqs));
                (Occur::Should, q)
            })
            .collect();
        let q: Box<dyn Query> = if clauses.len() == 1 {
            clauses.remove(0).1
        } else {
            Box::new(BooleanQuery::new(clauses))
        };
        Ok(self
            .searcher
            .search(&*q, &TopDocs::with_limit(k).order_by_score())?)
    }

    fn taat_hits(&self, terms: &[Term], k: usize) -> Result<Vec<(f32, DocAddress)>, Error> {
        let segments = self.searcher.segment_readers();
        // One term-dictionary lookup per term and segment; the global doc frequency gives tantivy's BM25 weight.
        let mut inverted = Vec::with_capacity(segments.len());
        let mut infos: Vec<Vec<Option<tantivy::postings::TermInfo>>> =
            Vec::with_capacity(segments.len());
        let mut doc_freq = vec![0u64; terms.len()];
        for seg in segments {
            let inv = seg.inverted_index(self.fields.body)?;
            let mut seg_infos = Vec::with_capacity(terms.len());
            for (t, df) in terms.iter().zip(doc_freq.iter_mut()) {
                let info = inv.get_term_info(t).map_err(|e| Error::Tantivy(e.into()))?;
                *df += info.as_ref().map_or(0, |i| u64::from(i.doc_freq));
                seg_infos.push(info);
            }
            inverted.push(inv);
            infos.push(seg_infos);
        }
        let weights: Vec<f32> = doc_freq
            .iter()
            .map(|&df| bm25_idf(df, self.total_docs) * (1.0 + BM25_K1))
            .collect();
        let mut best: Vec<(f32, DocAddress)> = Vec::with_capacity(4 * k);
        for (seg_ord, seg) in segments.iter().enumerate() {
            let norms = &self.seg_norms[seg_ord];
            let alive = seg.alive_bitset();
            let max_doc = seg.max_doc() as usize;
            TAAT_SCRATCH.with(|cell| -> Result<(), Error> {
                let mut scratch = cell.borrow_mut();
                let Scratch { acc, touched } = &mut *scratch;
                if acc.len() < max_doc {
                    acc.resize(max_doc, 0.0);
                }
                // One slot per document (each is recorded at most once) plus one for the branch-free write.
                if touched.len() < max_doc + 1 {
                    touched.resize(max_doc + 1, 0);
                }
                let mut count = 0;
                let filled = accumulate(
                    &inverted[seg_ord],
                    &norms[..norms.len().min(max_doc)],
                    &infos[seg_ord],
                    &weights,
                    &mut acc[..max_doc],
                    touched,
                    &mut count,
                );
                // Always reset the touched slots (also after an error) while selecting the best k.
                let mut threshold = f32::NEG_INFINITY;
                for &d in touched[..count].iter() {
                    let score = std::mem::take(&mut acc[d as usize]);
                    if score < threshold || alive.is_some_and(|a| a.is_deleted(d)) {
                        continue;
                    }
                    best.push((score, DocAddress::new(seg_ord as u32, d)));
                    if best.len() >= 4 * k {
                        top_k_in_place(&mut best, k);
                        threshold = best[k - 1].0;
                    }
                }
                filled
            })?;
        }
        top_k_in_place(&mut best, k);
        Ok(best)
    }

    /// Top-`k` passage ids of a query with scores, best first (loads only the id field's stored document).
    pub fn search_ids(&self, query: &str, k: usize) -> Result<Vec<(String, f32)>, Error> {
        self.search_hits(query, k)?
            .into_iter()
            .map(|(score, addr)| {
                if let Some(p) = self
                    .in_memory
                    .as_ref()
                    .and_then(|m| m.get(addr.doc_id as usize))
                {
                    return Ok((p.id.clone(), score));
                }
                let doc: TantivyDocument = self.searcher.doc(addr)?;
                Ok((self.str_field(&doc, self.fields.id), score))
            })
            .collect()
    }

    fn str_field(&self, doc: &TantivyDocument, field: Field) -> String {
        doc.get_first(field)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    }

    /// Top-`k` passages of one query, best first. Never fails on the query text itself.
    pub fn search_one(&self, query: &str, k: usize) -> Result<Vec<Passage>, Error> {
        self.search_hits(query, k)?
            .into_iter()
            .map(|(score, addr)| {
                if let Some(p) = self
                    .in_memory
                    .as_ref()
                    .and_then(|m| m.get(addr.doc_id as usize))
                {
                    return Ok(Passage { score, ..p.clone() });
                }
                let doc: TantivyDocument = self.searcher.doc(addr)?;
                Ok(Passage {
                    id: self.str_field(&doc, self.fields.id),
                    title: self.str_field(&doc, self.fields.title),
                    text: self.str_field(&doc, self.fields.text),
                    score,
                })
            })
            .collect()
    }
}

/// Passages of a single-segment index are held in memory (copied out of the doc store at open) when their text
/// totals at most this many bytes (256 MiB); larger corpora are read from the memory-mapped doc store per hit.
pub const MEMORY_PASSAGES_MAX_BYTES: usize = 256 << 20;

fn load_passages(
    searcher: &Searcher,
    fields: &Fields,
    max_doc: u32,
    max_bytes: usize,
) -> Result<Option<Vec<Passage>>, Error> {
    // A cheap size check first: the doc store is compressed, so its on-disk size under-estimates the text.
    if max_doc as usize > max_bytes / 64 {
        return Ok(None);
    }
    let get = |doc: &TantivyDocument, f: Field| {
        doc.get_first(f)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    let mut out = Vec::with_capacity(max_doc as usize);
    let mut bytes = 0usize;
    for d in 0..max_doc {
        let doc: TantivyDocument = searcher.doc(DocAddress::new(0, d))?;
        let p = Passage {
            id: get(&doc, fields.id),
            title: get(&doc, fields.title),
            text: get(&doc, fields.text),
            score: 0.0,
        };
        bytes += p.id.len() + p.title.len() + p.text.len() + std::mem::size_of::<Passage>();
        if bytes > max_bytes {
            return Ok(None);
        }
        out.push(p);
    }
    Ok(Some(out))
}

/// Decompressed doc-store blocks (16 KiB of passages each) kept in memory: up to 32 MiB, all of a small corpus.
pub const DOC_STORE_CACHE_BLOCKS: usize = 2048;

/// Segments up to this many documents are searched term-at-a-time with a dense per-thread score accumulator
/// (8 bytes per document and thread: scores and the touched list); larger ones with tantivy's block-max WAND.
pub const TAAT_MAX_DOCS: usize = 4 << 20;

#[derive(Default)]
struct Scratch {
    acc: Vec<f32>,
    touched: Vec<u32>,
}

thread_local! {
    static TAAT_SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Adds every term's BM25 contribution to `acc`, recording first-touched documents in `touched[..*count]` (BM25
/// terms are always > 0, so `acc[d] == 0` means untouched). `touched` must have room for `acc.len() + 1` entries.
/// The caller resets `acc` for the touched documents, also after an error.
///
/// The inner loop is branch-free on the data (the document id is always written to `touched[count]`, and `count`
/// advances only on a first touch): a "first touch?" branch is unpredictable and cost more than the arithmetic.
fn accumulate(
    inverted: &tantivy::InvertedIndexReader,
    norms: &[f32],
    infos: &[Option<tantivy::postings::TermInfo>],
    weights: &[f32],
    acc: &mut [f32],
    touched: &mut [u32],
    count: &mut usize,
) -> Result<(), Error> {
    let n = acc.len().min(norms.len());
    let (acc, norms) = (&mut acc[..n], &norms[..n]);
    if touched.len() <= n {
        return Err(Error::Invalid(
            "accumulate: touched buffer too small".into(),
        ));
    }
    let mut cnt = *count;
    for (info, &w) in infos.iter().zip(weights) {
        let Some(info) = info else {
            continue;
        };
        let mut block = inverted
            .read_block_postings_from_terminfo(info, IndexRecordOption::WithFreqs)
            .map_err(|e| Error::Tantivy(e.into()))?;
        loop {
            let docs = block.docs();
            if docs.is_empty() {
                break;
            }
            for (&d, &tf) in docs.iter().zip(block.freqs()) {
                let di = d as usize;
                if di >= n {
                    continue;
                }
                let old = acc[di];
                // cnt <= number of distinct documents seen <= n < touched.len().
                if let Some(t) = touched.get_mut(cnt) {
                    *t = d;
                }
                cnt += usize::from(old == 0.0);
                // tantivy's `Bm25Weight::score` = weight * tf / (tf + norm), same operations in the same order.
                let tf = tf as f32;
                acc[di] = old + w * (tf / (tf + norms[di]));
            }
            *count = cnt;
            block.advance();
        }
    }
    *count = cnt;
    Ok(())
}

/// tantivy's BM25 `k1` (fixed in tantivy 0.27, `tantivy::query::bm25`); the term-at-a-time path mirrors it and
/// `tests/real_corpus.rs` checks that its scores equal tantivy's own.
const BM25_K1: f32 = 1.2;
/// tantivy's BM25 `b` (fixed in tantivy 0.27).
const BM25_B: f32 = 0.75;

/// Lucene/tantivy IDF: `ln(1 + (N - n + 0.5) / (n + 0.5))`.
fn bm25_idf(doc_freq: u64, docs: u64) -> f32 {
    let doc_freq = doc_freq.min(docs);
    let x = ((docs - doc_freq) as f32 + 0.5) / (doc_freq as f32 + 0.5);
    (1.0 + x).ln()
}

/// Per-document BM25 length normalisation `k1 * (1 - b + b * fieldnorm / avg_fieldnorm)` of a segment.
fn segment_norms(
    seg: &tantivy::SegmentReader,
    field: Field,
    avg_fieldnorm: f32,
) -> Result<Vec<f32>, Error> {
    let reader = seg.get_fieldnorms_reader(field)?;
    Ok((0..seg.max_doc())
        .map(|d| BM25_K1 * (1.0 - BM25_B + BM25_B * reader.fieldnorm(d) as f32 / avg_fieldnorm))
        .collect())
}

thread_local! {
    static ANALYZER: std::cell::RefCell<Option<TextAnalyzer>> = const { std::cell::RefCell::new(None) };
}

/// Keeps the `k` best of `v` (score descending, then address ascending), sorted.
fn top_k_in_place(v: &mut Vec<(f32, DocAddress)>, k: usize) {
    let cmp =
        |a: &(f32, DocAddress), b: &(f32, DocAddress)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    if v.len() > k {
        v.select_nth_unstable_by(k, cmp);
        v.truncate(k);
    }
    v.sort_unstable_by(cmp);
}

impl Retriever for IndexRetriever {
    /// Searches the queries in parallel on rayon's pool (sequentially for a single query).
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        if queries.len() <= 1 {
            return queries.iter().map(|q| self.search_one(q, k)).collect();
        }
        queries.par_iter().map(|q| self.search_one(q, k)).collect()
    }

    fn search(&self, query: &str, k: usize) -> Result<Vec<Passage>, Error> {
        self.search_one(query, k)
    }

    fn passage_count(&self) -> Option<u64> {
        Some(self.num_docs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn tiny_corpus(dir: &Path) -> PathBuf {
        let p = dir.join("c.jsonl");
        let mut f = std::fs::File::create(&p).unwrap();
        writeln!(
            f,
            r#"{{"id":"1","title":"Paris","text":"Paris is the capital of France."}}"#
        )
        .unwrap();
        writeln!(
            f,
            r#"{{"id":"2","contents":"\"Berlin\"\nBerlin is the capital of Germany."}}"#
        )
        .unwrap();
        writeln!(
            f,
            r#"{{"id":"3","title":"Rome","text":"Rome is the capital of Italy."}}"#
        )
        .unwrap();
        writeln!(f, r#"{{"id":"3","title":"Dup","text":"duplicate id"}}"#).unwrap();
        writeln!(f, "oops").unwrap();
        p
    }

    #[test]
    fn build_search_reindex() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = tiny_corpus(dir.path());
        let out = dir.path().join("idx");
        let opts = BuildOptions {
            threads: 1,
            progress: false,
            ..Default::default()
        };
        let s = build_index(std::slice::from_ref(&corpus), &out, &opts).unwrap();
        assert_eq!((s.docs, s.skipped_lines, s.duplicate_ids), (3, 1, 1));
        let r = IndexRetriever::open(&out).unwrap();
        let hits = r.search_one("capital of germany?", 2).unwrap();
        assert_eq!(hits[0].id, "2");
        assert_eq!(
            hits[0].contents(),
            "\"Berlin\"\nBerlin is the capital of Germany."
        );
        assert!(hits[0].score > hits[1].score);
        assert!(r.search_one("", 3).unwrap().is_empty());
        assert!(r.search_one("the of", 3).unwrap().is_empty());
        assert!(r.search_one("paris", 0).unwrap().is_empty());
        assert_eq!(r.search_one("capital", 1_000_000_000).unwrap().len(), 3);
        drop(r);
        // Re-index into the same directory: replaced cleanly, same answers.
        let s2 = build_index(std::slice::from_ref(&corpus), &out, &opts).unwrap();
        assert_eq!(s2.docs, 3);
        let r = IndexRetriever::open(&out).unwrap();
        assert_eq!(r.num_docs(), 3);
        assert_eq!(r.search_one("Rome Italy", 1).unwrap()[0].id, "3");
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("kiln-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn refuses_foreign_dir_and_strict_fails() {
        let dir = tempfile::tempdir().unwrap();
        let corpus = tiny_corpus(dir.path());
        let foreign = dir.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::fs::write(foreign.join("precious.txt"), "keep").unwrap();
        let opts = BuildOptions {
            threads: 1,
            progress: false,
            ..Default::default()
        };
        let e = build_index(std::slice::from_ref(&corpus), &foreign, &opts).unwrap_err();
        assert!(e.to_string().contains("refusing"), "{e}");
        assert!(foreign.join("precious.txt").exists());
        let strict = BuildOptions {
            bad_lines: BadLinePolicy::Fail,
            ..opts
        };
        let e = build_index(
            std::slice::from_ref(&corpus),
            &dir.path().join("s"),
            &strict,
        )
        .unwrap_err();
        assert!(e.to_string().contains("c.jsonl:5:"), "{e}");
        assert!(!dir.path().join("s").exists());
        assert!(IndexRetriever::open(&foreign).is_err());
    }

    #[test]
    fn truncation_respects_char_boundaries() {
        let s = "é".repeat(10);
        assert_eq!(truncate_str(&s, 5), "éé");
        assert_eq!(truncate_str("abc", 10), "abc");
    }
}
