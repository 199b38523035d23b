//! Writes a synthetic training run through kiln-track, for trying the sinks and plots without training:
//!
//! `cargo run --release -p kiln-track --example track_writer -- RUN_DIR [STEPS] [DELAY_MS]`
//!
//! W&B follows the `WANDB_*` environment (e.g. `WANDB_MODE=offline`); TensorBoard, JSONL and plots are on.
//! Prints `logged N` after each step.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use kiln_track::{LoggingConfig, RunInfo, Tracker};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let run_dir = PathBuf::from(
        args.next()
            .ok_or("usage: track_writer RUN_DIR [STEPS] [DELAY_MS]")?,
    );
    let steps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(200);
    let delay_ms: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(0);
    let config = serde_json::json!({
        "name": "synthetic",
        "task": "search_r2",
        "trainer": {"steps": steps, "group_size": 8},
        "optim": {"lr": 3e-6},
    });
    std::fs::create_dir_all(&run_dir)?;
    std::fs::write(
        run_dir.join("recipe.yaml"),
        "name: synthetic\ntask: search_r2\ntrainer:\n  steps: 200\n  group_size: 8\noptim:\n  lr: 3.0e-6\n",
    )?;
    let cfg = LoggingConfig {
        tensorboard: true,
        ..LoggingConfig::default()
    };
    let mut tracker = Tracker::open(
        &cfg,
        RunInfo {
            run_dir: &run_dir,
            name: "synthetic",
            config: &config,
            resume_from_step: None,
        },
    )?;
    let mut out = std::io::stdout();
    for step in 1..=steps {
        let t = step as f64 / steps as f64;
        let noise = ((step as f64 * 12.9898).sin() * 43758.5453).fract() - 0.5;
        let m: BTreeMap<String, f64> = [
            (
                "reward/mean",
                0.15 + 0.55 * (1.0 - (-4.0 * t).exp()) + 0.08 * noise,
            ),
            ("reward/std", 0.35 - 0.1 * t + 0.02 * noise),
            ("kl/approx", 0.002 + 0.03 * t * (1.0 + 0.3 * noise)),
            ("entropy", 1.2 - 0.5 * t + 0.03 * noise),
            ("response_len/mean", 180.0 + 90.0 * t + 15.0 * noise),
            ("clip_frac", 0.05 + 0.1 * t + 0.02 * noise),
            ("lr", 3e-6 * (1.0 - t).max(0.05)),
            ("loss/policy", -0.02 + 0.04 * noise),
            ("grad_norm", 0.8 + 0.5 * noise.abs()),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .chain((step % 20 == 0).then(|| ("eval/exact_match".to_string(), 0.1 + 0.4 * t)))
        .collect();
        tracker.log(step, &m);
        writeln!(out, "logged {step}")?;
        out.flush()?;
        if delay_ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        }
    }
    tracker.finish(0)?;
    Ok(())
}
