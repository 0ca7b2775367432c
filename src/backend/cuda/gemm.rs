//! cuBLAS GEMMs as the lowering records them: one [`Gemm`] holds every argument of a
//! `cublasGemmEx` (or, batched over pointer arrays, `cublasGemmBatchedEx`) call, decided at
//! plan load; [`Gemm::run`] enqueues it on the handle's stream.

use cudarc::cublas::sys as blas_sys;

use super::device::Blas;
use crate::graph::DType;

/// A cuBLAS GEMM: C (m x n, column-major, F32) = op(A) op(B), batched over pointer arrays
/// when `batch > 1`.
pub(crate) struct Gemm {
    pub transa: bool,
    pub transb: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    /// Element type of A and B.
    pub dtype: DType,
    pub a: u64,
    pub lda: i32,
    pub b: u64,
    pub ldb: i32,
    pub c: u64,
    pub ldc: i32,
    pub batch: i32,
    /// 0 to overwrite C, 1 to add the product to it.
    pub beta: f32,
    /// Device address of `batch` A pointers, then `batch` B pointers, then `batch` C
    /// pointers (used when `batch > 1`).
    pub ptrs: u64,
}

impl Gemm {
    /// Enqueues the GEMM on the handle's stream.
    pub fn run(&self, blas: &Blas) -> Result<(), String> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        use blas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        let dt = match self.dtype {
            DType::F32 => CUDA_R_32F,
            DType::F16 => CUDA_R_16F,
            DType::BF16 => CUDA_R_16BF,
            dt @ (DType::I32 | DType::Quant(_)) => return Err(format!("GEMM of {dt} operands")),
        };
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let (alpha, beta) = (1f32, self.beta);
        let compute = blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let status = if self.batch == 1 {
            // SAFETY: a, b, c are device addresses inside the plan's arena, scratch or
            // buffers, with extents checked when the plan was lowered (ld >= rows, the
            // operands' byte spans inside their memory); alpha and beta are host scalars
            // read during the call (pointer mode host).
            unsafe {
                blas_sys::cublasGemmEx(
                    blas.handle(),
                    op(self.transa),
                    op(self.transb),
                    self.m,
                    self.n,
                    self.k,
                    (&alpha as *const f32).cast(),
                    self.a as *const std::ffi::c_void,
                    dt,
                    self.lda,
                    self.b as *const std::ffi::c_void,
                    dt,
                    self.ldb,
                    (&beta as *const f32).cast(),
                    self.c as *mut std::ffi::c_void,
                    CUDA_R_32F,
                    self.ldc,
                    compute,
                    algo,
                )
            }
        } else {
            let n = self.batch as u64;
            // SAFETY: as above; `ptrs` holds 3 * batch device pointers uploaded at load,
            // each naming one matrix inside the plan's memory.
            unsafe {
                blas_sys::cublasGemmBatchedEx(
                    blas.handle(),
                    op(self.transa),
                    op(self.transb),
                    self.m,
                    self.n,
                    self.k,
                    (&alpha as *const f32).cast(),
                    self.ptrs as *const *const std::ffi::c_void,
                    dt,
                    self.lda,
                    (self.ptrs + 8 * n) as *const *const std::ffi::c_void,
                    dt,
                    self.ldb,
                    (&beta as *const f32).cast(),
                    (self.ptrs + 16 * n) as *const *mut std::ffi::c_void,
                    CUDA_R_32F,
                    self.ldc,
                    self.batch,
                    compute,
                    algo,
                )
            }
        };
        status
            .result()
            .map_err(|e| format!("cuBLAS GEMM failed: {:?}", e.0))
    }
}
