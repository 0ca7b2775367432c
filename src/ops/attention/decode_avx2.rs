//! flash_attn_ext for a decode step on x86-64 CPUs with AVX2, FMA and F16C: few query
//! rows (at most [`MAX_Q`]) against an F16 K/V cache, read in place.
//!
//! The query rows that share a KV head (a GQA group, times the query positions) are
//! taken [`RB`] at a time, so that each K and V row is converted from f16 once for all
//! of them. Scores come four keys at a time (`RB x 4` vector accumulators over the head
//! dimension, one horizontal reduction per four keys), the softmax weights through the
//! vector [`exp_ps`], and V is summed into `RB x W` accumulators per slice of the value
//! dimension. Only keys that some row of a chunk may see are read (the unused end of a
//! KV bucket is never touched). Each chunk's keys are split into runs of at most
//! [`KEYS_PER_TASK`] so that one query row still gives both threads work; the runs'
//! partial `(max, sum, accumulator)` triples are merged as in flash-decoding.
//!
//! Differences from the reference in [`super::attend`]: the order of the f32 additions,
//! FMA contraction, and `exp` within a few ulp; masked keys, fully masked rows (zeros),
//! non-finite scores (NaN), softcapping and ALiBi slopes follow the same definitions. A
//! key some row of a chunk sees is read for all its rows: for a row that does not see it
//! its V row enters with a weight of 0.

use std::arch::x86_64::*;

use rayon::prelude::*;

use super::super::host::HostTensor;
use super::super::simd::{available, exp_ps};
use super::super::softmax::max_nan;
use super::finite_or_nan;
use crate::graph::{DType, FlashAttnParams};

/// Most query rows per step this kernel takes (more go through the general kernel).
pub(super) const MAX_Q: usize = 8;
/// Query rows that share one pass over a KV head's keys.
const RB: usize = 3;
/// Keys of one task (a run of one chunk's visible keys).
const KEYS_PER_TASK: usize = 128;
/// Largest head size taken (the query rows are copied into fixed buffers).
const MAX_D: usize = 256;
/// Work (rows x keys x (d + d_v)) below which the tasks run on the calling thread.
const SERIAL_WORK: usize = 1 << 16;

/// Runs the op with this kernel when it applies (F16 K and V with dense rows, head sizes
/// multiples of 8 up to [`MAX_D`], at most [`MAX_Q`] query rows, and the CPU features);
/// returns `false`, having done nothing, otherwise. With `slots` (and no mask) the keys
/// are those rows of K and V, every one visible: a paged cache read in place.
pub(super) fn try_run(
    p: &FlashAttnParams,
    dst: HostTensor,
    (q, k, v): (HostTensor, HostTensor, HostTensor),
    (mask, slots): (Option<HostTensor>, Option<&[u32]>),
) -> bool {
    let (d, d_v) = (k.ne[0], v.ne[0]);
    let fits = k.dtype == DType::F16
        && v.dtype == DType::F16
        && k.nb[0] == 2
        && v.nb[0] == 2
        && d % 8 == 0
        && d_v % 8 == 0
        && d <= MAX_D
        && d_v <= MAX_D
        && q.ne[1] <= MAX_Q;
    if !fits || !available() {
        return false;
    }
    run(p, dst, (q, k, v), (mask, slots));
    true
}

/// The query rows of one chunk: up to [`RB`] rows of one KV head and batch.
struct Chunk {
    /// (head, query index) of each row.
    rows: Vec<(usize, usize)>,
    b: usize,
    hk: usize,
    /// The rows' queries, `d` floats each.
    q: Vec<f32>,
    /// The rows' mask rows (`n_kv` floats each), empty without a mask.
    mask: Vec<f32>,
    /// The ALiBi slope of each row's head.
    slope: [f32; RB],
    /// Keys some row may see.
    keys: Vec<u32>,
}

impl Chunk {
    /// Runs of at most [`KEYS_PER_TASK`] of the visible keys, one task each; one empty run
    /// when no key is visible (its rows give zeros).
    fn runs(&self) -> usize {
        self.keys.len().div_ceil(KEYS_PER_TASK).max(1)
    }

    /// The keys of run `r`.
    fn run(&self, r: usize) -> &[u32] {
        let start = (r * KEYS_PER_TASK).min(self.keys.len());
        &self.keys[start..(start + KEYS_PER_TASK).min(self.keys.len())]
    }
}

/// One task's share of a chunk: for each row the largest score `m`, the sum `l` of
/// `exp(s - m)` and the unnormalized sum of `exp(s - m) v` (`d_v` floats per row).
struct Partial {
    m: [f32; RB],
    l: [f32; RB],
    acc: Vec<f32>,
}

/// Where the K or V rows of a chunk are: key `j`'s row at `base + j * stride` bytes.
#[derive(Clone, Copy)]
struct Rows {
    base: *const u8,
    stride: usize,
}

// SAFETY: the rows are read-only memory of the plan while the step runs.
unsafe impl Sync for Rows {}
unsafe impl Send for Rows {}

impl Rows {
    fn of(t: &HostTensor, hk: usize, b: usize) -> Rows {
        Rows {
            base: t.ptr.wrapping_add(t.offset([0, 0, hk, b])),
            stride: t.nb[1],
        }
    }

    /// Key `j`'s row.
    #[inline(always)]
    fn row(self, j: u32) -> *const u16 {
        self.base.wrapping_add(j as usize * self.stride) as *const u16
    }
}

fn run(
    p: &FlashAttnParams,
    dst: HostTensor,
    (q, k, v): (HostTensor, HostTensor, HostTensor),
    (mask, slots): (Option<HostTensor>, Option<&[u32]>),
) {
    let (d, n_kv, n_head_kv) = (k.ne[0], k.ne[1], k.ne[2]);
    let (d_v, n_q, n_head, batch) = (v.ne[0], q.ne[1], q.ne[2], q.ne[3]);
    let group = n_head / n_head_kv;
    let per_kv = group * n_q;
    let mut chunks = Vec::new();
    for b in 0..batch {
        for hk in 0..n_head_kv {
            for c0 in (0..per_kv).step_by(RB) {
                let rows: Vec<(usize, usize)> = (c0..(c0 + RB).min(per_kv))
                    .map(|r| (hk * group + r / n_q, r % n_q))
                    .collect();
                chunks.push(chunk(p, &q, (mask, slots), rows, (b, hk), (n_head, n_kv)));
            }
        }
    }
    // Tasks: (chunk, run of its keys).
    let tasks: Vec<(usize, usize)> = chunks
        .iter()
        .enumerate()
        .flat_map(|(c, ch)| (0..ch.runs()).map(move |r| (c, r)))
        .collect();
    let task = |&(c, r): &(usize, usize)| {
        let ch = &chunks[c];
        let keys = ch.run(r);
        let (kr, vr) = (Rows::of(&k, ch.hk, ch.b), Rows::of(&v, ch.hk, ch.b));
        // SAFETY: the CPU has AVX2, FMA and F16C (try_run); every key in `keys` is below
        // n_kv, so its K row (d f16) and V row (d_v f16) lie inside k and v, which the
        // plan keeps valid and unwritten during the step.
        unsafe { partial(p, ch, keys, (kr, vr), (d, d_v, n_kv)) }
    };
    let work = chunks
        .iter()
        .map(|c| c.rows.len() * c.keys.len())
        .sum::<usize>()
        * (d + d_v);
    let partials: Vec<Partial> = match work < SERIAL_WORK {
        true => tasks.iter().map(task).collect(),
        false => tasks.par_iter().map(task).collect(),
    };
    let mut out = vec![0f32; d_v];
    let mut at = 0;
    for ch in &chunks {
        let parts = &partials[at..at + ch.runs()];
        at += ch.runs();
        for (r, &(h, i)) in ch.rows.iter().enumerate() {
            merge(parts, r, d_v, &mut out);
            // SAFETY: the result is [d_v, n_head, n_q, batch]; (h, i, b) is inside it and
            // written by this row only.
            unsafe { dst.write_row(h, i, ch.b, &out) };
        }
    }
}

/// The rows of a chunk with their queries, mask rows, slopes and visible keys.
fn chunk(
    p: &FlashAttnParams,
    q: &HostTensor,
    (mask, slots): (Option<HostTensor>, Option<&[u32]>),
    rows: Vec<(usize, usize)>,
    (b, hk): (usize, usize),
    (n_head, n_kv): (usize, usize),
) -> Chunk {
    let d = q.ne[0];
    let mut qs = vec![0f32; rows.len() * d];
    let mut slope = [1f32; RB];
    for (r, &(h, i)) in rows.iter().enumerate() {
        // SAFETY: (i, h, b) is inside q's shape.
        unsafe { q.read_row(i, h, b, &mut qs[r * d..(r + 1) * d]) };
        slope[r] = p.slope(h, n_head);
    }
    let mut ms = Vec::new();
    let keys: Vec<u32> = match (slots, mask) {
        (Some(slots), _) => slots.to_vec(),
        (None, None) => (0..n_kv as u32).collect(),
        (None, Some(m)) => {
            ms.resize(rows.len() * n_kv, 0.0);
            for (r, &(h, i)) in rows.iter().enumerate() {
                // SAFETY: the mask broadcasts over heads and batches; row i < n_q <= ne[1].
                unsafe {
                    m.read_row(
                        i,
                        h % m.ne[2],
                        b % m.ne[3],
                        &mut ms[r * n_kv..(r + 1) * n_kv],
                    )
                };
            }
            (0..n_kv)
                .filter(|&j| (0..rows.len()).any(|r| ms[r * n_kv + j] != f32::NEG_INFINITY))
                .map(|j| j as u32)
                .collect()
        }
    };
    Chunk {
        rows,
        b,
        hk,
        q: qs,
        mask: ms,
        slope,
        keys,
    }
}

/// Adds the partial triples of row `r` into its normalized output.
fn merge(parts: &[Partial], r: usize, d_v: usize, out: &mut [f32]) {
    let m = parts
        .iter()
        .map(|p| p.m[r])
        .fold(f32::NEG_INFINITY, max_nan);
    out.fill(0.0);
    if m == f32::NEG_INFINITY {
        return;
    }
    let mut l = 0f32;
    for p in parts {
        let f = (p.m[r] - m).exp();
        l += f * p.l[r];
        for (o, a) in out.iter_mut().zip(&p.acc[r * d_v..(r + 1) * d_v]) {
            *o += f * a;
        }
    }
    out.iter_mut().for_each(|o| *o /= l);
}

/// The partial triple of chunk `ch`'s rows over `keys`.
///
/// # Safety
/// AVX2, FMA and F16C; every key's K and V rows lie in valid memory.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn partial(
    p: &FlashAttnParams,
    ch: &Chunk,
    keys: &[u32],
    (kr, vr): (Rows, Rows),
    (d, d_v, n_kv): (usize, usize, usize),
) -> Partial {
    let nr = ch.rows.len();
    let nk = keys.len();
    let mut s = vec![0f32; RB * nk];
    match nr {
        1 => scores::<1>(&ch.q, d, keys, kr, &mut s),
        2 => scores::<2>(&ch.q, d, keys, kr, &mut s),
        _ => scores::<3>(&ch.q, d, keys, kr, &mut s),
    }
    let mut part = Partial {
        m: [f32::NEG_INFINITY; RB],
        l: [0.0; RB],
        acc: vec![0f32; nr * d_v],
    };
    for r in 0..nr {
        let sr = &mut s[r * nk..(r + 1) * nk];
        for (x, &j) in sr.iter_mut().zip(keys) {
            let mut y = p.scale * finite_or_nan(*x);
            if p.softcap > 0.0 {
                y = p.softcap * (y / p.softcap).tanh();
            }
            if !ch.mask.is_empty() {
                let mv = ch.mask[r * n_kv + j as usize];
                y = match mv == f32::NEG_INFINITY {
                    true => f32::NEG_INFINITY,
                    false => y + ch.slope[r] * mv,
                };
            }
            *x = y;
        }
        part.m[r] = sr.iter().copied().fold(f32::NEG_INFINITY, max_nan);
        match part.m[r] == f32::NEG_INFINITY {
            // every key of this run is masked for this row: weights 0, not -inf
            true => sr.fill(0.0),
            false => part.l[r] = weights(sr, part.m[r]),
        }
    }
    match (nr, d_v % 32) {
        (1, 0) => values::<1, 4>(&s, nk, keys, vr, d_v, &mut part.acc),
        (2, 0) => values::<2, 4>(&s, nk, keys, vr, d_v, &mut part.acc),
        (3, 0) => values::<3, 2>(&s, nk, keys, vr, d_v, &mut part.acc),
        (1, _) => values::<1, 1>(&s, nk, keys, vr, d_v, &mut part.acc),
        (2, _) => values::<2, 1>(&s, nk, keys, vr, d_v, &mut part.acc),
        _ => values::<3, 1>(&s, nk, keys, vr, d_v, &mut part.acc),
    }
    part
}

/// `s[r * nk + t] = q_r . k_{keys[t]}` for the `R` query rows (`d` floats each in `q`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn scores<const R: usize>(q: &[f32], d: usize, keys: &[u32], kr: Rows, s: &mut [f32]) {
    let nk = keys.len();
    let qp = q.as_ptr();
    let mut t = 0;
    while t + 4 <= nk {
        let kp = [
            kr.row(keys[t]),
            kr.row(keys[t + 1]),
            kr.row(keys[t + 2]),
            kr.row(keys[t + 3]),
        ];
        let mut acc = [[_mm256_setzero_ps(); 4]; R];
        for c in (0..d).step_by(8) {
            let kv = kp.map(|p| _mm256_cvtph_ps(_mm_loadu_si128(p.add(c) as *const __m128i)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let qv = _mm256_loadu_ps(qp.add(r * d + c));
                for u in 0..4 {
                    acc[u] = _mm256_fmadd_ps(qv, kv[u], acc[u]);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            _mm_storeu_ps(s.as_mut_ptr().add(r * nk + t), hsum4(acc));
        }
        t += 4;
    }
    for t in t..nk {
        let kp = kr.row(keys[t]);
        let mut acc = [_mm256_setzero_ps(); R];
        for c in (0..d).step_by(8) {
            let kv = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(c) as *const __m128i));
            for (r, acc) in acc.iter_mut().enumerate() {
                *acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(r * d + c)), kv, *acc);
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            let four = [
                *acc,
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
                _mm256_setzero_ps(),
            ];
            s[r * nk + t] = _mm_cvtss_f32(hsum4(&four));
        }
    }
}

/// The lane sums of four vectors, as one `__m128`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum4(a: &[__m256; 4]) -> __m128 {
    let s01 = _mm256_hadd_ps(a[0], a[1]);
    let s23 = _mm256_hadd_ps(a[2], a[3]);
    let s = _mm256_hadd_ps(s01, s23);
    _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s))
}

/// Replaces the scores `s` by `exp(s - m)` (0 where masked); returns their sum.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weights(s: &mut [f32], m: f32) -> f32 {
    let mv = _mm256_set1_ps(m);
    let mut sum = _mm256_setzero_ps();
    let mut chunks = s.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        sum = _mm256_add_ps(sum, e);
    }
    let mut total = _mm_cvtss_f32(hsum4(&[
        sum,
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    ]));
    for x in chunks.into_remainder() {
        *x = (*x - m).exp();
        total += *x;
    }
    total
}

/// `acc[r * d_v..] += sum_t w[r * nk + t] * v_{keys[t]}` for `R` rows, `W` vectors of
/// the value dimension at a time (then one at a time for what is left).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values<const R: usize, const W: usize>(
    w: &[f32],
    nk: usize,
    keys: &[u32],
    vr: Rows,
    d_v: usize,
    acc: &mut [f32],
) {
    let mut c0 = 0;
    while c0 + 8 * W <= d_v {
        values_slice::<R, W>(w, nk, keys, vr, (c0, d_v), acc);
        c0 += 8 * W;
    }
    while c0 < d_v {
        values_slice::<R, 1>(w, nk, keys, vr, (c0, d_v), acc);
        c0 += 8;
    }
}

/// [`values`] for the `8 * W` dimensions from `c0`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn values_slice<const R: usize, const W: usize>(
    w: &[f32],
    nk: usize,
    keys: &[u32],
    vr: Rows,
    (c0, d_v): (usize, usize),
    acc: &mut [f32],
) {
    let mut a = [[_mm256_setzero_ps(); W]; R];
    for (t, &j) in keys.iter().enumerate() {
        let vp = vr.row(j).add(c0);
        let vv: [__m256; W] = std::array::from_fn(|x| {
            _mm256_cvtph_ps(_mm_loadu_si128(vp.add(8 * x) as *const __m128i))
        });
        for (r, a) in a.iter_mut().enumerate() {
            let wr = _mm256_set1_ps(*w.get_unchecked(r * nk + t));
            for x in 0..W {
                a[x] = _mm256_fmadd_ps(wr, vv[x], a[x]);
            }
        }
    }
    for (r, a) in a.iter().enumerate() {
        for (x, v) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(r * d_v + c0 + 8 * x), *v);
        }
    }
}
