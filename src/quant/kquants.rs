//! The K-quants: Q4_K, Q5_K and Q6_K, one 256-element super-block at a time.
//!
//! Quantization is ggml's reference (`quantize_row_q{4,5,6}_K_ref`): the per-sub-block
//! scale searches (`make_qkx2_quants` for Q4_K/Q5_K, `make_qx_quants` for Q6_K) with
//! ggml's parameters, rounding with [`nearest_int`] and every f32 expression in ggml's
//! order, then the scales quantized against the super-block scale and the quants
//! recomputed from the rounded scales.

use super::{as_array, as_array_mut, nearest_int, read_f16, signed_absmax, write_f16};

/// Elements per super-block.
pub const QK_K: usize = 256;

/// ggml's `GROUP_MAX_EPS`: a group whose largest magnitude is below it is all zero.
pub(crate) const GROUP_MAX_EPS: f32 = 1e-15;

/// The parameters of one `make_qkx2_quants` search: quants `0..=nmax`, trial inverse
/// scales `(rmin + rdelta * is + nmax) / (max - min)` for `is` in `0..=nstep`, errors
/// absolute (`mad`) or squared.
pub(crate) struct Qkx2 {
    pub nmax: i32,
    pub rmin: f32,
    pub rdelta: f32,
    pub nstep: i32,
    pub mad: bool,
}

/// Q4_K's search (`make_qkx2_quants(32, 15, .., -1.0, 0.1, 20, false)`).
const Q4_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 15,
    rmin: -1.0,
    rdelta: 0.1,
    nstep: 20,
    mad: false,
};

/// Q5_K's search (`make_qkx2_quants(32, 31, .., -0.5, 0.1, 15, false)`).
const Q5_K_SEARCH: Qkx2 = Qkx2 {
    nmax: 31,
    rmin: -0.5,
    rdelta: 0.1,
    nstep: 15,
    mad: false,
};

/// Quants of `x` for inverse scale `iscale` and offset `min`, clamped to `0..=nmax`.
#[inline(always)]
fn affine_levels<const N: usize>(x: &[f32; N], iscale: f32, min: f32, nmax: i32, l: &mut [u8; N]) {
    for (li, &v) in l.iter_mut().zip(x) {
        *li = nearest_int(iscale * (v - min)).clamp(0, nmax) as u8;
    }
}

/// Weighted squared (or, with `mad`, absolute) error of `scale * l + min` against `x`.
#[inline(always)]
fn affine_error<const N: usize>(
    x: &[f32; N],
    w: &[f32; N],
    l: &[u8; N],
    (scale, min): (f32, f32),
    mad: bool,
) -> f32 {
    let mut err = 0.0f32;
    for i in 0..N {
        let diff = scale * f32::from(l[i]) + min - x[i];
        err += w[i] * if mad { diff.abs() } else { diff * diff };
    }
    err
}

/// ggml's `make_qkx2_quants` for `N` values: fits `x ~ scale * l + min` (min <= 0) by
/// weighted least squares over the trial scales of `p`, keeping the one of least error.
/// Writes the quants to `l`; returns `(scale, -min)`.
pub(crate) fn make_qkx2_quants<const N: usize>(
    x: &[f32; N],
    w: &[f32; N],
    l: &mut [u8; N],
    p: &Qkx2,
) -> (f32, f32) {
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..N {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax = p.nmax as f32;
    let iscale = nmax / (max - min);
    let mut scale = 1.0 / iscale;
    affine_levels(x, iscale, min, p.nmax, l);
    let mut best_error = affine_error(x, w, l, (scale, min), p.mad);
    let mut laux = [0u8; N];
    for is in 0..=p.nstep {
        let iscale = (p.rmin + p.rdelta * is as f32 + nmax) / (max - min);
        affine_levels(x, iscale, min, p.nmax, &mut laux);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..N {
            let li = f32::from(laux[i]);
            sum_l += w[i] * li;
            sum_l2 += w[i] * li * li;
            sum_xl += w[i] * li * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let cur_error = affine_error(x, w, &laux, (this_scale, this_min), p.mad);
            if cur_error < best_error {
                *l = laux;
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Symmetric quants of `x` for inverse scale `iscale`, clamped to `-nmax..nmax`; the
/// `x^2`-weighted sums `(sum w*x*l, sum w*l*l)`. Writes `l + nmax` to `out` when given.
#[inline(always)]
fn qx_sums(x: &[f32; 16], iscale: f32, nmax: i32, out: Option<&mut [u8; 16]>) -> (f32, f32) {
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    let mut levels = [0u8; 16];
    for i in 0..16 {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        levels[i] = (l + nmax) as u8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    if let Some(out) = out {
        *out = levels;
    }
    (sumlx, suml2)
}

/// ggml's `make_qx_quants` for 16 values with `rmse_type = 1` and no importance weights:
/// symmetric quants `-nmax..nmax` (stored as `l + nmax` in `l`), the scale that minimises
/// the `x^2`-weighted error over 18 trial scales around `-nmax / max`. Returns the scale.
fn make_qx_quants(x: &[f32; 16], nmax: i32, l: &mut [u8; 16]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < GROUP_MAX_EPS {
        l.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = qx_sums(x, iscale, nmax, Some(l));
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = qx_sums(x, iscale, nmax, None);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            qx_sums(x, iscale, nmax, Some(l));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` from `scales[12]`.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Packs eight 6-bit scales and mins into `scales[12]` (the inverse of [`scale_min_k4`]).
fn pack_scales_k4(ls: &[u8; 8], lm: &[u8; 8], scales: &mut [u8]) {
    for j in 0..8 {
        if j < 4 {
            scales[j] = ls[j];
            scales[j + 4] = lm[j];
        } else {
            scales[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            scales[j - 4] |= (ls[j] >> 4) << 6;
            scales[j] |= (lm[j] >> 4) << 6;
        }
    }
}

/// The part shared by Q4_K and Q5_K: the per-sub-block search, the 6-bit scales and mins
/// and `d`/`dmin` written to `y[0..16]`, and the final quants (`0..=nmax`) in `l`.
fn quantize_k4_scales(x: &[f32; QK_K], y: &mut [u8], p: &Qkx2, l: &mut [u8; QK_K]) {
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs: &[f32; 32] = as_array(&x[32 * j..32 * j + 32]);
        let sum_x2 = xs.iter().fold(0.0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let lj = as_array_mut(&mut l[32 * j..32 * j + 32]);
        (scales[j], mins[j]) = make_qkx2_quants(xs, &w, lj, p);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let ls: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_scale * scales[j]) as u8).min(63));
    let lm: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_min * mins[j]) as u8).min(63));
    pack_scales_k4(&ls, &lm, &mut y[4..16]);
    write_f16(y, 0, max_scale / 63.0);
    write_f16(y, 2, max_min / 63.0);
    let (d, dmin) = (read_f16(y, 0), read_f16(y, 2));
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &y[4..16]);
        let dj = d * f32::from(sc);
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * f32::from(m);
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / dj).clamp(0, p.nmax) as u8;
        }
    }
}

/// Packs the low nibbles of 256 quants: per 64 elements, 32 bytes with elements
/// `l` (low nibble) and `l + 32` (high nibble).
fn pack_k_nibbles(l: &[u8; QK_K], qs: &mut [u8]) {
    for (c, q) in qs.chunks_exact_mut(32).enumerate() {
        for i in 0..32 {
            q[i] = (l[64 * c + i] & 0x0f) | ((l[64 * c + i + 32] & 0x0f) << 4);
        }
    }
}

/// Quantizes one Q4_K super-block (ggml's `quantize_row_q4_K_ref`).
pub fn quantize_q4_k(x: &[f32; QK_K], y: &mut [u8; 144]) {
    let mut l = [0u8; QK_K];
    quantize_k4_scales(x, y, &Q4_K_SEARCH, &mut l);
    pack_k_nibbles(&l, &mut y[16..]);
}

/// Quantizes one Q5_K super-block (ggml's `quantize_row_q5_K_ref`).
pub fn quantize_q5_k(x: &[f32; QK_K], y: &mut [u8; 176]) {
    let mut l = [0u8; QK_K];
    quantize_k4_scales(x, y, &Q5_K_SEARCH, &mut l);
    let qh = &mut y[16..48];
    qh.fill(0);
    for (i, &v) in l.iter().enumerate() {
        qh[i % 32] |= (v >> 4) << (i / 32);
    }
    pack_k_nibbles(&l, &mut y[48..]);
}

/// The 16 sub-block scales of a Q6_K super-block (from [`make_qx_quants`]) and the
/// quants of that search in `l`.
fn q6_k_sub_scales(x: &[f32; QK_K], l: &mut [u8; QK_K]) -> [f32; 16] {
    std::array::from_fn(|ib| {
        let xs = as_array(&x[16 * ib..16 * ib + 16]);
        make_qx_quants(xs, 32, as_array_mut(&mut l[16 * ib..16 * ib + 16]))
    })
}

/// Quantizes one Q6_K super-block (ggml's `quantize_row_q6_K_ref`).
pub fn quantize_q6_k(x: &[f32; QK_K], y: &mut [u8; 210]) {
    let mut l = [0u8; QK_K];
    let scales = q6_k_sub_scales(x, &mut l);
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for &s in &scales {
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = s;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        y.fill(0);
        return;
    }
    let iscale = -128.0 / max_scale;
    write_f16(y, 208, 1.0 / iscale);
    for (ib, &s) in scales.iter().enumerate() {
        y[192 + ib] = nearest_int(iscale * s).min(127) as i8 as u8;
    }
    let d = read_f16(y, 208);
    for j in 0..16 {
        let dj = d * f32::from(y[192 + j] as i8);
        if dj == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / dj).clamp(-32, 31) + 32) as u8;
        }
    }
    pack_q6_k(&l, y);
}

/// Packs 256 six-bit quants into Q6_K's `ql[128]` and `qh[64]`.
pub(crate) fn pack_q6_k(l: &[u8; QK_K], y: &mut [u8; 210]) {
    let (ql, rest) = y.split_at_mut(128);
    let qh = &mut rest[..64];
    for c in 0..2 {
        let lc = &l[128 * c..128 * c + 128];
        for i in 0..32 {
            let (a, b, e, f) = (lc[i], lc[i + 32], lc[i + 64], lc[i + 96]);
            ql[64 * c + i] = (a & 0x0f) | ((e & 0x0f) << 4);
            ql[64 * c + i + 32] = (b & 0x0f) | ((f & 0x0f) << 4);
            qh[32 * c + i] = (a >> 4) | ((b >> 4) << 2) | ((e >> 4) << 4) | ((f >> 4) << 6);
        }
    }
}

/// The 32 quants (0..=15) of sub-block `j` of Q4_K's `qs[128]`: the low (even `j`) or
/// high (odd `j`) nibbles of bytes `32 * (j / 2)..`.
#[inline(always)]
pub(crate) fn q4_k_sub(qs: &[u8], j: usize) -> [u8; 32] {
    let chunk: &[u8; 32] = as_array(&qs[32 * (j / 2)..32 * (j / 2) + 32]);
    let shift = 4 * (j % 2);
    chunk.map(|b| (b >> shift) & 0x0f)
}

/// The 32 quants (0..=31) of sub-block `j` of Q5_K's `qh[32]` and `qs[128]`: the nibbles
/// of [`q4_k_sub`] plus bit `j` of `qh[i]` as bit 4.
#[inline(always)]
pub(crate) fn q5_k_sub(qh: &[u8], qs: &[u8], j: usize) -> [u8; 32] {
    let qh: &[u8; 32] = as_array(&qh[..32]);
    let mut q = q4_k_sub(qs, j);
    for (v, &h) in q.iter_mut().zip(qh) {
        *v |= ((h >> j) & 1) << 4;
    }
    q
}

/// The 256 signed quants (-32..=31) of Q6_K's `ql[128]` and `qh[64]`, in element order.
#[inline(always)]
pub(crate) fn unpack_q6_k(ql: &[u8], qh: &[u8]) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for c in 0..2 {
        let (ql, qh) = (&ql[64 * c..64 * c + 64], &qh[32 * c..32 * c + 32]);
        let out = &mut q[128 * c..128 * c + 128];
        for i in 0..32 {
            let h = qh[i];
            out[i] = ((ql[i] & 0x0f) | ((h & 3) << 4)) as i8 - 32;
            out[i + 32] = ((ql[i + 32] & 0x0f) | (((h >> 2) & 3) << 4)) as i8 - 32;
            out[i + 64] = ((ql[i] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
            out[i + 96] = ((ql[i + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    q
}

/// Dequantizes Q4_K/Q5_K: `d * sc_j * q - dmin * m_j` per sub-block `j`, with the quants
/// of sub-block `j` from `sub(j)`.
#[inline(always)]
fn dequantize_k4(head: &[u8], sub: impl Fn(usize) -> [u8; 32], y: &mut [f32; QK_K]) {
    let (d, dmin) = (read_f16(head, 0), read_f16(head, 2));
    for (j, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(j, &head[4..16]);
        let (dj, mj) = (d * f32::from(sc), dmin * f32::from(m));
        for (v, qi) in ys.iter_mut().zip(sub(j)) {
            *v = dj * f32::from(qi) - mj;
        }
    }
}

/// Dequantizes one Q4_K super-block (ggml's `dequantize_row_q4_K`).
#[inline]
pub fn dequantize_q4_k(x: &[u8; 144], y: &mut [f32; QK_K]) {
    dequantize_k4(x, |j| q4_k_sub(&x[16..], j), y);
}

/// Dequantizes one Q5_K super-block (ggml's `dequantize_row_q5_K`).
#[inline]
pub fn dequantize_q5_k(x: &[u8; 176], y: &mut [f32; QK_K]) {
    dequantize_k4(x, |j| q5_k_sub(&x[16..48], &x[48..], j), y);
}

/// Dequantizes one Q6_K super-block (ggml's `dequantize_row_q6_K`): `d * scale_j * q`.
#[inline]
pub fn dequantize_q6_k(x: &[u8; 210], y: &mut [f32; QK_K]) {
    let d = read_f16(x, 208);
    let q = unpack_q6_k(&x[..128], &x[128..192]);
    for (j, (ys, qs)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
        let dj = d * f32::from(x[192 + j] as i8);
        for (v, &qi) in ys.iter_mut().zip(qs) {
            *v = dj * f32::from(qi);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips() {
        let ls: [u8; 8] = [0, 63, 17, 42, 1, 62, 33, 48];
        let lm: [u8; 8] = [5, 9, 63, 0, 31, 32, 16, 60];
        let mut packed = [0u8; 12];
        pack_scales_k4(&ls, &lm, &mut packed);
        for j in 0..8 {
            assert_eq!(scale_min_k4(j, &packed), (ls[j], lm[j]), "sub-block {j}");
        }
    }

    #[test]
    fn q6_k_packing_round_trips() {
        let l: [u8; QK_K] = std::array::from_fn(|i| ((i * 37 + 11) % 64) as u8);
        let mut y = [0u8; 210];
        pack_q6_k(&l, &mut y);
        let q = unpack_q6_k(&y[..128], &y[128..192]);
        for i in 0..QK_K {
            assert_eq!(i32::from(q[i]) + 32, i32::from(l[i]), "element {i}");
        }
    }
}
