//! Binary elementwise ops (`cuda/binary.cu`): each [`BinaryOp`]'s kernels come from its
//! functor ([`kernels::binary`](crate::backend::cuda::kernels::binary)), keyed by the
//! dtypes of both operands.

use crate::backend::cuda::args::BinaryArgs;
use crate::backend::cuda::kernels;
use crate::backend::cuda::lowering::{elementwise_grid, same_dtype, DevOp, Lowering};
use crate::graph::{BinaryOp, Operand};

/// `op(src[0], src[1])` into `dst` (dtype of `src[0]`), `src[1]` broadcast.
pub(crate) fn lower(
    op: BinaryOp,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    let (a, b) = (&src[0], &src[1]);
    same_dtype(op.name(), a, dst)?;
    let kernel = kernels::binary(op).get([a.dtype, b.dtype])?;
    let args = BinaryArgs {
        a: lw.t4(a),
        b: lw.t4(b),
        dst: lw.t4(dst),
    };
    let (grid, block) = elementwise_grid(dst.ne);
    Ok(vec![DevOp::kernel(kernel, grid, block, &args)])
}
