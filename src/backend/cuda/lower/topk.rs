//! top_k (`cuda/topk.cu`): one block of `TOPK_THREADS` threads per row.

use crate::backend::cuda::args::{TopKArgs, TOPK_THREADS};
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{expect_i32, row_grid, DevOp, Lowering};
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
    let kernel = by::TOP_K.get([a.dtype])?;
    let args = TopKArgs {
        src: lw.t4(a),
        dst: lw.t4(dst),
        k: k as i64,
    };
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(a.nrows())?,
        (TOPK_THREADS as u32, 1, 1),
        &args,
    )])
}
