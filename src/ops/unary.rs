//! Elementwise unary ops: scale, silu, gelu (tanh approximation).

use super::host::{for_each_row, HostTensor};
use super::{expect_dtype, Op};
use crate::error::Result;
use crate::graph::{DType, Graph, Step, TensorId};

/// The cubic coefficient of the tanh approximation of GELU.
pub const GELU_COEF_A: f32 = 0.044715;
/// `sqrt(2 / pi)`.
pub const SQRT_2_OVER_PI: f32 = 0.797_884_6;

impl Graph {
    fn unary(&mut self, op: Op, a: TensorId) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype(op.name(), &t.name, t.dtype, &DType::FLOATS)?;
        let (dtype, ne) = (t.dtype, t.ne);
        Ok(self.new_node(op, dtype, ne, &[a]))
    }

    /// `a * s`.
    pub fn scale(&mut self, a: TensorId, s: f32) -> Result<TensorId> {
        self.unary(Op::Scale { s }, a)
    }

    /// `a * sigmoid(a)` (SiLU / swish).
    pub fn silu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Silu, a)
    }

    /// GELU with the tanh approximation used by GPT-2.
    pub fn gelu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(Op::Gelu, a)
    }
}

/// SiLU of one value.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU (tanh approximation) of one value.
#[inline]
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// CPU reference for scale, silu and gelu.
pub(crate) fn cpu(step: &Step, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let s = match step.op {
        Op::Scale { s } => s,
        _ => 1.0,
    };
    let f: &dyn Fn(f32) -> f32 = match step.op {
        Op::Scale { .. } => &|x| x * s,
        Op::Silu => &silu,
        Op::Gelu => &gelu,
        _ => unreachable!("unary::cpu called for {}", step.op.name()),
    };
    let a = src[0];
    let mut row = vec![0f32; dst.ne[0]];
    for_each_row(dst.ne, |i1, i2, i3| {
        // SAFETY: indices come from dst.ne == a.ne; the plan guarantees valid memory.
        unsafe { a.read_row(i1, i2, i3, &mut row) };
        for x in row.iter_mut() {
            *x = f(*x);
        }
        // SAFETY: as above; this step is the only writer of dst.
        unsafe { dst.write_row(i1, i2, i3, &row) };
    });
    Ok(())
}
