//! The tensor node: plain data, like ggml's `struct ggml_tensor`. A node records its
//! dtype, `ne` element counts, `nb` byte strides, the op that produces it with typed
//! parameters, its sources, and (for views) the base tensor whose memory it shares.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use smallvec::SmallVec;

use super::DType;
use super::Op;

slotmap::new_key_type! {
    /// A copyable handle to a tensor node inside a [`Graph`](super::Graph).
    pub struct TensorId;
}

/// Flags that tell the allocator and the executors how a tensor is used.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Flags(u8);

impl Flags {
    /// No flag.
    pub const NONE: Flags = Flags(0);
    /// Written by the caller before each run (token ids, positions, masks). Lives in the
    /// arena at a fixed place and is never reused.
    pub const INPUT: Flags = Flags(1);
    /// Read by the caller after a run. Never reused.
    pub const OUTPUT: Flags = Flags(2);
    /// Read-only persistent memory held by the backend (model weights).
    pub const WEIGHT: Flags = Flags(4);
    /// Writable persistent memory held by the backend (a KV cache).
    pub const STATE: Flags = Flags(8);

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any flag of `other` is set.
    pub const fn intersects(self, other: Flags) -> bool {
        self.0 & other.0 != 0
    }

    /// The union of two flag sets.
    pub const fn union(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        self.union(rhs)
    }
}

impl fmt::Debug for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = [
            (Flags::INPUT, "input"),
            (Flags::OUTPUT, "output"),
            (Flags::WEIGHT, "weight"),
            (Flags::STATE, "state"),
        ];
        let set: Vec<&str> = names
            .iter()
            .filter(|(fl, _)| self.contains(*fl))
            .map(|(_, n)| *n)
            .collect();
        if set.is_empty() {
            f.write_str("-")
        } else {
            f.write_str(&set.join("|"))
        }
    }
}

/// A handle to a persistent buffer owned by a backend (weights, KV caches). Ids are
/// unique across all backends of the process, so a buffer of one backend cannot be
/// mistaken for another's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u32);

impl BufferId {
    /// A fresh id, never handed out before in this process.
    pub fn fresh() -> BufferId {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        BufferId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// Where a weight or state tensor's bytes live: a backend buffer and a byte offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferRef {
    /// The backend buffer.
    pub buffer: BufferId,
    /// Byte offset of the tensor's first element inside the buffer.
    pub offset: usize,
}

/// One node of the graph.
#[derive(Clone, Debug)]
pub struct Tensor {
    /// Element type.
    pub dtype: DType,
    /// Element counts per dimension; `ne[0]` is the innermost (contiguous) one.
    pub ne: [usize; 4],
    /// Byte strides per dimension.
    pub nb: [usize; 4],
    /// The op that produces this tensor, with its parameters.
    pub op: Op,
    /// The operands of `op`, in op order.
    pub src: SmallVec<[TensorId; 3]>,
    /// For views (and ops that write into another tensor's memory): the base tensor
    /// owning the memory. Always a non-view tensor.
    pub view_src: Option<TensorId>,
    /// Byte offset of this tensor inside `view_src`'s memory.
    pub view_offs: usize,
    /// Persistent storage of a weight or state leaf.
    pub data: Option<BufferRef>,
    /// A human-readable name (shown in dumps and error messages).
    pub name: String,
    /// How the tensor is used.
    pub flags: Flags,
}

impl Tensor {
    /// Total number of elements.
    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    /// Number of rows (all dimensions but the first).
    pub fn nrows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes spanned by the tensor from its first element to one past its last.
    pub fn nbytes(&self) -> usize {
        nbytes(self.dtype, &self.ne, &self.nb)
    }

    /// Whether elements are laid out densely in row-major order (dimensions of size 1
    /// may have any stride).
    pub fn is_contiguous(&self) -> bool {
        is_contiguous(self.dtype, &self.ne, &self.nb)
    }

    /// Whether this node shares another tensor's memory.
    pub fn is_view(&self) -> bool {
        self.view_src.is_some()
    }
}

/// Dense row-major byte strides for `ne` elements of `dtype`.
pub fn contiguous_strides(dtype: DType, ne: &[usize; 4]) -> [usize; 4] {
    let nb0 = dtype.block_bytes();
    let nb1 = dtype.row_bytes(ne[0]);
    let nb2 = nb1 * ne[1];
    let nb3 = nb2 * ne[2];
    [nb0, nb1, nb2, nb3]
}

/// Bytes spanned by a tensor of the given layout (0 for an empty tensor).
pub fn nbytes(dtype: DType, ne: &[usize; 4], nb: &[usize; 4]) -> usize {
    if ne.contains(&0) {
        return 0;
    }
    let bs = dtype.block_size();
    let mut bytes = if bs == 1 {
        dtype.block_bytes() + (ne[0] - 1) * nb[0]
    } else {
        ne[0] / bs * nb[0]
    };
    for i in 1..4 {
        bytes += (ne[i] - 1) * nb[i];
    }
    bytes
}

/// Whether the layout is dense row-major (strides of size-1 dimensions are ignored).
pub fn is_contiguous(dtype: DType, ne: &[usize; 4], nb: &[usize; 4]) -> bool {
    let mut expect = dtype.block_bytes();
    for i in 0..4 {
        if ne[i] != 1 && nb[i] != expect {
            return false;
        }
        expect = if i == 0 {
            dtype.row_bytes(ne[0])
        } else {
            expect * ne[i]
        };
    }
    true
}

/// Formats `ne` as `[a, b, c, d]`.
pub fn fmt_ne(ne: &[usize; 4]) -> String {
    format!("[{}, {}, {}, {}]", ne[0], ne[1], ne[2], ne[3])
}
