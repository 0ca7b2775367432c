//! Row normalizations: rms_norm and norm (LayerNorm without the affine part, with a
//! Welford mean/variance).

use super::host::{par_for_each_row, HostTensor};
use super::{expect_dtype, NormOp, Op};
use crate::error::{Error, Result};
use crate::graph::{DType, Graph, TensorId};

impl Graph {
    fn norm_node(&mut self, op: NormOp, a: TensorId) -> Result<TensorId> {
        let eps = op.eps();
        let t = self.get(a)?;
        expect_dtype(op.name(), &t.name, t.dtype, &DType::FLOATS)?;
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::shape(
                op.name(),
                format!("eps must be finite and >= 0, got {eps}"),
            ));
        }
        let (dtype, ne) = (t.dtype, t.ne);
        Ok(self.new_node(Op::Norm(op), dtype, ne, &[a]))
    }

    /// `x / sqrt(mean(x^2) + eps)` over each row (dim 0).
    pub fn rms_norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        self.norm_node(NormOp::RmsNorm { eps }, a)
    }

    /// `(x - mean(x)) / sqrt(var(x) + eps)` over each row (dim 0).
    pub fn norm(&mut self, a: TensorId, eps: f32) -> Result<TensorId> {
        self.norm_node(NormOp::Norm { eps }, a)
    }
}

/// CPU reference for rms_norm and norm.
pub(crate) fn cpu(op: NormOp, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let a = src[0];
    let n0 = dst.ne[0];
    let n = n0 as f32;
    par_for_each_row(
        dst.ne,
        || vec![0f32; n0],
        |row, i1, i2, i3| {
            // SAFETY: indices come from dst.ne == a.ne; the plan guarantees valid memory.
            unsafe { a.read_row(i1, i2, i3, row) };
            match op {
                NormOp::RmsNorm { eps } => {
                    let ss: f32 = row.iter().map(|x| x * x).sum();
                    let r = 1.0 / (ss / n + eps).sqrt();
                    row.iter_mut().for_each(|x| *x *= r);
                }
                NormOp::Norm { eps } => {
                    // Welford's running mean and sum of squared deviations.
                    let (mut mean, mut m2) = (0f32, 0f32);
                    for (k, &x) in row.iter().enumerate() {
                        let d = x - mean;
                        mean += d / (k + 1) as f32;
                        m2 += d * (x - mean);
                    }
                    let r = 1.0 / (m2 / n + eps).sqrt();
                    row.iter_mut().for_each(|x| *x = (*x - mean) * r);
                }
            }
            // SAFETY: as above; this row is written by this call only.
            unsafe { dst.write_row(i1, i2, i3, row) };
        },
    );
    Ok(())
}
