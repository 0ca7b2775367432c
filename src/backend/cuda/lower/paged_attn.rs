//! Paged attention, `paged_attn` (`cuda/fattn_paged.cu`, whose header describes the
//! kernels): a batch of tokens of several sequences over a K/V pool of blocks. The grids
//! are fixed here by the shapes alone (tokens, heads, table, pool), since a plan is replayed
//! with new tables and positions; each block finds its work in the data.
//!
//! - Batches of more than [`DECODE_TOKENS`] tokens with K and V of one type and head dim
//!   64, 128 or 256 first launch the tensor-core kernel `fattn_paged_mma_d<D>_<kv>`, a block
//!   per tile of tokens and query head, which takes the runs of at least [`MIN_RUN`] tokens
//!   of one sequence (a prefill chunk). `fattn_paged_list` launches before it and lists
//!   the tokens it leaves.
//! - Every other token goes to one decode kernel, a block per token (with the list: a wave
//!   of blocks that take the listed tokens in turn, not a block per token of the chunk, of
//!   which at 512 tokens of Llama-2-7B 16,384 found nothing to do), KV head (or query
//!   heads) and chunk of its keys, `split` chunks for the longest sequence the table holds
//!   (flash-decoding, as `flash_attn_ext`'s decode: [`dec_split`], [`decode_split`]):
//!   `fattn_paged_dec_d<D>_f16` for GQA over F16 caches (tensor cores),
//!   `fattn_paged_vec_d<D>_<kv>` / `fattn_paged_vec4_d<D>_<kv>` (streamed through shared
//!   memory; vec4, 4 query heads a block with GQA, takes no list) for F16, BF16, Q8_0 and
//!   Q4_0 caches whose rows allow it, and
//!   `fattn_paged_any_d<D>` for the rest (K and V of different types, F32, other head dims).
//! - `fattn_paged_combine` merges the chunks when there can be more than one; the partials
//!   and each token's chunk count go to scratch. In a decode step whose next product reads
//!   Q8_1 activations (or an F16 copy) it also writes them ([`lower_writing`]), as
//!   `flash_attn_ext`'s combine does. With one chunk (no combine) the streamed and any-type
//!   decode kernels write an F16 copy themselves, as they write the rows.

use crate::backend::cuda::args::{
    PagedArgs, FATTN_COMBINE_THREADS, FATTN_LIST_MAX_TILES, FATTN_LIST_THREADS, FATTN_MMA_ROWS,
    FATTN_MMA_ROWS_D256, FATTN_VEC_WARPS, PAGED_BF16, PAGED_F16, PAGED_F32, PAGED_Q4_0, PAGED_Q8_0,
};
use crate::backend::cuda::decode::q8_1::{written_by_fused, Q8Copy};
use crate::backend::cuda::kernels::{dims, k, Kernel, KernelSet};
use crate::backend::cuda::lower::attention::{
    aligned_rows, dec_split, decode_split, same_columns, stream_unit, BLOCKS_PER_SM, DEC_ROWS,
    DEC_TILE, MIN_CHUNK, STREAM_ROWS,
};
use crate::backend::cuda::lowering::{row_grid, DevOp, Lowering, MAX_GRID_YZ, WARP};
use crate::backend::fusion::{Q8For, Q8Layout};
use crate::graph::{DType, Operand, PagedAttnParams};
use crate::quant::QType;

/// Batches of up to this many tokens (the engine's decode batches) run on the decode
/// kernels alone; a larger batch also launches the tensor-core kernel for its runs. An empty
/// launch of it would cost a decode step about as much as a short sequence's attention.
pub(crate) const DECODE_TOKENS: usize = 64;
/// Tokens of one sequence in a row, within one tile of the tensor-core kernel, from which it
/// takes them (one warp's 16 rows of its mma tiles): a shorter run is decoded token by token
/// with the keys split over blocks.
const MIN_RUN: usize = 16;

/// Lowers `paged_attn(q, k, v, table, seqs)` into `dst`.
pub(crate) fn lower(
    p: &PagedAttnParams,
    src: &[Operand],
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    lower_writing(p, src, dst, None, lw).map(|(ops, _)| ops)
}

/// Lowers `paged_attn(q, k, v, table, seqs)` into `dst`. `q8_for` holds the F32
/// activations that the next step, a decode product, reads as Q8_1
/// ([`crate::backend::fusion::Fused::Attention`]): when they are `dst` itself seen as
/// `[d * n_head, n_tokens]` and the step ends in `fattn_paged_combine` without the prefill
/// kernel, the combine writes every row as Q8_1 too, returned as the copy made, and the
/// product skips its quantizing launch.
pub(crate) fn lower_writing(
    p: &PagedAttnParams,
    src: &[Operand],
    dst: &Operand,
    q8_for: Option<&Q8For>,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let (kt, vt) = (&src[1], &src[2]);
    let sh = Shape::check(p, src)?;
    if sh.n_tokens == 0 {
        return Ok((Vec::new(), None));
    }
    let mut args = fixed_args(p, src, dst, &sh, lw)?;
    let prefill = sh.prefill(kt, vt, &mut args)?;
    let decode = sh.decode_kernel(kt, vt, prefill.is_some(), lw)?;
    let blocks = decode.heads * sh.n_tokens;
    let split = decode.split(sh.max_pos, blocks, lw.sms);
    args.split = split as i32;
    (args.min_keys, args.unit) = decode.chunk_keys();
    let mut ops = Vec::new();
    let mut offset = 0;
    let mut made = None;
    if split > 1 {
        let rows = sh.n_tokens * sh.n_head;
        args.part = lw.reserve_scratch(&mut offset, rows * split * (sh.d + 2) * 4);
        args.chunks = lw.reserve_scratch(&mut offset, sh.n_tokens * 4);
    }
    // the copy of the result the next product reads: written by the combine, or with one
    // chunk by the decode blocks that write the rows (an F16 copy, element by element)
    let copies = match split {
        1 => decode.kind != DecodeKind::Dec,
        _ => true,
    };
    let q8 = q8_for.filter(|q8| {
        let layout_ok = split > 1 || q8.layout == Q8Layout::F16;
        copies && layout_ok && prefill.is_none() && same_columns(q8.of, dst, sh.d)
    });
    if let Some(q8) = q8 {
        let ((addr, nb1, layout), copy) = written_by_fused(Some(q8), &mut offset, lw);
        (args.q8, args.q8_nb1, args.q8_layout) = (addr, nb1, layout);
        made = copy;
    }
    // with the prefill kernel, the decode blocks take the tokens it leaves from a list, a
    // wave of them rather than a block per token
    let mut tokens = sh.n_tokens;
    if let Some(m) = prefill {
        args.decoded = lw.reserve_scratch(&mut offset, (sh.n_tokens + 1) * 4);
        let threads = (FATTN_LIST_THREADS as u32, 1, 1);
        ops.push(DevOp::kernel(
            k::FATTN_PAGED_LIST,
            (1, 1, 1),
            threads,
            &args,
        ));
        ops.push(DevOp::kernel(m.kernel, m.grid, (m.threads, 1, 1), &args));
        tokens = (lw.sms * BLOCKS_PER_SM)
            .div_ceil(decode.heads * split)
            .clamp(1, sh.n_tokens);
    }
    let grid = (split as u32, decode.heads as u32, tokens as u32);
    let op = DevOp::kernel(decode.kernel, grid, (decode.threads, 1, 1), &args);
    ops.push(match decode.kind {
        // fattn_dec's launch: in order, its many one-warp blocks holding 18-35 KB of shared
        // memory each (lower/attention.rs)
        DecodeKind::Dec => op.in_order(),
        // fattn_vec1s's launch: at most BLOCKS_PER_SM blocks an SM
        DecodeKind::Stream => op.at_most_per_sm(BLOCKS_PER_SM as u32),
        DecodeKind::Any => op,
    });
    if split > 1 {
        let combine = DevOp::kernel(
            k::FATTN_PAGED_COMBINE,
            row_grid(sh.n_tokens * sh.n_head)?,
            (FATTN_COMBINE_THREADS as u32, 1, 1),
            &args,
        );
        ops.push(match decode.kind {
            DecodeKind::Dec => combine.in_order(),
            DecodeKind::Stream | DecodeKind::Any => combine,
        });
    }
    Ok((ops, made))
}

/// The arguments every launch of the step shares, before the decode split is chosen.
fn fixed_args(
    p: &PagedAttnParams,
    src: &[Operand],
    dst: &Operand,
    sh: &Shape,
    lw: &Lowering,
) -> Result<PagedArgs, String> {
    let (q, kt, vt) = (&src[0], &src[1], &src[2]);
    let (bs_magic, bs_shift) = fast_div(p.block_size as u32);
    Ok(PagedArgs {
        q: lw.t4(q),
        k: lw.t4(kt),
        v: lw.t4(vt),
        dst: lw.t4(dst),
        table: lw.addr(&src[3]),
        seqs: lw.addr(&src[4]),
        part: 0,
        chunks: 0,
        decoded: 0,
        q8: 0,
        q8_nb1: 0,
        q8_layout: 0,
        err: lw.err,
        tag: lw.tag,
        n_tokens: sh.n_tokens as i32,
        n_seqs: sh.n_seqs as i32,
        max_blocks: sh.max_blocks as i32,
        max_pos: sh.max_pos as i32,
        n_blocks: (kt.ne[1] / p.block_size) as i32,
        block_size: p.block_size as i32,
        bs_magic: bs_magic as i32,
        bs_shift: bs_shift as i32,
        // a window past the longest sequence hides nothing
        window: p.window.min(sh.max_pos) as i32,
        group: sh.group as i32,
        scale: p.scale,
        softcap: p.softcap,
        split: 1,
        min_keys: 1,
        unit: 1,
        tile: 0,
        min_run: 0,
        kv_vec: i32::from(aligned_rows(lw, kt, 16) && aligned_rows(lw, vt, 16)),
        k_type: type_code(kt.dtype)?,
        v_type: type_code(vt.dtype)?,
    })
}

/// A kernel, its grid and its threads a block.
struct Grid {
    kernel: Kernel<PagedArgs>,
    grid: (u32, u32, u32),
    threads: u32,
}

/// The shapes of a `paged_attn` step, checked against what the kernels take.
struct Shape {
    d: usize,
    n_head: usize,
    n_head_kv: usize,
    group: usize,
    n_tokens: usize,
    n_seqs: usize,
    max_blocks: usize,
    /// Positions a sequence can hold: `max_blocks * block_size`.
    max_pos: usize,
}

impl Shape {
    /// Checks what the kernels assume beyond the builder's checks: a head dim of the
    /// kernels, V rows of the head dim, dense K/V rows, whole blocks per row for the block
    /// types, and sizes within the grid and 32-bit positions.
    fn check(p: &PagedAttnParams, src: &[Operand]) -> Result<Shape, String> {
        let (q, kt, vt, table) = (&src[0], &src[1], &src[2], &src[3]);
        let d = q.ne[0];
        any_kernel(d)?;
        if vt.ne[0] != d {
            return Err(format!(
                "paged_attn: value rows of {} differ from the head dim {d}",
                vt.ne[0]
            ));
        }
        for (name, t) in [("K", kt), ("V", vt)] {
            if t.dtype.quant().is_some() && d % 32 != 0 {
                return Err(format!(
                    "paged_attn: a {} {name} pool needs whole blocks per row, not {d}",
                    t.dtype
                ));
            }
            if t.nb[0] != t.dtype.block_bytes() {
                return Err(format!(
                    "paged_attn: {name} rows must be dense (nb0 {} for {})",
                    t.nb[0], t.dtype
                ));
            }
        }
        let (n_head, n_tokens, n_head_kv) = (q.ne[1], q.ne[2], kt.ne[2]);
        let (max_blocks, n_seqs) = (table.ne[0], table.ne[1]);
        let max_pos = max_blocks.saturating_mul(p.block_size);
        let fits = |n: usize| i32::try_from(n).is_ok();
        if n_tokens > MAX_GRID_YZ || n_head > MAX_GRID_YZ {
            return Err(format!(
                "paged_attn: {n_tokens} tokens x {n_head} heads exceed the grid ({MAX_GRID_YZ} each)"
            ));
        }
        if !(fits(max_pos) && fits(n_seqs) && fits(kt.ne[1]) && fits(p.block_size)) {
            return Err(format!(
                "paged_attn: a table of {max_blocks} blocks of {} positions x {n_seqs} \
                 sequences over {} slots passes the kernels' 32-bit positions",
                p.block_size, kt.ne[1]
            ));
        }
        Ok(Shape {
            d,
            n_head,
            n_head_kv,
            group: n_head / n_head_kv,
            n_tokens,
            n_seqs,
            max_blocks,
            max_pos,
        })
    }

    /// The tensor-core prefill kernel, a block per tile of tokens and query head, for a
    /// batch of more than [`DECODE_TOKENS`] tokens with K and V of one type at a head dim
    /// it takes; it sets the tile and the shortest run it takes in `args`.
    fn prefill(
        &self,
        kt: &Operand,
        vt: &Operand,
        args: &mut PagedArgs,
    ) -> Result<Option<Grid>, String> {
        let Some(set) = mma_family(self.d) else {
            return Ok(None);
        };
        if self.n_tokens <= DECODE_TOKENS || kt.dtype != vt.dtype {
            return Ok(None);
        }
        let rows = if self.d > 128 {
            FATTN_MMA_ROWS_D256
        } else {
            FATTN_MMA_ROWS
        };
        if self.n_tokens.div_ceil(rows as usize) > FATTN_LIST_MAX_TILES as usize {
            return Err(format!(
                "paged_attn: {} tokens exceed the {FATTN_LIST_MAX_TILES} tiles of {rows} a step takes",
                self.n_tokens
            ));
        }
        args.tile = rows;
        args.min_run = MIN_RUN as i32;
        Ok(Some(Grid {
            kernel: set.get([kt.dtype])?,
            grid: (
                self.n_tokens.div_ceil(rows as usize) as u32,
                self.n_head as u32,
                1,
            ),
            threads: rows as u32 / 16 * WARP as u32,
        }))
    }

    /// The decode kernel for K `kt` and V `vt` (see the module docs); `listed`: it takes
    /// the tokens the prefill kernel leaves from a list, which the streamed kernel of
    /// several query heads does not (`fattn_paged_vec4` takes a token a block).
    fn decode_kernel(
        &self,
        kt: &Operand,
        vt: &Operand,
        listed: bool,
        lw: &Lowering,
    ) -> Result<Decode, String> {
        let dt = kt.dtype;
        let same = dt == vt.dtype;
        if let Some(set) = dec_family(self.d).filter(|_| same && dt == DType::F16 && self.group > 1)
        {
            return Ok(Decode {
                kind: DecodeKind::Dec,
                kernel: set.get([dt])?,
                heads: self.n_head_kv * self.group.div_ceil(DEC_ROWS),
                threads: WARP as u32,
            });
        }
        let streams = stream_unit(dt, self.d)
            .is_some_and(|u| aligned_rows(lw, kt, u) && aligned_rows(lw, vt, u));
        let streamed = vec_family(self.d, self.group > 1 && !listed).filter(|_| same && streams);
        if let Some((set, rows)) = streamed {
            return Ok(Decode {
                kind: DecodeKind::Stream,
                kernel: set.get([dt])?,
                heads: self.n_head_kv * self.group.div_ceil(rows),
                threads: (FATTN_VEC_WARPS as usize * WARP) as u32,
            });
        }
        Ok(Decode {
            kind: DecodeKind::Any,
            kernel: any_kernel(self.d)?,
            heads: self.n_head,
            threads: (FATTN_VEC_WARPS as usize * WARP) as u32,
        })
    }
}

/// Which decode kernel runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum DecodeKind {
    /// `fattn_paged_dec`: tensor cores, one warp a block.
    Dec,
    /// `fattn_paged_vec`, `fattn_paged_vec4`: streamed through shared memory.
    Stream,
    /// `fattn_paged_any`: any cache.
    Any,
}

/// A decode launch: its kernel, blocks per token and chunk (grid.y) and threads a block.
struct Decode {
    kind: DecodeKind,
    kernel: Kernel<PagedArgs>,
    heads: usize,
    threads: u32,
}

impl Decode {
    /// Chunks of the longest sequence (`max_pos` keys) for `blocks` blocks a chunk on a GPU
    /// of `sms` SMs, as `flash_attn_ext`'s decode splits its keys: whole 32-key tiles for the
    /// tensor-core kernel, one wave of blocks for the streamed one.
    fn split(&self, max_pos: usize, blocks: usize, sms: usize) -> usize {
        match self.kind {
            DecodeKind::Dec => dec_split(max_pos, blocks, sms).0,
            DecodeKind::Stream => decode_split(max_pos, blocks, true, sms).0,
            DecodeKind::Any => decode_split(max_pos, blocks, false, sms).0,
        }
    }

    /// The fewest keys a chunk holds and the multiple its keys are of (the kernel's
    /// `min_keys` and `unit`).
    fn chunk_keys(&self) -> (i32, i32) {
        match self.kind {
            DecodeKind::Dec => (1, DEC_TILE as i32),
            DecodeKind::Stream | DecodeKind::Any => (MIN_CHUNK as i32, 1),
        }
    }
}

/// `(magic, shift)` with `j / d == (umulhi(j, magic) + j) >> shift` for every `j < 2^31`
/// (`d` >= 1): the division by a block size the kernels do for every key.
pub(crate) fn fast_div(d: u32) -> (u32, u32) {
    let shift = (0..32).find(|&s| (1u64 << s) >= u64::from(d)).unwrap_or(32);
    let magic = ((1u64 << 32) * ((1u64 << shift) - u64::from(d))) / u64::from(d) + 1;
    (magic as u32, shift)
}

/// `fattn_paged_any`'s code for a K/V dtype.
fn type_code(dt: DType) -> Result<i32, String> {
    Ok(match dt {
        DType::F32 => PAGED_F32,
        DType::F16 => PAGED_F16,
        DType::BF16 => PAGED_BF16,
        DType::Quant(QType::Q8_0) => PAGED_Q8_0,
        DType::Quant(QType::Q4_0) => PAGED_Q4_0,
        DType::I32 | DType::Quant(_) => {
            return Err(format!("paged_attn has no kernel for a {dt} pool"));
        }
    })
}

/// The decode kernel for any cache at head dim `d`.
fn any_kernel(d: usize) -> Result<Kernel<PagedArgs>, String> {
    Ok(match d {
        16 => k::FATTN_PAGED_ANY_D16,
        32 => k::FATTN_PAGED_ANY_D32,
        64 => k::FATTN_PAGED_ANY_D64,
        80 => k::FATTN_PAGED_ANY_D80,
        96 => k::FATTN_PAGED_ANY_D96,
        112 => k::FATTN_PAGED_ANY_D112,
        128 => k::FATTN_PAGED_ANY_D128,
        256 => k::FATTN_PAGED_ANY_D256,
        d => {
            return Err(format!(
                "paged_attn: no kernel for head dim {d} (16, 32, 64, 80, 96, 112, 128, 256)"
            ))
        }
    })
}

/// The tensor-core decode kernels (F16) at head dim `d`.
fn dec_family(d: usize) -> Option<KernelSet<PagedArgs, 1>> {
    dims::FATTN_PAGED_DEC.get(d).ok()
}

/// The streamed decode kernels at head dim `d` and their query heads a block: with GQA
/// (`gqa`), [`STREAM_ROWS`] at head dims 128 and 256 (at 64, fattn_vec4s's Q8_0 kernel
/// spilled within the register bound of 4 blocks an SM), else one.
fn vec_family(d: usize, gqa: bool) -> Option<(KernelSet<PagedArgs, 1>, usize)> {
    match dims::FATTN_PAGED_VEC4.get(d) {
        Ok(set) if gqa => Some((set, STREAM_ROWS)),
        Ok(_) | Err(_) => dims::FATTN_PAGED_VEC.get(d).ok().map(|set| (set, 1)),
    }
}

/// The tensor-core prefill kernels at head dim `d`.
fn mma_family(d: usize) -> Option<KernelSet<PagedArgs, 1>> {
    dims::FATTN_PAGED_MMA.get(d).ok()
}

#[cfg(test)]
mod tests {
    use super::fast_div;

    /// The multiply-shift division agrees with `/` for every block size a pool takes
    /// (powers of two and others) over the positions a table holds.
    #[test]
    fn fast_div_divides() {
        let div = |j: u32, (magic, shift): (u32, u32)| {
            let hi = ((u64::from(j) * u64::from(magic)) >> 32) as u32;
            ((u64::from(hi) + u64::from(j)) >> shift) as u32
        };
        for d in (1..=300).chain([512, 1000, 4096, 65_537, 1 << 20, i32::MAX as u32]) {
            let m = fast_div(d);
            let probes = (0..5000u32)
                .chain((1..2000).map(|i| i * d.min(1 << 20)))
                .chain((1..2000).flat_map(|i| {
                    let a = i * d.min(1 << 20);
                    [a - 1, a + 1]
                }))
                .chain([i32::MAX as u32 - 1, i32::MAX as u32, (1 << 30) + 12345]);
            for j in probes.filter(|&j| j <= i32::MAX as u32) {
                assert_eq!(div(j, m), j / d, "{j} / {d}");
            }
        }
    }
}
