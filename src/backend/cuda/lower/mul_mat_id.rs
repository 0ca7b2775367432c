//! mul_mat_id (`cuda/mul_mat_id.cu`, `cuda/mmq.cu`, `cuda/mul_mat_q.cu`): a decode step's
//! product of block-quantized experts runs each column on its expert's rows with the
//! decode kernels; any other product has `group_by_expert` sort the columns by expert into
//! scratch, then one of two products runs over each expert's columns:
//! - `mul_mat_vec_id_q_<type>` (decode: block-quantized weights of at most
//!   [`DECODE_MAX_TOKENS`] tokens, [`decode`]): the inputs quantized to Q8_1, then a
//!   block per 4 rows and column, each column's expert read by the one-column decode
//!   product (`mul_mat_vec_id_qd_<type>`, rows read in place, for Q4_K, Q5_K and IQ4_XS
//!   experts whose rows are all aligned for it: 16 bytes, IQ4_XS 8). No grouping: the ids
//!   are read by the kernel;
//! - `mmq_id_c<BN>_<type>` (block-quantized weights of a type with `mmq_*` kernels): the
//!   inputs quantized to Q8_1 once, each expert's columns in tiles of BN (listed by
//!   `group_by_expert`) on int8 tensor cores, each expert's rows read once a tile;
//! - `mul_mat_id_<type>` (any other weights): a block per tile of rows, expert and column
//!   chunk, each expert's rows dequantized once per chunk of its columns.
//!
//! A block's gate, up and down products share their ids: the grouping of the first serves
//! the next ones ([`Lowering::experts`]) while no step between them takes scratch or
//! writes the ids; the Q8_1 copy of the gate's inputs serves the up product too. A decode
//! product neither makes nor reads a grouping, and the scratch it takes for its Q8_1 copy
//! forgets the one there was ([`Lowering::reserve_scratch`]).

use super::{check_operands, lower_step};
use crate::backend::cuda::args::{
    MmqIdArgs, MulMatIdArgs, QGemvIdArgs, MMID_COLS, MMID_GROUP_THREADS, MMID_MAX_EXPERTS,
    MMID_ROWS, MMID_THREADS, MMQ_ROWS, MMQ_WARPS,
};
use crate::backend::cuda::decode::q8_1::{self, q8_1_column_bytes};
use crate::backend::cuda::decode::quant::in_place_alignment;
use crate::backend::cuda::decode::ROWS;
use crate::backend::cuda::kernels::{by, cols, k, Kernel};
use crate::backend::cuda::lowering::{
    expect_i32, row_grid, DevOp, ExpertGroups, ExpertTiles, Lowering, QuantPath, MAX_GRID_X,
    MAX_GRID_YZ, WARP,
};
use crate::backend::fusion::{ExpertPair, Q8Layout};
use crate::graph::{DType, Operand};

/// The grid's z at most: the column chunks of one expert that run side by side (a
/// prefill's experts have many; a decode step's one each).
const MAX_CHUNKS: usize = 32;

/// Most tokens of a product of block-quantized experts on the decode kernels
/// ([`decode`]). There each column reads its expert's rows, so an expert with `c` columns
/// is read `c` times, where the tensor-core product reads it once per tile of up to 8 of
/// its columns (but launches `n / 8 + n_expert` blocks per 64 rows, most of them idle,
/// and computes 8 columns for each tile of one or two). A token's experts are distinct,
/// so an expert has at most one column a token: at 4 tokens it is read at most 4 times,
/// the widths at which a plain product keeps its decode kernels (below
/// [`MMQ_FROM_COLS`](super::mmq::MMQ_FROM_COLS)). With 8 of 128 experts (Qwen3-30B-A3B)
/// 4 tokens' 32 columns fall on 29 experts on average: one read in 10 repeated, which L2
/// may serve. Set from these read counts; not yet timed against the tensor-core product.
pub(crate) const DECODE_MAX_TOKENS: usize = 4;

/// Most tokens of a product of block-quantized experts on the decode kernels under
/// `path` (none when it is forced onto the tensor cores): what the fusion pass is told
/// ([`crate::backend::fusion::Target::expert_decode_tokens`]).
pub(crate) fn decode_tokens(path: QuantPath) -> usize {
    match path {
        QuantPath::Mmq => 0,
        QuantPath::Auto | QuantPath::Mmh | QuantPath::Dequant => DECODE_MAX_TOKENS,
    }
}

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
    if let Some(ops) = decode(w, b, ids, dst, None, lw) {
        return ops;
    }
    if tiles > MAX_GRID_X {
        return Err(format!("mul_mat_id with {m} rows exceeds the grid"));
    }
    let tiled = tiled_kernel(w, dst, n, n_expert);
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

/// Two decode products of experts with the same inputs and ids ([`ExpertPair`]) as one
/// launch of the decode kernels, the second in the grid's upper half of rows; each as its
/// own step where the pair does not take them (which the fusion pass rules out).
pub(crate) fn lower_pair(p: &ExpertPair, lw: &mut Lowering) -> Result<Vec<DevOp>, String> {
    let (one, two) = (p.first, p.second);
    check_operands(one, lw)?;
    check_operands(two, lw)?;
    let second = Some((&two.src[0], &two.dst));
    if let Some(ops) = decode(&one.src[0], &one.src[1], &one.src[2], &one.dst, second, lw) {
        return ops;
    }
    let mut ops = lower_step(one, lw)?;
    ops.extend(lower_step(two, lw)?);
    Ok(ops)
}

/// The launches of a decode step's product (None when it is not one): block-quantized
/// weights of a type with decode kernels, whole blocks a row, at most
/// [`DECODE_MAX_TOKENS`] tokens, results dense along dim 0, and not forced onto the tensor
/// cores ([`QuantPath::Mmq`]). The Q8_1 copy of `b` (or the one an earlier step made, as
/// the gate's for the up product) is read by `mul_mat_vec_id_q*_<type>`, a grid row of
/// blocks a column `i + n_used * t`. Like the tensor-core path it reads Q8_1 inputs
/// whatever [`Lowering::mmvq`] says. `second`: the experts and result of a second
/// product of the same inputs and ids in the same launch ([`lower_pair`]).
fn decode(
    w: &Operand,
    b: &Operand,
    ids: &Operand,
    dst: &Operand,
    second: Option<(&Operand, &Operand)>,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    let (kk, m, n_expert) = (w.ne[0], w.ne[1], w.ne[2]);
    let (n_used, n_tokens) = (ids.ne[0], ids.ne[1]);
    // a pair's second product takes a second grid row of blocks a column
    let pair = 1 + usize::from(second.is_some());
    let takes = n_tokens <= decode_tokens(lw.quant_path)
        && pair * n_used * n_tokens <= MAX_GRID_YZ
        && q8_1_experts(w, dst);
    if !takes {
        return None;
    }
    let a = lw.addr(w);
    let a2 = second.map(|(w2, _)| lw.addr(w2));
    let align = in_place_alignment(w.dtype);
    let aligned = [Some(a), a2]
        .into_iter()
        .flatten()
        .all(|a| a.is_multiple_of(align as u64))
        && w.nb[1].is_multiple_of(align)
        && w.nb[2].is_multiple_of(align);
    let in_place = by::MUL_MAT_VEC_ID_QD
        .get([w.dtype])
        .ok()
        .filter(|_| aligned);
    let kernel = in_place.or_else(|| by::MUL_MAT_VEC_ID_Q.get([w.dtype]).ok())?;
    let grid = match row_grid(m.div_ceil(ROWS)) {
        Ok((x, _, _)) => (x, (pair * n_used * n_tokens) as u32, 1),
        Err(e) => return Some(Err(e)),
    };
    let layout = Q8Layout::of(w.dtype);
    let mut ops = Vec::with_capacity(2);
    let q8 = match q8_1::copy_of(b, layout, 0, lw, &mut ops) {
        Ok(addr) => addr,
        Err(e) => return Some(Err(e)),
    };
    let args = QGemvIdArgs {
        a,
        b: q8,
        ids: lw.addr(ids),
        dst: lw.addr(dst),
        err: lw.err,
        tag: lw.tag,
        k: kk as i64,
        m: m as i64,
        a_nb1: w.nb[1] as i64,
        a_nb2: w.nb[2] as i64,
        b_nb1: q8_1_column_bytes(kk) as i64,
        ids_nb0: ids.nb[0] as i64,
        ids_nb1: ids.nb[1] as i64,
        dst_nb1: dst.nb[1] as i64,
        dst_nb2: dst.nb[2] as i64,
        n_used: n_used as i64,
        b1: b.ne[1] as i64,
        n_expert: n_expert as i64,
        a2: a2.unwrap_or(0),
        dst2: second.map_or(0, |(_, d2)| lw.addr(d2)),
    };
    ops.push(DevOp::kernel(
        kernel,
        grid,
        ((ROWS * WARP) as u32, 1, 1),
        &args,
    ));
    Some(Ok(ops))
}

/// Whether the experts `w` and the result `dst` suit the products on Q8_1 inputs:
/// block-quantized weights in whole blocks a row, rows short enough for the kernels'
/// 32-bit counts, results dense along dim 0.
fn q8_1_experts(w: &Operand, dst: &Operand) -> bool {
    let kk = w.ne[0];
    w.dtype.quant().is_some()
        && kk.is_multiple_of(w.dtype.block_size())
        && kk < i32::MAX as usize
        && dst.nb[0] == 4
}

/// The `mmq_id_*` kernel of the product and its column tile, when it takes one: weights of
/// a type with `mmq_*` kernels ([`q8_1_experts`]) and an expert's rows one grid holds. The
/// tile is the narrowest that holds an expert's share of the columns when the ids spread
/// evenly.
fn tiled_kernel(
    w: &Operand,
    dst: &Operand,
    n: usize,
    n_expert: usize,
) -> Option<(Kernel<MmqIdArgs>, usize)> {
    let bn = n.div_ceil(n_expert).next_power_of_two().clamp(8, 64);
    let takes = q8_1_experts(w, dst)
        && w.ne[1] <= MMQ_ROWS as usize * MAX_GRID_YZ
        && n.div_ceil(bn) + n_expert <= MAX_GRID_X;
    let kernel = cols::MMQ_ID.get(bn).and_then(|s| s.get([w.dtype])).ok();
    kernel.filter(|_| takes).map(|k| (k, bn))
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
    let q8 = q8_1::copy_of(b, layout, groups.end, lw, &mut ops)?;
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
mod tests;
