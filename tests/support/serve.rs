//! `graft serve` under test: the real binary started on 127.0.0.1 on a free port (the
//! address read from its stderr), and a small HTTP/1.1 client over a plain TcpStream,
//! so that tests can also send what no well-behaved client sends (broken framing,
//! invalid UTF-8, bodies that never end). Included as a module by the tests that need it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The tiny fixture with a tokenizer.json.
pub fn tiny_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama3-tiny-bf16")
}

/// A running server, killed when dropped.
pub struct Server {
    pub child: Child,
    pub addr: SocketAddr,
    /// Every stderr line so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `graft serve --port 0 ARGS` and waits until it is ready.
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_graft"))
            .arg("serve")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the graft binary starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let lines = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("graft serve: listening on http://") {
                    let addr = rest.split_whitespace().next().unwrap().to_string();
                    let _ = tx.send(Ok(addr));
                } else if line.starts_with("graft serve: ready") {
                    let _ = tx.send(Err(()));
                }
                lines.lock().unwrap().push(line);
            }
        });
        let mut addr = None;
        let deadline = Instant::now() + Duration::from_secs(300);
        while Instant::now() < deadline {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(Ok(a)) => addr = Some(a.parse().unwrap()),
                Ok(Err(())) => break,
                Err(_) => {
                    if let Ok(Some(status)) = child.try_wait() {
                        panic!(
                            "graft serve exited with {status}:\n{}",
                            log.lock().unwrap().join("\n")
                        );
                    }
                }
            }
        }
        let addr = addr.expect("graft serve printed its address and got ready");
        Server { child, addr, log }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// A request with a JSON body.
    pub fn post(&self, path: &str, body: &serde_json::Value) -> Response {
        request(self.addr, "POST", path, &[], body.to_string().as_bytes())
    }

    /// A GET.
    pub fn get(&self, path: &str) -> Response {
        request(self.addr, "GET", path, &[], b"")
    }

    /// The value of metric `name` (a line `name value`).
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }

    /// Waits up to `secs` for metric `name` to read `value`.
    pub fn wait_metric(&self, name: &str, value: f64, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        while self.metric(name) != value {
            assert!(
                Instant::now() < deadline,
                "{name} stayed {} (want {value})",
                self.metric(name)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The resident memory of the server process, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/PID/status")
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        // SAFETY: kill(2) with a child's pid and a signal number has no memory effects.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `data:` fields of a server-sent event stream.
    pub fn events(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: ").map(str::to_string))
            .collect()
    }
}

/// Sends one request (`Connection: close`) and reads the whole response.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Response {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" {
        raw.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    raw.push_str("\r\n");
    let mut bytes = raw.into_bytes();
    bytes.extend_from_slice(body);
    raw_request(addr, &bytes)
}

/// Sends `bytes` as they are and reads the response until the server closes.
pub fn raw_request(addr: SocketAddr, bytes: &[u8]) -> Response {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    // a server that answers before reading a large body may close while it is sent
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    parse_response(&out)
}

/// Parses a whole HTTP/1.1 response (chunked or not).
pub fn parse_response(raw: &[u8]) -> Response {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no response head in {:?}", String::from_utf8_lossy(raw)));
    let head = String::from_utf8_lossy(&raw[..end]).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &raw[end + 4..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_vec()
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(nl) = b.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(String::from_utf8_lossy(&b[..nl]).trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = nl + 2;
        let stop = (start + size).min(b.len());
        out.extend_from_slice(&b[start..stop]);
        b = &b[(stop + 2).min(b.len())..];
    }
    out
}

/// A streamed request read event by event.
pub struct Stream {
    reader: BufReader<TcpStream>,
}

impl Stream {
    /// Sends a POST with `body` and reads the response head (200 expected).
    pub fn open(addr: SocketAddr, path: &str, body: &serde_json::Value) -> Stream {
        let body = body.to_string();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut reader = BufReader::new(s);
        let mut status = String::new();
        reader.read_line(&mut status).unwrap();
        assert!(status.contains(" 200 "), "{status}");
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            if line == "\r\n" {
                break;
            }
        }
        Stream { reader }
    }

    /// The next `data:` field (chunk framing skipped), or `None` at the end.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            let mut line = String::new();
            if self.reader.read_line(&mut line).ok()? == 0 {
                return None;
            }
            if let Some(data) = line.trim_end().strip_prefix("data: ") {
                return Some(data.to_string());
            }
        }
    }
}
