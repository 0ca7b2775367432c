//! The 32-element block types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1, one block at a time.
//!
//! Quantization follows ggml's `quantize_row_*_ref` operation by operation (f32 throughout,
//! the conversions to integers truncate like C's casts, `round` is C's `roundf`), so the
//! bytes are identical; dequantization follows ggml's `dequantize_row_*`.

use super::{read_f16, signed_absmax, write_f16};

/// Elements per block of every type in this file.
pub const QK: usize = 32;

/// The smallest and largest value, starting from `(f32::MAX, -f32::MAX)` as ggml does.
#[inline(always)]
fn min_max(x: &[f32; QK]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// The largest magnitude (ggml's `MAX(amax, fabsf(v))` loop).
#[inline(always)]
fn absmax(x: &[f32; QK]) -> f32 {
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    amax
}

/// `1 / d`, or 0 for a zero scale (an all-zero block).
#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// Packs 32 quants of up to 4 bits: element `j` low nibble, `j + 16` high nibble.
#[inline(always)]
fn pack_nibbles(q: &[u8; QK], qs: &mut [u8]) {
    for j in 0..QK / 2 {
        qs[j] = (q[j] & 0x0f) | ((q[j + QK / 2] & 0x0f) << 4);
    }
}

/// The fifth bits of 32 quants as a little-endian `u32` (bit `i` for element `i`).
#[inline(always)]
fn high_bits(q: &[u8; QK]) -> [u8; 4] {
    let mut qh = 0u32;
    for (i, &v) in q.iter().enumerate() {
        qh |= (u32::from(v >> 4) & 1) << i;
    }
    qh.to_le_bytes()
}

/// The 32 quants of a 4-bit block (`qs` as packed by [`pack_nibbles`]).
#[inline(always)]
pub(crate) fn unpack_nibbles(qs: &[u8]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        q[j] = qs[j] & 0x0f;
        q[j + QK / 2] = qs[j] >> 4;
    }
    q
}

/// The 32 quants of a 5-bit block: the nibbles of `qs` plus the bits of `qh` as bit 4.
#[inline(always)]
pub(crate) fn unpack_5bit(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let mut q = unpack_nibbles(qs);
    for (i, v) in q.iter_mut().enumerate() {
        *v |= ((qh[i / 8] >> (i % 8)) & 1) << 4;
    }
    q
}

/// The 32 quants of a block with a symmetric scale `d = max / -half`:
/// `min(hi, trunc(x / d + half + 0.5))`, C's `(int8_t)` cast then `MIN`.
#[inline(always)]
fn symmetric_quants(x: &[f32; QK], id: f32, half: f32, hi: i8) -> [u8; QK] {
    let mut q = [0u8; QK];
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = ((v * id + (half + 0.5)) as i8).min(hi) as u8;
    }
    q
}

/// The 32 quants of a block with scale and min: `trunc((x - min) / d + 0.5)`.
#[inline(always)]
fn affine_quants(x: &[f32; QK], min: f32, id: f32, hi: u8) -> [u8; QK] {
    let mut q = [0u8; QK];
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = (((v - min) * id + 0.5) as i8 as u8).min(hi);
    }
    q
}

/// Quantizes one Q4_0 block (ggml's `quantize_row_q4_0_ref`).
pub fn quantize_q4_0(x: &[f32; QK], y: &mut [u8; 18]) {
    let d = signed_absmax(x).1 / -8.0;
    write_f16(y, 0, d);
    let q = symmetric_quants(x, inverse(d), 8.0, 15);
    pack_nibbles(&q, &mut y[2..]);
}

/// Quantizes one Q4_1 block (ggml's `quantize_row_q4_1_ref`).
pub fn quantize_q4_1(x: &[f32; QK], y: &mut [u8; 20]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    write_f16(y, 0, d);
    write_f16(y, 2, min);
    let q = affine_quants(x, min, inverse(d), 15);
    pack_nibbles(&q, &mut y[4..]);
}

/// Quantizes one Q5_0 block (ggml's `quantize_row_q5_0_ref`).
pub fn quantize_q5_0(x: &[f32; QK], y: &mut [u8; 22]) {
    let d = signed_absmax(x).1 / -16.0;
    write_f16(y, 0, d);
    let q = symmetric_quants(x, inverse(d), 16.0, 31);
    y[2..6].copy_from_slice(&high_bits(&q));
    pack_nibbles(&q, &mut y[6..]);
}

/// Quantizes one Q5_1 block (ggml's `quantize_row_q5_1_ref`).
pub fn quantize_q5_1(x: &[f32; QK], y: &mut [u8; 24]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    write_f16(y, 0, d);
    write_f16(y, 2, min);
    let q = affine_quants(x, min, inverse(d), 31);
    y[4..8].copy_from_slice(&high_bits(&q));
    pack_nibbles(&q, &mut y[8..]);
}

/// The 8-bit quants of Q8_0/Q8_1 and their scale: `d = amax / 127`, `q = roundf(x / d)`.
#[inline(always)]
fn quants_8bit(x: &[f32; QK], qs: &mut [u8]) -> f32 {
    let d = absmax(x) / 127.0;
    let id = inverse(d);
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = round_half_away(v * id).clamp(-128, 127) as i8 as u8;
    }
    d
}

/// `x` rounded half away from zero, the value `f32::round` (C's `roundf`) gives, through a
/// truncating conversion: exact for |x| < 2^23 (where `x - trunc(x)` is exact), 0 for
/// NaN. On the baseline x86-64 target `f32::round` is a call into libm for each element,
/// which took 1.5% of a batched CPU decode of the default model; this loop vectorizes.
#[inline(always)]
fn round_half_away(x: f32) -> i32 {
    let t = x as i32;
    let f = x - t as f32;
    t + i32::from(f >= 0.5) - i32::from(f <= -0.5)
}

/// Quantizes one Q8_0 block (ggml's `quantize_row_q8_0_ref`).
pub fn quantize_q8_0(x: &[f32; QK], y: &mut [u8; 34]) {
    let d = quants_8bit(x, &mut y[2..]);
    write_f16(y, 0, d);
}

/// Quantizes one Q8_1 block (ggml's `quantize_row_q8_1_ref`): Q8_0's `d` and quants, and
/// `s = d * sum(q)` rounded to f16.
pub fn quantize_q8_1(x: &[f32; QK], y: &mut [u8; 36]) {
    let d = quants_8bit(x, &mut y[4..]);
    let sum: i32 = y[4..].iter().map(|&q| i32::from(q as i8)).sum();
    write_f16(y, 0, d);
    write_f16(y, 2, sum as f32 * d);
}

/// Dequantizes one Q4_0 block: `d * (q - 8)`.
#[inline]
pub fn dequantize_q4_0(x: &[u8; 18], y: &mut [f32; QK]) {
    let d = read_f16(x, 0);
    let q = unpack_nibbles(&x[2..]);
    for (v, &qi) in y.iter_mut().zip(&q) {
        *v = (i32::from(qi) - 8) as f32 * d;
    }
}

/// Dequantizes one Q4_1 block: `d * q + m`.
#[inline]
pub fn dequantize_q4_1(x: &[u8; 20], y: &mut [f32; QK]) {
    let (d, m) = (read_f16(x, 0), read_f16(x, 2));
    let q = unpack_nibbles(&x[4..]);
    for (v, &qi) in y.iter_mut().zip(&q) {
        *v = f32::from(qi) * d + m;
    }
}

/// Dequantizes one Q5_0 block: `d * (q - 16)`.
#[inline]
pub fn dequantize_q5_0(x: &[u8; 22], y: &mut [f32; QK]) {
    let d = read_f16(x, 0);
    let q = unpack_5bit(&x[2..6], &x[6..]);
    for (v, &qi) in y.iter_mut().zip(&q) {
        *v = (i32::from(qi) - 16) as f32 * d;
    }
}

/// Dequantizes one Q5_1 block: `d * q + m`.
#[inline]
pub fn dequantize_q5_1(x: &[u8; 24], y: &mut [f32; QK]) {
    let (d, m) = (read_f16(x, 0), read_f16(x, 2));
    let q = unpack_5bit(&x[4..8], &x[8..]);
    for (v, &qi) in y.iter_mut().zip(&q) {
        *v = f32::from(qi) * d + m;
    }
}

/// Dequantizes one Q8_0 block: `d * q`.
#[inline]
pub fn dequantize_q8_0(x: &[u8; 34], y: &mut [f32; QK]) {
    let d = read_f16(x, 0);
    for (v, &qi) in y.iter_mut().zip(&x[2..]) {
        *v = f32::from(qi as i8) * d;
    }
}

/// Dequantizes one Q8_1 block: `d * q` (the `s` field is not needed).
#[inline]
pub fn dequantize_q8_1(x: &[u8; 36], y: &mut [f32; QK]) {
    let d = read_f16(x, 0);
    for (v, &qi) in y.iter_mut().zip(&x[4..]) {
        *v = f32::from(qi as i8) * d;
    }
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    /// The same values as `f32::round` over the quantizers' range: every half-integer tie,
    /// the floats next to each tie, and a sweep in steps of 1/1024, both signs; NaN gives 0
    /// as `NaN.round() as i8` does.
    #[test]
    fn round_half_away_is_roundf() {
        let mut xs = vec![0.0f32, -0.0, f32::MIN_POSITIVE, 0.49999997, -0.49999997];
        for i in -300..=300 {
            let tie = i as f32 + 0.5;
            let b = tie.to_bits();
            xs.extend([tie, f32::from_bits(b + 1), f32::from_bits(b - 1)]);
        }
        xs.extend((-140 * 1024..=140 * 1024).map(|i| i as f32 / 1024.0));
        for x in xs {
            assert_eq!(round_half_away(x), x.round() as i32, "{x:e}");
        }
        assert_eq!(round_half_away(f32::NAN), f32::NAN.round() as i8 as i32);
    }
}
