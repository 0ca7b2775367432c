//! Copies and conversions (`cuda/cpy.cu`): cpy, cont / cast, set_rows, and the scratch
//! copies of other families (mul_mat's operands).

use crate::backend::cuda::args::{
    CpyArgs, RowsArgs, Tensor4, CPY_CONTIGUOUS, CPY_RESHAPE, CPY_SAME_SHAPE,
};
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{expect_i32, flat_grid, DevOp, Lowering};
use crate::graph::Operand;

/// A copy of `src` into the layout `dst` (elements matched in row-major order), with
/// conversion; `dst_addr` overrides where `dst` lives (scratch copies of mul_mat).
pub(crate) fn copy_to(
    lw: &Lowering,
    src: &Operand,
    dst: &Operand,
    dst_addr: u64,
) -> Result<DevOp, String> {
    let kernel = by::CPY.get([src.dtype, dst.dtype])?;
    let n = src.nelements();
    if n != dst.nelements() {
        return Err(format!(
            "cpy of {n} elements into {} elements",
            dst.nelements()
        ));
    }
    let mode = if src.is_contiguous() && dst.is_contiguous() {
        CPY_CONTIGUOUS
    } else if src.ne == dst.ne {
        CPY_SAME_SHAPE
    } else {
        CPY_RESHAPE
    };
    let args = CpyArgs {
        src: lw.t4(src),
        dst: Tensor4::new(dst_addr, dst),
        n: n as i64,
        mode,
    };
    let (grid, block) = flat_grid(n);
    Ok(DevOp::kernel(kernel, grid, block, &args))
}

/// A copy of `src` into `dst` where `dst` lives.
pub(crate) fn copy(lw: &Lowering, src: &Operand, dst: &Operand) -> Result<DevOp, String> {
    copy_to(lw, src, dst, lw.addr(dst))
}

/// set_rows: rows of `src[0]` into the rows `src[1]` of `dst`, one thread per element.
pub(crate) fn lower_set_rows(
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    let (s, ids) = (&src[0], &src[1]);
    expect_i32("set_rows ids", ids)?;
    let kernel = by::SET_ROWS.get([s.dtype, dst.dtype])?;
    let args = RowsArgs {
        src: lw.t4(s),
        ids: lw.t4(ids),
        dst: lw.t4(dst),
        err: lw.err,
        tag: lw.tag,
    };
    let (grid, block) = flat_grid(s.nelements());
    Ok(vec![DevOp::kernel(kernel, grid, block, &args)])
}
