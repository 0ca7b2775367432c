//! The CUDA backend: the kernel table, every op's property tests on the GPU against the
//! f64 oracle and the CPU (float and block-quantized tensors, mul_mat_id), a mixture of
//! experts' fused weighted sum bit for bit against the CPU, a small transformer step
//! captured and replayed as a CUDA graph, and the batched engine's random schedules.
//!
//! Built with `--features cuda` only (`cargo test --features cuda --test cuda`). Without
//! a GPU the device tests print "skipped: no GPU" and pass, unless `GRAFT_REQUIRE_GPU=1`,
//! which makes a missing GPU a failure.

use std::sync::Mutex;

#[path = "../common/mod.rs"]
mod common;
#[allow(dead_code)] // not every helper is used
#[path = "../support/fixtures.rs"]
mod fixtures;
#[allow(dead_code)] // the CPU tests' cases too
#[path = "../common/moe.rs"]
mod moe;
#[path = "../common/quant_strategies.rs"]
mod quant_strategies;

mod cuda_graph;
mod cuda_kernels;
mod engine_cuda;
mod moe_sum;
mod mul_mat_id;
mod ops_cuda;
mod ops_cuda_quant;

/// The property tests take the GPU one at a time.
static GPU: Mutex<()> = Mutex::new(());
