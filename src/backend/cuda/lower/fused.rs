//! Lowering of a plan's step groups ([`crate::backend::fusion`]): each [`Fused`] kind
//! becomes its launches, a [`Fused::Step`] the launches of its op family ([`lower_step`]).
//! The ops of a group are listed under its first step; the other steps get none.
//!
//! What passes from one group to the next is explicit: the Q8_1 copy of activations a
//! group made (the next decode products read it, [`Lowering::step_done`]) and the
//! factor of a folded norm ([`NormFoldOut`]), which the group after a
//! [`Fused::NormFold`] applies.

use super::super::args::{GluArgs, NormMulArgs, GEMV_WARPS, NORM_VEC};
use super::super::kernels::{by, k};
use super::super::lowering::{elementwise_grid, row_grid, DevOp, Lowering, NormFoldOut, Q8Copy};
use super::mul_mat::{self, FoldPart, Gemv};
use super::mul_mat_q::{self, act_code};
use super::{attention, check_operands, lower_step, rope};
use crate::backend::fusion::{
    Fused, GemvAdd, Group, NormFold, Q8For, RmsNormMul, SwiGlu, MAX_DECODE_COLS,
};
use crate::graph::{Loc, Op, Operand, Plan, Step};

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
    let mut fold = None;
    for g in groups {
        let step = &plan.steps[g.first];
        // a rope_store launch reports a bad id as its K write's
        lw.tag = tag(match &g.fused {
            Fused::RopeStore(s) => s.k_write,
            Fused::Step
            | Fused::RmsNormMul(_)
            | Fused::SwiGlu(_)
            | Fused::GemvAdd(_)
            | Fused::Attention(_)
            | Fused::NormFold(_) => g.first,
        });
        let (ops, made) = lower_group(step, &g.fused, &mut fold, lw).map_err(|e| (step, e))?;
        lw.launched |= !ops.is_empty();
        steps.push(ops);
        steps.extend((1..g.len).map(|_| Vec::new()));
        lw.step_done(
            plan.steps[g.first..g.first + g.len].iter().map(|s| &s.dst),
            made,
        );
    }
    match (fold, plan.steps.last()) {
        (Some(_), Some(last)) => Err((
            last,
            "internal: a folded norm's factor was not applied".into(),
        )),
        _ => Ok(steps),
    }
}

/// The launches of one group, and the Q8_1 copy of its result it made for the next
/// decode product. `fold`: the factor a [`Fused::NormFold`] group leaves for the next
/// group, which takes it.
fn lower_group(
    step: &Step,
    fused: &Fused,
    fold: &mut Option<NormFoldOut>,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let applied = fold.take();
    if fused.folded() != applied.is_some() {
        return Err("internal: a folded norm's factor and the launch that applies it are not next to each other".into());
    }
    match fused {
        Fused::Step => Ok((lower_step(step, lw)?, None)),
        Fused::RmsNormMul(n) => rms_norm_mul(n, lw),
        Fused::SwiGlu(s) => swiglu(s, applied.as_ref(), lw),
        Fused::GemvAdd(g) => Ok((gemv_add(g, lw)?, None)),
        Fused::RopeStore(s) => Ok((rope::lower_store(s, applied.as_ref(), lw)?, None)),
        Fused::Attention(q8) => {
            let Op::FlashAttnExt(p) = &step.op else {
                return Err("internal: a fused attention step that is not flash_attn_ext".into());
            };
            check_operands(step, lw)?;
            attention::lower_writing(p, &step.src, &step.dst, Some(q8), lw)
        }
        Fused::NormFold(f) => {
            let (ops, out) = norm_fold(f, lw)?;
            *fold = Some(out);
            Ok((ops, None))
        }
    }
}

/// The decode launches of a product [`Gemv`] says more about (the fusion pass matched it
/// as a decode product, so there are some).
fn gemv(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    extra: Gemv,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    mul_mat::gemv(a, b, dst, extra, lw)
        .unwrap_or_else(|| Err("internal: a fused decode product has no decode kernel".into()))
}

/// A decode product and its residual add as one launch.
fn gemv_add(g: &GemvAdd, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let extra = Gemv {
        dst: Some(g.y),
        add: Some(g.r),
        ..Gemv::default()
    };
    gemv(g.a, g.v, g.product, extra, lw)
}

/// The two launches of a folded norm ([`NormFold`]): `mul_mat_vec_fold_*` (the first
/// product with its add, also `y * w` and the block sums of `y^2` into held scratch) and
/// `mul_mat_vec_total_*` (the second product, reading `y * w`; its block 0 makes the
/// norm's factor), and the factor the next group applies.
fn norm_fold(f: &NormFold, lw: &mut Lowering) -> Result<(Vec<DevOp>, NormFoldOut), String> {
    check_operands(f.next, lw)?;
    let (at, rw, out) = fold_scratch(lw, f.w, f.y.ne[0], f.eps);
    let rows = Gemv {
        dst: Some(f.y),
        add: Some(f.r),
        fold: Some((at, FoldPart::Rows)),
        b: None,
    };
    let mut ops = gemv(f.a, f.v, f.product, rows, lw)?;
    let total = Gemv {
        b: Some(rw),
        fold: Some((at, FoldPart::Total)),
        ..Gemv::default()
    };
    ops.extend(gemv(&f.next.src[0], f.xn, &f.next.dst, total, lw)?);
    Ok((ops, out))
}

/// Holds the scratch of a norm over `m` elements folded (block sums of `y^2`, `rw = y * w`,
/// the factor) from offset 0, and writes its `NormFold` constants (cuda/args.cuh): their
/// address, `rw`'s, and what the fold holds until its factor is applied.
fn fold_scratch(lw: &mut Lowering, w: &Operand, m: usize, eps: f32) -> (u64, u64, NormFoldOut) {
    let count = m.div_ceil(GEMV_WARPS as usize);
    let mut held = 0;
    let parts = lw.reserve_scratch(&mut held, count * 4);
    let rw = lw.reserve_scratch(&mut held, m * 4);
    let scale = lw.reserve_scratch(&mut held, 4);
    // NormFold: w, rw, parts, scale, count, n, eps
    let mut fold: Vec<u8> = [lw.addr(w), rw, parts, scale, count as u64]
        .iter()
        .flat_map(|x| x.to_ne_bytes())
        .collect();
    fold.extend([m as f32, eps].iter().flat_map(|x| x.to_ne_bytes()));
    let fold = lw.push_consts(&fold);
    (fold, rw, NormFoldOut { scale, held })
}

/// Scratch from `*offset` for the Q8_1 copy `q8` of a fused step's result, and the
/// copy: its address, column stride and layout as the kernel's arguments (zeros without
/// one).
fn q8_1_out(
    q8: Option<&Q8For>,
    offset: &mut usize,
    lw: &mut Lowering,
) -> ((u64, i64, i64), Option<Q8Copy>) {
    let Some(q8) = q8 else {
        return ((0, 0, 0), None);
    };
    let (addr, row) = mul_mat_q::q8_1_copy(q8.of, offset, lw);
    let copy = Q8Copy {
        of: q8.of.clone(),
        addr,
        layout: q8.layout,
    };
    ((addr, row as i64, act_code(q8.layout)), Some(copy))
}

/// SwiGLU as one launch, scaling its inputs by `fold`'s factor when it applies a folded
/// norm; its Q8_1 copy lies after the scratch the fold holds.
fn swiglu(
    s: &SwiGlu,
    fold: Option<&NormFoldOut>,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let mut offset = fold.map_or(0, |f| f.held);
    let ((q8, q8_nb1, q8_layout), made) = q8_1_out(s.q8.as_ref(), &mut offset, lw);
    let args = GluArgs {
        gate: lw.t4(s.gate),
        up: lw.t4(s.up),
        dst: lw.t4(s.y),
        q8,
        q8_nb1,
        q8_layout,
        fold_scale: NormFoldOut::scale_of(fold),
    };
    let (grid, block) = elementwise_grid(s.y.ne);
    Ok((vec![DevOp::kernel(k::SWIGLU_F32, grid, block, &args)], made))
}

/// Shortest rows that take `rms_norm_mul`'s vector path in a decode step (a prefill's
/// many rows always do). Measured on an H100 (decode, rows written as Q8_1 too):
/// 4,096-element rows (Llama-2-7B) decode faster on it (Q4_0 377.0 against 362.3 tok/s),
/// 576-element rows (SmolLM2) slower (1,133-1,157 against 1,194-1,224), where the scalar
/// path's warp per 32 elements has more warps to spread the Q8_1 shuffles over; SmolLM2's
/// 512-token prefill was faster on it (140,506-141,467 against 122,390-123,437 tok/s).
/// Sizes between 576 and 4,096 were not measured.
const NORM_VEC_MIN: usize = 2048;

/// Whether `rms_norm_mul` can take its vector path (`rms_rows_vec` in cuda/norm.cu) for
/// `y = rms_norm(x) * w`: dense F32 rows of a multiple of 4 elements (at least
/// [`NORM_VEC_MIN`] of them in a decode step) that start on 16 bytes, at most `NORM_VEC`
/// groups of 4 a thread of a 1024-thread block, and a dense weight aligned to 4 of its
/// elements.
fn norm_vec(x: &Operand, y: &Operand, w: &Operand, lw: &Lowering) -> bool {
    let rows16 = |t: &Operand| {
        t.nb[0] == 4 && t.nb[1..].iter().all(|nb| nb % 16 == 0) && lw.addr(t) % 16 == 0
    };
    let wsize = w.dtype.block_bytes();
    x.ne[0] % 4 == 0
        && (x.ne[0] >= NORM_VEC_MIN || x.nrows() > MAX_DECODE_COLS)
        && x.ne[0] / 4 <= NORM_VEC as usize * 1024
        && rows16(x)
        && rows16(y)
        && w.nb[0] == wsize
        && lw.addr(w) % (4 * wsize as u64) == 0
}

/// Threads of a vector-path `rms_norm_mul` block for rows of `ne0` elements: `NORM_VEC`
/// groups of 4 a thread, whole warps.
fn norm_vec_threads(ne0: usize) -> u32 {
    (ne0 / 4)
        .div_ceil(NORM_VEC as usize)
        .next_multiple_of(32)
        .clamp(32, 1024) as u32
}

/// `rms_norm(x) * w` into `y` as one launch (F32 rows, `w` one row), also writing the
/// Q8_1 copy of `y` the next decode product reads when the pass asked for it.
fn rms_norm_mul(n: &RmsNormMul, lw: &mut Lowering) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let (x, w, y) = (n.x, n.w, n.y);
    let kernel = by::RMS_NORM_MUL.get([x.dtype, w.dtype])?;
    let ((q8, q8_nb1, q8_layout), made) = q8_1_out(n.q8.as_ref(), &mut 0, lw);
    let vec = norm_vec(x, y, w, lw);
    let args = NormMulArgs {
        src: lw.t4(x),
        dst: lw.t4(y),
        w: lw.t4(w),
        eps: n.eps,
        vec: i32::from(vec),
        q8,
        q8_nb1,
        q8_layout,
        // a weight, read while the previous kernel of the plan finishes
        w_early: i64::from(lw.read_only(w) && lw.launched),
    };
    // The vector path: NORM_VEC groups of 4 elements a thread. Otherwise a decode step
    // normalizes a few rows: a warp per 32 elements (up to 1024 threads) keeps it short; a
    // prefill has rows enough for a warp each (a wide block for long rows).
    let threads = match (vec, x.nrows() <= MAX_DECODE_COLS, x.ne[0] <= 1024) {
        (true, _, _) => norm_vec_threads(x.ne[0]),
        (false, true, _) => x.ne[0].next_multiple_of(32).min(1024) as u32,
        (false, false, true) => 32,
        (false, false, false) => 1024,
    };
    let op = DevOp::kernel(kernel, row_grid(y.nrows())?, (threads, 1, 1), &args);
    Ok((vec![op], made))
}
