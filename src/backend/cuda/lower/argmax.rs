//! Argmax (`cuda/argmax.cu`): one block per row.

use crate::backend::cuda::args::ArgmaxArgs;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{expect_i32, reduce_block, row_grid, DevOp, Lowering};
use crate::graph::Operand;

/// The I32 index of the largest element of each row of `src[0]` into `dst`.
pub(crate) fn lower(src: &[Operand], dst: &Operand, lw: &Lowering) -> Result<Vec<DevOp>, String> {
    let a = &src[0];
    expect_i32("argmax result", dst)?;
    if a.ne[0] > i32::MAX as usize {
        return Err(format!("argmax over rows of {} elements", a.ne[0]));
    }
    let kernel = by::ARGMAX.get([a.dtype])?;
    let args = ArgmaxArgs {
        src: lw.t4(a),
        dst: lw.t4(dst),
    };
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(a.nrows())?,
        reduce_block(a.ne[0]),
        &args,
    )])
}
