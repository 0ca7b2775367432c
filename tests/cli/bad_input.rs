//! The bad-input corpus: malformed files of every format graft reads (config.json,
//! safetensors headers, shard indexes, GGUF files, tokenizer.json, chat templates) and bad
//! command-line values, each run through the real `graft` binary. Every case must end
//! with a normal error exit (1, or 2 for clap's usage errors; never a panic's 101 or an
//! abort's signal), within a time limit (no hang), with a message that names the
//! problem. The malformed files are made here from the committed fixtures.
//!
//! Also here: the output guarantees (inputs never overwritten, devices/FIFOs/symlinks
//! kept, `-` for stdout, write errors reported) and non-finite logits stopping a run.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::fixtures::{fixture, join_safetensors, split_safetensors, TempCopy};

/// The longest any case may take: a hang fails the test instead of blocking it.
const LIMIT: Duration = Duration::from_secs(60);

/// Runs graft with `args` (stdin from `input`), killing it after [`LIMIT`].
fn run_with(args: &[&str], input: &[u8]) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run graft");
    let mut stdin = child.stdin.take().expect("stdin");
    // A child that exits before reading its input closes the pipe: not an error here.
    let _ = stdin.write_all(input);
    drop(stdin);
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("graft {args:?} hung for more than {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.wait_with_output().expect("output")
}

fn run(args: &[&str]) -> Output {
    run_with(args, b"")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Expects a normal error exit (`code`) whose message holds every needle.
fn fails_with(code: i32, args: &[&str], needles: &[&str]) {
    let o = run(args);
    let err = stderr(&o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "graft {args:?}: status {:?}: {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "graft {args:?} panicked: {err}");
    for n in needles {
        assert!(err.contains(n), "graft {args:?}: '{n}' not in: {err}");
    }
}

/// Expects `error: ...` with exit status 1 naming every needle.
fn fails(args: &[&str], needles: &[&str]) {
    fails_with(1, args, needles);
    let err = stderr(&run(args));
    assert!(err.starts_with("error: "), "{err}");
}

/// The long flags (`--name`) in `text`.
fn long_flags(text: &str) -> Vec<&str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter(|w| w.len() > 2 && w.starts_with("--") && w.as_bytes()[2].is_ascii_lowercase())
        .collect()
}

/// Expects [`fails`], and every long flag the message names to be one `graft <command>`
/// takes (listed by its --help): advice never names another command's flag.
fn fails_naming_own_flags(args: &[&str], needles: &[&str]) {
    fails(args, needles);
    let err = stderr(&run(args));
    let help = String::from_utf8(ok(&[args[0], "--help"])).unwrap();
    let own = long_flags(&help);
    for flag in long_flags(&err) {
        assert!(
            own.contains(&flag),
            "graft {args:?} names {flag}, which {} lacks: {err}",
            args[0]
        );
    }
}

/// Expects success; returns stdout.
fn ok(args: &[&str]) -> Vec<u8> {
    let o = run(args);
    assert!(o.status.success(), "graft {args:?}: {}", stderr(&o));
    o.stdout
}

/// A `generate` of one token from the folder or file `model`.
fn gen1(model: &str) -> Vec<&str> {
    vec![
        "generate",
        "--model",
        model,
        "--token-ids",
        "1,2",
        "-n",
        "2",
        "--quiet",
    ]
}

/// A copy of llama3-tiny-bf16 whose config.json has `edit` applied.
fn with_config(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> TempCopy {
    let t = TempCopy::of("llama3-tiny-bf16");
    let text = std::fs::read_to_string(t.path("config.json")).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    edit(v.as_object_mut().unwrap());
    std::fs::write(t.path("config.json"), v.to_string()).unwrap();
    t
}

/// One config field set to `value`.
fn config_field(field: &str, value: Value) -> TempCopy {
    with_config(|m| {
        m.insert(field.to_string(), value);
    })
}

/// Makes a FIFO at `path`.
#[cfg(unix)]
fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let st = Command::new("mkfifo").arg(path).status().expect("mkfifo");
    assert!(st.success());
}

#[test]
fn config_fields_are_checked_and_named() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("hidden_size", json!(0), "'hidden_size'"),
        ("hidden_size", json!(-64), "'hidden_size'"),
        ("hidden_size", json!("64"), "'hidden_size'"),
        ("hidden_size", json!(1u64 << 30), "'hidden_size'"),
        (
            "num_hidden_layers",
            json!(1_000_000_000),
            "'num_hidden_layers'",
        ),
        ("num_hidden_layers", json!(3), "'num_hidden_layers'"),
        ("num_hidden_layers", json!(1.5), "'num_hidden_layers'"),
        ("vocab_size", json!(1u64 << 30), "'vocab_size'"),
        (
            "intermediate_size",
            json!(1u64 << 30),
            "'intermediate_size'",
        ),
        ("num_attention_heads", json!(5), "num_attention_heads"),
        ("num_key_value_heads", json!(3), "'num_key_value_heads'"),
        ("head_dim", json!(3), "'head_dim'"),
        ("head_dim", json!(1u64 << 30), "'num_attention_heads'"),
        (
            "max_position_embeddings",
            json!(0),
            "'max_position_embeddings'",
        ),
        ("rms_norm_eps", json!(-1), "'rms_norm_eps'"),
        ("rope_theta", json!("big"), "'rope_theta'"),
        (
            "rope_parameters",
            json!({"rope_type": "yarn"}),
            "rope_parameters.rope_type",
        ),
        ("rope_parameters", json!(7), "'rope_parameters'"),
        ("eos_token_id", json!("two"), "'eos_token_id'"),
        ("bos_token_id", json!(1.5), "'bos_token_id'"),
        ("torch_dtype", json!(16), "'torch_dtype'"),
        ("hidden_act", json!("gelu"), "'hidden_act'"),
        ("model_type", json!("falcon"), "'model_type'"),
    ];
    for (field, value, needle) in cases {
        println!("config.json field {field} = {value}");
        let t = config_field(field, value);
        fails(&gen1(t.dir()), &[needle]);
    }
    let t = with_config(|m| {
        m.remove("hidden_size");
    });
    fails(&gen1(t.dir()), &["'hidden_size'", "missing"]);
    // Four size fields of 2^30 at once: refused before anything is allocated.
    let t = with_config(|m| {
        for f in [
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ] {
            m.insert(f.into(), json!(1u64 << 30));
        }
    });
    fails(&gen1(t.dir()), &["config.json", "field '"]);
}

/// Special-token ids outside the vocabulary (HF's GPT-2 defaults, 50256, in a smaller
/// vocabulary; -1 for none; llama.cpp's "bad special token" in a GGUF file) and a
/// torch_dtype graft does not load are accepted, as transformers and llama.cpp accept
/// them: one warning naming the field, the value unused, the run going on to its -n
/// tokens. They used to be refused.
#[test]
fn special_token_ids_outside_the_vocabulary_are_warnings() {
    let check = |model: &str, needles: &[&str]| {
        let o = run(&gen1(model));
        let err = stderr(&o);
        assert!(o.status.success(), "{model}: {err}");
        assert_eq!(err.matches("warning: ").count(), 1, "{err}");
        for n in needles {
            assert!(err.contains(n), "'{n}' not in: {err}");
        }
    };
    for (field, value) in [
        ("eos_token_id", json!(99999)),
        ("bos_token_id", json!(-1)),
        ("eos_token_id", json!([2, 50256])),
    ] {
        let t = config_field(field, value);
        check(
            t.dir(),
            &[&format!("'{field}'"), "not a token of the vocabulary"],
        );
    }
    // a checkpoint's dtype graft has no use for: transformers accepts any
    for dtype in ["int8", "float64"] {
        let t = config_field("torch_dtype", json!(dtype));
        check(t.dir(), &["'torch_dtype'", dtype, "not used"]);
    }
    use graft::gguf::Value as V;
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"] {
        let p = gguf_with("special", |md, _| set(md, key, V::U32(99999)));
        check(p.to_str().unwrap(), &[key, "99999"]);
    }
    // A text needs the BOS this tokenizer adds: that, and only that, is an error.
    let p = gguf_with("special", |md, _| {
        set(md, "tokenizer.ggml.bos_token_id", V::U32(99999))
    });
    let p = p.to_str().unwrap();
    fails_with(
        1,
        &["generate", "--model", p, "--prompt", "hi", "-n", "1"],
        &["tokenizer.ggml.bos_token_id 99999", "--token-ids"],
    );
    ok(&["tokenize", "--model", p, "--text", "hi", "--no-bos"]);
}

/// gpt2-tiny-f32 cut to a vocabulary of 300 (the first 300 rows of its tied embedding,
/// no tokenizer) with HF's GPT-2 defaults `bos_token_id` = `eos_token_id` = 50256, outside
/// it: a folder transformers loads and runs (GPT2Config does not check those ids).
fn gpt2_vocab_300() -> TempCopy {
    let t = TempCopy::of("gpt2-tiny-f32");
    std::fs::remove_file(t.path("tokenizer.json")).unwrap();
    let text = std::fs::read_to_string(t.path("config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    for (k, v) in [
        ("vocab_size", 300),
        ("bos_token_id", 50256),
        ("eos_token_id", 50256),
    ] {
        cfg[k] = json!(v);
    }
    std::fs::write(t.path("config.json"), cfg.to_string()).unwrap();
    let (mut h, data) = split_safetensors(&t.path("model.safetensors"));
    let mut names: Vec<String> = h
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect();
    names.sort_by_key(|n| h[n]["data_offsets"][0].as_u64().unwrap());
    let mut out = Vec::new();
    for n in names {
        let offs = &h[&n]["data_offsets"];
        let (s, mut e) = (offs[0].as_u64().unwrap(), offs[1].as_u64().unwrap());
        if n == "transformer.wte.weight" {
            e = s + 300 * 64 * 4;
            h[&n]["shape"] = json!([300, 64]);
        }
        h[&n]["data_offsets"] = json!([out.len(), out.len() as u64 + e - s]);
        out.extend_from_slice(&data[s as usize..e as usize]);
    }
    join_safetensors(&t.path("model.safetensors"), &h, &out);
    t
}

/// The F32 logits [n, vocab] `graft logits` writes to stdout for `ids` of `model`.
fn logits_of(model: &str, ids: &str) -> (Vec<f32>, Vec<usize>) {
    let bytes = ok(&[
        "logits",
        "--model",
        model,
        "--token-ids",
        ids,
        "--out",
        "-",
        "--quiet",
    ]);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (v, t.shape().to_vec())
}

/// A GPT-2 folder with HF's default bos/eos (50256) and a vocabulary of 300 runs: its
/// logits are the first 300 of the full fixture's (the same model with the rest of the
/// embedding cut off), generate runs to -n (no EOS to stop at), dump and convert work,
/// and the warning names the field once per run.
#[test]
fn a_gpt2_folder_with_hf_default_special_tokens_runs() {
    let small = gpt2_vocab_300();
    let full = fixture("gpt2-tiny-f32");
    let ids = "5,17,123,299";
    let (got, shape) = logits_of(small.dir(), ids);
    let (want, full_shape) = logits_of(full.to_str().unwrap(), ids);
    assert_eq!((shape, full_shape), (vec![4, 300], vec![4, 512]));
    for (row, w) in got.chunks(300).zip(want.chunks(512)) {
        for (a, b) in row.iter().zip(&w[..300]) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
    let o = run(&[
        "generate",
        "--model",
        small.dir(),
        "--token-ids",
        ids,
        "-n",
        "6",
        "--json",
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("'eos_token_id' 50256").count(), 1, "{err}");
    assert_eq!(err.matches("'bos_token_id' 50256").count(), 1, "{err}");
    let j: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (j["gen_tokens"].as_u64(), j["stop"].as_str()),
        (Some(6), Some("length"))
    );
    ok(&["dump", "--model", small.dir()]);
    let gguf = tempdir("gpt2-300").join("m.gguf");
    let g = gguf.to_str().unwrap();
    ok(&[
        "convert",
        "--model",
        small.dir(),
        "--type",
        "f32",
        "--out",
        g,
        "--quiet",
    ]);
    let (from_gguf, _) = logits_of(g, ids);
    assert_eq!(from_gguf, got, "the GGUF file's logits");
}

/// A chat model whose config names no valid EOS (50256 in a vocabulary of 512) replies
/// until the chat template's end of turn or -n tokens.
#[test]
fn chat_without_a_valid_eos_stops_at_n() {
    let t = TempCopy::of("gpt2-tiny-f32");
    let text = std::fs::read_to_string(t.path("config.json")).unwrap();
    let mut cfg: Value = serde_json::from_str(&text).unwrap();
    cfg["eos_token_id"] = json!(50256);
    std::fs::write(t.path("config.json"), cfg.to_string()).unwrap();
    let o = run(&[
        "generate",
        "--chat",
        "--model",
        t.dir(),
        "--prompt",
        "hi",
        "-n",
        "3",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("'eos_token_id' 50256"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn config_files_that_are_not_json_objects() {
    let cases: Vec<(&[u8], &str)> = vec![
        (b"{ not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b"\xff\xfe{}", "not UTF-8"),
    ];
    for (bytes, needle) in cases {
        let t = TempCopy::of("llama3-tiny-bf16");
        std::fs::write(t.path("config.json"), bytes).unwrap();
        fails(&gen1(t.dir()), &["config.json", needle]);
    }
    let t = TempCopy::of("llama3-tiny-bf16");
    std::fs::remove_file(t.path("config.json")).unwrap();
    fails(&gen1(t.dir()), &["config.json"]);
    std::fs::create_dir(t.path("config.json")).unwrap();
    fails(&gen1(t.dir()), &["config.json", "not a regular file"]);
}

/// A config.json, model file or tokenizer that is a FIFO is an error at once, not a hang.
#[cfg(unix)]
#[test]
fn fifos_as_inputs_are_refused_not_waited_on() {
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        let t = TempCopy::of("llama3-tiny-bf16");
        mkfifo(&t.path(file));
        let mut args = gen1(t.dir());
        args.extend(["--prompt", "hi"]);
        args.retain(|a| *a != "--token-ids" && *a != "1,2");
        fails(&args, &[file, "not a regular file (a FIFO)"]);
    }
    let t = TempCopy::of("llama3-tiny-f16");
    mkfifo(&t.path("model.safetensors.index.json"));
    fails(&gen1(t.dir()), &["index.json", "a FIFO"]);
    let dir = tempdir("fifo-gguf");
    let g = dir.join("m.gguf");
    mkfifo(&g);
    fails(&gen1(g.to_str().unwrap()), &["m.gguf", "a FIFO"]);
}

/// A copy of llama3-tiny-bf16 whose safetensors header has `edit` applied.
fn with_header(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> TempCopy {
    let t = TempCopy::of("llama3-tiny-bf16");
    let (mut h, data) = split_safetensors(&t.path("model.safetensors"));
    edit(h.as_object_mut().unwrap());
    join_safetensors(&t.path("model.safetensors"), &h, &data);
    t
}

const EMBED: &str = "model.embed_tokens.weight";

#[test]
fn safetensors_headers_are_checked() {
    let cases: Vec<(TempCopy, Vec<&str>)> = vec![
        (
            with_header(|m| m[EMBED]["dtype"] = json!("I64")),
            vec![EMBED, "I64"],
        ),
        (
            with_header(|m| m[EMBED]["dtype"] = json!("F8_E4M3")),
            vec![EMBED],
        ),
        (
            with_header(|m| m[EMBED]["shape"] = json!([512, 32])),
            vec!["shape [512, 32]", EMBED],
        ),
        (
            with_header(|m| {
                m.remove("model.norm.weight");
            }),
            vec!["model.norm.weight", "missing"],
        ),
        (
            with_header(|m| {
                let e = m[EMBED].clone();
                m.insert("model.extra.weight".into(), e);
            }),
            vec!["model.extra.weight"],
        ),
        (
            with_header(|m| m[EMBED]["data_offsets"] = json!([0, 1u64 << 40])),
            vec!["model.safetensors"],
        ),
        (
            with_header(|m| m[EMBED]["shape"] = json!([1u64 << 30, 1u64 << 30])),
            vec!["model.safetensors"],
        ),
        (
            with_header(|m| {
                m.insert("__metadata__".into(), json!(7));
            }),
            vec!["model.safetensors", "header"],
        ),
    ];
    for (t, needles) in cases {
        fails(&gen1(t.dir()), &needles);
    }
}

#[test]
fn safetensors_files_that_are_cut_or_garbled() {
    let orig = std::fs::read(fixture("llama3-tiny-bf16").join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(orig[..8].try_into().unwrap()) as usize;
    let mut huge_len = orig.clone();
    huge_len[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut not_json = orig.clone();
    not_json[8] = b'#';
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (orig[..5].to_vec(), "too short"),
        (Vec::new(), "too short"),
        (huge_len, "header claims"),
        (not_json, "bad safetensors header"),
        (orig[..8 + n + 100].to_vec(), "truncated"),
        (orig[..orig.len() - 1].to_vec(), "truncated"),
    ];
    for (bytes, needle) in cases {
        let t = TempCopy::of("llama3-tiny-bf16");
        std::fs::write(t.path("model.safetensors"), bytes).unwrap();
        fails(&gen1(t.dir()), &["model.safetensors", needle]);
    }
    let t = TempCopy::of("llama3-tiny-bf16");
    std::fs::remove_file(t.path("model.safetensors")).unwrap();
    fails(&gen1(t.dir()), &["no model.safetensors"]);
}

/// A copy of the sharded fixture whose index has `edit` applied.
fn with_index(edit: impl FnOnce(&mut Value)) -> TempCopy {
    let t = TempCopy::of("llama3-tiny-f16");
    let p = t.path("model.safetensors.index.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
    t
}

fn set_shard(v: &mut Value, file: &str) {
    v["weight_map"][EMBED] = json!(file);
}

#[test]
fn shard_indexes_stay_inside_the_folder() {
    let cases: Vec<(TempCopy, Vec<&str>)> = vec![
        (
            with_index(|v| set_shard(v, "../x.safetensors")),
            vec![EMBED, "'..'"],
        ),
        (
            with_index(|v| set_shard(v, "/etc/passwd")),
            vec![EMBED, "absolute path"],
        ),
        (with_index(|v| set_shard(v, "")), vec![EMBED, "empty path"]),
        (
            with_index(|v| set_shard(v, "sub/../../x")),
            vec![EMBED, "'..'"],
        ),
        (
            with_index(|v| set_shard(v, "missing.safetensors")),
            vec!["missing.safetensors"],
        ),
        (
            with_index(|v| v["weight_map"][EMBED] = json!(7)),
            vec!["weight_map", EMBED],
        ),
        (
            with_index(|v| {
                v.as_object_mut().unwrap().remove("weight_map");
            }),
            vec!["'weight_map'"],
        ),
        (
            with_index(|v| {
                v["weight_map"]["model.bogus.weight"] = json!("model-00001-of-00002.safetensors")
            }),
            vec!["model.bogus.weight", "no such tensor"],
        ),
    ];
    for (t, needles) in cases {
        fails(&gen1(t.dir()), &needles);
    }
    let t = TempCopy::of("llama3-tiny-f16");
    std::fs::write(t.path("model.safetensors.index.json"), "{ nope").unwrap();
    fails(&gen1(t.dir()), &["index.json", "not valid JSON"]);
}

/// A shard that is a symlink to a file outside the model folder is refused.
#[cfg(unix)]
#[test]
fn shard_symlinks_out_of_the_folder_are_refused() {
    let t = TempCopy::of("llama3-tiny-f16");
    let outside = tempdir("outside");
    let shard = "model-00001-of-00002.safetensors";
    std::fs::rename(t.path(shard), outside.join(shard)).unwrap();
    std::os::unix::fs::symlink(outside.join(shard), t.path(shard)).unwrap();
    fails(&gen1(t.dir()), &["weight_map entry", "outside the folder"]);
}

/// A fresh empty folder under the system's temporary folder.
pub(crate) fn tempdir(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "graft-bad-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A GGUF file of llama3-tiny-bf16 (F32), written once by `graft convert`.
fn tiny_gguf() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let p = tempdir("gguf").join("tiny.gguf");
        let m = fixture("llama3-tiny-bf16");
        ok(&[
            "convert",
            "--model",
            m.to_str().unwrap(),
            "--type",
            "f32",
            "--out",
            p.to_str().unwrap(),
            "--quiet",
        ]);
        p
    })
}

/// The tiny GGUF rewritten with `edit` applied to its metadata and tensor list.
fn gguf_with(
    tag: &str,
    edit: impl FnOnce(&mut graft::gguf::Metadata, &mut Vec<graft::gguf::TensorInfo>),
) -> PathBuf {
    use std::borrow::Cow;
    let f = graft::gguf::GgufFile::open(tiny_gguf()).unwrap();
    let mut md = f.metadata().clone();
    let mut tensors = f.tensors().to_vec();
    edit(&mut md, &mut tensors);
    let mut w = graft::gguf::GgufWriter::new();
    for (k, v) in md.iter() {
        w.metadata_mut().insert(k, v.clone());
    }
    for t in &tensors {
        let bytes = f.tensor_bytes(&t.name).unwrap();
        w.add_tensor(&t.name, &t.dims, t.ty, Cow::Owned(bytes.to_vec()))
            .unwrap();
    }
    let p = tempdir(tag).join("m.gguf");
    w.write_file(&p).unwrap();
    p
}

fn set(md: &mut graft::gguf::Metadata, key: &str, v: graft::gguf::Value) {
    md.insert(key, v);
}

#[test]
fn gguf_metadata_sizes_are_checked() {
    use graft::gguf::Value as V;
    let u32s = |key: &'static str, v: u32| {
        move |md: &mut graft::gguf::Metadata, _: &mut Vec<graft::gguf::TensorInfo>| {
            set(md, key, V::U32(v))
        }
    };
    let cases: Vec<(PathBuf, Vec<&str>)> = vec![
        (
            gguf_with("blocks", u32s("llama.block_count", 1_000_000_000)),
            vec!["'llama.block_count'"],
        ),
        (
            gguf_with("embd", u32s("llama.embedding_length", 1 << 30)),
            vec!["'llama.embedding_length'"],
        ),
        (
            gguf_with("ff", u32s("llama.feed_forward_length", 1 << 30)),
            vec!["'llama.feed_forward_length'"],
        ),
        (
            gguf_with("ctx0", u32s("llama.context_length", 0)),
            vec!["'llama.context_length'"],
        ),
        (
            gguf_with("heads", u32s("llama.attention.head_count", 5)),
            vec!["llama.attention.head_count"],
        ),
        (
            gguf_with("eos", |md, _| {
                set(md, "tokenizer.ggml.eos_token_id", V::String("two".into()))
            }),
            vec!["tokenizer.ggml.eos_token_id"],
        ),
        (
            gguf_with("arch", |md, _| {
                set(md, "general.architecture", V::String("falcon".into()))
            }),
            vec!["'general.architecture'", "falcon"],
        ),
        (
            gguf_with("eps", |md, _| {
                set(md, "llama.attention.layer_norm_rms_epsilon", V::F32(-1.0))
            }),
            vec!["layer_norm_rms_epsilon"],
        ),
        (
            gguf_with("noembd", |_, t| t.retain(|t| t.name != "token_embd.weight")),
            vec!["'token_embd.weight'", "missing"],
        ),
        (
            gguf_with("blktype", |md, _| {
                set(md, "llama.block_count", V::String("two".into()))
            }),
            vec!["llama.block_count"],
        ),
    ];
    for (p, needles) in cases {
        fails(&gen1(p.to_str().unwrap()), &needles);
    }
}

#[test]
fn gguf_files_that_are_cut_or_garbled() {
    let orig = std::fs::read(tiny_gguf()).unwrap();
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = orig.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    };
    let cases: Vec<(Vec<u8>, Vec<&str>)> = vec![
        (orig[..3].to_vec(), vec!["magic"]),
        (patch(0, b"GGML"), vec!["magic"]),
        (patch(4, &1u32.to_le_bytes()), vec!["version"]),
        (patch(4, &99u32.to_le_bytes()), vec!["version"]),
        (patch(8, &u64::MAX.to_le_bytes()), vec!["tensor count"]),
        (patch(16, &u64::MAX.to_le_bytes()), vec!["metadata"]),
        (
            patch(24, &u64::MAX.to_le_bytes()),
            vec!["metadata 0 key", "byte 24"],
        ),
        (orig[..orig.len() / 2].to_vec(), vec!["m.gguf"]),
        (orig[..200].to_vec(), vec!["m.gguf", "at byte"]),
    ];
    for (bytes, needles) in cases {
        let p = tempdir("cut").join("m.gguf");
        std::fs::write(&p, bytes).unwrap();
        fails(&gen1(p.to_str().unwrap()), &needles);
    }
}

#[test]
fn gguf_tokenizers_and_chat_templates_are_checked() {
    use graft::gguf::Value as V;
    let model = gguf_with("tokmodel", |md, _| {
        set(md, "tokenizer.ggml.model", V::String("klingon".into()))
    });
    let m = model.to_str().unwrap();
    fails(
        &["tokenize", "--model", m, "--text", "hi"],
        &["tokenizer.ggml.model", "klingon"],
    );
    let no_tokens = gguf_with("toktokens", |md, _| {
        let mut keep = graft::gguf::Metadata::new();
        for (k, v) in md.iter().filter(|(k, _)| *k != "tokenizer.ggml.tokens") {
            keep.insert(k, v.clone());
        }
        *md = keep;
    });
    fails(
        &[
            "tokenize",
            "--model",
            no_tokens.to_str().unwrap(),
            "--text",
            "hi",
        ],
        &["tokenizer.ggml.tokens"],
    );
    for (tag, template, needle) in [
        ("tplsyntax", "{% if %}", "syntax error"),
        (
            "tplraise",
            "{{ raise_exception('no system role') }}",
            "no system role",
        ),
        (
            "tplfilter",
            "{{ messages | nosuchfilter }}",
            "chat template",
        ),
    ] {
        let p = gguf_with(tag, |md, _| {
            set(md, "tokenizer.chat_template", V::String(template.into()))
        });
        let p = p.to_str().unwrap();
        fails(
            &[
                "generate", "--chat", "--model", p, "--prompt", "hi", "-n", "2",
            ],
            &["chat template", needle],
        );
    }
}

#[test]
fn tokenizer_json_files_are_checked() {
    let t = TempCopy::of("llama3-tiny-bf16");
    std::fs::write(t.path("tokenizer.json"), "{ nope").unwrap();
    fails(
        &["generate", "--model", t.dir(), "--prompt", "hi", "-n", "1"],
        &["tokenizer.json", "cannot load tokenizer"],
    );
    std::fs::write(t.path("tokenizer.json"), "{\"model\": 7}").unwrap();
    fails(
        &["tokenize", "--model", t.dir(), "--text", "hi"],
        &["tokenizer.json"],
    );
    let t = TempCopy::of("llama3-tiny-bf16");
    std::fs::write(t.path("tokenizer_config.json"), "[1]").unwrap();
    fails(
        &["generate", "--chat", "--model", t.dir(), "--prompt", "hi"],
        &["tokenizer_config.json", "expected a JSON object"],
    );
    std::fs::write(
        t.path("tokenizer_config.json"),
        json!({"chat_template": "{% for %}"}).to_string(),
    )
    .unwrap();
    fails(
        &["generate", "--chat", "--model", t.dir(), "--prompt", "hi"],
        &["chat template", "syntax error"],
    );
}

#[test]
fn command_line_sizes_and_values_are_checked() {
    let dir = fixture("llama3-tiny-bf16");
    let d = dir.to_str().unwrap();
    let g = |extra: &[&'static str]| {
        let mut a = vec!["generate", "--model", d, "--token-ids", "1,2", "--quiet"];
        a.extend_from_slice(extra);
        a
    };
    fails(
        &g(&["-n", "18446744073709551615", "--ctx", "64"]),
        &["exceeds the context of 64"],
    );
    fails(&g(&["--ctx", "0"]), &["--ctx 0"]);
    fails(&g(&["--ctx", "1000000000000"]), &["--ctx 1000000000000"]);
    fails(&g(&["--temperature", "nan"]), &["temperature"]);
    fails(&g(&["--temperature", "-1"]), &["temperature"]);
    fails(&g(&["--temperature", "1", "--top-p", "1.5"]), &["top-p"]);
    fails(
        &["generate", "--model", d, "--token-ids", "1,600"],
        &["token 600 at position 1"],
    );
    fails_with(
        2,
        &["generate", "--model", d, "--token-ids", "4294967296"],
        &["token-ids"],
    );
    fails_with(
        2,
        &["generate", "--model", d, "--token-ids", "1", "-n", "-1"],
        &["-1"],
    );
    fails(
        &["generate", "--model", d, "-f", "/nonexistent/p.txt"],
        &["/nonexistent/p.txt"],
    );
    let b = |extra: &[&'static str]| {
        let mut a = vec!["bench", "--preset", "tiny"];
        a.extend_from_slice(extra);
        a
    };
    fails(&b(&["-p", "18446744073709551615"]), &["-p"]);
    // bench sizes its context from -p and -n: the error names them
    fails(
        &b(&["-p", "1000000000000", "-n", "1"]),
        &["-p 1000000000000 + -n 1", "smaller -p and -n"],
    );
    fails(
        &b(&["-p", "64", "-n", "64", "--ctx", "100"]),
        &["--ctx 100", "-p 64 + -n 64"],
    );
    fails(
        &b(&["-d", "1000000000000", "-n", "1"]),
        &["-d 1000000000000 + -n 1", "smaller -d and -n"],
    );
    fails(&b(&["-n", "0"]), &["-n 0", "at least 1"]);
    fails(&b(&["--copy-bw", "0"]), &["--copy-bw 0"]);
    fails(&b(&["--copy-bw", "-3"]), &["--copy-bw -3"]);
    fails(&b(&["--copy-bw", "inf"]), &["--copy-bw inf"]);
    fails(&b(&["--reps", "0"]), &["--reps"]);
    let dump = |extra: &[&'static str]| {
        let mut a = vec!["dump", "--model", d];
        a.extend_from_slice(extra);
        a
    };
    fails(
        &dump(&["--n-tokens", "1000000000000", "--ctx", "1000000000000"]),
        &["--ctx"],
    );
    fails(
        &dump(&["--n-tokens", "100", "--ctx", "50"]),
        &["--n-tokens 100"],
    );
    fails(
        &dump(&["--n-tokens", "18446744073709551615", "--n-past", "5"]),
        &["--n-tokens"],
    );
    fails(
        &dump(&["--decode", "--n-past", "5000", "--ctx", "100"]),
        &["--n-past 5000"],
    );
    // tensor parallelism: sizes that do not divide, an empty or absurd group
    fails(&g(&["--tp", "3"]), &["--tp 3", "attention heads (8)"]);
    fails(&g(&["--tp", "0"]), &["--tp 0"]);
    fails(&g(&["--tp", "1000000"]), &["--tp 1000000"]);
    fails(&b(&["--tp", "3"]), &["--tp 3", "attention heads"]);
    fails(&dump(&["--tp", "16"]), &["--tp 16", "attention heads (8)"]);
}

/// Sizes past what a context or a KV pool holds (positions are 32-bit) are errors that
/// name the flags that set them, and only flags of the command run: bench and
/// batched-bench size their context from their lengths, generate and chat their pool from
/// --ctx (none of the three has --kv-size), batched-bench its pool from the batch.
#[test]
fn size_errors_name_the_commands_own_flags() {
    let d = fixture("llama3-tiny-bf16");
    let d = d.to_str().unwrap();
    let bench = |extra: &[&'static str]| {
        let mut a = vec!["bench", "--preset", "tiny", "--reps", "1"];
        a.extend_from_slice(extra);
        a
    };
    let batched = |extra: &[&'static str]| {
        let mut a = vec![
            "batched-bench",
            "--preset",
            "tiny",
            "--npl",
            "1",
            "--ntg",
            "1",
        ];
        a.extend_from_slice(extra);
        a
    };
    let cases: [(Vec<&str>, &[&str]); 11] = [
        (
            bench(&["-p", "1000000000000", "-n", "1"]),
            &["-p 1000000000000 + -n 1", "smaller -p and -n"],
        ),
        (
            bench(&["-p", "2147483640", "-n", "1"]),
            &["-p 2147483640 + -n 1", "smaller -p and -n"],
        ),
        (
            bench(&["-p", "4", "-n", "1", "--ctx", "2147483647"]),
            &["--ctx 2147483647", "smaller --ctx"],
        ),
        (
            batched(&["--npp", "1000000000000"]),
            &["--npp 1000000000000 + --ntg 1", "smaller --npp and --ntg"],
        ),
        (
            batched(&["--npp", "18446744073709551615"]),
            &["--npp 18446744073709551615"],
        ),
        (
            batched(&["--npp", "4", "--ntg", "18446744073709551615"]),
            &["--ntg 18446744073709551615"],
        ),
        (
            batched(&["--npp", "4", "--ctx", "2"]),
            &["--ctx 2 cannot hold --npp 4 + --ntg 1"],
        ),
        (
            batched(&["--npp", "4", "--npl", "1000000000000"]),
            &["1000000000000 sequences", "--npl"],
        ),
        (
            batched(&["--npp", "4", "--ctx", "2147483647"]),
            &["--ctx 2147483647", "smaller --ctx"],
        ),
        (
            vec![
                "generate",
                "--model",
                d,
                "--token-ids",
                "1",
                "--ctx",
                "2147483647",
            ],
            &["--ctx 2147483647", "smaller --ctx"],
        ),
        (
            vec!["chat", "--model", d, "--ctx", "2000000000"],
            &["--ctx 2000000000", "smaller --ctx"],
        ),
    ];
    for (args, needles) in cases {
        fails_naming_own_flags(&args, needles);
    }
}

/// A library caller gets the same named error for a config with a huge layer count,
/// before anything is allocated from it.
#[test]
fn a_huge_layer_count_is_a_named_error_not_an_abort() {
    let t = config_field("num_hidden_layers", json!(1_000_000_000u64));
    let mut be = graft::backend::cpu::CpuBackend::new();
    let opts = graft::models::LoadOptions::default();
    let e = graft::models::Model::load(Path::new(t.dir()), &mut be, &opts)
        .err()
        .expect("a huge layer count must fail");
    let msg = e.to_string();
    assert!(
        msg.contains("'num_hidden_layers' is 1000000000") && msg.contains("2 layers"),
        "{msg}"
    );
}

/// `logits --out`, `dump --out` and `convert --out` never overwrite the run's inputs,
/// whatever the spelling of the path (a symlink, a `./` prefix).
#[test]
fn outputs_never_overwrite_inputs() {
    let t = TempCopy::of("llama3-tiny-bf16");
    let before = std::fs::read(t.path("model.safetensors")).unwrap();
    let logits = |out: &str| {
        vec![
            "logits".to_string(),
            "--model".into(),
            t.dir().into(),
            "--token-ids".into(),
            "1,2".into(),
            "--out".into(),
            out.into(),
            "--quiet".into(),
        ]
    };
    let weights = t.path("model.safetensors");
    let w = weights.to_str().unwrap();
    let a = logits(w);
    fails(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        &["refusing to overwrite", "model.safetensors"],
    );
    let dotted = format!("{}/./model.safetensors", t.dir());
    let a = logits(&dotted);
    fails(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        &["refusing to overwrite"],
    );
    #[cfg(unix)]
    {
        let link = tempdir("link").join("l.safetensors");
        std::os::unix::fs::symlink(&weights, &link).unwrap();
        let a = logits(link.to_str().unwrap());
        fails(
            &a.iter().map(String::as_str).collect::<Vec<_>>(),
            &["refusing to overwrite"],
        );
    }
    let cfg = t.path("config.json");
    fails(
        &["dump", "--model", t.dir(), "--out", cfg.to_str().unwrap()],
        &["refusing to overwrite", "config.json"],
    );
    let tok = t.path("tokenizer.json");
    fails(
        &[
            "convert",
            "--model",
            t.dir(),
            "--type",
            "f32",
            "--out",
            tok.to_str().unwrap(),
        ],
        &["refusing to overwrite", "tokenizer.json"],
    );
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        before,
        "the weights changed"
    );
    let g = tiny_gguf().to_str().unwrap();
    fails(
        &["dump", "--model", g, "--out", g],
        &["refusing to overwrite"],
    );
    fails(
        &["dump", "--model", t.dir(), "--out", t.dir()],
        &["is a directory"],
    );
}

/// Devices, FIFOs and `-` are written in place; a symlink stays a link to the new data;
/// a regular file keeps its mode; a full device is an error naming it.
#[cfg(unix)]
#[test]
fn outputs_keep_what_is_at_the_path() {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let d = fixture("llama3-tiny-bf16");
    let d = d.to_str().unwrap();
    let dump = |out: &str| run(&["dump", "--model", d, "--out", out]);
    assert!(dump("/dev/null").status.success());
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    let o = dump("/dev/full");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("/dev/full"), "{}", stderr(&o));
    assert!(std::fs::metadata("/dev/full")
        .unwrap()
        .file_type()
        .is_char_device());
    let o = run(&[
        "logits",
        "--model",
        d,
        "--token-ids",
        "1",
        "--out",
        "/dev/full",
        "--quiet",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("/dev/full"), "{}", stderr(&o));
    let stdout = ok(&["dump", "--model", d, "--out", "-"]);
    assert!(
        String::from_utf8_lossy(&stdout).contains("get_rows"),
        "dump to stdout"
    );

    let dir = tempdir("outs");
    let fifo = dir.join("fifo");
    mkfifo(&fifo);
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).unwrap())
    };
    assert!(dump(fifo.to_str().unwrap()).status.success());
    assert!(!reader.join().unwrap().is_empty());
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());

    let real = dir.join("real.txt");
    std::fs::write(&real, "old").unwrap();
    std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o640)).unwrap();
    let link = dir.join("link.txt");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    assert!(dump(link.to_str().unwrap()).status.success());
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert!(std::fs::read_to_string(&real).unwrap().contains("get_rows"));
    let mode = std::fs::metadata(&real).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);
    let dangling = dir.join("dangling");
    std::os::unix::fs::symlink(dir.join("nowhere/x"), &dangling).unwrap();
    fails(
        &["dump", "--model", d, "--out", dangling.to_str().unwrap()],
        &["symlink"],
    );
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        names.iter().all(|n| !n.to_string_lossy().contains(".tmp-")),
        "{names:?}"
    );
}

/// A copy of llama3-tiny-bf16 whose final norm weights are all `bits` (BF16).
fn with_norm_bits(bits: u16) -> TempCopy {
    TempCopy::with_tensor_bits("llama3-tiny-bf16", "model.norm.weight", bits)
}

/// NaN or Inf weights stop generate (greedy or sampled), chat and logits with an error
/// naming the position: never token 0 repeated, never an all-NaN file.
#[test]
fn non_finite_logits_stop_every_command() {
    for bits in [0x7fc0u16, 0x7f80] {
        let t = with_norm_bits(bits);
        fails(&gen1(t.dir()), &["non-finite logits", "token position 1"]);
        let mut sampled = gen1(t.dir());
        sampled.extend(["--temperature", "1"]);
        fails(&sampled, &["non-finite logits", "token position 1"]);
        let out = tempdir("nan").join("l.safetensors");
        let o = out.to_str().unwrap();
        fails(
            &[
                "logits",
                "--model",
                t.dir(),
                "--token-ids",
                "1,2,3",
                "--out",
                o,
                "--quiet",
            ],
            &["non-finite logits", "token position 0"],
        );
        assert!(!out.exists(), "logits wrote a file of garbage");
        let o = run_with(&["chat", "--model", t.dir(), "--quiet"], b"hello\n");
        assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
        assert!(stderr(&o).contains("non-finite logits"), "{}", stderr(&o));
    }
}

/// A temperature so small that `1 / t` overflows (1e-45, the smallest f32) samples the
/// largest logit, as greedy decoding does: generate (penalties off) and chat (the chat
/// defaults' repetition penalty kept, so greedy with the same penalty), on the engine.
#[test]
fn a_tiny_temperature_samples_the_largest_logit() {
    let d = fixture("llama3-tiny-bf16");
    let d = d.to_str().unwrap();
    let generate = |extra: &[&str]| {
        let args = ["generate", "--model", d, "--token-ids", "1,2", "-n", "12"];
        ok(&[&args[..], &["--quiet"], extra].concat())
    };
    let chat = |extra: &[&str]| {
        let args = [&["chat", "--model", d, "-n", "12", "--quiet"][..], extra].concat();
        let o = run_with(&args, b"hi\nwhat next\n");
        assert!(o.status.success(), "graft {args:?}: {}", stderr(&o));
        o.stdout
    };
    let greedy = generate(&["--temperature", "0"]);
    let greedy_chat = chat(&["--temperature", "0", "--repeat-penalty", "1.1"]);
    assert_ne!(generate(&["--temperature", "1", "--seed", "3"]), greedy);
    for t in ["1e-45", "1e-40", "1e-38"] {
        for seed in ["1", "2"] {
            let sampled = ["--temperature", t, "--seed", seed];
            assert_eq!(generate(&sampled), greedy, "generate --temperature {t}");
            assert_eq!(chat(&sampled), greedy_chat, "chat --temperature {t}");
        }
    }
}

/// NaN in the weights that make q, k or v gives non-finite attention rows, so the logits
/// are not finite and every run stops with the error, whatever the cache type
/// (qwen3-tiny-bf16: head size 32, whole blocks for q8_0 and q4_0): generate (the
/// engine's paged attention), logits with the fused attention (the default) and with the
/// chain of ops. The fused attention used to take a row of NaN scores for a fully masked
/// one and give zeros (and a quantized cache to store a NaN K or V row as finite
/// numbers): generate then exited 0 with made-up tokens.
#[test]
fn nan_in_q_k_or_v_stops_generation_with_every_cache_type() {
    for proj in ["q_proj", "k_proj", "v_proj"] {
        let name = format!("model.layers.0.self_attn.{proj}.weight");
        let t = TempCopy::with_tensor_bits("qwen3-tiny-bf16", &name, 0x7fc0);
        let logits = |flash: &'static str| {
            let out = t.path("l.safetensors");
            let out = out.to_str().unwrap().to_string();
            vec![
                "logits".to_string(),
                "--model".into(),
                t.dir().into(),
                "--token-ids".into(),
                "1,2,3".into(),
                "--out".into(),
                out,
                "--flash-attn".into(),
                flash.into(),
            ]
        };
        for cache in ["f32", "f16", "bf16", "q8_0", "q4_0"] {
            let types = ["--ctk", cache, "--ctv", cache];
            let mut runs: Vec<Vec<String>> =
                vec![gen1(t.dir()).iter().map(|a| a.to_string()).collect()];
            runs.push(logits("on"));
            if !cache.starts_with('q') {
                runs.push(logits("off")); // a quantized V cache needs the fused attention
            }
            for mut args in runs {
                args.extend(types.iter().map(|a| a.to_string()));
                println!("{proj} NaN: {args:?}");
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                fails(&args, &["non-finite logits"]);
            }
        }
    }
}

/// `dump` lays a graph out from a config alone (no tensors to check it against): a
/// config with more layers or parameters than any model is refused by name, not laid out.
#[test]
fn dump_refuses_configs_no_model_has() {
    for (field, value, needle) in [
        (
            "num_hidden_layers",
            1_000_000_000u64,
            "num_hidden_layers 1000000000",
        ),
        ("hidden_size", 1 << 30, "parameters"),
    ] {
        let t = config_field(field, Value::from(value));
        for f in std::fs::read_dir(t.path(".")).unwrap() {
            let p = f.unwrap().path();
            if p.extension().is_some_and(|e| e == "safetensors") {
                std::fs::remove_file(p).unwrap();
            }
        }
        let dir = t.path(".");
        let dir = dir.to_str().unwrap();
        fails(&["dump", "--model", dir], &[needle]);
    }
}

/// Errors a user can cause name the input, what is wrong with it and what to do: an
/// `--out` whose folder is missing (not graft's temporary file), a file of a Hugging Face
/// folder given as the model (pass the folder), a quantized cache the head size does not
/// allow (use f16), `generate` without a prompt (every way to give one, and --model).
#[test]
fn messages_say_what_to_do() {
    let d = fixture("llama3-tiny-bf16");
    let d = d.to_str().unwrap();
    let missing = "/nonexistent-graft-dir/l.safetensors";
    for args in [
        vec!["logits", "--model", d, "--token-ids", "1", "--out", missing],
        vec!["dump", "--model", d, "--out", missing],
        vec!["convert", "--model", d, "--type", "f32", "--out", missing],
        vec!["trace", "--model", d, "--tokens", "1", "--out", missing],
    ] {
        fails(
            &args,
            &[
                missing,
                "/nonexistent-graft-dir does not exist",
                "create it",
            ],
        );
        assert!(!stderr(&run(&args)).contains(".tmp-"), "{args:?}");
    }
    // a folder that cannot take a new file (even as root)
    let o = run(&["dump", "--model", d, "--out", "/proc/graft-dump.txt"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/proc/graft-dump.txt")
            && err.contains("folder /proc")
            && !err.contains(".tmp-"),
        "{err}"
    );
    // every command that runs a model, as each takes its input
    let runs = |model: &str| -> Vec<Vec<String>> {
        let cmds: [&[&str]; 9] = [
            &["generate", "--token-ids", "1"],
            &["generate", "--chat", "--prompt", "hi"],
            &["chat"],
            &["bench", "-p", "2", "-n", "1", "--reps", "1"],
            &["batched-bench", "--npp", "2", "--ntg", "1", "--npl", "1"],
            &["logits", "--token-ids", "1", "--out", "-"],
            &["trace", "--tokens", "1"],
            &["dump"],
            &["tokenize", "--text", "hi"],
        ];
        let with = |c: &[&str]| {
            let mut a: Vec<String> = vec![c[0].into(), "--model".into(), model.into()];
            a.extend(c[1..].iter().map(|s| s.to_string()));
            a
        };
        cmds.iter().map(|c| with(c)).collect()
    };
    for file in ["config.json", "model.safetensors"] {
        for args in runs(&format!("{d}/{file}")) {
            let want = [file, "pass the folder", &format!("--model {d}")];
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            fails_naming_own_flags(&args, &want);
        }
    }
    for (flag, t) in [("--ctk", "q8_0"), ("--ctv", "q4_0")] {
        let k_or_v = if flag == "--ctk" { "k" } else { "v" };
        for mut args in runs(d) {
            if args[0] == "tokenize" {
                continue; // no cache
            }
            args.extend([flag.to_string(), t.to_string()]);
            let want = ["head size", "16", &format!("--cache-type-{k_or_v} f16")];
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            fails_naming_own_flags(&args, &want);
        }
    }
    let o = run(&["generate"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for flag in ["--prompt", "--file", "--token-ids", "-f FILE", "--model"] {
        assert!(err.contains(flag), "'{flag}' not in: {err}");
    }
    let o = run(&["trace", "--model", d]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    for flag in ["--prompt", "--prompt-file", "--tokens"] {
        assert!(err.contains(flag), "'{flag}' not in: {err}");
    }
}

/// The help of every command with --preset lists every preset.
#[test]
fn preset_help_lists_every_preset() {
    for cmd in ["bench", "batched-bench", "generate", "dump"] {
        let help = String::from_utf8(ok(&[cmd, "--help"])).unwrap();
        for name in graft::models::arch::presets::NAMES {
            assert!(help.contains(name), "{cmd} --help lacks {name}: {help}");
        }
    }
}
