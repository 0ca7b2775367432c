//! `graft serve-bench`: a load generator for OpenAI-compatible servers (`graft serve`,
//! llama-server: the same requests to both). At each concurrency level, that many
//! clients send streamed requests (greedy, `ignore_eos`, so every request generates
//! exactly `-n` tokens; different prompts of the same length) until the level's
//! requests are done: chat requests whose prompts are words, or with `--prompt-tokens`
//! completions whose prompts are token ids (for models whose vocabulary is synthetic,
//! such as random-weight GGUF files). It reports the aggregate output tokens per second
//! (all tokens over the level's wall time), the time to the first token and the time
//! per output token after it, at p50 and p99.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{header, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use graft::{Error, Result};

use super::print_out;

/// Arguments of `graft serve-bench`.
#[derive(clap::Args)]
pub struct Args {
    /// The server's base URL (http only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Concurrency levels, comma-separated.
    #[arg(short = 'c', long, value_delimiter = ',', default_value = "1,8,32,64")]
    concurrency: Vec<usize>,
    /// Requests per level (default: 4 per client, at least 8).
    #[arg(long)]
    requests: Option<usize>,
    /// Output tokens per request.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128)]
    max_tokens: usize,
    /// Words per prompt (chat requests).
    #[arg(long, default_value_t = 48)]
    prompt_words: usize,
    /// Send completions whose prompts are this many token ids, drawn from [3, --vocab),
    /// instead of chat requests.
    #[arg(long)]
    prompt_tokens: Option<usize>,
    /// The vocabulary the --prompt-tokens ids are drawn from (any model with at least
    /// this many tokens; Llama 2's 32000 fits Llama 3's too).
    #[arg(long, default_value_t = 32000)]
    vocab: u32,
    /// Seconds a request may take, from sending it to the end of its stream; a request
    /// past it counts as failed.
    #[arg(long, default_value_t = 600.0)]
    timeout: f64,
    /// Wait up to this many seconds for GET /health to answer 200 before starting.
    #[arg(long, default_value_t = 0.0)]
    wait: f64,
    /// The `model` field of the requests (llama-server ignores it; graft checks it).
    #[arg(long)]
    model: Option<String>,
    /// Sent as `Authorization: Bearer`.
    #[arg(long)]
    api_key: Option<String>,
    /// Seed of the prompts' words.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// What one request measured.
struct Sample {
    /// Seconds to the first token's text.
    ttft: f64,
    /// Seconds per output token after the first (`None` for one token).
    tpot: Option<f64>,
    tokens: usize,
}

/// One level's figures.
struct Level {
    clients: usize,
    requests: usize,
    errors: usize,
    first_error: Option<String>,
    wall: f64,
    tokens: usize,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
}

/// Words the prompts are drawn from.
const WORDS: [&str; 32] = [
    "lighthouse",
    "river",
    "keeper",
    "lamp",
    "storm",
    "harbour",
    "stone",
    "evening",
    "ship",
    "window",
    "garden",
    "mountain",
    "letter",
    "winter",
    "bridge",
    "market",
    "forest",
    "candle",
    "island",
    "road",
    "village",
    "music",
    "story",
    "bread",
    "morning",
    "cloud",
    "field",
    "station",
    "clock",
    "silver",
    "door",
    "summer",
];

/// Runs `graft serve-bench`.
pub fn run(a: Args) -> Result<()> {
    if a.concurrency.contains(&0) || a.max_tokens == 0 || a.prompt_tokens == Some(0) {
        return Err(Error::model(
            "-c levels, -n and --prompt-tokens must be at least 1",
        ));
    }
    if a.vocab <= FIRST_ID {
        return Err(Error::model(format!(
            "--vocab {}: the prompt ids are drawn from [{FIRST_ID}, --vocab); give more than {FIRST_ID}",
            a.vocab
        )));
    }
    let seconds = |flag: &str, v: f64| {
        Duration::try_from_secs_f64(v)
            .map_err(|_| Error::model(format!("{flag} {v}: give a number of seconds, 0 or more")))
    };
    let (wait, timeout) = (seconds("--wait", a.wait)?, seconds("--timeout", a.timeout)?);
    if !a.url.starts_with("http://") {
        return Err(Error::model(format!(
            "--url {}: only http:// URLs are served",
            a.url
        )));
    }
    // several threads, so that a chunk's arrival is stamped when it comes, not when a
    // busy thread gets to it
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .map_err(|e| Error::io("the tokio runtime", e))?;
    let a = Arc::new(a);
    let levels = rt.block_on(bench(a.clone(), wait, timeout))?;
    report(&a, &levels)
}

/// The first token id of `--prompt-tokens` prompts (after llama's `<unk>`, `<s>`, `</s>`).
const FIRST_ID: u32 = 3;

async fn bench(a: Arc<Args>, wait: Duration, timeout: Duration) -> Result<Vec<Level>> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        // every request on a connection of its own, closed after it: no server holds
        // idle connections between requests (llama-server keeps a thread on each), and
        // none is closed under a request about to reuse it
        .pool_max_idle_per_host(0)
        .build_http();
    wait_ready(&client, &a.url, wait).await?;
    // one request first: plans built, caches warm
    timed(timeout, one(&client, &a, usize::MAX)).await?;
    let mut levels = Vec::new();
    for &c in &a.concurrency {
        let requests = a.requests.unwrap_or((4 * c).max(8));
        let next = Arc::new(AtomicUsize::new(0));
        let start = Instant::now();
        let tasks: Vec<_> = (0..c)
            .map(|_| {
                let (client, a, next) = (client.clone(), a.clone(), next.clone());
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= requests {
                            return out;
                        }
                        out.push(timed(timeout, one(&client, &a, i)).await);
                    }
                })
            })
            .collect();
        let mut level = Level {
            clients: c,
            requests,
            errors: 0,
            first_error: None,
            wall: 0.0,
            tokens: 0,
            ttft: Vec::new(),
            tpot: Vec::new(),
        };
        for t in tasks {
            let samples = t
                .await
                .map_err(|e| Error::model(format!("a client task failed: {e}")))?;
            for s in samples {
                match s {
                    Ok(s) => {
                        level.tokens += s.tokens;
                        level.ttft.push(s.ttft);
                        level.tpot.extend(s.tpot);
                    }
                    Err(e) => {
                        level.errors += 1;
                        level.first_error.get_or_insert(e.to_string());
                    }
                }
            }
        }
        level.wall = start.elapsed().as_secs_f64();
        levels.push(level);
    }
    Ok(levels)
}

/// `request`, or an error when it takes longer than `timeout`.
async fn timed(timeout: Duration, request: impl Future<Output = Result<Sample>>) -> Result<Sample> {
    tokio::time::timeout(timeout, request)
        .await
        .unwrap_or_else(|_| {
            Err(Error::model(format!(
                "a request took longer than --timeout {} s",
                timeout.as_secs_f64()
            )))
        })
}

/// Asks `url`/health until it answers 200, for at most `wait` (not at all for 0).
async fn wait_ready<C>(
    client: &Client<C, Full<Bytes>>,
    url: &str,
    wait: std::time::Duration,
) -> Result<()>
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    if wait.is_zero() {
        return Ok(());
    }
    let deadline = Instant::now() + wait;
    let health = format!("{}/health", url.trim_end_matches('/'));
    let uri: axum::http::Uri = health
        .parse()
        .map_err(|e| Error::model(format!("--url {url}: {e}")))?;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        match client.get(uri.clone()).await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("status {}", r.status()),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Err(Error::model(format!(
        "{health} did not answer 200 within --wait {} s (last: {last})",
        wait.as_secs_f64()
    )))
}

/// The endpoint and body of request `i`: a chat whose prompt is `prompt_words` words,
/// or a completion whose prompt is `prompt_tokens` token ids, drawn with the seed and
/// `i`.
fn request_body(a: &Args, i: usize) -> (&'static str, Value) {
    let mut rng = StdRng::seed_from_u64(a.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut body = json!({
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(m) = &a.model {
        body["model"] = json!(m);
    }
    let path = match a.prompt_tokens {
        Some(n) => {
            let ids: Vec<u32> = (0..n)
                .map(|_| rng.random_range(FIRST_ID..a.vocab))
                .collect();
            body["prompt"] = json!(ids);
            "/v1/completions"
        }
        None => {
            let words: Vec<&str> = (0..a.prompt_words)
                .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                .collect();
            let text = format!("Write a long story with these words: {}.", words.join(" "));
            body["messages"] = json!([{"role": "user", "content": text}]);
            "/v1/chat/completions"
        }
    };
    (path, body)
}

/// The POST of `body` to `path`.
fn post(a: &Args, path: &str, body: Bytes) -> std::result::Result<Request<Full<Bytes>>, String> {
    let mut req = Request::post(format!("{}{path}", a.url.trim_end_matches('/')))
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = &a.api_key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    req.body(Full::new(body)).map_err(|e| e.to_string())
}

/// Sends request `i` and measures it.
async fn one<C>(client: &Client<C, Full<Bytes>>, a: &Args, i: usize) -> Result<Sample>
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    let (path, body) = request_body(a, i);
    let body = Bytes::from(body.to_string());
    let fail = |what: String| Error::model(format!("{}: {what}", a.url));
    let req = post(a, path, body).map_err(fail)?;
    let sent = Instant::now();
    let resp = client.request(req).await.map_err(|e| {
        let why = std::error::Error::source(&e).map_or(String::new(), |s| format!(": {s}"));
        fail(format!("{e}{why}"))
    })?;
    let status = resp.status();
    let mut body = resp.into_body();
    let (mut buf, mut first, mut last, mut pieces, mut usage) = (Vec::new(), None, None, 0, None);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| fail(e.to_string()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" || !status.is_success() {
                continue;
            }
            let v: Value = serde_json::from_str(data)
                .map_err(|e| fail(format!("a chunk that is not JSON ({e}): {data}")))?;
            if let Some(e) = v.get("error") {
                return Err(fail(format!("error in the stream: {e}")));
            }
            let choice = &v["choices"][0];
            let text = choice["delta"]["content"]
                .as_str()
                .or(choice["text"].as_str());
            if text.is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                first.get_or_insert(now);
                last = Some(now);
                pieces += 1;
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
            }
        }
    }
    if !status.is_success() {
        return Err(fail(format!("{status}: {}", String::from_utf8_lossy(&buf))));
    }
    let (Some(first), Some(last)) = (first, last) else {
        return Err(fail("a stream without text".into()));
    };
    let tokens = usage.unwrap_or(pieces);
    Ok(Sample {
        ttft: first.duration_since(sent).as_secs_f64(),
        tpot: (tokens > 1).then(|| last.duration_since(first).as_secs_f64() / (tokens - 1) as f64),
        tokens,
    })
}

/// The `p`-th percentile (nearest rank) of `v`, in milliseconds.
fn ms(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * v.len() as f64).ceil().max(1.0) as usize;
    v[rank.min(v.len()) - 1] * 1e3
}

/// What the prompts are: `48 words` (chat) or `128 token ids` (completions).
fn prompt_kind(a: &Args) -> String {
    match a.prompt_tokens {
        Some(n) => format!("{n} token ids"),
        None => format!("{} words", a.prompt_words),
    }
}

/// Prints the table (or JSON); an error when any request failed.
fn report(a: &Args, levels: &[Level]) -> Result<()> {
    let mut rows = Vec::new();
    for l in levels {
        let (mut ttft, mut tpot) = (l.ttft.clone(), l.tpot.clone());
        rows.push(json!({
            "clients": l.clients,
            "requests": l.requests,
            "errors": l.errors,
            "output_tokens": l.tokens,
            "wall_s": l.wall,
            "output_tok_s": l.tokens as f64 / l.wall,
            "ttft_ms_p50": ms(&mut ttft, 50.0),
            "ttft_ms_p99": ms(&mut ttft, 99.0),
            "tpot_ms_p50": ms(&mut tpot, 50.0),
            "tpot_ms_p99": ms(&mut tpot, 99.0),
        }));
    }
    if a.json {
        let out = json!({"url": a.url, "max_tokens": a.max_tokens, "prompt": prompt_kind(a), "levels": rows});
        print_out(&format!("{out}\n"))?;
    } else {
        let mut t = format!(
            "{} -- {} output tokens per request, prompts of {}\n\n| clients | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            a.url,
            a.max_tokens,
            prompt_kind(a)
        );
        for r in &rows {
            let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            t.push_str(&format!(
                "| {} | {} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2} | {} |\n",
                r["clients"],
                r["requests"],
                f("output_tok_s"),
                f("ttft_ms_p50"),
                f("ttft_ms_p99"),
                f("tpot_ms_p50"),
                f("tpot_ms_p99"),
                r["errors"]
            ));
        }
        print_out(&t)?;
    }
    match levels.iter().find_map(|l| l.first_error.as_ref()) {
        Some(e) => Err(Error::model(format!(
            "{} requests failed, the first with: {e}",
            levels.iter().map(|l| l.errors).sum::<usize>()
        ))),
        None => Ok(()),
    }
}
