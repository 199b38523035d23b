//! Evaluation helpers: seeded bootstrap confidence intervals and the QA report (a per-dataset table of EM / F1
//! with 95% CIs, mean searches, answer-in-retrieved-passages rate, and per-question JSONL transcripts).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use kiln_rl::stats::{Bootstrap, Quantile};
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::data::QaExample;
use crate::protocol::{EndReason, Episode, Step};
use crate::reward::{answer_in_passages, trajectory_outcome};

pub use kiln_rl::stats::Ci;

/// Percentile bootstrap CI of the mean of `values` at `level` (e.g. 0.95) with `resamples` resamples, seeded
/// (linear interpolation between ranks; see [`kiln_rl::stats`]).
pub fn bootstrap_ci(values: &[f64], resamples: usize, level: f64, seed: u64) -> Ci {
    kiln_rl::stats::bootstrap_ci(values, &qa_bootstrap(resamples, level, seed))
}

fn qa_bootstrap(resamples: usize, level: f64, seed: u64) -> Bootstrap {
    Bootstrap {
        resamples,
        level,
        seed,
        quantile: Quantile::Linear,
    }
}

/// Paired bootstrap CI of `mean(a) - mean(b)` (the same questions answered by two systems).
pub fn paired_bootstrap_diff(
    a: &[f64],
    b: &[f64],
    resamples: usize,
    level: f64,
    seed: u64,
) -> Result<Ci, Error> {
    kiln_rl::stats::paired_bootstrap_ci(a, b, &qa_bootstrap(resamples, level, seed)).map_err(
        |(x, y)| {
            Error::Invalid(format!(
                "paired bootstrap needs equal sizes, got {x} and {y}"
            ))
        },
    )
}

/// One evaluated question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QaRecord {
    /// Dataset name.
    pub dataset: String,
    /// Evaluation mode (`direct`, `rag`, `agent`, or a system label).
    pub mode: String,
    /// Example id.
    pub id: String,
    /// The question.
    pub question: String,
    /// Gold aliases.
    pub golden_answers: Vec<String>,
    /// The extracted answer.
    pub answer: Option<String>,
    /// Exact match.
    pub em: f64,
    /// Token F1.
    pub f1: f64,
    /// Searches made.
    pub searches: usize,
    /// Whether a retrieved passage contained a gold alias.
    pub answer_in_passages: bool,
    /// Why the episode ended.
    pub end_reason: Option<EndReason>,
    /// The prompt.
    pub prompt: String,
    /// The response transcript (policy text and observations).
    pub response: String,
    /// The steps (actions, queries, passages).
    pub steps: Vec<Step>,
}

impl QaRecord {
    /// Scores a finished episode for `example`.
    pub fn from_episode(dataset: &str, mode: &str, example: &QaExample, episode: &Episode) -> Self {
        let response = episode.trajectory.response_text();
        let o = trajectory_outcome(&episode.trajectory, &example.golden_answers);
        QaRecord {
            dataset: dataset.into(),
            mode: mode.into(),
            id: example.id.clone(),
            question: example.question.clone(),
            golden_answers: example.golden_answers.clone(),
            answer: o.answer,
            em: o.em,
            f1: o.f1,
            searches: episode.trajectory.searches().len(),
            answer_in_passages: answer_in_passages(&episode.trajectory, &example.golden_answers),
            end_reason: episode.end_reason().cloned(),
            prompt: episode.trajectory.prompt.clone(),
            response,
            steps: episode.trajectory.steps.clone(),
        }
    }
}

/// One row of the report table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Dataset name.
    pub dataset: String,
    /// Mode.
    pub mode: String,
    /// EM with its CI.
    pub em: Ci,
    /// Mean F1.
    pub f1: f64,
    /// Mean searches per question.
    pub mean_searches: f64,
    /// Share of questions with a gold alias in a retrieved passage.
    pub answer_in_passages: f64,
    /// Share of questions with an extracted answer.
    pub answered: f64,
}

/// Groups records by (dataset, mode) and summarises each group (EM CI: `resamples` bootstrap resamples at 95%,
/// seeded).
pub fn summarize(records: &[QaRecord], resamples: usize, seed: u64) -> Vec<Summary> {
    let mut groups: BTreeMap<(String, String), Vec<&QaRecord>> = BTreeMap::new();
    for r in records {
        groups
            .entry((r.dataset.clone(), r.mode.clone()))
            .or_default()
            .push(r);
    }
    groups
        .into_iter()
        .map(|((dataset, mode), rs)| {
            let n = rs.len() as f64;
            let em: Vec<f64> = rs.iter().map(|r| r.em).collect();
            Summary {
                em: bootstrap_ci(&em, resamples, 0.95, seed),
                f1: rs.iter().map(|r| r.f1).sum::<f64>() / n,
                mean_searches: rs.iter().map(|r| r.searches as f64).sum::<f64>() / n,
                answer_in_passages: rs.iter().filter(|r| r.answer_in_passages).count() as f64 / n,
                answered: rs.iter().filter(|r| r.answer.is_some()).count() as f64 / n,
                dataset,
                mode,
            }
        })
        .collect()
}

/// The summaries as a Markdown table (percentages).
pub fn markdown_table(summaries: &[Summary]) -> String {
    let mut s = String::from(
        "| dataset | mode | n | EM (95% CI) | F1 | searches/q | answer in passages | answered |\n\
         |---|---|---:|---|---:|---:|---:|---:|\n",
    );
    for r in summaries {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1} [{:.1}, {:.1}] | {:.1} | {:.2} | {:.1}% | {:.1}% |",
            r.dataset,
            r.mode,
            r.em.n,
            100.0 * r.em.mean,
            100.0 * r.em.lo,
            100.0 * r.em.hi,
            100.0 * r.f1,
            r.mean_searches,
            100.0 * r.answer_in_passages,
            100.0 * r.answered
        );
    }
    s
}

/// Files written by [`write_report`].
#[derive(Debug, Clone, PartialEq)]
pub struct ReportFiles {
    /// `report.md`: the table.
    pub markdown: PathBuf,
    /// `summary.json`: the summaries.
    pub summary: PathBuf,
    /// `transcripts.jsonl`: one [`QaRecord`] per line.
    pub transcripts: PathBuf,
}

/// Writes `report.md`, `summary.json` and `transcripts.jsonl` into `dir`.
pub fn write_report(
    dir: &Path,
    title: &str,
    records: &[QaRecord],
    resamples: usize,
    seed: u64,
) -> Result<(Vec<Summary>, ReportFiles), Error> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let summaries = summarize(records, resamples, seed);
    let files = ReportFiles {
        markdown: dir.join("report.md"),
        summary: dir.join("summary.json"),
        transcripts: dir.join("transcripts.jsonl"),
    };
    let md = format!(
        "# {title}\n\n{}\nEM: exact match after SQuAD normalisation of the last <answer> span, any alias; CI: \
         percentile bootstrap over questions ({resamples} resamples, seed {seed}).\n",
        markdown_table(&summaries)
    );
    std::fs::write(&files.markdown, md).map_err(|e| Error::io(&files.markdown, e))?;
    let js = serde_json::to_string_pretty(&summaries).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(&files.summary, js).map_err(|e| Error::io(&files.summary, e))?;
    let mut lines = String::new();
    for r in records {
        lines.push_str(&serde_json::to_string(r).map_err(|e| Error::Invalid(e.to_string()))?);
        lines.push('\n');
    }
    std::fs::write(&files.transcripts, lines).map_err(|e| Error::io(&files.transcripts, e))?;
    Ok((summaries, files))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_properties() {
        let ones = vec![1.0; 50];
        let c = bootstrap_ci(&ones, 500, 0.95, 0);
        assert_eq!((c.mean, c.lo, c.hi), (1.0, 1.0, 1.0));
        let v: Vec<f64> = (0..200)
            .map(|i| if i % 10 < 3 { 1.0 } else { 0.0 })
            .collect();
        let a = bootstrap_ci(&v, 2000, 0.95, 7);
        let b = bootstrap_ci(&v, 2000, 0.95, 7);
        assert_eq!(a, b, "seeded");
        assert!((a.mean - 0.3).abs() < 1e-12);
        assert!(a.lo < 0.3 && a.hi > 0.3);
        // Normal approximation: half-width 1.96 * sqrt(0.3 * 0.7 / 200) = 0.0635.
        let hw = (a.hi - a.lo) / 2.0;
        assert!((hw - 0.0635).abs() < 0.01, "half-width {hw}");
        let big: Vec<f64> = v.iter().cycle().take(2000).copied().collect();
        let c = bootstrap_ci(&big, 2000, 0.95, 7);
        assert!(c.hi - c.lo < (a.hi - a.lo) / 2.0);
        assert!(bootstrap_ci(&[], 10, 0.95, 0).mean.is_nan());
        let d = paired_bootstrap_diff(&v, &v, 100, 0.95, 0).unwrap();
        assert_eq!((d.mean, d.lo, d.hi), (0.0, 0.0, 0.0));
        assert!(paired_bootstrap_diff(&v, &[1.0], 100, 0.95, 0).is_err());
    }
}

/// How a question is answered in an evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EvalMode {
    /// No retrieval: one turn with [`crate::protocol::PromptTemplate::direct`].
    Direct,
    /// Retrieve once with the question, then one turn with [`crate::protocol::PromptTemplate::rag`].
    Rag,
    /// The multi-turn search agent ([`crate::protocol::PromptTemplate::search_r1`]).
    #[default]
    Agent,
}

impl std::str::FromStr for EvalMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "direct" => Ok(EvalMode::Direct),
            "rag" => Ok(EvalMode::Rag),
            "agent" => Ok(EvalMode::Agent),
            other => Err(Error::Invalid(format!(
                "unknown mode {other:?}; use direct, rag or agent"
            ))),
        }
    }
}

impl EvalMode {
    /// `direct`, `rag` or `agent`.
    pub fn name(self) -> &'static str {
        match self {
            EvalMode::Direct => "direct",
            EvalMode::Rag => "rag",
            EvalMode::Agent => "agent",
        }
    }

    /// A fresh episode for `question` with the prompt of this mode in `templates`. `rag_passages` (the top-k for the question) is required for
    /// [`EvalMode::Rag`] and ignored otherwise. Direct and RAG episodes have one turn, without search.
    pub fn episode(
        self,
        question: &str,
        rag_passages: Option<&[crate::protocol::Passage]>,
        protocol: &crate::protocol::ProtocolConfig,
        templates: &crate::protocol::PromptTemplates,
    ) -> Result<Episode, Error> {
        use crate::protocol::{ProtocolConfig, format_documents};
        let one_turn = ProtocolConfig {
            max_turns: 1,
            ..protocol.clone()
        };
        match self {
            EvalMode::Agent => Episode::for_question(&templates.agent, question, protocol.clone()),
            EvalMode::Direct => Episode::for_question(&templates.direct, question, one_turn),
            EvalMode::Rag => {
                let ps = rag_passages.ok_or_else(|| {
                    Error::Invalid("rag mode needs the passages retrieved for the question".into())
                })?;
                let prompt = templates
                    .rag
                    .render_with_context(question, &format_documents(ps));
                Episode::new(prompt, one_turn)
            }
        }
    }
}
