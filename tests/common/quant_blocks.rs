//! Weight rows of every quantized type for the tests: quantized from values where graft
//! quantizes the type, random valid blocks where it does not (the lattice i-quants, which
//! ggml quantizes only with an importance matrix): random bytes (so every index, sign and
//! scale field takes random values) with each f16 field set to a finite scale of a sane
//! magnitude.

use graft::quant::{quantize_row, QType};
use half::f16;

/// Byte offsets of a block's f16 fields (IQ1_M's `d`, spread over four nibbles, is set
/// apart in [`random_blocks`]).
fn f16_fields(q: QType) -> &'static [usize] {
    match q {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 | QType::IQ4_NL | QType::IQ4_XS => &[0],
        QType::Q4_1 | QType::Q5_1 | QType::Q8_1 | QType::Q4_K | QType::Q5_K => &[0, 2],
        QType::Q6_K => &[208],
        QType::Q2_K => &[80, 82],
        QType::Q3_K => &[108],
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S => &[0],
        QType::IQ1_M => &[],
        QType::TQ1_0 => &[52],
        QType::TQ2_0 => &[64],
    }
}

/// A small deterministic generator (splitmix64).
fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `nblocks` random valid blocks of `q` whose scales lie in `[scale / 2, scale)` (the
/// blocks' values then lie within some tens of `scale`).
pub fn random_blocks(q: QType, nblocks: usize, scale: f32, seed: u64) -> Vec<u8> {
    let mut s = seed;
    let bb = q.block_bytes();
    let mut out: Vec<u8> = (0..nblocks * bb).map(|_| next(&mut s) as u8).collect();
    for blk in out.chunks_exact_mut(bb) {
        let mut d = || {
            let u = (next(&mut s) >> 40) as f32 / (1u64 << 24) as f32;
            f16::from_f32(scale * (0.5 + 0.5 * u)).to_bits()
        };
        for &at in f16_fields(q) {
            blk[at..at + 2].copy_from_slice(&d().to_le_bytes());
        }
        if q == QType::IQ1_M {
            let bits = d();
            for i in 0..4 {
                let at = 49 + 2 * i;
                blk[at] = (blk[at] & 0x0f) | ((((bits >> (4 * i)) & 0xf) as u8) << 4);
            }
        }
    }
    out
}

/// The scale of random blocks of `q` whose values are of about the size of `amax`: the
/// type's largest element over its scale is some tens (IQ2: `15.5 / 4 * 43`).
fn scale_for(q: QType, amax: f32) -> f32 {
    let top = match q {
        QType::IQ2_XXS | QType::IQ2_XS | QType::IQ2_S => 166.0,
        QType::IQ3_XXS => 15.5 / 2.0 * 62.0,
        QType::IQ3_S => 31.0 * 15.0,
        QType::IQ1_S | QType::IQ1_M => 15.0 * 1.125,
        _ => 127.0,
    };
    (amax / top).max(1e-6)
}

/// A row of `q` for the values `x`: `x` quantized where graft can, else random blocks of
/// the same byte length and about `x`'s magnitude.
pub fn weight_row(q: QType, x: &[f32], seed: u64) -> Vec<u8> {
    let n = q.row_bytes(x.len()).expect("whole blocks");
    if q.can_quantize() {
        let mut out = vec![0u8; n];
        quantize_row(q, x, &mut out).expect("sizes match");
        return out;
    }
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    random_blocks(q, x.len() / q.block_size(), scale_for(q, amax), seed)
}
