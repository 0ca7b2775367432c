//! The `graft` binary end to end: generate (JSON and streaming, with and without a
//! tokenizer), logits, dump, bench, and the error paths, which must print a clear
//! message and exit non-zero without a panic.

use std::process::{Command, Output};

use crate::fixtures::{fixture, TempCopy};

const FIXTURES: [&str; 3] = ["llama2-tiny-f32", "llama3-tiny-bf16", "llama3-tiny-f16"];

/// Greedy steps whose reference margin is below this are not compared: 10x the largest
/// logit error against the HF float32 reference measured on the fixtures (1.1e-2, see
/// tests/models/model_fixtures.rs). The fixtures were made with margins >= 0.1, so in practice
/// every step is compared.
const NOISE_FLOOR: f64 = 0.11;

fn reference(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn graft(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(args)
        .output()
        .expect("run graft")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs graft, expecting success; returns stdout.
fn ok(args: &[&str]) -> String {
    let o = graft(args);
    assert!(o.status.success(), "graft {args:?} failed: {}", stderr(&o));
    stdout(&o)
}

/// `graft --version` names the version and the commit the binary was built from (the
/// tree's HEAD, which the build reruns for), so a benchmark's figure names its build.
#[test]
fn version_names_the_commit() {
    let out = ok(&["--version"]);
    let head = Command::new("git")
        .args(["rev-parse", "--short=7", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let want = format!("graft {} ({head})", env!("CARGO_PKG_VERSION"));
    assert_eq!(out.trim(), want);
}

/// Runs graft, expecting failure with exit status 1 and every needle in the message.
fn fails(args: &[&str], needles: &[&str]) {
    let o = graft(args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "graft {args:?}: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(
        o.stdout.is_empty(),
        "graft {args:?} printed {:?} before failing",
        stdout(&o)
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(
            err.contains(n),
            "graft {args:?}: {err:?} does not mention {n:?}"
        );
    }
}

#[test]
fn generate_json_reproduces_hf_greedy_tokens() {
    for name in FIXTURES {
        let r = reference(name);
        let want = ids(&r["greedy_tokens"]);
        let safe = r["greedy_margins"]
            .as_array()
            .unwrap()
            .iter()
            .take_while(|m| m.as_f64().unwrap() > NOISE_FLOOR)
            .count();
        assert!(
            safe >= 12,
            "{name}: only {safe} steps above the noise floor"
        );
        let dir = fixture(name);
        let n = want.len().to_string();
        let out = ok(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            r["prompt_text"].as_str().unwrap(),
            "-n",
            &n,
            "--json",
        ]);
        let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert_eq!(
            ids(&j["prompt_ids"]),
            ids(&r["tokens"]),
            "{name}: tokenizer"
        );
        let got = ids(&j["generated_ids"]);
        assert_eq!(got[..safe], want[..safe], "{name}");
        assert!(j["prompt_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(j["gen_tokens_per_s"].as_f64().unwrap() > 0.0);
        assert_eq!(j["stop"], "length");
        assert_eq!(
            j["plans"], 2,
            "a batch graph for the prompt, one for decoding"
        );
        assert!(j["text"].is_string());
        assert_eq!(j["backend"], "cpu");
    }
}

#[test]
fn generate_streams_text_and_ids() {
    let r = reference("llama2-tiny-f32");
    let dir = fixture("llama2-tiny-f32");
    let prompt = r["prompt_text"].as_str().unwrap();
    let out = ok(&[
        "generate",
        "--model",
        dir.to_str().unwrap(),
        "--prompt",
        prompt,
        "-n",
        "6",
    ]);
    assert!(
        out.starts_with(prompt) && out.len() > prompt.len() + 1,
        "{out:?}"
    );

    // Without a tokenizer: token ids in, token ids out.
    let t = TempCopy::of("llama2-tiny-f32");
    std::fs::remove_file(t.path("tokenizer.json")).unwrap();
    let prompt_ids: Vec<String> = ids(&r["tokens"]).iter().map(u64::to_string).collect();
    let out = ok(&[
        "generate",
        "--model",
        t.dir(),
        "--token-ids",
        &prompt_ids.join(","),
        "-n",
        "5",
    ]);
    let (_, generated) = out.split_once("->").expect("ids after the prompt");
    let got: Vec<u64> = generated
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(got, ids(&r["greedy_tokens"])[..5]);
    let out = ok(&[
        "generate",
        "--model",
        t.dir(),
        "--token-ids",
        &prompt_ids.join(","),
        "-n",
        "3",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(j["text"].is_null());
    assert_eq!(ids(&j["generated_ids"]), ids(&r["greedy_tokens"])[..3]);
    fails(
        &["generate", "--model", t.dir(), "--prompt", "hello"],
        &["--prompt needs a tokenizer.json", "--token-ids"],
    );

    // Sampling with a seed is reproducible.
    let sample = |seed: &str| {
        ok(&[
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            prompt,
            "-n",
            "10",
            "--temperature",
            "0.9",
            "--top-k",
            "50",
            "--top-p",
            "0.9",
            "--seed",
            seed,
            "--json",
        ])
    };
    let ids_of = |s: String| {
        ids(&serde_json::from_str::<serde_json::Value>(s.trim()).unwrap()["generated_ids"])
    };
    assert_eq!(ids_of(sample("5")), ids_of(sample("5")));
}

#[test]
fn logits_writes_every_position() {
    let name = "llama3-tiny-f16";
    let r = reference(name);
    let tokens: Vec<String> = ids(&r["tokens"]).iter().map(u64::to_string).collect();
    let t = TempCopy::of(name);
    let out_file = t.path("out.safetensors");
    ok(&[
        "logits",
        "--model",
        fixture(name).to_str().unwrap(),
        "--token-ids",
        &tokens.join(","),
        "--out",
        out_file.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&out_file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let logits = st.tensor("logits").unwrap();
    assert_eq!(logits.dtype(), safetensors::Dtype::F32);
    assert_eq!(logits.shape(), [tokens.len(), 512]);
    let ref_bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let rst = safetensors::SafeTensors::deserialize(&ref_bytes).unwrap();
    let f32s = |b: &[u8]| -> Vec<f64> {
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect()
    };
    let (a, b) = (
        f32s(logits.data()),
        f32s(rst.tensor("logits_f16kv").unwrap().data()),
    );
    let err: f64 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
    let norm: f64 = b.iter().map(|y| y * y).sum();
    assert!(err / norm < 3e-9, "NMSE {}", err / norm);
}

#[test]
fn dump_text_and_dot() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    // The classic attention chain (the reference path).
    let text = ok(&["dump", "--model", d, "--flash-attn", "off"]);
    assert!(text.starts_with("# graft graph:"), "{text}");
    for needle in [
        "mul_mat",
        "diag_mask_inf",
        "cpy",
        "arena @",
        "bf16",
        "[64,192,1,1]",
    ] {
        assert!(text.contains(needle), "prefill dump lacks {needle:?}");
    }
    assert!(!text.contains("set_rows"));
    let dec = ok(&["dump", "--model", d, "--decode", "--flash-attn", "off"]);
    for needle in ["set_rows", "kq_mask", "soft_max", "[256,1,8,1]"] {
        assert!(dec.contains(needle), "decode dump lacks {needle:?}");
    }
    assert!(!dec.contains("diag_mask_inf"));
    // The default: the fused attention node, a mask input, no score chain.
    for args in [
        &["dump", "--model", d][..],
        &["dump", "--model", d, "--decode"][..],
    ] {
        let fa = ok(args);
        assert!(
            fa.contains("flash_attn_ext") && fa.contains("kq_mask"),
            "{fa}"
        );
        assert!(
            !fa.contains("soft_max") && !fa.contains("diag_mask_inf"),
            "{fa}"
        );
    }
    let q = ok(&[
        "dump",
        "--preset",
        "llama2-7b",
        "--cache-type-k",
        "q8_0",
        "--cache-type-v",
        "q4_0",
    ]);
    assert!(q.contains("q8_0") && q.contains("q4_0"), "{q}");
    fails(
        &["dump", "--model", d, "--cache-type-k", "q8_0"],
        &["head size", "multiple of 32", "16"],
    );
    fails(
        &[
            "dump",
            "--preset",
            "llama2-7b",
            "--flash-attn",
            "off",
            "--cache-type-v",
            "q4_0",
        ],
        &["needs flash attention"],
    );
    let dot = ok(&["dump", "--model", d, "--format", "dot"]);
    assert!(dot.starts_with("digraph graft {") && dot.trim_end().ends_with('}'));
    // A published shape without any weights: q|k|v of Model 3 8B is 4096 + 2 * 1024 wide.
    let big = ok(&[
        "dump",
        "--preset",
        "llama3-8b",
        "--decode",
        "--dtype",
        "f16",
    ]);
    assert!(big.contains("[4096,6144,1,1]") && big.contains("[4096,28672,1,1]"));
    let t = TempCopy::of("llama3-tiny-bf16");
    let out = t.path("g.dot");
    ok(&[
        "dump",
        "--model",
        d,
        "--format",
        "dot",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(std::fs::read_to_string(out).unwrap(), dot);
}

#[test]
fn bench_tiny_on_cpu() {
    let out = ok(&[
        "bench",
        "--preset",
        "tiny",
        "--backend",
        "cpu",
        "-p",
        "16",
        "-n",
        "8",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert!(j["prompt_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["gen_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["weight_bytes"].as_u64().unwrap() > 0);
    assert!(j["roofline_fraction"].is_null());
    assert_eq!(j["plans"], 2, "the prompt's shape and the decode shape");
    let out = ok(&[
        "bench",
        "--preset",
        "tiny",
        "-p",
        "8",
        "-n",
        "4",
        "--copy-bw",
        "100",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let f = j["roofline_fraction"].as_f64().unwrap();
    let expect = j["weight_bytes_per_token"].as_f64().unwrap()
        * j["gen_tokens_per_s"].as_f64().unwrap()
        / 100e9;
    assert!(
        (f - expect).abs() <= 1e-9 * expect.max(1.0),
        "{f} vs {expect}"
    );
    let text = ok(&["bench", "--preset", "tiny", "-p", "8", "-n", "4"]);
    assert!(
        text.contains("generation") && text.contains("unknown (pass --copy-bw GBPS)"),
        "{text}"
    );
    assert!(text.contains("d=0"), "{text}");
    // -d: the decode steps after that many tokens, the context sized for them
    let kv = |extra: &[&str]| {
        let mut args = vec!["bench", "--preset", "tiny", "-p", "8", "-n", "4", "--json"];
        args.extend_from_slice(extra);
        let j: serde_json::Value = serde_json::from_str(ok(&args).trim()).unwrap();
        assert!(j["gen_tokens_per_s"].as_f64().unwrap() > 0.0);
        (
            j["n_depth"].as_u64().unwrap(),
            j["kv_cache_bytes"].as_u64().unwrap(),
        )
    };
    let (d0, short) = kv(&[]);
    let (d, long) = kv(&["-d", "300"]);
    assert_eq!((d0, d), (0, 300));
    assert!(long > 10 * short, "KV bytes {long} at -d 300, {short} at 0");
}

/// `batched-bench` on the CPU: the table's rows line up with llama-batched-bench's
/// columns and arithmetic, and `--profile` times one decode step of each batch size.
#[test]
fn batched_bench_tiny_on_cpu() {
    let args = [
        "batched-bench",
        "--preset",
        "tiny",
        "--backend",
        "cpu",
        "--npp",
        "8",
        "--ntg",
        "4",
        "--npl",
        "1,3",
        "--profile",
    ];
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let j: serde_json::Value = serde_json::from_str(ok(&json_args).trim()).unwrap();
    let rows = j["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{j}");
    for (r, b) in rows.iter().zip([1u64, 3]) {
        assert_eq!((r["pp"].as_u64(), r["tg"].as_u64()), (Some(8), Some(4)));
        assert_eq!(r["b"].as_u64(), Some(b));
        assert_eq!(r["n_kv"].as_u64(), Some(b * 12));
        let s_tg = r["s_tg"].as_f64().unwrap();
        let expect = (b * 4) as f64 / r["t_tg"].as_f64().unwrap();
        assert!((s_tg - expect).abs() <= 1e-9 * expect, "{r}");
    }
    let profiles = j["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 2, "{j}");
    for (p, b) in profiles.iter().zip([1u64, 3]) {
        assert_eq!(p["b"].as_u64(), Some(b));
        let steps = p["steps"].as_array().unwrap();
        let sum: f64 = steps.iter().map(|s| s["us"].as_f64().unwrap()).sum();
        assert!(sum > 0.0 && p["wall_ms"].as_f64().unwrap() > 0.0, "{p}");
        assert!((p["kernels_ms"].as_f64().unwrap() - sum / 1e3).abs() < 1e-9);
        assert!(
            steps.iter().any(|s| s["op"] == "mul_mat")
                && steps.iter().any(|s| s["op"] == "paged_attn"),
            "{p}"
        );
    }
    let text = ok(&args);
    assert!(
        text.contains("|    PP |     TG |    B |   N_KV |"),
        "{text}"
    );
    assert!(
        text.contains("decode step at B = 3:") && text.contains("| mul_mat |"),
        "{text}"
    );
    fails(
        &[
            "batched-bench",
            "--preset",
            "tiny",
            "--npp",
            "8",
            "--ntg",
            "2",
            "--profile",
        ],
        &["--profile", "--ntg of at least 3"],
    );
}

#[test]
fn errors_are_clear_and_never_panic() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    fails(
        &["generate", "--model", d, "--token-ids", "0,600,3"],
        &["token 600 at position 1", "outside the vocabulary of 512"],
    );
    fails(
        &[
            "generate",
            "--model",
            d,
            "--prompt",
            "The old lighthouse",
            "--ctx",
            "20",
            "-n",
            "30",
        ],
        &["exceeds the context of 20 tokens"],
    );
    fails(
        &[
            "generate",
            "--model",
            "/nonexistent/model",
            "--token-ids",
            "1",
        ],
        &["/nonexistent/model", "does not exist"],
    );
    fails(
        &[
            "logits",
            "--model",
            d,
            "--token-ids",
            "1,9999",
            "--out",
            "/tmp/x",
        ],
        &["index 9999"],
    );
    let t = TempCopy::of("llama3-tiny-bf16");
    let cfg = std::fs::read_to_string(t.path("config.json")).unwrap();
    std::fs::write(
        t.path("config.json"),
        cfg.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"),
    )
    .unwrap();
    fails(
        &["generate", "--model", t.dir(), "--token-ids", "1"],
        &["config.json", "'num_key_value_heads'"],
    );
    fails(&["dump", "--model", t.dir()], &["'num_key_value_heads'"]);
    fails(
        &["bench", "--preset", "llama9"],
        &["unknown preset 'llama9'", "llama3-8b"],
    );
    fails(
        &[
            "generate",
            "--model",
            d,
            "--token-ids",
            "1",
            "--temperature=-1",
        ],
        &["temperature"],
    );
    fails(
        &[
            "generate",
            "--model",
            d,
            "--token-ids",
            "1",
            "--temperature",
            "1",
            "--top-p",
            "1.5",
        ],
        &["top-p"],
    );
    #[cfg(not(feature = "cuda"))]
    fails(
        &[
            "generate",
            "--model",
            d,
            "--token-ids",
            "1",
            "--backend",
            "cuda",
        ],
        &["without CUDA support"],
    );
    // Usage errors are clap's: exit status 2 with a usage message.
    // (Without --model, generate uses the default model: a missing prompt is the error.)
    let o = graft(&["generate", "--model", d]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("--prompt"));
    let o = graft(&["generate", "--model", d, "--token-ids", "1", "--chat"]);
    assert_eq!(o.status.code(), Some(2));
    let o = graft(&["generate", "--model", d, "--token-ids", "1,x"]);
    assert_eq!(o.status.code(), Some(2));
}

/// Negative numbers reach the option's own check (not "unexpected argument"), and a
/// prompt can come from a file or standard input.
#[test]
fn negative_numbers_and_prompt_files() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    fails(
        &[
            "generate",
            "--model",
            d,
            "--prompt",
            "hi",
            "--temperature",
            "-1",
        ],
        &["temperature", "-1"],
    );
    for (flag, value) in [("-n", "-1"), ("--seed", "-3"), ("--ctx", "-5")] {
        let o = graft(&["generate", "--model", d, "--prompt", "hi", flag, value]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{flag} {value}: {err}");
        assert!(err.contains(&format!("invalid value '{value}'")), "{err}");
        assert!(!err.contains("unexpected argument"), "{err}");
    }
    let file = std::env::temp_dir().join(format!("graft-prompt-{}.txt", std::process::id()));
    std::fs::write(&file, "Once upon a time").unwrap();
    let f = file.to_str().unwrap();
    let from_file = ok(&[
        "generate", "--model", d, "-f", f, "-n", "4", "--json", "--quiet",
    ]);
    let from_arg = ok(&[
        "generate",
        "--model",
        d,
        "--prompt",
        "Once upon a time",
        "-n",
        "4",
        "--json",
        "--quiet",
    ]);
    let ids = |s: &str| {
        let v: serde_json::Value = serde_json::from_str(s).unwrap();
        (v["prompt_ids"].clone(), v["generated_ids"].clone())
    };
    assert_eq!(ids(&from_file), ids(&from_arg));
    let mut child = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args([
            "generate", "--model", d, "-f", "-", "-n", "4", "--json", "--quiet",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Once upon a time")
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(ids(&stdout(&o)), ids(&from_arg));
    std::fs::remove_file(&file).unwrap();
    fails(
        &["generate", "--model", d, "-f", "/"],
        &["not a regular file"],
    );
    fails(
        &["generate", "--model", d, "-f", "/nonexistent/prompt.txt"],
        &["/nonexistent/prompt.txt"],
    );
}

/// `bench --model` runs a model's own weights (a folder or a GGUF file) instead of a
/// preset; `--preset` and `--model` exclude each other.
#[test]
fn bench_takes_a_model() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    let out = ok(&[
        "bench", "--model", d, "-p", "4", "-n", "2", "--reps", "1", "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["model"], d);
    assert_eq!(v["dtype"], "as stored");
    assert!(v["gen_tokens_per_s"].as_f64().unwrap() > 0.0, "{out}");
    let q = ok(&[
        "bench",
        "--model",
        d,
        "--quantize",
        "q8_0",
        "-p",
        "4",
        "-n",
        "2",
        "--reps",
        "1",
        "--json",
    ]);
    assert!(q.contains("\"dtype\":\"q8_0\""), "{q}");
    let o = graft(&["bench", "--model", d, "--preset", "tiny"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// `dump --tp 2` says what each device holds and shows the graph every device runs,
/// with an all_reduce after each layer's attention output and down projection; text and
/// DOT alike.
#[test]
fn dump_shows_the_split_graph() {
    let o = graft(&["dump", "--preset", "tiny", "--tp", "2", "--decode"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(
        text.starts_with("# device 0 of 2: query heads 0..4, KV heads 0..1"),
        "{text}"
    );
    assert!(text.contains("# device 1 of 2: query heads 4..8, KV heads 1..2"));
    let reduces = text.lines().filter(|l| l.contains(" all_reduce ")).count();
    assert_eq!(reduces, 2 * 4, "{text}"); // tiny: 4 layers
    let o = graft(&["dump", "--preset", "tiny", "--tp", "2", "--format", "dot"]);
    let dot = String::from_utf8(o.stdout).unwrap();
    assert!(
        dot.starts_with("// device 0 of 2") && dot.contains("digraph"),
        "{dot}"
    );
    let o = graft(&["dump", "--preset", "tiny"]);
    let plain = String::from_utf8(o.stdout).unwrap();
    assert!(!plain.contains("all_reduce") && !plain.contains("# device"));
}

/// A cache folder whose default model is the tiny llama3 fixture as GGUF (stamped as
/// verified, so no download and no hashing).
fn fake_default_model_cache(tag: &str) -> std::path::PathBuf {
    use graft::models::pull::DEFAULT_MODEL;
    let cache = std::env::temp_dir().join(format!("graft-cli-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(&cache).unwrap();
    let file = cache.join(DEFAULT_MODEL.file_name);
    let m = fixture("llama3-tiny-bf16");
    ok(&[
        "convert",
        "--model",
        m.to_str().unwrap(),
        "--type",
        "f32",
        "--out",
        file.to_str().unwrap(),
        "--quiet",
    ]);
    let size = std::fs::metadata(&file).unwrap().len();
    std::fs::write(
        cache.join(format!("{}.sha256", DEFAULT_MODEL.file_name)),
        format!("{} {size}\n", DEFAULT_MODEL.sha256),
    )
    .unwrap();
    cache
}

/// graft with `args` and the cache folder `cache`.
fn graft_cached(args: &[&str], cache: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(args)
        .env("GRAFT_CACHE", cache)
        .output()
        .expect("run graft")
}

/// Every command that reads a model takes the same `--model` and, without it, the
/// default model from the cache: the output equals that of `--model` naming the file.
#[test]
fn commands_without_model_use_the_default_model() {
    let cache = fake_default_model_cache("default");
    let file = cache.join(graft::models::pull::DEFAULT_MODEL.file_name);
    let f = file.to_str().unwrap();
    let out = cache.join("l.safetensors");
    let o = out.to_str().unwrap();
    let cases: Vec<Vec<&str>> = vec![
        vec!["tokenize", "--text", "Hello world", "--json"],
        vec!["logits", "--token-ids", "1,2,3", "--out", "-", "--quiet"],
        vec![
            "generate",
            "--token-ids",
            "1,2",
            "-n",
            "3",
            "--json",
            "--quiet",
        ],
        vec!["trace", "--tokens", "1,2", "--json", "--quiet"],
        vec!["logits", "--token-ids", "4,5", "--out", o, "--quiet"],
    ];
    for args in cases {
        let default = graft_cached(&args, &cache);
        assert!(default.status.success(), "{args:?}: {}", stderr(&default));
        let mut named = vec![args[0], "--model", f];
        named.extend_from_slice(&args[1..]);
        let named = graft_cached(&named, &cache);
        assert!(named.status.success(), "{args:?}: {}", stderr(&named));
        if args[0] == "generate" {
            // Speeds differ between runs: compare the ids only.
            let ids = |o: &Output| {
                let v: serde_json::Value = serde_json::from_str(&stdout(o)).unwrap();
                (v["prompt_ids"].clone(), v["generated_ids"].clone())
            };
            assert_eq!(ids(&default), ids(&named), "{args:?}");
        } else {
            assert_eq!(default.stdout, named.stdout, "{args:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&cache);
}

/// The model options are one set, accepted with the same meaning by every command that
/// runs a model: `--dtype` is `--quantize` (also for `bench --model`, where it used to be
/// ignored), and the context and cache options reach the model.
#[test]
fn every_command_that_runs_a_model_takes_the_model_options() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    let shared = [
        "--model",
        d,
        "--ctx",
        "16",
        "--ctk",
        "f32",
        "--ctv",
        "bf16",
        "--backend",
        "cpu",
        "--tp",
        "1",
    ];
    let with = |head: &[&'static str], tail: &[&'static str]| {
        let mut a: Vec<&str> = head.to_vec();
        a.extend_from_slice(&shared);
        a.extend_from_slice(tail);
        a
    };
    let logits = |dtype: &[&'static str]| {
        let mut tail = vec!["--token-ids", "1,2,3", "--out", "-", "--quiet"];
        tail.extend_from_slice(&["--flash-attn", "off"]);
        tail.extend_from_slice(dtype);
        graft(&with(&["logits"], &tail)).stdout
    };
    let plain = logits(&[]);
    let q = logits(&["--quantize", "q8_0"]);
    assert!(!plain.is_empty() && plain != q, "q8_0 changed nothing");
    assert_eq!(logits(&["--dtype", "q8_0"]), q, "--dtype is --quantize");
    ok(&with(
        &["generate"],
        &["--token-ids", "1,2", "-n", "2", "--dtype", "q8_0"],
    ));
    // the engine runs the fused paged attention only, and says so
    fails(
        &with(
            &["generate"],
            &["--token-ids", "1,2", "--flash-attn", "off"],
        ),
        &["--flash-attn off", "fused paged attention"],
    );
    ok(&with(
        &["trace"],
        &[
            "--tokens",
            "1,2",
            "--dtype",
            "q8_0",
            "--quiet",
            "--flash-attn",
            "off",
        ],
    ));
    let bench = ok(&with(
        &["bench"],
        &[
            "-p", "4", "-n", "2", "--reps", "1", "--dtype", "q8_0", "--json",
        ],
    ));
    assert!(bench.contains("\"dtype\":\"q8_0\""), "{bench}");
    let mut chat = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(with(
            &["chat"],
            &["--quantize", "q8_0", "-n", "2", "--quiet"],
        ))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    chat.stdin.take().unwrap().write_all(b"hi\n").unwrap();
    let o = chat.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    // --ctx reaches the model: 20 tokens do not fit 16 positions.
    fails(
        &with(
            &["logits"],
            &[
                "--token-ids",
                "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17",
                "--out",
                "-",
            ],
        ),
        &["context of 16"],
    );
}

/// Sampling settings: for chats, flags over the model's generation_config.json over the
/// chat defaults, printed once with --verbose; a plain completion stays greedy whatever
/// the model recommends; --json carries the settings and their sources; bad values name
/// their flag.
#[test]
fn sampling_settings_follow_their_precedence() {
    let t = TempCopy::of("llama3-tiny-bf16");
    std::fs::write(
        t.path("generation_config.json"),
        r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.5}"#,
    )
    .unwrap();
    let o = graft(&[
        "generate",
        "--chat",
        "--model",
        t.dir(),
        "--prompt",
        "hi",
        "-n",
        "2",
        "--quiet",
        "--verbose",
        "--top-k",
        "7",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("sampling:").count(), 1, "{err}");
    for needle in [
        "temperature 0.6 (model)",
        "top_p 0.5 (model)",
        "top_k 7 (flag)",
        "min_p 0.05 (default)",
        "repeat_penalty 1.1 (default)",
        "(random)",
        "generation_config.json",
    ] {
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let json = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            "--model",
            t.dir(),
            "--token-ids",
            "1,2",
            "-n",
            "3",
        ];
        args.extend_from_slice(&["--json", "--quiet"]);
        args.extend_from_slice(extra);
        serde_json::from_str::<serde_json::Value>(ok(&args).trim()).unwrap()
    };
    let j = json(&[
        "--logit-bias",
        "5-inf",
        "--logit-bias",
        "7+1.5",
        "--seed",
        "3",
    ]);
    let s = &j["sampling"];
    assert_eq!(s["temperature"], 0.0, "{s}");
    assert_eq!(s["sources"]["temperature"], "default");
    assert_eq!(
        s["sources"]["top_p"], "default",
        "the model's settings are for chats"
    );
    assert_eq!(s["seed"], 3);
    assert_eq!(s["logit_bias"], serde_json::json!([[5, "-inf"], [7, 1.5]]));
    assert_eq!(s["sources"]["logit_bias"], "flag");
    // a bias moves the greedy pick: the banned first token never comes back
    let plain = ids(&json(&[])["generated_ids"]);
    let ban = format!("{}-inf", plain[0]);
    let banned = ids(&json(&["--logit-bias", &ban])["generated_ids"]);
    assert!(!banned.contains(&plain[0]), "{plain:?} {banned:?}");
    let d = t.dir();
    let g = |extra: &[&'static str]| {
        let mut a = vec![
            "generate",
            "--model",
            d,
            "--token-ids",
            "1",
            "--temperature",
            "1",
        ];
        a.extend_from_slice(extra);
        a
    };
    fails(&g(&["--min-p", "2"]), &["--min-p", "2"]);
    fails(&g(&["--typical-p", "-1"]), &["--typical-p"]);
    fails(&g(&["--repeat-penalty", "0"]), &["--repeat-penalty"]);
    fails(
        &g(&["--logit-bias", "100000+1"]),
        &["--logit-bias", "100000"],
    );
    fails(&g(&["--logit-bias", "3+inf"]), &["--logit-bias"]);
    for bad in ["3*2", "x+1", "3+y"] {
        let o = graft(&g(&["--logit-bias", bad]));
        assert_eq!(o.status.code(), Some(2), "{bad}: {}", stderr(&o));
        assert!(stderr(&o).contains(bad), "{}", stderr(&o));
    }
    std::fs::write(t.path("generation_config.json"), r#"{"top_p": 7}"#).unwrap();
    fails(
        &["generate", "--chat", "--model", d, "--prompt", "hi"],
        &["generation_config.json", "top_p"],
    );
}

/// `generate --chat --json` prints one object for the turn: the same reply as the
/// streamed text, its ids, why it stopped, the prompt and reply sizes. It used to be
/// refused.
#[test]
fn generate_chat_json() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    let chat = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--chat",
            "--model",
            d,
            "--prompt",
            "What is the capital of France?",
            "-n",
            "7",
            "--temperature",
            "0",
            "--quiet",
        ];
        a.extend_from_slice(extra);
        ok(&a)
    };
    let streamed = chat(&[]);
    let j: serde_json::Value = serde_json::from_str(chat(&["--json"]).trim()).unwrap();
    assert_eq!(j["text"].as_str().map(|t| format!("{t}\n")), Some(streamed));
    let n = j["gen_tokens"].as_u64().unwrap();
    assert!((1..=7).contains(&n), "{j}");
    assert_eq!(j["generated_ids"].as_array().unwrap().len() as u64, n);
    let stop = j["stop"].as_str().unwrap();
    assert!(stop == "eos" || (stop == "length" && n == 7), "{j}");
    assert!(j["prompt_tokens"].as_u64().unwrap() > 7, "{j}");
    assert_eq!(j["backend"], "cpu");
}
