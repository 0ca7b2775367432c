//! Unary elementwise ops (`cuda/unary.cu`): each [`UnaryOp`]'s kernels come from its
//! functor ([`kernels::unary`](crate::backend::cuda::kernels::unary)), keyed by dtype.
//! Also the fused SwiGLU launch `swiglu_f32` (the fusion pass picks the steps:
//! [`SwiGlu`]).

use crate::backend::cuda::args::{GluArgs, UnaryArgs};
use crate::backend::cuda::decode::fold::NormFoldOut;
use crate::backend::cuda::decode::q8_1::{written_by_fused, Q8Copy};
use crate::backend::cuda::kernels::{self, by, k, Kernel};
use crate::backend::cuda::lowering::{elementwise_grid, same_dtype, DevOp, Lowering};
use crate::backend::fusion::SwiGlu;
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

/// SwiGLU as one launch, scaling its inputs by `fold`'s factor when it applies a folded
/// norm, and writing the Q8_1 copy of its result the next decode product reads when the
/// pass asked for it (returned; it lies after the scratch the fold holds).
pub(crate) fn lower_swiglu(
    s: &SwiGlu,
    fold: Option<&NormFoldOut>,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let mut offset = fold.map_or(0, |f| f.held);
    let ((q8, q8_nb1, q8_layout), made) = written_by_fused(s.q8.as_ref(), &mut offset, lw);
    let args = GluArgs {
        gate: lw.t4(s.gate),
        up: lw.t4(s.up),
        dst: lw.t4(s.y),
        q8,
        q8_nb1,
        q8_layout,
        fold_scale: NormFoldOut::scale_of(fold),
    };
    let (grid, block) = elementwise_grid(s.y.ne);
    Ok((vec![DevOp::kernel(k::SWIGLU_F32, grid, block, &args)], made))
}
