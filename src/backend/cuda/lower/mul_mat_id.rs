//! mul_mat_id (`cuda/mul_mat_id.cu`, `cuda/mmq.cu`): `group_by_expert` sorts the columns
//! by expert into scratch, then one of two products runs over each expert's columns:
//! - `mmq_id_c<BN>_<type>` (block-quantized weights of a type with `mmq_*` kernels): the
//!   inputs quantized to Q8_1 once, each expert's columns in tiles of BN (listed by
//!   `group_by_expert`) on int8 tensor cores, each expert's rows read once a tile;
//! - `mul_mat_id_<type>` (any other weights): a block per tile of rows, expert and column
//!   chunk, each expert's rows dequantized once per chunk of its columns.
//!
//! A block's gate, up and down products share their ids: the grouping of the first serves
//! the next ones ([`Lowering::experts`]) while no step between them takes scratch or
//! writes the ids; the Q8_1 copy of the gate's inputs serves the up product too.

use crate::backend::cuda::args::{
    MmqIdArgs, MulMatIdArgs, MMID_COLS, MMID_GROUP_THREADS, MMID_MAX_EXPERTS, MMID_ROWS,
    MMID_THREADS, MMQ_ROWS, MMQ_WARPS,
};
use crate::backend::cuda::decode::q8_1::{self, q8_1_column_bytes};
use crate::backend::cuda::kernels::{by, cols, k, Kernel};
use crate::backend::cuda::lowering::{
    expect_i32, DevOp, ExpertGroups, ExpertTiles, Lowering, MAX_GRID_X, MAX_GRID_YZ, WARP,
};
use crate::backend::fusion::Q8Layout;
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
    let tiled = tiled_kernel(w, b, dst, n, n_expert)?;
    let (groups, regroup) = grouping(ids, n_expert, n, tiled.map(|(_, bn)| bn), lw);
    let chunks = n.div_ceil(MMID_COLS as usize).min(MAX_CHUNKS);
    let t = groups.tiles;
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
        tile_expert: t.map_or(0, |t| t.expert),
        tile_first: t.map_or(0, |t| t.first),
        tile_bn: t.map_or(0, |t| t.bn as i64),
        tiles: t.map_or(0, |t| t.count as i64),
    };
    let mut launches = Vec::new();
    if regroup {
        let block = (MMID_GROUP_THREADS as u32, 1, 1);
        launches.push(DevOp::kernel(k::GROUP_BY_EXPERT, (1, 1, 1), block, &args));
    }
    match (tiled, t) {
        (Some((kernel, _)), Some(t)) => {
            launches.extend(lower_tiled(kernel, w, b, dst, &groups, t, lw)?);
        }
        _ => {
            let grid = (tiles as u32, n_expert as u32, chunks as u32);
            let block = (MMID_THREADS as u32, 1, 1);
            launches.push(DevOp::kernel(kernel, grid, block, &args));
        }
    }
    lw.experts = Some(groups);
    Ok(launches)
}

/// The `mmq_id_*` kernel of the product and its column tile, when it takes one: weights of
/// a type with `mmq_*` kernels in whole blocks a row, results dense along dim 0, and an
/// expert's rows one grid holds. The tile is the narrowest that holds an expert's share
/// of the columns when the ids spread evenly.
fn tiled_kernel(
    w: &Operand,
    b: &Operand,
    dst: &Operand,
    n: usize,
    n_expert: usize,
) -> Result<Option<(Kernel<MmqIdArgs>, usize)>, String> {
    let bn = n.div_ceil(n_expert).next_power_of_two().clamp(8, 64);
    let takes = w.dtype.quant().is_some()
        && w.ne[0] % w.dtype.block_size() == 0
        && w.ne[0] < i32::MAX as usize
        && b.ne[0] == w.ne[0]
        && dst.nb[0] == 4
        && w.ne[1] <= MMQ_ROWS as usize * MAX_GRID_YZ
        && n.div_ceil(bn) + n_expert <= MAX_GRID_X;
    let kernel = cols::MMQ_ID.get(bn).and_then(|s| s.get([w.dtype]));
    Ok(match (takes, kernel) {
        (true, Ok(kernel)) => Some((kernel, bn)),
        _ => None,
    })
}

/// The columns of `ids` grouped by expert: those of the last mul_mat_id when it had these
/// ids (and the tiles of `bn` when asked for), else scratch for grouping them here (the
/// second value: whether to).
fn grouping(
    ids: &Operand,
    n_expert: usize,
    n: usize,
    bn: Option<usize>,
    lw: &mut Lowering,
) -> (ExpertGroups, bool) {
    match lw.experts.take() {
        Some(g) if g.ids == *ids && g.n_expert == n_expert && g.tiles.map(|t| t.bn) == bn => {
            (g, false)
        }
        Some(_) | None => {
            let mut offset = 0;
            let offsets = lw.reserve_scratch(&mut offset, (n_expert + 1) * 4);
            let cols = lw.reserve_scratch(&mut offset, n * 4);
            let tiles = bn.map(|bn| {
                let count = n.div_ceil(bn) + n_expert;
                ExpertTiles {
                    bn,
                    count,
                    expert: lw.reserve_scratch(&mut offset, count * 4),
                    first: lw.reserve_scratch(&mut offset, count * 4),
                }
            });
            let g = ExpertGroups {
                ids: ids.clone(),
                n_expert,
                offsets,
                cols,
                tiles,
                end: offset,
            };
            (g, true)
        }
    }
}

/// The launches of the tiled product: the Q8_1 copy of `b` past the grouping in scratch
/// (or the copy an earlier product made), then `mmq_id`.
fn lower_tiled(
    kernel: Kernel<MmqIdArgs>,
    w: &Operand,
    b: &Operand,
    dst: &Operand,
    groups: &ExpertGroups,
    t: ExpertTiles,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (kk, m) = (w.ne[0], w.ne[1]);
    let layout = Q8Layout::of(w.dtype);
    let mut ops = Vec::with_capacity(2);
    let q8 = match q8_1::made(b, layout, lw) {
        Some(addr) => addr,
        None => {
            let (addr, op) = q8_1::quantize_q8_1_at(b, layout, groups.end, lw)?;
            ops.push(op);
            addr
        }
    };
    let args = MmqIdArgs {
        a: lw.addr(w),
        b: q8,
        offsets: groups.offsets,
        cols: groups.cols,
        tile_expert: t.expert,
        tile_first: t.first,
        dst: lw.addr(dst),
        k: kk as i64,
        m: m as i64,
        a_nb1: w.nb[1] as i64,
        a_nb2: w.nb[2] as i64,
        b_nb1: q8_1_column_bytes(kk) as i64,
        dst_nb1: dst.nb[1] as i64,
        dst_nb2: dst.nb[2] as i64,
        n_used: dst.ne[1] as i64,
        b1: b.ne[1] as i64,
    };
    let grid = (t.count as u32, m.div_ceil(MMQ_ROWS as usize) as u32, 1);
    let threads = (MMQ_WARPS as usize * WARP) as u32;
    ops.push(DevOp::kernel(kernel, grid, (threads, 1, 1), &args));
    Ok(ops)
}

#[cfg(test)]
mod tests {
    use crate::backend::cuda::args::{MmqIdArgs, MulMatIdArgs};
    use crate::backend::cuda::lowering::{DevOp, Lowering};
    use crate::backend::cuda::tests::{args, fake_addr_any, kernel_launches, lower_plan};
    use crate::graph::{BufferId, BufferRef, DType, Graph};
    use crate::ops::UnaryOp;

    const SCRATCH: u64 = 1 << 50;

    /// A mixture's gate, up and down products over `n_tokens` tokens (8 experts of
    /// 256 x 256 weights of `dt`, 2 a token), lowered.
    fn experts_block(dt: DType, n_tokens: usize) -> Vec<Vec<DevOp>> {
        let (k, m, n_expert, n_used) = (256, 256, 8, 2);
        let mut g = Graph::new();
        let at = |offset| BufferRef {
            buffer: BufferId(1),
            offset,
        };
        let bytes = dt.row_bytes(k) * m * n_expert;
        let gate = g.weight("gate", dt, &[k, m, n_expert], at(0)).unwrap();
        let up = g.weight("up", dt, &[k, m, n_expert], at(bytes)).unwrap();
        let down = g
            .weight("down", dt, &[m, k, n_expert], at(2 * bytes))
            .unwrap();
        let x = g.input("x", DType::F32, &[k, 1, n_tokens]).unwrap();
        let ids = g.input("ids", DType::I32, &[n_used, n_tokens]).unwrap();
        let a = g.mul_mat_id(gate, x, ids).unwrap();
        let b = g.mul_mat_id(up, x, ids).unwrap();
        let a = g.unary(UnaryOp::Silu, a).unwrap();
        let h = g.mul(a, b).unwrap();
        let y = g.mul_mat_id(down, h, ids).unwrap();
        let plan = g.plan(&[y]).unwrap();
        let mut lw = Lowering {
            scratch_base: SCRATCH,
            ..Lowering::new(&fake_addr_any, true, 1)
        };
        lower_plan(&plan, &mut lw, false, |_| 0).unwrap()
    }

    /// A prefill's products of block-quantized experts run on the tensor cores: one
    /// grouping with its tiles for the three, one Q8_1 copy for the gate and up products'
    /// shared inputs and one for the down product's, both past the grouping in scratch,
    /// and every product reads the grouping and tiles the grouping wrote.
    #[test]
    fn prefill_experts_take_the_tensor_cores() {
        let ops = experts_block(DType::Q4_K, 64);
        let launches = kernel_launches(&ops);
        let ours: Vec<_> = launches
            .iter()
            .filter(|l| {
                ["mmq_id", "group", "quant"]
                    .iter()
                    .any(|p| l.kernel.name.starts_with(p))
            })
            .collect();
        let names: Vec<&str> = ours.iter().map(|l| l.kernel.name).collect();
        assert_eq!(
            names,
            [
                "group_by_expert",
                "quantize_q8_1_f32",
                "mmq_id_c16_q4_k",
                "mmq_id_c16_q4_k",
                "quantize_q8_1_f32",
                "mmq_id_c16_q4_k"
            ]
        );
        let group: MulMatIdArgs = args(ours[0]);
        // 128 columns of 8 experts: 128 / 8 = 16 a tile; at most 128 / 16 + 8 tiles
        assert_eq!((group.tile_bn, group.tiles), (16, 16));
        let end = [
            group.offsets,
            group.cols,
            group.tile_expert,
            group.tile_first,
        ]
        .iter()
        .max()
        .unwrap()
            + 16 * 4;
        let mmqs: Vec<MmqIdArgs> = [2, 3, 5].iter().map(|&i| args(ours[i])).collect();
        for p in &mmqs {
            assert_eq!(
                (p.offsets, p.cols, p.tile_expert, p.tile_first),
                (
                    group.offsets,
                    group.cols,
                    group.tile_expert,
                    group.tile_first
                )
            );
            assert!(p.b >= end, "the Q8_1 copy overlaps the grouping");
        }
        assert_eq!(mmqs[0].b, mmqs[1].b, "gate and up share their inputs' copy");
        assert_eq!((mmqs[0].b1, mmqs[2].b1, mmqs[2].n_used), (1, 2, 2));
        assert_eq!(ours[2].grid, (16, 4, 1));
    }

    /// Float experts and block types without tensor-core kernels keep the
    /// dequantizing kernel, grouped once for the three products.
    #[test]
    fn other_experts_keep_the_dequantizing_kernel() {
        for (dt, kernel) in [
            (DType::F16, "mul_mat_id_f16"),
            (DType::IQ4_XS, "mul_mat_id_iq4_xs"),
        ] {
            let ops = experts_block(dt, 64);
            let names: Vec<&str> = kernel_launches(&ops)
                .iter()
                .map(|l| l.kernel.name)
                .filter(|n| n.starts_with("mul_mat_id") || n.starts_with("group"))
                .collect();
            assert_eq!(names, ["group_by_expert", kernel, kernel, kernel]);
        }
    }
}
