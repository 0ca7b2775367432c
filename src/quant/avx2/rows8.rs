//! Products of frozen Q4_0 and IQ4_NL weights kept in rows of eight
//! ([`crate::quant::rows8`]) by Q8_1 columns, with `vpdpbusd` (AVX-512 VNNI and VL): the
//! decode step's single column and the prefill's many.
//!
//! A block of eight rows is one 16-byte load of their scales and four 32-byte loads of
//! their quants, each holding bytes `4g..4g + 4` of every row in the row's 32-bit lane:
//! masked and shifted, they are elements `4g..4g + 4` and `16 + 4g..16 + 4g + 4` of the
//! eight rows, which meet the column's matching 4-byte groups broadcast from memory. Lane
//! `r` of the sums is row `r`'s integer sum: one conversion and one multiply-add scale
//! eight rows, with no transpose and no horizontal sum. Q4_0's `-8` goes through the Q8_1
//! block's `s`, as in the portable code; IQ4_NL's levels are looked up plus 128 (unsigned,
//! as `vpdpbusd` wants them) and each sum starts at -128 times the sum of the column's
//! quants. The integer sums are those of the portable code; only the order of the f32
//! additions differs.

use std::arch::x86_64::*;

use super::{Cols, IQ4_NL, Q4_0, Q8};
use crate::quant::iq_tables::KVALUES_IQ4NL;
use crate::quant::rows8::ROWS;
use crate::quant::QType;

/// Bytes of a block of eight rows.
const GROUP_BLOCK: usize = 144;
/// Most columns taken at once (an accumulator, an offset sum and a running sum each).
const NC_MAX: usize = 8;

/// `out[c * col_stride + r]` = the dot product of row `r` of the groups at `w` (`groups`
/// groups of eight rows of `nb` blocks of `q`, `8 * nb * 18` bytes apart) with column `c`
/// of `a`; `sums` holds the integer sum of the quants of every Q8_1 block of `a` (read
/// for IQ4_NL only).
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI; `q` is Q4_0 or IQ4_NL (any
/// other type runs as IQ4_NL); the groups are valid memory; `a` holds `ncols` Q8_1
/// columns of `nb` blocks (and `sums` `ncols * nb` sums for IQ4_NL); `out` is valid for
/// writes of `8 * groups` floats from `c * col_stride` for every column `c`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(crate) unsafe fn rows(
    q: QType,
    (w, nb, groups): (*const u8, usize, usize),
    (a, sums): (Cols, &[i32]),
    ncols: usize,
    out: (*mut f32, usize),
) {
    // (the caller checked that q is one of the two)
    match q == QType::Q4_0 {
        true => each::<Q4_0>((w, nb, groups), (a, sums), ncols, out),
        false => each::<IQ4_NL>((w, nb, groups), (a, sums), ncols, out),
    }
}

/// [`rows`] for the type `T`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn each<const T: u8>(
    (w, nb, groups): (*const u8, usize, usize),
    (a, sums): (Cols, &[i32]),
    ncols: usize,
    (out, col_stride): (*mut f32, usize),
) {
    for gi in 0..groups {
        let g = w.add(gi * nb * GROUP_BLOCK);
        let mut c0 = 0;
        while c0 < ncols {
            let res = (out.add(gi * ROWS), col_stride);
            let at = c0;
            match ncols - c0 {
                1 => group::<T, 1>(g, nb, (a, sums), at, res),
                2 => group::<T, 2>(g, nb, (a, sums), at, res),
                3 => group::<T, 3>(g, nb, (a, sums), at, res),
                4 => group::<T, 4>(g, nb, (a, sums), at, res),
                5 => group::<T, 5>(g, nb, (a, sums), at, res),
                6 => group::<T, 6>(g, nb, (a, sums), at, res),
                7 => group::<T, 7>(g, nb, (a, sums), at, res),
                _ => group::<T, NC_MAX>(g, nb, (a, sums), at, res),
            }
            c0 += NC_MAX;
        }
    }
}

/// One group of eight rows against the `NC` columns from `c0`: row `r` and column `c0 + c`
/// into `out[(c0 + c) * col_stride + r]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn group<const T: u8, const NC: usize>(
    g: *const u8,
    nb: usize,
    (a, sums): (Cols, &[i32]),
    c0: usize,
    (out, col_stride): (*mut f32, usize),
) {
    let blocks = a.row / Q8;
    let low = _mm256_set1_epi8(0x0f);
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
    // the levels plus 128, as unsigned bytes
    let table = _mm_xor_si128(table, _mm_set1_epi8(i8::MIN));
    let table = _mm256_set_m128i(table, table);
    let mut acc = [_mm256_setzero_ps(); NC];
    let mut offs = [_mm256_setzero_ps(); NC];
    for b in 0..nb {
        let blk = g.add(b * GROUP_BLOCK);
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let at: [usize; NC] = std::array::from_fn(|c| (c0 + c) * blocks + b);
        let mut s: [__m256i; NC] = std::array::from_fn(|c| match T {
            IQ4_NL => _mm256_set1_epi32(-128 * sums[at[c]]),
            _ => _mm256_setzero_si256(),
        });
        for k in 0..4 {
            let v = _mm256_loadu_si256(blk.add(16 + 32 * k) as *const __m256i);
            let mut lo = _mm256_and_si256(v, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            if T == IQ4_NL {
                lo = _mm256_shuffle_epi8(table, lo);
                hi = _mm256_shuffle_epi8(table, hi);
            }
            for c in 0..NC {
                let x = a.q.add(at[c] * Q8 + 4) as *const i32;
                let xl = _mm256_set1_epi32(x.add(k).read_unaligned());
                let xh = _mm256_set1_epi32(x.add(4 + k).read_unaligned());
                s[c] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s[c], lo, xl), hi, xh);
            }
        }
        for c in 0..NC {
            let (d8, s8) = (*a.ds.add(2 * at[c]), *a.ds.add(2 * at[c] + 1));
            let scale = _mm256_mul_ps(d, _mm256_set1_ps(d8));
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), scale, acc[c]);
            if T == Q4_0 {
                offs[c] = _mm256_fmadd_ps(d, _mm256_set1_ps(s8), offs[c]);
            }
        }
    }
    for c in 0..NC {
        // Q4_0's quants are offset by 8: d * (d8 * sum(q a) - 8 * s8)
        let total = match T {
            Q4_0 => _mm256_fmadd_ps(_mm256_set1_ps(-8.0), offs[c], acc[c]),
            _ => acc[c],
        };
        _mm256_storeu_ps(out.add((c0 + c) * col_stride), total);
    }
}
