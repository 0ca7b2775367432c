//! The low-bit K-quants: Q2_K and Q3_K, one 256-element super-block at a time.
//!
//! Both split the super-block into 16 sub-blocks of 16 elements. The quants are stored as
//! 2-bit fields per 128 elements: `qs[32 c + l]` holds, at bit offsets 0, 2, 4 and 6,
//! elements `l`, `l + 32`, `l + 64` and `l + 96` of half `c` (`l` in `0..32`), so element
//! `e` is field `(e % 128) / 32` of byte `32 (e / 128) + e % 32`.
//!
//! - Q2_K (84 bytes: `scales[16]`, `qs[64]`, `d: f16`, `dmin: f16`): byte `scales[j]`
//!   holds sub-block `j`'s 4-bit scale (low nibble) and 4-bit min (high nibble); element
//!   `i` of sub-block `j` is `d * sc_j * q_i - dmin * m_j` with `q_i` in `0..4`.
//! - Q3_K (110 bytes: `hmask[32]`, `qs[64]`, `scales[12]`, `d: f16`): a third bit per
//!   element in `hmask`, bit `e / 32` of `hmask[e % 32]`, *cleared* for the values that
//!   lose 4: element `e` is `d * (sc_j - 32) * (q_e - (bit ? 0 : 4))`, in `-4..4`. The 16
//!   six-bit scales: the low nibble of `scales[j]` (`j < 8`) or the high nibble of
//!   `scales[j - 8]` (`j >= 8`), plus 2 high bits at offset `2 (j / 4)` of
//!   `scales[8 + j % 4]`.
//!
//! Quantization is ggml's `quantize_row_q{2,3}_K_ref` (what llama-quantize runs without
//! an importance matrix): Q2_K fits scale and min per sub-block with `make_qkx2_quants`
//! (absolute errors weighted by `|x|`), Q3_K a symmetric scale with `make_q3_quants`'
//! greedy refinement; the scales are quantized to 4 (6) bits against the super-block's
//! largest, the quants recomputed from the rounded scales, every f32 expression in ggml's
//! order.

use super::kquants::{make_qkx2_quants, Qkx2, GROUP_MAX_EPS, QK_K};
use super::{as_array, as_array_mut, nearest_int, read_f16, signed_absmax, write_f16};

/// Q2_K's search (`make_qkx2_quants(16, 3, .., -0.5, 0.1, 15, true)`).
const Q2_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 3,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
    mad: true,
};

/// The 2-bit field of element `e` (0..256) in `qs[64]`.
#[inline(always)]
pub(crate) fn q2_field(qs: &[u8], e: usize) -> u8 {
    (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3
}

/// Packs 256 values in `0..4` into `qs[64]` (the inverse of [`q2_field`]).
fn pack_q2_fields(l: &[u8; QK_K], qs: &mut [u8]) {
    for c in 0..2 {
        for i in 0..32 {
            let e = 128 * c + i;
            qs[32 * c + i] = l[e] | (l[e + 32] << 2) | (l[e + 64] << 4) | (l[e + 96] << 6);
        }
    }
}

/// Quantizes one Q2_K super-block (ggml's `quantize_row_q2_K_ref`).
pub fn quantize_q2_k(x: &[f32; QK_K], y: &mut [u8; 84]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut mins = [0.0f32; 16];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..16 {
        let xs: &[f32; 16] = as_array(&x[16 * j..16 * j + 16]);
        let w = xs.map(f32::abs);
        let lj = as_array_mut(&mut l[16 * j..16 * j + 16]);
        (scales[j], mins[j]) = make_qkx2_quants(xs, &w, lj, &Q2_K_SEARCH);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    // ggml stores the int results in bytes (a negative scale wraps, as in C).
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for j in 0..16 {
            y[j] = nearest_int(iscale * scales[j]) as u8;
        }
        write_f16(y, 80, max_scale / 15.0);
    } else {
        y[..16].fill(0);
        write_f16(y, 80, 0.0);
    }
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for j in 0..16 {
            y[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
        }
        write_f16(y, 82, max_min / 15.0);
    } else {
        write_f16(y, 82, 0.0);
    }
    let (d, dmin) = (read_f16(y, 80), read_f16(y, 82));
    for (j, &sm) in y[..16].iter().enumerate() {
        let dj = d * f32::from(sm & 0x0f);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(sm >> 4);
        for i in 16 * j..16 * j + 16 {
            l[i] = nearest_int((x[i] + dm) / dj).clamp(0, 3) as u8;
        }
    }
    pack_q2_fields(&l, &mut y[16..80]);
}

/// Dequantizes one Q2_K super-block (ggml's `dequantize_row_q2_K`).
#[inline]
pub fn dequantize_q2_k(x: &[u8; 84], y: &mut [f32; QK_K]) {
    let (d, dmin) = (read_f16(x, 80), read_f16(x, 82));
    for (j, ys) in y.chunks_exact_mut(16).enumerate() {
        let (dl, ml) = (d * f32::from(x[j] & 0x0f), dmin * f32::from(x[j] >> 4));
        for (i, v) in ys.iter_mut().enumerate() {
            *v = dl * f32::from(q2_field(&x[16..80], 16 * j + i)) - ml;
        }
    }
}

/// ggml's `make_q3_quants` for 16 values with `do_rmse`: symmetric quants in
/// `-nmax..nmax` for the scale `-nmax / max`, then up to 5 rounds of moving single quants
/// where that raises the `x^2`-weighted fit. Writes `quant + nmax` to `l`; returns the
/// least-squares scale of the final quants.
fn make_q3_quants(x: &[f32; 16], nmax: i32, l: &mut [u8; 16]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut q = [0i32; 16];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..16 {
        q[i] = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        let w = x[i] * x[i];
        sumlx += w * x[i] * q[i] as f32;
        suml2 += w * q[i] as f32 * q[i] as f32;
    }
    for _ in 0..5 {
        let mut changed = false;
        for i in 0..16 {
            let w = x[i] * x[i];
            let mut slx = sumlx - w * x[i] * q[i] as f32;
            if slx <= 0.0 {
                continue;
            }
            let mut sl2 = suml2 - w * q[i] as f32 * q[i] as f32;
            let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
            if new_l != q[i] {
                slx += w * x[i] * new_l as f32;
                sl2 += w * new_l as f32 * new_l as f32;
                if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                    (q[i], sumlx, suml2) = (new_l, slx, sl2);
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (li, qi) in l.iter_mut().zip(q) {
        *li = (qi + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// The 6-bit scale of sub-block `j` (0..16) from Q3_K's `scales[12]`, as stored (add -32).
#[inline(always)]
pub(crate) fn q3_k_scale(s: &[u8], j: usize) -> u8 {
    let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
    low | (((s[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)
}

/// The signed quant (-4..4) of element `e` of a Q3_K block (`hmask` at 0, `qs` at 32).
#[inline(always)]
pub(crate) fn q3_k_quant(x: &[u8], e: usize) -> i8 {
    let high = (x[e % 32] >> (e / 32)) & 1;
    q2_field(&x[32..96], e) as i8 - if high == 1 { 0 } else { 4 }
}

/// Quantizes one Q3_K super-block (ggml's `quantize_row_q3_K_ref`).
pub fn quantize_q3_k(x: &[f32; QK_K], y: &mut [u8; 110]) {
    let mut l = [0u8; QK_K];
    let scales: [f32; 16] = std::array::from_fn(|j| {
        let lj = as_array_mut(&mut l[16 * j..16 * j + 16]);
        make_q3_quants(as_array(&x[16 * j..16 * j + 16]), 4, lj)
    });
    let max_scale = signed_absmax(&scales).1;
    let sc = &mut y[96..108];
    sc.fill(0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &s) in scales.iter().enumerate() {
            // ggml keeps the rounded scale in an int8_t before clamping it
            let v = (i32::from(nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                sc[j] = v & 0x0f;
            } else {
                sc[j - 8] |= (v & 0x0f) << 4;
            }
            sc[8 + j % 4] |= (v >> 4) << (2 * (j / 4));
        }
        write_f16(y, 108, 1.0 / iscale);
    } else {
        write_f16(y, 108, 0.0);
    }
    let d = read_f16(y, 108);
    for j in 0..16 {
        let dj = d * f32::from(q3_k_scale(&y[96..108], j) as i8 - 32);
        if dj == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / dj).clamp(-4, 3) + 4) as u8;
        }
    }
    y[..32].fill(0);
    for (e, v) in l.iter_mut().enumerate() {
        if *v > 3 {
            y[e % 32] |= 1 << (e / 32);
            *v -= 4;
        }
    }
    pack_q2_fields(&l, &mut y[32..96]);
}

/// Dequantizes one Q3_K super-block (ggml's `dequantize_row_q3_K`).
#[inline]
pub fn dequantize_q3_k(x: &[u8; 110], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 108);
    for (j, ys) in y.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(q3_k_scale(&x[96..108], j) as i8 - 32);
        for (i, v) in ys.iter_mut().enumerate() {
            *v = dl * f32::from(q3_k_quant(x, 16 * j + i));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q2_fields_round_trip() {
        let l: [u8; QK_K] = std::array::from_fn(|i| ((i * 7 + i / 5) % 4) as u8);
        let mut qs = [0u8; 64];
        pack_q2_fields(&l, &mut qs);
        for (e, &v) in l.iter().enumerate() {
            assert_eq!(q2_field(&qs, e), v, "element {e}");
        }
    }
}
