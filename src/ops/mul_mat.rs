//! mul_mat with ggml's semantics: `a` [k, m, a2, a3] and `b` [k, n, b2, b3] contract over
//! dim 0 into F32 [m, n, b2, b3], i.e. `out[i, j] = sum_l a[l, i] * b[l, j]` (`a^T b`).
//! `a` is broadcast over `b` in dims 2 and 3 (`b2 % a2 == 0`): with `a` the K/V cache of
//! `a2` KV heads and `b` the queries of `b2` heads, query head `h` uses KV head
//! `h / (b2 / a2)`, which is grouped-query attention.

use rayon::prelude::*;

use super::host::{HostTensor, PAR_MIN_ELEMS};
use super::{expect_dtype, expect_float_or_quant, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};
use crate::quant::{self, QType};

impl Graph {
    /// `a^T b` contracted over dim 0: [k, m, a2, a3] x [k, n, b2, b3] -> F32 [m, n, b2, b3].
    pub fn mul_mat(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        let (ta, tb) = (self.get(a)?, self.get(b)?);
        expect_float_or_quant("mul_mat", &ta.name, ta.dtype)?;
        let b_types: &[DType] = if ta.dtype.quant().is_some() {
            &[DType::F32]
        } else {
            &DType::FLOATS
        };
        expect_dtype("mul_mat", &tb.name, tb.dtype, b_types)?;
        if ta.ne[0] != tb.ne[0] || tb.ne[2] % ta.ne[2] != 0 || tb.ne[3] % ta.ne[3] != 0 {
            return Err(Error::shape(
                "mul_mat",
                format!(
                    "'{}' {} and '{}' {} do not match: dim 0 must be equal and dims 2, 3 of the first must divide the second's",
                    ta.name,
                    fmt_ne(&ta.ne),
                    tb.name,
                    fmt_ne(&tb.ne)
                ),
            ));
        }
        let ne = [ta.ne[1], tb.ne[1], tb.ne[2], tb.ne[3]];
        Ok(self.new_node(Op::MulMat, DType::F32, ne, &[a, b]))
    }
}

/// Dot product with eight independent f32 accumulators (vectorizes well).
#[inline(always)]
pub fn dot_f32(x: &[f32], y: &[f32]) -> f32 {
    debug_assert_eq!(x.len(), y.len());
    let mut acc = [0f32; 8];
    let cx = x.chunks_exact(8);
    let cy = y.chunks_exact(8);
    let (rx, ry) = (cx.remainder(), cy.remainder());
    for (a, b) in cx.zip(cy) {
        for l in 0..8 {
            acc[l] += a[l] * b[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (a, b) in rx.iter().zip(ry) {
        s += a * b;
    }
    s
}

/// Rows of `a` handled per parallel task.
const ROWS_PER_TASK: usize = 16;

/// How the CPU multiplies block-typed weights by F32 activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QuantDot {
    /// Quantize each activation column to Q8_1 once, then integer dot products per
    /// block (ggml's CPU path and the GPU's dp4a path; NMSE about 1e-5..1e-4 from the
    /// activations' 8 bits). The default: the fast one.
    #[default]
    Q8_1,
    /// Dequantize each weight block and dot it with the f32 activations (the reference:
    /// only the weights' own rounding).
    F32,
}

/// How the CPU backend keeps a mul_mat's block-typed weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightLayout {
    /// ggml's blocks, row after row.
    #[default]
    Ggml,
    /// Frozen Q4_0 or IQ4_NL weights in rows of eight ([`quant::rows8`]): whole groups of
    /// eight dense rows.
    Rows8,
}

/// CPU reference for mul_mat (multi-threaded over rows of `a`); block-typed weights go
/// through `quant`, laid out as `layout` says.
pub(crate) fn cpu(
    dst: HostTensor,
    src: &[HostTensor],
    quant: QuantDot,
    layout: WeightLayout,
) -> Result<()> {
    let (a, b) = (src[0], src[1]);
    if let Some(q) = a.dtype.quant() {
        cpu_quant(q, (quant, layout), dst, a, b);
        return Ok(());
    }
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (r2, r3) = (b.ne[2] / a.ne[2], b.ne[3] / a.ne[3]);
    let a_dense = a.dtype == DType::F32
        && a.nb[0] == 4
        && (a.ptr as usize).is_multiple_of(4)
        && a.nb.iter().all(|n| n % 4 == 0);
    let mut bm = vec![0f32; n * k];
    for i3 in 0..b.ne[3] {
        for i2 in 0..b.ne[2] {
            for (j, col) in bm.chunks_exact_mut(k).enumerate() {
                // SAFETY: (j, i2, i3) is inside b's shape; the plan guarantees valid memory.
                unsafe { b.read_row(j, i2, i3, col) };
            }
            let (i02, i03) = (i2 / r2, i3 / r3);
            let bm = &bm;
            (0..m.div_ceil(ROWS_PER_TASK))
                .into_par_iter()
                .for_each(|task| {
                    let mut buf = vec![0f32; if a_dense { 0 } else { k }];
                    for i in task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(m) {
                        let row: &[f32] = if a_dense {
                            // SAFETY: a dense f32 row of k elements starts at this offset and
                            // nothing writes `a` during this step.
                            unsafe {
                                std::slice::from_raw_parts(
                                    a.ptr.add(a.offset([0, i, i02, i03])) as *const f32,
                                    k,
                                )
                            }
                        } else {
                            // SAFETY: (i, i02, i03) is inside a's shape.
                            unsafe { a.read_row(i, i02, i03, &mut buf) };
                            &buf
                        };
                        for (j, col) in bm.chunks_exact(k).enumerate() {
                            // SAFETY: (i, j, i2, i3) is inside dst; each task writes its own rows.
                            unsafe { dst.set([i, j, i2, i3], dot_f32(row, col)) };
                        }
                    }
                });
        }
    }
    Ok(())
}

/// Activation columns handed to one call of the row kernel on the Q8_1 path (which
/// walks them in groups of four against every row of the task; see
/// [`quant::vec_dot_q8_1_cols`]).
const COLS_PER_CALL: usize = 32;

/// mul_mat with block-typed `a` [k, m, a2, a3] (whole blocks along dim 0, any row
/// strides) and F32 `b` [k, n, b2, b3]: each column of `b` is read (and, for
/// [`QuantDot::Q8_1`], quantized) once per batch, rows of `a` are dotted in place.
fn cpu_quant(
    q: QType,
    (path, layout): (QuantDot, WeightLayout),
    dst: HostTensor,
    a: HostTensor,
    b: HostTensor,
) {
    match path {
        QuantDot::Q8_1 => cpu_quant_q8_1(q, layout, dst, a, b),
        QuantDot::F32 => cpu_quant_f32(q, layout, dst, a, b),
    }
}

/// Row `i` of batch (`i02`, `i03`) of the block-typed `a`: `w_bytes` dense bytes.
///
/// # Safety
/// (`i`, `i02`, `i03`) is inside `a`'s shape, and nothing writes `a` during the step.
unsafe fn quant_row<'a>(
    a: &HostTensor,
    i: usize,
    i02: usize,
    i03: usize,
    w_bytes: usize,
) -> &'a [u8] {
    // SAFETY: the row is whole blocks along dim 0 (dense) inside a's memory (caller).
    unsafe { std::slice::from_raw_parts(a.ptr.add(a.offset([0, i, i02, i03])), w_bytes) }
}

/// [`QuantDot::Q8_1`]: the columns of `b` quantized to Q8_1 once per batch, then each
/// task takes [`ROWS_PER_TASK`] rows of `a` and walks the columns in groups of
/// [`COLS_PER_CALL`], so that a group's activations and the task's weight rows stay in
/// the L1 cache while every pair is dotted.
fn cpu_quant_q8_1(q: QType, layout: WeightLayout, dst: HostTensor, a: HostTensor, b: HostTensor) {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (r2, r3) = (b.ne[2] / a.ne[2], b.ne[3] / a.ne[3]);
    let w_bytes = a.dtype.row_bytes(k);
    let q8_bytes = DType::Q8_1.row_bytes(k);
    let mut cols_q8 = vec![0u8; n * q8_bytes];
    // The d and s of every Q8_1 block as f32, converted once for all weight rows.
    let ds_per_col = q8_bytes / 36 * 2;
    let mut cols_ds = vec![0f32; n * ds_per_col];
    // the kernels write their results into dst directly (rows of eight: a column's rows
    // side by side, as in a mul_mat's dense F32 result)
    assert!(
        dst.nb[0].is_multiple_of(4)
            && dst.nb[1].is_multiple_of(4)
            && (layout == WeightLayout::Ggml || dst.nb[0] == 4),
        "a dense result"
    );
    // the columns packed eight at a time where the kernels of eight or sixteen rows
    // read them (whole runs of eight a call)
    let packing = match layout {
        WeightLayout::Ggml => quant::dot::packing(q, n.min(COLS_PER_CALL)),
        WeightLayout::Rows8 => Some(quant::rows8::packing(q)),
    };
    let mut cols_x8 = Vec::new();
    const { assert!(COLS_PER_CALL.is_multiple_of(quant::panel::RUN)) };
    for i3 in 0..b.ne[3] {
        for i2 in 0..b.ne[2] {
            let quantize = |col: &mut Vec<f32>, (j, out): (usize, &mut [u8])| {
                // SAFETY: (j, i2, i3) is inside b's shape; the plan guarantees valid memory.
                unsafe { b.read_row(j, i2, i3, col) };
                quant::quantize_row(QType::Q8_1, col, out).expect("k is whole Q8_1 blocks");
            };
            if n * k >= PAR_MIN_ELEMS {
                cols_q8
                    .par_chunks_exact_mut(q8_bytes)
                    .enumerate()
                    .for_each_init(|| vec![0f32; k], quantize);
            } else {
                let mut col = vec![0f32; k];
                for c in cols_q8.chunks_exact_mut(q8_bytes).enumerate() {
                    quantize(&mut col, c);
                }
            }
            if layout == WeightLayout::Ggml {
                quant::dot::q8_1_scales(&cols_q8, &mut cols_ds);
            }
            if let Some(how) = packing {
                quant::panel::pack(&cols_q8, n, how, &mut cols_x8);
            }
            let (i02, i03) = (i2 / r2, i3 / r3);
            let (cols_q8, cols_ds) = (&cols_q8, &cols_ds);
            let x8_per_run = k / 32 * quant::panel::COL_PANEL;
            // the panels of columns j0..j0 + nc (none where nothing reads them)
            let panels = |j0: usize, nc: usize| match cols_x8.is_empty() {
                true => &[][..],
                false => {
                    let runs = j0 / quant::panel::RUN..(j0 + nc).div_ceil(quant::panel::RUN);
                    &cols_x8[runs.start * x8_per_run..runs.end * x8_per_run]
                }
            };
            let task = |t: usize| {
                let rows = t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(m);
                for j0 in (0..n).step_by(COLS_PER_CALL) {
                    let nc = COLS_PER_CALL.min(n - j0);
                    // SAFETY: rows.start < m and (i02, i03) is inside a's batch dims; each
                    // row is whole blocks along dim 0 that nothing writes during the step.
                    // (rows of eight: rows.start is a multiple of 8, the rows whole groups)
                    // The results go straight into dst's rows of the task, which no other
                    // task writes; its strides are whole floats (checked above).
                    unsafe {
                        let w = a.ptr.add(a.offset([0, rows.start, i02, i03]));
                        let at = dst.ptr.add(dst.offset([rows.start, j0, i2, i3])) as *mut f32;
                        let (row, col) = (dst.nb[0] / 4, dst.nb[1] / 4);
                        match layout {
                            WeightLayout::Ggml => quant::dot::vec_dot_q8_1_rows(
                                q,
                                (w, a.nb[1], w_bytes),
                                (
                                    &cols_q8[j0 * q8_bytes..(j0 + nc) * q8_bytes],
                                    panels(j0, nc),
                                ),
                                &cols_ds[j0 * ds_per_col..(j0 + nc) * ds_per_col],
                                (rows.len(), nc),
                                quant::dot::Results { ptr: at, row, col },
                            ),
                            WeightLayout::Rows8 => quant::dot::vec_dot_q8_1_rows8(
                                q,
                                (w, k / 32, rows.len() / quant::rows8::ROWS),
                                panels(j0, nc),
                                nc,
                                (at, col),
                            ),
                        }
                    };
                }
            };
            let tasks = m.div_ceil(ROWS_PER_TASK);
            // a decode step's tasks are small: at least 64 KiB of weights a job
            let min_len = match n {
                1 => (65536 / (ROWS_PER_TASK * w_bytes).max(1)).max(1),
                _ => 1,
            };
            if tasks == 1 {
                task(0);
            } else {
                (0..tasks)
                    .into_par_iter()
                    .with_min_len(min_len)
                    .for_each(task);
            }
        }
    }
}

/// [`QuantDot::F32`]: each weight row dequantized (once, when there are several columns)
/// and dotted with the f32 columns, in the same order of sums either way.
fn cpu_quant_f32(q: QType, layout: WeightLayout, dst: HostTensor, a: HostTensor, b: HostTensor) {
    let (k, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    let (r2, r3) = (b.ne[2] / a.ne[2], b.ne[3] / a.ne[3]);
    let w_bytes = a.dtype.row_bytes(k);
    let mut cols = vec![0f32; n * k];
    for i3 in 0..b.ne[3] {
        for i2 in 0..b.ne[2] {
            for (j, col) in cols.chunks_exact_mut(k).enumerate() {
                // SAFETY: (j, i2, i3) is inside b's shape; the plan guarantees valid memory.
                unsafe { b.read_row(j, i2, i3, col) };
            }
            let (i02, i03) = (i2 / r2, i3 / r3);
            let cols = &cols;
            let scratch = || (vec![0f32; if n > 1 { k } else { 0 }], vec![0u8; w_bytes]);
            (0..m.div_ceil(ROWS_PER_TASK))
                .into_par_iter()
                .for_each_init(scratch, |(row, bytes), task| {
                    for i in task * ROWS_PER_TASK..((task + 1) * ROWS_PER_TASK).min(m) {
                        let w = match layout {
                            // SAFETY: i < m, (i02, i03) inside a's batch dims; a is
                            // read-only here.
                            WeightLayout::Ggml => unsafe { quant_row(&a, i, i02, i03, w_bytes) },
                            WeightLayout::Rows8 => {
                                let g = i / quant::rows8::ROWS * quant::rows8::ROWS;
                                let group = quant::rows8::ROWS * w_bytes;
                                // SAFETY: row i's group of eight dense rows lies inside a.
                                let src = unsafe { quant_row(&a, g, i02, i03, group) };
                                quant::rows8::row(src, i - g, bytes.as_mut_slice());
                                bytes.as_slice()
                            }
                        };
                        if n > 1 {
                            quant::dequantize_row(q, w, row).expect("k is whole blocks");
                        }
                        for (j, col) in cols.chunks_exact(k).enumerate() {
                            let v = if n > 1 {
                                quant::dot::dot_dequantized(row, col)
                            } else {
                                quant::vec_dot_f32(q, w, col)
                            };
                            // SAFETY: (i, j, i2, i3) is inside dst; each task writes its own rows.
                            unsafe { dst.set([i, j, i2, i3], v) };
                        }
                    }
                });
        }
    }
}
