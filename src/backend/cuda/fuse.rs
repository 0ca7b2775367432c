//! Kernel fusion at load time. Two consecutive steps become one launch when the first
//! one's result is read by the second alone (no other step, no view, not an output), so
//! skipping its write changes nothing a caller or a later step can see:
//!
//! | steps | launch |
//! | --- | --- |
//! | `rms_norm(x)`, `mul(that, w)`, `w` one row broadcast | `rms_norm_mul_f32_*` |
//! | `silu(gate)`, `mul(that, up)`, same shape | `swiglu_f32` |
//! | decode GEMV `mul_mat(w, v)`, `add(r, that)` or `add(that, r)`, same shape | `mul_mat_vec_*` (block weights: `mul_mat_vec_q_*` / `mul_mat_vec_dq_*`, 1..=8 columns) with `add = r` |
//!
//! The second step then has no launch of its own. (Folding the norm into the GEMV that
//! reads it, each warp summing x^2 itself, measured no faster on an H100 and was dropped.) A fused kernel still reads the first
//! step's sources while it writes the second step's result, which the allocator may have
//! placed in memory one of those sources had (free once the first step was done): so a
//! pair fuses only when the result overlaps no source it is read alongside, except the
//! exact same layout for sources read element by element at the index being written
//! (`x`, `gate`, `up`, `r`), which is the in-place case.

use std::collections::HashMap;

use super::args::{BinaryArgs, NormMulArgs};
use super::kernels::{by, k};
use super::lower::lower_step;
use super::lower::mul_mat::{self, Gemv};
use super::lowering::{disjoint, elementwise_grid, row_grid, DevOp, Lowering};
use crate::graph::{
    AllocKind, BinaryOp, DType, Loc, NormOp, Op, Operand, Plan, Step, TensorId, UnaryOp,
};

/// Lowers every step of `plan`, fusing pairs when `fusion` is on (a fused pair's ops are
/// listed under its first step, the second gets none). `tag(i)` is the index-error tag
/// of step `i`. Errors give the step and the reason.
pub(crate) fn lower_plan<'s>(
    plan: &'s Plan,
    lw: &mut Lowering,
    fusion: bool,
    tag: impl Fn(usize) -> i64,
) -> Result<Vec<Vec<DevOp>>, (&'s Step, String)> {
    let readers = readers(plan);
    lw.written = plan
        .steps
        .iter()
        .filter_map(|s| match s.dst.loc {
            Loc::Buffer(b, _) => Some(b),
            Loc::Arena(_) => None,
        })
        .collect();
    let mut steps = Vec::with_capacity(plan.steps.len());
    let mut i = 0;
    while i < plan.steps.len() {
        let step = &plan.steps[i];
        lw.tag = tag(i);
        let fused = match plan.steps.get(i + 1) {
            Some(next) if fusion => fuse(step, next, &readers, lw),
            _ => None,
        };
        if let Some(ops) = fused {
            steps.push(ops.map_err(|reason| (step, reason))?);
            steps.push(Vec::new());
            lw.wrote(&step.dst);
            lw.wrote(&plan.steps[i + 1].dst);
            i += 2;
            continue;
        }
        steps.push(lower_step(step, lw).map_err(|reason| (step, reason))?);
        lw.wrote(&step.dst);
        i += 1;
    }
    Ok(steps)
}

/// How many times each tensor's memory is read: by step sources (through views too) and
/// as a plan output.
fn readers(plan: &Plan) -> HashMap<TensorId, usize> {
    let base = |id: TensorId| match plan.alloc.info.get(id).map(|i| i.kind) {
        Some(AllocKind::View(b)) => b,
        _ => id,
    };
    let mut n = HashMap::new();
    let srcs = plan.steps.iter().flat_map(|s| s.src.iter());
    for op in srcs.chain(plan.outputs.iter().map(|io| &io.operand)) {
        *n.entry(base(op.id)).or_insert(0) += 1;
    }
    n
}

fn dense_f32(x: &Operand) -> bool {
    x.dtype == DType::F32 && x.is_contiguous()
}

/// Whether `x` and `y` share no byte or are the very same elements.
fn disjoint_or_same(x: &Operand, y: &Operand) -> bool {
    disjoint(x, y) || (x.loc == y.loc && x.ne == y.ne && x.nb == y.nb)
}

/// The other operand `r` of `add`, when `add` adds the dense F32 result of `mm` (read by
/// it alone) and a dense F32 `r` of the same shape into a dense F32 result.
fn residual_of<'s>(
    mm: &Step,
    add: &'s Step,
    readers: &HashMap<TensorId, usize>,
) -> Option<&'s Operand> {
    let mid = &mm.dst;
    if add.op != Op::Binary(BinaryOp::Add) || readers.get(&mid.id) != Some(&1) {
        return None;
    }
    let residual = match (&add.src[0], &add.src[1]) {
        (r, m) | (m, r) if m.id == mid.id && r.id != mid.id => r,
        _ => return None,
    };
    (dense_f32(residual) && dense_f32(&add.dst) && dense_f32(mid) && residual.ne == mid.ne)
        .then_some(residual)
}

/// The fused launch of `first` then `second`, or None when the pair is not a pattern.
/// `readers` comes from [`readers`].
fn fuse(
    first: &Step,
    second: &Step,
    readers: &HashMap<TensorId, usize>,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    let mid = &first.dst;
    if readers.get(&mid.id) != Some(&1) {
        return None;
    }
    match (&first.op, &second.op) {
        (Op::Norm(NormOp::RmsNorm { eps }), Op::Binary(BinaryOp::Mul)) => {
            let (x, w, y) = (&first.src[0], &second.src[1], &second.dst);
            let one_row = w.ne[1] * w.ne[2] * w.ne[3] == 1 && w.ne[0] == x.ne[0];
            if second.src[0].id != mid.id
                || x.dtype != DType::F32
                || y.dtype != DType::F32
                || !one_row
                || y.ne != x.ne
                || !disjoint_or_same(y, x)
                || !disjoint(y, w)
            {
                return None;
            }
            let kernel = by::RMS_NORM_MUL.get([x.dtype, w.dtype]);
            Some(kernel.and_then(|kernel| {
                let args = NormMulArgs {
                    src: lw.t4(x),
                    dst: lw.t4(y),
                    w: lw.t4(w),
                    eps: *eps,
                    pad: 0.0,
                };
                // Long rows get a wide block: a decode step normalizes a single row.
                let threads = if x.ne[0] <= 1024 { 32 } else { 1024 };
                Ok(vec![DevOp::kernel(
                    kernel,
                    row_grid(y.nrows())?,
                    (threads, 1, 1),
                    &args,
                )])
            }))
        }
        (Op::Unary(UnaryOp::Silu), Op::Binary(BinaryOp::Mul)) => {
            let (gate, up, y) = (&first.src[0], &second.src[1], &second.dst);
            if second.src[0].id != mid.id
                || [gate, up, y].iter().any(|t| t.dtype != DType::F32)
                || up.ne != gate.ne
                || y.ne != gate.ne
                || !disjoint_or_same(y, gate)
                || !disjoint_or_same(y, up)
            {
                return None;
            }
            let args = BinaryArgs {
                a: lw.t4(gate),
                b: lw.t4(up),
                dst: lw.t4(y),
            };
            let (grid, block) = elementwise_grid(y.ne);
            Some(Ok(vec![DevOp::kernel(k::SWIGLU_F32, grid, block, &args)]))
        }
        (Op::MulMat, Op::Binary(BinaryOp::Add)) => {
            let residual = residual_of(first, second, readers)?;
            let (w, v, y) = (&first.src[0], &first.src[1], &second.dst);
            if !(disjoint_or_same(y, residual) && disjoint(y, v) && disjoint(y, w)) {
                return None;
            }
            let extra = Gemv {
                dst: Some(y),
                add: Some(residual),
            };
            mul_mat::gemv(w, v, mid, extra, lw)
        }
        _ => None,
    }
}
