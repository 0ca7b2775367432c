//! The allocator: plans one memory arena for a whole execution order, like ggml's gallocr.
//!
//! Walking the order, it counts each tensor's consumers and views, gives every computed
//! tensor a block (best fit among freed blocks, else at the end of the arena), frees a
//! block after its tensor's last consumer and last view are done, and lets an op that
//! [can run in place](super::Op::can_inplace) take over its first source's block
//! when that source has one consumer, no views and the same layout. Inputs and outputs
//! are never reused; weights and state live in backend buffers; views never get memory
//! of their own.

use slotmap::SecondaryMap;

use super::{Flags, Forward, Graph, TensorId};

/// Alignment of every block in the arena, in bytes.
pub const ALIGN: usize = 256;

/// How a tensor gets its memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocKind {
    /// A block of its own in the arena.
    Arena,
    /// The block of the given source, taken over in place.
    InPlace(TensorId),
    /// The memory of another tensor (its `view_src`).
    View(TensorId),
    /// A backend buffer (weights, state).
    External,
}

/// Where one tensor lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocInfo {
    /// How the memory was obtained.
    pub kind: AllocKind,
    /// Byte offset in the arena (for `Arena` and `InPlace`; for a view of an arena
    /// tensor, its base's offset plus the view offset; 0 for external memory).
    pub offset: usize,
    /// Bytes the tensor spans.
    pub size: usize,
}

/// Figures of a plan: the arena's peak size next to the naive sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AllocReport {
    /// Size of the planned arena.
    pub peak_bytes: usize,
    /// Sum of the (aligned) sizes of all arena tensors, as if none were reused.
    pub naive_bytes: usize,
    /// Tensors with a block of their own.
    pub n_blocks: usize,
    /// Tensors that took over a source's block.
    pub n_inplace: usize,
    /// Views (no memory of their own).
    pub n_views: usize,
}

/// The allocator's result for one execution order.
#[derive(Clone, Debug, Default)]
pub struct Allocation {
    /// Where each tensor of the order lives.
    pub info: SecondaryMap<TensorId, AllocInfo>,
    /// Summary figures.
    pub report: AllocReport,
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Best-fit free list over a growing arena.
#[derive(Default)]
struct FreeList {
    /// Free blocks as (offset, size), sorted by offset, never adjacent.
    free: Vec<(usize, usize)>,
    /// Current end of the arena.
    end: usize,
    /// Largest end ever reached.
    peak: usize,
}

impl FreeList {
    fn alloc(&mut self, size: usize) -> usize {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, &(_, s))| s >= size)
            .min_by_key(|(_, &(_, s))| s)
            .map(|(i, _)| i);
        if let Some(i) = best {
            let (off, s) = self.free[i];
            if s == size {
                self.free.remove(i);
            } else {
                self.free[i] = (off + size, s - size);
            }
            return off;
        }
        // Nothing fits: grow the arena, starting inside a free block that ends at the end.
        let off = match self.free.last() {
            Some(&(o, s)) if o + s == self.end => {
                self.free.pop();
                o
            }
            _ => self.end,
        };
        self.end = off + size;
        self.peak = self.peak.max(self.end);
        off
    }

    fn release(&mut self, off: usize, size: usize) {
        let i = self.free.partition_point(|&(o, _)| o < off);
        debug_assert!(i == 0 || self.free[i - 1].0 + self.free[i - 1].1 <= off);
        debug_assert!(i == self.free.len() || off + size <= self.free[i].0);
        self.free.insert(i, (off, size));
        // Merge with the next, then the previous block.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// Plans the arena for `fwd`. With `guard_bytes > 0`, every block is followed by that
/// many unused bytes (and the arena starts with them), so a test can poison the arena
/// and catch a kernel writing past a tensor.
pub fn allocate(g: &Graph, fwd: &Forward, guard_bytes: usize) -> Allocation {
    let guard = align(guard_bytes);
    let mut children: SecondaryMap<TensorId, usize> = SecondaryMap::new();
    let mut views: SecondaryMap<TensorId, usize> = SecondaryMap::new();
    let mut keep: SecondaryMap<TensorId, ()> = SecondaryMap::new();
    for &id in &fwd.order {
        children.insert(id, 0);
        views.insert(id, 0);
    }
    for &id in &fwd.order {
        let t = g.tensor(id);
        for &s in &t.src {
            children[s] += 1;
        }
        if let Some(base) = t.view_src {
            if let Some(v) = views.get_mut(base) {
                *v += 1;
            }
        }
    }
    // Inputs and outputs are never reused; an output view keeps its base alive.
    for &id in &fwd.order {
        let t = g.tensor(id);
        if t.flags.intersects(Flags::INPUT | Flags::OUTPUT) || fwd.outputs.contains(&id) {
            keep.insert(id, ());
            if let Some(base) = t.view_src {
                keep.insert(base, ());
            }
        }
    }

    let mut fl = FreeList::default();
    if guard > 0 {
        fl.alloc(guard);
    }
    let mut alloc = Allocation::default();
    // The block each tensor currently owns (moves along an in-place chain).
    let mut owns: SecondaryMap<TensorId, (usize, usize)> = SecondaryMap::new();

    // Inputs first, at stable places.
    for &id in &fwd.order {
        let t = g.tensor(id);
        if t.op.is_leaf() && t.data.is_none() {
            let size = align(t.nbytes());
            let off = fl.alloc(size + guard);
            alloc.report.naive_bytes += size;
            alloc.report.n_blocks += 1;
            owns.insert(id, (off, size + guard));
            alloc.info.insert(
                id,
                AllocInfo {
                    kind: AllocKind::Arena,
                    offset: off,
                    size: t.nbytes(),
                },
            );
        }
    }

    for &id in &fwd.order {
        let t = g.tensor(id);
        if t.op.is_leaf() {
            if t.data.is_some() {
                alloc.info.insert(
                    id,
                    AllocInfo {
                        kind: AllocKind::External,
                        offset: 0,
                        size: t.nbytes(),
                    },
                );
            }
            continue;
        }
        if let Some(base) = t.view_src {
            let offset = alloc.info.get(base).map_or(0, |b| {
                if b.kind == AllocKind::External {
                    0
                } else {
                    b.offset + t.view_offs
                }
            });
            alloc.report.n_views += 1;
            alloc.info.insert(
                id,
                AllocInfo {
                    kind: AllocKind::View(base),
                    offset,
                    size: t.nbytes(),
                },
            );
        } else {
            let size = align(t.nbytes());
            alloc.report.naive_bytes += size;
            let parent = t.src.first().copied().filter(|&p| {
                let pt = g.tensor(p);
                t.op.can_inplace()
                    && pt.view_src.is_none()
                    && owns.contains_key(p)
                    && !keep.contains_key(p)
                    && children[p] == 1
                    && views[p] == 0
                    && pt.dtype == t.dtype
                    && pt.ne == t.ne
                    && pt.nb == t.nb
            });
            if let Some(p) = parent {
                let block = owns.remove(p).expect("checked above");
                owns.insert(id, block);
                alloc.report.n_inplace += 1;
                alloc.info.insert(
                    id,
                    AllocInfo {
                        kind: AllocKind::InPlace(p),
                        offset: block.0,
                        size: t.nbytes(),
                    },
                );
            } else {
                let off = fl.alloc(size + guard);
                owns.insert(id, (off, size + guard));
                alloc.report.n_blocks += 1;
                alloc.info.insert(
                    id,
                    AllocInfo {
                        kind: AllocKind::Arena,
                        offset: off,
                        size: t.nbytes(),
                    },
                );
            }
        }
        // This node has consumed its sources.
        for &s in &t.src {
            children[s] -= 1;
            if children[s] > 0 {
                continue;
            }
            let st = g.tensor(s);
            match st.view_src {
                Some(base) => {
                    if let Some(v) = views.get_mut(base) {
                        *v -= 1;
                        if *v == 0 && children[base] == 0 {
                            free(&mut fl, &mut owns, &keep, base);
                        }
                    }
                }
                None => {
                    if views[s] == 0 {
                        free(&mut fl, &mut owns, &keep, s);
                    }
                }
            }
        }
    }
    alloc.report.peak_bytes = fl.peak;
    alloc
}

fn free(
    fl: &mut FreeList,
    owns: &mut SecondaryMap<TensorId, (usize, usize)>,
    keep: &SecondaryMap<TensorId, ()>,
    id: TensorId,
) {
    if keep.contains_key(id) {
        return;
    }
    if let Some((off, size)) = owns.remove(id) {
        fl.release(off, size);
    }
}
