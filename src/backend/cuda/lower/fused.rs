//! Lowering of a plan's step groups ([`crate::backend::fusion`]): each [`Fused`] kind
//! becomes its launches, a [`Fused::Step`] the launches of its op family ([`lower_step`]).
//! The ops of a group are listed under its first step; the other steps get none.
//!
//! What passes from one group to the next is explicit: the Q8_1 copy of activations a
//! group made (the next decode products read it, [`Lowering::step_done`]) and the
//! factor of a folded norm ([`NormFoldOut`]), which the group after a
//! [`Fused::NormFold`] applies.

use super::{
    attention, binary, check_operands, lower_step, mmq, mul_mat, mul_mat_id, norm, paged_attn,
    rope, unary,
};
use crate::backend::cuda::args::MOE_SUM_STAGE;
use crate::backend::cuda::decode::fold::{self, NormFoldOut};
use crate::backend::cuda::decode::{gemv_add, q8_1::Q8Copy};
use crate::backend::cuda::lowering::{DevOp, Lowering, QuantPath};
use crate::backend::fusion::{Fused, Group, Target};
use crate::graph::{Loc, Op, Plan, Step};

/// What the fusion pass is told of the kernels `lw` lowers to: whether the decode products
/// with block-quantized weights read Q8_1 activations (on the `__dp4a` path,
/// [`Lowering::mmvq`], or forced onto the int8 tensor cores, [`QuantPath::Mmq`]), up to
/// how many columns the other products do (the int8 tensor-core product, by the
/// lowering's [`QuantPath`] and for the 32-element types whether `mmr_*` is on), that the
/// products on F16 tensor cores and cuBLAS read an F16 copy, up to how many columns the
/// tensor cores take, from how many columns a decode product takes them, up to how many
/// tokens a `mul_mat_id` runs on the decode kernels, and how many routing weights the
/// weighted sum of a mixture of experts stages.
pub(crate) fn target(lw: &Lowering) -> Target {
    Target {
        q8_1: lw.mmvq || lw.quant_path == QuantPath::Mmq,
        batched_cols: mmq::q8_cols(lw.quant_path),
        batched_cols_32: mmq::q8_cols_32(lw.quant_path, lw.mmr),
        f16_copies: true,
        tensor_cols: mmq::max_cols(lw.quant_path),
        batched_from: mmq::from_cols(lw.quant_path),
        expert_decode_tokens: mul_mat_id::decode_tokens(lw.quant_path),
        moe_sum_stage: MOE_SUM_STAGE as usize,
    }
}

/// Lowers the groups of `plan` (from [`crate::backend::fusion::fuse`] or
/// [`crate::backend::fusion::unfused`]): the ops of each step, a group's under its first
/// step. `tag(i)` is the index-error tag of step `i`. Errors give the step and the reason.
pub(crate) fn lower_plan<'s>(
    plan: &'s Plan,
    groups: &[Group<'s>],
    lw: &mut Lowering,
    tag: impl Fn(usize) -> i64,
) -> Result<Vec<Vec<DevOp>>, (&'s Step, String)> {
    lw.written = plan
        .steps
        .iter()
        .filter_map(|s| match s.dst.loc {
            Loc::Buffer(b, _) => Some(b),
            Loc::Arena(_) => None,
        })
        .collect();
    let mut steps = Vec::with_capacity(plan.steps.len());
    let mut pending = None;
    for g in groups {
        let step = &plan.steps[g.first];
        // a rope_store launch reports a bad id as its K write's
        lw.tag = tag(match &g.fused {
            Fused::RopeStore(s) => s.k_write,
            Fused::Step
            | Fused::RmsNormMul(_)
            | Fused::SwiGlu(_)
            | Fused::GemvAdd(_)
            | Fused::ProductAdd(_)
            | Fused::Attention(_)
            | Fused::NormFold(_)
            | Fused::MoeSum(_)
            | Fused::ExpertPair(_) => g.first,
        });
        let (ops, made) = lower_group(step, &g.fused, &mut pending, lw).map_err(|e| (step, e))?;
        lw.launched |= !ops.is_empty();
        steps.push(ops);
        steps.extend((1..g.len).map(|_| Vec::new()));
        lw.step_done(
            plan.steps[g.first..g.first + g.len].iter().map(|s| &s.dst),
            made,
        );
    }
    match (pending, plan.steps.last()) {
        (Some(_), Some(last)) => Err((
            last,
            "internal: a folded norm's factor was not applied".into(),
        )),
        _ => Ok(steps),
    }
}

/// The launches of one group, and the Q8_1 copy of its result it made for the next
/// decode product. `pending`: the factor a [`Fused::NormFold`] group leaves for the next
/// group, which takes it.
fn lower_group(
    step: &Step,
    fused: &Fused,
    pending: &mut Option<NormFoldOut>,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let applied = pending.take();
    if fused.folded() != applied.is_some() {
        return Err("internal: a folded norm's factor and the launch that applies it are not next to each other".into());
    }
    match fused {
        Fused::Step => Ok((lower_step(step, lw)?, None)),
        Fused::RmsNormMul(n) => norm::lower_mul(n, lw),
        Fused::SwiGlu(s) => unary::lower_swiglu(s, applied.as_ref(), lw),
        Fused::GemvAdd(g) => Ok((gemv_add(g, lw)?, None)),
        Fused::ProductAdd(p) => Ok((mul_mat::lower_product_add(p, lw)?, None)),
        Fused::RopeStore(s) => Ok((rope::lower_store(s, applied.as_ref(), lw)?, None)),
        Fused::Attention(q8) => {
            check_operands(step, lw)?;
            if let Op::PagedAttn(p) = &step.op {
                return paged_attn::lower_writing(p, &step.src, &step.dst, Some(q8), lw);
            }
            let Op::FlashAttnExt(p) = &step.op else {
                return Err(
                    "internal: a fused attention step that is neither flash_attn_ext nor paged_attn"
                        .into(),
                );
            };
            attention::lower_writing(p, &step.src, &step.dst, Some(q8), lw)
        }
        Fused::NormFold(f) => {
            let (ops, out) = fold::lower(f, lw)?;
            *pending = Some(out);
            Ok((ops, None))
        }
        Fused::MoeSum(s) => Ok((binary::lower_moe_sum(s, lw)?, None)),
        Fused::ExpertPair(p) => Ok((mul_mat_id::lower_pair(p, lw)?, None)),
    }
}
