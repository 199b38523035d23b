//! The retrieval server's connection and response limits against hostile clients on loopback: slowloris heads,
//! idle connections beyond the cap, slow bodies, a bad token with a huge declared body, answers over the size
//! bounds, and clients that never read. Each server gets test-sized timeouts so every test ends in a few seconds.
//!
//! The retriever is a stub that returns passages of a chosen size (the limits do not depend on BM25).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_retrieval::bench::{health_probe, open_idle_connections, still_open};
use kiln_retrieval::server::{ServerConfig, ServerHandle, spawn};
use kiln_retrieval::{Error, Passage, Retriever};

/// Answers every query with `k` passages whose text is `text_bytes` bytes long.
struct Stub {
    text_bytes: usize,
}

impl Retriever for Stub {
    fn search_batch(&self, queries: &[String], k: usize) -> Result<Vec<Vec<Passage>>, Error> {
        Ok(queries
            .iter()
            .map(|_| {
                (0..k)
                    .map(|i| Passage {
                        id: i.to_string(),
                        title: "T".into(),
                        text: "x".repeat(self.text_bytes),
                        score: 1.0,
                    })
                    .collect()
            })
            .collect())
    }

    fn passage_count(&self) -> Option<u64> {
        Some(1)
    }
}

fn start(cfg: ServerConfig, text_bytes: usize) -> ServerHandle {
    spawn(
        Arc::new(Stub { text_bytes }),
        cfg,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        2,
    )
    .expect("server starts")
}

/// Reads what the server sends until it closes the connection or `limit` passes; (bytes, closed).
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    let deadline = Instant::now() + limit;
    let mut out = Vec::new();
    let mut buf = [0u8; 65536];
    while Instant::now() < deadline {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return (out, true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return (out, true),
        }
    }
    (out, false)
}

fn status_line(resp: &[u8]) -> String {
    String::from_utf8_lossy(resp)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

fn json_body(resp: &[u8]) -> serde_json::Value {
    let text = String::from_utf8_lossy(resp);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not a JSON body ({e}): {text}"))
}

fn post(url: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = reqwest::blocking::Client::new()
        .post(url)
        .json(&body)
        .timeout(Duration::from_secs(20))
        .send()
        .expect("request answered");
    let status = r.status().as_u16();
    (status, r.json().expect("JSON answer"))
}

fn queries(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("question {i}")).collect()
}

#[test]
fn slowloris_head_is_cut_off_after_the_header_timeout() {
    let h = start(
        ServerConfig {
            header_read_timeout: Duration::from_millis(300),
            ..Default::default()
        },
        10,
    );
    let mut s = TcpStream::connect(h.addr()).unwrap();
    s.set_nodelay(true).unwrap();
    let head = b"POST /retrieve HTTP/1.1\r\nHost: kiln\r\nX-Padding: ";
    let t = Instant::now();
    let mut closed = false;
    // One byte every 50 ms: each byte is progress, but the head as a whole is late.
    'send: for i in 0..100 {
        let byte = [*head.get(i).unwrap_or(&b'a')];
        if s.write_all(&byte).is_err() {
            closed = true;
            break;
        }
        let stop = Instant::now() + Duration::from_millis(50);
        while Instant::now() < stop {
            let (_, c) = read_until_closed(&mut s, Duration::from_millis(50));
            if c {
                closed = true;
                break 'send;
            }
        }
    }
    let took = t.elapsed();
    assert!(closed, "a head trickled for {took:?} was never cut off");
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "cut off after {took:?}, expected about 300 ms"
    );
    // The server is still fine.
    assert!(health_probe(h.addr()).is_some());
}

#[test]
fn idle_connections_beyond_the_cap_are_shed_and_health_answers_at_once() {
    let h = start(
        ServerConfig {
            max_connections: 16,
            ..Default::default()
        },
        10,
    );
    let idle = open_idle_connections(h.addr(), 64);
    assert_eq!(idle.len(), 64);
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..5 {
        let ms = health_probe(h.addr()).expect("/health answers with 64 idle connections open");
        assert!(ms < 1000.0, "/health took {ms:.1} ms");
    }
    std::thread::sleep(Duration::from_millis(100));
    let open = still_open(&idle);
    assert!(
        open <= 16,
        "{open} of 64 idle connections still open with max_connections = 16"
    );
}

#[test]
fn slow_bodies_get_408_and_a_full_server_answers_503() {
    let h = start(
        ServerConfig {
            max_connections: 2,
            body_timeout: Duration::from_millis(500),
            ..Default::default()
        },
        10,
    );
    // Two requests whose bodies stall: both connections are busy (a request is being handled).
    let mut slow: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(h.addr()).unwrap();
            s.write_all(
                b"POST /retrieve HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\n\
                  Content-Length: 100\r\n\r\n{\"queries\":",
            )
            .unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(150));
    let mut third = TcpStream::connect(h.addr()).unwrap();
    let (resp, closed) = read_until_closed(&mut third, Duration::from_secs(2));
    assert!(closed, "refused connection left open");
    assert_eq!(status_line(&resp), "HTTP/1.1 503 Service Unavailable");
    assert!(
        json_body(&resp)["error"]
            .as_str()
            .unwrap()
            .contains("max-connections")
    );
    let t = Instant::now();
    for s in &mut slow {
        let (resp, _) = read_until_closed(s, Duration::from_secs(3));
        assert_eq!(status_line(&resp), "HTTP/1.1 408 Request Timeout");
        assert!(
            json_body(&resp)["error"]
                .as_str()
                .unwrap()
                .contains("body_timeout")
        );
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "408 after {:?}",
        t.elapsed()
    );
    // The slots are free again.
    assert!(health_probe(h.addr()).is_some());
}

#[test]
fn the_token_is_checked_before_the_body_is_read() {
    let h = start(
        ServerConfig {
            token: Some("s3cret".into()),
            ..Default::default()
        },
        10,
    );
    // Headers announcing 8 MiB, then nothing: the answer must come from the headers alone.
    for (auth, expect) in [
        (
            "Authorization: Bearer wrong\r\n",
            "HTTP/1.1 401 Unauthorized",
        ),
        ("", "HTTP/1.1 401 Unauthorized"),
        (
            "Authorization: Bearer s3cret\r\n",
            "HTTP/1.1 413 Payload Too Large",
        ),
    ] {
        let len = if expect.contains("413") {
            9 << 20
        } else {
            8 << 20
        };
        let mut s = TcpStream::connect(h.addr()).unwrap();
        let t = Instant::now();
        write!(
            s,
            "POST /retrieve HTTP/1.1\r\nHost: kiln\r\n{auth}Content-Type: application/json\r\n\
             Content-Length: {len}\r\n\r\n"
        )
        .unwrap();
        let (resp, _) = read_until_closed(&mut s, Duration::from_secs(3));
        assert_eq!(status_line(&resp), expect, "with {auth:?}");
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "answered after {:?}",
            t.elapsed()
        );
        let msg = json_body(&resp)["error"].as_str().unwrap().to_string();
        assert!(
            msg.contains("token") || msg.contains("max_body_bytes"),
            "{msg}"
        );
    }
}

#[test]
fn answers_over_the_size_bounds_get_422_naming_the_limit() {
    let h = start(
        ServerConfig {
            max_results: 1000,
            max_response_bytes: 200_000,
            ..Default::default()
        },
        1000,
    );
    let url = h.retrieve_url();
    let (st, v) = post(
        &url,
        serde_json::json!({"queries": queries(100), "topk": 100}),
    );
    assert_eq!(st, 422, "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(
        msg.contains("max_results = 1000") && msg.contains("--max-results"),
        "{msg}"
    );
    // 500 passages of ~1 KB: within max_results, over max_response_bytes.
    let (st, v) = post(
        &url,
        serde_json::json!({"queries": queries(100), "topk": 5, "return_scores": true}),
    );
    assert_eq!(st, 422, "{v}");
    let msg = v["error"].as_str().unwrap();
    assert!(
        msg.contains("max_response_bytes = 200000") && msg.contains("--max-response-bytes"),
        "{msg}"
    );
    // The server is up and a request within the bounds gets the usual answer.
    let (st, v) = post(
        &url,
        serde_json::json!({"queries": queries(10), "topk": 5, "return_scores": true}),
    );
    assert_eq!(st, 200, "{v}");
    let result = v["result"].as_array().unwrap();
    assert_eq!(result.len(), 10);
    assert_eq!(result[9].as_array().unwrap().len(), 5);
    assert_eq!(result[0][0]["document"]["id"], "0");
    assert_eq!(
        result[0][0]["document"]["contents"].as_str().unwrap().len(),
        "\"T\"\n".len() + 1000
    );
    assert_eq!(result[0][0]["score"], 1.0);
    let (st, v) = post(&url, serde_json::json!({"queries": ["a", "b"], "topk": 2}));
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["result"][1][1]["id"], "1",
        "documents without scores: {v}"
    );
}

/// A connection with a small receive buffer that sends one request and never reads.
fn non_reader(addr: SocketAddr, body: &[u8]) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let s = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.set_recv_buffer_size(4096).unwrap();
        sock.connect(addr).await.unwrap()
    });
    let mut s = s.into_std().unwrap();
    s.set_nonblocking(false).unwrap();
    write!(
        s,
        "POST /retrieve HTTP/1.1\r\nHost: kiln\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(body).unwrap();
    s
}

#[test]
fn clients_that_never_read_are_dropped_and_their_answers_freed() {
    let h = start(
        ServerConfig {
            idle_timeout: Duration::from_millis(1500),
            max_response_bytes: 20 << 20,
            max_pending_response_bytes: 24 << 20,
            ..Default::default()
        },
        64 * 1024,
    );
    // 25 queries x topk 10 x 64 KiB = about 16 MiB: far more than the socket buffers hold.
    let body = serde_json::json!({"queries": queries(25), "topk": 10}).to_string();
    let mut stuck = non_reader(h.addr(), body.as_bytes());
    std::thread::sleep(Duration::from_millis(300));
    // While its answer waits, a second one does not fit in max_pending_response_bytes.
    let (st, v) = post(&h.retrieve_url(), serde_json::from_str(&body).unwrap());
    assert_eq!(st, 503, "{v}");
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("--max-pending-response-bytes"),
        "{v}"
    );
    // After idle_timeout without progress the stuck connection is closed and its answer freed.
    std::thread::sleep(Duration::from_millis(2000));
    let (got, closed) = read_until_closed(&mut stuck, Duration::from_secs(5));
    assert!(closed, "the non-reading client was never dropped");
    assert!(
        got.len() < 8 << 20,
        "the whole answer ({} bytes) was delivered to a client that did not read",
        got.len()
    );
    let (st, v) = post(&h.retrieve_url(), serde_json::from_str(&body).unwrap());
    assert_eq!(st, 200, "{}", v["error"]);
    assert_eq!(v["result"].as_array().unwrap().len(), 25);
}
