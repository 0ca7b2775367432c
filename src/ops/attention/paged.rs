//! Paged attention, `paged_attn`: the fused attention of [`flash_attn_ext`] over a KV
//! cache kept in fixed-size blocks of a shared pool, for a batch that mixes sequences.
//! Each query token names its sequence and position; each sequence's keys live in the
//! blocks its row of the block table lists. Shapes:
//!
//! | operand | shape | dtype |
//! | --- | --- | --- |
//! | q | `[d, n_head, n_tokens]` (any strides) | F32 |
//! | k | `[d, n_slots, n_head_kv]` (a view of the K pool; any strides) | F32, F16, BF16, Q8_0, Q4_0 |
//! | v | `[d_v, n_slots, n_head_kv]` | as k |
//! | table | `[max_blocks, n_seqs]`: the physical block of each logical block | I32 |
//! | seqs | `[2, n_tokens]`: each token's sequence (a column of `table`) and position | I32 |
//! | result | `[d_v, n_head, n_tokens]` | F32 |
//!
//! Slot `s` of the pool is position `s % block_size` of physical block `s / block_size`,
//! so key position `j` of sequence `q` lives at slot
//! `table[j / block_size, q] * block_size + j % block_size`. The query of a token at
//! position `p` sees the positions `lo..=p` of its sequence, `lo = p + 1 - window` with a
//! sliding window (`window > 0`), else 0: causal attention needs no mask tensor, and
//! nothing is read beyond what the token may see. The score of a key is
//! `s = scale * q . k`, then `softcap * tanh(s / softcap)` when softcapping. Heads share
//! KV heads by broadcast (GQA: head `h` reads KV head `h / (n_head / n_head_kv)`).
//!
//! A token whose sequence is `-1` is padding: its result row is zeros and it reads
//! nothing. A score that is NaN (a NaN in the query or in a key it sees) makes the whole
//! result row NaN, and a NaN in a visible V row reaches the result through its weight:
//! non-finite input never comes out as finite attention.
//!
//! [`flash_attn_ext`]: crate::graph::Graph::flash_attn_ext

use rayon::prelude::*;

use super::KV_DTYPES;
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, Op, PagedAttnParams, Step, TensorId};
use crate::ops::expect_dtype;
use crate::ops::host::HostTensor;

/// The op's name in errors.
const OP: &str = "paged_attn";

impl Graph {
    /// Paged attention of `q` over the K and V pools `k`, `v`, each token's keys found
    /// through `table` and `seqs` (see the module docs for shapes); every shape and dtype
    /// is checked with a typed error.
    pub fn paged_attn(
        &mut self,
        q: TensorId,
        (k, v): (TensorId, TensorId),
        table: TensorId,
        seqs: TensorId,
        p: PagedAttnParams,
    ) -> Result<TensorId> {
        let (tq, tk, tv) = (self.get(q)?, self.get(k)?, self.get(v)?);
        let (tt, ts) = (self.get(table)?, self.get(seqs)?);
        expect_dtype(OP, &tq.name, tq.dtype, &[DType::F32])?;
        expect_dtype(OP, &tk.name, tk.dtype, &KV_DTYPES)?;
        expect_dtype(OP, &tv.name, tv.dtype, &KV_DTYPES)?;
        expect_dtype(OP, &tt.name, tt.dtype, &[DType::I32])?;
        expect_dtype(OP, &ts.name, ts.dtype, &[DType::I32])?;
        let shapes = || {
            format!(
                "q '{}' {}, k '{}' {}, v '{}' {}, table '{}' {}, seqs '{}' {}",
                tq.name,
                fmt_ne(&tq.ne),
                tk.name,
                fmt_ne(&tk.ne),
                tv.name,
                fmt_ne(&tv.ne),
                tt.name,
                fmt_ne(&tt.ne),
                ts.name,
                fmt_ne(&ts.ne)
            )
        };
        let fail = |what: &str| Err(Error::shape(OP, format!("{what}: {}", shapes())));
        let (n_head, n_tokens, n_head_kv) = (tq.ne[1], tq.ne[2], tk.ne[2]);
        if tq.ne[3] != 1 || tk.ne[3] != 1 || tv.ne[3] != 1 || tt.ne[2] != 1 || ts.ne[2] != 1 {
            return fail("q, k, v, table and seqs have no batch dimension");
        }
        if tk.ne[0] != tq.ne[0] {
            return fail("the head sizes of q and k differ");
        }
        if tv.ne[1] != tk.ne[1] || tv.ne[2] != n_head_kv {
            return fail("k and v must have the same slots and KV heads");
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return fail("the query heads must be a multiple of the KV heads");
        }
        if ts.ne[0] != 2 || ts.ne[1] != n_tokens {
            return fail("seqs must be [2, n_tokens]: each token's sequence and position");
        }
        if !tt.is_contiguous() || !ts.is_contiguous() {
            return fail("table and seqs must be contiguous");
        }
        if p.block_size == 0 || tk.ne[1] % p.block_size != 0 {
            return fail(&format!(
                "the pool's slots must be whole blocks of {}",
                p.block_size
            ));
        }
        if !(p.scale.is_finite() && p.softcap.is_finite() && p.softcap >= 0.0) {
            return Err(Error::shape(
                OP,
                format!("scale and softcap >= 0 must be finite: {p}"),
            ));
        }
        let d_v = tv.ne[0];
        Ok(self.new_node(
            Op::PagedAttn(p),
            DType::F32,
            [d_v, n_head, n_tokens, 1],
            &[q, k, v, table, seqs],
        ))
    }
}

/// One run of consecutive tokens of the same sequence: the keys of its last (furthest)
/// token are read once and serve every token of the run.
#[derive(Clone, Copy, Debug)]
struct Run {
    /// The sequence (a column of the table).
    seq: usize,
    /// Its tokens `start..end`.
    start: usize,
    end: usize,
    /// The first and last key position some token of the run sees.
    lo: usize,
    hi: usize,
}

/// The token (sequence, position) pairs of `seqs` grouped into [`Run`]s, checked
/// against the table's shape; padding tokens (sequence -1) belong to no run.
fn runs(step: &Step, seqs: HostTensor, table: HostTensor, p: &PagedAttnParams) -> Result<Vec<Run>> {
    let (max_blocks, n_seqs) = (table.ne[0], table.ne[1]);
    let bad = |index: i64, position: usize, limit: usize| Error::IndexOutOfRange {
        op: OP,
        node: step.name.clone(),
        index,
        position,
        limit,
    };
    let mut out: Vec<Run> = Vec::new();
    for t in 0..seqs.ne[1] {
        // SAFETY: (0, t) and (1, t) are inside seqs' [2, n_tokens] shape.
        let (s, pos) = unsafe { (seqs.get_i32([0, t, 0, 0]), seqs.get_i32([1, t, 0, 0])) };
        if s == -1 {
            continue;
        }
        if s < 0 || s as usize >= n_seqs {
            return Err(bad(s.into(), t, n_seqs));
        }
        let limit = max_blocks * p.block_size;
        if pos < 0 || pos as usize >= limit {
            return Err(bad(pos.into(), t, limit));
        }
        let (s, pos) = (s as usize, pos as usize);
        let lo = p.first_visible(pos);
        match out.last_mut() {
            Some(r) if r.seq == s && r.end == t => {
                r.end = t + 1;
                r.lo = r.lo.min(lo);
                r.hi = r.hi.max(pos);
            }
            Some(_) | None => out.push(Run {
                seq: s,
                start: t,
                end: t + 1,
                lo,
                hi: pos,
            }),
        }
    }
    Ok(out)
}

/// The dense f32 K (or V) rows of key positions `lo..=hi` of sequence `seq`, every KV
/// head side by side (`[d, n_head_kv]` a key) into `out`; a physical block outside the
/// pool is an error.
fn gather(
    step: &Step,
    pool: HostTensor,
    table: HostTensor,
    run: &Run,
    block_size: usize,
    out: &mut Vec<f32>,
) -> Result<()> {
    let (d, n_slots, heads) = (pool.ne[0], pool.ne[1], pool.ne[2]);
    let keys = run.hi + 1 - run.lo;
    out.resize(keys * heads * d, 0.0);
    let merged = pool.nb[0] == pool.dtype.block_bytes() && pool.dtype.row_bytes(d) == pool.nb[2];
    let whole = HostTensor {
        ne: [d * heads, n_slots, 1, 1],
        ..pool
    };
    for (key, row) in out.chunks_exact_mut(d * heads).enumerate() {
        let slot = slot_of(step, pool, table, run, run.lo + key, block_size)?;
        if merged {
            // SAFETY: slot < n_slots; a pool row's heads are contiguous (checked above).
            unsafe { whole.read_row(slot, 0, 0, row) };
        } else {
            for (h, part) in row.chunks_exact_mut(d).enumerate() {
                // SAFETY: (slot, h) is inside the pool's shape.
                unsafe { pool.read_row(slot, h, 0, part) };
            }
        }
    }
    Ok(())
}

/// The pool slot of key position `j` of `run`'s sequence; a physical block outside the
/// pool is an error.
fn slot_of(
    step: &Step,
    pool: HostTensor,
    table: HostTensor,
    run: &Run,
    j: usize,
    block_size: usize,
) -> Result<usize> {
    let n_slots = pool.ne[1];
    // SAFETY: j / block_size < max_blocks (checked by `runs`), seq < n_seqs.
    let block = unsafe { table.get_i32([j / block_size, run.seq, 0, 0]) };
    usize::try_from(block)
        .ok()
        .and_then(|b| b.checked_mul(block_size))
        .map(|b| b + j % block_size)
        .filter(|&s| s < n_slots)
        .ok_or_else(|| Error::IndexOutOfRange {
            op: OP,
            node: step.name.clone(),
            index: block.into(),
            position: j / block_size,
            limit: n_slots / block_size,
        })
}

/// CPU kernel: the tokens are grouped into runs of one sequence; each run's visible K
/// and V rows are gathered once into dense f32, then its (token, head) rows are scored,
/// softmaxed and summed over V, runs and rows in parallel. A decode run over F16 pools
/// takes [`decode_f16`] instead where the CPU allows.
pub(crate) fn cpu(
    step: &Step,
    p: &PagedAttnParams,
    dst: HostTensor,
    src: &[HostTensor],
) -> Result<()> {
    let (q, k, v, table, seqs) = (src[0], src[1], src[2], src[3], src[4]);
    let (d, n_head, n_tokens) = (q.ne[0], q.ne[1], q.ne[2]);
    let (d_v, n_head_kv) = (v.ne[0], k.ne[2]);
    let group = n_head / n_head_kv;
    let runs = runs(step, seqs, table, p)?;
    // padding rows (and tokens of no run) are zeros
    let zeros = vec![0f32; d_v];
    for t in 0..n_tokens {
        for h in 0..n_head {
            // SAFETY: (h, t) is inside the result [d_v, n_head, n_tokens].
            unsafe { dst.write_row(h, t, 0, &zeros) };
        }
    }
    let work: usize = runs
        .iter()
        .map(|r| (r.end - r.start) * n_head * (r.hi + 1 - r.lo) * (d + d_v))
        .sum();
    let one = |run: &Run| -> Result<()> {
        #[cfg(target_arch = "x86_64")]
        if decode_f16(step, p, dst, src, run)? {
            return Ok(());
        }
        let (mut kf, mut vf) = (Vec::new(), Vec::new());
        gather(step, k, table, run, p.block_size, &mut kf)?;
        gather(step, v, table, run, p.block_size, &mut vf)?;
        let n_keys = run.hi + 1 - run.lo;
        #[cfg(target_arch = "x86_64")]
        let kt = match crate::ops::simd::available() {
            true => super::paged_avx2::key_tiles(&kf, n_keys, n_head_kv, d),
            false => Vec::new(),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let kt = Vec::new();
        let rows = (run.end - run.start) * n_head;
        let row = |r: usize| {
            let (t, h) = (run.start + r / n_head, r % n_head);
            let mut qrow = vec![0f32; d];
            // SAFETY: (h, t) is inside q's shape.
            unsafe { q.read_row(h, t, 0, &mut qrow) };
            // SAFETY: (1, t) is inside seqs' shape; runs checked it is >= 0.
            let pos = unsafe { seqs.get_i32([1, t, 0, 0]) } as usize;
            let keys = KeyRows {
                k: &kf,
                kt: &kt,
                tiles: n_keys.div_ceil(8),
                v: &vf,
                first: run.lo,
                hk: h / group,
                n_head_kv,
            };
            let visible = p.first_visible(pos)..pos + 1;
            #[cfg(target_arch = "x86_64")]
            let acc = match crate::ops::simd::available() {
                // SAFETY: the CPU has AVX2, FMA and F16C; `keys` holds the run's keys
                // lo..=hi, among them every visible key of this token.
                true => unsafe { super::paged_avx2::attend_row(p, &qrow, &keys, visible, d_v) },
                false => attend_row(p, &qrow, &keys, visible, d_v),
            };
            #[cfg(not(target_arch = "x86_64"))]
            let acc = attend_row(p, &qrow, &keys, visible, d_v);
            // SAFETY: (h, t) is inside the result and written by this row only.
            unsafe { dst.write_row(h, t, 0, &acc) };
        };
        if rows * (run.hi + 1 - run.lo) * (d + d_v) < super::SERIAL_WORK {
            (0..rows).for_each(row);
        } else {
            (0..rows).into_par_iter().for_each(row);
        }
        Ok(())
    };
    if work < super::SERIAL_WORK || runs.len() == 1 {
        runs.iter().try_for_each(one)
    } else {
        runs.par_iter().try_for_each(one)
    }
}

/// A run of one token (a decode step's sequence) over F16 K and V pools: the AVX2 decode
/// kernel of `flash_attn_ext` ([`super::decode_avx2`]) on the pools themselves, its keys
/// the pool slots of the visible positions (read in place, every one visible). False
/// when the run or the pools do not qualify, or the CPU lacks AVX2, FMA or F16C.
#[cfg(target_arch = "x86_64")]
fn decode_f16(
    step: &Step,
    p: &PagedAttnParams,
    dst: HostTensor,
    src: &[HostTensor],
    run: &Run,
) -> Result<bool> {
    let (q, k, v, table) = (src[0], src[1], src[2], src[3]);
    let f16_rows = |t: &HostTensor| {
        t.dtype == DType::F16 && t.nb[0] == 2 && t.nb[2] == t.ne[0] * 2 && t.nb[1].is_multiple_of(2)
    };
    if run.end - run.start != 1 || !f16_rows(&k) || !f16_rows(&v) || !crate::ops::simd::available()
    {
        return Ok(false);
    }
    let (d, n_head) = (k.ne[0], q.ne[1]);
    // the pool slots of the visible keys: the kernel reads their rows in place
    let slots = (run.lo..=run.hi)
        .map(|j| slot_of(step, k, table, run, j, p.block_size).map(|s| s as u32))
        .collect::<Result<Vec<u32>>>()?;
    // the token's query rows as [d, 1, n_head, 1] and its result rows as [d_v, n_head, 1, 1]
    let qt = HostTensor {
        ptr: q.ptr.wrapping_add(q.offset([0, 0, run.start, 0])),
        ne: [d, 1, n_head, 1],
        nb: [q.nb[0], q.nb[2], q.nb[1], q.nb[3]],
        ..q
    };
    let out = HostTensor {
        ptr: dst.ptr.wrapping_add(dst.offset([0, 0, run.start, 0])),
        ne: [v.ne[0], n_head, 1, 1],
        ..dst
    };
    let fp = crate::graph::FlashAttnParams {
        scale: p.scale,
        max_bias: 0.0,
        softcap: p.softcap,
    };
    // the pools as [d, slots, n_head_kv]: a slot's heads side by side
    let pool = |t: HostTensor| HostTensor {
        ne: [t.ne[0], t.ne[1], t.ne[2], 1],
        ..t
    };
    let kv = (qt, pool(k), pool(v));
    Ok(super::decode_avx2::try_run(
        &fp,
        out,
        kv,
        (None, Some(&slots)),
    ))
}

/// The dense K and V rows of a run: key position `j` of KV head `hk` at
/// `k[((j - first) * n_head_kv + hk) * d..][..d]` (V likewise with `d_v`); with AVX2, K
/// also in `tiles` tiles of eight keys a KV head (`kt`, [`super::paged_avx2::key_tiles`]).
pub(super) struct KeyRows<'a> {
    pub(super) k: &'a [f32],
    pub(super) kt: &'a [f32],
    pub(super) tiles: usize,
    pub(super) v: &'a [f32],
    pub(super) first: usize,
    pub(super) hk: usize,
    pub(super) n_head_kv: usize,
}

/// The attention output of one query row over the key positions `keys`: scores, their
/// softmax and the weighted sum of the V rows; NaN when a `q . k` is not finite (an
/// infinity too: softcapping would make it a finite score).
fn attend_row(
    p: &PagedAttnParams,
    q: &[f32],
    rows: &KeyRows,
    keys: std::ops::Range<usize>,
    d_v: usize,
) -> Vec<f32> {
    let d = q.len();
    let scores: Vec<f32> = keys
        .clone()
        .map(|j| {
            let at = ((j - rows.first) * rows.n_head_kv + rows.hk) * d;
            let dot = crate::ops::mul_mat::dot_f32(q, &rows.k[at..at + d]);
            let mut s = p.scale * super::finite_or_nan(dot);
            if p.softcap > 0.0 {
                s = p.softcap * (s / p.softcap).tanh();
            }
            s
        })
        .collect();
    if scores.iter().any(|s| s.is_nan()) {
        return vec![f32::NAN; d_v];
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut acc = vec![0f32; d_v];
    let mut sum = 0f32;
    for (j, &s) in keys.zip(&scores) {
        let at = ((j - rows.first) * rows.n_head_kv + rows.hk) * d_v;
        let w = (s - max).exp();
        sum += w;
        acc.iter_mut()
            .zip(&rows.v[at..at + d_v])
            .for_each(|(a, x)| *a += w * x);
    }
    acc.iter_mut().for_each(|a| *a /= sum);
    acc
}
