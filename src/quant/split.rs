//! Split rows: the layout in which the CUDA backend keeps frozen Q4_0, Q4_1, Q5_0, Q5_1
//! and Q8_0 weights ([`Backend::freeze_weights`](crate::backend::Backend::freeze_weights)).
//!
//! A Q4_0 row of `nb` blocks is `nb` times (`d: f16`, `qs: [u8; 16]`), 18 bytes a
//! block, so no block after the first starts 16-byte aligned and a GPU lane cannot read a
//! block's quants as 16-byte loads. The other types are the same: a header (Q4_1: `d`,
//! `m`; Q5_0: `d`, `qh: [u8; 4]`; Q5_1: `d`, `m`, `qh`; Q8_0: `d`), then 16 quant bytes
//! (Q8_0: 32), 20, 22, 24 and 34 bytes a block. Split, the same row holds every block's
//! quant bytes first (block `b` at `QB b`, `QB` 16 or 32), then every block's header (at
//! `QB nb + H b`, `H` its 2 to 8 bytes): the same bytes in the same row length,
//! rearranged. Rows of a multiple of 16 bytes (256 elements for Q4_0, Q5_0 and Q8_0, 128
//! for Q4_1, 64 for Q5_1) keep 16-byte alignment from row to row. This module converts
//! rows both ways on the host: the backend reads frozen weights back in ggml's layout
//! with [`join_row`], and tests check the layout with [`split_row`].

use crate::quant::QType;

/// Whether `q` has a split-row layout: the 32-element types but Q8_1 (the activation
/// format), whose blocks are a header and then 16 or 32 quant bytes.
pub fn has_split_rows(q: QType) -> bool {
    matches!(
        q,
        QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1 | QType::Q8_0
    )
}

/// Bytes of a block's header in split rows: all but its 16 (Q8_0: 32) quant bytes.
fn head_bytes(q: QType) -> usize {
    let quants = if q == QType::Q8_0 { 32 } else { 16 };
    q.block_bytes() - quants
}

/// Whether a row of `row_len` elements of `q` can be split: a type with split rows,
/// whole blocks, and a multiple of 16 bytes, so that every split row of a dense tensor
/// stays 16-byte aligned (a multiple of 256 elements for Q4_0, Q5_0 and Q8_0, 128 for
/// Q4_1, 64 for Q5_1).
pub fn splittable(q: QType, row_len: usize) -> bool {
    let bs = q.block_size();
    has_split_rows(q)
        && row_len > 0
        && row_len % bs == 0
        && (row_len / bs * q.block_bytes()) % 16 == 0
}

/// One ggml row of `q` (`src`, whole blocks) as a split row into `dst` (same length).
pub fn split_row(q: QType, src: &[u8], dst: &mut [u8]) {
    let (bb, nb) = sizes(q, src, dst);
    let h = head_bytes(q);
    let qb = bb - h;
    for (b, blk) in src.chunks_exact(bb).enumerate() {
        dst[qb * b..qb * (b + 1)].copy_from_slice(&blk[h..]);
        dst[qb * nb + h * b..qb * nb + h * (b + 1)].copy_from_slice(&blk[..h]);
    }
}

/// One split row of `q` (`src`) back in ggml's layout into `dst` (same length).
pub fn join_row(q: QType, src: &[u8], dst: &mut [u8]) {
    let (bb, nb) = sizes(q, src, dst);
    let h = head_bytes(q);
    let qb = bb - h;
    for (b, blk) in dst.chunks_exact_mut(bb).enumerate() {
        blk[..h].copy_from_slice(&src[qb * nb + h * b..qb * nb + h * (b + 1)]);
        blk[h..].copy_from_slice(&src[qb * b..qb * (b + 1)]);
    }
}

/// The block bytes and block count of a row, after checking the type and the lengths
/// (the callers' contract: a programming error otherwise).
fn sizes(q: QType, src: &[u8], dst: &[u8]) -> (usize, usize) {
    assert!(has_split_rows(q), "{q} has no split-row layout");
    assert_eq!(src.len(), dst.len(), "split rows keep the row's length");
    let bb = q.block_bytes();
    assert_eq!(src.len() % bb, 0, "a row is whole {bb}-byte blocks");
    (bb, src.len() / bb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row;

    /// A split row puts block b's quants at QB b and its header (ggml's first H bytes of
    /// the block) at QB nb + H b, and joining gives the row back: checked field by field
    /// against the ggml blocks, not only as a round trip (a split that swapped two blocks
    /// would round-trip too).
    #[test]
    fn split_places_each_field_and_join_inverts_it() {
        let types = [
            (QType::Q4_0, 16usize, 2usize),
            (QType::Q4_1, 16, 4),
            (QType::Q5_0, 16, 6),
            (QType::Q5_1, 16, 8),
            (QType::Q8_0, 32, 2),
        ];
        for (q, qb, h) in types {
            let bb = qb + h;
            assert_eq!(bb, q.block_bytes(), "{q}");
            for blocks in [8usize, 16, 344] {
                let k = 32 * blocks;
                let x: Vec<f32> = (0..k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03)
                    .collect();
                let mut row = vec![0u8; q.row_bytes(k).unwrap()];
                quantize_row(q, &x, &mut row).unwrap();
                let mut split = vec![0u8; row.len()];
                split_row(q, &row, &mut split);
                for b in 0..blocks {
                    let quants = &row[bb * b + h..bb * (b + 1)];
                    assert_eq!(&split[qb * b..qb * (b + 1)], quants, "{q} block {b} quants");
                    let head = &split[qb * blocks + h * b..qb * blocks + h * (b + 1)];
                    assert_eq!(head, &row[bb * b..bb * b + h], "{q} block {b} header");
                }
                let mut back = vec![0u8; row.len()];
                join_row(q, &split, &mut back);
                assert_eq!(back, row);
            }
        }
    }

    #[test]
    fn splittable_rows_are_whole_16_byte_multiples() {
        for q in [QType::Q4_0, QType::Q5_0, QType::Q8_0] {
            for k in [256, 4096, 11008] {
                assert!(splittable(q, k), "{q} {k}");
            }
            // 18 blocks: 324 / 396 / 612 bytes; 128 elements: 72 / 88 / 136
            for k in [0, 32, 576, 100, 128] {
                assert!(!splittable(q, k), "{q} {k}");
            }
        }
        // Q4_1: 20 bytes a block, whole 16-byte rows every 4 blocks
        assert!(splittable(QType::Q4_1, 128) && splittable(QType::Q4_1, 4096));
        assert!(!splittable(QType::Q4_1, 576) && !splittable(QType::Q4_1, 64));
        // Q5_1: 24 bytes a block, every 2 blocks
        assert!(splittable(QType::Q5_1, 64) && splittable(QType::Q5_1, 576));
        assert!(!splittable(QType::Q5_1, 96));
        assert!(!splittable(QType::Q4_K, 4096) && !splittable(QType::Q8_1, 4096));
    }
}
