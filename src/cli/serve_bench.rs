//! `graft serve-bench`: a load generator for OpenAI-compatible servers (`graft serve`,
//! llama-server: the same requests to both). At each concurrency level, that many
//! clients send streamed chat requests (greedy, `ignore_eos`, so every request generates
//! exactly `-n` tokens; different prompts of the same length) until the level's
//! requests are done. It reports the aggregate output tokens per second (all tokens
//! over the level's wall time), the time to the first token and the time per output
//! token after it, at p50 and p99.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

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
    /// Words per prompt.
    #[arg(long, default_value_t = 48)]
    prompt_words: usize,
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
    if a.concurrency.contains(&0) || a.max_tokens == 0 {
        return Err(Error::model("-c levels and -n must be at least 1"));
    }
    if !a.url.starts_with("http://") {
        return Err(Error::model(format!(
            "--url {}: only http:// URLs are served",
            a.url
        )));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::io("the tokio runtime", e))?;
    let a = Arc::new(a);
    let levels = rt.block_on(bench(a.clone()))?;
    report(&a, &levels)
}

async fn bench(a: Arc<Args>) -> Result<Vec<Level>> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1024)
        .build_http();
    // one request first: plans built, caches warm
    one(&client, &a, usize::MAX).await?;
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
                        out.push(one(&client, &a, i).await);
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

/// The prompt of request `i`: `prompt_words` words drawn with the seed and `i`.
fn prompt(a: &Args, i: usize) -> String {
    let mut rng = StdRng::seed_from_u64(a.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let words: Vec<&str> = (0..a.prompt_words)
        .map(|_| WORDS[rng.random_range(0..WORDS.len())])
        .collect();
    format!("Write a long story with these words: {}.", words.join(" "))
}

/// Sends request `i` and measures it.
async fn one<C>(client: &Client<C, Full<Bytes>>, a: &Args, i: usize) -> Result<Sample>
where
    C: hyper_util::client::legacy::connect::Connect + Clone + Send + Sync + 'static,
{
    let mut body = json!({
        "messages": [{"role": "user", "content": prompt(a, i)}],
        "max_tokens": a.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if let Some(m) = &a.model {
        body["model"] = json!(m);
    }
    let mut req = Request::post(format!(
        "{}/v1/chat/completions",
        a.url.trim_end_matches('/')
    ))
    .header(header::CONTENT_TYPE, "application/json");
    if let Some(k) = &a.api_key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| Error::model(format!("--url {}: {e}", a.url)))?;
    let sent = Instant::now();
    let fail = |what: String| Error::model(format!("{}: {what}", a.url));
    let resp = client.request(req).await.map_err(|e| fail(e.to_string()))?;
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
            if v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
            {
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
        let out = json!({"url": a.url, "max_tokens": a.max_tokens, "prompt_words": a.prompt_words, "levels": rows});
        print_out(&format!("{out}\n"))?;
    } else {
        let mut t = format!(
            "{} -- {} output tokens per request, prompts of {} words\n\n| clients | requests | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | errors |\n|---:|---:|---:|---:|---:|---:|---:|---:|\n",
            a.url, a.max_tokens, a.prompt_words
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
