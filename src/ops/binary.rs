//! add and mul: elementwise with broadcasting of the second operand over all four
//! dimensions by ggml's rule `y[i % ky]` (each `b.ne[i]` must divide `a.ne[i]`).

use super::host::{par_for_each_row, HostTensor};
use super::{expect_dtype, BinaryOp, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};

impl Graph {
    /// `op(a, b)` elementwise, with `b` broadcast over `a` (each `b.ne[i]` must divide
    /// `a.ne[i]`; the result has `a`'s dtype and shape).
    pub fn binary(&mut self, op: BinaryOp, a: TensorId, b: TensorId) -> Result<TensorId> {
        let name = op.name();
        let (ta, tb) = (self.get(a)?, self.get(b)?);
        expect_dtype(name, &ta.name, ta.dtype, &DType::FLOATS)?;
        expect_dtype(name, &tb.name, tb.dtype, &DType::FLOATS)?;
        if (0..4).any(|i| ta.ne[i] % tb.ne[i] != 0) {
            return Err(Error::shape(
                name,
                format!(
                    "cannot broadcast '{}' {} over '{}' {}: each dim of the second must divide the first",
                    tb.name,
                    fmt_ne(&tb.ne),
                    ta.name,
                    fmt_ne(&ta.ne)
                ),
            ));
        }
        let (dtype, ne) = (ta.dtype, ta.ne);
        Ok(self.new_node(Op::Binary(op), dtype, ne, &[a, b]))
    }

    /// `a + b`, with `b` broadcast over `a` (result has `a`'s dtype and shape).
    pub fn add(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Add, a, b)
    }

    /// `a * b`, with `b` broadcast over `a` (result has `a`'s dtype and shape).
    pub fn mul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Mul, a, b)
    }
}

impl BinaryOp {
    /// The op's value at `(x, y)`: the CPU reference's one definition of it.
    #[inline]
    pub fn apply(self, x: f32, y: f32) -> f32 {
        match self {
            BinaryOp::Add => x + y,
            BinaryOp::Mul => x * y,
        }
    }
}

/// CPU reference for the [`BinaryOp`]s.
pub(crate) fn cpu(op: BinaryOp, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (a, b) = (src[0], src[1]);
    let (n0, nb0) = (dst.ne[0], b.ne[0]);
    par_for_each_row(
        dst.ne,
        || (vec![0f32; n0], vec![0f32; nb0]),
        |(ra, rb), i1, i2, i3| {
            // SAFETY: row indices come from dst.ne, which equals a.ne; b's row is taken
            // modulo its own shape; the plan guarantees the memory is valid.
            unsafe {
                a.read_row(i1, i2, i3, ra);
                b.read_row(i1 % b.ne[1], i2 % b.ne[2], i3 % b.ne[3], rb);
            }
            if rb.len() == ra.len() {
                for (x, &y) in ra.iter_mut().zip(rb.iter()) {
                    *x = op.apply(*x, y);
                }
            } else {
                for (j, x) in ra.iter_mut().enumerate() {
                    *x = op.apply(*x, rb[j % rb.len()]);
                }
            }
            // SAFETY: as above; this row is written by this call only.
            unsafe { dst.write_row(i1, i2, i3, ra) };
        },
    );
    Ok(())
}
