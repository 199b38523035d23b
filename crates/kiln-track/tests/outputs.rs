//! TensorBoard files read back by PyPI `tensorboard`, JSONL, plots and `report.md` (also through `kiln report`).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use kiln_track::{LoggingConfig, RunInfo, Tracker};

fn no_env(_: &str) -> Option<String> {
    None
}

fn write_run(dir: &Path, steps: u64, cfg: &LoggingConfig) {
    std::fs::write(
        dir.join("recipe.yaml"),
        "name: outputs-test\ntask: search_r2\ntrainer:\n  steps: 120\n  group_size: 8\noptim:\n  lr: 3.0e-6\n",
    )
    .unwrap();
    let config = serde_json::json!({"name": "outputs-test"});
    let mut t = Tracker::open_with_env(
        cfg,
        RunInfo {
            run_dir: dir,
            name: "outputs-test",
            config: &config,
            resume_from_step: None,
        },
        &no_env,
    )
    .unwrap();
    for step in 1..=steps {
        t.log(step, &metrics(step));
    }
    t.finish(0).unwrap();
}

#[test]
fn tensorboard_scalars_are_read_back_by_tensorboard() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LoggingConfig {
        tensorboard: true,
        plots: false,
        ..LoggingConfig::default()
    };
    write_run(dir.path(), 60, &cfg);
    let py = python(&["tensorboard"]);
    let script = repo_root().join("scripts/track/tb_read.py");
    let out = Command::new(py)
        .arg(&script)
        .arg(dir.path().join("tensorboard"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tb_read.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["files"], 1);
    let tags = v["tags"].as_object().unwrap();
    let mut expected = 0;
    for step in 1..=60u64 {
        for (k, want) in metrics(step) {
            expected += 1;
            let series = tags
                .get(&k)
                .unwrap_or_else(|| panic!("tag {k} missing: {:?}", tags.keys()));
            let point = series
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p[0] == step)
                .unwrap_or_else(|| panic!("{k} step {step} missing"));
            let got: f64 = match point[1].as_str().unwrap() {
                "nan" => f64::NAN,
                "inf" => f64::INFINITY,
                "-inf" => f64::NEG_INFINITY,
                s => s.parse().unwrap(),
            };
            let want = want as f32 as f64;
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "{k} step {step}: {got} vs {want}"
            );
        }
    }
    let total: usize = tags.values().map(|s| s.as_array().unwrap().len()).sum();
    assert_eq!(total, expected, "every scalar read back, nothing extra");
}

/// Decode a PNG; returns (width, height, distinct colours, fraction of non-white pixels).
fn png_stats(path: &Path) -> (u32, u32, usize, f64) {
    let dec = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = dec.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let px = &buf[..info.buffer_size()];
    let mut colours = std::collections::HashSet::new();
    let mut non_white = 0usize;
    let n = px.len() / channels;
    for p in px.chunks(channels) {
        colours.insert(p.to_vec());
        if p[..3.min(channels)].iter().any(|&c| c < 240) {
            non_white += 1;
        }
    }
    (
        info.width,
        info.height,
        colours.len(),
        non_white as f64 / n as f64,
    )
}

#[test]
fn plots_and_report_are_written_and_regenerated_by_kiln_report() {
    let dir = tempfile::tempdir().unwrap();
    write_run(dir.path(), 120, &LoggingConfig::default());
    let rows = kiln_track::read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    assert_eq!(rows.len(), 120);
    assert!(rows[6].values["loss/policy"].is_nan());
    assert_eq!(rows[6].values["grad_norm"], f64::INFINITY);

    let report = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(report.contains("# Run report: outputs-test"), "{report}");
    assert!(report.contains("| `trainer.group_size` | 8 |"), "{report}");
    assert!(report.contains("| `reward/mean` |"), "{report}");
    assert!(
        report.contains("![overview](plots/overview.png)"),
        "{report}"
    );
    // the curated metrics come first, eval next
    let pos = |k: &str| {
        report
            .find(&format!("### {k}"))
            .unwrap_or_else(|| panic!("no plot for {k}"))
    };
    assert!(pos("reward/mean") < pos("kl/approx") && pos("kl/approx") < pos("entropy"));
    assert!(pos("lr") < pos("eval/exact_match"));

    let plots = dir.path().join("plots");
    for key in [
        "overview",
        "reward_mean",
        "kl_approx",
        "entropy",
        "response_len_mean",
        "clip_frac",
        "lr",
        "eval_exact_match",
        "loss_policy",
    ] {
        let png = plots.join(format!("{key}.png"));
        let (w, h, colours, ink) = png_stats(&png);
        if key == "overview" {
            assert_eq!((w, h), kiln_track::plots::OVERVIEW_SIZE);
        } else {
            assert_eq!((w, h), kiln_track::plots::CHART_SIZE);
        }
        // axes, labels and curves: many colours (anti-aliased text) and a real share of ink, but not a flood
        assert!(colours > 20, "{key}.png has only {colours} colours");
        assert!(ink > 0.01 && ink < 0.6, "{key}.png ink fraction {ink}");
        let svg = std::fs::read_to_string(plots.join(format!("{key}.svg"))).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("<polyline"),
            "{key}.svg"
        );
    }

    // `kiln report` regenerates both from the files alone.
    std::fs::remove_dir_all(&plots).unwrap();
    std::fs::remove_file(dir.path().join("report.md")).unwrap();
    kiln_track::cli::run_report(kiln_track::cli::ReportArgs {
        run_dir: dir.path().to_path_buf(),
    })
    .unwrap();
    assert!(dir.path().join("report.md").is_file());
    assert!(plots.join("overview.png").is_file() && plots.join("reward_mean.svg").is_file());

    // and says what is wrong for a directory that is not a run
    let empty = tempfile::tempdir().unwrap();
    let err = kiln_track::cli::run_report(kiln_track::cli::ReportArgs {
        run_dir: empty.path().to_path_buf(),
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("metrics.jsonl"), "{err}");
}

#[test]
fn resumed_run_continues_metrics_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = LoggingConfig {
        plots: false,
        ..LoggingConfig::default()
    };
    write_run(dir.path(), 30, &cfg);
    let config = serde_json::json!({});
    let mut t = Tracker::open_with_env(
        &cfg,
        RunInfo {
            run_dir: dir.path(),
            name: "outputs-test",
            config: &config,
            resume_from_step: Some(20),
        },
        &no_env,
    )
    .unwrap();
    for step in 21..=25 {
        t.log(step, &metrics(step));
    }
    t.finish(0).unwrap();
    let steps: Vec<u64> = kiln_track::read_metrics(&dir.path().join("metrics.jsonl"))
        .unwrap()
        .iter()
        .map(|r| r.step)
        .collect();
    assert_eq!(steps, (1..=25).collect::<Vec<_>>());
}

#[test]
fn logging_section_parses_from_yaml_with_defaults() {
    let cfg: LoggingConfig = serde_norway::from_str(
        "tensorboard: true\nwandb:\n  mode: online\n  project: p\n  tags: [a, b]\nconsole:\n  every: 5\n",
    )
    .unwrap();
    assert!(cfg.jsonl && cfg.tensorboard && cfg.plots);
    assert_eq!(cfg.wandb.mode, Some(kiln_track::WandbMode::Online));
    assert_eq!(cfg.wandb.tags, Some(vec!["a".to_string(), "b".to_string()]));
    assert_eq!(cfg.console.every, 5);
    let err = serde_norway::from_str::<LoggingConfig>("wandb:\n  projetc: p\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("projetc"), "{err}");
}

/// A recipe without a `name` (the default: "use the recipe file's name") used to give
/// `# Run report: ` with nothing after it; the run directory's name stands in, and the plots carry
/// the same name (the SVG text is searchable).
#[test]
fn report_and_plots_carry_the_run_name_when_the_recipe_has_none() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("grpo_sequence-20261202-101500");
    std::fs::create_dir(&dir).unwrap();
    let cfg = LoggingConfig::default();
    write_run(&dir, 12, &cfg);
    std::fs::write(dir.join("recipe.yaml"), "name: ''\ntask: grpo_sequence\n").unwrap();
    kiln_track::report::write_report(&dir).unwrap();
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(
        report.starts_with("# Run report: grpo_sequence-20261202-101500\n"),
        "{report}"
    );
    let overview = std::fs::read_to_string(dir.join("plots/overview.svg")).unwrap();
    assert!(overview.contains("grpo_sequence-20261202-101500"));
    let chart = std::fs::read_to_string(dir.join("plots/reward_mean.svg")).unwrap();
    assert!(chart.contains("grpo_sequence-20261202-101500: reward/mean"));
}
