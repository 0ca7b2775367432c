//! Kernel fusion at load time. Consecutive steps become one launch when each step's
//! result is read by the next one alone (no other step, no view, not an output), so
//! skipping its write changes nothing a caller or a later step can see:
//!
//! | steps | launch |
//! | --- | --- |
//! | `rms_norm(x)`, `mul(that, w)`, `w` one row broadcast | `rms_norm_mul_f32_*` |
//! | `silu(gate)`, `mul(that, up)`, same shape | `swiglu_f32` |
//! | decode GEMV `mul_mat(w, v)`, `add(r, that)` or `add(that, r)`, same shape | `mul_mat_vec_*` (block weights: `mul_mat_vec_q_*` / `mul_mat_vec_dq_*`, 1..=8 columns) with `add = r` |
//! | [`rope(q)`], `rope(k)`, `set_rows(k_cache, k, ids)`, [`set_rows(v_cache, v, ids)`] (a decode or ring step's attention inputs; q and v when they fit) | `rope_store_<cache>` |
//! | `flash_attn_ext` (a decode that ends in `fattn_combine`), then a decode product of its result on the `__dp4a` path | the combine writes the product's Q8_1 activations too; the attention step keeps its own launches, the product loses its quantizing one |
//! | float decode GEMV `mul_mat(a, v)`, `add(r, that)`, `rms_norm(y)`, `mul(that, w)`, then a float decode GEMV of the norm's result whose every use is read by the next `rope_store` or SwiGLU launch | `mul_mat_vec_fold_*` (also `y * w` and block sums of `y^2`, in scratch), then `mul_mat_vec_total_*` reading `y * w` (block 0 also makes the norm's factor); the `rope_store` or SwiGLU launch scales by that factor ([`norm_fold`]) |
//!
//! The later steps then have no launch of their own. When the step after a fused norm or
//! SwiGLU is a decode product with block-quantized weights on the `__dp4a` path, the
//! fused kernel also writes its result as the Q8_1 activations that product reads, and
//! the product's own quantizing launch goes ([`Lowering::q8_1_made`]). (Folding the norm
//! into the GEMV that reads it, each warp summing x^2 itself, measured no faster on an
//! H100 and was dropped; so was a fold whose second product read the block sums itself,
//! slower than the norm's launch on an H200 (2026-11-29; docs/benchmarks.md). In the
//! kept fold one block of the second product adds the sums.) A fused kernel still reads
//! the first step's sources while it writes the later steps' results, which the allocator
//! may have placed in memory one of those sources had (free once the first step was
//! done): so steps fuse only when a result overlaps no source it is read alongside, except
//! the exact same layout for sources read element by element at the index being written
//! (`x`, `gate`, `up`, `r`, q's rope), which is the in-place case.

use std::collections::HashMap;

use super::args::{GluArgs, NormMulArgs, GEMV_WARPS, NORM_VEC};
use super::kernels::{by, k};
use super::lower::mul_mat::{self, FoldPart, Gemv};
use super::lower::mul_mat_q::{self, MAX_DECODE_COLS};
use super::lower::rope::{self, RopeStore};
use super::lower::{attention, check_operands, lower_step};
use super::lowering::{disjoint, elementwise_grid, row_grid, DevOp, Lowering, NormFoldOut, Q8Copy};
use crate::graph::{
    AllocKind, BinaryOp, CopyOp, DType, Loc, NormOp, Op, Operand, Plan, Step, TensorId, UnaryOp,
};

/// Lowers every step of `plan`, fusing steps when `fusion` is on (fused steps' ops are
/// listed under the first of them, the others get none). `tag(i)` is the index-error tag
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
        let fused = match fusion {
            true => fuse(plan, &plan.steps[i..], &readers, lw, &|j| tag(i + j)),
            false => None,
        };
        let (ops, used) = match fused {
            Some((ops, used)) => (ops.map_err(|reason| (step, reason))?, used),
            None => (lower_step(step, lw).map_err(|reason| (step, reason))?, 1),
        };
        lw.launched |= !ops.is_empty();
        steps.push(ops);
        steps.extend((1..used).map(|_| Vec::new()));
        lw.step_done(plan.steps[i..i + used].iter().map(|s| &s.dst));
        i += used;
    }
    if let (Some(fold), Some(last)) = (&lw.fold, plan.steps.last()) {
        return Err((
            last,
            format!(
                "internal: the norm folded for tensor {:?} was not applied",
                fold.of
            ),
        ));
    }
    Ok(steps)
}

/// The tensor whose memory `id` is (itself, or the base of a view).
fn base(plan: &Plan, id: TensorId) -> TensorId {
    match plan.alloc.info.get(id).map(|i| i.kind) {
        Some(AllocKind::View(b)) => b,
        _ => id,
    }
}

/// How many times each tensor's memory is read: by step sources (through views too) and
/// as a plan output.
fn readers(plan: &Plan) -> HashMap<TensorId, usize> {
    let mut n = HashMap::new();
    let srcs = plan.steps.iter().flat_map(|s| s.src.iter());
    for op in srcs.chain(plan.outputs.iter().map(|io| &io.operand)) {
        *n.entry(base(plan, op.id)).or_insert(0) += 1;
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

/// The fused launch of the first steps of `window` and how many steps it covers, or None
/// when they start no pattern. `readers` comes from [`readers`]; `tag(j)` is the
/// index-error tag of `window[j]`.
fn fuse(
    plan: &Plan,
    window: &[Step],
    readers: &HashMap<TensorId, usize>,
    lw: &mut Lowering,
    tag: &dyn Fn(usize) -> i64,
) -> Option<(Result<Vec<DevOp>, String>, usize)> {
    if let Some((store, used, k_write)) = rope_store(window, readers) {
        lw.tag = tag(k_write);
        let fold = take_fold(plan, lw, &store.sources());
        return Some((rope::lower_store(&store, fold.as_ref(), lw), used));
    }
    if let Some(fused) = norm_fold(plan, window, readers, lw) {
        return Some((fused, 5));
    }
    let (first, second) = (window.first()?, window.get(1)?);
    if let Op::FlashAttnExt(p) = &first.op {
        // The attention step alone, writing the next product's Q8_1 activations too
        // when its decode ends in a combine (attention::lower decides).
        let (b, layout) = mul_mat_q::q8_1_input(second, lw)?;
        let b = b.clone();
        let ops = check_operands(first, lw)
            .and_then(|()| attention::lower(p, &first.src, &first.dst, Some((&b, layout)), lw));
        return Some((ops, 1));
    }
    pair(plan, first, second, window.get(2), readers, lw).map(|ops| (ops, 2))
}

/// A decode RMS norm folded into the launches around the product after it, where the
/// steps are a float decode product `mul_mat(a, v)` (`a` not block-quantized, one column),
/// `add(r, that)`, `rms_norm(y)` and `mul(that, w)` (`w` one dense F32 row), the next step
/// a product of the norm's result read by it alone, and the steps after it one
/// `rope_store` launch or a SwiGLU pair that reads every use of that product's result. The
/// first four steps become one `mul_mat_vec_fold_*` launch: it writes `y`, `rw = y * w`
/// and the sum of `y^2` over each of its blocks (both in scratch, held until taken: the
/// norm's own block may be one the launch reads, such as `v`'s); the next product, a
/// float decode GEMV too (`mul_mat_vec_total_*`), reads `rw` in place of the norm's
/// result, and its block 0 adds the sums into the norm's factor `1 / sqrt(sum / n + eps)`
/// (scratch); the `rope_store` or SwiGLU launch scales its inputs by it
/// ([`Lowering::fold`]): the products are linear, so this is the product of the
/// normalized vector. Saves the norm's launch; no launch but one block reads the sums.
/// Returns the two launches of the first five steps.
fn norm_fold(
    plan: &Plan,
    window: &[Step],
    readers: &HashMap<TensorId, usize>,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    let [mm, add, norm, mul, next, rest @ ..] = window else {
        return None;
    };
    let (a, v) = (mm.src.first()?, mm.src.get(1)?);
    let next_a = next.src.first()?;
    let r = residual_of(mm, add, readers)?;
    let (Op::MulMat, Op::Norm(NormOp::RmsNorm { eps }), Op::Binary(BinaryOp::Mul), Op::MulMat) =
        (&mm.op, &norm.op, &mul.op, &next.op)
    else {
        return None;
    };
    let (y, xn, w) = (&add.dst, &mul.dst, mul.src.get(1)?);
    let fits = mul_mat::float_gemv(a, v)
        && norm.src[0] == *y
        && readers.get(&norm.dst.id) == Some(&1)
        && mul.src[0].id == norm.dst.id
        && readers.get(&xn.id) == Some(&1)
        && next.src.get(1).is_some_and(|b| b.id == xn.id)
        && mul_mat::float_gemv(next_a, xn)
        && lw.fold_norms
        && lw.fold.is_none()
        && dense_f32(w)
        && dense_f32(xn)
        && w.ne == y.ne
        && xn.ne == y.ne
        && y.nrows() == 1
        && disjoint_or_same(y, r)
        && disjoint(y, v)
        && disjoint(y, a)
        && disjoint(y, w)
        && folds_into(plan, rest, &next.dst, readers);
    if !fits {
        return None;
    }
    if let Err(e) = check_operands(next, lw) {
        return Some(Err(e));
    }
    // Both products lower (float_gemv): the fold is pending from here, so that any scratch
    // they reserve lies after what it holds.
    let (fold, rw, out) = fold_scratch(lw, w, y.ne[0], *eps, base(plan, next.dst.id));
    lw.fold = Some(out);
    let extra = Gemv {
        dst: Some(y),
        add: Some(r),
        fold: Some((fold, FoldPart::Rows)),
        b: None,
    };
    let mut ops = match mul_mat::gemv(a, v, &mm.dst, extra, lw)? {
        Ok(ops) => ops,
        Err(e) => return Some(Err(e)),
    };
    let read_rw = Gemv {
        b: Some(rw),
        fold: Some((fold, FoldPart::Total)),
        ..Gemv::default()
    };
    Some(
        mul_mat::gemv(next_a, xn, &next.dst, read_rw, lw)?.map(|more| {
            ops.extend(more);
            ops
        }),
    )
}

/// Holds the scratch of a norm over `m` elements folded for the product result `of`
/// (block sums of `y^2`, `rw = y * w`, the factor) from offset 0, and writes its
/// `NormFold` constants (cuda/args.cuh): their address, `rw`'s, and the pending fold.
fn fold_scratch(
    lw: &mut Lowering,
    w: &Operand,
    m: usize,
    eps: f32,
    of: TensorId,
) -> (u64, u64, NormFoldOut) {
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
    (fold, rw, NormFoldOut { of, scale, held })
}

/// Whether the launch that `steps` start with reads every use of `out` and can scale
/// them by a folded norm's factor: a `rope_store` launch or a SwiGLU pair.
fn folds_into(
    plan: &Plan,
    steps: &[Step],
    out: &Operand,
    readers: &HashMap<TensorId, usize>,
) -> bool {
    let of = base(plan, out.id);
    let uses = |srcs: &[&Operand]| srcs.iter().filter(|t| base(plan, t.id) == of).count();
    let read = match (rope_store(steps, readers), steps) {
        (Some((store, ..)), _) => uses(&store.sources()),
        (None, [silu, mul, ..]) => {
            swiglu_of(silu, mul, readers).map_or(0, |(g, u, _)| uses(&[g, u]))
        }
        (None, _) => 0,
    };
    read > 0 && readers.get(&of) == Some(&read)
}

/// The folded norm that the launch reading `srcs` must apply, taken from the lowering
/// (None when none is pending for them). Taking it frees the scratch it holds, so the
/// launch reserves its own scratch first (as `q8_1_out` before it in [`pair`]).
fn take_fold(plan: &Plan, lw: &mut Lowering, srcs: &[&Operand]) -> Option<NormFoldOut> {
    let of = lw.fold.as_ref()?.of;
    if !srcs.iter().any(|t| base(plan, t.id) == of) {
        return None;
    }
    lw.fold.take()
}

/// `silu(gate)` then `mul(that, up)` as one SwiGLU launch: (gate, up, result), when the
/// silu is read by the multiplication alone and all are F32 of one shape whose result
/// touches no source it is read alongside (the same layout is fine).
fn swiglu_of<'s>(
    silu: &'s Step,
    mul: &'s Step,
    readers: &HashMap<TensorId, usize>,
) -> Option<(&'s Operand, &'s Operand, &'s Operand)> {
    if (&silu.op, &mul.op) != (&Op::Unary(UnaryOp::Silu), &Op::Binary(BinaryOp::Mul))
        || readers.get(&silu.dst.id) != Some(&1)
    {
        return None;
    }
    let (gate, up, y) = (silu.src.first()?, mul.src.get(1)?, &mul.dst);
    let fits = mul.src[0].id == silu.dst.id
        && [gate, up, y].iter().all(|t| t.dtype == DType::F32)
        && up.ne == gate.ne
        && y.ne == gate.ne
        && disjoint_or_same(y, gate)
        && disjoint_or_same(y, up);
    fits.then_some((gate, up, y))
}

/// Where a fused step's result `y` also goes as Q8_1 activations (address, column stride
/// and layout), when `next` is a decode product of `y` that would quantize it; zeros when
/// not. The copy is then [`Lowering::q8_1_made`].
fn q8_1_out(y: &Operand, next: Option<&Step>, lw: &mut Lowering) -> (u64, i64, i64) {
    match next.and_then(|s| mul_mat_q::q8_1_input(s, lw)) {
        Some((b, layout)) if b == y && y.is_contiguous() && y.ne[0] % 32 == 0 => {
            let (addr, row) = mul_mat_q::q8_1_copy(y, &mut 0, lw);
            lw.q8_1_made = Some(Q8Copy {
                of: y.clone(),
                addr,
                layout,
            });
            (addr, row as i64, layout)
        }
        _ => (0, 0, 0),
    }
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

/// `rms_norm(x) * w` into `y` as one launch (F32 rows, `w` one row); when the step after
/// (`next`) is a quantized decode product of `y`, the launch also writes the Q8_1 copy
/// of `y` that it reads.
fn rms_norm_mul(
    x: &Operand,
    w: &Operand,
    y: &Operand,
    eps: f32,
    next: Option<&Step>,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let kernel = by::RMS_NORM_MUL.get([x.dtype, w.dtype])?;
    let (q8, q8_nb1, q8_layout) = q8_1_out(y, next, lw);
    let vec = norm_vec(x, y, w, lw);
    let args = NormMulArgs {
        src: lw.t4(x),
        dst: lw.t4(y),
        w: lw.t4(w),
        eps,
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
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(y.nrows())?,
        (threads, 1, 1),
        &args,
    )])
}

/// The fused launch of `first` then `second` (`next` the step after them), or None when
/// the pair is not a pattern.
fn pair(
    plan: &Plan,
    first: &Step,
    second: &Step,
    next: Option<&Step>,
    readers: &HashMap<TensorId, usize>,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    if let Some((gate, up, y)) = swiglu_of(first, second, readers) {
        let (q8, q8_nb1, q8_layout) = q8_1_out(y, next, lw);
        let fold = take_fold(plan, lw, &[gate, up]);
        let args = GluArgs {
            gate: lw.t4(gate),
            up: lw.t4(up),
            dst: lw.t4(y),
            q8,
            q8_nb1,
            q8_layout,
            fold_scale: NormFoldOut::scale_of(fold.as_ref()),
        };
        let (grid, block) = elementwise_grid(y.ne);
        return Some(Ok(vec![DevOp::kernel(k::SWIGLU_F32, grid, block, &args)]));
    }
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
            Some(rms_norm_mul(x, w, y, *eps, next, lw))
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
                ..Gemv::default()
            };
            mul_mat::gemv(w, v, mid, extra, lw)
        }
        _ => None,
    }
}

/// A decode (or ring) step's attention inputs as one `rope_store_<cache>` launch: the
/// rope of k read by its cache write alone (`set_rows` of k's rows, one dense row per
/// token), with the rope of q (same positions and parameters) and the V cache write (same
/// ids) when they are next to that pair, before or after it (the plan's order depends on
/// the attention's graph), and touch nothing the launch writes. Returns the launch's
/// steps, how many it covers (`window[..n]`) and which is the K write (an id outside the
/// cache is reported as its; the V write has the same ids).
fn rope_store<'s>(
    window: &'s [Step],
    readers: &HashMap<TensorId, usize>,
) -> Option<(RopeStore<'s>, usize, usize)> {
    let w = &window[..window.len().min(4)];
    (0..3).find_map(|at| {
        let (rk, sk) = (w.get(at)?, w.get(at + 1)?);
        let mut store = store_core(rk, sk, readers)?;
        // the steps before the pair must all join; after it, as many as do
        if !w[..at].iter().all(|s| join(&mut store, s)) {
            return None;
        }
        let used = at
            + 2
            + w[at + 2..]
                .iter()
                .take_while(|s| join(&mut store, s))
                .count();
        Some((store, used, at + 1))
    })
}

/// The core of a `rope_store` launch: `rk` ropes k, `sk` writes its rows into the cache,
/// and nothing else reads the roped k.
fn store_core<'s>(
    rk: &'s Step,
    sk: &'s Step,
    readers: &HashMap<TensorId, usize>,
) -> Option<RopeStore<'s>> {
    let (Op::Rope(p), Op::Copy(CopyOp::SetRows)) = (&rk.op, &sk.op) else {
        return None;
    };
    let (k, pos, roped) = (&rk.src[0], &rk.src[1], &rk.dst);
    let (rows, ids, cache) = (sk.src.first()?, sk.src.get(1)?, &sk.dst);
    let fits = readers.get(&roped.id) == Some(&1)
        && k.dtype == DType::F32
        && roped.dtype == DType::F32
        && rows.loc == roped.loc
        && roped.is_contiguous()
        && rows.is_contiguous()
        && k.ne[3] == 1
        && rows.ne == [k.ne[0] * k.ne[1], k.ne[2], 1, 1]
        && ids.dtype == DType::I32
        && ids.ne == [k.ne[2], 1, 1, 1]
        && cache.ne[0] == rows.ne[0]
        && cache.ne[2] == 1
        && cache.ne[3] == 1
        && rope::stores_to(cache.dtype);
    fits.then_some(RopeStore {
        p,
        pos,
        ids,
        k: (k, cache),
        q: None,
        v: None,
    })
}

/// Adds `s` to `st` when it is the rope of q or the V cache write of this token and the
/// launch has none yet, and its memory keeps clear of the rest; whether it joined.
fn join<'s>(st: &mut RopeStore<'s>, s: &'s Step) -> bool {
    let (src, dst) = match s.src.first() {
        Some(src) => (src, &s.dst),
        None => return false,
    };
    let joins = if let Op::Rope(p) = &s.op {
        st.q.is_none()
            && p == st.p
            && s.src.get(1) == Some(st.pos)
            && src.ne[0] == st.k.0.ne[0]
            && src.dtype == DType::F32
            && dst.dtype == DType::F32
            && disjoint_or_same(dst, src)
    } else {
        s.op == Op::Copy(CopyOp::SetRows)
            && st.v.is_none()
            && s.src.get(1) == Some(st.ids)
            && src.dtype == DType::F32
            && dst.dtype == st.k.1.dtype
    };
    let (reads, writes) = memory(st);
    if !joins
        || !writes.iter().all(|w| disjoint(src, w) && disjoint(dst, w))
        || !reads.iter().all(|r| disjoint(dst, r))
    {
        return false;
    }
    if matches!(s.op, Op::Rope(_)) {
        st.q = Some((src, dst));
    } else {
        st.v = Some((src, dst));
    }
    true
}

/// What the launch of `st` reads and writes.
fn memory<'s>(st: &RopeStore<'s>) -> (Vec<&'s Operand>, Vec<&'s Operand>) {
    let mut reads = vec![st.k.0, st.pos, st.ids];
    let mut writes = vec![st.k.1];
    for (src, dst) in st.q.iter().chain(&st.v) {
        reads.push(src);
        writes.push(dst);
    }
    (reads, writes)
}
