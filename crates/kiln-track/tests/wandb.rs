//! W&B sink checks against the real `wandb==0.31.0` (`wandb leet inspect`, `wandb sync`) and a recording loopback
//! server standing in for the W&B API. Run `just setup-test` (scripts/ci-deps/kiln-track.sh) first.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kiln_track::wandb::proto::RecordType;
use kiln_track::{LoggingConfig, RunInfo, Tracker, WandbConfig, WandbMode};

const API_KEY: &str = "0123456789abcdef0123456789abcdef01234567";

fn offline_cfg() -> LoggingConfig {
    LoggingConfig {
        wandb: WandbConfig {
            mode: Some(WandbMode::Offline),
            project: Some("kiln-test".into()),
            entity: Some("kiln-team".into()),
            group: Some("grpo-sweep".into()),
            job_type: Some("train".into()),
            tags: Some(vec!["search-r2".into(), "smoke".into()]),
            notes: Some("written by kiln-track's tests".into()),
            ..WandbConfig::default()
        },
        plots: false,
        console: kiln_track::ConsoleConfig {
            enabled: false,
            ..Default::default()
        },
        ..LoggingConfig::default()
    }
}

fn no_env(_: &str) -> Option<String> {
    None
}

/// Parse JSON that may hold bare NaN / Infinity tokens (as W&B's value_json does) by mapping them to strings.
fn json_lenient(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|_| {
        let fixed = s
            .replace("-Infinity", "\"-Infinity\"")
            .replace("Infinity", "\"Infinity\"")
            .replace("NaN", "\"NaN\"");
        let fixed = fixed.replace("\"-\"Infinity\"\"", "\"-Infinity\"");
        serde_json::from_str(&fixed).unwrap_or_else(|e| panic!("not JSON ({e}): {s}"))
    })
}

/// Compare a value printed by wandb with what kiln logged (NaN/inf may come back as numbers or strings).
fn same_value(got: &serde_json::Value, want: f64) -> bool {
    match got {
        serde_json::Value::Number(n) => {
            let g = n.as_f64().unwrap();
            g == want || (g - want).abs() <= 1e-12 * want.abs().max(1.0)
        }
        serde_json::Value::String(s) => {
            let s = s.to_ascii_lowercase();
            (want.is_nan() && s == "nan")
                || (want == f64::INFINITY && (s == "infinity" || s == "inf" || s == "+inf"))
                || (want == f64::NEG_INFINITY && (s == "-infinity" || s == "-inf"))
        }
        _ => false,
    }
}

#[test]
fn offline_run_is_read_back_by_real_wandb() {
    let dir = tempfile::tempdir().unwrap();
    let blob: String = (0..100_000)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    let config = serde_json::json!({
        "name": "wandb-offline",
        "trainer": {"steps": 200, "group_size": 8},
        "optim": {"lr": 3e-6, "betas": [0.9, 0.999]},
        "blob": blob,
    });
    let mut tracker = Tracker::open_with_env(
        &offline_cfg(),
        RunInfo {
            run_dir: dir.path(),
            name: "wandb-offline",
            config: &config,
            resume_from_step: None,
        },
        &no_env,
    )
    .unwrap();
    for step in 1..=200 {
        tracker.log(step, &metrics(step));
    }
    let summary = tracker.summary().clone();
    tracker.finish(0).unwrap();

    let file = find_wandb_file(dir.path());
    let name = file
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(name.starts_with("offline-run-"), "{name}");
    assert!(file.parent().unwrap().join("files").is_dir());
    // the 100 kB config spans blocks: the file is larger than 3 blocks
    assert!(std::fs::metadata(&file).unwrap().len() > 3 * 32768);

    // Records, one JSON object per line.
    let out = wandb_cli(&["leet", "inspect", "--json", file.to_str().unwrap()], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "leet inspect stderr: {stderr}"
    );
    let records: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(json_lenient)
        .collect();
    let history: Vec<&serde_json::Value> =
        records.iter().filter(|r| r["type"] == "history").collect();
    assert_eq!(history.len(), 200, "history records");
    for (i, h) in history.iter().enumerate() {
        let step = i as u64 + 1;
        let items = &h["history"]["item"];
        assert!(same_value(&items["_step"], step as f64), "step {step}: {h}");
        for (k, v) in metrics(step) {
            assert!(
                same_value(&items[&k], v),
                "step {step} {k}: want {v}, got {}",
                items[&k]
            );
        }
    }
    let run = records
        .iter()
        .find(|r| r["type"] == "run")
        .expect("run record");
    assert_eq!(
        run["run"]["run_group"], "grpo-sweep",
        "{}",
        run["run"]["run_group"]
    );
    assert_eq!(run["run"]["job_type"], "train");
    assert_eq!(
        run["run"]["tags"],
        serde_json::json!(["search-r2", "smoke"])
    );
    assert_eq!(run["run"]["entity"], "kiln-team");
    assert!(
        records.iter().any(|r| r["type"] == "exit"),
        "no exit record"
    );

    // State, config and summary.
    let out = wandb_cli(
        &[
            "leet",
            "inspect",
            "--json",
            "--summary",
            file.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "leet inspect --summary stderr: {stderr}"
    );
    let s = json_lenient(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(s["state"], "finished", "{s}");
    assert_eq!(s["exit_code"], 0);
    assert_eq!(s["step"], 200);
    assert_eq!(s["project"], "kiln-test");
    assert_eq!(s["name"], "wandb-offline");
    assert_eq!(s["config"], config, "config differs");
    let got = s["summary"].as_object().expect("summary object");
    assert_eq!(got.len(), summary.len(), "summary keys: {got:?}");
    for (k, v) in &summary {
        assert!(
            same_value(&got[k], *v),
            "summary {k}: want {v}, got {}",
            got[k]
        );
    }
}

/// The child half of `sigkill_mid_run_leaves_a_readable_file`: logs steps slowly until killed.
#[test]
fn zz_crash_child_helper() {
    let Ok(dir) = std::env::var("KILN_TRACK_CRASH_CHILD") else {
        return; // only does something when started by the crash test
    };
    let config = serde_json::json!({"name": "crash"});
    let mut tracker = Tracker::open_with_env(
        &offline_cfg(),
        RunInfo {
            run_dir: Path::new(&dir),
            name: "crash",
            config: &config,
            resume_from_step: None,
        },
        &no_env,
    )
    .unwrap();
    for step in 1..=100_000 {
        tracker.log(step, &metrics(step));
        println!("logged {step}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sigkill_mid_run_leaves_a_readable_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "zz_crash_child_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KILN_TRACK_CRASH_CHILD", dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut last = 0u64;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while last < 40 {
        let line = lines.next().expect("child ended early").unwrap();
        if let Some(n) = line.strip_prefix("logged ") {
            last = n.trim().parse().unwrap();
        }
    }
    child.kill().unwrap(); // SIGKILL: no destructor, no exit record
    child.wait().unwrap();

    let file = find_wandb_file(dir.path());
    let out = wandb_cli(&["leet", "inspect", "--json", file.to_str().unwrap()], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "leet inspect stderr after SIGKILL: {stderr}"
    );
    let steps: Vec<u64> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(json_lenient)
        .filter(|r| r["type"] == "history")
        .map(|r| r["history"]["item"]["_step"].as_u64().unwrap())
        .collect();
    assert!(
        steps.len() as u64 >= last,
        "{} history rows, child had logged {last}",
        steps.len()
    );
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
    let rows = kiln_track::read_metrics(&dir.path().join("metrics.jsonl")).unwrap();
    assert!(rows.len() as u64 >= last);
}

#[test]
fn drop_without_finish_writes_a_failed_exit() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"name": "panics"});
    let d = dir.path().to_path_buf();
    let r = std::panic::catch_unwind(move || {
        let mut t = Tracker::open_with_env(
            &offline_cfg(),
            RunInfo {
                run_dir: &d,
                name: "panics",
                config: &config,
                resume_from_step: None,
            },
            &no_env,
        )
        .unwrap();
        t.log(1, &metrics(1));
        panic!("trainer blew up");
    });
    assert!(r.is_err());
    let recs = read_wandb_records(&find_wandb_file(dir.path()));
    match &recs.last().unwrap().record_type {
        Some(RecordType::Exit(e)) => assert_ne!(e.exit_code, 0),
        other => panic!("last record is not an exit: {other:?}"),
    }
    assert!(
        recs.iter()
            .any(|r| matches!(r.record_type, Some(RecordType::Summary(_))))
    );
}

fn online_cfg(base_url: &str, finish_timeout: f64) -> LoggingConfig {
    let mut cfg = offline_cfg();
    cfg.wandb.mode = Some(WandbMode::Online);
    cfg.wandb.base_url = Some(base_url.into());
    cfg.wandb.run_id = Some("kilnrun1".into());
    cfg.wandb.stream_interval_secs = Some(0.02);
    cfg.wandb.finish_timeout_secs = Some(finish_timeout);
    cfg
}

fn key_env(k: &str) -> Option<String> {
    (k == "WANDB_API_KEY").then(|| API_KEY.to_string())
}

/// Concatenate the history lines of every file_stream request, checking that offsets are contiguous.
fn streamed_history(reqs: &[Received]) -> Vec<String> {
    streamed_history_at(reqs, 0)
}

/// [`streamed_history`] for a server that already holds `base` lines (placeholders here).
fn streamed_history_at(reqs: &[Received], base: usize) -> Vec<String> {
    let mut lines: Vec<String> = vec![String::new(); base];
    for r in reqs.iter().filter(|r| r.path.ends_with("/file_stream")) {
        let body = r.json();
        if let Some(h) = body["files"].get("wandb-history.jsonl") {
            let offset = h["offset"].as_u64().unwrap() as usize;
            let content: Vec<String> = h["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_str().unwrap().to_string())
                .collect();
            // a retried batch may be re-sent; it must land at the same place
            assert!(
                offset <= lines.len(),
                "gap: offset {offset} after {} lines",
                lines.len()
            );
            lines.truncate(offset);
            lines.extend(content);
        }
    }
    lines
}

fn step_of(line: &str) -> u64 {
    json_lenient(line)["_step"].as_u64().unwrap()
}

#[test]
fn online_streams_to_server_and_wandb_sync_uploads_offline_dir() {
    let server = FakeWandb::start();
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"name": "online", "optim": {"lr": 3e-6}});
    let (_, logs) = capture_logs(|| {
        let mut t = Tracker::open_with_env(
            &online_cfg(&server.base_url(), 20.0),
            RunInfo {
                run_dir: dir.path(),
                name: "online",
                config: &config,
                resume_from_step: None,
            },
            &key_env,
        )
        .unwrap();
        for step in 1..=60 {
            t.log(step, &metrics(step));
            if step % 10 == 0 {
                std::thread::sleep(Duration::from_millis(30));
            }
        }
        t.finish(0).unwrap();
    });
    assert!(!logs.contains("WARN"), "{logs}");
    assert!(
        logs.contains(&format!(
            "{}/kiln-team/kiln-test/runs/kilnrun1",
            server.base_url()
        )),
        "run URL: {logs}"
    );
    let reqs = server.received();
    let upsert = reqs
        .iter()
        .find(|r| r.operation().as_deref() == Some("UpsertBucket"))
        .expect("UpsertBucket");
    let expected_auth = format!("Basic {}", base64_api_key());
    assert_eq!(upsert.headers.get("authorization"), Some(&expected_auth));
    let v = &upsert.json()["variables"];
    assert_eq!(v["name"], "kilnrun1");
    assert_eq!(v["project"], "kiln-test");
    assert_eq!(v["entity"], "kiln-team");
    assert_eq!(v["displayName"], "online");
    assert_eq!(v["groupName"], "grpo-sweep");
    assert_eq!(v["jobType"], "train");
    assert_eq!(v["tags"], serde_json::json!(["search-r2", "smoke"]));
    let cfg: serde_json::Value = serde_json::from_str(v["config"].as_str().unwrap()).unwrap();
    assert_eq!(
        cfg,
        serde_json::json!({"name": {"value": "online"}, "optim": {"value": {"lr": 3e-6}}})
    );
    let lines = streamed_history(&reqs);
    assert_eq!(
        lines.iter().map(|l| step_of(l)).collect::<Vec<_>>(),
        (1..=60).collect::<Vec<_>>()
    );
    assert!(
        lines[6].contains("NaN") && lines[6].contains("Infinity"),
        "{}",
        lines[6]
    );
    let last = reqs
        .iter()
        .rev()
        .find(|r| r.path.ends_with("/file_stream"))
        .unwrap()
        .json();
    assert_eq!(last["complete"], true);
    assert_eq!(last["exitcode"], 0);
    assert!(
        reqs.iter()
            .filter(|r| r.path.ends_with("/file_stream"))
            .all(|r| r.path == "/files/kiln-team/kiln-test/kilnrun1/file_stream")
    );

    // The real `wandb sync` uploads kiln's offline directory: every history line must arrive.
    let sync_server = FakeWandb::start();
    let offline_dir = find_wandb_file(dir.path()).parent().unwrap().to_path_buf();
    let out = wandb_cli(
        &["sync", offline_dir.to_str().unwrap()],
        &[
            ("WANDB_BASE_URL", &sync_server.base_url()),
            ("WANDB_API_KEY", API_KEY),
        ],
    );
    let reqs = sync_server.received();
    let lines = streamed_history(&reqs);
    assert_eq!(
        lines.iter().map(|l| step_of(l)).collect::<Vec<_>>(),
        (1..=60).collect::<Vec<_>>(),
        "wandb sync output: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let last = reqs
        .iter()
        .rev()
        .find(|r| r.path.ends_with("/file_stream"))
        .unwrap()
        .json();
    assert_eq!(last["complete"], true);
    assert_eq!(last["exitcode"], 0);
}

fn base64_api_key() -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(format!("api:{API_KEY}"))
}

/// Log `steps` rows against a misbehaving server; returns (seconds spent in `log` calls, captured logs).
fn run_against(
    base_url: &str,
    dir: &Path,
    steps: u64,
    pause_every: u64,
    finish_timeout: f64,
) -> (f64, String) {
    let config = serde_json::json!({"name": "flaky"});
    let (spent, logs) = capture_logs(|| {
        let mut t = Tracker::open_with_env(
            &online_cfg(base_url, finish_timeout),
            RunInfo {
                run_dir: dir,
                name: "flaky",
                config: &config,
                resume_from_step: None,
            },
            &key_env,
        )
        .unwrap();
        let mut spent = 0.0;
        for step in 1..=steps {
            let t0 = Instant::now();
            t.log(step, &metrics(step));
            spent += t0.elapsed().as_secs_f64();
            if step % pause_every == 0 {
                std::thread::sleep(Duration::from_millis(40));
            }
        }
        t.finish(0).unwrap();
        spent
    });
    (spent, logs)
}

fn assert_offline_complete(dir: &Path, steps: u64) {
    let recs = read_wandb_records(&find_wandb_file(dir));
    let hist = recs
        .iter()
        .filter(|r| matches!(r.record_type, Some(RecordType::History(_))))
        .count();
    assert_eq!(hist as u64, steps, "offline history rows");
    match &recs.last().unwrap().record_type {
        Some(RecordType::Exit(e)) => assert_eq!(e.exit_code, 0),
        other => panic!("last record is not an exit: {other:?}"),
    }
}

fn count(logs: &str, needle: &str) -> usize {
    logs.lines()
        .filter(|l| l.contains("WARN") && l.contains(needle))
        .count()
}

#[test]
fn server_down_at_start_warns_once_and_keeps_the_offline_file() {
    // a port that was just free: connections are refused
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let (spent, logs) = run_against(
        &format!("http://127.0.0.1:{port}"),
        dir.path(),
        100,
        20,
        0.5,
    );
    assert!(
        spent < 2.0,
        "logging blocked on the network: {spent:.2} s in log()"
    );
    assert_eq!(count(&logs, "streaming to"), 1, "{logs}");
    assert_eq!(count(&logs, "gave up"), 1, "{logs}");
    assert_offline_complete(dir.path(), 100);
}

#[test]
fn server_dying_mid_run_warns_once_and_keeps_the_offline_file() {
    // UpsertBucket + 1 batch, then connection refused: the final `complete` request can never arrive
    let server = FakeWandb::start_with(Some(2));
    let dir = tempfile::tempdir().unwrap();
    let (spent, logs) = run_against(&server.base_url(), dir.path(), 80, 10, 0.5);
    assert!(
        spent < 2.0,
        "logging blocked on the network: {spent:.2} s in log()"
    );
    assert_eq!(count(&logs, "streaming to"), 1, "{logs}");
    assert_offline_complete(dir.path(), 80);
    let reqs = server.received();
    assert!(reqs.iter().all(|r| r.json().get("complete").is_none()));
    let lines = streamed_history(&reqs);
    assert!(
        !lines.is_empty() && lines.len() <= 80,
        "{} lines arrived",
        lines.len()
    );
    assert_eq!(
        lines.iter().map(|l| step_of(l)).collect::<Vec<_>>(),
        (1..=lines.len() as u64).collect::<Vec<_>>()
    );
}

#[test]
fn http_500s_are_retried_until_everything_arrives() {
    let server = FakeWandb::start();
    server
        .fail_status
        .store(500, std::sync::atomic::Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let url = server.base_url();
    let fail = server.fail_status.clone();
    let healer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(600));
        fail.store(0, std::sync::atomic::Ordering::SeqCst);
    });
    let (spent, logs) = run_against(&url, dir.path(), 60, 10, 20.0);
    healer.join().unwrap();
    assert!(
        spent < 2.0,
        "logging blocked on the network: {spent:.2} s in log()"
    );
    assert_eq!(count(&logs, "streaming to"), 1, "{logs}");
    assert_offline_complete(dir.path(), 60);
    let reqs = server.received();
    assert!(
        reqs.iter()
            .any(|r| r.operation().as_deref() == Some("UpsertBucket"))
    );
    let ok: Vec<Received> = reqs.into_iter().collect();
    let lines = streamed_history(&ok);
    assert_eq!(
        lines.iter().map(|l| step_of(l)).collect::<Vec<_>>(),
        (1..=60).collect::<Vec<_>>()
    );
    let last = ok
        .iter()
        .rev()
        .find(|r| r.path.ends_with("/file_stream"))
        .unwrap()
        .json();
    assert_eq!(last["complete"], true);
}

#[test]
fn env_settings_apply_and_recipe_overrides_them() {
    let env = |k: &str| -> Option<String> {
        match k {
            "WANDB_MODE" => Some("offline".into()),
            "WANDB_PROJECT" => Some("from-env".into()),
            "WANDB_ENTITY" => Some("env-entity".into()),
            "WANDB_TAGS" => Some("a, b,,c".into()),
            "WANDB_RUN_GROUP" => Some("env-group".into()),
            "WANDB_JOB_TYPE" => Some("eval".into()),
            "WANDB_NOTES" => Some("env notes".into()),
            "WANDB_NAME" => Some("env-name".into()),
            "WANDB_RUN_ID" => Some("envid123".into()),
            "WANDB_DIR" => Some("/tmp/wandb-dir".into()),
            "WANDB_BASE_URL" => Some("http://example.invalid/".into()),
            _ => None,
        }
    };
    let s = kiln_track::wandb::WandbSettings::resolve(
        &WandbConfig::default(),
        Path::new("/r"),
        "run",
        &env,
    )
    .unwrap();
    assert_eq!(s.mode, WandbMode::Offline);
    assert_eq!(s.project, "from-env");
    assert_eq!(s.entity.as_deref(), Some("env-entity"));
    assert_eq!(s.tags, vec!["a", "b", "c"]);
    assert_eq!(
        (s.group.as_str(), s.job_type.as_str(), s.notes.as_str()),
        ("env-group", "eval", "env notes")
    );
    assert_eq!(s.name, "env-name");
    assert_eq!(s.run_id.as_deref(), Some("envid123"));
    assert_eq!(s.dir, Path::new("/tmp/wandb-dir"));
    assert_eq!(s.base_url, "http://example.invalid");
    let recipe = WandbConfig {
        mode: Some(WandbMode::Disabled),
        project: Some("recipe-project".into()),
        tags: Some(vec![]),
        ..WandbConfig::default()
    };
    let s =
        kiln_track::wandb::WandbSettings::resolve(&recipe, Path::new("/r"), "run", &env).unwrap();
    assert_eq!(
        (s.mode, s.project.as_str(), s.tags.len()),
        (WandbMode::Disabled, "recipe-project", 0)
    );
    // online without an API key falls back to offline
    let online = WandbConfig {
        mode: Some(WandbMode::Online),
        ..WandbConfig::default()
    };
    let s = kiln_track::wandb::WandbSettings::resolve(&online, Path::new("/r"), "run", &no_env)
        .unwrap();
    assert_eq!(
        (
            s.mode,
            s.project.as_str(),
            s.name.as_str(),
            s.job_type.as_str()
        ),
        (WandbMode::Offline, "kiln", "run", "train")
    );
    let bad = |k: &str| (k == "WANDB_MODE").then(|| "sometimes".to_string());
    let err = kiln_track::wandb::WandbSettings::resolve(
        &WandbConfig::default(),
        Path::new("/r"),
        "run",
        &bad,
    );
    assert!(err.unwrap_err().to_string().contains("WANDB_MODE"));
}

#[test]
fn resumed_run_continues_the_same_wandb_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = serde_json::json!({"name": "resumed"});
    let open = |cfg: &LoggingConfig, resume: Option<u64>| {
        Tracker::open_with_env(
            cfg,
            RunInfo {
                run_dir: dir.path(),
                name: "resumed",
                config: &config,
                resume_from_step: resume,
            },
            &key_env,
        )
        .unwrap()
    };
    // first session: offline, 30 steps, then "crashes" after a checkpoint at step 20
    let mut cfg = offline_cfg();
    cfg.wandb.run_id = Some("kilnrun1".into());
    let mut t = open(&cfg, None);
    for step in 1..=30 {
        t.log(step, &metrics(step));
    }
    drop(t);
    // second session: online, resumes from step 20
    let server = FakeWandb::start();
    let mut t = open(&online_cfg(&server.base_url(), 20.0), Some(20));
    for step in 21..=40 {
        t.log(step, &metrics(step));
    }
    t.finish(0).unwrap();

    let wandb_dir = dir.path().join("wandb");
    let names: Vec<String> = std::fs::read_dir(&wandb_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("offline-run-"))
        .collect();
    assert_eq!(
        names
            .iter()
            .filter(|n| n.starts_with("superseded-offline-run-"))
            .count(),
        1,
        "{names:?}"
    );
    let newest = wandb_dir.join(
        names
            .iter()
            .find(|n| n.starts_with("offline-run-"))
            .unwrap(),
    );
    let file = find_wandb_file(&newest);
    let out = wandb_cli(
        &[
            "leet",
            "inspect",
            "--json",
            "--summary",
            file.to_str().unwrap(),
        ],
        &[],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "{stderr}");
    let s = json_lenient(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(
        (s["state"].as_str(), s["step"].as_u64()),
        (Some("finished"), Some(40)),
        "{s}"
    );
    let steps: Vec<u64> = read_wandb_records(&file)
        .iter()
        .filter_map(|r| match &r.record_type {
            Some(RecordType::History(h)) => Some(h.step.as_ref().unwrap().num as u64),
            _ => None,
        })
        .collect();
    assert_eq!(
        steps,
        (1..=40).collect::<Vec<_>>(),
        "the newest offline dir holds the whole run"
    );
    // online: the new rows replace the server's lines from the resume point on
    let reqs = server.received();
    let first = reqs
        .iter()
        .find(|r| r.path.ends_with("/file_stream"))
        .unwrap()
        .json();
    assert_eq!(first["files"]["wandb-history.jsonl"]["offset"], 20);
    let lines = streamed_history_at(&reqs, 20);
    assert_eq!(lines.len(), 40);
    assert_eq!(
        lines[20..].iter().map(|l| step_of(l)).collect::<Vec<_>>(),
        (21..=40).collect::<Vec<_>>()
    );
}
