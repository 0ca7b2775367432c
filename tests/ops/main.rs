//! Ops, graphs and block types on the CPU backend: the per-op property tests against the
//! f64 oracle, the error paths of every builder, flash attention, the allocator,
//! execution order, profiling, the text and DOT dumps, and the quantized block formats.
//!
//! One test binary for these areas (`cargo test --test ops`); each file is a module.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/moe.rs"]
#[allow(dead_code)] // the device tests share the cases
mod moe;
#[allow(dead_code)] // the device tests' cases; only set_rows is run here
#[path = "../common/quant_strategies.rs"]
mod quant_strategies;

mod alloc;
mod attention;
mod dump;
mod forward;
mod frozen_cpu;
mod mul_mat_id;
mod ops_cpu;
mod ops_errors;
mod paged_attn;
mod profile;
mod quant;
mod quant_ops;
