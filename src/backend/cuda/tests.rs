//! Host-side checks of the lowering (no GPU needed): mul_mat steps of many layouts are
//! lowered with host addresses, the resulting operations are carried out by a host
//! interpreter of each kernel's and cuBLAS's documented contract (copies, the GEMV
//! family, column-major GEMM over pointer arrays), and the result must equal the CPU
//! backend's. This catches wrong dispatch, strides, leading dimensions, transposes,
//! pointer arrays and scratch layouts; the kernels themselves are checked on a GPU by
//! tests/cuda/cuda_graph.rs and the op tests.

use half::f16;
use rand::{Rng, SeedableRng};

use super::args::KernelArgs;
use super::args::{
    BinaryArgs, CpyArgs, FattnArgs, GemvArgs, GluArgs, MoeSumArgs, NormArgs, NormFold, NormMulArgs,
    QGemvArgs, RopeStoreArgs, RowsArgs, SoftMaxArgs, SplitArgs, Tensor4, TopKArgs, UnaryArgs,
    ACT_BLOCKS, ACT_F16, CPY_CONTIGUOUS, CPY_RESHAPE, CPY_SAME_SHAPE, GEMV_WARPS, MOE_SUM_STAGE,
};
use super::decode::q8_1::Q8Copy;
use super::gemm::Gemm;
use super::lower::fused;
use super::lowering::{DevOp, Lowering, REGION_ALIGN};
use crate::backend::cpu::CpuBackend;
use crate::backend::fusion::{self, Q8Layout};
use crate::backend::{Backend, BackendExt};
use crate::graph::{DType, Graph, Loc, Plan, Step, TensorId};
use crate::ops::host::{load, store};

/// Lowers `plan` as the backend does: its steps grouped by the fusion pass (`fusion`, for
/// the target of `lw`'s kernels, [`fused::target`]) or each as it is.
pub(super) fn lower_plan<'s>(
    plan: &'s Plan,
    lw: &mut Lowering,
    fusion: bool,
    tag: impl Fn(usize) -> i64,
) -> Result<Vec<Vec<DevOp>>, (&'s Step, String)> {
    let groups = match fusion {
        true => fusion::fuse(plan, &fused::target(lw)),
        false => fusion::unfused(plan),
    };
    fused::lower_plan(plan, &groups, lw, tag)
}

/// Host memory for a plan: arena, constants, scratch (u64 words: aligned for any dtype).
struct HostMem {
    arena: Vec<u64>,
    consts: Vec<u64>,
    scratch: Vec<u64>,
}

pub(super) fn base(v: &mut [u64]) -> u64 {
    v.as_mut_ptr() as u64
}

/// Lowers every step of `plan` with host addresses, twice like `load` (sizes, then
/// addresses), with step fusion on or off, and returns the operations with the memory
/// they point into.
fn lower_on_host_with(plan: &Plan, fusion: bool) -> (Vec<Vec<DevOp>>, HostMem) {
    let lower = |arena: u64, consts: u64, scratch: u64| {
        let resolve = move |loc: Loc| match loc {
            Loc::Arena(off) => arena + off as u64,
            Loc::Buffer(..) => panic!("these plans use no buffers"),
        };
        let mut lw = Lowering {
            consts_base: consts,
            scratch_base: scratch,
            ..Lowering::new(&resolve, true, 1)
        };
        let ops = lower_plan(plan, &mut lw, fusion, |_| 0)
            .unwrap_or_else(|(s, e)| panic!("{} not supported: {e}", s.name));
        (ops, lw.consts, lw.scratch_need)
    };
    let (_, consts, scratch) = lower(0, 0, 0);
    let mut mem = HostMem {
        arena: vec![0; plan.arena_bytes.div_ceil(8)],
        consts: vec![0; consts.len().next_multiple_of(REGION_ALIGN).div_ceil(8) + 1],
        scratch: vec![0; scratch.div_ceil(8) + 1],
    };
    let (ops, consts2, scratch2) = lower(
        base(&mut mem.arena),
        base(&mut mem.consts),
        base(&mut mem.scratch),
    );
    assert_eq!((consts2.len(), scratch2), (consts.len(), scratch));
    bytemuck::cast_slice_mut::<u64, u8>(&mut mem.consts)[..consts2.len()].copy_from_slice(&consts2);
    (ops, mem)
}

/// The argument struct of a launch (a panic when the kernel takes another).
pub(super) fn args<T: KernelArgs>(op: &super::lowering::Launch) -> T {
    op.args
        .get::<T>()
        .unwrap_or_else(|| panic!("{} takes another argument struct", op.kernel.name))
}

pub(super) fn elem(ne: [i64; 4], i: i64) -> [i64; 4] {
    [
        i % ne[0],
        (i / ne[0]) % ne[1],
        (i / (ne[0] * ne[1])) % ne[2],
        i / (ne[0] * ne[1] * ne[2]),
    ]
}

pub(super) fn offset(nb: [i64; 4], i: [i64; 4]) -> i64 {
    (0..4).map(|d| i[d] * nb[d]).sum()
}

/// Element `ix` of the F32 tensor `t`.
///
/// # Safety
/// `t` lies in host memory with its shape and strides, and `ix` is inside its shape.
unsafe fn get_f32(t: &Tensor4, ix: [i64; 4]) -> f32 {
    load((t.data as i64 + offset(t.nb, ix)) as *const u8, DType::F32)
}

/// Sets element `ix` of the F32 tensor `t` to `v`.
///
/// # Safety
/// As for [`get_f32`].
unsafe fn set_f32(t: &Tensor4, ix: [i64; 4], v: f32) {
    store((t.data as i64 + offset(t.nb, ix)) as *mut u8, DType::F32, v)
}

/// Host version of cpy_S_D.
pub(super) fn run_cpy(name: &str, a: CpyArgs) {
    let mut parts = name.split('_').skip(1);
    let s = DType::parse(parts.next().unwrap()).unwrap();
    let d = DType::parse(parts.next().unwrap()).unwrap();
    for i in 0..a.n {
        let (so, dso) = match a.mode {
            CPY_CONTIGUOUS => (i * s.block_bytes() as i64, i * d.block_bytes() as i64),
            CPY_SAME_SHAPE => {
                let ix = elem(a.src.ne, i);
                (offset(a.src.nb, ix), offset(a.dst.nb, ix))
            }
            CPY_RESHAPE => (
                offset(a.src.nb, elem(a.src.ne, i)),
                offset(a.dst.nb, elem(a.dst.ne, i)),
            ),
            m => panic!("cpy mode {m}"),
        };
        // SAFETY: lowering placed both tensors inside the host memory of the plan.
        unsafe {
            let v = load((a.src.data as i64 + so) as *const u8, s);
            store((a.dst.data as i64 + dso) as *mut u8, d, v);
        }
    }
}

/// Host version of the GEMV family.
fn run_gemv(name: &str, p: GemvArgs) {
    let dt = if name.contains("p021") || name.contains("_nc_") || name.ends_with("_f16") {
        DType::F16
    } else if name.ends_with("bf16") {
        DType::BF16
    } else {
        DType::F32
    };
    let es = dt.block_bytes() as i64;
    for ch in 0..p.channels {
        for r in 0..p.m {
            let mut acc = 0f32;
            for l in 0..p.k {
                // SAFETY: inside the plan's host memory, per the GemvArgs contract.
                unsafe {
                    let a = load(
                        (p.a as i64 + r * p.a_nb1 + (ch / p.ratio) * p.a_nb2 + l * es) as *const u8,
                        dt,
                    );
                    let b = load((p.b as i64 + ch * p.b_nb2 + l * 4) as *const u8, DType::F32);
                    acc += a * b;
                }
            }
            if p.add != 0 {
                // SAFETY: `add` is a dense F32 vector of m elements in the plan's memory.
                acc += unsafe { load((p.add as i64 + r * 4) as *const u8, DType::F32) };
            }
            if name.contains("_fold_") {
                fold_row(&p, r, acc);
            }
            // SAFETY: as above.
            unsafe {
                store(
                    (p.dst as i64 + ch * p.dst_nb2 + r * 4) as *mut u8,
                    DType::F32,
                    acc,
                )
            };
        }
    }
    if name.contains("_total_") {
        fold_total(&p);
    }
}

/// The folded norm's part of `mul_mat_vec_fold_*` for row `r` (result `y`): `y * w` into
/// `rw`, and `y^2` added to its block's sum (rows in order, as the kernel's warps).
fn fold_row(p: &GemvArgs, r: i64, y: f32) {
    let rows = i64::from(GEMV_WARPS);
    // SAFETY: `fold` points at a NormFold in the plan's constants; its vectors lie in the
    // plan's memory (w and rw m elements, parts one per block of rows).
    unsafe {
        let f = *(p.fold as *const NormFold);
        let w = load((f.w as i64 + r * 4) as *const u8, DType::F32);
        store((f.rw as i64 + r * 4) as *mut u8, DType::F32, y * w);
        let part = (f.parts as i64 + (r / rows) * 4) as *mut u8;
        let before = if r % rows == 0 {
            0.0
        } else {
            load(part, DType::F32)
        };
        store(part, DType::F32, before + y * y);
    }
}

/// The total of `mul_mat_vec_total_*`: the folded norm's factor from its block sums.
fn fold_total(p: &GemvArgs) {
    // SAFETY: `fold` points at a NormFold in the plan's constants; `parts` holds `count`
    // F32 sums and `scale` one F32 in the plan's scratch.
    unsafe {
        let f = *(p.fold as *const NormFold);
        let sum: f32 = (0..f.count)
            .map(|i| load((f.parts as i64 + i * 4) as *const u8, DType::F32))
            .sum();
        store(
            f.scale as *mut u8,
            DType::F32,
            1.0 / (sum / f.n + f.eps).sqrt(),
        );
    }
}

/// The factor of a folded norm that a launch applies (1 without one).
fn fold_scale(scale: u64) -> f32 {
    match scale {
        0 => 1.0,
        // SAFETY: a fold's factor is one F32 in the plan's scratch.
        at => unsafe { load(at as *const u8, DType::F32) },
    }
}

/// Host version of split_*_bf16: hi = bf16(x) at dst, lo = bf16(x - hi) at dst + lo_offset.
fn run_split(name: &str, a: SplitArgs) {
    let s = if name.contains("f16_") {
        DType::F16
    } else {
        DType::F32
    };
    for i in 0..a.n {
        let ix = elem(a.src.ne, i);
        let (so, dso) = (offset(a.src.nb, ix), offset(a.dst.nb, ix));
        // SAFETY: lowering placed the source and both halves in the plan's memory.
        unsafe {
            let x = load((a.src.data as i64 + so) as *const u8, s);
            let hi = half::bf16::from_f32(x);
            let lo = half::bf16::from_f32(x - hi.to_f32());
            let d = (a.dst.data as i64 + dso) as *mut u16;
            d.write_unaligned(hi.to_bits());
            d.byte_offset(a.lo_offset as isize)
                .write_unaligned(lo.to_bits());
        }
    }
}

/// Host version of rms_norm_mul_f32_*: y = x / sqrt(mean(x^2) + eps) * w, row by row.
fn run_rms_norm_mul(name: &str, a: NormMulArgs) {
    assert!(
        a.q8 == 0 || a.q8_layout == ACT_F16,
        "the interpreter runs no Q8_1 path"
    );
    let wt = if name.ends_with("bf16") {
        DType::BF16
    } else if name.ends_with("f16") {
        DType::F16
    } else {
        DType::F32
    };
    let rows = a.src.ne[1] * a.src.ne[2] * a.src.ne[3];
    for r in 0..rows {
        let ix = elem([1, a.src.ne[1], a.src.ne[2], a.src.ne[3]], r);
        let at = |t: &Tensor4, i0: i64| t.data as i64 + offset(t.nb, [i0, ix[1], ix[2], ix[3]]);
        // SAFETY: rows of x and y and the weight lie in the plan's memory.
        unsafe {
            let mut ss = 0f32;
            for i0 in 0..a.src.ne[0] {
                let v = load(at(&a.src, i0) as *const u8, DType::F32);
                ss += v * v;
            }
            let scale = 1.0 / (ss / a.src.ne[0] as f32 + a.eps).sqrt();
            for i0 in 0..a.src.ne[0] {
                let v = load(at(&a.src, i0) as *const u8, DType::F32) * scale;
                let w = load((a.w.data as i64 + i0 * a.w.nb[0]) as *const u8, wt);
                store(at(&a.dst, i0) as *mut u8, DType::F32, v * w);
                if a.q8 != 0 {
                    let col = a.q8 as i64 + r * a.q8_nb1;
                    store((col + 2 * i0) as *mut u8, DType::F16, v * w);
                }
            }
        }
    }
}

/// Host version of add_f32_f32 / mul_f32_f32: `b` broadcast over `a` (`i % ne`).
fn run_binary(a: BinaryArgs, f: fn(f32, f32) -> f32) {
    let n: i64 = a.dst.ne.iter().product();
    for i in 0..n {
        let ix = elem(a.dst.ne, i);
        let ib = [0, 1, 2, 3].map(|d| ix[d] % a.b.ne[d]);
        // SAFETY: the three tensors lie in the plan's memory with these shapes.
        unsafe { set_f32(&a.dst, ix, f(get_f32(&a.a, ix), get_f32(&a.b, ib))) };
    }
}

/// Host version of swiglu_f32: y = silu(gate) * up, elementwise, any strides.
fn run_swiglu(a: GluArgs) {
    assert!(
        a.q8 == 0 || a.q8_layout == ACT_F16,
        "the interpreter runs no Q8_1 path"
    );
    let s = fold_scale(a.fold_scale);
    let n: i64 = a.dst.ne.iter().product();
    for i in 0..n {
        let ix = elem(a.dst.ne, i);
        // SAFETY: the three tensors lie in the plan's memory with these shapes.
        unsafe {
            let (g, u) = (s * get_f32(&a.gate, ix), s * get_f32(&a.up, ix));
            let y = g / (1.0 + (-g).exp()) * u;
            set_f32(&a.dst, ix, y);
            if a.q8 != 0 {
                let row = i / a.dst.ne[0];
                let col = a.q8 as i64 + row * a.q8_nb1;
                store((col + 2 * ix[0]) as *mut u8, DType::F16, y);
            }
        }
    }
}

/// Host version of moe_sum_f32: `dst[e, t] = ((y[e, 0, t] w[0, 0, t] + y[e, 1, t]
/// w[0, 1, t]) + ...) (+ r[e, t])`, each product and sum an f32 operation, in slot order;
/// staged, one block that finds every weight first (up to `MOE_SUM_STAGE`: read, or when
/// routed made by [`route_weights`]), else each weight read when its element is computed
/// (so a sum over the weights comes out wrong).
fn run_moe_sum(grid: (u32, u32, u32), a: MoeSumArgs) {
    let n_used = a.y.ne[1];
    let at = |i: i64, t: i64| {
        // SAFETY: w lies in the plan's memory with its shape [1, n_used, n].
        unsafe { get_f32(&a.w, [0, i, t, 0]) }
    };
    let staged: Vec<f32> = match (a.staged, a.logits.data) {
        (0, _) => Vec::new(),
        (_, routed) => {
            assert_eq!(grid, (1, 1, 1), "a staged sum is one block");
            assert!(n_used * a.dst.ne[1] <= i64::from(MOE_SUM_STAGE));
            match routed {
                0 => (0..a.dst.ne[1])
                    .flat_map(|t| (0..n_used).map(move |i| (i, t)))
                    .map(|(i, t)| at(i, t))
                    .collect(),
                _ => route_weights(&a),
            }
        }
    };
    let weight = |i: i64, t: i64| match a.staged {
        0 => at(i, t),
        _ => staged[(i + n_used * t) as usize],
    };
    for t in 0..a.dst.ne[1] {
        for e in 0..a.dst.ne[0] {
            // SAFETY: y, r and dst lie in the plan's memory with these shapes.
            unsafe {
                let term = |i| get_f32(&a.y, [e, i, t, 0]) * weight(i, t);
                let mut sum = (1..n_used).fold(term(0), |acc, i| acc + term(i));
                if a.r.data != 0 {
                    sum += get_f32(&a.r, [e, t, 0, 0]);
                }
                set_f32(&a.dst, [e, t, 0, 0], sum);
            }
        }
    }
}

/// The routing weights moe_sum_f32 makes, `n_used` a token: the softmax of the logits at
/// the ids, its sum in the kernel's order (a warp's butterfly over 32 lanes, zeros past
/// `n_used`).
fn route_weights(a: &MoeSumArgs) -> Vec<f32> {
    let n_used = a.y.ne[1] as usize;
    assert!(n_used <= 32, "a warp a token");
    let mut out = Vec::new();
    for t in 0..a.dst.ne[1] {
        let v: Vec<f32> = (0..n_used as i64)
            .map(|i| {
                // SAFETY: ids [n_used, n] and logits [1, n_expert, n] lie in the plan's
                // memory, and the ids are a top_k of the logits (in range).
                unsafe {
                    let id = *((a.ids.data as i64 + offset(a.ids.nb, [i, t, 0, 0])) as *const i32);
                    get_f32(&a.logits, [0, i64::from(id), t, 0])
                }
            })
            .collect();
        let mx = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if mx == f32::NEG_INFINITY {
            out.extend(std::iter::repeat_n(0.0, n_used));
            continue;
        }
        let mut lanes = [0f32; 32];
        for (l, x) in lanes.iter_mut().zip(&v) {
            *l = (x - mx).exp();
        }
        for o in [16, 8, 4, 2, 1] {
            lanes = std::array::from_fn(|l| lanes[l] + lanes[l ^ o]);
        }
        let inv = 1.0 / lanes[0];
        out.extend(v.iter().map(|x| (x - mx).exp() * inv));
    }
    out
}

/// Host version of cublasGemmEx / cublasGemmBatchedEx (column-major, alpha 1, beta 0 or 1).
fn run_gemm(g: &Gemm) {
    let es = g.dtype.block_bytes() as u64;
    let batch = g.batch as u64;
    for bi in 0..batch {
        let ptr = |array: u64| -> u64 {
            if g.batch == 1 {
                [g.a, g.b, g.c][array as usize]
            } else {
                // SAFETY: the pointer arrays were uploaded into the constants.
                unsafe { *((g.ptrs + 8 * (array * batch + bi)) as *const u64) }
            }
        };
        let (a, b, c) = (ptr(0), ptr(1), ptr(2));
        for j in 0..g.n as u64 {
            for i in 0..g.m as u64 {
                let mut acc = 0f32;
                for l in 0..g.k as u64 {
                    let ai = if g.transa {
                        l + i * g.lda as u64
                    } else {
                        i + l * g.lda as u64
                    };
                    let bi = if g.transb {
                        j + l * g.ldb as u64
                    } else {
                        l + j * g.ldb as u64
                    };
                    // SAFETY: inside the plan's host memory, per cuBLAS's contract.
                    unsafe {
                        acc += load((a + ai * es) as *const u8, g.dtype)
                            * load((b + bi * es) as *const u8, g.dtype);
                    }
                }
                let cp = (c + (i + j * g.ldc as u64) * 4) as *mut u8;
                // SAFETY: as above.
                unsafe {
                    let prev = if g.beta == 0.0 {
                        0.0
                    } else {
                        g.beta * load(cp, DType::F32)
                    };
                    store(cp, DType::F32, prev + acc)
                };
            }
        }
    }
}

/// Runs `y` of graph `g` on the CPU backend and through the host-lowered operations;
/// returns the dispatch (kernel names) and checks the results agree.
fn check(g: &Graph, y: TensorId, inputs: &[TensorId], seed: u64) -> Vec<String> {
    check_within(g, y, inputs, seed, 1e-5)
}

/// [`check`] with an NMSE bound of `tol`.
fn check_within(g: &Graph, y: TensorId, inputs: &[TensorId], seed: u64, tol: f64) -> Vec<String> {
    check_lowering(g, y, inputs, seed, tol, false)
}
/// Runs one lowered operation in host memory with the interpreter; returns its name.
fn interpret(op: &DevOp) -> String {
    let l = match op {
        DevOp::Kernel(l) => l,
        DevOp::AllReduce(_) => panic!("unexpected all_reduce in a one-device plan"),
        DevOp::Gemm(gm) => {
            run_gemm(gm);
            return format!(
                "gemm(batch {}, t{}{})",
                gm.batch,
                u8::from(gm.transa),
                u8::from(gm.transb)
            );
        }
    };
    let name = l.kernel.name;
    match name {
        _ if name.starts_with("cpy_") => run_cpy(name, args(l)),
        _ if name.starts_with("split_") => run_split(name, args(l)),
        _ if name.starts_with("mul_mat_") => run_gemv(name, args(l)),
        _ if name.starts_with("rms_norm_mul_") => run_rms_norm_mul(name, args(l)),
        "scale_f32" => run_scale(args(l)),
        "add_f32_f32" => run_binary(args(l), |x, y| x + y),
        "rms_norm_f32" => run_rms_norm(args(l)),
        "mul_f32_f32" => run_binary(args(l), |x, y| x * y),
        "swiglu_f32" => run_swiglu(args(l)),
        "moe_sum_f32" => run_moe_sum(l.grid, args(l)),
        "top_k_f32" | "top_k_warp_f32" => run_top_k(args(l)),
        "get_rows_f32" => run_get_rows(args(l)),
        "soft_max_f32" => run_soft_max(args(l)),
        _ => panic!("unexpected kernel {name}"),
    }
    name.to_string()
}

/// `top_k_f32`, `top_k_warp_f32`: the I32 indices of each row's `k` largest, in the
/// order of [`crate::ops::topk::top_k_row`].
fn run_top_k(a: TopKArgs) {
    for r in 0..a.src.ne[1] * a.src.ne[2] * a.src.ne[3] {
        let ix = elem([1, a.src.ne[1], a.src.ne[2], a.src.ne[3]], r);
        // SAFETY: src and dst lie in the plan's memory with these shapes.
        unsafe {
            let row: Vec<f32> = (0..a.src.ne[0])
                .map(|i| get_f32(&a.src, [i, ix[1], ix[2], ix[3]]))
                .collect();
            for (j, id) in (0..).zip(crate::ops::topk::top_k_row(&row, a.k as usize)) {
                let at = a.dst.data as i64 + offset(a.dst.nb, [j, ix[1], ix[2], ix[3]]);
                *(at as *mut i32) = id as i32;
            }
        }
    }
}

/// `get_rows_f32`: dst row (i1, i2, i3) = row ids[i1, i2, i3] of the F32 table's matrix
/// (i2, i3); the ids must be in range.
fn run_get_rows(a: RowsArgs) {
    let n: i64 = a.dst.ne.iter().product();
    for i in 0..n {
        let [i0, i1, i2, i3] = elem(a.dst.ne, i);
        // SAFETY: the three tensors lie in the plan's memory with these shapes.
        unsafe {
            let id = *((a.ids.data as i64 + offset(a.ids.nb, [i1, i2, i3, 0])) as *const i32);
            assert!(
                (0..a.src.ne[1]).contains(&i64::from(id)),
                "id {id} in range"
            );
            let v = get_f32(&a.src, [i0, i64::from(id), i2, i3]);
            set_f32(&a.dst, [i0, i1, i2, i3], v);
        }
    }
}

/// `soft_max_f32` without a mask: each row of `src * scale`, its max subtracted, exp'd
/// and divided by the sum.
fn run_soft_max(a: SoftMaxArgs) {
    assert_eq!(a.mask.data, 0, "the interpreter runs no mask");
    for r in 0..a.src.ne[1] * a.src.ne[2] * a.src.ne[3] {
        let ix = elem([1, a.src.ne[1], a.src.ne[2], a.src.ne[3]], r);
        let at = |i: i64| [i, ix[1], ix[2], ix[3]];
        // SAFETY: src and dst lie in the plan's memory with these shapes.
        unsafe {
            let v: Vec<f32> = (0..a.src.ne[0])
                .map(|i| get_f32(&a.src, at(i)) * a.scale)
                .collect();
            let mx = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = v.iter().map(|x| (x - mx).exp()).sum();
            for (i, x) in (0..).zip(&v) {
                set_f32(&a.dst, at(i), (x - mx).exp() / sum);
            }
        }
    }
}

/// `scale_f32`: dst = src * scale, F32, any strides.
fn run_scale(a: UnaryArgs) {
    let n: i64 = a.dst.ne.iter().product();
    for i in 0..n {
        let ix = elem(a.dst.ne, i);
        // SAFETY: both tensors lie in the plan's memory with these shapes.
        unsafe { set_f32(&a.dst, ix, get_f32(&a.src, ix) * a.scale) };
    }
}

/// `rms_norm_f32`: the same kernel as rms_norm_mul with a weight of ones.
fn run_rms_norm(a: NormArgs) {
    let ones = vec![1f32; a.src.ne[0] as usize];
    run_rms_norm_mul(
        "rms_norm_mul_f32_f32",
        NormMulArgs {
            src: a.src,
            dst: a.dst,
            w: Tensor4 {
                data: ones.as_ptr() as u64,
                ne: [a.src.ne[0], 1, 1, 1],
                nb: [4, 0, 0, 0],
            },
            eps: a.eps,
            vec: 0,
            q8: 0,
            q8_nb1: 0,
            q8_layout: 0,
            w_early: 0,
        },
    );
}

/// [`check_within`], lowering with step fusion on or off.
fn check_lowering(
    g: &Graph,
    y: TensorId,
    inputs: &[TensorId],
    seed: u64,
    tol: f64,
    fusion: bool,
) -> Vec<String> {
    let (names, got, want) = run_on_host(g, y, inputs, seed, fusion);
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        num += (*g as f64 - *w as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    let nmse = num / den;
    assert!(nmse < tol, "{names:?}: NMSE {nmse:e} against the CPU");
    names
}

/// Runs `y` of graph `g` (the `inputs` random in -1..1 from `seed`) on the CPU backend
/// and through the host-lowered operations, with step fusion on or off: the kernel
/// names, the lowered result and the CPU's.
pub(super) fn run_on_host(
    g: &Graph,
    y: TensorId,
    inputs: &[TensorId],
    seed: u64,
    fusion: bool,
) -> (Vec<String>, Vec<f32>, Vec<f32>) {
    let plan = g.plan(&[y]).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut cpu = CpuBackend::new();
    let e = cpu.load(&plan).unwrap();
    let (ops, mut mem) = lower_on_host_with(&plan, fusion);
    for &id in inputs {
        let io = plan.inputs.iter().find(|io| io.operand.id == id).unwrap();
        let n = io.operand.nelements();
        let vals: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let es = io.operand.dtype.block_bytes();
        let mut bytes = vec![0u8; n * es];
        for (i, &v) in vals.iter().enumerate() {
            // SAFETY: inside `bytes`.
            unsafe { store(bytes.as_mut_ptr().add(i * es), io.operand.dtype, v) };
        }
        cpu.set_input(e, id, &bytes).unwrap();
        let Loc::Arena(off) = io.operand.loc else {
            unreachable!()
        };
        bytemuck::cast_slice_mut::<u64, u8>(&mut mem.arena)[off..off + bytes.len()]
            .copy_from_slice(&bytes);
    }
    cpu.compute(e).unwrap();
    let out = plan.outputs[0].operand.clone();
    let want = cpu.get_output_f32(e, y, out.nelements()).unwrap();

    let names: Vec<String> = ops.iter().flatten().map(interpret).collect();
    let Loc::Arena(off) = out.loc else {
        unreachable!()
    };
    let got: &[f32] = bytemuck::cast_slice(
        &bytemuck::cast_slice::<u64, u8>(&mem.arena)[off..off + out.nelements() * 4],
    );
    (names, got.to_vec(), want)
}

/// BF16 weights times F32 activations in cuBLAS: the split keeps the activations to about
/// 16 bits, so the product is far closer to the CPU's (f32 activations) than BF16
/// activations alone would be (NMSE about 1e-6 here).
#[test]
fn bf16_split_keeps_activation_precision() {
    let mut g = Graph::new();
    let a = g.input("a", DType::BF16, &[256, 24]).unwrap();
    let b = g.input("b", DType::F32, &[256, 8]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(
        check_within(&g, y, &[a, b], 11, 1e-9),
        vec!["split_f32_bf16", "gemm(batch 1, t10)", "gemm(batch 1, t10)"]
    );
}

#[test]
fn decode_gemv_paths() {
    for (dt, k, kernel) in [
        (DType::F16, 64, "mul_mat_vec_f16"),
        (DType::F16, 37, "mul_mat_vec_f16"),
        (DType::BF16, 40, "mul_mat_vec_bf16"),
        (DType::F32, 33, "mul_mat_vec_f32"),
    ] {
        let mut g = Graph::new();
        let w = g.input("w", dt, &[k, 9]).unwrap();
        let x = g.input("x", DType::F32, &[k]).unwrap();
        let y = g.mul_mat(w, x).unwrap();
        assert_eq!(check(&g, y, &[w, x], 1), vec![kernel.to_string()]);
    }
}

#[test]
fn attention_gemv_paths() {
    let (hd, ctx, kvh, nh) = (16, 40, 2, 6);
    // Permuted K-cache view [hd, n_kv, kvh] over a cache of rows [hd * kvh] per position.
    let mut g = Graph::new();
    let kc = g.input("kc", DType::F16, &[hd * kvh, ctx]).unwrap();
    let kv = g
        .view_3d(kc, hd, ctx - 3, kvh, hd * kvh * 2, hd * 2, 0)
        .unwrap();
    let q = g.input("q", DType::F32, &[hd, nh, 1]).unwrap();
    let qp = g.permute(q, [0, 2, 1, 3]).unwrap();
    let y = g.mul_mat(kv, qp).unwrap();
    assert_eq!(check(&g, y, &[kc, q], 2), vec!["mul_mat_p021_f16_f32"]);

    // Transposed V-cache view [n_kv, hd, kvh] with rows along positions (k > 256).
    let ctx = 300;
    let mut g = Graph::new();
    let vc = g.input("vc", DType::F16, &[ctx, hd, kvh]).unwrap();
    let vv = g
        .view_3d(vc, ctx - 5, hd, kvh, ctx * 2, ctx * hd * 2, 0)
        .unwrap();
    let p = g.input("p", DType::F32, &[ctx - 5, 1, nh]).unwrap();
    let y = g.mul_mat(vv, p).unwrap();
    assert_eq!(check(&g, y, &[vc, p], 3), vec!["mul_mat_vec_nc_f16_f32"]);
}

/// The decode kernels of one query: with one row per KV head (MHA) the streamed one for
/// F16 and BF16 caches whose rows start 16-byte aligned and Q8_0 and Q4_0 caches (head dim
/// 128) whose rows start 8-byte aligned, in one wave of chunks; the register one for F32
/// caches and for rows off that alignment. GQA: F16 on the tensor-core kernel, aligned
/// Q8_0 and Q4_0 streamed (a block per 4 query heads of a KV head; with a mask per head a
/// block per query head), BF16 and unaligned rows on `fattn_vec`.
#[test]
fn one_query_decode_attention_kernels() {
    use crate::graph::FlashAttnParams;
    let (hd, ctx) = (128, 4400);
    // the kernel (less its `fattn_` prefix) and the splits on 132 SMs (H100 SXM, H200)
    // and on 108 (A100): the streamed kernel's one wave of 4 blocks an SM holds 16 chunks
    // of 32 heads on the first, 13 on the second
    for (dt, n_head_kv, mask_heads, offs, n_kv, want, splits) in [
        (DType::F16, 32, 1, 0, 4352, "vec1s_d128_f16", [16, 13]),
        (DType::BF16, 32, 1, 0, 768, "vec1s_d128_bf16", [12, 12]),
        (DType::F16, 32, 1, 2, 4352, "vec1_d128_f16", [17, 14]),
        (DType::Q8_0, 32, 1, 0, 4352, "vec1s_d128_q8_0", [16, 13]),
        (DType::Q4_0, 32, 32, 0, 768, "vec1s_d128_q4_0", [12, 12]),
        (DType::Q8_0, 32, 1, 4, 4352, "vec1_d128_q8_0", [17, 14]),
        (DType::F32, 32, 1, 0, 4352, "vec1_d128_f32", [17, 14]),
        (DType::F16, 16, 1, 0, 4352, "dec_d128_f16", [46, 46]),
        // GQA: quantized caches streamed, a block per 4 query heads of a KV head (8 KV
        // heads: 8 blocks a chunk, 64 chunks fit one wave on 132 SMs, 54 on 108), or per
        // query head with a mask per head
        (DType::Q8_0, 8, 1, 0, 4352, "vec4s_d128_q8_0", [64, 54]),
        (DType::Q4_0, 8, 1, 0, 768, "vec4s_d128_q4_0", [12, 12]),
        (DType::Q8_0, 4, 1, 0, 4352, "vec4s_d128_q8_0", [64, 54]),
        (DType::Q4_0, 16, 1, 0, 4352, "vec4s_d128_q4_0", [33, 27]),
        (DType::Q8_0, 8, 32, 0, 4352, "vec1s_d128_q8_0", [16, 13]),
        (DType::Q8_0, 8, 1, 4, 4352, "vec_d128_q8_0", [64, 54]),
        (DType::BF16, 8, 1, 0, 4352, "vec_d128_bf16", [64, 54]),
    ] {
        let mut g = Graph::new();
        let (hs, row) = (dt.row_bytes(hd), dt.row_bytes(hd) * n_head_kv);
        let kc = g.input("kc", dt, &[hd * n_head_kv, ctx]).unwrap();
        let vc = g.input("vc", dt, &[hd * n_head_kv, ctx]).unwrap();
        let k = g.view_3d(kc, hd, n_kv, n_head_kv, row, hs, offs).unwrap();
        let v = g.view_3d(vc, hd, n_kv, n_head_kv, row, hs, offs).unwrap();
        let q = g.input("q", DType::F32, &[hd, 1, 32]).unwrap();
        let mask = g.input("mask", DType::F16, &[n_kv, 1, mask_heads]).unwrap();
        let p = FlashAttnParams {
            scale: 0.1,
            max_bias: 0.0,
            softcap: 0.0,
        };
        let y = g.flash_attn_ext(q, k, v, Some(mask), p).unwrap();
        let plan = g.plan(&[y]).unwrap();
        for (sms, split) in [132, 108].into_iter().zip(splits) {
            let mut lw = Lowering {
                sms,
                ..Lowering::new(&fake_addr, true, 1)
            };
            let steps = lower_plan(&plan, &mut lw, false, |_| 0).unwrap();
            let launches = kernel_launches(&steps);
            let names: Vec<&str> = launches.iter().map(|l| l.kernel.name).collect();
            let a = args::<FattnArgs>(launches[0]);
            let kernel = format!("fattn_{want}");
            assert_eq!(names, [kernel.as_str(), "fattn_combine"], "{dt} {offs}");
            assert_eq!(a.split, split, "{want} on {sms} SMs");
            // the streamed kernels' one wave at most 4 blocks an SM; the others uncapped
            let (one, four) = (want.starts_with("vec1s"), want.starts_with("vec4s"));
            let cap = if one || four { 4 } else { 0 };
            assert_eq!(launches[0].per_sm, cap, "{want}");
            assert_eq!(launches[1].per_sm, 0);
            assert_eq!(launches[0].early, !want.starts_with("dec"), "{want}");
            assert_eq!(launches[0].grid.0 as i64, split);
            // blocks along y: query heads (fattn_vec1s), 4 query heads of a KV head
            // (fattn_vec4s), KV heads (the others)
            let heads = match (one, four) {
                (true, _) => 32,
                (_, true) => n_head_kv * (32 / n_head_kv).div_ceil(4),
                _ => n_head_kv,
            };
            assert_eq!(launches[0].grid.1 as usize, heads, "{want}");
            assert!(a.split * a.chunk >= n_kv as i64 && (a.split - 1) * a.chunk < n_kv as i64);
        }
    }
}

/// Operands cuBLAS reads as they are: dense, batched with broadcast, either one
/// transposed.
#[test]
fn cublas_paths_in_place() {
    // F16 weights, F32 activations: converted, plain GEMM.
    let mut g = Graph::new();
    let w = g.input("w", DType::F16, &[24, 10]).unwrap();
    let x = g.input("x", DType::F32, &[24, 7]).unwrap();
    let y = g.mul_mat(w, x).unwrap();
    assert_eq!(
        check(&g, y, &[w, x], 4),
        vec!["cpy_f32_f16", "gemm(batch 1, t10)"]
    );

    // Batched with broadcast of `a` in dims 2 and 3 (GQA-style), F32 both.
    let mut g = Graph::new();
    let a = g.input("a", DType::F32, &[8, 5, 2, 1]).unwrap();
    let b = g.input("b", DType::F32, &[8, 3, 4, 3]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(check(&g, y, &[a, b], 5), vec!["gemm(batch 12, t10)"]);

    // `a` transposed (dim 1 dense): read without transposing; BF16 both.
    let mut g = Graph::new();
    let at = g.input("at", DType::BF16, &[8, 16]).unwrap();
    let a = g.transpose(at).unwrap(); // [16, 8], nb0 = 16
    let b = g.input("b", DType::BF16, &[16, 4]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(check(&g, y, &[at, b], 6), vec!["gemm(batch 1, t00)"]);

    // `b` transposed (dim 1 dense): read transposed.
    let mut g = Graph::new();
    let a = g.input("a", DType::F32, &[8, 5]).unwrap();
    let bt = g.input("bt", DType::F32, &[4, 8]).unwrap();
    let b = g.transpose(bt).unwrap(); // [8, 4], nb0 = 16
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(check(&g, y, &[a, bt], 7), vec!["gemm(batch 1, t11)"]);
}

/// Operands cuBLAS cannot read as they are: copied densely (or with 16-byte rows) first.
#[test]
fn cublas_paths_copied() {
    // Rows, leading dimensions or batch strides off 16 bytes (an F16 view 2 bytes into
    // its tensor, 98-byte rows): copied with 16-byte rows first, never given to cuBLAS.
    let mut g = Graph::new();
    let a0 = g.input("a0", DType::F16, &[49, 1, 2, 2]).unwrap();
    let a = g.view(a0, [48, 1, 2, 2], [2, 98, 98, 196], 2).unwrap();
    let b = g.input("b", DType::F16, &[48, 8, 2, 2]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(
        check(&g, y, &[a0, b], 12),
        vec!["cpy_f16_f16", "gemm(batch 4, t10)"]
    );
    let mut g = Graph::new();
    let a = g.input("a", DType::F16, &[10, 6]).unwrap(); // 20-byte rows
    let b = g.input("b", DType::F16, &[10, 3]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(
        check(&g, y, &[a, b], 13),
        vec!["cpy_f16_f16", "cpy_f16_f16", "gemm(batch 1, t10)"]
    );

    // Neither dim of `a` dense: copied densely first. `b` F16 under F32 `a`: converted.
    let mut g = Graph::new();
    let a0 = g.input("a0", DType::F32, &[3, 7, 5]).unwrap();
    let a = g.permute(a0, [2, 0, 1, 3]).unwrap(); // [7, 5, 3], nb0 = 12, nb1 = 84
    let b = g.input("b", DType::F16, &[7, 2, 3]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(
        check(&g, y, &[a0, b], 9),
        vec!["cpy_f16_f32", "cpy_f32_f32", "gemm(batch 3, t10)"]
    );
}

/// Attention's permuted operands and BF16 channels: batched GEMMs over heads.
#[test]
fn cublas_paths_batched() {
    // Permuted attention operands: batched over heads with GQA, activations converted.
    let (hd, ctx, kvh, nh, t) = (16, 24, 2, 4, 3);
    let mut g = Graph::new();
    let kc = g.input("kc", DType::F16, &[hd * kvh, ctx]).unwrap();
    let kv = g
        .view_3d(kc, hd, ctx, kvh, hd * kvh * 2, hd * 2, 0)
        .unwrap();
    let q = g.input("q", DType::F32, &[hd, nh, t]).unwrap();
    let qp = g.permute(q, [0, 2, 1, 3]).unwrap();
    let y = g.mul_mat(kv, qp).unwrap();
    assert_eq!(
        check(&g, y, &[kc, q], 8),
        vec!["cpy_f32_f16", "gemm(batch 4, t10)"]
    );

    // One column but channels of another dtype than F16: batched GEMM, n = 1; BF16
    // weights take the F32 activations as two BF16 halves (two GEMMs, summed).
    let mut g = Graph::new();
    let a = g.input("a", DType::BF16, &[16, 6, 2]).unwrap();
    let b = g.input("b", DType::F32, &[16, 1, 4]).unwrap();
    let y = g.mul_mat(a, b).unwrap();
    assert_eq!(
        check(&g, y, &[a, b], 10),
        vec!["split_f32_bf16", "gemm(batch 4, t10)", "gemm(batch 4, t10)"]
    );
}

/// A decode block's pairs fuse (norm and its weight, SwiGLU, GEMV and the residual add)
/// and compute what the CPU does; a pair whose middle result has another reader does not.
#[test]
fn fusion_patterns() {
    let (d, ff) = (64, 48);
    let mut g = Graph::new();
    // The residual stream is an intermediate, as in a model: each add runs in place on it.
    let x0 = g.input("x0", DType::F32, &[d, 1]).unwrap();
    let x = g.scale(x0, 0.5).unwrap();
    let wn = g.input("wn", DType::BF16, &[d]).unwrap();
    let wo = g.input("wo", DType::F16, &[d, d]).unwrap();
    let wgu = g.input("wgu", DType::F16, &[d, 2 * ff]).unwrap();
    let wd = g.input("wd", DType::F16, &[ff, d]).unwrap();
    let cur = g.rms_norm(x, 1e-5).unwrap();
    let cur = g.mul(cur, wn).unwrap(); // rms_norm_mul
    let o = g.mul_mat(wo, cur).unwrap();
    let x1 = g.add(x, o).unwrap(); // gemv + add
    let gu = g.mul_mat(wgu, x1).unwrap();
    let row = g.tensor(gu).nb[1];
    let gate = g.view_2d(gu, ff, 1, row, 0).unwrap();
    let up = g.view_2d(gu, ff, 1, row, ff * 4).unwrap();
    let h = g.silu(gate).unwrap();
    let h = g.mul(h, up).unwrap(); // swiglu
    let dn = g.mul_mat(wd, h).unwrap();
    let y = g.add(dn, x1).unwrap(); // gemv + add, the product first
    assert_eq!(
        check_lowering(&g, y, &[x0, wn, wo, wgu, wd], 14, 1e-9, true),
        [
            "scale_f32",
            "rms_norm_mul_f32_bf16",
            "mul_mat_vec_f16",
            "mul_mat_vec_f16",
            "swiglu_f32",
            "mul_mat_vec_f16"
        ]
    );

    // The add's result lands in the block the GEMV's input vector had (free once the
    // unfused GEMV is done): fusing would overwrite the vector while it is read.
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[d, 1]).unwrap();
    let v0 = g.input("v0", DType::F32, &[d, 1]).unwrap();
    let wo = g.input("wo", DType::F16, &[d, d]).unwrap();
    let v = g.scale(v0, 0.5).unwrap();
    let o = g.mul_mat(wo, v).unwrap();
    let x1 = g.add(x, o).unwrap();
    let plan = g.plan(&[x1]).unwrap();
    let (loc_of, find) = (
        |id| plan.alloc.info[id].offset,
        |op: &str| plan.steps.iter().find(|s| s.op.name() == op).unwrap(),
    );
    assert_eq!(
        loc_of(find("add").dst.id),
        loc_of(find("mul_mat").src[1].id),
        "the allocator reuses the vector's block (the case this checks)"
    );
    assert_eq!(
        check_lowering(&g, x1, &[x, v0, wo], 16, 1e-9, true),
        ["scale_f32", "mul_mat_vec_f16", "add_f32_f32"]
    );

    // The norm is read twice: nothing fuses with it; the product's add still does.
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[d, 1]).unwrap();
    let wn = g.input("wn", DType::F32, &[d]).unwrap();
    let wo = g.input("wo", DType::F32, &[d, d]).unwrap();
    let n = g.rms_norm(x, 1e-5).unwrap();
    let cur = g.mul(n, wn).unwrap();
    let o = g.mul_mat(wo, cur).unwrap();
    let y = g.add(o, n).unwrap();
    let names = check_lowering(&g, y, &[x, wn, wo], 15, 1e-9, true);
    assert!(
        !names.iter().any(|k| k.starts_with("rms_norm_mul")),
        "{names:?}"
    );
    assert_eq!(names.last().map(String::as_str), Some("mul_mat_vec_f32"));
}

/// Two decode FFN blocks whose norms fold (o + add + norm, then down + add + norm), 70
/// rows (the last block of a fold's launch has 2): the result (the second SwiGLU, plus a
/// view of the second product's result when `extra_reader`) and the inputs.
fn fold_graph(extra_reader: bool) -> (Graph, TensorId, Vec<TensorId>) {
    let (d, ff) = (70, 40);
    let mut g = Graph::new();
    let x0 = g.input("x0", DType::F32, &[d, 1]).unwrap();
    let v0 = g.input("v0", DType::F32, &[d, 1]).unwrap();
    let x = g.scale(x0, 4.0).unwrap();
    let v = g.scale(v0, 0.5).unwrap();
    let wo = g.input("wo", DType::F16, &[d, d]).unwrap();
    let wd = g.input("wd", DType::BF16, &[ff, d]).unwrap();
    let mut inputs = vec![x0, v0, wo, wd];
    let mut ffn = |g: &mut Graph, x: TensorId, name: &str| {
        let wn = g.input(&format!("{name}.wn"), DType::F32, &[d]).unwrap();
        let wgu = g
            .input(&format!("{name}.wgu"), DType::F32, &[d, 2 * ff])
            .unwrap();
        inputs.extend([wn, wgu]);
        let n = g.rms_norm(x, 1e-5).unwrap();
        let cur = g.mul(n, wn).unwrap();
        let gu = g.mul_mat(wgu, cur).unwrap();
        let row = g.tensor(gu).nb[1];
        let gate = g.view_2d(gu, ff, 1, row, 0).unwrap();
        let up = g.view_2d(gu, ff, 1, row, ff * 4).unwrap();
        let h = g.silu(gate).unwrap();
        (g.mul(h, up).unwrap(), up)
    };
    let o = g.mul_mat(wo, v).unwrap();
    let x1 = g.add(x, o).unwrap();
    let (h, _) = ffn(&mut g, x1, "l0");
    let dn = g.mul_mat(wd, h).unwrap();
    let x2 = g.add(dn, x1).unwrap();
    let (h2, up2) = ffn(&mut g, x2, "l1");
    let y = match extra_reader {
        true => g.add(h2, up2).unwrap(),
        false => h2,
    };
    (g, y, inputs)
}

/// The decode plans (classic attention, then flash attention) of the tiny preset with
/// every weight of type `wt`, a 256-slot cache: (flash attention, layers, plan).
fn tiny_decode_plans(wt: DType) -> Vec<(bool, usize, Plan)> {
    use crate::graph::BufferId;
    use crate::models::arch::presets;
    use crate::models::blocks::build_decode;
    use crate::models::blocks::kv_cache::KvCache;
    use crate::models::load::options::CacheTypes;
    use crate::models::load::weights::{uniform, Weights};
    let cfg = presets::preset("tiny").unwrap();
    let w = Weights::layout(&cfg, &uniform(wt), BufferId::fresh());
    [false, true]
        .into_iter()
        .map(|flash_attn| {
            let types = CacheTypes {
                flash_attn,
                ..CacheTypes::default()
            };
            let kv = KvCache::layout(&cfg, 256, types, BufferId::fresh());
            let plan = build_decode(&cfg, &w, &kv, 256).unwrap().plan().unwrap();
            (flash_attn, cfg.num_hidden_layers, plan)
        })
        .collect()
}

/// A decode step of an F16 Llama: every norm after a layer's o or down product is folded
/// (the first layer's attention norm follows the embedding, the final norm feeds the
/// head, so those two stay `rms_norm_mul` launches), each applied by the next
/// `rope_store` or SwiGLU, with or without flash attention; without fusion nothing folds.
#[test]
fn decode_norm_folds() {
    let hidden = crate::models::arch::presets::preset("tiny")
        .unwrap()
        .hidden_size;
    for (flash_attn, l, plan) in tiny_decode_plans(DType::F16) {
        for fusion in [true, false] {
            let mut lw = Lowering {
                scratch_base: 1 << 50,
                ..Lowering::new(&fake_addr_any, true, 1)
            };
            let ops = lower_plan(&plan, &mut lw, fusion, |_| 0).unwrap();
            let launches = kernel_launches(&ops);
            let count = |k: &str| launches.iter().filter(|l| l.kernel.name == k).count();
            let (folds, norms) = match fusion {
                true => (2 * l - 1, 2),
                false => (0, 0),
            };
            for k in ["mul_mat_vec_fold_f16", "mul_mat_vec_total_f16"] {
                assert_eq!(count(k), folds, "{k} {flash_attn} {fusion}");
            }
            assert_eq!(
                count("rms_norm_mul_f32_f32"),
                norms,
                "{flash_attn} {fusion}"
            );
            if !fusion {
                continue;
            }
            // each fold is taken by the launch after the next product, in order
            let mut pending = None;
            for launch in &launches {
                let taken = match launch.kernel.name {
                    "mul_mat_vec_fold_f16" => {
                        assert!(pending.is_none(), "a fold before the last was taken");
                        // SAFETY: the args point into the plan's constants, as lowered
                        let f: NormFold = unsafe {
                            let at = args::<GemvArgs>(launch).fold - lw.consts_base;
                            std::ptr::read_unaligned(lw.consts.as_ptr().add(at as usize).cast())
                        };
                        assert_eq!((f.n, f.count), (hidden as f32, hidden.div_ceil(4) as i64));
                        pending = Some(f.scale);
                        continue;
                    }
                    "rope_store_f16" => args::<RopeStoreArgs>(launch).fold_scale,
                    "swiglu_f32" => args::<GluArgs>(launch).fold_scale,
                    _ => continue,
                };
                assert_eq!(Some(taken).filter(|&p| p != 0), pending.take());
            }
            assert!(pending.is_none());
        }
    }
}

/// The decode norm folded into the launches around the product after it, checked by the
/// interpreter against the CPU: two folds in a row, each applied by the SwiGLU after the
/// next product; and no fold where that product's result has another reader.
#[test]
fn norm_fold_pattern() {
    let (g, y, inputs) = fold_graph(false);
    let names = check_lowering(&g, y, &inputs, 17, 1e-9, true);
    assert_eq!(
        names,
        [
            "scale_f32",
            "scale_f32",
            "mul_mat_vec_fold_f16",
            "mul_mat_vec_total_f32",
            "swiglu_f32",
            "mul_mat_vec_fold_bf16",
            "mul_mat_vec_total_f32",
            "swiglu_f32"
        ]
    );
    let plan = g.plan(&[y]).unwrap();
    let (ops, _) = lower_on_host_with(&plan, true);
    let swiglus: Vec<GluArgs> = kernel_launches(&ops)
        .iter()
        .filter(|l| l.kernel.name == "swiglu_f32")
        .map(|l| args(l))
        .collect();
    // each fold's vector, sums and factor are held in scratch until its SwiGLU takes them,
    // so the second fold's factor is where the first's was
    assert_eq!(swiglus.len(), 2);
    assert_ne!(swiglus[0].fold_scale, 0);
    assert_eq!(swiglus[0].fold_scale, swiglus[1].fold_scale);

    // The second product's result also read by the final add: its norm stays a launch.
    let (g, y, inputs) = fold_graph(true);
    let names = check_lowering(&g, y, &inputs, 18, 1e-9, true);
    let count = |k: &str| names.iter().filter(|n| n.starts_with(k)).count();
    assert_eq!(count("rms_norm_mul"), 1, "{names:?}");
    assert_eq!(count("mul_mat_vec_fold"), 1, "{names:?}");
    assert_eq!(count("mul_mat_vec_total"), 1, "{names:?}");
}

/// A folded norm's scratch (its block sums, `y * w` and factor) is held until the launch
/// that applies the factor: the Q8_1 copy that launch writes for the quantized product
/// after it lies past that scratch, and the product reads the copy.
#[test]
fn pending_fold_holds_its_scratch() {
    use crate::quant::QType;
    let (d, ff) = (64, 32);
    let mut g = Graph::new();
    let x0 = g.input("x0", DType::F32, &[d, 1]).unwrap();
    let v0 = g.input("v0", DType::F32, &[d, 1]).unwrap();
    let x = g.scale(x0, 4.0).unwrap();
    let v = g.scale(v0, 0.5).unwrap();
    let wo = g.input("wo", DType::F16, &[d, d]).unwrap();
    let wn = g.input("wn", DType::F32, &[d]).unwrap();
    let wgu = g.input("wgu", DType::F32, &[d, 2 * ff]).unwrap();
    let wd = g.input("wd", DType::Quant(QType::Q4_0), &[ff, d]).unwrap();
    let o = g.mul_mat(wo, v).unwrap();
    let x1 = g.add(x, o).unwrap();
    let n = g.rms_norm(x1, 1e-5).unwrap();
    let cur = g.mul(n, wn).unwrap();
    let gu = g.mul_mat(wgu, cur).unwrap();
    let row = g.tensor(gu).nb[1];
    let gate = g.view_2d(gu, ff, 1, row, 0).unwrap();
    let up = g.view_2d(gu, ff, 1, row, ff * 4).unwrap();
    let h = g.silu(gate).unwrap();
    let h = g.mul(h, up).unwrap();
    let y = g.mul_mat(wd, h).unwrap();
    let plan = g.plan(&[y]).unwrap();
    let base = 1 << 40;
    let mut lw = Lowering {
        scratch_base: base,
        ..Lowering::new(&fake_addr_any, true, 1)
    };
    let ops = lower_plan(&plan, &mut lw, true, |_| 0).unwrap();
    let launches = kernel_launches(&ops);
    let names: Vec<&str> = launches.iter().map(|l| l.kernel.name).collect();
    assert_eq!(
        names,
        [
            "scale_f32",
            "scale_f32",
            "mul_mat_vec_fold_f16",
            "mul_mat_vec_total_f32",
            "swiglu_f32",
            "mul_mat_vec_q_c1_q4_0"
        ]
    );
    // the fold's scratch: block sums (16 floats), y * w (64), the factor, each aligned
    let held = 3 * REGION_ALIGN as u64;
    let swiglu = args::<GluArgs>(launches[4]);
    assert_eq!(swiglu.fold_scale, base + 2 * REGION_ALIGN as u64);
    assert_eq!(swiglu.q8, base + held);
    assert_eq!(args::<QGemvArgs>(launches[5]).b, swiglu.q8);
    assert!(lw.scratch_need > held as usize);
}

#[test]
fn f16_round_trip_of_the_interpreter() {
    // The interpreter's loads and stores agree with `half` (guards the checks above).
    let mut b = [0u8; 2];
    // SAFETY: two bytes.
    unsafe { store(b.as_mut_ptr(), DType::F16, 0.1) };
    assert_eq!(f16::from_le_bytes(b), f16::from_f32(0.1));
}

/// Every elementwise op has a kernel per float dtype, named after the op (the functor of
/// the same name was instantiated), and the dtype-keyed sets answer for each dtype.
#[test]
fn elementwise_kernel_sets_cover_every_op() {
    use crate::graph::{BinaryOp, UnaryOp};
    for &op in UnaryOp::ALL {
        let set = super::kernels::unary(op);
        assert_eq!(set.name, op.name());
        for dt in DType::FLOATS {
            assert_eq!(
                set.get([dt]).unwrap().id.name,
                format!("{}_{}", op.name(), dt)
            );
        }
        assert!(set.get([DType::I32]).is_err());
    }
    for &op in BinaryOp::ALL {
        let set = super::kernels::binary(op);
        for a in DType::FLOATS {
            for b in DType::FLOATS {
                assert_eq!(
                    set.get([a, b]).unwrap().id.name,
                    format!("{}_{a}_{b}", op.name())
                );
            }
        }
    }
}

/// The address [`lower_all_reduce`] gives an arena location (no memory behind it).
fn fake_addr(loc: Loc) -> u64 {
    match loc {
        Loc::Arena(off) => 0x1000 + off as u64,
        Loc::Buffer(..) => panic!("these plans use no buffers"),
    }
}

/// The all_reduce steps of `plan` lowered for a member of a group of `devices` GPUs.
fn lower_all_reduce(plan: &Plan, devices: usize) -> Vec<Result<Vec<DevOp>, String>> {
    let mut lw = Lowering::new(&fake_addr, true, devices);
    plan.steps
        .iter()
        .filter(|s| s.op.name() == "all_reduce")
        .map(|s| super::lower::lower_step(s, &mut lw))
        .collect()
}

/// An all_reduce over the group's GPUs becomes one NCCL all-reduce of the tensor's
/// elements from its source into its result; over a size other than the group's it is an
/// error naming both; over one device it is a copy or nothing.
#[test]
fn all_reduce_lowers_to_nccl_over_the_group() {
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[7, 3]).unwrap();
    let y = g.scale(x, 2.0).unwrap();
    let s = g.all_reduce(y, 2).unwrap();
    let plan = g.plan(&[s]).unwrap();
    let step = plan
        .steps
        .iter()
        .find(|st| st.op.name() == "all_reduce")
        .unwrap();
    let ops = lower_all_reduce(&plan, 2).remove(0).unwrap();
    assert_eq!(ops.len(), 1);
    match &ops[0] {
        DevOp::AllReduce(a) => {
            assert_eq!(a.count, 21);
            assert_eq!(a.send, fake_addr(step.src[0].loc));
            assert_eq!(a.recv, fake_addr(step.dst.loc));
        }
        other @ (DevOp::Kernel(_) | DevOp::Gemm(_)) => {
            panic!("expected an all-reduce, got {}", other.name())
        }
    }
    assert_eq!(ops[0].name(), "ncclAllReduce");
    for devices in [1, 4] {
        let e = lower_all_reduce(&plan, devices).remove(0).err().unwrap();
        assert!(
            e.contains("over 2 GPUs") && e.contains(&format!("group of {devices}")),
            "{e}"
        );
    }
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[5]).unwrap();
    let y = g.scale(x, 2.0).unwrap();
    let s = g.all_reduce(y, 1).unwrap();
    let plan = g.plan(&[s]).unwrap();
    for ops in lower_all_reduce(&plan, 1) {
        assert!(ops
            .unwrap()
            .iter()
            .all(|op| !matches!(op, DevOp::AllReduce(_))));
    }
}

/// Kernel names of every step of `plan` lowered without fusion, at fake addresses.
fn lowered_names(plan: &Plan, mmvq: bool) -> Vec<&'static str> {
    let mut lw = Lowering::new(&fake_addr, mmvq, 1);
    let steps = lower_plan(plan, &mut lw, false, |_| 0).unwrap();
    steps.iter().flatten().map(DevOp::name).collect()
}

/// Decode products of the same activations (a layer's q, k and v) quantize them to Q8_1
/// once, across a step between them that writes elsewhere (the plan runs q, k, q+k, v);
/// products of other activations quantize those; the dequantizing path quantizes nothing.
#[test]
fn q8_1_activations_are_quantized_once() {
    let q4 = DType::Quant(crate::quant::QType::Q4_0);
    let mut g = Graph::new();
    let x0 = g.input("x0", DType::F32, &[64, 1]).unwrap();
    let x = g.scale(x0, 0.5).unwrap();
    let w: Vec<TensorId> = (0..4)
        .map(|i| g.input(&format!("w{i}"), q4, &[64, 64]).unwrap())
        .collect();
    let q = g.mul_mat(w[0], x).unwrap();
    let k = g.mul_mat(w[1], x).unwrap();
    let v = g.mul_mat(w[2], x).unwrap();
    let s = g.add(q, k).unwrap();
    let s = g.add(s, v).unwrap();
    let o = g.mul_mat(w[3], s).unwrap();
    let plan = g.plan(&[o]).unwrap();
    let (quant, mmvq) = ("quantize_q8_1_f32", "mul_mat_vec_q_c1_q4_0");
    assert_eq!(
        lowered_names(&plan, true),
        [
            "scale_f32",
            quant,
            mmvq,
            mmvq,
            "add_f32_f32",
            mmvq,
            "add_f32_f32",
            quant,
            mmvq
        ]
    );
    assert!(!lowered_names(&plan, false).contains(&quant));
}

/// The kernel launches of lowered steps, in order.
pub(super) fn kernel_launches(ops: &[Vec<DevOp>]) -> Vec<&super::lowering::Launch> {
    ops.iter()
        .flatten()
        .filter_map(|op| match op {
            DevOp::Kernel(k) => Some(k),
            DevOp::Gemm(_) | DevOp::AllReduce(_) => None,
        })
        .collect()
}

/// A Q8_1 copy takes the layout of the product that reads it (`ACT_PAIRS` for the
/// K-quants, `ACT_BLOCKS` for the 32-element types): the fused norm writes the first
/// product's, and a product of the same activations in the other layout quantizes them
/// again in its own instead of reading that copy.
#[test]
fn q8_1_copies_take_the_layout_of_their_product() {
    use crate::backend::cuda::args::ACT_PAIRS;
    use crate::quant::QType;
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[256, 1]).unwrap();
    let nw = g.input("nw", DType::F32, &[256]).unwrap();
    let n = g.rms_norm(x, 1e-5).unwrap();
    let y = g.mul(n, nw).unwrap();
    let wk = g
        .input("wk", DType::Quant(QType::Q4_K), &[256, 64])
        .unwrap();
    let w0 = g
        .input("w0", DType::Quant(QType::Q4_0), &[256, 64])
        .unwrap();
    let a = g.mul_mat(wk, y).unwrap();
    let b = g.mul_mat(w0, y).unwrap();
    let plan = g.plan(&[a, b]).unwrap();
    let mut lw = Lowering::new(&fake_addr_any, true, 1);
    let ops = lower_plan(&plan, &mut lw, true, |_| 0).unwrap();
    let launches = kernel_launches(&ops);
    let names: Vec<&str> = launches.iter().map(|k| k.kernel.name).collect();
    assert_eq!(
        names,
        [
            "rms_norm_mul_f32_f32",
            "mul_mat_vec_qd_c1_q4_k",
            "quantize_q8_1_f32",
            "mul_mat_vec_q_c1_q4_0"
        ]
    );
    let norm = args::<NormMulArgs>(launches[0]);
    assert_eq!(
        (norm.q8_layout, args::<QGemvArgs>(launches[1]).b),
        (ACT_PAIRS, norm.q8)
    );
    let quant = args::<CpyArgs>(launches[2]);
    assert_eq!(quant.mode, ACT_BLOCKS);
    assert_eq!(args::<QGemvArgs>(launches[3]).b, quant.dst.data);
}

/// Q4_K and Q5_K decode products over rows at 16-byte aligned addresses and strides read
/// them in place (`mul_mat_vec_qd_*`, weights loaded before the wait as weights in a
/// buffer no step writes); rows at other addresses keep the staged kernel, Q6_K (210-byte
/// blocks) always does, and the dequantizing path is the same for both.
#[test]
fn aligned_k_quant_rows_are_read_in_place() {
    use crate::graph::{BufferId, BufferRef};
    use crate::quant::QType;
    let cases = [
        (QType::Q4_K, 0, "mul_mat_vec_qd_c1_q4_k"),
        (QType::Q4_K, 2, "mul_mat_vec_q_c1_q4_k"),
        (QType::Q5_K, 32, "mul_mat_vec_qd_c1_q5_k"),
        (QType::Q5_K, 18, "mul_mat_vec_q_c1_q5_k"),
        (QType::Q6_K, 0, "mul_mat_vec_q_c1_q6_k"),
    ];
    for (q, offset, want) in cases {
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, &[512, 1]).unwrap();
        let data = BufferRef {
            buffer: BufferId(3),
            offset,
        };
        let w = g.weight("w", DType::Quant(q), &[512, 8], data).unwrap();
        let y = g.mul_mat(w, x).unwrap();
        let plan = g.plan(&[y]).unwrap();
        for mmvq in [true, false] {
            let mut lw = Lowering::new(&fake_addr_any, mmvq, 1);
            let ops = lower_plan(&plan, &mut lw, true, |_| 0).unwrap();
            let launches = kernel_launches(&ops);
            let product = launches.last().expect("a product launch");
            if mmvq {
                assert_eq!(product.kernel.name, want, "{q} at offset {offset}");
                assert_eq!(args::<QGemvArgs>(product).prefetch, 1, "{q}: weights");
            } else {
                assert!(
                    product.kernel.name.starts_with("mul_mat_vec_dq_c1_"),
                    "{q} at offset {offset}: {}",
                    product.kernel.name
                );
            }
        }
    }
    // weights the plan writes (a quantizing cast into the arena): in place, loaded after
    // the wait
    let mut g = Graph::new();
    let x = g.input("x", DType::F32, &[512, 1]).unwrap();
    let wf = g.input("wf", DType::F32, &[512, 8]).unwrap();
    let w = g.cast(wf, DType::Quant(QType::Q4_K)).unwrap();
    let y = g.mul_mat(w, x).unwrap();
    let plan = g.plan(&[y]).unwrap();
    let mut lw = Lowering::new(&fake_addr_any, true, 1);
    let ops = lower_plan(&plan, &mut lw, true, |_| 0).unwrap();
    let launches = kernel_launches(&ops);
    let product = launches.last().expect("a product launch");
    assert_eq!(product.kernel.name, "mul_mat_vec_qd_c1_q4_k");
    assert_eq!(args::<QGemvArgs>(product).prefetch, 0);
}

/// A step that writes memory the quantized activations came from makes the copy stale;
/// a write elsewhere and taking scratch for another step are told apart.
#[test]
fn q8_1_copy_is_forgotten_when_its_source_is_written() {
    let mut g = Graph::new();
    let a = g.input("a", DType::F32, &[64, 1]).unwrap();
    let b = g.input("b", DType::F32, &[64, 1]).unwrap();
    let c = g.add(a, b).unwrap();
    let plan = g.plan(&[c]).unwrap();
    let operand = |id: TensorId| {
        plan.steps
            .iter()
            .flat_map(|s| s.src.iter().chain([&s.dst]))
            .find(|o| o.id == id)
            .unwrap()
            .clone()
    };
    let (a, b) = (operand(a), operand(b));
    assert_ne!(a.loc, b.loc);
    let mut lw = Lowering::new(&fake_addr, true, 1);
    let copy = |of: &crate::graph::Operand| Q8Copy {
        of: of.clone(),
        addr: 0x100,
        layout: Q8Layout::Blocks,
    };
    lw.q8_1 = Some(copy(&a));
    lw.wrote(&b);
    assert!(lw.q8_1.is_some(), "a write elsewhere keeps it");
    lw.wrote(&a);
    assert!(lw.q8_1.is_none(), "a write over the source drops it");
    lw.q8_1 = Some(copy(&a));
    lw.reserve_scratch(&mut 0, 64);
    assert!(lw.q8_1.is_none(), "another step's scratch drops it");
}

/// The address of a plan location for lowering without memory behind it: arena offsets
/// and buffers (weights, the KV cache) far apart.
pub(super) fn fake_addr_any(loc: Loc) -> u64 {
    match loc {
        Loc::Arena(off) => 0x1000 + off as u64,
        Loc::Buffer(b, off) => ((b.0 as u64 + 1) << 40) + off as u64,
    }
}

/// Each Q8_1 copy a fused kernel of `ops` writes is what the next launch, a decode
/// product, reads.
fn q8_copies_feed_products(ops: &[&DevOp], flash_attn: bool) {
    for pair in ops.windows(2) {
        let (DevOp::Kernel(a), DevOp::Kernel(b)) = (pair[0], pair[1]) else {
            continue;
        };
        let q8 = match a.kernel.name {
            n if n.starts_with("rms_norm_mul_") => args::<NormMulArgs>(a).q8,
            "swiglu_f32" => args::<GluArgs>(a).q8,
            "fattn_combine" => args::<FattnArgs>(a).q8,
            _ => continue,
        };
        assert!(
            q8 != 0,
            "{} writes no Q8_1 copy before {} ({flash_attn})",
            a.kernel.name,
            b.kernel.name
        );
        assert!(
            b.kernel.name.starts_with("mul_mat_vec_q_c1_"),
            "{}",
            b.kernel.name
        );
        assert_eq!(args::<QGemvArgs>(b).b, q8);
    }
}

/// The `rope_store` launch of a decode layer of `cfg` covers q, k and v of the token.
fn rope_store_covers_the_token(ops: &[&DevOp], cfg: &crate::models::Config) {
    let rs = ops
        .iter()
        .find_map(|op| match op {
            DevOp::Kernel(k) if k.kernel.name == "rope_store_f16" => Some(args::<RopeStoreArgs>(k)),
            DevOp::Kernel(_) | DevOp::Gemm(_) | DevOp::AllReduce(_) => None,
        })
        .unwrap();
    let (hd, heads, kv_heads) = (
        cfg.head_dim,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    );
    assert_eq!((rs.q_rows, rs.k_rows), (heads as i64, kv_heads as i64));
    assert!(rs.v_blocks > 0);
    assert_eq!(rs.k_src.ne, [hd as i64, kv_heads as i64, 1, 1]);
    assert_eq!(rs.slots, 256);
}

/// One decode layer of a Q4_0 Llama with fusion: the attention norm writes the Q8_1 copy
/// the q|k|v product reads (no quantizing launch of its own), the ropes of q and k and the
/// cache writes of k and v are one `rope_store` launch, and SwiGLU writes the Q8_1 copy
/// of the down product, and with flash attention the combine writes the o product's;
/// without fusion each of those is a launch of its own. Also checks that the fused
/// kernels' Q8_1 copies are at the address the products read.
#[test]
fn decode_layer_fusions() {
    let cfg = crate::models::arch::presets::preset("tiny").unwrap();
    let q4 = DType::Quant(crate::quant::QType::Q4_0);
    for (flash_attn, l, plan) in tiny_decode_plans(q4) {
        let lower = |fusion, small_dq| {
            let mut lw = Lowering {
                scratch_base: 1 << 50,
                small_dq,
                ..Lowering::new(&fake_addr_any, true, 1)
            };
            lower_plan(&plan, &mut lw, fusion, |_| 0).unwrap()
        };
        let fused_ops = lower(true, false);
        let fused: Vec<&DevOp> = fused_ops.iter().flatten().collect();
        let names: Vec<&str> = fused.iter().map(|op| op.name()).collect();
        let count = |names: &[&str], k: &str| names.iter().filter(|n| **n == k).count();
        // quantizing launches: only the attention output's (o product) remains, and not
        // even that after flash attention, whose combine writes the copy; the head reads
        // the final norm's copy
        let o_quant = if flash_attn { 0 } else { l };
        assert_eq!(count(&names, "quantize_q8_1_f32"), o_quant, "{names:?}");
        assert_eq!(count(&names, "rope_store_f16"), l, "{names:?}");
        assert!(
            !names
                .iter()
                .any(|n| *n == "rope_f32" || n.starts_with("set_rows")),
            "{names:?}"
        );
        let unfused_ops = lower(false, false);
        let unfused: Vec<&str> = unfused_ops.iter().flatten().map(DevOp::name).collect();
        assert_eq!(count(&unfused, "quantize_q8_1_f32"), 4 * l + 1);
        assert_eq!(count(&unfused, "rope_f32"), 2 * l);
        assert_eq!(count(&unfused, "set_rows_f32_f16"), 2 * l);
        // per layer 2 norm weights, 2 residual adds, silu's multiplication (the pairs),
        // 3 quantizations (4 with flash attention), 2 ropes and 2 cache writes in one; the
        // head's norm and quantization
        assert_eq!(
            unfused.len() - names.len(),
            (11 + usize::from(flash_attn)) * l + 2,
            "{names:?}"
        );
        q8_copies_feed_products(&fused, flash_attn);
        rope_store_covers_the_token(&fused, &cfg);
        // small products pick their kernel: with a Q8_1 copy at hand the dp4a kernel,
        // without one (the attention output's) the dequantizing one, in one launch
        let auto_ops = lower(true, true);
        let auto: Vec<&str> = auto_ops.iter().flatten().map(DevOp::name).collect();
        assert_eq!(count(&auto, "quantize_q8_1_f32"), 0, "{auto:?}");
        assert_eq!(count(&auto, "mul_mat_vec_dq_c1_q4_0"), o_quant, "{auto:?}");
        assert_eq!(
            count(&auto, "mul_mat_vec_q_c1_q4_0"),
            4 * l + 1 - o_quant,
            "{auto:?}"
        );
    }
}

/// A decode step of the engine over a Q4_0 Llama: where the paged attention's keys are
/// split (a combine launches) the combine writes the Q8_1 copy the o product reads, and
/// the step has one quantizing launch a layer less than with one chunk (no combine),
/// where the product quantizes its input itself.
#[test]
fn paged_combine_writes_the_o_products_q8_1() {
    use super::args::PagedArgs;
    use crate::graph::BufferId;
    use crate::models::blocks::batch::{build_batch, BatchShape};
    use crate::models::blocks::kv_cache::KvCache;
    use crate::models::load::options::CacheTypes;
    use crate::models::load::weights::{uniform, Weights};
    let cfg = crate::models::arch::presets::preset("tiny").unwrap();
    let q4 = DType::Quant(crate::quant::QType::Q4_0);
    let w = Weights::layout(&cfg, &uniform(q4), BufferId::fresh());
    let types = CacheTypes {
        flash_attn: true,
        ..CacheTypes::default()
    };
    let pool = KvCache::pool(&cfg, 16 * 300, types, BufferId::fresh());
    let l = cfg.num_hidden_layers;
    // the launches of a 4-sequence decode step over a table of `max_blocks` rows
    let launches_of = |max_blocks| {
        let shape = BatchShape {
            n_tokens: 4,
            n_seqs: 4,
            max_blocks,
            candidates: 0,
            decode: true,
        };
        let plan = build_batch(&cfg, &w, &pool, 16, shape)
            .unwrap()
            .plan()
            .unwrap();
        let mut lw = Lowering {
            scratch_base: 1 << 50,
            ..Lowering::new(&fake_addr_any, true, 1)
        };
        lower_plan(&plan, &mut lw, true, |_| 0).unwrap()
    };
    let count = |launches: &[&super::lowering::Launch], k: &str| {
        launches.iter().filter(|l| l.kernel.name == k).count()
    };
    let (split_ops, one_ops) = (launches_of(256), launches_of(1));
    let (split, one) = (kernel_launches(&split_ops), kernel_launches(&one_ops));
    assert_eq!(count(&split, "fattn_paged_combine"), l);
    assert_eq!(count(&one, "fattn_paged_combine"), 0);
    for (i, k) in split.iter().enumerate() {
        if k.kernel.name != "fattn_paged_combine" {
            continue;
        }
        let (q8, next) = (args::<PagedArgs>(k).q8, split[i + 1]);
        assert_ne!(q8, 0, "the combine writes a copy");
        assert!(next.kernel.name.ends_with("_q4_0"), "{}", next.kernel.name);
        assert_eq!(
            args::<QGemvArgs>(next).b,
            q8,
            "the o product reads the copy"
        );
    }
    let quant = |launches: &[&super::lowering::Launch]| count(launches, "quantize_q8_1_f32");
    assert_eq!(quant(&one) - quant(&split), l);
}

/// What the fusion pass assumes of the kernels holds of the kernel tables: the caches
/// `rope_store` writes, the block types with decode products, on both paths and in split
/// rows where the type has them, and those with batched products on Q8_1 activations (so
/// a product it fuses always has a kernel, and reads the Q8_1 copy it gets).
#[test]
fn fusion_assumes_the_kernels_there_are() {
    use super::kernels::{by, cols};
    use crate::backend::fusion::{batched_type, decode_type, ROPE_STORE_CACHES};
    use crate::quant::split::has_split_rows;
    use crate::quant::QType;
    let quants = QType::ALL.map(DType::Quant);
    for dt in DType::FLOATS.into_iter().chain([DType::I32]).chain(quants) {
        assert_eq!(
            ROPE_STORE_CACHES.contains(&dt),
            by::ROPE_STORE.get([dt]).is_ok(),
            "{dt}"
        );
    }
    for q in QType::ALL {
        let has = |family: super::kernels::KeyedSets<QGemvArgs, 1>| {
            family
                .entries
                .iter()
                .all(|(_, set)| set.get([DType::Quant(q)]).is_ok())
        };
        assert_eq!(has(cols::MUL_MAT_VEC_Q), decode_type(q), "{q}");
        assert_eq!(has(cols::MUL_MAT_VEC_DQ), decode_type(q), "{q}");
        let mmq = cols::MMQ
            .entries
            .iter()
            .all(|(_, set)| set.get([DType::Quant(q)]).is_ok());
        assert_eq!(mmq, batched_type(q), "{q}: batched products");
        if has_split_rows(q) {
            assert!(decode_type(q), "{q}");
            for family in [
                cols::MUL_MAT_VEC_QS,
                cols::MUL_MAT_VEC_QSP,
                cols::MUL_MAT_VEC_DQS,
            ] {
                assert!(has(family), "{q}: {}", family.name);
            }
        }
    }
}

/// paged_attn's launches by shape on 132 SMs: the decode kernel by cache types, GQA and
/// head dim (tensor cores for GQA over F16, streamed for aligned F16, BF16, Q8_0, Q4_0 at
/// head dims 64, 128, 256, 4 query heads a block with GQA at 128 and 256 but beside the
/// prefill kernel, the any-type kernel for the rest), its chunks as flash_attn_ext's decode splits the table's longest
/// sequence (a combine when there can be more than one), and the tensor-core prefill kernel
/// first for batches of more than 64 tokens with K and V of one type, after the list of the
/// tokens it leaves, which the decode kernel's wave of blocks takes in turn.
#[test]
fn paged_attention_kernels() {
    use super::args::PagedArgs;
    use crate::graph::PagedAttnParams;
    let (f16, bf16, f32) = (DType::F16, DType::BF16, DType::F32);
    let (q8, q4) = (DType::Q8_0, DType::Q4_0);
    // (K, V, head dim, KV heads, group, tokens, the kernels less their fattn_paged_ prefix,
    // the chunks, blocks along y), over a table of 256 blocks of 16 positions
    for (k, v, d, n_head_kv, group, n_tokens, want, split, heads) in [
        (f16, f16, 128, 8, 4, 1, "dec_d128_f16 combine", 43, 8),
        (f16, f16, 128, 8, 4, 64, "dec_d128_f16", 1, 8),
        (f16, f16, 64, 2, 24, 1, "dec_d64_f16 combine", 64, 4),
        (f16, f16, 128, 32, 1, 1, "vec_d128_f16 combine", 16, 32),
        (f16, f16, 128, 32, 1, 8, "vec_d128_f16 combine", 2, 32),
        (f16, f16, 128, 32, 1, 32, "vec_d128_f16", 1, 32),
        (q8, q8, 128, 8, 4, 1, "vec4_d128_q8_0 combine", 64, 8),
        (bf16, bf16, 256, 4, 8, 2, "vec4_d256_bf16 combine", 33, 8),
        (q4, q4, 64, 8, 4, 1, "vec_d64_q4_0 combine", 16, 32),
        (f16, q8, 128, 8, 4, 1, "any_d128 combine", 17, 32),
        (f32, f32, 128, 32, 1, 1, "any_d128 combine", 17, 32),
        (f16, f16, 80, 2, 2, 1, "any_d80 combine", 64, 4),
        (
            f16,
            f16,
            128,
            8,
            4,
            512,
            "list mma_d128_f16 dec_d128_f16",
            1,
            8,
        ),
        (
            bf16,
            bf16,
            256,
            4,
            2,
            100,
            "list mma_d256_bf16 vec_d256_bf16",
            1,
            8,
        ),
        (f16, q8, 128, 8, 4, 512, "any_d128", 1, 32),
    ] {
        let case = format!("{k}/{v} d {d}, {n_head_kv} x {group} heads, {n_tokens} tokens");
        let (max_blocks, bs, n_blocks) = (256, 16, 300);
        let mut g = Graph::new();
        let pool = |g: &mut Graph, name: &str, dt: DType| {
            let rows = g.input(name, dt, &[d * n_head_kv, n_blocks * bs]).unwrap();
            let (row, head) = (dt.row_bytes(d * n_head_kv), dt.row_bytes(d));
            g.view_3d(rows, d, n_blocks * bs, n_head_kv, row, head, 0)
                .unwrap()
        };
        let (kp, vp) = (pool(&mut g, "k", k), pool(&mut g, "v", v));
        let q = g
            .input("q", DType::F32, &[d, n_head_kv * group, n_tokens])
            .unwrap();
        let table = g.input("table", DType::I32, &[max_blocks, 3]).unwrap();
        let seqs = g.input("seqs", DType::I32, &[2, n_tokens]).unwrap();
        let p = PagedAttnParams {
            scale: 0.1,
            softcap: 0.0,
            block_size: bs,
            window: 0,
        };
        let y = g.paged_attn(q, (kp, vp), table, seqs, p).unwrap();
        let plan = g.plan(&[y]).unwrap();
        let mut lw = Lowering::new(&fake_addr, true, 1);
        let steps = lower_plan(&plan, &mut lw, false, |_| 0).unwrap();
        let launches = kernel_launches(&steps);
        let names: Vec<&str> = launches
            .iter()
            .map(|l| &l.kernel.name["fattn_paged_".len()..])
            .collect();
        assert_eq!(names.join(" "), want, "{case}");
        let mma = want.starts_with("list");
        let (decode, name) = (launches[2 * usize::from(mma)], names[2 * usize::from(mma)]);
        let a = args::<PagedArgs>(decode);
        // beside the prefill kernel, a wave of 4 blocks an SM on 132 SMs takes the listed
        // tokens; else a block per token
        let tokens = match mma {
            true => (132 * 4usize)
                .div_ceil(heads as usize * split as usize)
                .min(n_tokens),
            false => n_tokens,
        };
        let grid = (split as u32, heads, tokens as u32);
        assert_eq!((a.split, decode.grid), (split, grid), "{case}");
        let fixed = (a.max_pos, a.n_blocks, a.n_seqs, a.group);
        assert_eq!(fixed, (4096, 300, 3, group as i32), "{case}");
        assert_eq!((a.bs_magic, a.bs_shift), (1, 4), "{case}: j / 16 = j >> 4");
        // the partials of every token, head and chunk, then each token's chunk count
        let part = n_tokens * n_head_kv * group * split as usize * (d + 2) * 4;
        let (part, counts) = (
            part.next_multiple_of(256),
            (n_tokens * 4).next_multiple_of(256),
        );
        let scratch = if split > 1 { part + counts } else { 0 };
        let list = if mma {
            ((n_tokens + 1) * 4).next_multiple_of(256)
        } else {
            0
        };
        assert_eq!(lw.scratch_need, scratch + list, "{case}: scratch");
        if split > 1 {
            assert_eq!(
                a.chunks - a.part,
                part as u64,
                "{case}: the counts after the partials"
            );
        }
        let (dec, stream) = (name.starts_with("dec"), name.starts_with("vec"));
        let chunks = if dec { (1, 32) } else { (64, 1) };
        assert_eq!((a.min_keys, a.unit), chunks, "{case}");
        // the tensor-core decode launches in order, the streamed one at most 4 blocks an SM
        let launch = (decode.early, decode.per_sm);
        assert_eq!(launch, (!dec, if stream { 4 } else { 0 }), "{case}");
        if mma {
            let rows = if d > 128 { 32 } else { 64 };
            assert_eq!((a.tile, a.min_run), (rows, 16), "{case}");
            assert_eq!(
                (launches[0].grid, launches[0].block.0),
                ((1, 1, 1), 256),
                "{case}"
            );
            let m = launches[1];
            let tiles = n_tokens.div_ceil(rows as usize) as u32;
            assert_eq!(m.grid, (tiles, (n_head_kv * group) as u32, 1), "{case}");
            assert_eq!(m.block.0 as i32, rows / 16 * 32, "{case}");
        } else {
            assert_eq!(a.min_run, 0, "{case}");
        }
    }
}
