//! Masks and softmax (`cuda/softmax.cu`): diag_mask_inf elementwise, soft_max one block
//! per row, with or without an additive mask.

use crate::backend::cuda::args::{DiagMaskArgs, SoftMaxArgs};
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{
    elementwise_grid, reduce_block, row_grid, same_dtype, DevOp, Lowering,
};
use crate::graph::{MaskOp, Operand};

/// diag_mask_inf or soft_max of `src[0]` (mask `src[1]`, if any) into `dst`.
pub(crate) fn lower(
    op: MaskOp,
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    let a = &src[0];
    same_dtype(op.name(), a, dst)?;
    match op {
        MaskOp::DiagMaskInf { n_past } => {
            let kernel = by::DIAG_MASK_INF.get([a.dtype])?;
            let args = DiagMaskArgs {
                src: lw.t4(a),
                dst: lw.t4(dst),
                n_past: n_past as i64,
            };
            let (grid, block) = elementwise_grid(dst.ne);
            Ok(vec![DevOp::kernel(kernel, grid, block, &args)])
        }
        MaskOp::SoftMax { scale } => {
            let mask = src.get(1);
            let kernel = match mask {
                None => by::SOFT_MAX.get([a.dtype])?,
                Some(m) => by::SOFT_MAX_MASK.get([a.dtype, m.dtype])?,
            };
            let args = SoftMaxArgs {
                src: lw.t4(a),
                mask: mask.map(|m| lw.t4(m)).unwrap_or_default(),
                dst: lw.t4(dst),
                scale,
                pad: 0.0,
            };
            Ok(vec![DevOp::kernel(
                kernel,
                row_grid(dst.nrows())?,
                reduce_block(dst.ne[0]),
                &args,
            )])
        }
    }
}
