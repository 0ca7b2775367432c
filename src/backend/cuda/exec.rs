//! A plan loaded into the CUDA backend ([`CudaExec`]) and the loop that runs it
//! ([`Launcher`]).
//!
//! Each exec owns one device allocation: the plan's arena, then its constants (rope
//! tables, GEMM pointer arrays), then the scratch of its mul_mats. Addresses never
//! change while the exec lives, which is what makes the lowered launches (and the CUDA
//! graph captured from them) valid for every run. A plan is immutable once loaded: new
//! shapes or a new topology mean a new plan, loaded (and captured) anew.

use std::collections::HashSet;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaGraph, CudaStream};

use super::args::SpinArgs;
use super::device::{driver_error_text, Blas, DeviceMem};
use super::kernels::{k, KernelTable};
use super::lowering::DevOp;
use super::nccl::Member;
use crate::backend::StepTime;
use crate::error::{Error, Result};
use crate::graph::{BufferId, Plan, Step, TensorId};

/// Whether an exec runs from a captured CUDA graph.
pub(crate) enum GraphState {
    /// Not captured yet: the next run with graphs enabled captures.
    Fresh,
    /// Captured and instantiated: runs replay it.
    Captured(CudaGraph),
    /// Capture failed (the reason was reported); runs are eager.
    Failed,
}

/// A loaded plan.
pub(crate) struct CudaExec {
    /// The plan.
    pub plan: Plan,
    /// Arena, constants and scratch, in this order.
    pub mem: DeviceMem,
    /// The device operations of each step of `plan.steps`.
    pub steps: Vec<Vec<DevOp>>,
    /// Capture state.
    pub graph: GraphState,
    /// Inputs written at least once.
    pub written: HashSet<TensorId>,
    /// Buffers the plan uses (they must outlive its runs).
    pub buffers: Vec<BufferId>,
    /// Whether some step records bad indices (get_rows, set_rows, paged_attn).
    pub checks_indices: bool,
}

impl CudaExec {
    /// Device address of the arena.
    pub fn arena(&self) -> u64 {
        self.mem.ptr()
    }
}

/// The tag of step `step` of exec `exec` in the index-error record.
pub(crate) fn error_tag(exec: usize, step: usize) -> i64 {
    ((exec as i64) << 32) | step as i64
}

/// (exec, step) of an index-error tag.
pub(crate) fn decode_tag(tag: i64) -> (usize, usize) {
    ((tag >> 32) as usize, (tag & 0xffff_ffff) as usize)
}

/// The error of a step, naming its op and node.
pub(crate) fn node_error(step: &Step, msg: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: "cuda",
        msg: format!("{} '{}': {msg}", step.op.name(), step.name),
    }
}

/// Everything a run needs besides the exec.
pub(crate) struct Launcher<'a> {
    pub kernels: &'a KernelTable,
    pub blas: &'a Blas,
    pub stream: &'a Arc<CudaStream>,
    /// Synchronize after every step (debugging: errors then name their node).
    pub sync_each: bool,
    /// Launch kernels with programmatic stream serialization (PDL, sm_90+): a kernel may
    /// launch while the previous one runs and waits for it in its own code.
    pub pdl: bool,
    /// The device group this backend is a member of, for all-reduces.
    pub group: Option<&'a Member>,
}

impl Launcher<'_> {
    /// Enqueues one device operation; the error says what failed.
    pub fn launch(&self, op: &DevOp) -> std::result::Result<(), String> {
        match op {
            DevOp::Kernel(l) => {
                let mut params = [l.args.as_param()];
                let smem = self.kernels.smem_cap(l.kernel, l.per_sm);
                let launched = if self.pdl && l.early {
                    let mut attr = sys::CUlaunchAttribute {
                        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                        pad: [0; 4],
                        // SAFETY: an all-zero union is a valid value of every member.
                        value: unsafe { std::mem::zeroed() },
                    };
                    attr.value.programmaticStreamSerializationAllowed = 1;
                    let config = sys::CUlaunchConfig {
                        gridDimX: l.grid.0,
                        gridDimY: l.grid.1,
                        gridDimZ: l.grid.2,
                        blockDimX: l.block.0,
                        blockDimY: l.block.1,
                        blockDimZ: l.block.2,
                        sharedMemBytes: smem,
                        hStream: self.stream.cu_stream(),
                        attrs: &mut attr,
                        numAttrs: 1,
                    };
                    // SAFETY: as for the plain launch below; `config` and `attr` outlive the
                    // call, which copies them. Every plan kernel waits (griddepcontrol.wait)
                    // before it touches memory an earlier kernel writes, so starting it
                    // early is safe.
                    unsafe {
                        sys::cuLaunchKernelEx(
                            &config,
                            self.kernels.func(l.kernel),
                            params.as_mut_ptr(),
                            std::ptr::null_mut(),
                        )
                    }
                    .result()
                } else {
                    // SAFETY: the function belongs to the loaded kernel table; `params`
                    // points at the argument struct the kernel takes (KernelArgs: same
                    // layout as the C struct), which the driver copies before returning;
                    // every device address in it was resolved at load to memory owned by
                    // the exec or the backend's buffers, with extents checked by
                    // validate_plan and lowering; no kernel uses dynamic shared memory (a
                    // cap's reservation is within the per-block limit and only occupies).
                    unsafe {
                        result::launch_kernel(
                            self.kernels.func(l.kernel),
                            l.grid,
                            l.block,
                            smem,
                            self.stream.cu_stream(),
                            &mut params,
                        )
                    }
                };
                launched.map_err(|e| {
                    format!(
                        "launch of kernel {} (grid {:?}, block {:?}) failed: {}",
                        l.kernel.name,
                        l.grid,
                        l.block,
                        driver_error_text(e)
                    )
                })
            }
            DevOp::Gemm(g) => g.run(self.blas),
            DevOp::AllReduce(a) => match self.group {
                Some(m) => m
                    .group
                    .all_reduce_sum(m.rank, (a.send, a.recv, a.count), self.stream),
                None => Err("an all_reduce step on a backend outside a device group".into()),
            },
        }
    }

    /// Enqueues every operation of one step.
    pub fn run_step(&self, step: &Step, ops: &[DevOp]) -> Result<()> {
        for op in ops {
            self.launch(op).map_err(|msg| node_error(step, msg))?;
        }
        if self.sync_each {
            self.stream
                .synchronize()
                .map_err(|e| node_error(step, format!("failed: {}", driver_error_text(e))))?;
        }
        Ok(())
    }

    /// Runs the whole plan eagerly with a timing event between steps, all enqueued behind
    /// a spin kernel that holds the stream until they are, so each step's time is its
    /// kernels' time, not the host's launch rate. Waits for the run.
    pub fn run_profiled(&self, exec: &CudaExec, ctx: &Arc<CudaContext>) -> Result<Vec<StepTime>> {
        let ev = |what| Error::Backend {
            backend: "cuda",
            msg: format!("profiling: {what}"),
        };
        let events = (0..=exec.plan.steps.len())
            .map(|_| ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| ev(format!("cuEventCreate: {}", driver_error_text(e))))?;
        // 20 us per launch of the plan covers the host's enqueueing with room to spare.
        let launches: usize = exec.steps.iter().map(Vec::len).sum();
        let spin = DevOp::kernel(
            k::SPIN_WAIT,
            (1, 1, 1),
            (1, 1, 1),
            &SpinArgs {
                ns: (20_000 * launches as i64).max(1_000_000),
            },
        );
        self.launch(&spin).map_err(ev)?;
        events[0]
            .record(self.stream)
            .map_err(|e| ev(format!("cuEventRecord: {}", driver_error_text(e))))?;
        for (i, (step, ops)) in exec.plan.steps.iter().zip(&exec.steps).enumerate() {
            self.run_step(step, ops)?;
            events[i + 1]
                .record(self.stream)
                .map_err(|e| ev(format!("cuEventRecord: {}", driver_error_text(e))))?;
        }
        self.stream
            .synchronize()
            .map_err(|e| ev(format!("the profiled run failed: {}", driver_error_text(e))))?;
        let mut rows = Vec::with_capacity(exec.plan.steps.len());
        for (i, (step, ops)) in exec.plan.steps.iter().zip(&exec.steps).enumerate() {
            let ms = events[i]
                .elapsed_ms(&events[i + 1])
                .map_err(|e| ev(format!("cuEventElapsedTime: {}", driver_error_text(e))))?;
            let kernels: Vec<&str> = ops.iter().map(DevOp::name).collect();
            rows.push(StepTime {
                name: step.name.clone(),
                op: step.op.name(),
                kernels: if kernels.is_empty() {
                    "(fused into the step before)".to_string()
                } else {
                    kernels.join(" + ")
                },
                us: f64::from(ms) * 1e3,
            });
        }
        Ok(rows)
    }

    /// Enqueues the whole plan.
    pub fn run_all(&self, exec: &CudaExec) -> Result<()> {
        for (step, ops) in exec.plan.steps.iter().zip(&exec.steps) {
            self.run_step(step, ops)?;
        }
        Ok(())
    }

    /// Captures the whole plan's launches into a CUDA graph, or says why it could not (the
    /// capture is ended even after a failed launch).
    pub fn capture(&self, exec: &CudaExec) -> std::result::Result<CudaGraph, String> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        self.stream
            .begin_capture(mode)
            .map_err(|err| format!("cuStreamBeginCapture: {}", driver_error_text(err)))?;
        let enqueued = self.run_all(exec);
        let ended = self.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        match (enqueued, ended) {
            (Ok(()), Ok(Some(graph))) => Ok(graph),
            (Err(err), _) => Err(err.to_string()),
            (Ok(()), Ok(None)) => Err("the capture recorded nothing".into()),
            (Ok(()), Err(err)) => Err(format!("cuStreamEndCapture: {}", driver_error_text(err))),
        }
    }
}
