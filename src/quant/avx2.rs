//! AVX2 kernels of [`super::vec_dot_q8_1_cols`]: one quantized weight row against one to
//! four activation columns quantized to Q8_1, with `std::arch` intrinsics.
//!
//! Each weight block is unpacked once into 32 unsigned quants (one `__m256i`), then, for
//! every column, multiplied by the column's 32 signed Q8_1 quants with `vpmaddubsw`
//! (pairs summed into i16; no pair can saturate: at most `2 * 63 * 128`) and `vpmaddwd`
//! (pairs of i16 summed into i32, or weighted by a sub-block scale), converted to f32
//! and accumulated with the block's scales in eight f32 lanes. Offsets (Q4_0's `-8`,
//! Q5_0's `-16`, Q4_1/Q5_1's `m`, the K-quants' mins) are applied per block through the
//! Q8_1 block's `s = d * sum(q)` field, as in the portable [`super::dot`] code; Q6_K's
//! `-32` (per 16-element scale group, finer than `s`) is taken off in i16 by subtracting
//! `32 * a` pair sums. Q8_0/Q8_1 weights are signed, so they use the sign trick:
//! `|w| * (a * sign(w))`.
//!
//! The integer sums are those of the portable code, exactly; only the order in which the
//! f32 terms are added differs (eight lanes per column, summed at the end).
//!
//! [`dot_rows`] with several columns runs the legacy types, Q4_K, Q5_K and IQ4_XS eight
//! rows at a time where the CPU has AVX-512 VNNI (`tile8`), else and for the rows after
//! the last eight four at a time (`tile`: the rows' sums in the lanes of one vector); the
//! decode step (one column) runs the legacy types through [`legacy_x4`], the other types
//! row by row. Activations are quantized to Q8_1 by `q8_1`.
//!
//! On CPUs with AVX-512 VNNI (and VL), those two kernels sum the products of unsigned
//! quants and signed activations with `vpdpbusd` ([`dpbusd`]: four byte products added
//! into each i32 lane, no i16 step) instead of `vpmaddubsw` + `vpmaddwd`; the const
//! parameter `V` of the kernels says which ([`vnni_available`]); those kernels run inside
//! functions compiled for AVX-512, which also gives them 32 vector registers.

use std::arch::x86_64::*;

mod low;
pub(super) mod q8_1;
pub(super) mod rows8;
mod tile;
mod tile8;

use super::dot::Results;
use super::iq_tables::KVALUES_IQ4NL;
use super::kquants::scale_min_k4;
use super::panel::Packing;
use super::QType;

/// Bytes of a Q8_1 block.
const Q8: usize = 36;

/// Column counts from which kernels use one accumulator set (see [`Acc`]).
const SPLIT_BELOW: usize = 3;

/// Whether this CPU runs the AVX2 + FMA + F16C kernels, these and `ops::simd`'s (std
/// caches the detection).
#[inline]
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Whether this CPU runs `vpdpbusd` on 256-bit registers and the other AVX-512 features
/// the kernels of `V = true` are compiled for (F, VL, BW, VNNI).
#[inline]
pub(crate) fn vnni_available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
}

/// How [`dot_rows`] with `ncols` columns of weights of `q` reads the columns packed
/// eight at a time (for the 16-row kernel, `tile8`), or `None` where it reads none.
pub(crate) fn packing(q: QType, ncols: usize) -> Option<Packing> {
    match ncols >= tile8::FROM_COLS && vnni_available() {
        true => tile8::packing(q),
        false => None,
    }
}

/// `acc` plus, in each i32 lane, the four products of the unsigned bytes of `u` with the
/// signed bytes of `s` in that lane: `vpdpbusd` when `V`, else `vpmaddubsw` (pairs in
/// i16, exact while no pair passes `i16::MAX`, as every caller's quants ensure) and
/// `vpmaddwd`. Both give the same sums.
///
/// # Safety
/// The CPU has AVX2, and AVX-512 VNNI and VL when `V` ([`vnni_available`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dpbusd<const V: bool>(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    if !V {
        let pairs = _mm256_maddubs_epi16(u, s);
        return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
    // SAFETY: the CPU has AVX-512 VNNI and VL (caller).
    unsafe { vpdpbusd(acc, u, s) }
}

/// `vpdpbusd` on 256-bit registers. Its callers are inlined into functions compiled for
/// AVX-512 F, VL, BW and VNNI, where this is inlined in turn.
///
/// # Safety
/// The CPU has AVX-512 F, VL, BW and VNNI ([`vnni_available`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
#[inline]
unsafe fn vpdpbusd(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

/// `out[c]` = the dot product of the weight row `w` (blocks of `q`) with the Q8_1 row
/// `a[c * row..(c + 1) * row]`, `row = a.len() / out.len()`; `ds` holds the `d` and `s`
/// of every Q8_1 block of `a`, in order, as f32 (see [`super::dot::q8_1_scales`]).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C ([`available`]); `w` is whole blocks of `q`, `a` holds
/// `out.len()` Q8_1 rows of one block per 32 weights of `w` and `ds` two floats per
/// block of `a` (checked by the caller).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_cols(q: QType, w: &[u8], a: &[u8], ds: &[f32], out: &mut [f32]) {
    let n = out.len();
    if n == 0 {
        return;
    }
    let row = a.len() / n;
    let cols = |c: usize| Cols {
        q: a[c * row..].as_ptr(),
        ds: ds[c * row / Q8 * 2..].as_ptr(),
        row,
    };
    let mut c = 0;
    while c + 4 <= n {
        run::<4>(q, w, cols(c), &mut out[c..c + 4]);
        c += 4;
    }
    let rest = &mut out[c..];
    match rest.len() {
        3 => run::<3>(q, w, cols(c), rest),
        2 => run::<2>(q, w, cols(c), rest),
        1 => run::<1>(q, w, cols(c), rest),
        _ => {}
    }
}

/// Row `r` and column `c` of `out` = the dot product of weight row `r` (at
/// `w + r * w_stride`, `nb` blocks of `q`) with column `c` of `a` (`ncols` Q8_1 rows,
/// scales in `ds`), for `r` in `0..nrows`: columns in groups of four, each group against
/// every row, so that a group's activations stay in the L1 cache. `vnni`: the kernels
/// that have a `vpdpbusd` form use it ([`dpbusd`]), sixteen rows at a time take every
/// column first (`tile8`, where `panels` holds the columns packed as [`packing`] says),
/// and the four-row tiles take groups of [`tile::WIDE_COLS`] columns.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and AVX-512 VNNI and VL if `vnni`
/// ([`vnni_available`]); every weight row is `nb` whole blocks of valid memory;
/// `a` holds `ncols` Q8_1 rows of `nb * q.block_size() / 32` blocks, `ds` two floats per
/// block of `a`, and `out` `nrows` rows of `ncols` results (checked by the caller).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows(
    q: QType,
    (w, w_stride, nb): (*const u8, usize, usize),
    (a, panels): (&[u8], &[u8]),
    ds: &[f32],
    (nrows, ncols, vnni): (usize, usize, bool),
    out: Results,
) {
    if ncols == 0 {
        return;
    }
    let row = a.len() / ncols;
    // sixteen rows at a time against every column first, where the CPU allows
    let done = match vnni && ncols >= tile8::FROM_COLS {
        // SAFETY: vnni_available() (dot_rows' contract); the rows, columns and results
        // are as tile8::rows requires (checked by the caller).
        true => unsafe { tile8::rows(q, (w, w_stride, nb), (nrows, ncols), panels, out) },
        false => 0,
    };
    let (w, out, nrows) = (w.add(done * w_stride), out.from(done, 0), nrows - done);
    if nrows == 0 {
        return;
    }
    let group = match vnni && tile::has_tiles(q) {
        true => tile::WIDE_COLS,
        false => 4,
    };
    let mut c0 = 0;
    while c0 < ncols {
        let cols = Cols {
            q: a[c0 * row..].as_ptr(),
            ds: ds[c0 * row / Q8 * 2..].as_ptr(),
            row,
        };
        let rows = Rows {
            w,
            w_stride,
            nb,
            nrows,
            c0,
        };
        match ((ncols - c0).min(group), vnni) {
            (1, false) => rows.run::<1, false>(q, cols, out),
            (2, false) => rows.run::<2, false>(q, cols, out),
            (3, false) => rows.run::<3, false>(q, cols, out),
            (_, false) => rows.run::<4, false>(q, cols, out),
            (1, true) => rows.run::<1, true>(q, cols, out),
            (2, true) => rows.run::<2, true>(q, cols, out),
            (3, true) => rows.run::<3, true>(q, cols, out),
            (4, true) => rows.run::<4, true>(q, cols, out),
            (5, true) => rows.run::<5, true>(q, cols, out),
            (6, true) => rows.run::<6, true>(q, cols, out),
            (7, true) => rows.run::<7, true>(q, cols, out),
            (_, true) => rows.run::<8, true>(q, cols, out),
        }
        c0 += group;
    }
}

/// The weight rows of [`dot_rows`] and where a column group's results go.
struct Rows {
    w: *const u8,
    w_stride: usize,
    nb: usize,
    nrows: usize,
    c0: usize,
}

impl Rows {
    /// Every row against the `NC` columns of `a` (`V`: with `vpdpbusd`, see [`dpbusd`]).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn run<const NC: usize, const V: bool>(&self, q: QType, a: Cols, out: Results) {
        if NC == 1 {
            let done = match V {
                // SAFETY: V is chosen only where vnni_available() (dot_rows' contract).
                true => unsafe { self.one_column_wide(q, a, out) },
                false => self.legacy_column::<false>(q, a, out),
            };
            if done {
                return;
            }
        }
        // legacy types: four rows at a time, then the rows left
        let out = out.from(0, self.c0);
        let done = tile::rows::<NC, V>(q, (self.w, self.w_stride, self.nb), self.nrows, a, out);
        for r in done..self.nrows {
            let v: [f32; NC] = row::<NC>(q, self.w.add(r * self.w_stride), self.nb, a);
            for (c, x) in v.into_iter().enumerate() {
                out.set(r, c, x);
            }
        }
    }
}

impl Rows {
    /// [`Rows::legacy_column`] by `vpdpbusd`, compiled for AVX-512.
    ///
    /// # Safety
    /// As [`dot_rows`] with `vnni`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
    unsafe fn one_column_wide(&self, q: QType, a: Cols, out: Results) -> bool {
        self.legacy_column::<true>(q, a, out)
    }

    /// [`Rows::one_column`] for a legacy type `q`, and whether `q` is one (else nothing
    /// is done).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn legacy_column<const V: bool>(&self, q: QType, a: Cols, out: Results) -> bool {
        match q {
            QType::Q4_0 => self.one_column::<Q4_0, V>(a, out),
            QType::Q4_1 => self.one_column::<Q4_1, V>(a, out),
            QType::Q5_0 => self.one_column::<Q5_0, V>(a, out),
            QType::Q5_1 => self.one_column::<Q5_1, V>(a, out),
            QType::Q8_0 => self.one_column::<Q8_0, V>(a, out),
            QType::Q8_1 => self.one_column::<Q8_1, V>(a, out),
            QType::IQ4_NL => self.one_column::<IQ4_NL, V>(a, out),
            QType::Q4_K
            | QType::Q5_K
            | QType::Q6_K
            | QType::Q2_K
            | QType::Q3_K
            | QType::IQ4_XS
            | QType::IQ2_XXS
            | QType::IQ2_XS
            | QType::IQ2_S
            | QType::IQ3_XXS
            | QType::IQ3_S
            | QType::IQ1_S
            | QType::IQ1_M
            | QType::TQ1_0
            | QType::TQ2_0 => return false,
        }
        true
    }

    /// Every row of a legacy type against the one column of `a` (a decode step's
    /// matrix-vector product): four rows at a time through [`legacy_x4`], the rest one by
    /// one.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn one_column<const T: u8, const V: bool>(&self, a: Cols, out: Results) {
        let mut r = 0;
        while r + 4 <= self.nrows {
            let v = legacy_x4::<T, V>(self.w.add(r * self.w_stride), self.w_stride, self.nb, a);
            for (k, x) in v.into_iter().enumerate() {
                out.set(r + k, self.c0, x);
            }
            r += 4;
        }
        for r in r..self.nrows {
            let [x] = legacy::<T, 1>(self.w.add(r * self.w_stride), self.nb, a);
            out.set(r, self.c0, x);
        }
    }
}

/// Q8_1 activation columns: their blocks (`row` bytes per column) and the blocks' `d`
/// and `s` as f32 pairs (`row / 36 * 2` floats per column).
#[derive(Clone, Copy)]
pub(crate) struct Cols {
    q: *const u8,
    ds: *const f32,
    row: usize,
}

impl Cols {
    /// The 32 quants, `d` and `s` of Q8_1 block `blk` of column `c`.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn block(&self, c: usize, blk: usize) -> (__m256i, f32, f32) {
        // (row / Q8 is the same for every call: computed once out of the callers' loops)
        let at = c * (self.row / Q8) + blk;
        let qv = _mm256_loadu_si256(self.q.add(at * Q8 + 4) as *const __m256i);
        (qv, *self.ds.add(2 * at), *self.ds.add(2 * at + 1))
    }
}

// The legacy block types, as const parameters.
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;
const Q8_1: u8 = 5;
const IQ4_NL: u8 = 6;

/// `NC` columns of `a` against the weight row `w`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn run<const NC: usize>(q: QType, w: &[u8], a: Cols, out: &mut [f32]) {
    let nb = w.len() / q.block_bytes();
    out.copy_from_slice(&row::<NC>(q, w.as_ptr(), nb, a));
}

/// One weight row of `nb` blocks of `q` at `w` against `NC` Q8_1 columns: the type's
/// kernel (Q2_K, Q3_K and IQ4_XS in [`low`]), or for the types without one (the lattice
/// i-quants and the ternary types, a small share of what models store) the portable code
/// column by column.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row<const NC: usize>(q: QType, w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    match q {
        QType::Q4_0 => legacy::<Q4_0, NC>(w, nb, a),
        QType::Q4_1 => legacy::<Q4_1, NC>(w, nb, a),
        QType::Q5_0 => legacy::<Q5_0, NC>(w, nb, a),
        QType::Q5_1 => legacy::<Q5_1, NC>(w, nb, a),
        QType::Q8_0 => legacy::<Q8_0, NC>(w, nb, a),
        QType::Q8_1 => legacy::<Q8_1, NC>(w, nb, a),
        QType::Q4_K => k4::<false, NC>(w, nb, a),
        QType::Q5_K => k4::<true, NC>(w, nb, a),
        QType::Q6_K => q6_k::<NC>(w, nb, a),
        QType::IQ4_NL => legacy::<IQ4_NL, NC>(w, nb, a),
        QType::Q2_K => low::q2_k::<NC>(w, nb, a),
        QType::Q3_K => low::q3_k::<NC>(w, nb, a),
        QType::IQ4_XS => low::iq4_xs::<NC>(w, nb, a),
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M
        | QType::TQ1_0
        | QType::TQ2_0 => portable::<NC>(q, w, nb, a),
    }
}

/// [`row`] by the portable code ([`super::dot::vec_dot_q8_1_cols_portable`]), one column
/// at a time.
#[inline]
unsafe fn portable<const NC: usize>(q: QType, w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    // SAFETY: the row is nb whole blocks of valid memory (callers).
    let w = unsafe { std::slice::from_raw_parts(w, nb * q.block_bytes()) };
    let mut out = [0.0f32; NC];
    for (c, o) in out.iter_mut().enumerate() {
        // SAFETY: column c's Q8_1 blocks are the a.row bytes at a.q + c * a.row (Cols).
        let col = unsafe { std::slice::from_raw_parts(a.q.add(c * a.row), a.row) };
        super::dot::vec_dot_q8_1_cols_portable(q, w, col, std::slice::from_mut(o));
    }
    out
}

/// The two little-endian f16 at `p` as f32 (a 4-byte load into a zeroed register: no
/// dependency on an older register's contents).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16x2(p: *const u8) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// Per-column accumulators: eight f32 lanes of scaled integer sums, and a scalar for
/// the offset terms. With fewer than [`SPLIT_BELOW`] columns kernels keep two sets and
/// alternate between them block by block, so that consecutive blocks do not wait on each
/// other's additions; with more, the columns are independent enough, and a second set
/// would not fit the 16 vector registers.
#[derive(Clone, Copy)]
struct Acc<const NC: usize> {
    v: [__m256; NC],
    offs: [f32; NC],
}

impl<const NC: usize> Acc<NC> {
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn new() -> Self {
        Self {
            v: [_mm256_setzero_ps(); NC],
            offs: [0.0; NC],
        }
    }

    /// `acc[c] += scale * sumi` (sumi: eight i32 partial sums).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn add(&mut self, c: usize, scale: f32, sumi: __m256i) {
        self.v[c] = _mm256_fmadd_ps(_mm256_set1_ps(scale), _mm256_cvtepi32_ps(sumi), self.v[c]);
    }

    /// The totals of two sets of accumulators.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn sum(self, other: Self) -> [f32; NC] {
        let mut r = [0.0f32; NC];
        for (c, t) in r.iter_mut().enumerate() {
            *t = hsum(_mm256_add_ps(self.v[c], other.v[c])) + (self.offs[c] + other.offs[c]);
        }
        r
    }
}

/// The sum of the eight lanes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// A weight per 16-element half: `lo` for the low 128-bit lane, `hi` for the high one.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn halves(lo: i16, hi: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo))
}

/// The 32 quants of 16 packed bytes at `p`: low nibbles (elements 0..16), then high.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let qs = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(qs, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m);
    _mm256_set_m128i(hi, lo)
}

/// The IQ4_NL levels (signed) of 32 indices 0..16, one a byte.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn iq4_levels(idx: __m256i) -> __m256i {
    let table = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
    _mm256_shuffle_epi8(_mm256_set_m128i(table, table), idx)
}

/// Byte `i` = 0x10 where bit `i` of `qh` is set, else 0 (the fifth bit of Q5_0/Q5_1).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fifth_bits(qh: u32) -> __m256i {
    let v = _mm256_set1_epi32(qh as i32);
    // Byte i takes byte i / 8 of qh (each 128-bit lane holds all four).
    let spread = _mm256_shuffle_epi8(
        v,
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Block bytes of a legacy type.
const fn legacy_bytes(t: u8) -> usize {
    match t {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        Q8_0 => 34,
        IQ4_NL => 18,
        _ => 36,
    }
}

/// One legacy weight block at `p` (IQ4_NL is one too: Q4_0's layout with its nibbles
/// indexing 16 levels): its 32 quants (unsigned for the 4/5-bit types, signed for
/// Q8_0/Q8_1 and IQ4_NL's levels), its scale `d`, and the factor of the Q8_1 block's `s`
/// in the block's dot product (`-8 d`, `-16 d`, `m`; unused for the signed types). Every
/// block is at least 4 bytes past its `d`, so the scales are read 4 bytes at a time.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn legacy_block<const T: u8>(p: *const u8) -> (__m256i, f32, f32) {
    let (d, m) = f16x2(p);
    match T {
        Q4_0 => (nibbles(p.add(2)), d, -8.0 * d),
        Q4_1 => (nibbles(p.add(4)), d, m),
        Q5_0 => {
            let qh = (p.add(2) as *const u32).read_unaligned();
            let q = _mm256_or_si256(nibbles(p.add(6)), fifth_bits(qh));
            (q, d, -16.0 * d)
        }
        Q5_1 => {
            let qh = (p.add(4) as *const u32).read_unaligned();
            let q = _mm256_or_si256(nibbles(p.add(8)), fifth_bits(qh));
            (q, d, m)
        }
        Q8_0 => (_mm256_loadu_si256(p.add(2) as *const __m256i), d, 0.0),
        IQ4_NL => (iq4_levels(nibbles(p.add(2))), d, 0.0),
        _ => (_mm256_loadu_si256(p.add(4) as *const __m256i), d, 0.0),
    }
}

/// Legacy weight block `b` of the row at `w` against `NC` columns, into `acc`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn legacy_step<const T: u8, const NC: usize>(
    w: *const u8,
    b: usize,
    a: Cols,
    acc: &mut Acc<NC>,
) {
    let signed = T == Q8_0 || T == Q8_1 || T == IQ4_NL;
    let ones = _mm256_set1_epi16(1);
    let (q, d, m) = legacy_block::<T>(w.add(b * legacy_bytes(T)));
    let qa = if signed { _mm256_sign_epi8(q, q) } else { q };
    for c in 0..NC {
        let (mut av, d8, s8) = a.block(c, b);
        if signed {
            av = _mm256_sign_epi8(av, q);
        }
        acc.add(
            c,
            d * d8,
            _mm256_madd_epi16(_mm256_maddubs_epi16(qa, av), ones),
        );
        if !signed {
            acc.offs[c] += m * s8;
        }
    }
}

/// One legacy weight row of `nb` blocks at `w` against `NC` Q8_1 columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn legacy<const T: u8, const NC: usize>(w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    let (mut even, mut odd) = (Acc::<NC>::new(), Acc::<NC>::new());
    if NC >= SPLIT_BELOW {
        for b in 0..nb {
            legacy_step::<T, NC>(w, b, a, &mut even);
        }
        return even.sum(odd);
    }
    let mut b = 0;
    while b + 2 <= nb {
        legacy_step::<T, NC>(w, b, a, &mut even);
        legacy_step::<T, NC>(w, b + 1, a, &mut odd);
        b += 2;
    }
    if b < nb {
        legacy_step::<T, NC>(w, b, a, &mut even);
    }
    even.sum(odd)
}

/// The f16 `d` at `p` in the low half of an i32, and in the high half the f16 after it
/// (`m`) when `with_m`, else 0 (a finite f16 0.0, never a field that is not a scale).
#[inline(always)]
unsafe fn scale_bits(p: *const u8, with_m: bool) -> i32 {
    match with_m {
        true => (p as *const i32).read_unaligned(),
        false => i32::from((p as *const u16).read_unaligned()),
    }
}

/// Four legacy weight rows (`stride` bytes apart, `nb` blocks each, the first at `w`)
/// against one Q8_1 column: the decode step's kernel. Each activation block is loaded
/// once for the four rows; the rows' scales are converted four at a time, and their
/// offset terms (`m * s8`, `-8 d * s8`, `-16 d * s8`) summed in one vector, so no scalar
/// chain runs through the row; the four totals come out of one horizontal reduction.
/// The integer sums are those of [`legacy`] (`V`: by `vpdpbusd`); only the order of the f32
/// additions differs.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn legacy_x4<const T: u8, const V: bool>(
    w: *const u8,
    stride: usize,
    nb: usize,
    a: Cols,
) -> [f32; 4] {
    let signed = T == Q8_0 || T == Q8_1 || T == IQ4_NL;
    let has_m = T == Q4_1 || T == Q5_1;
    let bytes = legacy_bytes(T);
    let rows = [w, w.add(stride), w.add(2 * stride), w.add(3 * stride)];
    let mut acc = [_mm256_setzero_ps(); 4];
    // Lanes 0..4: sum of d_r * s8 (times -8 or -16 at the end); lanes 4..8: sum of m_r * s8.
    let mut offs = _mm256_setzero_ps();
    // Interleaved (d, m) pairs of the four rows into d0..d3, m0..m3.
    let split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    // Four rows are four short streams, too short for the hardware prefetcher to learn:
    // the cache lines of the next four rows are fetched ahead, spread over this loop.
    // (A prefetch past the matrix is harmless: it never faults, hence wrapping_add.)
    let next = w.wrapping_add(12 * stride);
    let lines = (4 * stride).div_ceil(64);
    let per_block = lines.div_ceil(nb.max(1));
    for b in 0..nb {
        let at = b * bytes;
        for l in b * per_block..((b + 1) * per_block).min(lines) {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * l) as *const i8);
        }
        let (av, d8, s8) = a.block(0, b);
        let bits = _mm_setr_epi32(
            scale_bits(rows[0].add(at), has_m),
            scale_bits(rows[1].add(at), has_m),
            scale_bits(rows[2].add(at), has_m),
            scale_bits(rows[3].add(at), has_m),
        );
        let dm = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(bits), split);
        if !signed {
            offs = _mm256_fmadd_ps(dm, _mm256_set1_ps(s8), offs);
        }
        let scales = _mm256_mul_ps(dm, _mm256_set1_ps(d8));
        for (r, acc) in acc.iter_mut().enumerate() {
            let (q, _, _) = legacy_block::<T>(rows[r].add(at));
            let (qa, av) = match signed {
                true => (_mm256_sign_epi8(q, q), _mm256_sign_epi8(av, q)),
                false => (q, av),
            };
            let sumi = dpbusd::<V>(_mm256_setzero_si256(), qa, av);
            let scale = _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(r as i32));
            *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(sumi), *acc);
        }
    }
    // Row r's total is the sum of acc[r]'s eight lanes.
    let s01 = _mm256_hadd_ps(acc[0], acc[1]);
    let s23 = _mm256_hadd_ps(acc[2], acc[3]);
    let s = _mm256_hadd_ps(s01, s23);
    let mut total = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let (d_offs, m_offs) = (
        _mm256_castps256_ps128(offs),
        _mm256_extractf128_ps::<1>(offs),
    );
    total = match T {
        Q4_0 => _mm_fmadd_ps(_mm_set1_ps(-8.0), d_offs, total),
        Q5_0 => _mm_fmadd_ps(_mm_set1_ps(-16.0), d_offs, total),
        Q4_1 | Q5_1 => _mm_add_ps(total, m_offs),
        _ => total,
    };
    let mut out = [0.0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), total);
    out
}

/// Sub-block `j` of the Q4_K (`FIVE = false`) or Q5_K super-block `b` at `wb` against
/// `NC` columns, into `acc`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn k4_step<const FIVE: bool, const NC: usize>(
    wb: *const u8,
    b: usize,
    j: usize,
    (d, dmin, qh): (f32, f32, __m256i),
    a: Cols,
    acc: &mut Acc<NC>,
) {
    let low = _mm256_set1_epi8(0x0f);
    let scales = std::slice::from_raw_parts(wb.add(4), 12);
    let qs = wb.add(if FIVE { 48 } else { 16 });
    let (sc, m) = scale_min_k4(j, scales);
    let raw = _mm256_loadu_si256(qs.add(32 * (j / 2)) as *const __m256i);
    let mut q = if j.is_multiple_of(2) {
        _mm256_and_si256(raw, low)
    } else {
        _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low)
    };
    if FIVE {
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    let scv = _mm256_set1_epi16(i16::from(sc));
    let mf = dmin * f32::from(m);
    for c in 0..NC {
        let (av, d8, s8) = a.block(c, 8 * b + j);
        acc.add(
            c,
            d * d8,
            _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), scv),
        );
        acc.offs[c] -= mf * s8;
    }
}

/// One Q4_K (`FIVE = false`) or Q5_K row of `nb` super-blocks at `w` against `NC` Q8_1
/// columns (8 Q8_1 blocks per super-block).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn k4<const FIVE: bool, const NC: usize>(w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    let bytes = if FIVE { 176 } else { 144 };
    let (mut even, mut odd) = (Acc::<NC>::new(), Acc::<NC>::new());
    for b in 0..nb {
        let wb = w.add(b * bytes);
        let (d, dmin) = f16x2(wb);
        let qh = if FIVE {
            _mm256_loadu_si256(wb.add(16) as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        for j in (0..8).step_by(2) {
            k4_step::<FIVE, NC>(wb, b, j, (d, dmin, qh), a, &mut even);
            let other = if NC >= SPLIT_BELOW {
                &mut even
            } else {
                &mut odd
            };
            k4_step::<FIVE, NC>(wb, b, j + 1, (d, dmin, qh), a, other);
        }
    }
    even.sum(odd)
}

/// The 2-bit field `t` (bits `2t..2t + 2`) of every byte of `qh`, moved to bits 4..6.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_high(qh: __m256i, t: usize) -> __m256i {
    let three = _mm256_set1_epi8(3);
    let f = match t {
        0 => qh,
        1 => _mm256_srli_epi16::<2>(qh),
        2 => _mm256_srli_epi16::<4>(qh),
        _ => _mm256_srli_epi16::<6>(qh),
    };
    // Each byte holds 0..=3 after the mask, so the 16-bit shift stays inside its byte.
    _mm256_slli_epi16::<4>(_mm256_and_si256(f, three))
}

/// Quarter `t` (elements `128h + 32t..`) of half `h` of the Q6_K super-block `b` at
/// `wb` (scale `d`) against `NC` columns, into `acc`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k_step<const NC: usize>(
    wb: *const u8,
    b: usize,
    (h, t): (usize, usize),
    d: f32,
    a: Cols,
    acc: &mut Acc<NC>,
) {
    let low = _mm256_set1_epi8(0x0f);
    let m32 = _mm256_set1_epi8(32);
    // ql[64h..] low nibbles (t = 0), ql[64h + 32..] low (t = 1), then their high ones.
    let ql = _mm256_loadu_si256(wb.add(64 * h + 32 * (t % 2)) as *const __m256i);
    let qh = _mm256_loadu_si256(wb.add(128 + 32 * h) as *const __m256i);
    let lo = if t < 2 {
        _mm256_and_si256(ql, low)
    } else {
        _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low)
    };
    let q = _mm256_or_si256(lo, q6_high(qh, t));
    let j = 4 * h + t;
    let scales = wb.add(192) as *const i8;
    let scv = halves(
        i16::from(*scales.add(2 * j)),
        i16::from(*scales.add(2 * j + 1)),
    );
    for c in 0..NC {
        let (av, d8, _) = a.block(c, 8 * b + j);
        // (q - 32) * a summed in pairs, in i16: |sum| <= 2 * 32 * 128.
        let p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, av), _mm256_maddubs_epi16(m32, av));
        acc.add(c, d * d8, _mm256_madd_epi16(p, scv));
    }
}

/// One Q6_K row of `nb` super-blocks at `w` against `NC` Q8_1 columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q6_k<const NC: usize>(w: *const u8, nb: usize, a: Cols) -> [f32; NC] {
    let (mut even, mut odd) = (Acc::<NC>::new(), Acc::<NC>::new());
    for b in 0..nb {
        let wb = w.add(b * 210);
        // d is the last two bytes of the block: read 4 bytes ending there.
        let d = f16x2(wb.add(206)).1;
        for h in 0..2 {
            for t in (0..4).step_by(2) {
                q6_k_step::<NC>(wb, b, (h, t), d, a, &mut even);
                let other = if NC >= SPLIT_BELOW {
                    &mut even
                } else {
                    &mut odd
                };
                q6_k_step::<NC>(wb, b, (h, t + 1), d, a, other);
            }
        }
    }
    even.sum(odd)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::dot::{q8_1_scales, vec_dot_q8_1_cols_portable, Results};
    use super::super::{quantize_row, QType};

    /// The types with kernels here (the others run the portable code).
    const TYPES: [QType; 13] = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q8_1,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::Q2_K,
        QType::Q3_K,
        QType::IQ4_NL,
        QType::IQ4_XS,
    ];

    /// Values in `[-scale, scale)` from a small LCG (the row content does not matter,
    /// only that every quant value and sign occurs).
    fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn quantized(q: QType, x: &[f32]) -> Vec<u8> {
        let mut out = vec![0u8; q.row_bytes(x.len()).unwrap()];
        quantize_row(q, x, &mut out).unwrap();
        out
    }

    /// The intrinsics against the portable code on `cols` columns of `blocks` blocks:
    /// equal up to the order of the f32 additions.
    fn check(q: QType, blocks: usize, cols: usize, seed: u64) -> Result<(), TestCaseError> {
        if !super::available() {
            return Ok(());
        }
        let n = blocks * q.block_size();
        // Weights with a per-block offset (so the mins and the `s` terms matter) and
        // activations whose magnitude changes from block to block.
        let mut x = values(seed, n, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v += 0.3 * ((i / 32) % 3) as f32;
        }
        let w = quantized(q, &x);
        let mut a = Vec::new();
        let mut mag = 0.0f32;
        for c in 0..cols {
            let mut y = values(seed ^ ((c as u64 + 1) * 0x9e37), n, 1.0);
            for (i, v) in y.iter_mut().enumerate() {
                *v *= 1.0 + ((i / 32 + c) % 4) as f32;
            }
            mag = mag.max(y.iter().map(|v| v.abs()).sum());
            a.extend(quantized(QType::Q8_1, &y));
        }
        let mut want = vec![0.0f32; cols];
        let mut got = vec![0.0f32; cols];
        vec_dot_q8_1_cols_portable(q, &w, &a, &mut want);
        let mut ds = vec![0.0f32; a.len() / 36 * 2];
        q8_1_scales(&a, &mut ds);
        // SAFETY: available() was checked; the lengths describe `cols` rows.
        unsafe { super::dot_cols(q, &w, &a, &ds, &mut got) };
        // The weights are below 2 in magnitude: every term and partial sum is below
        // 2 * mag, and each of the ~`blocks * 9` f32 roundings is within 2^-23 of it.
        let tol = 2.0 * mag * (blocks * 9 + 8) as f32 * f32::EPSILON;
        for c in 0..cols {
            prop_assert!(
                (got[c] - want[c]).abs() <= tol,
                "{q} blocks={blocks} cols={cols} column {c}: avx2 {} vs portable {} (tol {tol:e})",
                got[c],
                want[c]
            );
        }
        Ok(())
    }

    /// [`super::dot_rows`] on `nrows` rows `pad` bytes apart beyond their length, against
    /// the portable code row by row.
    fn check_rows(q: QType, blocks: usize, nrows: usize, ncols: usize, pad: usize, seed: u64) {
        if !super::available() {
            return;
        }
        let n = blocks * q.block_size();
        let row_bytes = q.row_bytes(n).unwrap();
        let stride = row_bytes + pad;
        let mut w = vec![0u8; stride * nrows];
        for r in 0..nrows {
            let x = values(seed + r as u64, n, 1.0 + r as f32);
            w[r * stride..r * stride + row_bytes].copy_from_slice(&quantized(q, &x));
        }
        let mut a = Vec::new();
        for c in 0..ncols {
            a.extend(quantized(
                QType::Q8_1,
                &values(seed ^ (77 + c as u64), n, 2.0),
            ));
        }
        let mut ds = vec![0.0f32; a.len() / 36 * 2];
        q8_1_scales(&a, &mut ds);
        let mut panels = Vec::new();
        if let Some(how) = super::packing(q, ncols) {
            super::super::panel::pack(&a, ncols, how, &mut panels);
        }
        for (vnni, by_rows) in [
            (false, true),
            (super::vnni_available(), true),
            (super::vnni_available(), false),
        ] {
            // results row by row, or column by column (a mul_mat's result) with a gap
            // of 3 after each column, whose sentinels must stay
            let gap = if by_rows { 0 } else { 3 };
            let mut got = vec![f32::MAX; nrows * ncols + gap * ncols];
            let out = match by_rows {
                true => Results {
                    ptr: got.as_mut_ptr(),
                    row: ncols,
                    col: 1,
                },
                false => Results {
                    ptr: got.as_mut_ptr(),
                    row: 1,
                    col: nrows + gap,
                },
            };
            // SAFETY: available() was checked, and vnni_available() for vnni; the rows lie
            // in `w`; `got` holds every result.
            unsafe {
                super::dot_rows(
                    q,
                    (w.as_ptr(), stride, blocks),
                    (&a, &panels),
                    &ds,
                    (nrows, ncols, vnni),
                    out,
                )
            };
            let mut dense = vec![0f32; nrows * ncols];
            for (r, c) in (0..nrows).flat_map(|r| (0..ncols).map(move |c| (r, c))) {
                dense[r * ncols + c] = got[r * out.row + c * out.col];
            }
            if !by_rows {
                for c in 0..ncols {
                    let pad = &got[c * (nrows + gap) + nrows..(c + 1) * (nrows + gap)];
                    assert!(
                        pad.iter().all(|&x| x == f32::MAX),
                        "{q}: a write past column {c}"
                    );
                }
            }
            compare_rows(
                q,
                (&w, stride, row_bytes),
                &a,
                (nrows, ncols),
                (&dense, vnni),
            );
        }
    }

    /// The results `got` of [`check_rows`] (by the `vpdpbusd` kernels if `vnni`) against
    /// the portable code, row by row.
    fn compare_rows(
        q: QType,
        (w, stride, row_bytes): (&[u8], usize, usize),
        a: &[u8],
        (nrows, ncols): (usize, usize),
        (got, vnni): (&[f32], bool),
    ) {
        let n = row_bytes / q.block_bytes() * q.block_size();
        let blocks = row_bytes / q.block_bytes();
        for r in 0..nrows {
            let mut want = vec![0.0f32; ncols];
            vec_dot_q8_1_cols_portable(q, &w[r * stride..r * stride + row_bytes], a, &mut want);
            for c in 0..ncols {
                let (g, e) = (got[r * ncols + c], want[c]);
                // Inputs below 2 and 4 in magnitude: every partial sum is below 8 per
                // element, and each of the ~`blocks * 9` f32 roundings within 2^-23 of it.
                let tol = 8.0 * n as f32 * (blocks * 9 + 8) as f32 * f32::EPSILON;
                assert!(
                    (g - e).abs() <= tol,
                    "{q} (vnni {vnni}) row {r} of {nrows}, column {c} of {ncols}: {g} vs {e} (tol {tol:e})"
                );
            }
        }
    }

    #[test]
    fn rows_with_strides_and_odd_counts() {
        for q in TYPES {
            for (nrows, ncols) in [
                (1, 1),
                (3, 5),
                (7, 4),
                (5, 9),
                (2, 13),
                (3, 17),
                (2, 22),
                (4, 32),
                (4, 1),
                (5, 1),
                (7, 1),
                (8, 1),
                (13, 1),
                (9, 3),
                (16, 1),
                (16, 4),
                (16, 32),
                (24, 3),
                (40, 9),
            ] {
                check_rows(q, 2, nrows, ncols, 6 * nrows % 5, 7 + nrows as u64);
            }
        }
    }

    #[test]
    fn every_type_and_column_count() {
        for q in TYPES {
            for cols in 1..=9 {
                check(q, 3, cols, 42 + cols as u64).unwrap();
            }
        }
    }

    /// Rows as long as a model's (576 = 18 blocks, 1536 = 48), past every unrolled step.
    #[test]
    fn model_length_rows() {
        for q in TYPES {
            let per = q.block_size() / 32;
            for blocks in [8usize, 16, 18, 33, 48] {
                let blocks = blocks.div_ceil(per);
                for cols in [1, 2, 4, 5] {
                    check(q, blocks, cols, 1 + blocks as u64).unwrap();
                }
                check_rows(q, blocks, 3, 4, 2, 5);
                // eight-row tiles past a run of units, more columns than a register set
                check_rows(q, blocks, 17, 10, 3, 11);
                // decode: one column, four rows at a time and a remainder
                check_rows(q, blocks, 7, 1, 2, 9);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn avx2_matches_portable(t in 0usize..13, blocks in 1usize..=7, cols in 1usize..=11, seed in any::<u64>()) {
            let q = TYPES[t];
            let blocks = if q.block_size() == 256 { blocks.div_ceil(2) } else { blocks };
            check(q, blocks, cols, seed)?;
        }

        /// [`super::dot_rows`] on random row and column counts: the sixteen-row tiles (and
        /// eight rows alone after them), the four-row tiles of the legacy types (and the
        /// rows after the last whole tile), every column group.
        #[test]
        fn rows_match_portable(
            t in 0usize..13,
            blocks in 1usize..=9,
            nrows in 1usize..=26,
            ncols in 1usize..=11,
            pad in 0usize..8,
            seed in 0u64..1 << 32,
        ) {
            let q = TYPES[t];
            let blocks = if q.block_size() == 256 { blocks.div_ceil(3) } else { blocks };
            check_rows(q, blocks, nrows, ncols, pad, seed);
        }
    }
}
