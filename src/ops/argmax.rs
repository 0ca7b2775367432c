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
///
/// Two passes that vectorize (a decode step's row is the vocabulary, 32k-150k logits):
/// the largest value and whether every value is finite, in [`LANES`] independent lanes,
/// then the first index holding that value.
pub fn argmax_op_row(row: &[f32]) -> i32 {
    let mut max = [f32::NEG_INFINITY; LANES];
    // |x| < inf is false for NaN and for both infinities.
    let mut finite = [true; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for k in 0..LANES {
            max[k] = if c[k] > max[k] { c[k] } else { max[k] };
            finite[k] &= c[k].abs() < f32::INFINITY;
        }
    }
    for &x in tail {
        max[0] = if x > max[0] { x } else { max[0] };
        finite[0] &= x.abs() < f32::INFINITY;
    }
    if row.is_empty() {
        return 0;
    }
    if !finite.iter().all(|&f| f) {
        return NON_FINITE;
    }
    let best = max.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    row.iter().position(|&x| x == best).unwrap_or(0) as i32
}

/// Independent lanes of [`argmax_op_row`]'s first pass.
const LANES: usize = 16;

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
    let dense = a.dtype == DType::F32 && a.nb[0] == 4 && (a.ptr as usize).is_multiple_of(4);
    let mut row = vec![0f32; if dense { 0 } else { a.ne[0] }];
    for_each_row(a.ne, |i1, i2, i3| {
        // SAFETY: (i1, i2, i3) is inside a; a dense row is ne[0] aligned f32 there; dst is
        // [ne1, ne2, ne3] written by this step only.
        unsafe {
            let v = match dense {
                true => argmax_op_row(std::slice::from_raw_parts(
                    a.ptr.add(a.offset([0, i1, i2, i3])) as *const f32,
                    a.ne[0],
                )),
                false => {
                    a.read_row(i1, i2, i3, &mut row);
                    argmax_op_row(&row)
                }
            };
            dst.set_i32([i1, i2, i3, 0], v);
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-pass row function against the plain definition: first maximum, -1 for any
    /// non-finite value, at every length around the lane count and with ties.
    #[test]
    fn row_matches_definition() {
        let mut s = 12345u64;
        let mut next = || {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32
        };
        for n in (1..70).chain([1000, 49152 + 7]) {
            for trial in 0..6 {
                // few distinct values, so ties are common
                let mut row: Vec<f32> = (0..n).map(|_| (next() * 8.0).floor() - 4.0).collect();
                if trial == 1 {
                    row[n / 2] = f32::NAN;
                }
                if trial == 2 {
                    row[n - 1] = f32::INFINITY;
                }
                if trial == 3 {
                    row[0] = f32::NEG_INFINITY;
                }
                if trial == 4 {
                    row.iter_mut().for_each(|x| *x = -1.0e30);
                }
                let want = match row.iter().all(|v| v.is_finite()) {
                    true => argmax_row(&row) as i32,
                    false => NON_FINITE,
                };
                assert_eq!(argmax_op_row(&row), want, "n={n} trial={trial}");
            }
        }
    }
}
