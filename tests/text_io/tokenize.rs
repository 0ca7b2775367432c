//! `graft tokenize` and [`TokenizerSpec::from_gguf`]: the tokenizer of a `.gguf` file
//! written here with graft's own writer from the reference vectors in
//! tests/fixtures/tokenizer/ (llama.cpp's `tokenizer.ggml.*` keys), and of a model folder.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use graft::gguf::{Array, GgufFile, GgufWriter, Metadata, Value};
use graft::models::text::tokenizer;
use graft::models::TokenizerSpec;
use graft::Error;
use serde::Deserialize;

use crate::fixtures::fixture;

#[derive(Deserialize)]
struct Vectors {
    spec: TokenizerSpec,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

fn vectors(name: &str) -> Vectors {
    let path = fixture("tokenizer").join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The `tokenizer.ggml.*` pairs llama.cpp's converter writes for `spec`.
fn metadata_of(spec: &TokenizerSpec) -> Metadata {
    let mut md = Metadata::new();
    let s = |v: &str| Value::String(v.to_string());
    md.insert("general.architecture", s("llama"));
    md.insert("tokenizer.ggml.model", s(&spec.model));
    if let Some(pre) = &spec.pre {
        md.insert("tokenizer.ggml.pre", s(pre));
    }
    md.insert(
        "tokenizer.ggml.tokens",
        Value::Array(Array::String(spec.tokens.clone())),
    );
    if let Some(v) = &spec.scores {
        md.insert("tokenizer.ggml.scores", Value::Array(Array::F32(v.clone())));
    }
    if let Some(v) = &spec.token_types {
        let types = Value::Array(Array::I32(v.clone()));
        md.insert("tokenizer.ggml.token_type", types);
    }
    if let Some(v) = &spec.merges {
        let merges = Value::Array(Array::String(v.clone()));
        md.insert("tokenizer.ggml.merges", merges);
    }
    let ids = [
        ("bos_token_id", spec.bos),
        ("eos_token_id", spec.eos),
        ("eot_token_id", spec.eot),
        ("eom_token_id", spec.eom),
        ("unknown_token_id", spec.unk),
        ("padding_token_id", spec.pad),
    ];
    for (k, id) in ids {
        if let Some(id) = id {
            md.insert(format!("tokenizer.ggml.{k}"), Value::U32(id));
        }
    }
    let flags = [
        ("add_bos_token", spec.add_bos),
        ("add_eos_token", spec.add_eos),
        ("add_space_prefix", spec.add_space_prefix),
    ];
    for (k, flag) in flags {
        if let Some(flag) = flag {
            md.insert(format!("tokenizer.ggml.{k}"), Value::Bool(flag));
        }
    }
    if let Some(t) = &spec.chat_template {
        md.insert("tokenizer.chat_template", s(t));
    }
    md
}

/// A fresh scratch folder for this test binary.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graft-tokenize-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes a GGUF file holding `md` and one small tensor (no weights are read anyway).
fn write_gguf(path: &Path, md: &Metadata) {
    let mut w = GgufWriter::new();
    for (k, v) in md.iter() {
        w.metadata_mut().insert(k, v.clone());
    }
    w.add_tensor(
        "token_embd.weight",
        &[4],
        graft::gguf::GgmlType::F32,
        vec![0u8; 16],
    )
    .unwrap();
    w.write_file(path).unwrap();
}

fn graft(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graft"))
        .args(args)
        .output()
        .expect("run graft")
}

fn ok(args: &[&str]) -> String {
    let o = graft(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "graft {args:?} failed: {err}");
    String::from_utf8(o.stdout).unwrap()
}

fn json_ids(out: &str) -> Vec<u32> {
    let v: serde_json::Value = serde_json::from_str(out).unwrap();
    let ids = v["ids"].as_array().unwrap();
    ids.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The ids of the text lines (`    42 -> 'piece'`).
fn line_ids(out: &str) -> Vec<u32> {
    out.lines()
        .map(|l| l.split(" -> ").next().unwrap().trim().parse().unwrap())
        .collect()
}

/// The spec read back from GGUF metadata is the spec that was written.
#[test]
fn from_gguf_reads_back_every_key() {
    for name in [
        "llama3-tiny-gpt2",
        "llama2-tiny-spm",
        "smollm2-135m-instruct",
    ] {
        let spec = vectors(name).spec;
        let md = metadata_of(&spec);
        let bytes = {
            let mut w = GgufWriter::new();
            for (k, v) in md.iter() {
                w.metadata_mut().insert(k, v.clone());
            }
            w.to_bytes().unwrap()
        };
        let file = GgufFile::from_bytes(name, bytes).unwrap();
        assert_eq!(
            TokenizerSpec::from_gguf(file.metadata()).unwrap(),
            spec,
            "{name}"
        );
    }
}

/// Missing required keys and keys of the wrong type are errors naming the key.
#[test]
fn from_gguf_names_the_bad_key() {
    let spec = vectors("llama3-tiny-gpt2").spec;
    let cases: [(&str, Option<Value>); 5] = [
        ("tokenizer.ggml.model", None),
        ("tokenizer.ggml.tokens", None),
        (
            "tokenizer.ggml.tokens",
            Some(Value::Array(Array::F32(vec![1.0]))),
        ),
        (
            "tokenizer.ggml.eos_token_id",
            Some(Value::String("1".into())),
        ),
        (
            "tokenizer.ggml.token_type",
            Some(Value::Array(Array::F32(vec![1.0]))),
        ),
    ];
    for (key, value) in cases {
        let mut md = Metadata::new();
        for (k, v) in metadata_of(&spec).iter() {
            if k != key {
                md.insert(k, v.clone());
            }
        }
        if let Some(v) = value.clone() {
            md.insert(key, v);
        }
        match TokenizerSpec::from_gguf(&md) {
            Err(e @ Error::GgufInput { .. }) => {
                assert!(e.to_string().contains(key), "{key}: {e}")
            }
            Err(e) => panic!("{key}: expected a GGUF input error, got {e}"),
            Ok(_) => panic!("{key} = {value:?}: expected an error"),
        }
    }
    // Token types written as u32 by some converters are accepted.
    let mut md = metadata_of(&spec);
    let types = spec.token_types.clone().unwrap();
    let u32s = types.iter().map(|&t| t as u32).collect();
    md.insert("tokenizer.ggml.token_type", Value::Array(Array::U32(u32s)));
    let read = TokenizerSpec::from_gguf(&md).unwrap();
    assert_eq!(read.token_types, Some(types));
}

/// `graft tokenize` on a `.gguf` file gives the reference ids of every case, as JSON and
/// as text lines, for a byte-level BPE and a SentencePiece vocabulary.
#[test]
fn tokenize_a_gguf_file_matches_the_reference() {
    let dir = scratch("gguf");
    for name in ["llama3-tiny-gpt2", "llama2-tiny-spm"] {
        let v = vectors(name);
        let path = dir.join(format!("{name}.gguf"));
        write_gguf(&path, &metadata_of(&v.spec));
        let model = path.to_str().unwrap();
        for case in &v.cases {
            let out = ok(&["tokenize", "--model", model, "--text", &case.text, "--json"]);
            assert_eq!(json_ids(&out), case.ids, "{name}: {:?}", case.text);
            let out = ok(&["tokenize", "--model", model, "--text", &case.text]);
            assert_eq!(line_ids(&out), case.ids, "{name}: {:?}", case.text);
        }
    }
    // Text lines: the id right-aligned in six columns, then the piece.
    let model = dir.join("llama3-tiny-gpt2.gguf");
    let out = ok(&[
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--text",
        "Hello world",
    ]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "     0 -> '<|begin_of_text|>'");
    assert_eq!(lines[1], "    42 -> 'H'");
    assert_eq!(lines[5], "   267 -> ' w'");
    let out = ok(&[
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--text",
        "a\nb",
    ]);
    assert_eq!(
        out.lines().count(),
        4,
        "a newline piece stays on its line: {out}"
    );
    assert!(out.contains(" -> '\\n'"), "{out}");
    // --no-bos leaves the BOS out.
    let no_bos = [
        "tokenize",
        "--model",
        model.to_str().unwrap(),
        "--text",
        "Hello world",
    ];
    let out = ok(&[&no_bos[..], &["--no-bos", "--json"]].concat());
    assert_eq!(json_ids(&out), [42, 71, 284, 81, 267, 291, 342]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model folder's tokenizer.json gives the same ids as the library; special-token text
/// is parsed unless `--no-parse-special`.
#[test]
fn tokenize_a_folder() {
    let dir = fixture("llama3-tiny-bf16");
    let model = dir.to_str().unwrap();
    let text = "The keeper lit the lamp.<|eot_id|>";
    let tok = tokenizer::for_model(&dir).unwrap().unwrap().tokenizer;
    let want = tok.encode(text).unwrap();
    assert_eq!(want.last(), Some(&2), "<|eot_id|> parsed as one token");
    let out = ok(&["tokenize", "--model", model, "--text", text, "--json"]);
    assert_eq!(json_ids(&out), want);
    let out = ok(&[
        "tokenize",
        "--model",
        model,
        "--text",
        text,
        "--no-parse-special",
        "--json",
    ]);
    let plain = json_ids(&out);
    assert!(!plain.contains(&2) && plain.len() > want.len(), "{plain:?}");
    let out = ok(&["tokenize", "--model", model, "--text", text]);
    assert!(out.ends_with("     2 -> '<|eot_id|>'\n"), "{out}");
}

/// Files that are not GGUF, missing paths and models without a tokenizer get a clear
/// error and exit status 1.
#[test]
fn tokenize_refuses_bad_models() {
    let dir = scratch("bad");
    let not_gguf = dir.join("notes.gguf");
    std::fs::write(&not_gguf, "hello, not a model").unwrap();
    let bare = dir.join("bare.gguf");
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String("llama".into()));
    write_gguf(&bare, &md);
    let missing = dir.join("missing.gguf");
    let empty_dir = dir.join("folder");
    std::fs::create_dir_all(&empty_dir).unwrap();
    let cases = [
        (&not_gguf, "not a GGUF file"),
        (&bare, "has no tokenizer"),
        (&missing, "missing.gguf"),
        (&empty_dir, "has no tokenizer"),
    ];
    for (path, needle) in cases {
        let o = graft(&["tokenize", "--model", path.to_str().unwrap(), "--text", "x"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{}: {err}", path.display());
        assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
