//! Row normalizations (`cuda/norm.cu`): one block per row.

use crate::backend::cuda::args::NormArgs;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{reduce_block, row_grid, same_dtype, DevOp, Lowering};
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
