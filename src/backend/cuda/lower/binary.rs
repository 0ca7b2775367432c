//! Binary elementwise ops (`cuda/binary.cu`): each [`BinaryOp`]'s kernels come from its
//! functor ([`kernels::binary`](crate::backend::cuda::kernels::binary)), keyed by the
//! dtypes of both operands. Also the fused launch `moe_sum_f32`, a mixture of experts'
//! mul by its routing weights and adds of its expert slots (the fusion pass picks the
//! steps: [`MoeSum`]).

use crate::backend::cuda::args::{BinaryArgs, MoeSumArgs, MOE_SUM_THREADS};
use crate::backend::cuda::kernels::{self, k};
use crate::backend::cuda::lowering::{
    check_aligned, elementwise_grid, same_dtype, DevOp, Lowering,
};
use crate::backend::fusion::MoeSum;
use crate::graph::{BinaryOp, Operand};

#[cfg(test)]
mod tests;

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

/// A mixture of experts' weighted sum as one launch: `out[e, t]` is the sum over the
/// expert slots `i`, in order, of `ys[e, i, t] * w[0, i, t]`, plus the residual when its
/// add is fused (one thread an element; one block when it stages the weights, which it
/// reads, or makes from the router's logits when routed, before it writes).
pub(crate) fn lower_moe_sum(s: &MoeSum, lw: &Lowering) -> Result<Vec<DevOp>, String> {
    let route = s.route.as_ref();
    let checked = [
        ("the outputs", Some(s.ys)),
        ("the weights", Some(s.w)),
        ("the sum", Some(s.out)),
        ("the residual", s.residual),
        ("the router's logits", route.map(|r| r.logits)),
        ("the experts' ids", route.map(|r| r.ids)),
    ];
    for (what, t) in checked {
        if let Some(t) = t {
            check_aligned(what, t, lw.addr(t))?;
        }
    }
    let t4 = |t: Option<&Operand>| t.map(|t| lw.t4(t)).unwrap_or_default();
    let args = MoeSumArgs {
        y: lw.t4(s.ys),
        w: lw.t4(s.w),
        dst: lw.t4(s.out),
        r: t4(s.residual),
        logits: t4(route.map(|r| r.logits)),
        ids: t4(route.map(|r| r.ids)),
        staged: i64::from(s.staged),
    };
    let (grid, block) = match s.staged {
        true => ((1, 1, 1), (MOE_SUM_THREADS as u32, 1, 1)),
        false => elementwise_grid(s.out.ne),
    };
    Ok(vec![DevOp::kernel(k::MOE_SUM_F32, grid, block, &args)])
}
