//! Backends run [`Plan`]s. A backend owns persistent buffers (weights, KV caches), loads
//! a plan into an executable with its own arena, and runs it: inputs are written into
//! fixed places before a run and outputs read after it.
//!
//! - [`cpu::CpuBackend`]: the reference implementation of every op on any strides.
//! - `cuda::CudaBackend` (feature `cuda`): kernels from `cuda/*.cu`, cuBLAS, and the whole
//!   plan captured into one CUDA graph that later runs replay.
//! - [`group::DeviceGroup`]: N backends run as one for tensor parallelism (each member
//!   runs the same plan on its share of the weights; `all_reduce` joins them).
//! - [`fusion`]: the plan pass that groups consecutive steps into fused steps, which the
//!   CUDA backend lowers to one launch each (it needs no backend to run).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod frozen;
pub mod fusion;
pub mod group;

use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Io, Loc, Plan, Step, TensorId};

/// A plan loaded into a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ExecId(pub usize);

/// Counters a backend keeps about its runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Runs executed op by op.
    pub eager_runs: u64,
    /// CUDA graphs captured (0 on the CPU).
    pub captures: u64,
    /// Runs served by replaying a captured graph.
    pub replays: u64,
}

/// A read of a plan output started by [`Backend::begin_read`]: the bytes already read,
/// or the backend's ticket for a copy still under way. [`Backend::finish_read`] takes it.
#[derive(Debug)]
pub struct PendingRead(pub(crate) Pending);

/// What a [`PendingRead`] holds.
#[derive(Debug)]
pub(crate) enum Pending {
    /// Read at once (backends that run synchronously).
    Done(Vec<u8>),
    /// Copy number `ticket` into the backend's host slot `slot`, of `len` bytes.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Slot {
        slot: usize,
        ticket: u64,
        len: usize,
    },
}

/// The time one step of a plan took in a profiled run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTime {
    /// The node's name.
    pub name: String,
    /// The node's op.
    pub op: &'static str,
    /// What ran for it (kernel names on CUDA; the op on the CPU).
    pub kernels: String,
    /// Microseconds.
    pub us: f64,
}

/// A table of a profile: one row per (op, kernels) with the count of steps, their total
/// time and share, largest first, then the total.
pub fn profile_table(rows: &[StepTime]) -> String {
    let mut groups: Vec<(String, &'static str, usize, f64)> = Vec::new();
    for r in rows {
        match groups.iter_mut().find(|g| g.0 == r.kernels && g.1 == r.op) {
            Some(g) => {
                g.2 += 1;
                g.3 += r.us;
            }
            None => groups.push((r.kernels.clone(), r.op, 1, r.us)),
        }
    }
    groups.sort_by(|a, b| b.3.total_cmp(&a.3));
    let total: f64 = rows.iter().map(|r| r.us).sum();
    let mut out = String::from("| op | kernels | steps | total us | us/step | share |\n| --- | --- | ---: | ---: | ---: | ---: |\n");
    for (kernels, op, n, us) in &groups {
        out.push_str(&format!(
            "| {op} | {kernels} | {n} | {us:.1} | {:.2} | {:.1}% |\n",
            us / *n as f64,
            100.0 * us / total.max(f64::MIN_POSITIVE)
        ));
    }
    out.push_str(&format!(
        "| all | | {} | {total:.1} | | 100% |\n",
        rows.len()
    ));
    out
}

/// A weight tensor handed to [`Backend::freeze_weights`]: dense rows of `row_len`
/// elements of `dtype` at byte `offset` of the buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrozenTensor {
    /// The tensor's name, for messages (`blk.0.attn_qkv.weight`).
    pub name: String,
    /// Byte offset in the buffer.
    pub offset: usize,
    /// The dtype.
    pub dtype: DType,
    /// Elements of a row.
    pub row_len: usize,
    /// Rows.
    pub rows: usize,
}

/// What every backend offers.
pub trait Backend {
    /// A short name ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// A new zero-filled persistent buffer of `bytes` bytes.
    fn alloc_buffer(&mut self, bytes: usize) -> Result<BufferId>;

    /// Releases a buffer. Plans that use it must not run afterwards.
    fn free_buffer(&mut self, buf: BufferId) -> Result<()>;

    /// Bytes this backend can still allocate where it has a memory of its own (a GPU),
    /// `None` where buffers come from the host's memory.
    fn free_memory(&mut self) -> Result<Option<usize>>;

    /// Copies `data` into `buf` at byte `offset`.
    fn write_buffer(&mut self, buf: BufferId, offset: usize, data: &[u8]) -> Result<()>;

    /// Waits for everything enqueued so far (a no-op where runs are synchronous); a failure
    /// of an asynchronous run surfaces here.
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    /// Devices this backend drives: 1, or the size of a
    /// [`DeviceGroup`](group::DeviceGroup), whose members each hold a copy of every buffer.
    fn devices(&self) -> usize {
        1
    }

    /// Copies `data` into `buf` at byte `offset` on device `device` only (a device
    /// group's member gets its own share of the weights); device 0 is the only device of
    /// a single-device backend.
    fn write_buffer_on(
        &mut self,
        device: usize,
        buf: BufferId,
        offset: usize,
        data: &[u8],
    ) -> Result<()> {
        match device {
            0 => self.write_buffer(buf, offset, data),
            _ => Err(Error::plan(format!(
                "{}: device {device} of a single-device backend",
                self.name()
            ))),
        }
    }

    /// Declares `tensors` of `buf` frozen weights: nothing writes them again, and plans
    /// read them only as the weights (`src[0]`) of mul_mat. A backend may then keep them
    /// in a layout of its own; the CUDA backend stores Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q5_K
    /// tensors whose rows are a whole number of 16 bytes, and Q6_K tensors of rows of at
    /// least 2,048 elements, in split rows ([`crate::quant::split`]) for its decode
    /// products; the CPU backend, where the CPU has AVX-512 VNNI, Q4_0 and IQ4_NL tensors
    /// of a whole number of groups of eight rows in rows of eight ([`crate::quant::rows8`]).
    /// Reading a frozen tensor back still gives ggml's bytes; writing it, or
    /// loading a plan that reads it any other way, is an error that names it. By default
    /// nothing changes.
    fn freeze_weights(&mut self, buf: BufferId, tensors: &[FrozenTensor]) -> Result<()> {
        let _ = (buf, tensors);
        Ok(())
    }

    /// Copies `len` bytes of `buf` from byte `src` to byte `dst` (the ranges must not
    /// overlap), after the runs enqueued so far and before later ones; on every device of
    /// a group, each within its own copy of the buffer. By default through the host.
    fn copy_within(&mut self, buf: BufferId, src: usize, dst: usize, len: usize) -> Result<()> {
        if src.max(dst) - src.min(dst) < len {
            return Err(crate::Error::plan(format!(
                "copy_within: {len} bytes from {src} to {dst} overlap"
            )));
        }
        let mut tmp = vec![0u8; len];
        self.read_buffer(buf, src, &mut tmp)?;
        self.write_buffer(buf, dst, &tmp)
    }

    /// Copies bytes of `buf` from `offset` into `out`.
    fn read_buffer(&mut self, buf: BufferId, offset: usize, out: &mut [u8]) -> Result<()>;

    /// Fills `n` elements of `dtype` at `offset` of `buf` with seeded pseudo-random values,
    /// uniform in `[-scale, scale)` (benchmark weights made on the device).
    fn fill_random(
        &mut self,
        buf: BufferId,
        offset: usize,
        dtype: DType,
        n: usize,
        seed: u64,
        scale: f32,
    ) -> Result<()>;

    /// Whether this backend can run `step`, and why not.
    fn supports(&self, step: &Step) -> std::result::Result<(), String>;

    /// Loads a plan: checks every step is supported and every buffer reference is in
    /// bounds, and allocates the plan's arena.
    fn load(&mut self, plan: &Plan) -> Result<ExecId>;

    /// Releases a loaded plan and its arena.
    fn unload(&mut self, exec: ExecId) -> Result<()>;

    /// Writes an input of a loaded plan (the bytes of the whole contiguous tensor).
    fn set_input(&mut self, exec: ExecId, id: TensorId, data: &[u8]) -> Result<()>;

    /// Runs a loaded plan.
    fn compute(&mut self, exec: ExecId) -> Result<()>;

    /// Reads an output of a loaded plan after a run.
    fn get_output(&mut self, exec: ExecId, id: TensorId, out: &mut [u8]) -> Result<()>;

    /// Copies `bytes` of output `src` of plan `from` into input `dst` of plan `to` after
    /// the runs enqueued so far, without the host waiting for them (a token the device
    /// picked feeds the next step). By default through the host.
    fn forward_output(
        &mut self,
        from: ExecId,
        src: TensorId,
        to: ExecId,
        dst: TensorId,
        bytes: usize,
    ) -> Result<()> {
        let mut data = vec![0u8; bytes];
        self.get_output(from, src, &mut data)?;
        self.set_input(to, dst, &data)
    }

    /// Starts reading `bytes` of an output of a loaded plan after the runs enqueued so
    /// far; [`Backend::finish_read`] waits for it. The host may enqueue more runs in
    /// between (the output itself must not be overwritten before the read: a later run
    /// of the same plan is enqueued after it, so it is not). By default the read is done
    /// at once.
    fn begin_read(&mut self, exec: ExecId, id: TensorId, bytes: usize) -> Result<PendingRead> {
        let mut data = vec![0u8; bytes];
        self.get_output(exec, id, &mut data)?;
        Ok(PendingRead(Pending::Done(data)))
    }

    /// The bytes of a read that [`Backend::begin_read`] started, once they are on the
    /// host; an error a run before the read recorded (a bad index) surfaces here.
    fn finish_read(&mut self, read: PendingRead) -> Result<Vec<u8>> {
        match read.0 {
            Pending::Done(data) => Ok(data),
            Pending::Slot { .. } => Err(Error::plan(
                "a pending read was finished on a backend that did not start it",
            )),
        }
    }

    /// Run counters.
    fn stats(&self) -> Stats;

    /// Fills a loaded plan's whole arena with `byte` (to poison it before a test run).
    fn fill_arena(&mut self, exec: ExecId, byte: u8) -> Result<()>;

    /// A copy of a loaded plan's whole arena (to check sentinels after a test run).
    fn read_arena(&mut self, exec: ExecId) -> Result<Vec<u8>>;

    /// Turns step profiling on or off. While on, every run times each of its steps
    /// (eagerly: a capturing backend neither captures nor replays) and keeps the times
    /// for [`Backend::take_profile`].
    fn set_profiling(&mut self, on: bool);

    /// The step times of the profiled runs since the last call, in execution order.
    fn take_profile(&mut self) -> Vec<StepTime>;
}

/// Typed conveniences over [`Backend`].
pub trait BackendExt: Backend {
    /// Writes an F32 input.
    fn set_input_f32(&mut self, exec: ExecId, id: TensorId, data: &[f32]) -> Result<()> {
        self.set_input(exec, id, bytemuck::cast_slice(data))
    }

    /// Writes an I32 input.
    fn set_input_i32(&mut self, exec: ExecId, id: TensorId, data: &[i32]) -> Result<()> {
        self.set_input(exec, id, bytemuck::cast_slice(data))
    }

    /// Reads an F32 output of `n` elements.
    fn get_output_f32(&mut self, exec: ExecId, id: TensorId, n: usize) -> Result<Vec<f32>> {
        let mut v = vec![0f32; n];
        self.get_output(exec, id, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }

    /// Reads an I32 output of `n` elements.
    fn get_output_i32(&mut self, exec: ExecId, id: TensorId, n: usize) -> Result<Vec<i32>> {
        let mut v = vec![0i32; n];
        self.get_output(exec, id, bytemuck::cast_slice_mut(&mut v))?;
        Ok(v)
    }
}

impl<B: Backend + ?Sized> BackendExt for B {}

/// Checks, for any backend, that every step is supported and every buffer reference of
/// the plan lies inside its buffer (`buffer_size` answers `None` for unknown buffers).
pub(crate) fn validate_plan(
    backend: &dyn Backend,
    plan: &Plan,
    buffer_size: impl Fn(BufferId) -> Option<usize>,
) -> Result<()> {
    for step in &plan.steps {
        backend
            .supports(step)
            .map_err(|reason| Error::Unsupported {
                backend: backend.name(),
                node: step.name.clone(),
                op: step.op.name(),
                reason,
            })?;
    }
    // Weight and state leaves first, by name: every other buffer operand is a view
    // inside one of them.
    for io in &plan.externals {
        if let Loc::Buffer(buf, off) = io.operand.loc {
            let size = buffer_size(buf).ok_or_else(|| {
                Error::plan(format!(
                    "{}: buffer {:?} of '{}' does not belong to this backend",
                    backend.name(),
                    buf,
                    io.name
                ))
            })?;
            let need = io.operand.nbytes();
            if off.checked_add(need).is_none_or(|end| end > size) {
                return Err(Error::plan(format!(
                    "{}: '{}' ({} {}) needs {} bytes at offset {} of buffer {:?}, which has {}",
                    backend.name(),
                    io.name,
                    io.operand.dtype,
                    crate::graph::fmt_ne(&io.operand.ne),
                    need,
                    off,
                    buf,
                    size
                )));
            }
        }
    }
    let operands = plan
        .steps
        .iter()
        .flat_map(|s| std::iter::once(&s.dst).chain(s.src.iter()));
    for op in operands {
        if let Loc::Buffer(buf, off) = op.loc {
            let size = buffer_size(buf).ok_or_else(|| {
                Error::plan(format!(
                    "{}: buffer {:?} used by a tensor of the plan does not belong to this backend",
                    backend.name(),
                    buf
                ))
            })?;
            if off + op.nbytes() > size {
                return Err(Error::plan(format!(
                    "{}: tensor {:?} needs bytes {}..{} of buffer {:?}, which has {}",
                    backend.name(),
                    op.id,
                    off,
                    off + op.nbytes(),
                    buf,
                    size
                )));
            }
        }
    }
    Ok(())
}

/// Checks that `len` bytes at `offset` lie inside buffer `buf` of `size` bytes.
pub(crate) fn range_check(
    backend: &str,
    what: &str,
    buf: BufferId,
    offset: usize,
    len: usize,
    size: usize,
) -> Result<()> {
    if offset.checked_add(len).is_none_or(|end| end > size) {
        return Err(Error::plan(format!(
            "{backend}: {what} of {len} bytes at offset {offset} is outside buffer {buf:?} of {size} bytes"
        )));
    }
    Ok(())
}

/// Checks that `len` bytes fit input or output `id` (looked up in `list`), returning
/// where the tensor lives.
pub(crate) fn io_slot(list: &[Io], id: TensorId, len: usize, what: &str) -> Result<Loc> {
    let io = list
        .iter()
        .find(|io| io.operand.id == id)
        .ok_or_else(|| Error::plan(format!("tensor {id:?} is not an {what} of this plan")))?;
    if !io.operand.is_contiguous() {
        return Err(Error::plan(format!(
            "{what} '{}' is not contiguous; make it contiguous with cont() before reading it",
            io.name
        )));
    }
    let need = io.operand.nbytes();
    if len != need {
        return Err(Error::plan(format!(
            "{what} '{}' ({} {}) has {} bytes, got {}",
            io.name,
            io.operand.dtype,
            crate::graph::fmt_ne(&io.operand.ne),
            need,
            len
        )));
    }
    Ok(io.operand.loc)
}
