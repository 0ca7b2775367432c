//! graft: a ggml-style compute-graph framework for LLM inference.
//!
//! Model code builds a lazy tensor DAG ([`graph::Graph`]); nothing is computed while
//! building. [`graph::Graph::plan`] orders the nodes and lays out one memory arena with
//! the allocator; a [`backend::Backend`] (the CPU reference, or CUDA with CUDA-graph
//! capture and replay) executes the plan. Models live in [`models`].
//!
//! Layers, from the bottom:
//! - [`quant`]: ggml-compatible quantized block formats (quantize, dequantize, the dot
//!   products of the quantized matrix-vector product), pure Rust;
//! - [`graph`]: tensors (`dtype`, `ne[4]`, `nb[4]`), the op set, the arena of nodes, the
//!   execution order, the allocator, plans and dumps;
//! - [`ops`]: one file per op family (builder, shape inference, CPU kernel);
//! - [`backend`]: CPU and CUDA executors;
//! - [`gguf`]: llama.cpp's GGUF model files, read (memory-mapped, every field checked)
//!   and written;
//! - [`models`]: model graphs (Llama) defined with the public API only;
//! - [`files`]: outputs written without losing data, inputs opened only when regular;
//! - [`fuzz`]: the loaders' fuzzing entry points (bytes in, `Result` out);
//! - [`serve`]: `graft serve`, an OpenAI-compatible HTTP server on the batched
//!   [`engine`].

#![deny(clippy::wildcard_enum_match_arm)]

pub mod backend;
pub mod engine;
pub mod error;
pub mod files;
pub mod fuzz;
pub mod gguf;
pub mod graph;
pub mod models;
pub mod ops;
pub mod quant;
pub mod serve;

pub use error::{Error, Result};

/// The README's code runs as a doctest, so the example there stays true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
