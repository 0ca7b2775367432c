//! The folded decode norm ([`crate::backend::fusion::NormFold`]): the first product (with
//! its residual add) also writes `y * w` and the block sums of `y^2` into scratch held
//! until the factor is applied, the second product reads `y * w` and its block 0 adds the
//! sums into the norm's factor, which the next group's launch applies
//! ([`NormFoldOut`]). The constants the two kernels share are a `NormFold`
//! (`cuda/args.cuh`).

use super::{fused_gemv, FoldPart, Gemv};
use crate::backend::cuda::args::GEMV_WARPS;
use crate::backend::cuda::lower::check_operands;
use crate::backend::cuda::lowering::{DevOp, Lowering};
use crate::backend::fusion::NormFold;
use crate::graph::Operand;

/// The factor of a folded norm that the product after the norm computes, for the launch
/// after that product, which applies it.
#[derive(Clone, Debug)]
pub struct NormFoldOut {
    /// Address of the factor (F32, in held scratch).
    pub scale: u64,
    /// Scratch bytes the fold holds until the factor is applied (its `y * w`, block sums
    /// and factor, from offset 0): the launch that applies it takes its own scratch after
    /// them.
    pub held: usize,
}

impl NormFoldOut {
    /// The `fold_scale` argument of the launch that applies `fold` (0: none).
    pub fn scale_of(fold: Option<&Self>) -> u64 {
        fold.map_or(0, |f| f.scale)
    }
}

/// The two launches of a folded norm: `mul_mat_vec_fold_*` (the first product with its
/// add, also `y * w` and the block sums of `y^2` into held scratch) and
/// `mul_mat_vec_total_*` (the second product, reading `y * w`; its block 0 makes the
/// norm's factor), and the factor the next group applies.
pub(crate) fn lower(f: &NormFold, lw: &mut Lowering) -> Result<(Vec<DevOp>, NormFoldOut), String> {
    check_operands(f.next, lw)?;
    let (at, rw, out) = hold_scratch(lw, f.w, f.y.ne[0], f.eps);
    let rows = Gemv {
        dst: Some(f.y),
        add: Some(f.r),
        fold: Some((at, FoldPart::Rows)),
        b: None,
    };
    let mut ops = fused_gemv(f.a, f.v, f.product, rows, lw)?;
    let total = Gemv {
        b: Some(rw),
        fold: Some((at, FoldPart::Total)),
        ..Gemv::default()
    };
    ops.extend(fused_gemv(&f.next.src[0], f.xn, &f.next.dst, total, lw)?);
    Ok((ops, out))
}

/// Holds the scratch of a norm over `m` elements folded (block sums of `y^2`, `rw = y * w`,
/// the factor) from offset 0, and writes its `NormFold` constants: their address, `rw`'s,
/// and what the fold holds until its factor is applied.
fn hold_scratch(lw: &mut Lowering, w: &Operand, m: usize, eps: f32) -> (u64, u64, NormFoldOut) {
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
