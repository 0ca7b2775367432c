//! Four weight rows of a legacy type (IQ4_NL among them) against `NC` Q8_1 columns at
//! once: the kernel of the products with several columns (prefill).
//!
//! Each block of the four rows is unpacked once for all the columns and transposed in
//! 4-byte groups ([`transpose`]): register `i` holds group `i` of the four rows in its
//! low 128-bit half and group `i + 4` in its high half. A column's block is then spread
//! to match by four `vpshufd` (group `i` of the activations in every lane of the low
//! half, group `i + 4` in the high half), so the products of the four registers, summed
//! lane by lane, give in each lane the integer sum of one row (lanes 0..4 and 4..8: rows
//! 0..4, low and high half of the block), with no horizontal sums. That vector is
//! converted once and scaled by the rows' `d` times the column's `d8` in one
//! multiply-add, and the rows' offsets (the `s8` terms) take one more. The row-at-a-time
//! kernel spends a conversion, a broadcast, a multiply-add and a scalar offset per row
//! and column instead; measured on a 2-core Zen 4, a [576, 1536] product of 128 columns
//! took 0.48x its time for Q4_0, 0.60x for Q5_0, 0.73x for Q8_0 and 0.78x for IQ4_NL.
//! (Also tried on the sub-blocks of the K-quants and IQ4_XS, one row's scales unpacked per
//! sub-block: it was slower there.) The integer sums are those of the portable code;
//! only the order of the f32 additions differs.

use std::arch::x86_64::*;

use super::{legacy_block, legacy_bytes, Cols};
use super::{IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1};
use crate::quant::QType;

/// Whether the quants of `T` are signed (their signs go onto the activations:
/// `|q| * (a * sign(q))`).
const fn signed(t: u8) -> bool {
    matches!(t, Q8_0 | Q8_1 | IQ4_NL)
}

/// Whether a unit of `T` has an offset applied through the Q8_1 block's `s`.
const fn has_offset(t: u8) -> bool {
    matches!(t, Q4_0 | Q4_1 | Q5_0 | Q5_1)
}

/// One block of a weight row: its 32 quants, its scale `d` and the factor of the Q8_1
/// block's `s` in its dot product (0 without an offset).
#[derive(Clone, Copy)]
struct Unit {
    q: __m256i,
    d: f32,
    m: f32,
}

/// Block `k` of the row at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn unit<const T: u8>(p: *const u8, k: usize) -> Unit {
    let (q, d, m) = legacy_block::<T>(p.add(k * legacy_bytes(T)));
    Unit { q, d, m }
}

/// The 32 quants of four rows (one register each) regrouped by 4-byte group: register
/// `i` holds, in its 32-bit lanes, group `i` of rows 0..4 and then group `i + 4` of rows
/// 0..4 (a 4x4 transpose of 32-bit lanes in each 128-bit half).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn transpose(q: [__m256i; 4]) -> [__m256i; 4] {
    let t0 = _mm256_unpacklo_epi32(q[0], q[1]);
    let t1 = _mm256_unpackhi_epi32(q[0], q[1]);
    let t2 = _mm256_unpacklo_epi32(q[2], q[3]);
    let t3 = _mm256_unpackhi_epi32(q[2], q[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// The integer sums of four rows (quants `wt` from [`transpose`], `wa` their magnitudes
/// for the signed types) against one Q8_1 block `av`: lane `r` and `r + 4` the sums of
/// row `r` over the low and high half of the block.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sums<const T: u8>(wt: &[__m256i; 4], wa: &[__m256i; 4], av: __m256i) -> __m256i {
    let a0 = _mm256_shuffle_epi32::<0x00>(av);
    let a1 = _mm256_shuffle_epi32::<0x55>(av);
    let a2 = _mm256_shuffle_epi32::<0xaa>(av);
    let a3 = _mm256_shuffle_epi32::<0xff>(av);
    let ones = _mm256_set1_epi16(1);
    if signed(T) {
        // |q| * (a * sign(q)) in pairs: |sum| <= 2 * 127 * 128, summed in i32
        let p0 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wa[0], _mm256_sign_epi8(a0, wt[0])),
            ones,
        );
        let p1 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wa[1], _mm256_sign_epi8(a1, wt[1])),
            ones,
        );
        let p2 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wa[2], _mm256_sign_epi8(a2, wt[2])),
            ones,
        );
        let p3 = _mm256_madd_epi16(
            _mm256_maddubs_epi16(wa[3], _mm256_sign_epi8(a3, wt[3])),
            ones,
        );
        _mm256_add_epi32(_mm256_add_epi32(p0, p1), _mm256_add_epi32(p2, p3))
    } else {
        // 4- and 5-bit quants: |pair| <= 2 * 31 * 128, so four pairs still fit an i16
        let p0 = _mm256_maddubs_epi16(wt[0], a0);
        let p1 = _mm256_maddubs_epi16(wt[1], a1);
        let p2 = _mm256_maddubs_epi16(wt[2], a2);
        let p3 = _mm256_maddubs_epi16(wt[3], a3);
        _mm256_madd_epi16(
            _mm256_add_epi16(_mm256_add_epi16(p0, p1), _mm256_add_epi16(p2, p3)),
            ones,
        )
    }
}

/// The rows at `rows` (`units` blocks each) against `NC` columns of `a`: `out[c][r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<const T: u8, const NC: usize>(
    rows: [*const u8; 4],
    units: usize,
    a: Cols,
) -> [[f32; 4]; NC] {
    let mut acc = [_mm256_setzero_ps(); NC];
    let mut offs = [_mm_setzero_ps(); NC];
    for k in 0..units {
        // (not rows.map: a closure would not inherit the target features)
        let u = [
            unit::<T>(rows[0], k),
            unit::<T>(rows[1], k),
            unit::<T>(rows[2], k),
            unit::<T>(rows[3], k),
        ];
        let d = _mm_setr_ps(u[0].d, u[1].d, u[2].d, u[3].d);
        let d = _mm256_set_m128(d, d);
        let m = _mm_setr_ps(u[0].m, u[1].m, u[2].m, u[3].m);
        let wt = transpose([u[0].q, u[1].q, u[2].q, u[3].q]);
        let wa = if signed(T) {
            [
                _mm256_sign_epi8(wt[0], wt[0]),
                _mm256_sign_epi8(wt[1], wt[1]),
                _mm256_sign_epi8(wt[2], wt[2]),
                _mm256_sign_epi8(wt[3], wt[3]),
            ]
        } else {
            wt
        };
        for c in 0..NC {
            let (av, d8, s8) = a.block(c, k);
            let si = sums::<T>(&wt, &wa, av);
            // lanes: rows 0..4 of the low halves, then of the high halves
            let s = _mm256_cvtepi32_ps(si);
            acc[c] = _mm256_fmadd_ps(s, _mm256_mul_ps(d, _mm256_set1_ps(d8)), acc[c]);
            if has_offset(T) {
                offs[c] = _mm_fmadd_ps(m, _mm_set1_ps(s8), offs[c]);
            }
        }
    }
    let mut out = [[0.0f32; 4]; NC];
    for (c, o) in out.iter_mut().enumerate() {
        let halves = _mm_add_ps(
            _mm256_castps256_ps128(acc[c]),
            _mm256_extractf128_ps::<1>(acc[c]),
        );
        _mm_storeu_ps(o.as_mut_ptr(), _mm_add_ps(halves, offs[c]));
    }
    out
}

/// The row tiles of [`super::dot_rows`]: rows `0..nrows / 4 * 4` (`stride` bytes apart,
/// `nb` blocks of `q` each, the first at `w`) against the `NC` columns of `a`, row `r`
/// and column `c` into `out[r * ncols + c]`; the number of rows done, 0 for a type
/// that is not a legacy one.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; the rows are valid memory; `a` holds `NC` columns of
/// one Q8_1 block per 32 weights of a row; `out` holds `nrows * ncols` floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn rows<const NC: usize>(
    q: QType,
    (w, stride, nb): (*const u8, usize, usize),
    (nrows, ncols): (usize, usize),
    a: Cols,
    out: &mut [f32],
) -> usize {
    match q {
        QType::Q4_0 => each_tile::<Q4_0, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::Q4_1 => each_tile::<Q4_1, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::Q5_0 => each_tile::<Q5_0, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::Q5_1 => each_tile::<Q5_1, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::Q8_0 => each_tile::<Q8_0, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::Q8_1 => each_tile::<Q8_1, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::IQ4_NL => each_tile::<IQ4_NL, NC>((w, stride, nb), (nrows, ncols), a, out),
        QType::Q4_K
        | QType::Q5_K
        | QType::Q6_K
        | QType::Q3_K
        | QType::IQ4_XS
        | QType::Q2_K
        | QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M
        | QType::TQ1_0
        | QType::TQ2_0 => 0,
    }
}

/// [`rows`] for the legacy type `T`, rows of `units` blocks.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn each_tile<const T: u8, const NC: usize>(
    (w, stride, units): (*const u8, usize, usize),
    (nrows, ncols): (usize, usize),
    a: Cols,
    out: &mut [f32],
) -> usize {
    let done = nrows / 4 * 4;
    for r in (0..done).step_by(4) {
        let p = w.add(r * stride);
        let rows = [p, p.add(stride), p.add(2 * stride), p.add(3 * stride)];
        for (c, v) in tile::<T, NC>(rows, units, a).into_iter().enumerate() {
            for (i, x) in v.into_iter().enumerate() {
                out[(r + i) * ncols + c] = x;
            }
        }
    }
    done
}
