//! Cases of the ops on block-quantized tensors for the device tests: quantizing casts,
//! dequantizing casts, get_rows from a quantized table, and mul_mat with quantized
//! weights (decode widths 1..=8, optionally with a fused residual add, batched widths
//! 9..=300, and prefill widths with broadcast batches). Weight rows may be strided (a view
//! with padding blocks after each row), and so may activation rows (padding elements that
//! hold NaN, so that a kernel reading them fails the case); values mix gaussian-like
//! numbers, outliers, zero blocks and all-equal blocks.
//!
//! [`run`] builds a case on any backend, with the plan's arena poisoned around every
//! tensor, and returns the result bytes; [`oracle`] is the f64 result from the weights
//! dequantized on the host (`graft::quant`).

use graft::backend::{Backend, FrozenTensor};
use graft::graph::{BufferId, BufferRef, DType, Graph, PlanOptions, TensorId};
use graft::quant::{self, QType};

use crate::common::quant_blocks;
use graft::Result;
use proptest::prelude::*;

/// The weight types: every block type but Q8_1, the activation format.
pub fn weight_types() -> Vec<QType> {
    QType::ALL
        .into_iter()
        .filter(|&q| q != QType::Q8_1)
        .collect()
}

/// The weight types graft quantizes to on the CPU (the cases that write a block type).
pub fn quantizable_types() -> Vec<QType> {
    weight_types()
        .into_iter()
        .filter(|q| q.can_quantize())
        .collect()
}

/// The legacy types and Q4_K, Q5_K, Q6_K: the types the CUDA backend quantizes to
/// (`cpy_f32_<q>`, `set_rows_f32_<q>` in cuda/quantize.cu) and has batched products on
/// the int8 tensor cores for (`mmq_*`, cuda/mmq.cu). The low-bit K-quants, IQ4 and the
/// ternary types are quantized on the host (`graft convert`, `--quantize`), and their
/// batched products take the F16 copy for cuBLAS.
pub fn core_types() -> Vec<QType> {
    quantizable_types()
        .into_iter()
        .filter(|q| {
            matches!(
                q,
                QType::Q4_0
                    | QType::Q4_1
                    | QType::Q5_0
                    | QType::Q5_1
                    | QType::Q8_0
                    | QType::Q4_K
                    | QType::Q5_K
                    | QType::Q6_K
            )
        })
        .collect()
}

/// The op of a case.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum QOp {
    /// `cast(x, q)` of F32 rows.
    Quantize,
    /// `cast(w, F32 | F16)` of quantized rows.
    Dequantize(DType),
    /// `get_rows(w, ids)` into F32.
    GetRows,
    /// `set_rows(w, x, ids)` of `n` F32 rows into the quantized table, a state (the
    /// write of a quantized KV cache), with distinct ids.
    SetRows,
    /// `mul_mat(w, x)`, then `add(r, that)` when `add`.
    MulMat { add: bool },
}

/// One case: a quantized (or to-be-quantized) matrix stack `[k, rows, a2, a3]` whose rows
/// are `pad` blocks longer in memory than they are in the view, and for get_rows /
/// mul_mat the other operand's width `n` and batches `b2 = a2 * r2`, `b3 = a3 * r3`
/// (mul_mat: rows of `k + x_pad` elements, viewed as `k`).
#[derive(Clone, Debug)]
pub struct QCase {
    pub op: QOp,
    pub q: QType,
    pub k: usize,
    pub rows: usize,
    pub pad: usize,
    /// Bytes before the weight stack in its buffer (even: blocks are 2-byte aligned).
    pub offset: usize,
    pub n: usize,
    pub a_batch: [usize; 2],
    pub repeat: [usize; 2],
    /// Elements after each activation row of a mul_mat (NaN; the view leaves them out).
    pub x_pad: usize,
    pub seed: u64,
}

impl QCase {
    /// A mul_mat case over one dense `[k, rows]` weight of `q` at the start of its buffer
    /// (no padding, batches or broadcast) by `n` columns, with the residual add when `add`.
    pub fn mul_mat(q: QType, k: usize, rows: usize, n: usize, add: bool, seed: u64) -> QCase {
        QCase {
            op: QOp::MulMat { add },
            q,
            k,
            rows,
            pad: 0,
            offset: 0,
            n,
            a_batch: [1, 1],
            repeat: [1, 1],
            x_pad: 0,
            seed,
        }
    }

    /// Elements of a row in memory (the view's `k` plus the padding blocks).
    pub fn stride_elems(&self) -> usize {
        self.k + self.pad * self.q.block_size()
    }

    /// Batches of the second operand / the result.
    pub fn b_batch(&self) -> [usize; 2] {
        [
            self.a_batch[0] * self.repeat[0],
            self.a_batch[1] * self.repeat[1],
        ]
    }

    /// Rows of the whole weight stack.
    pub fn weight_rows(&self) -> usize {
        self.rows * self.a_batch[0] * self.a_batch[1]
    }

    /// Columns of a mul_mat's activations, batches included (one after the other, as in
    /// the result).
    pub fn cols(&self) -> usize {
        let [b2, b3] = self.b_batch();
        self.n * b2 * b3
    }
}

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// `len` values in blocks of 32: mostly gaussian-like, some blocks zero or all equal,
/// rare outliers 30 times larger.
pub fn values(seed: u64, len: usize) -> Vec<f32> {
    values_with(seed, len, 30.0)
}

/// [`values`] with outliers `outlier` times larger.
pub fn values_with(seed: u64, len: usize, outlier: f32) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let kind = r.below(16);
        let c = (r.unit() - 0.5) * 4.0;
        for _ in 0..32.min(len - v.len()) {
            let x = match kind {
                0 => 0.0,
                1 => c,
                _ => {
                    let g = (0..4).map(|_| r.unit()).sum::<f32>() - 2.0;
                    if r.below(64) == 0 {
                        g * outlier
                    } else {
                        g
                    }
                }
            };
            v.push(x);
        }
    }
    v
}

/// The weight stack quantized row by row (padded rows, as stored; random valid blocks
/// for the types graft only reads, see [`crate::common::quant_blocks`]).
pub fn weight_bytes(c: &QCase) -> Vec<u8> {
    let se = c.stride_elems();
    let x = values(c.seed, se * c.weight_rows());
    let rb = c.q.row_bytes(se).expect("whole blocks");
    let mut out = Vec::with_capacity(rb * c.weight_rows());
    for (r, src) in x.chunks_exact(se).enumerate() {
        out.extend(quant_blocks::weight_row(c.q, src, c.seed ^ r as u64));
    }
    out
}

/// The weight stack of case `c` as [`Backend::freeze_weights`] takes it.
pub fn frozen(c: &QCase) -> FrozenTensor {
    FrozenTensor {
        name: "w".into(),
        offset: c.offset,
        dtype: DType::Quant(c.q),
        row_len: c.stride_elems(),
        rows: c.weight_rows(),
    }
}

/// The dequantized weight stack as the view sees it: `[k, rows, a2, a3]` dense.
pub fn weights_dequantized(c: &QCase) -> Vec<f32> {
    let se = c.stride_elems();
    let rb = c.q.row_bytes(se).expect("whole blocks");
    let bytes = weight_bytes(c);
    let mut out = Vec::with_capacity(c.k * c.weight_rows());
    let mut row = vec![0.0f32; se];
    for chunk in bytes.chunks_exact(rb) {
        quant::dequantize_row(c.q, chunk, &mut row).expect("sizes agree");
        out.extend_from_slice(&row[..c.k]);
    }
    out
}

/// The F32 input of a Quantize case (`[stride_elems, rows]`, viewed as `[k, rows]`); in
/// a quarter of the cases one element is a NaN or an infinity, whose block every backend
/// writes as zeros with a NaN scale.
pub fn quantize_input(c: &QCase) -> Vec<f32> {
    let se = c.stride_elems();
    let mut x = values(c.seed, se * c.rows);
    if c.seed.is_multiple_of(4) {
        let bad = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(c.seed / 4 % 3) as usize];
        let (i, row) = ((c.seed / 16) as usize % c.k, (c.seed / 7) as usize % c.rows);
        x[row * se + i] = bad;
    }
    x
}

/// The activations `[k, n, b2, b3]` of a MulMat case (outliers 8 times larger: one 30
/// times larger would cost the other 31 values of its Q8_1 block most of their bits).
pub fn activations(c: &QCase) -> Vec<f32> {
    values_with(c.seed.wrapping_add(1), c.k * c.cols(), 8.0)
}

/// The activations as the case's input holds them: rows of `k + x_pad` elements, the
/// padding NaN.
pub fn activation_input(c: &QCase) -> Vec<f32> {
    let x = activations(c);
    let mut out = Vec::with_capacity((c.k + c.x_pad) * c.cols());
    for row in x.chunks_exact(c.k) {
        out.extend_from_slice(row);
        out.extend(std::iter::repeat_n(f32::NAN, c.x_pad));
    }
    out
}

/// The exact result of the Q8_1 paths (the decode `__dp4a` kernels, the int8 tensor-core
/// product) of a MulMat case over one weight matrix: each column quantized to Q8_1 on the
/// host, each weight row dotted with it by `graft::quant::vec_dot_q8_1` (the CPU oracle of
/// those kernels).
pub fn oracle_q8_1(c: &QCase) -> Vec<f64> {
    let mut out = q8_1_products(c, &activations(c));
    if matches!(c.op, QOp::MulMat { add: true }) {
        for (v, r) in out.iter_mut().zip(residual(c)) {
            *v += f64::from(r);
        }
    }
    out
}

/// `vec_dot_q8_1` of every weight row of case `c` (one matrix) with each column of `x`
/// (`[k, cols]` dense, [`QCase::cols`]) quantized to Q8_1 on the host: `[rows, cols]`,
/// column after column.
pub fn q8_1_products(c: &QCase, x: &[f32]) -> Vec<f64> {
    let se = c.stride_elems();
    let rb = c.q.row_bytes(se).expect("whole blocks");
    let used = c.q.row_bytes(c.k).expect("whole blocks");
    let w = weight_bytes(c);
    let mut out = Vec::with_capacity(c.rows * c.cols());
    for col in x.chunks_exact(c.k).take(c.cols()) {
        let mut a = vec![0u8; QType::Q8_1.row_bytes(c.k).expect("whole blocks")];
        quant::quantize_row(QType::Q8_1, col, &mut a).expect("sizes");
        for i in 0..c.rows {
            out.push(f64::from(quant::vec_dot_q8_1(
                c.q,
                &w[i * rb..i * rb + used],
                &a,
            )));
        }
    }
    out
}

/// How far the Q8_1 decode path may be from [`q8_1_products`] (`want`, plus the residual
/// of an `add` case) when only the order of the f32 sums differs: both sides add the same
/// per-block terms, so each element may move by a few roundings of the terms' total
/// magnitude, bounded here by `sum_b max|w|_b * sum_(i in b) |x_i|` over the blocks `b`
/// of the weight row (which covers the scale-times-minimum terms of the types with an
/// offset) plus the residual. The bound, `4 (blocks + 4) 2^-24` of that, is a worst case
/// of recursive summation; a block dropped, doubled or scaled wrongly moves the result by
/// about one block's share of the total, hundreds of times more at these row lengths.
/// A near-zero result (terms that cancel) stays checkable where a normalized error is not.
/// Returns the first element outside the bound.
pub fn check_sum_order(c: &QCase, x: &[f32], got: &[f32], want: &[f64]) -> Result<(), String> {
    let w = weights_dequantized(c);
    let qk = c.q.block_size();
    let nblocks = c.k / qk;
    let tol = 4.0 * (nblocks + 4) as f64 * f64::from(2.0f32.powi(-24));
    let res = matches!(c.op, QOp::MulMat { add: true }).then(|| residual(c));
    for (col, xc) in x.chunks_exact(c.k).take(c.cols()).enumerate() {
        for r in 0..c.rows {
            let wr = &w[r * c.k..(r + 1) * c.k];
            let mut mag: f64 = wr
                .chunks_exact(qk)
                .zip(xc.chunks_exact(qk))
                .map(|(wb, xb)| {
                    let wmax = wb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    f64::from(wmax) * xb.iter().map(|v| f64::from(v.abs())).sum::<f64>()
                })
                .sum();
            let at = col * c.rows + r;
            if let Some(res) = &res {
                mag += f64::from(res[at].abs());
            }
            let diff = (f64::from(got[at]) - want[at]).abs();
            if diff > tol * mag {
                return Err(format!(
                    "row {r} column {col}: {} against {} (difference {diff:e}, bound {:e})",
                    got[at],
                    want[at],
                    tol * mag
                ));
            }
        }
    }
    Ok(())
}

/// The residual `[rows, n]` of a MulMat case with `add`.
pub fn residual(c: &QCase) -> Vec<f32> {
    values(c.seed.wrapping_add(2), c.rows * c.n)
}

/// The ids of a GetRows case; of a SetRows case, distinct (the first `n` of a shuffle).
pub fn ids(c: &QCase) -> Vec<i32> {
    let mut r = Rng::new(c.seed.wrapping_add(3));
    if c.op == QOp::SetRows {
        let mut all: Vec<i32> = (0..c.rows as i32).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, r.below(i + 1));
        }
        all.truncate(c.n);
        return all;
    }
    (0..c.n).map(|_| r.below(c.rows) as i32).collect()
}

/// The F32 rows `[k, n]` a SetRows case writes.
pub fn set_rows_input(c: &QCase) -> Vec<f32> {
    values_with(c.seed.wrapping_add(4), c.k * c.n, 8.0)
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The weight stack as a strided view of a padded weight leaf in `buf` (a state leaf for
/// SetRows, which writes it).
pub fn weight_view(g: &mut Graph, c: &QCase, buf: BufferId) -> Result<TensorId> {
    let se = c.stride_elems();
    let [a2, a3] = c.a_batch;
    let dt = DType::Quant(c.q);
    let r = BufferRef {
        buffer: buf,
        offset: c.offset,
    };
    let shape = [se, c.rows, a2, a3];
    let leaf = if c.op == QOp::SetRows {
        g.state("w", dt, &shape, r)?
    } else {
        g.weight("w", dt, &shape, r)?
    };
    if c.pad == 0 {
        return Ok(leaf);
    }
    let nb1 = dt.row_bytes(se);
    g.view_4d(
        leaf,
        [c.k, c.rows, a2, a3],
        nb1,
        nb1 * c.rows,
        nb1 * c.rows * a2,
        0,
    )
}

/// Builds the case on `be`, runs it, and returns the result's dtype and bytes.
pub fn run(c: &QCase, be: &mut dyn Backend) -> Result<(DType, Vec<u8>)> {
    run_with(c, be, false)
}

/// [`run`] with the weights declared frozen ([`Backend::freeze_weights`]) once written:
/// the whole stack, `stride_elems` elements a row, named `w`.
pub fn run_frozen(c: &QCase, be: &mut dyn Backend) -> Result<(DType, Vec<u8>)> {
    run_with(c, be, true)
}

fn run_with(c: &QCase, be: &mut dyn Backend, freeze: bool) -> Result<(DType, Vec<u8>)> {
    let mut buffers = Vec::new();
    let result = run_inner(c, be, &mut buffers, freeze);
    for b in buffers {
        be.free_buffer(b)?;
    }
    result
}

fn run_inner(
    c: &QCase,
    be: &mut dyn Backend,
    buffers: &mut Vec<BufferId>,
    freeze: bool,
) -> Result<(DType, Vec<u8>)> {
    let mut g = Graph::new();
    let mut inputs: Vec<(TensorId, Vec<u8>)> = Vec::new();
    let out = match c.op {
        QOp::Quantize => {
            let se = c.stride_elems();
            let x = g.input("x", DType::F32, &[se, c.rows])?;
            inputs.push((x, f32_bytes(&quantize_input(c))));
            let v = g.view_2d(x, c.k, c.rows, se * 4, 0)?;
            g.cast(v, DType::Quant(c.q))?
        }
        QOp::Dequantize(_) | QOp::GetRows | QOp::SetRows | QOp::MulMat { .. } => {
            let bytes = weight_bytes(c);
            let buf = be.alloc_buffer(c.offset + bytes.len())?;
            buffers.push(buf);
            be.write_buffer(buf, c.offset, &bytes)?;
            if freeze {
                be.freeze_weights(buf, &[frozen(c)])?;
            }
            let w = weight_view(&mut g, c, buf)?;
            match c.op {
                QOp::Dequantize(dt) => g.cast(w, dt)?,
                QOp::GetRows => {
                    let ids_t = g.input("ids", DType::I32, &[c.n])?;
                    let v: Vec<u8> = ids(c).iter().flat_map(|i| i.to_le_bytes()).collect();
                    inputs.push((ids_t, v));
                    g.get_rows(w, ids_t)?
                }
                QOp::SetRows => {
                    let x = g.input("x", DType::F32, &[c.k, c.n])?;
                    inputs.push((x, f32_bytes(&set_rows_input(c))));
                    let ids_t = g.input("ids", DType::I32, &[c.n])?;
                    let v: Vec<u8> = ids(c).iter().flat_map(|i| i.to_le_bytes()).collect();
                    inputs.push((ids_t, v));
                    g.set_rows(w, x, ids_t)?
                }
                QOp::MulMat { add } => {
                    let [b2, b3] = c.b_batch();
                    let ke = c.k + c.x_pad;
                    let xin = g.input("x", DType::F32, &[ke, c.n, b2, b3])?;
                    inputs.push((xin, f32_bytes(&activation_input(c))));
                    let nb1 = 4 * ke;
                    let x =
                        g.view_4d(xin, [c.k, c.n, b2, b3], nb1, nb1 * c.n, nb1 * c.n * b2, 0)?;
                    let y = g.mul_mat(w, x)?;
                    if add {
                        let r = g.input("r", DType::F32, &[c.rows, c.n])?;
                        inputs.push((r, f32_bytes(&residual(c))));
                        // by the seed, the residual as computed in the graph (an exact
                        // copy), which the add then overwrites in place: the device fuses
                        // a product of any width with that add, not with an input's
                        let r = match c.seed % 2 {
                            0 => g.scale(r, 1.0)?,
                            _ => r,
                        };
                        g.add(r, y)?
                    } else {
                        y
                    }
                }
                QOp::Quantize => unreachable!("handled above"),
            }
        }
    };
    let guard_bytes = crate::common::GUARD_BYTES;
    let plan = g.plan_with(&[out], &PlanOptions { guard_bytes })?;
    let io = plan.io(out).expect("the output").operand.clone();
    let exec = be.load(&plan)?;
    let mut bytes = vec![0u8; io.nbytes()];
    let run = (|| {
        // Twice: a backend may capture a graph on the first run and replay it. The arena is
        // poisoned before each run: bytes outside every tensor must keep the poison.
        for _ in 0..2 {
            be.fill_arena(exec, SENTINEL)?;
            for (id, data) in &inputs {
                be.set_input(exec, *id, data)?;
            }
            be.compute(exec)?;
        }
        be.get_output(exec, out, &mut bytes)?;
        be.read_arena(exec)
    })();
    be.unload(exec)?;
    let arena = run?;
    if let Some(v) = arena_violation(&plan, &g, &arena) {
        return Err(graft::Error::plan(format!(
            "{c:?}: sentinel overwritten: {v}"
        )));
    }
    if io.dtype == DType::F32 {
        let poison = [SENTINEL; 4];
        if let Some(i) = bytes.chunks_exact(4).position(|b| b == poison) {
            return Err(graft::Error::plan(format!(
                "{c:?}: result element {i} was never written"
            )));
        }
    }
    Ok((io.dtype, bytes))
}

/// The f64 result of a Dequantize, GetRows, SetRows or MulMat case (dense, row-major).
/// SetRows: the table with rows `ids` replaced by the written rows, quantized and
/// dequantized by the reference (`graft::quant`), the others untouched.
pub fn oracle(c: &QCase) -> Vec<f64> {
    let mut w = weights_dequantized(c);
    match c.op {
        QOp::Quantize => panic!("quantize cases compare bytes"),
        QOp::SetRows => {
            let x = set_rows_input(c);
            let mut bytes = vec![0u8; c.q.row_bytes(c.k).expect("whole blocks")];
            for (j, &i) in ids(c).iter().enumerate() {
                let i = i as usize;
                quant::quantize_row(c.q, &x[j * c.k..(j + 1) * c.k], &mut bytes)
                    .expect("sizes agree");
                quant::dequantize_row(c.q, &bytes, &mut w[i * c.k..(i + 1) * c.k])
                    .expect("sizes agree");
            }
            w.iter().map(|&v| f64::from(v)).collect()
        }
        QOp::Dequantize(_) => w.iter().map(|&v| f64::from(v)).collect(),
        QOp::GetRows => ids(c)
            .iter()
            .flat_map(|&i| {
                let i = i as usize;
                w[i * c.k..(i + 1) * c.k].iter().map(|&v| f64::from(v))
            })
            .collect(),
        QOp::MulMat { add } => {
            let x = activations(c);
            let [b2, b3] = c.b_batch();
            let [r2, r3] = c.repeat;
            let (k, m, n) = (c.k, c.rows, c.n);
            let mut out = Vec::with_capacity(m * n * b2 * b3);
            for i3 in 0..b3 {
                for i2 in 0..b2 {
                    let a_mat = (i3 / r3) * c.a_batch[0] + i2 / r2;
                    let wm = &w[a_mat * k * m..(a_mat + 1) * k * m];
                    let xm = &x[(i3 * b2 + i2) * k * n..(i3 * b2 + i2 + 1) * k * n];
                    for j in 0..n {
                        for i in 0..m {
                            let s: f64 = (0..k)
                                .map(|l| f64::from(wm[i * k + l]) * f64::from(xm[j * k + l]))
                                .sum();
                            out.push(s);
                        }
                    }
                }
            }
            if add {
                for (o, r) in out.iter_mut().zip(residual(c)) {
                    *o += f64::from(r);
                }
            }
            out
        }
    }
}

/// The values of result bytes of dtype `dt` (F32 or F16).
pub fn decode(dt: DType, bytes: &[u8]) -> Vec<f64> {
    match dt {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        other => panic!("no values of {other} results"),
    }
}

/// The values of result bytes of dtype `dt`: F32 or F16 ([`decode`]), or rows of `k`
/// elements of a block type (a SetRows result), dequantized by the reference.
pub fn decode_rows(dt: DType, k: usize, bytes: &[u8]) -> Vec<f64> {
    let DType::Quant(q) = dt else {
        return decode(dt, bytes);
    };
    let rb = q.row_bytes(k).expect("whole blocks");
    let mut row = vec![0f32; k];
    let mut out = Vec::with_capacity(bytes.len() / rb * k);
    for b in bytes.chunks_exact(rb) {
        quant::dequantize_row(q, b, &mut row).expect("sizes agree");
        out.extend(row.iter().map(|&v| f64::from(v)));
    }
    out
}

use crate::common::case::{arena_violation, SENTINEL};
pub use crate::common::nmse;

fn qtype() -> impl Strategy<Value = QType> {
    proptest::sample::select(weight_types())
}

/// Row lengths: 1..=12 blocks (often more for 32-element blocks).
fn blocks(q: QType) -> BoxedStrategy<usize> {
    let max = if q.block_size() == 32 { 160 } else { 20 };
    (1usize..=max).prop_map(move |b| b * q.block_size()).boxed()
}

/// Quantizing casts of F32 rows to one of `types` (odd row counts, strided rows).
pub fn quantize(types: Vec<QType>) -> BoxedStrategy<QCase> {
    (
        proptest::sample::select(types),
        any::<u64>(),
        1usize..=37,
        0usize..=2,
    )
        .prop_flat_map(|(q, seed, rows, pad)| {
            blocks(q).prop_map(move |k| QCase {
                op: QOp::Quantize,
                q,
                k,
                rows,
                pad,
                offset: 0,
                n: 1,
                a_batch: [1, 1],
                repeat: [1, 1],
                x_pad: 0,
                seed,
            })
        })
        .boxed()
}

/// Dequantizing casts to F32 and F16 of strided quantized rows.
pub fn dequantize() -> BoxedStrategy<QCase> {
    (
        qtype(),
        any::<u64>(),
        1usize..=37,
        0usize..=2,
        proptest::sample::select(vec![DType::F32, DType::F16]),
    )
        .prop_flat_map(|(q, seed, rows, pad, dt)| {
            blocks(q).prop_map(move |k| QCase {
                op: QOp::Dequantize(dt),
                q,
                k,
                rows,
                pad,
                offset: 0,
                n: 1,
                a_batch: [1, 1],
                repeat: [1, 1],
                x_pad: 0,
                seed,
            })
        })
        .boxed()
}

/// get_rows of 1..=20 ids from a strided quantized table.
pub fn get_rows() -> BoxedStrategy<QCase> {
    (qtype(), any::<u64>(), 1usize..=37, 0usize..=2, 1usize..=20)
        .prop_flat_map(|(q, seed, rows, pad, n)| {
            blocks(q).prop_map(move |k| QCase {
                op: QOp::GetRows,
                q,
                k,
                rows,
                pad,
                offset: 0,
                n,
                a_batch: [1, 1],
                repeat: [1, 1],
                x_pad: 0,
                seed,
            })
        })
        .boxed()
}

/// set_rows of 1..=20 distinct F32 rows into a quantized table of one of `types` of up to
/// 37 rows.
pub fn set_rows(types: Vec<QType>) -> BoxedStrategy<QCase> {
    (
        proptest::sample::select(types),
        any::<u64>(),
        1usize..=37,
        1usize..=20,
    )
        .prop_flat_map(|(q, seed, rows, n)| {
            blocks(q).prop_map(move |k| QCase {
                op: QOp::SetRows,
                q,
                k,
                rows,
                pad: 0,
                offset: 0,
                n: n.min(rows),
                a_batch: [1, 1],
                repeat: [1, 1],
                x_pad: 0,
                seed,
            })
        })
        .boxed()
}

/// Decode products: 1..=8 columns, odd row counts, strided weight rows, half of them
/// with a residual add (fused on the device).
pub fn mul_mat_decode() -> BoxedStrategy<QCase> {
    (
        qtype(),
        any::<u64>(),
        1usize..=77,
        0usize..=2,
        1usize..=8,
        any::<bool>(),
    )
        .prop_flat_map(|(q, seed, rows, pad, n, add)| {
            blocks(q).prop_map(move |k| QCase {
                pad,
                ..QCase::mul_mat(q, k, rows, n, add, seed)
            })
        })
        .boxed()
}

/// Decode products whose weight stack starts 2, 6 or 8 bytes into its buffer: rows
/// that are not 16-byte aligned (or 4-byte, for 2 and 6), which the K-quants' product
/// reads with other loads than aligned rows.
pub fn mul_mat_decode_offset() -> BoxedStrategy<QCase> {
    (
        mul_mat_decode(),
        prop_oneof![Just(2usize), Just(6), Just(8)],
    )
        .prop_map(|(c, offset)| QCase { offset, ..c })
        .boxed()
}

/// Prefill products: 9..=600 columns, or fewer with broadcast batches.
pub fn mul_mat_prefill() -> BoxedStrategy<QCase> {
    (
        qtype(),
        any::<u64>(),
        1usize..=70,
        0usize..=1,
        prop_oneof![9usize..=64, 65usize..=600, 1usize..=8],
        (1usize..=2, 1usize..=2),
        (1usize..=2, 1usize..=2),
    )
        .prop_flat_map(|(q, seed, rows, pad, n, (a2, a3), (r2, r3))| {
            let max = if q.block_size() == 32 { 24 } else { 3 };
            (1usize..=max).prop_map(move |b| {
                let batched = n <= 8;
                QCase {
                    op: QOp::MulMat { add: false },
                    q,
                    k: b * q.block_size(),
                    rows,
                    pad,
                    offset: 0,
                    n,
                    a_batch: if batched { [a2, a3] } else { [1, a3] },
                    repeat: if batched { [r2.max(2), r3] } else { [r2, 1] },
                    x_pad: 0,
                    seed,
                }
            })
        })
        .boxed()
}

/// Batched products (a batched decode step, a prefill chunk): 9..=300 columns (the int8
/// tensor-core product up to `MMQ_MAX_COLS`, the F16 copy for cuBLAS past it), counted
/// over broadcast batches of activations a third of the time (one weight matrix, `n`
/// columns a batch); rows 1..=150 (up to three tiles of 64, the last partial); rows of up
/// to 2,048 elements (parts of K); weight rows padded and at offsets 0, 2 and 6 (aligned
/// and unaligned K-quant blocks), activation rows padded with NaN or dense; a third of
/// the cases without batches with a residual add.
pub fn mul_mat_batched() -> BoxedStrategy<QCase> {
    let batches = prop_oneof![
        4 => Just([1usize, 1]),
        1 => Just([2, 1]),
        1 => Just([1, 3]),
        1 => Just([2, 3]),
    ];
    (
        qtype(),
        any::<u64>(),
        1usize..=150,
        0usize..=2,
        prop_oneof![9usize..=64, 65usize..=300],
        batches,
        prop_oneof![Just(0usize), Just(2), Just(6)],
        0usize..=3,
    )
        .prop_flat_map(|(q, seed, rows, pad, cols, repeat, offset, x_pad)| {
            let max = if q.block_size() == 32 { 64 } else { 8 };
            let add = repeat == [1, 1] && seed % 3 == 0;
            (1usize..=max).prop_map(move |b| QCase {
                pad,
                offset,
                n: (cols / (repeat[0] * repeat[1])).max(1),
                repeat,
                x_pad,
                ..QCase::mul_mat(q, b * q.block_size(), rows, 1, add, seed)
            })
        })
        .boxed()
}

/// The frozen-weight rules a backend keeps whatever its layout, for the weights of `c`
/// (a mul_mat case, at `c.offset` of a buffer with bytes around them) frozen on `be`:
/// freezing twice changes nothing; reading back gives ggml's bytes (the whole buffer,
/// and ranges across the weights' start, inside them and to the buffer's end); a write
/// into them, one across their start, a fill over them, freezing `other` (overlapping
/// them) and a plan that dequantizes them are errors naming the tensor (`w`); the bytes
/// around them stay writable. `refuses`: whether the backend keeps these weights in a
/// layout of its own (else it may accept the writes and the plan).
pub fn check_frozen_rules(be: &mut dyn Backend, c: &QCase, other: FrozenTensor, refuses: bool) {
    let w = weight_bytes(c);
    let (offset, total) = (c.offset, c.offset + w.len() + 300);
    let mut all: Vec<u8> = (0..total).map(|i| (i * 7 + 3) as u8).collect();
    all[offset..offset + w.len()].copy_from_slice(&w);
    let buf = be.alloc_buffer(total).unwrap();
    be.write_buffer(buf, 0, &all).unwrap();
    be.freeze_weights(buf, &[frozen(c)]).unwrap();
    be.freeze_weights(buf, &[frozen(c)]).unwrap();
    let mut back = vec![0u8; total];
    be.read_buffer(buf, 0, &mut back).unwrap();
    assert!(
        back == all,
        "{:?}: reading the whole buffer back gave other bytes",
        c.q
    );
    let inside = (offset + 5, offset + 5 + (w.len() - 5).min(996));
    for (a, b) in [
        inside,
        (offset - 9, offset + 20),
        (offset + w.len() - 7, total),
    ] {
        let mut part = vec![0u8; b - a];
        be.read_buffer(buf, a, &mut part).unwrap();
        assert!(
            part == all[a..b],
            "{:?}: reading bytes {a}..{b} back gave other bytes",
            c.q
        );
    }
    if refuses {
        let must_name = |r: Result<()>, what: &str| match r {
            Err(e) => assert!(
                e.to_string().contains("frozen weight w"),
                "{:?} {what}: {e}",
                c.q
            ),
            Ok(()) => panic!("{:?}: {what} succeeded", c.q),
        };
        must_name(
            be.write_buffer(buf, offset + 100, &[1, 2, 3]),
            "a write into them",
        );
        must_name(
            be.write_buffer(buf, offset - 2, &[0; 4]),
            "a write across their start",
        );
        must_name(
            be.fill_random(buf, offset, DType::F32, 4, 1, 1.0),
            "fill_random over them",
        );
        must_name(
            be.freeze_weights(buf, &[other]),
            "freezing an overlapping tensor",
        );
        // a dequantizing copy of the frozen weights is not a mul_mat
        let mut g = Graph::new();
        let wt = weight_view(&mut g, c, buf).unwrap();
        let y = g.cast(wt, DType::F32).unwrap();
        let plan = g.plan(&[y]).unwrap();
        match be.load(&plan) {
            Err(e) => assert!(e.to_string().contains("frozen weight w"), "{:?}: {e}", c.q),
            Ok(_) => panic!("{:?}: a plan that dequantizes frozen weights loaded", c.q),
        }
    }
    be.write_buffer(buf, offset + w.len(), &[9; 16]).unwrap();
    be.write_buffer(buf, 0, &all[..offset]).unwrap();
    be.free_buffer(buf).unwrap();
}
