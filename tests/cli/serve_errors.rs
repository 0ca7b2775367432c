//! `graft serve` against a corpus of bad requests: broken JSON, wrong types, huge,
//! negative and non-finite numbers, unknown fields, unknown roles and models, fields of
//! the other endpoint, bodies over the limit, invalid UTF-8, wrong methods and paths, a
//! slow client, clients that hang up mid-stream. Each gets the right status and an
//! error in the OpenAI shape (`{"error": {"message", "type", "param", "code"}}`), the
//! server stays up, and a normal request afterwards gets the same answer as before.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::server::{raw_request, request, tiny_fixture, Response, Server, Stream};
use serde_json::{json, Value};

/// One bad request and what it must get.
struct Case {
    method: &'static str,
    path: &'static str,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
    param: Option<&'static str>,
}

const CHAT: &str = "/v1/chat/completions";
const COMP: &str = "/v1/completions";

fn case(
    path: &'static str,
    body: &str,
    status: u16,
    code: &'static str,
    param: Option<&'static str>,
) -> Case {
    Case {
        method: "POST",
        path,
        body: body.as_bytes().to_vec(),
        status,
        code,
        param,
    }
}

/// A chat body of one user message, with `extra` fields.
fn chat_with(extra: &str) -> String {
    format!(r#"{{"messages": [{{"role": "user", "content": "hi"}}]{extra}}}"#)
}

/// A completions body with `extra` fields.
fn comp_with(extra: &str) -> String {
    format!(r#"{{"prompt": "hi"{extra}}}"#)
}

fn corpus() -> Vec<Case> {
    let bad = |body: &str| case(CHAT, body, 400, "invalid_json", None);
    let chat = |extra: &str, code, param| case(CHAT, &chat_with(extra), 400, code, Some(param));
    let comp = |extra: &str, code, param| case(COMP, &comp_with(extra), 400, code, Some(param));
    let nested = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    // a Value field nested past serde_json's recursion limit
    let deep_field = format!(r#"{{"prompt": {nested}}}"#);
    let mut v = vec![
        // broken JSON
        bad("{"),
        bad("[1,"),
        bad(""),
        bad("nul"),
        bad("{} {}"),
        bad("{'messages': []}"),
        bad(r#"{"messages": [}"#),
        bad(r#"{"max_tokens": 1,}"#),
        bad(r#"{"temperature": NaN}"#),
        bad(r#"{"temperature": Infinity}"#),
        bad(r#"{"temperature": -Infinity}"#),
        bad(r#"{"max_tokens": 1e400}"#),
        case(COMP, &deep_field, 400, "invalid_json", None),
        bad("\u{0}"),
        // the body is not an object
        case(CHAT, "[]", 400, "invalid_type", None),
        bad(&nested),
        case(CHAT, "\"hello\"", 400, "invalid_type", None),
        case(COMP, "42", 400, "invalid_type", None),
        // wrong types
        case(
            CHAT,
            r#"{"messages": "hi"}"#,
            400,
            "invalid_type",
            Some("messages"),
        ),
        case(
            CHAT,
            r#"{"messages": ["hi"]}"#,
            400,
            "invalid_type",
            Some("messages[0]"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": 1, "content": "x"}]}"#,
            400,
            "invalid_type",
            Some("messages[0].role"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            400,
            "invalid_type",
            Some("messages[0].content"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#,
            400,
            "invalid_type",
            Some("messages[0].content[0]"),
        ),
        chat(r#", "temperature": "hot""#, "invalid_type", "temperature"),
        chat(r#", "max_tokens": "10""#, "invalid_type", "max_tokens"),
        chat(r#", "stream": "yes""#, "invalid_type", "stream"),
        chat(r#", "stop": 7"#, "invalid_type", "stop"),
        chat(r#", "stop": [1]"#, "invalid_type", "stop[0]"),
        chat(r#", "seed": "x""#, "invalid_type", "seed"),
        chat(r#", "n": "1""#, "invalid_type", "n"),
        chat(r#", "logprobs": 3"#, "invalid_type", "logprobs"),
        chat(r#", "logit_bias": [1]"#, "invalid_type", "logit_bias"),
        chat(
            r#", "stream_options": true, "stream": true"#,
            "invalid_type",
            "stream_options",
        ),
        comp(r#", "logprobs": true"#, "invalid_type", "logprobs"),
        case(
            COMP,
            r#"{"prompt": {"text": "hi"}}"#,
            400,
            "invalid_type",
            Some("prompt"),
        ),
        case(
            COMP,
            r#"{"prompt": [1.5, 2]}"#,
            400,
            "invalid_value",
            Some("prompt[0]"),
        ),
        case(
            COMP,
            r#"{"prompt": [-1]}"#,
            400,
            "invalid_value",
            Some("prompt[0]"),
        ),
        // out of range, huge and negative numbers
        chat(r#", "temperature": 3"#, "invalid_value", "temperature"),
        chat(r#", "temperature": -0.5"#, "invalid_value", "temperature"),
        chat(r#", "temperature": 1e300"#, "invalid_value", "temperature"),
        chat(r#", "top_p": 1.5"#, "invalid_value", "top_p"),
        chat(r#", "top_p": -0.1"#, "invalid_value", "top_p"),
        chat(r#", "min_p": 2"#, "invalid_value", "min_p"),
        chat(
            r#", "presence_penalty": 2.5"#,
            "invalid_value",
            "presence_penalty",
        ),
        chat(
            r#", "frequency_penalty": -9"#,
            "invalid_value",
            "frequency_penalty",
        ),
        chat(
            r#", "repeat_penalty": 0"#,
            "invalid_value",
            "repeat_penalty",
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}"#,
            400,
            "invalid_value",
            Some("max_tokens"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}"#,
            400,
            "invalid_value",
            Some("max_tokens"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e20}"#,
            400,
            "invalid_type",
            Some("max_tokens"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 18446744073709551615}"#,
            400,
            "context_length_exceeded",
            Some("max_tokens"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000}"#,
            400,
            "context_length_exceeded",
            Some("max_tokens"),
        ),
        case(
            COMP,
            &format!(r#"{{"prompt": [{}]}}"#, vec!["5"; 300].join(",")),
            400,
            "context_length_exceeded",
            Some("max_tokens"),
        ),
        chat(r#", "seed": 1e30"#, "invalid_type", "seed"),
        chat(r#", "seed": 99999999999999999999"#, "invalid_type", "seed"),
        chat(
            r#", "logprobs": true, "top_logprobs": 21"#,
            "invalid_value",
            "top_logprobs",
        ),
        chat(r#", "top_logprobs": 2"#, "invalid_value", "top_logprobs"),
        comp(r#", "logprobs": 99"#, "invalid_value", "logprobs"),
        chat(r#", "n": 2"#, "unsupported_parameter", "n"),
        chat(r#", "n": 0"#, "unsupported_parameter", "n"),
        chat(
            r#", "stop": ["a", "b", "c", "d", "e"]"#,
            "invalid_value",
            "stop",
        ),
        chat(r#", "stop": [""]"#, "invalid_value", "stop"),
        chat(
            r#", "logit_bias": {"abc": 1}"#,
            "invalid_value",
            "logit_bias.abc",
        ),
        chat(
            r#", "logit_bias": {"3": 500}"#,
            "invalid_value",
            "logit_bias.3",
        ),
        chat(
            r#", "logit_bias": {"99999999": 1}"#,
            "invalid_value",
            "logit_bias",
        ),
        case(
            COMP,
            r#"{"prompt": [999999]}"#,
            400,
            "invalid_value",
            Some("prompt"),
        ),
        case(
            COMP,
            r#"{"prompt": []}"#,
            400,
            "invalid_value",
            Some("prompt"),
        ),
        // unknown and missing fields
        chat(r#", "bogus": 1"#, "unknown_parameter", "bogus"),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": "hi", "mood": "x"}]}"#,
            400,
            "unknown_parameter",
            Some("messages[0].mood"),
        ),
        chat(
            r#", "stream": true, "stream_options": {"include_usage": true, "extra": 1}"#,
            "unknown_parameter",
            "stream_options.extra",
        ),
        case(
            CHAT,
            r#"{"max_tokens": 3}"#,
            400,
            "missing_required_parameter",
            Some("messages"),
        ),
        case(
            CHAT,
            r#"{"messages": []}"#,
            400,
            "invalid_value",
            Some("messages"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"content": "hi"}]}"#,
            400,
            "missing_required_parameter",
            Some("messages[0].role"),
        ),
        case(
            COMP,
            r#"{"max_tokens": 3}"#,
            400,
            "missing_required_parameter",
            Some("prompt"),
        ),
        case(
            CHAT,
            &comp_with(""),
            400,
            "unknown_parameter",
            Some("prompt"),
        ),
        case(
            COMP,
            &chat_with(""),
            400,
            "unknown_parameter",
            Some("messages"),
        ),
        // roles, models, features not served
        case(
            CHAT,
            r#"{"messages": [{"role": "bot", "content": "hi"}]}"#,
            400,
            "invalid_value",
            Some("messages[0].role"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "tool", "content": "hi"}]}"#,
            400,
            "invalid_value",
            Some("messages[0].role"),
        ),
        case(
            CHAT,
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#,
            400,
            "unsupported_parameter",
            Some("messages[0].content[0].type"),
        ),
        case(
            CHAT,
            &chat_with(r#", "model": "gpt-4o""#),
            404,
            "model_not_found",
            Some("model"),
        ),
        chat(
            r#", "tools": [{"type": "function", "function": {"name": "f"}}]"#,
            "unsupported_parameter",
            "tools",
        ),
        chat(
            r#", "response_format": {"type": "json_object"}"#,
            "unsupported_parameter",
            "response_format",
        ),
        comp(r#", "echo": true"#, "unsupported_parameter", "echo"),
        chat(
            r#", "stream_options": {"include_usage": true}"#,
            "invalid_value",
            "stream_options",
        ),
        // tokenize and detokenize
        case(
            "/tokenize",
            r#"{"text": "hi"}"#,
            400,
            "unknown_parameter",
            Some("text"),
        ),
        case(
            "/tokenize",
            r#"{}"#,
            400,
            "missing_required_parameter",
            Some("content"),
        ),
        case(
            "/detokenize",
            r#"{"tokens": [1, 100000]}"#,
            400,
            "invalid_value",
            Some("tokens[1]"),
        ),
        case(
            "/detokenize",
            r#"{"tokens": "1 2"}"#,
            400,
            "invalid_type",
            Some("tokens"),
        ),
    ];
    // invalid UTF-8
    let mut utf8 = case(CHAT, "", 400, "invalid_json", None);
    utf8.body = b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec();
    v.push(utf8);
    let mut utf8 = case(COMP, "", 400, "invalid_json", None);
    utf8.body = b"\xc3\x28{\"prompt\": \"x\"}".to_vec();
    v.push(utf8);
    // wrong methods and paths
    for (method, path, status, code) in [
        ("GET", CHAT, 405, "method_not_allowed"),
        ("PUT", COMP, 405, "method_not_allowed"),
        ("DELETE", "/v1/models", 405, "method_not_allowed"),
        ("POST", "/health", 405, "method_not_allowed"),
        ("PATCH", "/metrics", 405, "method_not_allowed"),
        ("GET", "/tokenize", 405, "method_not_allowed"),
        ("POST", "/v2/chat/completions", 404, "not_found"),
        ("POST", "/v1/chat/completions/extra", 404, "not_found"),
        ("GET", "/v1", 404, "not_found"),
        ("GET", "/v1/models/../../etc/passwd", 404, "not_found"),
    ] {
        v.push(Case {
            method,
            path,
            body: b"{}".to_vec(),
            status,
            code,
            param: None,
        });
    }
    v
}

/// The error body's shape, code and param.
fn check_error(what: &str, r: &Response, status: u16, code: &str, param: Option<&str>) {
    assert_eq!(r.status, status, "{what}: {}", r.text());
    assert!(
        r.header("content-type")
            .unwrap_or("")
            .starts_with("application/json"),
        "{what}"
    );
    let v: Value = serde_json::from_slice(&r.body)
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", r.text()));
    let e = &v["error"];
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{what}: {v}"
    );
    assert!(e["type"].is_string(), "{what}: {v}");
    assert_eq!(e["code"], code, "{what}: {v}");
    match param {
        Some(p) => assert_eq!(e["param"], p, "{what}: {v}"),
        None => assert!(
            e["param"].is_null() || e["param"].is_string(),
            "{what}: {v}"
        ),
    }
    assert_eq!(
        v.as_object().unwrap().len(),
        1,
        "{what}: only the error: {v}"
    );
}

fn normal(s: &Server) -> String {
    let r = s.post(
        COMP,
        &json!({"prompt": "Once upon", "max_tokens": 8, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn bad_requests_get_the_right_errors_and_disturb_nothing() {
    let model = tiny_fixture();
    let s = Server::start(&[
        "--model",
        model.to_str().unwrap(),
        "--ctx",
        "256",
        "--max-body",
        "1M",
        "--timeout",
        "1",
    ]);
    let before = normal(&s);
    // a long request runs through the whole corpus and must come out whole
    let long = json!({"prompt": "Once", "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut bystander = Stream::open(s.addr, COMP, &long);
    let cases = corpus();
    let mut count = cases.len();
    for c in &cases {
        let what = format!(
            "{} {} {:?}",
            c.method,
            c.path,
            String::from_utf8_lossy(&c.body)
                .chars()
                .take(80)
                .collect::<String>()
        );
        let r = request(s.addr, c.method, c.path, &[], &c.body);
        check_error(&what, &r, c.status, c.code, c.param);
    }

    // bodies over --max-body: declared, and sent in chunks without a length
    let big = vec![b' '; 10 << 20];
    let r = request(s.addr, "POST", CHAT, &[], &big);
    check_error("a 10 MB body", &r, 413, "request_too_large", None);
    let mut chunked = format!("POST {COMP} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").into_bytes();
    for _ in 0..20 {
        chunked.extend_from_slice(format!("{:x}\r\n", 100_000).as_bytes());
        chunked.extend(std::iter::repeat_n(b' ', 100_000));
        chunked.extend_from_slice(b"\r\n");
    }
    chunked.extend_from_slice(b"0\r\n\r\n");
    check_error(
        "a 2 MB chunked body",
        &raw_request(s.addr, &chunked),
        413,
        "request_too_large",
        None,
    );
    count += 2;

    // a slow client: the body never arrives in full
    let t = Instant::now();
    let mut slow = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        slow,
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{\"mess"
    )
    .unwrap();
    // meanwhile the server serves others
    assert_eq!(s.get("/health").status, 200);
    let mut out = Vec::new();
    slow.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    std::io::Read::read_to_end(&mut slow, &mut out).unwrap();
    check_error(
        "a slow client",
        &crate::server::parse_response(&out),
        408,
        "timeout",
        None,
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    count += 1;

    // clients that hang up mid-stream and mid-request
    for _ in 0..3 {
        let mut st = Stream::open(s.addr, COMP, &long);
        st.next_event().unwrap();
    }
    let mut half = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        half,
        "POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{{"
    )
    .unwrap();
    drop(half);
    count += 4;

    // the bystander got every token
    let mut events = Vec::new();
    while let Some(e) = bystander.next_event() {
        events.push(e);
    }
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(count >= 100, "{count} cases");
    eprintln!("{count} bad requests");
    assert_eq!(s.get("/health").status, 200);
    s.wait_metric("graft_requests_running", 0.0, 10);
    s.wait_metric("graft_kv_blocks_used", 0.0, 10);
    assert_eq!(normal(&s), before, "the same answer after the corpus");
}
