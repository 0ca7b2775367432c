//! Row normalizations (`cuda/norm.cu`): one block per row. Also the fused
//! `rms_norm_mul` launch (the norm and the multiplication by its weight; the fusion pass
//! picks the steps: [`RmsNormMul`]), which also writes the Q8_1 activations of the decode
//! product after it when the pass asks for them.

use crate::backend::cuda::args::{NormArgs, NormMulArgs, NORM_VEC};
use crate::backend::cuda::decode::q8_1::{written_by_fused, Q8Copy};
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{reduce_block, row_grid, same_dtype, DevOp, Lowering};
use crate::backend::fusion::{RmsNormMul, MAX_DECODE_COLS};
use crate::graph::{NormOp, Operand};

/// rms_norm or norm of `src[0]` into `dst` (same dtype).
pub(crate) fn lower(
    op: NormOp,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    let a = &src[0];
    same_dtype(op.name(), a, dst)?;
    let set = match op {
        NormOp::RmsNorm { .. } => by::RMS_NORM,
        NormOp::Norm { .. } => by::NORM,
    };
    let kernel = set.get([a.dtype])?;
    let args = NormArgs {
        src: lw.t4(a),
        dst: lw.t4(dst),
        eps: op.eps(),
        pad: 0.0,
    };
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(dst.nrows())?,
        reduce_block(dst.ne[0]),
        &args,
    )])
}

/// Shortest rows that take `rms_norm_mul`'s vector path in a decode step (a prefill's
/// many rows always do). Measured on an H100 (decode, rows written as Q8_1 too):
/// 4,096-element rows (Llama-2-7B) decode faster on it (Q4_0 377.0 against 362.3 tok/s),
/// 576-element rows (SmolLM2) slower (1,133-1,157 against 1,194-1,224), where the scalar
/// path's warp per 32 elements has more warps to spread the Q8_1 shuffles over; SmolLM2's
/// 512-token prefill was faster on it (140,506-141,467 against 122,390-123,437 tok/s).
/// Sizes between 576 and 4,096 were not measured.
const NORM_VEC_MIN: usize = 2048;

/// Whether `rms_norm_mul` can take its vector path (`rms_rows_vec` in cuda/norm.cu) for
/// `y = rms_norm(x) * w`: dense F32 rows of a multiple of 4 elements (at least
/// [`NORM_VEC_MIN`] of them in a decode step) that start on 16 bytes, at most `NORM_VEC`
/// groups of 4 a thread of a 1024-thread block, and a dense weight aligned to 4 of its
/// elements.
fn norm_vec(x: &Operand, y: &Operand, w: &Operand, lw: &Lowering) -> bool {
    let rows16 = |t: &Operand| {
        t.nb[0] == 4 && t.nb[1..].iter().all(|nb| nb % 16 == 0) && lw.addr(t).is_multiple_of(16)
    };
    let wsize = w.dtype.block_bytes();
    x.ne[0].is_multiple_of(4)
        && (x.ne[0] >= NORM_VEC_MIN || x.nrows() > MAX_DECODE_COLS)
        && x.ne[0] / 4 <= NORM_VEC as usize * 1024
        && rows16(x)
        && rows16(y)
        && w.nb[0] == wsize
        && lw.addr(w).is_multiple_of(4 * wsize as u64)
}

/// Threads of a vector-path `rms_norm_mul` block for rows of `ne0` elements: `NORM_VEC`
/// groups of 4 a thread, whole warps.
fn norm_vec_threads(ne0: usize) -> u32 {
    (ne0 / 4)
        .div_ceil(NORM_VEC as usize)
        .next_multiple_of(32)
        .clamp(32, 1024) as u32
}

/// `rms_norm(x) * w` into `y` as one launch (F32 rows, `w` one row), also writing the
/// Q8_1 copy of `y` the next decode product reads when the pass asked for it (returned).
pub(crate) fn lower_mul(
    n: &RmsNormMul,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let (x, w, y) = (n.x, n.w, n.y);
    let kernel = by::RMS_NORM_MUL.get([x.dtype, w.dtype])?;
    let ((q8, q8_nb1, q8_layout), made) = written_by_fused(n.q8.as_ref(), &mut 0, lw);
    let vec = norm_vec(x, y, w, lw);
    let args = NormMulArgs {
        src: lw.t4(x),
        dst: lw.t4(y),
        w: lw.t4(w),
        eps: n.eps,
        vec: i32::from(vec),
        q8,
        q8_nb1,
        q8_layout,
        // a weight, read while the previous kernel of the plan finishes
        w_early: i64::from(lw.read_only(w) && lw.launched),
    };
    // The vector path: NORM_VEC groups of 4 elements a thread. Otherwise a decode step
    // normalizes a few rows: a warp per 32 elements (up to 1024 threads) keeps it short; a
    // prefill has rows enough for a warp each (a wide block for long rows).
    let threads = match (vec, x.nrows() <= MAX_DECODE_COLS, x.ne[0] <= 1024) {
        (true, _, _) => norm_vec_threads(x.ne[0]),
        (false, true, _) => x.ne[0].next_multiple_of(32).min(1024) as u32,
        (false, false, true) => 32,
        (false, false, false) => 1024,
    };
    let op = DevOp::kernel(kernel, row_grid(y.nrows())?, (threads, 1, 1), &args);
    Ok((vec![op], made))
}
