//! mul_mat with block-quantized weights on int8 tensor cores (`mmq_c<BN>_<q>`,
//! `mmq_split_c<BN>_<q>` and `mmq_reduce` in `cuda/mmq.cu`), for the products that
//! [`super::mul_mat_q`] gives it: more activation columns than the decode kernels take,
//! at most [`MMQ_MAX_COLS`] (the batched decode step of 8 to 64 sequences, a short prefill
//! chunk).
//!
//! - The activations `b` [k, n, b2, b3] (F32, dense rows, any strides) are quantized to
//!   Q8_1 once, as the decode products read them ([`q8_1::quantize_q8_1`] into scratch, in
//!   the layout of the weight type), or the copy a step before made is read instead (a
//!   fused norm or SwiGLU, or the product before of the same activations:
//!   [`Lowering::q8_1`]). All `n b2 b3` columns are the product's columns: the weights
//!   are one matrix, broadcast over the batches.
//! - A block of the kernel takes `MMQ_ROWS` (64) weight rows by a tile of 8, 16, 32 or 64
//!   columns ([`col_tile`]); frozen weights in split rows take `mmq_split_*`.
//! - A grid of too few blocks for the GPU splits K into parts ([`parts`]): part `z` writes
//!   its partial sums into scratch after the Q8_1 copy, and `mmq_reduce` adds them up into
//!   `dst` in order, so results are the same on every run.

use crate::backend::cuda::args::{
    MmqArgs, MmqReduceArgs, MMQ_K, MMQ_REDUCE_THREADS, MMQ_ROWS, MMQ_WARPS,
};
use crate::backend::cuda::decode::q8_1::{self, q8_1_column_bytes};
use crate::backend::cuda::kernels::{cols, k};
use crate::backend::cuda::lowering::{flat_grid, DevOp, Lowering, QuantPath, MAX_GRID_YZ, WARP};
use crate::backend::fusion::{quant_batched_layout, Q8Layout};
use crate::graph::Operand;

#[cfg(test)]
pub(super) mod tests;

/// Most activation columns (batches included) of the int8 tensor-core product where a
/// product is not a decode product ([`QuantPath::Auto`]). Its f32 work grows with the
/// columns (every 32-element sub-block of every (row, column) pair is scaled on its own)
/// while the F16 copy for cuBLAS costs the same at any width and its GEMM runs at F16
/// tensor-core rates, so past some width cuBLAS wins. `graft bench-ops` on an H200
/// (2026-12-02), the [4096, 11008] Q4_0 product, µs a node: 64 columns 51.9 here against
/// 60.7 with cuBLAS, 128 columns 104.4 against 62.6, 256 columns 187.9 against 70.0.
pub const MMQ_MAX_COLS: usize = 64;

/// Fewest activation columns from which a decode product whose weights have `mmq_*`
/// kernels takes the int8 tensor-core product rather than the decode kernels
/// ([`QuantPath::Auto`]; such a product's residual add is not fused into it, as the
/// decode kernels' epilogue would be). The decode kernels take 5 to 8 columns with their
/// 8-column form, which reads each weight once but every activation block once a column:
/// `graft bench-ops` on an H200 (2026-12-02), the [4096, 11008] Q4_0 product by 8
/// columns, 36.6 µs a node on the decode kernel against 19.7 here.
pub const MMQ_FROM_COLS: usize = 5;

const ROWS: usize = MMQ_ROWS as usize;
const CHUNK: usize = MMQ_K as usize;
// mmq_reduce's blocks are flat_grid's.
const _: () = assert!(MMQ_REDUCE_THREADS == 256);

/// Blocks per SM below which a product's K is split into parts: a block is `MMQ_WARPS`
/// warps, one per SM partition, which alone cannot hide the latency of their loads.
const MIN_BLOCKS_PER_SM: usize = 3;
/// Most parts of K (each part's partial sums are `m n` floats of scratch traffic).
const MAX_PARTS: usize = 8;
/// Fewest `MMQ_K`-element chunks of a part (a block's setup and its first loads are
/// spread over them).
const MIN_PART_CHUNKS: usize = 4;

/// Most activation columns of products on the int8 tensor cores under `path` (0: none),
/// the bound the fusion pass is given ([`crate::backend::fusion::Target`]).
pub(crate) fn max_cols(path: QuantPath) -> usize {
    match path {
        QuantPath::Auto => MMQ_MAX_COLS,
        QuantPath::Mmq => usize::MAX,
        QuantPath::Dequant => 0,
    }
}

/// Fewest activation columns from which a product in a decode layout takes the int8
/// tensor cores under `path` (`usize::MAX`: never), the bound the fusion pass is given
/// ([`crate::backend::fusion::Target`]).
pub(crate) fn from_cols(path: QuantPath) -> usize {
    match path {
        QuantPath::Auto => MMQ_FROM_COLS,
        QuantPath::Mmq => 1,
        QuantPath::Dequant => usize::MAX,
    }
}

/// Whether `a b` runs on the int8 tensor cores: block-quantized weights of a type with
/// `mmq_*` kernels in the batched layout ([`quant_batched_layout`]: one weight matrix,
/// whole blocks a row, F32 activations with dense rows) whose columns, batches included,
/// are at most [`max_cols`] of the lowering's path, and rows one grid holds. Decode
/// products take the decode kernels first (`decode::quant`) unless the path is
/// [`QuantPath::Mmq`].
pub(crate) fn takes(a: &Operand, b: &Operand, lw: &Lowering) -> bool {
    quant_batched_layout(a, b, max_cols(lw.quant_path))
        && cols::MMQ.get(8).and_then(|s| s.get([a.dtype])).is_ok()
        && a.ne[1] <= ROWS * MAX_GRID_YZ
}

/// The launches of `dst = a b` on the int8 tensor cores, or None when the product is not
/// one they take ([`takes`]).
pub(crate) fn lower(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    takes(a, b, lw).then(|| lower_taken(a, b, dst, lw))
}

fn lower_taken(
    a: &Operand,
    b: &Operand,
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (kk, m, n) = (a.ne[0], a.ne[1], b.nrows());
    let bn = col_tile(n);
    let family = match lw.weights_split(a)? {
        true => cols::MMQ_SPLIT,
        false => cols::MMQ,
    };
    let kernel = family.get(bn)?.get([a.dtype])?;
    let layout = Q8Layout::of(a.dtype);
    let mut ops = Vec::with_capacity(3);
    let q8 = q8_1::copy_of(b, layout, 0, lw, &mut ops)?;
    let col_bytes = q8_1_column_bytes(kk);
    let grid = (n.div_ceil(bn), m.div_ceil(ROWS));
    let (parts, chunks) = parts(grid.0 * grid.1, kk.div_ceil(CHUNK), lw.sms);
    // With parts of K, their partial sums go to scratch after the Q8_1 copy.
    let out = match parts {
        1 => lw.addr(dst),
        _ => lw.reserve_past_copy(q8, col_bytes * n, parts * m * n * 4),
    };
    let args = MmqArgs {
        a: lw.addr(a),
        b: q8,
        dst: out,
        k: kk as i64,
        m: m as i64,
        n: n as i64,
        a_nb1: a.nb[1] as i64,
        b_nb1: col_bytes as i64,
        chunks: chunks as i64,
        prefetch: i64::from(lw.read_only(a)),
    };
    let grid = (
        u32::try_from(grid.0).map_err(|_| format!("{n} columns"))?,
        grid.1 as u32,
        parts as u32,
    );
    let threads = (MMQ_WARPS as usize * WARP) as u32;
    ops.push(DevOp::kernel(kernel, grid, (threads, 1, 1), &args));
    if parts > 1 {
        ops.push(reduce(out, lw.addr(dst), m * n, parts));
    }
    Ok(ops)
}

/// `mmq_reduce`: the `split` parts of `count` partial sums at `part` added up in order
/// into `dst`.
fn reduce(part: u64, dst: u64, count: usize, split: usize) -> DevOp {
    let args = MmqReduceArgs {
        part,
        dst,
        count: count as i64,
        split: split as i64,
    };
    let (grid, block) = flat_grid(count);
    DevOp::kernel(k::MMQ_REDUCE, grid, block, &args)
}

/// The column tile of `mmq_*` for `n` columns: the narrowest of 8, 16, 32 and 64 that
/// holds them, 64 beyond (a tile reads its weights once, so wider tiles read them fewer
/// times; narrower ones compute fewer unused columns).
fn col_tile(n: usize) -> usize {
    n.next_power_of_two().clamp(8, 64)
}

/// How many parts K is split into for a grid of `tiles` blocks on `sms` SMs, and the
/// chunks of `MMQ_K` elements of each (the last part may have fewer): as few as give
/// every SM `MIN_BLOCKS_PER_SM` blocks, at most `MAX_PARTS`, each of `MIN_PART_CHUNKS`
/// chunks or more.
fn parts(tiles: usize, chunks: usize, sms: usize) -> (usize, usize) {
    let want = (MIN_BLOCKS_PER_SM * sms)
        .div_ceil(tiles.max(1))
        .clamp(1, MAX_PARTS)
        .min((chunks / MIN_PART_CHUNKS).max(1));
    let per = chunks.div_ceil(want);
    (chunks.div_ceil(per), per)
}
