//! Attention row ops: diag_mask_inf (causal mask) and soft_max with a scale and an
//! optional additive mask. Soft_max works in f32 throughout; a row that is entirely -inf
//! becomes all zeros instead of NaN.

use super::host::{for_each_row, HostTensor};
use super::{expect_dtype, MaskOp, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};

impl Graph {
    /// Sets `a[i0, i1, ..]` to -inf where `i0 > n_past + i1`: query row `i1` (at position
    /// `n_past + i1`) sees keys `0..=n_past + i1`.
    pub fn diag_mask_inf(&mut self, a: TensorId, n_past: usize) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype("diag_mask_inf", &t.name, t.dtype, &DType::FLOATS)?;
        let (dtype, ne) = (t.dtype, t.ne);
        Ok(self.new_node(Op::Mask(MaskOp::DiagMaskInf { n_past }), dtype, ne, &[a]))
    }

    /// Softmax over each row of `a`.
    pub fn soft_max(&mut self, a: TensorId) -> Result<TensorId> {
        self.soft_max_ext(a, None, 1.0)
    }

    /// Softmax over each row of `a * scale + mask`. `mask` (F32 or F16) has `a`'s row
    /// length and is broadcast over `a` in dims 1..3 (`mask.ne[i] | a.ne[i]`).
    pub fn soft_max_ext(
        &mut self,
        a: TensorId,
        mask: Option<TensorId>,
        scale: f32,
    ) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype("soft_max", &t.name, t.dtype, &DType::FLOATS)?;
        if !scale.is_finite() {
            return Err(Error::shape(
                "soft_max",
                format!("scale must be finite, got {scale}"),
            ));
        }
        let (dtype, ne) = (t.dtype, t.ne);
        let mut src = vec![a];
        if let Some(m) = mask {
            let tm = self.get(m)?;
            expect_dtype("soft_max", &tm.name, tm.dtype, &[DType::F32, DType::F16])?;
            if tm.ne[0] != ne[0] || (1..4).any(|i| ne[i] % tm.ne[i] != 0) {
                return Err(Error::shape(
                    "soft_max",
                    format!(
                        "mask '{}' {} must have rows of {} and broadcast over '{}' {}",
                        tm.name,
                        fmt_ne(&tm.ne),
                        ne[0],
                        t.name,
                        fmt_ne(&ne)
                    ),
                ));
            }
            src.push(m);
        }
        Ok(self.new_node(Op::Mask(MaskOp::SoftMax { scale }), dtype, ne, &src))
    }
}

/// The larger of `a` and `b`, NaN when either is NaN (IEEE 754-2019's `maximum`):
/// `f32::max` returns the other operand, so a reduction built on it would pass over a NaN
/// and give a finite result for a row that holds one.
#[inline(always)]
pub(crate) fn max_nan(a: f32, b: f32) -> f32 {
    if a.is_nan() || a > b {
        a
    } else {
        b
    }
}

/// Softmax of `row` in place (`row` already scaled and masked): a row that is all `-inf`
/// (every entry masked) gives zeros, a row holding a NaN gives NaN.
pub fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, max_nan);
    if max == f32::NEG_INFINITY {
        row.iter_mut().for_each(|x| *x = 0.0);
        return;
    }
    let mut sum = 0f32;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|x| *x *= inv);
}

/// CPU reference for diag_mask_inf and soft_max.
pub(crate) fn cpu(op: MaskOp, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let a = src[0];
    let mut row = vec![0f32; dst.ne[0]];
    let mut mrow = vec![0f32; dst.ne[0]];
    for_each_row(dst.ne, |i1, i2, i3| {
        // SAFETY: indices come from dst.ne == a.ne; valid memory per the plan.
        unsafe { a.read_row(i1, i2, i3, &mut row) };
        match op {
            MaskOp::DiagMaskInf { n_past } => {
                for (i0, x) in row.iter_mut().enumerate() {
                    if i0 > n_past + i1 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            MaskOp::SoftMax { scale } => {
                row.iter_mut().for_each(|x| *x *= scale);
                if let Some(m) = src.get(1) {
                    // SAFETY: the mask is broadcast; indices are taken modulo its shape.
                    unsafe { m.read_row(i1 % m.ne[1], i2 % m.ne[2], i3 % m.ne[3], &mut mrow) };
                    row.iter_mut().zip(&mrow).for_each(|(x, m)| *x += m);
                }
                softmax_row(&mut row);
            }
        }
        // SAFETY: as above; this step is the only writer of dst.
        unsafe { dst.write_row(i1, i2, i3, &row) };
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of NaN scores (a NaN query) is NaN, not taken for a fully masked row; a row
    /// holding one NaN is NaN; a fully masked row is zeros.
    #[test]
    fn nan_rows_stay_nan_and_masked_rows_are_zeros() {
        for row in [
            vec![f32::NAN, f32::NAN],
            vec![1.0, f32::NAN, 2.0],
            vec![f32::NAN, f32::NEG_INFINITY],
        ] {
            let mut r = row.clone();
            softmax_row(&mut r);
            assert!(r.iter().all(|x| x.is_nan()), "{row:?} -> {r:?}");
        }
        let mut r = vec![f32::NEG_INFINITY; 3];
        softmax_row(&mut r);
        assert_eq!(r, [0.0; 3]);
        assert!(max_nan(1.0, f32::NAN).is_nan() && max_nan(f32::NAN, 1.0).is_nan());
        assert_eq!((max_nan(1.0, 2.0), max_nan(2.0, 1.0)), (2.0, 2.0));
    }
}
