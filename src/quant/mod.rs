//! ggml-compatible quantized block formats: the block layouts, quantize and dequantize
//! of one row, and the dot products of the quantized matrix-vector product.
//!
//! A quantized row is a sequence of fixed-size blocks; each block stores `block_size()`
//! values (32, or 256 for the K-quants' super-blocks) in `block_bytes()` bytes. The byte
//! layout of every block is ggml's (`ggml-common.h`), so a block written here is read by
//! llama.cpp and the reverse. All multi-byte fields are little-endian; `f16` fields are
//! IEEE half floats, converted from f32 with round-to-nearest-even (ggml's
//! `GGML_FP32_TO_FP16`).
//!
//! # The 32-element blocks ([`legacy`])
//!
//! | type | bytes | layout | value of element `i` |
//! |------|------:|--------|----------------------|
//! | Q4_0 | 18 | `d: f16`, `qs: [u8; 16]` | `d * (q_i - 8)` |
//! | Q4_1 | 20 | `d: f16`, `m: f16`, `qs: [u8; 16]` | `d * q_i + m` |
//! | Q5_0 | 22 | `d: f16`, `qh: u32`, `qs: [u8; 16]` | `d * (q_i - 16)` |
//! | Q5_1 | 24 | `d: f16`, `m: f16`, `qh: u32`, `qs: [u8; 16]` | `d * q_i + m` |
//! | Q8_0 | 34 | `d: f16`, `qs: [i8; 32]` | `d * q_i` |
//! | Q8_1 | 36 | `d: f16`, `s: f16`, `qs: [i8; 32]` | `d * q_i` (`s = d * sum(q)`) |
//!
//! In the 4- and 5-bit types byte `j` of `qs` holds element `j` in its low nibble and
//! element `j + 16` in its high nibble; bit `i` of `qh` is the fifth bit of element `i`.
//! Quantization follows ggml's reference rules: Q4_0/Q5_0 take the value of largest
//! magnitude `max` (the first one on ties) and `d = max / -8` (`/ -16`), so that value
//! maps to quant 0 exactly, then `q = min(15, trunc(x / d + 8.5))`; Q4_1/Q5_1 use
//! `d = (max - min) / 15` (`/ 31`), `m = min`, `q = trunc((x - min) / d + 0.5)`;
//! Q8_0/Q8_1 use `d = amax / 127`, `q = round(x / d)` with halves away from zero. Q8_1 is
//! the activation format of the quantized matrix-vector product: its `s` field lets a
//! dot product apply a weight block's offset (`-8`, `m`, a K-quant min) to the whole
//! block at once.
//!
//! # The K-quants ([`kquants`]): 256-element super-blocks
//!
//! | type | bytes | layout |
//! |------|------:|--------|
//! | Q4_K | 144 | `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qs: [u8; 128]` |
//! | Q5_K | 176 | `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qh: [u8; 32]`, `qs: [u8; 128]` |
//! | Q6_K | 210 | `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16` |
//!
//! Q4_K and Q5_K split the super-block into 8 sub-blocks of 32 with a 6-bit scale `sc_j`
//! and a 6-bit min `m_j` each; element `i` of sub-block `j` is
//! `d * sc_j * q_i - dmin * m_j`. The 16 six-bit numbers are packed in `scales[12]`: for
//! `j < 4`, `sc_j` is the low 6 bits of byte `j` and `m_j` those of byte `j + 4`; for
//! `j >= 4`, the low 4 bits of `sc_j` and `m_j` are the low and high nibble of byte
//! `j + 4`, and their top 2 bits are the top 2 bits of bytes `j - 4` and `j`. The quants
//! are stored per 64 elements: 32 bytes of `qs` hold sub-block `2k` in the low nibbles and
//! `2k + 1` in the high nibbles; in Q5_K, bit `j` of `qh[l]` is the fifth bit of element
//! `l` of sub-block `j`. Scales and mins come from ggml's reference search
//! (`make_qkx2_quants`: a weighted least-squares fit of scale and min over a range of
//! trial scales), then are themselves quantized to 6 bits against `d = max_scale / 63`
//! and `dmin = max_min / 63`.
//!
//! Q6_K has 16 sub-blocks of 16 with a signed 8-bit scale each; element `i` of sub-block
//! `j` is `d * scales_j * (q_i - 32)` with a 6-bit `q_i`. Per 128 elements (`ql` advancing
//! by 64 bytes, `qh` by 32), `ql[l]` holds elements `l` and `l + 64` (low, high nibble),
//! `ql[l + 32]` elements `l + 32` and `l + 96`, and `qh[l]` the top 2 bits of elements
//! `l`, `l + 32`, `l + 64`, `l + 96` at bit offsets 0, 2, 4, 6. Its scales come from ggml's
//! `make_qx_quants` (a search over 18 trial scales around `-32 / max`, weighted by `x^2`)
//! and are quantized against `d = max_scale / -128`.
//!
//! The searches round with ggml's `nearest_int` (round half to even, through the
//! `1.5 * 2^23` float trick) and evaluate every float expression in ggml's order, without
//! fused multiply-adds, so their output is byte-identical to ggml's `quantize_row_*_ref`
//! built without FMA contraction.
//!
//! # The low-bit K-quants, the i-quants and the ternary types
//!
//! | type | block | bytes | bits/weight | module | quantize |
//! |------|------:|------:|------:|--------|----------|
//! | Q2_K | 256 | 84 | 2.625 | [`kquants23`] | ggml's reference |
//! | Q3_K | 256 | 110 | 3.4375 | [`kquants23`] | ggml's reference |
//! | IQ4_NL | 32 | 18 | 4.5 | [`iq4`] | llama-quantize's (no importance matrix) |
//! | IQ4_XS | 256 | 136 | 4.25 | [`iq4`] | llama-quantize's (no importance matrix) |
//! | IQ2_XXS, IQ2_XS, IQ2_S | 256 | 66, 74, 82 | 2.06 - 2.56 | [`iqgrid`] | read only |
//! | IQ3_XXS, IQ3_S | 256 | 98, 110 | 3.06, 3.44 | [`iqgrid`] | read only |
//! | IQ1_S, IQ1_M | 256 | 50, 56 | 1.56, 1.75 | [`iqgrid`] | read only |
//! | TQ1_0, TQ2_0 | 256 | 54, 66 | 1.69, 2.06 | [`ternary`] | ggml's reference |
//!
//! Each module documents its layouts. The lattice i-quants index fixed grids of 4 or 8
//! values whose tables (`iq_tables.rs`, and `cuda/iq_tables.cuh` for the device) are
//! generated from llama.cpp's gguf-py by `scripts/make-iq-tables.py`; ggml quantizes them
//! only with an importance matrix, so graft reads them ([`QType::can_quantize`] is false
//! and writing one is an error). For the dot products every 32 elements of these types
//! read as signed integer quants with an integer scale per 16 (`iqgrid::Sub`) times a
//! per-block factor.
//!
//! # Dot products ([`dot`])
//!
//! [`vec_dot_q8_1`] is the CPU oracle of the GPU's `__dp4a` path: one weight row against
//! activations quantized to Q8_1, integer sums per 32-element block (per 16 for Q6_K's
//! scales) in `i32`, scales and offsets applied in `f32` the way ggml-cuda's
//! `vec_dot_*_q8_1` functions combine them; [`vec_dot_q8_1_cols`] takes several
//! activation columns at once and, on x86-64 with AVX2, runs hand-written intrinsics
//! (`avx2.rs`) that unpack each weight block once for up to four columns. [`vec_dot_f32`] is the
//! dequantize-in-registers path: each block dequantized and dotted with f32 activations.
//!
//! # Adding a type
//!
//! Add the variant to [`QType`] (every `match` over it then asks for the new arms: sizes,
//! name, ggml id, [`QType::can_quantize`]), its block functions to the module of its
//! family, its arm in the dispatch of [`quantize_row`] and [`dequantize_row`] and in both
//! dot products (for a type read as `Sub`s, its sub-block reader), and its test vectors
//! to `scripts/make-quant-vectors.py`.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::available as simd_available;
pub mod dot;
pub mod iq4;
mod iq_tables;
pub mod iqgrid;
pub mod kquants;
pub mod kquants23;
pub mod legacy;
pub mod panel;
pub mod rows8;
pub mod split;
pub mod ternary;

pub use dot::{
    q8_1_scales, vec_dot_f32, vec_dot_q8_1, vec_dot_q8_1_cols, vec_dot_q8_1_cols_scaled,
};

use crate::error::{Error, Result};
use half::f16;

/// A ggml quantized block type.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    /// 32 elements, 4-bit quants, one f16 scale; 4.5 bits per weight.
    Q4_0,
    /// 32 elements, 4-bit quants, f16 scale and min; 5 bits per weight.
    Q4_1,
    /// 32 elements, 5-bit quants, one f16 scale; 5.5 bits per weight.
    Q5_0,
    /// 32 elements, 5-bit quants, f16 scale and min; 6 bits per weight.
    Q5_1,
    /// 32 elements, 8-bit quants, one f16 scale; 8.5 bits per weight.
    Q8_0,
    /// 32 elements, 8-bit quants, f16 scale and f16 `d * sum(q)`; the activation format.
    Q8_1,
    /// 256 elements, 4-bit quants, 8 sub-blocks with 6-bit scales and mins; 4.5 bits per weight.
    Q4_K,
    /// 256 elements, 5-bit quants, 8 sub-blocks with 6-bit scales and mins; 5.5 bits per weight.
    Q5_K,
    /// 256 elements, 6-bit quants, 16 sub-blocks with 8-bit scales; 6.5625 bits per weight.
    Q6_K,
    /// 256 elements, 2-bit quants, 16 sub-blocks with 4-bit scales and mins; 2.625 bits per
    /// weight.
    Q2_K,
    /// 256 elements, 3-bit quants, 16 sub-blocks with 6-bit scales; 3.4375 bits per weight.
    Q3_K,
    /// 32 elements, 4-bit indices into 16 non-linear levels, one f16 scale; 4.5 bits per
    /// weight.
    IQ4_NL,
    /// 256 elements, IQ4_NL's levels, 8 sub-blocks with 6-bit scales; 4.25 bits per weight.
    IQ4_XS,
    /// 256 elements, 8-value points of a 256-point lattice with 7-bit signs, 4-bit scales
    /// per 32; 2.0625 bits per weight (needs an importance matrix to quantize).
    IQ2_XXS,
    /// 256 elements, 8-value points of a 512-point lattice, 4-bit scales per 16; 2.3125
    /// bits per weight (needs an importance matrix to quantize).
    IQ2_XS,
    /// 256 elements, 8-value points of a 1024-point lattice with 8 sign bits, 4-bit scales
    /// per 16; 2.5625 bits per weight (needs an importance matrix to quantize).
    IQ2_S,
    /// 256 elements, 4-value points of a 256-point lattice, 4-bit scales per 32; 3.0625
    /// bits per weight (needs an importance matrix to quantize).
    IQ3_XXS,
    /// 256 elements, 4-value points of a 512-point lattice, 4-bit scales per 32; 3.4375
    /// bits per weight (needs an importance matrix to quantize).
    IQ3_S,
    /// 256 elements, 8-value ternary points of a 2048-point lattice plus a shift, 3-bit
    /// scales per 32; 1.5625 bits per weight (needs an importance matrix to quantize).
    IQ1_S,
    /// 256 elements, IQ1_S's lattice with a shift per 8 values, 3-bit scales per 16;
    /// 1.75 bits per weight (needs an importance matrix to quantize).
    IQ1_M,
    /// 256 elements, ternary values packed 5 to a byte, one f16 scale; 1.6875 bits per
    /// weight.
    TQ1_0,
    /// 256 elements, ternary values in 2 bits, one f16 scale; 2.0625 bits per weight.
    TQ2_0,
}

impl QType {
    /// Every quantized type, in ggml's numbering order.
    pub const ALL: [QType; 22] = [
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q8_0,
        QType::Q8_1,
        QType::Q2_K,
        QType::Q3_K,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
        QType::IQ2_XXS,
        QType::IQ2_XS,
        QType::IQ3_XXS,
        QType::IQ1_S,
        QType::IQ4_NL,
        QType::IQ3_S,
        QType::IQ2_S,
        QType::IQ4_XS,
        QType::IQ1_M,
        QType::TQ1_0,
        QType::TQ2_0,
    ];

    /// Elements per block: 32 for the legacy types and IQ4_NL, 256 for the others.
    pub const fn block_size(self) -> usize {
        match self {
            QType::Q4_0
            | QType::Q4_1
            | QType::Q5_0
            | QType::Q5_1
            | QType::Q8_0
            | QType::Q8_1
            | QType::IQ4_NL => 32,
            QType::Q2_K
            | QType::Q3_K
            | QType::Q4_K
            | QType::Q5_K
            | QType::Q6_K
            | QType::IQ4_XS
            | QType::IQ2_XXS
            | QType::IQ2_XS
            | QType::IQ2_S
            | QType::IQ3_XXS
            | QType::IQ3_S
            | QType::IQ1_S
            | QType::IQ1_M
            | QType::TQ1_0
            | QType::TQ2_0 => 256,
        }
    }

    /// Whether [`quantize_row`] can write the type: every type but the lattice i-quants
    /// (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), which ggml quantizes with an
    /// importance matrix only; graft reads them.
    pub const fn can_quantize(self) -> bool {
        match self {
            QType::IQ2_XXS
            | QType::IQ2_XS
            | QType::IQ2_S
            | QType::IQ3_XXS
            | QType::IQ3_S
            | QType::IQ1_S
            | QType::IQ1_M => false,
            QType::Q4_0
            | QType::Q4_1
            | QType::Q5_0
            | QType::Q5_1
            | QType::Q8_0
            | QType::Q8_1
            | QType::Q2_K
            | QType::Q3_K
            | QType::Q4_K
            | QType::Q5_K
            | QType::Q6_K
            | QType::IQ4_NL
            | QType::IQ4_XS
            | QType::TQ1_0
            | QType::TQ2_0 => true,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub const fn block_bytes(self) -> usize {
        match self {
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q8_0 => 34,
            QType::Q8_1 => 36,
            QType::Q4_K => 144,
            QType::Q5_K => 176,
            QType::Q6_K => 210,
            QType::Q2_K => 84,
            QType::Q3_K => 110,
            QType::IQ4_NL => 18,
            QType::IQ4_XS => 136,
            QType::IQ2_XXS => 66,
            QType::IQ2_XS => 74,
            QType::IQ2_S => 82,
            QType::IQ3_XXS => 98,
            QType::IQ3_S => 110,
            QType::IQ1_S => 50,
            QType::IQ1_M => 56,
            QType::TQ1_0 => 54,
            QType::TQ2_0 => 66,
        }
    }

    /// ggml's lower-case name ("q4_0", ..., "q6_k", "iq4_xs").
    pub const fn name(self) -> &'static str {
        match self {
            QType::Q4_0 => "q4_0",
            QType::Q4_1 => "q4_1",
            QType::Q5_0 => "q5_0",
            QType::Q5_1 => "q5_1",
            QType::Q8_0 => "q8_0",
            QType::Q8_1 => "q8_1",
            QType::Q4_K => "q4_k",
            QType::Q5_K => "q5_k",
            QType::Q6_K => "q6_k",
            QType::Q2_K => "q2_k",
            QType::Q3_K => "q3_k",
            QType::IQ4_NL => "iq4_nl",
            QType::IQ4_XS => "iq4_xs",
            QType::IQ2_XXS => "iq2_xxs",
            QType::IQ2_XS => "iq2_xs",
            QType::IQ2_S => "iq2_s",
            QType::IQ3_XXS => "iq3_xxs",
            QType::IQ3_S => "iq3_s",
            QType::IQ1_S => "iq1_s",
            QType::IQ1_M => "iq1_m",
            QType::TQ1_0 => "tq1_0",
            QType::TQ2_0 => "tq2_0",
        }
    }

    /// The type's number in ggml's `enum ggml_type` (and in GGUF files).
    pub const fn ggml_type_id(self) -> u32 {
        match self {
            QType::Q4_0 => 2,
            QType::Q4_1 => 3,
            QType::Q5_0 => 6,
            QType::Q5_1 => 7,
            QType::Q8_0 => 8,
            QType::Q8_1 => 9,
            QType::Q4_K => 12,
            QType::Q5_K => 13,
            QType::Q6_K => 14,
            QType::Q2_K => 10,
            QType::Q3_K => 11,
            QType::IQ2_XXS => 16,
            QType::IQ2_XS => 17,
            QType::IQ3_XXS => 18,
            QType::IQ1_S => 19,
            QType::IQ4_NL => 20,
            QType::IQ3_S => 21,
            QType::IQ2_S => 22,
            QType::IQ4_XS => 23,
            QType::IQ1_M => 29,
            QType::TQ1_0 => 34,
            QType::TQ2_0 => 35,
        }
    }

    /// The type named `name` (as [`QType::name`] writes it, any letter case), if any.
    pub fn parse(name: &str) -> Option<QType> {
        QType::ALL
            .into_iter()
            .find(|q| q.name().eq_ignore_ascii_case(name))
    }

    /// Bytes of a row of `n` elements, or an error when `n` is not a multiple of the
    /// block size.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        row_bytes_for("row_bytes", self, n)
    }
}

impl std::fmt::Display for QType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// [`QType::row_bytes`], with `op` naming the caller in the error.
fn row_bytes_for(op: &'static str, q: QType, n: usize) -> Result<usize> {
    if !n.is_multiple_of(q.block_size()) {
        return Err(Error::shape(
            op,
            format!(
                "{}: a row of {n} elements is not a multiple of the block size {}",
                q.name(),
                q.block_size()
            ),
        ));
    }
    Ok(n / q.block_size() * q.block_bytes())
}

/// Checks that `n` elements fill whole blocks of `q` and that `bytes` is their size.
fn check_row(op: &'static str, q: QType, n: usize, bytes: usize) -> Result<()> {
    let want = row_bytes_for(op, q, n)?;
    if bytes != want {
        return Err(Error::shape(
            op,
            format!(
                "{}: {n} elements take {want} bytes ({} blocks of {} bytes), the buffer has {bytes}",
                q.name(),
                n / q.block_size(),
                q.block_bytes()
            ),
        ));
    }
    Ok(())
}

/// Quantizes the f32 row `src` into the blocks of `dst`, byte for byte as ggml's
/// `quantize_row_*_ref` where the values are finite; a block holding a NaN or an infinity
/// is stored with a NaN scale (see [`mark_non_finite`]). `src.len()` must be a multiple
/// of `q.block_size()` and `dst.len()` equal to `q.row_bytes(src.len())`; otherwise a
/// shape error names the sizes.
pub fn quantize_row(q: QType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    check_row("quantize_row", q, src.len(), dst.len())?;
    if !q.can_quantize() {
        return Err(Error::DType {
            op: "quantize_row",
            operand: "row".into(),
            found: crate::graph::DType::Quant(q),
            expected: format!(
                "a type graft can quantize to: ggml quantizes {q} only with an importance matrix \
                 (llama-imatrix); read a file llama-quantize made, or pick q2_k, q3_k or iq4_xs"
            ),
        });
    }
    match q {
        QType::Q4_0 => for_each_block(src, dst, legacy::quantize_q4_0),
        QType::Q4_1 => for_each_block(src, dst, legacy::quantize_q4_1),
        QType::Q5_0 => for_each_block(src, dst, legacy::quantize_q5_0),
        QType::Q5_1 => for_each_block(src, dst, legacy::quantize_q5_1),
        QType::Q8_0 => for_each_block(src, dst, legacy::quantize_q8_0),
        QType::Q8_1 => {
            #[cfg(target_arch = "x86_64")]
            if avx2::available() {
                // SAFETY: the CPU has AVX2, FMA and F16C; check_row checked the lengths.
                // The blocks that are not finite get their NaN scale there too.
                unsafe { avx2::q8_1::quantize_row(src, dst) };
                return Ok(());
            }
            for_each_block(src, dst, legacy::quantize_q8_1)
        }
        QType::Q4_K => for_each_block(src, dst, kquants::quantize_q4_k),
        QType::Q5_K => for_each_block(src, dst, kquants::quantize_q5_k),
        QType::Q6_K => for_each_block(src, dst, kquants::quantize_q6_k),
        QType::Q2_K => for_each_block(src, dst, kquants23::quantize_q2_k),
        QType::Q3_K => for_each_block(src, dst, kquants23::quantize_q3_k),
        QType::IQ4_NL => for_each_block(src, dst, iq4::quantize_iq4_nl),
        QType::IQ4_XS => for_each_block(src, dst, iq4::quantize_iq4_xs),
        QType::TQ1_0 => for_each_block(src, dst, ternary::quantize_tq1_0),
        QType::TQ2_0 => for_each_block(src, dst, ternary::quantize_tq2_0),
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M => unreachable!("can_quantize() refused {q}"),
    }
    mark_non_finite(q, src, dst);
    Ok(())
}

/// Rewrites every block of `dst` whose values in `src` hold a NaN or an infinity as zeros
/// with a NaN scale `d`, so that every value of it dequantizes to NaN. ggml's quantizers
/// take the block's largest magnitude with a comparison that passes over a NaN and store
/// finite quants for it: a non-finite activation or KV-cache row would come back finite.
fn mark_non_finite(q: QType, src: &[f32], dst: &mut [u8]) {
    let d_at = match q {
        QType::Q6_K => 208,
        QType::Q2_K => 80,
        QType::Q3_K => 108,
        QType::TQ1_0 => 52,
        QType::TQ2_0 => 64,
        QType::Q4_0
        | QType::Q4_1
        | QType::Q5_0
        | QType::Q5_1
        | QType::Q8_0
        | QType::Q8_1
        | QType::Q4_K
        | QType::Q5_K
        | QType::IQ4_NL
        | QType::IQ4_XS => 0,
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M => unreachable!("can_quantize() refused {q}"),
    };
    let blocks = src.chunks_exact(q.block_size());
    for (x, y) in blocks.zip(dst.chunks_exact_mut(q.block_bytes())) {
        if !x.iter().all(|v| v.is_finite()) {
            y.fill(0);
            write_f16(y, d_at, f32::NAN);
        }
    }
}

/// Dequantizes the blocks of `src` into the f32 row `dst`, as ggml's `dequantize_row_*`.
/// `dst.len()` must be a multiple of `q.block_size()` and `src.len()` equal to
/// `q.row_bytes(dst.len())`; otherwise a shape error names the sizes.
pub fn dequantize_row(q: QType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    check_row("dequantize_row", q, dst.len(), src.len())?;
    match q {
        QType::Q4_0 => for_each_block(src, dst, legacy::dequantize_q4_0),
        QType::Q4_1 => for_each_block(src, dst, legacy::dequantize_q4_1),
        QType::Q5_0 => for_each_block(src, dst, legacy::dequantize_q5_0),
        QType::Q5_1 => for_each_block(src, dst, legacy::dequantize_q5_1),
        QType::Q8_0 => for_each_block(src, dst, legacy::dequantize_q8_0),
        QType::Q8_1 => for_each_block(src, dst, legacy::dequantize_q8_1),
        QType::Q4_K => for_each_block(src, dst, kquants::dequantize_q4_k),
        QType::Q5_K => for_each_block(src, dst, kquants::dequantize_q5_k),
        QType::Q6_K => for_each_block(src, dst, kquants::dequantize_q6_k),
        QType::Q2_K => for_each_block(src, dst, kquants23::dequantize_q2_k),
        QType::Q3_K => for_each_block(src, dst, kquants23::dequantize_q3_k),
        QType::IQ4_NL => for_each_block(src, dst, iq4::dequantize_iq4_nl),
        QType::IQ4_XS => for_each_block(src, dst, iq4::dequantize_iq4_xs),
        QType::IQ2_XXS => for_each_block(src, dst, iqgrid::dequantize_iq2_xxs),
        QType::IQ2_XS => for_each_block(src, dst, iqgrid::dequantize_iq2_xs),
        QType::IQ2_S => for_each_block(src, dst, iqgrid::dequantize_iq2_s),
        QType::IQ3_XXS => for_each_block(src, dst, iqgrid::dequantize_iq3_xxs),
        QType::IQ3_S => for_each_block(src, dst, iqgrid::dequantize_iq3_s),
        QType::IQ1_S => for_each_block(src, dst, iqgrid::dequantize_iq1_s),
        QType::IQ1_M => for_each_block(src, dst, iqgrid::dequantize_iq1_m),
        QType::TQ1_0 => for_each_block(src, dst, ternary::dequantize_tq1_0),
        QType::TQ2_0 => for_each_block(src, dst, ternary::dequantize_tq2_0),
    }
    Ok(())
}

/// Applies `f` to each pair of corresponding fixed-size chunks of `src` and `dst` (the
/// caller has checked that both hold the same number of whole chunks).
fn for_each_block<S: Copy, D, const NS: usize, const ND: usize>(
    src: &[S],
    dst: &mut [D],
    f: impl Fn(&[S; NS], &mut [D; ND]),
) {
    for (s, d) in src.chunks_exact(NS).zip(dst.chunks_exact_mut(ND)) {
        f(as_array(s), as_array_mut(d));
    }
}

/// `s` as an array reference; `s` comes from `chunks_exact(N)` (or a fixed sub-range), so
/// the length always matches.
#[inline(always)]
pub(crate) fn as_array<T, const N: usize>(s: &[T]) -> &[T; N] {
    s.try_into().expect("chunk of the array's length")
}

/// Mutable twin of [`as_array`].
#[inline(always)]
pub(crate) fn as_array_mut<T, const N: usize>(s: &mut [T]) -> &mut [T; N] {
    s.try_into().expect("chunk of the array's length")
}

/// Reads the little-endian f16 at `b[at..at + 2]` as f32.
#[inline(always)]
pub(crate) fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Writes `v` rounded to f16 (nearest, ties to even) at `b[at..at + 2]`.
#[inline(always)]
pub(crate) fn write_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// The largest magnitude in `x` and the first value of that magnitude (ggml keeps the
/// first on ties), as `(magnitude, value)`: the search that starts ggml's quantizers.
#[inline(always)]
pub(crate) fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// ggml's `nearest_int`: adds `1.5 * 2^23` so that the float addition rounds to an
/// integer (ties to even) and reads it from the mantissa bits. Exact for `|x| <= 2^22`;
/// outside that range (or for NaN) the result is meaningless but, as in ggml, no panic.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_half_to_even() {
        let cases = [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (-2.5, -2),
            (2.4999, 2),
            (-7.6, -8),
            (63.0, 63),
            (4_194_303.0, 4_194_303),
        ];
        for (x, want) in cases {
            assert_eq!(nearest_int(x), want, "nearest_int({x})");
        }
    }

    #[test]
    fn names_parse_back_and_sizes_are_ggml_s() {
        let bytes = [
            18, 20, 22, 24, 34, 36, 84, 110, 144, 176, 210, 66, 74, 98, 50, 18, 110, 82, 136, 56,
            54, 66,
        ];
        for (q, b) in QType::ALL.into_iter().zip(bytes) {
            assert_eq!(QType::parse(q.name()), Some(q));
            assert_eq!(QType::parse(&q.name().to_uppercase()), Some(q));
            assert_eq!(q.block_bytes(), b);
            assert_eq!(q.to_string(), q.name());
        }
        assert_eq!(QType::parse("q7_k"), None);
        // ALL is in ggml's numbering order, and the sizes are those of the GGUF reader's type
        // table, but for Q8_1, which GGUF files written by gguf-py store in its older
        // 40-byte block (ggml's block, graft's activations, is 36)
        let ids: Vec<u32> = QType::ALL.iter().map(|q| q.ggml_type_id()).collect();
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
        for q in QType::ALL {
            let t = crate::gguf::GgmlType::from_id(q.ggml_type_id()).expect("a ggml type");
            assert_eq!(t.name().to_lowercase(), q.name());
            assert_eq!(t.block_size() as usize, q.block_size(), "{q}");
            let gguf_bytes = if q == QType::Q8_1 {
                40
            } else {
                q.block_bytes()
            };
            assert_eq!(t.block_bytes() as usize, gguf_bytes, "{q}");
        }
    }

    /// A block holding a NaN or an infinity dequantizes to NaN in every type graft
    /// quantizes to (ggml's
    /// rules would give finite values: the NaN is passed over by the block's maximum);
    /// the row's other blocks are quantized as without it.
    #[test]
    fn non_finite_blocks_dequantize_to_nan() {
        for q in QType::ALL.into_iter().filter(|q| q.can_quantize()) {
            let n = 2 * q.block_size();
            let x: Vec<f32> = (0..n).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
            let rb = q.row_bytes(n).unwrap();
            let (mut clean, mut bad) = (vec![0u8; rb], vec![0u8; rb]);
            quantize_row(q, &x, &mut clean).unwrap();
            for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut y = x.clone();
                y[q.block_size() + 3] = v;
                quantize_row(q, &y, &mut bad).unwrap();
                let mut back = vec![0f32; n];
                dequantize_row(q, &bad, &mut back).unwrap();
                let (first, second) = back.split_at(q.block_size());
                assert!(second.iter().all(|v| v.is_nan()), "{q} {v}: {second:?}");
                assert!(first.iter().all(|v| v.is_finite()), "{q} {v}");
                let half = rb / 2;
                assert_eq!(
                    bad[..half],
                    clean[..half],
                    "{q} {v}: the finite block changed"
                );
            }
        }
    }

    #[test]
    fn row_bytes_names_the_sizes() {
        assert_eq!(QType::Q4_K.row_bytes(512).ok(), Some(288));
        let e = QType::Q4_0.row_bytes(33).err().map(|e| e.to_string());
        assert!(e.is_some_and(|m| m.contains("33") && m.contains("32")));
    }
}
