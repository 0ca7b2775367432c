//! NCCL for the CUDA members of a [`DeviceGroup`](crate::backend::group::DeviceGroup):
//! one communicator per GPU of this process (`ncclCommInitAll`), the `all_reduce` step
//! enqueued as an in-place `ncclAllReduce` (sum, F32) on the member's own stream, so that
//! the member's CUDA graph captures it like any kernel, and abort when a member fails so
//! that no other member's collective waits forever for it.
//!
//! libnccl is loaded at run time (cudarc's dynamic loading, as for cuBLAS): a graft built
//! with the `cuda` feature runs without it until `--tp` asks for more than one GPU.
//! cudarc looks for `libnccl.so` (or `libnccl.so.1`, `.13`, ...); NVIDIA's wheels and
//! packages ship `libnccl.so.2`, so the folder on `LD_LIBRARY_PATH` must hold a
//! `libnccl.so` link to it (`scripts/gpu-bundle.sh`'s runner makes one).
//!
//! NVLink multicast (NVLS) stays off: [`init_all`] sets `NCCL_NVLS_ENABLE=0` in the
//! process before NCCL reads its environment, whatever the caller's environment says.
//! NVLS needs `cuMulticastCreate`, which can put a shared host's GPUs out of service.
//! Unless the caller set it, `NCCL_RUNTIME_CONNECT=0` too: NCCL then connects the GPUs
//! inside `ncclCommInitAll` rather than at the first collective, which would otherwise
//! fall inside a member's CUDA graph capture and block its host thread on the others.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;

use crate::error::{Error, Result};

/// The environment switch NCCL reads for NVLink multicast, and the only value graft
/// lets it see.
pub const NVLS_VAR: &str = "NCCL_NVLS_ENABLE";

/// The communicators of one group, shared by its members and the group itself.
pub(crate) struct NcclGroup {
    /// One communicator per rank; null once aborted or destroyed.
    comms: Mutex<Vec<sys::ncclComm_t>>,
    /// Ranks in the group.
    size: usize,
    aborted: AtomicBool,
    /// The members' contexts, kept alive until the communicators are gone.
    _contexts: Vec<Arc<CudaContext>>,
}

// SAFETY: a communicator is used by one thread at a time (its member's, or the group's
// while no member runs); the handles themselves are plain pointers that NCCL allows to be
// used from any thread, and the mutex serializes abort and destroy.
unsafe impl Send for NcclGroup {}
unsafe impl Sync for NcclGroup {}

/// A member's view of its group: the group and its rank in it.
#[derive(Clone)]
pub(crate) struct Member {
    pub group: Arc<NcclGroup>,
    pub rank: usize,
}

/// NCCL's text for a result code.
fn nccl_text(e: &nccl::NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
    let text = unsafe { std::ffi::CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
    format!("{:?} ({})", e.0, text.to_string_lossy())
}

/// NCCL's switch for connecting peers at the first collective instead of at init.
pub const RUNTIME_CONNECT_VAR: &str = "NCCL_RUNTIME_CONNECT";

/// Sets NCCL's environment: `NCCL_NVLS_ENABLE=0` always, and `NCCL_RUNTIME_CONNECT=0`
/// unless the caller chose a value (see the module docs).
pub fn set_environment() {
    // The process's environment is changed before NCCL is initialised; graft's own
    // threads do not read the environment concurrently with this.
    if std::env::var(NVLS_VAR).ok().as_deref() != Some("0") {
        std::env::set_var(NVLS_VAR, "0");
    }
    if std::env::var_os(RUNTIME_CONNECT_VAR).is_none() {
        std::env::set_var(RUNTIME_CONNECT_VAR, "0");
    }
}

/// One communicator for each of `contexts` (GPU ordinals in order, rank = index), all
/// made together in this process.
pub(crate) fn init_all(contexts: &[Arc<CudaContext>]) -> Result<Arc<NcclGroup>> {
    // SAFETY: only tries to open the shared library.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDevice(
            "NCCL (libnccl.so) was not found: --tp over GPUs needs it. Put a folder holding \
             libnccl.so on LD_LIBRARY_PATH; NVIDIA's packages install libnccl.so.2, so link \
             it there as libnccl.so (pip's nvidia-nccl-cu13 keeps it in \
             site-packages/nvidia/nccl/lib)"
                .into(),
        ));
    }
    set_environment();
    let n = contexts.len();
    let ordinals: Vec<i32> = contexts.iter().map(|c| c.ordinal() as i32).collect();
    let mut comms = vec![std::ptr::null_mut(); n];
    // SAFETY: `comms` has room for n handles and `ordinals` holds n device ordinals.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, ordinals.as_ptr()) }.map_err(
        |e| {
            Error::NoDevice(format!(
                "ncclCommInitAll over GPUs {ordinals:?}: {}",
                nccl_text(&e)
            ))
        },
    )?;
    Ok(Arc::new(NcclGroup {
        comms: Mutex::new(comms),
        size: n,
        aborted: AtomicBool::new(false),
        _contexts: contexts.to_vec(),
    }))
}

impl NcclGroup {
    /// Members in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<sys::ncclComm_t>> {
        self.comms.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether [`NcclGroup::abort`] ran: the communicators are gone for good.
    pub fn aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Aborts every communicator: collectives in flight on any GPU return, and every later
    /// all-reduce of the group is an error. The group cannot be used again (a model on it
    /// must be loaded anew).
    pub fn abort(&self) {
        let mut comms = self.lock();
        self.aborted.store(true, Ordering::Release);
        for c in comms.iter_mut().filter(|c| !c.is_null()) {
            // SAFETY: a live communicator of this group; abort frees it, and it is nulled
            // so nothing uses it again.
            let _ = unsafe { nccl::comm_abort(*c) };
            *c = std::ptr::null_mut();
        }
    }

    /// Enqueues the sum of `count` F32 values at `send` over the group into `recv` (may be
    /// `send`: in place) on `stream`, as member `rank`.
    pub fn all_reduce_sum(
        &self,
        rank: usize,
        (send, recv, count): (u64, u64, usize),
        stream: &CudaStream,
    ) -> std::result::Result<(), String> {
        if self.aborted() {
            return Err(
                "the device group was aborted after a member failed; load the model again".into(),
            );
        }
        let comm = *self
            .lock()
            .get(rank)
            .ok_or_else(|| format!("rank {rank} outside the group"))?;
        // SAFETY: `comm` is this rank's live communicator (not aborted: checked above, and
        // abort runs only while no member enqueues); send and recv are device ranges of
        // `count` F32 values on this rank's GPU, resolved at load; the stream is the
        // member's, on that GPU.
        unsafe {
            nccl::all_reduce(
                send as *const std::ffi::c_void,
                recv as *mut std::ffi::c_void,
                count,
                sys::ncclDataType_t::ncclFloat32,
                sys::ncclRedOp_t::ncclSum,
                comm,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| format!("ncclAllReduce of {count} values: {}", nccl_text(&e)))
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        for c in self.lock().iter().filter(|c| !c.is_null()) {
            // SAFETY: a live communicator; its members (and their streams) are gone, and
            // the contexts are still held by `_contexts`.
            let _ = unsafe { nccl::comm_destroy(*c) };
        }
    }
}
