//! mul_mat with block-quantized weights (`a` of a [`QType`](crate::quant::QType), dense
//! blocks along dim 0 at any row stride) and F32 activations `b`, F32 dense result.
//!
//! 1. Decode (`b` has 1..=8 columns, no batches): one launch per product, one warp per
//!    weight row, every column of `b` against each weight read once
//!    (`cuda/mul_mat_q.cu`), in one of two ways chosen by [`Lowering::mmvq`]
//!    (`GRAFT_CUDA_MMVQ`):
//!    - `quantize_q8_1_f32` writes `b` as Q8_1 blocks into the plan's scratch, then
//!      `mul_mat_vec_q_c<NC>_<q>` takes integer dot products with `__dp4a` (default).
//!      Products of the same activations in a row (a layer's q, k and v when a mix
//!      splits them) quantize them once ([`Lowering::q8_1`]);
//!    - `mul_mat_vec_dq_c<NC>_<q>` dequantizes the weights in registers and dots them with
//!      the F32 activations.
//!
//!    `NC` is the smallest of 1, 2, 4, 8 that holds the columns. A following residual add
//!    can be fused into the launch (see [`super::super::fuse`]). With
//!    [`Lowering::small_dq`] (the backend's default), a product of at most
//!    [`SMALL_DQ_BYTES`] of weights whose activations have no Q8_1 copy yet takes the
//!    second kind: one launch instead of two.
//! 2. Everything else (prefill, batches): `cpy_<q>_f16` dequantizes the weights into
//!    scratch as F16 rows padded to 16 bytes, then the cuBLAS path of
//!    [`super::mul_mat`] runs on them (activations converted to F16 as for F16 weights).
//!    The scratch is part of the loaded plan, so both stay inside a captured graph.
//!
//! Frozen Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K weights in split rows
//! ([`crate::backend::cuda::split`]) take the same paths with their own kernels:
//! `mul_mat_vec_qs_c<NC>_<q>` (no staging: a lane reads a block's quants, Q5_K and Q6_K a
//! pair of sub-blocks, as 16-byte loads; `mul_mat_vec_qsp_c<NC>_<q>` when the grid fits on
//! the GPU at once, loading each lane's first blocks before the wait; Q5_K's and Q6_K's
//! load the first pair early in any grid and differ in the pairs a lane keeps in flight),
//! `mul_mat_vec_dqs_c<NC>_<q>` and
//! `cpy_split_<q>_f16`, the same values in the same order as the ggml-layout kernels.
//! Q4_K and Q5_K blocks (144 and 176 bytes) are multiples of 16 bytes: rows that start
//! 16-byte aligned at a 16-byte multiple stride are read in place on the `__dp4a` path
//! (`mul_mat_vec_qd_c<NC>_<q>`, [`Rows::Aligned`]), the same sums as the staged kernel.

use super::cpy::copy_to;
use super::mul_mat::{lower_gemm, padded, Gemv};
use crate::backend::cuda::args::{
    CpyArgs, QGemvArgs, Tensor4, ACT_BLOCKS, ACT_PAIRS, CPY_SAME_SHAPE, GEMV_WARPS,
};
use crate::backend::cuda::kernels::{by, cols, k, KernelSet};
use crate::backend::cuda::lowering::{flat_grid, row_grid, DevOp, Lowering, Q8Copy, MAX_GRID_YZ};
use crate::backend::fusion::{quant_decode_layout, Q8Layout};
use crate::graph::{DType, Operand};
use crate::quant::QType;
/// Weight bytes up to which a decode product whose activations have no Q8_1 copy yet
/// takes the dequantize-in-registers kernel when [`Lowering::small_dq`] is on: one launch
/// instead of a quantizing launch and a product, which is what counts for the small
/// matrices of a 135M model (SmolLM2's attention output, 576 x 576 Q4_1, 187 KB).
const SMALL_DQ_BYTES: usize = 1 << 20;
/// Rows (one per warp) per thread block of the decode kernels.
const ROWS: usize = GEMV_WARPS as usize;
/// Bytes of one column of `k` activations quantized to Q8_1 for the decode kernels: the
/// `k` quants in groups of 16 blocks (512 bytes, the last one padded), then a (d, sum) f16
/// pair per 32 elements, padded to 16 bytes (cuda/quant.cuh, `act_at`), in either layout.
fn q8_1_column_bytes(k: usize) -> usize {
    (k.next_multiple_of(512) + k / 32 * 4).next_multiple_of(16)
}

/// A Q8_1 layout as the kernels take it (`mode`, `q8_layout`): `ACT_BLOCKS` or `ACT_PAIRS`
/// (`act_at` in cuda/quant.cuh).
pub(crate) fn act_code(layout: Q8Layout) -> i64 {
    match layout {
        Q8Layout::Blocks => ACT_BLOCKS,
        Q8Layout::Pairs => ACT_PAIRS,
    }
}

/// Lowers `dst = a b` with block-quantized `a` of type `q`.
pub(crate) fn lower(
    q: QType,
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    if b.dtype != DType::F32 {
        return Err(format!(
            "mul_mat of {q} weights needs F32 activations, got {}",
            b.dtype
        ));
    }
    if dst.dtype != DType::F32 || !dst.is_contiguous() {
        return Err("mul_mat needs a dense F32 result".into());
    }
    if !a.rows_contiguous() {
        return Err(format!(
            "mul_mat of {q} weights needs dense blocks along dim 0, got strides {:?}",
            a.nb
        ));
    }
    let (kk, a2, a3) = (a.ne[0], a.ne[2], a.ne[3]);
    if b.ne[0] != kk || b.ne[2] % a2 != 0 || b.ne[3] % a3 != 0 {
        return Err(format!("mul_mat of {:?} by {:?}", a.ne, b.ne));
    }
    if let Some(ops) = gemv(a, b, dst, Gemv::default(), lw) {
        return ops;
    }
    // Prefill: F16 copy of the weights in scratch, then cuBLAS.
    let dense = padded(a, DType::F16);
    let mut offset = 0usize;
    let addr = lw.reserve_scratch(&mut offset, dense.nbytes());
    let copy = match lw.weights_split(a)? {
        true => split_copy(lw, a, &dense, addr)?,
        false => copy_to(lw, a, &dense, addr)?,
    };
    lower_gemm(&dense, addr, b, dst, lw, offset, vec![copy])
}

/// `cpy_split_<q>_f16`: the F16 copy of weights `a` in split rows into the dense,
/// 16-byte aligned rows `dense` at `addr` (the only copy the kernel makes: see
/// cuda/convert.cu).
fn split_copy(lw: &Lowering, a: &Operand, dense: &Operand, addr: u64) -> Result<DevOp, String> {
    let n = a.nelements();
    let rows = n / a.ne[0];
    let fits = dense.ne == a.ne
        && dense.nb[0] == 2
        && dense.nb[1] % 16 == 0
        && addr % 16 == 0
        && (rows == 1 || dense.nb[2] == dense.nb[1] * dense.ne[1])
        && dense.nb[3] == dense.nb[2] * dense.ne[2]
        && n / 8 < i32::MAX as usize;
    if !fits {
        return Err(format!(
            "the F16 copy of frozen {} weights {:?} needs dense 16-byte aligned rows, got strides {:?}",
            a.dtype, a.ne, dense.nb
        ));
    }
    let args = CpyArgs {
        src: lw.t4(a),
        dst: Tensor4::new(addr, dense),
        n: n as i64,
        mode: CPY_SAME_SHAPE,
    };
    let (grid, block) = flat_grid(n / 8);
    let kernel = by::CPY_SPLIT.get([a.dtype, DType::F16])?;
    Ok(DevOp::kernel(kernel, grid, block, &args))
}

/// How a decode kernel reads the rows of its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rows {
    /// ggml's layout, staged through shared memory (the `__dp4a` path) or read as
    /// 2-byte aligned blocks (the dequantizing path).
    Ggml,
    /// Frozen weights in split rows (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K, Q6_K).
    Split,
    /// Split rows in a grid the GPU holds at once ([`one_wave`]): each lane's first
    /// blocks are loaded before the kernel waits for its predecessor
    /// (`mul_mat_vec_qsp_c<NC>_<q>`).
    SplitOneWave,
    /// ggml's layout at 16-byte aligned rows, read in place: Q4_K and Q5_K on the
    /// `__dp4a` path (`mul_mat_vec_qd_c<NC>_<q>`).
    Aligned,
}

/// The decode kernel set for `ncols` columns on the chosen path and row reading: the
/// family's kernels for the fewest columns that hold `ncols` (1, 2, 4 or 8).
fn kernel_set(mmvq: bool, ncols: usize, rows: Rows) -> Result<KernelSet<QGemvArgs, 1>, String> {
    let family = match (mmvq, rows) {
        (true, Rows::Ggml) => cols::MUL_MAT_VEC_Q,
        (true, Rows::Split) => cols::MUL_MAT_VEC_QS,
        (true, Rows::SplitOneWave) => cols::MUL_MAT_VEC_QSP,
        (true, Rows::Aligned) => cols::MUL_MAT_VEC_QD,
        (false, Rows::Ggml | Rows::Aligned) => cols::MUL_MAT_VEC_DQ,
        (false, Rows::Split | Rows::SplitOneWave) => cols::MUL_MAT_VEC_DQS,
    };
    family.covering(ncols)
}

/// The kernel of a set for `ncols` columns: 1, 2, up to 4, up to 8.
fn cols_index(ncols: usize) -> usize {
    match ncols {
        1 => 0,
        2 => 1,
        3 | 4 => 2,
        _ => 3,
    }
}

/// Thread blocks an SM holds of the decode kernels, by [`cols_index`] (their
/// `__launch_bounds__` in cuda/mul_mat_q.cu).
const RESIDENT: [usize; 4] = [8, 8, 6, 4];

/// Whether the grid of a decode product of `m` rows by `ncols` columns fits a GPU of `sms`
/// SMs at once, so that every block can load its first weights before the previous kernel
/// ends. On the H100 that took the split Q4_0 product of [4096, 4096] from 70 to 86% of the copy
/// bandwidth and [11008, 4096] from 82 to 93%, but [4096, 11008] (2,752 blocks) from 89
/// to 85%: blocks past the first wave gain nothing from it (a chain of 48 products).
fn one_wave(m: usize, ncols: usize, sms: usize) -> bool {
    m.div_ceil(ROWS) <= sms * RESIDENT[cols_index(ncols)]
}

/// Scratch at `*offset` for the Q8_1 copy of the F32 columns `b` [k, n] that the decode
/// kernels read: its address and column stride (bytes).
pub(crate) fn q8_1_copy(b: &Operand, offset: &mut usize, lw: &mut Lowering) -> (u64, usize) {
    let row = q8_1_column_bytes(b.ne[0]);
    (lw.reserve_scratch(offset, row * b.ne[1]), row)
}

/// The decode launches of `a b` (block-quantized `a`) into the dense F32 `dst` (or
/// `extra.dst`), plus `extra.add`, or None when the product is not a decode product
/// ([`quant_decode_layout`]) or its type has no kernel on the chosen path.
pub(crate) fn gemv(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    extra: Gemv,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    if !quant_decode_layout(a, b) {
        return None;
    }
    let (kk, m, n) = (a.ne[0], a.ne[1], b.ne[1]);
    // The Q8_1 copy of `b` in this product's layout an earlier step made, if any. A small
    // product without one dequantizes in registers: it is launch-bound, and quantizing
    // would be a second launch.
    let layout = Q8Layout::of(a.dtype);
    let copy = lw
        .q8_1
        .as_ref()
        .filter(|c| c.of == *b && c.layout == layout)
        .map(|c| c.addr);
    let small = lw.small_dq && m * a.nb[1] <= SMALL_DQ_BYTES;
    let q8 = lw.mmvq && (copy.is_some() || !small);
    let a_addr = lw.addr(a);
    let rows = match lw.weights_split(a) {
        Ok(true) if one_wave(m, n, lw.sms) => Rows::SplitOneWave,
        Ok(true) => Rows::Split,
        Ok(false) if a_addr % 16 == 0 && a.nb[1] % 16 == 0 => Rows::Aligned,
        Ok(false) => Rows::Ggml,
        Err(e) => return Some(Err(e)),
    };
    let kernel = match kernel_set(q8, n, rows).and_then(|s| s.get([a.dtype])) {
        Ok(kernel) => kernel,
        // Aligned rows of a type without in-place kernels: the ggml-layout ones read them
        // too. (Split rows never fall back: those kernels would misread them.)
        Err(_) if rows == Rows::Aligned => kernel_set(q8, n, Rows::Ggml)
            .and_then(|s| s.get([a.dtype]))
            .ok()?,
        Err(_) => return None,
    };
    let mut args = QGemvArgs {
        a: a_addr,
        b: lw.addr(b),
        dst: lw.addr(extra.dst.unwrap_or(dst)),
        add: extra.add.map_or(0, |r| lw.addr(r)),
        k: kk as i64,
        m: m as i64,
        ncols: n as i64,
        a_nb1: a.nb[1] as i64,
        b_nb1: b.nb[1] as i64,
        vec: 0,
        prefetch: i64::from(lw.read_only(a)),
    };
    let mut ops = Vec::with_capacity(2);
    if q8 {
        args.b = match copy {
            Some(addr) => addr,
            None => match quantize_q8_1(b, layout, lw) {
                Ok((addr, op)) => {
                    ops.push(op);
                    addr
                }
                Err(e) => return Some(Err(e)),
            },
        };
        args.b_nb1 = q8_1_column_bytes(kk) as i64;
    } else {
        let b_addr = lw.addr(b);
        args.vec = i64::from(b_addr % 16 == 0 && (n == 1 || b.nb[1] % 16 == 0));
    }
    Some(row_grid(m.div_ceil(ROWS)).map(|grid| {
        ops.push(DevOp::kernel(
            kernel,
            grid,
            ((ROWS * 32) as u32, 1, 1),
            &args,
        ));
        ops
    }))
}

/// `quantize_q8_1_f32` of the F32 columns `b` [k, n] into scratch (a column of
/// [`q8_1_column_bytes`] each), recorded as the copy that later decode products of `b`
/// read ([`Lowering::q8_1`]): the scratch address and the launch.
fn quantize_q8_1(b: &Operand, layout: Q8Layout, lw: &mut Lowering) -> Result<(u64, DevOp), String> {
    let (kk, n) = (b.ne[0], b.ne[1]);
    let (addr, row) = q8_1_copy(b, &mut 0, lw);
    let args = CpyArgs {
        src: lw.t4(b),
        dst: Tensor4 {
            data: addr,
            ne: [kk as i64, n as i64, 1, 1],
            nb: [1, row as i64, (row * n) as i64, (row * n) as i64],
        },
        n: 0,
        mode: act_code(layout),
    };
    let grid = (
        u32::try_from((kk / 32).div_ceil(ROWS)).map_err(|_| format!("{kk} elements per row"))?,
        n.min(MAX_GRID_YZ) as u32,
        1,
    );
    lw.q8_1 = Some(Q8Copy {
        of: b.clone(),
        addr,
        layout,
    });
    Ok((
        addr,
        DevOp::kernel(
            k::QUANTIZE_Q8_1_F32,
            grid,
            ((ROWS * 32) as u32, 1, 1),
            &args,
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::one_wave;

    #[test]
    fn one_wave_follows_the_sm_count() {
        // [4096, 4096] for one column: 1,024 blocks of 4 rows; 8 an SM fit 132 SMs (1,056
        // slots) but not an H100 PCIe's 114 (912) or an A100's 108 (864).
        assert!(one_wave(4096, 1, 132));
        assert!(!one_wave(4096, 1, 114));
        assert!(!one_wave(4096, 1, 108));
        // [11008, 4096]: 2,752 blocks, more than one wave anywhere here
        assert!(!one_wave(11_008, 1, 132));
        // 8 columns: 4 blocks an SM
        assert!(one_wave(2048, 8, 132) && !one_wave(2048, 8, 127));
        assert!(one_wave(4 * 4 * 127, 8, 127) && !one_wave(4 * 4 * 127 + 1, 8, 127));
    }
}
