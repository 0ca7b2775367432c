//! The lazy tensor graph: an arena of [`Tensor`] nodes named by copyable [`TensorId`]s.
//!
//! Building a graph computes nothing. Leaves are inputs (written before each run),
//! weights (read-only backend buffers) and state (writable backend buffers such as a KV
//! cache); every other node is made by an op builder (see [`crate::ops`]), which checks
//! shapes and dtypes and returns a typed [`Error`] naming the op and the shapes.
//! [`Graph::build_forward`] collects what some outputs need in a valid execution order,
//! and [`Graph::plan`] turns that order into a [`Plan`] with a memory arena laid out by
//! the allocator. The op set ([`op::Op`], its family sub-enums and parameter types) is
//! part of this layer, since every node records the op that produces it.
//!
//! ```
//! use graft::graph::{DType, Graph};
//! let mut g = Graph::new();
//! let x = g.input("x", DType::F32, &[4, 3]).unwrap();
//! let w = g.input("w", DType::F32, &[4, 5]).unwrap();
//! let y = g.mul_mat(w, x).unwrap(); // [5, 3]
//! let y = g.silu(y).unwrap();
//! assert_eq!(g.tensor(y).ne, [5, 3, 1, 1]);
//! ```

pub mod alloc;
pub mod dtype;
pub mod dump;
pub mod forward;
pub mod op;
pub mod plan;
pub mod tensor;

pub use alloc::{AllocKind, AllocReport, Allocation};
pub use dtype::DType;
pub use forward::Forward;
pub use op::{
    AllReduceParams, BinaryOp, CopyOp, FlashAttnParams, Llama3Scaling, MaskOp, NormOp, Op, OpKind,
    PagedAttnParams, RopeMode, RopeParams, UnaryOp, ViewOp,
};
pub use plan::{Io, Loc, Operand, Plan, PlanOptions, Step};
pub use tensor::{
    contiguous_strides, fmt_ne, is_contiguous, nbytes, BufferId, BufferRef, Flags, Tensor, TensorId,
};

use slotmap::SlotMap;
use smallvec::SmallVec;

use crate::error::{Error, Result};

/// The graph context: owns every tensor node.
#[derive(Clone, Default)]
pub struct Graph {
    nodes: SlotMap<TensorId, Tensor>,
    counter: usize,
}

/// Turns a shape of 1 to 4 dimensions into `ne[4]` (missing dimensions are 1).
pub fn shape4(op: &'static str, shape: &[usize]) -> Result<[usize; 4]> {
    if shape.is_empty() || shape.len() > 4 {
        return Err(Error::shape(
            op,
            format!("a shape has 1 to 4 dimensions, got {shape:?}"),
        ));
    }
    if shape.contains(&0) {
        return Err(Error::shape(
            op,
            format!("every dimension must be at least 1, got {shape:?}"),
        ));
    }
    // Byte sizes and strides must fit in usize for any dtype (at most 8 bytes each).
    if shape
        .iter()
        .try_fold(8usize, |acc, &d| acc.checked_mul(d))
        .is_none()
    {
        return Err(Error::shape(
            op,
            format!("a shape of {shape:?} has too many elements to address"),
        ));
    }
    let mut ne = [1usize; 4];
    ne[..shape.len()].copy_from_slice(shape);
    Ok(ne)
}

/// Checks that rows of `ne[0]` elements of `dtype` are whole blocks (always true for
/// plain dtypes); the error names the op, the tensor and the sizes.
pub fn check_blocks(op: &'static str, name: &str, dtype: DType, ne: &[usize; 4]) -> Result<()> {
    let bs = dtype.block_size();
    if !ne[0].is_multiple_of(bs) {
        return Err(Error::shape(
            op,
            format!(
                "'{name}' {} of {dtype}: ne[0] = {} is not a multiple of the {dtype} block of {bs} elements",
                fmt_ne(ne),
                ne[0]
            ),
        ));
    }
    Ok(())
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of nodes in the arena.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node behind `id`, or an error if `id` names no node of this graph.
    ///
    /// Ids are only meaningful in the graph that made them: an id from another graph is
    /// caught when its slot is empty here, but may alias an unrelated node otherwise.
    pub fn get(&self, id: TensorId) -> Result<&Tensor> {
        self.nodes
            .get(id)
            .ok_or_else(|| Error::UnknownTensor(format!("{id:?}")))
    }

    /// The node behind `id`.
    ///
    /// # Panics
    /// If `id` does not belong to this graph; use [`Graph::get`] for a fallible lookup.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        match self.nodes.get(id) {
            Some(t) => t,
            None => panic!("tensor id {id:?} does not belong to this graph"),
        }
    }

    /// Iterates over all nodes in creation order is not guaranteed; use
    /// [`Graph::build_forward`] for an execution order.
    pub fn iter(&self) -> impl Iterator<Item = (TensorId, &Tensor)> {
        self.nodes.iter()
    }

    /// Renames a tensor (names show up in dumps and error messages).
    pub fn set_name(&mut self, id: TensorId, name: impl Into<String>) -> Result<TensorId> {
        let t = self
            .nodes
            .get_mut(id)
            .ok_or_else(|| Error::UnknownTensor(format!("{id:?}")))?;
        t.name = name.into();
        Ok(id)
    }

    /// Marks a tensor as an output: its memory is never reused and it can be read back
    /// after a run.
    pub fn set_output(&mut self, id: TensorId) -> Result<TensorId> {
        let t = self
            .nodes
            .get_mut(id)
            .ok_or_else(|| Error::UnknownTensor(format!("{id:?}")))?;
        t.flags = t.flags | Flags::OUTPUT;
        Ok(id)
    }

    /// A new input leaf: contiguous, written by the caller before each run.
    pub fn input(&mut self, name: &str, dtype: DType, shape: &[usize]) -> Result<TensorId> {
        let ne = shape4("input", shape)?;
        check_blocks("input", name, dtype, &ne)?;
        Ok(self.leaf(name, dtype, ne, Flags::INPUT, None))
    }

    /// A new weight leaf: contiguous, read-only, stored in a backend buffer.
    pub fn weight(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        data: BufferRef,
    ) -> Result<TensorId> {
        let ne = shape4("weight", shape)?;
        check_blocks("weight", name, dtype, &ne)?;
        Ok(self.leaf(name, dtype, ne, Flags::WEIGHT, Some(data)))
    }

    /// A new state leaf: contiguous, writable, persistent across runs (a KV cache).
    pub fn state(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        data: BufferRef,
    ) -> Result<TensorId> {
        let ne = shape4("state", shape)?;
        check_blocks("state", name, dtype, &ne)?;
        Ok(self.leaf(name, dtype, ne, Flags::STATE, Some(data)))
    }

    fn leaf(
        &mut self,
        name: &str,
        dtype: DType,
        ne: [usize; 4],
        flags: Flags,
        data: Option<BufferRef>,
    ) -> TensorId {
        self.push(Tensor {
            dtype,
            ne,
            nb: contiguous_strides(dtype, &ne),
            op: Op::Leaf,
            src: SmallVec::new(),
            view_src: None,
            view_offs: 0,
            data,
            name: name.to_string(),
            flags,
        })
    }

    fn push(&mut self, t: Tensor) -> TensorId {
        self.counter += 1;
        self.nodes.insert(t)
    }

    fn default_name(&self, op: &Op) -> String {
        format!("{}.{}", op.name(), self.counter)
    }

    /// Adds a computed node with a fresh contiguous result of `dtype` and shape `ne`.
    pub(crate) fn new_node(
        &mut self,
        op: Op,
        dtype: DType,
        ne: [usize; 4],
        src: &[TensorId],
    ) -> TensorId {
        let name = self.default_name(&op);
        self.push(Tensor {
            dtype,
            ne,
            nb: contiguous_strides(dtype, &ne),
            op,
            src: SmallVec::from_slice(src),
            view_src: None,
            view_offs: 0,
            data: None,
            name,
            flags: Flags::NONE,
        })
    }

    /// Adds a node that shares the memory of `base_of` at byte offset `offs` relative to
    /// the first byte of `base_of` (which may itself be a view).
    #[allow(clippy::too_many_arguments)] // the node's full layout, spelled out
    pub(crate) fn new_view_node(
        &mut self,
        op: Op,
        base_of: TensorId,
        dtype: DType,
        ne: [usize; 4],
        nb: [usize; 4],
        offs: usize,
        src: &[TensorId],
    ) -> TensorId {
        let b = self.tensor(base_of);
        let (view_src, view_offs) = match b.view_src {
            Some(vs) => (vs, b.view_offs + offs),
            None => (base_of, offs),
        };
        let name = self.default_name(&op);
        self.push(Tensor {
            dtype,
            ne,
            nb,
            op,
            src: SmallVec::from_slice(src),
            view_src: Some(view_src),
            view_offs,
            data: None,
            name,
            flags: Flags::NONE,
        })
    }

    /// The tensor whose memory `id` uses: itself, or the base of a view.
    pub fn base_of(&self, id: TensorId) -> TensorId {
        self.tensor(id).view_src.unwrap_or(id)
    }

    /// Looks up every id, failing on the first one that is not in this graph.
    pub(crate) fn check_ids(&self, ids: &[TensorId]) -> Result<()> {
        for &id in ids {
            self.get(id)?;
        }
        Ok(())
    }
}
