//! Cold-start demonstrations from real multi-hop questions (the recipe's `warm_start.real:`).
//!
//! Why: the synthetic world's passages are templated sentences, and a 135M actor cold-started on them
//! learns a lookup that does not carry over to Wikipedia prose: on HotpotQA most of its answers are a
//! substring of the question or of its own query, although the answer is in the retrieved passages for a
//! third of the questions (README, "Real data"). These demonstrations show the actor reading an answer out
//! of real passages, with the same protocol, chat framing and tokenization as the synthetic ones.
//!
//! How, for each training question (seeded shuffle, until `max_demos` are built):
//! 1. **Filter.** Take the first gold alias `a`; skip yes/no answers, answers of more than
//!    [`MAX_ANSWER_WORDS`] words and answers that occur in the question (the skill taught here is reading
//!    the passages, not copying from the question).
//! 2. **One search.** Search the question itself (top-k of the protocol). If the page of an entity the
//!    question names (its [`title_key`] occurs in the question) contains `a` (normalised as for exact match,
//!    on word boundaries), the demonstration is: search the question, then quote that page's sentence with
//!    `a` in `<think>` and answer `a`. (Without the page check many matches were coincidences: "American"
//!    in an unrelated biography for "What nationality is the director of film X?".)
//! 3. **Two searches** (`two_hop`). Otherwise take the names that the question's entity pages among the
//!    first results mention and the question does not ([`bridge_candidates`]: runs of capitalised words, at
//!    most [`MAX_BRIDGES`] per question) and search each; the first whose results hold `a` on the name's own
//!    page (title key = the name) gives: search the question, note the sentence that mentions the name and
//!    search the name, then quote the sentence with `a` and answer.
//! 4. **Replay.** The scripted turns run through the real rollout loop ([`run_episodes`]) against the same
//!    retriever, so observations are formatted and tokenized exactly as in training; a demonstration whose
//!    replayed search no longer shows `a` is dropped.
//!
//! RAG demonstrations (`rag_ratio` per agent demonstration) reuse one-search questions: the RAG template with
//! the question's top-k passages, answered the same way, so that `kiln eval --mode rag` asks the same
//! weights in a format they know on real text too.

use std::path::PathBuf;

use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::answer::normalize_answer;
use crate::data::QaExample;
use crate::protocol::{
    ANSWER_CLOSE, ANSWER_OPEN, Episode, Passage, PromptTemplates, ProtocolConfig, SEARCH_CLOSE,
    SEARCH_OPEN, THINK_CLOSE, THINK_OPEN, format_documents,
};
use crate::rollout::{OnSearchError, ScriptedPolicy, SearchBackend, run_episodes};

/// Answers longer than this many words are skipped (long spans are rarely quoted verbatim).
pub const MAX_ANSWER_WORDS: usize = 8;

/// Words of context kept on each side of the answer when its sentence is long.
const QUOTE_WORDS: usize = 20;

/// Bridge names searched per question at most (two-search demonstrations).
pub const MAX_BRIDGES: usize = 6;

/// Questions searched per batch while scanning.
const SCAN_CHUNK: usize = 256;

/// Settings of the real-data demonstrations (`warm_start.real`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RealDemosConfig {
    /// Training questions: a QA JSONL file or a dataset name under `datasets_root` (e.g.
    /// `multihop/train_questions_8k.jsonl`). Never an evaluation split.
    pub questions: String,
    /// The retriever the scripted searches run on: a `kiln index` folder (BM25), `dense:DIR`, `hybrid:DIR`
    /// or a server URL; the index the real-data evaluation uses.
    pub index: PathBuf,
    /// Agent demonstrations to build (fewer when the questions run out). Default 200.
    pub max_demos: usize,
    /// RAG demonstrations per agent demonstration. Default 0.15.
    pub rag_ratio: f64,
    /// Also build two-search demonstrations (search a name the question's entity page mentions when the
    /// question's own results miss the answer). Default true.
    pub two_hop: bool,
    /// Demonstrations longer than this many tokens (prompt included) are left out: the supervised step's
    /// memory grows with the square of the longest row (attention kept for the backward pass). Default
    /// 1024.
    pub max_tokens: usize,
}

impl Default for RealDemosConfig {
    fn default() -> Self {
        RealDemosConfig {
            questions: String::new(),
            index: PathBuf::new(),
            max_demos: 200,
            rag_ratio: 0.15,
            two_hop: true,
            max_tokens: 1024,
        }
    }
}

/// What the scan found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RealDemoStats {
    /// Questions looked at.
    pub scanned: usize,
    /// Skipped: yes/no, long or empty answers.
    pub skipped_answer: usize,
    /// Skipped: the answer occurs in the question.
    pub skipped_in_question: usize,
    /// Skipped: no scripted search found a passage with the answer.
    pub no_evidence: usize,
    /// One-search demonstrations kept.
    pub one_search: usize,
    /// Two-search demonstrations kept.
    pub two_search: usize,
    /// Dropped after the replay (the replayed search did not show the answer).
    pub dropped_on_replay: usize,
    /// Left out after tokenization: longer than `max_tokens` (agent and RAG demonstrations).
    #[serde(default)]
    pub too_long: usize,
    /// The policy turns and searches of the first few demonstrations of each kind, for inspection.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub samples: Vec<String>,
}

/// Demonstrations of each kind kept in [`RealDemoStats::samples`].
const SAMPLES_PER_KIND: usize = 3;

/// The question, the policy turns and the queries' first passage titles of `ep`, as one line each.
fn sample_text(question: &str, ep: &Episode) -> String {
    let mut s = format!("Q: {question}");
    for st in &ep.trajectory.steps {
        s.push_str(&format!("\n> {}", one_line(&st.policy.text)));
        if let Some(call) = &st.search {
            let titles: Vec<&str> = call.passages.iter().map(|p| p.title.as_str()).collect();
            s.push_str(&format!("\n  [retrieved: {}]", titles.join(" | ")));
        }
    }
    s
}

/// The demonstrations: finished agent episodes (text; tokenize like the synthetic ones) and RAG
/// `(prompt, target)` pairs.
#[derive(Debug, Clone, Default)]
pub struct RealDemos {
    /// Agent episodes.
    pub episodes: Vec<Episode>,
    /// RAG prompt and target texts.
    pub rag: Vec<(String, String)>,
    /// Counters.
    pub stats: RealDemoStats,
}

/// `haystack` (normalised) contains `needle` (normalised, non-empty) on word boundaries.
fn contains_words(haystack_norm: &str, needle_norm: &str) -> bool {
    !needle_norm.is_empty() && format!(" {haystack_norm} ").contains(&format!(" {needle_norm} "))
}

fn passage_has(p: &Passage, answer_norm: &str) -> bool {
    contains_words(&normalize_answer(&p.text), answer_norm)
}

/// The sentence of `text` that contains the answer (the first), cut to [`QUOTE_WORDS`] words on each side
/// of it when long; `None` when no sentence contains it.
pub fn evidence_sentence(text: &str, answer_norm: &str) -> Option<String> {
    let sentences = split_sentences(text);
    let s = sentences
        .iter()
        .find(|s| contains_words(&normalize_answer(s), answer_norm))?;
    let words: Vec<&str> = s.split_whitespace().collect();
    let n_ans = answer_norm.split_whitespace().count().max(1);
    if words.len() <= 2 * QUOTE_WORDS + n_ans {
        return Some(words.join(" "));
    }
    // Where the answer starts: the first window of its length (else a little longer: punctuation or an
    // article may split or pad it) whose normalised text holds it.
    let window_at = |extra: usize| {
        (0..words.len()).find(|&i| {
            let end = (i + n_ans + extra).min(words.len());
            contains_words(&normalize_answer(&words[i..end].join(" ")), answer_norm)
        })
    };
    let at = window_at(0).or_else(|| window_at(2)).unwrap_or(0);
    let lo = at.saturating_sub(QUOTE_WORDS);
    let hi = (at + n_ans + QUOTE_WORDS).min(words.len());
    Some(words[lo..hi].join(" "))
}

/// Splits on `. `, `! `, `? ` and newlines (enough for quoting; abbreviations may split a sentence early).
fn split_sentences(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\n' {
            if !cur.trim().is_empty() {
                out.push(cur.trim().to_string());
            }
            cur.clear();
            continue;
        }
        cur.push(c);
        if matches!(c, '.' | '!' | '?') && chars.peek().is_none_or(|n| n.is_whitespace()) {
            out.push(cur.trim().to_string());
            cur.clear();
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn search_turn(think: &str, query: &str) -> String {
    format!(
        "{THINK_OPEN}{think}{THINK_CLOSE}\n{SEARCH_OPEN} {} {SEARCH_CLOSE}",
        one_line(query)
    )
}

fn answer_turn(evidence: &str, answer: &str) -> String {
    format!(
        "{THINK_OPEN}{}{THINK_CLOSE}\n{ANSWER_OPEN} {} {ANSWER_CLOSE}",
        one_line(evidence),
        one_line(answer)
    )
}

/// Lower-case words that may sit inside a name ("Bank of England", "Leonardo da Vinci").
const NAME_CONNECTORS: &[&str] = &[
    "of", "the", "de", "da", "del", "von", "van", "and", "la", "le",
];

/// Capitalised words that open sentences rather than names.
const NOT_NAMES: &[&str] = &[
    "The",
    "A",
    "An",
    "It",
    "He",
    "She",
    "They",
    "His",
    "Her",
    "Its",
    "Their",
    "In",
    "On",
    "At",
    "As",
    "After",
    "Before",
    "During",
    "This",
    "That",
    "These",
    "Those",
    "There",
    "When",
    "While",
    "Although",
    "However",
    "From",
    "For",
    "With",
    "By",
    "Since",
    "Following",
    "Born",
    "Also",
    "But",
    "And",
    "Of",
    "What",
    "Which",
    "Who",
    "Whom",
    "Whose",
    "Where",
    "How",
    "Why",
    "Is",
    "Are",
    "Was",
    "Were",
    "Did",
    "Do",
    "Does",
    "In",
    "Name",
];

/// The names in one sentence, in order: maximal runs of capitalised words (lower-case connectors such as
/// "of" inside; a run ends at a word ending in punctuation), without a sentence-opening word of
/// [`NOT_NAMES`] or a lone capitalised first word, and at least 4 letters long.
pub fn names_in(sentence: &str) -> Vec<String> {
    let clean = |w: &str| w.trim_matches(|c: char| !c.is_alphanumeric()).to_string();
    let cap = |w: &str| clean(w).chars().next().is_some_and(char::is_uppercase);
    let words: Vec<&str> = sentence.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        if !cap(words[i]) {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        let mut end = i + 1;
        while j < words.len() {
            if words[j - 1].ends_with(|c: char| !c.is_alphanumeric()) {
                break;
            }
            if cap(words[j]) {
                j += 1;
                end = j;
            } else if NAME_CONNECTORS.contains(&words[j])
                && words.get(j + 1).is_some_and(|w| cap(w))
            {
                j += 1;
            } else {
                break;
            }
        }
        let mut run: Vec<String> = words[i..end].iter().map(|w| clean(w)).collect();
        // A sentence's first word is capitalised anyway: keep it only inside a longer run.
        if NOT_NAMES.contains(&run[0].as_str()) || (i == 0 && run.len() == 1) {
            run.remove(0);
        }
        i = end;
        let name = run.join(" ");
        if name.chars().filter(|c| c.is_alphabetic()).count() >= 4 {
            out.push(name);
        }
    }
    out
}

/// A passage's title as an entity key: normalised, without a trailing parenthesis (`"X (1948 film)"` ->
/// `"x"`).
pub fn title_key(title: &str) -> String {
    let t = match title.find(" (") {
        Some(i) if title.trim_end().ends_with(')') => &title[..i],
        _ => title,
    };
    normalize_answer(t)
}

/// `p` is the page of an entity the question names: its title key occurs in the question (normalised).
fn about_question(p: &Passage, question_norm: &str) -> bool {
    contains_words(question_norm, &title_key(&p.title))
}

/// Names the passages mention that the question (normalised: `question_norm`) does not, in order of
/// appearance, with the sentence that mentions each (cut like [`evidence_sentence`]); only the pages of
/// entities the question names count ([`title_key`] in the question: an unrelated result's names are not
/// a bridge). At most [`MAX_BRIDGES`], each once.
pub fn bridge_candidates(passages: &[Passage], question_norm: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for p in passages.iter().filter(|p| about_question(p, question_norm)) {
        for sentence in split_sentences(&p.text) {
            for name in names_in(&sentence) {
                let norm = normalize_answer(&name);
                if norm.is_empty()
                    || contains_words(question_norm, &norm)
                    || !seen.insert(norm.clone())
                {
                    continue;
                }
                let note = evidence_sentence(&sentence, &norm).unwrap_or_else(|| sentence.clone());
                out.push((name, note));
                if out.len() >= MAX_BRIDGES {
                    return out;
                }
            }
        }
    }
    out
}

/// A planned demonstration: question index, scripted turns, the answer (normalised) the last observation
/// must show, and the question's own top-k (for RAG).
struct Plan {
    question: usize,
    turns: Vec<String>,
    answer_norm: String,
    first: Vec<Passage>,
}

/// Builds up to `cfg.max_demos` agent demonstrations (and the RAG ones) from `questions` (see the module
/// docs). `search` is the real retriever; `rng` orders the questions.
pub fn build_real_demos(
    questions: &[QaExample],
    cfg: &RealDemosConfig,
    templates: &PromptTemplates,
    protocol: &ProtocolConfig,
    search: &dyn SearchBackend,
    rng: &mut ChaCha8Rng,
) -> Result<RealDemos, Error> {
    let k = protocol.top_k.max(1);
    if cfg.two_hop && protocol.max_turns < 3 {
        return Err(Error::Invalid(format!(
            "warm_start.real.two_hop needs protocol.max_turns >= 3 (search, search, answer), got {}",
            protocol.max_turns
        )));
    }
    let mut order: Vec<usize> = (0..questions.len()).collect();
    order.shuffle(rng);
    let mut stats = RealDemoStats::default();
    let mut plans: Vec<Plan> = Vec::new();
    for chunk in order.chunks(SCAN_CHUNK) {
        if plans.len() >= cfg.max_demos {
            break;
        }
        // 1. Filter.
        let mut todo: Vec<(usize, String)> = Vec::new();
        for &i in chunk {
            stats.scanned += 1;
            let q = &questions[i];
            let a = q.golden_answers.first().map(String::as_str).unwrap_or("");
            let an = normalize_answer(a);
            let words = an.split_whitespace().count();
            if an.is_empty() || an == "yes" || an == "no" || words > MAX_ANSWER_WORDS {
                stats.skipped_answer += 1;
                continue;
            }
            if contains_words(&normalize_answer(&q.question), &an) {
                stats.skipped_in_question += 1;
                continue;
            }
            todo.push((i, an));
        }
        if todo.is_empty() {
            continue;
        }
        // 2. One search: the question itself.
        let qs: Vec<String> = todo
            .iter()
            .map(|(i, _)| one_line(&questions[*i].question))
            .collect();
        let firsts = search.search_batch(&qs, k)?;
        let mut second: Vec<(usize, String, Vec<Passage>)> = Vec::new();
        for ((i, an), mut ps) in todo.into_iter().zip(firsts) {
            ps.truncate(k);
            let q = &questions[i];
            let a = &q.golden_answers[0];
            let qn = normalize_answer(&q.question);
            // The evidence must sit on the page of an entity the question names: "American" in an
            // unrelated biography is a coincidence, not a reading.
            if let Some(ev) = ps
                .iter()
                .filter(|p| about_question(p, &qn))
                .find_map(|p| evidence_sentence(&p.text, &an))
            {
                plans.push(Plan {
                    question: i,
                    turns: vec![
                        search_turn(
                            "I need to search for the answer to this question.",
                            &q.question,
                        ),
                        answer_turn(&ev, a),
                    ],
                    answer_norm: an,
                    first: ps,
                });
            } else if cfg.two_hop {
                second.push((i, an, ps));
            } else {
                stats.no_evidence += 1;
            }
        }
        // 3. Two searches: a name the first results mention and the question does not.
        if !second.is_empty() {
            let mut queries = Vec::new();
            let mut owner = Vec::new();
            for (s, (i, _, ps)) in second.iter().enumerate() {
                let q = &questions[*i].question;
                for (name, note) in bridge_candidates(ps, &normalize_answer(q)) {
                    queries.push(name.clone());
                    owner.push((s, name, note));
                }
            }
            let results = search.search_batch(&queries, k)?;
            let mut done = vec![false; second.len()];
            for ((s, name, note), mut ps2) in owner.into_iter().zip(results) {
                if done[s] {
                    continue;
                }
                ps2.truncate(k);
                let (i, an, ps) = &second[s];
                // The evidence must sit on the bridge entity's own page.
                let bridge = normalize_answer(&name);
                let Some(ev) = ps2
                    .iter()
                    .filter(|p| title_key(&p.title) == bridge)
                    .find_map(|p| evidence_sentence(&p.text, an))
                else {
                    continue;
                };
                done[s] = true;
                let q = &questions[*i];
                let note = format!("{note} Now I need to look up {name}.");
                plans.push(Plan {
                    question: *i,
                    turns: vec![
                        search_turn(
                            "I need to search for the answer to this question.",
                            &q.question,
                        ),
                        search_turn(&note, &name),
                        answer_turn(&ev, &q.golden_answers[0]),
                    ],
                    answer_norm: an.clone(),
                    first: ps.clone(),
                });
            }
            stats.no_evidence += done.iter().filter(|d| !**d).count();
        }
    }
    plans.truncate(cfg.max_demos);
    // 4. Replay through the rollout loop.
    let mut eps = plans
        .iter()
        .map(|p| {
            Episode::for_question(
                &templates.agent,
                &questions[p.question].question,
                protocol.clone(),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut policy = ScriptedPolicy::new(plans.iter().map(|p| p.turns.clone()).collect());
    run_episodes(&mut eps, &mut policy, search, OnSearchError::EndEpisode)?;
    let mut out = RealDemos::default();
    let n_rag = (cfg.max_demos as f64 * cfg.rag_ratio).round() as usize;
    for (p, ep) in plans.iter().zip(eps) {
        let searches = ep.trajectory.searches();
        let shows = searches
            .last()
            .is_some_and(|s| s.passages.iter().any(|x| passage_has(x, &p.answer_norm)));
        if ep.trajectory.final_answer().is_none() || searches.len() + 1 != p.turns.len() || !shows {
            stats.dropped_on_replay += 1;
            continue;
        }
        let kind_count = if searches.len() == 1 {
            stats.one_search
        } else {
            stats.two_search
        };
        if kind_count < SAMPLES_PER_KIND {
            stats
                .samples
                .push(sample_text(&questions[p.question].question, &ep));
        }
        if searches.len() == 1 {
            stats.one_search += 1;
            if out.rag.len() < n_rag {
                let q = &questions[p.question];
                out.rag.push((
                    templates
                        .rag
                        .render_with_context(&q.question, &format_documents(&p.first)),
                    p.turns[p.turns.len() - 1].clone(),
                ));
            }
        } else {
            stats.two_search += 1;
        }
        out.episodes.push(ep);
    }
    out.stats = stats;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evidence_is_the_sentence_with_the_answer() {
        let text =
            "Alpha Beta was born in 1901. He moved to Paris, France in 1920. He died in Rome.";
        assert_eq!(
            evidence_sentence(text, &normalize_answer("Paris")).as_deref(),
            Some("He moved to Paris, France in 1920.")
        );
        // Word boundaries: "Rome" must not match "Romeo".
        assert_eq!(evidence_sentence("Romeo left.", "rome"), None);
        assert_eq!(evidence_sentence(text, "london"), None);
    }

    #[test]
    fn long_sentences_are_cut_around_the_answer() {
        let mut words: Vec<String> = (0..100).map(|i| format!("w{i}")).collect();
        words[70] = "Zanzibar".into();
        let s = evidence_sentence(&words.join(" "), "zanzibar").unwrap();
        let n = s.split_whitespace().count();
        assert!(n <= 2 * QUOTE_WORDS + 1, "{n}: {s}");
        assert!(
            s.contains("Zanzibar") && s.starts_with("w50") && s.ends_with("w90"),
            "{s}"
        );
    }

    #[test]
    fn bridges_are_names_the_question_lacks() {
        let p = Passage {
            id: "x".into(),
            title: "Quillon Bridge".into(),
            text: "Quillon Bridge crosses the River Sarn. It was designed by Maret Hollis of the Bank of \
                   England, in 1890. The bridge is old."
                .into(),
            score: 0.0,
        };
        let q = normalize_answer("Who designed Quillon Bridge?");
        let names: Vec<String> = bridge_candidates(std::slice::from_ref(&p), &q)
            .into_iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(names, vec!["River Sarn", "Maret Hollis", "Bank of England"]);
        // The page of an entity the question does not name gives no bridge.
        assert!(
            bridge_candidates(&[p], &normalize_answer("Who founded Velmora Abbey?")).is_empty()
        );
    }

    #[test]
    fn title_keys_drop_the_disambiguation() {
        assert_eq!(
            title_key("The Barber of Seville (1948 film)"),
            "barber of seville"
        );
        assert_eq!(title_key("Clement Virgo"), "clement virgo");
        assert_eq!(title_key("Area (m2)x"), "area m2x");
    }

    #[test]
    fn sentences_split_on_stops_and_newlines() {
        assert_eq!(
            split_sentences("A b. C d?\nE 3.5 f"),
            vec!["A b.", "C d?", "E 3.5 f"]
        );
    }
}
