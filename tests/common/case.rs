//! Case descriptions and the backend-generic runner.
//!
//! A [`Case`] is plain data: the op with its parameters, the leaves (dtype, shape, where
//! the memory comes from, the values), and for every operand the chain of view ops that
//! turns its leaf into what the op sees. [`run_case`] builds a fresh graph from it on any
//! `&mut dyn Backend`, so the same case can run on the CPU and on a GPU.

use std::fmt;

use graft::backend::Backend;
use graft::graph::{AllocKind, BufferId, BufferRef, DType, Graph, Plan, PlanOptions, TensorId};
use graft::ops::{BinaryOp, RopeParams, UnaryOp};
use graft::{Error, Result};

/// The values of a leaf, one per element in row-major order, exactly representable in the
/// leaf's dtype.
#[derive(Clone, PartialEq)]
pub enum Data {
    /// Float values (F32, F16, BF16 leaves).
    F(Vec<f32>),
    /// Integer values (I32 leaves).
    I(Vec<i32>),
}

/// Where a leaf's memory comes from.
#[derive(Clone, PartialEq)]
pub enum Storage {
    /// An input written with `set_input` after loading the plan.
    Input,
    /// A read-only weight `pad` bytes into a backend buffer of its own.
    Weight { pad: usize },
    /// A writable state leaf in a buffer of its own: `pad` bytes before the tensor and
    /// `tail` bytes after it, all of which must survive the run unchanged.
    State { pad: Vec<u8>, tail: Vec<u8> },
}

/// One leaf of a case.
#[derive(Clone)]
pub struct Leaf {
    /// Name given to the leaf in the graph.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape (the leaf itself is contiguous).
    pub ne: [usize; 4],
    /// Where its memory comes from.
    pub storage: Storage,
    /// Its values.
    pub data: Data,
}

/// A view op applied to an operand on its way from the leaf to the op.
#[derive(Clone, Debug, PartialEq)]
pub enum ViewStep {
    /// `view_1d` .. `view_4d` (picked by the shape) with byte strides and a byte offset.
    View {
        ne: [usize; 4],
        nb: [usize; 4],
        offs: usize,
    },
    /// `permute(axes)`.
    Permute([usize; 4]),
    /// `transpose()`.
    Transpose,
    /// `reshape(ne)` of a contiguous operand.
    Reshape([usize; 4]),
}

/// One operand of the op: a leaf and the view chain applied to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Arg {
    /// Index into [`Case::leaves`].
    pub leaf: usize,
    /// View ops, applied in order.
    pub steps: Vec<ViewStep>,
}

/// The op under test, with its parameters. Operands are [`Case::args`] in the builder's
/// order (set_rows: destination, source, ids; cpy: source, destination).
#[derive(Clone, Debug, PartialEq)]
pub enum OpCase {
    GetRows,
    Binary(BinaryOp),
    Scale(f32),
    Unary(UnaryOp),
    RmsNorm(f32),
    Norm(f32),
    MulMat,
    Rope(RopeParams),
    Cpy,
    Cont,
    Cast(DType),
    SetRows,
    DiagMaskInf(usize),
    /// Soft_max with a scale; the mask, when present, is the second operand.
    SoftMax(f32),
    Argmax,
    /// top_k with this `k`.
    TopK(usize),
}

impl OpCase {
    /// The op's name as graft reports it.
    pub fn name(&self) -> &'static str {
        match self {
            OpCase::GetRows => "get_rows",
            OpCase::Binary(op) => op.name(),
            OpCase::Scale(_) => "scale",
            OpCase::Unary(op) => op.name(),
            OpCase::RmsNorm(_) => "rms_norm",
            OpCase::Norm(_) => "norm",
            OpCase::MulMat => "mul_mat",
            OpCase::Rope(_) => "rope",
            OpCase::Cpy => "cpy",
            OpCase::Cont => "cont",
            OpCase::Cast(_) => "cast",
            OpCase::SetRows => "set_rows",
            OpCase::DiagMaskInf(_) => "diag_mask_inf",
            OpCase::SoftMax(_) => "soft_max",
            OpCase::Argmax => "argmax",
            OpCase::TopK(_) => "top_k",
        }
    }

    /// The operand holding the state the op writes into (cpy and set_rows).
    pub fn state_arg(&self) -> Option<usize> {
        match self {
            OpCase::Cpy => Some(1),
            OpCase::SetRows => Some(0),
            _ => None,
        }
    }
}

/// A complete, backend-independent test case.
#[derive(Clone)]
pub struct Case {
    /// The op.
    pub op: OpCase,
    /// The layout family the case was drawn from ("general", "gemv", "p021", ...).
    pub family: &'static str,
    /// The leaves.
    pub leaves: Vec<Leaf>,
    /// The operands.
    pub args: Vec<Arg>,
    /// For ops writing a state: also output `cont(after(state, [result]))`.
    pub read_back: bool,
    /// Feed the op `cont(first operand)` instead of the operand itself, so that an op
    /// able to run in place takes over that block.
    pub inplace: bool,
    /// The seed the layouts and values were drawn from.
    pub seed: u64,
}

/// Name of the op's result node (shows up in runtime errors).
pub fn out_name(op: &OpCase) -> String {
    format!("{}_out", op.name())
}

impl Case {
    /// The dtype of operand `i` (views keep the leaf's dtype).
    pub fn arg_dtype(&self, i: usize) -> DType {
        self.leaves[self.args[i].leaf].dtype
    }

    /// The dtype of the op's result.
    pub fn result_dtype(&self) -> DType {
        match &self.op {
            OpCase::GetRows | OpCase::MulMat => DType::F32,
            OpCase::Argmax | OpCase::TopK(_) => DType::I32,
            OpCase::Cast(d) => *d,
            OpCase::Cpy => self.arg_dtype(1),
            OpCase::SetRows => self.arg_dtype(0),
            _ => self.arg_dtype(0),
        }
    }

    /// The float dtypes of all operands and of the result.
    fn float_dtypes(&self) -> Vec<DType> {
        (0..self.args.len())
            .map(|i| self.arg_dtype(i))
            .chain(std::iter::once(self.result_dtype()))
            .filter(|d| d.is_float())
            .collect()
    }

    /// Whether every backend must support this case: F32 for elementwise and row ops,
    /// every float dtype pair for the data-movement ops, and mul_mat with an F32 second
    /// operand (any float first operand).
    pub fn required_everywhere(&self) -> bool {
        match &self.op {
            OpCase::Cpy | OpCase::Cast(_) | OpCase::SetRows | OpCase::GetRows => true,
            OpCase::Cont => self.arg_dtype(0).is_float(),
            OpCase::MulMat => self.arg_dtype(1) == DType::F32,
            _ => self.float_dtypes().iter().all(|&d| d == DType::F32),
        }
    }
}

impl fmt::Debug for Case {
    /// A summary without the values (they follow from the seed).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "Case {:?} family={} seed={:#x} read_back={} inplace={}",
            self.op, self.family, self.seed, self.read_back, self.inplace
        )?;
        for (i, l) in self.leaves.iter().enumerate() {
            let storage = match &l.storage {
                Storage::Input => "input".to_string(),
                Storage::Weight { pad } => format!("weight pad={pad}"),
                Storage::State { pad, tail } => {
                    format!("state pad={} tail={}", pad.len(), tail.len())
                }
            };
            writeln!(
                f,
                "  leaf {i} '{}' {} {:?} {storage}",
                l.name, l.dtype, l.ne
            )?;
        }
        for (i, a) in self.args.iter().enumerate() {
            writeln!(f, "  arg {i}: leaf {} {:?}", a.leaf, a.steps)?;
        }
        Ok(())
    }
}

/// Bytes of a leaf's values in its dtype.
pub fn encode(dtype: DType, data: &Data) -> Vec<u8> {
    match data {
        Data::I(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Data::F(v) => v.iter().flat_map(|&x| encode_value(dtype, x)).collect(),
    }
}

/// Bytes of one float value in `dtype` (round to nearest even).
pub fn encode_value(dtype: DType, x: f32) -> Vec<u8> {
    match dtype {
        DType::F32 => x.to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
        DType::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
        DType::I32 => (x as i32).to_le_bytes().to_vec(),
        DType::Quant(q) => panic!("{q} has no single-value encoding; quantize whole rows"),
    }
}

/// The value of the element of `dtype` at the start of `bytes`.
pub fn decode_value(dtype: DType, bytes: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_le_bytes(bytes[..4].try_into().unwrap()) as f64,
        DType::F16 => half::f16::from_le_bytes(bytes[..2].try_into().unwrap()).to_f64(),
        DType::BF16 => half::bf16::from_le_bytes(bytes[..2].try_into().unwrap()).to_f64(),
        DType::I32 => i32::from_le_bytes(bytes[..4].try_into().unwrap()) as f64,
        DType::Quant(q) => panic!("{q} has no single-value decoding; dequantize whole rows"),
    }
}

/// All elements of `bytes` as values of `dtype`.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.block_bytes())
        .map(|c| decode_value(dtype, c))
        .collect()
}

/// The bytes of a state leaf's whole buffer before the run.
pub fn state_image(leaf: &Leaf) -> Vec<u8> {
    let Storage::State { pad, tail } = &leaf.storage else {
        panic!("leaf '{}' is not a state", leaf.name)
    };
    let mut img = pad.clone();
    img.extend(encode(leaf.dtype, &leaf.data));
    img.extend(tail);
    img
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The op's result read with `get_output` (None for ops writing a state).
    pub out: Option<Vec<f64>>,
    /// `cont(after(state, [result]))` when the case asks for it.
    pub read_back: Option<Vec<f64>>,
    /// The whole buffer of every state leaf after the run, by leaf index.
    pub states: Vec<(usize, Vec<u8>)>,
    /// Arena bytes outside every tensor that a run changed (with guard bytes on).
    pub arena_violation: Option<String>,
    /// Steps of the plan that ran in place.
    pub inplace_steps: usize,
}

/// Byte poured over the arena before a run with guard bytes.
pub const SENTINEL: u8 = 0xA5;

/// Builds `case` on `backend`, runs it once and reads everything back. With
/// `guard_bytes > 0` the arena is poisoned with [`SENTINEL`] before the inputs are written
/// and checked after the run. Every buffer the case allocates is freed again.
pub fn run_case(case: &Case, backend: &mut dyn Backend, guard_bytes: usize) -> Result<Outcome> {
    run_case_n(case, backend, guard_bytes, 1)
}

/// [`run_case`] with `runs` runs of the loaded plan (a backend may execute later runs
/// differently, e.g. by replaying a captured graph). Before every run the arena is
/// poisoned again (with guard bytes on) and the inputs are written again; the results
/// are read after the last run.
pub fn run_case_n(
    case: &Case,
    backend: &mut dyn Backend,
    guard_bytes: usize,
    runs: usize,
) -> Result<Outcome> {
    let mut buffers: Vec<Option<BufferId>> = vec![None; case.leaves.len()];
    let result = run_with_buffers(case, backend, guard_bytes, runs, &mut buffers);
    let mut freed = Ok(());
    for b in buffers.into_iter().flatten() {
        if let Err(e) = backend.free_buffer(b) {
            freed = Err(e);
        }
    }
    let outcome = result?;
    freed.map(|()| outcome)
}

/// Applies the view chain of `arg` to the leaf `t`.
fn apply_steps(g: &mut Graph, mut t: TensorId, steps: &[ViewStep]) -> Result<TensorId> {
    for s in steps {
        t = match *s {
            ViewStep::View { ne, nb, offs } => {
                if ne[1] == 1 && ne[2] == 1 && ne[3] == 1 {
                    g.view_1d(t, ne[0], offs)?
                } else if ne[2] == 1 && ne[3] == 1 {
                    g.view_2d(t, ne[0], ne[1], nb[1], offs)?
                } else if ne[3] == 1 {
                    g.view_3d(t, ne[0], ne[1], ne[2], nb[1], nb[2], offs)?
                } else {
                    g.view_4d(t, ne, nb[1], nb[2], nb[3], offs)?
                }
            }
            ViewStep::Permute(axes) => g.permute(t, axes)?,
            ViewStep::Transpose => g.transpose(t)?,
            ViewStep::Reshape(ne) => g.reshape(t, &ne)?,
        };
    }
    Ok(t)
}

/// Calls the op's builder.
fn build_op(g: &mut Graph, op: &OpCase, a: &[TensorId]) -> Result<TensorId> {
    match *op {
        OpCase::GetRows => g.get_rows(a[0], a[1]),
        OpCase::Binary(op) => g.binary(op, a[0], a[1]),
        OpCase::Scale(s) => g.scale(a[0], s),
        OpCase::Unary(op) => g.unary(op, a[0]),
        OpCase::RmsNorm(eps) => g.rms_norm(a[0], eps),
        OpCase::Norm(eps) => g.norm(a[0], eps),
        OpCase::MulMat => g.mul_mat(a[0], a[1]),
        OpCase::Rope(p) => g.rope(a[0], a[1], p),
        OpCase::Cpy => g.cpy(a[0], a[1]),
        OpCase::Cont => g.cont(a[0]),
        OpCase::Cast(d) => g.cast(a[0], d),
        OpCase::SetRows => g.set_rows(a[0], a[1], a[2]),
        OpCase::DiagMaskInf(n_past) => g.diag_mask_inf(a[0], n_past),
        OpCase::SoftMax(scale) => match a.get(1) {
            None if scale == 1.0 => g.soft_max(a[0]),
            m => g.soft_max_ext(a[0], m.copied(), scale),
        },
        OpCase::Argmax => g.argmax(a[0]),
        OpCase::TopK(k) => g.top_k(a[0], k),
    }
}

fn run_with_buffers(
    case: &Case,
    be: &mut dyn Backend,
    guard_bytes: usize,
    runs: usize,
    buffers: &mut [Option<BufferId>],
) -> Result<Outcome> {
    let mut g = Graph::new();
    let mut leaf_ids = Vec::with_capacity(case.leaves.len());
    for (i, leaf) in case.leaves.iter().enumerate() {
        let id = match &leaf.storage {
            Storage::Input => g.input(&leaf.name, leaf.dtype, &leaf.ne)?,
            Storage::Weight { pad } => {
                let bytes = encode(leaf.dtype, &leaf.data);
                let buf = be.alloc_buffer(pad + bytes.len())?;
                buffers[i] = Some(buf);
                be.write_buffer(buf, *pad, &bytes)?;
                let r = BufferRef {
                    buffer: buf,
                    offset: *pad,
                };
                g.weight(&leaf.name, leaf.dtype, &leaf.ne, r)?
            }
            Storage::State { pad, .. } => {
                let img = state_image(leaf);
                let buf = be.alloc_buffer(img.len())?;
                buffers[i] = Some(buf);
                be.write_buffer(buf, 0, &img)?;
                let r = BufferRef {
                    buffer: buf,
                    offset: pad.len(),
                };
                g.state(&leaf.name, leaf.dtype, &leaf.ne, r)?
            }
        };
        leaf_ids.push(id);
    }
    let mut arg_ids = Vec::with_capacity(case.args.len());
    for arg in &case.args {
        arg_ids.push(apply_steps(&mut g, leaf_ids[arg.leaf], &arg.steps)?);
    }
    if case.inplace {
        arg_ids[0] = g.cont(arg_ids[0])?;
    }
    let out = build_op(&mut g, &case.op, &arg_ids)?;
    g.set_name(out, out_name(&case.op))?;
    let mut outputs = vec![out];
    if case.read_back {
        let si = case
            .op
            .state_arg()
            .expect("read_back needs an op writing a state");
        let state = leaf_ids[case.args[si].leaf];
        let after = g.after(state, &[out])?;
        let rb = g.cont(after)?;
        g.set_name(rb, "read_back")?;
        outputs.push(rb);
    }
    let plan = g.plan_with(&outputs, &PlanOptions { guard_bytes })?;
    let exec = be.load(&plan)?;
    let result = (|| {
        for _ in 0..runs {
            if guard_bytes > 0 {
                be.fill_arena(exec, SENTINEL)?;
            }
            for (leaf, &id) in case.leaves.iter().zip(&leaf_ids) {
                if leaf.storage == Storage::Input {
                    be.set_input(exec, id, &encode(leaf.dtype, &leaf.data))?;
                }
            }
            be.compute(exec)?;
        }
        let read = |be: &mut dyn Backend, id: TensorId| -> Result<Vec<f64>> {
            let io = plan.io(id).expect("an output of the plan");
            let mut bytes = vec![0u8; io.operand.nbytes()];
            be.get_output(exec, id, &mut bytes)?;
            Ok(decode(io.operand.dtype, &bytes))
        };
        let out_vals = match case.op.state_arg() {
            Some(_) => None,
            None => Some(read(be, out)?),
        };
        let read_back = match outputs.get(1) {
            Some(&rb) => Some(read(be, rb)?),
            None => None,
        };
        let mut states = Vec::new();
        for (i, leaf) in case.leaves.iter().enumerate() {
            if matches!(leaf.storage, Storage::State { .. }) {
                let mut img = vec![0u8; state_image(leaf).len()];
                be.read_buffer(buffers[i].expect("state buffer"), 0, &mut img)?;
                states.push((i, img));
            }
        }
        let arena_violation = if guard_bytes > 0 {
            arena_violation(&plan, &g, &be.read_arena(exec)?)
        } else {
            None
        };
        Ok(Outcome {
            out: out_vals,
            read_back,
            states,
            arena_violation,
            inplace_steps: plan.steps.iter().filter(|s| s.inplace).count(),
        })
    })();
    let unloaded = be.unload(exec);
    let outcome = result?;
    unloaded.map(|()| outcome)
}

/// Describes the arena bytes outside every tensor extent (arena blocks, in-place blocks,
/// inputs) that no longer hold [`SENTINEL`], or None when all are intact.
pub fn arena_violation(plan: &Plan, g: &Graph, arena: &[u8]) -> Option<String> {
    let mut covered = vec![false; arena.len()];
    let mut extents = Vec::new();
    for (id, info) in plan.alloc.info.iter() {
        if matches!(info.kind, AllocKind::Arena | AllocKind::InPlace(_)) {
            let end = (info.offset + info.size).min(arena.len());
            covered[info.offset.min(end)..end].fill(true);
            extents.push((info.offset, info.offset + info.size, id));
        }
    }
    let bad: Vec<usize> = (0..arena.len())
        .filter(|&i| !covered[i] && arena[i] != SENTINEL)
        .collect();
    let &first = bad.first()?;
    let before = extents
        .iter()
        .filter(|e| e.1 <= first)
        .max_by_key(|e| e.1)
        .map(|&(s, e, id)| format!("'{}' at {s}..{e}", g.tensor(id).name))
        .unwrap_or_else(|| "nothing".into());
    Some(format!(
        "{} arena bytes outside every tensor were overwritten; first at offset {first} (0x{:02x}), after {before}; arena of {} bytes",
        bad.len(),
        arena[first],
        arena.len()
    ))
}

/// Whether `e` is the error a backend gives for a node it cannot run.
pub fn is_unsupported(e: &Error) -> bool {
    matches!(e, Error::Unsupported { .. })
}
