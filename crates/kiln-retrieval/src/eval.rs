//! Retrieval quality: QA files with supporting passage ids (e.g. `gold_context_union_qa.jsonl`) and recall@k.
//!
//! recall@k of a question = the fraction of its supporting passages found among the top k; the reported figure is
//! the mean over questions (questions without supporting ids are skipped). `all@k` is the fraction of questions
//! with every supporting passage in the top k.

use std::path::Path;

use crate::corpus::CorpusLines;
use crate::{Error, Retriever};

/// One question with the ids of the passages that support its answer.
#[derive(Debug, Clone)]
pub struct QaItem {
    /// The question text.
    pub question: String,
    /// Ids of its supporting passages.
    pub supporting: Vec<String>,
}

#[derive(serde::Deserialize)]
struct RawQa {
    question: String,
    #[serde(default)]
    supporting_passage_ids: Vec<String>,
}

/// Reads a JSONL file of `{"question", "supporting_passage_ids": [...]}` rows (other keys ignored).
pub fn load_qa(path: &Path) -> Result<Vec<QaItem>, Error> {
    let mut lines = CorpusLines::open(path)?;
    let mut buf = Vec::new();
    let mut out = Vec::new();
    while let Some(n) = lines.next_line(&mut buf)? {
        let s = std::str::from_utf8(&buf).map_err(|e| Error::BadLine {
            path: path.to_path_buf(),
            line: n,
            msg: format!("not UTF-8: {e}"),
        })?;
        if s.trim().is_empty() {
            continue;
        }
        let r: RawQa = serde_json::from_str(s).map_err(|e| Error::BadLine {
            path: path.to_path_buf(),
            line: n,
            msg: format!("expected {{\"question\": .., \"supporting_passage_ids\": [..]}}: {e}"),
        })?;
        out.push(QaItem {
            question: r.question,
            supporting: r.supporting_passage_ids,
        });
    }
    Ok(out)
}

/// Recall figures at one cut-off.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct RecallAt {
    /// The cut-off k.
    pub k: usize,
    /// Mean fraction of supporting passages in the top k.
    pub recall: f64,
    /// Fraction of questions with all supporting passages in the top k.
    pub all: f64,
    /// Questions counted.
    pub questions: usize,
}

/// recall@k for each k in `ks`, from the retrieved id lists (`retrieved[i]` best first, for `qa[i]`).
pub fn recall_from_ids(qa: &[QaItem], retrieved: &[Vec<String>], ks: &[usize]) -> Vec<RecallAt> {
    ks.iter()
        .map(|&k| {
            let mut sum = 0.0;
            let mut all = 0usize;
            let mut n = 0usize;
            for (item, ids) in qa.iter().zip(retrieved) {
                if item.supporting.is_empty() {
                    continue;
                }
                let top = &ids[..ids.len().min(k)];
                let found = item.supporting.iter().filter(|s| top.contains(s)).count();
                sum += found as f64 / item.supporting.len() as f64;
                all += usize::from(found == item.supporting.len());
                n += 1;
            }
            RecallAt {
                k,
                recall: if n > 0 { sum / n as f64 } else { 0.0 },
                all: if n > 0 { all as f64 / n as f64 } else { 0.0 },
                questions: n,
            }
        })
        .collect()
}

/// Searches every question with `retriever` (top max(ks)) and computes recall@k for each k in `ks`.
pub fn recall_at(
    retriever: &dyn Retriever,
    qa: &[QaItem],
    ks: &[usize],
) -> Result<Vec<RecallAt>, Error> {
    let kmax = ks.iter().copied().max().unwrap_or(0);
    let queries: Vec<String> = qa.iter().map(|q| q.question.clone()).collect();
    let lists = retriever.search_batch(&queries, kmax)?;
    let ids: Vec<Vec<String>> = lists
        .into_iter()
        .map(|l| l.into_iter().map(|p| p.id).collect())
        .collect();
    Ok(recall_from_ids(qa, &ids, ks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recall_arithmetic() {
        let qa = vec![
            QaItem {
                question: "a".into(),
                supporting: vec!["1".into(), "2".into()],
            },
            QaItem {
                question: "b".into(),
                supporting: vec!["3".into()],
            },
        ];
        let got = vec![
            vec!["1".to_string(), "9".into(), "2".into()],
            vec!["8".to_string(), "3".into()],
        ];
        let r = recall_from_ids(&qa, &got, &[1, 3]);
        assert!((r[0].recall - 0.25).abs() < 1e-12);
        assert!((r[1].recall - 1.0).abs() < 1e-12);
        assert!((r[1].all - 1.0).abs() < 1e-12);
        assert!((r[0].all - 0.0).abs() < 1e-12);
    }
}
