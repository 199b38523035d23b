//! Seeded percentile-bootstrap confidence intervals, shared by every task's evaluation report
//! (Sudoku accuracy tables in kiln-sas, QA tables in kiln-search).
//!
//! [`bootstrap_ci`] resamples the values with replacement `resamples` times (ChaCha8 seeded with
//! `seed`, so a report is reproducible), takes the mean of each resample and reads the
//! `(1 - level) / 2` and `(1 + level) / 2` percentiles of the sorted means. [`paired_bootstrap_ci`]
//! is the same on the per-item differences `a_i - b_i` of two systems scored on the same items.
//!
//! Two percentile rules exist because the two reports were written with different ones and their
//! published tables must not move: [`Quantile::Nearest`] (the mean at the rounded rank; Sudoku)
//! and [`Quantile::Linear`] (linear interpolation between ranks; QA).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// A mean with a bootstrap confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ci {
    /// Sample mean (NaN when empty).
    pub mean: f64,
    /// Lower bound.
    pub lo: f64,
    /// Upper bound.
    pub hi: f64,
    /// Sample size.
    pub n: usize,
}

/// How a percentile is read off the sorted bootstrap means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantile {
    /// The value at rank `round(q * (len - 1))`.
    Nearest,
    /// Linear interpolation between the two ranks around `q * (len - 1)`.
    Linear,
}

/// Settings of a bootstrap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bootstrap {
    /// Resamples (at least 1 is drawn).
    pub resamples: usize,
    /// Confidence level, e.g. 0.95.
    pub level: f64,
    /// Seed of the resampling.
    pub seed: u64,
    /// Percentile rule.
    pub quantile: Quantile,
}

fn percentile(sorted: &[f64], q: f64, rule: Quantile) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    match rule {
        Quantile::Nearest => sorted[(pos.round() as usize).min(sorted.len() - 1)],
        Quantile::Linear => {
            let (i, f) = (pos.floor() as usize, pos - pos.floor());
            if i + 1 < sorted.len() {
                sorted[i] * (1.0 - f) + sorted[i + 1] * f
            } else {
                sorted[i]
            }
        }
    }
}

/// Percentile-bootstrap CI of the mean of `values`.
pub fn bootstrap_ci(values: &[f64], b: &Bootstrap) -> Ci {
    let n = values.len();
    if n == 0 {
        return Ci {
            mean: f64::NAN,
            lo: f64::NAN,
            hi: f64::NAN,
            n,
        };
    }
    let mean = values.iter().sum::<f64>() / n as f64;
    let mut rng = ChaCha8Rng::seed_from_u64(b.seed);
    let mut means: Vec<f64> = (0..b.resamples.max(1))
        .map(|_| (0..n).map(|_| values[rng.random_range(0..n)]).sum::<f64>() / n as f64)
        .collect();
    means.sort_by(f64::total_cmp);
    let a = (1.0 - b.level) / 2.0;
    Ci {
        mean,
        lo: percentile(&means, a, b.quantile),
        hi: percentile(&means, 1.0 - a, b.quantile),
        n,
    }
}

/// Paired bootstrap CI of `mean(a - b)` (the same items scored by two systems); `Err` with both
/// sizes when they differ.
pub fn paired_bootstrap_ci(a: &[f64], b: &[f64], boot: &Bootstrap) -> Result<Ci, (usize, usize)> {
    if a.len() != b.len() {
        return Err((a.len(), b.len()));
    }
    let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    Ok(bootstrap_ci(&d, boot))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boot(quantile: Quantile) -> Bootstrap {
        Bootstrap {
            resamples: 2000,
            level: 0.95,
            seed: 7,
            quantile,
        }
    }

    #[test]
    fn brackets_the_mean_and_is_seeded() {
        let v: Vec<f64> = (0..50).map(|i| (i % 3) as f64).collect();
        for q in [Quantile::Nearest, Quantile::Linear] {
            let c = bootstrap_ci(&v, &boot(q));
            assert!(
                c.lo <= c.mean && c.mean <= c.hi && c.hi - c.lo > 0.0,
                "{c:?}"
            );
            assert_eq!(c, bootstrap_ci(&v, &boot(q)));
            assert_eq!(c.n, 50);
        }
        assert!(bootstrap_ci(&[], &boot(Quantile::Linear)).mean.is_nan());
    }

    #[test]
    fn percentile_rules() {
        let s = [0.0, 1.0, 2.0, 3.0];
        assert_eq!(percentile(&s, 0.5, Quantile::Linear), 1.5);
        assert_eq!(percentile(&s, 0.5, Quantile::Nearest), 2.0);
        assert_eq!(percentile(&s, 1.0, Quantile::Nearest), 3.0);
    }

    #[test]
    fn paired_needs_equal_sizes_and_is_zero_on_itself() {
        let v = [1.0, 0.0, 1.0, 1.0];
        let d = paired_bootstrap_ci(&v, &v, &boot(Quantile::Nearest)).unwrap();
        assert_eq!((d.mean, d.lo, d.hi), (0.0, 0.0, 0.0));
        assert_eq!(
            paired_bootstrap_ci(&v, &[1.0], &boot(Quantile::Linear)),
            Err((4, 1))
        );
    }
}
