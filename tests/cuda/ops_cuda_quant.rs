//! The CUDA backend's ops on block-quantized tensors against the CPU backend and an f64
//! oracle on the host-dequantized weights (`common/quant_strategies.rs` draws the cases):
//! quantizing casts give the CPU's bytes (a block holding a NaN or an infinity too: zeros
//! with a NaN scale), dequantizing casts and get_rows the CPU's bits, mul_mat is within an
//! NMSE bound of the oracle and of the CPU on the path its width takes, which the profile
//! must show: the Q8_1 paths (the `__dp4a` decode kernels and the int8 tensor-core product
//! of batched widths: 5e-4, or 1.5 times the error of the host's Q8_1 reference where
//! that is larger, with the kernel held to that reference elementwise up to the order of
//! its f32 sums, `quant_strategies::check_sum_order`), dequantize in registers (1e-5) and
//! the weights dequantized to F16 for cuBLAS (1e-4). Each plan runs twice (capture, then
//! replay) with its arena poisoned around every tensor, which must stay poisoned. Without
//! a GPU every test prints "skipped: no GPU" and passes, unless `GRAFT_REQUIRE_GPU=1`.

use std::cell::RefCell;

use graft::backend::cpu::CpuBackend;
use graft::backend::cuda::{f16_from_cols, CudaBackend, QuantPath, MMQ_FROM_COLS, MMQ_MAX_COLS};
use graft::backend::Backend;
use graft::graph::{DType, Graph, TensorId};
use graft::ops::mul_mat::QuantDot;
use graft::quant::QType;
use proptest::prelude::any;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use qs::{QCase, QOp};
use quant_strategies as qs;

use crate::{common, quant_strategies};

/// Bound on the NMSE of the Q8_1 decode path (activations quantized to 8 bits).
const NMSE_MMVQ: f64 = 5e-4;
/// Bound on the NMSE of the F32 decode path.
const NMSE_DMMV: f64 = 1e-5;
/// Bound on the NMSE of the prefill path (weights and activations rounded to F16).
const NMSE_PREFILL: f64 = 1e-4;

/// Runs `cases` cases of `strategy`, each checked by `check` on the GPU and the CPU.
fn on_gpu<S: Strategy>(
    name: &str,
    strategy: S,
    cases: u32,
    check: impl Fn(&S::Value, &mut CudaBackend, &mut CpuBackend) -> Result<(), String>,
) {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    // The reference: block-typed products on the exact (f32) path, so the CPU only adds
    // the weights' own rounding (its Q8_1 path is checked against vec_dot_q8_1 instead).
    let mut cpu = CpuBackend::new();
    cpu.set_quant_dot(QuantDot::F32);
    let config = Config {
        source_file: Some(file!()),
        ..common::config(cases)
    };
    let cuda = RefCell::new(&mut cuda);
    let cpu = RefCell::new(&mut cpu);
    let result = TestRunner::new(config).run(&strategy, |case| {
        check(&case, &mut cuda.borrow_mut(), &mut cpu.borrow_mut()).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
}

fn run_on(
    c: &QCase,
    be: &mut dyn graft::backend::Backend,
) -> Result<(graft::graph::DType, Vec<u8>), String> {
    qs::run(c, be).map_err(|e| format!("{} failed: {e}", be.name()))
}

/// The first block (of `block` bytes) where `a` and `b` differ, if any.
fn first_diff(a: &[u8], b: &[u8], block: usize) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("lengths {} and {}", a.len(), b.len()));
    }
    let i = a.iter().zip(b).position(|(x, y)| x != y)?;
    let s = i / block * block;
    Some(format!(
        "byte {i} (block at {s}): cuda {:?} cpu {:?}",
        &a[s..(s + block).min(a.len())],
        &b[s..(s + block).min(b.len())]
    ))
}

/// The result bytes on both backends must be identical.
fn check_bytes(c: &QCase, cuda: &mut CudaBackend, cpu: &mut CpuBackend) -> Result<(), String> {
    let (_, g) = run_on(c, cuda)?;
    let (dt, r) = run_on(c, cpu)?;
    if let Some(d) = first_diff(&g, &r, dt.block_bytes()) {
        return Err(format!("{c:?}: results differ: {d}"));
    }
    if c.op != QOp::Quantize {
        let e = qs::nmse(&qs::decode_rows(dt, c.k, &r), &qs::oracle(c));
        if e.is_nan() || e > 1e-6 {
            return Err(format!("{c:?}: cpu vs oracle NMSE {e:e}"));
        }
    }
    Ok(())
}

/// The kernels a quantized mul_mat runs on the GPU.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Path {
    /// Q8_1 activations, `__dp4a` decode kernels.
    Dp4a,
    /// Weights dequantized in registers against F32 activations.
    Dequantize,
    /// Q8_1 activations, the int8 tensor-core product.
    Mmq,
    /// F16 activations, the F16 tensor-core product on weights unpacked to F16 (in shared
    /// memory, `mmh_*`, or in registers, `mmr_*`).
    Mmh,
    /// Weights dequantized to F16 for cuBLAS.
    Cublas,
}

impl Path {
    /// The path of the kernels a run's profile lists.
    fn of(kernels: &[String]) -> Option<Path> {
        let ran = |k: &str| kernels.iter().any(|s| s.contains(k));
        [
            ("mmq_c", Path::Mmq),
            ("mmq_split_", Path::Mmq),
            ("mmh_", Path::Mmh),
            ("mmr_", Path::Mmh),
            ("mul_mat_vec_q", Path::Dp4a),
            ("mul_mat_vec_dq", Path::Dequantize),
            ("cublas", Path::Cublas),
        ]
        .into_iter()
        .find_map(|(k, p)| ran(k).then_some(p))
    }

    /// The path the lowering must pick for case `c` on the decode path `mmvq`: the decode
    /// kernels for a few columns without batches (below `MMQ_FROM_COLS` for a type the
    /// tensor-core products take, with or without a residual add after it), the
    /// tensor-core products up to `MMQ_MAX_COLS` columns (batches included) over one weight
    /// matrix of a type they have kernels for ([`qs::core_types`]: int8 below
    /// `f16_from_cols`, F16 from there), cuBLAS otherwise.
    fn expected(c: &QCase, mmvq: bool) -> Path {
        let one = c.a_batch == [1, 1];
        let mmq_type = qs::core_types().contains(&c.q);
        let decode_cols = match mmq_type {
            true => MMQ_FROM_COLS - 1,
            false => 8,
        };
        match (c.n <= decode_cols && one && c.repeat == [1, 1], mmvq) {
            (true, true) => Path::Dp4a,
            (true, false) => Path::Dequantize,
            (false, _) if one && c.cols() < f16_from_cols(DType::Quant(c.q), true) && mmq_type => {
                Path::Mmq
            }
            (false, _) if one && c.cols() <= MMQ_MAX_COLS && mmq_type => Path::Mmh,
            (false, _) => Path::Cublas,
        }
    }

    /// Bound on the NMSE of the path's results against the oracle and the CPU.
    fn bound(self) -> f64 {
        match self {
            Path::Dp4a | Path::Mmq => NMSE_MMVQ,
            Path::Dequantize => NMSE_DMMV,
            Path::Mmh | Path::Cublas => NMSE_PREFILL,
        }
    }
}

/// mul_mat on the GPU on the path its shape takes (decode kernels on the `mmvq` path,
/// the tensor-core product or cuBLAS; the profile of a second, eager run names the
/// kernels, and its results must be the replayed run's bytes), within the path's bound of
/// the oracle and of the CPU; a Q8_1 path also within the order of its f32 sums of the
/// host's `vec_dot_q8_1`.
fn check_mul_mat(
    c: &QCase,
    cuda: &mut CudaBackend,
    cpu: &mut CpuBackend,
    mmvq: bool,
) -> Result<(), String> {
    let want = qs::oracle(c);
    let (dt, r) = run_on(c, cpu)?;
    let r = qs::decode(dt, &r);
    let e = qs::nmse(&r, &want);
    if e > NMSE_DMMV {
        return Err(format!("{c:?}: cpu vs oracle NMSE {e:e}"));
    }
    cuda.set_mmvq(Some(mmvq));
    let out = run_on(c, cuda);
    cuda.set_mmvq(None);
    let (dt, bytes) = out?;
    let (eager, kernels) = profiled(cuda, mmvq, |cuda| run_on(c, cuda));
    let path = Path::of(&kernels);
    if path != Some(Path::expected(c, mmvq)) {
        return Err(format!("{c:?} (mmvq {mmvq}): ran {path:?}: {kernels:?}"));
    }
    if let Some(d) = first_diff(&eager?.1, &bytes, 4) {
        return Err(format!("{c:?}: eager and replayed runs differ: {d}"));
    }
    let path = Path::expected(c, mmvq);
    let g = qs::decode(dt, &bytes);
    if let Some(i) = g.iter().position(|v| !v.is_finite()) {
        return Err(format!("{c:?} ({path:?}): element {i} is {}", g[i]));
    }
    // The Q8_1 paths' error is that of the 8-bit activations, which a case with few
    // outputs and outliers can push past the bound by itself: the bound is then the
    // host reference's own error against the oracle (normalized by the oracle, as the
    // kernel's is), and the exact check below still holds the kernel to that reference.
    let reference = matches!(path, Path::Dp4a | Path::Mmq).then(|| qs::oracle_q8_1(c));
    let bound = match &reference {
        Some(q) => path.bound().max(1.5 * qs::nmse(q, &want)),
        None => path.bound(),
    };
    // The Q8_1 paths compute exactly what vec_dot_q8_1 does, up to the order of the f32
    // sums (checked first: its message names the element).
    if let Some(q) = &reference {
        let g: Vec<f32> = g.iter().map(|&v| v as f32).collect();
        qs::check_sum_order(c, &qs::activations(c), &g, q)
            .map_err(|e| format!("{c:?} ({path:?}): vs vec_dot_q8_1: {e}"))?;
    }
    let (eo, ec) = (qs::nmse(&g, &want), qs::nmse(&g, &r));
    if eo > bound || ec > bound {
        return Err(format!(
            "{c:?} ({path:?}): NMSE vs oracle {eo:e}, vs cpu {ec:e} (bound {bound:e})"
        ));
    }
    Ok(())
}

#[test]
fn prop_quantize_matches_cpu_bytes() {
    on_gpu("quantize", qs::quantize(qs::core_types()), 192, check_bytes);
}

#[test]
fn prop_dequantize_matches_cpu_bits() {
    on_gpu("dequantize", qs::dequantize(), 192, check_bytes);
}

#[test]
fn prop_get_rows_matches_cpu_bits() {
    on_gpu("get_rows", qs::get_rows(), 128, check_bytes);
}

/// set_rows into a quantized table (a quantized KV cache's write): the CPU's bytes.
#[test]
fn prop_set_rows_matches_cpu_bytes() {
    on_gpu("set_rows", qs::set_rows(qs::core_types()), 96, check_bytes);
}

#[test]
fn prop_mul_mat_decode_q8_1() {
    on_gpu(
        "mul_mat decode (Q8_1, dp4a)",
        qs::mul_mat_decode(),
        192,
        |c, g, r| check_mul_mat(c, g, r, true),
    );
}

/// The same with weight rows that are not 16-byte aligned: the K-quants' pairs then take
/// 32-bit words where aligned rows take 16-byte loads.
#[test]
fn prop_mul_mat_decode_q8_1_unaligned() {
    on_gpu(
        "mul_mat decode (Q8_1, dp4a), unaligned rows",
        qs::mul_mat_decode_offset(),
        96,
        |c, g, r| check_mul_mat(c, g, r, true),
    );
}

/// A case `prop_mul_mat_decode_q8_1` found with 512 cases: one output whose terms nearly
/// cancel (oracle -0.416, the host's Q8_1 reference -0.839). The Q8_1 path's bound is
/// that reference's own error normalized by the oracle, as the kernel's NMSE is;
/// normalized by the reference instead it was a quarter of that, and the kernel, which
/// matches the reference, failed it. Row of 144 Q8_0 blocks plus one of padding: two
/// staged chunks, the second partial.
#[test]
fn decode_q8_1_single_output_near_zero() {
    let case = QCase {
        pad: 1,
        ..QCase::mul_mat(QType::Q8_0, 4608, 1, 1, false, 7931866750241223111)
    };
    on_gpu(
        "mul_mat decode, near-zero output",
        proptest::strategy::Just(case),
        1,
        |c, g, r| check_mul_mat(c, g, r, true),
    );
}

#[test]
fn prop_mul_mat_decode_dequantize() {
    on_gpu(
        "mul_mat decode (dequantize)",
        qs::mul_mat_decode(),
        192,
        |c, g, r| check_mul_mat(c, g, r, false),
    );
}

/// `rms_norm(x) * nw` then a decode product of it, on the GPU: the fused norm writes the
/// Q8_1 activations the product reads. The normalized rows must be the CPU's, and the
/// product must be `vec_dot_q8_1` against those very rows quantized on the host (exact up
/// to the order of the f32 sums), so a wrong quant, scale or block sum in the norm's Q8_1
/// copy fails (the widths where a product takes the F16 tensor cores instead: the CPU's
/// product within the F16 bound). The norm weight is F32, F16 or BF16. Aligned, rows of 2,048 elements or
/// more take the kernel's 16-byte vector path and shorter ones its scalar path;
/// `misalign` puts the weight one element off its buffer's alignment, which takes the
/// scalar path at any length. Row lengths up to 160 blocks leave warps partly outside the
/// row.
#[test]
fn prop_norm_then_decode_q8_1() {
    let wdt = proptest::sample::select(vec![DType::F32, DType::F16, DType::BF16]);
    let strategy = (qs::mul_mat_decode(), wdt, any::<bool>());
    on_gpu(
        "norm then decode",
        strategy,
        64,
        |(c, wdt, misalign), cuda, cpu| check_norm_decode(c, *wdt, *misalign, cuda, cpu),
    );
}

fn check_norm_decode(
    c: &QCase,
    wdt: DType,
    misalign: bool,
    cuda: &mut CudaBackend,
    cpu: &mut CpuBackend,
) -> Result<(), String> {
    let what = format!("{c:?}, norm weight {wdt}, misaligned {misalign}");
    let (h_gpu, y_gpu) =
        norm_decode(c, wdt, misalign, cuda).map_err(|e| format!("{what}: cuda: {e}"))?;
    let (h_cpu, y_cpu) =
        norm_decode(c, wdt, misalign, cpu).map_err(|e| format!("{what}: cpu: {e}"))?;
    let as64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
    let e = qs::nmse(&h_gpu, &as64(&h_cpu));
    if e > 1e-10 {
        return Err(format!("{what}: normalized rows vs cpu NMSE {e:e}"));
    }
    // From f16_from_cols columns on, the 32-element types' products take the F16 tensor
    // cores (mmr_*), which read their own F16 copy of the normalized rows, not the norm's
    // Q8_1 one: held to the CPU's exact product within the F16 paths' bound.
    if qs::core_types().contains(&c.q) && c.n >= f16_from_cols(DType::Quant(c.q), true) {
        let e = qs::nmse(&y_gpu, &as64(&y_cpu));
        return match e <= NMSE_PREFILL {
            true => Ok(()),
            false => Err(format!("{what}: F16 product vs cpu NMSE {e:e}")),
        };
    }
    // vec_dot_q8_1 of each weight row with each normalized column, quantized on the host.
    let want = qs::q8_1_products(c, &h_gpu);
    if let Some(i) = y_gpu.iter().position(|v| !v.is_finite()) {
        return Err(format!("{what}: element {i} is {}", y_gpu[i]));
    }
    qs::check_sum_order(c, &h_gpu, &y_gpu, &want)
        .map_err(|e| format!("{what}: product vs vec_dot_q8_1: {e}"))
}

/// Runs `y = mul_mat(w, rms_norm(x) * nw)` of case `c` (its weights and activations) on
/// `be`; returns the normalized rows and `y`.
fn norm_decode(
    c: &QCase,
    wdt: DType,
    misalign: bool,
    be: &mut dyn graft::backend::Backend,
) -> graft::Result<(Vec<f32>, Vec<f32>)> {
    run_over_weights(c, be, |g, w| {
        let x = g.input("x", DType::F32, &[c.k, c.n])?;
        let off = usize::from(misalign);
        let nw_all = g.input("nw", wdt, &[c.k + 1])?;
        let nw = g.view_1d(nw_all, c.k, off * wdt.block_bytes())?;
        let h = g.rms_norm(x, 1e-5)?;
        let h = g.mul(h, nw)?;
        let y = g.mul_mat(w, h)?;
        let nw_vals = qs::values(c.seed.wrapping_add(7), c.k + 1);
        let inputs = vec![
            (x, qs::f32_bytes(&qs::activations(c))),
            (
                nw_all,
                common::case::encode(wdt, &common::case::Data::F(nw_vals)),
            ),
        ];
        Ok((inputs, [h, y]))
    })
}

/// Builds a graph over the (strided) weights of case `c` in a buffer of their own on
/// `be`: `build` gets the weight view, adds the rest, and returns the inputs with their
/// bytes and two F32 outputs. Runs it twice (capture, then replay); returns the outputs.
fn run_over_weights(
    c: &QCase,
    be: &mut dyn graft::backend::Backend,
    build: impl FnOnce(&mut Graph, TensorId) -> graft::Result<(Vec<(TensorId, Vec<u8>)>, [TensorId; 2])>,
) -> graft::Result<(Vec<f32>, Vec<f32>)> {
    let bytes = qs::weight_bytes(c);
    let buf = be.alloc_buffer(bytes.len())?;
    let result = (|| {
        be.write_buffer(buf, 0, &bytes)?;
        let mut g = Graph::new();
        let w = qs::weight_view(&mut g, c, buf)?;
        let (inputs, outs) = build(&mut g, w)?;
        let mut out_bytes = Vec::with_capacity(2);
        for id in outs {
            out_bytes.push(vec![0u8; g.get(id)?.ne.iter().product::<usize>() * 4]);
        }
        let plan = g.plan(&outs)?;
        let exec = be.load(&plan)?;
        let run = (|| {
            for _ in 0..2 {
                for (id, data) in &inputs {
                    be.set_input(exec, *id, data)?;
                }
                be.compute(exec)?;
            }
            for (id, out) in outs.iter().zip(&mut out_bytes) {
                be.get_output(exec, *id, out)?;
            }
            Ok(())
        })();
        be.unload(exec)?;
        run.map(|()| (floats(&out_bytes[0]), floats(&out_bytes[1])))
    })();
    be.free_buffer(buf)?;
    result
}

/// A decode attention, then a decode product of its result: when the keys are split
/// over blocks, `fattn_combine` writes the product's Q8_1 activations itself (the
/// product has no quantizing launch). The attention result must be the CPU's (F16 cache
/// NMSE 5e-4, F32 1e-6), and the product `vec_dot_q8_1` against that very result
/// quantized on the host, up to the order of the f32 sums; so a wrong quant, scale, sum,
/// column or head offset in the combine's copy fails. Head dims 64 and 128, MHA and GQA
/// (one-row and tensor-core decode kernels), 1-3 queries, 130-1,500 keys (split).
#[test]
fn prop_attention_then_decode_q8_1() {
    let q = proptest::sample::select(qs::weight_types());
    let kv = proptest::sample::select(vec![DType::F16, DType::F32]);
    let shape = (
        proptest::sample::select(vec![64usize, 128]),
        proptest::sample::select(vec![4usize, 8]),
        proptest::sample::select(vec![1usize, 2, 4]),
        1usize..=3,
        130usize..=1500,
        1usize..=40,
    );
    let strategy = (q, kv, shape, any::<u64>()).prop_map(|(q, kv, shape, seed)| AttnProduct {
        q,
        kv,
        shape,
        seed,
    });
    on_gpu("attention then decode", strategy, 48, |a, cuda, cpu| {
        a.check(cuda, cpu)
    });
}

/// A case of [`prop_attention_then_decode_q8_1`]: weight type, cache type, (head dim,
/// heads, GQA group, queries, keys, weight rows) and the seed of every value.
#[derive(Debug)]
struct AttnProduct {
    q: QType,
    kv: DType,
    shape: (usize, usize, usize, usize, usize, usize),
    seed: u64,
}

impl AttnProduct {
    /// The product's weights as a decode QCase over the attention result.
    fn product(&self) -> QCase {
        let (d, heads, _, n_q, _, rows) = self.shape;
        QCase {
            op: QOp::MulMat { add: false },
            q: self.q,
            k: d * heads,
            rows,
            pad: 0,
            offset: 0,
            n: n_q,
            a_batch: [1, 1],
            repeat: [1, 1],
            x_pad: 0,
            seed: self.seed,
        }
    }

    fn check(&self, cuda: &mut CudaBackend, cpu: &mut CpuBackend) -> Result<(), String> {
        let (o_gpu, y_gpu) = self.run(cuda).map_err(|e| format!("{self:?}: cuda: {e}"))?;
        let (o_cpu, _) = self.run(cpu).map_err(|e| format!("{self:?}: cpu: {e}"))?;
        let as64 = |v: &[f32]| v.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let e = qs::nmse(&o_gpu, &as64(&o_cpu));
        let bound = if self.kv == DType::F16 { 5e-4 } else { 1e-6 };
        if e > bound {
            return Err(format!("{self:?}: attention vs cpu NMSE {e:e}"));
        }
        if let Some(i) = y_gpu.iter().position(|v| !v.is_finite()) {
            return Err(format!("{self:?}: element {i} is {}", y_gpu[i]));
        }
        let c = self.product();
        let want = qs::q8_1_products(&c, &o_gpu);
        qs::check_sum_order(&c, &o_gpu, &y_gpu, &want)
            .map_err(|e| format!("{self:?}: product vs vec_dot_q8_1: {e}"))
    }

    /// Runs `y = mul_mat(w, flash_attn_ext(q, k, v))` on `be`; returns the attention
    /// result (as the product's columns) and `y`.
    fn run(&self, be: &mut dyn graft::backend::Backend) -> graft::Result<(Vec<f32>, Vec<f32>)> {
        let (d, heads, group, n_q, n_kv, _) = self.shape;
        run_over_weights(&self.product(), be, |g, w| {
            let qt = g.input("q", DType::F32, &[d, n_q, heads])?;
            let kt = g.input("k", self.kv, &[d, n_kv, heads / group])?;
            let vt = g.input("v", self.kv, &[d, n_kv, heads / group])?;
            let p = graft::graph::FlashAttnParams {
                scale: 1.0 / (d as f32).sqrt(),
                max_bias: 0.0,
                softcap: 0.0,
            };
            let o = g.flash_attn_ext(qt, kt, vt, None, p)?;
            let o = g.reshape(o, &[d * heads, n_q])?;
            let y = g.mul_mat(w, o)?;
            let kv_len = d * n_kv * heads / group;
            let values = |seed: u64, len: usize, dt: DType| {
                let v = qs::values_with(self.seed.wrapping_add(seed), len, 4.0);
                common::case::encode(dt, &common::case::Data::F(v))
            };
            let inputs = vec![
                (qt, values(11, d * n_q * heads, DType::F32)),
                (kt, values(12, kv_len, self.kv)),
                (vt, values(13, kv_len, self.kv)),
            ];
            Ok((inputs, [o, y]))
        })
    }
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn prop_mul_mat_prefill() {
    on_gpu("mul_mat prefill", qs::mul_mat_prefill(), 96, |c, g, r| {
        check_mul_mat(c, g, r, true)
    });
}

/// Batched products (9..=300 columns, batches of activations broadcast over one weight
/// matrix, strided activation rows whose NaN padding no kernel may read, rows of up to
/// three 64-row tiles and long enough for parts of K, weights at aligned and unaligned
/// offsets): the int8 tensor-core product up to `MMQ_MAX_COLS` columns, exactly the host's
/// `vec_dot_q8_1` up to the order of its f32 sums; cuBLAS on the F16 copy past it.
#[test]
fn prop_mul_mat_batched() {
    on_gpu("mul_mat batched", qs::mul_mat_batched(), 128, |c, g, r| {
        check_mul_mat(c, g, r, true)
    });
}

/// Every width of the tensor-core product's column tiles and the decode widths, forced
/// onto it (`QuantPath::Mmq`), every type it has kernels for: 1..=8 columns take the
/// 8-column tile, which only batched activations reach otherwise.
#[test]
fn prop_mmq_forced_at_decode_widths() {
    use proptest::sample::select;
    let case = (
        select(qs::core_types()),
        1usize..=8,
        1usize..=70,
        any::<u64>(),
    )
        .prop_flat_map(|(q, n, rows, seed)| {
            let max = if q.block_size() == 32 { 40 } else { 5 };
            (1usize..=max)
                .prop_map(move |b| QCase::mul_mat(q, b * q.block_size(), rows, n, false, seed))
        });
    on_gpu("mmq at decode widths", case, 48, |c, cuda, _cpu| {
        let want = qs::oracle_q8_1(c);
        cuda.set_quant_path(QuantPath::Mmq);
        let (out, kernels) = profiled(cuda, true, |cuda| run_on(c, cuda));
        cuda.set_quant_path(QuantPath::Auto);
        if Path::of(&kernels) != Some(Path::Mmq) {
            return Err(format!("{c:?}: {kernels:?}"));
        }
        let (dt, bytes) = out?;
        let g: Vec<f32> = qs::decode(dt, &bytes).iter().map(|&v| v as f32).collect();
        qs::check_sum_order(c, &qs::activations(c), &g, &want).map_err(|e| format!("{c:?}: {e}"))
    });
}

/// Every width of the F16 tensor-core product's column tiles and the decode widths, forced
/// onto it (`QuantPath::Mmh`), every type it has kernels for (the 32-element types with
/// their weights unpacked in registers, `mmr_*`, or in shared memory, `mmh_*`, by the
/// seed), rows of one to a few row tiles and long enough for parts of K: within the F16
/// paths' bound of the oracle and of the CPU.
#[test]
fn prop_mmh_forced_at_every_width() {
    use proptest::sample::select;
    let case = (
        select(qs::core_types()),
        1usize..=MMQ_MAX_COLS,
        1usize..=200,
        any::<u64>(),
    )
        .prop_flat_map(|(q, n, rows, seed)| {
            let max = if q.block_size() == 32 { 160 } else { 20 };
            (1usize..=max)
                .prop_map(move |b| QCase::mul_mat(q, b * q.block_size(), rows, n, false, seed))
        });
    on_gpu("mmh at every width", case, 48, |c, cuda, cpu| {
        let want = qs::oracle(c);
        let (dt, r) = run_on(c, cpu)?;
        let r = qs::decode(dt, &r);
        let mmr = c.seed % 2 == 0;
        cuda.set_quant_path(QuantPath::Mmh);
        cuda.set_mmr(mmr);
        let (out, kernels) = profiled(cuda, true, |cuda| run_on(c, cuda));
        cuda.set_quant_path(QuantPath::Auto);
        cuda.set_mmr(true);
        if Path::of(&kernels) != Some(Path::Mmh) {
            return Err(format!("{c:?}: {kernels:?}"));
        }
        let in_registers = kernels.iter().any(|k| k.contains("mmr_"));
        if in_registers != (mmr && c.q.block_size() == 32) {
            return Err(format!("{c:?} (mmr {mmr}): {kernels:?}"));
        }
        let (dt, bytes) = out?;
        let g = qs::decode(dt, &bytes);
        if let Some(i) = g.iter().position(|v| !v.is_finite()) {
            return Err(format!("{c:?}: element {i} is {}", g[i]));
        }
        let (eo, ec) = (qs::nmse(&g, &want), qs::nmse(&g, &r));
        match eo <= NMSE_PREFILL && ec <= NMSE_PREFILL {
            true => Ok(()),
            false => Err(format!("{c:?}: NMSE vs oracle {eo:e}, vs cpu {ec:e}")),
        }
    });
}

/// A mul_mat case over frozen weights of one of `types`: `k` one of `ks` (rows the CUDA
/// backend splits or not), at one of `offsets` (16-byte aligned or not), one wave of
/// blocks (`mul_mat_vec_qsp_*`) or more (`mul_mat_vec_qs_*`), decode widths, the widths of
/// each column tile of the tensor-core product and prefill widths past them, a fused
/// residual add or not, padded rows (`pad` blocks, one of `pads`) or not, on either decode
/// path.
fn frozen_case(
    types: Vec<QType>,
    ks: Vec<usize>,
    offsets: Vec<usize>,
    pads: Vec<usize>,
) -> impl Strategy<Value = (QCase, bool)> {
    use proptest::sample::select;
    (
        select(types),
        select(ks),
        proptest::prop_oneof![1usize..150, 4225usize..4400],
        select(vec![1usize, 2, 3, 4, 5, 8, 9, 17, 40, 64, 100, 300]),
        select(offsets),
        select(pads),
        any::<bool>(),
        any::<u64>(),
        any::<bool>(),
    )
        .prop_map(|(q, k, rows, n, offset, pad, add, seed, mmvq)| {
            // rows of at most 4,096 elements in the grids of more than one wave: the
            // weights are quantized on the host
            let k = if rows > 150 { k.min(4096) } else { k };
            let c = QCase {
                pad,
                offset,
                ..QCase::mul_mat(q, k, rows, n, add, seed)
            };
            (c, mmvq)
        })
}

/// Frozen Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 weights (`Backend::freeze_weights`) give the
/// very bytes the same weights give unfrozen, on both decode paths and the prefill path,
/// in grids of one wave of blocks and more; the profile shows the split kernels ran exactly when the rows could be split
/// (rows of a whole number of 16 bytes, 16-byte aligned), so the check cannot pass by freezing
/// changing nothing. A view of part of each
/// frozen row (padded rows) must fail to load with an error naming the tensor.
#[test]
fn prop_frozen_weights_match_unfrozen() {
    use QType::*;
    let case = frozen_case(
        vec![Q4_0, Q4_1, Q5_0, Q5_1, Q8_0],
        vec![256, 512, 768, 2304, 4096, 96, 128, 64],
        vec![0, 16, 2064, 2],
        vec![0, 0, 8],
    );
    on_gpu("frozen weights", case, 96, |(c, mmvq), cuda, _cpu| {
        check_frozen(c, *mmvq, cuda)
    });
}

/// `prop_frozen_weights_match_unfrozen` for Q5_K and Q6_K. Q6_K's split rows are rotated
/// by their address: rows of 1-43 super-blocks (split from 8 on: 2,048 elements), at
/// offsets that leave every even rotation to some row (rows of 9, 11, 43 blocks are 2, 6
/// and 6 bytes past a multiple of 16); Q5_K's are split at 16-byte aligned offsets only.
/// Grids of one wave of blocks and more, padded rows, decode and prefill widths, both
/// decode paths.
#[test]
fn prop_frozen_k_quant_weights_match_unfrozen() {
    let case = frozen_case(
        vec![QType::Q5_K, QType::Q6_K],
        vec![256, 1792, 2048, 2304, 2816, 4096, 11008],
        vec![0, 16, 2064, 2, 6, 10, 14],
        vec![0, 0, 1],
    );
    on_gpu(
        "frozen K-quant weights",
        case,
        64,
        |(c, mmvq), cuda, _cpu| check_frozen(c, *mmvq, cuda),
    );
}

/// Frozen weights of every type under batched products (`qs::mul_mat_batched`: broadcast
/// batches, strided activations, 9..=300 columns): the bytes the same weights give
/// unfrozen, the split kernels (`mmq_split_*`, `cpy_split_*`) exactly when the rows are
/// split (offset 0; Q6_K: any even offset).
#[test]
fn prop_frozen_batched_match_unfrozen() {
    on_gpu(
        "frozen weights, batched",
        qs::mul_mat_batched(),
        64,
        |c, cuda, _cpu| check_frozen(c, true, cuda),
    );
}

/// Q4_K and Q5_K decode products at 16-byte aligned rows and IQ4_XS ones at 8-byte
/// aligned rows (with padding blocks, IQ4_XS rows that are not 16-byte multiples), which
/// the backend reads in place (`mul_mat_vec_qd_*`), against the same weights 2 bytes
/// further into their buffer, which the staged kernel (`mul_mat_vec_q_*`) reads: the same result bytes
/// (the same sums in the same order), each kernel seen in its profile so the check
/// cannot pass by both taking one path, and the aligned result held to the oracle and
/// the CPU. Row lengths from one super-block to past a 4,096-element staging chunk,
/// padded rows, 1-8 columns, the fused residual add on and off.
#[test]
fn prop_aligned_rows_match_staged() {
    use proptest::sample::select;
    let case = (
        select(vec![QType::Q4_K, QType::Q5_K, QType::IQ4_XS]),
        select(vec![256usize, 512, 1024, 4096, 4352, 11008]),
        1usize..90,
        select(vec![1usize, 2, 3, 4, 5, 8]),
        select(vec![0usize, 32, 2064]),
        0usize..=1,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(q, k, rows, n, offset, pad, add, seed)| QCase {
            pad,
            offset,
            ..QCase::mul_mat(q, k, rows, n, add, seed)
        });
    on_gpu("aligned rows read in place", case, 64, |c, cuda, cpu| {
        let staged_case = QCase {
            offset: c.offset + 2,
            ..c.clone()
        };
        // the decode kernels at every width they take (from 5 columns the lowering gives
        // a product that is not fused with its residual add to the tensor cores)
        cuda.set_quant_path(QuantPath::Dequant);
        let (aligned, aligned_kernels) = profiled(cuda, true, |cuda| run_on(c, cuda));
        let (staged, staged_kernels) = profiled(cuda, true, |cuda| run_on(&staged_case, cuda));
        cuda.set_quant_path(QuantPath::Auto);
        let (aligned, staged) = (aligned?.1, staged?.1);
        let nc = c.n.next_power_of_two(); // the kernel of the fewest of 1, 2, 4, 8 columns
        let q = c.q.to_string().to_lowercase();
        for (kernels, want) in [
            (&aligned_kernels, format!("mul_mat_vec_qd_c{nc}_{q}")),
            (&staged_kernels, format!("mul_mat_vec_q_c{nc}_{q}")),
        ] {
            if !kernels.iter().any(|k| k.contains(&want)) {
                return Err(format!("{c:?}: no {want} in {kernels:?}"));
            }
        }
        if let Some(d) = first_diff(&aligned, &staged, 4) {
            return Err(format!("{c:?}: aligned and staged results differ: {d}"));
        }
        check_mul_mat(c, cuda, cpu, true)
    });
}

/// IQ3_XXS and IQ3_S decode products, whose kernels look their points up in the copy of
/// the lattice table each block makes in shared memory first: the staged kernel seen in
/// the profile, results held to the oracle and the CPU. 1-4 columns, rows over several
/// blocks of 4 rows with a partial last one (the warps past the last row take part in the
/// copy, then return), rows across the 4,096-element staging chunk, padded rows.
#[test]
fn prop_staged_lattice_tables_decode() {
    use proptest::sample::select;
    let case = (
        select(vec![QType::IQ3_XXS, QType::IQ3_S]),
        select(vec![256usize, 512, 4096, 4352]),
        1usize..=45,
        1usize..=4,
        0usize..=1,
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(q, k, rows, n, pad, add, seed)| QCase {
            pad,
            ..QCase::mul_mat(q, k, rows, n, add, seed)
        });
    on_gpu("staged lattice tables", case, 48, |c, cuda, cpu| {
        let (out, kernels) = profiled(cuda, true, |cuda| run_on(c, cuda));
        out?;
        let nc = c.n.next_power_of_two();
        let want = format!("mul_mat_vec_q_c{nc}_{}", c.q.to_string().to_lowercase());
        if !kernels.iter().any(|k| k.contains(&want)) {
            return Err(format!("{c:?}: no {want} in {kernels:?}"));
        }
        check_mul_mat(c, cuda, cpu, true)
    });
}

/// Runs `f` on `cuda` on the decode path `mmvq` (the Q8_1 one when true) with the
/// profiler on, then puts both back: what `f` returned and the kernels of every step.
fn profiled<T>(
    cuda: &mut CudaBackend,
    mmvq: bool,
    f: impl FnOnce(&mut CudaBackend) -> T,
) -> (T, Vec<String>) {
    cuda.set_mmvq(Some(mmvq));
    cuda.set_profiling(true);
    let out = f(cuda);
    let profile = cuda.take_profile();
    cuda.set_profiling(false);
    cuda.set_mmvq(None);
    (out, profile.into_iter().map(|s| s.kernels).collect())
}

/// Q4_K weights quantized by the plan itself (a cast into the arena, 16-byte aligned)
/// and then multiplied: the in-place product must wait for the cast before it loads
/// them (nothing may be read early from weights the plan writes), giving what the CPU
/// gives.
#[test]
fn k_quant_weights_written_by_the_plan_are_read_after_the_wait() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    let mut cpu = CpuBackend::new();
    let (k, rows) = (4096, 300);
    let w = qs::values(11, k * rows);
    let x = qs::values(12, k);
    let run = |be: &mut dyn Backend| -> graft::Result<Vec<f32>> {
        let mut g = Graph::new();
        let wf = g.input("wf", DType::F32, &[k, rows])?;
        let xt = g.input("x", DType::F32, &[k, 1])?;
        let wq = g.cast(wf, DType::Quant(QType::Q4_K))?;
        let y = g.mul_mat(wq, xt)?;
        let plan = g.plan(&[y])?;
        let exec = be.load(&plan)?;
        let mut out = vec![0u8; rows * 4];
        for _ in 0..2 {
            be.set_input(exec, wf, &qs::f32_bytes(&w))?;
            be.set_input(exec, xt, &qs::f32_bytes(&x))?;
            be.compute(exec)?;
        }
        be.get_output(exec, y, &mut out)?;
        be.unload(exec)?;
        Ok(out
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect())
    };
    let want = run(&mut cpu).unwrap();
    let (got, kernels) = profiled(&mut cuda, true, |cuda| run(cuda));
    let got = got.unwrap();
    assert!(
        kernels.iter().any(|k| k.contains("mul_mat_vec_qd_c1_q4_k")),
        "{kernels:?}"
    );
    let e = qs::nmse(&got, &want);
    assert!(e <= NMSE_MMVQ, "NMSE vs cpu {e:e}");
}

/// A frozen weight of more than the 64 MiB of rows the backend splits at a time
/// (Q4_0 [4096, 29300], 67.5 MB): split in two pieces, the same product bytes.
#[test]
fn frozen_weight_past_one_chunk() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut cuda) = common::cuda_backend() else {
        return;
    };
    let c = QCase::mul_mat(QType::Q4_0, 4096, 29_300, 1, false, 3);
    check_frozen(&c, true, &mut cuda).unwrap();
}

fn check_frozen(c: &QCase, mmvq: bool, cuda: &mut CudaBackend) -> Result<(), String> {
    // rows of whole 16-byte multiples (Q4_0, Q5_0, Q8_0: 256 elements; Q4_1: 128; Q5_1:
    // 64; Q5_K: any) at a 16-byte aligned start; Q6_K rows of 8 super-blocks or more at an
    // even one; never Q4_K (buffers start 256-byte aligned)
    let split = graft::quant::split::splittable_at(c.q, c.stride_elems(), c.offset as u64);
    cuda.set_mmvq(Some(mmvq));
    let plain = run_on(c, cuda);
    let (frozen, kernels) = profiled(cuda, mmvq, |cuda| qs::run_frozen(c, cuda));
    let what = format!("{c:?} (mmvq {mmvq})");
    if split && c.pad > 0 {
        return match frozen {
            Err(e) if e.to_string().contains("frozen weight w") => Ok(()),
            Err(e) => Err(format!(
                "{what}: the error does not name the frozen weight: {e}"
            )),
            Ok(_) => Err(format!("{what}: a view of part of each frozen row loaded")),
        };
    }
    let (_, want) = plain?;
    let (_, got) = frozen.map_err(|e| format!("{what}: frozen: {e}"))?;
    if let Some(d) = first_diff(&got, &want, 4) {
        return Err(format!("{what}: frozen and unfrozen results differ: {d}"));
    }
    let ran_split = kernels.iter().any(|s| {
        [
            "mul_mat_vec_qs_",
            "mul_mat_vec_qsp_",
            "mul_mat_vec_dqs_",
            "mmq_split_",
            "mmh_split_",
            "mmr_split_",
            "cpy_split_",
        ]
        .iter()
        .any(|k| s.contains(k))
    });
    if ran_split != split {
        return Err(format!(
            "{what}: split kernels ran: {ran_split}, expected {split}: {kernels:?}"
        ));
    }
    Ok(())
}

/// Freezing splits only the tensor's bytes, reading back gives ggml's bytes (any range,
/// partial rows included), and a write, a fill, a second tensor over the region and a plan
/// that reads the frozen weight other than as mul_mat weights are errors naming it.
#[test]
fn frozen_weights_read_back_and_refuse_writes() {
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    let Some(mut be) = common::cuda_backend() else {
        return;
    };
    // Q6_K rows of 2,304 elements (1,890 bytes) from an offset 6 past a 16-byte
    // boundary: each row rotated by its own address
    for (q, k, offset) in [
        (QType::Q4_0, 512, 256),
        (QType::Q8_0, 512, 256),
        (QType::Q5_K, 512, 256),
        (QType::Q6_K, 2304, 262),
    ] {
        frozen_read_back_and_writes(&mut be, q, k, offset);
    }
}

/// One type's case of `frozen_weights_read_back_and_refuse_writes`.
fn frozen_read_back_and_writes(be: &mut CudaBackend, q: QType, k: usize, offset: usize) {
    use graft::backend::FrozenTensor;
    let rows = 37usize;
    let c = QCase {
        offset,
        ..QCase::mul_mat(q, k, rows, 1, false, 11)
    };
    // Half a row in (an even byte): whole rows of its own, but not rows of the region.
    let other = FrozenTensor {
        name: "v".into(),
        offset: offset + qs::weight_bytes(&c).len() / rows / 4 * 2,
        rows: 2,
        ..qs::frozen(&c)
    };
    qs::check_frozen_rules(be, &c, other, true);
}

/// The `tiny` preset in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q5_K (rows of 256 and 768 elements:
/// every matrix but the embedding table is split when the model freezes its weights) gives the same
/// log-probabilities on the engine, bit for bit, with split rows as without, over a prompt (the F16
/// copy for cuBLAS) and decode steps (the split decode product); the profile shows which kernels
/// ran. The same for a wider model (rows of 2,048 and 2,304 elements) in Q6_K and Q4_K_M,
/// whose Q6_K matrices are split.
#[test]
fn frozen_tiny_model_matches_unfrozen() {
    use graft::models::QuantPlan;
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    if common::cuda_backend().is_none() {
        return;
    }
    let tiny = graft::models::arch::presets::preset("tiny").unwrap();
    for (plan, kernel) in [
        (QuantPlan::Q4_0, "mul_mat_vec_qsp_c1_q4_0"),
        (QuantPlan::Q4_1, "mul_mat_vec_qsp_c1_q4_1"),
        (QuantPlan::Q5_0, "mul_mat_vec_qsp_c1_q5_0"),
        (QuantPlan::Q5_1, "mul_mat_vec_qsp_c1_q5_1"),
        (QuantPlan::Q8_0, "mul_mat_vec_qsp_c1_q8_0"),
        (QuantPlan::Q5_K, "mul_mat_vec_qsp_c1_q5_k"),
    ] {
        tiny_model_split_and_not(&tiny, plan, kernel);
    }
    // Rows of 2,048 and 2,304 elements (1,890 bytes: rotated Q6_K rows), an output head of
    // its own: Q6_K split, and Q4_K_M (Q6_K for v, half of down and the head, in split
    // rows, next to Q4_K read in place).
    let wide = graft::models::Config {
        hidden_size: 2048,
        intermediate_size: 2304,
        num_hidden_layers: 2,
        num_attention_heads: 16,
        num_key_value_heads: 4,
        head_dim: 128,
        tie_word_embeddings: false,
        ..tiny
    };
    for plan in [QuantPlan::Q6_K, QuantPlan::Q4_K_M] {
        tiny_model_split_and_not(&wide, plan, "mul_mat_vec_qsp_c1_q6_k");
    }
}

/// The engine over the seeded random model `cfg` in `plan` on a fresh GPU backend with
/// split rows on or off (context 32).
fn random_engine(
    cfg: &graft::models::Config,
    plan: graft::models::QuantPlan,
    split: bool,
) -> graft::engine::Engine {
    use graft::engine::{Engine, EngineConfig};
    let mut be = common::cuda_backend().expect("the GPU found before");
    be.set_split(split);
    Engine::random(cfg.clone(), plan, 5, Box::new(be), EngineConfig::new(32)).unwrap()
}

/// The log-probabilities of the model `cfg` in `plan` on the engine after a prompt and over
/// 6 decode steps (each read back), and the kernels of the first decode step, with and
/// without split rows; `kernel` must run with.
fn tiny_model_split_and_not(
    cfg: &graft::models::Config,
    plan: graft::models::QuantPlan,
    kernel: &str,
) {
    use graft::engine::{Event, Request};
    let prompt: Vec<u32> = (0..9).map(|i| (i * 311 + 5) % 4096).collect();
    let run = |split: bool| {
        let mut e = random_engine(cfg, plan, split);
        let mut req = Request::greedy(prompt.clone(), 7);
        req.logprobs = Some(cfg.vocab_size);
        req.stop.ignore_eos = true;
        e.add(req).unwrap();
        let (mut rows, mut kernels, mut step) = (Vec::new(), String::new(), 0);
        while e.has_work() {
            // the second step is the first decode step
            e.backend().set_profiling(step == 1);
            for ev in e.step().unwrap() {
                if let Event::Token { logprobs, .. } = ev {
                    rows.extend(logprobs.unwrap().top);
                }
            }
            if step == 1 {
                kernels = profiled_kernels(&mut e);
            }
            step += 1;
        }
        e.release().unwrap();
        (rows, kernels)
    };
    let (plain, k_plain) = run(false);
    let (split, k_split) = run(true);
    assert!(
        k_split.contains(kernel),
        "{plan} split decode kernels: {k_split}"
    );
    assert!(
        !k_plain.contains("mul_mat_vec_qs"),
        "{plan} unsplit decode kernels: {k_plain}"
    );
    assert_eq!(plain.len(), 7 * cfg.vocab_size);
    let diff = plain
        .iter()
        .zip(&split)
        .position(|(a, b)| a.0 != b.0 || a.1.to_bits() != b.1.to_bits());
    assert!(
        diff.is_none(),
        "{plan}: log-probability {diff:?} differs with split rows"
    );
}

/// The `tiny` preset (rows of 256 and 768 elements, 4 layers) in the mixes of the low-bit
/// K-quants and IQ4, random weights the CUDA backend quantizes on the host (it has no
/// quantizing copy to these types) from the F32 values it drew: the same bytes as the
/// CPU's model of the same seed, so the engine's log-probability rows (centered on their
/// means) over a 300-token prefill (the dequantizing copy for cuBLAS) and 6 decode steps
/// (the `__dp4a` products of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS) stay within
/// 1e-3 NMSE of the CPU's, as the other quantized models (`quantized_decode_matches_the_cpu`
/// in tests/models); a wrong block gives order 1.
#[test]
fn low_bit_mixes_match_the_cpu() {
    use graft::models::{CacheTypes, QuantPlan};
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    if common::cuda_backend().is_none() {
        return;
    }
    let tiny = graft::models::arch::presets::preset("tiny").unwrap();
    let centered = |rows: Vec<f32>| -> Vec<f64> {
        rows.chunks(tiny.vocab_size)
            .flat_map(|r| {
                let mean = r.iter().map(|&x| x as f64).sum::<f64>() / r.len() as f64;
                r.iter().map(move |&x| x as f64 - mean)
            })
            .collect()
    };
    for plan in [
        QuantPlan::Q2_K,
        QuantPlan::Q3_K_M,
        QuantPlan::IQ4_NL,
        QuantPlan::IQ4_XS,
    ] {
        let cuda = common::cuda_backend().expect("the GPU found before");
        let (got, _) = model_rows(Box::new(cuda), &tiny, plan, CacheTypes::default());
        let (want, _) = model_rows(
            Box::new(CpuBackend::new()),
            &tiny,
            plan,
            CacheTypes::default(),
        );
        let e = common::nmse(&centered(got), &centered(want));
        println!("tiny {plan}: NMSE against the CPU {e:.2e}");
        assert!(e <= 1e-3, "tiny {plan}: NMSE {e:e} against the CPU");
    }
}

/// Models whose K/V caches are Q8_0 or Q4_0 (head dims 64, 128, 256: the rows the streamed
/// decode kernels copy 4 and 8 bytes at a time; MHA, and GQA with 2, 3, 4 and 8 query heads
/// a KV head), on the engine against the same seeded model on the CPU: the decode steps must
/// run `fattn_paged_vec_d<D>_<type>` (MHA, and head dim 64) or `fattn_paged_vec4_d<D>_<type>`
/// (GQA; 3 heads: one block short of 4, 8: two blocks a KV head) in several chunks (a
/// 300-token prompt) and their log-probabilities stay within 2e-5 NMSE of the CPU's (the
/// one-sequence decode measured on an H200: 1.4e-7 to 2.7e-7 with Q8_0 caches, 4.3e-6 to
/// 1.0e-5 with Q4_0). Both backends quantize the same K/V rows into the pool, so what differs
/// is the order of the sums; a wrong block offset, scale, nibble order, KV head or query
/// head gives errors of order 1.
#[test]
fn quantized_caches_stream_in_model_decode() {
    use graft::models::{arch::presets, CacheTypes, Config as ModelConfig, QuantPlan};
    let _serial = crate::GPU.lock().unwrap_or_else(|e| e.into_inner());
    if common::cuda_backend().is_none() {
        return;
    }
    let tiny = presets::preset("tiny").unwrap();
    // head dim, query heads, query heads a KV head, cache type
    for (d, heads, group, ty) in [
        (64, 4, 1, QType::Q8_0),
        (128, 2, 1, QType::Q4_0),
        (256, 1, 1, QType::Q8_0),
        (64, 4, 1, QType::Q4_0),
        (64, 4, 4, QType::Q8_0),
        (128, 2, 2, QType::Q4_0),
        (128, 8, 4, QType::Q8_0),
        (256, 4, 4, QType::Q4_0),
        (128, 6, 3, QType::Q4_0),
        (128, 16, 8, QType::Q8_0),
    ] {
        let cfg = ModelConfig {
            num_attention_heads: heads,
            num_key_value_heads: heads / group,
            head_dim: d,
            ..tiny.clone()
        };
        let cache = CacheTypes {
            k: DType::Quant(ty),
            v: DType::Quant(ty),
            flash_attn: true,
        };
        let cuda = common::cuda_backend().expect("the GPU found before");
        let (got, kernels) = model_rows(Box::new(cuda), &cfg, QuantPlan::F32, cache);
        let (want, _) = model_rows(Box::new(CpuBackend::new()), &cfg, QuantPlan::F32, cache);
        let kernel = match group == 1 || d == 64 {
            true => format!("fattn_paged_vec_d{d}_{ty}"),
            false => format!("fattn_paged_vec4_d{d}_{ty}"),
        };
        assert!(
            kernels.contains(&kernel) && kernels.contains("fattn_paged_combine"),
            "head dim {d}, group {group}, {ty} cache: the last decode step ran {kernels}"
        );
        let e = common::nmse(&got, &want);
        println!("head dim {d}, group {group}, {ty} cache: NMSE against the CPU {e:.2e}");
        assert!(
            e <= 2e-5,
            "head dim {d}, group {group}, {ty}: NMSE {e:e} against the CPU"
        );
    }
}

/// The log-probabilities on the engine, over a seeded random model `cfg` in `plan` with
/// caches `cache`, of the last token of a 300-token prompt and of 6 fixed tokens after it,
/// each a decode step over the cached prefix; and the kernels of the last step (profiled).
fn model_rows(
    be: Box<dyn Backend>,
    cfg: &graft::models::Config,
    plan: graft::models::QuantPlan,
    cache: graft::models::CacheTypes,
) -> (Vec<f32>, String) {
    use graft::engine::{Engine, EngineConfig, Event, Request};
    let vocab = cfg.vocab_size as u32;
    let mut seq: Vec<u32> = (0..300).map(|i| (i * 311 + 5) % vocab).collect();
    seq.extend([7, 901, 13, 4000, 250, 64]);
    let ecfg = EngineConfig {
        cache,
        ..EngineConfig::new(320)
    };
    let mut e = Engine::random(cfg.clone(), plan, 5, be, ecfg).unwrap();
    let mut rows = Vec::new();
    for end in 300..=seq.len() {
        let last = end == seq.len();
        let mut req = Request::greedy(seq[..end].to_vec(), 1);
        req.logprobs = Some(cfg.vocab_size);
        req.stop.ignore_eos = true;
        e.add(req).unwrap();
        e.backend().set_profiling(last);
        while e.has_work() {
            for ev in e.step().unwrap() {
                if let Event::Token { logprobs, .. } = ev {
                    let mut row = vec![0f32; cfg.vocab_size];
                    for (t, lp) in logprobs.unwrap().top {
                        row[t as usize] = lp;
                    }
                    rows.extend(row);
                }
            }
        }
    }
    let kernels = profiled_kernels(&mut e);
    e.release().unwrap();
    (rows, kernels)
}

/// The kernels of the runs profiled on `e`'s backend since profiling was turned on, and
/// profiling off.
fn profiled_kernels(e: &mut graft::engine::Engine) -> String {
    let names: Vec<String> = e
        .backend()
        .take_profile()
        .into_iter()
        .map(|s| s.kernels)
        .collect();
    e.backend().set_profiling(false);
    names.join(" ")
}
