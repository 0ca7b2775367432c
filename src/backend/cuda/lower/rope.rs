//! Rope (`cuda/rope.cu`): one block per row; the inverse frequencies go into the plan's
//! constant region.

use crate::backend::cuda::args::RopeArgs;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{
    expect_i32, loop_block, row_grid, same_dtype, DevOp, Lowering,
};
use crate::graph::{Operand, RopeMode, RopeParams};

/// `src[0]` rotated by the positions `src[1]` into `dst` (same dtype).
pub(crate) fn lower(
    p: &RopeParams,
    src: &[Operand],
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (a, pos) = (&src[0], &src[1]);
    same_dtype("rope", a, dst)?;
    expect_i32("rope positions", pos)?;
    if p.n_dims % 2 != 0 || p.n_dims > a.ne[0] {
        return Err(format!(
            "rope n_dims {} does not fit rows of {}",
            p.n_dims, a.ne[0]
        ));
    }
    let kernel = by::ROPE.get([a.dtype])?;
    let freqs: Vec<u8> = p.inv_freqs().iter().flat_map(|f| f.to_ne_bytes()).collect();
    let freqs = lw.push_consts(&freqs);
    let args = RopeArgs {
        src: lw.t4(a),
        dst: lw.t4(dst),
        pos: lw.addr(pos),
        pos_nb0: pos.nb[0] as i64,
        freqs,
        n_dims: p.n_dims as i64,
        neox: i64::from(p.mode == RopeMode::Neox),
    };
    let work = (p.n_dims / 2).max(a.ne[0] - p.n_dims);
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(dst.nrows())?,
        loop_block(work),
        &args,
    )])
}
