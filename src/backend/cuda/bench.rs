//! The op benchmark (`graft bench-ops`): the device's copy
//! bandwidth, then each kernel path at Llama-7B decode and prefill sizes (float weights,
//! and block-quantized Q4_0 / Q4_K / Q8_0 weights on both decode paths, quantized on the
//! device from seeded random values and frozen as a model freezes them, so Q4_0 and
//! Q8_0 take the split-row kernels; every type's `__dp4a` product also as a model runs
//! it, its Q8_1 input made once for all nodes, not by a quantizing launch of its own;
//! the fused attention, whose decode row's bandwidth is
//! that of its K/V read and prefill row's FLOP rate that of the unmasked half of a
//! causal 512 x 512; the paged attention of batches of sequences next to it, [`paged`];
//! the batched quantized products by 8 to 512 columns on each path, [`batched`]), then a
//! graph of many small nodes run eagerly and replayed. The bytes of a quantized product
//! are those of its blocks.
//!
//! Each op case is a plan of `R` copies of one node over distinct weights or caches
//! (enough that the 50 MB L2 cannot hold them, for the memory-bound cases). Two times:
//! - kernel: events recorded right before and after each node's launches, for every
//!   node in turn, many nodes enqueued before one synchronization (so the GPU does not
//!   wait for the host between them); the median over all samples. It includes the
//!   GPU's own launch latency (about a microsecond), and for kernels shorter than the
//!   host's enqueue time it also includes waiting for the host;
//! - node in graph: the plan captured into a CUDA graph and replayed; replay time over
//!   `R` (median of several batches): what a node costs in a real run.
//!
//! Bandwidth and FLOP rate come from the node-in-graph time, the condition every model
//! step runs in (a replayed graph); they count the bytes a node must read and write once,
//! and the fraction is of the measured copy bandwidth (bytes read + written by a
//! device-to-device copy). A kernel that only reads can exceed 100%: the copy's figure
//! includes its writes.

mod batched;
mod paged;

use serde::Serialize;

use super::device::{driver_error, DeviceMem};
use super::lowering::DevOp;
use super::CudaBackend;
use crate::backend::{Backend, BackendExt, ExecId, FrozenTensor};
use crate::error::{Error, Result};
use crate::graph::{BufferRef, DType, Graph, TensorId};
use crate::ops::{RopeMode, RopeParams};
use crate::quant::QType;

/// Options of [`run_bench_ops`].
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// GPU ordinal.
    pub device: usize,
    /// Timed replays per case (split into batches; the median batch counts).
    pub iters: usize,
    /// Only the op cases whose name contains this (all when None).
    pub filter: Option<String>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            device: 0,
            iters: 50,
            filter: None,
        }
    }
}

/// One measured case.
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    /// What was run.
    pub case: String,
    /// The kernels (or cuBLAS calls) of one node.
    pub kernels: String,
    /// Microseconds per kernel run alone (event-timed, launch latency included).
    pub us: f64,
    /// Microseconds per node of a replayed graph.
    pub graph_us: f64,
    /// Bytes a node reads and writes (at least once).
    pub bytes: f64,
    /// Achieved bandwidth in GB/s, from the node-in-graph time.
    pub gb_s: f64,
    /// `gb_s` over the measured copy bandwidth.
    pub of_copy: f64,
    /// TFLOP/s for matrix products, from the node-in-graph time.
    pub tflop_s: Option<f64>,
}

/// The graph of many small nodes, eager against replayed.
#[derive(Clone, Debug, Serialize)]
pub struct GraphRow {
    /// Nodes in the graph.
    pub nodes: usize,
    /// Microseconds per eager run (every node launched).
    pub eager_us: f64,
    /// Microseconds per replay of the captured graph.
    pub replay_us: f64,
}

/// Everything [`run_bench_ops`] measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// The GPU.
    pub device: String,
    /// Device-to-device copy bandwidth in GB/s (bytes read + written).
    pub copy_gb_s: f64,
    /// The op cases.
    pub rows: Vec<BenchRow>,
    /// The batched quantized products, path by path (their cases are in `rows` too).
    pub batched: Vec<batched::BatchedRow>,
    /// Eager against replayed.
    pub graph: GraphRow,
}

impl BenchReport {
    /// The report as markdown tables.
    pub fn markdown(&self) -> String {
        let mut s = format!(
            "## graft bench-ops on {}\n\ndevice copy bandwidth: {:.0} GB/s (read + write)\n\n",
            self.device, self.copy_gb_s
        );
        s.push_str("| case | kernels | us alone | us/node in graph | GB/s | of copy | TFLOP/s |\n");
        s.push_str("| --- | --- | ---: | ---: | ---: | ---: | ---: |\n");
        for r in &self.rows {
            s.push_str(&format!(
                "| {} | {} | {:.2} | {:.2} | {:.0} | {:.0}% | {} |\n",
                r.case,
                r.kernels,
                r.us,
                r.graph_us,
                r.gb_s,
                r.of_copy * 100.0,
                r.tflop_s.map_or("".into(), |t| format!("{t:.1}"))
            ));
        }
        s.push_str(&batched::table(&self.batched));
        let g = &self.graph;
        s.push_str(&format!(
            "\n| graph of {} small nodes | us/run | us/node |\n| --- | ---: | ---: |\n| eager | {:.1} | {:.2} |\n| replayed | {:.1} | {:.2} |\n",
            g.nodes,
            g.eager_us,
            g.eager_us / g.nodes as f64,
            g.replay_us,
            g.replay_us / g.nodes as f64
        ));
        s
    }
}

/// A timing event pair on the backend's stream.
struct Timer {
    start: cudarc::driver::CudaEvent,
    end: cudarc::driver::CudaEvent,
}

impl Timer {
    fn new(be: &CudaBackend) -> Result<Self> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let ev = || {
            be.ctx
                .new_event(flags)
                .map_err(|e| driver_error("cuEventCreate", e))
        };
        Ok(Timer {
            start: ev()?,
            end: ev()?,
        })
    }

    /// Microseconds the work enqueued by `f` took on the device.
    fn time(
        &self,
        be: &mut CudaBackend,
        f: impl FnOnce(&mut CudaBackend) -> Result<()>,
    ) -> Result<f64> {
        self.start
            .record(&be.stream)
            .map_err(|e| driver_error("cuEventRecord", e))?;
        f(be)?;
        self.end
            .record(&be.stream)
            .map_err(|e| driver_error("cuEventRecord", e))?;
        let ms = self
            .start
            .elapsed_ms(&self.end)
            .map_err(|e| driver_error("cuEventElapsedTime", e))?;
        Ok(f64::from(ms) * 1e3)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Device copy bandwidth in GB/s (bytes read + written): a 512 MiB device-to-device
/// copy, median of 20 after 3 warm-ups. The ceiling for memory-bound kernels.
pub fn copy_bandwidth(be: &mut CudaBackend) -> Result<f64> {
    const BYTES: usize = 512 << 20;
    let src = DeviceMem::alloc(&be.ctx, BYTES, "the copy benchmark")?;
    let dst = DeviceMem::alloc(&be.ctx, BYTES, "the copy benchmark")?;
    let timer = Timer::new(be)?;
    let mut times = Vec::new();
    for i in 0..23 {
        let t = timer.time(be, |be| {
            // SAFETY: both allocations hold BYTES bytes and live until the stream is idle.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.ptr(),
                    src.ptr(),
                    BYTES,
                    be.stream.cu_stream(),
                )
            }
            .map_err(|e| driver_error("cuMemcpyDtoDAsync", e))
        })?;
        if i >= 3 {
            times.push(t);
        }
    }
    be.synchronize()?;
    Ok(2.0 * BYTES as f64 / median(times) / 1e3)
}

/// A weight or state tensor of random values in a fresh buffer.
fn random_leaf(
    be: &mut CudaBackend,
    g: &mut Graph,
    name: &str,
    dtype: DType,
    shape: &[usize],
    seed: u64,
    state: bool,
) -> Result<TensorId> {
    let n: usize = shape.iter().product();
    let buf = be.alloc_buffer(n * dtype.block_bytes())?;
    be.fill_random(buf, 0, dtype, n, seed, 0.5)?;
    let data = BufferRef {
        buffer: buf,
        offset: 0,
    };
    if state {
        g.state(name, dtype, shape, data)
    } else {
        g.weight(name, dtype, shape, data)
    }
}

/// The bytes of `rows` rows of `row_len` elements of `q` made on the host, for the types
/// the device does not quantize to: seeded values in [-0.5, 0.5) quantized by
/// [`crate::quant::quantize_row`], or, for the read-only lattice types, seeded random
/// bytes (a product's speed does not depend on its values).
fn host_blocks(q: QType, row_len: usize, rows: usize, seed: u64) -> Result<Vec<u8>> {
    use rayon::prelude::*;
    let rb = DType::Quant(q).row_bytes(row_len);
    let mut out = vec![0u8; rb * rows];
    let next = |s: &mut u64| {
        *s ^= *s << 13;
        *s ^= *s >> 7;
        *s ^= *s << 17;
        *s
    };
    out.par_chunks_mut(rb)
        .enumerate()
        .try_for_each(|(r, row)| {
            let mut s = (seed ^ (r as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
            if !q.can_quantize() {
                row.iter_mut().for_each(|b| *b = next(&mut s) as u8);
                return Ok(());
            }
            let x: Vec<f32> = (0..row_len)
                .map(|_| (next(&mut s) >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
                .collect();
            crate::quant::quantize_row(q, &x, row)
        })?;
    Ok(out)
}

/// A frozen weight of block type `q` holding seeded random values quantized on the
/// device (a plan of its own: `cpy` of a random F32 tensor into the quantized buffer), or
/// on the host for the types the device does not quantize to ([`host_blocks`]).
fn quant_leaf(
    be: &mut CudaBackend,
    g: &mut Graph,
    name: &str,
    q: QType,
    shape: &[usize],
    seed: u64,
) -> Result<TensorId> {
    let n: usize = shape.iter().product();
    let dt = DType::Quant(q);
    let rows = n / shape[0];
    let buf = be.alloc_buffer(dt.row_bytes(shape[0]) * rows)?;
    let at = |buffer| BufferRef { buffer, offset: 0 };
    if super::kernels::by::CPY.get([DType::F32, dt]).is_err() {
        be.write_buffer(buf, 0, &host_blocks(q, shape[0], rows, seed)?)?;
        return g.weight(name, dt, shape, at(buf));
    }
    let src = be.alloc_buffer(n * 4)?;
    be.fill_random(src, 0, DType::F32, n, seed, 0.5)?;
    let mut q_graph = Graph::new();
    let x = q_graph.weight("x", DType::F32, shape, at(src))?;
    let y = q_graph.state("y", dt, shape, at(buf))?;
    let done = q_graph.cpy(x, y)?;
    let plan = q_graph.plan(&[done])?;
    let exec = be.load(&plan)?;
    be.compute(exec)?;
    be.synchronize()?;
    be.unload(exec)?;
    be.free_buffer(src)?;
    // Frozen as a model freezes its matrices, so that the products are the model's
    // (split rows for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K, unless GRAFT_CUDA_SPLIT=0).
    let frozen = FrozenTensor {
        name: name.to_string(),
        offset: 0,
        dtype: dt,
        row_len: shape[0],
        rows,
    };
    be.freeze_weights(buf, &[frozen])?;
    g.weight(name, dt, shape, at(buf))
}

/// Writes deterministic values into every input of a loaded plan.
fn fill_inputs(be: &mut CudaBackend, exec: ExecId) -> Result<()> {
    let inputs = be.exec(exec)?.plan.inputs.clone();
    for io in inputs {
        let n = io.operand.nelements();
        match io.operand.dtype {
            DType::I32 => be.set_input_i32(exec, io.operand.id, &vec![0i32; n])?,
            DType::F32 => {
                let v: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
                be.set_input_f32(exec, io.operand.id, &v)?
            }
            dt @ (DType::F16 | DType::BF16 | DType::Quant(_)) => {
                let bytes = vec![0u8; dt.row_bytes(n)];
                be.set_input(exec, io.operand.id, &bytes)?
            }
        }
    }
    Ok(())
}

/// The kernels of the last step of a plan, for the report (every step of a case is one
/// node's, but the first of a shared-activation case also quantizes them).
fn kernel_names(be: &CudaBackend, exec: ExecId) -> Result<String> {
    let e = be.exec(exec)?;
    let names: Vec<&str> = e
        .steps
        .last()
        .map(|ops| ops.iter().map(DevOp::name).collect())
        .unwrap_or_default();
    Ok(names.join(" + "))
}

/// Microseconds per replay of a loaded plan: capture, warm up, then the median of five
/// batches of `iters / 5` replays.
fn time_replays(be: &mut CudaBackend, exec: ExecId, iters: usize) -> Result<f64> {
    be.set_graphs(true);
    for _ in 0..3 {
        be.compute(exec)?;
    }
    let timer = Timer::new(be)?;
    let per_batch = (iters / 5).max(1);
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = timer.time(be, |be| {
            for _ in 0..per_batch {
                be.compute(exec)?;
            }
            Ok(())
        })?;
        times.push(t / per_batch as f64);
    }
    be.synchronize()?;
    Ok(median(times))
}

/// Median microseconds of one step's launches over `rounds` rounds of every step of a
/// loaded plan (see the module docs).
fn time_kernels(be: &mut CudaBackend, exec: ExecId, rounds: usize) -> Result<f64> {
    let n = be.exec(exec)?.steps.len();
    let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    let events = (0..2 * n)
        .map(|_| be.ctx.new_event(flags))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| driver_error("cuEventCreate", e))?;
    let mut times = Vec::with_capacity(rounds * n);
    for _ in 0..rounds {
        let e = be.exec(exec)?;
        let launcher = be.launcher();
        for (i, (step, ops)) in e.plan.steps.iter().zip(&e.steps).enumerate() {
            events[2 * i]
                .record(&be.stream)
                .map_err(|err| driver_error("cuEventRecord", err))?;
            launcher.run_step(step, ops)?;
            events[2 * i + 1]
                .record(&be.stream)
                .map_err(|err| driver_error("cuEventRecord", err))?;
        }
        for i in 0..n {
            let ms = events[2 * i]
                .elapsed_ms(&events[2 * i + 1])
                .map_err(|err| driver_error("cuEventElapsedTime", err))?;
            times.push(f64::from(ms) * 1e3);
        }
    }
    Ok(median(times))
}

/// Adds node number `r` of a case to a graph (allocating its weights on the backend).
type BuildFn<'a> = Box<dyn Fn(&mut CudaBackend, &mut Graph, usize) -> Result<TensorId> + 'a>;

/// A plan of `reps` nodes made by `build`, run and timed by [`run_case`].
struct Case<'a> {
    name: String,
    reps: usize,
    /// Bytes one node reads and writes.
    bytes: f64,
    /// Floating-point operations of one node (0 when not a product).
    flops: f64,
    build: BuildFn<'a>,
}

fn run_case(be: &mut CudaBackend, copy_gb_s: f64, iters: usize, case: Case) -> Result<BenchRow> {
    let mut g = Graph::new();
    let mut outs = Vec::with_capacity(case.reps);
    for r in 0..case.reps {
        outs.push((case.build)(be, &mut g, r)?);
    }
    let plan = g.plan(&outs)?;
    let exec = be.load(&plan)?;
    fill_inputs(be, exec)?;
    let kernels = kernel_names(be, exec)?;
    // Replays first: they also warm everything up for the kernel timing, which gets one
    // untimed round of its own (the first case of a run otherwise pays for clocks and
    // caches coming up).
    let graph_us = time_replays(be, exec, iters)? / case.reps as f64;
    time_kernels(be, exec, 2)?;
    let us = time_kernels(be, exec, iters.div_ceil(case.reps).max(5))?;
    be.unload(exec)?;
    // (nodes may share a buffer: each is freed once)
    let mut buffers: Vec<_> = plan
        .externals
        .iter()
        .filter_map(|io| match io.operand.loc {
            crate::graph::Loc::Buffer(b, _) => Some(b),
            crate::graph::Loc::Arena(_) => None,
        })
        .collect();
    buffers.sort();
    buffers.dedup();
    for b in buffers {
        be.free_buffer(b)?;
    }
    let gb_s = case.bytes / graph_us / 1e3;
    Ok(BenchRow {
        case: case.name,
        kernels,
        us,
        graph_us,
        bytes: case.bytes,
        gb_s,
        of_copy: gb_s / copy_gb_s,
        tflop_s: (case.flops > 0.0).then(|| case.flops / graph_us / 1e6),
    })
}

/// Replicas so that `bytes` per node times replicas exceed the L2 several times, and at
/// least 32 nodes per graph, so one replay's launch cost is spread as thinly as over a
/// model step's hundreds of nodes.
fn reps_for(bytes: f64) -> usize {
    ((256e6 / bytes).ceil() as usize).clamp(32, 64)
}

/// A decode GEMV case: `w` [k, m] of `dtype` times an F32 vector.
fn gemv_case<'a>(dtype: DType, k: usize, m: usize) -> Case<'a> {
    let bytes = (k * m * dtype.block_bytes() + 4 * (k + m)) as f64;
    Case {
        name: format!("mul_mat {dtype} [{k}, {m}] x f32 [{k}] (decode GEMV)"),
        reps: reps_for(bytes),
        bytes,
        flops: 2.0 * (k * m) as f64,
        build: Box::new(move |be, g, r| {
            let x = g.input(&format!("x{r}"), DType::F32, &[k])?;
            let w = random_leaf(be, g, &format!("w{r}"), dtype, &[k, m], r as u64, false)?;
            g.mul_mat(w, x)
        }),
    }
}

/// How a quantized decode case runs its products.
#[derive(Clone, Copy, PartialEq, Eq)]
enum QPath {
    /// Each node quantizes its own activations to Q8_1, then the `__dp4a` product.
    Dp4a,
    /// Each node dequantizes the weights in registers against F32 activations.
    Dequantize,
    /// The `__dp4a` product as a model step runs it: every node reads the same
    /// activations, so the plan quantizes them to Q8_1 once (in a model the norm before
    /// the products writes that copy, and no quantizing launch runs) and each node is the
    /// product kernel alone; the one quantizing launch is counted, spread over the nodes.
    Dp4aShared,
}

/// A decode product with block-quantized weights `w` [k, m] of `q` times an F32 vector,
/// on `path`.
fn qgemv_case<'a>(q: QType, k: usize, m: usize, path: QPath) -> Case<'a> {
    let bytes = (DType::Quant(q).row_bytes(k) * m + 4 * (k + m)) as f64;
    let what = match path {
        QPath::Dp4a => "q8_1 + dp4a",
        QPath::Dequantize => "dequantize",
        QPath::Dp4aShared => "product alone: one Q8_1 copy for all nodes",
    };
    let shared = std::cell::Cell::new(None);
    Case {
        name: format!("mul_mat {q} [{k}, {m}] x f32 [{k}] (decode, {what})"),
        reps: reps_for(bytes),
        bytes,
        flops: 2.0 * (k * m) as f64,
        build: Box::new(move |be, g, r| {
            // Lowering reads the switch when the plan loads, after every node is built.
            be.set_mmvq(Some(path != QPath::Dequantize));
            let x = match (path, shared.get()) {
                (QPath::Dp4aShared, Some(x)) => x,
                (QPath::Dp4aShared, None) => {
                    let x = g.input("x", DType::F32, &[k])?;
                    shared.set(Some(x));
                    x
                }
                (QPath::Dp4a | QPath::Dequantize, _) => {
                    g.input(&format!("x{r}"), DType::F32, &[k])?
                }
            };
            let w = quant_leaf(be, g, &format!("w{r}"), q, &[k, m], r as u64)?;
            g.mul_mat(w, x)
        }),
    }
}

/// The prefill product with block-quantized weights [4096, 4096] times 512 F32 tokens:
/// the weights dequantized to F16 in scratch, then cuBLAS.
fn qprefill_case<'a>(q: QType) -> Case<'a> {
    const D: usize = 4096;
    const T: usize = 512;
    Case {
        name: format!("mul_mat {q} [{D}, {D}] x f32 [{D}, {T}] (prefill)"),
        reps: 4,
        bytes: (DType::Quant(q).row_bytes(D) * D + D * T * 4 + D * T * 4) as f64,
        flops: 2.0 * (D * D * T) as f64,
        build: Box::new(move |be, g, r| {
            let x = g.input(&format!("x{r}"), DType::F32, &[D, T])?;
            let w = quant_leaf(be, g, &format!("w{r}"), q, &[D, D], r as u64)?;
            g.mul_mat(w, x)
        }),
    }
}

/// Attention cases over an F16 cache of `n_kv` positions, 32 heads of 128.
fn attention_cases<'a>(n_kv: usize) -> [Case<'a>; 2] {
    const HD: usize = 128;
    const HEADS: usize = 32;
    let cache = (n_kv * HD * HEADS * 2) as f64;
    let kq = Case {
        name: format!("kq: K-cache f16 [{HD}, {n_kv}, {HEADS}] x q (p021)"),
        reps: reps_for(cache),
        bytes: cache + (HD * HEADS * 4 + n_kv * HEADS * 4) as f64,
        flops: 2.0 * (n_kv * HD * HEADS) as f64,
        build: Box::new(move |be, g, r| {
            // K cache rows are positions: [HD * HEADS, n_kv]; the view is [HD, n_kv, HEADS].
            let kc = random_leaf(
                be,
                g,
                &format!("k{r}"),
                DType::F16,
                &[HD * HEADS, n_kv],
                r as u64,
                true,
            )?;
            let kv = g.view_3d(kc, HD, n_kv, HEADS, HD * HEADS * 2, HD * 2, 0)?;
            let q = g.input(&format!("q{r}"), DType::F32, &[HD, 1, HEADS])?;
            g.mul_mat(kv, q)
        }),
    };
    let kqv = Case {
        name: format!("kqv: V-cache f16 [{n_kv}, {HD}, {HEADS}] x p (vec_nc)"),
        reps: reps_for(cache),
        bytes: cache + (n_kv * HEADS * 4 + HD * HEADS * 4) as f64,
        flops: 2.0 * (n_kv * HD * HEADS) as f64,
        build: Box::new(move |be, g, r| {
            // The transposed V cache: [n_kv, HD, HEADS], rows along positions.
            let vc = random_leaf(
                be,
                g,
                &format!("v{r}"),
                DType::F16,
                &[n_kv, HD, HEADS],
                r as u64,
                true,
            )?;
            let vv = g.view_3d(vc, n_kv, HD, HEADS, n_kv * 2, n_kv * HD * 2, 0)?;
            let p = g.input(&format!("p{r}"), DType::F32, &[n_kv, 1, HEADS])?;
            g.mul_mat(vv, p)
        }),
    };
    [kq, kqv]
}

/// Fused attention (`flash_attn_ext`) over an F16 cache laid out as the model's,
/// `[HD * HEADS, n_ctx]` viewed as `[HD, n_kv, HEADS]`, 32 heads of 128 (Llama-2-7B):
/// decode (one query, 4096 keys; bandwidth of the K/V read) and a causal prefill of 512
/// queries over 512 keys (FLOP rate of the unmasked half, the work a causal kernel must do).
fn flash_attn_cases<'a>() -> Vec<Case<'a>> {
    const HD: usize = 128;
    const HEADS: usize = 32;
    let p = crate::ops::FlashAttnParams {
        scale: 1.0 / (HD as f32).sqrt(),
        max_bias: 0.0,
        softcap: 0.0,
    };
    let cache = |be: &mut CudaBackend, g: &mut Graph, name: &str, n: usize, r: usize| {
        let c = random_leaf(be, g, name, DType::F16, &[HD * HEADS, n], r as u64, true)?;
        g.view_3d(c, HD, n, HEADS, HD * HEADS * 2, HD * 2, 0)
    };
    // Decode: one query over n_kv keys, MHA (32 KV heads) and GQA (8 KV heads, as
    // Llama-3-8B); the bytes are the K/V rows read.
    let decode = |n_kv: usize, heads_kv: usize| {
        let kv_bytes = (2 * n_kv * HD * heads_kv * 2) as f64;
        Case {
            name: format!(
                "flash_attn_ext f16 K/V [{HD}, {n_kv}, {heads_kv}], {HEADS} heads, 1 query (decode)"
            ),
            reps: reps_for(kv_bytes),
            bytes: kv_bytes + (2 * HD * HEADS * 4) as f64,
            flops: 4.0 * (n_kv * HD * HEADS) as f64,
            build: Box::new(move |be, g, r| {
                let cache = |be: &mut CudaBackend, g: &mut Graph, name: &str, r: usize| {
                    let c = random_leaf(
                        be,
                        g,
                        name,
                        DType::F16,
                        &[HD * heads_kv, n_kv],
                        r as u64,
                        true,
                    )?;
                    g.view_3d(c, HD, n_kv, heads_kv, HD * heads_kv * 2, HD * 2, 0)
                };
                let k = cache(be, g, &format!("k{r}"), 2 * r)?;
                let v = cache(be, g, &format!("v{r}"), 2 * r + 1)?;
                let q = g.input(&format!("q{r}"), DType::F32, &[HD, 1, HEADS])?;
                g.flash_attn_ext(q, k, v, None, p)
            }),
        }
    };
    let mut cases: Vec<Case<'a>> = [512, 1024, 2048, 4096, 16384]
        .into_iter()
        .map(|n| decode(n, HEADS))
        .collect();
    cases.extend([4096, 16384].map(|n| decode(n, 8)));
    const T: usize = 512;
    let prefill = Case {
        name: format!("flash_attn_ext f16 K/V [{HD}, {T}, {HEADS}], {T} queries, causal (prefill)"),
        reps: 8,
        bytes: (2 * T * HD * HEADS * 2 + 2 * T * HD * HEADS * 4 + T * T * 2) as f64,
        flops: 4.0 * (HD * HEADS * T * (T + 1) / 2) as f64,
        build: Box::new(move |be, g, r| {
            let k = cache(be, g, &format!("k{r}"), T, 2 * r)?;
            let v = cache(be, g, &format!("v{r}"), T, 2 * r + 1)?;
            let q = g.input(&format!("q{r}"), DType::F32, &[HD, T, HEADS])?;
            // The causal mask as a weight (inputs get filler values): key j hidden from
            // query i when j > i.
            let mask: Vec<u8> = (0..T * T)
                .flat_map(|e| {
                    let (i, j) = (e / T, e % T);
                    let x = if j > i { f32::NEG_INFINITY } else { 0.0 };
                    half::f16::from_f32(x).to_le_bytes()
                })
                .collect();
            let buf = be.alloc_buffer(mask.len())?;
            be.write_buffer(buf, 0, &mask)?;
            let data = BufferRef {
                buffer: buf,
                offset: 0,
            };
            let m = g.weight(&format!("mask{r}"), DType::F16, &[T, T], data)?;
            g.flash_attn_ext(q, k, v, Some(m), p)
        }),
    };
    cases.push(prefill);
    cases
}

/// Small decode-size row ops (L2-resident; these measure the per-node cost).
fn small_cases<'a>() -> Vec<Case<'a>> {
    const D: usize = 4096;
    let rope = RopeParams::new(RopeMode::Neox, 128, 10000.0);
    vec![
        Case {
            name: format!("rms_norm f32 [{D}]"),
            reps: 64,
            bytes: (2 * D * 4) as f64,
            flops: 0.0,
            build: Box::new(|_, g, r| {
                let x = g.input(&format!("x{r}"), DType::F32, &[D])?;
                g.rms_norm(x, 1e-5)
            }),
        },
        Case {
            name: "rope neox f32 [128, 32, 1]".into(),
            reps: 64,
            bytes: (2 * D * 4) as f64,
            flops: 0.0,
            build: Box::new(move |_, g, r| {
                let x = g.input(&format!("x{r}"), DType::F32, &[128, 32, 1])?;
                let pos = g.input(&format!("pos{r}"), DType::I32, &[1])?;
                g.rope(x, pos, rope)
            }),
        },
        Case {
            name: "soft_max f32 [4096, 1, 32] + f32 mask".into(),
            reps: 64,
            bytes: (2 * 4096 * 32 * 4 + 4096 * 4) as f64,
            flops: 0.0,
            build: Box::new(|_, g, r| {
                let x = g.input(&format!("x{r}"), DType::F32, &[4096, 1, 32])?;
                let mask = g.input(&format!("m{r}"), DType::F32, &[4096, 1])?;
                g.soft_max_ext(x, Some(mask), 0.088)
            }),
        },
        Case {
            name: format!("cpy f32 [{D}] -> f16 cache row"),
            reps: 64,
            bytes: (D * 6) as f64,
            flops: 0.0,
            build: Box::new(|be, g, r| {
                let x = g.input(&format!("x{r}"), DType::F32, &[D])?;
                let c = random_leaf(
                    be,
                    g,
                    &format!("c{r}"),
                    DType::F16,
                    &[D, 16],
                    r as u64,
                    true,
                )?;
                let row = g.view_1d(c, D, 3 * D * 2)?;
                g.cpy(x, row)
            }),
        },
    ]
}

/// The prefill GEMM: F16 weights [4096, 4096] times 512 tokens (F32 activations, converted
/// first, as the model runs it; then F16 activations, the GEMM alone).
fn prefill_cases<'a>() -> Vec<Case<'a>> {
    const D: usize = 4096;
    const T: usize = 512;
    let flops = 2.0 * (D * D * T) as f64;
    [DType::F32, DType::F16]
        .into_iter()
        .map(|act| Case {
            name: format!("mul_mat f16 [{D}, {D}] x {act} [{D}, {T}] (prefill)"),
            reps: 4,
            bytes: (D * D * 2 + D * T * act.block_bytes() + D * T * 4) as f64,
            flops,
            build: Box::new(move |be, g, r| {
                let x = g.input(&format!("x{r}"), act, &[D, T])?;
                let w = random_leaf(
                    be,
                    g,
                    &format!("w{r}"),
                    DType::F16,
                    &[D, D],
                    r as u64,
                    false,
                )?;
                g.mul_mat(w, x)
            }),
        })
        .collect()
}

/// 300 x [rms_norm, mul, rope, add] on [128, 32, 1], eagerly and replayed.
fn graph_case(be: &mut CudaBackend, iters: usize) -> Result<GraphRow> {
    const BLOCKS: usize = 300;
    let mut g = Graph::new();
    let mut x = g.input("x", DType::F32, &[128, 32, 1])?;
    let pos = g.input("pos", DType::I32, &[1])?;
    let w = random_leaf(be, &mut g, "w", DType::F32, &[128], 7, false)?;
    let rope = RopeParams::new(RopeMode::Neox, 128, 10000.0);
    for _ in 0..BLOCKS {
        let h = g.rms_norm(x, 1e-5)?;
        let h = g.mul(h, w)?;
        let h = g.rope(h, pos, rope)?;
        x = g.add(x, h)?;
    }
    let plan = g.plan(&[x])?;
    let nodes = plan.steps.len();
    let exec = be.load(&plan)?;
    fill_inputs(be, exec)?;
    let runs = iters.max(10);
    be.set_graphs(false);
    be.compute(exec)?;
    be.synchronize()?;
    let t0 = std::time::Instant::now();
    for _ in 0..runs {
        be.compute(exec)?;
    }
    be.synchronize()?;
    let eager_us = t0.elapsed().as_secs_f64() * 1e6 / runs as f64;
    be.set_graphs(true);
    be.compute(exec)?;
    be.synchronize()?;
    let t0 = std::time::Instant::now();
    for _ in 0..runs {
        be.compute(exec)?;
    }
    be.synchronize()?;
    let replay_us = t0.elapsed().as_secs_f64() * 1e6 / runs as f64;
    be.unload(exec)?;
    Ok(GraphRow {
        nodes,
        eager_us,
        replay_us,
    })
}

/// Runs the op benchmark on GPU `opts.device`.
pub fn run_bench_ops(opts: &BenchOptions) -> Result<BenchReport> {
    if opts.iters == 0 {
        return Err(Error::plan("bench-ops: iters must be at least 1"));
    }
    let mut be = CudaBackend::new(opts.device)?;
    let device = be.device_name();
    let copy_gb_s = copy_bandwidth(&mut be)?;
    let mut cases = vec![
        gemv_case(DType::F16, 4096, 4096),
        gemv_case(DType::F16, 4096, 11008),
        gemv_case(DType::F16, 11008, 4096),
        gemv_case(DType::BF16, 4096, 4096),
        gemv_case(DType::F32, 4096, 4096),
    ];
    for n_kv in [512, 1024, 2048, 4096, 16384] {
        cases.extend(attention_cases(n_kv));
    }
    cases.extend(flash_attn_cases());
    cases.extend(paged::paged_attn_cases());
    cases.extend(small_cases());
    cases.extend(prefill_cases());
    for q in [QType::Q4_0, QType::Q4_K, QType::Q8_0] {
        for path in [QPath::Dp4a, QPath::Dequantize, QPath::Dp4aShared] {
            for (k, m) in [(4096, 4096), (4096, 11008), (11008, 4096)] {
                cases.push(qgemv_case(q, k, m, path));
            }
        }
    }
    // The other weight types, the low-bit K-quants, i-quants and ternary types included.
    let others = QType::ALL
        .into_iter()
        .filter(|q| ![QType::Q4_0, QType::Q4_K, QType::Q8_0, QType::Q8_1].contains(q));
    for q in others {
        for (k, m) in [(4096, 4096), (4096, 11008), (11008, 4096)] {
            cases.push(qgemv_case(q, k, m, QPath::Dp4aShared));
        }
    }
    cases.extend(
        [
            QType::Q4_0,
            QType::Q4_K,
            QType::Q8_0,
            QType::Q2_K,
            QType::Q3_K,
            QType::IQ4_XS,
            QType::IQ3_XXS,
        ]
        .map(qprefill_case),
    );
    if let Some(f) = &opts.filter {
        cases.retain(|c| c.name.contains(f.as_str()));
    }
    let mut rows = Vec::with_capacity(cases.len());
    for case in cases {
        rows.push(run_case(&mut be, copy_gb_s, opts.iters, case)?);
    }
    let (filter, mut batched) = (opts.filter.as_deref(), Vec::new());
    for q in [QType::Q4_0, QType::Q8_0, QType::Q4_K] {
        let widths = batched::cases(&mut be, q, copy_gb_s, opts.iters, filter, &mut rows)?;
        batched.extend(widths);
    }
    be.set_mmvq(None);
    let graph = graph_case(&mut be, opts.iters)?;
    Ok(BenchReport {
        device,
        copy_gb_s,
        rows,
        batched,
        graph,
    })
}
