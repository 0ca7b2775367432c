//! Eight weight rows against every Q8_1 column of a call at once, by `vpdpbusd` (AVX-512
//! VNNI and VL): the prefill products of the types [`super::tile`] takes, where the CPU
//! has those features.
//!
//! A run of [`UNITS`] units (blocks, or 32-element sub-blocks) of eight rows is unpacked
//! once into a buffer that stays in the L1 cache ([`fill`]): for each unit eight
//! registers, register `g` holding bytes `4g..4g + 4` of the unit's 32 quants of row `r`
//! in its 32-bit lane `r` (an 8x8 transpose of 32-bit lanes), with the rows' factors of
//! the column's `d8` and `s8`. Every column then meets a unit with eight `vpdpbusd`, each
//! against one 4-byte group of the column's block broadcast from memory: lane `r` of the
//! sum is row `r`'s integer sum, so one conversion and one multiply-add scale all eight
//! rows, with no shuffles per column and no horizontal sums. The 4-row tile spends four
//! shuffles, four `vpdpbusd` and the same scaling on half the rows.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones. The unsigned quants (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q4_K, Q5_K) meet the signed activations directly. For the signed ones
//! (Q8_0, IQ4_NL, IQ4_XS) the activations come plus 128 (`a ^ 0x80`, made once per
//! product: [`crate::quant::dot::q8_1_plus_128`]) and each row's sum starts at -128 times the sum of its quants, computed
//! when the unit is unpacked. The integer sums are those of the portable code; only the
//! order of the f32 additions differs.

use std::arch::x86_64::*;

use super::tile::{by_tile_type, has_offset, signed, transpose, unit, Factors};
use super::{Cols, Q8};
use crate::quant::QType;

/// Units unpacked into the buffer at a time (10 KiB of quants and factors).
const UNITS: usize = 32;
/// Fewest columns of a call this kernel takes (a decode step's single column stays on
/// the row kernels).
pub(super) const FROM_COLS: usize = 2;
/// Most columns scaled in registers at once (two accumulators each).
const NC_MAX: usize = 8;

/// The unpacked quants of one unit of eight rows and their factors: `q[g]` lane `r` holds
/// bytes `4g..4g + 4` of row `r`'s quants; `d` scales the rows' integer sums (times the
/// column's `d8`); `m` multiplies the column's `s8`; `start` is -128 times the sum of
/// each row's quants for the signed types (zero for the others).
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Unit8 {
    q: [__m256i; 8],
    d: __m256,
    m: __m256,
    start: __m256i,
}

/// Whether `q` is a type of the tiles whose quants are signed (its products read the
/// activations plus 128).
pub(super) fn signed_type(q: QType) -> bool {
    by_tile_type!(q, 0, T, _units => signed(T), false)
}

/// The activation columns of a call: the Q8_1 blocks and, for the signed types, their
/// quants plus 128 (32 bytes a block; null when not given).
#[derive(Clone, Copy)]
struct Acts {
    cols: Cols,
    plus128: *const u8,
}

impl Acts {
    fn new(cols: Cols, plus128: &[u8]) -> Self {
        let plus128 = match plus128.is_empty() {
            true => std::ptr::null(),
            false => plus128.as_ptr(),
        };
        Acts { cols, plus128 }
    }

    /// The 32 quants of Q8_1 block `at` (counted over all columns) as 8 words: plus 128
    /// for the signed types.
    ///
    /// # Safety
    /// `at` is a block of the columns; for a signed `T`, `plus128` is not null.
    #[inline(always)]
    unsafe fn quants<const T: u8>(&self, at: usize) -> *const i32 {
        match signed(T) {
            true => self.plus128.add(32 * at) as *const i32,
            false => self.cols.q.add(at * Q8 + 4) as *const i32,
        }
    }
}

/// Rows done by the 8-row kernel for `q` (rows `0..nrows / 8 * 8`, the others left to the
/// caller), or 0 for a type it does not take, and for the signed types when `plus128` is
/// empty.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI; the rows (`stride` bytes
/// apart, `nb` blocks of `q` each) are valid memory; `a` holds `ncols` Q8_1 columns of one
/// block per 32 weights of a row; `plus128` is empty or holds their quants plus 128
/// ([`crate::quant::dot::q8_1_plus_128`]); `out` holds `nrows * ncols` floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) unsafe fn rows(
    q: QType,
    (w, stride, nb): (*const u8, usize, usize),
    (nrows, ncols): (usize, usize),
    (a, plus128): (Cols, &[u8]),
    out: &mut [f32],
) -> usize {
    let m = (w, stride);
    let n = (nrows, ncols);
    let a = Acts::new(a, plus128);
    by_tile_type!(q, nb, T, units => each::<T>(m, units, n, a, out), 0)
}

/// [`rows`] for the type `T`, rows of `units` units.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn each<const T: u8>(
    (w, stride): (*const u8, usize),
    units: usize,
    (nrows, ncols): (usize, usize),
    a: Acts,
    out: &mut [f32],
) -> usize {
    let done = nrows / 8 * 8;
    // the signed types meet the activations plus 128
    if done == 0 || ncols == 0 || (signed(T) && a.plus128.is_null()) {
        return 0;
    }
    let mut buf = [Unit8 {
        q: [_mm256_setzero_si256(); 8],
        d: _mm256_setzero_ps(),
        m: _mm256_setzero_ps(),
        start: _mm256_setzero_si256(),
    }; UNITS];
    let mut acc = vec![[_mm256_setzero_ps(); 2]; ncols];
    for r0 in (0..done).step_by(8) {
        let p = w.add(r0 * stride);
        let rows: [*const u8; 8] = std::array::from_fn(|i| p.add(i * stride));
        acc.fill([_mm256_setzero_ps(); 2]);
        let (mut f_lo, mut f_hi) = (Factors::default(), Factors::default());
        for k0 in (0..units).step_by(UNITS) {
            let run = &mut buf[..UNITS.min(units - k0)];
            for (i, u) in run.iter_mut().enumerate() {
                *u = fill::<T>(&rows, k0 + i, (&mut f_lo, &mut f_hi));
            }
            let run = &*run;
            let mut c0 = 0;
            while c0 < ncols {
                let acc = &mut acc[c0..];
                match ncols - c0 {
                    1 => cols::<T, 1>(run, a, (c0, k0), acc),
                    2 => cols::<T, 2>(run, a, (c0, k0), acc),
                    3 => cols::<T, 3>(run, a, (c0, k0), acc),
                    4 => cols::<T, 4>(run, a, (c0, k0), acc),
                    5 => cols::<T, 5>(run, a, (c0, k0), acc),
                    6 => cols::<T, 6>(run, a, (c0, k0), acc),
                    7 => cols::<T, 7>(run, a, (c0, k0), acc),
                    _ => cols::<T, NC_MAX>(run, a, (c0, k0), acc),
                }
                c0 += NC_MAX;
            }
        }
        for (c, [v, offs]) in acc.iter().enumerate() {
            let mut res = [0f32; 8];
            _mm256_storeu_ps(res.as_mut_ptr(), _mm256_add_ps(*v, *offs));
            for (i, x) in res.into_iter().enumerate() {
                out[(r0 + i) * ncols + c] = x;
            }
        }
    }
    done
}

/// Unit `k` of the eight rows at `rows` (the factors of super-block types in `f`, rows
/// 0..4 and 4..8, refilled when `k % 8 == 0`), unpacked as [`Unit8`] holds it.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn fill<const T: u8>(
    rows: &[*const u8; 8],
    k: usize,
    (f_lo, f_hi): (&mut Factors, &mut Factors),
) -> Unit8 {
    let lo = [rows[0], rows[1], rows[2], rows[3]];
    let hi = [rows[4], rows[5], rows[6], rows[7]];
    let (q_lo, d_lo, m_lo) = unit::<T>(lo, k, f_lo);
    let (q_hi, d_hi, m_hi) = unit::<T>(hi, k, f_hi);
    let q = transpose8([
        q_lo[0], q_lo[1], q_lo[2], q_lo[3], q_hi[0], q_hi[1], q_hi[2], q_hi[3],
    ]);
    let start = match signed(T) {
        true => {
            // -128 times each row's quants summed: the activations come plus 128
            let h = _mm256_set1_epi8(i8::MIN);
            let mut s = _mm256_setzero_si256();
            for g in q {
                s = _mm256_dpbusd_epi32(s, h, g);
            }
            _mm256_sub_epi32(_mm256_setzero_si256(), s)
        }
        false => _mm256_setzero_si256(),
    };
    Unit8 {
        q,
        d: _mm256_set_m128(d_hi, d_lo),
        m: _mm256_set_m128(m_hi, m_lo),
        start,
    }
}

/// The quants of eight rows (one register each) regrouped: register `g` holds, in lane
/// `r`, the 4-byte group `g` of row `r` (an 8x8 transpose of 32-bit lanes).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn transpose8(q: [__m256i; 8]) -> [__m256i; 8] {
    // rows 0..4 and 4..8 by the four-row tile's transpose (groups g and g + 4 of each
    // in the low and high halves), then the halves of the two put side by side
    let lo = transpose([q[0], q[1], q[2], q[3]]);
    let hi = transpose([q[4], q[5], q[6], q[7]]);
    [
        _mm256_permute2x128_si256::<0x20>(lo[0], hi[0]),
        _mm256_permute2x128_si256::<0x20>(lo[1], hi[1]),
        _mm256_permute2x128_si256::<0x20>(lo[2], hi[2]),
        _mm256_permute2x128_si256::<0x20>(lo[3], hi[3]),
        _mm256_permute2x128_si256::<0x31>(lo[0], hi[0]),
        _mm256_permute2x128_si256::<0x31>(lo[1], hi[1]),
        _mm256_permute2x128_si256::<0x31>(lo[2], hi[2]),
        _mm256_permute2x128_si256::<0x31>(lo[3], hi[3]),
    ]
}

/// The units of `run` (units `k0..` of the rows) against `NC` columns from `c0` of `a`,
/// added into `acc` (per column: the scaled sums and the offset terms, a lane a row).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn cols<const T: u8, const NC: usize>(
    run: &[Unit8],
    a: Acts,
    (c0, k0): (usize, usize),
    acc: &mut [[__m256; 2]],
) {
    let blocks = a.cols.row / Q8;
    let mut v: [__m256; NC] = std::array::from_fn(|c| acc[c][0]);
    let mut offs: [__m256; NC] = std::array::from_fn(|c| acc[c][1]);
    for (i, u) in run.iter().enumerate() {
        let at: [usize; NC] = std::array::from_fn(|c| (c0 + c) * blocks + k0 + i);
        let aq: [*const i32; NC] = std::array::from_fn(|c| a.quants::<T>(at[c]));
        // the columns' chains side by side, so that no column waits on its own sums
        let mut s = [u.start; NC];
        for (g, &wq) in u.q.iter().enumerate() {
            for c in 0..NC {
                let x = _mm256_set1_epi32(aq[c].add(g).read_unaligned());
                s[c] = match signed(T) {
                    true => _mm256_dpbusd_epi32(s[c], x, wq),
                    false => _mm256_dpbusd_epi32(s[c], wq, x),
                };
            }
        }
        for c in 0..NC {
            let (d8, s8) = (*a.cols.ds.add(2 * at[c]), *a.cols.ds.add(2 * at[c] + 1));
            let scale = _mm256_mul_ps(u.d, _mm256_set1_ps(d8));
            v[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[c]), scale, v[c]);
            if has_offset(T) {
                offs[c] = _mm256_fmadd_ps(u.m, _mm256_set1_ps(s8), offs[c]);
            }
        }
    }
    for c in 0..NC {
        acc[c] = [v[c], offs[c]];
    }
}
