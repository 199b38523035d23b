//! End-to-end training tests of `recipes/grpo_sequence.yaml` through the `kiln` binary:
//! the reward improves within a short budget, and a run killed with SIGKILL and resumed with
//! `--resume` reproduces the metrics of an uninterrupted run exactly (CPU backend, same seed).

use std::path::Path;
use std::time::{Duration, Instant};

use kiln_e2e::{kiln, only_run_dir, read_metrics, run_kiln, scratch_project, text};

/// Settings that keep the e2e runs short.
const FAST: &[&str] = &[
    "--set",
    "logging.plots=false",
    "--set",
    "sequence.eval_prompts=64",
];

fn train_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["train", "recipes/grpo_sequence.yaml"];
    v.extend_from_slice(FAST);
    v.extend_from_slice(extra);
    v
}

#[test]
fn grpo_sequence_reward_improves() {
    let p = scratch_project();
    let out = run_kiln(
        p.path(),
        &train_args(&[
            "--set",
            "trainer.steps=80",
            "--set",
            "trainer.eval_every=0",
            "--set",
            "sequence.length=3",
            "--set",
            "optim.lr=0.002",
        ]),
    );
    assert!(out.status.success(), "{}", text(&out));
    let run = only_run_dir(p.path());
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 80);
    let reward =
        |r: &serde_json::Map<String, serde_json::Value>| r["reward/mean"].as_f64().unwrap();
    let first: f64 = rows[..5].iter().map(reward).sum::<f64>() / 5.0;
    let last: f64 = rows[75..].iter().map(reward).sum::<f64>() / 5.0;
    assert!(first < 0.3, "starts near chance (0.1), got {first}");
    assert!(
        last > first + 0.25,
        "reward did not improve enough: {first:.3} -> {last:.3}"
    );
    let eval = rows[79]["eval/accuracy"].as_f64().expect("final eval");
    assert!(eval > 0.35, "held-out accuracy {eval}");
    // run directory layout
    assert!(run.join("recipe.yaml").is_file());
    assert!(run.join("checkpoints/step-80/model.bpk").is_file());
    assert!(run.join("checkpoints/step-80/optim.bpk").is_file());
    assert!(run.join("checkpoints/step-80/state.json").is_file());
    // evaluating the checkpoint reproduces the final evaluation
    let out = run_kiln(p.path(), &["eval", run.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("eval/accuracy"), "{}", text(&out));
    let report = std::fs::read_to_string(run.join("eval/step-80.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&report).unwrap();
    let again = v["metrics"]["eval/accuracy"].as_f64().unwrap();
    assert!(
        (again - eval).abs() < 1e-9,
        "eval {again} vs training-time eval {eval}"
    );
}

fn comparable(rows: &[serde_json::Map<String, serde_json::Value>]) -> Vec<Vec<(String, String)>> {
    rows.iter()
        .map(|r| {
            r.iter()
                .filter(|(k, _)| {
                    !k.starts_with("time/") && !k.starts_with("throughput/") && !k.starts_with('_')
                })
                .map(|(k, v)| (k.clone(), v.to_string()))
                .collect()
        })
        .collect()
}

fn wait_for(path: &Path, timeout: Duration) -> bool {
    let t0 = Instant::now();
    while t0.elapsed() < timeout {
        if path.exists() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// The run directory a `kiln train` started in `project` creates (waits up to a minute).
fn wait_for_run_dir(project: &Path) -> std::path::PathBuf {
    let runs = project.join("runs");
    assert!(wait_for(&runs, Duration::from_secs(60)), "no runs dir");
    loop {
        if let Some(e) = std::fs::read_dir(&runs).unwrap().flatten().next() {
            break e.path();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn sigkill_then_resume_matches_uninterrupted_run() {
    let common = [
        "--set",
        "trainer.steps=12",
        "--set",
        "trainer.checkpoint_every=4",
        "--set",
        "trainer.keep_checkpoints=3",
        "--set",
        "trainer.eval_every=0",
        "--set",
        "sequence.length=4",
        "--set",
        "algorithm.kl_beta=0.01",
        "--set",
        "trainer.ppo_epochs=2",
    ];
    // Uninterrupted reference run.
    let a = scratch_project();
    let out = run_kiln(a.path(), &train_args(&common));
    assert!(out.status.success(), "{}", text(&out));
    let rows_a = read_metrics(&only_run_dir(a.path()).join("metrics.jsonl"));
    assert_eq!(rows_a.len(), 12);

    // Interrupted run: SIGKILL once the step-8 checkpoint is complete.
    let b = scratch_project();
    let mut child = kiln(b.path())
        .args(train_args(&common))
        .spawn()
        .expect("spawn");
    let run_b = wait_for_run_dir(b.path());
    let done = wait_for(
        &run_b.join("checkpoints/step-8/state.json"),
        Duration::from_secs(300),
    );
    child.kill().expect("SIGKILL"); // Child::kill sends SIGKILL on Unix
    let _ = child.wait();
    assert!(done, "the step-8 checkpoint never appeared");
    assert!(
        !run_b.join("checkpoints/step-12").exists(),
        "run finished before it could be killed; the test needs a slower run"
    );

    let out = run_kiln(b.path(), &["train", "--resume", run_b.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let rows_b = read_metrics(&run_b.join("metrics.jsonl"));
    let steps: Vec<u64> = rows_b.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(
        steps,
        (1..=12).collect::<Vec<_>>(),
        "one row per step after resume"
    );
    assert_eq!(
        comparable(&rows_a),
        comparable(&rows_b),
        "resumed metrics differ"
    );
}

/// Ctrl-C (SIGINT) during `kiln train`: the run directory was printed at the start, the process
/// exits with 130 and prints the `--resume` command, and that command continues the run to its end.
#[test]
fn ctrl_c_prints_the_resume_command_which_continues_the_run() {
    let p = scratch_project();
    let child = kiln(p.path())
        .args(train_args(&[
            "--set",
            "trainer.steps=400",
            "--set",
            "trainer.checkpoint_every=2",
            "--set",
            "trainer.eval_every=0",
        ]))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let run = wait_for_run_dir(p.path());
    let ckpt = wait_for(
        &run.join("checkpoints/step-2/state.json"),
        Duration::from_secs(300),
    );
    let kill = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("kill -INT");
    assert!(kill.success());
    let out = child.wait_with_output().expect("wait");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(ckpt, "the step-2 checkpoint never appeared: {err}");
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains(&format!(
            "run directory: {}",
            Path::new("runs").join(run.file_name().unwrap()).display()
        )) || err.contains(&format!("run directory: {}", run.display())),
        "{err}"
    );
    assert!(
        !err.contains('\u{1b}'),
        "colour escapes in piped stderr: {err:?}"
    );
    let line = err
        .lines()
        .find(|l| l.trim_start().starts_with("kiln train --resume "))
        .unwrap_or_else(|| panic!("no resume command in: {err}"));
    let dir = line.trim_start().trim_start_matches("kiln train --resume ");
    assert!(
        !run.join("checkpoints/step-400").exists(),
        "the run ended before Ctrl-C; the test needs a longer run"
    );
    // Continue to two steps past the newest complete checkpoint (the full 400 would be slow).
    let newest = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().join("state.json").is_file())
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.strip_prefix("step-")?.parse::<u64>().ok()
        })
        .max()
        .expect("a complete checkpoint");
    let steps = format!("trainer.steps={}", newest + 2);
    let out = run_kiln(p.path(), &["train", "--resume", dir, "--set", &steps]);
    assert!(out.status.success(), "{}", text(&out));
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.last().unwrap()["step"].as_u64(), Some(newest + 2));
}

/// A corrupt newest checkpoint (one flipped byte in its weights): `--resume` warns and names the
/// file, continues from the previous checkpoint, and the metrics equal those of the uninterrupted
/// run. Before: the flipped byte was loaded silently.
#[test]
fn resume_after_a_corrupt_newest_checkpoint_continues_from_the_previous_one() {
    let common = [
        "--set",
        "trainer.steps=8",
        "--set",
        "trainer.checkpoint_every=4",
        "--set",
        "trainer.keep_checkpoints=3",
        "--set",
        "trainer.eval_every=0",
        "--set",
        "sequence.length=4",
    ];
    let p = scratch_project();
    let out = run_kiln(p.path(), &train_args(&common));
    assert!(out.status.success(), "{}", text(&out));
    let run = only_run_dir(p.path());
    let rows_a = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows_a.len(), 8);
    let model = run.join("checkpoints/step-8/model.bpk");
    let mut bytes = std::fs::read(&model).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&model, bytes).unwrap();

    let out = run_kiln(p.path(), &["train", "--resume", run.to_str().unwrap()]);
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("step-8") && log.contains("SHA-256") && log.contains("model.bpk"),
        "no warning naming the corrupt file: {log}"
    );
    assert!(
        log.contains("checkpoints/step-4"),
        "the fallback is not named: {log}"
    );
    let rows_b = read_metrics(&run.join("metrics.jsonl"));
    let steps: Vec<u64> = rows_b.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, (1..=8).collect::<Vec<_>>());
    assert_eq!(
        comparable(&rows_a),
        comparable(&rows_b),
        "metrics after the fallback differ from the uninterrupted run"
    );
}
