//! The `graft` binary end to end (generate, logits, dump, bench, trace, convert, chat,
//! serve) and its error paths on a corpus of bad input, and checks of the source tree: the
//! docs' code blocks are the real code, the rooms of src/models import only earlier
//! rooms, and the peer scripts pass their self-test.
//!
//! These tests need what cargo builds next to them (the `graft` binary, the source
//! folder), so they stay out of the GPU bundle.

#[allow(dead_code)] // only the chat tests use it
#[path = "../support/default_model.rs"]
mod cached_model;
#[allow(dead_code)] // not every helper is used
#[path = "../support/fixtures.rs"]
mod fixtures;
#[allow(dead_code)] // not every helper is used
#[path = "../support/reference.rs"]
mod reference;
#[allow(dead_code)] // not every helper is used
#[path = "../support/serve.rs"]
mod server;

mod bad_input;
mod chat;
mod cli;
mod docs;
mod engine_memory;
mod gguf_model;
mod peer_scripts;
mod rooms;
mod serve;
mod serve_errors;
mod serve_load;
mod trace;
