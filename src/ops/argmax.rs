//! argmax: the index of the largest element of each row, as I32 (greedy sampling on the
//! device without copying the logits back). Ties go to the lowest index. A row holding a
//! NaN or an infinity gives -1, so that a caller reading only the argmax still learns
//! that the logits are garbage (the model checks it: no silent token 0).

use super::host::{for_each_row, HostTensor};
use super::{expect_dtype, Op};
use crate::error::Result;
use crate::graph::{DType, Graph, TensorId};

impl Graph {
    /// I32 [ne1, ne2, ne3] holding the argmax of each row of `a` [ne0, ne1, ne2, ne3], or
    /// -1 for a row holding a non-finite value.
    pub fn argmax(&mut self, a: TensorId) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype("argmax", &t.name, t.dtype, &DType::FLOATS)?;
        let ne = [t.ne[1], t.ne[2], t.ne[3], 1];
        Ok(self.new_node(Op::Argmax, DType::I32, ne, &[a]))
    }
}

/// The op's value for `row`: the index of its first maximum, or -1 when it holds a NaN
/// or an infinity.
pub fn argmax_op_row(row: &[f32]) -> i32 {
    match row.iter().all(|v| v.is_finite()) {
        true => argmax_row(row) as i32,
        false => NON_FINITE,
    }
}

/// What argmax gives for a row holding a NaN or an infinity.
pub const NON_FINITE: i32 = -1;

/// Index of the first maximum of `row` (NaN entries are skipped; 0 if all are NaN).
pub fn argmax_row(row: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && (!found || v > best_v) {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best
}

/// CPU reference for argmax.
pub(crate) fn cpu(dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let a = src[0];
    let mut row = vec![0f32; a.ne[0]];
    for_each_row(a.ne, |i1, i2, i3| {
        // SAFETY: (i1, i2, i3) is inside a; dst is [ne1, ne2, ne3] written by this step only.
        unsafe {
            a.read_row(i1, i2, i3, &mut row);
            dst.set_i32([i1, i2, i3, 0], argmax_op_row(&row));
        }
    });
    Ok(())
}
