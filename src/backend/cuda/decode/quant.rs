//! Decode products with block-quantized weights (`cuda/mul_mat_q.cu`): 1 to 8 columns of
//! F32 activations, one launch a product, one warp a weight row, every column against each
//! weight read once, on one of two paths ([`Lowering::mmvq`]):
//! - the activations quantized to Q8_1 ([`super::q8_1`]), then integer dot products with
//!   `__dp4a`: `mul_mat_vec_q_c<NC>_<q>` (the default). Products of the same activations
//!   in a row (a layer's q, k and v when a mix splits them) quantize them once, and a fused
//!   step before the product may have written them already;
//! - the weights dequantized in registers and dotted with the F32 activations:
//!   `mul_mat_vec_dq_c<NC>_<q>`.
//!
//! `NC` is the smallest of 1, 2, 4, 8 that holds the columns. With [`Lowering::small_dq`]
//! (the backend's default), a product of at most [`SMALL_DQ_BYTES`] of weights whose
//! activations have no Q8_1 copy yet takes the second path: one launch instead of two.
//!
//! Frozen Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K weights in split rows
//! ([`crate::backend::cuda::split`]) take their own kernels: `mul_mat_vec_qs_c<NC>_<q>` (no
//! staging: a lane reads a block's quants, Q5_K and Q6_K a pair of sub-blocks, as 16-byte
//! loads; `mul_mat_vec_qsp_c<NC>_<q>` when the grid fits on the GPU at once, loading each
//! lane's first blocks before the wait; Q5_K's and Q6_K's load the first pair early in any
//! grid and differ in the pairs a lane keeps in flight) and `mul_mat_vec_dqs_c<NC>_<q>`,
//! the same values in the same order as the ggml-layout kernels. Q4_K and Q5_K blocks
//! (144 and 176 bytes) are multiples of 16 bytes, IQ4_XS's (136) of 8: rows that start
//! so aligned at a stride of such a multiple ([`in_place_alignment`]) are read in place on
//! the `__dp4a` path (`mul_mat_vec_qd_c<NC>_<q>`, [`Rows::Aligned`]), the same sums as the
//! staged kernel.

use super::q8_1::{made, q8_1_column_bytes, quantize_q8_1};
use super::{Gemv, ROWS};
use crate::backend::cuda::args::QGemvArgs;
use crate::backend::cuda::kernels::{cols, KernelSet};
use crate::backend::cuda::lowering::{row_grid, DevOp, Lowering};
use crate::backend::fusion::{quant_decode_layout, Q8Layout};
use crate::graph::{DType, Operand};

/// Weight bytes up to which a decode product whose activations have no Q8_1 copy yet
/// takes the dequantize-in-registers kernel when [`Lowering::small_dq`] is on: one launch
/// instead of a quantizing launch and a product, which is what counts for the small
/// matrices of a 135M model (SmolLM2's attention output, 576 x 576 Q4_1, 187 KB).
const SMALL_DQ_BYTES: usize = 1 << 20;

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
    /// ggml's layout at aligned rows ([`in_place_alignment`]), read in place: Q4_K, Q5_K
    /// and IQ4_XS on the `__dp4a` path (`mul_mat_vec_qd_c<NC>_<q>`).
    Aligned,
}

/// The alignment, in bytes, of the rows (their address and stride) that the in-place
/// decode kernels of weights `dt` read (`mul_mat_vec_qd_*`, `mul_mat_vec_id_qd_*`): the
/// widest load, up to 16 bytes, that keeps every block of such a row aligned (the largest
/// power of two dividing the block's bytes). Q4_K's and Q5_K's blocks of 144 and 176
/// bytes are read as 16-byte words, IQ4_XS's of 136 as 8-byte ones; the other types have
/// no in-place kernels.
pub(crate) fn in_place_alignment(dt: DType) -> usize {
    if let DType::Quant(q) = dt {
        let bytes = q.block_bytes();
        return (bytes & bytes.wrapping_neg()).min(16);
    }
    16
}

/// Whether the rows of `a` at `addr` are aligned for its in-place decode kernels.
fn aligned_rows(addr: u64, a: &Operand) -> bool {
    let align = in_place_alignment(a.dtype);
    addr.is_multiple_of(align as u64) && a.nb[1].is_multiple_of(align)
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

/// Thread blocks an SM holds of the one-wave kernel of weights `dt` for `ncols` columns
/// on the chosen path: the minimum its `__launch_bounds__` asks for (0 without a kernel).
fn resident(mmvq: bool, ncols: usize, dt: DType) -> u32 {
    kernel_set(mmvq, ncols, Rows::SplitOneWave)
        .and_then(|s| s.get([dt]))
        .map_or(0, |k| k.id.resident)
}

/// Whether the grid of a decode product of `m` rows fits a GPU of `sms` SMs at once, with
/// `resident` blocks an SM, so that every block can load its first weights before the
/// previous kernel ends. On the H100 that took the split Q4_0 product of [4096, 4096] from
/// 70 to 86% of the copy bandwidth and [11008, 4096] from 82 to 93%, but [4096, 11008]
/// (2,752 blocks) from 89 to 85%: blocks past the first wave gain nothing from it (a chain
/// of 48 products).
fn one_wave(m: usize, resident: u32, sms: usize) -> bool {
    m.div_ceil(ROWS) <= sms * resident as usize
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
    let copy = made(b, layout, lw);
    let small = lw.small_dq && m * a.nb[1] <= SMALL_DQ_BYTES;
    let q8 = lw.mmvq && (copy.is_some() || !small);
    let a_addr = lw.addr(a);
    let rows = match lw.weights_split(a) {
        Ok(true) if one_wave(m, resident(q8, n, a.dtype), lw.sms) => Rows::SplitOneWave,
        Ok(true) => Rows::Split,
        Ok(false) if aligned_rows(a_addr, a) => Rows::Aligned,
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
        args.vec = i64::from(b_addr.is_multiple_of(16) && (n == 1 || b.nb[1].is_multiple_of(16)));
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

#[cfg(test)]
mod tests {
    use super::{in_place_alignment, kernel_set, one_wave, resident, Rows};
    use crate::graph::DType;
    use crate::quant::QType;

    #[test]
    fn in_place_kernels_read_rows_at_their_blocks_alignment() {
        let with_kernels: Vec<QType> = QType::ALL
            .into_iter()
            .filter(|&q| {
                kernel_set(true, 1, Rows::Aligned)
                    .and_then(|s| s.get([DType::Quant(q)]))
                    .is_ok()
            })
            .collect();
        assert_eq!(with_kernels, [QType::Q4_K, QType::Q5_K, QType::IQ4_XS]);
        let aligns: Vec<usize> = with_kernels
            .iter()
            .map(|&q| in_place_alignment(DType::Quant(q)))
            .collect();
        assert_eq!(aligns, [16, 16, 8]);
        // every block of an aligned row starts aligned
        for (q, a) in with_kernels.iter().zip(aligns) {
            assert_eq!(q.block_bytes() % a, 0, "{q}");
        }
    }

    #[test]
    fn one_wave_follows_the_sm_count() {
        let q4 = DType::Quant(QType::Q4_0);
        // the kernels' launch bounds: 8 blocks an SM for 1-2 columns, 6 for 4, 4 for 8, on
        // both paths
        for mmvq in [true, false] {
            let by_cols: Vec<u32> = [1, 2, 3, 4, 5, 8].map(|n| resident(mmvq, n, q4)).to_vec();
            assert_eq!(by_cols, [8, 8, 6, 6, 4, 4]);
        }
        assert_eq!(resident(true, 9, q4), 0);
        // [4096, 4096] for one column: 1,024 blocks of 4 rows; 8 an SM fit 132 SMs (1,056
        // slots) but not an H100 PCIe's 114 (912) or an A100's 108 (864).
        assert!(one_wave(4096, 8, 132));
        assert!(!one_wave(4096, 8, 114));
        assert!(!one_wave(4096, 8, 108));
        // [11008, 4096]: 2,752 blocks, more than one wave anywhere here
        assert!(!one_wave(11_008, 8, 132));
        // 8 columns: 4 blocks an SM
        assert!(one_wave(2048, 4, 132) && !one_wave(2048, 4, 127));
        assert!(one_wave(4 * 4 * 127, 4, 127) && !one_wave(4 * 4 * 127 + 1, 4, 127));
    }
}
