//! Shared test helpers: the venv Python (real `wandb` / `tensorboard` packages), a recording loopback HTTP
//! server standing in for the W&B API, and a `.wandb` reader built on kiln's own framing code.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// The Python interpreter with the test packages (`KILN_PYTHON`, default `<repo>/.venv/bin/python`). Fails the
/// test with setup instructions when it or a module is missing, or when wandb is not the pinned 0.31.0.
/// Checked once per test process and module set.
pub fn python(modules: &[&str]) -> PathBuf {
    static CHECKED: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let py = std::env::var_os("KILN_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    let mut check = format!("import {}", modules.join(", "));
    if modules.contains(&"wandb") {
        check.push_str("; assert wandb.__version__ == '0.31.0', 'wandb ' + wandb.__version__ + ' is not 0.31.0'");
    }
    let mut done = CHECKED.lock().unwrap_or_else(|e| e.into_inner());
    if done.contains(&check) {
        return py;
    }
    let out = Command::new(&py).args(["-c", &check]).output();
    let ok = out.as_ref().map(|o| o.status.success()).unwrap_or(false);
    assert!(
        ok,
        "Python test dependencies missing ({}: `{check}` failed: {}). Run `just setup-test` \
         (or `bash scripts/ci-deps/kiln-track.sh`) to install wandb==0.31.0 and tensorboard into .venv",
        py.display(),
        out.map(|o| String::from_utf8_lossy(&o.stderr)
            .lines()
            .last()
            .unwrap_or("")
            .to_string())
            .unwrap_or_else(|e| e.to_string())
    );
    done.push(check);
    py
}

/// Run the real wandb CLI (`python -m wandb ARGS`).
pub fn wandb_cli(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let py = python(&["wandb"]);
    let mut cmd = Command::new(py);
    cmd.args(["-m", "wandb"]).args(args);
    cmd.env("WANDB_ERROR_REPORTING", "false")
        .env("WANDB_SILENT", "true")
        .env("NO_COLOR", "1");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run python -m wandb")
}

/// The one `run-*.wandb` file under `dir` (searched recursively).
pub fn find_wandb_file(dir: &Path) -> PathBuf {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "wandb") {
                found.push(p);
            }
        }
    }
    assert_eq!(
        found.len(),
        1,
        "expected one .wandb file under {}: {found:?}",
        dir.display()
    );
    found.pop().unwrap()
}

/// Decode every record of a `.wandb` file with kiln's reader (for quick structural checks).
pub fn read_wandb_records(path: &Path) -> Vec<kiln_track::wandb::proto::Record> {
    use prost::Message;
    let bytes = std::fs::read(path).unwrap();
    kiln_track::wandb::log::read_records(&bytes)
        .unwrap()
        .iter()
        .map(|r| kiln_track::wandb::proto::Record::decode(r.as_slice()).unwrap())
        .collect()
}

/// One request the server received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Received {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
    pub fn operation(&self) -> Option<String> {
        self.json()
            .get("operationName")
            .and_then(|v| v.as_str())
            .map(str::to_string)
    }
}

/// A loopback HTTP/1.1 server that records requests and answers like a minimal W&B API.
pub struct FakeWandb {
    pub port: u16,
    pub requests: Arc<Mutex<Vec<Received>>>,
    /// Answer every request with this status (e.g. 500) while non-zero.
    pub fail_status: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl FakeWandb {
    pub fn start() -> FakeWandb {
        Self::start_with(None)
    }

    /// `die_after`: stop listening (connections refused from then on) after this many requests.
    pub fn start_with(die_after: Option<usize>) -> FakeWandb {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let requests = Arc::new(Mutex::new(Vec::new()));
        let fail_status = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (rq, fs, st) = (requests.clone(), fail_status.clone(), stop.clone());
        std::thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            let served = Arc::new(AtomicUsize::new(0));
            loop {
                if st.load(Ordering::SeqCst)
                    || die_after.is_some_and(|n| served.load(Ordering::SeqCst) >= n)
                {
                    return; // drops the listener: later connects are refused
                }
                match listener.accept() {
                    Ok((stream, _)) => {
                        stream.set_nonblocking(false).unwrap();
                        let (rq, fs, sv) = (rq.clone(), fs.clone(), served.clone());
                        std::thread::spawn(move || {
                            if handle(stream, &rq, &fs, port) {
                                sv.fetch_add(1, Ordering::SeqCst);
                            }
                        });
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        FakeWandb {
            port,
            requests,
            fail_status,
            stop,
        }
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    pub fn received(&self) -> Vec<Received> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for FakeWandb {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serve one request on a connection (answers `Connection: close`). Returns whether a request was read.
fn handle(
    stream: TcpStream,
    requests: &Mutex<Vec<Received>>,
    fail_status: &AtomicUsize,
    port: u16,
) -> bool {
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return false;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let mut body = Vec::new();
    if let Some(n) = headers
        .get("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        body.resize(n, 0);
        reader.read_exact(&mut body).ok();
    } else if headers
        .get("transfer-encoding")
        .is_some_and(|v| v.contains("chunked"))
    {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok();
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            let mut chunk = vec![0u8; n + 2];
            reader.read_exact(&mut chunk).ok();
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    let rec = Received {
        method,
        path: path.clone(),
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let fail = fail_status.load(Ordering::SeqCst);
    let (status, reply) = if fail != 0 {
        (fail, "{\"error\":\"injected failure\"}".to_string())
    } else {
        (200, answer(&rec, port))
    };
    requests.lock().unwrap().push(rec);
    let mut out = stream;
    let _ = write!(
        out,
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{reply}",
        reply.len()
    );
    let _ = out.flush();
    true
}

fn answer(r: &Received, port: u16) -> String {
    if r.path.ends_with("/file_stream") {
        return r#"{"exitcode":null,"limits":{}}"#.into();
    }
    let v = r.json();
    let op = v
        .get("operationName")
        .and_then(|o| o.as_str())
        .unwrap_or("");
    let vars = &v["variables"];
    match op {
        "UpsertBucket" => {
            let name = vars["name"].as_str().unwrap_or("run");
            let project = vars["project"].as_str().unwrap_or("uncategorized");
            let entity = vars["entity"].as_str().unwrap_or("tester");
            serde_json::json!({"data": {"upsertBucket": {"inserted": true, "bucket": {
                "id": format!("id-{name}"), "name": name, "displayName": vars["displayName"],
                "historyLineCount": 0, "config": vars["config"], "sweepName": null, "description": null,
                "project": {"id": "p1", "name": project, "entity": {"id": "e1", "name": entity}}}}}})
            .to_string()
        }
        // `wandb sync` uploads config.yaml and wandb-summary.json through signed URLs: point them back here.
        "CreateRunFiles" => {
            let files: Vec<serde_json::Value> = vars["files"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(|f| {
                    let name = f.as_str().unwrap_or("file").to_string();
                    serde_json::json!({"name": name, "uploadUrl": format!("http://127.0.0.1:{port}/upload/{name}")})
                })
                .collect();
            serde_json::json!({"data": {"createRunFiles": {"runID": "id-run", "uploadHeaders": [], "files": files}}})
                .to_string()
        }
        "Viewer" => r#"{"data":{"viewer":{"id":"u1","entity":"tester","username":"tester","flags":null,"teams":{"edges":[]}}}}"#.into(),
        _ => r#"{"data":{}}"#.into(),
    }
}

/// Captured `tracing` output (text, no colours) of everything run inside [`capture_logs`].
pub fn capture_logs<R>(f: impl FnOnce() -> R) -> (R, String) {
    #[derive(Clone)]
    struct W(Arc<Mutex<Vec<u8>>>);
    impl Write for W {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Arc::new(Mutex::new(Vec::new()));
    let w = W(buf.clone());
    let sub = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(move || w.clone())
        .finish();
    let r = tracing::subscriber::with_default(sub, f);
    let text = String::from_utf8_lossy(&buf.lock().unwrap()).into_owned();
    (r, text)
}

/// Metrics of a synthetic step; `nan_at` steps get NaN / +inf / -inf values.
pub fn metrics(step: u64) -> BTreeMap<String, f64> {
    let t = step as f64;
    let mut m: BTreeMap<String, f64> = [
        ("reward/mean", 0.2 + 0.001 * t),
        ("kl/approx", 1e-4 * t),
        ("entropy", 1.5 - 0.002 * t),
        ("response_len/mean", 100.0 + t),
        ("clip_frac", 0.05),
        ("lr", 3e-6),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), *v))
    .collect();
    if step % 50 == 7 {
        m.insert("loss/policy".into(), f64::NAN);
        m.insert("grad_norm".into(), f64::INFINITY);
        m.insert("adv/mean".into(), f64::NEG_INFINITY);
    } else {
        m.insert("loss/policy".into(), -0.01 * t);
        m.insert("grad_norm".into(), 1.0 / t);
        m.insert("adv/mean".into(), 0.0);
    }
    if step.is_multiple_of(25) {
        m.insert("eval/exact_match".into(), 0.001 * t);
    }
    m
}
