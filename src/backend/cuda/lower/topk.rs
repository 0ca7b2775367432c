//! top_k (`cuda/topk.cu`): one block of `TOPK_THREADS` threads per row, or for rows of at
//! most `TOPK_WARP_MAX` elements and `k` up to a warp (a mixture of experts' router
//! logits) one warp per row, `TOPK_WARP_ROWS` rows a block.

use crate::backend::cuda::args::{TopKArgs, TOPK_THREADS, TOPK_WARP_MAX, TOPK_WARP_ROWS};
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{expect_i32, row_grid, DevOp, Lowering, WARP};
use crate::graph::Operand;

/// The I32 indices of the `k` largest elements of each row of `src[0]` into `dst`.
pub(crate) fn lower(
    k: usize,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    let a = &src[0];
    expect_i32("top_k result", dst)?;
    if a.ne[0] > i32::MAX as usize {
        return Err(format!("top_k over rows of {} elements", a.ne[0]));
    }
    if k == 0 || k > TOPK_THREADS as usize {
        return Err(format!(
            "top_k with k = {k}: the kernel takes 1..={TOPK_THREADS}"
        ));
    }
    let args = TopKArgs {
        src: lw.t4(a),
        dst: lw.t4(dst),
        k: k as i64,
    };
    if a.ne[0] <= TOPK_WARP_MAX as usize && k <= WARP.min(a.ne[0]) {
        let rows = TOPK_WARP_ROWS as usize;
        return Ok(vec![DevOp::kernel(
            by::TOP_K_WARP.get([a.dtype])?,
            row_grid(a.nrows().div_ceil(rows))?,
            ((rows * WARP) as u32, 1, 1),
            &args,
        )]);
    }
    Ok(vec![DevOp::kernel(
        by::TOP_K.get([a.dtype])?,
        row_grid(a.nrows())?,
        (TOPK_THREADS as u32, 1, 1),
        &args,
    )])
}
