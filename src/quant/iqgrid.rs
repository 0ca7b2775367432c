//! The lattice i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M, read
//! only (ggml quantizes them with an importance matrix; graft dequantizes them and takes
//! their dot products).
//!
//! Each stores, per group of 8 (IQ3: 4) elements, the index of a point of a fixed lattice
//! (`iq_tables.rs`: magnitudes 8, 25, 43 for IQ2; 4..62 and 1..15 for IQ3; -1, 0, 1
//! for IQ1) and the signs of its 8 elements; a super-block of 256 has one f16 `d` and a
//! small scale per 32 (or 16) elements. With `K(s)` the scale's factor:
//!
//! | type | bytes | layout | element |
//! |------|------:|--------|---------|
//! | IQ2_XXS | 66 | `d`, per 32: `u32` of 4 grid bytes, `u32` of 4 x 7 sign bits + 4-bit `s` | `d (0.5 + s) / 4 * g * sign` |
//! | IQ2_XS | 74 | `d`, `qs: [u16; 32]` (9-bit index, 7 sign bits), `scales[8]` (4 bits per 16) | `d (0.5 + s) / 4 * g * sign` |
//! | IQ2_S | 82 | `d`, `qs[32]` (index low 8 bits), `signs[32]`, `qh[8]` (2 bits each), `scales[8]` | `d (0.5 + s) / 4 * g * sign` |
//! | IQ3_XXS | 98 | `d`, `qs[64]` (one index per 4), per 32: `u32` of 4 x 7 sign bits + 4-bit `s` | `d (0.5 + s) / 2 * g * sign` |
//! | IQ3_S | 110 | `d`, `qs[64]`, `qh[8]` (9th index bit), `signs[32]`, `scales[4]` (4 bits per 32) | `d (1 + 2 s) * g * sign` |
//! | IQ1_S | 50 | `d`, `qs[32]`, `qh: [u16; 8]` (3 index bits per 8, 3-bit `s`, shift sign) | `d (2 s + 1) (g +- 1/8)` |
//! | IQ1_M | 56 | `qs[32]`, `qh[16]` (3 index bits and a shift sign per 8), `scales[8]` (3 bits per 16, `d` in the top nibbles) | `d (2 s + 1) (g +- 1/8)` |
//!
//! Seven sign bits address ggml's `ksigns_iq2xs`, whose eighth bit is their parity (an
//! even number of minus signs: `ksign`). Dequantization follows ggml's
//! `dequantize_row_iq*` expression by expression.
//!
//! For the dot products ([`super::dot`]) each 32-element sub-block is read as signed
//! integer quants and integer scales per 16 elements (`Sub`) times a per-block f32
//! factor: the scale factors are `(2 s + 1) / 8` (IQ2), `(2 s + 1) / 4` (IQ3_XXS), `2 s + 1`
//! (IQ3_S) and, with the shift folded into the quants as `8 g +- 1`, `(2 s + 1) / 8` (IQ1).

use super::iq_tables::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use super::kquants::QK_K;
use super::read_f16;

/// One 32-element sub-block as the integer dot products take it: signed quants and the
/// integer scale of each 16-element half (both halves the same for types with one scale
/// per 32), mins per half (Q2_K only; zero elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sub {
    pub q: [i8; 32],
    pub sc: [i32; 2],
    pub m: [i32; 2],
}

impl Sub {
    /// Quants `q` with one scale `sc` for all 32.
    #[inline(always)]
    pub fn one(q: [i8; 32], sc: i32) -> Sub {
        Sub {
            q,
            sc: [sc, sc],
            m: [0, 0],
        }
    }
}

/// ggml's `ksigns_iq2xs[i]`: the 7 sign bits `i` and their parity as bit 7.
#[inline(always)]
pub(crate) const fn ksign(i: u32) -> u8 {
    let i = (i & 127) as u8;
    i | (((i.count_ones() & 1) as u8) << 7)
}

/// Element `j` (byte `j`) of a lattice point.
#[inline(always)]
fn point_byte(p: u64, j: usize) -> u8 {
    (p >> (8 * j)) as u8
}

/// The little-endian `u32` at `b[at..at + 4]`.
#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The little-endian `u16` at `b[at..at + 2]`.
#[inline(always)]
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// 8 lattice bytes `p` with the sign bits `signs` (bit `j`: element `j` negative) as i8.
#[inline(always)]
fn signed8(p: u64, signs: u8) -> [i8; 8] {
    std::array::from_fn(|j| {
        let v = point_byte(p, j) as i8;
        if signs >> j & 1 == 1 {
            -v
        } else {
            v
        }
    })
}

/// Writes `scale * g_j * sign_j` for the 8 elements of lattice point `p` (ggml's order:
/// the scale times the magnitude, then the sign).
#[inline(always)]
fn put8(y: &mut [f32], scale: f32, p: u64, signs: u8) {
    for (j, v) in y[..8].iter_mut().enumerate() {
        let s = if signs >> j & 1 == 1 { -1.0 } else { 1.0 };
        *v = scale * f32::from(point_byte(p, j)) * s;
    }
}

// ---------------------------------------------------------------------------------------
// IQ2_XXS

/// The grid indices and the sign/scale word of IQ2_XXS sub-block `ib`.
#[inline(always)]
fn iq2_xxs_words(x: &[u8], ib: usize) -> (u32, u32) {
    (u32_at(x, 2 + 8 * ib), u32_at(x, 6 + 8 * ib))
}

/// Dequantizes one IQ2_XXS super-block (ggml's `dequantize_row_iq2_xxs`).
pub fn dequantize_iq2_xxs(x: &[u8; 66], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let (idx, aux) = iq2_xxs_words(x, ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let p = IQ2XXS_GRID[(idx >> (8 * l) & 255) as usize];
            put8(&mut ys[8 * l..], db, p, ksign(aux >> (7 * l)));
        }
    }
}

/// IQ2_XXS sub-block `ib` for the dot products (factor `d / 8`).
#[inline(always)]
pub(crate) fn iq2_xxs_sub(x: &[u8; 66], ib: usize) -> Sub {
    let (idx, aux) = iq2_xxs_words(x, ib);
    let mut q = [0i8; 32];
    for l in 0..4 {
        let p = IQ2XXS_GRID[(idx >> (8 * l) & 255) as usize];
        q[8 * l..8 * l + 8].copy_from_slice(&signed8(p, ksign(aux >> (7 * l))));
    }
    Sub::one(q, 2 * (aux >> 28) as i32 + 1)
}

// ---------------------------------------------------------------------------------------
// IQ2_XS and IQ2_S: 4-bit scales per 16 elements

/// The two scale nibbles of sub-block `ib` (`scales` at `at`) as `2 s + 1`.
#[inline(always)]
fn half_scales(x: &[u8], at: usize, ib: usize) -> [i32; 2] {
    let s = x[at + ib];
    [2 * i32::from(s & 15) + 1, 2 * i32::from(s >> 4) + 1]
}

/// The lattice point and signs of group `l` (0..4) of IQ2_XS sub-block `ib`.
#[inline(always)]
fn iq2_xs_group(x: &[u8], ib: usize, l: usize) -> (u64, u8) {
    let v = u16_at(x, 2 + 2 * (4 * ib + l));
    (IQ2XS_GRID[usize::from(v & 511)], ksign(u32::from(v >> 9)))
}

/// Dequantizes one IQ2_XS super-block (ggml's `dequantize_row_iq2_xs`).
pub fn dequantize_iq2_xs(x: &[u8; 74], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let s = x[66 + ib];
        let db = [
            d * (0.5 + f32::from(s & 15)) * 0.25,
            d * (0.5 + f32::from(s >> 4)) * 0.25,
        ];
        for l in 0..4 {
            let (p, signs) = iq2_xs_group(x, ib, l);
            put8(&mut ys[8 * l..], db[l / 2], p, signs);
        }
    }
}

/// IQ2_XS sub-block `ib` for the dot products (factor `d / 8`).
#[inline(always)]
pub(crate) fn iq2_xs_sub(x: &[u8; 74], ib: usize) -> Sub {
    let mut q = [0i8; 32];
    for l in 0..4 {
        let (p, signs) = iq2_xs_group(x, ib, l);
        q[8 * l..8 * l + 8].copy_from_slice(&signed8(p, signs));
    }
    Sub {
        q,
        sc: half_scales(x, 66, ib),
        m: [0, 0],
    }
}

/// The lattice point and signs of group `l` (0..4) of IQ2_S sub-block `ib`.
#[inline(always)]
fn iq2_s_group(x: &[u8], ib: usize, l: usize) -> (u64, u8) {
    let hi = (usize::from(x[66 + ib]) << (8 - 2 * l)) & 0x300;
    (
        IQ2S_GRID[usize::from(x[2 + 4 * ib + l]) | hi],
        x[34 + 4 * ib + l],
    )
}

/// Dequantizes one IQ2_S super-block (ggml's `dequantize_row_iq2_s`).
pub fn dequantize_iq2_s(x: &[u8; 82], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let s = x[74 + ib];
        let db = [
            d * (0.5 + f32::from(s & 15)) * 0.25,
            d * (0.5 + f32::from(s >> 4)) * 0.25,
        ];
        for l in 0..4 {
            let (p, signs) = iq2_s_group(x, ib, l);
            put8(&mut ys[8 * l..], db[l / 2], p, signs);
        }
    }
}

/// IQ2_S sub-block `ib` for the dot products (factor `d / 8`).
#[inline(always)]
pub(crate) fn iq2_s_sub(x: &[u8; 82], ib: usize) -> Sub {
    let mut q = [0i8; 32];
    for l in 0..4 {
        let (p, signs) = iq2_s_group(x, ib, l);
        q[8 * l..8 * l + 8].copy_from_slice(&signed8(p, signs));
    }
    Sub {
        q,
        sc: half_scales(x, 74, ib),
        m: [0, 0],
    }
}

// ---------------------------------------------------------------------------------------
// IQ3_XXS and IQ3_S: 4-value lattice points

/// Writes `scale * g_j * sign_j` for the 4 elements of the IQ3 point `p`, signs from bit
/// `first` on.
#[inline(always)]
fn put4(y: &mut [f32], scale: f32, p: u32, signs: u8, first: usize) {
    for (j, v) in y[..4].iter_mut().enumerate() {
        let s = if signs >> (first + j) & 1 == 1 {
            -1.0
        } else {
            1.0
        };
        *v = scale * f32::from((p >> (8 * j)) as u8) * s;
    }
}

/// The 8 signed quants of two IQ3 points and their 8 sign bits.
#[inline(always)]
fn signed4x2(p1: u32, p2: u32, signs: u8) -> [i8; 8] {
    signed8(u64::from(p1) | (u64::from(p2) << 32), signs)
}

/// Dequantizes one IQ3_XXS super-block (ggml's `dequantize_row_iq3_xxs`).
pub fn dequantize_iq3_xxs(x: &[u8; 98], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let aux = u32_at(x, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = ksign(aux >> (7 * l));
            let qs = &x[2 + 8 * ib + 2 * l..];
            put4(
                &mut ys[8 * l..],
                db,
                IQ3XXS_GRID[usize::from(qs[0])],
                signs,
                0,
            );
            put4(
                &mut ys[8 * l + 4..],
                db,
                IQ3XXS_GRID[usize::from(qs[1])],
                signs,
                4,
            );
        }
    }
}

/// IQ3_XXS sub-block `ib` for the dot products (factor `d / 4`).
#[inline(always)]
pub(crate) fn iq3_xxs_sub(x: &[u8; 98], ib: usize) -> Sub {
    let aux = u32_at(x, 66 + 4 * ib);
    let mut q = [0i8; 32];
    for l in 0..4 {
        let qs = &x[2 + 8 * ib + 2 * l..];
        let (p1, p2) = (
            IQ3XXS_GRID[usize::from(qs[0])],
            IQ3XXS_GRID[usize::from(qs[1])],
        );
        q[8 * l..8 * l + 8].copy_from_slice(&signed4x2(p1, p2, ksign(aux >> (7 * l))));
    }
    Sub::one(q, 2 * (aux >> 28) as i32 + 1)
}

/// The two lattice points of group `l` (0..4) of IQ3_S sub-block `ib`.
#[inline(always)]
fn iq3_s_points(x: &[u8], ib: usize, l: usize) -> (u32, u32) {
    let (qs, qh) = (&x[2 + 8 * ib + 2 * l..], usize::from(x[66 + ib]));
    (
        IQ3S_GRID[usize::from(qs[0]) | ((qh << (8 - 2 * l)) & 256)],
        IQ3S_GRID[usize::from(qs[1]) | ((qh << (7 - 2 * l)) & 256)],
    )
}

/// The 4-bit scale of IQ3_S sub-block `ib`.
#[inline(always)]
fn iq3_s_scale(x: &[u8], ib: usize) -> u8 {
    (x[106 + ib / 2] >> (4 * (ib % 2))) & 15
}

/// Dequantizes one IQ3_S super-block (ggml's `dequantize_row_iq3_s`).
pub fn dequantize_iq3_s(x: &[u8; 110], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let db = d * f32::from(1 + 2 * iq3_s_scale(x, ib));
        for l in 0..4 {
            let (p1, p2) = iq3_s_points(x, ib, l);
            let signs = x[74 + 4 * ib + l];
            put4(&mut ys[8 * l..], db, p1, signs, 0);
            put4(&mut ys[8 * l + 4..], db, p2, signs, 4);
        }
    }
}

/// IQ3_S sub-block `ib` for the dot products (factor `d`).
#[inline(always)]
pub(crate) fn iq3_s_sub(x: &[u8; 110], ib: usize) -> Sub {
    let mut q = [0i8; 32];
    for l in 0..4 {
        let (p1, p2) = iq3_s_points(x, ib, l);
        q[8 * l..8 * l + 8].copy_from_slice(&signed4x2(p1, p2, x[74 + 4 * ib + l]));
    }
    Sub::one(q, 1 + 2 * i32::from(iq3_s_scale(x, ib)))
}

// ---------------------------------------------------------------------------------------
// IQ1_S and IQ1_M: ternary lattice points plus a shift of 1/8

/// ggml's `IQ1S_DELTA` (and `IQ1M_DELTA`).
const IQ1_DELTA: f32 = 0.125;

/// Writes `scale * (g_j + delta)` for the 8 elements of IQ1 point `p`.
#[inline(always)]
fn put8_shifted(y: &mut [f32], scale: f32, p: u64, delta: f32) {
    for (j, v) in y[..8].iter_mut().enumerate() {
        *v = scale * (f32::from(point_byte(p, j) as i8) + delta);
    }
}

/// The 8 quants `8 g + 1` (or `8 g - 1` when `minus`) of IQ1 point `p`: `g + delta` in
/// eighths.
#[inline(always)]
fn shifted8(p: u64, minus: bool) -> [i8; 8] {
    std::array::from_fn(|j| 8 * (point_byte(p, j) as i8) + if minus { -1 } else { 1 })
}

/// The lattice point of group `l` of IQ1_S sub-block `ib`.
#[inline(always)]
fn iq1_s_point(x: &[u8], ib: usize, l: usize) -> u64 {
    let qh = u16_at(x, 34 + 2 * ib);
    IQ1S_GRID[usize::from(x[2 + 4 * ib + l]) | (usize::from((qh >> (3 * l)) & 7) << 8)]
}

/// Dequantizes one IQ1_S super-block (ggml's `dequantize_row_iq1_s`).
pub fn dequantize_iq1_s(x: &[u8; 50], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 0);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let qh = u16_at(x, 34 + 2 * ib);
        let dl = d * f32::from(2 * ((qh >> 12) & 7) + 1);
        let delta = if qh & 0x8000 != 0 {
            -IQ1_DELTA
        } else {
            IQ1_DELTA
        };
        for l in 0..4 {
            put8_shifted(&mut ys[8 * l..], dl, iq1_s_point(x, ib, l), delta);
        }
    }
}

/// IQ1_S sub-block `ib` for the dot products (factor `d / 8`).
#[inline(always)]
pub(crate) fn iq1_s_sub(x: &[u8; 50], ib: usize) -> Sub {
    let qh = u16_at(x, 34 + 2 * ib);
    let mut q = [0i8; 32];
    for l in 0..4 {
        let p = iq1_s_point(x, ib, l);
        q[8 * l..8 * l + 8].copy_from_slice(&shifted8(p, qh & 0x8000 != 0));
    }
    Sub::one(q, 2 * i32::from((qh >> 12) & 7) + 1)
}

/// IQ1_M's super-block scale `d`, spread over the top nibbles of its four `u16` scales.
#[inline(always)]
pub(crate) fn iq1_m_d(x: &[u8]) -> f32 {
    let sc = |i: usize| u16_at(x, 48 + 2 * i);
    let bits = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000);
    half::f16::from_bits(bits).to_f32()
}

/// The 3-bit scales (as `2 s + 1`) of the two halves of IQ1_M sub-block `ib`.
#[inline(always)]
fn iq1_m_scales(x: &[u8], ib: usize) -> [i32; 2] {
    let sc = u16_at(x, 48 + 2 * (ib / 2));
    let s = |k: usize| 2 * i32::from((sc >> (6 * (ib % 2) + 3 * k)) & 7) + 1;
    [s(0), s(1)]
}

/// The lattice point of group `l` of IQ1_M sub-block `ib`, and whether its shift is
/// negative.
#[inline(always)]
fn iq1_m_group(x: &[u8], ib: usize, l: usize) -> (u64, bool) {
    let qh = x[32 + 2 * ib + l / 2];
    let shift = if l.is_multiple_of(2) { 8 } else { 4 };
    let idx = usize::from(x[4 * ib + l]) | ((usize::from(qh) << shift) & 0x700);
    let sign_bit = if l.is_multiple_of(2) { 0x08 } else { 0x80 };
    (IQ1S_GRID[idx], qh & sign_bit != 0)
}

/// Dequantizes one IQ1_M super-block (ggml's `dequantize_row_iq1_m`).
pub fn dequantize_iq1_m(x: &[u8; 56], y: &mut [f32; QK_K]) {
    let d = iq1_m_d(x);
    for (ib, ys) in y.chunks_exact_mut(32).enumerate() {
        let [s1, s2] = iq1_m_scales(x, ib);
        let dl = [d * s1 as f32, d * s2 as f32];
        for l in 0..4 {
            let (p, minus) = iq1_m_group(x, ib, l);
            let delta = if minus { -IQ1_DELTA } else { IQ1_DELTA };
            put8_shifted(&mut ys[8 * l..], dl[l / 2], p, delta);
        }
    }
}

/// IQ1_M sub-block `ib` for the dot products (factor `d / 8`).
#[inline(always)]
pub(crate) fn iq1_m_sub(x: &[u8; 56], ib: usize) -> Sub {
    let mut q = [0i8; 32];
    for l in 0..4 {
        let (p, minus) = iq1_m_group(x, ib, l);
        q[8 * l..8 * l + 8].copy_from_slice(&shifted8(p, minus));
    }
    Sub {
        q,
        sc: iq1_m_scales(x, ib),
        m: [0, 0],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every coordinate of the lattices whose points the CUDA decode products negate
    /// bytewise is positive: their negation (`negated4` in `cuda/quant_lowbit.cuh`) is an
    /// xor and a plain add, exact only where no byte is 0. Read from the device's tables
    /// (`cuda/iq_tables.cuh`), and the host's agree with them.
    #[test]
    fn grid_coordinates_are_never_zero() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/cuda/iq_tables.cuh");
        let text = std::fs::read_to_string(path).unwrap();
        let table = |name: &str| -> Vec<u64> {
            let start = text
                .find(&format!(" {name}["))
                .unwrap_or_else(|| panic!("{name}"));
            let body = &text[start..];
            let body = &body[body.find('{').unwrap() + 1..body.find("};").unwrap()];
            body.split(',')
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(|t| {
                    let hex = t
                        .trim_start_matches("0x")
                        .trim_end_matches("ull")
                        .trim_end_matches('u');
                    u64::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("{name}: {t}: {e}"))
                })
                .collect()
        };
        let wide = [
            ("IQ2XXS_GRID", &IQ2XXS_GRID[..]),
            ("IQ2XS_GRID", &IQ2XS_GRID[..]),
            ("IQ2S_GRID", &IQ2S_GRID[..]),
        ];
        for (name, host) in wide {
            let dev = table(name);
            assert_eq!(dev, host, "{name}");
            for p in dev {
                assert!(p.to_le_bytes().iter().all(|&b| b > 0), "{name}: {p:#x}");
            }
        }
        for (name, host) in [
            ("IQ3XXS_GRID", &IQ3XXS_GRID[..]),
            ("IQ3S_GRID", &IQ3S_GRID[..]),
        ] {
            let dev = table(name);
            assert_eq!(
                dev,
                host.iter().map(|&p| u64::from(p)).collect::<Vec<_>>(),
                "{name}"
            );
            for p in dev {
                assert!(
                    (p as u32).to_le_bytes().iter().all(|&b| b > 0),
                    "{name}: {p:#x}"
                );
            }
        }
    }

    #[test]
    fn ksign_has_even_parity() {
        for i in 0..128u32 {
            let s = ksign(i);
            assert_eq!(u32::from(s & 127), i);
            assert_eq!(s.count_ones() % 2, 0, "{i}");
        }
        assert_eq!([ksign(0), ksign(1), ksign(3), ksign(127)], [0, 129, 3, 255]);
    }

    /// The integer view of a sub-block times its factor gives the dequantized values
    /// (exactly: the factors are the scales times powers of two).
    #[test]
    fn subs_scale_back_to_the_dequantized_values() {
        let mut blk = [0u8; 110];
        for (i, b) in blk.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(151).wrapping_add(17);
        }
        blk[0..2].copy_from_slice(&half::f16::from_f32(0.0123).to_le_bytes());
        let d = read_f16(&blk, 0);
        let mut y = [0.0f32; QK_K];
        dequantize_iq3_s(&blk, &mut y);
        for ib in 0..8 {
            let s = iq3_s_sub(&blk, ib);
            for i in 0..32 {
                let v = d * s.sc[i / 16] as f32 * f32::from(s.q[i]);
                assert_eq!(v, y[32 * ib + i], "sub-block {ib} element {i}");
            }
        }
    }
}
