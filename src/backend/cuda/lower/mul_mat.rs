//! mul_mat lowering: the kernel or cuBLAS call, decided by layout when a plan is loaded (like ggml's CUDA backend).
//! Notation: `a` [k, m, a2, a3], `b` [k, n, b2, b3], dst F32 [m, n, b2, b3] (dense),
//! `out[i, j] = sum_l a[l, i] * b[l, j]`, `a` broadcast over `b` in dims 2 and 3.
//!
//! 1. Decode GEMV (`mul_mat_vec_{f16,bf16,f32}`, [`crate::backend::cuda::decode::float`]):
//!    n == 1, every other dim 1, rows of `a` dense (any row stride), `b` an F32 vector
//!    with dense elements; a following residual add can be fused into it (see
//!    [`crate::backend::fusion`]).
//! 2. `mul_mat_p021_f16_f32`: `a` F16 with dense rows of k <= 256 elements (a permuted
//!    K-cache view [hd, n_kv, n_kv_heads]), n == 1, dims 3 == 1, `b` F32 with dense
//!    elements; channels (dim 2) broadcast GQA-style.
//! 3. `mul_mat_vec_nc_f16_f32`: the same with longer rows (a transposed V-cache view
//!    [n_kv, hd, n_kv_heads]).
//! 4. Block-quantized weights: see [`super::mul_mat_q`] (decode kernels for 1..=8
//!    columns, the int8 tensor-core product up to `MMQ_MAX_COLS`, otherwise the weights
//!    dequantized to F16 in scratch and case 5).
//! 5. Everything else: cuBLAS (`cublasGemmEx`, or `cublasGemmBatchedEx` with pointer
//!    arrays built here and uploaded with the plan's constants: the arena and buffers
//!    never move), tensor cores for F16/BF16, f32 accumulation (`CUBLAS_COMPUTE_32F`, no
//!    TF32). `b` of another dtype than `a` is converted into the plan's scratch first;
//!    operands that no (trans, ld) pair describes are copied there densely. With BF16
//!    weights, an F32/F16 `b` is split into `hi = bf16(b)` and `lo = bf16(b - hi)` and
//!    the product is `a hi + a lo` (two GEMMs, f32 sums): rounding the activations to
//!    BF16's 8-bit mantissa alone would make prefill far less precise than decode, whose
//!    GEMV keeps them in f32; the split keeps about 16 bits.

use super::cpy::copy_to;
use super::mmq;
use super::mul_mat_q;
use crate::backend::cuda::args::{GemvArgs, SplitArgs, Tensor4, P021_ROWS, P021_THREADS};
use crate::backend::cuda::decode::{self, Gemv, ROWS as GEMV_ROWS};
use crate::backend::cuda::gemm::Gemm;
use crate::backend::cuda::kernels::{by, k};
use crate::backend::cuda::lowering::{flat_grid, row_grid, DevOp, Lowering};
use crate::backend::fusion::ProductAdd;
use crate::graph::{contiguous_strides, DType, Operand, Step};

/// Longest row the short-row kernel takes.
const P021_MAX_K: usize = 256;

fn to_i32(what: &str, v: usize) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("mul_mat: {what} {v} exceeds cuBLAS's 32-bit sizes"))
}

/// Where a product's result goes: `dst`, with `add` added to it when given (a fused
/// residual add in `dst`'s own memory, [`ProductAdd`]).
#[derive(Clone, Copy)]
pub(crate) struct Out<'a> {
    pub dst: &'a Operand,
    pub add: Option<&'a Operand>,
}

impl<'a> Out<'a> {
    /// The result alone.
    pub fn plain(dst: &'a Operand) -> Self {
        Out { dst, add: None }
    }

    /// The decode kernels' extras for this result (its add).
    pub fn gemv(self) -> Gemv<'a> {
        Gemv {
            add: self.add,
            ..Gemv::default()
        }
    }

    /// cuBLAS's beta for the first GEMM: 1 to add the product to the residual already in
    /// `dst`'s memory.
    fn beta(self, lw: &Lowering) -> Result<f32, String> {
        match self.add {
            None => Ok(0.0),
            Some(r) if lw.addr(r) == lw.addr(self.dst) && r.nb == self.dst.nb => Ok(1.0),
            Some(_) => Err("internal: a fused residual add outside its result's memory".into()),
        }
    }
}

/// Lowers a mul_mat step (see the module docs for the dispatch rules).
pub(crate) fn lower(step: &Step, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    lower_into(&step.src[0], &step.src[1], Out::plain(&step.dst), lw)
}

/// Lowers a product and the residual add written over the residual ([`ProductAdd`]): the
/// launches of the product's path, the residual added where they write the result.
pub(crate) fn lower_product_add(p: &ProductAdd, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let out = Out {
        dst: p.y,
        add: Some(p.r),
    };
    lower_into(p.a, p.b, out, lw)
}

/// Lowers `out = a b` (see the module docs for the dispatch rules).
fn lower_into(a: &Operand, b: &Operand, out: Out, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let dst = out.dst;
    if let Some(q) = a.dtype.quant() {
        return mul_mat_q::lower(q, a, b, out, lw);
    }
    if !a.dtype.is_float() || !b.dtype.is_float() {
        return Err(format!("mul_mat of {} by {}", a.dtype, b.dtype));
    }
    if dst.dtype != DType::F32 || !dst.is_contiguous() {
        return Err("mul_mat needs a dense F32 result".into());
    }
    let (kk, m, a2, a3) = (a.ne[0], a.ne[1], a.ne[2], a.ne[3]);
    let (n, b2, b3) = (b.ne[1], b.ne[2], b.ne[3]);
    if b.ne[0] != kk || b2 % a2 != 0 || b3 % a3 != 0 {
        return Err(format!("mul_mat of {:?} by {:?}", a.ne, b.ne));
    }
    let (a_addr, b_addr) = (lw.addr(a), lw.addr(b));
    let vector_b = b.dtype == DType::F32 && b.rows_contiguous() && n == 1;

    // 1. Decode GEMV.
    if let Some(ops) = decode::gemv(a, b, dst, out.gemv(), lw) {
        return ops;
    }

    // 2, 3. Attention products over an F16 cache view.
    let attention = vector_b && a.dtype == DType::F16 && a3 == 1 && b3 == 1;
    if attention && a.rows_contiguous() && out.add.is_none() {
        if kk <= P021_MAX_K {
            let strides_ok =
                (m == 1 || a.nb[1].is_multiple_of(8)) && (a2 == 1 || a.nb[2].is_multiple_of(8));
            let b_ok = b_addr.is_multiple_of(16) && (b2 == 1 || b.nb[2].is_multiple_of(16));
            let args = GemvArgs {
                vec: i64::from(a_addr % 8 == 0 && strides_ok && b_ok),
                ..channel_args(a, b, dst, lw)
            };
            let warps = m.div_ceil(P021_ROWS as usize) * b2;
            let blocks = warps.div_ceil(P021_THREADS as usize / 32);
            return Ok(vec![DevOp::kernel(
                k::MUL_MAT_P021_F16_F32,
                row_grid(blocks)?,
                (P021_THREADS as u32, 1, 1),
                &args,
            )]);
        }
        if let Some(op) = gemv_channels(a, b, dst, lw) {
            return op.map(|op| vec![op]);
        }
    }

    // 5. cuBLAS.
    lower_gemm(a, a_addr, b, out, lw, 0, Vec::new())
}

/// The arguments of a GEMV over the channels of `b` (dim 2), channel `c` reading
/// channel `c / (b2 / a2)` of `a`: scalar loads, no prefetch, nothing added.
fn channel_args(a: &Operand, b: &Operand, dst: &Operand, lw: &Lowering) -> GemvArgs {
    GemvArgs {
        a: lw.addr(a),
        b: lw.addr(b),
        dst: lw.addr(dst),
        k: a.ne[0] as i64,
        m: a.ne[1] as i64,
        channels: b.ne[2] as i64,
        a_nb1: a.nb[1] as i64,
        a_nb2: a.nb[2] as i64,
        b_nb2: b.nb[2] as i64,
        dst_nb2: dst.nb[2] as i64,
        ratio: (b.ne[2] / a.ne[2]) as i64,
        vec: 0,
        add: 0,
        prefetch: 0,
        fold: 0,
    }
}

/// The attention GEMV over channels (`mul_mat_vec_nc_f16_f32`): `a` F16 [k, m, a2] with
/// dense rows at any row and channel strides (a transposed V-cache view), `b` F32
/// [k, 1, b2] with dense rows, channel `c` of `b` reading channel `c / (b2 / a2)` of `a`.
fn gemv_channels(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    lw: &Lowering,
) -> Option<Result<DevOp, String>> {
    let (kk, m, a2, b2) = (a.ne[0], a.ne[1], a.ne[2], b.ne[2]);
    if b2 > 65535 || kk >= i32::MAX as usize {
        return None;
    }
    let (a_addr, b_addr) = (lw.addr(a), lw.addr(b));
    let vec = a_addr % 16 == 0
        && (m == 1 || a.nb[1].is_multiple_of(16))
        && (a2 == 1 || a.nb[2].is_multiple_of(16))
        && b_addr % 16 == 0
        && (b2 == 1 || b.nb[2].is_multiple_of(16));
    let args = GemvArgs {
        vec: i64::from(vec),
        prefetch: i64::from(lw.read_only(a)),
        ..channel_args(a, b, dst, lw)
    };
    Some(row_grid(m.div_ceil(GEMV_ROWS)).map(|(gx, _, _)| {
        DevOp::kernel(
            k::MUL_MAT_VEC_NC_F16_F32,
            (gx, b2 as u32, 1),
            ((GEMV_ROWS * 32) as u32, 1, 1),
            &args,
        )
    }))
}

/// How one GEMM operand is read: its address and byte strides of dims 2 and 3, whether
/// cuBLAS transposes it, and its leading dimension.
struct GemmOperand {
    addr: u64,
    nb2: usize,
    nb3: usize,
    trans: bool,
    ld: usize,
}

/// Describes `x` [k, cols, ..] of element type `x.dtype` to cuBLAS as the column-major
/// k x cols matrix read transposed (`x_t`) or, when dim 1 is the dense one, as the
/// cols x k matrix read as is (`!x_t`). `x_t` is what the product wants (true for a,
/// false for b). None when no leading dimension describes the layout.
fn describe(x: &Operand, addr: u64, x_t: bool) -> Option<GemmOperand> {
    let es = x.dtype.block_bytes();
    let (kk, cols) = (x.ne[0], x.ne[1]);
    // cuBLAS's tensor-core kernels assume 16-byte aligned matrices, leading dimensions
    // and batch strides (a 2-byte aligned F16 view read back NaN); anything else goes
    // through a dense copy in the (aligned) scratch.
    let batched_stride_ok = |nb: usize, n: usize| n == 1 || nb.is_multiple_of(16);
    if !addr.is_multiple_of(16)
        || !batched_stride_ok(x.nb[2], x.ne[2])
        || !batched_stride_ok(x.nb[3], x.ne[3])
    {
        return None;
    }
    if x.rows_contiguous() && (cols == 1 || (x.nb[1].is_multiple_of(16) && x.nb[1] / es >= kk)) {
        let ld = if cols == 1 { kk } else { x.nb[1] / es };
        return Some(GemmOperand {
            addr,
            nb2: x.nb[2],
            nb3: x.nb[3],
            trans: x_t,
            ld,
        });
    }
    if kk > 1 && cols > 1 && x.nb[1] == es && x.nb[0].is_multiple_of(16) && x.nb[0] / es >= cols {
        return Some(GemmOperand {
            addr,
            nb2: x.nb[2],
            nb3: x.nb[3],
            trans: !x_t,
            ld: x.nb[0] / es,
        });
    }
    None
}

/// The layout of `x` as `dtype` with rows padded to 16 bytes (dense when a row is a
/// multiple of 16 bytes already): what cuBLAS reads best, and always describable.
pub(crate) fn padded(x: &Operand, dtype: DType) -> Operand {
    let mut nb = contiguous_strides(dtype, &x.ne);
    nb[1] = dtype.row_bytes(x.ne[0]).next_multiple_of(16);
    nb[2] = nb[1] * x.ne[1];
    nb[3] = nb[2] * x.ne[2];
    Operand {
        id: x.id,
        dtype,
        ne: x.ne,
        nb,
        loc: x.loc,
    }
}

/// `x` as cuBLAS reads it (`x_t`: as the transposed operand): in place at `at` when given
/// and describable, else a copy converted to `dtype` in scratch with 16-byte rows
/// ([`padded`]), its launch appended to `ops`.
fn gemm_operand(
    x: &Operand,
    at: Option<u64>,
    x_t: bool,
    dtype: DType,
    lw: &mut Lowering,
    offset: &mut usize,
    ops: &mut Vec<DevOp>,
) -> Result<GemmOperand, String> {
    if let Some(d) = at.and_then(|addr| describe(x, addr, x_t)) {
        return Ok(d);
    }
    let dense = padded(x, dtype);
    let addr = lw.reserve_scratch(offset, dense.nbytes());
    ops.push(copy_to(lw, x, &dense, addr)?);
    Ok(describe(&dense, addr, x_t).expect("a padded copy is describable"))
}

/// `x` split into two BF16 tensors of layout `dense` at `addr` (hi) and `addr + lo`.
fn split_to(
    lw: &Lowering,
    x: &Operand,
    dense: &Operand,
    addr: u64,
    lo: u64,
) -> Result<DevOp, String> {
    let kernel = by::SPLIT.get([x.dtype, DType::BF16])?;
    let n = x.nelements();
    let args = SplitArgs {
        src: lw.t4(x),
        dst: Tensor4::new(addr, dense),
        n: n as i64,
        lo_offset: lo as i64,
    };
    let (grid, block) = flat_grid(n);
    Ok(DevOp::kernel(kernel, grid, block, &args))
}

/// `b` as the GEMM with `dtype` weights reads it, and where its low halves start (None:
/// no split): in place when it has that type and cuBLAS can describe it, else a dense copy
/// in scratch; with BF16 weights and other activations, two BF16 halves (hi, then lo at
/// the returned shift; see the module docs). F32 `b` under F16 weights is its F16 copy
/// ([`mmq::f16_copy_of`]: the one a step before made, else one the next product of the
/// same activations reads).
fn gemm_b(
    b: &Operand,
    dtype: DType,
    lw: &mut Lowering,
    offset: &mut usize,
    ops: &mut Vec<DevOp>,
) -> Result<(GemmOperand, Option<u64>), String> {
    if dtype == DType::BF16 && b.dtype != DType::BF16 {
        let dense = padded(b, dtype);
        let lo_shift = dense.nbytes().next_multiple_of(16) as u64;
        let addr = lw.reserve_scratch(offset, 2 * lo_shift as usize);
        ops.push(split_to(lw, b, &dense, addr, lo_shift)?);
        let op = describe(&dense, addr, false).expect("a padded copy is describable");
        return Ok((op, Some(lo_shift)));
    }
    if dtype == DType::F16 && b.dtype == DType::F32 {
        let addr = mmq::f16_copy_of(b, offset, lw, ops)?;
        let op = describe(&padded(b, dtype), addr, false).expect("a padded copy is describable");
        return Ok((op, None));
    }
    let at = (b.dtype == dtype).then(|| lw.addr(b));
    Ok((gemm_operand(b, at, false, dtype, lw, offset, ops)?, None))
}

/// The pointer arrays of a batched GEMM over `b`'s `b2 x b3` channels, in the constant
/// region: A (channel `(i2 / r2, i3 / r3)` of the weights), then B shifted by `b_shift`,
/// then C.
fn batch_ptrs(
    aop: &GemmOperand,
    bop: &GemmOperand,
    b_shift: u64,
    dst: &Operand,
    (b2, b3): (usize, usize),
    (r2, r3): (usize, usize),
    lw: &mut Lowering,
) -> u64 {
    let mut arrays: Vec<u64> = Vec::with_capacity(3 * b2 * b3);
    for i3 in 0..b3 {
        for i2 in 0..b2 {
            arrays.push(aop.addr + ((i2 / r2) * aop.nb2 + (i3 / r3) * aop.nb3) as u64);
        }
    }
    for i3 in 0..b3 {
        for i2 in 0..b2 {
            arrays.push(bop.addr + b_shift + (i2 * bop.nb2 + i3 * bop.nb3) as u64);
        }
    }
    for i3 in 0..b3 {
        for i2 in 0..b2 {
            arrays.push(lw.addr(dst) + (i2 * dst.nb[2] + i3 * dst.nb[3]) as u64);
        }
    }
    let bytes: Vec<u8> = arrays.iter().flat_map(|p| p.to_ne_bytes()).collect();
    lw.push_consts(&bytes)
}

/// The cuBLAS product of `a` (float, at `a_addr`: where it lives, or a scratch copy) and
/// `b` into `out`, after the launches `ops` that used scratch up to `offset`.
pub(crate) fn lower_gemm(
    a: &Operand,
    a_addr: u64,
    b: &Operand,
    out: Out,
    lw: &mut Lowering,
    mut offset: usize,
    mut ops: Vec<DevOp>,
) -> Result<Vec<DevOp>, String> {
    let (dtype, dst, beta) = (a.dtype, out.dst, out.beta(lw)?);
    let (kk, m, a2, a3) = (a.ne[0], a.ne[1], a.ne[2], a.ne[3]);
    let (n, b2, b3) = (b.ne[1], b.ne[2], b.ne[3]);
    let (bop, lo_shift) = gemm_b(b, dtype, lw, &mut offset, &mut ops)?;
    let aop = gemm_operand(a, Some(a_addr), true, dtype, lw, &mut offset, &mut ops)?;

    let batch = b2 * b3;
    let (r2, r3) = (b2 / a2, b3 / a3);
    let mut ptrs = |b_shift: u64| match batch {
        1 => 0,
        _ => batch_ptrs(&aop, &bop, b_shift, dst, (b2, b3), (r2, r3), lw),
    };
    let hi_ptrs = ptrs(0);
    let lo = lo_shift.map(|shift| (shift, ptrs(shift)));
    let c = lw.addr(dst);
    let gemm = |b_shift: u64, beta: f32, ptrs: u64| -> Result<DevOp, String> {
        Ok(DevOp::Gemm(Gemm {
            transa: aop.trans,
            transb: bop.trans,
            m: to_i32("m", m)?,
            n: to_i32("n", n)?,
            k: to_i32("k", kk)?,
            dtype,
            a: aop.addr,
            lda: to_i32("lda", aop.ld)?,
            b: bop.addr + b_shift,
            ldb: to_i32("ldb", bop.ld)?,
            c,
            ldc: to_i32("ldc", m)?,
            batch: to_i32("batch", batch)?,
            beta,
            ptrs,
        }))
    };
    ops.push(gemm(0, beta, hi_ptrs)?);
    if let Some((shift, lo_ptrs)) = lo {
        ops.push(gemm(shift, 1.0, lo_ptrs)?);
    }
    Ok(ops)
}
