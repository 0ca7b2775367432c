//! A [`Plan`]: what a backend executes. It is made from a graph by building the forward
//! order and running the allocator, and it owns everything a backend needs (ops, layouts,
//! memory locations), so the graph itself can be dropped or rebuilt afterwards.

use smallvec::SmallVec;

use super::alloc::{allocate, AllocKind, Allocation};
use super::Op;
use super::{BufferId, DType, Flags, Forward, Graph, TensorId};
use crate::error::{Error, Result};

/// Where an operand's first element lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Loc {
    /// A byte offset in the plan's arena.
    Arena(usize),
    /// A byte offset in a backend buffer.
    Buffer(BufferId, usize),
}

/// One tensor as a kernel sees it: dtype, layout and location.
#[derive(Clone, Debug, PartialEq)]
pub struct Operand {
    /// The tensor in the source graph.
    pub id: TensorId,
    /// Element type.
    pub dtype: DType,
    /// Element counts.
    pub ne: [usize; 4],
    /// Byte strides.
    pub nb: [usize; 4],
    /// First element.
    pub loc: Loc,
}

impl Operand {
    /// Total elements.
    pub fn nelements(&self) -> usize {
        self.ne.iter().product()
    }

    /// Rows (all dimensions but the first).
    pub fn nrows(&self) -> usize {
        self.ne[1] * self.ne[2] * self.ne[3]
    }

    /// Bytes spanned.
    pub fn nbytes(&self) -> usize {
        super::nbytes(self.dtype, &self.ne, &self.nb)
    }

    /// Whether the layout is dense row-major.
    pub fn is_contiguous(&self) -> bool {
        super::is_contiguous(self.dtype, &self.ne, &self.nb)
    }

    /// Whether each row is dense (`nb[0]` is the element size).
    pub fn rows_contiguous(&self) -> bool {
        self.ne[0] == 1 || self.nb[0] == self.dtype.block_bytes()
    }
}

/// One node a backend must compute.
#[derive(Clone, Debug)]
pub struct Step {
    /// The node's name (for errors and profiles).
    pub name: String,
    /// The op and its parameters.
    pub op: Op,
    /// The result.
    pub dst: Operand,
    /// The sources, in op order.
    pub src: SmallVec<[Operand; 3]>,
    /// Whether `dst` shares the memory of `src[0]`.
    pub inplace: bool,
}

/// A named tensor the caller writes before a run (input) or reads after it (output).
#[derive(Clone, Debug)]
pub struct Io {
    /// The tensor's name.
    pub name: String,
    /// Its layout and location.
    pub operand: Operand,
}

/// An execution plan: ordered steps over one arena.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Computing nodes in execution order (views and leaves need no step).
    pub steps: Vec<Step>,
    /// Bytes of arena the plan needs.
    pub arena_bytes: usize,
    /// Input leaves.
    pub inputs: Vec<Io>,
    /// Outputs asked for.
    pub outputs: Vec<Io>,
    /// Weight and state leaves the plan reads or writes.
    pub externals: Vec<Io>,
    /// The forward order the plan was made from.
    pub forward: Forward,
    /// The allocator's result.
    pub alloc: Allocation,
}

impl Plan {
    /// The input or output with this id.
    pub fn io(&self, id: TensorId) -> Option<&Io> {
        self.inputs
            .iter()
            .chain(self.outputs.iter())
            .find(|io| io.operand.id == id)
    }
}

/// Options of [`Graph::plan_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct PlanOptions {
    /// Unused bytes after every arena block (rounded up to the alignment), for sentinel
    /// checks in tests. 0 in normal use.
    pub guard_bytes: usize,
}

impl Graph {
    /// The operand description of `id` under an allocation.
    fn operand(&self, alloc: &Allocation, id: TensorId) -> Result<Operand> {
        let t = self.tensor(id);
        let base = t.view_src.unwrap_or(id);
        let bt = self.tensor(base);
        let offs = if t.view_src.is_some() { t.view_offs } else { 0 };
        let loc = match bt.data {
            Some(r) => Loc::Buffer(
                r.buffer,
                r.offset.checked_add(offs).ok_or_else(|| {
                    Error::plan(format!(
                        "tensor '{}' lies at buffer offset {} + {offs}, beyond the address space",
                        t.name, r.offset
                    ))
                })?,
            ),
            None => {
                let info = alloc.info.get(base).ok_or_else(|| {
                    Error::plan(format!("tensor '{}' has no memory in the plan", t.name))
                })?;
                Loc::Arena(info.offset + offs)
            }
        };
        Ok(Operand {
            id,
            dtype: t.dtype,
            ne: t.ne,
            nb: t.nb,
            loc,
        })
    }

    /// Builds the forward order for `outputs`, plans its arena and lists the steps.
    ///
    /// Every tensor in `outputs` can be read after a run; inputs the order needs must be
    /// written before it.
    pub fn plan(&self, outputs: &[TensorId]) -> Result<Plan> {
        self.plan_with(outputs, &PlanOptions::default())
    }

    /// [`Graph::plan`] with options.
    pub fn plan_with(&self, outputs: &[TensorId], opts: &PlanOptions) -> Result<Plan> {
        let forward = self.build_forward(outputs)?;
        let alloc = allocate(self, &forward, opts.guard_bytes);
        let mut steps = Vec::new();
        let mut inputs = Vec::new();
        let mut externals = Vec::new();
        for &id in &forward.order {
            let t = self.tensor(id);
            if t.op.is_leaf() {
                let io = Io {
                    name: t.name.clone(),
                    operand: self.operand(&alloc, id)?,
                };
                if t.data.is_some() {
                    externals.push(io);
                } else if t.flags.contains(Flags::INPUT) {
                    inputs.push(io);
                } else {
                    return Err(Error::plan(format!(
                        "leaf '{}' is neither an input nor backed by a buffer",
                        t.name
                    )));
                }
                continue;
            }
            if !t.op.computes() {
                continue;
            }
            let src = t
                .src
                .iter()
                .map(|&s| self.operand(&alloc, s))
                .collect::<Result<SmallVec<_>>>()?;
            steps.push(Step {
                name: t.name.clone(),
                op: t.op.clone(),
                dst: self.operand(&alloc, id)?,
                src,
                inplace: matches!(
                    alloc.info.get(id).map(|i| i.kind),
                    Some(AllocKind::InPlace(_))
                ),
            });
        }
        let outputs = outputs
            .iter()
            .map(|&id| {
                Ok(Io {
                    name: self.tensor(id).name.clone(),
                    operand: self.operand(&alloc, id)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Plan {
            steps,
            arena_bytes: alloc.report.peak_bytes,
            inputs,
            outputs,
            externals,
            forward,
            alloc,
        })
    }
}
