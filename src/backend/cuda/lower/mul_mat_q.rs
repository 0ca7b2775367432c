//! mul_mat with block-quantized weights (`a` of a [`QType`](crate::quant::QType), dense
//! blocks along dim 0 at any row stride) and F32 activations `b`, F32 dense result.
//!
//! Which path a product takes, by its activation columns `n` (all of `b`'s columns,
//! batches included): the thresholds are
//! [`MAX_DECODE_COLS`](crate::backend::fusion::MAX_DECODE_COLS) and
//! [`MMQ_MAX_COLS`](super::mmq::MMQ_MAX_COLS), set from `graft bench-ops`, which times
//! each path at 8 to 512 columns on the Llama-2-7B shapes ([`QuantPath`] forces one for it
//! and for tests):
//!
//! 1. Decode (`n <= MAX_DECODE_COLS`, no batches): the decode products of
//!    [`crate::backend::cuda::decode::quant`]; from
//!    [`MMQ_FROM_COLS`](super::mmq::MMQ_FROM_COLS) columns on, the int8 tensor-core
//!    product instead where the weights' type has it (the fusion pass then leaves its
//!    residual add a step of its own: [`crate::backend::fusion::Target::batched_from`]).
//! 2. Batched (`n <= MMQ_MAX_COLS`, one weight matrix: a batched decode step of 8 to 64
//!    sequences, a short prefill chunk): the int8 tensor-core product ([`super::mmq`]),
//!    which reads the weights once per 64 columns, where the decode kernels read them
//!    once per 8 and the F16 copy writes and reads 2 bytes a weight.
//! 3. Everything else (long prefills, batched weights): `cpy_<q>_f16` dequantizes the
//!    weights into scratch as F16 rows padded to 16 bytes (`cpy_split_<q>_f16` for frozen
//!    weights in split rows, [`crate::backend::cuda::split`]), then the cuBLAS path of
//!    [`super::mul_mat`] runs on them (activations converted to F16 as for F16 weights).
//!    The scratch is part of the loaded plan, so both stay inside a captured graph.

use super::cpy::copy_to;
use super::mmq;
use super::mul_mat::{lower_gemm, padded, Out};
use crate::backend::cuda::args::{CpyArgs, Tensor4, CPY_SAME_SHAPE};
use crate::backend::cuda::decode;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{flat_grid, DevOp, Lowering, QuantPath};
use crate::graph::{DType, Operand};
use crate::quant::QType;

/// Lowers `out = a b` with block-quantized `a` of type `q`.
pub(crate) fn lower(
    q: QType,
    a: &Operand,
    b: &Operand,
    out: Out,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let dst = out.dst;
    if b.dtype != DType::F32 {
        return Err(format!(
            "mul_mat of {q} weights needs F32 activations, got {}",
            b.dtype
        ));
    }
    if dst.dtype != DType::F32 || !dst.is_contiguous() {
        return Err("mul_mat needs a dense F32 result".into());
    }
    if !a.rows_contiguous() {
        return Err(format!(
            "mul_mat of {q} weights needs dense blocks along dim 0, got strides {:?}",
            a.nb
        ));
    }
    let (kk, a2, a3) = (a.ne[0], a.ne[2], a.ne[3]);
    if b.ne[0] != kk || !b.ne[2].is_multiple_of(a2) || !b.ne[3].is_multiple_of(a3) {
        return Err(format!("mul_mat of {:?} by {:?}", a.ne, b.ne));
    }
    let tensor_cores_first = match lw.quant_path {
        QuantPath::Mmq | QuantPath::Mmh => true,
        QuantPath::Auto => b.nrows() >= mmq::MMQ_FROM_COLS && mmq::takes(a, b, lw),
        QuantPath::Dequant => false,
    };
    if !tensor_cores_first {
        if let Some(ops) = decode::gemv(a, b, dst, out.gemv(), lw) {
            return ops;
        }
    }
    if let Some(ops) = mmq::lower(a, b, out, lw) {
        return ops;
    }
    // Prefill: F16 copy of the weights in scratch, then cuBLAS.
    let dense = padded(a, DType::F16);
    let mut offset = 0usize;
    let addr = lw.reserve_scratch(&mut offset, dense.nbytes());
    let copy = match lw.weights_split(a)? {
        true => split_copy(lw, a, &dense, addr)?,
        false => copy_to(lw, a, &dense, addr)?,
    };
    lower_gemm(&dense, addr, b, out, lw, offset, vec![copy])
}

/// `cpy_split_<q>_f16`: the F16 copy of weights `a` in split rows into the dense,
/// 16-byte aligned rows `dense` at `addr` (the only copy the kernel makes: see
/// cuda/convert.cu).
fn split_copy(lw: &Lowering, a: &Operand, dense: &Operand, addr: u64) -> Result<DevOp, String> {
    let n = a.nelements();
    let rows = n / a.ne[0];
    let fits = dense.ne == a.ne
        && dense.nb[0] == 2
        && dense.nb[1].is_multiple_of(16)
        && addr.is_multiple_of(16)
        && (rows == 1 || dense.nb[2] == dense.nb[1] * dense.ne[1])
        && dense.nb[3] == dense.nb[2] * dense.ne[2]
        && n / 8 < i32::MAX as usize;
    if !fits {
        return Err(format!(
            "the F16 copy of frozen {} weights {:?} needs dense 16-byte aligned rows, got strides {:?}",
            a.dtype, a.ne, dense.nb
        ));
    }
    let args = CpyArgs {
        src: lw.t4(a),
        dst: Tensor4::new(addr, dense),
        n: n as i64,
        mode: CPY_SAME_SHAPE,
    };
    let (grid, block) = flat_grid(n / 8);
    let kernel = by::CPY_SPLIT.get([a.dtype, DType::F16])?;
    Ok(DevOp::kernel(kernel, grid, block, &args))
}
