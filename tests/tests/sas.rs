//! End-to-end tests of the SAS recipes through the `kiln` binary (tiny settings, CPU):
//! - `recipes/sas_sudoku.yaml`: the whole chain on a fresh project (pre-train the denoiser because
//!   none exists, train the order policy with GRPO, print the evaluation table), then
//!   `kiln eval RUN --task sudoku --data FILE`;
//! - `recipes/sas_gsm8k_llada.yaml`: the CPU smoke test (tiny random LLaDA-style denoiser, text
//!   order policy trained for 2 GRPO steps, pass@1 per schedule), then
//!   `kiln eval RUN --task gsm8k --data PATH`.

use std::path::PathBuf;

use kiln_e2e::{only_run_dir, read_metrics, repo_root, run_kiln, scratch_project, text};

fn shared(rel: &str) -> String {
    let p: PathBuf = repo_root().join("../shared/datasets").join(rel);
    assert!(p.is_file(), "{} is missing", p.display());
    p.to_string_lossy().into_owned()
}

#[test]
fn sas_sudoku_chain_runs_end_to_end() {
    let p = scratch_project();
    let magic = shared("sudoku/magictour_top1465.jsonl");
    let sets = format!(
        "final_eval.sets=[{{name: gen, generated: {{side: 9, count: 6, givens: [36], seed: 303}}}}, \
         {{name: magictour_top1465, path: \"{magic}\", limit: 2, schedules: [margin, learned]}}]"
    );
    let out = kiln_tiny(
        p.path(),
        &["train", "recipes/sas_sudoku.yaml"],
        4,
        &[
            "--set",
            "sas.train.count=8",
            "--set",
            "sas.puzzles_per_step=2",
            "--set",
            "sas.group_size=2",
            "--set",
            "trainer.steps=2",
            "--set",
            &sets,
            "--set",
            "final_eval.schedules=[random, expert, confidence, margin, learned]",
            "--set",
            "final_eval.image_puzzles=2",
            "--set",
            "logging.plots=false",
        ],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("wall time: pre-training"), "{log}");
    let run = only_run_dir_with(p.path(), "sas_sudoku");
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 2, "two GRPO steps logged");
    assert!(
        rows[0]["reward/mean"].as_f64().unwrap() < 0.0,
        "log-prob rewards"
    );
    assert!(
        p.path()
            .join("runs/sas/denoiser-9x9-500/denoiser.bpk")
            .is_file()
    );
    let md = std::fs::read_to_string(run.join("eval/sudoku.md")).unwrap();
    for s in ["| random |", "| margin |", "| learned |", "| expert |"] {
        assert!(md.contains(s), "{s} missing from\n{md}");
    }
    assert!(md.contains("magictour_top1465 (2 puzzles"), "{md}");
    let magic_table = md.split("magictour_top1465").nth(1).unwrap();
    assert!(
        !magic_table.contains("| random |"),
        "per-set schedules:\n{md}"
    );
    assert!(md.contains("learned - best heuristic"), "{md}");
    assert!(run.join("eval/orders-gen.png").is_file());
    // kiln eval of the run on one puzzle file (three magictour puzzles).
    let lines: Vec<String> = std::fs::read_to_string(&magic)
        .unwrap()
        .lines()
        .take(3)
        .map(String::from)
        .collect();
    let three = p.path().join("three.jsonl");
    std::fs::write(&three, lines.join("\n") + "\n").unwrap();
    let three = three.to_string_lossy().into_owned();
    let runs = run.to_string_lossy().into_owned();
    let out = run_kiln(
        p.path(),
        &[
            "eval",
            &runs,
            "--task",
            "sudoku",
            "--data",
            &three,
            "--set",
            "final_eval.image_puzzles=0",
            "--set",
            "final_eval.schedules=[margin, learned]",
        ],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("three (3 puzzles"), "{log}");
    assert!(
        log.contains("| learned |") && !log.contains("| random |"),
        "{log}"
    );
    // `kiln eval` writes a folder of its own: the training run's table is kept as it was.
    assert_eq!(
        std::fs::read_to_string(run.join("eval/sudoku.md")).unwrap(),
        md,
        "kiln eval overwrote the run's table"
    );
    let evals: Vec<PathBuf> = std::fs::read_dir(run.join("eval"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("sudoku.md").is_file())
        .collect();
    assert_eq!(evals.len(), 1, "{evals:?}");
    assert!(
        std::fs::read_to_string(evals[0].join("sudoku.md"))
            .unwrap()
            .contains("three (3 puzzles")
    );
    let out = run_kiln(p.path(), &["eval", &runs, "--task", "gsm8k"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("sas_gsm8k"), "{}", text(&out));

    // Stage 2 on this run's policy; the stage-2 run has no checkpoints of its own, and `kiln eval`
    // of it takes the policy from `stage2.policy_from` and the fine-tuned denoiser from the run.
    let policy_from = format!("stage2.policy_from={runs}");
    let out = kiln_tiny(
        p.path(),
        &["train", "recipes/sas_sudoku_stage2.yaml"],
        4,
        &[
            "--set",
            &policy_from,
            "--set",
            "stage2.steps=2",
            "--set",
            "stage2.batch_size=2",
            "--set",
            "stage2.puzzles=4",
            "--set",
            &sets,
            "--set",
            "final_eval.schedules=[margin, learned]",
            "--set",
            "final_eval.stage2_schedules=[learned]",
            "--set",
            "final_eval.image_puzzles=0",
            "--set",
            "logging.plots=false",
        ],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(log.contains("| learned+stage2 |"), "{log}");
    let s2run = only_run_dir_with(p.path(), "sas_sudoku_stage2");
    assert!(s2run.join("denoiser-stage2/denoiser.bpk").is_file());
    let s2runs = s2run.to_string_lossy().into_owned();
    let out = run_kiln(
        p.path(),
        &["eval", &s2runs, "--task", "sudoku", "--data", &three],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("three (3 puzzles") && log.contains("| learned+stage2 |"),
        "{log}"
    );

    // The denoiser folder records its pre-training; the run records which weights it froze.
    let den = p.path().join("runs/sas/denoiser-9x9-500");
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(den.join("pretrain.json")).unwrap()).unwrap();
    assert_eq!(rec["complete"], true, "{rec}");
    assert_eq!(rec["steps_done"], 4, "{rec}");
    assert!(run.join("denoiser_source.json").is_file());
    // A recipe whose pre-training settings differ from the folder's is refused before any work.
    let out = kiln_tiny(p.path(), &["train", "recipes/sas_sudoku.yaml"], 5, &[]);
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(
        log.contains("pretrain.steps: 4 -> 5") && log.contains("denoiser_dir"),
        "{log}"
    );
    // Re-training the denoiser in place (another seed) invalidates the run's policy: eval refuses.
    let out = kiln_tiny(
        p.path(),
        &[
            "train",
            "recipes/mdm_sudoku.yaml",
            "--set",
            "denoiser_dir=runs/sas/denoiser-9x9-500",
            "--set",
            "seed=1",
        ],
        4,
        &["--set", "logging.plots=false"],
    );
    assert!(out.status.success(), "{}", text(&out));
    let out = run_kiln(
        p.path(),
        &["eval", &runs, "--task", "sudoku", "--data", &three],
    );
    let log = text(&out);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains("re-trained or replaced"), "{log}");
}

/// `--set` arguments of the tiny denoiser (and its short pre-training) used by these tests.
fn tiny_denoiser(pretrain_steps: u32) -> Vec<String> {
    [
        "model.d_model=32".to_string(),
        "model.n_layers=1".into(),
        "model.n_heads=2".into(),
        "model.d_ff=64".into(),
        format!("pretrain.steps={pretrain_steps}"),
        "pretrain.batch_size=8".into(),
        "pretrain.data.count=10".into(),
    ]
    .into_iter()
    .flat_map(|kv| ["--set".to_string(), kv])
    .collect()
}

/// Runs `kiln` in `project` with `head`, the tiny denoiser's arguments, then `tail`.
fn kiln_tiny(
    project: &std::path::Path,
    head: &[&str],
    steps: u32,
    tail: &[&str],
) -> std::process::Output {
    let mut v: Vec<String> = head.iter().map(|s| s.to_string()).collect();
    v.extend(tiny_denoiser(steps));
    v.extend(tail.iter().map(|s| s.to_string()));
    let v: Vec<&str> = v.iter().map(String::as_str).collect();
    run_kiln(project, &v)
}

fn only_run_dir_with(project: &std::path::Path, prefix: &str) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(project.join("runs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
        })
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

#[test]
fn sas_gsm8k_smoke_trains_the_text_policy_and_evaluates() {
    let p = scratch_project();
    let test = shared("gsm8k/test.jsonl");
    let train = shared("gsm8k/train.jsonl");
    let out = run_kiln(
        p.path(),
        &[
            "train",
            "recipes/sas_gsm8k_llada.yaml",
            "--set",
            &format!("data={test}"),
            "--set",
            &format!("train.data={train}"),
        ],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    for s in [
        "gen_length 16, steps 16, block_length 8",
        "| random |",
        "| confidence |",
        "| learned |",
    ] {
        assert!(log.contains(s), "`{s}` missing:\n{log}");
    }
    let run = only_run_dir(p.path());
    let rows = read_metrics(&run.join("metrics.jsonl"));
    assert_eq!(rows.len(), 2, "two GRPO steps");
    let r = rows[0]["reward/mean"].as_f64().unwrap();
    // 16 teacher-forced log-probs of a random 256-token model: about 16 * -ln(255).
    assert!(r < -40.0 && r > -200.0, "reward {r}");
    assert!(run.join("checkpoints/step-2/model.bpk").is_file());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("eval/gsm8k.json")).unwrap())
            .unwrap();
    assert_eq!(report["protocol"]["decode"]["gen_length"], 16);
    assert_eq!(report["protocol"]["decode"]["block_length"], 8);
    assert_eq!(report["problems"], 4);
    let res = report["results"].as_array().unwrap();
    assert_eq!(res.len(), 4);
    for r in res {
        let rows = r["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        for row in rows {
            assert!(row["output"].is_string());
        }
    }
    // kiln eval of the trained policy on a GSM8K file (the first 2 problems).
    let runs = run.to_string_lossy().into_owned();
    let out = run_kiln(
        p.path(),
        &[
            "eval", &runs, "--task", "gsm8k", "--data", &test, "--set", "limit=2",
        ],
    );
    let log = text(&out);
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("(2 problems)") && log.contains("| learned |"),
        "{log}"
    );
    let out = run_kiln(p.path(), &["eval", &runs, "--task", "sudoku"]);
    assert!(!out.status.success());
}
