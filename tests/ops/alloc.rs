//! Allocator tests: property tests on random DAGs built with the real op builders, and
//! deterministic tests of best fit, merging of free blocks and in-place decisions.
//!
//! Nothing here reuses the allocator's bookkeeping. Liveness is computed from the graph
//! and the plan's order alone: a tensor's memory (its base's, for a view) is live from
//! the step that produces it to the last step that reads it directly or through any view;
//! inputs, outputs and the bases of output views live for the whole plan; an in-place
//! node and the source it took over form one chain sharing one block. Values are checked
//! end to end against an f64 evaluator written here, on an arena poisoned with NaNs, so a
//! wrong reuse shows up as a wrong value, and bytes outside every tensor must keep the
//! poison.

use std::collections::{HashMap, HashSet};

use common::oracle::unary_ref;
use graft::backend::cpu::CpuBackend;
use graft::backend::{Backend, BackendExt};
use graft::graph::alloc::ALIGN;
use graft::graph::{
    AllocKind, BufferRef, DType, Flags, Graph, Loc, Operand, Plan, PlanOptions, TensorId,
};
use graft::ops::{RopeMode, RopeParams, UnaryOp};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common;

/// The result of one check: what is wrong, if anything.
type Check = Result<(), String>;

/// "Live until after the last step".
const FOREVER: usize = usize::MAX;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Row-major position of index `i` in a dense tensor of shape `ne`.
fn flat(ne: [usize; 4], i: [usize; 4]) -> usize {
    i[0] + ne[0] * (i[1] + ne[1] * (i[2] + ne[2] * i[3]))
}

/// Every index of `ne` in row-major order (dim 0 fastest).
fn indices(ne: [usize; 4]) -> Vec<[usize; 4]> {
    let mut v = Vec::with_capacity(ne.iter().product());
    for i3 in 0..ne[3] {
        for i2 in 0..ne[2] {
            for i1 in 0..ne[1] {
                for i0 in 0..ne[0] {
                    v.push([i0, i1, i2, i3]);
                }
            }
        }
    }
    v
}

/// Byte offset of index `i` under strides `nb`.
fn byte_offset(nb: [usize; 4], i: [usize; 4]) -> usize {
    (0..4).map(|k| i[k] * nb[k]).sum()
}

// ---------------------------------------------------------------------------------------
// The graph under test with its f64 evaluator.
// ---------------------------------------------------------------------------------------

/// Elementwise unary ops of the evaluator.
#[derive(Clone, Copy, Debug)]
enum Unary {
    Scale(f32),
    Op(UnaryOp),
}

/// A graph, the CPU backend holding its weight and state buffers, and the values every
/// tensor must have, computed in f64 as the graph is built. Every tensor is F32 or I32
/// (4-byte elements), so element `k` of a base tensor's memory sits at byte `4k`.
struct Rig {
    g: Graph,
    be: CpuBackend,
    rng: StdRng,
    /// Dense row-major values of every tensor made so far.
    vals: HashMap<TensorId, Vec<f64>>,
    /// The memory of every base tensor, one value per 4-byte element.
    mem: HashMap<TensorId, Vec<f64>>,
    f32_inputs: HashMap<TensorId, Vec<f32>>,
    i32_inputs: HashMap<TensorId, Vec<i32>>,
}

impl Rig {
    fn new(seed: u64) -> Self {
        Rig {
            g: Graph::new(),
            be: CpuBackend::new(),
            rng: StdRng::seed_from_u64(seed),
            vals: HashMap::new(),
            mem: HashMap::new(),
            f32_inputs: HashMap::new(),
            i32_inputs: HashMap::new(),
        }
    }

    fn ne(&self, id: TensorId) -> [usize; 4] {
        self.g.tensor(id).ne
    }

    fn name(&self, what: &str) -> String {
        format!("{what}{}", self.g.len())
    }

    /// Values of magnitude 0.5..1.5 with random signs (away from zero, so a value read
    /// from the wrong place is visibly wrong).
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let m = self.rng.random_range(0.5f32..1.5);
                if self.rng.random_bool(0.5) {
                    m
                } else {
                    -m
                }
            })
            .collect()
    }

    /// Records a tensor with memory of its own (dense).
    fn base(&mut self, id: TensorId, v: Vec<f64>) -> TensorId {
        assert_eq!(v.len(), self.g.tensor(id).nelements());
        self.mem.insert(id, v.clone());
        self.vals.insert(id, v);
        id
    }

    /// Records a view: its values are read from its base's memory through its layout.
    fn viewed(&mut self, id: TensorId) -> TensorId {
        let t = self.g.tensor(id);
        let base = t.view_src.expect("a view");
        let mem = &self.mem[&base];
        let v = indices(t.ne)
            .into_iter()
            .map(|i| mem[(t.view_offs + byte_offset(t.nb, i)) / 4])
            .collect();
        self.vals.insert(id, v);
        id
    }

    fn input(&mut self, shape: &[usize]) -> TensorId {
        let name = self.name("in");
        let id = self.g.input(&name, DType::F32, shape).unwrap();
        let v = self.values(self.g.tensor(id).nelements());
        self.f32_inputs.insert(id, v.clone());
        self.base(id, v.into_iter().map(f64::from).collect())
    }

    /// An I32 input with values in `0..limit`.
    fn ids(&mut self, shape: &[usize], limit: usize) -> TensorId {
        let name = self.name("ids");
        let id = self.g.input(&name, DType::I32, shape).unwrap();
        let v: Vec<i32> = (0..self.g.tensor(id).nelements())
            .map(|_| self.rng.random_range(0..limit) as i32)
            .collect();
        self.i32_inputs.insert(id, v.clone());
        self.base(id, v.into_iter().map(f64::from).collect())
    }

    /// A weight (or, with `state`, a state tensor) in a backend buffer of its own, at a
    /// random offset.
    fn external(&mut self, shape: &[usize], state: bool) -> TensorId {
        let n: usize = shape.iter().product();
        let pad = self.rng.random_range(0..4usize);
        let buffer = self.be.alloc_buffer((pad + n + 1) * 4).unwrap();
        let v = self.values(n);
        self.be
            .write_buffer(buffer, pad * 4, bytemuck::cast_slice(&v))
            .unwrap();
        let data = BufferRef {
            buffer,
            offset: pad * 4,
        };
        let id = if state {
            let name = self.name("state");
            self.g.state(&name, DType::F32, shape, data).unwrap()
        } else {
            let name = self.name("w");
            self.g.weight(&name, DType::F32, shape, data).unwrap()
        };
        self.base(id, v.into_iter().map(f64::from).collect())
    }

    fn binary(&mut self, a: TensorId, b: TensorId, mul: bool) -> TensorId {
        let id = if mul {
            self.g.mul(a, b)
        } else {
            self.g.add(a, b)
        }
        .unwrap();
        let (na, nb) = (self.ne(a), self.ne(b));
        let (va, vb) = (&self.vals[&a], &self.vals[&b]);
        let v = indices(na)
            .into_iter()
            .map(|i| {
                let x = va[flat(na, i)];
                let y = vb[flat(nb, [0, 1, 2, 3].map(|k| i[k] % nb[k]))];
                if mul {
                    x * y
                } else {
                    x + y
                }
            })
            .collect();
        self.base(id, v)
    }

    fn unary(&mut self, a: TensorId, op: Unary) -> TensorId {
        let id = match op {
            Unary::Scale(s) => self.g.scale(a, s),
            Unary::Op(op) => self.g.unary(op, a),
        }
        .unwrap();
        let v = self.vals[&a]
            .iter()
            .map(|&x| match op {
                Unary::Scale(s) => x * f64::from(s),
                Unary::Op(op) => unary_ref(op, x),
            })
            .collect();
        self.base(id, v)
    }

    /// Applies `f` to each row (dim 0) of `a`'s values; `f` gets the row index too.
    fn rowwise(&self, a: TensorId, mut f: impl FnMut(&mut [f64], [usize; 4])) -> Vec<f64> {
        let ne = self.ne(a);
        let mut v = self.vals[&a].clone();
        for (r, row) in v.chunks_exact_mut(ne[0]).enumerate() {
            let i = [0, r % ne[1], (r / ne[1]) % ne[2], r / (ne[1] * ne[2])];
            f(row, i);
        }
        v
    }

    fn rms_norm(&mut self, a: TensorId, eps: f32) -> TensorId {
        let id = self.g.rms_norm(a, eps).unwrap();
        let v = self.rowwise(a, |row, _| {
            let ms = row.iter().map(|x| x * x).sum::<f64>() / row.len() as f64;
            let r = 1.0 / (ms + f64::from(eps)).sqrt();
            row.iter_mut().for_each(|x| *x *= r);
        });
        self.base(id, v)
    }

    /// LayerNorm without the affine part.
    fn norm(&mut self, a: TensorId, eps: f32) -> TensorId {
        let id = self.g.norm(a, eps).unwrap();
        let v = self.rowwise(a, |row, _| {
            let n = row.len() as f64;
            let mean = row.iter().sum::<f64>() / n;
            let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
            let r = 1.0 / (var + f64::from(eps)).sqrt();
            row.iter_mut().for_each(|x| *x = (*x - mean) * r);
        });
        self.base(id, v)
    }

    fn soft_max(&mut self, a: TensorId, mask: Option<TensorId>, scale: f32) -> TensorId {
        let id = self.g.soft_max_ext(a, mask, scale).unwrap();
        let m = mask.map(|m| (self.ne(m), self.vals[&m].clone()));
        let v = self.rowwise(a, |row, i| {
            for (i0, x) in row.iter_mut().enumerate() {
                *x *= f64::from(scale);
                if let Some((mne, mv)) = &m {
                    *x += mv[flat(*mne, [i0, i[1] % mne[1], i[2] % mne[2], i[3] % mne[3]])];
                }
            }
            let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = row.iter().map(|x| (x - max).exp()).sum();
            row.iter_mut().for_each(|x| *x = (*x - max).exp() / sum);
        });
        self.base(id, v)
    }

    /// Rope with base 10000 over the first `n_dims` dims of `a`, positions `pos`.
    fn rope(&mut self, a: TensorId, pos: TensorId, n_dims: usize, mode: RopeMode) -> TensorId {
        let id = self
            .g
            .rope(a, pos, RopeParams::new(mode, n_dims, 10000.0))
            .unwrap();
        let p = self.vals[&pos].clone();
        let v = self.rowwise(a, |row, i| {
            for k in 0..n_dims / 2 {
                let theta = p[i[2]] * 10000f64.powf(-((2 * k) as f64) / n_dims as f64);
                let (s, c) = theta.sin_cos();
                let (j0, j1) = match mode {
                    RopeMode::Normal => (2 * k, 2 * k + 1),
                    RopeMode::Neox => (k, k + n_dims / 2),
                };
                let (x0, x1) = (row[j0], row[j1]);
                row[j0] = x0 * c - x1 * s;
                row[j1] = x0 * s + x1 * c;
            }
        });
        self.base(id, v)
    }

    /// ggml mul_mat: out[i, j, i2, i3] = sum_l a[l, i, i2 / r2, i3 / r3] * b[l, j, i2, i3].
    fn mul_mat(&mut self, a: TensorId, b: TensorId) -> TensorId {
        let id = self.g.mul_mat(a, b).unwrap();
        let (na, nb) = (self.ne(a), self.ne(b));
        let (va, vb) = (&self.vals[&a], &self.vals[&b]);
        let (r2, r3) = (nb[2] / na[2], nb[3] / na[3]);
        let v = indices([na[1], nb[1], nb[2], nb[3]])
            .into_iter()
            .map(|[i, j, i2, i3]| {
                (0..na[0])
                    .map(|l| va[flat(na, [l, i, i2 / r2, i3 / r3])] * vb[flat(nb, [l, j, i2, i3])])
                    .sum::<f64>()
            })
            .collect();
        self.base(id, v)
    }

    fn cont(&mut self, a: TensorId) -> TensorId {
        let id = self.g.cont(a).unwrap();
        let v = self.vals[&a].clone();
        self.base(id, v)
    }

    /// get_rows with `n` fresh random ids.
    fn get_rows(&mut self, table: TensorId, n: usize) -> TensorId {
        let nt = self.ne(table);
        let ids = self.ids(&[n, nt[2], nt[3]], nt[1]);
        let id = self.g.get_rows(table, ids).unwrap();
        let (vt, vi) = (&self.vals[&table], &self.vals[&ids]);
        let v = indices([nt[0], n, nt[2], nt[3]])
            .into_iter()
            .map(|[i0, r, i2, i3]| {
                let row = vi[flat([n, nt[2], nt[3], 1], [r, i2, i3, 0])] as usize;
                vt[flat(nt, [i0, row, i2, i3])]
            })
            .collect();
        self.base(id, v)
    }

    fn view(&mut self, a: TensorId, ne: [usize; 4], nb: [usize; 4], offs: usize) -> TensorId {
        let id = self.g.view(a, ne, nb, offs).unwrap();
        self.viewed(id)
    }

    fn view_1d(&mut self, a: TensorId, ne0: usize, offs: usize) -> TensorId {
        let id = self.g.view_1d(a, ne0, offs).unwrap();
        self.viewed(id)
    }

    fn reshape(&mut self, a: TensorId, shape: &[usize]) -> TensorId {
        let id = self.g.reshape(a, shape).unwrap();
        self.viewed(id)
    }

    fn permute(&mut self, a: TensorId, axes: [usize; 4]) -> TensorId {
        let id = self.g.permute(a, axes).unwrap();
        self.viewed(id)
    }

    fn transpose(&mut self, a: TensorId) -> TensorId {
        let id = self.g.transpose(a).unwrap();
        self.viewed(id)
    }

    /// Copies `a` into a fresh state tensor (between random padding) and returns the
    /// result of the cpy: a 1-d view of the state with `a`'s values in row-major order.
    fn cpy_to_state(&mut self, a: TensorId) -> TensorId {
        let n = self.g.tensor(a).nelements();
        let (p0, p1) = (self.rng.random_range(0..3), self.rng.random_range(0..3));
        let state = self.external(&[p0 + n + p1], true);
        let dst = self.g.view_1d(state, n, p0 * 4).unwrap();
        let id = self.g.cpy(a, dst).unwrap();
        let va = self.vals[&a].clone();
        self.mem.get_mut(&state).unwrap()[p0..p0 + n].copy_from_slice(&va);
        self.viewed(id)
    }

    /// Where the first element of `id` lives under `plan`.
    fn loc(&self, plan: &Plan, id: TensorId) -> Loc {
        let t = self.g.tensor(id);
        let base = t.view_src.unwrap_or(id);
        let offs = if t.view_src.is_some() { t.view_offs } else { 0 };
        match self.g.tensor(base).data {
            Some(r) => Loc::Buffer(r.buffer, r.offset + offs),
            None => Loc::Arena(plan.alloc.info[base].offset + offs),
        }
    }

    /// Reads `id` after a run, from the arena copy or from its backend buffer.
    fn read(&mut self, plan: &Plan, arena: &[u8], id: TensorId) -> Vec<f64> {
        let t = self.g.tensor(id).clone();
        let n = t.nbytes();
        let bytes = match self.loc(plan, id) {
            Loc::Arena(off) => arena[off..off + n].to_vec(),
            Loc::Buffer(b, off) => {
                let mut v = vec![0u8; n];
                self.be.read_buffer(b, off, &mut v).unwrap();
                v
            }
        };
        indices(t.ne)
            .into_iter()
            .map(|i| {
                let k = byte_offset(t.nb, i);
                let w: [u8; 4] = bytes[k..k + 4].try_into().unwrap();
                match t.dtype {
                    DType::I32 => f64::from(i32::from_le_bytes(w)),
                    _ => f64::from(f32::from_le_bytes(w)),
                }
            })
            .collect()
    }

    /// Runs `plan` twice on the CPU with the arena poisoned by NaNs, and compares every
    /// output (listed or flagged) with the evaluator; bytes of the arena that belong to
    /// no tensor must keep the poison.
    fn run_and_compare(&mut self, plan: &Plan) -> Result<(), String> {
        let e = self.be.load(plan).map_err(|e| e.to_string())?;
        self.be.fill_arena(e, 0xff).unwrap();
        for io in &plan.inputs {
            let id = io.operand.id;
            match io.operand.dtype {
                DType::I32 => self.be.set_input_i32(e, id, &self.i32_inputs[&id]),
                _ => self.be.set_input_f32(e, id, &self.f32_inputs[&id]),
            }
            .unwrap();
        }
        let mut check: Vec<TensorId> = plan.forward.outputs.clone();
        check.extend(
            plan.forward
                .order
                .iter()
                .filter(|&&id| self.g.tensor(id).flags.contains(Flags::OUTPUT)),
        );
        let covered = arena_bytes_in_use(&self.g, plan);
        for run in 0..2 {
            self.be.compute(e).map_err(|e| e.to_string())?;
            let arena = self.be.read_arena(e).unwrap();
            for &id in &check {
                let got = self.read(plan, &arena, id);
                compare(&got, &self.vals[&id])
                    .map_err(|m| format!("run {run}: '{}': {m}", self.g.tensor(id).name))?;
            }
            for io in &plan.outputs {
                if io.operand.is_contiguous() && io.operand.dtype == DType::F32 {
                    let got = self
                        .be
                        .get_output_f32(e, io.operand.id, io.operand.nelements())
                        .unwrap();
                    let want = self.read(plan, &arena, io.operand.id);
                    ensure!(
                        got.iter().zip(&want).all(|(g, w)| f64::from(*g) == *w),
                        "get_output of '{}' differs from its bytes in the arena",
                        io.name
                    );
                }
            }
            for (k, &b) in arena.iter().enumerate() {
                ensure!(
                    covered[k] || b == 0xff,
                    "run {run}: arena byte {k} belongs to no tensor but was written (0x{b:02x})"
                );
            }
        }
        self.be.unload(e).unwrap();
        Ok(())
    }
}

/// Which arena bytes belong to some tensor at some time (inputs and every block).
fn arena_bytes_in_use(g: &Graph, plan: &Plan) -> Vec<bool> {
    let mut covered = vec![false; plan.arena_bytes];
    for &id in &plan.forward.order {
        let t = g.tensor(id);
        if t.view_src.is_none() && t.data.is_none() {
            let off = plan.alloc.info[id].offset;
            covered[off..off + t.nbytes()].fill(true);
        }
    }
    covered
}

/// Every value finite and within `1e-3 * (|want| + rms(want))` of the evaluator's.
fn compare(got: &[f64], want: &[f64]) -> Result<(), String> {
    ensure!(
        got.len() == want.len(),
        "{} values, expected {}",
        got.len(),
        want.len()
    );
    let rms = (want.iter().map(|x| x * x).sum::<f64>() / want.len() as f64).sqrt();
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        ensure!(
            g.is_finite() && (g - w).abs() <= 1e-3 * (w.abs() + rms) + 1e-6,
            "element {i} is {g}, expected {w}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The independent liveness check.
// ---------------------------------------------------------------------------------------

/// One arena block: an input, or a chain of tensors (a node and the in-place nodes that
/// took its memory over), with its bytes and the steps during which it is live.
#[derive(Debug)]
struct Block {
    members: Vec<TensorId>,
    off: usize,
    size: usize,
    start: usize,
    end: usize,
    input: bool,
    pinned: bool,
}

impl Block {
    fn overlaps_bytes(&self, o: &Block, gap: usize) -> bool {
        self.off < o.off + o.size + gap && o.off < self.off + self.size + gap
    }

    /// `'name' [offset+size, steps start..=end]`.
    fn describe(&self, g: &Graph) -> String {
        let end = if self.end == FOREVER {
            "end".to_string()
        } else {
            self.end.to_string()
        };
        format!(
            "'{}' [{}+{}, steps {}..={end}]",
            g.tensor(self.members[0]).name,
            self.off,
            self.size,
            self.start
        )
    }

    fn overlaps_time(&self, o: &Block) -> bool {
        self.start <= o.end && o.start <= self.end
    }
}

/// The base tensor whose memory `id` uses (itself, or its view source).
fn base_of(g: &Graph, id: TensorId) -> TensorId {
    g.tensor(id).view_src.unwrap_or(id)
}

/// What the check derives from the graph and the plan's order alone.
struct Liveness {
    /// Each node's step.
    pos: HashMap<TensorId, usize>,
    /// Inputs and outputs (listed or flagged) and the bases of output views: they live
    /// to the end.
    pinned: HashSet<TensorId>,
    /// The last step reading each base tensor, directly or through views.
    last: HashMap<TensorId, usize>,
    /// Until which step each base tensor is held for the in-place rule: like `last`, but
    /// the extra sources of `after` (ordering only, no read) are held until the `after`.
    hold: HashMap<TensorId, usize>,
}

impl Liveness {
    fn new(g: &Graph, plan: &Plan) -> Liveness {
        let order = &plan.forward.order;
        let pos = order.iter().enumerate().map(|(p, &id)| (id, p)).collect();
        let mut pinned = HashSet::new();
        for &id in order {
            let t = g.tensor(id);
            if t.flags.intersects(Flags::INPUT | Flags::OUTPUT)
                || plan.forward.outputs.contains(&id)
            {
                pinned.insert(id);
                pinned.insert(base_of(g, id));
            }
        }
        let mut last = HashMap::new();
        for (p, &id) in order.iter().enumerate() {
            let t = g.tensor(id);
            if t.op.computes() {
                for &s in &t.src {
                    last.insert(base_of(g, s), p);
                }
            }
        }
        let mut hold = last.clone();
        for (p, &id) in order.iter().enumerate() {
            let t = g.tensor(id);
            if t.op.is_view() {
                for &s in &t.src {
                    if Some(base_of(g, s)) != t.view_src {
                        let h = hold.entry(base_of(g, s)).or_insert(p);
                        *h = (*h).max(p);
                    }
                }
            }
        }
        Liveness {
            pos,
            pinned,
            last,
            hold,
        }
    }

    /// The last step at which the memory of `id` must still hold it.
    fn end_of(&self, id: TensorId) -> usize {
        if self.pinned.contains(&id) {
            FOREVER
        } else {
            self.last.get(&id).copied().unwrap_or(self.pos[&id])
        }
    }
}

/// The arena blocks a plan's allocation implies, and the figures its report must give.
#[derive(Default)]
struct Blocks {
    blocks: Vec<Block>,
    block_of: HashMap<TensorId, usize>,
    n_blocks: usize,
    n_inplace: usize,
    n_views: usize,
    /// Every computed tensor's aligned bytes: the arena without any reuse.
    naive: usize,
}

impl Blocks {
    /// Checks the allocation of node `id` and adds it to the blocks.
    fn add(&mut self, g: &Graph, plan: &Plan, lv: &Liveness, id: TensorId) -> Check {
        let t = g.tensor(id);
        let Some(a) = plan.alloc.info.get(id) else {
            return Err(format!("'{}' has no allocation", t.name));
        };
        ensure!(
            a.size == t.nbytes(),
            "'{}': size {} != nbytes {}",
            t.name,
            a.size,
            t.nbytes()
        );
        if let Some(vb) = t.view_src {
            self.n_views += 1;
            return check_view(g, plan, id, vb);
        }
        if t.data.is_some() {
            ensure!(
                a.kind == AllocKind::External,
                "weight/state '{}' has kind {:?}",
                t.name,
                a.kind
            );
            return Ok(());
        }
        self.naive += align(t.nbytes());
        ensure!(
            a.offset % ALIGN == 0,
            "'{}' at unaligned {}",
            t.name,
            a.offset
        );
        match a.kind {
            AllocKind::Arena => self.open(g, lv, id, a.offset)?,
            AllocKind::InPlace(src) => self.extend(g, plan, lv, id, src)?,
            other => return Err(format!("computed '{}' has kind {other:?}", t.name)),
        }
        check_no_missed_inplace(g, plan, lv, id)
    }

    /// A new block for node `id` at `offset`.
    fn open(&mut self, g: &Graph, lv: &Liveness, id: TensorId, offset: usize) -> Check {
        let t = g.tensor(id);
        self.n_blocks += 1;
        let input = t.op.is_leaf();
        ensure!(
            !input || t.flags.contains(Flags::INPUT),
            "leaf '{}' in the arena is not an input",
            t.name
        );
        self.block_of.insert(id, self.blocks.len());
        self.blocks.push(Block {
            members: vec![id],
            off: offset,
            size: t.nbytes(),
            start: if input { 0 } else { lv.pos[&id] },
            end: if input { FOREVER } else { lv.end_of(id) },
            input,
            pinned: lv.pinned.contains(&id),
        });
        Ok(())
    }

    /// Node `id`, in place over `src`, joins the block of `src`.
    fn extend(
        &mut self,
        g: &Graph,
        plan: &Plan,
        lv: &Liveness,
        id: TensorId,
        src: TensorId,
    ) -> Check {
        let (t, info) = (g.tensor(id), &plan.alloc.info);
        self.n_inplace += 1;
        check_inplace_allowed(g, lv, id, src)?;
        ensure!(
            info[src].offset == info[id].offset,
            "in-place '{}' at {} but its source '{}' at {}",
            t.name,
            info[id].offset,
            g.tensor(src).name,
            info[src].offset
        );
        let k = self.block_of[&src];
        self.block_of.insert(id, k);
        let b = &mut self.blocks[k];
        b.members.push(id);
        b.end = b.end.max(lv.end_of(id));
        b.pinned |= lv.pinned.contains(&id);
        Ok(())
    }
}

/// A view `id` of `vb`: no memory of its own, exactly at its base's offset + view_offs,
/// inside the base.
fn check_view(g: &Graph, plan: &Plan, id: TensorId, vb: TensorId) -> Check {
    let (t, info) = (g.tensor(id), &plan.alloc.info);
    let a = info[id];
    ensure!(
        a.kind == AllocKind::View(vb),
        "view '{}' has kind {:?}",
        t.name,
        a.kind
    );
    let bt = g.tensor(vb);
    if bt.data.is_none() {
        let b = info[vb];
        ensure!(
            a.offset == b.offset + t.view_offs,
            "view '{}' at {} but its base '{}' is at {} + view_offs {}",
            t.name,
            a.offset,
            bt.name,
            b.offset,
            t.view_offs
        );
        ensure!(
            t.view_offs + t.nbytes() <= bt.nbytes(),
            "view '{}' reaches past its base",
            t.name
        );
    }
    Ok(())
}

/// The converse of the in-place rule: whenever its conditions hold, node `id` does run
/// in place over its first source.
fn check_no_missed_inplace(g: &Graph, plan: &Plan, lv: &Liveness, id: TensorId) -> Check {
    let (t, info) = (g.tensor(id), &plan.alloc.info);
    let Some(&src) = t.src.first() else {
        return Ok(());
    };
    if matches!(info[id].kind, AllocKind::Arena)
        && check_inplace_allowed(g, lv, id, src).is_ok()
        && info.get(src).is_some_and(|s| {
            matches!(s.kind, AllocKind::Arena | AllocKind::InPlace(_))
                && !g.tensor(src).op.is_leaf()
        })
    {
        return Err(format!(
            "'{}' could run in place over '{}' but got a block of its own",
            t.name,
            g.tensor(src).name
        ));
    }
    Ok(())
}

/// Checks a plan against liveness computed here from the graph and the order alone.
fn check_plan(g: &Graph, plan: &Plan, guard: usize) -> Check {
    let lv = Liveness::new(g, plan);
    let mut blocks = Blocks::default();
    for &id in &plan.forward.order {
        blocks.add(g, plan, &lv, id)?;
    }
    check_report(g, plan, &blocks, guard)?;
    check_pairs(g, &blocks.blocks, align(guard))?;
    check_steps(g, plan)
}

/// The report's figures against the blocks: counts, the arena without reuse, the peak
/// (the end of the highest block and its guard), every block inside the guards.
fn check_report(g: &Graph, plan: &Plan, b: &Blocks, guard: usize) -> Check {
    let report = plan.alloc.report;
    ensure!(plan.arena_bytes == report.peak_bytes, "arena_bytes != peak");
    let (n_blocks, n_inplace, n_views) = (b.n_blocks, b.n_inplace, b.n_views);
    ensure!(
        (report.n_blocks, report.n_inplace, report.n_views) == (n_blocks, n_inplace, n_views),
        "report counts {:?} != ({n_blocks}, {n_inplace}, {n_views})",
        report
    );
    let naive = b.naive;
    ensure!(
        report.naive_bytes == naive,
        "naive {} != {naive}",
        report.naive_bytes
    );
    let guard_a = align(guard);
    if guard == 0 {
        ensure!(
            report.peak_bytes <= naive,
            "peak {} > naive {naive}",
            report.peak_bytes
        );
    }
    let mut top = guard_a;
    for b in &b.blocks {
        ensure!(
            b.off >= guard_a && b.off + b.size + guard_a <= report.peak_bytes,
            "block of '{}' at {}+{} (guard {guard_a}) outside the arena of {}",
            g.tensor(b.members[0]).name,
            b.off,
            b.size,
            report.peak_bytes
        );
        top = top.max(b.off + align(b.size) + guard_a);
    }
    ensure!(
        b.blocks.is_empty() || top == report.peak_bytes,
        "peak {} but the highest block ends at {top}",
        report.peak_bytes
    );
    Ok(())
}

/// Pairs of blocks: no overlap while both live; guards of `guard_a` bytes between them;
/// inputs never overlapped; outputs never overwritten after being produced.
fn check_pairs(g: &Graph, blocks: &[Block], guard_a: usize) -> Check {
    for (i, x) in blocks.iter().enumerate() {
        for y in &blocks[i + 1..] {
            let name = |b: &Block| g.tensor(b.members[0]).name.clone();
            let both_live = x.overlaps_time(y);
            ensure!(
                !(both_live && x.overlaps_bytes(y, guard_a)),
                "{} and {} are live together and closer than {guard_a} bytes",
                x.describe(g),
                y.describe(g)
            );
            for (p, q) in [(x, y), (y, x)] {
                ensure!(
                    !(p.input && p.overlaps_bytes(q, 0)),
                    "input '{}' overlaps '{}'",
                    name(p),
                    name(q)
                );
                ensure!(
                    !(p.pinned && q.start > p.start && p.overlaps_bytes(q, 0)),
                    "output '{}' is overwritten by '{}' after being produced",
                    name(p),
                    name(q)
                );
            }
        }
    }
    Ok(())
}

/// Steps: exactly the computing nodes, with operands where the allocation says.
fn check_steps(g: &Graph, plan: &Plan) -> Check {
    let info = &plan.alloc.info;
    let computing: Vec<TensorId> = (plan.forward.order.iter().copied())
        .filter(|&id| g.tensor(id).op.computes())
        .collect();
    ensure!(
        plan.steps.iter().map(|s| s.dst.id).collect::<Vec<_>>() == computing,
        "steps are not the computing nodes in order"
    );
    let expect_loc = |o: &Operand| {
        let t = g.tensor(o.id);
        let b = base_of(g, o.id);
        let offs = if t.view_src.is_some() { t.view_offs } else { 0 };
        match g.tensor(b).data {
            Some(r) => Loc::Buffer(r.buffer, r.offset + offs),
            None => Loc::Arena(info[b].offset + offs),
        }
    };
    for s in &plan.steps {
        ensure!(
            s.inplace == matches!(info[s.dst.id].kind, AllocKind::InPlace(_)),
            "step '{}' inplace flag disagrees with the allocation",
            s.name
        );
        for o in std::iter::once(&s.dst).chain(&s.src) {
            ensure!(
                o.loc == expect_loc(o),
                "step '{}': operand '{}' at {:?}, expected {:?}",
                s.name,
                g.tensor(o.id).name,
                o.loc,
                expect_loc(o)
            );
            let t = g.tensor(o.id);
            ensure!(
                (o.dtype, o.ne, o.nb) == (t.dtype, t.ne, t.nb),
                "operand layout differs from the node"
            );
        }
    }
    Ok(())
}

/// The conditions under which `id` may take over the block of its first source `src`:
/// an op that can run in place, `src` a computed non-view tensor that is not an input,
/// output, weight or state, with the same layout, held for the last time by `id` (no
/// later reader, directly or through a view, and no later `after` ordered on it) and
/// read by `id` only as `src[0]`.
fn check_inplace_allowed(g: &Graph, lv: &Liveness, id: TensorId, src: TensorId) -> Check {
    let (t, s) = (g.tensor(id), g.tensor(src));
    ensure!(
        t.op.can_inplace(),
        "'{}' ({}) cannot run in place",
        t.name,
        t.op.name()
    );
    ensure!(
        t.src.first() == Some(&src),
        "'{}' in place over a source that is not src[0]",
        t.name
    );
    ensure!(
        s.view_src.is_none() && !s.op.is_leaf(),
        "'{}' in place over '{}', which is not a computed tensor",
        t.name,
        s.name
    );
    ensure!(
        !s.flags
            .intersects(Flags::INPUT | Flags::OUTPUT | Flags::WEIGHT | Flags::STATE)
            && !lv.pinned.contains(&src),
        "'{}' in place over input/output '{}'",
        t.name,
        s.name
    );
    ensure!(
        (s.dtype, s.ne, s.nb) == (t.dtype, t.ne, t.nb),
        "'{}' in place over '{}' of another layout",
        t.name,
        s.name
    );
    ensure!(
        lv.hold.get(&src) == Some(&lv.pos[&id]),
        "'{}' (step {}) in place over '{}', which is used until step {:?}",
        t.name,
        lv.pos[&id],
        s.name,
        lv.hold.get(&src)
    );
    let reads = t.src.iter().filter(|&&x| base_of(g, x) == src).count();
    ensure!(
        reads == 1,
        "'{}' in place over '{}', which it reads {reads} times",
        t.name,
        s.name
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Random graphs.
// ---------------------------------------------------------------------------------------

/// One step of the random graph builder: an op code and three numbers that pick the
/// operands and parameters.
#[derive(Clone, Debug)]
struct Instr {
    op: u8,
    a: u32,
    b: u32,
    c: u32,
}

fn instr() -> impl Strategy<Value = Instr> {
    (0u8..18, any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(op, a, b, c)| Instr {
        op,
        a,
        b,
        c,
    })
}

/// Tensors made so far that later ops may use (all F32).
struct Pool(Vec<TensorId>);

impl Pool {
    /// Half the time one of the four most recent tensors (long chains), else any.
    fn pick(&self, x: u32) -> TensorId {
        let n = self.0.len();
        let k = (x >> 1) as usize;
        if x & 1 == 0 {
            self.0[n - 1 - k % n.min(4)]
        } else {
            self.0[k % n]
        }
    }
}

impl Rig {
    fn random_shape(&mut self) -> [usize; 4] {
        [
            self.rng.random_range(1..=8),
            self.rng.random_range(1..=4),
            self.rng.random_range(1..=3),
            self.rng.random_range(1..=2),
        ]
    }

    /// A shape each of whose dims divides `ne`'s (for broadcasting).
    fn divisor_shape(&mut self, ne: [usize; 4]) -> [usize; 4] {
        ne.map(|n| if self.rng.random_bool(0.5) { n } else { 1 })
    }

    /// Keeps values in a range where f32 stays accurate and values stay away from zero:
    /// a large result is normalized, a tiny one gets a fresh input added.
    fn tame(&mut self, id: TensorId) -> TensorId {
        let max = self.vals[&id].iter().fold(0f64, |m, x| m.max(x.abs()));
        if max > 16.0 {
            self.rms_norm(id, 1e-5)
        } else if max < 0.05 {
            let ne = self.ne(id);
            let y = self.input(&ne);
            self.binary(id, y, false)
        } else {
            id
        }
    }

    /// Runs one instruction, returning the tensor it adds to the pool.
    fn step(&mut self, pool: &Pool, i: &Instr) -> TensorId {
        let a = pool.pick(i.a);
        let na = self.ne(a);
        let c = i.c as usize;
        match i.op {
            0 => {
                let s = self.random_shape();
                self.input(&s)
            }
            1 => {
                let s = self.random_shape();
                self.external(&s, c.is_multiple_of(3))
            }
            2 | 3 => self.step_binary(pool, a, i),
            4..=7 => self.step_unary(a, i.op, c),
            8 => {
                let mask = (c % 2 == 1).then(|| {
                    let m1 = if c % 4 == 1 { na[1] } else { 1 };
                    self.input(&[na[0], m1])
                });
                self.soft_max(a, mask, [1.0, 0.5, 0.125][c % 3])
            }
            9 if na[0] >= 2 => {
                let pos = self.ids(&[na[2]], 16);
                let n_dims = 2 * (1 + c % (na[0] / 2));
                let mode = if c.is_multiple_of(2) {
                    RopeMode::Normal
                } else {
                    RopeMode::Neox
                };
                self.rope(a, pos, n_dims, mode)
            }
            9 => self.unary(a, Unary::Op(UnaryOp::Silu)),
            10 | 11 => self.step_mul_mat(pool, a, i),
            12 => self.cont(a),
            13 => self.get_rows(a, 1 + c % 4),
            14..=16 => self.step_view(a, i.op, c),
            _ => self.cpy_to_state(a),
        }
    }

    /// Instructions 2 and 3: `a` plus or times a fresh input or a pool tensor whose shape
    /// broadcasts to `a`'s (3: the op in place).
    fn step_binary(&mut self, pool: &Pool, a: TensorId, i: &Instr) -> TensorId {
        let na = self.ne(a);
        let b = if i.c.is_multiple_of(3) {
            let s = self.divisor_shape(na);
            self.input(&s)
        } else {
            let cands: Vec<TensorId> = pool
                .0
                .iter()
                .copied()
                .filter(|&b| (0..4).all(|k| na[k].is_multiple_of(self.ne(b)[k])))
                .collect();
            cands[i.b as usize % cands.len()]
        };
        let r = self.binary(a, b, i.op == 3);
        self.tame(r)
    }

    /// Instructions 4 to 7: scale, SiLU, GELU (SiLU where GELU's tanh form would lose
    /// precision) and the norms.
    fn step_unary(&mut self, a: TensorId, op: u8, c: usize) -> TensorId {
        let r = match op {
            4 => self.unary(a, Unary::Scale([0.5, -1.25, 2.0, 0.75][c % 4])),
            5 => self.unary(a, Unary::Op(UnaryOp::Silu)),
            6 => {
                // GELU's tanh form loses f32 precision below about -4 (1 + tanh cancels).
                let min = self.vals[&a].iter().fold(0f64, |m, &x| m.min(x));
                let op = if min < -4.0 {
                    Unary::Op(UnaryOp::Silu)
                } else {
                    Unary::Op(UnaryOp::Gelu)
                };
                self.unary(a, op)
            }
            _ => {
                let eps = [1e-5, 1e-6][c % 2];
                // norm is ill-conditioned on nearly constant rows: f32 and f64 round the
                // tiny deviations differently and the division magnifies them.
                let ne0 = self.ne(a)[0];
                let spread = self.vals[&a].chunks_exact(ne0).fold(f64::MAX, |m, row| {
                    let lo = row.iter().copied().fold(f64::MAX, f64::min);
                    let hi = row.iter().copied().fold(f64::MIN, f64::max);
                    m.min(hi - lo)
                });
                if c.is_multiple_of(3) && ne0 > 1 && spread > 0.1 {
                    self.norm(a, eps)
                } else {
                    self.rms_norm(a, eps)
                }
            }
        };
        self.tame(r)
    }

    /// Instructions 10 and 11: `w^T a` with `w` [k, m, w2 | x2, w3 | x3] from the pool or
    /// fresh (10: an external buffer, 11: an input), `a` [k, n, x2, x3] -> [m, n, x2, x3].
    fn step_mul_mat(&mut self, pool: &Pool, a: TensorId, i: &Instr) -> TensorId {
        let na = self.ne(a);
        let c = i.c as usize;
        let cands: Vec<TensorId> = pool
            .0
            .iter()
            .copied()
            .filter(|&w| {
                let nw = self.ne(w);
                nw[0] == na[0] && na[2].is_multiple_of(nw[2]) && na[3].is_multiple_of(nw[3])
            })
            .collect();
        let w = if c.is_multiple_of(3) {
            let m = self.rng.random_range(1..=5);
            let w2 = if c.is_multiple_of(2) { na[2] } else { 1 };
            if i.op == 10 {
                self.external(&[na[0], m, w2], false)
            } else {
                self.input(&[na[0], m, w2])
            }
        } else {
            cands[i.b as usize % cands.len()]
        };
        let r = self.mul_mat(w, a);
        self.tame(r)
    }

    /// Instructions 14 to 16: a strided window of `a` with its own strides; a reshape, a
    /// 1-D view or a transpose; a random permutation.
    fn step_view(&mut self, a: TensorId, op: u8, c: usize) -> TensorId {
        let t = self.g.tensor(a).clone();
        match op {
            14 => {
                let ne = t.ne.map(|n| self.rng.random_range(1..=n));
                let offs: usize = (0..4)
                    .map(|k| self.rng.random_range(0..=t.ne[k] - ne[k]) * t.nb[k])
                    .sum();
                self.view(a, ne, t.nb, offs)
            }
            15 if t.is_contiguous() && c.is_multiple_of(2) => {
                self.reshape(a, &[t.ne[0] * t.ne[1], t.ne[2] * t.ne[3]])
            }
            15 if t.is_contiguous() => {
                let n = self.rng.random_range(1..=t.nelements());
                let start = self.rng.random_range(0..=t.nelements() - n);
                self.view_1d(a, n, start * 4)
            }
            15 => self.transpose(a),
            _ => {
                let mut axes = [0, 1, 2, 3];
                for k in (1..4).rev() {
                    axes.swap(k, self.rng.random_range(0..=k));
                }
                self.permute(a, axes)
            }
        }
    }
}

/// Builds a random graph; returns the rig and the outputs to pass to `plan`. Every
/// tensor left without a consumer is either an output or ordered before the last tensor
/// with `after`, so the whole graph runs. `outs` picks extra outputs: mode 0 passes it
/// to `plan`, 1 only flags it with `set_output`, 2 does both.
fn random_graph(seed: u64, instrs: &[Instr], outs: &[(u32, u8)]) -> (Rig, Vec<TensorId>) {
    let mut rig = Rig::new(seed);
    let first = rig.random_shape();
    let mut pool = Pool(vec![rig.input(&first)]);
    for i in instrs {
        let t = rig.step(&pool, i);
        pool.0.push(t);
    }
    let consumed: HashSet<TensorId> = rig
        .g
        .iter()
        .flat_map(|(_, t)| t.src.iter().copied())
        .collect();
    let last = *pool.0.last().unwrap();
    let mut listed = Vec::new();
    let mut deps = Vec::new();
    for &t in &pool.0 {
        if t != last && !consumed.contains(&t) && !listed.contains(&t) && !deps.contains(&t) {
            if rig.rng.random_bool(0.5) {
                listed.push(t);
            } else {
                deps.push(t);
            }
        }
    }
    let last = if deps.is_empty() {
        last
    } else {
        let id = rig.g.after(last, &deps).unwrap();
        rig.viewed(id)
    };
    let mut outputs = vec![last];
    outputs.extend(listed);
    for &(o, mode) in outs {
        let t = pool.0[o as usize % pool.0.len()];
        if mode != 0 {
            rig.g.set_output(t).unwrap();
        }
        if mode != 1 {
            outputs.push(t);
        }
    }
    (rig, outputs)
}

/// Plans `outputs` with `guard` bytes, checks the plan and runs it against the evaluator;
/// a failure message carries the text dump of the plan.
fn plan_check_run(rig: &mut Rig, outputs: &[TensorId], guard: usize) -> Result<Plan, String> {
    let plan = rig
        .g
        .plan_with(outputs, &PlanOptions { guard_bytes: guard })
        .map_err(|e| e.to_string())?;
    check_plan(&rig.g, &plan, guard)
        .and_then(|()| rig.run_and_compare(&plan))
        .map_err(|m| {
            format!(
                "guard {guard}: {m}\n{}",
                graft::graph::dump::text(&rig.g, &plan)
            )
        })?;
    Ok(plan)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_graphs_are_planned_safely_and_compute_correctly(
        seed in any::<u64>(),
        instrs in prop::collection::vec(instr(), 1..60),
        outs in prop::collection::vec((any::<u32>(), 0u8..3), 0..4),
    ) {
        let (mut rig, outputs) = random_graph(seed, &instrs, &outs);
        let plain = plan_check_run(&mut rig, &outputs, 0).map_err(TestCaseError::fail)?;
        let guarded = plan_check_run(&mut rig, &outputs, 256).map_err(TestCaseError::fail)?;
        // Guards change where blocks go, never which node runs in place.
        prop_assert_eq!(plain.alloc.report.n_inplace, guarded.alloc.report.n_inplace);
    }
}

// ---------------------------------------------------------------------------------------
// Deterministic cases.
// ---------------------------------------------------------------------------------------

fn kind(plan: &Plan, id: TensorId) -> AllocKind {
    plan.alloc.info[id].kind
}

fn offset(plan: &Plan, id: TensorId) -> usize {
    plan.alloc.info[id].offset
}

#[test]
fn best_fit_reuses_the_small_free_block() {
    let mut g = Graph::new();
    let xs = g.input("xs", DType::F32, &[64]).unwrap(); // 256 B
    let xb = g.input("xb", DType::F32, &[1024]).unwrap(); // 4096 B
    let big = g.cont(xb).unwrap(); // lower address
    let sep = g.cont(xs).unwrap(); // an output: keeps big's and small's blocks apart
    let small = g.cont(xs).unwrap(); // higher address
    let keep = g.cont(xs).unwrap(); // separates `small` from the end of the arena
    let all = g.after(xs, &[big, sep, small, keep]).unwrap(); // allocates them in a row
    let r1 = g.mul_mat(big, xb).unwrap(); // [1, 1]; then frees big
    let r2 = g.mul_mat(small, xs).unwrap(); // [1, 1]: reuses big's block; then frees small
    let t = g.cont(keep).unwrap(); // 256 B: the freed 256 B block fits exactly
    let plan = g.plan(&[all, sep, r1, r2, t]).unwrap();
    check_plan(&g, &plan, 0).unwrap();
    assert!(offset(&plan, big) < offset(&plan, small));
    assert_eq!(
        offset(&plan, r2),
        offset(&plan, big),
        "a freed block is reused"
    );
    assert_eq!(
        offset(&plan, t),
        offset(&plan, small),
        "best fit takes the exact 256 B block, not the start of the larger free block"
    );
    assert_eq!(
        plan.arena_bytes,
        offset(&plan, r1) + ALIGN,
        "the arena did not grow for t"
    );
}

/// Three adjacent blocks freed so that the last release merges with both neighbours;
/// then a tensor of their total size fits where the first one was.
#[test]
fn adjacent_free_blocks_merge() {
    for order in [[0, 1, 2], [2, 1, 0]] {
        let mut g = Graph::new();
        let xs = g.input("xs", DType::F32, &[64]).unwrap(); // 256 B
        let y = g.input("y", DType::F32, &[64, 128]).unwrap();
        let xb = g.input("xb", DType::F32, &[192]).unwrap(); // 768 B
        let keep = g.cont(xs).unwrap();
        let abc = [
            g.cont(xs).unwrap(),
            g.cont(xs).unwrap(),
            g.cont(xs).unwrap(),
        ];
        let all = g.after(xs, &abc).unwrap(); // a, b, c allocated in a row
        let [a, b, c] = order.map(|k| abc[k]);
        let r1 = g.mul_mat(a, c).unwrap(); // frees the two outer blocks
        let r2 = g.mul_mat(b, y).unwrap(); // 512 B, fits neither; then frees the middle
        let t = g.cont(xb).unwrap(); // 768 B: fits only in the merged block
        let plan = g.plan(&[keep, all, r1, r2, t]).unwrap();
        check_plan(&g, &plan, 0).unwrap();
        let offs = abc.map(|x| offset(&plan, x));
        assert_eq!(offs[1], offs[0] + ALIGN);
        assert_eq!(offs[2], offs[1] + ALIGN);
        assert_eq!(
            offset(&plan, t),
            offs[0],
            "merged block reused (order {order:?})"
        );
        assert_eq!(plan.arena_bytes, offset(&plan, r2) + 2 * ALIGN);
    }
}

#[test]
fn elementwise_chain_runs_in_place() {
    let mut r = Rig::new(7);
    let x = r.input(&[8, 2, 3]); // [d, heads, tokens]
    let bias = r.input(&[8]);
    let pos = r.ids(&[3], 32);
    let a = r.cont(x);
    let b = r.unary(a, Unary::Op(UnaryOp::Silu));
    let c = r.unary(b, Unary::Scale(1.5));
    let d = r.unary(c, Unary::Op(UnaryOp::Gelu));
    let e = r.binary(d, bias, false);
    let f = r.binary(e, x, true);
    let h = r.rms_norm(f, 1e-5);
    let k = r.rope(h, pos, 8, RopeMode::Neox);
    let s = r.soft_max(k, None, 0.5);
    let chain = [a, b, c, d, e, f, h, k, s];
    let plan = plan_check_run(&mut r, &[s], 0).unwrap();
    for w in chain.windows(2) {
        assert_eq!(kind(&plan, w[1]), AllocKind::InPlace(w[0]));
        assert_eq!(offset(&plan, w[1]), offset(&plan, a));
    }
    assert_eq!(plan.alloc.report.n_inplace, chain.len() - 1);
    assert_eq!(
        plan.alloc.report.n_blocks, 4,
        "x, bias, pos and one block for the chain"
    );
    assert!(plan.steps.iter().filter(|s| s.inplace).count() == chain.len() - 1);
}

#[test]
fn no_in_place_while_the_source_has_another_consumer() {
    let mut r = Rig::new(8);
    let x = r.input(&[16, 4]);
    let a = r.cont(x);
    let b = r.unary(a, Unary::Op(UnaryOp::Silu)); // a is still read by c: own block
    let c = r.unary(a, Unary::Scale(2.0)); // the last reader of a may take it over
    let out = r.binary(b, c, false);
    let plan = plan_check_run(&mut r, &[out], 0).unwrap();
    assert_eq!(kind(&plan, b), AllocKind::Arena);
    assert_ne!(offset(&plan, b), offset(&plan, a));
    assert_eq!(kind(&plan, c), AllocKind::InPlace(a));
    assert_eq!(kind(&plan, out), AllocKind::InPlace(b));

    // A node reading its source twice never overwrites it.
    let sq = r.binary(out, out, true);
    let plan = plan_check_run(&mut r, &[sq], 0).unwrap();
    assert_eq!(kind(&plan, sq), AllocKind::Arena);
}

#[test]
fn no_in_place_while_the_source_has_a_live_view() {
    let mut r = Rig::new(9);
    let x = r.input(&[16, 4]);
    let a = r.cont(x);
    let nb1 = r.g.tensor(a).nb[1];
    let v = r.view(a, [8, 4, 1, 1], [4, nb1, nb1 * 4, nb1 * 4], 16); // columns 4..12
    let b = r.unary(a, Unary::Op(UnaryOp::Silu));
    let out = r.binary(b, v, false); // v read after b
    let plan = plan_check_run(&mut r, &[out], 0).unwrap();
    assert_eq!(kind(&plan, v), AllocKind::View(a));
    assert_eq!(offset(&plan, v), offset(&plan, a) + 16);
    assert_eq!(kind(&plan, b), AllocKind::Arena);
    assert_eq!(kind(&plan, out), AllocKind::InPlace(b));

    // The view comes first in the order, so `a` has no other direct consumer left when
    // `b` runs: only the live view protects it.
    let mut r = Rig::new(13);
    let x = r.input(&[8, 8]);
    let a = r.cont(x);
    let v = r.transpose(a);
    let b = r.unary(a, Unary::Op(UnaryOp::Silu));
    let out = r.binary(v, b, false); // reads the view after b
    let plan = plan_check_run(&mut r, &[out], 0).unwrap();
    let at = |id| plan.forward.order.iter().position(|&i| i == id).unwrap();
    assert!(at(v) < at(b));
    assert_eq!(kind(&plan, b), AllocKind::Arena);

    // Once every reader of the view is done, the source may be taken over.
    let mut r = Rig::new(10);
    let x = r.input(&[16, 4]);
    let a = r.cont(x);
    let t = r.transpose(a);
    let w = r.cont(t); // the view's only reader, before b
    let b = r.unary(a, Unary::Op(UnaryOp::Gelu));
    let wt = r.transpose(w);
    let out = r.binary(b, wt, false);
    let plan = plan_check_run(&mut r, &[w, out], 0).unwrap();
    let at = |id| plan.forward.order.iter().position(|&i| i == id).unwrap();
    assert!(at(w) < at(b));
    assert_eq!(kind(&plan, b), AllocKind::InPlace(a));
}

#[test]
fn no_in_place_over_inputs_outputs_weights_or_state() {
    let mut r = Rig::new(11);
    let x = r.input(&[8, 3]);
    let w = r.external(&[8, 3], false);
    let s = r.external(&[8, 3], true);
    let a = r.cont(x);
    r.g.set_output(a).unwrap();
    let ux = r.unary(x, Unary::Op(UnaryOp::Silu));
    let uw = r.unary(w, Unary::Op(UnaryOp::Silu));
    let us = r.unary(s, Unary::Op(UnaryOp::Silu));
    let ua = r.unary(a, Unary::Op(UnaryOp::Silu));
    let b = r.cont(x);
    let ub = r.unary(b, Unary::Op(UnaryOp::Gelu)); // b is a listed output
    let sum = r.binary(ux, uw, false);
    let sum = r.binary(sum, us, false);
    let sum = r.binary(sum, ua, false);
    let sum = r.binary(sum, ub, false);
    let plan = plan_check_run(&mut r, &[sum, b], 0).unwrap();
    for u in [ux, uw, us, ua, ub] {
        assert_eq!(kind(&plan, u), AllocKind::Arena);
    }
    for e in [w, s] {
        assert_eq!(kind(&plan, e), AllocKind::External);
    }
}

#[test]
fn views_of_weights_and_state_stay_in_their_buffers() {
    let mut r = Rig::new(12);
    let w = r.external(&[6, 4], false);
    let wt = r.transpose(w);
    let x = r.input(&[4, 5]);
    let y = r.mul_mat(wt, x); // [6, 5]
    let st = r.cpy_to_state(y); // [30], a view of a state buffer
    let st2 = r.reshape(st, &[6, 5]);
    let out = r.binary(st2, y, true);
    let plan = plan_check_run(&mut r, &[out, st2], 256).unwrap();
    for v in [wt, st, st2] {
        assert!(matches!(kind(&plan, v), AllocKind::View(_)));
    }
    let step = plan.steps.iter().find(|s| s.dst.id == out).unwrap();
    assert!(matches!(step.src[0].loc, Loc::Buffer(..)));
    assert!(plan
        .outputs
        .iter()
        .any(|io| matches!(io.operand.loc, Loc::Buffer(..))));
}
