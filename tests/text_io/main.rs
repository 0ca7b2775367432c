//! What graft reads and writes besides models: the GGUF reader and writer (against
//! llama.cpp's `gguf` package), tokenizers from GGUF metadata and chat templates,
//! `graft tokenize`, the fuzzers' corpora, and `graft pull`.

#[allow(dead_code)] // only the fixtures' paths are used here
#[path = "../support/fixtures.rs"]
mod fixtures;

mod fuzz_corpus;
mod gguf;
#[cfg(unix)]
mod pull;
mod tokenize;
mod tokenizer_gguf;
