//! Copies and conversions (`cuda/cpy.cu`): cpy, cont / cast, set_rows, and the scratch
//! copies of other families (mul_mat's operands). Copies from or to a block-quantized
//! type go to `cuda/convert.cu` (`cpy_<q>_{f32,f16}`: one thread per 8 elements) and
//! `cuda/quantize.cu` (`cpy_f32_<q>`: one thread per block), see [`block_copy`].

use crate::backend::cuda::args::{
    CpyArgs, RowsArgs, Tensor4, CPY_CONTIGUOUS, CPY_RESHAPE, CPY_SAME_SHAPE,
};
use crate::backend::cuda::kernels::{by, Kernel};
use crate::backend::cuda::lowering::{expect_i32, flat_grid, DevOp, Lowering};
use crate::graph::{DType, Operand};

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
    if src.dtype.quant().is_some() || dst.dtype.quant().is_some() {
        return block_copy(lw, kernel, src, dst, dst_addr);
    }
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
    // Dense, 16-byte aligned float copies take 8 elements a thread (cuda/cpy.cu).
    let vec8 = mode == CPY_CONTIGUOUS
        && n.is_multiple_of(8)
        && src.dtype != DType::I32
        && args.src.data.is_multiple_of(16)
        && dst_addr.is_multiple_of(16);
    let (grid, block) = flat_grid(if vec8 { n / 8 } else { n });
    Ok(DevOp::kernel(kernel, grid, block, &args))
}

/// A copy from or to a block-quantized type with `kernel` (one that exists: F32 -> block
/// type, block type -> F32 / F16). The block side needs dense blocks along dim 0 (any
/// row strides); quantizing needs the same shape on both sides, dequantizing matches
/// elements in row-major order when the shapes differ.
fn block_copy(
    lw: &Lowering,
    kernel: Kernel<CpyArgs>,
    src: &Operand,
    dst: &Operand,
    dst_addr: u64,
) -> Result<DevOp, String> {
    let n = src.nelements();
    if n != dst.nelements() {
        return Err(format!(
            "cpy of {n} elements into {} elements",
            dst.nelements()
        ));
    }
    let mut args = CpyArgs {
        src: lw.t4(src),
        dst: Tensor4::new(dst_addr, dst),
        n: n as i64,
        mode: if src.ne == dst.ne {
            CPY_SAME_SHAPE
        } else {
            CPY_RESHAPE
        },
    };
    match (src.dtype.quant(), dst.dtype.quant()) {
        (Some(q), None) => {
            if !src.rows_contiguous() {
                return Err(format!(
                    "dequantizing {q} needs dense blocks along dim 0 (nb[0] = {}), got {:?}",
                    q.block_bytes(),
                    src.nb
                ));
            }
            let (grid, block) = flat_grid(n / 8);
            Ok(DevOp::kernel(kernel, grid, block, &args))
        }
        (None, Some(q)) => {
            if !dst.rows_contiguous() || src.ne != dst.ne {
                return Err(format!(
                    "quantizing to {q} needs the same shape on both sides and dense blocks \
                     along dim 0 of the result, got {:?} into {:?} (nb {:?})",
                    src.ne, dst.ne, dst.nb
                ));
            }
            args.n = (n / q.block_size()) as i64;
            let (grid, block) = flat_grid(args.n as usize);
            Ok(DevOp::kernel(kernel, grid, block, &args))
        }
        (Some(a), Some(b)) => Err(format!("no copy between block types ({a} to {b})")),
        (None, None) => Err("a block copy between plain dtypes".into()),
    }
}

/// A copy of `src` into `dst` where `dst` lives.
pub(crate) fn copy(lw: &Lowering, src: &Operand, dst: &Operand) -> Result<DevOp, String> {
    copy_to(lw, src, dst, lw.addr(dst))
}

/// set_rows: rows of `src[0]` into the rows `src[1]` of `dst`, one thread per element,
/// or per block when `dst` is quantized (`cuda/quantize.cu`: F32 sources).
pub(crate) fn lower_set_rows(
    src: &[Operand],
    dst: &Operand,
    lw: &Lowering,
) -> Result<Vec<DevOp>, String> {
    let (s, ids) = (&src[0], &src[1]);
    expect_i32("set_rows ids", ids)?;
    let kernel = by::SET_ROWS.get([s.dtype, dst.dtype])?;
    let threads = match dst.dtype.quant() {
        Some(q) if s.ne[0] % q.block_size() == 0 => s.nelements() / q.block_size(),
        Some(q) => {
            return Err(format!(
                "set_rows: rows of {} elements are not whole {} blocks of {}",
                s.ne[0],
                dst.dtype,
                q.block_size()
            ))
        }
        None => s.nelements(),
    };
    let args = RowsArgs {
        src: lw.t4(s),
        ids: lw.t4(ids),
        dst: lw.t4(dst),
        err: lw.err,
        tag: lw.tag,
    };
    let (grid, block) = flat_grid(threads);
    Ok(vec![DevOp::kernel(kernel, grid, block, &args)])
}
