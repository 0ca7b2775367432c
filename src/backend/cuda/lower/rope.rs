//! Rope (`cuda/rope.cu`): a row per `threadIdx.y` (several per block when there are many
//! rows); the inverse frequencies go into the plan's constant region. Also the fused
//! `rope_store` launch of a decode step's attention inputs (q and k roped, k and v written
//! into the cache; the fusion pass picks the steps: [`RopeStore`]).

use crate::backend::cuda::args::{RopeArgs, RopeStoreArgs, Tensor4};
use crate::backend::cuda::decode::fold::NormFoldOut;
use crate::backend::cuda::kernels::by;
use crate::backend::cuda::lowering::{
    expect_i32, loop_block, row_grid, same_dtype, DevOp, Lowering, MAX_GRID_X, WARP,
};
use crate::backend::fusion::RopeStore;
use crate::graph::{Operand, RopeMode, RopeParams};

/// Checks that rows of `a` can take rope `p` at positions `pos`; the frequency table's
/// address in the constant region.
fn freqs(p: &RopeParams, a: &Operand, pos: &Operand, lw: &mut Lowering) -> Result<u64, String> {
    expect_i32("rope positions", pos)?;
    if !p.n_dims.is_multiple_of(2) || p.n_dims > a.ne[0] {
        return Err(format!(
            "rope n_dims {} does not fit rows of {}",
            p.n_dims, a.ne[0]
        ));
    }
    let freqs: Vec<u8> = p.inv_freqs().iter().flat_map(|f| f.to_ne_bytes()).collect();
    Ok(lw.push_consts(&freqs))
}

/// Threads per block for rope rows of `ne0` elements, `n_dims` of them rotated.
fn rope_block(p: &RopeParams, ne0: usize) -> (u32, u32, u32) {
    loop_block((p.n_dims / 2).max(ne0 - p.n_dims))
}

/// `src[0]` rotated by the positions `src[1]` into `dst` (same dtype).
pub(crate) fn lower(
    p: &RopeParams,
    src: &[Operand],
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (a, pos) = (&src[0], &src[1]);
    same_dtype("rope", a, dst)?;
    let kernel = by::ROPE.get([a.dtype])?;
    let freqs = freqs(p, a, pos, lw)?;
    let args = RopeArgs {
        src: lw.t4(a),
        dst: lw.t4(dst),
        pos: lw.addr(pos),
        pos_nb0: pos.nb[0] as i64,
        freqs,
        n_dims: p.n_dims as i64,
        neox: i64::from(p.mode == RopeMode::Neox),
    };
    let (threads, _, _) = rope_block(p, a.ne[0]);
    let rows = dst.nrows();
    let per_block = rows_per_block(rows, threads);
    Ok(vec![DevOp::kernel(
        kernel,
        row_grid(rows.div_ceil(per_block as usize))?,
        (threads, per_block, 1),
        &args,
    )])
}

/// Rows from which `rope` and `rope_store` take several rows per block.
const MANY_ROPE_ROWS: usize = 1024;

/// Rope rows a block of `threads` threads a row takes, of `rows` in all: a prefill's rows
/// are short and many, several a block (256 threads), so that blocks are not mostly launch
/// and setup; fewer rows keep one a block.
fn rows_per_block(rows: usize, threads: u32) -> u32 {
    match rows >= MANY_ROPE_ROWS {
        true => (256 / threads).max(1),
        false => 1,
    }
}

/// Tokens of a step from which `rope_store` takes its 16-byte path (half the threads,
/// twice the bytes in flight each): a prompt's chunk, whose launch is many waves of the
/// GPU. On an H200 (2026-12-03), Llama-2-7B: a 512-token chunk's launch took 27-29 µs
/// under ncu, and prompts ran 3-6% faster than before it; decode steps of 8 to 64
/// sequences (a wave or less) ran 0.2-2.5% slower on it.
const VEC_TOKENS: usize = 128;

/// Whether the rows of `t` are dense elements of `es` bytes starting 16-byte aligned
/// (`rope_store`'s 16-byte loads and stores).
fn dense16(t: &Tensor4, es: i64) -> bool {
    let strides_ok = (1..4).all(|d| t.ne[d] <= 1 || t.nb[d] % 16 == 0);
    t.nb[0] == es && t.data.is_multiple_of(16) && strides_ok
}

/// Threads per block of the V part of `rope_store` (a grid-stride element loop).
const V_BLOCK: usize = 256;

/// The `rope_store_<cache>` launch of `s`, scaling q, k and v by `fold`'s factor when given.
pub(crate) fn lower_store(
    s: &RopeStore,
    fold: Option<&NormFoldOut>,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    let (k, cache) = s.k;
    let kernel = by::ROPE_STORE.get([cache.dtype])?;
    let freqs = freqs(s.p, k, s.pos, lw)?;
    // row ids[i2] of the cache holds k's heads (i1) one after another
    let k_dst = Tensor4 {
        data: lw.addr(cache),
        ne: k.ne.map(|n| n as i64),
        nb: [
            cache.nb[0] as i64,
            (k.ne[0] * cache.nb[0]) as i64,
            cache.nb[1] as i64,
            cache.nb[2] as i64,
        ],
    };
    let none = Tensor4 {
        data: 0,
        ne: [0; 4],
        nb: [0; 4],
    };
    let (q_src, q_dst, q_rows) = match s.q {
        Some((qs, qd)) => (lw.t4(qs), lw.t4(qd), qs.nrows()),
        None => (none, none, 0),
    };
    let k_src = lw.t4(k);
    let v = s.v.map(|(vs, vd)| (lw.t4(vs), lw.t4(vd)));
    let es = cache.dtype.block_bytes() as i64;
    // rows normed first take a warp each (rope_row_normed)
    let normed = s.q_norm.is_some() || s.k_norm.is_some();
    let vec = !normed
        && k.ne[2] * k.ne[3] >= VEC_TOKENS
        && s.p.n_dims.is_multiple_of(4)
        && (q_rows == 0 || (dense16(&q_src, 4) && dense16(&q_dst, 4)))
        && dense16(&k_src, 4)
        && dense16(&k_dst, es)
        && v.is_none_or(|(vs, vd)| vs.ne[0] % 8 == 0 && dense16(&vs, 4) && dense16(&vd, es));
    // several rows a block as `rope` takes them; one a block of V_BLOCK threads when
    // there are few rows and v's elements are copied too
    let (row_threads, _, _) = match (normed, vec) {
        (true, _) => (WARP as u32, 1, 1),
        (false, true) => loop_block((s.p.n_dims / 4).max(k.ne[0] - s.p.n_dims)),
        (false, false) => rope_block(s.p, k.ne[0]),
    };
    let per_block = rows_per_block(q_rows + k.nrows(), row_threads);
    let threads = match per_block == 1 && s.v.is_some() && !normed {
        true => V_BLOCK as u32,
        false => row_threads,
    };
    let block_threads = (threads * per_block) as usize;
    // v's elements, or its chunks of 8 with `vec`, a thread each
    let per_thread = if vec { 8 } else { 1 };
    let (v_src, v_dst, v_blocks) = match v {
        Some((vs, vd)) => {
            let n = vs.ne.iter().product::<i64>() as usize / per_thread;
            (vs, vd, n.div_ceil(block_threads).clamp(1, 1 << 16))
        }
        None => (none, none, 0),
    };
    let rows = |n: usize| n.div_ceil(per_block as usize);
    let blocks = rows(q_rows) + rows(k.nrows()) + v_blocks;
    if blocks > MAX_GRID_X {
        return Err(format!(
            "{blocks} rope and cache rows exceed the grid limit of {MAX_GRID_X}"
        ));
    }
    let args = RopeStoreArgs {
        q_src,
        q_dst,
        k_src,
        k_dst,
        v_src,
        v_dst,
        ids: lw.t4(s.ids),
        pos: lw.addr(s.pos),
        pos_nb0: s.pos.nb[0] as i64,
        freqs,
        n_dims: s.p.n_dims as i64,
        neox: i64::from(s.p.mode == RopeMode::Neox),
        q_rows: q_rows as i64,
        k_rows: k.nrows() as i64,
        v_blocks: v_blocks as i64,
        slots: cache.ne[1] as i64,
        err: lw.err,
        tag: lw.tag,
        fold_scale: NormFoldOut::scale_of(fold),
        vec: i64::from(vec),
        q_norm: s.q_norm.map_or(0, |n| lw.addr(n.w)),
        k_norm: s.k_norm.map_or(0, |n| lw.addr(n.w)),
        q_eps: s.q_norm.map_or(0.0, |n| n.eps),
        k_eps: s.k_norm.map_or(0.0, |n| n.eps),
    };
    if normed && fold.is_some() {
        return Err("internal: a rope_store launch with both a folded norm and row norms".into());
    }
    Ok(vec![DevOp::kernel(
        kernel,
        (blocks as u32, 1, 1),
        (threads, per_block, 1),
        &args,
    )])
}
