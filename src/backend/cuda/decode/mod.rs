//! The decode fast path, lowered in one place: the products of one to eight activation
//! columns (a decode step's, and a short prefill's), their Q8_1 activations, the folded
//! RMS norm, and how their kernels are picked.
//!
//! | file | owns | kernels |
//! | --- | --- | --- |
//! | [`float`] | float GEMVs (`mul_mat_vec_{f16,bf16,f32}`), with a fused residual add, and as the two launches of a folded norm (`mul_mat_vec_fold_*`, `mul_mat_vec_total_*`) | `cuda/mul_mat.cu` |
//! | [`quant`] | products with block-quantized weights: the family by path and row layout (`mul_mat_vec_{q,qs,qsp,qd,dq,dqs}_c<NC>_<q>`), the column count, one-wave grids, small products | `cuda/mul_mat_q.cu`, its instances in `build/instances.rs` |
//! | [`q8_1`] | Q8_1 activations: a copy's layout and scratch, `quantize_q8_1_f32`, the copies fused steps write and the products read | `cuda/quantize.cu`, `act_at` in `cuda/quant.cuh` |
//! | [`fold`] | the folded norm: its held scratch and constants, its two launches | `NormFold` in `cuda/args.cuh`, `cuda/mul_mat.cu` |
//!
//! Which steps are decode products, and which fused steps write a product's Q8_1
//! activations or fold a norm, the fusion pass decides ([`crate::backend::fusion`]: the
//! predicates [`float_gemv`](crate::backend::fusion::float_gemv) and
//! [`quant_decode_layout`](crate::backend::fusion::quant_decode_layout) are the ones used
//! here); this module decides the launches. Two options of the backend choose between live
//! paths for block-quantized weights ([`Lowering::mmvq`], [`Lowering::small_dq`]): by
//! default the activations are quantized to Q8_1 for `__dp4a`, except for products of at
//! most 1 MiB of weights whose activations have no Q8_1 copy yet, which dequantize in
//! registers (one launch instead of two).

pub(crate) mod float;
pub(crate) mod fold;
pub(crate) mod q8_1;
pub(crate) mod quant;

use super::args::GEMV_WARPS;
use super::lowering::{DevOp, Lowering};
use crate::backend::fusion::ProductAdd;
use crate::graph::Operand;

/// Rows (one a warp) per thread block of every decode product kernel.
pub(crate) const ROWS: usize = GEMV_WARPS as usize;

/// A decode GEMV's part in a folded norm ([`crate::backend::fusion::NormFold`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FoldPart {
    /// The product before the norm: also `y * w` and block sums of `y^2`.
    Rows,
    /// The product after it: block 0 also adds the sums into the norm's factor.
    Total,
}

/// What a decode launch fuses into the product.
#[derive(Clone, Copy, Default)]
pub(crate) struct Gemv<'a> {
    /// Where the result goes instead of the step's own result (a fused add's result).
    pub dst: Option<&'a Operand>,
    /// A dense F32 vector added to the result (a fused residual add).
    pub add: Option<&'a Operand>,
    /// The address of a folded norm's `NormFold` (float weights only) and the launch's
    /// part in it: `mul_mat_vec_fold_*` (the product before the norm) or
    /// `mul_mat_vec_total_*` (the product after it).
    pub fold: Option<(u64, FoldPart)>,
    /// Where the vector `b` is read instead of its own place (float weights only: a
    /// folded norm's `y * w` in scratch), with `b`'s layout.
    pub b: Option<u64>,
}

/// The decode launches computing `a b` into the dense F32 `dst` (or `extra.dst`), plus
/// `extra.add`, or None when `a b` is not a decode product ([`float::gemv`],
/// [`quant::gemv`]).
pub(crate) fn gemv(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    extra: Gemv,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    match a.dtype.quant() {
        Some(_) => quant::gemv(a, b, dst, extra, lw),
        None => float::gemv(a, b, dst, extra, lw),
    }
}

/// The launches of a product the fusion pass matched as a decode product (so there are
/// some).
pub(crate) fn fused_gemv(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    extra: Gemv,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    gemv(a, b, dst, extra, lw)
        .unwrap_or_else(|| Err("internal: a fused decode product has no decode kernel".into()))
}

/// A decode product and its residual add ([`Fused::GemvAdd`](crate::backend::fusion::Fused::GemvAdd)) as one launch.
pub(crate) fn gemv_add(g: &ProductAdd, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let extra = Gemv {
        dst: Some(g.y),
        add: Some(g.r),
        ..Gemv::default()
    };
    fused_gemv(g.a, g.b, g.product, extra, lw)
}
