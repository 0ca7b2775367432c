//! Split rows: the layout in which the CUDA backend keeps frozen Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0, Q5_K and Q6_K weights ([`Backend::freeze_weights`](crate::backend::Backend::freeze_weights)).
//!
//! A Q4_0 row of `nb` blocks is `nb` times (`d: f16`, `qs: [u8; 16]`), 18 bytes a
//! block, so no block after the first starts 16-byte aligned and a GPU lane cannot read a
//! block's quants as 16-byte loads. The other types are the same: a header (Q4_1: `d`,
//! `m`; Q5_0: `d`, `qh: [u8; 4]`; Q5_1: `d`, `m`, `qh`; Q8_0: `d`), then 16 quant bytes
//! (Q8_0: 32), 20, 22, 24 and 34 bytes a block. Split, the same row holds every block's
//! quant bytes first (block `b` at `QB b`, `QB` 16 or 32), then every block's header (at
//! `QB nb + H b`, `H` its 2 to 8 bytes): the same bytes in the same row length,
//! rearranged. Rows of a multiple of 16 bytes (256 elements for Q4_0, Q5_0 and Q8_0, 128
//! for Q4_1, 64 for Q5_1) keep 16-byte alignment from row to row.
//!
//! Q6_K (210 bytes: `ql[128]`, `qh[64]`, `scales[16]`, `d`) is split further, as its
//! product reads it: a lane takes two 32-element sub-blocks `2p`, `2p + 1` (`p` 0..4), whose
//! six-bit quants are spread over 64 bytes of `ql` and 32 of `qh` that the pair `2p ^ 2`
//! also reads. Split, a block's 192 quant bytes are its four pairs, 48 bytes each: 32 bytes
//! of low nibbles (element `i` of sub-block `2p` in the low half of byte `i`, of `2p + 1`
//! in the high half), then 16 bytes of the high bit pairs (element `4k + i` of sub-block
//! `2p + u` in byte `4 (k % 4) + i` at bits `2 (2u + k / 4)`). The row is every block's
//! quants (block `b` at `192 b`), then every block's scales (at `192 nb + 16 b`), then
//! every block's `d` (at `208 nb + 2 b`), rotated forward by the distance from the row's
//! device address to the next 16-byte boundary ([`rotation`]): a row of 11,008 elements
//! is 9,030 bytes, so the rows of a tensor start at every even offset, and the rotation
//! keeps every row's quants aligned. Rows of at least 8 blocks are split, so that only the
//! `d` of the last blocks can wrap around to the row's start.
//!
//! Q5_K (176 bytes: `d`, `dmin`, `scales[12]`, `qh[32]`, `qs[128]`) keeps rows 16-byte
//! aligned by itself; its product's lane takes a pair of sub-blocks, which needs 32 bytes
//! of `qs` but only two bits of each of the 32 `qh` bytes. Split, the row is every block's
//! `qs` as ggml has them (block `b` at `128 b`), then every block's fifth bits by sub-block
//! (at `128 nb + 32 b + 4 j`: a word whose byte `i` holds at bit `k` the fifth bit of
//! element `4k + i` of sub-block `j`, so a pair's are one 8-byte load), then every block's
//! 16 header bytes (`d`, `dmin`, `scales`, at `160 nb + 16 b`).
//!
//! This module converts rows both ways on the host: the backend reads frozen weights back
//! in ggml's layout with [`join_row`], and tests check the layout with [`split_row`].

use crate::quant::kquants::{pack_q6_k, unpack_q6_k};
use crate::quant::QType;

/// How a type's rows are split.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Every block's quant bytes (the last `quants` of the block), then every header.
    Blocks { quants: usize },
    /// Q5_K's quants, fifth bits by sub-block, headers.
    Q5K,
    /// Q6_K's pairs, scales and `d`, rotated by the row's address.
    Q6K,
    /// No split rows: Q8_1 (the activation format), Q4_K (read in place as it is) and the
    /// types whose decode products read ggml's layout.
    None,
}

fn layout(q: QType) -> Layout {
    match q {
        QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1 => Layout::Blocks { quants: 16 },
        QType::Q8_0 => Layout::Blocks { quants: 32 },
        QType::Q5_K => Layout::Q5K,
        QType::Q6_K => Layout::Q6K,
        QType::Q8_1
        | QType::Q4_K
        | QType::Q2_K
        | QType::Q3_K
        | QType::IQ4_NL
        | QType::IQ4_XS
        | QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S
        | QType::IQ1_M
        | QType::TQ1_0
        | QType::TQ2_0 => Layout::None,
    }
}

/// Whether `q` has a split-row layout: the 32-element types but Q8_1 (the activation
/// format), whose blocks are a header and then 16 or 32 quant bytes, Q5_K and Q6_K.
pub fn has_split_rows(q: QType) -> bool {
    layout(q) != Layout::None
}

/// Bytes by which a split row of `q` at device address `addr` is rotated: for Q6_K, the
/// distance from `addr` to the next 16-byte boundary (its rows start 2-byte aligned,
/// so 0 to 14); 0 for the other types, whose split rows start aligned.
pub fn rotation(q: QType, addr: u64) -> usize {
    match layout(q) {
        Layout::Q6K => (addr.wrapping_neg() % 16) as usize,
        Layout::Blocks { .. } | Layout::Q5K | Layout::None => 0,
    }
}

/// Whether a row of `row_len` elements of `q` can be split: a type with split rows and
/// whole blocks; for the 32-element types a multiple of 16 bytes, so that every split row
/// of a dense tensor stays 16-byte aligned (a multiple of 256 elements for Q4_0, Q5_0 and
/// Q8_0, 128 for Q4_1, 64 for Q5_1); for Q5_K any; for Q6_K at least 8 blocks (2,048
/// elements).
pub fn splittable(q: QType, row_len: usize) -> bool {
    let bs = q.block_size();
    let whole = row_len > 0 && row_len.is_multiple_of(bs);
    match layout(q) {
        Layout::Blocks { .. } => whole && (row_len / bs * q.block_bytes()).is_multiple_of(16),
        Layout::Q5K => whole,
        Layout::Q6K => whole && row_len / bs >= 8,
        Layout::None => false,
    }
}

/// Whether rows of `row_len` elements of `q` starting at device address `addr` can be
/// split ([`splittable`]): 16-byte aligned, Q6_K's 2-byte aligned (it rotates its rows).
pub fn splittable_at(q: QType, row_len: usize, addr: u64) -> bool {
    let align = if layout(q) == Layout::Q6K { 2 } else { 16 };
    splittable(q, row_len) && addr.is_multiple_of(align)
}

/// One ggml row of `q` (`src`, whole blocks) as a split row into `dst` (same length), for
/// the device address `addr` (see [`rotation`]).
pub fn split_row(q: QType, src: &[u8], dst: &mut [u8], addr: u64) {
    let (bb, nb) = sizes(q, src, dst);
    match layout(q) {
        Layout::Blocks { quants } => {
            let h = bb - quants;
            for (b, blk) in src.chunks_exact(bb).enumerate() {
                dst[quants * b..quants * (b + 1)].copy_from_slice(&blk[h..]);
                dst[quants * nb + h * b..quants * nb + h * (b + 1)].copy_from_slice(&blk[..h]);
            }
        }
        Layout::Q5K => split_q5_k(src, dst),
        Layout::Q6K => split_q6_k(src, dst, rotation(q, addr)),
        Layout::None => unreachable!("sizes() checked that {q} has split rows"),
    }
}

/// One split row of `q` (`src`, as it lies at device address `addr`) back in ggml's
/// layout into `dst` (same length).
pub fn join_row(q: QType, src: &[u8], dst: &mut [u8], addr: u64) {
    let (bb, nb) = sizes(q, src, dst);
    match layout(q) {
        Layout::Blocks { quants } => {
            let h = bb - quants;
            for (b, blk) in dst.chunks_exact_mut(bb).enumerate() {
                blk[..h].copy_from_slice(&src[quants * nb + h * b..quants * nb + h * (b + 1)]);
                blk[h..].copy_from_slice(&src[quants * b..quants * (b + 1)]);
            }
        }
        Layout::Q5K => join_q5_k(src, dst),
        Layout::Q6K => join_q6_k(src, dst, rotation(q, addr)),
        Layout::None => unreachable!("sizes() checked that {q} has split rows"),
    }
}

/// Q5_K's split row: quants, fifth bits by sub-block and headers of every block (module
/// docs).
fn split_q5_k(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 176;
    for (b, blk) in src.chunks_exact(176).enumerate() {
        dst[128 * b..128 * (b + 1)].copy_from_slice(&blk[48..]);
        dst[160 * nb + 16 * b..160 * nb + 16 * (b + 1)].copy_from_slice(&blk[..16]);
        let bits = &mut dst[128 * nb + 32 * b..128 * nb + 32 * (b + 1)];
        bits.fill(0);
        for (e, &h) in blk[16..48].iter().enumerate() {
            for (j, word) in bits.chunks_exact_mut(4).enumerate() {
                word[e % 4] |= ((h >> j) & 1) << (e / 4);
            }
        }
    }
}

/// [`split_q5_k`] undone.
fn join_q5_k(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 176;
    for (b, blk) in dst.chunks_exact_mut(176).enumerate() {
        blk[48..].copy_from_slice(&src[128 * b..128 * (b + 1)]);
        blk[..16].copy_from_slice(&src[160 * nb + 16 * b..160 * nb + 16 * (b + 1)]);
        let bits = &src[128 * nb + 32 * b..128 * nb + 32 * (b + 1)];
        for (e, h) in blk[16..48].iter_mut().enumerate() {
            *h = 0;
            for (j, word) in bits.chunks_exact(4).enumerate() {
                *h |= ((word[e % 4] >> (e / 4)) & 1) << j;
            }
        }
    }
}

/// Q6_K's split row: quants, scales and `d` of every block (module docs), rotated by `rot`.
fn split_q6_k(src: &[u8], dst: &mut [u8], rot: usize) {
    let nb = src.len() / 210;
    let mut seq = vec![0u8; src.len()];
    for (b, blk) in src.chunks_exact(210).enumerate() {
        let q = unpack_q6_k(&blk[..128], &blk[128..192]).map(|v| (v + 32) as u8);
        pack_q6_k_pairs(&q, &mut seq[192 * b..192 * (b + 1)]);
        seq[192 * nb + 16 * b..192 * nb + 16 * (b + 1)].copy_from_slice(&blk[192..208]);
        seq[208 * nb + 2 * b..208 * nb + 2 * (b + 1)].copy_from_slice(&blk[208..]);
    }
    dst.copy_from_slice(&seq);
    dst.rotate_right(rot);
}

/// [`split_q6_k`] undone.
fn join_q6_k(src: &[u8], dst: &mut [u8], rot: usize) {
    let nb = src.len() / 210;
    let mut seq = src.to_vec();
    seq.rotate_left(rot);
    for (b, blk) in dst.chunks_exact_mut(210).enumerate() {
        let q = unpack_q6_k_pairs(&seq[192 * b..192 * (b + 1)]);
        let blk: &mut [u8; 210] = blk.try_into().expect("210-byte chunks");
        pack_q6_k(&q, blk);
        blk[192..208].copy_from_slice(&seq[192 * nb + 16 * b..192 * nb + 16 * (b + 1)]);
        blk[208..].copy_from_slice(&seq[208 * nb + 2 * b..208 * nb + 2 * (b + 1)]);
    }
}

/// Where the high bit pair of element `i` (0..32) of sub-block `2p + u` lies in its pair's
/// 16 bytes: (byte, shift).
fn q6_k_high_at(u: usize, i: usize) -> (usize, usize) {
    let k = i / 4;
    (4 * (k % 4) + i % 4, 2 * (2 * u + k / 4))
}

/// A block's 256 six-bit quants (0..64, element order) as its four 48-byte pairs.
fn pack_q6_k_pairs(q: &[u8; 256], out: &mut [u8]) {
    out.fill(0);
    for (p, pair) in out.chunks_exact_mut(48).enumerate() {
        for u in 0..2 {
            for i in 0..32 {
                let v = q[64 * p + 32 * u + i];
                pair[i] |= (v & 0x0f) << (4 * u);
                let (byte, shift) = q6_k_high_at(u, i);
                pair[32 + byte] |= (v >> 4) << shift;
            }
        }
    }
}

/// [`pack_q6_k_pairs`] undone.
fn unpack_q6_k_pairs(bytes: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for (p, pair) in bytes.chunks_exact(48).enumerate() {
        for u in 0..2 {
            for i in 0..32 {
                let (byte, shift) = q6_k_high_at(u, i);
                q[64 * p + 32 * u + i] =
                    ((pair[i] >> (4 * u)) & 0x0f) | (((pair[32 + byte] >> shift) & 3) << 4);
            }
        }
    }
    q
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

    /// A row of `k` elements of `q` quantized from a sawtooth with outliers, and its
    /// split row for the device address `addr`.
    fn quantized_and_split(q: QType, k: usize, addr: u64) -> (Vec<u8>, Vec<u8>) {
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * if i % 61 == 0 { 0.3 } else { 0.03 })
            .collect();
        let mut row = vec![0u8; q.row_bytes(k).unwrap()];
        quantize_row(q, &x, &mut row).unwrap();
        let mut split = vec![0u8; row.len()];
        split_row(q, &row, &mut split, addr);
        (row, split)
    }

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
                let (row, split) = quantized_and_split(q, k, 0);
                for b in 0..blocks {
                    let quants = &row[bb * b + h..bb * (b + 1)];
                    assert_eq!(&split[qb * b..qb * (b + 1)], quants, "{q} block {b} quants");
                    let head = &split[qb * blocks + h * b..qb * blocks + h * (b + 1)];
                    assert_eq!(head, &row[bb * b..bb * b + h], "{q} block {b} header");
                }
                let mut back = vec![0u8; row.len()];
                join_row(q, &split, &mut back, 0);
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
        // Q5_K: 176-byte blocks, any whole number of them
        assert!(splittable(QType::Q5_K, 256) && splittable(QType::Q5_K, 11008));
        assert!(!splittable(QType::Q5_K, 128) && !splittable_at(QType::Q5_K, 4096, 8));
        // Q6_K: any row of 8 blocks or more, whatever its bytes
        for k in [2048, 2304, 4096, 11008] {
            assert!(splittable(QType::Q6_K, k), "{k}");
        }
        for k in [0, 256, 1792, 2100] {
            assert!(!splittable(QType::Q6_K, k), "{k}");
        }
        assert!(splittable_at(QType::Q6_K, 11008, 6) && !splittable_at(QType::Q6_K, 11008, 7));
        assert!(splittable_at(QType::Q4_0, 4096, 32) && !splittable_at(QType::Q4_0, 4096, 2));
    }

    /// A Q5_K split row, read as the device reads it: sub-block j's element i from its
    /// block's quant bytes and its fifth bit from the word of sub-block j, the header at
    /// its place; and joining gives ggml's row back.
    #[test]
    fn q5_k_split_rows_hold_each_quant_where_the_kernels_read_it() {
        let q = QType::Q5_K;
        for blocks in [1usize, 3, 16, 43] {
            let k = 256 * blocks;
            let (row, split) = quantized_and_split(q, k, 0);
            for b in 0..blocks {
                let blk = &row[176 * b..176 * (b + 1)];
                assert_eq!(
                    &split[160 * blocks + 16 * b..160 * blocks + 16 * (b + 1)],
                    &blk[..16]
                );
                for j in 0..8 {
                    for i in 0..32 {
                        // ggml: nibble j % 2 of qs[32 (j / 2) + i], bit j of qh[i]
                        let want = ((blk[48 + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15)
                            | (((blk[16 + i] >> j) & 1) << 4);
                        let lo = (split[128 * b + 32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
                        let word = 128 * blocks + 32 * b + 4 * j;
                        let hi = (split[word + i % 4] >> (i / 4)) & 1;
                        assert_eq!(lo | (hi << 4), want, "block {b} sub-block {j} element {i}");
                    }
                }
            }
            let mut back = vec![0u8; row.len()];
            join_row(q, &split, &mut back, 0);
            assert_eq!(back, row, "{blocks} blocks");
        }
    }

    /// A Q6_K split row, read as the device reads it: from the rotated address, sub-block
    /// j's element i at its pair's nibble and high bits, its scale, the block's d; and
    /// joining gives ggml's row back. Every rotation from 0 to 14.
    #[test]
    fn q6_k_split_rows_hold_each_quant_where_the_kernels_read_it() {
        let q = QType::Q6_K;
        for (blocks, addr) in [
            (8usize, 0u64),
            (43, 6),
            (43, 2),
            (9, 14),
            (16, 10),
            (11, 4),
            (12, 8),
            (10, 12),
        ] {
            let k = 256 * blocks;
            let (row, split) = quantized_and_split(q, k, addr);
            let rot = rotation(q, addr);
            assert_eq!((addr as usize + rot) % 16, 0);
            let len = row.len();
            let at = |logical: usize| split[(logical + rot) % len];
            for b in 0..blocks {
                let blk = &row[210 * b..210 * (b + 1)];
                let want = unpack_q6_k(&blk[..128], &blk[128..192]);
                for j in 0..8 {
                    let (p, u) = (j / 2, j % 2);
                    for i in 0..32 {
                        let base = 192 * b + 48 * p;
                        let lo = (at(base + i) >> (4 * u)) & 0x0f;
                        // element 4k + r in byte 4 (k % 4) + r at bits 2 (2u + k / 4)
                        let (byte, shift) = (4 * (i / 4 % 4) + i % 4, 2 * (2 * u + i / 16));
                        let hi = (at(base + 32 + byte) >> shift) & 3;
                        let got = (lo | (hi << 4)) as i8 - 32;
                        assert_eq!(got, want[32 * j + i], "block {b} sub-block {j} element {i}");
                    }
                }
                for s in 0..16 {
                    assert_eq!(
                        at(192 * blocks + 16 * b + s),
                        blk[192 + s],
                        "block {b} scale {s}"
                    );
                }
                assert_eq!(
                    [at(208 * blocks + 2 * b), at(208 * blocks + 2 * b + 1)],
                    blk[208..]
                );
            }
            // the quants start 16-byte aligned; only d's wrap around (8 blocks or more)
            assert!(rot <= 2 * blocks);
            let mut back = vec![0u8; len];
            join_row(q, &split, &mut back, addr);
            assert_eq!(back, row, "{blocks} blocks at {addr}");
        }
    }
}
