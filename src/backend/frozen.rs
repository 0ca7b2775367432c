//! The rules every backend keeps for the frozen weights it stores in a layout of its own
//! ([`Backend::freeze_weights`](super::Backend::freeze_weights)): a plan reads such a
//! region only as the weights (`src[0]`) of mul_mat and never writes it, and nothing else
//! writes it either. The CUDA backend's split rows and the CPU backend's rows of eight
//! are the regions.

use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Loc, Op, Operand, Plan};
use crate::quant::QType;

/// A backend's own layout of frozen rows: its name, and what it needs of a region
/// besides the rows (the CUDA split rows: the buffer's device address).
pub(crate) trait Layout: Clone + std::fmt::Debug {
    /// The layout's name in messages (`split rows`).
    const NAME: &'static str;
    /// Rows it rewrites together (a product reads whole units of them).
    const UNIT_ROWS: usize;
    /// Those units in messages (`rows`).
    const UNITS: &'static str;
}

/// A frozen tensor (or several adjacent ones) kept in layout `L`: whole rows of one
/// block type.
#[derive(Clone, Debug)]
pub(crate) struct FrozenRows<L> {
    /// The tensor's name (names, when several were joined).
    pub name: String,
    /// Its buffer.
    pub buffer: BufferId,
    /// The block type.
    pub q: QType,
    /// Byte offset of its first row in the buffer.
    pub offset: usize,
    /// Elements of a row.
    pub row_len: usize,
    /// Bytes of a row (ggml's and the layout's).
    pub row_bytes: usize,
    /// Rows.
    pub rows: usize,
    /// What the layout needs besides (read by the CUDA backend's split rows only).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub layout: L,
}

impl<L: Layout> FrozenRows<L> {
    /// The region of `rows` rows of `row_len` elements of `q` at `offset` of `buffer`.
    pub fn of(
        name: &str,
        (buffer, offset): (BufferId, usize),
        (q, row_len, rows): (QType, usize, usize),
        layout: L,
    ) -> Self {
        FrozenRows {
            name: name.to_string(),
            buffer,
            q,
            offset,
            row_len,
            row_bytes: DType::Quant(q).row_bytes(row_len),
            rows,
            layout,
        }
    }

    /// One past the region's last byte.
    pub fn end(&self) -> usize {
        self.offset + self.rows * self.row_bytes
    }

    /// Bytes of a unit of [`Layout::UNIT_ROWS`] rows.
    pub fn unit_bytes(&self) -> usize {
        L::UNIT_ROWS * self.row_bytes
    }

    /// Whether `other` is whole units of this region (of the same type and row length).
    pub fn holds(&self, other: &Self) -> bool {
        other.buffer == self.buffer
            && other.q == self.q
            && other.row_len == self.row_len
            && other.offset >= self.offset
            && (other.offset - self.offset).is_multiple_of(self.unit_bytes())
            && other.end() <= self.end()
    }

    /// Whether bytes `[start, start + len)` of `buffer` touch the region.
    pub fn overlaps(&self, buffer: BufferId, start: usize, len: usize) -> bool {
        buffer == self.buffer && len > 0 && start < self.end() && self.offset < start + len
    }

    /// Whether `next` begins where this region ends, with rows of the same type and
    /// length (one matrix to the product that reads both).
    fn continued_by(&self, next: &Self) -> bool {
        next.buffer == self.buffer
            && next.q == self.q
            && next.row_len == self.row_len
            && next.offset == self.end()
    }

    /// Appends the rows of `next` ([`FrozenRows::continued_by`]); the name lists both.
    fn extend(&mut self, next: Self) {
        self.rows += next.rows;
        self.name = format!("{} | {}", self.name, next.name);
    }
}

/// Sorts the regions by place and joins each to the one it continues: a model's q, k and
/// v (gate and up) are one matrix to the product that reads them.
pub(crate) fn coalesce<L: Layout>(regions: &mut Vec<FrozenRows<L>>) {
    regions.sort_by_key(|r| (r.buffer, r.offset));
    let mut out: Vec<FrozenRows<L>> = Vec::with_capacity(regions.len());
    for r in regions.drain(..) {
        match out.last_mut() {
            Some(last) if last.continued_by(&r) => last.extend(r),
            _ => out.push(r),
        }
    }
    *regions = out;
}

/// The region an operand's bytes touch, if any, and the operand's offset in its buffer.
pub(crate) fn touched<'r, L: Layout>(
    regions: &'r [FrozenRows<L>],
    op: &Operand,
) -> Option<(&'r FrozenRows<L>, usize)> {
    let Loc::Buffer(buf, off) = op.loc else {
        return None;
    };
    regions
        .iter()
        .find(|r| r.overlaps(buf, off, op.nbytes().max(1)))
        .map(|r| (r, off))
}

/// Whether the mul_mat weights `a` lie in a region: `Ok(false)` outside every one,
/// `Ok(true)` for whole units of one (its type and row length, dense rows from a unit's
/// start; with units of one row a single row at any stride), an error naming the tensor
/// otherwise.
pub(crate) fn weights_in<L: Layout>(
    regions: &[FrozenRows<L>],
    a: &Operand,
) -> std::result::Result<bool, String> {
    let Some((r, off)) = touched(regions, a) else {
        return Ok(false);
    };
    let rows = a.ne[1] * a.ne[2] * a.ne[3];
    let flat = a.nb[2] == a.nb[1] * a.ne[1] && a.nb[3] == a.nb[2] * a.ne[2];
    let dense = a.nb[1] == r.row_bytes && flat && a.ne[1].is_multiple_of(L::UNIT_ROWS);
    let whole = a.dtype == DType::Quant(r.q)
        && a.ne[0] == r.row_len
        && a.rows_contiguous()
        && ((rows == 1 && L::UNIT_ROWS == 1) || dense)
        && off >= r.offset
        && (off - r.offset).is_multiple_of(r.unit_bytes())
        && off + rows * r.row_bytes <= r.end();
    match whole {
        true => Ok(true),
        false => Err(format!(
            "the frozen weight {} ({} [{}, {}] in {}) is read as {} {:?} with strides {:?} at \
             byte {} of it: a mul_mat reads frozen weights only as whole {}",
            r.name,
            r.q,
            r.row_len,
            r.rows,
            L::NAME,
            a.dtype,
            a.ne,
            a.nb,
            off as i64 - r.offset as i64,
            L::UNITS
        )),
    }
}

/// Checks that `plan` reads the regions only as mul_mat weights (the backend then checks
/// that those are whole units of its layout) and writes none of them.
pub(crate) fn check_plan<L: Layout>(
    backend: &'static str,
    regions: &[FrozenRows<L>],
    plan: &Plan,
) -> Result<()> {
    if regions.is_empty() {
        return Ok(());
    }
    let fail = |node: &str, op: &'static str, r: &FrozenRows<L>, how: &str| Error::Unsupported {
        backend,
        node: node.to_string(),
        op,
        reason: format!(
            "{how} the frozen weight {} ({} in {}, bytes {}..{} of buffer {:?}); \
             frozen weights are read only as the weights (src[0]) of mul_mat",
            r.name,
            r.q,
            L::NAME,
            r.offset,
            r.end(),
            r.buffer
        ),
    };
    for step in &plan.steps {
        if let Some((r, _)) = touched(regions, &step.dst) {
            return Err(fail(&step.name, step.op.name(), r, "writes"));
        }
        for (i, src) in step.src.iter().enumerate() {
            if let Some((r, _)) = touched(regions, src) {
                if !(step.op == Op::MulMat && i == 0) {
                    let how = format!("reads (src[{i}])");
                    return Err(fail(&step.name, step.op.name(), r, &how));
                }
            }
        }
    }
    Ok(())
}

/// An error when bytes `[offset, offset + len)` of `buf` touch a region.
pub(crate) fn check_write<L: Layout>(
    backend: &'static str,
    regions: &[FrozenRows<L>],
    (buf, offset, len): (BufferId, usize, usize),
    what: &str,
) -> Result<()> {
    match regions.iter().find(|r| r.overlaps(buf, offset, len)) {
        None => Ok(()),
        Some(r) => Err(Error::plan(format!(
            "{backend}: {what} of {len} bytes at offset {offset} of buffer {buf:?} touches the \
             frozen weight {} (bytes {}..{}); frozen weights cannot be written",
            r.name,
            r.offset,
            r.end()
        ))),
    }
}
