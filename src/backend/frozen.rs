//! The rules every backend keeps for the frozen weights it stores in a layout of its own
//! ([`Backend::freeze_weights`](super::Backend::freeze_weights)): a plan reads such a
//! region only as the weights (`src[0]`) of mul_mat and never writes it, and nothing else
//! writes it either. The CUDA backend's split rows and the CPU backend's rows of eight
//! are the regions.

use crate::error::{Error, Result};
use crate::graph::{BufferId, Loc, Op, Operand, Plan};

/// A frozen tensor (or several adjacent ones) kept in a backend's own layout.
pub(crate) trait Region: Sized {
    /// The tensor's name (names, when several were joined).
    fn name(&self) -> &str;
    /// Its buffer.
    fn buffer(&self) -> BufferId;
    /// Byte offset of its first byte in the buffer.
    fn start(&self) -> usize;
    /// One past its last byte.
    fn end(&self) -> usize;
    /// Its type and layout, for messages (`Q4_0 in split rows`).
    fn layout(&self) -> String;

    /// Whether `next` begins where this region ends, with rows of the same type and
    /// length (one matrix to the product that reads both).
    fn continued_by(&self, next: &Self) -> bool;
    /// Appends the rows of `next` ([`Region::continued_by`]); the name lists both.
    fn extend(&mut self, next: Self);

    /// Whether bytes `[start, start + len)` of `buffer` touch the region.
    fn overlaps(&self, buffer: BufferId, start: usize, len: usize) -> bool {
        buffer == self.buffer() && len > 0 && start < self.end() && self.start() < start + len
    }
}

/// Sorts the regions by place and joins each to the one it continues: a model's q, k and
/// v (gate and up) are one matrix to the product that reads them.
pub(crate) fn coalesce<R: Region>(regions: &mut Vec<R>) {
    regions.sort_by_key(|r| (r.buffer(), r.start()));
    let mut out: Vec<R> = Vec::with_capacity(regions.len());
    for r in regions.drain(..) {
        match out.last_mut() {
            Some(last) if last.continued_by(&r) => last.extend(r),
            _ => out.push(r),
        }
    }
    *regions = out;
}

/// The region an operand's bytes touch, if any, and the operand's offset in its buffer.
pub(crate) fn touched<'r, R: Region>(regions: &'r [R], op: &Operand) -> Option<(&'r R, usize)> {
    let Loc::Buffer(buf, off) = op.loc else {
        return None;
    };
    regions
        .iter()
        .find(|r| r.overlaps(buf, off, op.nbytes().max(1)))
        .map(|r| (r, off))
}

/// Checks that `plan` reads the regions only as mul_mat weights (the backend then checks
/// that those are whole units of its layout) and writes none of them.
pub(crate) fn check_plan<R: Region>(
    backend: &'static str,
    regions: &[R],
    plan: &Plan,
) -> Result<()> {
    if regions.is_empty() {
        return Ok(());
    }
    let fail = |node: &str, op: &'static str, r: &R, how: &str| Error::Unsupported {
        backend,
        node: node.to_string(),
        op,
        reason: format!(
            "{how} the frozen weight {} ({}, bytes {}..{} of buffer {:?}); \
             frozen weights are read only as the weights (src[0]) of mul_mat",
            r.name(),
            r.layout(),
            r.start(),
            r.end(),
            r.buffer()
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
pub(crate) fn check_write<R: Region>(
    backend: &'static str,
    regions: &[R],
    (buf, offset, len): (BufferId, usize, usize),
    what: &str,
) -> Result<()> {
    match regions.iter().find(|r| r.overlaps(buf, offset, len)) {
        None => Ok(()),
        Some(r) => Err(Error::plan(format!(
            "{backend}: {what} of {len} bytes at offset {offset} of buffer {buf:?} touches the \
             frozen weight {} (bytes {}..{}); frozen weights cannot be written",
            r.name(),
            r.start(),
            r.end()
        ))),
    }
}
