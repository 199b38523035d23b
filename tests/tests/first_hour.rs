//! A new user's first hour: `kiln doctor` says what the machine has and what each recipe needs,
//! logs piped to a file carry no colour escapes, and the run's report is titled with the run's
//! name (a recipe without `name:` used to give `# Run report: ` with nothing after it).

use kiln_e2e::{kiln, only_run_dir, scratch_project, text};

#[test]
fn doctor_reports_the_machine_and_what_each_recipe_needs() {
    let p = scratch_project();
    let recipes = p.path().join("recipes");
    std::fs::write(
        recipes.join("zz_missing_model.yaml"),
        "extends: ../configs/search/search_r2_base.yaml\npretrained: /nonexistent/SmolLM2-folder\n",
    )
    .unwrap();
    std::fs::write(
        recipes.join("zz_invalid.yaml"),
        "task: grpo_sequence\ntrainer:\n  steps: -3\n",
    )
    .unwrap();
    let t0 = std::time::Instant::now();
    let out = kiln(p.path())
        .args(["doctor", "--data", "/nonexistent/shared/datasets"])
        .output()
        .expect("spawn kiln doctor");
    let secs = t0.elapsed().as_secs_f64();
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    for section in [
        "\nmachine\n",
        "\nbackends\n",
        "\nmodels (",
        "\ndata\n",
        "\nrecipes (",
    ] {
        assert!(s.contains(section), "no `{}` section: {s}", section.trim());
    }
    let line = |name: &str| {
        s.lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no line for {name}: {s}"))
            .to_string()
    };
    assert!(line("grpo_sequence.yaml").ends_with("ready"), "{s}");
    let missing = line("zz_missing_model.yaml");
    assert!(
        missing.contains("needs") && missing.contains("/nonexistent/SmolLM2-folder"),
        "{missing}"
    );
    assert!(line("zz_invalid.yaml").contains("INVALID"), "{s}");
    assert!(s.contains("/nonexistent/shared/datasets not found"), "{s}");
    assert!(!s.contains('\u{1b}'), "colour escapes: {s:?}");
    eprintln!("kiln doctor answered in {secs:.2} s");
}

#[test]
fn piped_logs_have_no_colour_escapes_and_the_report_carries_the_run_name() {
    let p = scratch_project();
    let out = kiln(p.path())
        .env("KILN_LOG", "info")
        .env_remove("NO_COLOR")
        .args([
            "train",
            "recipes/grpo_sequence.yaml",
            "--set",
            "trainer.steps=2",
            "--set",
            "trainer.eval_every=0",
            "--set",
            "sequence.eval_prompts=8",
        ])
        .output()
        .expect("spawn kiln train");
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    assert!(s.contains("INFO"), "info log lines expected: {s}");
    assert!(
        !s.contains('\u{1b}'),
        "colour escapes in piped output: {s:?}"
    );
    let run = only_run_dir(p.path());
    let run_name = run.file_name().unwrap().to_string_lossy().into_owned();
    assert!(run_name.starts_with("grpo_sequence-"), "{run_name}");
    assert!(
        s.contains(&format!("run directory: runs/{run_name}")),
        "{s}"
    );
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    let title = report.lines().next().unwrap_or_default();
    assert_eq!(title, format!("# Run report: {run_name}"), "{report}");
}
