//! Q8_1 activation columns packed eight at a time: what the products of eight weight rows
//! against many columns read on CPUs with AVX-512 VNNI (rows of eight,
//! [`crate::quant::rows8`], and the eight-row tiles of ggml's layout).
//!
//! For each run of eight columns (the last one padded with zero columns) and each Q8_1
//! block, a panel of [`COL_PANEL`] bytes: the eight columns' 32 quants (256 bytes), their
//! `d` as f32 (32 bytes), then a third field per column (32 bytes, see [`Packing`]). Every
//! column of a block then sits at a fixed distance from one pointer, and a kernel walks the
//! panels of a run in order.

use crate::quant::read_f16;

/// Columns in a run.
pub const RUN: usize = 8;
/// Bytes of one block of a run of eight packed columns.
pub const COL_PANEL: usize = 320;
/// Bytes of a Q8_1 block.
const Q8_1_BLOCK: usize = 36;

/// What a panel holds besides `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Packing {
    /// The quants as they are, and the block's `s = d * sum(q)` as f32.
    Plain,
    /// The quants plus 128 (`q ^ 0x80`, unsigned, for weights of signed quants that
    /// `vpdpbusd` takes as its signed operand), and `s` as f32.
    Plus128,
    /// The quants as they are, and `-128 * sum(q)` as i32 (for weights read plus 128).
    Sums,
}

/// The Q8_1 columns `a` (`ncols` columns of `nb` blocks each, one after the other) packed
/// as `how` says into `out`: `ncols.div_ceil(8) * nb` panels.
pub fn pack(a: &[u8], ncols: usize, how: Packing, out: &mut Vec<u8>) {
    let nb = a.len() / Q8_1_BLOCK / ncols.max(1);
    out.clear();
    out.resize(ncols.div_ceil(RUN) * nb * COL_PANEL, 0);
    if nb == 0 {
        return;
    }
    for (c, col) in a.chunks_exact(nb * Q8_1_BLOCK).enumerate() {
        let lane = c % RUN;
        for (b, blk) in col.chunks_exact(Q8_1_BLOCK).enumerate() {
            let at = ((c / RUN) * nb + b) * COL_PANEL;
            let panel = &mut out[at..at + COL_PANEL];
            let quants = &mut panel[32 * lane..32 * lane + 32];
            quants.copy_from_slice(&blk[4..]);
            let third = match how {
                Packing::Plain => read_f16(blk, 2).to_le_bytes(),
                Packing::Plus128 => {
                    quants.iter_mut().for_each(|x| *x ^= 0x80);
                    read_f16(blk, 2).to_le_bytes()
                }
                Packing::Sums => {
                    let sum: i32 = blk[4..].iter().map(|&x| i32::from(x as i8)).sum();
                    (-128 * sum).to_le_bytes()
                }
            };
            let d = read_f16(blk, 0).to_le_bytes();
            panel[256 + 4 * lane..260 + 4 * lane].copy_from_slice(&d);
            panel[288 + 4 * lane..292 + 4 * lane].copy_from_slice(&third);
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
        for how in [Packing::Plain, Packing::Plus128, Packing::Sums] {
            pack(&a, ncols, how, &mut out);
            assert_eq!(out.len(), 2 * nb * COL_PANEL);
            for (c, b) in (0..ncols).flat_map(|c| (0..nb).map(move |b| (c, b))) {
                let src = &a[(c * nb + b) * Q8_1_BLOCK..(c * nb + b + 1) * Q8_1_BLOCK];
                let panel = &out[((c / 8) * nb + b) * COL_PANEL..][..COL_PANEL];
                let lane = c % 8;
                let flip = if how == Packing::Plus128 { 0x80 } else { 0 };
                let want: Vec<u8> = src[4..].iter().map(|&x| x ^ flip).collect();
                assert_eq!(&panel[32 * lane..32 * lane + 32], &want[..]);
                let word = |at: usize| <[u8; 4]>::try_from(&panel[at..at + 4]).unwrap();
                let i = c * nb + b;
                assert_eq!(f32::from_le_bytes(word(256 + 4 * lane)), 0.5 + i as f32);
                let third = word(288 + 4 * lane);
                if how == Packing::Sums {
                    let sum: i32 = src[4..].iter().map(|&x| i32::from(x as i8)).sum();
                    assert_eq!(i32::from_le_bytes(third), -128 * sum);
                } else {
                    assert_eq!(f32::from_le_bytes(third), -(i as f32));
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
}
