//! get_rows (`cuda/get_rows.cu`; block-quantized tables: `get_rows_<q>` in
//! `cuda/convert.cu`): one block per result row.

use crate::backend::cuda::args::RowsArgs;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{expect_i32, loop_block, row_grid, DevOp, Lowering};
use crate::graph::{DType, Operand};

/// Rows of `src[0]` picked by the ids `src[1]` into the F32 `dst`.
pub(crate) fn lower(src: &[Operand], dst: &Operand, lw: &Lowering) -> Result<Vec<DevOp>, String> {
    let (table, ids) = (&src[0], &src[1]);
    let kernel = by::GET_ROWS.get([table.dtype])?;
    expect_i32("get_rows ids", ids)?;
    if table.dtype.quant().is_some() && !table.rows_contiguous() {
        return Err(format!(
            "get_rows from a {} table needs dense blocks along dim 0, got strides {:?}",
            table.dtype, table.nb
        ));
    }
    if dst.dtype != DType::F32 {
        return Err(format!("get_rows needs an F32 result, got {}", dst.dtype));
    }
    let args = RowsArgs {
        src: lw.t4(table),
        ids: lw.t4(ids),
        dst: lw.t4(dst),
        err: lw.err,
        tag: lw.tag,
    };
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(dst.nrows())?,
        loop_block(dst.ne[0]),
        &args,
    )])
}
