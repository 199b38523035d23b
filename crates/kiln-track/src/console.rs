//! Console progress lines (through `tracing`, so they respect `RUST_LOG` and the CLI's log format).

use std::collections::BTreeMap;

use crate::config::ConsoleConfig;

/// The metrics shown when the recipe names none, in this order (keys a step lacks are skipped), then `eval/*`.
pub(crate) const CURATED: &[&str] = &[
    "reward/mean",
    "kl/approx",
    "kl/ref",
    "entropy",
    "loss/policy",
    "clip_frac",
    "response_len/mean",
    "grad_norm",
    "lr",
];

pub(crate) struct Console {
    enabled: bool,
    every: u64,
    keys: Vec<String>,
    lines: u64,
}

impl Console {
    pub(crate) fn new(cfg: &ConsoleConfig) -> Console {
        Console {
            enabled: cfg.enabled,
            every: cfg.every,
            keys: cfg.keys.clone(),
            lines: 0,
        }
    }

    pub(crate) fn log(&mut self, step: u64, metrics: &BTreeMap<String, f64>) {
        if !self.enabled {
            return;
        }
        let due = self.lines == 0 || (self.every > 0 && step.is_multiple_of(self.every));
        if !due {
            return;
        }
        self.lines += 1;
        tracing::info!("{}", format_line(step, metrics, &self.keys));
    }
}

/// `step 10 | reward/mean 0.512 | kl/approx 0.00121 | ...`
pub(crate) fn format_line(step: u64, metrics: &BTreeMap<String, f64>, keys: &[String]) -> String {
    let mut line = format!("step {step}");
    let mut push = |k: &str, v: f64| {
        line.push_str(&format!(" | {k} {}", short(v)));
    };
    if keys.is_empty() {
        for k in CURATED {
            if let Some(v) = metrics.get(*k) {
                push(k, *v);
            }
        }
        for (k, v) in metrics.iter().filter(|(k, _)| k.starts_with("eval/")) {
            push(k, *v);
        }
    } else {
        for k in keys {
            if let Some(v) = metrics.get(k) {
                push(k, *v);
            }
        }
    }
    line
}

/// A compact number: 4 significant digits, scientific notation for very small or large magnitudes.
pub(crate) fn short(v: f64) -> String {
    if !v.is_finite() {
        return format!("{v}");
    }
    let a = v.abs();
    if a != 0.0 && !(1e-3..1e5).contains(&a) {
        format!("{v:.3e}")
    } else {
        let s = format!("{v:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        if s.is_empty() || s == "-" {
            "0".into()
        } else {
            s.to_string()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn curated_line() {
        let m: BTreeMap<String, f64> = [
            ("reward/mean", 0.5),
            ("lr", 3e-6),
            ("other", 1.0),
            ("eval/em", 0.25),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
        assert_eq!(
            format_line(3, &m, &[]),
            "step 3 | reward/mean 0.5 | lr 3.000e-6 | eval/em 0.25"
        );
        assert_eq!(short(f64::NAN), "NaN");
        assert_eq!(short(0.0), "0");
    }
}
