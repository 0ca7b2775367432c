//! Rows of eight: the layout in which the CPU backend keeps frozen Q4_0 and IQ4_NL
//! weights ([`Backend::freeze_weights`](crate::backend::Backend::freeze_weights)) on CPUs
//! with AVX-512 VNNI.
//!
//! Both types store a block as (`d: f16`, `qs: [u8; 16]`), 18 bytes, byte `i` of `qs`
//! holding element `i` in its low nibble and element `i + 16` in its high one. Eight rows
//! of `nb` blocks (`8 * 18 * nb` bytes, the same bytes as ggml's eight rows) hold, block
//! after block, the eight rows' `d` (16 bytes), then for each 4-byte group `g` of `qs`
//! (0..4) the eight rows' bytes `4g..4g + 4` (32 bytes): 144 bytes a block. One 32-byte
//! load then gives a kernel four elements of each of eight rows in the rows' 32-bit
//! lanes, and one 16-byte load their scales, with no transpose (`quant::avx2::rows8`).
//! The products read their activation columns packed eight at a time
//! ([`crate::quant::panel`]).

use crate::quant::panel::Packing;
use crate::quant::QType;

/// Rows in a group.
pub const ROWS: usize = 8;
/// Bytes of a block of one row.
const BLOCK: usize = 18;

/// Whether this CPU runs the products of rows of eight (AVX-512 VNNI and VL, with AVX2,
/// FMA and F16C): where it does not, nothing is stored in them.
pub fn usable() -> bool {
    #[cfg(target_arch = "x86_64")]
    return super::avx2::available() && super::avx2::vnni_available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether frozen weights of `q` with rows of `row_len` elements can be stored in rows of
/// eight (the rows must also come in whole groups of eight).
pub fn takes(q: QType, row_len: usize) -> bool {
    matches!(q, QType::Q4_0 | QType::IQ4_NL) && row_len > 0 && row_len.is_multiple_of(32)
}

/// How the products of rows of eight of `q` read their columns ([`crate::quant::panel`]):
/// Q4_0's quants as they are with the blocks' `s` (its `-8` taken off through it, as in
/// the portable code); IQ4_NL's with -128 times their sums (its levels are read plus 128).
pub fn packing(q: QType) -> Packing {
    match q == QType::IQ4_NL {
        true => Packing::Sums,
        false => Packing::Plain,
    }
}

/// Eight rows of ggml's layout (`src`, `8 * row_bytes` bytes) into rows of eight (`dst`).
pub fn interleave(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / (ROWS * BLOCK);
    let row = nb * BLOCK;
    for b in 0..nb {
        let out = &mut dst[b * ROWS * BLOCK..(b + 1) * ROWS * BLOCK];
        for r in 0..ROWS {
            let blk = &src[r * row + b * BLOCK..r * row + (b + 1) * BLOCK];
            out[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
            for g in 0..4 {
                let at = 16 + 32 * g + 4 * r;
                out[at..at + 4].copy_from_slice(&blk[2 + 4 * g..6 + 4 * g]);
            }
        }
    }
}

/// Rows of eight (`src`) back into ggml's eight rows (`dst`): [`interleave`] undone.
pub fn join(src: &[u8], dst: &mut [u8]) {
    let row_bytes = dst.len() / ROWS;
    for (r, out) in dst.chunks_exact_mut(row_bytes).enumerate() {
        row(src, r, out);
    }
}

/// Row `r` (0..8) of a group of rows of eight (`src`) in ggml's layout, into `dst`
/// (`row_bytes` bytes).
pub fn row(src: &[u8], r: usize, dst: &mut [u8]) {
    for (b, blk) in dst.chunks_exact_mut(BLOCK).enumerate() {
        let inp = &src[b * ROWS * BLOCK..(b + 1) * ROWS * BLOCK];
        blk[..2].copy_from_slice(&inp[2 * r..2 * r + 2]);
        for g in 0..4 {
            let at = 16 + 32 * g + 4 * r;
            blk[2 + 4 * g..6 + 4 * g].copy_from_slice(&inp[at..at + 4]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleave_join_and_rows_round_trip() {
        for nb in [1usize, 3, 18] {
            let src: Vec<u8> = (0..ROWS * BLOCK * nb)
                .map(|i| (i * 7 % 251) as u8)
                .collect();
            let mut mid = vec![0u8; src.len()];
            interleave(&src, &mut mid);
            assert_ne!(mid, src);
            // block 0: the rows' d side by side, then group 0 of every row
            assert_eq!(&mid[2..4], &src[nb * BLOCK..nb * BLOCK + 2]);
            assert_eq!(&mid[16 + 4..16 + 8], &src[nb * BLOCK + 2..nb * BLOCK + 6]);
            let mut back = vec![0u8; src.len()];
            join(&mid, &mut back);
            assert_eq!(back, src);
            for r in 0..ROWS {
                let mut one = vec![0u8; nb * BLOCK];
                row(&mid, r, &mut one);
                assert_eq!(one, src[r * nb * BLOCK..(r + 1) * nb * BLOCK]);
            }
        }
    }
}
