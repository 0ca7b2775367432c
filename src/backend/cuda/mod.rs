//! The CUDA backend (feature `cuda`): kernels from `cuda/*.cu` (compiled by build.rs and
//! embedded), cuBLAS for GEMMs, and each loaded plan captured into one CUDA graph that
//! later runs replay.
//!
//! - One context and one stream; cudarc's event tracking is off, so nothing but the
//!   backend's own work is enqueued (and stream capture sees only that).
//! - Persistent buffers are one device allocation each; a loaded plan is one allocation
//!   (arena, constants, scratch, see [`exec`]). Addresses never move, so every launch is
//!   decided once, at [`Backend::load`] ([`lower`]: one lowering file per op family, on
//!   the machinery of [`lowering`]), and a run is a loop of launches, or one graph launch.
//! - Runs: the first [`Backend::compute`] of a plan captures its launches into a CUDA
//!   graph and launches it; later runs replay it. Inputs are copied into their fixed
//!   arena places by [`Backend::set_input`] before the launch, in stream order.
//!   A loaded plan never changes, so its graph stays valid: other shapes or another
//!   topology (a longer prompt, a different batch) are another plan, loaded and
//!   captured anew; what changes between runs of one plan is only data (inputs, state).
//!   `GRAFT_CUDA_GRAPHS=0` (or [`CudaBackend::set_graphs`]) runs eagerly every time; a
//!   capture that fails falls back to eager runs for that plan with a warning
//!   ([`CudaBackend::warnings`]). `GRAFT_CUDA_SYNC=1` synchronizes after every node so that
//!   an asynchronous kernel fault names its node (graphs off). Decode products with
//!   block-quantized weights run the Q8_1 `__dp4a` kernels, except small ones whose
//!   activations have no Q8_1 copy yet, which dequantize in registers (one launch
//!   instead of two); [`CudaBackend::set_mmvq`] puts every one on the first or the second
//!   kind (tests and `graft bench-ops` measure both). The environment switches are listed
//!   in docs/cli.md ("Environment variables").
//! - get_rows and set_rows never touch memory outside their tables: a bad id is recorded
//!   in a small device record, and the next synchronizing call ([`Backend::get_output`],
//!   [`Backend::read_buffer`], [`Backend::read_arena`]) or finished read
//!   ([`Backend::finish_read`]) returns [`Error::IndexOutOfRange`] and clears it.
//! - Reads can finish later ([`reads`]): [`Backend::begin_read`] copies an output into a
//!   page-locked slot behind the runs enqueued so far and [`Backend::finish_read`] waits
//!   for that copy alone, while [`Backend::forward_output`] copies an output into another
//!   plan's input on the device; greedy decoding uses both to stay a step ahead. Inputs
//!   are written through a ring of page-locked slots ([`writes`]), so that writing the
//!   next step's inputs never waits for the step before.

mod args;
pub mod bench;
mod decode;
mod device;
mod exec;
mod gemm;
pub mod kernels;
#[cfg(test)]
mod launch_lists;
mod lower;
mod lowering;
pub mod nccl;
mod pinned;
mod reads;
mod split;
#[cfg(test)]
mod tests;
mod writes;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use self::args::{CpyArgs, FillRandomArgs, IndexError, Tensor4};
pub(crate) use self::device::DeviceMem;
use self::device::{driver_error, driver_error_text, Blas};
use self::exec::{decode_tag, error_tag, CudaExec, GraphState, Launcher};
use self::kernels::by;
use self::kernels::{KernelId, KernelTable};
pub use self::lower::mmq::{f16_from_cols, MMH_FROM_COLS, MMQ_FROM_COLS, MMQ_MAX_COLS};
use self::lower::{fused, lower_step};
pub use self::lowering::QuantPath;
use self::lowering::{flat_grid, DevOp, Lowering, REGION_ALIGN};
use self::reads::Reads;
use self::split::SplitRows;
use self::writes::{Writes, MAX_STAGED};
use super::fusion;
use super::{
    io_slot, range_check, validate_plan, Backend, ExecId, FrozenTensor, Pending, PendingRead,
    Stats, StepTime,
};
use crate::error::{Error, Result};
use crate::graph::{BufferId, DType, Loc, Plan, Step, TensorId};
use crate::quant::split::has_split_rows;

/// Most bytes of rows [`Backend::freeze_weights`] copies aside at a time to split them.
const SPLIT_CHUNK: usize = 64 << 20;

/// The CUDA backend.
pub struct CudaBackend {
    // Field order is drop order: plans and buffers go before the handles and modules
    // they use, the stream and context last.
    execs: Vec<Option<CudaExec>>,
    buffers: HashMap<BufferId, DeviceMem>,
    blas: Blas,
    kernels: KernelTable,
    index_err: DeviceMem,
    /// A run of a plan with index checks was enqueued since the record was last read.
    index_check_pending: bool,
    stats: Stats,
    graphs: bool,
    sync_each: bool,
    /// Whether load fuses consecutive steps ([`fusion`]); `GRAFT_CUDA_FUSE=0` turns it off.
    fusion: bool,
    /// Whether plan kernels launch with programmatic dependent launch (sm_90 and later;
    /// `GRAFT_CUDA_PDL=0` turns it off). Profiled runs never use it.
    pdl: bool,
    /// Whether decode products with block-quantized weights quantize the activations to
    /// Q8_1 and use `__dp4a` (`mul_mat_vec_q_*`, default) or dequantize the weights in
    /// registers (`mul_mat_vec_dq_*`; [`CudaBackend::set_mmvq`]).
    mmvq: bool,
    /// Whether small decode products without a Q8_1 copy at hand dequantize in registers
    /// anyway (the default; off once the path is set by [`CudaBackend::set_mmvq`]).
    small_dq: bool,
    /// How products of block-quantized weights by more than a few columns run
    /// ([`QuantPath::Auto`] but in the op benchmark and tests, which compare the paths).
    quant_path: QuantPath,
    /// Whether products of the 32-element block types on F16 tensor cores unpack the
    /// weights in registers (`mmr_*`, the default) or into shared memory (`mmh_*`;
    /// `GRAFT_CUDA_MMR=0`, [`CudaBackend::set_mmr`]).
    mmr: bool,
    /// Streaming multiprocessors of the GPU: the lowering sizes the grids that must fit
    /// it at once (the decode attention's split, one-wave decode products) for them.
    sms: usize,
    /// Whether [`Backend::freeze_weights`] stores Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q5_K and Q6_K
    /// weights in split rows (see [`split`]; `GRAFT_CUDA_SPLIT=0` turns it off).
    split_rows: bool,
    /// The frozen tensors stored in split rows.
    split: Vec<SplitRows>,
    /// Kernel-name prefixes whose launches plans leave out (`GRAFT_CUDA_SKIP`, a
    /// diagnostic: results are wrong; see [`CudaBackend::set_skip`]).
    skip: Vec<String>,
    /// Reads under way ([`Backend::begin_read`]).
    reads: Reads,
    /// The staging ring of input writes ([`Backend::set_input`]).
    writes: Writes,
    /// Step times of profiled runs (`Some` while profiling is on).
    profile: Option<Vec<StepTime>>,
    warnings: Vec<String>,
    /// The device group this GPU is a member of (`--tp`), with its NCCL communicator.
    group: Option<nccl::Member>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the raw CUDA handles inside (functions, cuBLAS handle, graphs) are not tied to a
// thread: every entry point binds the backend's context to the calling thread first, and
// `&mut self` methods keep calls serialized.
unsafe impl Send for CudaBackend {}

/// A failed wait for enqueued work: a kernel faulted asynchronously.
fn run_failed(e: result::DriverError) -> Error {
    Error::Backend {
        backend: "cuda",
        msg: format!(
            "the GPU failed while running enqueued work: {}; the context is unusable now \
             (rerun with GRAFT_CUDA_SYNC=1 to name the node)",
            driver_error_text(e)
        ),
    }
}

fn no_device(what: &str, e: result::DriverError) -> Error {
    Error::NoDevice(format!("{what}: {}", driver_error_text(e)))
}

/// A boolean environment switch: unset is None; "0", "false", "off" and "no" are false.
fn env_flag(name: &str) -> Option<bool> {
    std::env::var(name).ok().map(|v| {
        let v = v.trim().to_ascii_lowercase();
        !matches!(v.as_str(), "0" | "false" | "off" | "no")
    })
}

/// The CUDA version the driver supports, as 1000 * major + 10 * minor.
fn driver_version() -> std::result::Result<i32, result::DriverError> {
    let mut v = 0;
    // SAFETY: writes one int; needs no initialized driver.
    unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
    Ok(v)
}

/// The oldest driver API the bindings use (CUDA 13.0, driver 580).
const MIN_DRIVER: i32 = 13000;

/// Fails with [`Error::NoDevice`], naming what is missing, unless the driver library, a
/// CUDA 13 driver, GPU `ordinal` and cuBLAS are all present.
fn check_device(ordinal: usize) -> Result<()> {
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::NoDevice(
            "the NVIDIA driver library (libcuda.so.1) was not found: no GPU driver on this machine"
                .into(),
        ));
    }
    let version = driver_version().map_err(|e| no_device("cuDriverGetVersion", e))?;
    if version < MIN_DRIVER {
        return Err(Error::NoDevice(format!(
            "the NVIDIA driver supports CUDA {}.{}; graft needs a CUDA {}.{} driver (580 or newer)",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER / 1000,
            MIN_DRIVER % 1000 / 10
        )));
    }
    let count = CudaContext::device_count().map_err(|e| no_device("cuInit", e))?;
    if ordinal >= count.max(0) as usize {
        return Err(Error::NoDevice(format!(
            "GPU {ordinal} asked for, {count} present"
        )));
    }
    // SAFETY: only tries to open the shared library.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(Error::NoDevice(
            "cuBLAS (libcublas.so.13, libcublasLt.so.13) was not found; where the CUDA \
             toolkit has it, run with LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

impl CudaBackend {
    /// Opens GPU `ordinal`. Fails with [`Error::NoDevice`] when there is no driver, no
    /// such GPU, or no cuBLAS library.
    pub fn new(ordinal: usize) -> Result<Self> {
        check_device(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| no_device("creating a context", e))?;
        // SAFETY: all work goes to the one stream below, so no slice needs events to
        // order streams; events recorded by cudarc would also break stream capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating a stream", e))?;
        let kernels = KernelTable::load(&ctx)?;
        let blas = Blas::new(&ctx, &stream)?;
        let (cc_major, _) = ctx
            .compute_capability()
            .map_err(|e| driver_error("reading the compute capability", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("cuDeviceGetAttribute(multiprocessors)", e))?;
        let index_err = DeviceMem::alloc(
            &ctx,
            std::mem::size_of::<IndexError>(),
            "the index-error record",
        )?;
        let mut be = CudaBackend {
            execs: Vec::new(),
            buffers: HashMap::new(),
            blas,
            kernels,
            index_err,
            index_check_pending: false,
            stats: Stats::default(),
            graphs: env_flag("GRAFT_CUDA_GRAPHS").unwrap_or(true),
            sync_each: env_flag("GRAFT_CUDA_SYNC").unwrap_or(false),
            fusion: env_flag("GRAFT_CUDA_FUSE") != Some(false),
            pdl: cc_major >= 9 && env_flag("GRAFT_CUDA_PDL") != Some(false),
            mmvq: true,
            small_dq: true,
            quant_path: QuantPath::Auto,
            mmr: env_flag("GRAFT_CUDA_MMR") != Some(false),
            sms: usize::try_from(sms).unwrap_or(0).max(1),
            split_rows: env_flag("GRAFT_CUDA_SPLIT") != Some(false),
            split: Vec::new(),
            skip: Vec::new(),
            reads: Reads::new(),
            writes: Writes::new(),
            profile: None,
            warnings: Vec::new(),
            group: None,
            stream,
            ctx,
        };
        be.memset(be.index_err.ptr(), 0, be.index_err.bytes())?;
        be.wait()?;
        if let Ok(list) = std::env::var("GRAFT_CUDA_SKIP") {
            be.set_skip(list.split(',').map(str::to_string).collect());
        }
        Ok(be)
    }

    /// Opens GPU `ordinal` for a test or a tool that can do without one: `Ok(None)` (after
    /// writing "skipped: no GPU" and the reason to stderr) when there is no usable device, unless
    /// `GRAFT_REQUIRE_GPU=1`, which turns that into the [`Error::NoDevice`] error.
    pub fn new_or_skip(ordinal: usize) -> Result<Option<Self>> {
        match Self::new(ordinal) {
            Ok(be) => Ok(Some(be)),
            Err(Error::NoDevice(msg)) if env_flag("GRAFT_REQUIRE_GPU") != Some(true) => {
                // Written to stderr directly rather than with eprintln!, which the test
                // harness captures: a skip must show in a plain `cargo test`.
                use std::io::Write as _;
                let _ = writeln!(std::io::stderr(), "skipped: no GPU ({msg})");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Turns programmatic dependent launch on or off (default on for sm_90 and later unless
    /// `GRAFT_CUDA_PDL=0`); it has no effect on older GPUs. Takes effect for plans captured
    /// or run eagerly from now on.
    pub fn set_pdl(&mut self, on: bool) {
        self.pdl = on
            && self
                .ctx
                .compute_capability()
                .is_ok_and(|(major, _)| major >= 9);
    }

    /// Picks the decode path of products with block-quantized weights for plans loaded
    /// from now on: `Some(true)` quantizes the activations to Q8_1 and runs the `__dp4a`
    /// kernels `mul_mat_vec_q_*` for every product, `Some(false)` dequantizes the weights
    /// in registers (`mul_mat_vec_dq_*`) for every product, `None` (the default) takes the
    /// first except for small products whose activations have no Q8_1 copy yet.
    pub fn set_mmvq(&mut self, path: Option<bool>) {
        self.mmvq = path != Some(false);
        self.small_dq = path.is_none();
    }

    /// Puts the products of block-quantized weights of plans loaded from now on on `path`
    /// (default [`QuantPath::Auto`]): for the op benchmark, which times every path at the
    /// same widths, and for tests of one path at any width.
    pub fn set_quant_path(&mut self, path: QuantPath) {
        self.quant_path = path;
    }

    /// Whether products of the 32-element block types on F16 tensor cores in plans loaded
    /// from now on unpack the weights in registers (`mmr_*`, default on unless
    /// `GRAFT_CUDA_MMR=0`) or into shared memory (`mmh_*`, as the K-quants do).
    pub fn set_mmr(&mut self, on: bool) {
        self.mmr = on;
    }

    /// Leaves every kernel whose name starts with one of `prefixes` out of the plans loaded
    /// from now on (empty prefixes are ignored; `GRAFT_CUDA_SKIP=a,b` sets them when the
    /// backend opens). A diagnostic for timing only: what the rest of a replayed graph
    /// costs without those kernels, which a profile of kernels run one at a time cannot
    /// show. Their outputs are never written, so every result after them is wrong; a
    /// warning says so.
    pub fn set_skip(&mut self, prefixes: Vec<String>) {
        self.skip = prefixes.into_iter().filter(|p| !p.is_empty()).collect();
        if !self.skip.is_empty() {
            self.warn(format!(
                "kernels starting with {} are skipped (GRAFT_CUDA_SKIP): results are wrong, \
                 for timing only",
                self.skip.join(", ")
            ));
        }
    }

    /// Whether [`Backend::freeze_weights`] from now on stores Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    /// Q5_K and Q6_K weights in split rows (default on unless `GRAFT_CUDA_SPLIT=0`; tensors frozen
    /// already stay as they are).
    pub fn set_split(&mut self, on: bool) {
        self.split_rows = on;
    }

    /// Turns kernel fusion ([`crate::backend::fusion`]: norm and weight, SwiGLU, GEMV and
    /// residual add, rope and cache writes, the folded decode norm, Q8_1 copies made by the
    /// step before a quantized product) on or off for plans loaded from now on (default on
    /// unless `GRAFT_CUDA_FUSE=0`).
    pub fn set_fusion(&mut self, on: bool) {
        self.fusion = on;
    }

    /// Turns CUDA-graph capture and replay on or off (default on unless
    /// `GRAFT_CUDA_GRAPHS=0`). Off, every run launches each node.
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
    }

    /// Whether runs capture and replay CUDA graphs.
    pub fn graphs(&self) -> bool {
        self.graphs && !self.sync_each
    }

    /// Warnings so far (plans whose capture failed and that run eagerly).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The GPU's name and compute capability.
    pub fn device_name(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        match self.ctx.compute_capability() {
            Ok((a, b)) => format!("{name} (sm_{a}{b})"),
            Err(_) => name,
        }
    }

    /// Registers and local (spill) bytes per thread of a kernel.
    pub fn kernel_resources(&self, k: KernelId) -> Result<(i32, i32)> {
        use sys::CUfunction_attribute_enum as A;
        Ok((
            self.kernels.attribute(k, A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            self.kernels
                .attribute(k, A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
        ))
    }

    /// Blocks of `threads` threads of `k` that one SM holds at once, launched with the
    /// reservation of [`DevOp::at_most_per_sm`]`(per_sm)` (0: none).
    pub fn blocks_per_sm(&self, k: KernelId, threads: u32, per_sm: u32) -> Result<u32> {
        self.bind()?;
        let mut n = 0;
        let smem = self.kernels.smem_cap(k, per_sm);
        // SAFETY: the handle belongs to the loaded kernel table; writes one int.
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                self.kernels.func(k),
                threads as i32,
                smem as usize,
            )
        }
        .result()
        .map_err(|e| driver_error("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
        Ok(n as u32)
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the CUDA context", e))
    }

    fn launcher(&self) -> Launcher<'_> {
        Launcher {
            kernels: &self.kernels,
            blas: &self.blas,
            stream: &self.stream,
            sync_each: self.sync_each,
            pdl: self.pdl && self.profile.is_none(),
            group: self.group.as_ref(),
        }
    }

    /// GPUs in this backend's device group (1 outside a group).
    fn group_size(&self) -> usize {
        self.group.as_ref().map_or(1, |m| m.group.size())
    }

    /// The backend's CUDA context (a device group's communicators keep it alive).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes this backend rank `member.rank` of an NCCL device group: its `all_reduce`
    /// steps over the group's size become NCCL all-reduces on its stream.
    pub(crate) fn join(&mut self, member: nccl::Member) {
        self.group = Some(member);
    }

    /// Device memory for [`CudaBackend::warm_up_group`]: one zeroed F32.
    pub(crate) fn warm_up_value(&mut self) -> Result<DeviceMem> {
        self.bind()?;
        let mem = DeviceMem::alloc(&self.ctx, 4, "the group's warm-up value")?;
        self.memset(mem.ptr(), 0, 4)?;
        Ok(mem)
    }

    /// One all-reduce of the single value in `mem` over the group, outside any capture,
    /// waited for: a group that cannot sum fails when it is made, not inside a plan's
    /// first run. Every member calls it at the same time, each on its own thread.
    pub(crate) fn warm_up_group(&mut self, mem: &DeviceMem) -> Result<()> {
        self.bind()?;
        if let Some(m) = &self.group {
            m.group
                .all_reduce_sum(m.rank, (mem.ptr(), mem.ptr(), 1), &self.stream)
                .map_err(|msg| Error::Backend {
                    backend: "cuda",
                    msg: format!("the device group's first all-reduce: {msg}"),
                })?;
        }
        self.synchronize_checked()
    }

    fn memset(&self, ptr: u64, byte: u8, bytes: usize) -> Result<()> {
        // SAFETY: callers pass a range inside memory owned by this backend.
        unsafe { result::memset_d8_async(ptr, byte, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver_error("cuMemsetD8Async", e))
    }

    fn htod(&self, ptr: u64, data: &[u8]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        // SAFETY: callers pass a device range of data.len() bytes owned by this backend.
        // From pageable memory the driver stages `data` before returning, so the slice
        // may be dropped afterwards.
        unsafe { result::memcpy_htod_async(ptr, data, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying to the device", e))
    }

    /// Copies device bytes to `out` after everything enqueued so far.
    fn dtoh(&mut self, ptr: u64, out: &mut [u8]) -> Result<()> {
        self.wait()?;
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: callers pass a device range of out.len() bytes owned by this backend.
        unsafe { result::memcpy_dtoh_async(out, ptr, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying from the device", e))?;
        self.stream
            .synchronize()
            .map_err(|e| driver_error("copying from the device", e))
    }

    /// Waits for the stream; an asynchronous kernel fault surfaces here. (Not named
    /// `synchronize`: on `&mut self` that name resolves to [`Backend::synchronize`], which
    /// calls back into this.)
    fn wait(&self) -> Result<()> {
        self.stream.synchronize().map_err(run_failed)
    }

    /// Waits for the stream, then reports (and clears) a bad index recorded by a run.
    fn synchronize_checked(&mut self) -> Result<()> {
        self.wait()?;
        if !self.index_check_pending {
            return Ok(());
        }
        self.index_check_pending = false;
        let rec = self.read_index_record()?;
        self.report_index_error(rec)
    }

    /// Reports a bad index in the record `rec` read from the device (and clears the
    /// record); Ok when it holds none.
    fn report_index_error(&mut self, rec: IndexError) -> Result<()> {
        if rec.flag == 0 {
            return Ok(());
        }
        self.index_check_pending = false;
        self.memset(self.index_err.ptr(), 0, self.index_err.bytes())?;
        let (exec, step) = decode_tag(rec.tag);
        let step = self
            .execs
            .get(exec)
            .and_then(|e| e.as_ref())
            .and_then(|e| e.plan.steps.get(step));
        Err(Error::IndexOutOfRange {
            op: step.map_or("get_rows/set_rows/mul_mat_id/paged_attn", |s| s.op.name()),
            node: step.map_or_else(|| "(an unloaded plan)".into(), |s| s.name.clone()),
            index: rec.index,
            position: rec.position as usize,
            limit: rec.limit as usize,
        })
    }

    /// Drops a bad index recorded by plan `exec` (which is being unloaded, so that its
    /// slot's next plan is not blamed for it); one of another plan stays pending.
    fn discard_index_error_of(&mut self, exec: usize) -> Result<()> {
        if !self.index_check_pending {
            return Ok(());
        }
        let rec = self.read_index_record()?;
        if rec.flag != 0 && decode_tag(rec.tag).0 == exec {
            self.memset(self.index_err.ptr(), 0, self.index_err.bytes())?;
            self.index_check_pending = false;
        }
        Ok(())
    }

    /// The index-error record, read after everything enqueued so far.
    fn read_index_record(&self) -> Result<IndexError> {
        let mut rec = IndexError::default();
        // SAFETY: the record is a live allocation of exactly this size.
        unsafe {
            result::memcpy_dtoh_async(
                rec.bytes_mut(),
                self.index_err.ptr(),
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| driver_error("reading the index-error record", e))?;
        self.wait()?;
        Ok(rec)
    }

    /// The device address of output `id` (`bytes` long) of plan `exec`, checked.
    fn output_ptr(&self, exec: ExecId, id: TensorId, bytes: usize) -> Result<u64> {
        let e = self.exec(exec)?;
        let loc = io_slot(&e.plan.outputs, id, bytes, "output")?;
        if let Loc::Buffer(b, _) = loc {
            self.buffer(b)?;
        }
        Ok(self.resolve(e.arena(), loc))
    }

    fn exec(&self, exec: ExecId) -> Result<&CudaExec> {
        self.execs
            .get(exec.0)
            .and_then(|e| e.as_ref())
            .ok_or_else(|| Error::plan(format!("cuda: no loaded plan {exec:?}")))
    }

    fn buffer(&self, buf: BufferId) -> Result<&DeviceMem> {
        self.buffers
            .get(&buf)
            .ok_or_else(|| Error::plan(format!("cuda: unknown buffer {buf:?}")))
    }

    /// Device address of a plan location of `exec` (arena base `arena`).
    fn resolve(&self, arena: u64, loc: Loc) -> u64 {
        match loc {
            Loc::Arena(off) => arena + off as u64,
            Loc::Buffer(b, off) => self.buffers.get(&b).map_or(0, |m| m.ptr()) + off as u64,
        }
    }

    /// Lowers every step of `plan` with the given bases; returns the operations, the
    /// constant region and the scratch bytes needed.
    fn lower_plan(
        &self,
        plan: &Plan,
        exec_index: usize,
        arena: u64,
        consts: u64,
        scratch: u64,
    ) -> Result<(Vec<Vec<DevOp>>, Vec<u8>, usize)> {
        let resolve = |loc: Loc| self.resolve(arena, loc);
        let mut lw = Lowering {
            consts_base: consts,
            scratch_base: scratch,
            err: self.index_err.ptr(),
            small_dq: self.small_dq,
            split: &self.split,
            sms: self.sms,
            quant_path: self.quant_path,
            mmr: self.mmr,
            ..Lowering::new(&resolve, self.mmvq, self.group_size())
        };
        let groups = match self.fusion {
            true => fusion::fuse(plan, &fused::target(&lw)),
            false => fusion::unfused(plan),
        };
        let mut steps = fused::lower_plan(plan, &groups, &mut lw, |i| error_tag(exec_index, i))
            .map_err(|(step, reason)| Error::Unsupported {
                backend: "cuda",
                node: step.name.clone(),
                op: step.op.name(),
                reason,
            })?;
        for ops in &mut steps {
            ops.retain(|op| !self.skip.iter().any(|p| op.name().starts_with(p.as_str())));
        }
        Ok((steps, lw.consts, lw.scratch_need))
    }

    /// [`Backend::freeze_weights`] before the regions are coalesced: splits each tensor of
    /// `tensors` in `buf` that can be, and records its region.
    fn split_tensors(&mut self, buf: BufferId, tensors: &[FrozenTensor]) -> Result<()> {
        let (base, size) = {
            let mem = self.buffer(buf)?;
            (mem.ptr(), mem.bytes())
        };
        for t in tensors {
            let Some(q) = t.dtype.quant().filter(|&q| has_split_rows(q)) else {
                continue;
            };
            let bytes = t.dtype.row_bytes(t.row_len) * t.rows;
            range_check("cuda", "freeze", buf, t.offset, bytes, size)?;
            let region = SplitRows::new(&t.name, buf, base, t.offset, q, t.row_len, t.rows);
            let Some(region) = region.filter(|_| self.split_rows) else {
                continue;
            };
            if let Some(r) = self.split.iter().find(|r| r.overlaps(buf, t.offset, bytes)) {
                if r.holds(&region) {
                    continue; // frozen already
                }
                return Err(Error::plan(format!(
                    "cuda: freezing {} (bytes {}..{} of buffer {buf:?}) overlaps the frozen weight {}",
                    t.name,
                    t.offset,
                    t.offset + bytes,
                    r.name
                )));
            }
            self.split_in_place(base, &region)?;
            self.split.push(region);
        }
        Ok(())
    }

    /// Rewrites the rows of `r` (in the buffer at device address `base`) as split rows,
    /// [`SPLIT_CHUNK`] bytes of rows at a time: a copy of them to a temporary allocation,
    /// then `split_rows_<q>` from it back into place.
    fn split_in_place(&mut self, base: u64, r: &SplitRows) -> Result<()> {
        let chunk_rows = (SPLIT_CHUNK / r.row_bytes).clamp(1, r.rows);
        let tmp = DeviceMem::alloc(
            &self.ctx,
            chunk_rows * r.row_bytes,
            "a frozen weight's rows",
        )?;
        let kernel = by::SPLIT_ROWS
            .get([DType::Quant(r.q)])
            .map_err(Error::plan)?;
        let rb = r.row_bytes as i64;
        for first in (0..r.rows).step_by(chunk_rows) {
            let rows = chunk_rows.min(r.rows - first);
            let (at, bytes) = (
                base + (r.offset + first * r.row_bytes) as u64,
                rows * r.row_bytes,
            );
            // SAFETY: both ranges are `bytes` long, inside allocations this backend owns (the
            // region was range-checked against its buffer), and do not overlap.
            unsafe { result::memcpy_dtod_async(tmp.ptr(), at, bytes, self.stream.cu_stream()) }
                .map_err(|e| driver_error("copying a weight being frozen", e))?;
            let t4 = |data: u64| Tensor4 {
                data,
                ne: [r.row_len as i64, rows as i64, 1, 1],
                nb: [
                    r.q.block_bytes() as i64,
                    rb,
                    rb * rows as i64,
                    rb * rows as i64,
                ],
            };
            let blocks = rows * r.row_len / r.q.block_size();
            let args = CpyArgs {
                src: t4(tmp.ptr()),
                dst: t4(at),
                n: blocks as i64,
                mode: 0,
            };
            let (grid, block) = flat_grid(blocks);
            let op = DevOp::kernel(kernel, grid, block, &args);
            self.launcher().launch(&op).map_err(|msg| Error::Backend {
                backend: "cuda",
                msg: format!("freezing {}: {msg}", r.name),
            })?;
        }
        // The temporary copy is freed on return: wait for the kernels that read it.
        self.wait()
    }

    /// Records a warning and prints it once.
    fn warn(&mut self, msg: String) {
        eprintln!("graft cuda: warning: {msg}");
        self.warnings.push(msg);
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Memory is freed below while work may still be queued: wait for it first.
        let _ = self.bind();
        let _ = self.stream.synchronize();
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn free_memory(&mut self) -> Result<Option<usize>> {
        self.bind()?;
        let (free, _total) =
            result::mem_get_info().map_err(|e| driver_error("reading the free memory", e))?;
        Ok(Some(free))
    }

    fn alloc_buffer(&mut self, bytes: usize) -> Result<BufferId> {
        self.bind()?;
        let mem = DeviceMem::alloc(&self.ctx, bytes, "a buffer")?;
        self.memset(mem.ptr(), 0, bytes)?;
        let id = BufferId::fresh();
        self.buffers.insert(id, mem);
        Ok(id)
    }

    fn free_buffer(&mut self, buf: BufferId) -> Result<()> {
        self.bind()?;
        self.buffer(buf)?;
        self.wait()?;
        self.buffers.remove(&buf);
        self.split.retain(|r| r.buffer != buf);
        Ok(())
    }

    fn write_buffer(&mut self, buf: BufferId, offset: usize, data: &[u8]) -> Result<()> {
        self.bind()?;
        let mem = self.buffer(buf)?;
        range_check("cuda", "write", buf, offset, data.len(), mem.bytes())?;
        split::check_write(&self.split, buf, offset, data.len(), "a write")?;
        self.htod(mem.ptr() + offset as u64, data)
    }

    fn copy_within(&mut self, buf: BufferId, src: usize, dst: usize, len: usize) -> Result<()> {
        self.bind()?;
        let mem = self.buffer(buf)?;
        range_check("cuda", "copy from", buf, src, len, mem.bytes())?;
        range_check("cuda", "copy to", buf, dst, len, mem.bytes())?;
        if src.max(dst) - src.min(dst) < len {
            return Err(Error::plan(format!(
                "copy_within: {len} bytes from {src} to {dst} overlap"
            )));
        }
        split::check_write(&self.split, buf, dst, len, "a copy")?;
        if len == 0 {
            return Ok(());
        }
        let base = mem.ptr();
        // SAFETY: both ranges were checked inside the buffer and apart; the copy is
        // enqueued on the backend's stream, in order with its runs.
        unsafe {
            result::memcpy_dtod_async(
                base + dst as u64,
                base + src as u64,
                len,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| driver_error("copying within a buffer", e))
    }

    fn freeze_weights(&mut self, buf: BufferId, tensors: &[FrozenTensor]) -> Result<()> {
        self.bind()?;
        let frozen = self.split_tensors(buf, tensors);
        // Once, for the regions added (even when a later tensor failed).
        split::coalesce(&mut self.split);
        frozen
    }

    fn read_buffer(&mut self, buf: BufferId, offset: usize, out: &mut [u8]) -> Result<()> {
        self.bind()?;
        let mem = self.buffer(buf)?;
        range_check("cuda", "read", buf, offset, out.len(), mem.bytes())?;
        let base = mem.ptr();
        self.synchronize_checked()?;
        let regions = std::mem::take(&mut self.split);
        let read = split::read_joined(&regions, buf, offset, out, |at, bytes| {
            self.dtoh(base + at as u64, bytes)
        });
        self.split = regions;
        read
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
        self.bind()?;
        let kernel = by::FILL_RANDOM.get([dtype]).map_err(|_| {
            Error::plan(format!(
                "cuda: fill_random needs a float dtype, got {dtype}"
            ))
        })?;
        let es = dtype.block_bytes();
        let mem = self.buffer(buf)?;
        let bytes = n
            .checked_mul(es)
            .ok_or_else(|| Error::plan(format!("cuda: fill_random of {n} elements overflows")))?;
        range_check("cuda", "fill", buf, offset, bytes, mem.bytes())?;
        split::check_write(&self.split, buf, offset, bytes, "fill_random")?;
        if !offset.is_multiple_of(es) {
            return Err(Error::plan(format!(
                "cuda: fill_random at offset {offset} is not aligned to {dtype} elements"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let args = FillRandomArgs {
            dst: mem.ptr() + offset as u64,
            n: n as i64,
            seed,
            scale,
            pad: 0.0,
        };
        let (grid, block) = flat_grid(n);
        let op = DevOp::kernel(kernel, grid, block, &args);
        self.launcher().launch(&op).map_err(|msg| Error::Backend {
            backend: "cuda",
            msg: format!("fill_random: {msg}"),
        })
    }

    fn supports(&self, step: &Step) -> std::result::Result<(), String> {
        let resolve = |loc: Loc| self.resolve(0, loc);
        let mut lw = Lowering {
            sms: self.sms,
            ..Lowering::new(&resolve, self.mmvq, self.group_size())
        };
        lower_step(step, &mut lw).map(|_| ())
    }

    fn load(&mut self, plan: &Plan) -> Result<ExecId> {
        self.bind()?;
        validate_plan(self, plan, |b| self.buffers.get(&b).map(|m| m.bytes()))?;
        split::check_plan(&self.split, plan)?;
        let index = self
            .execs
            .iter()
            .position(|e| e.is_none())
            .unwrap_or(self.execs.len());
        // Sizes first (lowering with the regions at offset 0), then the real addresses.
        let arena_bytes = plan.arena_bytes.next_multiple_of(REGION_ALIGN);
        let (_, consts, scratch) = self.lower_plan(plan, index, 0, arena_bytes as u64, 0)?;
        let consts_bytes = consts.len().next_multiple_of(REGION_ALIGN);
        let total = arena_bytes + consts_bytes + scratch;
        let mem = DeviceMem::alloc(&self.ctx, total, "a plan's arena")?;
        let base = mem.ptr();
        let (steps, consts2, scratch2) = self.lower_plan(
            plan,
            index,
            base,
            base + arena_bytes as u64,
            base + (arena_bytes + consts_bytes) as u64,
        )?;
        if consts2.len() != consts.len() || scratch2 != scratch {
            return Err(Error::Backend {
                backend: "cuda",
                msg: "internal error: lowering a plan gave two different layouts".into(),
            });
        }
        // Zero the arena and scratch first: the warm-up GEMMs below read arena blocks
        // whose producers have not run yet (compute-sanitizer's initcheck reported those
        // reads inside cuBLAS before this), and no kernel may see bytes nobody wrote.
        self.memset(base, 0, total)?;
        self.htod(base + arena_bytes as u64, &consts2)?;
        // Run each GEMM once now, outside any capture: cuBLAS loads its kernels lazily and
        // sets up its heuristics on first use. Inputs are zeros; the results land in the
        // GEMM's own arena block, which a run overwrites.
        for (step, ops) in plan.steps.iter().zip(&steps) {
            for op in ops {
                if let DevOp::Gemm(g) = op {
                    g.run(&self.blas)
                        .map_err(|msg| exec::node_error(step, msg))?;
                }
            }
        }
        self.wait()?;
        let mut buffers: Vec<BufferId> = plan
            .steps
            .iter()
            .flat_map(|s| std::iter::once(&s.dst).chain(s.src.iter()))
            .chain(plan.externals.iter().map(|io| &io.operand))
            .filter_map(|op| match op.loc {
                Loc::Buffer(b, _) => Some(b),
                Loc::Arena(_) => None,
            })
            .collect();
        buffers.sort();
        buffers.dedup();
        let exec = CudaExec {
            plan: plan.clone(),
            mem,
            steps,
            graph: GraphState::Fresh,
            written: HashSet::new(),
            buffers,
            checks_indices: plan.steps.iter().any(|s| s.op.reads_indices()),
        };
        if index == self.execs.len() {
            self.execs.push(Some(exec));
        } else {
            self.execs[index] = Some(exec);
        }
        Ok(ExecId(index))
    }

    fn unload(&mut self, exec: ExecId) -> Result<()> {
        self.bind()?;
        self.exec(exec)?;
        self.wait()?;
        self.discard_index_error_of(exec.0)?;
        self.execs[exec.0] = None;
        Ok(())
    }

    fn set_input(&mut self, exec: ExecId, id: TensorId, data: &[u8]) -> Result<()> {
        self.bind()?;
        let e = self.exec(exec)?;
        let Loc::Arena(off) = io_slot(&e.plan.inputs, id, data.len(), "input")? else {
            return Err(Error::plan("cuda: an input outside the arena"));
        };
        let dst = e.arena() + off as u64;
        match data.len() {
            0 => {}
            1..=MAX_STAGED => self.writes.write(&self.ctx, &self.stream, dst, data)?,
            _ => self.htod(dst, data)?,
        }
        if let Some(e) = self.execs[exec.0].as_mut() {
            e.written.insert(id);
        }
        Ok(())
    }

    fn compute(&mut self, exec: ExecId) -> Result<()> {
        self.bind()?;
        let e = self.exec(exec)?;
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
        if let Some(b) = e.buffers.iter().find(|b| !self.buffers.contains_key(b)) {
            return Err(Error::plan(format!(
                "cuda: buffer {b:?} used by this plan was freed; load the plan again"
            )));
        }
        let use_graphs = self.graphs() && !e.steps.iter().all(Vec::is_empty);
        let checks = e.checks_indices;
        let launcher = Launcher {
            kernels: &self.kernels,
            blas: &self.blas,
            stream: &self.stream,
            sync_each: self.sync_each,
            pdl: self.pdl && self.profile.is_none(),
            group: self.group.as_ref(),
        };
        let e = self.execs[exec.0].as_mut().expect("checked above");
        let mut warning = None;
        if let Some(profile) = self.profile.as_mut() {
            profile.extend(launcher.run_profiled(e, &self.ctx)?);
            self.stats.eager_runs += 1;
            if checks {
                self.index_check_pending = true;
            }
            return Ok(());
        }
        match &e.graph {
            GraphState::Captured(graph) if use_graphs => {
                graph
                    .launch()
                    .map_err(|err| driver_error("launching the CUDA graph", err))?;
                self.stats.replays += 1;
            }
            GraphState::Fresh if use_graphs => match launcher.capture(e) {
                Ok(graph) => {
                    graph
                        .launch()
                        .map_err(|err| driver_error("launching the CUDA graph", err))?;
                    e.graph = GraphState::Captured(graph);
                    self.stats.captures += 1;
                }
                Err(reason) => {
                    e.graph = GraphState::Failed;
                    warning = Some(format!(
                            "capturing plan {exec:?} into a CUDA graph failed ({reason}); it runs eagerly"
                        ));
                    launcher.run_all(e)?;
                    self.stats.eager_runs += 1;
                }
            },
            GraphState::Captured(_) | GraphState::Fresh | GraphState::Failed => {
                launcher.run_all(e)?;
                self.stats.eager_runs += 1;
            }
        }
        if checks {
            self.index_check_pending = true;
        }
        if let Some(w) = warning {
            self.warn(w);
        }
        Ok(())
    }

    fn get_output(&mut self, exec: ExecId, id: TensorId, out: &mut [u8]) -> Result<()> {
        self.bind()?;
        let ptr = self.output_ptr(exec, id, out.len())?;
        self.synchronize_checked()?;
        self.dtoh(ptr, out)
    }

    fn forward_output(
        &mut self,
        from: ExecId,
        src: TensorId,
        to: ExecId,
        dst: TensorId,
        bytes: usize,
    ) -> Result<()> {
        self.bind()?;
        let src_ptr = self.output_ptr(from, src, bytes)?;
        let e = self.exec(to)?;
        let Loc::Arena(off) = io_slot(&e.plan.inputs, dst, bytes, "input")? else {
            return Err(Error::plan("cuda: an input outside the arena"));
        };
        let dst_ptr = e.arena() + off as u64;
        if bytes > 0 {
            // SAFETY: io_slot checked both ranges: `bytes` of an output and of an input
            // of loaded plans, in memory this backend owns; stream order puts the copy
            // after the runs enqueued so far.
            unsafe { result::memcpy_dtod_async(dst_ptr, src_ptr, bytes, self.stream.cu_stream()) }
                .map_err(|e| driver_error("copying an output to an input", e))?;
        }
        if let Some(e) = self.execs[to.0].as_mut() {
            e.written.insert(dst);
        }
        Ok(())
    }

    fn begin_read(&mut self, exec: ExecId, id: TensorId, bytes: usize) -> Result<PendingRead> {
        self.bind()?;
        let ptr = self.output_ptr(exec, id, bytes)?;
        let record = self.index_err.ptr();
        let (slot, ticket) = self
            .reads
            .begin(&self.ctx, &self.stream, ptr, bytes, record)?;
        Ok(PendingRead(Pending::Slot {
            slot,
            ticket,
            len: bytes,
        }))
    }

    fn finish_read(&mut self, read: PendingRead) -> Result<Vec<u8>> {
        match read.0 {
            Pending::Done(data) => Ok(data),
            Pending::Slot { slot, ticket, len } => {
                self.bind()?;
                let (data, rec) = self.reads.finish(slot, ticket, len, run_failed)?;
                self.report_index_error(rec)?;
                Ok(data)
            }
        }
    }

    fn stats(&self) -> Stats {
        self.stats
    }

    fn synchronize(&mut self) -> Result<()> {
        self.bind()?;
        self.synchronize_checked()
    }

    fn fill_arena(&mut self, exec: ExecId, byte: u8) -> Result<()> {
        self.bind()?;
        let e = self.exec(exec)?;
        self.memset(e.arena(), byte, e.plan.arena_bytes)
    }

    fn read_arena(&mut self, exec: ExecId) -> Result<Vec<u8>> {
        self.bind()?;
        let e = self.exec(exec)?;
        let (ptr, n) = (e.arena(), e.plan.arena_bytes);
        let mut out = vec![0u8; n];
        self.synchronize_checked()?;
        self.dtoh(ptr, &mut out)?;
        Ok(out)
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
