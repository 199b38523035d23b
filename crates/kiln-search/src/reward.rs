//! The hybrid reward of Search-R2 (METHODS, Search-R2 "Reward", its "Total"): the outcome exact match
//! gated by the answer, boosted by the process reward of the searches, `R = EM * (1 + r_process)`
//! ([`score`]); plus outcome EM / F1 and the process judges it is built from.
//!
//! - Outcome: the LAST `<answer>` span of the response ([`crate::answer::extract_answer`]) against any gold alias
//!   after normalisation; no answer scores 0. For a trajectory only policy segments are searched
//!   ([`trajectory_answer`]): the invalid-action observation itself mentions `<answer> and </answer>`.
//! - Process: `r_process = (1/M) * sum_i u_i` over the M searches of the trajectory (M = 0 gives 0). `u_i` comes
//!   from a [`ProcessJudge`]. The built-in [`DeterministicJudge`] sets `u_i = 1` iff search i returned at least
//!   one passage that is *helpful* and *new*:
//!   - helpful: it contains a gold alias (normalised, on word boundaries, in title or text), or its id is a gold
//!     supporting passage id, or (optionally) its normalised title is a gold supporting title;
//!   - new: no earlier search of the same trajectory returned it (same id; same title and text when ids are
//!     empty).
//!
//!   An LLM judge plugs in through the same trait; [`judge_prompt`] and [`parse_judge_verdict`] give it a
//!   prompt and a parser.
//! - Total (the hybrid reward, [`score`]): `R = EM * (1 + r_process)` when the process reward is on, else
//!   `R = EM` (Search-R1). Every component is reported separately in [`RewardBreakdown`].

use std::collections::{BTreeMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::answer::{em_any, extract_answer, f1_any, normalize_answer};
use crate::protocol::{Passage, SearchCall, Trajectory};

/// What is known to be right for a question.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Gold {
    /// Gold answer aliases.
    pub answers: Vec<String>,
    /// Ids of the corpus passages that support the answer (may be empty).
    #[serde(default)]
    pub supporting_passage_ids: Vec<String>,
    /// Titles of the supporting passages (may be empty).
    #[serde(default)]
    pub supporting_titles: Vec<String>,
}

/// Outcome of a response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The extracted answer (last `<answer>` span), if any.
    pub answer: Option<String>,
    /// Exact match (0 or 1).
    pub em: f64,
    /// Token F1.
    pub f1: f64,
}

/// EM and F1 of the last `<answer>` span of `response` against any alias.
pub fn outcome<S: AsRef<str>>(response: &str, golds: &[S]) -> Outcome {
    match extract_answer(response) {
        None => Outcome {
            answer: None,
            em: 0.0,
            f1: 0.0,
        },
        Some(a) => Outcome {
            answer: Some(a.to_string()),
            em: em_any(a, golds),
            f1: f1_any(a, golds),
        },
    }
}

/// The answer of a trajectory: the last `<answer>` span of its policy segments. Observations are skipped, so
/// the `<answer> and </answer>` of the invalid-action message or a tag inside a retrieved passage never counts
/// as the policy's answer.
pub fn trajectory_answer(trajectory: &Trajectory) -> Option<&str> {
    trajectory
        .steps
        .iter()
        .rev()
        .find_map(|s| extract_answer(&s.policy.text))
}

/// EM and F1 of a trajectory's answer ([`trajectory_answer`]) against any alias.
pub fn trajectory_outcome<S: AsRef<str>>(trajectory: &Trajectory, golds: &[S]) -> Outcome {
    match trajectory_answer(trajectory) {
        None => Outcome {
            answer: None,
            em: 0.0,
            f1: 0.0,
        },
        Some(a) => Outcome {
            answer: Some(a.to_string()),
            em: em_any(a, golds),
            f1: f1_any(a, golds),
        },
    }
}

/// Scores the usefulness of each search of a trajectory, `u_i in [0, 1]`.
pub trait ProcessJudge {
    /// One score per element of `searches`, in order.
    fn judge(
        &mut self,
        question: &str,
        gold: &Gold,
        searches: &[&SearchCall],
    ) -> Result<Vec<f64>, Error>;
}

/// Whether normalised `hay` contains normalised `needle` on word boundaries (both already normalised).
fn contains_words(hay: &str, needle: &str) -> bool {
    if needle.is_empty() {
        return false;
    }
    let mut pos = 0;
    while let Some(i) = hay[pos..].find(needle) {
        let s = pos + i;
        let e = s + needle.len();
        let left_ok = s == 0 || hay.as_bytes()[s - 1] == b' ';
        let right_ok = e == hay.len() || hay.as_bytes()[e] == b' ';
        if left_ok && right_ok {
            return true;
        }
        pos = s + hay[s..].chars().next().map_or(1, char::len_utf8);
    }
    false
}

/// Whether any gold alias occurs in the passage (normalised, word boundaries, title or text).
pub fn passage_contains_answer<S: AsRef<str>>(p: &Passage, golds: &[S]) -> bool {
    let hay = normalize_answer(&format!("{} {}", p.title, p.text));
    golds
        .iter()
        .any(|g| contains_words(&hay, &normalize_answer(g.as_ref())))
}

/// Whether any passage of any search of the trajectory contains a gold alias (the "answer in retrieved
/// passages" rate of an evaluation).
pub fn answer_in_passages<S: AsRef<str>>(trajectory: &Trajectory, golds: &[S]) -> bool {
    trajectory
        .searches()
        .iter()
        .any(|s| s.passages.iter().any(|p| passage_contains_answer(p, golds)))
}

/// The deterministic process judge (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DeterministicJudge {
    /// Count a passage whose title is a gold supporting title as helpful (default true).
    pub use_titles: bool,
}

impl Default for DeterministicJudge {
    fn default() -> Self {
        DeterministicJudge { use_titles: true }
    }
}

fn passage_key(p: &Passage) -> String {
    if p.id.is_empty() {
        format!("\u{0}{}\u{0}{}", p.title, p.text)
    } else {
        p.id.clone()
    }
}

impl DeterministicJudge {
    /// Whether a passage helps identify the gold answer.
    pub fn helpful(&self, p: &Passage, gold: &Gold) -> bool {
        if !p.id.is_empty() && gold.supporting_passage_ids.contains(&p.id) {
            return true;
        }
        if self.use_titles && !gold.supporting_titles.is_empty() {
            let t = normalize_answer(&p.title);
            if !t.is_empty()
                && gold
                    .supporting_titles
                    .iter()
                    .any(|g| normalize_answer(g) == t)
            {
                return true;
            }
        }
        passage_contains_answer(p, &gold.answers)
    }
}

impl ProcessJudge for DeterministicJudge {
    fn judge(
        &mut self,
        _question: &str,
        gold: &Gold,
        searches: &[&SearchCall],
    ) -> Result<Vec<f64>, Error> {
        let mut seen: HashSet<String> = HashSet::new();
        let mut out = Vec::with_capacity(searches.len());
        for s in searches {
            let useful = s
                .passages
                .iter()
                .any(|p| !seen.contains(&passage_key(p)) && self.helpful(p, gold));
            out.push(if useful { 1.0 } else { 0.0 });
            seen.extend(s.passages.iter().map(passage_key));
        }
        Ok(out)
    }
}

/// A prompt asking an LLM judge whether one search helped (answer with "yes" or "no").
pub fn judge_prompt(
    question: &str,
    gold: &Gold,
    search: &SearchCall,
    earlier: &[&SearchCall],
) -> String {
    let mut s = String::from(
        "You judge one search step of an agent answering a question. Say whether the passages returned by this \
         search contain information that helps identify the correct answer and that the earlier searches did not \
         already return. Reply with yes or no.\n\n",
    );
    s.push_str(&format!(
        "Question: {}\nCorrect answer: {}\n",
        question.trim(),
        gold.answers.join(" | ")
    ));
    if !earlier.is_empty() {
        s.push_str("Passages returned earlier:\n");
        for e in earlier {
            s.push_str(&crate::protocol::format_documents(&e.passages));
            s.push('\n');
        }
    }
    s.push_str(&format!(
        "This search: {}\nPassages returned:\n{}\nHelpful and new (yes/no):",
        search.query,
        crate::protocol::format_documents(&search.passages)
    ));
    s
}

/// Parses an LLM judge's reply: `Some(true)` for yes, `Some(false)` for no, `None` otherwise.
pub fn parse_judge_verdict(text: &str) -> Option<bool> {
    let w: String = text
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphabetic())
        .collect::<String>()
        .to_lowercase();
    match w.as_str() {
        "yes" => Some(true),
        "no" => Some(false),
        _ => None,
    }
}

/// Reward settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RewardConfig {
    /// Add the process reward: `R = EM * (1 + r_process)` (off: `R = EM`, Search-R1).
    pub process: bool,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig { process: true }
    }
}

/// Every reward component of one trajectory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardBreakdown {
    /// Extracted answer.
    pub answer: Option<String>,
    /// Exact match (0/1).
    pub em: f64,
    /// Token F1.
    pub f1: f64,
    /// Number of searches M.
    pub searches: usize,
    /// Per-search usefulness `u_i`.
    pub useful: Vec<f64>,
    /// `(1/M) sum u_i` (0 when M = 0).
    pub r_process: f64,
    /// The training reward.
    pub total: f64,
}

/// Scores a trajectory.
pub fn score(
    trajectory: &Trajectory,
    question: &str,
    gold: &Gold,
    config: &RewardConfig,
    judge: &mut dyn ProcessJudge,
) -> Result<RewardBreakdown, Error> {
    let o = trajectory_outcome(trajectory, &gold.answers);
    let searches = trajectory.searches();
    let m = searches.len();
    let useful = if m == 0 {
        Vec::new()
    } else {
        let u = judge.judge(question, gold, &searches)?;
        if u.len() != m {
            return Err(Error::Invalid(format!(
                "process judge returned {} scores for {m} searches",
                u.len()
            )));
        }
        u.into_iter()
            .map(|x| {
                if x.is_finite() {
                    x.clamp(0.0, 1.0)
                } else {
                    0.0
                }
            })
            .collect()
    };
    let r_process = if m == 0 {
        0.0
    } else {
        useful.iter().sum::<f64>() / m as f64
    };
    let total = if config.process {
        o.em * (1.0 + r_process)
    } else {
        o.em
    };
    Ok(RewardBreakdown {
        answer: o.answer,
        em: o.em,
        f1: o.f1,
        searches: m,
        useful,
        r_process,
        total,
    })
}

/// Batch means of the reward components.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardStats {
    n: usize,
    em: f64,
    f1: f64,
    r_process: f64,
    total: f64,
    searches: f64,
    answered: f64,
}

impl RewardStats {
    /// Adds one trajectory.
    pub fn add(&mut self, r: &RewardBreakdown) {
        self.n += 1;
        self.em += r.em;
        self.f1 += r.f1;
        self.r_process += r.r_process;
        self.total += r.total;
        self.searches += r.searches as f64;
        self.answered += f64::from(u8::from(r.answer.is_some()));
    }

    /// `reward/em`, `reward/f1`, `reward/process`, `reward/total`, `reward/searches`, `reward/answered` (means).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        if self.n == 0 {
            return BTreeMap::new();
        }
        let n = self.n as f64;
        BTreeMap::from([
            ("reward/em".into(), self.em / n),
            ("reward/f1".into(), self.f1 / n),
            ("reward/process".into(), self.r_process / n),
            ("reward/total".into(), self.total / n),
            ("reward/searches".into(), self.searches / n),
            ("reward/answered".into(), self.answered / n),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Action, Segment, Step};

    fn p(id: &str, title: &str, text: &str) -> Passage {
        Passage {
            id: id.into(),
            title: title.into(),
            text: text.into(),
            score: 0.0,
        }
    }

    fn traj(searches: Vec<Vec<Passage>>, answer: Option<&str>) -> Trajectory {
        let mut t = Trajectory::new("P");
        for (i, ps) in searches.into_iter().enumerate() {
            t.steps.push(Step {
                policy: Segment::policy(format!("<search>q{i}</search>")),
                action: Action::Search(format!("q{i}")),
                search: Some(SearchCall {
                    query: format!("q{i}"),
                    passages: ps,
                }),
                observation: Some(Segment::observation("\n\n<information></information>\n\n")),
            });
        }
        if let Some(a) = answer {
            t.steps.push(Step {
                policy: Segment::policy(format!("<answer>{a}</answer>")),
                action: Action::Answer(a.into()),
                search: None,
                observation: None,
            });
        }
        t
    }

    fn gold() -> Gold {
        Gold {
            answers: vec!["Velno".into(), "Velno City".into()],
            supporting_passage_ids: vec!["s1".into()],
            supporting_titles: vec!["Tom Brant".into()],
        }
    }

    #[test]
    fn word_boundary_containment() {
        assert!(contains_words("born in velno in 1990", "velno"));
        assert!(!contains_words("born in velnoria", "velno"));
        assert!(!contains_words("1990s", "1990"));
        assert!(contains_words("1990", "1990"));
        assert!(!contains_words("abc", ""));
        assert!(contains_words("é velno", "velno"));
    }

    #[test]
    fn process_reward_components() {
        let mut j = DeterministicJudge::default();
        let cfg = RewardConfig::default();
        // search 1: supporting id (no answer string) -> useful
        // search 2: contains the answer -> useful
        // search 3: same answer passage again -> duplicate, not useful
        // search 4: irrelevant -> not useful
        let t = traj(
            vec![
                vec![p("s1", "Acme", "Acme was founded by Tom Brant.")],
                vec![
                    p("x", "Other", "nothing"),
                    p("s2", "T", "Tom Brant was born in Velno."),
                ],
                vec![p("s2", "T", "Tom Brant was born in Velno.")],
                vec![p("z", "Z", "zzz")],
            ],
            Some("the velno"),
        );
        let r = score(&t, "q", &gold(), &cfg, &mut j).unwrap();
        assert_eq!(r.useful, [1.0, 1.0, 0.0, 0.0]);
        assert_eq!(r.searches, 4);
        assert_eq!(r.r_process, 0.5);
        assert_eq!(r.em, 1.0);
        assert_eq!(r.total, 1.5);
        assert_eq!(r.answer.as_deref(), Some("the velno"));
        // Search-R1: outcome only.
        let r1 = score(&t, "q", &gold(), &RewardConfig { process: false }, &mut j).unwrap();
        assert_eq!(r1.total, 1.0);
        assert_eq!(r1.r_process, 0.5, "still reported");
        // Wrong answer: process reward does not count.
        let t2 = traj(vec![vec![p("s1", "Acme", "x")]], Some("Paris"));
        let r2 = score(&t2, "q", &gold(), &cfg, &mut j).unwrap();
        assert_eq!((r2.em, r2.r_process, r2.total), (0.0, 1.0, 0.0));
        // M = 0 -> r_process = 0.
        let r3 = score(&traj(vec![], Some("Velno")), "q", &gold(), &cfg, &mut j).unwrap();
        assert_eq!((r3.searches, r3.r_process, r3.total), (0, 0.0, 1.0));
        // No answer at all.
        let r4 = score(&traj(vec![], None), "q", &gold(), &cfg, &mut j).unwrap();
        assert_eq!(
            (r4.answer.clone(), r4.em, r4.f1, r4.total),
            (None, 0.0, 0.0, 0.0)
        );
        // Supporting title counts; without titles it does not.
        let t5 = traj(
            vec![vec![p("", "Tom  Brant", "no answer here")]],
            Some("Velno"),
        );
        assert_eq!(
            score(&t5, "q", &gold(), &cfg, &mut j).unwrap().useful,
            [1.0]
        );
        let mut nj = DeterministicJudge { use_titles: false };
        assert_eq!(
            score(&t5, "q", &gold(), &cfg, &mut nj).unwrap().useful,
            [0.0]
        );
        // Passages without ids are deduplicated by content.
        let t6 = traj(
            vec![vec![p("", "A", "Velno")], vec![p("", "A", "Velno")]],
            Some("Velno"),
        );
        assert_eq!(
            score(&t6, "q", &gold(), &cfg, &mut j).unwrap().useful,
            [1.0, 0.0]
        );
    }

    #[test]
    fn observations_never_provide_the_answer() {
        let mut t = Trajectory::new("P");
        t.steps.push(Step {
            policy: Segment::policy("no action"),
            action: Action::Invalid,
            search: None,
            observation: Some(Segment::observation(
                crate::protocol::INVALID_ACTION_OBSERVATION,
            )),
        });
        assert_eq!(extract_answer(&t.response_text()), Some("and"));
        assert_eq!(trajectory_answer(&t), None);
        let r = score(
            &t,
            "q",
            &gold(),
            &RewardConfig::default(),
            &mut DeterministicJudge::default(),
        )
        .unwrap();
        assert_eq!((r.answer, r.em), (None, 0.0));
        // A span in an earlier policy turn still counts when the last turn has none.
        let mut t2 = traj(vec![], Some("Velno"));
        t2.steps.push(Step {
            policy: Segment::policy("trailing"),
            action: Action::Invalid,
            search: None,
            observation: None,
        });
        assert_eq!(trajectory_answer(&t2), Some("Velno"));
    }

    struct BadJudge(Vec<f64>);
    impl ProcessJudge for BadJudge {
        fn judge(&mut self, _: &str, _: &Gold, _: &[&SearchCall]) -> Result<Vec<f64>, Error> {
            Ok(self.0.clone())
        }
    }

    #[test]
    fn pluggable_judge_is_sanitised() {
        let t = traj(vec![vec![], vec![]], Some("Velno"));
        let cfg = RewardConfig::default();
        let r = score(&t, "q", &gold(), &cfg, &mut BadJudge(vec![f64::NAN, 7.0])).unwrap();
        assert_eq!(r.useful, [0.0, 1.0]);
        assert!(score(&t, "q", &gold(), &cfg, &mut BadJudge(vec![1.0])).is_err());
        assert_eq!(parse_judge_verdict(" Yes."), Some(true));
        assert_eq!(parse_judge_verdict("no"), Some(false));
        assert_eq!(parse_judge_verdict("maybe"), None);
        let s = SearchCall {
            query: "q".into(),
            passages: vec![p("1", "T", "x")],
        };
        let prompt = judge_prompt("Q?", &gold(), &s, &[]);
        assert!(prompt.contains("Correct answer: Velno | Velno City"));
        assert!(prompt.ends_with("Helpful and new (yes/no):"));
    }

    #[test]
    fn stats_means() {
        let mut s = RewardStats::default();
        let mut j = DeterministicJudge::default();
        let cfg = RewardConfig::default();
        s.add(&score(&traj(vec![], Some("Velno")), "q", &gold(), &cfg, &mut j).unwrap());
        s.add(&score(&traj(vec![], None), "q", &gold(), &cfg, &mut j).unwrap());
        let m = s.metrics();
        assert_eq!(m["reward/em"], 0.5);
        assert_eq!(m["reward/answered"], 0.5);
        assert!(RewardStats::default().metrics().is_empty());
        assert!(answer_in_passages(
            &traj(vec![vec![p("a", "b", "in velno city")]], None),
            &gold().answers
        ));
    }
}
