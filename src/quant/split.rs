//! Split rows: the layout in which the CUDA backend keeps frozen Q4_0 and Q8_0 weights
//! ([`Backend::freeze_weights`](crate::backend::Backend::freeze_weights)).
//!
//! A Q4_0 row of `nb` blocks is `nb` times (`d: f16`, `qs: [u8; 16]`), 18 bytes a
//! block (Q8_0: `qs: [i8; 32]`, 34 bytes), so no block after the first starts 16-byte
//! aligned and a GPU lane cannot read a block's quants as 16-byte loads. Split, the same
//! row holds every block's quant bytes first (block `b` at `16 b`, Q8_0 `32 b`), then
//! every block's `d` (at `16 nb + 2 b`, Q8_0 `32 nb + 2 b`): the same bytes in the same
//! row length, rearranged. Rows of a multiple of 8 blocks (256 elements) keep 16-byte
//! alignment from row to row. This module converts rows both ways on the host: the
//! backend reads frozen weights back in ggml's layout with [`join_row`], and tests check
//! the layout with [`split_row`].

use crate::quant::QType;

/// Bytes of a block's header (its f16 scale) in the types with split rows.
const HEAD: usize = 2;

/// Whether `q` has a split-row layout: Q4_0 and Q8_0, whose blocks are an f16 scale and
/// then 16 or 32 quant bytes.
pub fn has_split_rows(q: QType) -> bool {
    matches!(q, QType::Q4_0 | QType::Q8_0)
}

/// Whether a row of `row_len` elements of `q` can be split: a type with split rows,
/// whole blocks, and a multiple of 16 bytes, so that every split row of a dense tensor
/// stays 16-byte aligned (a multiple of 256 elements for both types).
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
    let qb = bb - HEAD;
    for (b, blk) in src.chunks_exact(bb).enumerate() {
        dst[qb * b..qb * (b + 1)].copy_from_slice(&blk[HEAD..]);
        dst[qb * nb + HEAD * b..qb * nb + HEAD * (b + 1)].copy_from_slice(&blk[..HEAD]);
    }
}

/// One split row of `q` (`src`) back in ggml's layout into `dst` (same length).
pub fn join_row(q: QType, src: &[u8], dst: &mut [u8]) {
    let (bb, nb) = sizes(q, src, dst);
    let qb = bb - HEAD;
    for (b, blk) in dst.chunks_exact_mut(bb).enumerate() {
        blk[..HEAD].copy_from_slice(&src[qb * nb + HEAD * b..qb * nb + HEAD * (b + 1)]);
        blk[HEAD..].copy_from_slice(&src[qb * b..qb * (b + 1)]);
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

    /// A split row puts block b's quants at QB b and its scale at QB nb + 2 b, and joining
    /// gives the row back: checked field by field against the ggml blocks, not only as a
    /// round trip (a split that swapped two blocks would round-trip too).
    #[test]
    fn split_places_each_field_and_join_inverts_it() {
        for (q, qb) in [(QType::Q4_0, 16usize), (QType::Q8_0, 32)] {
            let bb = qb + 2;
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
                    let quants = &row[bb * b + 2..bb * (b + 1)];
                    assert_eq!(&split[qb * b..qb * (b + 1)], quants, "{q} block {b} quants");
                    let d = &split[qb * blocks + 2 * b..qb * blocks + 2 * b + 2];
                    assert_eq!(d, &row[bb * b..bb * b + 2], "{q} block {b} d");
                }
                let mut back = vec![0u8; row.len()];
                join_row(q, &split, &mut back);
                assert_eq!(back, row);
            }
        }
    }

    #[test]
    fn splittable_rows_are_multiples_of_256_elements() {
        for q in [QType::Q4_0, QType::Q8_0] {
            for k in [256, 4096, 11008] {
                assert!(splittable(q, k), "{q} {k}");
            }
            // 18 blocks: 324 / 612 bytes
            for k in [0, 32, 576, 100] {
                assert!(!splittable(q, k), "{q} {k}");
            }
        }
        assert!(!splittable(QType::Q4_1, 4096));
        assert!(!splittable(QType::Q4_K, 4096));
    }
}
