//! Hostile and absurd inputs to the recipe loader and `kiln export` (issue 20): each must be refused
//! promptly with a clear error, never overflow the stack, hang, or damage files.
//!
//! Every probe runs with a deadline: before the fix, the fan-out probe ran forever and the deep
//! `--set` aborted with a stack overflow.

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use kiln_e2e::{kiln, repo_root, scratch_project, text};

/// Run `kiln args...` in `cwd`; panic if it has not finished after `secs` seconds.
fn run_within(cwd: &Path, args: &[&str], secs: u64) -> Output {
    let mut child = kiln(cwd)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn kiln");
    let t0 = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if t0.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kiln {args:?} did not finish within {secs} s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// A refused recipe: exit code 2, no panic, and every `expect` in the output.
fn assert_refused(out: &Output, expect: &[&str]) {
    let t = text(out);
    assert_eq!(out.status.code(), Some(2), "exit code 2 expected:\n{t}");
    assert!(
        !t.contains("panicked") && !t.contains("overflow"),
        "no panic / stack overflow:\n{t}"
    );
    for e in expect {
        assert!(t.contains(e), "`{e}` missing from:\n{t}");
    }
}

#[test]
fn a_60000_deep_set_is_a_depth_error() {
    let project = scratch_project();
    let key = vec!["a"; 60_000].join(".");
    let set = format!("{key}=1");
    let out = run_within(
        project.path(),
        &[
            "train",
            "recipes/grpo_sequence.yaml",
            "--dry-run",
            "--set",
            &set,
        ],
        20,
    );
    assert_refused(&out, &["60000 levels deep", "at most 32 levels"]);
    assert!(text(&out).len() < 2000, "the 120 kB argument is not echoed");
}

#[test]
fn a_20000_key_recipe_is_loaded_and_located() {
    let project = scratch_project();
    let mut yaml = String::from("task: grpo_sequence\n");
    for i in 0..20_000 {
        yaml.push_str(&format!("k{i}: {i}\n"));
    }
    std::fs::write(project.path().join("many.yaml"), yaml).unwrap();
    // a hang guard, not a timing assertion (measured: 18-20 s before the fix, 0.04 s after)
    let out = run_within(project.path(), &["train", "many.yaml", "--dry-run"], 60);
    assert_refused(&out, &["unknown key `k0`", "many.yaml:2:"]);
}

#[test]
fn an_extends_diamond_fan_out_stops_at_the_include_limit() {
    let project = scratch_project();
    let p = project.path();
    // each file extends two copies of the next, 30 levels: 2^30 includes without a limit
    std::fs::write(
        p.join("f0.yaml"),
        "task: grpo_sequence\nextends: [f1.yaml, f1.yaml]\n",
    )
    .unwrap();
    for i in 1..30 {
        std::fs::write(
            p.join(format!("f{i}.yaml")),
            format!("seed: {i}\nextends: [f{n}.yaml, f{n}.yaml]\n", n = i + 1),
        )
        .unwrap();
    }
    std::fs::write(p.join("f30.yaml"), "seed: 30\n").unwrap();
    let out = run_within(p, &["train", "f0.yaml", "--dry-run"], 20);
    assert_refused(
        &out,
        &["more than 256 `extends` includes", ".yaml:2:", "hint:"],
    );
}

#[test]
fn absurd_model_sizes_are_refused_with_the_estimate() {
    let project = scratch_project();
    for set in [
        "model.num_hidden_layers=1000000000000",
        "model.hidden_size=1e9",
        "model.hidden_size=1000000000",
        "sequence.group_size=1000000000000",
    ] {
        let out = run_within(
            project.path(),
            &[
                "train",
                "recipes/grpo_sequence.yaml",
                "--dry-run",
                "--set",
                set,
            ],
            20,
        );
        let field = set.split('=').next().unwrap();
        assert_refused(
            &out,
            &[
                &format!("`{field}`"),
                "ceiling",
                "would need ≈",
                "parameters",
                &format!("--set {set}"),
            ],
        );
    }
    // under every ceiling, but far more than any machine holds
    let out = run_within(
        project.path(),
        &[
            "train",
            "recipes/grpo_sequence.yaml",
            "--dry-run",
            "--set",
            "model.hidden_size=65536",
            "--set",
            "model.num_hidden_layers=1024",
        ],
        20,
    );
    assert_refused(
        &out,
        &["does not fit in memory", "would need ≈", "this machine has"],
    );
}

#[test]
fn dry_run_prints_the_memory_estimate() {
    let project = scratch_project();
    let out = run_within(
        project.path(),
        &["train", "recipes/grpo_sequence.yaml", "--dry-run"],
        20,
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("memory estimate: ≈"), "{t}");
    assert!(t.contains("`model`:") && t.contains("parameters"), "{t}");
}

#[test]
fn unknown_yaml_tags_are_refused() {
    let project = scratch_project();
    std::fs::write(
        project.path().join("bad.yaml"),
        "task: grpo_sequence\ntrainer:\n  steps: !evil 5\n",
    )
    .unwrap();
    let out = run_within(project.path(), &["train", "bad.yaml", "--dry-run"], 20);
    assert_refused(&out, &["bad.yaml:3:", "tag `!evil`", "trainer.steps"]);
    let out = run_within(
        project.path(),
        &[
            "train",
            "recipes/grpo_sequence.yaml",
            "--dry-run",
            "--set",
            "trainer.steps=!evil 5",
        ],
        20,
    );
    assert_refused(&out, &["tag `!evil`"]);
}

/// Every file of `dir` with its bytes.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut v: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (p, b)
        })
        .collect();
    v.sort();
    v
}

#[test]
fn export_never_writes_over_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let m = root.join("m");
    std::fs::create_dir(&m).unwrap();
    let fixture = repo_root().join("crates/kiln-lm/tests/fixtures/tiny-llama");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture.join(f), m.join(f)).unwrap();
    }
    std::fs::write(m.join("tokenizer.json"), "{\"version\": \"1.0\"}\n").unwrap();
    std::fs::write(m.join("tokenizer_config.json"), "{\"bos_token\": null}\n").unwrap();
    let before = snapshot(&m);
    std::os::unix::fs::symlink(&m, root.join("link")).unwrap();
    let m_abs = m.display().to_string();
    for (input, out) in [
        ("m", "m"),
        ("./m", "m/"),
        ("m", "link"),
        ("link", "./m"),
        ("m", "m/new/.."),
        (m_abs.as_str(), "m"),
    ] {
        let o = run_within(root, &["export", input, "--hf", out], 60);
        let t = text(&o);
        assert!(
            !o.status.success(),
            "export {input} --hf {out} succeeded:\n{t}"
        );
        assert!(
            t.contains("refusing to export") && t.contains("input folder"),
            "export {input} --hf {out}:\n{t}"
        );
        assert_eq!(snapshot(&m), before, "export {input} --hf {out} changed m/");
    }
    assert!(!m.join("new").exists(), "nothing was created");

    // an output file that is a link to an input file
    let h = root.join("h");
    std::fs::create_dir(&h).unwrap();
    std::fs::hard_link(m.join("tokenizer.json"), h.join("tokenizer.json")).unwrap();
    let o = run_within(root, &["export", "m", "--hf", "h"], 60);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("a file of the input"), "{}", text(&o));
    assert_eq!(snapshot(&m), before);

    // a real export still works and copies the tokenizer files
    let o = run_within(root, &["export", "m", "--hf", "out"], 60);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(snapshot(&m), before);
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(root.join("out").join(f)).unwrap(),
            std::fs::read(m.join(f)).unwrap()
        );
    }
    assert!(root.join("out/model.safetensors").is_file());
}
