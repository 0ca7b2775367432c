//! AVX2 kernels of the low-bit K-quants and IQ4_XS (IQ4_NL runs as a legacy type, see
//! `legacy_block`): one weight row against `NC` Q8_1 columns, the sums of the portable
//! `dot_subs` with the f32 terms added in another order.
//!
//! Each 32-element sub-block is unpacked into one `__m256i` of quants, multiplied by the
//! column's Q8_1 quants with `vpmaddubsw` (unsigned quants; IQ4_XS's signed levels by the
//! sign trick, `|q| * (a * sign(q))`) and weighted by the sub-block's scales with
//! `vpmaddwd`: one scale per 16-element half (the low and high 128-bit lanes) for Q2_K and
//! Q3_K. Q3_K's `-4` is taken off in i16 (`4 * a` pair sums, as Q6_K's `-32`), Q2_K's mins
//! weight the pair sums of the activations.

use std::arch::x86_64::*;

use super::{f16x2, halves, iq4_levels, nibbles, Acc, Cols, SPLIT_BELOW};
use crate::quant::kquants23::q3_k_scale;

/// The 2-bit field `f` (0..4) of every byte of `v`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn field2(v: __m256i, f: usize) -> __m256i {
    let shifted = _mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * f as i32));
    // the 16-bit shift moves bits across bytes; the mask keeps each byte's own field
    _mm256_and_si256(shifted, _mm256_set1_epi8(3))
}

/// Runs `$step::<NC>(w, b, j, a, acc)` over the `$nb` super-blocks' 8 sub-blocks,
/// alternating two accumulator sets below [`SPLIT_BELOW`] columns (as the K-quant kernels
/// do), and gives the totals. (A macro, not a function taking a closure: a closure would
/// not inherit the kernels' target features.)
macro_rules! each_sub {
    ($step:ident, $w:expr, $nb:expr, $a:expr) => {{
        let (mut even, mut odd) = (Acc::<NC>::new(), Acc::<NC>::new());
        for b in 0..$nb {
            for j in (0..8).step_by(2) {
                $step::<NC>($w, b, j, $a, &mut even);
                let other = if NC >= SPLIT_BELOW {
                    &mut even
                } else {
                    &mut odd
                };
                $step::<NC>($w, b, j + 1, $a, other);
            }
        }
        even.sum(odd)
    }};
}

/// One Q2_K row of `nb` super-blocks (84 bytes: `scales[16]`, `qs[64]`, `d`, `dmin`) at
/// `w` against `NC` Q8_1 columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn q2_k<const NC: usize>(w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    each_sub!(q2_k_step, w, nb, a)
}

/// Sub-block `j` of Q2_K super-block `b` of the row at `w` against `NC` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q2_k_step<const NC: usize>(w: *const u8, b: usize, j: usize, a: Cols, acc: &mut Acc<NC>) {
    let wb = w.add(84 * b);
    let (d, dmin) = f16x2(wb.add(80));
    let raw = _mm256_loadu_si256(wb.add(16 + 32 * (j / 4)) as *const __m256i);
    let q = field2(raw, j % 4);
    let (s0, s1) = (*wb.add(2 * j), *wb.add(2 * j + 1));
    let scv = halves(i16::from(s0 & 15), i16::from(s1 & 15));
    let mv = halves(i16::from(s0 >> 4), i16::from(s1 >> 4));
    let ones = _mm256_set1_epi8(1);
    for c in 0..NC {
        let (av, d8, _) = a.block(c, 8 * b + j);
        acc.add(
            c,
            d * d8,
            _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), scv),
        );
        let asum = _mm256_maddubs_epi16(ones, av);
        acc.add(c, -dmin * d8, _mm256_madd_epi16(asum, mv));
    }
}

/// One Q3_K row of `nb` super-blocks (110 bytes: `hmask[32]`, `qs[64]`, `scales[12]`,
/// `d`) at `w` against `NC` Q8_1 columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn q3_k<const NC: usize>(w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    each_sub!(q3_k_step, w, nb, a)
}

/// Sub-block `j` of Q3_K super-block `b` of the row at `w` against `NC` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q3_k_step<const NC: usize>(w: *const u8, b: usize, j: usize, a: Cols, acc: &mut Acc<NC>) {
    let four = _mm256_set1_epi8(4);
    let wb = w.add(110 * b);
    // d is the block's last two bytes: read 4 bytes ending there
    let d = f16x2(wb.add(106)).1;
    let raw = _mm256_loadu_si256(wb.add(32 + 32 * (j / 4)) as *const __m256i);
    let hm = _mm256_loadu_si256(wb as *const __m256i);
    let bit = _mm256_set1_epi8((1u8 << j) as i8);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
    // q + 4 in 0..8: the low bits, plus 4 where the high bit is set
    let q = _mm256_or_si256(field2(raw, j % 4), _mm256_and_si256(set, four));
    let scales = std::slice::from_raw_parts(wb.add(96), 12);
    let sc = |h: usize| i16::from(q3_k_scale(scales, h)) - 32;
    let scv = halves(sc(2 * j), sc(2 * j + 1));
    for c in 0..NC {
        let (av, d8, _) = a.block(c, 8 * b + j);
        // (q + 4 - 4) * a summed in pairs, in i16: |sum| <= 2 * 4 * 127
        let p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, av), _mm256_maddubs_epi16(four, av));
        acc.add(c, d * d8, _mm256_madd_epi16(p, scv));
    }
}

/// One IQ4_XS row of `nb` super-blocks (136 bytes: `d`, `scales_h`, `scales_l[4]`,
/// `qs[128]`) at `w` against `NC` Q8_1 columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn iq4_xs<const NC: usize>(w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    each_sub!(iq4_xs_step, w, nb, a)
}

/// Sub-block `j` of IQ4_XS super-block `b` of the row at `w` against `NC` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn iq4_xs_step<const NC: usize>(
    w: *const u8,
    b: usize,
    j: usize,
    a: Cols,
    acc: &mut Acc<NC>,
) {
    let wb = w.add(136 * b);
    let (d, _) = f16x2(wb);
    let h = u16::from_le_bytes([*wb.add(2), *wb.add(3)]);
    let ls = ((*wb.add(4 + j / 2) >> (4 * (j % 2))) & 15) | ((((h >> (2 * j)) & 3) as u8) << 4);
    let scv = _mm256_set1_epi16(i16::from(ls) - 32);
    let q = iq4_levels(nibbles(wb.add(8 + 16 * j)));
    let qa = _mm256_sign_epi8(q, q);
    for c in 0..NC {
        let (av, d8, _) = a.block(c, 8 * b + j);
        // |q| * (a * sign(q)) in pairs: |sum| <= 2 * 127 * 127, no saturation
        let p = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(av, q));
        acc.add(c, d * d8, _mm256_madd_epi16(p, scv));
    }
}
