//! The meta-refiner's text side: its prompt, the revise-or-accept rule, the sampled cut point and the cut.
//!
//! The same policy model, prompted with [`build_refiner_prompt`], scores the candidate continuations
//! [`candidate_texts`] (`" 0"`, `" 1"`, ..., `" T"`, T = number of steps) by teacher-forced log-probability.
//! [`decide`] revises iff `logsumexp_{j>=1} log p(j) >= log p(0) + margin`; [`sample_cut`] then draws j from
//! `p(j | j >= 1)`; [`Episode::cut_before_step`] keeps steps `1..j-1` with their observations byte for byte and
//! lets the actor regenerate from step j. [`refine`] combines the three and enforces `max_revisions`.
//! [`RefinerStats`] accumulates the diagnostics the paper logs.

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::protocol::{Episode, Trajectory};

/// Instructions at the top of the refiner prompt.
pub const REFINER_INSTRUCTIONS: &str = "You are reviewing a search agent's attempt to answer a question. The attempt is split into numbered assistant steps; a step that searched is followed by what the search tool returned. Find the first step that is wrong or unhelpful (a poor search query, a wrong conclusion, a wrong answer). Reply with its number, or 0 if no step has a problem.";

/// The last line of the refiner prompt; the decision follows it.
pub const REFINER_QUESTION: &str = "Problematic step index (0 = no issue):";

/// Refiner settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RefinerConfig {
    /// Run the refiner in training rollouts (off = Search-R1).
    pub enabled: bool,
    /// Revise iff `logsumexp_{j>=1} log p(j) >= log p(0) + margin` (default 0).
    pub margin: f64,
    /// At most this many revisions per rollout (default 1).
    pub max_revisions: usize,
    /// Include the refiner's decision tokens in the policy loss (joint optimisation; default true).
    pub joint: bool,
}

impl Default for RefinerConfig {
    fn default() -> Self {
        RefinerConfig {
            enabled: true,
            margin: 0.0,
            max_revisions: 1,
            joint: true,
        }
    }
}

/// The refiner prompt for a trajectory: instructions, the question, one `ASSISTANT_STEP_i:` line per step
/// (followed by `TOOL: <observation i>` when the step has an observation), and [`REFINER_QUESTION`].
pub fn build_refiner_prompt(question: &str, trajectory: &Trajectory) -> String {
    let mut s = String::new();
    s.push_str(REFINER_INSTRUCTIONS);
    s.push_str("\n\nQuestion: ");
    s.push_str(question.trim());
    s.push_str("\n\n");
    for (i, step) in trajectory.steps.iter().enumerate() {
        s.push_str(&format!(
            "ASSISTANT_STEP_{}: {}\n",
            i + 1,
            step.policy.text.trim()
        ));
        if let Some(obs) = &step.observation {
            s.push_str(&format!("TOOL: {}\n", obs.text.trim()));
        }
    }
    s.push_str(REFINER_QUESTION);
    s
}

/// The continuations to score: `" 0"`, `" 1"`, ..., `" T"` (a space after the prompt's colon).
pub fn candidate_texts(num_steps: usize) -> Vec<String> {
    (0..=num_steps).map(|j| format!(" {j}")).collect()
}

/// Parses a generated refiner answer (first integer in the text) into `0..=num_steps`; anything else is 0
/// (accept).
pub fn parse_decision(text: &str, num_steps: usize) -> usize {
    let digits: String = text
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits
        .parse::<usize>()
        .ok()
        .filter(|j| *j <= num_steps)
        .unwrap_or(0)
}

fn logsumexp(xs: &[f64]) -> f64 {
    let m = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

/// The accept/revise decision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    /// `log p("0")`.
    pub log_p_accept: f64,
    /// `logsumexp_{j>=1} log p(j)`.
    pub log_p_revise: f64,
    /// Whether to revise.
    pub revise: bool,
}

fn check_logps(logps: &[f64]) -> Result<(), Error> {
    if logps.is_empty() {
        return Err(Error::Invalid(
            "refiner: no candidate log-probabilities (need log p(\"0\")..log p(\"T\"))".into(),
        ));
    }
    if logps.iter().any(|x| x.is_nan() || *x == f64::INFINITY) {
        return Err(Error::Invalid(format!(
            "refiner: log-probabilities must be finite or -inf, got {logps:?}"
        )));
    }
    Ok(())
}

/// Revise iff `logsumexp_{j>=1} logps[j] >= logps[0] + margin`. `logps[j]` is the log-probability of candidate
/// j (unnormalised scores are fine: only differences matter). With no step to cut (`logps.len() == 1`) or all
/// `logps[1..]` at -inf, never revises.
pub fn decide(logps: &[f64], margin: f64) -> Result<Decision, Error> {
    check_logps(logps)?;
    let log_p_accept = logps[0];
    let log_p_revise = logsumexp(&logps[1..]);
    let revise = log_p_revise > f64::NEG_INFINITY && log_p_revise >= log_p_accept + margin;
    Ok(Decision {
        log_p_accept,
        log_p_revise,
        revise,
    })
}

/// `p(j | j >= 1)` for `j = 1..=T` (index 0 of the result is j = 1).
pub fn cut_distribution(logps: &[f64]) -> Result<Vec<f64>, Error> {
    check_logps(logps)?;
    let tail = &logps[1..];
    let z = logsumexp(tail);
    if z == f64::NEG_INFINITY {
        return Err(Error::Invalid(
            "refiner: every cut candidate has probability 0".into(),
        ));
    }
    Ok(tail.iter().map(|x| (x - z).exp()).collect())
}

/// Draws a cut step `j in 1..=T` from `p(j | j >= 1)`.
pub fn sample_cut<R: Rng + ?Sized>(logps: &[f64], rng: &mut R) -> Result<usize, Error> {
    let p = cut_distribution(logps)?;
    let u: f64 = rng.random::<f64>();
    let mut acc = 0.0;
    for (i, pi) in p.iter().enumerate() {
        acc += pi;
        if u < acc {
            return Ok(i + 1);
        }
    }
    // Rounding: the last candidate with positive mass.
    Ok(p.iter().rposition(|x| *x > 0.0).unwrap_or(0) + 1)
}

/// What the refiner did to one episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefinerRecord {
    /// The refiner prompt.
    pub prompt: String,
    /// Scores of `" 0"..=" T"`.
    pub logps: Vec<f64>,
    /// The decision (absent when the episode had used up `max_revisions`).
    pub decision: Option<Decision>,
    /// The sampled cut step (1-based), when revised.
    pub cut: Option<usize>,
}

impl RefinerRecord {
    /// The decision the refiner took as its candidate text (`" 0"` when accepted, `" j"` when cut at j): the
    /// tokens that enter the policy loss under joint optimisation. `None` when no decision was taken.
    pub fn decision_text(&self) -> Option<String> {
        self.decision.map(|_| format!(" {}", self.cut.unwrap_or(0)))
    }
}

/// Result of [`refine`].
#[derive(Debug, Clone, PartialEq)]
pub enum Refined {
    /// Keep the episode as it is.
    Accept(RefinerRecord),
    /// Regenerate from step `record.cut`: run this episode on.
    Revise(RefinerRecord, Box<Episode>),
}

/// Applies the refiner to a finished episode given the scores `logps` of [`candidate_texts`]`(T)`: accepts when
/// the episode already had `max_revisions` revisions or the rule says accept, otherwise samples j and cuts.
pub fn refine<R: Rng + ?Sized>(
    question: &str,
    episode: &Episode,
    logps: &[f64],
    config: &RefinerConfig,
    rng: &mut R,
) -> Result<Refined, Error> {
    let t = episode.trajectory.steps.len();
    let mut record = RefinerRecord {
        prompt: build_refiner_prompt(question, &episode.trajectory),
        logps: logps.to_vec(),
        decision: None,
        cut: None,
    };
    if episode.revisions >= config.max_revisions || t == 0 {
        return Ok(Refined::Accept(record));
    }
    if logps.len() != t + 1 {
        return Err(Error::Invalid(format!(
            "refiner: {} scores for a trajectory of {t} steps (need {})",
            logps.len(),
            t + 1
        )));
    }
    let d = decide(logps, config.margin)?;
    record.decision = Some(d);
    if !d.revise {
        return Ok(Refined::Accept(record));
    }
    let j = sample_cut(logps, rng)?;
    record.cut = Some(j);
    let ep = episode.cut_before_step(j)?;
    Ok(Refined::Revise(record, Box::new(ep)))
}

/// Refiner diagnostics over a batch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RefinerStats {
    /// Episodes the refiner looked at with a decision.
    pub decided: usize,
    /// Of those, revised.
    pub revised: usize,
    /// Cut step histogram (j -> count).
    pub cut_histogram: BTreeMap<usize, usize>,
    /// Sum of rewards of revised trajectories before revision.
    pub reward_before_sum: f64,
    /// Sum of rewards of revised trajectories after revision.
    pub reward_after_sum: f64,
    /// Revised trajectories with both rewards recorded.
    pub reward_pairs: usize,
}

impl RefinerStats {
    /// Counts one record.
    pub fn record(&mut self, r: &RefinerRecord) {
        if let Some(d) = r.decision {
            self.decided += 1;
            if d.revise {
                self.revised += 1;
            }
        }
        if let Some(j) = r.cut {
            *self.cut_histogram.entry(j).or_default() += 1;
        }
    }

    /// Adds the counts of `other` (another rollout round of the same step).
    pub fn merge(&mut self, other: &RefinerStats) {
        self.decided += other.decided;
        self.revised += other.revised;
        for (j, c) in &other.cut_histogram {
            *self.cut_histogram.entry(*j).or_default() += c;
        }
        self.reward_before_sum += other.reward_before_sum;
        self.reward_after_sum += other.reward_after_sum;
        self.reward_pairs += other.reward_pairs;
    }

    /// Records the reward of a revised trajectory before and after its revision.
    pub fn record_rewards(&mut self, before: f64, after: f64) {
        self.reward_before_sum += before;
        self.reward_after_sum += after;
        self.reward_pairs += 1;
    }

    /// Metrics: `refiner/acceptance_rate`, `refiner/intervention_volume`, `refiner/reward_before`,
    /// `refiner/reward_after`, `refiner/trimming_gain`, `refiner/cut_step_<j>` (share of cuts at step j).
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        if self.decided > 0 {
            let v = self.revised as f64 / self.decided as f64;
            m.insert("refiner/intervention_volume".into(), v);
            m.insert("refiner/acceptance_rate".into(), 1.0 - v);
        }
        if self.reward_pairs > 0 {
            let n = self.reward_pairs as f64;
            m.insert("refiner/reward_before".into(), self.reward_before_sum / n);
            m.insert("refiner/reward_after".into(), self.reward_after_sum / n);
            m.insert(
                "refiner/trimming_gain".into(),
                (self.reward_after_sum - self.reward_before_sum) / n,
            );
        }
        let cuts: usize = self.cut_histogram.values().sum();
        for (j, c) in &self.cut_histogram {
            m.insert(format!("refiner/cut_step_{j}"), *c as f64 / cuts as f64);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn decision_rule() {
        let l = |p: f64| p.ln();
        // p0 = 0.5, p1 + p2 = 0.5 -> revise at margin 0 (>=).
        let d = decide(&[l(0.5), l(0.25), l(0.25)], 0.0).unwrap();
        assert!(d.revise);
        assert!((d.log_p_revise - l(0.5)).abs() < 1e-12);
        assert!(!decide(&[l(0.5), l(0.25), l(0.25)], 0.1).unwrap().revise);
        assert!(!decide(&[l(0.6), l(0.2), l(0.2)], 0.0).unwrap().revise);
        assert!(decide(&[l(0.4), l(0.3), l(0.3)], 0.0).unwrap().revise);
        // negative margin revises more eagerly
        assert!(decide(&[l(0.6), l(0.2), l(0.2)], -1.0).unwrap().revise);
        // no step to cut, or zero mass on cuts
        assert!(!decide(&[0.0], 0.0).unwrap().revise);
        assert!(
            !decide(&[f64::NEG_INFINITY, f64::NEG_INFINITY], -10.0)
                .unwrap()
                .revise
        );
        assert!(decide(&[f64::NAN, 0.0], 0.0).is_err());
        assert!(decide(&[], 0.0).is_err());
    }

    #[test]
    fn cut_sampling_follows_conditional() {
        let logps = [0.0f64, (0.1f64).ln(), (0.3f64).ln(), (0.6f64).ln()];
        let p = cut_distribution(&logps).unwrap();
        assert!((p[0] - 0.1).abs() < 1e-12 && (p[2] - 0.6).abs() < 1e-12);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[sample_cut(&logps, &mut rng).unwrap()] += 1;
        }
        assert_eq!(counts[0], 0);
        let f = |c: usize| c as f64 / 20_000.0;
        assert!((f(counts[1]) - 0.1).abs() < 0.015, "{counts:?}");
        assert!((f(counts[3]) - 0.6).abs() < 0.015, "{counts:?}");
        // Deterministic for a seed.
        let a: Vec<usize> = {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
            (0..10)
                .map(|_| sample_cut(&logps, &mut r).unwrap())
                .collect()
        };
        let b: Vec<usize> = {
            let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
            (0..10)
                .map(|_| sample_cut(&logps, &mut r).unwrap())
                .collect()
        };
        assert_eq!(a, b);
        // A candidate with zero mass is never drawn.
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        for _ in 0..1000 {
            assert_eq!(
                sample_cut(&[0.0, f64::NEG_INFINITY, 0.0], &mut r).unwrap(),
                2
            );
        }
    }

    #[test]
    fn parse_generated_decisions() {
        assert_eq!(parse_decision(" 2", 3), 2);
        assert_eq!(parse_decision("3 because", 3), 3);
        assert_eq!(parse_decision("4", 3), 0);
        assert_eq!(parse_decision("none", 3), 0);
        assert_eq!(parse_decision("", 3), 0);
        assert_eq!(parse_decision("99999999999999999999999", 3), 0);
        assert_eq!(candidate_texts(2), [" 0", " 1", " 2"]);
    }

    #[test]
    fn stats_metrics() {
        let mut s = RefinerStats::default();
        let rec = |revise: bool, cut: Option<usize>| RefinerRecord {
            prompt: String::new(),
            logps: vec![],
            decision: Some(Decision {
                log_p_accept: 0.0,
                log_p_revise: 0.0,
                revise,
            }),
            cut,
        };
        s.record(&rec(false, None));
        s.record(&rec(true, Some(2)));
        s.record(&rec(true, Some(2)));
        s.record(&rec(false, None));
        s.record_rewards(0.0, 1.0);
        s.record_rewards(1.0, 1.0);
        let m = s.metrics();
        assert_eq!(m["refiner/intervention_volume"], 0.5);
        assert_eq!(m["refiner/acceptance_rate"], 0.5);
        assert_eq!(m["refiner/trimming_gain"], 0.5);
        assert_eq!(m["refiner/cut_step_2"], 1.0);
    }
}
