//! A bounded load test of `graft serve` on 127.0.0.1 with the tiny fixture: 10,000
//! requests (text and chat completions, every tenth streamed) from 64 concurrent
//! keep-alive clients, short prompts and 4 to 8 output tokens each. No request may fail,
//! and the server's resident memory after the first 2,000 requests (the warm-up) may
//! not grow by more than a small allowance to the end. The run stops by itself: after
//! the last request, or at a deadline (a failure). `GRAFT_LOAD_REQUESTS=N` runs N requests
//! instead (a soak).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::server::{raw_request, tiny_fixture, Server};
use serde_json::json;

/// Requests unless `GRAFT_LOAD_REQUESTS` says.
const REQUESTS: usize = 10_000;
const CLIENTS: usize = 64;
const WARM_UP: usize = 2_000;
const DEADLINE: Duration = Duration::from_secs(900);
/// Growth of the resident set allowed after the warm-up.
const RSS_ALLOWANCE_KIB: u64 = 16 << 10;

/// One keep-alive connection.
struct Client {
    reader: BufReader<TcpStream>,
    stream: TcpStream,
}

impl Client {
    fn connect(addr: std::net::SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        stream.set_nodelay(true).unwrap();
        Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            stream,
        }
    }

    /// POSTs `body` and reads the answer (Content-Length framed); the status and body.
    fn post(&mut self, path: &str, body: &str) -> std::io::Result<(u16, Vec<u8>)> {
        write!(
            self.stream,
            "POST {path} HTTP/1.1\r\nHost: graft\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut status = String::new();
        self.reader.read_line(&mut status)?;
        let code = status
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let mut len = 0;
        loop {
            let mut line = String::new();
            self.reader.read_line(&mut line)?;
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body)?;
        Ok((code, body))
    }
}

/// The body of request `i`.
fn body(i: usize) -> (&'static str, String) {
    let n = 4 + i % 5;
    match i % 3 {
        0 => (
            "/v1/completions",
            json!({"prompt": format!("Request {i} of the lamp"), "max_tokens": n, "temperature": 0.7, "seed": i, "ignore_eos": true}).to_string(),
        ),
        1 => (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": format!("Hello {}", i % 97)}], "max_tokens": n, "temperature": 0, "ignore_eos": true}).to_string(),
        ),
        _ => (
            "/v1/completions",
            json!({"prompt": [5, 6, 7, (i % 400) + 3], "max_tokens": n, "temperature": 0, "ignore_eos": true}).to_string(),
        ),
    }
}

#[test]
fn ten_thousand_requests_at_concurrency_64() {
    let model = tiny_fixture();
    let s = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--ctx",
        "128",
        "--parallel",
        "64",
        "--max-queue",
        "64",
    ]);
    let requests: usize = std::env::var("GRAFT_LOAD_REQUESTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(REQUESTS);
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let tokens = AtomicU64::new(0);
    let failures = Mutex::new(Vec::new());
    let warm_rss = Mutex::new(None);
    let peak_rss = AtomicU64::new(0);
    let start = Instant::now();
    std::thread::scope(|sc| {
        for _ in 0..CLIENTS {
            sc.spawn(|| {
                let mut client = Client::connect(s.addr);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= requests || start.elapsed() > DEADLINE {
                        break;
                    }
                    let (path, b) = body(i);
                    let (status, answer) = if i % 10 == 9 {
                        let mut v: serde_json::Value = serde_json::from_str(&b).unwrap();
                        v["stream"] = json!(true);
                        let raw = format!(
                            "POST {path} HTTP/1.1\r\nHost: graft\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{v}",
                            v.to_string().len()
                        );
                        let r = raw_request(s.addr, raw.as_bytes());
                        let ok = r.events().last().map(String::as_str) == Some("[DONE]");
                        (if ok { r.status } else { 599 }, Vec::new())
                    } else {
                        match client.post(path, &b) {
                            Ok(r) => r,
                            Err(e) => {
                                client = Client::connect(s.addr);
                                (0, e.to_string().into_bytes())
                            }
                        }
                    };
                    if status != 200 {
                        failures.lock().unwrap().push(format!("{i}: {status} {}", String::from_utf8_lossy(&answer)));
                    } else if !answer.is_empty() {
                        let v: serde_json::Value = serde_json::from_slice(&answer).unwrap();
                        tokens.fetch_add(v["usage"]["completion_tokens"].as_u64().unwrap(), Ordering::Relaxed);
                    }
                    let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                    if d == WARM_UP {
                        *warm_rss.lock().unwrap() = Some(s.rss_kib());
                    } else if d > WARM_UP && d.is_multiple_of(500) {
                        peak_rss.fetch_max(s.rss_kib(), Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let end_rss = s.rss_kib();
    let peak = peak_rss.load(Ordering::Relaxed).max(end_rss);
    let warm = warm_rss.lock().unwrap().expect("the warm-up finished");
    let done = done.load(Ordering::Relaxed);
    eprintln!(
        "{done} requests in {secs:.1} s ({:.0} requests/s, {} tokens generated); RSS after warm-up {} MiB, peak after {} MiB, end {} MiB",
        done as f64 / secs,
        tokens.load(Ordering::Relaxed),
        warm >> 10,
        peak >> 10,
        end_rss >> 10
    );
    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed, e.g. {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_eq!(done, requests, "the deadline of {DEADLINE:?} passed");
    assert!(
        peak <= warm + RSS_ALLOWANCE_KIB,
        "memory grew after the warm-up: {warm} KiB -> {peak} KiB"
    );
    s.wait_metric("graft_requests_running", 0.0, 10);
    s.wait_metric("graft_kv_blocks_used", 0.0, 10);
    eprintln!(
        "batch plans built: {}",
        s.metric("graft_batch_plans_built_total")
    );
}
