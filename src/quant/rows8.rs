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
//!
//! The Q8_1 activation columns those products read are packed eight columns at a time
//! ([`pack_cols`]): block after block, the eight columns' 32 quants (256 bytes), their
//! `d` as f32 (32 bytes), then each column's offset term (32 bytes: see [`pack_cols`]),
//! so that every column of a block sits at a fixed distance from one pointer.

use crate::quant::{read_f16, QType};

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

/// Bytes of a block of Q8_1.
const Q8_1_BLOCK: usize = 36;
/// Bytes of one block of eight packed columns ([`pack_cols`]).
pub const COL_PANEL: usize = 320;

/// The Q8_1 columns `a` (`ncols` columns of `nb` blocks each, one after the other) packed
/// for the products of rows of eight of `q` into `out`: for each run of eight columns (the
/// last one padded with zeros) and each block, the eight columns' quants (32 bytes each),
/// their `d` (f32) and their offset term: for Q4_0 the Q8_1 block's `s = d * sum(q)` as
/// f32 (its quants are offset by 8: `-8 * s`, as in the portable code), for IQ4_NL the i32
/// `-128 * sum(q)` (its levels are read plus 128, exactly taken off in the integer sum).
pub fn pack_cols(q: QType, a: &[u8], ncols: usize, out: &mut Vec<u8>) {
    let nb = a.len() / Q8_1_BLOCK / ncols.max(1);
    out.clear();
    out.resize(ncols.div_ceil(ROWS) * nb * COL_PANEL, 0);
    if nb == 0 {
        return;
    }
    for (c, col) in a.chunks_exact(nb * Q8_1_BLOCK).enumerate() {
        for (b, blk) in col.chunks_exact(Q8_1_BLOCK).enumerate() {
            let at = ((c / ROWS) * nb + b) * COL_PANEL;
            let panel = &mut out[at..at + COL_PANEL];
            let lane = c % ROWS;
            panel[32 * lane..32 * lane + 32].copy_from_slice(&blk[4..]);
            let off = if q == QType::IQ4_NL {
                let sum: i32 = blk[4..].iter().map(|&x| i32::from(x as i8)).sum();
                (-128 * sum).to_le_bytes()
            } else {
                read_f16(blk, 2).to_le_bytes()
            };
            let d = read_f16(blk, 0).to_le_bytes();
            panel[256 + 4 * lane..260 + 4 * lane].copy_from_slice(&d);
            panel[288 + 4 * lane..292 + 4 * lane].copy_from_slice(&off);
        }
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
    fn packed_columns_sit_in_their_lanes() {
        let (nb, ncols) = (3usize, 10usize);
        let mut a = vec![0u8; ncols * nb * Q8_1_BLOCK];
        let mut blk = [0u8; Q8_1_BLOCK];
        for (i, chunk) in a.chunks_exact_mut(Q8_1_BLOCK).enumerate() {
            crate::quant::write_f16(&mut blk, 0, 0.5 + i as f32);
            crate::quant::write_f16(&mut blk, 2, -(i as f32));
            for (j, q) in blk[4..].iter_mut().enumerate() {
                *q = (i * 7 + j) as u8 ^ 0x80;
            }
            chunk.copy_from_slice(&blk);
        }
        let mut out = Vec::new();
        for q in [QType::Q4_0, QType::IQ4_NL] {
            pack_cols(q, &a, ncols, &mut out);
            assert_eq!(out.len(), 2 * nb * COL_PANEL);
            for (c, b) in (0..ncols).flat_map(|c| (0..nb).map(move |b| (c, b))) {
                let src = &a[(c * nb + b) * Q8_1_BLOCK..(c * nb + b + 1) * Q8_1_BLOCK];
                let panel = &out[((c / 8) * nb + b) * COL_PANEL..][..COL_PANEL];
                let lane = c % 8;
                assert_eq!(&panel[32 * lane..32 * lane + 32], &src[4..]);
                let word = |at: usize| <[u8; 4]>::try_from(&panel[at..at + 4]).unwrap();
                let i = c * nb + b;
                assert_eq!(f32::from_le_bytes(word(256 + 4 * lane)), 0.5 + i as f32);
                let off = word(288 + 4 * lane);
                if q == QType::Q4_0 {
                    assert_eq!(f32::from_le_bytes(off), -(i as f32));
                } else {
                    let sum: i32 = src[4..].iter().map(|&x| i32::from(x as i8)).sum();
                    assert_eq!(i32::from_le_bytes(off), -128 * sum);
                }
            }
            // the padding columns of the last run are zeros
            assert!(out[nb * COL_PANEL..]
                .chunks_exact(COL_PANEL)
                .all(|p| p[64..256]
                    .iter()
                    .chain(&p[264..288])
                    .chain(&p[296..])
                    .all(|&x| x == 0)));
        }
    }

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
