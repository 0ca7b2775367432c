//! Fused attention, ggml's `flash_attn_ext`: for every query row and head,
//! `softmax(scale * q k^T (+ slope * mask)) v` in one op, with no `[n_kv, n_q, heads]`
//! score tensor. Shapes (ggml's):
//!
//! | operand | shape | dtype |
//! | --- | --- | --- |
//! | q | `[d, n_q, n_head, batch]` | F32 |
//! | k | `[d, n_kv, n_head_kv, batch]` (any strides a cache view has) | F32, F16, BF16, Q8_0, Q4_0 |
//! | v | `[d_v, n_kv, n_head_kv, batch]` | as k |
//! | mask (optional) | `[n_kv, >= n_q, m2, m3]`, `m2 \| n_head`, `m3 \| batch` | F32, F16 |
//! | result | `[d_v, n_head, n_q, batch]` | F32 |
//!
//! The result is laid out head-major within a query, so `reshape` to `[d_v * n_head,
//! n_q]` is the attention output ready for the output projection. Heads share KV heads
//! by broadcast (GQA: head `h` reads KV head `h / (n_head / n_head_kv)`). The score of
//! key `j` is `s = scale * q . k_j`, then `softcap * tanh(s / softcap)` when softcapping,
//! then `+ slope_h * mask[j, i]` (ALiBi slopes when `max_bias > 0`, else 1).
//!
//! The CPU kernel reads K and V (of the keys some query may see) once into dense f32 rows, then per query row computes
//! every key's score (a row of `n_kv` floats, where the GPU's online softmax keeps a
//! running maximum instead), the maximum `M`, the weights `exp(s - M)`, their sum `S`
//! and `sum_j exp(s_j - M) v_j / S`. Masked keys (`-inf`) are skipped; a row whose keys
//! are all masked gives zeros.
//!
//! Non-finite inputs give non-finite outputs, on every backend and cache type: a `q . k`
//! that is not finite (a NaN or an infinity in q or in a visible key's K row) makes the
//! score NaN, and the row's maximum keeps a NaN ([`max_nan`]), so the whole row is NaN; a
//! NaN or infinity in a visible key's V row reaches the output through its weight. A key
//! masked with `-inf` for a query never gets a score from its K row; its V row enters the
//! kernels that share V tiles between query rows (the CPU's decode kernel, CUDA's) with a
//! weight of exactly 0, so, as in ggml, the V rows of masked keys must be finite: the KV
//! cache is zero-initialised, and a row written from non-finite values already makes the
//! rows that see it non-finite.

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod decode_avx2;
pub mod paged;
#[cfg(target_arch = "x86_64")]
mod paged_avx2;

use super::host::HostTensor;
use super::softmax::max_nan;
use super::{expect_dtype, FlashAttnParams, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};

/// Dtypes the K and V operands may have.
pub const KV_DTYPES: [DType; 5] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q8_0,
    DType::Q4_0,
];

impl Graph {
    /// Fused attention of `q` over `k`, `v` with an optional additive `mask` (see the
    /// module docs for shapes); every shape and dtype is checked with a typed error.
    pub fn flash_attn_ext(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        mask: Option<TensorId>,
        p: FlashAttnParams,
    ) -> Result<TensorId> {
        const OP: &str = "flash_attn_ext";
        let (tq, tk, tv) = (self.get(q)?, self.get(k)?, self.get(v)?);
        expect_dtype(OP, &tq.name, tq.dtype, &[DType::F32])?;
        expect_dtype(OP, &tk.name, tk.dtype, &KV_DTYPES)?;
        expect_dtype(OP, &tv.name, tv.dtype, &KV_DTYPES)?;
        let shapes = || {
            format!(
                "q '{}' {}, k '{}' {}, v '{}' {}",
                tq.name,
                fmt_ne(&tq.ne),
                tk.name,
                fmt_ne(&tk.ne),
                tv.name,
                fmt_ne(&tv.ne)
            )
        };
        if tk.ne[0] != tq.ne[0] {
            return Err(Error::shape(OP, format!("head sizes differ: {}", shapes())));
        }
        if tv.ne[1] != tk.ne[1] || tv.ne[2] != tk.ne[2] || tv.ne[3] != tk.ne[3] {
            return Err(Error::shape(
                OP,
                format!(
                    "k and v must have the same keys, KV heads and batch: {}",
                    shapes()
                ),
            ));
        }
        if tq.ne[2] % tk.ne[2] != 0 || tq.ne[3] != tk.ne[3] {
            return Err(Error::shape(
                OP,
                format!(
                    "the query heads must be a multiple of the KV heads and the batches equal: {}",
                    shapes()
                ),
            ));
        }
        let finite = |x: f32| x.is_finite();
        let ok = finite(p.scale)
            && p.max_bias >= 0.0
            && finite(p.max_bias)
            && p.softcap >= 0.0
            && finite(p.softcap);
        if !ok {
            return Err(Error::shape(
                OP,
                format!("scale, max_bias >= 0 and softcap >= 0 must be finite: {p}"),
            ));
        }
        let (d_v, n_q, n_head, batch) = (tv.ne[0], tq.ne[1], tq.ne[2], tq.ne[3]);
        let mut src = vec![q, k, v];
        if let Some(m) = mask {
            self.check_attn_mask(m, tk.ne[1], n_q, n_head, batch)?;
            src.push(m);
        }
        Ok(self.new_node(
            Op::FlashAttnExt(p),
            DType::F32,
            [d_v, n_head, n_q, batch],
            &src,
        ))
    }

    fn check_attn_mask(
        &self,
        m: TensorId,
        n_kv: usize,
        n_q: usize,
        n_head: usize,
        batch: usize,
    ) -> Result<()> {
        let tm = self.get(m)?;
        expect_dtype(
            "flash_attn_ext",
            &tm.name,
            tm.dtype,
            &[DType::F32, DType::F16],
        )?;
        if tm.ne[0] != n_kv
            || tm.ne[1] < n_q
            || !n_head.is_multiple_of(tm.ne[2])
            || !batch.is_multiple_of(tm.ne[3])
        {
            return Err(Error::shape(
                "flash_attn_ext",
                format!(
                    "mask '{}' {} must be [{n_kv}, >= {n_q}, a divisor of {n_head}, a divisor of {batch}]",
                    tm.name,
                    fmt_ne(&tm.ne)
                ),
            ));
        }
        Ok(())
    }
}

/// CPU kernel. A decode step on an F16 cache goes to [`decode_avx2`] where the CPU has
/// AVX2 (see there); otherwise the K and V rows of every key that some query row may see read once
/// into dense f32 (`[d, n_head_kv, n_kv, batch]`: a key's heads side by side), then the
/// (query, head, batch) rows split over rayon's threads, each row scored against every
/// unmasked key, softmaxed and multiplied by V.
pub(crate) fn cpu(p: &FlashAttnParams, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (q, k, v) = (src[0], src[1], src[2]);
    let mask = src.get(3).copied();
    #[cfg(target_arch = "x86_64")]
    if decode_avx2::try_run(p, dst, (q, k, v), (mask, None)) {
        return Ok(());
    }
    let (d, n_kv, n_head_kv) = (k.ne[0], k.ne[1], k.ne[2]);
    let (d_v, n_q, n_head, batch) = (v.ne[0], q.ne[1], q.ne[2], q.ne[3]);
    let group = n_head / n_head_kv;
    let mut kv = SCRATCH.with(|s| s.take());
    visible_keys(mask, n_q, &mut kv.2);
    dense_rows(k, &kv.2, &mut kv.0);
    dense_rows(v, &kv.2, &mut kv.1);
    let (kf, vf) = (&kv.0, &kv.1);
    let rows = n_q * n_head * batch;
    // Small tasks for a decode step's few rows, a few dozen tasks for a prompt's.
    let per_task = rows.div_ceil(64);
    let task = |t: usize| {
        let mut qrow = vec![0f32; d];
        let mut scores = vec![0f32; n_kv];
        let mut acc = vec![0f32; d_v];
        for r in t * per_task..((t + 1) * per_task).min(rows) {
            // Row r is query i of head h in batch b, heads of one query adjacent.
            let (h, i, b) = (r % n_head, (r / n_head) % n_q, r / (n_q * n_head));
            // SAFETY: (i, h, b) is inside q's shape; the plan guarantees valid memory.
            unsafe { q.read_row(i, h, b, &mut qrow) };
            let hk = h / group;
            let (kb, vb) = (n_kv * n_head_kv * d * b, n_kv * n_head_kv * d_v * b);
            let row = Row {
                q: &qrow,
                i,
                h,
                b,
                n_head,
                k: &kf[kb + hk * d..kb + n_kv * n_head_kv * d],
                v: &vf[vb + hk * d_v..vb + n_kv * n_head_kv * d_v],
                k_stride: n_head_kv * d,
                v_stride: n_head_kv * d_v,
            };
            attend_fast(p, &row, mask, &mut scores, &mut acc);
            // SAFETY: the result is [d_v, n_head, n_q, batch]; (h, i, b) is inside it and
            // each row is written by one task only.
            unsafe { dst.write_row(h, i, b, &acc) };
        }
    };
    let tasks = rows.div_ceil(per_task);
    if rows * n_kv * (d + d_v) < SERIAL_WORK {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
    SCRATCH.with(|s| s.replace(kv));
    Ok(())
}

/// Multiply-adds (rows x keys x (d + d_v)) below which the rows run on the calling
/// thread, where handing them to another thread costs more than it saves. A decode step
/// of SmolLM2 (9 heads, ~200 keys, 2 x 64 dims: 2^18) already gains from both threads
/// (2-core machine: 117.6 -> 120.9 tok/s median of 8 interleaved runs).
const SERIAL_WORK: usize = 1 << 16;

thread_local! {
    /// The dense K and V (and the visible keys) of the last call on this thread, kept so
    /// that the next call (the next layer) reuses the allocations.
    static SCRATCH: std::cell::Cell<(Vec<f32>, Vec<f32>, Vec<bool>)> = const {
        std::cell::Cell::new((Vec::new(), Vec::new(), Vec::new()))
    };
}

/// Into `seen`, for every key: whether some query row of the mask (any of its heads and
/// batches) does not mask it with `-inf`; every key without a mask. A decode step's mask
/// hides the unused end of its KV-length bucket, whose rows need not be read.
fn visible_keys(mask: Option<HostTensor>, n_q: usize, seen: &mut Vec<bool>) {
    let Some(m) = mask else {
        seen.clear();
        return;
    };
    seen.clear();
    seen.resize(m.ne[0], false);
    let mut row = vec![0f32; m.ne[0]];
    for i3 in 0..m.ne[3] {
        for i2 in 0..m.ne[2] {
            for i in 0..n_q {
                // SAFETY: i < n_q <= m.ne[1]; i2, i3 inside the mask's shape.
                unsafe { m.read_row(i, i2, i3, &mut row) };
                for (s, &x) in seen.iter_mut().zip(&row) {
                    *s |= x != f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// The rows of `t` ([`n`, keys, heads, batch]) as dense f32 into `out`, laid out
/// [`n`, heads, keys, batch] (a key's heads side by side); only the keys marked in `seen`
/// (all when `seen` is empty) are read, the others are left as they were. When a key's heads lie
/// side by side in `t` too (a KV cache row), they are read as one row.
fn dense_rows(t: HostTensor, seen: &[bool], out: &mut Vec<f32>) {
    let (n, keys, heads, batch) = (t.ne[0], t.ne[1], t.ne[2], t.ne[3]);
    // Rows of keys not in `seen` are never read: what an earlier call left there stays
    // (no clearing of the whole buffer, layer after layer).
    out.resize(n * heads * keys * batch, 0.0);
    let merged =
        (t.nb[0] == t.dtype.block_bytes() && t.dtype.row_bytes(n) == t.nb[2]) || heads == 1;
    let whole = HostTensor {
        ne: [n * heads, keys, 1, batch],
        ..t
    };
    for (kb, key) in out.chunks_exact_mut(n * heads).enumerate() {
        let (j, b) = (kb % keys, kb / keys);
        if !seen.is_empty() && !seen[j] {
            continue;
        }
        if merged {
            // SAFETY: key j of batch b is inside t, its heads contiguous (checked above).
            unsafe { whole.read_row(j, 0, b, key) };
        } else {
            for (h, row) in key.chunks_exact_mut(n).enumerate() {
                // SAFETY: (j, h, b) is inside t's shape.
                unsafe { t.read_row(j, h, b, row) };
            }
        }
    }
}

/// One query row of one head, with the dense f32 K and V rows of its KV head.
struct Row<'a> {
    q: &'a [f32],
    i: usize,
    h: usize,
    b: usize,
    n_head: usize,
    /// Key `j`'s K row at `k[j * k_stride..][..d]` (V likewise).
    k: &'a [f32],
    v: &'a [f32],
    k_stride: usize,
    v_stride: usize,
}

/// [`attend`] compiled for AVX2 and FMA where the CPU has them (the same operations in
/// the same order: only the vector width of the loops differs, not the result).
fn attend_fast(
    p: &FlashAttnParams,
    row: &Row,
    mask: Option<HostTensor>,
    scores: &mut [f32],
    acc: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        /// [`attend`] with AVX2 and FMA enabled.
        #[target_feature(enable = "avx2,fma")]
        unsafe fn attend_avx2(
            p: &FlashAttnParams,
            row: &Row,
            mask: Option<HostTensor>,
            scores: &mut [f32],
            acc: &mut [f32],
        ) {
            attend(p, row, mask, scores, acc);
        }
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        unsafe { attend_avx2(p, row, mask, scores, acc) };
        return;
    }
    attend(p, row, mask, scores, acc);
}

/// The attention output of one query row into `acc`: the scores of every key into
/// `scores` (`-inf` where masked), their softmax, and the weighted sum of the V rows.
#[inline(always)]
fn attend(
    p: &FlashAttnParams,
    row: &Row,
    mask: Option<HostTensor>,
    scores: &mut [f32],
    acc: &mut [f32],
) {
    let slope = p.slope(row.h, row.n_head);
    if let Some(m) = mask {
        // SAFETY: the mask broadcasts over heads and batches; the row index is inside it.
        unsafe { m.read_row(row.i, row.h % m.ne[2], row.b % m.ne[3], scores) };
    } else {
        scores.fill(0.0);
    }
    let d = row.q.len();
    let mut max = f32::NEG_INFINITY;
    for (j, s) in scores.iter_mut().enumerate() {
        if *s == f32::NEG_INFINITY {
            continue;
        }
        let krow = &row.k[j * row.k_stride..j * row.k_stride + d];
        let bias = slope * *s;
        let mut x = p.scale * finite_or_nan(super::mul_mat::dot_f32(row.q, krow));
        if p.softcap > 0.0 {
            x = p.softcap * (x / p.softcap).tanh();
        }
        *s = x + bias;
        max = max_nan(max, *s);
    }
    acc.fill(0.0);
    if max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0f32;
    let d_v = acc.len();
    for (j, &s) in scores.iter().enumerate() {
        if s == f32::NEG_INFINITY {
            continue;
        }
        let vrow = &row.v[j * row.v_stride..j * row.v_stride + d_v];
        let w = (s - max).exp();
        sum += w;
        acc.iter_mut().zip(vrow).for_each(|(a, x)| *a += w * x);
    }
    acc.iter_mut().for_each(|a| *a /= sum);
}

/// A `q . k` dot product as the score takes it: NaN when it is not finite, so that an
/// infinity in q or k cannot pass for a masked key (`-inf`) or be capped to a finite score
/// by softcapping.
#[inline(always)]
fn finite_or_nan(dot: f32) -> f32 {
    if dot.is_finite() {
        dot
    } else {
        f32::NAN
    }
}
