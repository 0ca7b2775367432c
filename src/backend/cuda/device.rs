//! Device resources with owners: [`DeviceMem`] (one device allocation, freed on drop) and
//! [`Blas`] (a cuBLAS handle bound to the backend's stream with a preallocated
//! workspace), and the mapping of driver and cuBLAS errors to [`Error`]s.

use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys};
use cudarc::driver::{result, sys, CudaContext, CudaStream};

use crate::error::{Error, Result};

/// A driver error as text: its name and description.
pub(crate) fn driver_error_text(e: result::DriverError) -> String {
    let name = e
        .error_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e
        .error_string()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{name} ({text})")
}

/// A driver error with the call that returned it.
pub(crate) fn driver_error(what: &str, e: result::DriverError) -> Error {
    Error::Backend {
        backend: "cuda",
        msg: format!("{what}: {}", driver_error_text(e)),
    }
}

/// A cuBLAS error with the call that returned it.
pub(crate) fn blas_error(what: &str, e: blas_result::CublasError) -> Error {
    Error::Backend {
        backend: "cuda",
        msg: format!("{what}: cuBLAS status {:?}", e.0),
    }
}

/// One device allocation of `bytes` bytes (at least 256-byte aligned), freed on drop.
pub(crate) struct DeviceMem {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMem {
    /// Allocates `bytes` bytes (1 at least) for `what`; out of memory names the size.
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize, what: &str) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| driver_error("binding the context", e))?;
        // SAFETY: a plain allocation; the memory is only used through this owner.
        match unsafe { result::malloc_sync(bytes.max(1)) } {
            Ok(ptr) => Ok(DeviceMem {
                ptr,
                bytes,
                ctx: ctx.clone(),
            }),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                let (free, total) = result::mem_get_info().unwrap_or((0, 0));
                Err(Error::Backend {
                    backend: "cuda",
                    msg: format!(
                        "out of device memory allocating {bytes} bytes for {what} ({free} of {total} bytes free)"
                    ),
                })
            }
            Err(e) => Err(driver_error(
                &format!("allocating {bytes} bytes for {what}"),
                e,
            )),
        }
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size asked for.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        // Owners synchronize the stream before dropping memory that work may still use.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by cuMemAlloc in DeviceMem::alloc and freed once, here.
        self.ctx.record_err(unsafe { result::free_sync(self.ptr) });
    }
}

/// Bytes of the cuBLAS workspace (what cuBLAS recommends for Hopper).
pub(crate) const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle on the backend's stream, with its own workspace so that no call
/// allocates memory (which would break stream capture).
pub(crate) struct Blas {
    handle: blas_sys::cublasHandle_t,
    _workspace: DeviceMem,
}

impl Blas {
    /// Creates the handle, binds it to `stream` and gives it a workspace.
    pub fn new(ctx: &Arc<CudaContext>, stream: &CudaStream) -> Result<Self> {
        let workspace = DeviceMem::alloc(ctx, BLAS_WORKSPACE_BYTES, "the cuBLAS workspace")?;
        let handle = blas_result::create_handle().map_err(|e| blas_error("cublasCreate", e))?;
        let blas = Blas {
            handle,
            _workspace: workspace,
        };
        // SAFETY: the handle is valid; the stream outlives the handle (the backend drops
        // the handle first); the workspace is owned by `blas` and outlives the handle's use.
        unsafe {
            blas_result::set_stream(blas.handle, stream.cu_stream() as _)
                .map_err(|e| blas_error("cublasSetStream", e))?;
            blas_sys::cublasSetWorkspace_v2(
                blas.handle,
                blas._workspace.ptr() as *mut std::ffi::c_void,
                BLAS_WORKSPACE_BYTES,
            )
            .result()
            .map_err(|e| blas_error("cublasSetWorkspace", e))?;
            // No TF32: F32 x F32 products stay in full f32.
            blas_sys::cublasSetMathMode(blas.handle, blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| blas_error("cublasSetMathMode", e))?;
        }
        Ok(blas)
    }

    /// The raw handle.
    pub fn handle(&self) -> blas_sys::cublasHandle_t {
        self.handle
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: created in Blas::new and destroyed once, here; the error (if any) has no
        // one to go to.
        let _ = unsafe { blas_result::destroy_handle(self.handle) };
    }
}
