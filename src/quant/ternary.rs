//! The ternary types TQ1_0 and TQ2_0: 256 values in {-1, 0, 1} times one f16 scale `d`
//! (the largest magnitude), for models trained ternary (BitNet b1.58 and its kin).
//!
//! - TQ2_0 (66 bytes: `qs[64]`, `d`): `q + 1` in 2 bits, laid out as Q2_K's quants (per
//!   128 elements, byte `l` holds elements `l`, `l + 32`, `l + 64`, `l + 96` at bit
//!   offsets 0, 2, 4, 6).
//! - TQ1_0 (54 bytes: `qs[48]`, `qh[4]`, `d`): five trits a byte, stored as the byte
//!   `ceil(t * 256 / 243)` of their base-3 number `t` (first trit most significant), so
//!   trit `n` of byte `b` is `((b * 3^n) mod 256) * 3 >> 8`. Bytes `qs[0..32]` hold
//!   elements `32 n + m` (trit `n` of byte `m`), `qs[32..48]` elements `160 + 16 n + m`,
//!   and `qh[0..4]` four trits each, elements `240 + 4 n + j`.
//!
//! Quantization is ggml's `quantize_row_tq{1,2}_0_ref`: `d = max |x|`, `q = round(x / d)`
//! with halves away from zero.

use super::kquants::QK_K;
use super::kquants23::q2_field;
use super::{read_f16, write_f16};

/// The largest magnitude and its inverse (0 for an all-zero block).
#[inline(always)]
fn scale(x: &[f32; QK_K]) -> (f32, f32) {
    let amax = x
        .iter()
        .fold(0.0f32, |a, &v| if a > v.abs() { a } else { v.abs() });
    (amax, if amax != 0.0 { 1.0 / amax } else { 0.0 })
}

/// `round(v * id) + 1`, C's `lroundf` (halves away from zero), in 0..=2 for |v| <= 1 / id.
#[inline(always)]
fn trit(v: f32, id: f32) -> u8 {
    ((v * id).round() as i32 + 1) as u8
}

/// Quantizes one TQ2_0 super-block (ggml's `quantize_row_tq2_0_ref`).
pub fn quantize_tq2_0(x: &[f32; QK_K], y: &mut [u8; 66]) {
    let (d, id) = scale(x);
    write_f16(y, 64, d);
    for c in 0..2 {
        for m in 0..32 {
            let mut q = 0u8;
            for n in 0..4 {
                q |= (trit(x[128 * c + 32 * n + m], id) & 3) << (2 * n);
            }
            y[32 * c + m] = q;
        }
    }
}

/// Dequantizes one TQ2_0 super-block (ggml's `dequantize_row_tq2_0`).
#[inline]
pub fn dequantize_tq2_0(x: &[u8; 66], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 64);
    for (e, v) in y.iter_mut().enumerate() {
        *v = (i32::from(q2_field(&x[..64], e)) - 1) as f32 * d;
    }
}

/// The TQ2_0 quants (-1..=1) of elements `32 j..32 j + 32`.
#[inline(always)]
pub(crate) fn tq2_0_quants(x: &[u8], j: usize) -> [i8; 32] {
    std::array::from_fn(|i| q2_field(&x[..64], 32 * j + i) as i8 - 1)
}

/// The byte of the trits `t` (first most significant, `t.len()` of them, shifted up to
/// five places): ggml's ceiling division by 243.
fn pack_trits(t: &[u8]) -> u8 {
    let mut q = 0u16;
    for &v in t {
        q = q * 3 + u16::from(v);
    }
    for _ in t.len()..5 {
        q *= 3;
    }
    (q * 256).div_ceil(243) as u8
}

/// Trit `n` (0 most significant) of a packed byte, as `q + 1`.
#[inline(always)]
fn unpack_trit(b: u8, n: u32) -> u8 {
    let q = b.wrapping_mul(3u8.pow(n));
    ((u16::from(q) * 3) >> 8) as u8
}

/// Where element `e` of a TQ1_0 block lies: (byte, trit).
#[inline(always)]
fn tq1_0_at(e: usize) -> (usize, u32) {
    match e {
        0..160 => (e % 32, (e / 32) as u32),
        160..240 => (32 + (e - 160) % 16, ((e - 160) / 16) as u32),
        _ => (48 + (e - 240) % 4, ((e - 240) / 4) as u32),
    }
}

/// Quantizes one TQ1_0 super-block (ggml's `quantize_row_tq1_0_ref`).
pub fn quantize_tq1_0(x: &[f32; QK_K], y: &mut [u8; 54]) {
    let (d, id) = scale(x);
    write_f16(y, 52, d);
    let mut t = [[0u8; 5]; 52];
    for (e, &v) in x.iter().enumerate() {
        let (b, n) = tq1_0_at(e);
        t[b][n as usize] = trit(v, id);
    }
    for (b, trits) in t.iter().enumerate() {
        y[b] = pack_trits(&trits[..if b < 48 { 5 } else { 4 }]);
    }
}

/// The TQ1_0 quants (-1..=1) of elements `32 j..32 j + 32`.
#[inline(always)]
pub(crate) fn tq1_0_quants(x: &[u8], j: usize) -> [i8; 32] {
    std::array::from_fn(|i| {
        let (b, n) = tq1_0_at(32 * j + i);
        unpack_trit(x[b], n) as i8 - 1
    })
}

/// Dequantizes one TQ1_0 super-block (ggml's `dequantize_row_tq1_0`).
#[inline]
pub fn dequantize_tq1_0(x: &[u8; 54], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 52);
    for (j, ys) in y.chunks_exact_mut(32).enumerate() {
        for (v, q) in ys.iter_mut().zip(tq1_0_quants(x, j)) {
            *v = f32::from(q) * d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trits_round_trip() {
        for a in 0..243u16 {
            let t: Vec<u8> = (0..5).map(|n| (a / 3u16.pow(4 - n) % 3) as u8).collect();
            let b = pack_trits(&t);
            for (n, &v) in t.iter().enumerate() {
                assert_eq!(unpack_trit(b, n as u32), v, "{a} trit {n}");
            }
        }
        // four trits shifted up one place
        assert_eq!(unpack_trit(pack_trits(&[2, 0, 1, 2]), 3), 2);
    }
}
