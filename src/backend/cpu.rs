//! The CPU reference backend: every op on any strides, f32 accumulation, F16/BF16
//! through `half`. mul_mat runs on all cores (rayon); everything else is plain loops.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod frozen;

use super::{io_slot, range_check, validate_plan, Backend, ExecId, FrozenTensor, Stats, StepTime};
use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Loc, Plan, Step, TensorId};
use crate::ops::collective::LocalGroup;
use crate::ops::host::{store, HostTensor};
use crate::ops::mul_mat::{QuantDot, WeightLayout};
use crate::ops::{self, CopyOp, Op};

/// A pointer that may cross to another thread (the arena's base, handed to the rayon
/// thread that runs a plan while the backend is borrowed for the call).
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

// SAFETY: the pointer is only used while `compute` holds the backend mutably, and the
// thread it is sent to is done with it before `compute` returns.
unsafe impl Send for SendPtr {}

/// A loaded plan with its arena.
struct CpuExec {
    plan: Plan,
    /// The arena, as u64 words so every 8-byte-aligned offset is aligned for any dtype.
    arena: Vec<u64>,
    /// Inputs written at least once.
    written: HashSet<TensorId>,
    /// How each step's mul_mat weights are laid out (rows of eight when frozen so).
    layouts: Vec<WeightLayout>,
}

/// The CPU backend.
#[derive(Default)]
pub struct CpuBackend {
    buffers: HashMap<BufferId, Vec<u64>>,
    sizes: HashMap<BufferId, usize>,
    execs: Vec<Option<CpuExec>>,
    stats: Stats,
    /// Step times of profiled runs (`Some` while profiling is on).
    profile: Option<Vec<StepTime>>,
    /// How block-typed weights are multiplied.
    quant: QuantDot,
    /// The group this backend is a member of, and its rank there (tensor parallelism on
    /// simulated devices).
    group: Option<(Arc<LocalGroup>, usize)>,
    /// Frozen weights kept in rows of eight.
    frozen: Vec<frozen::Rows8>,
}

/// A zeroed allocation of at least `bytes` bytes, or an error naming the size.
fn words(bytes: usize) -> Result<Vec<u64>> {
    let n = bytes.div_ceil(8);
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| Error::Backend {
        backend: "cpu",
        msg: format!("out of host memory allocating {bytes} bytes"),
    })?;
    v.resize(n, 0);
    Ok(v)
}

fn as_bytes_mut(v: &mut [u64]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

impl CpuBackend {
    /// A CPU backend using rayon's global thread pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Member `rank` of `group`: its `all_reduce` steps meet the other members'.
    /// Runs execute on the calling thread (not on rayon's pool, whose few threads the
    /// waiting members would otherwise hold).
    pub fn in_group(group: Arc<LocalGroup>, rank: usize) -> Self {
        CpuBackend {
            group: Some((group, rank)),
            ..Self::default()
        }
    }

    /// Picks how block-typed weights are multiplied (default [`QuantDot::Q8_1`]).
    pub fn set_quant_dot(&mut self, quant: QuantDot) {
        self.quant = quant;
    }

    fn buffer_mut(&mut self, buf: BufferId) -> Result<(&mut [u8], usize)> {
        let size = self.size(buf)?;
        let v = self.buffers.get_mut(&buf).expect("sizes and buffers agree");
        Ok((&mut as_bytes_mut(v)[..size], size))
    }

    /// The bytes of `buf`, read-only.
    fn buffer(&self, buf: BufferId) -> Result<&[u8]> {
        let size = self.size(buf)?;
        let v = self.buffers.get(&buf).expect("sizes and buffers agree");
        Ok(&bytemuck::cast_slice::<u64, u8>(v)[..size])
    }

    /// The size of `buf`, or an error naming an unknown buffer.
    fn size(&self, buf: BufferId) -> Result<usize> {
        self.sizes
            .get(&buf)
            .copied()
            .ok_or_else(|| Error::plan(format!("cpu: unknown buffer {buf:?}")))
    }

    fn exec(&self, exec: ExecId) -> Result<&CpuExec> {
        self.execs
            .get(exec.0)
            .and_then(|e| e.as_ref())
            .ok_or_else(|| Error::plan(format!("cpu: no loaded plan {exec:?}")))
    }

    fn exec_mut(&mut self, exec: ExecId) -> Result<&mut CpuExec> {
        self.execs
            .get_mut(exec.0)
            .and_then(|e| e.as_mut())
            .ok_or_else(|| Error::plan(format!("cpu: no loaded plan {exec:?}")))
    }
}

/// SplitMix64, the generator behind [`Backend::fill_random`] on every backend.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `i`-th value of the seeded uniform stream in `[-scale, scale)`.
pub fn random_uniform(seed: u64, i: u64, scale: f32) -> f32 {
    let bits = splitmix64(seed ^ splitmix64(i)) >> 40; // 24 random bits
    (bits as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn free_memory(&mut self) -> Result<Option<usize>> {
        Ok(None)
    }

    fn alloc_buffer(&mut self, bytes: usize) -> Result<BufferId> {
        let id = BufferId::fresh();
        self.buffers.insert(id, words(bytes)?);
        self.sizes.insert(id, bytes);
        Ok(id)
    }

    fn free_buffer(&mut self, buf: BufferId) -> Result<()> {
        self.sizes
            .remove(&buf)
            .ok_or_else(|| Error::plan(format!("cpu: unknown buffer {buf:?}")))?;
        self.buffers.remove(&buf);
        self.frozen.retain(|r| r.buffer != buf);
        Ok(())
    }

    fn write_buffer(&mut self, buf: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        super::frozen::check_write("cpu", &self.frozen, (buf, offset, data.len()), "write")?;
        let (mem, size) = self.buffer_mut(buf)?;
        range_check("cpu", "write", buf, offset, data.len(), size)?;
        mem[offset..offset + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read_buffer(&mut self, buf: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        let mem = self.buffer(buf)?;
        range_check("cpu", "read", buf, offset, out.len(), mem.len())?;
        frozen::read_joined(&self.frozen, (buf, mem), offset, out);
        Ok(())
    }

    fn freeze_weights(&mut self, buf: BufferId, tensors: &[FrozenTensor]) -> Result<()> {
        // (taken out for the call: the buffer's bytes borrow the backend)
        let mut regions = std::mem::take(&mut self.frozen);
        let done = self
            .buffer_mut(buf)
            .and_then(|(mem, _)| frozen::freeze((buf, mem), tensors, &mut regions));
        self.frozen = regions;
        done
    }

    fn fill_random(
        &mut self,
        buf: BufferId,
        offset: usize,
        dtype: DType,
        n: usize,
        seed: u64,
        scale: f32,
    ) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::plan(format!(
                "cpu: fill_random needs a float dtype, got {dtype}"
            )));
        }
        let es = dtype.block_bytes();
        super::frozen::check_write("cpu", &self.frozen, (buf, offset, n * es), "fill_random")?;
        let (mem, size) = self.buffer_mut(buf)?;
        range_check("cpu", "fill", buf, offset, n * es, size)?;
        for i in 0..n {
            let v = random_uniform(seed, i as u64, scale);
            // SAFETY: offset + (i + 1) * es <= size was checked above.
            unsafe { store(mem.as_mut_ptr().add(offset + i * es), dtype, v) };
        }
        Ok(())
    }

    fn supports(&self, step: &Step) -> std::result::Result<(), String> {
        // The reference backend runs every op on any layout the builders accept.
        let _ = step;
        Ok(())
    }

    fn load(&mut self, plan: &Plan) -> Result<ExecId> {
        validate_plan(self, plan, |b| self.sizes.get(&b).copied())?;
        super::frozen::check_plan("cpu", &self.frozen, plan)?;
        let layouts = plan
            .steps
            .iter()
            .map(|step| match step.op == Op::MulMat {
                true => match super::frozen::weights_in(&self.frozen, &step.src[0]) {
                    Ok(true) => Ok(WeightLayout::Rows8),
                    Ok(false) => Ok(WeightLayout::Ggml),
                    Err(reason) => Err(Error::Unsupported {
                        backend: "cpu",
                        node: step.name.clone(),
                        op: step.op.name(),
                        reason,
                    }),
                },
                false => Ok(WeightLayout::Ggml),
            })
            .collect::<Result<Vec<_>>>()?;
        let exec = CpuExec {
            plan: plan.clone(),
            arena: words(plan.arena_bytes)?,
            written: HashSet::new(),
            layouts,
        };
        let slot = self.execs.iter().position(|e| e.is_none());
        Ok(ExecId(match slot {
            Some(i) => {
                self.execs[i] = Some(exec);
                i
            }
            None => {
                self.execs.push(Some(exec));
                self.execs.len() - 1
            }
        }))
    }

    fn unload(&mut self, exec: ExecId) -> Result<()> {
        self.exec(exec)?;
        self.execs[exec.0] = None;
        Ok(())
    }

    fn set_input(&mut self, exec: ExecId, id: TensorId, data: &[u8]) -> Result<()> {
        let e = self.exec_mut(exec)?;
        let Loc::Arena(off) = io_slot(&e.plan.inputs, id, data.len(), "input")? else {
            unreachable!("inputs live in the arena")
        };
        as_bytes_mut(&mut e.arena)[off..off + data.len()].copy_from_slice(data);
        e.written.insert(id);
        Ok(())
    }

    fn compute(&mut self, exec: ExecId) -> Result<()> {
        let quant = self.quant;
        let e = self
            .execs
            .get_mut(exec.0)
            .and_then(|e| e.as_mut())
            .ok_or_else(|| Error::plan(format!("cpu: no loaded plan {exec:?}")))?;
        if let Some(io) = e
            .plan
            .inputs
            .iter()
            .find(|io| !e.written.contains(&io.operand.id))
        {
            return Err(Error::plan(format!(
                "input '{}' was never written before the first run",
                io.name
            )));
        }
        let arena = SendPtr(as_bytes_mut(&mut e.arena).as_mut_ptr());
        let run = Run {
            arena,
            buffers: &mut self.buffers,
            profile: &mut self.profile,
            quant,
            group: self.group.as_ref().map(|(g, r)| (&**g, *r)),
        };
        let steps = (&e.plan.steps[..], &e.layouts[..]);
        match run.group {
            // A member of a group runs on its own thread (see `in_group`).
            Some(_) => run.steps(steps)?,
            // The whole plan runs on a thread of rayon's pool, so that each op's parallel
            // loop shares its work with the pool's other threads directly instead of
            // waking them and putting the calling thread to sleep, op after op; the
            // pool's other threads stay awake for the run (`keep_awake`).
            None => {
                let done = AtomicBool::new(false);
                let done = &done;
                rayon::scope(|s| {
                    let plan_thread = rayon::current_thread_index();
                    for _ in 1..rayon::current_num_threads() {
                        s.spawn(move |_| keep_awake(done, plan_thread));
                    }
                    let ran = run.steps(steps);
                    done.store(true, Ordering::Release);
                    ran
                })?
            }
        }
        self.stats.eager_runs += 1;
        Ok(())
    }

    fn get_output(&mut self, exec: ExecId, id: TensorId, out: &mut [u8]) -> Result<()> {
        let e = self.exec(exec)?;
        match io_slot(&e.plan.outputs, id, out.len(), "output")? {
            Loc::Arena(off) => {
                out.copy_from_slice(
                    &bytemuck::cast_slice::<u64, u8>(&e.arena)[off..off + out.len()],
                );
                Ok(())
            }
            Loc::Buffer(b, off) => self.read_buffer(b, off, out),
        }
    }

    fn stats(&self) -> Stats {
        self.stats
    }

    fn fill_arena(&mut self, exec: ExecId, byte: u8) -> Result<()> {
        let e = self.exec_mut(exec)?;
        let n = e.plan.arena_bytes;
        as_bytes_mut(&mut e.arena)[..n].fill(byte);
        Ok(())
    }

    fn read_arena(&mut self, exec: ExecId) -> Result<Vec<u8>> {
        let e = self.exec(exec)?;
        Ok(bytemuck::cast_slice::<u64, u8>(&e.arena)[..e.plan.arena_bytes].to_vec())
    }

    fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(|| self.profile.take().unwrap_or_default());
    }

    fn take_profile(&mut self) -> Vec<StepTime> {
        self.profile
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }
}

/// A pool thread's loop while a plan runs on another (`plan_thread`): it takes each
/// piece of parallel work the plan's ops queue as soon as it is there (`rayon::yield_now`)
/// and spins in between, until `done`. Left alone, the thread would fall asleep in the
/// serial ops between two products and be woken for each, which cost a decode step of
/// SmolLM2 on 2 cores more than its attention. On the plan's own thread (where it can land
/// when that thread waits for work it queued) it returns at once.
fn keep_awake(done: &AtomicBool, plan_thread: Option<usize>) {
    if rayon::current_thread_index() == plan_thread {
        return;
    }
    while !done.load(Ordering::Acquire) {
        if rayon::yield_now() != Some(rayon::Yield::Executed) {
            std::hint::spin_loop();
        }
    }
}

/// One run of a plan's steps over its arena and the backend's buffers.
struct Run<'a> {
    arena: SendPtr,
    buffers: &'a mut HashMap<BufferId, Vec<u64>>,
    profile: &'a mut Option<Vec<StepTime>>,
    quant: QuantDot,
    group: Option<(&'a LocalGroup, usize)>,
}

impl Run<'_> {
    fn steps(self, (steps, layouts): (&[Step], &[WeightLayout])) -> Result<()> {
        let Run {
            arena,
            buffers,
            profile,
            quant,
            group,
        } = self;
        let mut ptr = |loc: Loc| -> *mut u8 {
            match loc {
                // SAFETY: load() checked that every arena offset lies inside the arena.
                Loc::Arena(off) => unsafe { arena.0.add(off) },
                Loc::Buffer(b, off) => {
                    let v = buffers.get_mut(&b).expect("validated at load");
                    // SAFETY: load() checked the extent against the buffer's size.
                    unsafe { as_bytes_mut(v).as_mut_ptr().add(off) }
                }
            }
        };
        let mut src: Vec<HostTensor> = Vec::with_capacity(4);
        for (step, &layout) in steps.iter().zip(layouts) {
            let dst = HostTensor::new(ptr(step.dst.loc), &step.dst);
            src.clear();
            src.extend(step.src.iter().map(|s| HostTensor::new(ptr(s.loc), s)));
            let start = std::time::Instant::now();
            run_step(step, dst, &src, (quant, layout), group)?;
            if let Some(p) = profile.as_mut() {
                p.push(StepTime {
                    name: step.name.clone(),
                    op: step.op.name(),
                    kernels: step.op.name().to_string(),
                    us: start.elapsed().as_secs_f64() * 1e6,
                });
            }
        }
        Ok(())
    }
}

/// Runs one step with the CPU reference kernels; `quant` picks how block-typed weights
/// are multiplied and `layout` how a mul_mat's are laid out; `group` is the device group
/// (and rank) of a tensor-parallel member.
pub fn run_step(
    step: &Step,
    dst: HostTensor,
    src: &[HostTensor],
    (quant, layout): (QuantDot, WeightLayout),
    group: Option<(&LocalGroup, usize)>,
) -> Result<()> {
    match step.op {
        Op::Leaf | Op::View(_) => Ok(()),
        Op::GetRows => ops::get_rows::cpu(step, dst, src),
        Op::Unary(op) => ops::unary::cpu(op, dst, src),
        Op::Scale { s } => ops::unary::cpu_scale(s, dst, src),
        Op::Binary(op) => ops::binary::cpu(op, dst, src),
        Op::Norm(op) => ops::norm::cpu(op, dst, src),
        Op::MulMat => ops::mul_mat::cpu(dst, src, quant, layout),
        Op::MulMatId => ops::mul_mat_id::cpu(step, dst, src, quant),
        Op::Rope(ref p) => ops::rope::cpu(p, dst, src),
        Op::Copy(CopyOp::Cpy | CopyOp::Cont) => ops::cpy::cpu_copy(dst, src),
        Op::Copy(CopyOp::SetRows) => ops::cpy::cpu_set_rows(step, dst, src),
        Op::Mask(op) => ops::softmax::cpu(op, dst, src),
        Op::Argmax => ops::argmax::cpu(dst, src),
        Op::TopK { k } => ops::topk::cpu(k, dst, src),
        Op::FlashAttnExt(ref p) => ops::attention::cpu(p, dst, src),
        Op::PagedAttn(ref p) => ops::attention::paged::cpu(step, p, dst, src),
        Op::AllReduce(p) => ops::collective::cpu(p, dst, src, group),
    }
}
