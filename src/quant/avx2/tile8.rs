//! Sixteen weight rows against every Q8_1 column of a call at once, by `vpdpbusd` on
//! 512-bit registers (AVX-512 VNNI): the prefill products of the types [`super::tile`]
//! takes, where the CPU has those features.
//!
//! A run of [`UNITS`] units (blocks, or 32-element sub-blocks) of sixteen rows is unpacked
//! once into a buffer that stays in the L1 cache ([`fill`]): for each unit eight
//! registers, register `g` holding bytes `4g..4g + 4` of the unit's 32 quants of row `r`
//! in its 32-bit lane `r` (an 8x8 transpose of 32-bit lanes for each eight rows), with the
//! rows' factors of the column's `d8` and `s8`. The columns come packed eight at a time
//! ([`crate::quant::panel`]), so every column of a unit is one pointer away. Every column
//! then meets a unit with eight `vpdpbusd`, each against one 4-byte group of the column's
//! block broadcast from memory: lane `r` of the sum is row `r`'s integer sum, so one
//! conversion and one multiply-add scale all sixteen rows, with no shuffles per column and
//! no horizontal sums. Eight rows left at the end take the same path, read twice and
//! stored once.
//!
//! `vpdpbusd` multiplies unsigned bytes by signed ones. The unsigned quants (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q4_K, Q5_K) meet the signed activations directly. For the signed ones
//! (Q8_0, IQ4_NL, IQ4_XS) the activations come plus 128 ([`Packing::Plus128`]) and each
//! row's sum starts at -128 times the sum of its quants, computed when the unit is
//! unpacked. The integer sums are those of the portable code; only the order of the f32
//! additions differs.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::tile::{by_tile_type, has_offset, signed, transpose, unit, Factors};
use crate::quant::dot::Results;
use crate::quant::panel::{Packing, COL_PANEL, RUN};
use crate::quant::QType;

/// Units unpacked into the buffer at a time (11 KiB of quants and factors).
const UNITS: usize = 16;
/// Most columns a pass over the rows takes (their accumulators on the stack, 4 KiB).
const MAX_COLS: usize = 32;
/// Fewest columns of a call this kernel takes (a decode step's single column stays on
/// the row kernels).
pub(super) const FROM_COLS: usize = 2;

/// The unpacked quants of one unit of eight rows and their factors: `q[g]` lane `r` holds
/// bytes `4g..4g + 4` of row `r`'s quants; `d` scales the rows' integer sums (times the
/// column's `d8`); `m` multiplies the column's `s8`; `start` is -128 times the sum of
/// each row's quants for the signed types (zero for the others).
#[derive(Clone, Copy)]
struct Unit8 {
    q: [__m256i; 8],
    d: __m256,
    m: __m256,
    start: __m256i,
}

/// Two [`Unit8`] side by side: the first eight rows in the low halves, the next eight in
/// the high ones.
#[repr(C, align(64))]
struct Unit16 {
    q: [__m512i; 8],
    d: __m512,
    m: __m512,
    start: __m512i,
}

/// How the kernel reads the columns for weights of `q` ([`Packing::Plus128`] for the
/// signed types), or `None` for a type it does not take.
pub(super) fn packing(q: QType) -> Option<Packing> {
    by_tile_type!(q, 0, T, _units => Some(match signed(T) {
        true => Packing::Plus128,
        false => Packing::Plain,
    }), None)
}

/// Rows done by the kernel for `q` (rows `0..nrows / 8 * 8`, the others left to the
/// caller), or 0 for a type it does not take and when `panels` is empty.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C and AVX-512 F, VL, BW and VNNI; the rows (`stride` bytes
/// apart, `nb` blocks of `q` each) are valid memory; `panels` is empty or holds `ncols`
/// Q8_1 columns of one block per 32 weights of a row packed as [`packing`] says; `out`
/// holds `nrows` rows of `ncols` results.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
pub(super) unsafe fn rows(
    q: QType,
    (w, stride, nb): (*const u8, usize, usize),
    (nrows, ncols): (usize, usize),
    panels: &[u8],
    out: Results,
) -> usize {
    let m = (w, stride);
    let n = (nrows, ncols);
    if panels.is_empty() {
        return 0;
    }
    by_tile_type!(q, nb, T, units => each::<T>(m, units, n, panels.as_ptr(), out), 0)
}

/// [`rows`] for the type `T`, rows of `units` units: sixteen rows at a time against up
/// to [`MAX_COLS`] columns.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn each<const T: u8>(
    (w, stride): (*const u8, usize),
    units: usize,
    (nrows, ncols): (usize, usize),
    panels: *const u8,
    out: Results,
) -> usize {
    let done = nrows / 8 * 8;
    if done == 0 || ncols == 0 {
        return 0;
    }
    // (each unit is unpacked before it is read: no zeroing)
    let mut buf = [const { MaybeUninit::<Unit16>::uninit() }; UNITS];
    for c0 in (0..ncols).step_by(MAX_COLS) {
        let nc = MAX_COLS.min(ncols - c0);
        let x = panels.add(c0 / RUN * units * COL_PANEL);
        for r0 in (0..done).step_by(16) {
            // the last eight rows, if alone, read twice and stored once
            let rows = (w.add(r0 * stride), stride, r0 + 8 < done);
            sixteen::<T>(rows, units, (x, nc), &mut buf, out.from(r0, c0));
        }
    }
    done
}

/// Sixteen rows from `w` (`stride` bytes apart; eight, read twice, where not `two`)
/// against the first `nc` (at most [`MAX_COLS`]) packed columns at `x`, into `out`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn sixteen<const T: u8>(
    (w, stride, two): (*const u8, usize, bool),
    units: usize,
    (x, nc): (*const u8, usize),
    buf: &mut [MaybeUninit<Unit16>; UNITS],
    out: Results,
) {
    let first: [*const u8; 8] = std::array::from_fn(|i| w.add(i * stride));
    let second = match two {
        true => std::array::from_fn(|i| w.add((8 + i) * stride)),
        false => first,
    };
    let mut acc = [[_mm512_setzero_ps(); 2]; MAX_COLS];
    let mut f = [Factors::default(), Factors::default()];
    let mut g = [Factors::default(), Factors::default()];
    for k0 in (0..units).step_by(UNITS) {
        let len = UNITS.min(units - k0);
        for (i, u) in buf[..len].iter_mut().enumerate() {
            let lo = fill::<T>(&first, k0 + i, &mut f);
            let hi = fill::<T>(&second, k0 + i, &mut g);
            u.write(join(lo, hi));
        }
        // SAFETY: the first len units were written just above.
        let run = std::slice::from_raw_parts(buf.as_ptr() as *const Unit16, len);
        for c0 in (0..nc).step_by(RUN) {
            let x = x.add(c0 / RUN * units * COL_PANEL);
            let acc = &mut acc[c0..];
            match nc - c0 {
                1 => cols::<T, 1>(run, x, k0, acc),
                2 => cols::<T, 2>(run, x, k0, acc),
                3 => cols::<T, 3>(run, x, k0, acc),
                4 => cols::<T, 4>(run, x, k0, acc),
                5 => cols::<T, 5>(run, x, k0, acc),
                6 => cols::<T, 6>(run, x, k0, acc),
                7 => cols::<T, 7>(run, x, k0, acc),
                _ => cols::<T, RUN>(run, x, k0, acc),
            }
        }
    }
    let rows = if two { 16 } else { 8 };
    for (c, [v, offs]) in acc[..nc].iter().enumerate() {
        let sums = _mm512_add_ps(*v, *offs);
        let at = out.from(0, c).ptr;
        match (out.row == 1, two) {
            // a column's rows side by side (a mul_mat's result): one store
            (true, true) => _mm512_storeu_ps(at, sums),
            (true, false) => _mm256_storeu_ps(at, _mm512_castps512_ps256(sums)),
            (false, _) => {
                let mut res = [0f32; 16];
                _mm512_storeu_ps(res.as_mut_ptr(), sums);
                for (i, x) in res.into_iter().take(rows).enumerate() {
                    out.set(i, c, x);
                }
            }
        }
    }
}

/// The units of eight rows `lo` and `hi` as one [`Unit16`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn join(lo: Unit8, hi: Unit8) -> Unit16 {
    let int = |a: __m256i, b: __m256i| _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b);
    let float = |a: __m256, b: __m256| {
        let (a, b) = (_mm256_castps_pd(a), _mm256_castps_pd(b));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(a), b))
    };
    Unit16 {
        q: std::array::from_fn(|g| int(lo.q[g], hi.q[g])),
        d: float(lo.d, hi.d),
        m: float(lo.m, hi.m),
        start: int(lo.start, hi.start),
    }
}

/// Unit `k` of the eight rows at `rows` (the factors of super-block types in `f`, rows
/// 0..4 and 4..8, refilled when `k % 8 == 0`), unpacked as [`Unit8`] holds it.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn fill<const T: u8>(rows: &[*const u8; 8], k: usize, f: &mut [Factors; 2]) -> Unit8 {
    let lo = [rows[0], rows[1], rows[2], rows[3]];
    let hi = [rows[4], rows[5], rows[6], rows[7]];
    let [f_lo, f_hi] = f;
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

/// The units of `run` (units `k0..` of the rows) against the first `NC` columns of the
/// packed run at `x`, added into `acc` (per column: the scaled sums and the offset terms,
/// a lane a row).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn cols<const T: u8, const NC: usize>(
    run: &[Unit16],
    x: *const u8,
    k0: usize,
    acc: &mut [[__m512; 2]],
) {
    let mut v: [__m512; NC] = std::array::from_fn(|c| acc[c][0]);
    let mut offs: [__m512; NC] = std::array::from_fn(|c| acc[c][1]);
    for (i, u) in run.iter().enumerate() {
        let p = x.add((k0 + i) * COL_PANEL);
        let word = |at: usize| _mm512_set1_epi32((p.add(at) as *const i32).read_unaligned());
        let float = |at: usize| _mm512_set1_ps((p.add(at) as *const f32).read_unaligned());
        // the columns' chains side by side, so that no column waits on its own sums
        let mut s = [u.start; NC];
        for (g, &wq) in u.q.iter().enumerate() {
            for (c, s) in s.iter_mut().enumerate() {
                let x = word(32 * c + 4 * g);
                *s = match signed(T) {
                    true => _mm512_dpbusd_epi32(*s, x, wq),
                    false => _mm512_dpbusd_epi32(*s, wq, x),
                };
            }
        }
        for c in 0..NC {
            let scale = _mm512_mul_ps(u.d, float(256 + 4 * c));
            v[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[c]), scale, v[c]);
            if has_offset(T) {
                offs[c] = _mm512_fmadd_ps(u.m, float(288 + 4 * c), offs[c]);
            }
        }
    }
    for c in 0..NC {
        acc[c] = [v[c], offs[c]];
    }
}
