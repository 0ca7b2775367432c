//! The non-linear 4-bit types: IQ4_NL (32-element blocks) and IQ4_XS (256-element
//! super-blocks), whose 4-bit quants index 16 fixed levels (`KVALUES_IQ4NL`, -127 to
//! 113, denser near zero) instead of being the value itself.
//!
//! - IQ4_NL (18 bytes: `d: f16`, `qs[16]`): element `i` is `d * K[q_i]`, the nibbles packed
//!   as in Q4_0 (byte `j`: element `j` low, `j + 16` high).
//! - IQ4_XS (136 bytes: `d: f16`, `scales_h: u16`, `scales_l[4]`, `qs[128]`): 8 sub-blocks
//!   of 32, each with a 6-bit scale `ls_j` (low nibble of `scales_l[j / 2]` at `4 (j % 2)`,
//!   high 2 bits of `scales_h` at `2 j`) and IQ4_NL's nibble layout over its 16 bytes of
//!   `qs`: element `i` of sub-block `j` is `d * (ls_j - 32) * K[q_i]`.
//!
//! Quantization is ggml's `quantize_iq4_nl` / `quantize_iq4_xs` without an importance
//! matrix (what llama-quantize runs): per 32 elements, the scale that maps the value of
//! largest magnitude to the lowest level, then 15 trial scales around it, each element
//! taking its nearest level, the scale of best `x^2`-weighted least-squares fit kept;
//! IQ4_XS then rounds the sub-block scales to 6 bits against the super-block's largest
//! and picks every element's level again for its rounded scale.

use super::iq_tables::KVALUES_IQ4NL;
use super::kquants::{GROUP_MAX_EPS, QK_K};
use super::{as_array, as_array_mut, nearest_int, read_f16, signed_absmax, write_f16};

/// The trial scales on either side of the first guess (ggml's `ntry = 7`).
const NTRY: i32 = 7;

/// ggml's `best_index_int8`: the level of [`KVALUES_IQ4NL`] nearest to `x` (ties to the
/// upper one), by bisection.
#[inline(always)]
pub(crate) fn nearest_level(x: f32) -> u8 {
    let k = &KVALUES_IQ4NL;
    if x <= f32::from(k[0]) {
        return 0;
    }
    if x >= f32::from(k[15]) {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < f32::from(k[mid]) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - f32::from(k[hi - 1]) < f32::from(k[hi]) - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// The `x^2`-weighted sums `(sum w q x, sum w q^2)` of `x` mapped to its nearest levels
/// at inverse scale `id`; the levels' indices into `l` when given.
#[inline(always)]
fn level_sums(x: &[f32; 32], id: f32, mut l: Option<&mut [u8; 32]>) -> (f32, f32) {
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for (i, &v) in x.iter().enumerate() {
        let li = nearest_level(id * v);
        if let Some(l) = l.as_deref_mut() {
            l[i] = li;
        }
        let q = f32::from(KVALUES_IQ4NL[usize::from(li)]);
        let w = v * v;
        sumqx += w * q * v;
        sumq2 += w * q * q;
    }
    (sumqx, sumq2)
}

/// The scale of 32 values (ggml's search in `quantize_row_iq4_nl_impl`, weights `x^2`),
/// with the levels of its first guess in `l`; 0 for an all-zero group.
fn sub_scale(x: &[f32; 32], l: &mut [u8; 32]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let k0 = f32::from(KVALUES_IQ4NL[0]);
    let (sumqx, sumq2) = level_sums(x, 1.0 / (-max / k0), Some(l));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let (sumqx, sumq2) = level_sums(x, (itry as f32 + k0) / max, None);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Packs 32 level indices as IQ4_NL's 16 bytes (element `j` low, `j + 16` high).
fn pack_levels(l: &[u8; 32], qs: &mut [u8]) {
    for j in 0..16 {
        qs[j] = l[j] | (l[j + 16] << 4);
    }
}

/// The 32 level indices of 16 packed bytes.
#[inline(always)]
pub(crate) fn unpack_levels(qs: &[u8]) -> [u8; 32] {
    std::array::from_fn(|i| {
        if i < 16 {
            qs[i] & 0x0f
        } else {
            qs[i - 16] >> 4
        }
    })
}

/// Quantizes one IQ4_NL block (ggml's `quantize_iq4_nl`, no importance matrix).
pub fn quantize_iq4_nl(x: &[f32; 32], y: &mut [u8; 18]) {
    let mut l = [0u8; 32];
    let d = sub_scale(x, &mut l);
    write_f16(y, 0, d);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (li, &v) in l.iter_mut().zip(x) {
        *li = nearest_level(id * v);
    }
    pack_levels(&l, &mut y[2..]);
}

/// Quantizes one IQ4_XS super-block (ggml's `quantize_iq4_xs`, no importance matrix).
pub fn quantize_iq4_xs(x: &[f32; QK_K], y: &mut [u8; 136]) {
    let mut l = [0u8; 32];
    let scales: [f32; 8] =
        std::array::from_fn(|ib| sub_scale(as_array(&x[32 * ib..32 * ib + 32]), &mut l));
    let max_scale = signed_absmax(&scales).1;
    let d = -max_scale / 32.0;
    write_f16(y, 0, d);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut scales_h = 0u16;
    for (ib, &s) in scales.iter().enumerate() {
        let ls = nearest_int(id * s).clamp(-32, 31);
        let dl = d * ls as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        let xb: &[f32; 32] = as_array(&x[32 * ib..32 * ib + 32]);
        for (li, &v) in l.iter_mut().zip(xb) {
            *li = nearest_level(idl * v);
        }
        pack_levels(&l, &mut y[8 + 16 * ib..24 + 16 * ib]);
        let ls = (ls + 32) as u8;
        if ib % 2 == 0 {
            y[4 + ib / 2] = ls & 0x0f;
        } else {
            y[4 + ib / 2] |= (ls & 0x0f) << 4;
        }
        scales_h |= u16::from(ls >> 4) << (2 * ib);
    }
    y[2..4].copy_from_slice(&scales_h.to_le_bytes());
}

/// Dequantizes one IQ4_NL block (ggml's `dequantize_row_iq4_nl`).
#[inline]
pub fn dequantize_iq4_nl(x: &[u8; 18], y: &mut [f32; 32]) {
    let d = read_f16(x, 0);
    for (v, li) in y.iter_mut().zip(unpack_levels(&x[2..])) {
        *v = d * f32::from(KVALUES_IQ4NL[usize::from(li)]);
    }
}

/// The 6-bit scale (0..64, as stored: add -32) of sub-block `j` of an IQ4_XS block.
#[inline(always)]
pub(crate) fn iq4_xs_scale(x: &[u8], j: usize) -> u8 {
    let h = u16::from_le_bytes([x[2], x[3]]);
    ((x[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | ((((h >> (2 * j)) & 3) as u8) << 4)
}

/// Dequantizes one IQ4_XS super-block (ggml's `dequantize_row_iq4_xs`).
#[inline]
pub fn dequantize_iq4_xs(x: &[u8; 136], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (j, ys) in y.chunks_exact_mut(32).enumerate() {
        let dl = d * (i32::from(iq4_xs_scale(x, j)) - 32) as f32;
        let ys: &mut [f32; 32] = as_array_mut(ys);
        for (v, li) in ys.iter_mut().zip(unpack_levels(&x[8 + 16 * j..])) {
            *v = dl * f32::from(KVALUES_IQ4NL[usize::from(li)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bisection picks the nearest level, the upper one of two at equal distance.
    #[test]
    fn nearest_level_is_the_nearest() {
        let k = KVALUES_IQ4NL.map(f32::from);
        for i in -1400..=1400 {
            let x = i as f32 * 0.1;
            let got = usize::from(nearest_level(x));
            let best = k.iter().map(|&v| (x - v).abs()).fold(f32::MAX, f32::min);
            assert_eq!((x - k[got]).abs(), best, "x = {x}");
        }
        assert_eq!(nearest_level(-5.0), 7, "between -10 and 1, nearer -10");
        assert_eq!(nearest_level(-4.5), 8, "a tie between -10 and 1 takes 1");
        assert_eq!(nearest_level(7.0), 9, "a tie between 1 and 13 takes 13");
    }
}
