//! Products of frozen Q4_0 and IQ4_NL weights kept in rows of eight
//! ([`crate::quant::rows8`]) by Q8_1 columns packed eight at a time
//! ([`crate::quant::panel`]), with `vpdpbusd` on 512-bit registers (AVX-512
//! VNNI): the decode step's single column and the prefill's many.
//!
//! Several columns take two groups of eight rows through one register: a block of them is two 16-byte
//! loads of their scales and four pairs of 32-byte loads of their quants, each holding
//! bytes `4g..4g + 4` of every row in the row's 32-bit lane: masked and shifted, they are
//! elements `4g..4g + 4` and `16 + 4g..16 + 4g + 4` of the sixteen rows, which meet the
//! column's matching 4-byte groups broadcast from memory. Lane `r` of the sums is row
//! `r`'s integer sum: one conversion and one multiply-add scale sixteen rows, with no
//! transpose and no horizontal sum, and every column of a block is one pointer away. One
//! column (the decode step) takes a group at a time, in 256-bit registers.
//! Q4_0's `-8` goes through the Q8_1 block's `s`, as in the portable code; IQ4_NL's
//! levels are looked up plus 128 (unsigned, as `vpdpbusd` wants them) and each sum starts
//! at -128 times the sum of the column's quants. The integer sums are those of the
//! portable code; the f32 terms are added in the order of `tile8`'s, the prefill kernel
//! of ggml's layout, so that a prompt gives the same logits frozen or not (a decode
//! step's one-column kernels of ggml's layout add them in another order).

use std::arch::x86_64::*;

use super::{IQ4_NL, Q4_0};
use crate::quant::iq_tables::KVALUES_IQ4NL;
use crate::quant::panel::COL_PANEL;
use crate::quant::rows8::ROWS;
use crate::quant::QType;

/// Bytes of a block of eight rows.
const GROUP_BLOCK: usize = 144;
/// Columns in a packed run (an accumulator and a running sum each).
const NC_MAX: usize = 8;

/// `out[c * col_stride + r]` = the dot product of row `r` of the groups at `w` (`groups`
/// groups of eight rows of `nb` blocks of `q`, `8 * nb * 18` bytes apart) with column `c`
/// of `cols` (packed as [`crate::quant::rows8::packing`] says).
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI; `q` is Q4_0 or IQ4_NL (any
/// other type runs as IQ4_NL); the groups are valid memory; `cols` holds `ncols` columns of
/// `nb` blocks packed for `q`; `out` is valid for writes of `8 * groups` floats from
/// `c * col_stride` for every column `c`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(crate) unsafe fn rows(
    q: QType,
    (w, nb, groups): (*const u8, usize, usize),
    cols: *const u8,
    ncols: usize,
    out: (*mut f32, usize),
) {
    // (the caller checked that q is one of the two)
    match q == QType::Q4_0 {
        true => each::<Q4_0>((w, nb, groups), cols, ncols, out),
        false => each::<IQ4_NL>((w, nb, groups), cols, ncols, out),
    }
}

/// [`rows`] for the type `T`: one column group by group ([`column`]); several by pairs of
/// groups, then a last odd group read twice and stored once ([`pair`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn each<const T: u8>(
    (w, nb, groups): (*const u8, usize, usize),
    cols: *const u8,
    ncols: usize,
    (out, col_stride): (*mut f32, usize),
) {
    if ncols == 1 {
        for gi in 0..groups {
            column::<T>(w.add(gi * nb * GROUP_BLOCK), nb, cols, out.add(gi * ROWS));
        }
        return;
    }
    for gi in (0..groups).step_by(2) {
        let g0 = w.add(gi * nb * GROUP_BLOCK);
        let two = gi + 1 < groups;
        let g1 = if two { g0.add(nb * GROUP_BLOCK) } else { g0 };
        for c0 in (0..ncols).step_by(NC_MAX) {
            let x = cols.add(c0 / NC_MAX * nb * COL_PANEL);
            let res = (out.add(gi * ROWS + c0 * col_stride), col_stride, two);
            match ncols - c0 {
                1 => pair::<T, 1>((g0, g1), nb, x, res),
                2 => pair::<T, 2>((g0, g1), nb, x, res),
                3 => pair::<T, 3>((g0, g1), nb, x, res),
                4 => pair::<T, 4>((g0, g1), nb, x, res),
                5 => pair::<T, 5>((g0, g1), nb, x, res),
                6 => pair::<T, 6>((g0, g1), nb, x, res),
                7 => pair::<T, 7>((g0, g1), nb, x, res),
                _ => pair::<T, NC_MAX>((g0, g1), nb, x, res),
            }
        }
    }
}

/// One group of eight rows at `g` against the packed column at `x` (the decode step):
/// row `r` into `out[r]`. The group's blocks are read in order, one stream that the
/// hardware prefetchers keep ahead of (with [`pair`]'s two streams a decode step's products
/// of rows of eight took 15% longer).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn column<const T: u8>(g: *const u8, nb: usize, x: *const u8, out: *mut f32) {
    let low = _mm256_set1_epi8(0x0f);
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
    // the levels plus 128, as unsigned bytes
    let table = _mm256_broadcastsi128_si256(_mm_xor_si128(table, _mm_set1_epi8(i8::MIN)));
    let (mut acc, mut offs) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..nb {
        let blk = g.add(b * GROUP_BLOCK);
        let p = x.add(b * COL_PANEL);
        let word = |at: usize| _mm256_set1_epi32((p.add(at) as *const i32).read_unaligned());
        let float = |at: usize| _mm256_set1_ps((p.add(at) as *const f32).read_unaligned());
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let mut s = match T {
            IQ4_NL => word(288),
            _ => _mm256_setzero_si256(),
        };
        for k in 0..4 {
            let v = _mm256_loadu_si256(blk.add(16 + 32 * k) as *const __m256i);
            let mut lo = _mm256_and_si256(v, low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
            if T == IQ4_NL {
                lo = _mm256_shuffle_epi8(table, lo);
                hi = _mm256_shuffle_epi8(table, hi);
            }
            s = _mm256_dpbusd_epi32(
                _mm256_dpbusd_epi32(s, lo, word(4 * k)),
                hi,
                word(16 + 4 * k),
            );
        }
        let scale = _mm256_mul_ps(d, float(256));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc);
        if T == Q4_0 {
            offs = _mm256_fmadd_ps(d, float(288), offs);
        }
    }
    // Q4_0's quants are offset by 8: d * (d8 * sum(q a) - 8 * s8)
    let total = match T {
        Q4_0 => _mm256_fmadd_ps(_mm256_set1_ps(-8.0), offs, acc),
        _ => acc,
    };
    _mm256_storeu_ps(out, total);
}

/// Two groups of eight rows (`g0`, `g1`) against the first `NC` columns of the packed run
/// at `x`: row `r` (of sixteen, `g1`'s from 8; eight where not `two`) and column `c` into
/// `out[c * col_stride + r]`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn pair<const T: u8, const NC: usize>(
    (g0, g1): (*const u8, *const u8),
    nb: usize,
    x: *const u8,
    (out, col_stride, two): (*mut f32, usize, bool),
) {
    let low = _mm512_set1_epi8(0x0f);
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
    // the levels plus 128, as unsigned bytes
    let table = _mm512_broadcast_i32x4(_mm_xor_si128(table, _mm_set1_epi8(i8::MIN)));
    let mut acc = [_mm512_setzero_ps(); NC];
    let mut offs = [_mm512_setzero_ps(); NC];
    for b in 0..nb {
        let (b0, b1) = (g0.add(b * GROUP_BLOCK), g1.add(b * GROUP_BLOCK));
        let p = x.add(b * COL_PANEL);
        let word = |at: usize| _mm512_set1_epi32((p.add(at) as *const i32).read_unaligned());
        let float = |at: usize| _mm512_set1_ps((p.add(at) as *const f32).read_unaligned());
        let d = _mm512_cvtph_ps(_mm256_loadu2_m128i(b1 as *const _, b0 as *const _));
        let mut s: [__m512i; NC] = std::array::from_fn(|c| match T {
            IQ4_NL => word(288 + 4 * c),
            _ => _mm512_setzero_si512(),
        });
        for k in 0..4 {
            let v0 = _mm256_loadu_si256(b0.add(16 + 32 * k) as *const __m256i);
            let v1 = _mm256_loadu_si256(b1.add(16 + 32 * k) as *const __m256i);
            let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v0), v1);
            let mut lo = _mm512_and_si512(v, low);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
            if T == IQ4_NL {
                lo = _mm512_shuffle_epi8(table, lo);
                hi = _mm512_shuffle_epi8(table, hi);
            }
            for (c, s) in s.iter_mut().enumerate() {
                let (xl, xh) = (word(32 * c + 4 * k), word(32 * c + 16 + 4 * k));
                *s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*s, lo, xl), hi, xh);
            }
        }
        for c in 0..NC {
            let scale = _mm512_mul_ps(d, float(256 + 4 * c));
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[c]), scale, acc[c]);
            if T == Q4_0 {
                offs[c] = _mm512_fmadd_ps(d, float(288 + 4 * c), offs[c]);
            }
        }
    }
    for c in 0..NC {
        // Q4_0's quants are offset by 8: d * (d8 * sum(q a) - 8 * s8)
        let total = match T {
            Q4_0 => _mm512_fmadd_ps(_mm512_set1_ps(-8.0), offs[c], acc[c]),
            _ => acc[c],
        };
        let at = out.add(c * col_stride);
        match two {
            true => _mm512_storeu_ps(at, total),
            false => _mm256_storeu_ps(at, _mm512_castps512_ps256(total)),
        }
    }
}
