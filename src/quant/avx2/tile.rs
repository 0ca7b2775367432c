//! Four weight rows against `NC` Q8_1 columns at once: the kernel of the products with
//! several columns (prefill) for the legacy types (IQ4_NL among them) and the
//! super-block types with one scale per 32 elements (Q4_K, Q5_K, IQ4_XS) on CPUs without
//! AVX-512 VNNI, and on those for the rows after the last eight that [`super::tile8`]
//! takes (which unpacks its units with [`unit`]).
//!
//! Each 32-element unit of the four rows (a block, or a sub-block: what one Q8_1 block
//! meets) is unpacked once for all the columns and transposed in 4-byte groups
//! ([`transpose`]): register `i` holds group `i` of the four rows in its low 128-bit half
//! and group `i + 4` in its high half. A column's block is then spread to match by four
//! `vpshufd` (group `i` of the activations in every lane of the low half, group `i + 4`
//! in the high half), so the products of the four registers, summed lane by lane, give
//! in each lane the integer sum of one row (lanes 0..4 and 4..8: rows 0..4, low and high
//! half of the unit), with no horizontal sums. That vector is converted once and scaled
//! by the rows' factors times the column's `d8` in one multiply-add, and the rows'
//! offsets (the `s8` terms) take one more. A sub-block's integer scale is folded into its
//! f32 factor (`d * sc`, exact in f32), its min into the offset factor, both unpacked once
//! per super-block ([`Factors`]). The row-at-a-time kernels spend a conversion, a
//! broadcast, a multiply-add and a scalar offset per row and column instead; measured on
//! a 2-core Zen 4, one thread, 128 columns, [576, 1536] products took 0.48x their time for
//! Q4_0, 0.60x for Q5_0, 0.73x for Q8_0, 0.78x for IQ4_NL, and [1536, 576] ones 0.85x for
//! IQ4_XS, 0.97x for Q4_K and about the same for Q5_K. A decode step (one column) of the
//! super-block types stays on the row kernels, which were faster there. The integer sums
//! are those of the portable code; only the order of the f32 additions differs.

use std::arch::x86_64::*;

use super::{dpbusd, f16x2, iq4_levels, legacy_block, legacy_bytes, nibbles, Cols};
use super::{IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1};
use crate::quant::dot::Results;
use crate::quant::iq4::iq4_xs_scale;
use crate::quant::kquants::scale_min_k4;
use crate::quant::QType;

/// The most columns [`super::dot_rows`] hands the tiles at once with AVX-512 VNNI (4
/// without it).
pub(super) const WIDE_COLS: usize = 8;

/// Whether [`rows`] has tiles for `q` (the others run row by row).
pub(super) fn has_tiles(q: QType) -> bool {
    matches!(
        q,
        QType::Q4_0
            | QType::Q4_1
            | QType::Q5_0
            | QType::Q5_1
            | QType::Q8_0
            | QType::Q8_1
            | QType::IQ4_NL
            | QType::Q4_K
            | QType::Q5_K
            | QType::IQ4_XS
    )
}

// The super-block types with one scale per 32 elements, as const parameters (after the
// legacy ones of `super`).
pub(super) const Q4_K: u8 = 7;
pub(super) const Q5_K: u8 = 8;
pub(super) const IQ4_XS: u8 = 9;

/// Whether the quants of `T` are signed (their signs go onto the activations:
/// `|q| * (a * sign(q))`).
pub(super) const fn signed(t: u8) -> bool {
    matches!(t, Q8_0 | Q8_1 | IQ4_NL | IQ4_XS)
}

/// Whether `T` comes in 256-element super-blocks of 8 units.
const fn super_block(t: u8) -> bool {
    matches!(t, Q4_K | Q5_K | IQ4_XS)
}

/// Whether a unit of `T` has an offset applied through the Q8_1 block's `s`.
pub(super) const fn has_offset(t: u8) -> bool {
    matches!(t, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4_K | Q5_K)
}

/// The factors of the 8 sub-blocks of one super-block of four rows: `d[j][r]` scales
/// the sums of sub-block `j` of row `r` (the super-block's `d` times the sub-block's
/// integer scale, a product exact in f32), `m[j][r]` multiplies the Q8_1 block's `s`
/// (`-dmin` times the sub-block's min; 0 for IQ4_XS).
#[derive(Clone, Copy, Default)]
pub(super) struct Factors {
    d: [[f32; 4]; 8],
    m: [[f32; 4]; 8],
}

/// The [`Factors`] of super-block `b` of the rows at `rows`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn factors<const T: u8>(rows: [*const u8; 4], b: usize) -> Factors {
    let mut f = Factors::default();
    for (r, &p) in rows.iter().enumerate() {
        if T == IQ4_XS {
            let wb = p.add(136 * b);
            let d = f16x2(wb).0;
            let head = std::slice::from_raw_parts(wb, 8);
            for j in 0..8 {
                f.d[j][r] = d * f32::from(i16::from(iq4_xs_scale(head, j)) - 32);
            }
        } else {
            let wb = p.add(b * if T == Q5_K { 176 } else { 144 });
            let (d, dmin) = f16x2(wb);
            let scales = std::slice::from_raw_parts(wb.add(4), 12);
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                f.d[j][r] = d * f32::from(sc);
                f.m[j][r] = -dmin * f32::from(m);
            }
        }
    }
    f
}

/// The 32 quants of sub-block `j` of super-block `b` of the row at `p` (IQ4_XS: the
/// signed levels).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sub_quants<const T: u8>(p: *const u8, b: usize, j: usize) -> __m256i {
    if T == IQ4_XS {
        return iq4_levels(nibbles(p.add(136 * b + 8 + 16 * j)));
    }
    let wb = p.add(b * if T == Q5_K { 176 } else { 144 });
    let qs = wb.add(if T == Q5_K { 48 } else { 16 });
    let raw = _mm256_loadu_si256(qs.add(32 * (j / 2)) as *const __m256i);
    let low = _mm256_set1_epi8(0x0f);
    let q = match j % 2 {
        0 => _mm256_and_si256(raw, low),
        _ => _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low),
    };
    if T != Q5_K {
        return q;
    }
    let qh = _mm256_loadu_si256(wb.add(16) as *const __m256i);
    let bit = _mm256_set1_epi8((1u8 << j) as i8);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
    _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// Unit `k` of the rows at `rows` (block `k`, or sub-block `k % 8` of super-block
/// `k / 8`, whose factors `f` holds once `k % 8 == 0` has filled it): the four rows'
/// quants, their scales `d` and their factors of the Q8_1 block's `s`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn unit<const T: u8>(
    rows: [*const u8; 4],
    k: usize,
    f: &mut Factors,
) -> ([__m256i; 4], __m128, __m128) {
    if super_block(T) {
        let (b, j) = (k / 8, k % 8);
        if j == 0 {
            *f = factors::<T>(rows, b);
        }
        let q = [
            sub_quants::<T>(rows[0], b, j),
            sub_quants::<T>(rows[1], b, j),
            sub_quants::<T>(rows[2], b, j),
            sub_quants::<T>(rows[3], b, j),
        ];
        let (d, m) = (f.d[j].as_ptr(), f.m[j].as_ptr());
        return (q, _mm_loadu_ps(d), _mm_loadu_ps(m));
    }
    // (not rows.map: a closure would not inherit the target features)
    let at = k * legacy_bytes(T);
    let u = [
        legacy_block::<T>(rows[0].add(at)),
        legacy_block::<T>(rows[1].add(at)),
        legacy_block::<T>(rows[2].add(at)),
        legacy_block::<T>(rows[3].add(at)),
    ];
    let d = _mm_setr_ps(u[0].1, u[1].1, u[2].1, u[3].1);
    let m = _mm_setr_ps(u[0].2, u[1].2, u[2].2, u[3].2);
    ([u[0].0, u[1].0, u[2].0, u[3].0], d, m)
}

/// The 32 quants of four rows (one register each) regrouped by 4-byte group: register
/// `i` holds, in its 32-bit lanes, group `i` of rows 0..4 and then group `i + 4` of rows
/// 0..4 (a 4x4 transpose of 32-bit lanes in each 128-bit half).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn transpose(q: [__m256i; 4]) -> [__m256i; 4] {
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
/// row `r` over the low and high half of the block. `V`: by [`vnni_sums`] (`wa` unused,
/// `start` from [`signed_start`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn sums<const T: u8, const V: bool>(
    wt: &[__m256i; 4],
    wa: &[__m256i; 4],
    (av, start): (__m256i, __m256i),
) -> __m256i {
    if V {
        return vnni_sums::<T>(wt, (av, start));
    }
    let [a0, a1, a2, a3] = dwords(av);
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

/// Each of the four 4-byte groups of every 128-bit half of `v`, repeated over its half:
/// the activations a transposed quant register ([`transpose`]) meets.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dwords(v: __m256i) -> [__m256i; 4] {
    [
        _mm256_shuffle_epi32::<0x00>(v),
        _mm256_shuffle_epi32::<0x55>(v),
        _mm256_shuffle_epi32::<0xaa>(v),
        _mm256_shuffle_epi32::<0xff>(v),
    ]
}

/// [`sums`] by `vpdpbusd`, in two chains of two. Unsigned quants meet the signed
/// activations directly (`start` zero); the signed types' quants meet the activations
/// plus 128 (unsigned: `a ^ 0x80`), from `start` = -128 times the quants' sums
/// ([`signed_start`]), which is the same for every column.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn vnni_sums<const T: u8>(wt: &[__m256i; 4], (av, start): (__m256i, __m256i)) -> __m256i {
    // vpdpbusd's first operand is the unsigned one
    let (u, s) = match signed(T) {
        true => (dwords(_mm256_xor_si256(av, _mm256_set1_epi8(i8::MIN))), *wt),
        false => (*wt, dwords(av)),
    };
    let p01 = dpbusd::<true>(dpbusd::<true>(start, u[0], s[0]), u[1], s[1]);
    let p23 = dpbusd::<true>(
        dpbusd::<true>(_mm256_setzero_si256(), u[2], s[2]),
        u[3],
        s[3],
    );
    _mm256_add_epi32(p01, p23)
}

/// -128 times the sum of the signed bytes of each i32 lane over the four registers `wt`
/// (by `vpdpbusd`: the CPU has AVX-512 VNNI and VL): what [`vnni_sums`] takes off the
/// products of the activations plus 128.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn signed_start(wt: &[__m256i; 4]) -> __m256i {
    let zero = _mm256_setzero_si256();
    // 128 as an unsigned byte
    let h = _mm256_set1_epi8(i8::MIN);
    let s01 = dpbusd::<true>(dpbusd::<true>(zero, h, wt[0]), h, wt[1]);
    let s23 = dpbusd::<true>(dpbusd::<true>(zero, h, wt[2]), h, wt[3]);
    _mm256_sub_epi32(zero, _mm256_add_epi32(s01, s23))
}

/// The rows at `rows` (`units` blocks each) against `NC` columns of `a`: `out[c][r]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<const T: u8, const NC: usize, const V: bool>(
    rows: [*const u8; 4],
    units: usize,
    a: Cols,
) -> [[f32; 4]; NC] {
    let mut acc = [_mm256_setzero_ps(); NC];
    let mut offs = [_mm_setzero_ps(); NC];
    let mut f = Factors::default();
    for k in 0..units {
        let (q, d, m) = unit::<T>(rows, k, &mut f);
        let d = _mm256_set_m128(d, d);
        let wt = transpose(q);
        let (wa, start) = match (signed(T), V) {
            (true, false) => (
                [
                    _mm256_sign_epi8(wt[0], wt[0]),
                    _mm256_sign_epi8(wt[1], wt[1]),
                    _mm256_sign_epi8(wt[2], wt[2]),
                    _mm256_sign_epi8(wt[3], wt[3]),
                ],
                _mm256_setzero_si256(),
            ),
            (true, true) => (wt, signed_start(&wt)),
            (false, _) => (wt, _mm256_setzero_si256()),
        };
        for c in 0..NC {
            let (av, d8, s8) = a.block(c, k);
            let si = sums::<T, V>(&wt, &wa, (av, start));
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

/// `$body` with the const `$t` the code of the block type `$q` among the types with tiles
/// (the legacy types' of `super`, then [`Q4_K`], [`Q5_K`], [`IQ4_XS`]) and `$units` the
/// units of a row of `$nb` blocks (8 a super-block); `$none` for the other types.
macro_rules! by_tile_type {
    ($q:expr, $nb:expr, $t:ident, $units:ident => $body:expr, $none:expr) => {{
        use $crate::quant::avx2::tile::{IQ4_XS, Q4_K, Q5_K};
        use $crate::quant::avx2::{IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1};
        use $crate::quant::QType;
        match $q {
            QType::Q4_0 => {
                const $t: u8 = Q4_0;
                let $units = $nb;
                $body
            }
            QType::Q4_1 => {
                const $t: u8 = Q4_1;
                let $units = $nb;
                $body
            }
            QType::Q5_0 => {
                const $t: u8 = Q5_0;
                let $units = $nb;
                $body
            }
            QType::Q5_1 => {
                const $t: u8 = Q5_1;
                let $units = $nb;
                $body
            }
            QType::Q8_0 => {
                const $t: u8 = Q8_0;
                let $units = $nb;
                $body
            }
            QType::Q8_1 => {
                const $t: u8 = Q8_1;
                let $units = $nb;
                $body
            }
            QType::IQ4_NL => {
                const $t: u8 = IQ4_NL;
                let $units = $nb;
                $body
            }
            QType::Q4_K => {
                const $t: u8 = Q4_K;
                let $units = $nb * 8;
                $body
            }
            QType::Q5_K => {
                const $t: u8 = Q5_K;
                let $units = $nb * 8;
                $body
            }
            QType::IQ4_XS => {
                const $t: u8 = IQ4_XS;
                let $units = $nb * 8;
                $body
            }
            QType::Q6_K
            | QType::Q3_K
            | QType::Q2_K
            | QType::IQ2_XXS
            | QType::IQ2_XS
            | QType::IQ2_S
            | QType::IQ3_XXS
            | QType::IQ3_S
            | QType::IQ1_S
            | QType::IQ1_M
            | QType::TQ1_0
            | QType::TQ2_0 => $none,
        }
    }};
}
pub(super) use by_tile_type;

/// The row tiles of [`super::dot_rows`]: rows `0..nrows / 4 * 4` (`stride` bytes apart,
/// `nb` blocks of `q` each, the first at `w`) against the `NC` columns of `a`, row `r`
/// and column `c` into `out`; the number of rows done, 0 for a type that is not a
/// legacy one.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and AVX-512 VNNI and VL when `V`; the rows are valid
/// memory; `a` holds `NC` columns of one Q8_1 block per 32 weights of a row; `out` holds
/// `nrows` rows of `NC` results.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn rows<const NC: usize, const V: bool>(
    q: QType,
    (w, stride, nb): (*const u8, usize, usize),
    nrows: usize,
    a: Cols,
    out: Results,
) -> usize {
    by_tile_type!(q, nb, T, units => each_tile::<T, NC, V>((w, stride, units), nrows, a, out), 0)
}

/// [`rows`] for the type `T`, rows of `units` units.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn each_tile<const T: u8, const NC: usize, const V: bool>(
    (w, stride, units): (*const u8, usize, usize),
    nrows: usize,
    a: Cols,
    out: Results,
) -> usize {
    if NC == 1 && super_block(T) {
        // a decode step: the row kernels were faster (the factors of four rows cost more
        // than one column's products win)
        return 0;
    }
    match V {
        true => each_tile_wide::<T, NC>((w, stride, units), nrows, a, out),
        false => tiles::<T, NC, false>((w, stride, units), nrows, a, out),
    }
}

/// [`tiles`] by `vpdpbusd`, compiled for AVX-512 (F, VL, BW, VNNI): its 32 vector
/// registers hold the accumulators of up to 8 columns ([`WIDE_COLS`]) besides a unit's
/// quants, so that each unit is unpacked once for twice the columns of the AVX2 tile.
///
/// # Safety
/// As [`rows`] with `V`: the CPU has AVX-512 F, VL, BW and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn each_tile_wide<const T: u8, const NC: usize>(
    (w, stride, units): (*const u8, usize, usize),
    nrows: usize,
    a: Cols,
    out: Results,
) -> usize {
    tiles::<T, NC, true>((w, stride, units), nrows, a, out)
}

/// The loop of [`each_tile`]: every whole tile of four rows, its results into `out`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tiles<const T: u8, const NC: usize, const V: bool>(
    (w, stride, units): (*const u8, usize, usize),
    nrows: usize,
    a: Cols,
    out: Results,
) -> usize {
    let done = nrows / 4 * 4;
    for r in (0..done).step_by(4) {
        let p = w.add(r * stride);
        let rows = [p, p.add(stride), p.add(2 * stride), p.add(3 * stride)];
        for (c, v) in tile::<T, NC, V>(rows, units, a).into_iter().enumerate() {
            for (i, x) in v.into_iter().enumerate() {
                out.set(r + i, c, x);
            }
        }
    }
    done
}
