//! The tensor type ids of ggml ([`GgmlType`]) with their block layout, so the byte size of a
//! tensor of any known type can be checked without knowing how to decode it.

use std::fmt;

/// Elements per block of the k-quant and most i-quant types.
const QK_K: u32 = 256;

/// A ggml tensor type as stored in a GGUF tensor info (a `u32` id).
///
/// Every type is stored as blocks: `block_size` elements take `block_bytes` bytes, and a
/// tensor's first dimension must be a multiple of `block_size`. Ids that ggml has removed
/// (4, 5, 31..=33, 36..=38) are unknown here, as are ids past the last listed one.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

impl GgmlType {
    /// Every known type, in id order.
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
        GgmlType::NVFP4,
        GgmlType::Q1_0,
    ];

    /// The type with this id, or `None` for an unknown or removed id.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.id() == id)
    }

    /// The id stored in GGUF files.
    pub fn id(self) -> u32 {
        self.layout().0
    }

    /// The name ggml gives the type (`"Q4_K"`, `"BF16"`).
    pub fn name(self) -> &'static str {
        self.layout().1
    }

    /// Elements per block (1 for the plain types).
    pub fn block_size(self) -> u32 {
        self.layout().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u32 {
        self.layout().3
    }

    /// The bytes of a row of `n` elements, or `None` when `n` is not a multiple of the
    /// block size or the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let bs = u64::from(self.block_size());
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(u64::from(self.block_bytes()))
    }

    /// (id, name, block size, block bytes).
    fn layout(self) -> (u32, &'static str, u32, u32) {
        use GgmlType as T;
        match self {
            T::F32 => (0, "F32", 1, 4),
            T::F16 => (1, "F16", 1, 2),
            T::Q4_0 => (2, "Q4_0", 32, 2 + 16),
            T::Q4_1 => (3, "Q4_1", 32, 2 + 2 + 16),
            T::Q5_0 => (6, "Q5_0", 32, 2 + 4 + 16),
            T::Q5_1 => (7, "Q5_1", 32, 2 + 2 + 4 + 16),
            T::Q8_0 => (8, "Q8_0", 32, 2 + 32),
            // gguf-py's size (the older block of f32 d and s), which the files it writes
            // use; ggml's block is 36 bytes today. No model file stores Q8_1, an
            // activation format (graft does not load it as a weight).
            T::Q8_1 => (9, "Q8_1", 32, 4 + 4 + 32),
            T::Q2_K => (10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            T::Q3_K => (11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            T::Q4_K => (12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
            T::Q5_K => (13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            T::Q6_K => (14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            T::Q8_K => (15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
            T::IQ2_XXS => (16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
            T::IQ2_XS => (17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
            T::IQ3_XXS => (18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
            T::IQ1_S => (19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
            T::IQ4_NL => (20, "IQ4_NL", 32, 2 + 16),
            T::IQ3_S => (21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            T::IQ2_S => (22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
            T::IQ4_XS => (23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            T::I8 => (24, "I8", 1, 1),
            T::I16 => (25, "I16", 1, 2),
            T::I32 => (26, "I32", 1, 4),
            T::I64 => (27, "I64", 1, 8),
            T::F64 => (28, "F64", 1, 8),
            T::IQ1_M => (29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            T::BF16 => (30, "BF16", 1, 2),
            T::TQ1_0 => (34, "TQ1_0", QK_K, 2 + 4 * 13),
            T::TQ2_0 => (35, "TQ2_0", QK_K, 2 + 64),
            T::MXFP4 => (39, "MXFP4", 32, 1 + 16),
            T::NVFP4 => (40, "NVFP4", 64, 4 + 32),
            T::Q1_0 => (41, "Q1_0", 128, 2 + 16),
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
    }

    #[test]
    fn row_bytes_needs_whole_blocks() {
        assert_eq!(GgmlType::Q4_K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None);
    }
}
