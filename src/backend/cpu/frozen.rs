//! Frozen Q4_0 and IQ4_NL weights in rows of eight ([`crate::quant::rows8`]): what
//! [`Backend::freeze_weights`](crate::backend::Backend::freeze_weights) does on the CPU
//! backend where the CPU has AVX-512 VNNI, and the rules that keep the layout invisible
//! from outside.
//!
//! - Freezing rewrites, in place, each tensor of those types whose rows come in whole
//!   groups of eight (`rows % 8 == 0`), and records it as a [`Rows8`] region. Other
//!   tensors stay as they are.
//! - Plans: a mul_mat whose weights (`src[0]`) are whole groups of a region runs the rows
//!   of eight kernels ([`weights_rows8`]); a plan that reads a region any other way, or
//!   writes one, fails to load with an error naming the tensor
//!   ([`crate::backend::frozen::check_plan`]).
//! - [`Backend::read_buffer`](crate::backend::Backend::read_buffer) gives ggml's bytes
//!   back ([`read_joined`]); writes into a region are errors.

use crate::backend::frozen::{coalesce, touched, FrozenRows, Layout};
use crate::backend::FrozenTensor;
use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Operand};
use crate::quant::rows8;

/// The CPU backend's layout of frozen rows: eight rows interleaved.
#[derive(Clone, Debug)]
pub(super) struct Eight;

impl Layout for Eight {
    const NAME: &'static str = "rows of eight";
    const UNIT_ROWS: usize = rows8::ROWS;
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

/// Whether the mul_mat weights `a` lie in rows of eight: `Ok(false)` outside every
/// region, `Ok(true)` for whole groups of one (its type and row length, dense rows,
/// starting at a group), an error naming the tensor otherwise.
pub(super) fn weights_rows8(regions: &[Rows8], a: &Operand) -> std::result::Result<bool, String> {
    let Some((r, off)) = touched(regions, a) else {
        return Ok(false);
    };
    let rows = a.ne[1] * a.ne[2] * a.ne[3];
    let flat = a.nb[2] == a.nb[1] * a.ne[1] && a.nb[3] == a.nb[2] * a.ne[2];
    let whole = a.dtype == DType::Quant(r.q)
        && a.ne[0] == r.row_len
        && a.rows_contiguous()
        && a.nb[1] == r.row_bytes
        && flat
        && a.ne[1].is_multiple_of(rows8::ROWS)
        && off >= r.offset
        && (off - r.offset).is_multiple_of(r.unit_bytes())
        && off + rows * r.row_bytes <= r.end();
    match whole {
        true => Ok(true),
        false => Err(format!(
            "the frozen weight {} ({} [{}, {}] in rows of eight) is read as {} {:?} with strides \
             {:?} at byte {} of it: a mul_mat reads frozen weights only as whole groups of \
             eight rows",
            r.name,
            r.q,
            r.row_len,
            r.rows,
            a.dtype,
            a.ne,
            a.nb,
            off as i64 - r.offset as i64
        )),
    }
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
