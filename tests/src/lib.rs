//! Helpers for the end-to-end tests in `tests/tests/*.rs`, which drive the `kiln` binary as a user
//! would. The binary is found next to the test executable's profile directory
//! (`target/<profile>/kiln`); `just test` builds it first. `KILN_BIN` overrides the path.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ lives in the repo root")
        .to_path_buf()
}

/// Path of the `kiln` binary.
pub fn kiln_bin() -> PathBuf {
    if let Ok(p) = std::env::var("KILN_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/<test-binary>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary inside target/<profile>/deps");
    let bin = profile_dir.join(format!("kiln{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the kiln binary is not built at {}: run `just test` (or `cargo build --release -p kiln-cli` \
         before `cargo test --release`), or set KILN_BIN",
        bin.display()
    );
    bin
}

/// A `kiln` command running in `cwd`.
pub fn kiln(cwd: &Path) -> Command {
    let mut c = Command::new(kiln_bin());
    c.current_dir(cwd);
    c.env("KILN_LOG", "warn");
    c
}

/// Run `kiln args...` in `cwd` and capture its output.
pub fn run_kiln(cwd: &Path, args: &[&str]) -> Output {
    kiln(cwd).args(args).output().expect("spawn kiln")
}

/// stdout + stderr as text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A scratch project directory holding copies of `configs/` and `recipes/` so tests can run recipes
/// with relative paths without writing into the repository.
pub fn scratch_project() -> tempfile::TempDir {
    let d = tempfile::tempdir().expect("tempdir");
    for sub in ["configs", "recipes"] {
        copy_dir(&repo_root().join(sub), &d.path().join(sub));
    }
    d
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for e in std::fs::read_dir(from).expect("read_dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            copy_dir(&p, &to.join(e.file_name()));
        } else {
            std::fs::copy(&p, to.join(e.file_name())).expect("copy");
        }
    }
}

/// Rows of a `metrics.jsonl` (NaN tokens are mapped to null by the tests' reader).
pub fn read_metrics(path: &Path) -> Vec<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let cleaned = l
                .replace("-Infinity", "null")
                .replace("Infinity", "null")
                .replace("NaN", "null");
            match serde_json::from_str::<serde_json::Value>(&cleaned) {
                Ok(serde_json::Value::Object(m)) => m,
                other => panic!("bad metrics line {l:?}: {other:?}"),
            }
        })
        .collect()
}

/// The single run directory under `<project>/runs`.
pub fn only_run_dir(project: &Path) -> PathBuf {
    let runs: Vec<PathBuf> = std::fs::read_dir(project.join("runs"))
        .expect("runs dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(runs.len(), 1, "expected one run dir, got {runs:?}");
    runs[0].clone()
}
