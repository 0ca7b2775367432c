//! top_k: the indices of the `k` largest elements of each row, as I32, ordered by value
//! (largest first, ties: lower index first): a sampler's candidates, selected on the
//! device so that only `k` ids and values (through `get_rows`) are copied back instead of
//! the whole vocabulary.
//!
//! The order is total and the same on every backend: `-0` equals `+0`, and NaN ranks
//! above every number (`+inf` included), so a row holding a NaN puts it first, where the
//! caller that reads the values sees it and reports it.

use super::host::{par_for_each_row, HostTensor};
use super::{expect_dtype, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};

/// The largest `k` every backend takes (the CUDA kernel sorts the `k` winners of a row in
/// one block of at most 1024 threads).
pub const MAX_K: usize = 1024;

impl Graph {
    /// I32 `[k, ne1, ne2, ne3]`: the indices of the `k` largest elements of each row of
    /// `a` `[ne0, ne1, ne2, ne3]` (`1 <= k <= min(ne0, MAX_K)`), in the order of the
    /// module documentation.
    pub fn top_k(&mut self, a: TensorId, k: usize) -> Result<TensorId> {
        let t = self.get(a)?;
        expect_dtype("top_k", &t.name, t.dtype, &DType::FLOATS)?;
        if k == 0 || k > t.ne[0] || k > MAX_K {
            return Err(Error::shape(
                "top_k",
                format!(
                    "k = {k} for rows of '{}' {}: k must be in 1..={} (the row length, at most {MAX_K})",
                    t.name,
                    fmt_ne(&t.ne),
                    t.ne[0].min(MAX_K)
                ),
            ));
        }
        let ne = [k, t.ne[1], t.ne[2], t.ne[3]];
        Ok(self.new_node(Op::TopK { k }, DType::I32, ne, &[a]))
    }
}

/// The rank key of a value: a larger key ranks first. Every NaN maps to `u32::MAX`
/// (above `+inf`), `-0` to the key of `+0`; the other values keep their order (the sign
/// bit flipped for positives, every bit for negatives).
pub fn order_key(x: f32) -> u32 {
    if x.is_nan() {
        return u32::MAX;
    }
    let bits = if x == 0.0 { 0 } else { x.to_bits() };
    match bits >> 31 {
        0 => bits | 0x8000_0000,
        _ => !bits,
    }
}

/// The indices of the `k` largest values of `row`, in order (`k <= row.len()`).
pub fn top_k_row(row: &[f32], k: usize) -> Vec<u32> {
    // (key, index) with the index bit-flipped: one u64 compare, larger first
    let mut keyed: Vec<u64> = row
        .iter()
        .enumerate()
        .map(|(i, &x)| ((order_key(x) as u64) << 32) | (!(i as u32)) as u64)
        .collect();
    let desc = |a: &u64, b: &u64| b.cmp(a);
    if k < keyed.len() {
        keyed.select_nth_unstable_by(k - 1, desc);
        keyed.truncate(k);
    }
    keyed.sort_unstable_by(desc);
    keyed.iter().map(|&v| !(v as u32)).collect()
}

/// CPU reference for top_k.
pub(crate) fn cpu(k: usize, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let a = src[0];
    par_for_each_row(
        a.ne,
        || vec![0f32; a.ne[0]],
        |row, i1, i2, i3| {
            // SAFETY: (i1, i2, i3) is a row of a; dst is [k, ne1, ne2, ne3], its column
            // (i1, i2, i3) written by this row only.
            unsafe {
                a.read_row(i1, i2, i3, row);
                for (j, id) in top_k_row(row, k).into_iter().enumerate() {
                    dst.set_i32([j, i1, i2, i3], id as i32);
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key keeps the order of numbers, puts NaN first and -0 with +0.
    #[test]
    fn keys_order_values() {
        let vals = [
            f32::NEG_INFINITY,
            f32::MIN,
            -1.5,
            -f32::MIN_POSITIVE,
            -1e-45,
            0.0,
            1e-45,
            f32::MIN_POSITIVE,
            2.0,
            f32::MAX,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{} {}", w[0], w[1]);
        }
        assert_eq!(order_key(-0.0), order_key(0.0));
        for nan in [f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)] {
            assert_eq!(order_key(nan), u32::MAX);
        }
    }

    #[test]
    fn rows_in_order_with_ties_nan_and_infinities() {
        let row = [
            1.0,
            f32::NAN,
            3.0,
            -0.0,
            3.0,
            f32::NEG_INFINITY,
            0.0,
            f32::NAN,
        ];
        assert_eq!(top_k_row(&row, 8), [1, 7, 2, 4, 0, 3, 6, 5]);
        assert_eq!(top_k_row(&row, 3), [1, 7, 2]);
        assert_eq!(top_k_row(&[5.0], 1), [0]);
    }
}
