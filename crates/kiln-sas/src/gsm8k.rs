//! GSM8K for masked diffusion LMs: answer extraction, exact numeric match, and LLaDA-style
//! semi-autoregressive decoding with a choice of unmasking schedule (METHODS, SAS "Decoding").
//!
//! **Answer extraction** ([`extract_answer`]): the number after the last `####` marker if there
//! is one, else the last number in the text. Thousands separators, currency signs, percent signs
//! and trailing units/punctuation are stripped; simple fractions `a/b` become their value.
//! [`answers_match`] compares numerically (so `18.00` matches `18`).
//!
//! **Decoding** ([`llada_generate`]): the prompt is followed by `gen_length` mask tokens split into
//! blocks of `block_length`; each block gets `steps / n_blocks` steps; at each step the denoiser
//! predicts every masked position (greedy digits at temperature 0), and the `k` masked positions
//! of the current block with the highest schedule score are revealed (LLaDA's "low-confidence
//! remasking" = the confidence schedule), `k` spreading the block's tokens evenly over its steps.

use std::path::Path;
use std::sync::OnceLock;

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use regex::Regex;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::policy::allowed_cells;
use crate::schedule::Schedule;
use crate::text::{N_TEXT_FEATURES, StatsForward, TextOrderPolicy, text_features};

fn number_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| {
        // A signed number with optional thousands separators and decimals, or a fraction a/b.
        Regex::new(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?")
            .expect("valid regex")
    })
}

/// Parse one matched number (commas, `$`, spaces removed; `a/b` divided) to f64.
fn parse_number(m: &str) -> Option<f64> {
    let clean: String = m
        .chars()
        .filter(|c| !matches!(c, ',' | '$' | ' ' | '\t'))
        .collect();
    if let Some((a, b)) = clean.split_once('/') {
        let (a, b) = (a.parse::<f64>().ok()?, b.parse::<f64>().ok()?);
        if b == 0.0 {
            return None;
        }
        return Some(a / b);
    }
    clean.parse::<f64>().ok()
}

/// The answer a text gives: the first number after the last `####`, else the last number.
/// `None` when there is no number.
pub fn extract_answer(text: &str) -> Option<f64> {
    if let Some(pos) = text.rfind("####") {
        let tail = &text[pos + 4..];
        if let Some(m) = number_re().find(tail) {
            return parse_number(m.as_str());
        }
    }
    number_re()
        .find_iter(text)
        .last()
        .and_then(|m| parse_number(m.as_str()))
}

/// Exact numeric match of two answers (relative tolerance 1e-9 for decimal round-off).
pub fn answers_match(pred: Option<f64>, gold: f64) -> bool {
    match pred {
        Some(p) => (p - gold).abs() <= 1e-9 * gold.abs().max(1.0),
        None => false,
    }
}

/// One GSM8K problem.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// The question.
    pub question: String,
    /// The reference solution text (ends in `#### N`).
    pub answer: String,
    /// The number of the reference answer.
    pub gold: f64,
}

/// Why a GSM8K file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Gsm8kError {
    /// I/O error.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A line is not a GSM8K record.
    #[error("{path}:{line}: {msg}")]
    Line {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        msg: String,
    },
}

/// Load GSM8K JSONL (`{"question", "answer"}` per line; the answer ends in `#### N`).
pub fn load_gsm8k(path: &Path) -> Result<Vec<Problem>, Gsm8kError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| Gsm8kError::Io {
        path: p.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for (k, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |msg: String| Gsm8kError::Line {
            path: p.clone(),
            line: k + 1,
            msg,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let q = v["question"]
            .as_str()
            .ok_or_else(|| bad("missing string field `question`".into()))?;
        let a = v["answer"]
            .as_str()
            .ok_or_else(|| bad("missing string field `answer`".into()))?;
        if !a.contains("####") {
            return Err(bad("the answer has no `#### N` final answer".into()));
        }
        let gold =
            extract_answer(a).ok_or_else(|| bad("no number after `####` in the answer".into()))?;
        out.push(Problem {
            question: q.to_string(),
            answer: a.to_string(),
            gold,
        });
    }
    Ok(out)
}

/// LLaDA-style decoding settings (recipe section `decode:` of the GSM8K recipe); every field is
/// logged with each evaluation since GSM8K numbers are only comparable under the same protocol.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(default)]
pub struct LladaDecodeConfig {
    /// Generated tokens (LLaDA GSM8K: 256).
    pub gen_length: usize,
    /// Total denoising steps (LLaDA: equal to gen_length, one token per step).
    pub steps: usize,
    /// Semi-autoregressive block length (LLaDA GSM8K: 32); must divide `gen_length`.
    pub block_length: usize,
    /// Which masked positions to reveal: confidence (LLaDA's low-confidence remasking), margin,
    /// entropy, random, left_to_right, or learned (the trained text order policy).
    pub schedule: Schedule,
}

impl Default for LladaDecodeConfig {
    fn default() -> Self {
        Self {
            gen_length: 256,
            steps: 256,
            block_length: 32,
            schedule: Schedule::Confidence,
        }
    }
}

impl LladaDecodeConfig {
    /// Consistency checks: `Err((field, message))`.
    pub fn check(&self) -> Result<(), (String, String)> {
        let e = |f: &str, m: String| Err((f.to_string(), m));
        if self.gen_length == 0 {
            return e("decode.gen_length", "must be >= 1".into());
        }
        if self.block_length == 0 || !self.gen_length.is_multiple_of(self.block_length) {
            return e(
                "decode.block_length",
                format!(
                    "must divide gen_length {} (got {})",
                    self.gen_length, self.block_length
                ),
            );
        }
        let blocks = self.gen_length / self.block_length;
        if self.steps == 0 || !self.steps.is_multiple_of(blocks) {
            return e(
                "decode.steps",
                format!(
                    "must be a positive multiple of the {blocks} blocks (got {})",
                    self.steps
                ),
            );
        }
        if self.schedule == Schedule::Expert {
            return e(
                "decode.schedule",
                "expert is Sudoku-only; use confidence, margin, entropy, random, left_to_right or learned".into(),
            );
        }
        Ok(())
    }
}

/// Tokens revealed at each step of a block: `n` tokens spread evenly over `steps` steps (the
/// first `n % steps` steps get one more), as LLaDA's `get_num_transfer_tokens`.
pub fn transfer_schedule(n: usize, steps: usize) -> Vec<usize> {
    let base = n / steps.max(1);
    let rem = n % steps.max(1);
    (0..steps).map(|s| base + (s < rem) as usize).collect()
}

/// Generate `cfg.gen_length` tokens after each prompt (rows of equal length) with the
/// masked-diffusion LM behind `forward` (see [`StatsForward`]; the mask token must never be its
/// prediction) whose mask token is `mask_id` and vocabulary `vocab`. With
/// [`Schedule::Learned`], `policy` scores the positions (greedy: its `k` most likely allowed
/// positions). Returns the generated tokens only.
#[allow(clippy::too_many_arguments)]
pub fn llada_generate(
    forward: &mut StatsForward<'_>,
    vocab: usize,
    prompts: &[Vec<u32>],
    cfg: &LladaDecodeConfig,
    mask_id: u32,
    policy: Option<&TextOrderPolicy>,
    rng: &mut ChaCha8Rng,
) -> Vec<Vec<u32>> {
    let b = prompts.len();
    if b == 0 {
        return Vec::new();
    }
    let pl = prompts[0].len();
    let g = cfg.gen_length;
    let len = pl + g;
    let mut x: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut r = p.clone();
            r.resize(len, mask_id);
            r
        })
        .collect();
    let mut masked = vec![vec![true; g]; b];
    let blocks = g / cfg.block_length.max(1);
    let steps_per_block = (cfg.steps / blocks.max(1)).max(1);
    for _blk in 0..blocks {
        let per_step = transfer_schedule(cfg.block_length, steps_per_block);
        for &k in &per_step {
            let flat: Vec<u32> = x.iter().flatten().copied().collect();
            let stats = forward(&flat, b, len, None);
            if stats.len() != b * len {
                tracing::error!(
                    "the model returned {} positions, expected {b} x {len}; decoding stops",
                    stats.len()
                );
                return x.into_iter().map(|r| r[pl..].to_vec()).collect();
            }
            let allowed: Vec<Vec<bool>> = masked
                .iter()
                .map(|m| allowed_cells(m, cfg.block_length))
                .collect();
            let learned: Option<Vec<f32>> = match (cfg.schedule, policy) {
                (Schedule::Learned, Some(pol)) => {
                    let mut f = Vec::with_capacity(b * g * N_TEXT_FEATURES);
                    for r in 0..b {
                        text_features(
                            &stats[r * len + pl..(r + 1) * len],
                            &masked[r],
                            &allowed[r],
                            cfg.block_length,
                            vocab,
                            &mut f,
                        );
                    }
                    let al: Vec<bool> = allowed.iter().flatten().copied().collect();
                    Some(pol.host_log_probs(f, al, b, g, 1.0))
                }
                _ => None,
            };
            for (r, row) in x.iter_mut().enumerate() {
                let mut cand: Vec<(f32, usize, u32)> = Vec::new();
                for j in 0..g {
                    if !allowed[r][j] {
                        continue;
                    }
                    let s = stats[r * len + pl + j];
                    let score = match cfg.schedule {
                        Schedule::Margin => s.margin,
                        Schedule::Entropy => -s.entropy,
                        Schedule::Random => rng.random::<f32>(),
                        Schedule::LeftToRight => -(j as f32),
                        Schedule::Learned => learned.as_ref().map_or(s.top1, |l| l[r * g + j]),
                        _ => s.top1,
                    };
                    cand.push((score, j, s.argmax));
                }
                cand.sort_by(|a, c| c.0.total_cmp(&a.0).then(a.1.cmp(&c.1)));
                for &(_, j, tok) in cand.iter().take(k) {
                    row[pl + j] = tok;
                    masked[r][j] = false;
                }
            }
        }
    }
    x.into_iter().map(|r| r[pl..].to_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn official_test_answers_all_parse() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/datasets/gsm8k/test.jsonl");
        let problems = load_gsm8k(&path).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(problems.len(), 1319);
        for p in &problems {
            // The text after #### is a plain (possibly comma-separated, signed) number.
            let tail = p.answer.rsplit("####").next().unwrap().trim();
            let direct: f64 = tail
                .replace(',', "")
                .parse()
                .unwrap_or_else(|e| panic!("{tail}: {e}"));
            assert_eq!(p.gold, direct, "{tail}");
            assert!(answers_match(extract_answer(&p.answer), direct));
        }
    }

    #[test]
    fn tricky_model_outputs() {
        let cases: &[(&str, Option<f64>)] = &[
            ("#### 72", Some(72.0)),
            ("She pays 3 + 4 = 7 dollars.\n#### 7", Some(7.0)),
            ("The answer is $1,234.50.", Some(1234.5)),
            ("So he has 5 apples left.", Some(5.0)),
            ("First 12, then 15. #### 15 apples", Some(15.0)),
            ("#### -3", Some(-3.0)),
            ("####  1,000,000", Some(1_000_000.0)),
            ("It grows by 10%.", Some(10.0)),
            ("It takes 0.5 hours", Some(0.5)),
            ("Half of it is 3/4 of a cup", Some(0.75)),
            ("#### 18.00", Some(18.0)),
            ("no numbers here", None),
            ("#### five\nbut actually 6", Some(6.0)),
            ("He earned $ 40 per day, 2 days: $80.", Some(80.0)),
            ("3 4 5 ####", Some(5.0)),
            ("1,5", Some(5.0)),
        ];
        for (text, want) in cases {
            assert_eq!(extract_answer(text), *want, "{text:?}");
        }
        assert!(answers_match(Some(18.0), 18.0));
        assert!(!answers_match(Some(18.5), 18.0));
        assert!(!answers_match(None, 1.0));
    }

    #[test]
    fn bad_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.jsonl");
        std::fs::write(
            &p,
            "{\"question\":\"q\",\"answer\":\"#### 4\"}\n{\"question\":\"q\"}\n",
        )
        .unwrap();
        let e = load_gsm8k(&p).unwrap_err().to_string();
        assert!(e.contains("g.jsonl:2") && e.contains("answer"), "{e}");
    }

    #[test]
    fn transfer_schedule_spreads_tokens() {
        assert_eq!(transfer_schedule(32, 32), vec![1; 32]);
        assert_eq!(transfer_schedule(10, 4), vec![3, 3, 2, 2]);
        assert_eq!(transfer_schedule(10, 4).iter().sum::<usize>(), 10);
    }

    #[test]
    fn llada_decoding_fills_every_position_block_by_block() {
        use crate::denoiser::{DenoiserConfig, digit_log_probs};
        use burn::tensor::Device;
        use rand::SeedableRng;
        // The Sudoku denoiser is a masked-diffusion LM over 10 tokens with mask 0: decode "text"
        // with it (its log-probs cover tokens 1..=9; the mask gets -inf).
        let device = Device::flex();
        device.seed(1);
        let model = DenoiserConfig {
            d_model: 32,
            n_layers: 1,
            n_heads: 2,
            d_ff: 64,
            ..Default::default()
        }
        .init(&device);
        let mut forward = |toks: &[u32], b: usize, len: usize, _t: Option<&[u32]>| {
            let lp = digit_log_probs(&model, toks, b, len);
            lp.chunks(9)
                .map(|row| {
                    let mut s = crate::text::stats_of_log_probs(row, None);
                    s.argmax += 1; // digits are tokens 1..=9
                    s
                })
                .collect::<Vec<_>>()
        };
        let pol = crate::text::TextPolicyConfig::default().init(&device);
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for schedule in [
            Schedule::Confidence,
            Schedule::Random,
            Schedule::LeftToRight,
            Schedule::Learned,
        ] {
            let dc = LladaDecodeConfig {
                gen_length: 8,
                steps: 4,
                block_length: 4,
                schedule,
            };
            dc.check().unwrap();
            let out = llada_generate(
                &mut forward,
                10,
                &[vec![1, 2, 3], vec![4, 5, 6]],
                &dc,
                0,
                Some(&pol),
                &mut rng,
            );
            assert_eq!(out.len(), 2);
            for r in &out {
                assert_eq!(r.len(), 8);
                assert!(r.iter().all(|&t| (1..10).contains(&t)), "{r:?}");
            }
        }
        assert!(
            LladaDecodeConfig {
                block_length: 3,
                ..Default::default()
            }
            .check()
            .is_err()
        );
    }
}
