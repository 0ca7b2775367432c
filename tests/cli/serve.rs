//! `graft serve` end to end on 127.0.0.1 with the tiny fixture (and the default model
//! where it is cached): every endpoint; streamed and whole answers equal; stop strings
//! never emitted, also when they span tokens; seeds; log-probabilities against greedy
//! picks; usage against /tokenize; 32 concurrent greedy clients against each alone; a
//! client that disconnects frees its sequence and blocks; the queue limit; the API key;
//! graceful shutdown.

use crate::server::{request, tiny_fixture, Server, Stream};
use serde_json::{json, Value};

/// The tiny fixture served with `extra` flags (a context of 256 unless they say).
fn tiny(extra: &[&str]) -> Server {
    let model = tiny_fixture();
    let mut args = vec!["--model", model.to_str().unwrap()];
    if !extra.contains(&"--ctx") {
        args.extend(["--ctx", "256"]);
    }
    args.extend_from_slice(extra);
    Server::start(&args)
}

/// The default model served with `extra` flags, or `None` (said) when it is not cached.
fn default_model_server(extra: &[&str]) -> Option<Server> {
    let model = crate::cached_model::cached_default_model()?;
    let mut args = vec!["--model", model.to_str().unwrap()];
    args.extend_from_slice(extra);
    Some(Server::start(&args))
}

/// The text and usage of a whole answer.
fn whole(s: &Server, path: &str, body: &Value) -> (String, Value) {
    let r = s.post(path, body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let choice = &v["choices"][0];
    let text = match path {
        "/v1/chat/completions" => choice["message"]["content"].as_str().unwrap(),
        _ => choice["text"].as_str().unwrap(),
    };
    (text.to_string(), v)
}

/// The text of a streamed answer (pieces concatenated), its pieces, its finish reason
/// and its usage (with include_usage).
fn streamed(s: &Server, path: &str, body: &Value) -> (String, Vec<String>, String, Value) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = s.post(path, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    let events = r.events();
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let (mut pieces, mut finish, mut usage) = (Vec::new(), String::new(), Value::Null);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
            assert_eq!(v["choices"], json!([]), "the usage chunk has no choice");
            continue;
        }
        let c = &v["choices"][0];
        let piece = match path {
            "/v1/chat/completions" => c["delta"]["content"].as_str(),
            _ => c["text"].as_str(),
        };
        pieces.extend(piece.map(str::to_string));
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (pieces.concat(), pieces, finish, usage)
}

#[test]
fn endpoints_answer_in_the_openai_shape() {
    let s = tiny(&[]);
    assert_eq!(s.get("/health").json(), json!({"status": "ok"}));
    let models = s.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "llama3-tiny-bf16");
    let chat = json!({"model": "llama3-tiny-bf16", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0});
    let (_, v) = whole(&s, "/v1/chat/completions", &chat);
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let reason = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(reason == "stop" || reason == "length", "{reason}");
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    let tokens = s.post(
        "/tokenize",
        &json!({"content": "Once upon a time", "add_special": true}),
    );
    let ids = tokens.json()["tokens"].as_array().unwrap().clone();
    let (_, v) = whole(
        &s,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["usage"]["prompt_tokens"].as_u64().unwrap(),
        ids.len() as u64
    );
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // the same prompt as token ids gives the same answer
    let (by_ids, _) = whole(
        &s,
        "/v1/completions",
        &json!({"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(by_ids, v["choices"][0]["text"].as_str().unwrap());
    let back = s.post("/detokenize", &json!({"tokens": ids[1..]}));
    assert_eq!(back.json()["content"], "Once upon a time");
    assert!(s.get("/").text().contains("/v1/chat/completions"));
    let metrics = s.get("/metrics").text();
    for name in [
        "graft_requests_total{endpoint=\"/v1/completions\",status=\"200\"} 2",
        "graft_requests_running 0",
        "graft_requests_waiting 0",
        "graft_kv_blocks_used 0",
        "graft_time_to_first_token_seconds_count 3",
        "graft_time_per_output_token_seconds_count 3",
    ] {
        assert!(
            metrics.lines().any(|l| l == name),
            "{name} not in\n{metrics}"
        );
    }
    assert!(s.metric("graft_generation_tokens_total") >= 10.0);
    assert!(
        s.metric("graft_prefix_cache_hit_tokens_total") > 0.0,
        "the second prompt hit the cache"
    );
    // one log line per request, with tokens for the generations
    let log = s.log();
    assert!(
        log.lines()
            .any(|l| l.starts_with("POST /v1/completions 200 ") && l.contains(" tokens ")),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.starts_with("GET /v1/models 200 ")),
        "{log}"
    );
}

#[test]
fn streamed_and_whole_answers_are_equal() {
    let s = tiny(&[]);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"prompt": "The lamp", "max_tokens": 24, "temperature": 0, "ignore_eos": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "A river", "max_tokens": 16, "temperature": 0.9, "seed": 7}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "temperature": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Ho"}], "max_tokens": 12, "temperature": 1.2, "seed": 3, "stop": ["e", "ab"]}),
        ),
    ] {
        let (text, v) = whole(&s, path, &body);
        let (streamed_text, _, finish, usage) = streamed(&s, path, &body);
        assert_eq!(streamed_text, text, "{body}");
        assert_eq!(
            finish,
            v["choices"][0]["finish_reason"].as_str().unwrap(),
            "{body}"
        );
        assert_eq!(
            usage["completion_tokens"], v["usage"]["completion_tokens"],
            "{body}"
        );
        assert_eq!(
            usage["prompt_tokens"], v["usage"]["prompt_tokens"],
            "{body}"
        );
    }
}

#[test]
fn stop_strings_are_never_emitted_also_across_tokens() {
    let s = tiny(&[]);
    let base = json!({"prompt": "Once upon a time there", "max_tokens": 40, "temperature": 0,
        "ignore_eos": true, "logprobs": 0});
    let (text, v) = whole(&s, "/v1/completions", &base);
    let pieces: Vec<String> = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    // a stop string made of the end of one token's text and the start of the next
    let k = (3..pieces.len() - 1)
        .find(|&k| {
            let (a, b) = (&pieces[k], &pieces[k + 1]);
            a.is_ascii() && b.is_ascii() && !a.is_empty() && !b.is_empty()
        })
        .expect("two ASCII tokens in a row");
    let stop = format!(
        "{}{}",
        pieces[k].chars().last().unwrap(),
        pieces[k + 1].chars().next().unwrap()
    );
    let expected = &text[..text.find(&stop).unwrap()];
    let mut body = base.clone();
    body["stop"] = json!([stop, "never-in-the-text"]);
    body.as_object_mut().unwrap().remove("logprobs");
    let (cut, v) = whole(&s, "/v1/completions", &body);
    assert_eq!(cut, expected, "stop {stop:?}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let (streamed_text, pieces, finish, _) = streamed(&s, "/v1/completions", &body);
    assert_eq!(streamed_text, expected);
    assert_eq!(finish, "stop");
    assert!(pieces.iter().all(|p| !p.contains(&stop)), "{pieces:?}");
}

/// A sampling setting comes from the request, else the server's flags, else the model's
/// generation_config.json (here `do_sample: false`, greedy), else the chat defaults; a
/// bad flag stops the server with an error naming it.
#[test]
fn sampling_settings_come_from_the_request_the_flags_and_the_model() {
    let dir = crate::bad_input::tempdir("serve-greedy-model");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(tiny_fixture().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(
        dir.join("generation_config.json"),
        r#"{"do_sample": false}"#,
    )
    .unwrap();
    let greedy_model = Server::start(&["--model", dir.to_str().unwrap(), "--ctx", "256"]);
    let plain = tiny(&[]);
    let ask = |s: &Server, extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Tell a story"}],
            "max_tokens": 16, "ignore_eos": true});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        whole(s, "/v1/chat/completions", &body).0
    };
    let argmax = ask(&plain, json!({"temperature": 0}));
    for seed in [1, 2, 3] {
        assert_eq!(
            ask(&greedy_model, json!({"seed": seed})),
            argmax,
            "seed {seed}"
        );
    }
    // the chat defaults sample (temperature 0.8): seeds give other texts
    let sampled: Vec<String> = (1..4)
        .map(|seed| ask(&plain, json!({"seed": seed})))
        .collect();
    assert!(sampled.iter().any(|t| *t != argmax), "{sampled:?}");
    // a temperature in the request beats the model's greedy
    let hot: Vec<String> = (1..4)
        .map(|seed| ask(&greedy_model, json!({"seed": seed, "temperature": 1.5})))
        .collect();
    assert!(hot.iter().any(|t| *t != argmax), "{hot:?}");
    assert!(
        greedy_model.log().contains("generation_config.json"),
        "the server says where its settings come from:\n{}",
        greedy_model.log()
    );
    // a flag beats the model, a request beats the flag
    let hot_flag = Server::start(&["--model", dir.to_str().unwrap(), "--temperature", "1.5"]);
    let flagged: Vec<String> = (1..4)
        .map(|seed| ask(&hot_flag, json!({"seed": seed})))
        .collect();
    assert!(flagged.iter().any(|t| *t != argmax), "{flagged:?}");
    assert_eq!(ask(&hot_flag, json!({"seed": 1, "temperature": 0})), argmax);
    let cold_flag = tiny(&["--temperature", "0"]);
    assert_eq!(ask(&cold_flag, json!({"seed": 2})), argmax);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_graft"))
        .args([
            "serve",
            "--port",
            "0",
            "--model",
            dir.to_str().unwrap(),
            "--top-p",
            "2",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("error: --top-p: must be in [0, 1], got 2"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `max_completion_tokens` wins over `max_tokens`; without `include_usage` no chunk
/// carries a usage, with it every chunk but the last has `"usage": null`.
#[test]
fn token_limits_and_the_usage_chunk() {
    let s = tiny(&[]);
    let chat = json!({"messages": [{"role": "user", "content": "Count"}], "temperature": 0,
        "ignore_eos": true, "max_tokens": 9, "max_completion_tokens": 4});
    let (_, v) = whole(&s, "/v1/chat/completions", &chat);
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let mut only_max = chat.clone();
    only_max
        .as_object_mut()
        .unwrap()
        .remove("max_completion_tokens");
    let (_, v) = whole(&s, "/v1/chat/completions", &only_max);
    assert_eq!(v["usage"]["completion_tokens"], 9, "{v}");
    for include in [None, Some(false), Some(true)] {
        let mut body = chat.clone();
        body["stream"] = json!(true);
        if let Some(i) = include {
            body["stream_options"] = json!({"include_usage": i});
        }
        let events = s.post("/v1/chat/completions", &body).events();
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let (last, rest) = chunks.split_last().unwrap();
        match include {
            Some(true) => {
                assert_eq!(last["usage"]["completion_tokens"], 4, "{last}");
                assert_eq!(last["choices"], json!([]));
                for c in rest {
                    assert!(c.as_object().unwrap()["usage"].is_null(), "{c}");
                }
            }
            None | Some(false) => {
                for c in &chunks {
                    assert!(c.get("usage").is_none(), "{c}");
                }
                assert_eq!(last["choices"][0]["finish_reason"], "length");
            }
        }
    }
}

/// `/metrics` is Prometheus' text format: every sample's metric has its HELP and TYPE
/// first, values are numbers, histogram buckets grow to `+Inf`, which equals the count.
#[test]
fn metrics_are_prometheus_text() {
    let s = tiny(&[]);
    whole(
        &s,
        "/v1/completions",
        &json!({"prompt": "Once", "max_tokens": 5, "temperature": 0, "ignore_eos": true}),
    );
    let r = s.get("/metrics");
    assert_eq!(r.header("content-type"), Some("text/plain; version=0.0.4"));
    let text = r.text();
    let (mut typed, mut helped) = (
        std::collections::HashMap::new(),
        std::collections::HashSet::new(),
    );
    let mut buckets: Vec<(String, f64)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split(' ').next().unwrap().to_string());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            typed.insert(name.to_string(), kind.to_string());
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("{line}"));
        let name = series.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|sfx| name.strip_suffix(sfx))
            .filter(|f| typed.get(*f).map(String::as_str) == Some("histogram"))
            .unwrap_or(name);
        assert!(
            name.starts_with("graft_") && typed.contains_key(family) && helped.contains(family),
            "{line}: no TYPE/HELP before it"
        );
        if name.ends_with("_bucket") {
            if let Some((prev, v)) = buckets.last() {
                if prev == family {
                    assert!(value >= *v, "buckets grow: {line}");
                }
            }
            buckets.push((family.to_string(), value));
            if series.contains("le=\"+Inf\"") {
                assert_eq!(s_count(&text, family), value, "{line}");
            }
        }
    }
    assert_eq!(s_count(&text, "graft_time_to_first_token_seconds"), 1.0);
    assert_eq!(s.metric("graft_generation_tokens_total"), 5.0);
}

/// The `_count` of histogram `family` in `text`.
fn s_count(text: &str, family: &str) -> f64 {
    let key = format!("{family}_count ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key)?.parse().ok())
        .unwrap()
}

/// `graft serve-bench` against the tiny fixture, with chat prompts of words and with
/// completions of token ids: every request done and counted by both sides, the figures
/// numbers in order; a server that is not there is an error naming it.
#[test]
fn serve_bench_measures_the_server() {
    let s = tiny(&["--parallel", "4"]);
    let url = format!("http://{}", s.addr);
    let bench = |wait: &str, extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_graft"))
            .args(["serve-bench", "--url", &url, "-c", "1,3", "-n", "5"])
            .args(["--requests", "6", "--json", "--wait", wait])
            .args(extra)
            .output()
            .unwrap()
    };
    for prompts in [
        &["--prompt-words", "6"][..],
        &["--prompt-tokens", "20", "--vocab", "512"][..],
    ] {
        let out = bench("30", prompts);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{prompts:?}: {err}");
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let levels = v["levels"].as_array().unwrap();
        assert_eq!(levels.len(), 2, "{v}");
        for (l, clients) in levels.iter().zip([1, 3]) {
            assert_eq!(
                (
                    &l["clients"],
                    &l["requests"],
                    &l["errors"],
                    &l["output_tokens"]
                ),
                (&json!(clients), &json!(6), &json!(0), &json!(30)),
                "{l}"
            );
            let f = |k: &str| l[k].as_f64().unwrap();
            assert!(
                f("output_tok_s") > 0.0 && f("output_tok_s").is_finite(),
                "{l}"
            );
            assert!(
                0.0 < f("ttft_ms_p50") && f("ttft_ms_p50") <= f("ttft_ms_p99"),
                "{l}"
            );
            assert!(
                0.0 < f("tpot_ms_p50") && f("tpot_ms_p50") <= f("tpot_ms_p99"),
                "{l}"
            );
        }
    }
    // a warm-up and 12 requests on each endpoint
    for endpoint in ["/v1/chat/completions", "/v1/completions"] {
        let name = format!("graft_requests_total{{endpoint=\"{endpoint}\",status=\"200\"}}");
        assert_eq!(s.metric(&name), 13.0, "{endpoint}");
    }
    drop(s);
    let out = bench("0.5", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "{url}/health did not answer 200 within --wait 0.5 s"
        )),
        "{err}"
    );
}

#[test]
fn seeds_repeat_and_differ() {
    let s = tiny(&[]);
    let ask = |seed: u64| {
        let body = json!({"prompt": "Once", "max_tokens": 24, "temperature": 1.5, "seed": seed, "ignore_eos": true});
        whole(&s, "/v1/completions", &body).0
    };
    let first = ask(42);
    assert_eq!(ask(42), first, "the same seed gives the same text");
    assert!(
        (43..47).any(|seed| ask(seed) != first),
        "other seeds give other texts"
    );
}

#[test]
fn logprobs_match_the_greedy_picks() {
    let s = tiny(&[]);
    let body = json!({"messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 3});
    let (_, v) = whole(&s, "/v1/chat/completions", &body);
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 12);
    for t in content {
        let lp = t["logprob"].as_f64().unwrap();
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let best = top[0]["logprob"].as_f64().unwrap();
        assert!(
            lp <= 0.0 && (lp - best).abs() < 1e-6,
            "greedy picks the most likely: {t}"
        );
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        assert_eq!(t["bytes"], json!(t["token"].as_str().unwrap().as_bytes()));
    }
    // the streamed answer carries the same tokens and log-probabilities, token by token;
    // its prompt comes from the prefix cache but for its last token, computed by the
    // decode kernel rather than in the prompt's chunk: the values agree to float rounding
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &sb);
    let streamed: Vec<Value> = r
        .events()
        .iter()
        .filter(|e| e.as_str() != "[DONE]")
        .filter_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["logprobs"]["content"].as_array().cloned()
        })
        .flatten()
        .collect();
    assert_eq!(streamed.len(), content.len());
    for (a, b) in streamed.iter().zip(content) {
        same_logprob(a, b);
        let (ta, tb) = (a["top_logprobs"].as_array(), b["top_logprobs"].as_array());
        let (ta, tb) = (ta.unwrap(), tb.unwrap());
        assert_eq!(ta.len(), tb.len(), "{a} vs {b}");
        ta.iter().zip(tb).for_each(|(x, y)| same_logprob(x, y));
    }
}

/// Two log-probability entries name the same token (text and bytes) with values within
/// float rounding of each other.
fn same_logprob(a: &Value, b: &Value) {
    assert_eq!(
        (&a["token"], &a["bytes"]),
        (&b["token"], &b["bytes"]),
        "{a} vs {b}"
    );
    let (x, y) = (
        a["logprob"].as_f64().unwrap(),
        b["logprob"].as_f64().unwrap(),
    );
    assert!((x - y).abs() <= 1e-5, "{a} vs {b}");
}

/// A greedy chat answer token by token: each token's text and the margin of its
/// log-probability over the runner-up's.
fn greedy_tokens(s: &Server, prompt: &str, max_tokens: usize) -> Vec<(String, f64)> {
    let body = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (_, v) = whole(s, "/v1/chat/completions", &body);
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    content
        .iter()
        .map(|t| {
            let top = t["top_logprobs"].as_array().unwrap();
            let lp = |i: usize| {
                top.get(i)
                    .map_or(f64::NEG_INFINITY, |x| x["logprob"].as_f64().unwrap())
            };
            (t["token"].as_str().unwrap().to_string(), lp(0) - lp(1))
        })
        .collect()
}

/// Each of `prompts` asked alone, then all at once: every client gets the tokens it got
/// alone, up to the first step whose choice was closer than `margin` (0: every step).
fn concurrent_equals_alone(s: &Server, prompts: &[String], max_tokens: usize, margin: f64) {
    let alone: Vec<_> = prompts
        .iter()
        .map(|p| greedy_tokens(s, p, max_tokens))
        .collect();
    let together: Vec<_> = std::thread::scope(|sc| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| sc.spawn(move || greedy_tokens(s, p, max_tokens)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut compared = 0;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        let clear = a.iter().take_while(|(_, m)| *m >= margin).count();
        let (a, t): (Vec<&String>, Vec<&String>) = (
            a.iter().map(|x| &x.0).collect(),
            t.iter().map(|x| &x.0).collect(),
        );
        let n = clear.min(a.len());
        assert_eq!(
            &t[..n.min(t.len())],
            &a[..n],
            "client {i} ({:?})",
            prompts[i]
        );
        if margin == 0.0 {
            assert_eq!(t, a, "client {i} ({:?})", prompts[i]);
        }
        compared += n;
    }
    eprintln!("{compared} tokens compared");
    assert!(
        compared >= 3 * prompts.len(),
        "too few clear steps to compare: {compared}"
    );
}

/// 32 different prompts of the tiny fixture's words.
fn client_prompts() -> Vec<String> {
    (0..32)
        .map(|i| {
            format!(
                "Client {i} asks about lamp {} and river {}",
                i * 7 % 13,
                i % 5
            )
        })
        .collect()
}

#[test]
fn thirty_two_concurrent_greedy_clients_get_their_text_alone() {
    let s = tiny(&["--parallel", "32"]);
    concurrent_equals_alone(&s, &client_prompts(), 24, 0.0);
}

/// On CUDA (the cuda feature and a GPU; "skipped: no GPU" without one unless
/// GRAFT_REQUIRE_GPU=1): 32 concurrent greedy clients get the tokens they get alone
/// wherever the choice was clear (a batch's products may round otherwise than one
/// sequence's), and the pipelined greedy decode streams what it answers whole.
#[cfg(feature = "cuda")]
#[test]
fn concurrent_greedy_clients_on_cuda() {
    match graft::backend::cuda::CudaBackend::new(0) {
        Ok(_) => {}
        Err(graft::Error::NoDevice(reason))
            if std::env::var("GRAFT_REQUIRE_GPU").as_deref() != Ok("1") =>
        {
            eprintln!("skipped: no GPU ({reason})");
            return;
        }
        Err(e) => panic!("opening the CUDA backend failed: {e}"),
    }
    let s = tiny(&["--backend", "cuda", "--parallel", "32"]);
    concurrent_equals_alone(&s, &client_prompts(), 24, 0.05);
    for prompt in ["The lamp", "A river", "Once upon a time there"] {
        let body =
            json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true});
        let (text, v) = whole(&s, "/v1/completions", &body);
        let (streamed_text, _, finish, usage) = streamed(&s, "/v1/completions", &body);
        assert_eq!(streamed_text, text, "{prompt}");
        assert_eq!(
            (finish.as_str(), &usage["completion_tokens"]),
            ("length", &json!(40))
        );
        assert_eq!(v["usage"]["completion_tokens"], 40);
    }
}

/// On the default model (Q4_1 weights) the CPU's quantized dot products add their f32
/// terms in an order that depends on how many columns a step has (1 to 4 at a time), so
/// a batch and a lone sequence may differ in the last bits of a logit: tokens must agree
/// wherever the choice was clear.
#[test]
fn thirty_two_concurrent_greedy_clients_on_the_default_model() {
    let Some(s) = default_model_server(&["--ctx", "512", "--parallel", "32"]) else {
        return;
    };
    let prompts: Vec<String> = (0..32)
        .map(|i| format!("Write one sentence about the number {i}."))
        .collect();
    concurrent_equals_alone(&s, &prompts, 12, 0.5);
}

#[test]
fn a_client_that_goes_away_frees_its_sequence() {
    let s = tiny(&["--ctx", "4096"]);
    let long = json!({"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "ignore_eos": true});
    // streamed: read two events, hang up
    let mut body = long.clone();
    body["stream"] = json!(true);
    let mut st = Stream::open(s.addr, "/v1/completions", &body);
    st.next_event().unwrap();
    st.next_event().unwrap();
    drop(st);
    s.wait_metric("graft_requests_running", 0.0, 10);
    s.wait_metric("graft_kv_blocks_used", 0.0, 10);
    // whole: send the request and hang up before the answer
    let mut tcp = std::net::TcpStream::connect(s.addr).unwrap();
    let text = long.to_string();
    use std::io::Write;
    write!(
        tcp,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
    .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(100));
    drop(tcp);
    s.wait_metric("graft_requests_running", 0.0, 10);
    s.wait_metric("graft_kv_blocks_used", 0.0, 10);
    // every token generated is counted, a cancelled request's too: one request that ran
    // to its end would have made 4000
    let generated = s.metric("graft_generation_tokens_total");
    assert!(
        generated < 4000.0,
        "both were cancelled before their end ({generated} tokens)"
    );
    let gone = "graft_requests_total{endpoint=\"/v1/completions\",status=\"499\"}";
    assert_eq!(s.metric(gone), 2.0);
    let log = s.log();
    assert_eq!(log.matches("POST /v1/completions 499 ").count(), 2, "{log}");
    // the server goes on
    let (_, v) = whole(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 3, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let s = tiny(&["--ctx", "512", "--parallel", "1", "--max-queue", "1"]);
    let long = json!({"prompt": "Once", "max_tokens": 500, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut a = Stream::open(s.addr, "/v1/completions", &long);
    a.next_event().unwrap();
    let _b = Stream::open(s.addr, "/v1/completions", &long);
    s.wait_metric("graft_requests_waiting", 1.0, 10);
    let r = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(r.json()["error"]["code"], "server_overloaded");
}

#[test]
fn the_api_key_guards_the_api() {
    let s = tiny(&["--api-key", "sesame"]);
    let r = s.get("/v1/models");
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    let with = |auth: &str| request(s.addr, "GET", "/v1/models", &[("Authorization", auth)], b"");
    assert_eq!(with("Bearer sesam").status, 401);
    assert_eq!(with("sesame").status, 401);
    assert_eq!(with("Bearer sesame").status, 200);
    assert_eq!(s.get("/health").status, 200, "health needs no key");
}

#[test]
fn sigterm_lets_running_requests_finish_and_exits_0() {
    let mut s = tiny(&["--ctx", "512", "--shutdown-timeout", "60"]);
    let body = json!({"prompt": "Once", "max_tokens": 200, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut st = Stream::open(s.addr, "/v1/completions", &body);
    st.next_event().unwrap();
    s.terminate();
    let mut events = 1;
    let mut last = String::new();
    while let Some(e) = st.next_event() {
        events += 1;
        last = e;
    }
    assert_eq!(last, "[DONE]", "the running request finished");
    assert!(events > 100, "{events} events");
    let status = s.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", s.log());
    assert!(
        std::net::TcpStream::connect(s.addr).is_err(),
        "no more connections"
    );
}

#[test]
fn the_shutdown_timeout_cuts_off_long_requests() {
    // 0.05 s: the two requests' 1,000 tokens take the tiny model far longer (about 0.3 s
    // on an idle 2-core machine, where 0.3 s let both finish and the cut never came)
    let mut s = tiny(&[
        "--ctx",
        "512",
        "--shutdown-timeout",
        "0.05",
        "--parallel",
        "1",
    ]);
    let body = json!({"prompt": "Once", "max_tokens": 500, "temperature": 0, "ignore_eos": true, "stream": true});
    let mut st = Stream::open(s.addr, "/v1/completions", &body);
    st.next_event().unwrap();
    // a second one waits behind the first
    let _queued = Stream::open(s.addr, "/v1/completions", &body);
    let t = std::time::Instant::now();
    s.terminate();
    let status = s.child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{}", s.log());
    assert!(t.elapsed().as_secs_f64() < 10.0);
    assert!(s.log().contains("--shutdown-timeout passed"), "{}", s.log());
}

/// Whether a client test may skip: its tool is missing and `var` does not require it.
fn skip(var: &str, why: &str) -> bool {
    if std::env::var(var).is_ok_and(|v| v == "1") {
        panic!("{why}, and {var}=1 requires this test");
    }
    eprintln!("skipped: {why} (set {var}=1 to require it)");
    true
}

/// Runs the official `openai` Python client's checks against `s` serving `model_id`.
fn openai_client(s: &Server, model_id: &str) {
    let python = std::env::var("GRAFT_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has
        && skip(
            "GRAFT_REQUIRE_OPENAI",
            "python3 with the openai package is missing",
        )
    {
        return;
    }
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/cli/serve_clients/openai_client.py");
    let out = std::process::Command::new(&python)
        .arg(script)
        .arg(format!("http://{}", s.addr))
        .arg(model_id)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "{stdout}\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log()
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}

#[test]
fn the_openai_python_client_works_with_the_tiny_fixture() {
    let s = tiny(&[]);
    openai_client(&s, "llama3-tiny-bf16");
}

#[test]
fn the_openai_python_client_works_with_the_default_model() {
    let Some(s) = default_model_server(&["--ctx", "1024", "--alias", "smollm2"]) else {
        return;
    };
    openai_client(&s, "smollm2");
}

/// The chat page in headless Chromium (playwright-core from tests/cli/serve_clients/node_modules,
/// installed by `npm install` there): a typed message gets a streamed reply.
#[test]
fn the_chat_page_streams_a_reply_in_headless_chromium() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cli/serve_clients");
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    let ready = dir.join("node_modules/playwright-core").is_dir()
        && std::path::Path::new(&chromium).exists()
        && std::process::Command::new("node")
            .arg("--version")
            .output()
            .is_ok();
    if !ready
        && skip(
            "GRAFT_REQUIRE_BROWSER",
            "node, playwright-core (npm install in tests/cli/serve_clients) or chromium is missing",
        )
    {
        return;
    }
    let s = tiny(&["--ctx", "96"]);
    let shot = std::env::temp_dir().join(format!("graft-serve-page-{}.png", std::process::id()));
    let out = std::process::Command::new("node")
        .current_dir(&dir)
        .arg("page_test.mjs")
        .arg(format!("http://{}/", s.addr))
        .arg(&shot)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["kind"], "msg assistant", "the reply is no error: {v}");
    assert!(!v["reply"].as_str().unwrap().trim().is_empty(), "{v}");
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 5000,
        "a screenshot of the page"
    );
    assert!(
        s.log().contains("POST /v1/chat/completions 200"),
        "{}",
        s.log()
    );
}
