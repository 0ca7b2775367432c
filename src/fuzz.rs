//! Entry points for fuzzing the loaders: each takes arbitrary bytes, runs them through
//! the same code a user's file goes through, and returns a `Result`, never panicking.
//!
//! The cargo-fuzz targets in `fuzz/` call these; `cargo test` (tests/text_io/fuzz_corpus.rs) runs
//! the seed corpora (`fuzz/corpus/<target>/`) and every regression found
//! (`fuzz/regressions/<target>/`) through them as well, so CI covers what the fuzzers
//! found without building libFuzzer.
//!
//! | target | input |
//! | --- | --- |
//! | [`safetensors_config`] | a config.json and a safetensors file, paired ([`split_pair`]) |
//! | [`gguf`] | a GGUF file: read, its `llama` config and weights loaded |
//! | [`gguf_tokenizer`] | a GGUF file whose `tokenizer.*` metadata builds a tokenizer |
//! | [`chat_template`] | a chat template's source, rendered over a fixed conversation |

use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::gguf::GgufFile;
use crate::models::load::gguf::{config_from_gguf, load_gguf_weights};
use crate::models::load::safetensors::load_weights_from_bytes;
use crate::models::text::chat::{ChatTemplate, Message};
use crate::models::{Config, LoadOptions, TokenizerSpec};
use crate::{Error, Result};

/// The names of the fuzz targets (the folders under `fuzz/corpus` and `fuzz/regressions`).
pub const TARGETS: [&str; 4] = [
    "safetensors_config",
    "gguf",
    "gguf_tokenizer",
    "chat_template",
];

/// Runs the target named `target` on `data` (see [`TARGETS`]).
pub fn run(target: &str, data: &[u8]) -> Result<()> {
    match target {
        "safetensors_config" => safetensors_config(data),
        "gguf" => gguf(data),
        "gguf_tokenizer" => gguf_tokenizer(data),
        "chat_template" => chat_template(data),
        other => Err(Error::model(format!("no fuzz target '{other}'"))),
    }
}

/// Splits a [`safetensors_config`] input: a little-endian `u32` length, that many bytes of
/// config.json, then the safetensors file.
pub fn split_pair(data: &[u8]) -> Result<(&[u8], &[u8])> {
    let short = || Error::model("fuzz input: shorter than its config length");
    let n: [u8; 4] = data
        .get(..4)
        .ok_or_else(short)?
        .try_into()
        .map_err(|_| short())?;
    let n = u32::from_le_bytes(n) as usize;
    let config = data.get(4..4usize.saturating_add(n)).ok_or_else(short)?;
    Ok((config, &data[4 + n..]))
}

/// The inverse of [`split_pair`]: one input from a config.json and a safetensors file.
pub fn join_pair(config: &[u8], safetensors: &[u8]) -> Vec<u8> {
    let mut out = (config.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(config);
    out.extend_from_slice(safetensors);
    out
}

/// The config (checked) paired with the safetensors file (header checked against the
/// config, tensors checked and loaded onto the CPU backend).
pub fn safetensors_config(data: &[u8]) -> Result<()> {
    let (config, st) = split_pair(data)?;
    let text = std::str::from_utf8(config)
        .map_err(|e| Error::model(format!("fuzz config.json: not UTF-8: {e}")))?;
    let cfg = Config::from_json_str(text, "fuzz/config.json")?;
    let mut be = CpuBackend::new();
    let opts = LoadOptions::default();
    let w = load_weights_from_bytes("fuzz/model.safetensors", st.to_vec(), &cfg, &mut be, &opts)?;
    be.free_buffer(w.buffer)
}

/// A GGUF file: read, described, and when it is a `llama` model, its weights loaded onto
/// the CPU backend.
pub fn gguf(data: &[u8]) -> Result<()> {
    let f = GgufFile::from_bytes("fuzz.gguf", data.to_vec())?;
    let _ = f.to_string();
    let cfg = config_from_gguf(&f)?;
    let mut be = CpuBackend::new();
    let w = load_gguf_weights(&f, &cfg, &mut be, &LoadOptions::default())?;
    be.free_buffer(w.buffer)
}

/// A GGUF file's tokenizer metadata: the tokenizer built, a text encoded and decoded,
/// and the chat template (if any) compiled.
pub fn gguf_tokenizer(data: &[u8]) -> Result<()> {
    let f = GgufFile::from_bytes("fuzz.gguf", data.to_vec())?;
    let spec = TokenizerSpec::from_gguf(f.metadata())?;
    let tok = spec.build()?;
    for text in [
        "Hello, world! 123",
        " <|im_start|>user\n\u{e9}\u{4e2d}\u{1f600}  x",
    ] {
        let ids = tok.encode(text)?;
        let _ = tok.decode(&ids)?;
    }
    ChatTemplate::from_spec(&spec).map(drop)
}

/// A chat template (the input as UTF-8, lossily) compiled and rendered over a short
/// conversation, with and without the generation prompt.
pub fn chat_template(data: &[u8]) -> Result<()> {
    let source = String::from_utf8_lossy(data);
    let t = ChatTemplate::new(Some(&source), "<s>", "</s>")?;
    let messages = [
        Message::new("system", "Be brief."),
        Message::new("user", "Hi {{ there }}"),
        Message::new("assistant", "Hello."),
        Message::new("user", "Bye"),
    ];
    t.render(&messages, true)?;
    t.render(&messages[1..2], false).map(drop)
}
