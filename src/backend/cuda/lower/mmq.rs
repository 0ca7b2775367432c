//! mul_mat with block-quantized weights on tensor cores, for the products that
//! [`super::mul_mat_q`] gives it: more activation columns than the decode kernels take,
//! at most [`MMQ_MAX_COLS`] (the batched decode step of 8 to 64 sequences, a short prefill
//! chunk). Below [`MMH_FROM_COLS`] columns the int8 tensor cores (`mmq_c<BN>_<q>`,
//! `mmq_split_c<BN>_<q>` in `cuda/mmq.cu`), from there on F16 ones: `mmr_c<BN>_<q>`,
//! `mmr_split_c<BN>_<q>` (`cuda/mmr.cu`, the weights unpacked in registers) for the
//! 32-element types, `mmh_c<BN>_<q>`, `mmh_split_c<BN>_<q>` (`cuda/mmh.cu`, unpacked into
//! shared memory) for the K-quants; `mmq_reduce` adds up parts of K.
//!
//! - On int8 tensor cores, the activations `b` [k, n, b2, b3] (F32, dense rows, any
//!   strides) are quantized to Q8_1 once, as the decode products read them
//!   ([`q8_1::quantize_q8_1`] into scratch, in the layout of the weight type), or the copy
//!   a step before made is read instead (a fused norm or SwiGLU, or the product before of
//!   the same activations: [`Lowering::q8_1`]). On F16 ones they are converted to F16
//!   columns once (or the product before of the same activations made the copy:
//!   [`Lowering::f16`]). All `n b2 b3` columns are the product's columns: the weights are
//!   one matrix, broadcast over the batches.
//! - A block of the kernel takes `MMQ_ROWS` (64; `mmr_*`: `MMR_ROWS`, 128) weight rows by a
//!   tile of 8, 16, 32 or 64 columns ([`col_tile`]); frozen weights in split rows take
//!   `*_split_*`.
//! - A grid of too few blocks for the GPU splits K into parts ([`parts`]): part `z` writes
//!   its partial sums into scratch after the activations' copy, and `mmq_reduce` adds them up into
//!   `dst` in order, so results are the same on every run.

use super::cpy::copy_to;
use super::mul_mat::{padded, Out};
use crate::backend::cuda::args::{
    MmqArgs, MmqReduceArgs, MMH_K, MMQ_K, MMQ_REDUCE_THREADS, MMQ_ROWS, MMQ_WARPS, MMR_K, MMR_ROWS,
    MMR_WARPS,
};
use crate::backend::cuda::decode::q8_1::{self, q8_1_column_bytes};
use crate::backend::cuda::kernels::{cols, k, KeyedSets};
use crate::backend::cuda::lowering::{
    flat_grid, DevOp, Lowering, QuantPath, MAX_GRID_YZ, REGION_ALIGN, WARP,
};
use crate::backend::fusion::{quant_batched_layout, Q8Layout, MAX_DECODE_COLS};
use crate::graph::{DType, Operand};
use crate::quant::QType;

#[cfg(test)]
pub(super) mod tests;

/// Most activation columns (batches included) of the tensor-core products where a
/// product is not a decode product ([`QuantPath::Auto`]). The int8 product's f32 work
/// grows with the columns (every 32-element sub-block of every (row, column) pair is
/// scaled on its own) while the F16 copy for cuBLAS costs the same at any width and its
/// GEMM runs at F16 tensor-core rates, so past some width cuBLAS wins. `graft bench-ops`
/// on an H200 (2026-12-02), the [4096, 11008] Q4_0 product, µs a node: 64 columns 51.9 on
/// the int8 product against 60.7 with cuBLAS, 128 columns 104.4 against 62.6, 256 columns
/// 187.9 against 70.0. The F16 tensor-core product (42.3 at 64 columns, 2026-12-04) has
/// not been timed past 64.
pub const MMQ_MAX_COLS: usize = 64;

/// Fewest activation columns from which a decode product whose weights have `mmq_*`
/// kernels takes the int8 tensor-core product rather than the decode kernels
/// ([`QuantPath::Auto`]; such a product's residual add is not fused into it, as the
/// decode kernels' epilogue would be). The decode kernels take 5 to 8 columns with their
/// 8-column form, which reads each weight once but every activation block once a column:
/// `graft bench-ops` on an H200 (2026-12-02), the [4096, 11008] Q4_0 product by 8
/// columns, 36.6 µs a node on the decode kernel against 19.7 here.
pub const MMQ_FROM_COLS: usize = 5;

/// Fewest activation columns from which a batched product takes the F16 tensor cores
/// (`mmh_*`) rather than the int8 ones ([`QuantPath::Auto`]): the int8 product scales
/// every sub-block of every (row, column) pair in f32, work that grows with the columns,
/// while the F16 one unpacks each weight to F16 once a tile and leaves the rest to the
/// tensor cores. More than the decode widths, so that the fusion pass's decode products
/// (whose residual add is not fused from [`MMQ_FROM_COLS`] on) all read Q8_1.
pub const MMH_FROM_COLS: usize = 16;
const _: () = assert!(MMH_FROM_COLS > MAX_DECODE_COLS);

/// An F16 copy of F32 activations in scratch, as `mmh_*` reads them (columns of
/// [`f16_column_bytes`]): the next product of the same activations on F16 tensor cores
/// reads it ([`Lowering::f16`]).
#[derive(Clone, Debug)]
pub struct F16Copy {
    /// The activations.
    pub of: Operand,
    /// The copy's address.
    pub addr: u64,
}
const CHUNK: usize = MMQ_K as usize;
// mmq_reduce's blocks are flat_grid's.
const _: () = assert!(MMQ_REDUCE_THREADS == 256);

/// Blocks of `mmq_*` and `mmh_*` per SM below which a product's K is split into parts: a
/// block is `MMQ_WARPS` warps, one per SM partition, which alone cannot hide the latency of
/// their loads.
const MIN_BLOCKS_PER_SM: usize = 3;
/// Blocks of `mmr_*` of weights `dt` by `bn` columns an SM holds (their launch bound,
/// build/instances.rs): one of 64 columns and Q8_0's of 32, two of the others.
fn mmr_per_sm(dt: DType, bn: usize) -> usize {
    if bn == 64 || (bn == 32 && dt == DType::Quant(QType::Q8_0)) {
        1
    } else {
        2
    }
}
/// Most parts of K (each part's partial sums are `m n` floats of scratch traffic).
const MAX_PARTS: usize = 8;
/// Fewest `MMQ_K`-element chunks of a part (a block's setup and its first loads are
/// spread over them).
const MIN_PART_CHUNKS: usize = 4;

/// Most activation columns of products on the tensor cores (int8 or F16) under `path`
/// (0: none).
pub(crate) fn max_cols(path: QuantPath) -> usize {
    match path {
        QuantPath::Auto => MMQ_MAX_COLS,
        QuantPath::Mmq | QuantPath::Mmh => usize::MAX,
        QuantPath::Dequant => 0,
    }
}

/// Most activation columns of products of the 256-element types on the int8 tensor cores
/// under `path` (0: none), which read Q8_1 activations: the bound the fusion pass is
/// given ([`crate::backend::fusion::Target`]).
pub(crate) fn q8_cols(path: QuantPath) -> usize {
    match path {
        QuantPath::Auto => MMH_FROM_COLS - 1,
        QuantPath::Mmq => usize::MAX,
        QuantPath::Mmh | QuantPath::Dequant => 0,
    }
}

/// The same for the 32-element types, whose products take `mmr_*` on the F16 tensor cores
/// from [`MMQ_FROM_COLS`] when `mmr` ([`f16_from_cols`]).
pub(crate) fn q8_cols_32(path: QuantPath, mmr: bool) -> usize {
    match (path, mmr) {
        (QuantPath::Auto, true) => MMQ_FROM_COLS - 1,
        _ => q8_cols(path),
    }
}

/// Fewest activation columns from which a batched product of weights `dt` takes the F16
/// tensor cores under [`QuantPath::Auto`]: every width the tensor cores take
/// ([`MMQ_FROM_COLS`]) for the types of `mmr_*` (when `mmr`, the backend's default), which
/// beat the int8 product from the narrowest tile on (`graft bench-ops` on an H200,
/// 2026-12-04, Q4_0 by 8 columns, µs a node: [4096, 4096] 7.63 against 10.86,
/// [4096, 11008] 15.58 against 22.70, [11008, 4096] 15.66 against 20.77), and
/// [`MMH_FROM_COLS`] for the others. The fusion pass is told the same ([`q8_cols_32`]), so
/// a fused step before such a product writes its F16 copy.
pub fn f16_from_cols(dt: DType, mmr: bool) -> usize {
    match mmr && has_mmr(dt) {
        true => MMQ_FROM_COLS,
        false => MMH_FROM_COLS,
    }
}

/// Whether weights `dt` have `mmr_*` kernels.
fn has_mmr(dt: DType) -> bool {
    cols::MMR.get(8).and_then(|s| s.get([dt])).is_ok()
}

/// Whether a product of `n` columns of weights `dt` on the tensor cores takes the F16 ones
/// under `path` (`mmr`: whether `mmr_*` may).
fn f16_cores(n: usize, path: QuantPath, dt: DType, mmr: bool) -> bool {
    match path {
        QuantPath::Auto => n >= f16_from_cols(dt, mmr),
        QuantPath::Mmh => true,
        QuantPath::Mmq | QuantPath::Dequant => false,
    }
}

/// Fewest activation columns from which a product in a decode layout takes the tensor
/// cores under `path` (`usize::MAX`: never), the bound the fusion pass is given
/// ([`crate::backend::fusion::Target`]).
pub(crate) fn from_cols(path: QuantPath) -> usize {
    match path {
        QuantPath::Auto => MMQ_FROM_COLS,
        QuantPath::Mmq | QuantPath::Mmh => 1,
        QuantPath::Dequant => usize::MAX,
    }
}

/// Bytes of one column of `k` activations in F16 as `mmh_*` reads them (16-byte aligned).
pub(crate) fn f16_column_bytes(k: usize) -> usize {
    (2 * k).next_multiple_of(16)
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
        && a.ne[1] <= MMQ_ROWS as usize * MAX_GRID_YZ
}

/// The launches of `dst = a b` on the int8 tensor cores, or None when the product is not
/// one they take ([`takes`]).
pub(crate) fn lower(
    a: &Operand,
    b: &Operand,
    out: Out,
    lw: &mut Lowering,
) -> Option<Result<Vec<DevOp>, String>> {
    takes(a, b, lw).then(|| lower_taken(a, b, out, lw))
}

/// The kernel family of a product on the tensor cores and its geometry.
struct Family {
    kernels: KeyedSets<MmqArgs, 1>,
    /// Weight rows a block takes.
    rows: usize,
    /// Elements of K a block takes per step (`chunks` counts them).
    chunk: usize,
    /// Threads of a block.
    threads: usize,
    /// Blocks an SM holds (the minimum of the kernels' launch bounds).
    per_sm: usize,
    /// Whether K is split by whole waves of blocks ([`parts_in_waves`]) rather than until
    /// every SM has `per_sm` blocks ([`parts`]).
    waves: bool,
}

/// The family of a product of weights `dt` (in split rows when `split`) by column tiles of
/// `bn`, on the F16 tensor cores when `f16`: `mmr_*` for the 32-element types there
/// (unless `mmr` is off), whose weights unpack in registers, `mmh_*` for the others.
fn family(dt: DType, split: bool, f16: bool, mmr: bool, bn: usize) -> Family {
    let mmr = f16 && mmr && has_mmr(dt);
    let ((plain, in_split), rows, chunk, warps, per_sm) = match (f16, mmr) {
        (false, _) => (
            (cols::MMQ, cols::MMQ_SPLIT),
            MMQ_ROWS,
            MMQ_K,
            MMQ_WARPS,
            MIN_BLOCKS_PER_SM,
        ),
        (true, false) => (
            (cols::MMH, cols::MMH_SPLIT),
            MMQ_ROWS,
            MMH_K,
            MMQ_WARPS,
            MIN_BLOCKS_PER_SM,
        ),
        (true, true) => (
            (cols::MMR, cols::MMR_SPLIT),
            MMR_ROWS,
            MMR_K,
            MMR_WARPS,
            mmr_per_sm(dt, bn),
        ),
    };
    Family {
        kernels: if split { in_split } else { plain },
        rows: rows as usize,
        chunk: chunk as usize,
        threads: warps as usize * WARP,
        per_sm,
        waves: mmr,
    }
}

fn lower_taken(
    a: &Operand,
    b: &Operand,
    Out { dst, add }: Out,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (kk, m, n) = (a.ne[0], a.ne[1], b.nrows());
    let bn = col_tile(n);
    let f16 = f16_cores(n, lw.quant_path, a.dtype, lw.mmr);
    let fam = family(a.dtype, lw.weights_split(a)?, f16, lw.mmr, bn);
    let kernel = fam.kernels.get(bn)?.get([a.dtype])?;
    let mut ops = Vec::with_capacity(3);
    let (act, col_bytes) = match f16 {
        true => (f16_copy_of(b, &mut 0, lw, &mut ops)?, f16_column_bytes(kk)),
        false => {
            let q8 = q8_1::copy_of(b, Q8Layout::of(a.dtype), 0, lw, &mut ops)?;
            (q8, q8_1_column_bytes(kk))
        }
    };
    let chunk = fam.chunk;
    let grid = (n.div_ceil(bn), m.div_ceil(fam.rows));
    let (tiles, slots) = (grid.0 * grid.1, fam.per_sm * lw.sms);
    let (parts, chunks) = match fam.waves {
        // a part's partial sums (4 bytes a row and column, written and read back in L2, at
        // about a quarter of the cost of reading as many bytes of weights) against the
        // weights' bytes
        true => parts_in_waves(tiles, kk.div_ceil(chunk), slots, chunk, {
            2.0 * n as f64 / a.nb[1] as f64
        }),
        false => parts(tiles, kk.div_ceil(chunk), slots, chunk),
    };
    // With parts of K, their partial sums go to scratch after the activations' copy.
    let out = match parts {
        1 => lw.addr(dst),
        _ => lw.reserve_past_copy(act, col_bytes * n, parts * m * n * 4),
    };
    // a fused residual add: by the kernel with one part, else by the reduction
    let res = add.map_or(0, |r| lw.addr(r));
    let args = MmqArgs {
        a: lw.addr(a),
        b: act,
        dst: out,
        k: kk as i64,
        m: m as i64,
        n: n as i64,
        a_nb1: a.nb[1] as i64,
        b_nb1: col_bytes as i64,
        chunks: chunks as i64,
        prefetch: i64::from(lw.read_only(a)),
        res: if parts == 1 { res } else { 0 },
    };
    let grid = (
        u32::try_from(grid.0).map_err(|_| format!("{n} columns"))?,
        grid.1 as u32,
        parts as u32,
    );
    ops.push(DevOp::kernel(
        kernel,
        grid,
        (fam.threads as u32, 1, 1),
        &args,
    ));
    if parts > 1 {
        ops.push(reduce(out, lw.addr(dst), m * n, parts, res));
    }
    Ok(ops)
}

/// The address of the F16 copy of the F32 columns `b` [k, n, b2, b3] that `mmh_*`,
/// `mmr_*` and cuBLAS with F16 weights read (columns of [`f16_column_bytes`] one after the
/// other): the one a step before made ([`Lowering::f16`]: a product of the same
/// activations, or the fused step that computed them), else a copy into scratch at
/// `*offset`, its launch pushed onto `ops`. Either way `*offset` ends past the copy.
pub(crate) fn f16_copy_of(
    b: &Operand,
    offset: &mut usize,
    lw: &mut Lowering,
    ops: &mut Vec<DevOp>,
) -> Result<u64, String> {
    let dense = padded(b, DType::F16);
    debug_assert_eq!(dense.nb[1], f16_column_bytes(b.ne[0]));
    if let Some(c) = lw.f16.as_ref().filter(|c| c.of == *b) {
        let end = (c.addr - lw.scratch_base) as usize + dense.nbytes();
        *offset = (*offset).max(end.next_multiple_of(REGION_ALIGN));
        return Ok(c.addr);
    }
    let addr = lw.reserve_scratch(offset, dense.nbytes());
    ops.push(copy_to(lw, b, &dense, addr)?);
    lw.f16 = Some(F16Copy {
        of: b.clone(),
        addr,
    });
    Ok(addr)
}

/// `mmq_reduce`: the `split` parts of `count` partial sums at `part` added up in order
/// into `dst`, plus the residual at `res` (0: none).
fn reduce(part: u64, dst: u64, count: usize, split: usize, res: u64) -> DevOp {
    let args = MmqReduceArgs {
        part,
        dst,
        count: count as i64,
        split: split as i64,
        res,
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

/// How many parts K is split into for a grid of `tiles` blocks where the GPU holds
/// `slots` at once, and the chunks of `chunk` elements (`MMQ_K`, `MMH_K` or `MMR_K`) of
/// each (the last part may have fewer): as few as fill the slots, at most `MAX_PARTS`,
/// each of `MIN_PART_CHUNKS` chunks of `MMQ_K` elements or more.
fn parts(tiles: usize, chunks: usize, slots: usize, chunk: usize) -> (usize, usize) {
    let want = slots
        .div_ceil(tiles.max(1))
        .clamp(1, most_parts(chunks, chunk));
    split_chunks(chunks, want)
}

/// Most parts `chunks` chunks of `chunk` elements may be split into: `MAX_PARTS`, each of
/// `MIN_PART_CHUNKS` chunks of `MMQ_K` elements or more (at least one part).
fn most_parts(chunks: usize, chunk: usize) -> usize {
    let min_chunks = MIN_PART_CHUNKS * CHUNK / chunk;
    MAX_PARTS.min((chunks / min_chunks).max(1))
}

/// `chunks` chunks in about `want` parts of equal chunks (the last may have fewer): the
/// count of parts and the chunks of each.
fn split_chunks(chunks: usize, want: usize) -> (usize, usize) {
    let per = chunks.div_ceil(want);
    (chunks.div_ceil(per), per)
}

/// How many parts K is split into for a grid of `tiles` blocks of `mmr_*` where the GPU
/// holds `slots` at once, and the chunks of `chunk` elements of each: of the counts up to
/// `MAX_PARTS` (each of `MIN_PART_CHUNKS` chunks of `MMQ_K` elements or more), the fewest
/// that minimize whole waves of blocks (each block taking a part of K) plus the partial
/// sums' traffic, `extra` of the weights' bytes a part. Its blocks hold their weights'
/// loads in flight through the whole part, so a wave that is mostly empty costs nearly a
/// full one: [11008, 4096] by 8 columns (86 tiles) on 264 slots takes 3 parts, one wave,
/// where filling the slots (4 parts) takes two.
fn parts_in_waves(
    tiles: usize,
    chunks: usize,
    slots: usize,
    chunk: usize,
    extra: f64,
) -> (usize, usize) {
    let cost = |p: usize| {
        let waves = (tiles * p).div_ceil(slots.max(1)) as f64 / p as f64;
        waves + if p > 1 { p as f64 * extra } else { 0.0 }
    };
    // min_by keeps the first of equal costs: the fewest parts
    let want = (1..=most_parts(chunks, chunk))
        .min_by(|&a, &b| cost(a).total_cmp(&cost(b)))
        .unwrap_or(1);
    split_chunks(chunks, want)
}
