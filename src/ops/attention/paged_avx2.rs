//! The paged attention's row kernel ([`super::paged`]'s `attend_row`: one query row
//! over the gathered f32 K and V rows of its visible keys) with AVX2 and FMA: the scores
//! as eight-lane dot products, their softmax weights by the vector [`exp_ps`], and the V
//! rows summed eight values at a time. A prefill chunk runs it for every (token, head)
//! row; the portable loop took a sixth of a 128-token prefill of SmolLM2 on a 2-core Zen 4.
//!
//! Differences from the portable row: the order of the f32 additions, FMA contraction,
//! and `exp` within a few ulp. A score that is not finite makes the row NaN, softcapping
//! takes the same `tanh`, as there.

use std::arch::x86_64::*;

use super::paged::KeyRows;
use crate::graph::PagedAttnParams;
use crate::ops::simd::exp_ps;

/// The attention output of the query row `q` over the key positions `keys` of `rows`
/// (`d_v` values): NaN when a `q . k` is not finite.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`crate::ops::simd::available`]); `rows` holds every
/// key of `keys` (K rows of `q.len()` values, V rows of `d_v`).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attend_row(
    p: &PagedAttnParams,
    q: &[f32],
    rows: &KeyRows,
    keys: std::ops::Range<usize>,
    d_v: usize,
) -> Vec<f32> {
    let d = q.len();
    let mut scores: Vec<f32> = Vec::with_capacity(keys.len());
    for j in keys.clone() {
        let at = ((j - rows.first) * rows.n_head_kv + rows.hk) * d;
        let dot = dot(q, &rows.k[at..at + d]);
        if !dot.is_finite() {
            return vec![f32::NAN; d_v];
        }
        let mut s = p.scale * dot;
        if p.softcap > 0.0 {
            s = p.softcap * (s / p.softcap).tanh();
        }
        scores.push(s);
    }
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    // the weights exp(s - max) in place, eight at a time
    let mut chunks = scores.chunks_exact_mut(8);
    for c in &mut chunks {
        let s = _mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(max));
        _mm256_storeu_ps(c.as_mut_ptr(), exp_ps(s));
    }
    for s in chunks.into_remainder() {
        *s = (*s - max).exp();
    }
    let sum: f32 = scores.iter().sum();
    let mut acc = vec![0f32; d_v];
    match d_v {
        64 => weighted::<8>(rows, keys, &scores, &mut acc),
        128 => weighted::<16>(rows, keys, &scores, &mut acc),
        _ => {
            for (j, &w) in keys.zip(&scores) {
                let at = ((j - rows.first) * rows.n_head_kv + rows.hk) * d_v;
                axpy(w, &rows.v[at..at + d_v], &mut acc);
            }
        }
    }
    acc.iter_mut().for_each(|a| *a /= sum);
    acc
}

/// `acc` (`8 * N` values) = the sum over `keys` of weight `w[i]` times key `i`'s V row,
/// the sums kept in `N` registers.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn weighted<const N: usize>(
    rows: &KeyRows,
    keys: std::ops::Range<usize>,
    w: &[f32],
    acc: &mut [f32],
) {
    let d_v = 8 * N;
    let mut sum = [_mm256_setzero_ps(); N];
    for (j, &wj) in keys.zip(w) {
        let at = ((j - rows.first) * rows.n_head_kv + rows.hk) * d_v;
        let v = &rows.v[at..at + d_v];
        let wv = _mm256_set1_ps(wj);
        for (i, s) in sum.iter_mut().enumerate() {
            *s = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v.as_ptr().add(8 * i)), *s);
        }
    }
    for (i, s) in sum.iter().enumerate() {
        _mm256_storeu_ps(acc.as_mut_ptr().add(8 * i), *s);
    }
}

/// The dot product of `x` and `y` (equal lengths), eight lanes of fused multiply-adds.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let (cx, cy) = (x.chunks_exact(8), y.chunks_exact(8));
    let (rx, ry) = (cx.remainder(), cy.remainder());
    for (a, b) in cx.zip(cy) {
        acc = _mm256_fmadd_ps(
            _mm256_loadu_ps(a.as_ptr()),
            _mm256_loadu_ps(b.as_ptr()),
            acc,
        );
    }
    let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
    let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    for (a, b) in rx.iter().zip(ry) {
        s += a * b;
    }
    s
}

/// `acc += w * x` (equal lengths).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn axpy(w: f32, x: &[f32], acc: &mut [f32]) {
    let wv = _mm256_set1_ps(w);
    let mut ca = acc.chunks_exact_mut(8);
    let mut cx = x.chunks_exact(8);
    for (a, b) in (&mut ca).zip(&mut cx) {
        let v = _mm256_fmadd_ps(wv, _mm256_loadu_ps(b.as_ptr()), _mm256_loadu_ps(a.as_ptr()));
        _mm256_storeu_ps(a.as_mut_ptr(), v);
    }
    for (a, b) in ca.into_remainder().iter_mut().zip(cx.remainder()) {
        *a += w * b;
    }
}
