//! Unary elementwise ops (`cuda/unary.cu`): each [`UnaryOp`]'s kernels come from its
//! functor ([`kernels::unary`](crate::backend::cuda::kernels::unary)), keyed by dtype.

use crate::backend::cuda::args::UnaryArgs;
use crate::backend::cuda::kernels::{self, by, Kernel};
use crate::backend::cuda::lowering::{elementwise_grid, same_dtype, DevOp, Lowering};
use crate::graph::{Operand, UnaryOp};

fn launch(
    kernel: Kernel<UnaryArgs>,
    scale: f32,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> DevOp {
    let args = UnaryArgs {
        src: lw.t4(&src[0]),
        dst: lw.t4(dst),
        scale,
        pad: 0.0,
    };
    let (grid, block) = elementwise_grid(dst.ne);
    DevOp::kernel(kernel, grid, block, &args)
}

/// `op(src[0])` into `dst` (same dtype).
pub(crate) fn lower(
    op: UnaryOp,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    same_dtype(op.name(), &src[0], dst)?;
    let kernel = kernels::unary(op).get([dst.dtype])?;
    Ok(vec![launch(kernel, 1.0, src, dst, lw)])
}

/// `src[0] * s` into `dst` (same dtype).
pub(crate) fn lower_scale(
    s: f32,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    same_dtype("scale", &src[0], dst)?;
    let kernel = by::SCALE.get([dst.dtype])?;
    Ok(vec![launch(kernel, s, src, dst, lw)])
}
