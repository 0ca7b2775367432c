//! Collectives (`src/ops/collective.rs`). A group of one device is a copy; summing over
//! several GPUs needs an NCCL communicator per device, which this backend does not hold
//! yet, so such a step is refused with the reason (tensor parallelism runs on the CPU
//! backend's simulated devices today).

use super::cpy;
use crate::backend::cuda::lowering::{DevOp, Lowering};
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
        n => Err(format!(
            "all_reduce over {n} GPUs needs NCCL, which the CUDA backend does not drive yet; \
             --tp runs on the CPU backend"
        )),
    }
}
