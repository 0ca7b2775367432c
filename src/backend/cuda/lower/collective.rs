//! Collectives (`src/ops/collective.rs`). A group of one device is a copy (or nothing,
//! in place); over the GPUs of a device group the sum is an NCCL all-reduce on the
//! member's stream (see [`crate::backend::cuda::nccl`]), captured into the member's
//! CUDA graph like a kernel.

use super::cpy;
use crate::backend::cuda::lowering::{AllReduce, DevOp, Lowering};
use crate::graph::{AllReduceParams, Operand};

/// Lowers an all_reduce over `p.devices` devices.
pub(crate) fn lower(
    p: AllReduceParams,
    src: &[Operand],
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    match p.devices {
        1 if lw.addr(dst) == lw.addr(&src[0]) => Ok(Vec::new()),
        1 => Ok(vec![cpy::copy(lw, &src[0], dst)?]),
        n if n == lw.devices => Ok(vec![DevOp::AllReduce(AllReduce {
            send: lw.addr(&src[0]),
            recv: lw.addr(dst),
            count: dst.nelements(),
        })]),
        n => Err(format!(
            "all_reduce over {n} GPUs on a backend in a group of {} (--tp with the CUDA \
             backend makes a group of CUDA backends joined by NCCL)",
            lw.devices
        )),
    }
}
