//! Graceful shutdown on SIGTERM: `serve(.., shutdown_signal())` returns cleanly (in its own test binary, because
//! it signals the whole test process).

#![cfg(unix)]

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_retrieval::server::{ServerConfig, serve, shutdown_signal};
use kiln_retrieval::{BuildOptions, IndexRetriever, Retriever, build_index};

#[test]
fn sigterm_stops_the_server_gracefully() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("c.jsonl");
    let mut f = std::fs::File::create(&corpus).unwrap();
    writeln!(
        f,
        r#"{{"id":"1","title":"Kiln","text":"A kiln fires pottery."}}"#
    )
    .unwrap();
    drop(f);
    let idx = dir.path().join("idx");
    let opts = BuildOptions {
        progress: false,
        threads: 1,
        ..Default::default()
    };
    build_index(&[corpus], &idx, &opts).unwrap();
    let r: Arc<dyn Retriever> = Arc::new(IndexRetriever::open(&idx).unwrap());

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(listener).unwrap();
            serve(l, r, ServerConfig::default(), shutdown_signal()).await
        })
    });
    let client = reqwest::blocking::Client::new();
    let url = format!("http://{addr}/retrieve");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ok = client
            .post(&url)
            .json(
                &serde_json::json!({"queries": ["kiln pottery"], "topk": 1, "return_scores": true}),
            )
            .send()
            .map(|r| r.status().is_success())
            .unwrap_or(false);
        if ok {
            break;
        }
        assert!(Instant::now() < deadline, "server did not come up");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The signal handlers are registered once the shutdown future has been polled, which happens before serving.
    std::thread::sleep(Duration::from_millis(100));
    let st = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while !server.is_finished() {
        assert!(
            Instant::now() < deadline,
            "server did not stop after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server.join().unwrap().unwrap();
    assert!(client.get(format!("http://{addr}/health")).send().is_err());
}
