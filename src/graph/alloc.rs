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
    let mut p = Planner::new(g, fwd, align(guard_bytes));
    // Inputs first, at stable places.
    for &id in &fwd.order {
        let t = g.tensor(id);
        if t.op.is_leaf() && t.data.is_none() {
            p.alloc.report.naive_bytes += align(t.nbytes());
            p.block(id);
        }
    }
    for &id in &fwd.order {
        let t = g.tensor(id);
        if !t.op.is_leaf() {
            p.place(id);
            p.consumed(id);
        } else if t.data.is_some() {
            p.record(id, AllocKind::External, 0);
        }
    }
    p.alloc.report.peak_bytes = p.fl.peak;
    p.alloc
}

/// The allocator's state while it walks an execution order.
struct Planner<'g> {
    g: &'g Graph,
    /// Unused bytes after every block.
    guard: usize,
    /// Consumers of each tensor that have not run yet.
    children: SecondaryMap<TensorId, usize>,
    /// Views of each tensor whose consumers have not all run yet.
    views: SecondaryMap<TensorId, usize>,
    /// Tensors whose memory is never reused: inputs, outputs and the bases of output views.
    keep: SecondaryMap<TensorId, ()>,
    fl: FreeList,
    /// The block each tensor currently owns (moves along an in-place chain).
    owns: SecondaryMap<TensorId, (usize, usize)>,
    alloc: Allocation,
}

impl<'g> Planner<'g> {
    /// Counts the consumers and views of every tensor of `fwd` and marks those kept.
    fn new(g: &'g Graph, fwd: &Forward, guard: usize) -> Self {
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
        Planner {
            g,
            guard,
            children,
            views,
            keep,
            fl,
            owns: SecondaryMap::new(),
            alloc: Allocation::default(),
        }
    }

    /// Records where `id` lives with `kind` at `offset`.
    fn record(&mut self, id: TensorId, kind: AllocKind, offset: usize) {
        let size = self.g.tensor(id).nbytes();
        self.alloc.info.insert(id, AllocInfo { kind, offset, size });
    }

    /// Gives `id` a block of its own (and the guard after it).
    fn block(&mut self, id: TensorId) {
        let size = align(self.g.tensor(id).nbytes()) + self.guard;
        let off = self.fl.alloc(size);
        self.owns.insert(id, (off, size));
        self.alloc.report.n_blocks += 1;
        self.record(id, AllocKind::Arena, off);
    }

    /// Places the computed tensor `id`: its base's memory for a view, its first source's
    /// block when it can run in place there, else a block of its own.
    fn place(&mut self, id: TensorId) {
        let t = self.g.tensor(id);
        if let Some(base) = t.view_src {
            let offset = self.alloc.info.get(base).map_or(0, |b| {
                if b.kind == AllocKind::External {
                    0
                } else {
                    b.offset + t.view_offs
                }
            });
            self.alloc.report.n_views += 1;
            self.record(id, AllocKind::View(base), offset);
            return;
        }
        self.alloc.report.naive_bytes += align(t.nbytes());
        match t.src.first().copied().filter(|&p| self.takes_over(id, p)) {
            Some(p) => {
                let block = self.owns.remove(p).expect("checked by takes_over");
                self.owns.insert(id, block);
                self.alloc.report.n_inplace += 1;
                self.record(id, AllocKind::InPlace(p), block.0);
            }
            None => self.block(id),
        }
    }

    /// Whether `id` can take over the block of its first source `p`: it runs in place, and
    /// `p` owns a block that nothing else will read, with the same layout.
    fn takes_over(&self, id: TensorId, p: TensorId) -> bool {
        let (t, pt) = (self.g.tensor(id), self.g.tensor(p));
        t.op.can_inplace()
            && pt.view_src.is_none()
            && self.owns.contains_key(p)
            && !self.keep.contains_key(p)
            && self.children[p] == 1
            && self.views[p] == 0
            && pt.dtype == t.dtype
            && pt.ne == t.ne
            && pt.nb == t.nb
    }

    /// `id` has run: frees each source (or a view's base) whose last consumer it was.
    fn consumed(&mut self, id: TensorId) {
        let g = self.g;
        for &s in &g.tensor(id).src {
            self.children[s] -= 1;
            if self.children[s] > 0 {
                continue;
            }
            match g.tensor(s).view_src {
                Some(base) => {
                    if let Some(v) = self.views.get_mut(base) {
                        *v -= 1;
                        if *v == 0 && self.children[base] == 0 {
                            self.free(base);
                        }
                    }
                }
                None => {
                    if self.views[s] == 0 {
                        self.free(s);
                    }
                }
            }
        }
    }

    /// Returns `id`'s block to the free list, unless it is kept.
    fn free(&mut self, id: TensorId) {
        if self.keep.contains_key(id) {
            return;
        }
        if let Some((off, size)) = self.owns.remove(id) {
            self.fl.release(off, size);
        }
    }
}
