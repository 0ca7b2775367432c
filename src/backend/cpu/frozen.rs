//! Frozen Q4_0 and IQ4_NL weights in rows of eight ([`crate::quant::rows8`]): what
//! [`Backend::freeze_weights`](crate::backend::Backend::freeze_weights) does on the CPU
//! backend where the CPU has AVX-512 VNNI, and the rules that keep the layout invisible
//! from outside.
//!
//! - Freezing rewrites, in place, each tensor of those types whose rows come in whole
//!   groups of eight (`rows % 8 == 0`), and records it as a [`Rows8`] region. Other
//!   tensors stay as they are.
//! - Plans: a mul_mat whose weights (`src[0]`) are whole groups of a region runs the rows
//!   of eight kernels ([`crate::backend::frozen::weights_in`]); a plan that reads a region any other way, or
//!   writes one, fails to load with an error naming the tensor
//!   ([`crate::backend::frozen::check_plan`]).
//! - [`Backend::read_buffer`](crate::backend::Backend::read_buffer) gives ggml's bytes
//!   back ([`read_joined`]); writes into a region are errors.

use crate::backend::frozen::{coalesce, FrozenRows, Layout};
use crate::backend::FrozenTensor;
use crate::error::{Error, Result};
use crate::graph::BufferId;
use crate::quant::rows8;

/// The CPU backend's layout of frozen rows: eight rows interleaved.
#[derive(Clone, Debug)]
pub(super) struct Eight;

impl Layout for Eight {
    const NAME: &'static str = "rows of eight";
    const UNIT_ROWS: usize = rows8::ROWS;
    const UNITS: &'static str = "groups of eight rows";
}

/// One frozen tensor kept in rows of eight (or several adjacent ones).
pub(super) type Rows8 = FrozenRows<Eight>;

/// Freezes `tensors` of buffer `buf` (its bytes `mem`): the ones rows of eight take are
/// rewritten in place and added to `regions`.
pub(super) fn freeze(
    (buf, mem): (BufferId, &mut [u8]),
    tensors: &[FrozenTensor],
    regions: &mut Vec<Rows8>,
) -> Result<()> {
    if !rows8::usable() {
        return Ok(());
    }
    for t in tensors {
        let Some(q) = t.dtype.quant().filter(|&q| rows8::takes(q, t.row_len)) else {
            continue;
        };
        if t.rows == 0 || !t.rows.is_multiple_of(rows8::ROWS) {
            continue;
        }
        let region = Rows8::of(&t.name, (buf, t.offset), (q, t.row_len, t.rows), Eight);
        let bytes = region.end() - region.offset;
        crate::backend::range_check("cpu", "freeze", buf, t.offset, bytes, mem.len())?;
        if let Some(r) = regions.iter().find(|r| r.overlaps(buf, t.offset, bytes)) {
            if r.holds(&region) {
                continue; // frozen already
            }
            return Err(Error::plan(format!(
                "cpu: freezing {} (bytes {}..{} of buffer {buf:?}) overlaps the frozen weight {}",
                t.name,
                t.offset,
                t.offset + bytes,
                r.name
            )));
        }
        let mut tmp = vec![0u8; region.unit_bytes()];
        for group in mem[t.offset..t.offset + bytes].chunks_exact_mut(region.unit_bytes()) {
            tmp.copy_from_slice(group);
            rows8::interleave(&tmp, group);
        }
        regions.push(region);
    }
    coalesce(regions);
    Ok(())
}

/// Bytes `[offset, offset + out.len())` of buffer `buf` (its bytes `mem`) in ggml's
/// layout: each group of eight rows of a region that the range touches joined back.
pub(super) fn read_joined(
    regions: &[Rows8],
    (buf, mem): (BufferId, &[u8]),
    offset: usize,
    out: &mut [u8],
) {
    let (len, end) = (out.len(), offset + out.len());
    out.copy_from_slice(&mem[offset..end]);
    for r in regions.iter().filter(|r| r.overlaps(buf, offset, len)) {
        let gb = r.unit_bytes();
        let first = (offset.max(r.offset) - r.offset) / gb;
        let last = (end.min(r.end()) - r.offset).div_ceil(gb);
        let mut joined = vec![0u8; gb];
        for g in first..last {
            let at = r.offset + g * gb;
            rows8::join(&mem[at..at + gb], &mut joined);
            // the part of this group inside the range
            let (lo, hi) = (at.max(offset), (at + gb).min(end));
            out[lo - offset..hi - offset].copy_from_slice(&joined[lo - at..hi - at]);
        }
    }
}
