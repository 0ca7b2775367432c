//! Elementwise unary ops: scale, and the [`UnaryOp`] functions (silu, gelu, ...). Each
//! function's scalar definition is [`UnaryOp::apply`]; the CPU kernel maps it over rows.

use super::host::{par_for_each_row, HostTensor};
use super::{expect_dtype, Op, UnaryOp};
use crate::error::Result;
use crate::graph::{DType, Graph, TensorId};

/// The cubic coefficient of the tanh approximation of GELU.
pub const GELU_COEF_A: f32 = 0.044715;
/// `sqrt(2 / pi)`.
pub const SQRT_2_OVER_PI: f32 = 0.797_884_6;

impl Graph {
    fn elementwise(&mut self, op: Op, a: TensorId) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype(op.name(), &t.name, t.dtype, &DType::FLOATS)?;
        let (dtype, ne) = (t.dtype, t.ne);
        Ok(self.new_node(op, dtype, ne, &[a]))
    }

    /// `op(a)` elementwise (F32, F16 or BF16; the result has `a`'s dtype and shape).
    pub fn unary(&mut self, op: UnaryOp, a: TensorId) -> Result<TensorId> {
        self.elementwise(Op::Unary(op), a)
    }

    /// `a * s`.
    pub fn scale(&mut self, a: TensorId, s: f32) -> Result<TensorId> {
        self.elementwise(Op::Scale { s }, a)
    }

    /// `a * sigmoid(a)` (SiLU / swish): `unary(UnaryOp::Silu, a)`.
    pub fn silu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Silu, a)
    }

    /// GELU with the tanh approximation used by GPT-2: `unary(UnaryOp::Gelu, a)`.
    pub fn gelu(&mut self, a: TensorId) -> Result<TensorId> {
        self.unary(UnaryOp::Gelu, a)
    }
}

impl UnaryOp {
    /// The op's value at `x`: the CPU reference's one definition of it.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
            // 0.5 x (1 + tanh(u)) as x / (1 + exp(-2u)): the same function, without the
            // cancellation of 1 + tanh(u) in f32 for x below about -3.
            UnaryOp::Gelu => {
                let u = SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x);
                x / (1.0 + (-2.0 * u).exp())
            }
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::LogSigmoid => x.min(0.0) - (-x.abs()).exp().ln_1p(),
        }
    }
}

/// Maps `f` over every element of `src[0]` into `dst` (same shape).
fn map(dst: HostTensor, src: &[HostTensor], f: impl Fn(f32) -> f32 + Sync + Send) -> Result<()> {
    let a = src[0];
    let n0 = dst.ne[0];
    par_for_each_row(
        dst.ne,
        || vec![0f32; n0],
        |row, i1, i2, i3| {
            // SAFETY: indices come from dst.ne == a.ne; the plan guarantees valid memory.
            unsafe { a.read_row(i1, i2, i3, row) };
            for x in row.iter_mut() {
                *x = f(*x);
            }
            // SAFETY: as above; this row is written by this call only.
            unsafe { dst.write_row(i1, i2, i3, row) };
        },
    );
    Ok(())
}

/// CPU reference for the [`UnaryOp`] functions. silu takes the AVX2 path where the CPU has it (a vector exp within a few ulp of `expf`; a decode step
/// spends more in silu's exp than in most ops).
pub(crate) fn cpu(op: UnaryOp, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    #[cfg(target_arch = "x86_64")]
    if op == UnaryOp::Silu && super::simd::available() {
        let n0 = dst.ne[0];
        par_for_each_row(
            dst.ne,
            || vec![0f32; n0],
            |row, i1, i2, i3| {
                // SAFETY: indices come from dst.ne == a.ne; the plan guarantees valid
                // memory; the CPU has AVX2 and FMA (checked above); each row is written by
                // this call only.
                unsafe {
                    src[0].read_row(i1, i2, i3, row);
                    super::simd::silu_in_place(row);
                    dst.write_row(i1, i2, i3, row);
                }
            },
        );
        return Ok(());
    }
    map(dst, src, |x| op.apply(x))
}

/// CPU reference for scale.
pub(crate) fn cpu_scale(s: f32, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    map(dst, src, |x| x * s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GELU keeps its relative precision where its value is small: for x in [-9, -3] the
    /// f32 result is within 2e-5 of the f64 function (|2u| up to 60 scales u's rounding) (the tanh form lost every digit near
    /// x = -5, where 1 + tanh(u) cancels).
    #[test]
    fn gelu_is_precise_for_negative_inputs() {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        for i in 0..=600 {
            let x32 = -3.0 - i as f32 * 0.01;
            let x = f64::from(x32);
            let u = c * (x + f64::from(GELU_COEF_A) * x * x * x);
            let want = x / (1.0 + (-2.0 * u).exp());
            let got = f64::from(UnaryOp::Gelu.apply(x32));
            let rel = ((got - want) / want).abs();
            assert!(
                rel < 2e-5,
                "gelu({x}) = {got:e}, f64 {want:e}, relative error {rel:e}"
            );
        }
    }
}
