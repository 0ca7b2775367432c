//! mul_mat_id (`cuda/mul_mat_id.cu`): `group_by_expert` sorts the columns by expert into
//! scratch, then `mul_mat_id_<type>` runs a block per tile of rows, expert and column
//! chunk, each expert's rows read once per chunk of its columns. A block's gate, up and
//! down products share their ids: the grouping of the first serves the next ones
//! ([`Lowering::experts`]) while no step between them takes scratch or writes the ids.

use crate::backend::cuda::args::{
    MulMatIdArgs, MMID_COLS, MMID_GROUP_THREADS, MMID_MAX_EXPERTS, MMID_ROWS, MMID_THREADS,
};
use crate::backend::cuda::kernels::{by, k};
use crate::backend::cuda::lowering::{expect_i32, DevOp, ExpertGroups, Lowering, MAX_GRID_X};
use crate::graph::{DType, Operand};

/// The grid's z at most: the column chunks of one expert that run side by side (a
/// prefill's experts have many; a decode step's one each).
const MAX_CHUNKS: usize = 32;

/// `dst` = the experts `src[0]` times the inputs `src[1]` for the ids `src[2]`.
pub(crate) fn lower(
    src: &[Operand],
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (w, b, ids) = (&src[0], &src[1], &src[2]);
    let kernel = by::MUL_MAT_ID.get([w.dtype])?;
    expect_i32("mul_mat_id ids", ids)?;
    if b.dtype != DType::F32 || b.nb[0] != 4 || dst.dtype != DType::F32 {
        return Err(format!(
            "mul_mat_id needs F32 inputs dense along dim 0 and an F32 result, got {} inputs with strides {:?}",
            b.dtype, b.nb
        ));
    }
    if w.dtype.quant().is_some() && !w.rows_contiguous() {
        return Err(format!(
            "mul_mat_id with {} experts needs dense blocks along dim 0, got strides {:?}",
            w.dtype, w.nb
        ));
    }
    let (m, n_expert, n) = (w.ne[1], w.ne[2], ids.ne[0] * ids.ne[1]);
    if n_expert > MMID_MAX_EXPERTS as usize || n > i32::MAX as usize / 2 {
        return Err(format!(
            "mul_mat_id over {n_expert} experts and {n} columns: the kernels take at most {MMID_MAX_EXPERTS} experts"
        ));
    }
    let tiles = m.div_ceil(MMID_ROWS as usize);
    if n == 0 {
        return Ok(Vec::new());
    }
    if tiles > MAX_GRID_X {
        return Err(format!("mul_mat_id with {m} rows exceeds the grid"));
    }
    // the columns grouped by expert: those of the last mul_mat_id when it had these
    // ids, else grouped here
    let (groups, regroup) = match lw.experts.take() {
        Some(g) if g.ids == *ids && g.n_expert == n_expert => (g, false),
        Some(_) | None => {
            let mut offset = 0;
            let offsets = lw.reserve_scratch(&mut offset, (n_expert + 1) * 4);
            let cols = lw.reserve_scratch(&mut offset, n * 4);
            let g = ExpertGroups {
                ids: ids.clone(),
                n_expert,
                offsets,
                cols,
            };
            (g, true)
        }
    };
    let chunks = n.div_ceil(MMID_COLS as usize).min(MAX_CHUNKS);
    let args = MulMatIdArgs {
        w: lw.t4(w),
        b: lw.t4(b),
        ids: lw.t4(ids),
        dst: lw.t4(dst),
        offsets: groups.offsets,
        cols: groups.cols,
        err: lw.err,
        tag: lw.tag,
        chunks: chunks as i64,
    };
    let mut launches = Vec::new();
    if regroup {
        let block = (MMID_GROUP_THREADS as u32, 1, 1);
        launches.push(DevOp::kernel(k::GROUP_BY_EXPERT, (1, 1, 1), block, &args));
    }
    let grid = (tiles as u32, n_expert as u32, chunks as u32);
    launches.push(DevOp::kernel(
        kernel,
        grid,
        (MMID_THREADS as u32, 1, 1),
        &args,
    ));
    lw.experts = Some(groups);
    Ok(launches)
}
