//! Frozen Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K weights in split rows
//! ([`crate::quant::split`]): what
//! [`Backend::freeze_weights`](crate::backend::Backend::freeze_weights) does on this
//! backend, and the rules that keep the layout invisible from outside.
//!
//! - Freezing splits, in place, each tensor of those types whose rows can be split (a
//!   whole number of 16 bytes starting 16-byte aligned; Q6_K rows of at least 2,048
//!   elements at any even address, see [`splittable_at`]) (`split_rows_<q>` from a
//!   temporary copy), and
//!   records it as a [`SplitRows`] region; a tensor whose rows continue a region's (a
//!   model's q, k and v, stored as one matrix) extends it. Other tensors stay as they are.
//! - Plans: a mul_mat whose weights (`src[0]`) are whole rows of a region lowers to the
//!   split kernels (`mul_mat_vec_qs_*`, `mul_mat_vec_qsp_*`, `mul_mat_vec_dqs_*`,
//!   `cpy_split_<q>_f16` for the prefill's F16 copy, see `decode::quant` and `lower::mul_mat_q`). A plan that reads a region any other
//!   way, or writes one, fails to load with an error naming the tensor ([`check_plan`]).
//! - [`Backend::read_buffer`](crate::backend::Backend::read_buffer) joins the rows it
//!   reads back into ggml's layout ([`read_joined`]); writes into a region are errors
//!   ([`check_write`]).
//! - `GRAFT_CUDA_SPLIT=0` leaves every tensor as it is (freezing then changes nothing).

pub(crate) use crate::backend::frozen::coalesce;
use crate::backend::frozen::{self, FrozenRows, Layout};
use crate::error::Result;
use crate::graph::{BufferId, Operand, Plan};
use crate::quant::split::{join_row, splittable_at};
use crate::quant::QType;

/// The CUDA backend's layout of frozen rows: what its regions need besides the rows.
#[derive(Clone, Debug)]
pub(crate) struct Split {
    /// The device address of the buffer (Q6_K rows are rotated by their address).
    pub base: u64,
}

impl Layout for Split {
    const NAME: &'static str = "split rows";
    const UNIT_ROWS: usize = 1;
    const UNITS: &'static str = "rows";
}

/// One frozen tensor of a type with split rows stored in them (or several adjacent ones).
pub(crate) type SplitRows = FrozenRows<Split>;

impl SplitRows {
    /// A region for `rows` rows of `row_len` elements of `q` at `offset` of `buffer`
    /// (device address `base`), or None when such rows cannot be split (see
    /// [`splittable_at`]).
    pub fn new(
        name: &str,
        buffer: BufferId,
        base: u64,
        offset: usize,
        q: QType,
        row_len: usize,
        rows: usize,
    ) -> Option<Self> {
        (rows > 0 && splittable_at(q, row_len, base + offset as u64))
            .then(|| FrozenRows::of(name, (buffer, offset), (q, row_len, rows), Split { base }))
    }

    /// Joins the split rows held in `bytes` (whole rows of the region from byte `at` of
    /// its buffer, as read from the device) back into ggml's layout.
    fn join(&self, at: usize, bytes: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; bytes.len()];
        let rows = bytes
            .chunks_exact(self.row_bytes)
            .zip(out.chunks_exact_mut(self.row_bytes));
        for (r, (src, dst)) in rows.enumerate() {
            let addr = self.layout.base + (at + r * self.row_bytes) as u64;
            join_row(self.q, src, dst, addr);
        }
        out
    }
}

/// Whether the mul_mat weights `a` lie in split rows: `Ok(false)` outside every region,
/// `Ok(true)` for whole rows of one (its type, a row's elements, dense rows `row_bytes` apart
/// from a row boundary, inside the region), an error naming the tensor otherwise.
pub(crate) fn weights_split(
    regions: &[SplitRows],
    a: &Operand,
) -> std::result::Result<bool, String> {
    frozen::weights_in(regions, a)
}

/// Checks that `plan` reads the regions only as mul_mat weights (the lowering then checks
/// that those are whole rows, [`weights_split`]) and writes none of them.
pub(crate) fn check_plan(regions: &[SplitRows], plan: &Plan) -> Result<()> {
    frozen::check_plan("cuda", regions, plan)
}

/// An error when bytes `[offset, offset + len)` of `buf` touch a region.
pub(crate) fn check_write(
    regions: &[SplitRows],
    buf: BufferId,
    offset: usize,
    len: usize,
    what: &str,
) -> Result<()> {
    frozen::check_write("cuda", regions, (buf, offset, len), what)
}

/// Reads bytes `[offset, offset + out.len())` of `buf` into `out` with `read(first_byte,
/// bytes)`, which reads the device, in ggml's layout: one read, widened to whole rows
/// of every region it touches, whose rows are then joined.
pub(crate) fn read_joined(
    regions: &[SplitRows],
    buf: BufferId,
    offset: usize,
    out: &mut [u8],
    mut read: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<()> {
    let end = offset + out.len();
    let hit: Vec<&SplitRows> = regions
        .iter()
        .filter(|r| r.overlaps(buf, offset, out.len()))
        .collect();
    if hit.is_empty() {
        return read(offset, out);
    }
    // Each region's rows from the one holding max(offset, start) to the one holding
    // min(end, its end) - 1.
    let rows_of = |r: &SplitRows| {
        let first = (offset.max(r.offset) - r.offset) / r.row_bytes;
        let last = (end.min(r.end()) - r.offset).div_ceil(r.row_bytes);
        (
            r.offset + first * r.row_bytes,
            r.offset + last * r.row_bytes,
        )
    };
    let lo = hit.iter().map(|r| rows_of(r).0).fold(offset, usize::min);
    let hi = hit.iter().map(|r| rows_of(r).1).fold(end, usize::max);
    let mut bytes = vec![0u8; hi - lo];
    read(lo, &mut bytes)?;
    for r in hit {
        let (a, b) = rows_of(r);
        let joined = r.join(a, &bytes[a - lo..b - lo]);
        bytes[a - lo..b - lo].copy_from_slice(&joined);
    }
    out.copy_from_slice(&bytes[offset - lo..end - lo]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::{DType, Loc, TensorId};
    use crate::quant::split::split_row;

    fn region(name: &str, offset: usize, row_len: usize, rows: usize) -> SplitRows {
        SplitRows::new(name, BufferId(1), 0, offset, QType::Q4_0, row_len, rows).unwrap()
    }

    fn weights(offset: usize, ne: [usize; 4], nb1: usize) -> Operand {
        Operand {
            id: TensorId::default(),
            dtype: DType::Q4_0,
            ne,
            nb: [18, nb1, nb1 * ne[1], nb1 * ne[1] * ne[2]],
            loc: Loc::Buffer(BufferId(1), offset),
        }
    }

    #[test]
    fn adjacent_tensors_coalesce_and_whole_rows_are_split() {
        // q, k, v of 256 elements a row (144 bytes), out of order; then a gap.
        let mut rs = vec![
            region("k", 256 + 144 * 8, 256, 2),
            region("q", 256, 256, 8),
            region("v", 256 + 144 * 10, 256, 2),
            region("o", 256 + 144 * 13, 256, 4),
        ];
        let misaligned = SplitRows::new("x", BufferId(1), 8, 256, QType::Q4_0, 256, 1);
        assert!(misaligned.is_none());
        let q8 = SplitRows::new("q8", BufferId(1), 0, 256 + 144 * 12, QType::Q8_0, 256, 1);
        let q8 = q8.unwrap();
        assert_eq!(q8.row_bytes, 272);
        let mut with_q8 = vec![region("q", 256, 256, 12), q8];
        coalesce(&mut with_q8);
        assert_eq!(
            with_q8.len(),
            2,
            "rows of another type do not extend a region"
        );
        coalesce(&mut rs);
        assert_eq!(rs.len(), 2);
        assert_eq!((rs[0].name.as_str(), rs[0].rows), ("q | k | v", 12));
        assert!(rs[0].holds(&region("k", 256 + 144 * 8, 256, 2)));
        assert!(!rs[0].holds(&region("k", 256 + 144 * 8, 256, 5)));
        // the fused q|k|v product, one row, a batch of rows with flat strides
        assert_eq!(
            weights_split(&rs, &weights(256, [256, 12, 1, 1], 144)),
            Ok(true)
        );
        assert_eq!(
            weights_split(&rs, &weights(256 + 144 * 3, [256, 1, 1, 1], 999)),
            Ok(true)
        );
        assert_eq!(
            weights_split(&rs, &weights(256, [256, 3, 4, 1], 144)),
            Ok(true)
        );
        // outside every region
        assert_eq!(
            weights_split(&rs, &weights(0, [128, 1, 1, 1], 72)),
            Ok(false)
        );
        // part of a row, a strided view, past the region's end, not at a row start
        for op in [
            weights(256, [128, 12, 1, 1], 144),
            weights(256, [256, 6, 1, 1], 288),
            weights(256, [256, 13, 1, 1], 144),
            weights(256 + 18, [256, 2, 1, 1], 144),
        ] {
            let e = weights_split(&rs, &op).unwrap_err();
            assert!(e.contains("q | k | v"), "{e}");
        }
        assert!(check_write(&rs, BufferId(1), 0, 256, "a write").is_ok());
        assert!(check_write(&rs, BufferId(2), 256, 10, "a write").is_ok());
        let e = check_write(&rs, BufferId(1), 255, 2, "a write").unwrap_err();
        assert!(e.to_string().contains("q | k | v"), "{e}");
    }

    /// A read of any byte range gives ggml's bytes back from split rows: Q4_0 rows of 256
    /// elements, and Q6_K rows of 2,304 (1,890 bytes, so each row has its own rotation) in
    /// a buffer at an address 6 bytes past a 16-byte boundary.
    #[test]
    fn reads_join_the_rows_they_touch() {
        for (q, row_len, base) in [(QType::Q4_0, 256usize, 0u64), (QType::Q6_K, 2304, 6)] {
            reads_join(q, row_len, base);
        }
    }

    fn reads_join(q: QType, row_len: usize, base: u64) {
        let (offset, rows) = (32usize, 3usize);
        let row_bytes = q.row_bytes(row_len).unwrap();
        let ggml: Vec<u8> = (0..offset + rows * row_bytes + 20)
            .map(|i| (i * 13 + 1) as u8)
            .collect();
        let mut device = ggml.clone();
        for r in 0..rows {
            let at = offset + r * row_bytes;
            let (src, dst) = (&ggml[at..at + row_bytes], &mut device[at..at + row_bytes]);
            split_row(q, src, dst, base + at as u64);
        }
        assert_ne!(device, ggml);
        let region = |name: &str, offset: usize, rows: usize| {
            SplitRows::new(name, BufferId(1), base, offset, q, row_len, rows).unwrap()
        };
        // One region of the 3 rows, or rows 0 and 2 as two regions (row 1, split on the
        // "device" here, then reads back split: it is not a frozen weight's).
        let one = vec![region("w", offset, rows)];
        let two = vec![
            region("w", offset, 1),
            region("v", offset + 2 * row_bytes, 1),
        ];
        let mut but_row_1 = ggml.clone();
        let row_1 = offset + row_bytes..offset + 2 * row_bytes;
        but_row_1[row_1.clone()].copy_from_slice(&device[row_1]);
        let ranges = [
            (0, ggml.len()),
            (offset + 5, offset + 150),
            (offset + row_bytes + 12, ggml.len()),
            (3, 40),
            (offset + 100, offset + 2 * row_bytes + 7),
        ];
        for (rs, want) in [(&one, &ggml), (&two, &but_row_1)] {
            for (a, b) in ranges {
                let mut out = vec![0u8; b - a];
                let mut reads = 0;
                read_joined(rs, BufferId(1), a, &mut out, |at, buf| {
                    reads += 1;
                    buf.copy_from_slice(&device[at..at + buf.len()]);
                    Ok(())
                })
                .unwrap();
                assert_eq!(reads, 1, "{q} bytes {a}..{b}: one device read");
                assert!(
                    out == want[a..b],
                    "{q}: {} regions, bytes {a}..{b}",
                    rs.len()
                );
            }
        }
    }
}
