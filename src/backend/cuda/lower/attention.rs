//! Fused attention, `flash_attn_ext` (`cuda/fattn.cu`). Up to [`DECODE_MAX_QUERIES`]
//! queries, flash-decoding: the keys split into chunks over blocks, then `fattn_combine`
//! when there is more than one chunk. F16 caches with more than one query row per KV head
//! take the tensor-core kernel `fattn_dec_d<D>_f16` (one warp per 16 query rows of a KV
//! head); the other cases the CUDA-core kernel `fattn_vec_d<D>_<kv>`
//! (`fattn_vec1_d<D>_<kv>` when each KV head has a single query row: MHA decode;
//! `fattn_vec1s_d<D>_<kv>`, K/V streamed through shared memory, for F16 and BF16 caches
//! with 16-byte aligned rows and Q8_0 and Q4_0 caches of head dims 64, 128 and 256 with
//! 4-byte or 8-byte aligned rows; the latter also with GQA and one query as
//! `fattn_vec4s_d<D>_<kv>`, a block per 4 query heads of a KV head (head dims 128 and 256),
//! or `fattn_vec1s`, a block per query head (64, or a mask per head)), exact in F32 and
//! BF16. Beyond that the tensor-core prefill kernel `fattn_mma_d<D>_<kv>`, after
//! `fattn_kv_range` when there is a mask (the live keys of each block of query rows, so
//! that masked tiles are never loaded). The ALiBi slope of every head goes into the
//! constant region, the decode partials and key ranges into scratch, and so does the Q8_1
//! copy of the result that `fattn_combine` writes for a quantized product after it.

use crate::backend::cuda::args::{
    FattnArgs, FATTN_COMBINE_THREADS, FATTN_MMA_KEYS, FATTN_MMA_ROWS, FATTN_MMA_ROWS_D256,
    FATTN_RANGE_KEYS, FATTN_RANGE_ROWS, FATTN_RANGE_THREADS, FATTN_VEC_ROWS, FATTN_VEC_UNROLL,
    FATTN_VEC_WARPS,
};
use crate::backend::cuda::decode::q8_1::{act_code, q8_1_copy, Q8Copy};
use crate::backend::cuda::kernels::{dims, k, Kernel, KernelSet, KeyedSets};
use crate::backend::cuda::lowering::{row_grid, DevOp, Lowering, MAX_GRID_YZ, WARP};
use crate::backend::fusion::{Q8For, Q8Layout};
use crate::graph::{DType, FlashAttnParams, Operand};
use crate::quant::QType;

/// Queries up to which the decode kernel runs (it handles any count, slowly for many).
pub(crate) const DECODE_MAX_QUERIES: usize = 8;
/// Blocks per SM the decode split aims for: a block of 4 warps keeps 4 keys' K and V
/// rows per lane group in flight, and 4 such blocks per SM hide the memory latency.
pub(crate) const BLOCKS_PER_SM: usize = 4;
/// Scores (queries x keys) from which a masked prefill first finds the live keys of each
/// block of rows (`fattn_kv_range`). Measured on an H100 (one launch of 32 heads, head dim
/// 128, causal): 8,192 x 8,192 took 5.67 ms without and 3.56 ms with it; 512 x 512 35 µs
/// without and 43 µs with it, and 1,024 x 4,096 429 µs without and 447 with it.
const RANGE_MIN_SCORES: usize = 1 << 24;
/// Query heads per block of `fattn_vec4s` and `fattn_paged_vec4` (the `R` of their
/// instances in build/instances.rs and cuda/fattn_paged.cu).
pub(crate) const STREAM_ROWS: usize = 4;
/// Fewest keys per decode block of the CUDA-core kernel when the keys are split.
pub(crate) const MIN_CHUNK: usize = 64;
/// Most chunks of one row's keys (`fattn_combine` loads two chunks' (max, sum) a lane).
const MAX_SPLIT: usize = 64;
/// Query rows per block of the tensor-core decode kernel: the 16 rows of its mma tiles.
pub(crate) const DEC_ROWS: usize = 16;
/// Keys per chunk of the tensor-core decode kernel are a multiple of this (its key tile).
pub(crate) const DEC_TILE: usize = FATTN_MMA_KEYS as usize;
/// Blocks (one warp each) per SM the tensor-core decode split aims for. Measured on an
/// H100 (F16 cache, head dim 128): 8 KV heads x 16,640 keys took 35.6 µs in 48 chunks
/// (384 blocks) and 39.8 µs in 58; 32 KV heads x 4,352 keys 34.8 µs in 12 chunks and
/// 38.5 µs in 46.
const DEC_BLOCKS_PER_SM: usize = 3;

// The prefill kernel turns pairs of 8-key score tiles into the 16-wide A operand of P.V,
// and its blocks are whole warps of 16 query rows.
const _: () = assert!(FATTN_MMA_KEYS % 16 == 0 && FATTN_MMA_ROWS % 16 == 0);
const _: () = assert!(FATTN_MMA_ROWS_D256 % 16 == 0);
// A decode chunk of MIN_CHUNK keys is at least one whole step of the head-dim-128 kernel
// (FATTN_VEC_WARPS warps x 2 key groups x FATTN_VEC_UNROLL keys).
const _: () = assert!(MIN_CHUNK >= (FATTN_VEC_WARPS * 2 * FATTN_VEC_UNROLL) as usize);

/// Lowers `flash_attn_ext(q, k, v, mask?)` into `dst`.
pub(crate) fn lower(
    p: &FlashAttnParams,
    src: &[Operand],
    dst: &Operand,
    lw: &mut Lowering,
) -> Result<Vec<DevOp>, String> {
    lower_writing(p, src, dst, None, lw).map(|(ops, _)| ops)
}

/// Lowers `flash_attn_ext(q, k, v, mask?)` into `dst`. `q8_for` holds the F32 activations
/// that the next step, a decode product, reads as Q8_1 ([`crate::backend::fusion::Fused::Attention`]): when they
/// are `dst` itself seen as `[d * n_head, n_q * batch]` and the decode ends in
/// `fattn_combine`, the combine also writes them as Q8_1, returned as the copy made, and
/// the product skips its quantizing launch.
pub(crate) fn lower_writing(
    p: &FlashAttnParams,
    src: &[Operand],
    dst: &Operand,
    q8_for: Option<&Q8For>,
    lw: &mut Lowering,
) -> Result<(Vec<DevOp>, Option<Q8Copy>), String> {
    let (q, kt, vt, mask) = (&src[0], &src[1], &src[2], src.get(3));
    let d = check(q, kt, vt, dst)?;
    let (n_q, n_head, batch) = (q.ne[1], q.ne[2], q.ne[3]);
    let (n_kv, n_head_kv) = (kt.ne[1], kt.ne[2]);
    let slopes: Vec<u8> = (0..n_head)
        .flat_map(|h| p.slope(h, n_head).to_ne_bytes())
        .collect();
    let mut args = FattnArgs {
        q: lw.t4(q),
        k: lw.t4(kt),
        v: lw.t4(vt),
        mask: mask.map(|m| lw.t4(m)).unwrap_or_default(),
        dst: lw.t4(dst),
        part: 0,
        range: 0,
        slopes: lw.push_consts(&slopes),
        scale: p.scale,
        softcap: p.softcap,
        mask_f16: i32::from(mask.is_some_and(|m| m.dtype == DType::F16)),
        kv_vec: i32::from(aligned_rows(lw, kt, 16) && aligned_rows(lw, vt, 16)),
        group: (n_head / n_head_kv) as i64,
        split: 1,
        chunk: n_kv as i64,
        q8: 0,
        q8_nb1: 0,
        q8_layout: 0,
    };
    if n_q > DECODE_MAX_QUERIES {
        let rows = if d > 128 {
            FATTN_MMA_ROWS_D256
        } else {
            FATTN_MMA_ROWS
        } as usize;
        let grid = (n_q.div_ceil(rows) as u32, n_head as u32, batch as u32);
        let kernel = at_dim(dims::FATTN_MMA, d)?.get([kt.dtype])?;
        let block = ((rows / 16 * WARP) as u32, 1, 1);
        let mut ops = Vec::new();
        if let Some(m) = mask.filter(|_| n_q * n_kv >= RANGE_MIN_SCORES) {
            ops.push(live_key_ranges(m, n_q, n_kv, &mut args, lw)?);
        }
        ops.push(DevOp::kernel(kernel, grid, block, &args));
        return Ok((ops, None));
    }
    let decode = Decode {
        d,
        n_q,
        n_head,
        n_head_kv,
        batch,
        n_kv,
        streams: stream_unit(kt.dtype, d)
            .is_some_and(|u| aligned_rows(lw, kt, u) && aligned_rows(lw, vt, u)),
        mask_per_head: mask.is_some_and(|m| m.ne[2] > 1),
        q8_for: q8_for
            .filter(|q8| same_columns(q8.of, dst, d))
            .map(|q8| (q8.of.clone(), q8.layout)),
    };
    match kt.dtype {
        // Several rows per KV head (GQA, or several queries): the tensor-core kernel
        // reads each K/V tile once for all of them (it took a Llama-3-8B decode at
        // 16,384 keys from 95 to 149 tok/s on an H100); one row per KV head (MHA decode)
        // stays on the one-row CUDA-core kernel: level with it after 512 tokens
        // (Llama-2-7B F16 186.3-186.9 against 185.9-186.1 tok/s, Q4_0 378-380 against
        // 380-381), faster after 4,096 (164.5 against 159.5)
        DType::F16 if n_q * n_head > n_head_kv => decode.mma(args, lw),
        // F32 and BF16: exact in the cache's precision (the tensor-core kernel rounds K
        // and V to F16); the quantized caches: measured faster (a one-warp block would
        // load and convert each tile with nothing to hide it behind); an I32 cache has no
        // kernel, which the kernel set's lookup names
        DType::F16 | DType::F32 | DType::BF16 | DType::I32 | DType::Quant(_) => {
            decode.vec(kt.dtype, args, lw)
        }
    }
}

/// Whether `b` is the dense F32 result `dst` [d, n_head, n_q, batch] seen as columns
/// `[d * n_head, n_q * batch]` (the same bytes), with whole 32-element Q8_1 blocks per head
/// (also `paged_attn`'s result [d, n_head, n_tokens]).
pub(crate) fn same_columns(b: &Operand, dst: &Operand, d: usize) -> bool {
    let cols = dst.ne[2] * dst.ne[3];
    d.is_multiple_of(32)
        && b.dtype == DType::F32
        && b.loc == dst.loc
        && b.is_contiguous()
        && dst.is_contiguous()
        && b.ne == [dst.ne[0] * dst.ne[1], cols, 1, 1]
}

/// The shape of a decode: head dim, queries, query heads, KV heads, batches, keys; and
/// the operand of the next decode product that the combine may also write as Q8_1.
struct Decode {
    d: usize,
    n_q: usize,
    n_head: usize,
    n_head_kv: usize,
    batch: usize,
    n_kv: usize,
    /// Whether the cache's rows suit the streamed kernel `fattn_vec1s` ([`stream_unit`]).
    streams: bool,
    /// Whether the mask has more than one head (`ne[2] > 1`: the heads of a group may
    /// read different mask rows, so they cannot share a `fattn_vec4s` block).
    mask_per_head: bool,
    /// The activations of the decode product after it, which the combine writes as Q8_1
    /// too, and their layout.
    q8_for: Option<(Operand, Q8Layout)>,
}

impl Decode {
    /// The tensor-core decode kernel `fattn_dec_d<D>_f16`: one warp per block, up to
    /// [`DEC_ROWS`] rows of one KV head over a chunk of whole key tiles. It launches in
    /// order ([`DevOp::in_order`]): its blocks hold 18-35 KB of shared memory each.
    fn mma(&self, mut args: FattnArgs, lw: &mut Lowering) -> Result<Launches, String> {
        let row_blocks = (self.n_q * self.n_head / self.n_head_kv).div_ceil(DEC_ROWS);
        let blocks = self.grid_rows(row_blocks)?;
        let (split, chunk) = dec_split(self.n_kv, blocks, lw.sms);
        args.split = split as i64;
        args.chunk = chunk as i64;
        let kernel = at_dim(dims::FATTN_DEC, self.d)?.get([DType::F16])?;
        let grid = (split as u32, self.n_head_kv as u32, blocks as u32);
        self.launch(kernel, grid, WARP as u32, Order::InOrder, args, lw)
    }

    /// The CUDA-core decode kernel `fattn_vec_d<D>_<kv>`; for one row per KV head (MHA
    /// decode) `fattn_vec1_d<D>_<kv>` (one accumulator in registers instead of
    /// FATTN_VEC_ROWS), or `fattn_vec1s_d<D>_<kv>` where the cache's rows allow it
    /// ([`stream_unit`]: K/V streamed through shared memory, in one wave of blocks, one
    /// block per query head). The one-query GQA decode of quantized caches is streamed
    /// too: `fattn_vec4s_d<D>_<kv>`, a block per [`STREAM_ROWS`] query heads of a KV head
    /// (head dims 128 and 256), or `fattn_vec1s` (head dim 64, or a mask per head).
    fn vec(&self, dt: DType, mut args: FattnArgs, lw: &mut Lowering) -> Result<Launches, String> {
        let group = self.n_head / self.n_head_kv;
        let one = self.n_q * group == 1;
        // GQA over a quantized cache: K/V rows copied whole by cp.async, against
        // fattn_vec's 2-byte register loads of the blocks, and dequantized once for 4 query
        // heads (Llama-3-8B, Q8_0 cache, H200: after 4,096 tokens 164.1 tok/s on fattn_vec,
        // 0.93x llama.cpp's, 187.4 with a block per query head, 1.07x; after 16,384 tokens
        // 133.7 with a block per query head, 150.8 with 4, 1.10x)
        let gqa = self.n_q == 1 && matches!(dt, DType::Quant(_));
        let streamed = (one || gqa) && self.streams;
        let four = if streamed && gqa && group > 1 && !self.mask_per_head {
            dims::FATTN_VEC4S.get(self.d).ok()
        } else {
            None
        };
        // the kernels, the blocks along the grid's y and the row blocks per batch along its z
        let (set, heads, row_blocks) = match (one, streamed, four) {
            (_, _, Some(set)) => (set, self.n_head_kv * group.div_ceil(STREAM_ROWS), 1),
            (_, true, None) => (at_dim(dims::FATTN_VEC1S, self.d)?, self.n_head, 1),
            (true, false, None) => (at_dim(dims::FATTN_VEC1, self.d)?, self.n_head_kv, 1),
            (false, false, None) => (
                at_dim(dims::FATTN_VEC, self.d)?,
                self.n_head_kv,
                (self.n_q * group).div_ceil(FATTN_VEC_ROWS as usize),
            ),
        };
        let blocks = self.grid_rows(row_blocks)?;
        let (split, chunk) = decode_split(self.n_kv, heads * blocks, streamed, lw.sms);
        args.split = split as i64;
        args.chunk = chunk as i64;
        let grid = (split as u32, heads as u32, blocks as u32);
        let block = (FATTN_VEC_WARPS as usize * WARP) as u32;
        // The streamed kernel's one wave, launched while rope_store still runs, at most
        // BLOCKS_PER_SM blocks an SM (5 fit): Llama-2-7B F16 after 4,096 tokens 216.8 ->
        // 219.7 tok/s on an H200 (the same with 4 an SM through its registers).
        let order = Order::Early {
            per_sm: if streamed { BLOCKS_PER_SM as u32 } else { 0 },
        };
        self.launch(set.get([dt])?, grid, block, order, args, lw)
    }

    /// Blocks along the grid's z (`row_blocks` per batch), checked against its limit.
    fn grid_rows(&self, row_blocks: usize) -> Result<usize, String> {
        let blocks = self.batch * row_blocks;
        if blocks > MAX_GRID_YZ {
            return Err(format!(
                "flash_attn_ext: {} batches x {row_blocks} row blocks exceed the grid",
                self.batch
            ));
        }
        Ok(blocks)
    }

    /// The decode launch (see [`Order`]), then `fattn_combine` over scratch partials when
    /// the keys are split (in order too after an in-order kernel), which also writes the
    /// Q8_1 copy of [`Decode::q8_for`] when there is one.
    fn launch(
        &self,
        kernel: Kernel<FattnArgs>,
        grid: (u32, u32, u32),
        threads: u32,
        order: Order,
        mut args: FattnArgs,
        lw: &mut Lowering,
    ) -> Result<Launches, String> {
        let (split, rows) = (args.split as usize, self.n_head * self.n_q * self.batch);
        let mut made = None;
        if split > 1 {
            let mut offset = 0;
            args.part = lw.reserve_scratch(&mut offset, rows * split * (self.d + 2) * 4);
            if let Some((b, layout)) = &self.q8_for {
                let (addr, col) = q8_1_copy(b, *layout, &mut offset, lw);
                (args.q8, args.q8_nb1, args.q8_layout) = (addr, col as i64, act_code(*layout));
                made = Some(Q8Copy {
                    of: b.clone(),
                    addr,
                    layout: *layout,
                });
            }
        }
        let op = DevOp::kernel(kernel, grid, (threads, 1, 1), &args);
        let (op, in_order) = match order {
            Order::InOrder => (op.in_order(), true),
            Order::Early { per_sm } => (op.at_most_per_sm(per_sm), false),
        };
        if split == 1 {
            return Ok((vec![op], made));
        }
        let mut combine = DevOp::kernel(
            k::FATTN_COMBINE,
            row_grid(rows)?,
            (FATTN_COMBINE_THREADS as u32, 1, 1),
            &args,
        );
        if in_order {
            // With programmatic dependent launch the combine's blocks, and through them
            // the next product's, became resident while the tensor-core kernel ran:
            // Llama-3-8B F16 decoded at 158-159 tok/s that way and at 170.8 in order
            // (H100, -p 512 -n 128; the classic chain 171-173).
            combine = combine.in_order();
        }
        Ok((vec![op, combine], made))
    }
}

/// A decode's launches and the Q8_1 copy of its result they write, if any.
type Launches = (Vec<DevOp>, Option<Q8Copy>);

/// How a decode kernel launches.
#[derive(Clone, Copy)]
enum Order {
    /// Once the kernel before has ended ([`DevOp::in_order`]).
    InOrder,
    /// While the kernel before ends, at most `per_sm` blocks an SM (0: any number;
    /// [`DevOp::at_most_per_sm`]).
    Early { per_sm: u32 },
}

/// The `fattn_kv_range` launch before the prefill kernel: for every [`FATTN_RANGE_ROWS`]
/// query rows x [`FATTN_RANGE_KEYS`] keys of each mask head, the first and last key whose
/// mask entry is not -inf (into scratch, `args.range`), so that the prefill kernel skips
/// the key tiles no row of its block sees (past the diagonal of a causal mask).
fn live_key_ranges(
    m: &Operand,
    n_q: usize,
    n_kv: usize,
    args: &mut FattnArgs,
    lw: &mut Lowering,
) -> Result<DevOp, String> {
    let groups = n_q.div_ceil(FATTN_RANGE_ROWS as usize);
    let chunks = n_kv.div_ceil(FATTN_RANGE_KEYS as usize);
    let heads = m.ne[2] * m.ne[3];
    if groups > MAX_GRID_YZ || heads > MAX_GRID_YZ || i32::try_from(n_kv).is_err() {
        return Err(format!(
            "flash_attn_ext: {n_q} queries x {n_kv} keys x {heads} mask heads exceed the \
             prefill kernel's key ranges"
        ));
    }
    let mut offset = 0;
    args.range = lw.reserve_scratch(&mut offset, groups * chunks * heads * 8);
    Ok(DevOp::kernel(
        k::FATTN_KV_RANGE,
        (chunks as u32, groups as u32, heads as u32),
        (FATTN_RANGE_THREADS as u32, 1, 1),
        args,
    ))
}

/// Checks what the kernels assume beyond the builder's checks; returns the head dim.
fn check(q: &Operand, kt: &Operand, vt: &Operand, dst: &Operand) -> Result<usize, String> {
    let d = q.ne[0];
    if vt.ne[0] != d {
        return Err(format!(
            "flash_attn_ext: value rows of {} differ from the head dim {d}",
            vt.ne[0]
        ));
    }
    if kt.dtype != vt.dtype {
        return Err(format!(
            "flash_attn_ext: K {} and V {} must have one dtype",
            kt.dtype, vt.dtype
        ));
    }
    if kt.dtype.quant().is_some() && !d.is_multiple_of(32) {
        return Err(format!(
            "flash_attn_ext: a {} cache needs whole blocks per row, not {d}",
            kt.dtype
        ));
    }
    for (name, t) in [("K", kt), ("V", vt)] {
        if t.nb[0] != t.dtype.block_bytes() {
            return Err(format!(
                "flash_attn_ext: {name} rows must be dense (nb0 {} for {})",
                t.nb[0], t.dtype
            ));
        }
    }
    if dst.ne[1] > MAX_GRID_YZ || kt.ne[2] > MAX_GRID_YZ || q.ne[3] > MAX_GRID_YZ {
        return Err("flash_attn_ext: too many heads or batches for the grid".into());
    }
    Ok(d)
}

/// The kernels of head dim `d` of a family ([`dims`]), or the error naming the head dims
/// there are.
fn at_dim(family: KeyedSets<FattnArgs, 1>, d: usize) -> Result<KernelSet<FattnArgs, 1>, String> {
    family.get(d).map_err(|e| format!("flash_attn_ext: {e}"))
}

/// Whether every row of `t` starts `align`-byte aligned (16: the kernels' vector loads).
pub(crate) fn aligned_rows(lw: &Lowering, t: &Operand, align: u64) -> bool {
    lw.addr(t).is_multiple_of(align)
        && (1..4).all(|i| t.ne[i] == 1 || (t.nb[i] as u64).is_multiple_of(align))
}

/// The alignment the streamed decode kernel `fattn_vec1s` needs of the starts of K/V rows
/// of `d` elements of `dt` (the size of its copies, `KvRow` in cuda/fattn.cu): 16 bytes
/// for F16 and BF16; for Q8_0 and Q4_0, 8 where a row's bytes are a multiple of 8 (head
/// dims 128 and 256), 4 where they are a multiple of 4 (64). None: no streamed kernel
/// (other types; Q8_0 and Q4_0 rows of head dims 32 and 96, 2-byte multiples).
pub(crate) fn stream_unit(dt: DType, d: usize) -> Option<u64> {
    let bytes = match dt {
        DType::F16 | DType::BF16 => return Some(16),
        DType::Quant(QType::Q8_0 | QType::Q4_0) => dt.row_bytes(d),
        DType::F32 | DType::I32 | DType::Quant(_) => return None,
    };
    [8, 4].into_iter().find(|u| bytes % *u as usize == 0)
}

/// Chunks and keys per chunk of the tensor-core decode kernel, `blocks` blocks per chunk:
/// chunks of whole tiles, enough of them to fill a GPU of `sms` SMs with
/// [`DEC_BLOCKS_PER_SM`] blocks per SM; a short cache (two tiles a chunk or less) is
/// latency-bound and gets one tile a chunk. Measured on an H100 (F16 cache): head dim 64,
/// 3 KV heads, 768 keys took 7.0 µs with the combine in 24 chunks and 8.5 in 12; head dim
/// 128, 32 KV heads, 768 keys 9.7 µs in 24 chunks and 10.5 in 12.
pub(crate) fn dec_split(n_kv: usize, blocks: usize, sms: usize) -> (usize, usize) {
    let tiles = n_kv.div_ceil(DEC_TILE).max(1);
    let want = (sms * DEC_BLOCKS_PER_SM)
        .div_ceil(blocks.max(1))
        .clamp(1, MAX_SPLIT);
    let mut per = tiles.div_ceil(want);
    if per <= 2 {
        per = 1;
    }
    let chunk = per.max(tiles.div_ceil(MAX_SPLIT)) * DEC_TILE;
    (n_kv.div_ceil(chunk).max(1), chunk)
}

/// Chunks and keys per chunk of the decode kernel: enough chunks that `blocks` blocks per
/// chunk fill a GPU of `sms` SMs with [`BLOCKS_PER_SM`] blocks per SM, each of at least
/// [`MIN_CHUNK`] keys (fewer keys: one chunk). `one_wave` rounds the chunks down, so that
/// the blocks fit the GPU at once (the streamed kernel, whose blocks each keep a stage in
/// flight from start to end: H200, 32 KV heads x 4,352 keys, 23.9 µs in 16 chunks and
/// 29.4 in 23, two waves).
pub(crate) fn decode_split(
    n_kv: usize,
    blocks: usize,
    one_wave: bool,
    sms: usize,
) -> (usize, usize) {
    let slots = sms * BLOCKS_PER_SM;
    let want = if one_wave {
        (slots / blocks.max(1)).max(1)
    } else {
        slots.div_ceil(blocks.max(1))
    };
    let split = want.min(n_kv / MIN_CHUNK).clamp(1, MAX_SPLIT);
    let chunk = n_kv.div_ceil(split).max(1);
    (n_kv.div_ceil(chunk).max(1), chunk)
}

#[cfg(test)]
mod tests {
    use super::{dec_split, decode_split, BLOCKS_PER_SM, DEC_TILE, MAX_SPLIT};

    #[test]
    fn decode_split_fills_the_gpu_with_whole_chunks() {
        // Llama-2-7B decode on 132 SMs: 32 KV heads, 4096 keys.
        let (split, chunk) = decode_split(4096, 32, false, 132);
        assert_eq!((split, chunk), (17, 241));
        assert!(split * chunk >= 4096 && (split - 1) * chunk < 4096);
        // in one wave: 16 chunks of 32 blocks fit 132 SMs x 4
        assert_eq!(decode_split(4352, 32, true, 132), (16, 272));
        assert_eq!(decode_split(768, 32, true, 132), (12, 64));
        assert_eq!(decode_split(16_640, 32, true, 132), (16, 1040));
        for one_wave in [false, true] {
            assert_eq!(decode_split(1, 1, one_wave, 132), (1, 1));
            assert_eq!(decode_split(100, 1, one_wave, 132), (1, 100));
            assert_eq!(decode_split(100, 10_000, one_wave, 132), (1, 100));
            let (s, c) = decode_split(1999, 8, one_wave, 132);
            assert!(s * c >= 1999 && (s - 1) * c < 1999 && c >= 64);
        }
    }

    #[test]
    fn decode_split_follows_the_sm_count() {
        // 132 SMs (H100 SXM, H200) hold 16 chunks of 32 heads in one wave of 4 an SM; an
        // H100 PCIe (114) 14, an A100 (108) 13, an RTX 3090 (82) 10: 16 would take two.
        for (sms, one_wave_split) in [(132, 16), (128, 16), (114, 14), (108, 13), (82, 10), (8, 1)]
        {
            let (split, chunk) = decode_split(4352, 32, true, sms);
            assert_eq!(split, one_wave_split, "{sms} SMs");
            assert!(
                split == 1 || split * 32 <= sms * BLOCKS_PER_SM,
                "{sms} SMs: {split}"
            );
            assert!(split * chunk >= 4352 && (split - 1) * chunk < 4352);
            // without the one-wave rule the chunks fill every slot
            let (split, _) = decode_split(1 << 20, 32, false, sms);
            assert!(split * 32 >= sms * BLOCKS_PER_SM, "{sms} SMs: {split}");
            assert!((split - 1) * 32 < sms * BLOCKS_PER_SM, "{sms} SMs: {split}");
        }
        // the tensor-core decode's chunks follow too: Llama-3-8B, 16,640 keys
        assert_eq!(dec_split(16_640, 8, 132).0, 48);
        assert!(dec_split(16_640, 8, 66).0 < 48);
    }

    #[test]
    fn dec_split_takes_whole_tiles() {
        // Llama-3-8B at 16,640 keys: 8 KV heads, 11 tiles a chunk
        assert_eq!(dec_split(16_640, 8, 132), (48, 352));
        // Llama-2-7B at 4,352 keys: 32 KV heads
        assert_eq!(dec_split(4352, 32, 132), (13, 352));
        // short caches: one tile a chunk
        assert_eq!(dec_split(768, 32, 132), (24, 32));
        assert_eq!(dec_split(768, 3, 132), (24, 32));
        assert_eq!(dec_split(1, 1, 132), (1, 32));
        // at most MAX_SPLIT chunks, every key in one
        for (n_kv, blocks) in [(100_000, 1), (5000, 7), (33, 200), (64 * 32 + 1, 1)] {
            let (s, c) = dec_split(n_kv, blocks, 132);
            assert!(
                s <= MAX_SPLIT && c % DEC_TILE == 0,
                "{n_kv} {blocks}: {s} {c}"
            );
            assert!(
                s * c >= n_kv && (s - 1) * c < n_kv,
                "{n_kv} {blocks}: {s} {c}"
            );
        }
    }
}
