//! Float decode GEMVs (`cuda/mul_mat.cu`): `mul_mat_vec_{f16,bf16,f32}` for one column
//! with dense weight rows (any row stride) and an F32 vector, one warp a row, 16-byte
//! loads when rows and the vector are 16-byte aligned; with a fused residual add, and as
//! the two launches of a folded norm (`mul_mat_vec_fold_*`, `mul_mat_vec_total_*`).

use super::{FoldPart, Gemv, ROWS};
use crate::backend::cuda::args::GemvArgs;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{row_grid, DevOp, Lowering};
use crate::backend::fusion::float_gemv;
use crate::graph::Operand;

/// The GEMV launch computing `a b` (float `a`) into the dense F32 `dst` (or `extra.dst`),
/// plus `extra.add`, or None when `a b` is not a float decode product ([`float_gemv`]).
pub(crate) fn gemv(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    extra: Gemv,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    if !float_gemv(a, b) {
        return None;
    }
    let (kk, m) = (a.ne[0], a.ne[1]);
    let set = match extra.fold {
        Some((_, FoldPart::Rows)) => by::MUL_MAT_VEC_FOLD,
        Some((_, FoldPart::Total)) => by::MUL_MAT_VEC_TOTAL,
        None => by::MUL_MAT_VEC,
    };
    let kernel = match set.get([a.dtype]) {
        Ok(kernel) => kernel,
        Err(e) => return Some(Err(e)),
    };
    let (a_addr, b_addr) = (lw.addr(a), extra.b.unwrap_or_else(|| lw.addr(b)));
    let vec = a_addr % 16 == 0 && (m == 1 || a.nb[1].is_multiple_of(16)) && b_addr % 16 == 0;
    let args = GemvArgs {
        a: a_addr,
        b: b_addr,
        dst: lw.addr(extra.dst.unwrap_or(dst)),
        k: kk as i64,
        m: m as i64,
        channels: 1,
        a_nb1: a.nb[1] as i64,
        a_nb2: 0,
        b_nb2: 0,
        dst_nb2: 0,
        ratio: 1,
        vec: i64::from(vec),
        add: extra.add.map_or(0, |r| lw.addr(r)),
        prefetch: i64::from(lw.read_only(a)),
        fold: extra.fold.map_or(0, |(at, _)| at),
    };
    Some(row_grid(m.div_ceil(ROWS)).map(|grid| {
        vec![DevOp::kernel(
            kernel,
            grid,
            ((ROWS * 32) as u32, 1, 1),
            &args,
        )]
    }))
}
