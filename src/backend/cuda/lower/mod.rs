//! Lowering per op family: one file per family, mirroring `src/ops/<family>.rs` and
//! `cuda/<family>.cu`, each turning a step of its family into [`DevOp`]s with the shared
//! machinery of [`super::lowering`]. [`lower_step`] dispatches on the op with no catch-all
//! arm; each family answers, with a reason, for any dtype or layout its kernels do not
//! handle, which is also how the backend answers
//! [`Backend::supports`](crate::backend::Backend::supports).

pub(crate) mod argmax;
pub(crate) mod attention;
pub(crate) mod binary;
pub(crate) mod collective;
pub(crate) mod cpy;
pub(crate) mod fused;
pub(crate) mod get_rows;
pub(crate) mod mmq;
pub(crate) mod mul_mat;
pub(crate) mod mul_mat_id;
pub(crate) mod mul_mat_q;
pub(crate) mod norm;
pub(crate) mod paged_attn;
pub(crate) mod rope;
pub(crate) mod softmax;
pub(crate) mod topk;
pub(crate) mod unary;

use super::lowering::{check_aligned, DevOp, Lowering};
use crate::graph::{CopyOp, Op, Step};

/// Checks that every operand of `step` is aligned to its element (the kernels' loads).
pub(crate) fn check_operands(step: &Step, lw: &Lowering) -> Result<(), String> {
    check_aligned("the result", &step.dst, lw.addr(&step.dst))?;
    for (i, s) in step.src.iter().enumerate() {
        check_aligned(&format!("source {i}"), s, lw.addr(s))?;
    }
    Ok(())
}

/// Lowers one step, or says why the CUDA backend cannot run it.
pub(crate) fn lower_step(step: &Step, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let (dst, src) = (&step.dst, &step.src[..]);
    check_operands(step, lw)?;
    match step.op {
        Op::Leaf | Op::View(_) => Ok(Vec::new()),
        Op::GetRows => get_rows::lower(src, dst, lw),
        Op::Unary(op) => unary::lower(op, src, dst, lw),
        Op::Scale { s } => unary::lower_scale(s, src, dst, lw),
        Op::Binary(op) => binary::lower(op, src, dst, lw),
        Op::Norm(op) => norm::lower(op, src, dst, lw),
        Op::MulMat => mul_mat::lower(step, lw),
        Op::MulMatId => mul_mat_id::lower(src, dst, lw),
        Op::Rope(ref p) => rope::lower(p, src, dst, lw),
        Op::Copy(CopyOp::Cpy | CopyOp::Cont) => Ok(vec![cpy::copy(lw, &src[0], dst)?]),
        Op::Copy(CopyOp::SetRows) => cpy::lower_set_rows(src, dst, lw),
        Op::Mask(op) => softmax::lower(op, src, dst, lw),
        Op::Argmax => argmax::lower(src, dst, lw),
        Op::TopK { k } => topk::lower(k, src, dst, lw),
        Op::FlashAttnExt(ref p) => attention::lower(p, src, dst, lw),
        Op::PagedAttn(ref p) => paged_attn::lower(p, src, dst, lw),
        Op::AllReduce(p) => collective::lower(p, src, dst, lw),
    }
}
