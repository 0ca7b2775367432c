//! Dot products of one quantized weight row with a row of activations: the inner loop
//! of the quantized matrix-vector product.
//!
//! [`vec_dot_q8_1`] takes the activations quantized to Q8_1 and is the CPU oracle of
//! ggml-cuda's `mul_mat_vec_q` path: products of quants summed in `i32` per 32-element
//! block (per 16 elements under Q6_K's scales), then scaled in `f32`. A weight block's
//! offset (Q4_0's `-8`, Q5_0's `-16`, Q4_1/Q5_1's `m`, the K-quants' mins) is applied once
//! per block through the Q8_1 block's `s = d * sum(q)` field:
//!
//! | weights | one 32-element block (`d8`, `s8`: the Q8_1 block's fields) |
//! |---------|-------------------------------------------------------------|
//! | Q4_0 | `d4 * (sumi * d8 - 8 * s8)`, `sumi = sum(q4 * q8)` with `q4` in `0..16` |
//! | Q4_1 | `sumi * (d4 * d8) + m4 * s8` |
//! | Q5_0 | `d5 * (sumi * d8 - 16 * s8)`, `q5` in `0..32` |
//! | Q5_1 | `sumi * (d5 * d8) + m5 * s8` |
//! | Q8_0, Q8_1 | `(dw * d8) * sumi` |
//!
//! For Q4_K and Q5_K a super-block meets 8 Q8_1 blocks, one per sub-block `j`:
//! `d * sum_j(d8_j * (sc_j * sumi_j)) - dmin * sum_j(s8_j * m_j)`. For Q6_K each Q8_1
//! block covers two 16-element scale groups: `d * sum_j(d8_j * (sc_a * sumi_a + sc_b *
//! sumi_b))` with the quants' `-32` applied before the integer products. Products of two
//! f16 scales are taken in f32 (ggml-cuda's path for GPUs without fast f16 arithmetic).
//!
//! [`vec_dot_f32`] is the dequantize-in-registers path: each block is dequantized exactly
//! as [`super::dequantize_row`] does and dotted with the f32 activations.

use super::iq_tables::KVALUES_IQ4NL;
use super::iqgrid::{self, Sub};
use super::kquants::{scale_min_k4, unpack_q6_k};
use super::kquants23::{self, q2_field, q3_k_quant, q3_k_scale};
use super::legacy::{unpack_5bit, unpack_nibbles};
use super::{as_array, as_array_mut, iq4, legacy, panel, read_f16, ternary, QType};

/// Whether the CPU runs the AVX2 + FMA copy of [`vec_dot_f32`] (detected once; std
/// caches the answer). That copy differs from the portable one only in rounding where
/// FMA contracts a multiply-add of the f32 scales.
#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// Bytes of a Q8_1 block.
const Q8_1_BYTES: usize = 36;

/// Dot product of the quantized weight row `w` (blocks of `q`) with the activations `a`
/// quantized to Q8_1 (one Q8_1 block per 32 weights; 8 per K-quant super-block).
///
/// # Panics
/// If `w` is not a whole number of `q` blocks, or `a` does not hold one Q8_1 block per
/// 32 weights of `w`: the caller sizes both from the same row length.
pub fn vec_dot_q8_1(q: QType, w: &[u8], a: &[u8]) -> f32 {
    let mut out = [0.0f32];
    vec_dot_q8_1_cols(q, w, a, &mut out);
    out[0]
}

/// Dot products of the quantized weight row `w` (blocks of `q`) with `out.len()`
/// activation rows quantized to Q8_1, stored one after the other in `a`:
/// `out[c] = vec_dot_q8_1(q, w, &a[c * r..(c + 1) * r])` with `r = a.len() / out.len()`.
/// On x86-64 CPUs with AVX2, FMA and F16C the weight blocks are unpacked once for up to
/// four columns by the intrinsics of [`super::avx2`]; elsewhere each column goes through
/// the portable code. Both give the same integer sums; the f32 sums of the block terms
/// are added in different orders.
///
/// # Panics
/// If `w` is not a whole number of `q` blocks, or `a` does not hold `out.len()` rows of
/// one Q8_1 block per 32 weights of `w`.
pub fn vec_dot_q8_1_cols(q: QType, w: &[u8], a: &[u8], out: &mut [f32]) {
    let mut ds = vec![0.0f32; a.len() / Q8_1_BYTES * 2];
    q8_1_scales(a, &mut ds);
    vec_dot_q8_1_cols_scaled(q, w, a, &ds, out);
}

/// [`vec_dot_q8_1_cols`] with the `d` and `s` of every Q8_1 block of `a` already in `ds`
/// as f32 ([`q8_1_scales`]), as mul_mat prepares them once for all weight rows.
///
/// # Panics
/// As [`vec_dot_q8_1_cols`], or if `ds` does not hold two floats per block of `a`.
pub fn vec_dot_q8_1_cols_scaled(q: QType, w: &[u8], a: &[u8], ds: &[f32], out: &mut [f32]) {
    let n = w.len() / q.block_bytes() * q.block_size();
    assert!(
        w.len().is_multiple_of(q.block_bytes())
            && a.len() == out.len() * (n / 32 * Q8_1_BYTES)
            && ds.len() == a.len() / Q8_1_BYTES * 2,
        "vec_dot_q8_1 {q}: {} weight bytes, {} Q8_1 bytes and {} scales do not describe {} row(s)",
        w.len(),
        a.len(),
        ds.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        // SAFETY: the CPU has AVX2, FMA and F16C; the lengths were checked above.
        unsafe { super::avx2::dot_cols(q, w, a, ds, out) };
        return;
    }
    vec_dot_q8_1_cols_portable(q, w, a, out);
}

/// Where the products of [`vec_dot_q8_1_rows`] go: row `r` and column `c` at
/// `ptr + r * row + c * col` (counted in floats), e.g. straight into a mul_mat's result.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Results {
    /// Row 0, column 0.
    pub ptr: *mut f32,
    /// Floats from one row to the next.
    pub row: usize,
    /// Floats from one column to the next.
    pub col: usize,
}

impl Results {
    /// Writes `v` at row `r`, column `c`.
    ///
    /// # Safety
    /// `(r, c)` is one of the results: valid memory that nothing else accesses meanwhile.
    #[inline(always)]
    pub(crate) unsafe fn set(self, r: usize, c: usize, v: f32) {
        // SAFETY: (r, c) is one of the results (caller).
        unsafe { self.ptr.add(r * self.row + c * self.col).write_unaligned(v) }
    }

    /// The results from row `r` and column `c` on.
    ///
    /// # Safety
    /// `(r, c)` is one of the results, or just past the last row or column.
    #[inline(always)]
    pub(crate) unsafe fn from(self, r: usize, c: usize) -> Self {
        Results {
            // SAFETY: inside the results or one past them (caller).
            ptr: unsafe { self.ptr.add(r * self.row + c * self.col) },
            ..self
        }
    }
}

/// Dot products of `nrows` weight rows (row `r` at `w + r * w_stride`, `row_bytes` whole
/// blocks of `q`) with `ncols` activation columns quantized to Q8_1 (`a`, scales in `ds`
/// as [`vec_dot_q8_1_cols_scaled`] takes them; `panels` empty or the columns packed as
/// [`packing`] says), row `r` and column `c` into `out`. mul_mat's inner loop: the checks
/// and the choice of kernel are made once for all the rows.
///
/// # Safety
/// Every weight row is `row_bytes` bytes of valid memory that nothing writes meanwhile;
/// `out` holds `nrows` rows of `ncols` columns, memory nothing else accesses meanwhile.
///
/// # Panics
/// If `row_bytes` is not whole blocks, `a` does not hold `ncols` Q8_1 rows of one block
/// per 32 weights, `ds` two floats per block of `a`, or `panels` is neither empty nor
/// `ncols` packed columns.
pub(crate) unsafe fn vec_dot_q8_1_rows(
    q: QType,
    (w, w_stride, row_bytes): (*const u8, usize, usize),
    (a, panels): (&[u8], &[u8]),
    ds: &[f32],
    (nrows, ncols): (usize, usize),
    out: Results,
) {
    let nb = row_bytes / q.block_bytes();
    let q8_row = nb * q.block_size() / 32 * Q8_1_BYTES;
    assert!(
        row_bytes % q.block_bytes() == 0
            && a.len() == ncols * q8_row
            && ds.len() == a.len() / Q8_1_BYTES * 2
            && (panels.is_empty()
                || panels.len() == ncols.div_ceil(panel::RUN) * (q8_row / Q8_1_BYTES) * panel::COL_PANEL),
        "vec_dot_q8_1_rows {q}: {row_bytes} bytes per row, {} Q8_1 bytes for {ncols} columns, {} scales, {} packed bytes",
        a.len(),
        ds.len(),
        panels.len()
    );
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        let vnni = super::avx2::vnni_available();
        let shape = (nrows, ncols, vnni);
        // SAFETY: the CPU has AVX2, FMA and F16C, and AVX-512 VNNI and VL if vnni; the
        // rows and results are valid (caller) and the other lengths were checked above.
        unsafe { super::avx2::dot_rows(q, (w, w_stride, nb), (a, panels), ds, shape, out) };
        return;
    }
    let mut o = vec![0f32; ncols];
    for r in 0..nrows {
        // SAFETY: row r is row_bytes bytes of valid memory (caller).
        let wr = unsafe { std::slice::from_raw_parts(w.add(r * w_stride), row_bytes) };
        vec_dot_q8_1_cols_portable(q, wr, a, &mut o);
        for (c, &v) in o.iter().enumerate() {
            // SAFETY: (r, c) is one of the results (caller).
            unsafe { out.set(r, c, v) };
        }
    }
}

/// The products of weights kept in rows of eight ([`super::rows8`]): `groups` groups of
/// eight rows of `nb` blocks of `q` from `w`, by `ncols` Q8_1 columns packed as
/// [`super::rows8::packing`] says ([`super::panel`]), row `r` and column `c` into `out.0[c * out.1 + r]` (a
/// column's rows side by side, as in a mul_mat's result).
///
/// # Safety
/// The groups are valid memory that nothing writes meanwhile; the CPU runs the kernels
/// ([`super::rows8::usable`]); `out.0` is valid for writes of `8 * groups` floats from
/// `c * out.1` for every column `c`, memory nothing else accesses meanwhile.
///
/// # Panics
/// If `q` is not a type of rows of eight, or `cols` is not as long as `ncols` packed
/// columns of `nb` blocks.
pub(crate) unsafe fn vec_dot_q8_1_rows8(
    q: QType,
    (w, nb, groups): (*const u8, usize, usize),
    cols: &[u8],
    ncols: usize,
    out: (*mut f32, usize),
) {
    assert!(
        matches!(q, QType::Q4_0 | QType::IQ4_NL)
            && cols.len() == ncols.div_ceil(panel::RUN) * nb * panel::COL_PANEL,
        "vec_dot_q8_1_rows8 {q}: {nb} blocks a row, {groups} groups, {} packed bytes for \
         {ncols} columns",
        cols.len(),
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU runs the kernels and the groups are valid (caller); the length of
    // the columns was checked above.
    unsafe {
        super::avx2::rows8::rows(q, (w, nb, groups), cols.as_ptr(), ncols, out)
    };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("rows of eight are x86-64 only ({w:?})");
}

/// How [`vec_dot_q8_1_rows`] with `ncols` columns of weights of `q` reads the columns
/// packed eight at a time ([`super::panel`]), or `None` where it reads none (without
/// them it takes slower kernels).
pub(crate) fn packing(q: QType, ncols: usize) -> Option<super::panel::Packing> {
    #[cfg(target_arch = "x86_64")]
    if super::avx2::available() {
        return super::avx2::packing(q, ncols);
    }
    let _ = (q, ncols);
    None
}

/// The `d` and `s` fields of every Q8_1 block of `a` as f32 pairs into `ds`.
pub fn q8_1_scales(a: &[u8], ds: &mut [f32]) {
    for (blk, pair) in a.chunks_exact(Q8_1_BYTES).zip(ds.chunks_exact_mut(2)) {
        let (d, s) = q8_1_ds(blk);
        pair.copy_from_slice(&[d, s]);
    }
}

/// [`vec_dot_q8_1_cols`] without SIMD intrinsics, one column at a time (the reference of
/// the intrinsics' tests). Same length checks as [`vec_dot_q8_1_cols`].
pub(crate) fn vec_dot_q8_1_cols_portable(q: QType, w: &[u8], a: &[u8], out: &mut [f32]) {
    let n = w.len() / q.block_bytes() * q.block_size();
    let r = n / 32 * Q8_1_BYTES;
    assert!(w.len().is_multiple_of(q.block_bytes()) && a.len() == out.len() * r);
    for (o, ac) in out.iter_mut().zip(a.chunks_exact(r.max(1))) {
        *o = vec_dot_q8_1_any(q, w, ac);
    }
}

/// One column of [`vec_dot_q8_1_cols_portable`].
#[inline(always)]
fn vec_dot_q8_1_any(q: QType, w: &[u8], a: &[u8]) -> f32 {
    match q {
        QType::Q4_0 => sum_blocks::<18, 36>(w, a, dot_q4_0),
        QType::Q4_1 => sum_blocks::<20, 36>(w, a, dot_q4_1),
        QType::Q5_0 => sum_blocks::<22, 36>(w, a, dot_q5_0),
        QType::Q5_1 => sum_blocks::<24, 36>(w, a, dot_q5_1),
        QType::Q8_0 => sum_blocks::<34, 36>(w, a, |w, a| dot_q8(read_f16(w, 0), &w[2..], a)),
        QType::Q8_1 => sum_blocks::<36, 36>(w, a, |w, a| dot_q8(read_f16(w, 0), &w[4..], a)),
        QType::Q4_K => sum_blocks::<144, 288>(w, a, |w, a| dot_k4::<false>(w, &w[16..], a)),
        QType::Q5_K => sum_blocks::<176, 288>(w, a, |w, a| dot_k4::<true>(w, &w[48..], a)),
        QType::Q6_K => sum_blocks::<210, 288>(w, a, dot_q6_k),
        QType::Q2_K => sum_blocks::<84, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 80), read_f16(w, 82)), q2_k_sub)
        }),
        QType::Q3_K => sum_blocks::<110, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 108), 0.0), q3_k_sub)
        }),
        QType::IQ4_NL => sum_blocks::<18, 36>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0), 0.0), iq4_nl_sub)
        }),
        QType::IQ4_XS => sum_blocks::<136, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0), 0.0), iq4_xs_sub)
        }),
        QType::IQ2_XXS => sum_blocks::<66, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0) * 0.125, 0.0), iqgrid::iq2_xxs_sub)
        }),
        QType::IQ2_XS => sum_blocks::<74, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0) * 0.125, 0.0), iqgrid::iq2_xs_sub)
        }),
        QType::IQ2_S => sum_blocks::<82, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0) * 0.125, 0.0), iqgrid::iq2_s_sub)
        }),
        QType::IQ3_XXS => sum_blocks::<98, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0) * 0.25, 0.0), iqgrid::iq3_xxs_sub)
        }),
        QType::IQ3_S => sum_blocks::<110, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0), 0.0), iqgrid::iq3_s_sub)
        }),
        QType::IQ1_S => sum_blocks::<50, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 0) * 0.125, 0.0), iqgrid::iq1_s_sub)
        }),
        QType::IQ1_M => sum_blocks::<56, 288>(w, a, |w, a| {
            dot_subs(w, a, (iqgrid::iq1_m_d(w) * 0.125, 0.0), iqgrid::iq1_m_sub)
        }),
        QType::TQ1_0 => sum_blocks::<54, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 52), 0.0), |w, j| {
                Sub::one(ternary::tq1_0_quants(w, j), 1)
            })
        }),
        QType::TQ2_0 => sum_blocks::<66, 288>(w, a, |w, a| {
            dot_subs(w, a, (read_f16(w, 64), 0.0), |w, j| {
                Sub::one(ternary::tq2_0_quants(w, j), 1)
            })
        }),
    }
}

/// Dot product of the quantized weight row `w` (blocks of `q`) with the f32 activations
/// `x`: each block dequantized, then dotted in f32.
///
/// # Panics
/// If `w` is not a whole number of `q` blocks or `x` does not hold one value per weight.
pub fn vec_dot_f32(q: QType, w: &[u8], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2).
        return unsafe { vec_dot_f32_avx2(q, w, x) };
    }
    vec_dot_f32_any(q, w, x)
}

/// The dot product of a weight row that [`super::dequantize_row`] dequantized with `x`,
/// summed as [`vec_dot_f32`] sums the quantized row (the same bits): a product with
/// several columns dequantizes each weight row once instead of once per column.
pub fn dot_dequantized(w: &[f32], x: &[f32]) -> f32 {
    assert!(
        w.len() == x.len() && w.len().is_multiple_of(LANES),
        "dot_dequantized: {} weights and {} activations are not one row of whole blocks",
        w.len(),
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2 and FMA (checked by has_avx2).
        return unsafe { dot_dequantized_avx2(w, x) };
    }
    dot_dequantized_any(w, x)
}

/// [`dot_dequantized`] compiled for AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_dequantized_avx2(w: &[f32], x: &[f32]) -> f32 {
    dot_dequantized_any(w, x)
}

/// [`dot_dequantized`] for any target: [`f32_blocks`]'s lanes over the whole row.
#[inline(always)]
fn dot_dequantized_any(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (wc, xc) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)) {
        for k in 0..LANES {
            acc[k] += wc[k] * xc[k];
        }
    }
    reduce_lanes(&acc)
}

/// [`vec_dot_f32`] compiled for AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn vec_dot_f32_avx2(q: QType, w: &[u8], x: &[f32]) -> f32 {
    vec_dot_f32_any(q, w, x)
}

/// [`vec_dot_f32`] for any target (inlined into the AVX2 copy).
#[inline(always)]
fn vec_dot_f32_any(q: QType, w: &[u8], x: &[f32]) -> f32 {
    assert!(
        w.len().is_multiple_of(q.block_bytes())
            && x.len() == w.len() / q.block_bytes() * q.block_size(),
        "vec_dot_f32 {q}: {} weight bytes and {} activations do not describe one row",
        w.len(),
        x.len()
    );
    match q {
        QType::Q4_0 => f32_blocks(w, x, legacy::dequantize_q4_0),
        QType::Q4_1 => f32_blocks(w, x, legacy::dequantize_q4_1),
        QType::Q5_0 => f32_blocks(w, x, legacy::dequantize_q5_0),
        QType::Q5_1 => f32_blocks(w, x, legacy::dequantize_q5_1),
        QType::Q8_0 => f32_blocks(w, x, legacy::dequantize_q8_0),
        QType::Q8_1 => f32_blocks(w, x, legacy::dequantize_q8_1),
        QType::Q4_K => f32_blocks(w, x, super::kquants::dequantize_q4_k),
        QType::Q5_K => f32_blocks(w, x, super::kquants::dequantize_q5_k),
        QType::Q6_K => f32_blocks(w, x, super::kquants::dequantize_q6_k),
        QType::Q2_K => f32_blocks(w, x, kquants23::dequantize_q2_k),
        QType::Q3_K => f32_blocks(w, x, kquants23::dequantize_q3_k),
        QType::IQ4_NL => f32_blocks(w, x, iq4::dequantize_iq4_nl),
        QType::IQ4_XS => f32_blocks(w, x, iq4::dequantize_iq4_xs),
        QType::IQ2_XXS => f32_blocks(w, x, iqgrid::dequantize_iq2_xxs),
        QType::IQ2_XS => f32_blocks(w, x, iqgrid::dequantize_iq2_xs),
        QType::IQ2_S => f32_blocks(w, x, iqgrid::dequantize_iq2_s),
        QType::IQ3_XXS => f32_blocks(w, x, iqgrid::dequantize_iq3_xxs),
        QType::IQ3_S => f32_blocks(w, x, iqgrid::dequantize_iq3_s),
        QType::IQ1_S => f32_blocks(w, x, iqgrid::dequantize_iq1_s),
        QType::IQ1_M => f32_blocks(w, x, iqgrid::dequantize_iq1_m),
        QType::TQ1_0 => f32_blocks(w, x, ternary::dequantize_tq1_0),
        QType::TQ2_0 => f32_blocks(w, x, ternary::dequantize_tq2_0),
    }
}

/// Sums `f` over the pairs of weight blocks (`W` bytes) and their Q8_1 blocks (`A` bytes).
#[inline(always)]
fn sum_blocks<const W: usize, const A: usize>(
    w: &[u8],
    a: &[u8],
    f: impl Fn(&[u8; W], &[u8; A]) -> f32,
) -> f32 {
    w.chunks_exact(W)
        .zip(a.chunks_exact(A))
        .fold(0.0f32, |acc, (w, a)| acc + f(as_array(w), as_array(a)))
}

/// Dequantizes each block of `w` with `deq` and dots it with its slice of `x`, in
/// [`LANES`] independent f32 sums kept across the whole row (so that the loop
/// vectorizes), added up at the end.
#[inline(always)]
fn f32_blocks<const W: usize, const N: usize>(
    w: &[u8],
    x: &[f32],
    deq: impl Fn(&[u8; W], &mut [f32; N]),
) -> f32 {
    let mut buf = [0.0f32; N];
    let mut acc = [0.0f32; LANES];
    for (wb, xb) in w.chunks_exact(W).zip(x.chunks_exact(N)) {
        deq(as_array(wb), as_array_mut(&mut buf));
        for (bc, xc) in buf.chunks_exact(LANES).zip(xb.chunks_exact(LANES)) {
            for k in 0..LANES {
                acc[k] += bc[k] * xc[k];
            }
        }
    }
    reduce_lanes(&acc)
}

/// Independent partial sums of [`f32_blocks`] (both block sizes are multiples).
const LANES: usize = 16;

/// The sum of the lanes, pairwise.
#[inline(always)]
fn reduce_lanes(acc: &[f32; LANES]) -> f32 {
    let mut v = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for k in 0..width {
            v[k] += v[k + width];
        }
        width /= 2;
    }
    v[0]
}

/// `sum(q[i] * a[i])` in i32 over `N` quants, with `a` the i8 quants of a Q8_1 block;
/// the products of the 4- to 6-bit quants fit i16, the form that becomes `pmaddwd`.
#[inline(always)]
fn isum<const N: usize>(q: &[i8; N], a: &[u8]) -> i32 {
    let a: &[u8; N] = as_array(&a[..N]);
    let mut s = 0i32;
    for i in 0..N {
        s += i32::from(i16::from(q[i])) * i32::from(i16::from(a[i] as i8));
    }
    s
}

/// Quants known to lie in `0..=127` as i8 (a cast that keeps every value).
#[inline(always)]
fn as_i8<const N: usize>(q: [u8; N]) -> [i8; N] {
    q.map(|v| v as i8)
}

/// The `d` and `s` fields of a Q8_1 block.
#[inline(always)]
fn q8_1_ds(a: &[u8]) -> (f32, f32) {
    (read_f16(a, 0), read_f16(a, 2))
}

/// One Q4_0 block against one Q8_1 block.
#[inline(always)]
fn dot_q4_0(w: &[u8; 18], a: &[u8; 36]) -> f32 {
    let sumi = isum(&as_i8(unpack_nibbles(&w[2..])), &a[4..]);
    let (d8, s8) = q8_1_ds(a);
    read_f16(w, 0) * (sumi as f32 * d8 - 8.0 * s8)
}

/// One Q4_1 block against one Q8_1 block.
#[inline(always)]
fn dot_q4_1(w: &[u8; 20], a: &[u8; 36]) -> f32 {
    let sumi = isum(&as_i8(unpack_nibbles(&w[4..])), &a[4..]);
    let (d8, s8) = q8_1_ds(a);
    sumi as f32 * (read_f16(w, 0) * d8) + read_f16(w, 2) * s8
}

/// One Q5_0 block against one Q8_1 block.
#[inline(always)]
fn dot_q5_0(w: &[u8; 22], a: &[u8; 36]) -> f32 {
    let sumi = isum(&as_i8(unpack_5bit(&w[2..6], &w[6..])), &a[4..]);
    let (d8, s8) = q8_1_ds(a);
    read_f16(w, 0) * (sumi as f32 * d8 - 16.0 * s8)
}

/// One Q5_1 block against one Q8_1 block.
#[inline(always)]
fn dot_q5_1(w: &[u8; 24], a: &[u8; 36]) -> f32 {
    let sumi = isum(&as_i8(unpack_5bit(&w[4..8], &w[8..])), &a[4..]);
    let (d8, s8) = q8_1_ds(a);
    sumi as f32 * (read_f16(w, 0) * d8) + read_f16(w, 2) * s8
}

/// One Q8_0 / Q8_1 weight block (scale `dw`, quants `qs`) against one Q8_1 block.
#[inline(always)]
fn dot_q8(dw: f32, qs: &[u8], a: &[u8; 36]) -> f32 {
    let q: [i8; 32] = std::array::from_fn(|i| qs[i] as i8);
    let sumi = isum(&q, &a[4..]);
    dw * read_f16(a, 0) * sumi as f32
}

/// One Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`, `qh` at `w[16..48]`) super-block
/// (header `w[0..16]`, nibbles `qs[128]`) against 8 Q8_1 blocks.
#[inline(always)]
fn dot_k4<const FIVE: bool>(w: &[u8], qs: &[u8], a: &[u8; 288]) -> f32 {
    let (mut sumf_d, mut sumf_m) = (0.0f32, 0.0f32);
    for c in 0..4 {
        let sums = k4_pair_sums::<FIVE>(w, qs, c, &a[72 * c..72 * c + 72]);
        for (k, sumi) in sums.into_iter().enumerate() {
            let j = 2 * c + k;
            let (sc, m) = scale_min_k4(j, &w[4..16]);
            let (d8, s8) = q8_1_ds(&a[36 * j..]);
            sumf_d += d8 * (i32::from(sc) * sumi) as f32;
            sumf_m += s8 * f32::from(m);
        }
    }
    read_f16(w, 0) * sumf_d - read_f16(w, 2) * sumf_m
}

/// The integer sums of sub-blocks `2c` (low nibbles of the 32 bytes `qs[32c..]`, plus
/// bit `2c` of `qh` for Q5_K) and `2c + 1` (high nibbles, bit `2c + 1`) against their two
/// Q8_1 blocks `a[0..72]`.
#[inline(always)]
fn k4_pair_sums<const FIVE: bool>(w: &[u8], qs: &[u8], c: usize, a: &[u8]) -> [i32; 2] {
    let q: &[u8; 32] = as_array(&qs[32 * c..32 * c + 32]);
    let (a0, a1): (&[u8; 32], &[u8; 32]) = (as_array(&a[4..36]), as_array(&a[40..72]));
    let h: &[u8; 32] = as_array(&w[16..48]);
    let (mut s0, mut s1) = (0i32, 0i32);
    for i in 0..32 {
        let (mut lo, mut hi) = (q[i] & 0x0f, q[i] >> 4);
        if FIVE {
            lo |= ((h[i] >> (2 * c)) & 1) << 4;
            hi |= ((h[i] >> (2 * c + 1)) & 1) << 4;
        }
        s0 += i32::from(i16::from(lo)) * i32::from(i16::from(a0[i] as i8));
        s1 += i32::from(i16::from(hi)) * i32::from(i16::from(a1[i] as i8));
    }
    [s0, s1]
}

/// One Q6_K super-block against 8 Q8_1 blocks.
#[inline(always)]
fn dot_q6_k(w: &[u8; 210], a: &[u8; 288]) -> f32 {
    let q = unpack_q6_k(&w[..128], &w[128..192]);
    let mut sumf = 0.0f32;
    for (j, (qj, aj)) in q
        .chunks_exact(32)
        .zip(a.chunks_exact(Q8_1_BYTES))
        .enumerate()
    {
        let sumi_a = isum::<16>(as_array(&qj[..16]), &aj[4..20]);
        let sumi_b = isum::<16>(as_array(&qj[16..]), &aj[20..]);
        let (sc_a, sc_b) = (
            i32::from(w[192 + 2 * j] as i8),
            i32::from(w[193 + 2 * j] as i8),
        );
        sumf += read_f16(aj, 0) * (sc_a * sumi_a + sc_b * sumi_b) as f32;
    }
    read_f16(w, 208) * sumf
}

/// One weight block read as [`Sub`]s (sub-block `j` by `sub(w, j)`, one per Q8_1 block of
/// `a`) against its Q8_1 blocks, with the block's factors `(d, dmin)`:
/// `d * sum_j(d8_j * sumi_j) - dmin * sum_j(d8_j * summ_j)`, where `sumi_j` is the
/// integer sum `sc_a * sum(q a) + sc_b * sum(q a)` over the two 16-element halves and
/// `summ_j = m_a * sum(a) + m_b * sum(a)` (Q2_K's mins; zero for the other types).
#[inline(always)]
fn dot_subs<const W: usize>(
    w: &[u8; W],
    a: &[u8],
    (d, dmin): (f32, f32),
    sub: impl Fn(&[u8; W], usize) -> Sub,
) -> f32 {
    let (mut sumf_d, mut sumf_m) = (0.0f32, 0.0f32);
    for (j, aj) in a.chunks_exact(Q8_1_BYTES).enumerate() {
        let s = sub(w, j);
        let sumi_a = isum::<16>(as_array(&s.q[..16]), &aj[4..20]);
        let sumi_b = isum::<16>(as_array(&s.q[16..]), &aj[20..]);
        let d8 = read_f16(aj, 0);
        sumf_d += d8 * (s.sc[0] * sumi_a + s.sc[1] * sumi_b) as f32;
        if s.m != [0, 0] {
            let (asum_a, asum_b) = (
                isum::<16>(&[1; 16], &aj[4..20]),
                isum::<16>(&[1; 16], &aj[20..]),
            );
            sumf_m += d8 * (s.m[0] * asum_a + s.m[1] * asum_b) as f32;
        }
    }
    d * sumf_d - dmin * sumf_m
}

/// Q2_K sub-block `j` (its two 16-element halves `2 j`, `2 j + 1`): quants 0..4, scales
/// and mins; factors `(d, dmin)`.
#[inline(always)]
pub(crate) fn q2_k_sub(w: &[u8; 84], j: usize) -> Sub {
    let (s0, s1) = (w[2 * j], w[2 * j + 1]);
    Sub {
        q: std::array::from_fn(|i| q2_field(&w[16..80], 32 * j + i) as i8),
        sc: [i32::from(s0 & 15), i32::from(s1 & 15)],
        m: [i32::from(s0 >> 4), i32::from(s1 >> 4)],
    }
}

/// Q3_K sub-block `j`: quants -4..4 and the signed scales of its halves; factor `d`.
#[inline(always)]
pub(crate) fn q3_k_sub(w: &[u8; 110], j: usize) -> Sub {
    let sc = |h: usize| i32::from(q3_k_scale(&w[96..108], h)) - 32;
    Sub {
        q: std::array::from_fn(|i| q3_k_quant(w, 32 * j + i)),
        sc: [sc(2 * j), sc(2 * j + 1)],
        m: [0, 0],
    }
}

/// The 32 levels of 16 packed IQ4 bytes.
#[inline(always)]
fn iq4_levels(qs: &[u8]) -> [i8; 32] {
    iq4::unpack_levels(qs).map(|l| KVALUES_IQ4NL[usize::from(l)])
}

/// The IQ4_NL block as one sub-block; factor `d`.
#[inline(always)]
pub(crate) fn iq4_nl_sub(w: &[u8; 18], _: usize) -> Sub {
    Sub::one(iq4_levels(&w[2..]), 1)
}

/// IQ4_XS sub-block `j`: levels and the signed 6-bit scale; factor `d`.
#[inline(always)]
pub(crate) fn iq4_xs_sub(w: &[u8; 136], j: usize) -> Sub {
    let sc = i32::from(iq4::iq4_xs_scale(w, j)) - 32;
    Sub::one(iq4_levels(&w[8 + 16 * j..]), sc)
}
