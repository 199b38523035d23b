//! The refiner start: teaching the meta-refiner its judgement on the actor's *own* trajectories, after the
//! cold start and before GRPO (a stage of Search-R2 recipes, `refiner_start:`; off by default).
//!
//! Why: the cold start's refiner demonstrations are scripted corruptions of gold trajectories (a swapped
//! answer, a swapped query), which is not what the actor gets wrong; the cold-started SmolLM2 refiner came
//! out blind (P(accept) ~0.21 on right and wrong trajectories alike, AUC 0.575) and Search-R2's
//! cut-and-regenerate then threw away right answers (README, "A pre-trained actor"). Here the labels come from
//! the distribution the refiner will judge during GRPO:
//!
//! 1. **Sample** `group_size` trajectories per question from the actor (the recipe's training sampling) on
//!    `questions` training questions taken from the *end* of the training split (the cold start's agent
//!    demonstrations come from its start).
//! 2. **Label** each with an oracle that knows the gold data ([`first_bad_step`]): a right answer (EM 1) is
//!    `0` (accept); otherwise the first step that went wrong: a search that retrieved no supporting passage
//!    it had not seen before, an invalid turn, or the wrong answer; a trajectory that ran out of turns with
//!    nothing else wrong is cut at its last step.
//! 3. **Hold out** a share of the questions (`holdout`), balance the rest (as many wrong as right
//!    trajectories, the majority subsampled), and fine-tune on refiner prompts only (`epochs` passes, LoRA
//!    adapters when the recipe has them, merged), the target being the label's `" j"`.
//! 4. **Calibrate** the decision margin on the held-out trajectories ([`calibrate_margin`]: the margin of
//!    `logsumexp_{j>=1} log p(j) - log p(0) >= margin` with the best balanced accuracy of "revise iff the
//!    answer is wrong"), and report the AUC of that score before and after (0.5 = blind).
//!
//! The result (merged weights, `refiner_start.json` with the report and the margin) is saved atomically into
//! its own folder; the GRPO policy, its KL reference and the LoRA base are then these weights.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::module::Module;
use kiln_lm::{SamplingConfig, Tokenizer, Transformer};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::agent::{LmActor, LmRefiner, encode_prompt};
use crate::data::QaExample;
use crate::protocol::{Action, Episode, PromptTemplates, ProtocolConfig, Trajectory};
use crate::refiner::{build_refiner_prompt, candidate_texts};
use crate::reward::{DeterministicJudge, Gold, RewardConfig, score};
use crate::rollout::{OnSearchError, SearchBackend, run_episodes};
use crate::task::{RefinerRequest, RefinerScorer};
use crate::warmstart::{SftExample, WarmStartConfig, example_from, supervised};

/// Settings of the refiner start (the recipe's `refiner_start` section).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct RefinerStartConfig {
    /// Training questions whose own trajectories are sampled and labelled (0 = no refiner start).
    /// Default 0.
    pub questions: usize,
    /// Trajectories sampled per question (the recipe's `search.sampling`). Default 4.
    pub group_size: usize,
    /// Share of the questions held out to calibrate the margin and measure the AUC. Default 0.25.
    pub holdout: f64,
    /// Passes over the (balanced) labelled trajectories. Default 3.
    pub epochs: usize,
    /// Sequences per step. Default 4.
    pub batch_size: usize,
    /// Peak learning rate (AdamW, warmup 10%, cosine to 10%). Default 5e-4.
    pub lr: f64,
    /// Use the calibrated margin in GRPO instead of `search.batch.refiner.margin`. Default true.
    pub calibrate: bool,
    /// Where the policy with the tuned refiner is saved (default: `init_dir` with `-refiner` appended).
    pub dir: Option<PathBuf>,
}

impl Default for RefinerStartConfig {
    fn default() -> Self {
        RefinerStartConfig {
            questions: 0,
            group_size: 4,
            holdout: 0.25,
            epochs: 3,
            batch_size: 4,
            lr: 5e-4,
            calibrate: true,
            dir: None,
        }
    }
}

impl RefinerStartConfig {
    /// Refuses settings that cannot run, with the field to fix.
    pub fn validate(&self) -> Result<(), Error> {
        if self.questions == 0 {
            return Ok(());
        }
        let bad = |m: String| Err(Error::Invalid(format!("refiner_start: {m}")));
        if self.group_size == 0 || self.epochs == 0 || self.batch_size == 0 {
            return bad("group_size, epochs and batch_size must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.holdout) {
            return bad(format!("holdout must be in [0, 1), got {}", self.holdout));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("lr must be a positive number, got {}", self.lr));
        }
        if self.questions < 2 && self.holdout > 0.0 {
            return bad(
                "questions must be at least 2 with a holdout (one to train, one to calibrate)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// What the refiner start did (saved as `refiner_start.json` beside the weights).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RefinerStartReport {
    /// Questions sampled for training / held out.
    pub questions_train: usize,
    /// See `questions_train`.
    pub questions_holdout: usize,
    /// Trajectories sampled, and how many answered right.
    pub trajectories: usize,
    /// See `trajectories`.
    pub right: usize,
    /// Labels of the training trajectories before balancing (label -> count; 0 = accept).
    pub labels: BTreeMap<usize, usize>,
    /// Refiner demonstrations trained on (balanced) and supervised steps.
    pub examples: usize,
    /// See `examples`.
    pub steps: usize,
    /// Mean decision-token loss over the first and the last 10% of the steps.
    pub loss_first: f64,
    /// See `loss_first`.
    pub loss_last: f64,
    /// Held-out AUC of the revise score for wrong vs right trajectories, before and after (0.5 = blind;
    /// NaN when the holdout lacks a class).
    pub auc_before: f64,
    /// See `auc_before`.
    pub auc_after: f64,
    /// Calibrated margin (None when the holdout lacks a class: the recipe's margin stays).
    pub margin: Option<f64>,
    /// Held-out share of right / wrong trajectories the rule revises at the calibrated margin (at margin 0
    /// without one), before and after.
    pub revise_right_before: f64,
    /// See `revise_right_before`.
    pub revise_wrong_before: f64,
    /// See `revise_right_before`.
    pub revise_right_after: f64,
    /// See `revise_right_before`.
    pub revise_wrong_after: f64,
    /// Wall time of the sampling, the fine-tuning and the whole stage.
    pub sample_seconds: f64,
    /// See `sample_seconds`.
    pub train_seconds: f64,
    /// See `sample_seconds`.
    pub seconds: f64,
}

/// The report's file name inside the refiner-start folder.
pub const REPORT_FILE: &str = "refiner_start.json";

/// The settings key's file name inside the refiner-start folder.
pub const KEY_FILE: &str = "refiner_start.key";

/// The label of one sampled trajectory: 0 when its answer is right (`em`), else the 1-based index of its
/// first bad step: a search whose passages hold no supporting passage not already retrieved (with no
/// supporting ids in `gold`: no passage containing a gold alias, normalised), an invalid turn, or the
/// (wrong) answer. A trajectory with nothing else wrong (it ran out of turns) is cut at its last step; an
/// empty one gets 1.
pub fn first_bad_step(trajectory: &Trajectory, em: bool, gold: &Gold) -> usize {
    if em {
        return 0;
    }
    let mut seen: Vec<&str> = Vec::new();
    let answers: Vec<String> = gold
        .answers
        .iter()
        .map(|a| crate::answer::normalize_answer(a))
        .filter(|a| !a.is_empty())
        .collect();
    for (i, step) in trajectory.steps.iter().enumerate() {
        match &step.action {
            Action::Search(_) => {
                let passages = step.search.as_ref().map(|s| &s.passages[..]).unwrap_or(&[]);
                let useful = passages.iter().any(|p| {
                    let new = !seen.contains(&p.id.as_str());
                    let supports = if gold.supporting_passage_ids.is_empty() {
                        let text =
                            crate::answer::normalize_answer(&format!("{} {}", p.title, p.text));
                        answers.iter().any(|a| text.contains(a.as_str()))
                    } else {
                        gold.supporting_passage_ids.contains(&p.id)
                    };
                    new && supports
                });
                seen.extend(passages.iter().map(|p| p.id.as_str()));
                if !useful {
                    return i + 1;
                }
            }
            Action::Answer(_) | Action::Invalid => return i + 1,
        }
    }
    trajectory.steps.len().max(1)
}

/// The revise score of one refiner score vector `lp[0..=T]`: `logsumexp_{j>=1} lp[j] - lp[0]` (the rule
/// revises iff it is >= the margin). `-inf` when there is no cut candidate.
pub fn revise_score(lp: &[f64]) -> f64 {
    if lp.len() < 2 {
        return f64::NEG_INFINITY;
    }
    let cuts = &lp[1..];
    let m = cuts.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return f64::NEG_INFINITY;
    }
    let lse = m + cuts.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
    lse - lp[0]
}

/// Area under the ROC curve of `pos` vs `neg` scores (ties count one half); NaN if either is empty.
pub fn auc(pos: &[f64], neg: &[f64]) -> f64 {
    if pos.is_empty() || neg.is_empty() {
        return f64::NAN;
    }
    let mut s = 0.0;
    for p in pos {
        for n in neg {
            s += if p > n {
                1.0
            } else if p == n {
                0.5
            } else {
                0.0
            };
        }
    }
    s / (pos.len() * neg.len()) as f64
}

/// The margin with the best balanced accuracy of "revise iff wrong" over `(score, wrong)` pairs, the
/// rule revising iff `score >= margin`. Candidates are the midpoints between consecutive distinct scores,
/// and one below the lowest (revise all) and one above the highest (revise none); ties go to the larger
/// margin (fewer revisions). None when a class is missing or a score is NaN.
pub fn calibrate_margin(scored: &[(f64, bool)]) -> Option<f64> {
    let nw = scored.iter().filter(|s| s.1).count();
    let nr = scored.len() - nw;
    if nw == 0 || nr == 0 || scored.iter().any(|s| s.0.is_nan()) {
        return None;
    }
    let mut xs: Vec<f64> = scored
        .iter()
        .map(|s| s.0)
        .filter(|x| x.is_finite())
        .collect();
    xs.sort_by(f64::total_cmp);
    xs.dedup();
    let mut cands = Vec::with_capacity(xs.len() + 1);
    match (xs.first(), xs.last()) {
        (Some(lo), Some(hi)) => {
            cands.push(lo - 1.0);
            cands.extend(xs.windows(2).map(|w| 0.5 * (w[0] + w[1])));
            cands.push(hi + 1.0);
        }
        _ => cands.push(0.0),
    }
    let mut best = (f64::NEG_INFINITY, 0.0);
    for m in cands {
        let (rw, rr) = revise_rates(scored, m);
        let ba = 0.5 * (rw + (1.0 - rr));
        if ba >= best.0 {
            best = (ba, m);
        }
    }
    Some(best.1)
}

/// Share of the wrong and of the right trajectories revised at `margin`.
fn revise_rates(scored: &[(f64, bool)], margin: f64) -> (f64, f64) {
    let (mut w, mut nw, mut r, mut nr) = (0usize, 0usize, 0usize, 0usize);
    for (s, wrong) in scored {
        let revised = *s >= margin;
        if *wrong {
            nw += 1;
            w += usize::from(revised);
        } else {
            nr += 1;
            r += usize::from(revised);
        }
    }
    (w as f64 / nw.max(1) as f64, r as f64 / nr.max(1) as f64)
}

/// Everything the stage needs from the recipe besides the policy.
pub struct RefinerStartInputs<'a> {
    /// The stage's settings.
    pub config: &'a RefinerStartConfig,
    /// Training questions (the stage takes its questions from the end).
    pub questions: &'a [QaExample],
    /// The tokenizer of the policy.
    pub tokenizer: &'a Tokenizer,
    /// Prompt templates (the agent's).
    pub templates: &'a PromptTemplates,
    /// Protocol of the rollouts.
    pub protocol: &'a ProtocolConfig,
    /// Reward settings (EM decides right / wrong).
    pub reward: &'a RewardConfig,
    /// Training sampling of the actor.
    pub sampling: &'a SamplingConfig,
    /// Rows per generation call (0 = all).
    pub max_batch: usize,
    /// What a failing search does.
    pub on_search_error: OnSearchError,
    /// The search engine.
    pub search: &'a dyn SearchBackend,
    /// LoRA adapters to fine-tune (merged before saving); None = every weight.
    pub lora: Option<&'a kiln_lm::LoraConfig>,
    /// The margin used before calibration (the recipe's).
    pub margin: f64,
    /// Seed of the sampling, the split, the balancing and the batches.
    pub seed: u64,
    /// Written as [`KEY_FILE`] inside the folder before it is moved into place (what the stage was made
    /// under, so that a later run can refuse other settings; the folder never exists without it).
    pub key: &'a str,
}

/// Runs the stage (module docs) on `model` (on an autodiff device) and saves the result into `dir`.
pub fn refiner_start(
    inp: &RefinerStartInputs<'_>,
    model: Transformer,
    dir: &Path,
    mut on_step: impl FnMut(&str, usize, usize, f64),
) -> Result<RefinerStartReport, Error> {
    let start = Instant::now();
    let cfg = inp.config;
    cfg.validate()?;
    let n = cfg.questions.min(inp.questions.len());
    if n == 0 {
        return Err(Error::Invalid(
            "refiner_start: no training questions to sample".into(),
        ));
    }
    let qs: Vec<&QaExample> = inp.questions.iter().rev().take(n).collect();
    let n_hold = ((n as f64 * cfg.holdout).round() as usize).min(n - 1);
    let n_train = n - n_hold;
    let g = cfg.group_size;

    // 1. Sample the actor's own trajectories.
    let snapshot = model.valid();
    let mut eps = Vec::with_capacity(n * g);
    for q in &qs {
        for _ in 0..g {
            eps.push(Episode::for_question(
                &inp.templates.agent,
                &q.question,
                inp.protocol.clone(),
            )?);
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(inp.seed ^ 0x2ef1_a7e5);
    // In pieces of `max_batch` episodes, one actor each (its kept KV caches live for one piece).
    let chunk = if inp.max_batch == 0 {
        eps.len()
    } else {
        inp.max_batch
    };
    let total = eps.len();
    for (k, part) in eps.chunks_mut(chunk.max(1)).enumerate() {
        let mut actor = LmActor::new(&snapshot, inp.tokenizer, inp.sampling.clone(), &mut rng);
        actor.max_batch = inp.max_batch;
        run_episodes(part, &mut actor, inp.search, inp.on_search_error)?;
        on_step("sampling", ((k + 1) * chunk).min(total), total, f64::NAN);
    }
    let sample_seconds = start.elapsed().as_secs_f64();

    // 2. Label.
    let mut judge = DeterministicJudge::default();
    let mut rows: Vec<(usize, String, usize, bool)> = Vec::with_capacity(eps.len()); // (question, prompt, label, wrong)
    for (i, ep) in eps.iter().enumerate() {
        let q = qs[i / g];
        let gold = q.gold();
        let rw = score(&ep.trajectory, &q.question, &gold, inp.reward, &mut judge)?;
        let em = rw.em > 0.0;
        let label = first_bad_step(&ep.trajectory, em, &gold);
        rows.push((
            i / g,
            build_refiner_prompt(&q.question, &ep.trajectory),
            label,
            !em,
        ));
    }
    let right = rows.iter().filter(|r| !r.3).count();
    let (train_rows, hold_rows): (Vec<_>, Vec<_>) = rows.into_iter().partition(|r| r.0 < n_train);
    let mut labels = BTreeMap::new();
    for r in &train_rows {
        *labels.entry(r.2).or_insert(0) += 1;
    }

    // 3. Balance and fine-tune.
    let (mut acc, mut cut): (Vec<_>, Vec<_>) = train_rows.iter().partition(|r| !r.3);
    if acc.is_empty() || cut.is_empty() {
        return Err(Error::Invalid(format!(
            "refiner_start: the actor's {} training trajectories were all {}: the refiner cannot learn to tell \
             them apart; raise refiner_start.questions or group_size (or check the cold start)",
            train_rows.len(),
            if acc.is_empty() { "wrong" } else { "right" }
        )));
    }
    acc.shuffle(&mut rng);
    cut.shuffle(&mut rng);
    let k = acc.len().min(cut.len());
    let window = snapshot.config().max_position_embeddings;
    let mut examples: Vec<SftExample> = Vec::with_capacity(2 * k);
    for r in acc.iter().take(k).chain(cut.iter().take(k)) {
        let e = example_from(
            inp.tokenizer,
            encode_prompt(inp.tokenizer, &r.1)?,
            &format!(" {}", r.2),
            "refiner",
        )?;
        if e.ids.len() <= window {
            examples.push(e);
        }
    }
    if examples.is_empty() {
        return Err(Error::Invalid(format!(
            "refiner_start: every refiner prompt is longer than the model window ({window} tokens)"
        )));
    }
    let steps = (cfg.epochs * examples.len()).div_ceil(cfg.batch_size);
    let sft = WarmStartConfig {
        steps,
        batch_size: cfg.batch_size,
        lr: cfg.lr,
        context_weight: 0.0,
        ..WarmStartConfig::default()
    };
    let hold_prompts: Vec<(String, Vec<String>, bool)> = hold_rows
        .iter()
        .map(|r| {
            let t = r.1.matches("ASSISTANT_STEP_").count();
            (r.1.clone(), candidate_texts(t), r.3)
        })
        .collect();
    let before = hold_scores(&snapshot, inp.tokenizer, &hold_prompts)?;
    drop(snapshot);
    let t_train = Instant::now();
    let mut m = model;
    if let Some(l) = inp.lora {
        m.device().seed(inp.seed ^ 0x4ef1);
        m = m.with_lora(l);
    }
    let (m, losses) = supervised(m, &examples, &sft, &mut rng, |s, l| {
        on_step("refiner SFT", s, steps, l)
    })?;
    let m = if m.has_lora() { m.merge_lora() } else { m };
    let m = m.valid();
    let train_seconds = t_train.elapsed().as_secs_f64();

    // 4. Calibrate on the held-out questions.
    let after = hold_scores(&m, inp.tokenizer, &hold_prompts)?;
    let margin = calibrate_margin(&after);
    let at = margin.unwrap_or(inp.margin);
    let split = |s: &[(f64, bool)]| -> (Vec<f64>, Vec<f64>) {
        let w = s.iter().filter(|x| x.1).map(|x| x.0).collect();
        let r = s.iter().filter(|x| !x.1).map(|x| x.0).collect();
        (w, r)
    };
    let (bw, br) = split(&before);
    let (aw, ar) = split(&after);
    let (rwb, rrb) = revise_rates(&before, calibrate_margin(&before).unwrap_or(inp.margin));
    let (rwa, rra) = revise_rates(&after, at);
    let tenth = (losses.len() / 10).max(1);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
    let report = RefinerStartReport {
        questions_train: n_train,
        questions_holdout: n_hold,
        trajectories: eps.len(),
        right,
        labels,
        examples: examples.len(),
        steps,
        loss_first: mean(&losses[..tenth.min(losses.len())]),
        loss_last: mean(&losses[losses.len().saturating_sub(tenth)..]),
        auc_before: auc(&bw, &br),
        auc_after: auc(&aw, &ar),
        margin,
        revise_right_before: rrb,
        revise_wrong_before: rwb,
        revise_right_after: rra,
        revise_wrong_after: rwa,
        sample_seconds,
        train_seconds,
        seconds: start.elapsed().as_secs_f64(),
    };
    save(&m, &report, inp.key, dir)?;
    Ok(report)
}

/// `(revise score, wrong)` of each held-out prompt under `model`.
fn hold_scores(
    model: &Transformer,
    tok: &Tokenizer,
    prompts: &[(String, Vec<String>, bool)],
) -> Result<Vec<(f64, bool)>, Error> {
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    let reqs: Vec<RefinerRequest<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(index, (p, c, _))| RefinerRequest {
            index,
            prompt: p,
            candidates: c,
        })
        .collect();
    let mut scorer = LmRefiner {
        model,
        tokenizer: tok,
        max_batch: 8,
    };
    let scores = scorer.score(&reqs)?;
    Ok(scores
        .iter()
        .zip(prompts)
        .map(|(lp, p)| (revise_score(lp), p.2))
        .collect())
}

/// Reads the report of a refiner-start folder.
pub fn read_report(dir: &Path) -> Result<RefinerStartReport, Error> {
    let p = dir.join(REPORT_FILE);
    let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
    serde_json::from_str(&text).map_err(|e| {
        Error::Invalid(format!(
            "{}: not a refiner-start report ({e}); delete {} to redo the refiner start",
            p.display(),
            dir.display()
        ))
    })
}

fn save(
    model: &Transformer,
    report: &RefinerStartReport,
    key: &str,
    dir: &Path,
) -> Result<(), Error> {
    let tmp = dir.with_extension("tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    kiln_lm::save_hf_dir(model, &tmp)
        .map_err(|e| Error::Invalid(format!("saving the refiner-start model: {e}")))?;
    let rp = tmp.join(REPORT_FILE);
    let json = serde_json::to_string_pretty(report).map_err(|e| Error::Invalid(e.to_string()))?;
    std::fs::write(&rp, json).map_err(|e| Error::io(&rp, e))?;
    let kp = tmp.join(KEY_FILE);
    std::fs::write(&kp, key).map_err(|e| Error::io(&kp, e))?;
    let _ = std::fs::remove_dir_all(dir);
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Passage, SearchCall, Segment, Step};

    fn passage(id: &str, text: &str) -> Passage {
        Passage {
            id: id.into(),
            title: String::new(),
            text: text.into(),
            score: 0.0,
        }
    }

    fn search(ids: &[(&str, &str)]) -> Step {
        Step {
            policy: Segment::policy("<search> q </search>".to_string()),
            action: Action::Search("q".into()),
            search: Some(SearchCall {
                query: "q".into(),
                passages: ids.iter().map(|(i, t)| passage(i, t)).collect(),
            }),
            observation: None,
        }
    }

    fn answer(a: &str) -> Step {
        Step {
            policy: Segment::policy(format!("<answer> {a} </answer>")),
            action: Action::Answer(a.into()),
            search: None,
            observation: None,
        }
    }

    fn traj(steps: Vec<Step>) -> Trajectory {
        let mut t = Trajectory::new("p");
        t.steps = steps;
        t
    }

    fn gold(ids: &[&str]) -> Gold {
        Gold {
            answers: vec!["Ada Lovelace".into()],
            supporting_passage_ids: ids.iter().map(|s| s.to_string()).collect(),
            supporting_titles: vec![],
        }
    }

    #[test]
    fn right_answers_are_accepted_whatever_their_searches() {
        let t = traj(vec![search(&[("x", "")]), answer("Ada Lovelace")]);
        assert_eq!(first_bad_step(&t, true, &gold(&["d1"])), 0);
    }

    #[test]
    fn the_first_search_without_new_support_is_the_cut() {
        let g = gold(&["d1", "d2"]);
        // Step 1 finds d1, step 2 finds d1 again (nothing new): cut at 2.
        let t = traj(vec![
            search(&[("d1", ""), ("x", "")]),
            search(&[("d1", ""), ("y", "")]),
            answer("Bob"),
        ]);
        assert_eq!(first_bad_step(&t, false, &g), 2);
        // Both searches useful, the answer wrong: cut at the answer.
        let t = traj(vec![
            search(&[("d1", "")]),
            search(&[("d2", "")]),
            answer("Bob"),
        ]);
        assert_eq!(first_bad_step(&t, false, &g), 3);
        // The first search misses: cut at 1.
        let t = traj(vec![
            search(&[("z", "")]),
            search(&[("d2", "")]),
            answer("Bob"),
        ]);
        assert_eq!(first_bad_step(&t, false, &g), 1);
    }

    #[test]
    fn invalid_turns_and_running_out_of_turns() {
        let g = gold(&["d1"]);
        let mut inv = answer("");
        inv.action = Action::Invalid;
        let t = traj(vec![search(&[("d1", "")]), inv]);
        assert_eq!(first_bad_step(&t, false, &g), 2);
        // Only useful searches, no answer: the last step.
        let t = traj(vec![search(&[("d1", "")])]);
        assert_eq!(first_bad_step(&t, false, &g), 1);
        assert_eq!(first_bad_step(&traj(vec![]), false, &g), 1);
    }

    #[test]
    fn without_supporting_ids_a_passage_with_the_answer_supports() {
        let g = gold(&[]);
        let t = traj(vec![
            search(&[("a", "The engine of Ada Lovelace.")]),
            search(&[("b", "nothing here")]),
            answer("Bob"),
        ]);
        assert_eq!(first_bad_step(&t, false, &g), 2);
    }

    #[test]
    fn revise_score_is_cut_mass_over_accept() {
        let lp = [0.5f64.ln(), 0.25f64.ln(), 0.25f64.ln()];
        assert!(revise_score(&lp).abs() < 1e-12);
        let lp = [0.2f64.ln(), 0.4f64.ln(), 0.4f64.ln()];
        assert!((revise_score(&lp) - 4f64.ln()).abs() < 1e-12);
        assert_eq!(revise_score(&[0.0]), f64::NEG_INFINITY);
    }

    #[test]
    fn calibration_separates_when_it_can_and_prefers_fewer_revisions() {
        // Wrong trajectories score higher: the margin falls between the classes.
        let s = [(0.1, false), (0.2, false), (0.5, true), (0.9, true)];
        let m = calibrate_margin(&s).unwrap();
        assert!(m > 0.2 && m <= 0.5, "{m}");
        assert_eq!(revise_rates(&s, m), (1.0, 0.0));
        // A blind score (same values in both classes): balanced accuracy is 0.5 at every margin, and the
        // tie goes to revising nothing.
        let s = [(0.3, false), (0.3, true), (0.7, false), (0.7, true)];
        let m = calibrate_margin(&s).unwrap();
        assert_eq!(revise_rates(&s, m), (0.0, 0.0));
        // A missing class or a NaN: no calibration.
        assert_eq!(calibrate_margin(&[(0.1, true)]), None);
        assert_eq!(calibrate_margin(&[(f64::NAN, true), (0.0, false)]), None);
    }

    #[test]
    fn auc_counts_ties_as_half() {
        assert_eq!(auc(&[1.0, 2.0], &[0.0]), 1.0);
        assert_eq!(auc(&[1.0], &[1.0]), 0.5);
        assert!(auc(&[], &[1.0]).is_nan());
    }

    #[test]
    fn bad_settings_say_which_field() {
        let c = RefinerStartConfig {
            questions: 10,
            holdout: 1.0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("holdout"));
        let c = RefinerStartConfig {
            questions: 10,
            epochs: 0,
            ..Default::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("epochs"));
        assert!(RefinerStartConfig::default().validate().is_ok());
    }
}
