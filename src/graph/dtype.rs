//! Element types. A dtype knows its block size (elements per block) and the bytes per
//! block, so block-quantized types can be added later without touching stride logic.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (the upper half of an f32).
    BF16,
    /// 32-bit signed integer (token ids, positions, argmax results).
    I32,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];
    /// The floating-point dtypes.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Elements per block (1 for every plain type; > 1 for block-quantized types).
    pub const fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Bytes of a row of `ne0` elements (`ne0` must be a multiple of the block size).
    pub const fn row_bytes(self, ne0: usize) -> usize {
        ne0 / self.block_size() * self.block_bytes()
    }

    /// Whether the type holds floating-point values.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// The lower-case name used in dumps and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
        }
    }

    /// Parses a name as printed by [`DType::name`] (case-insensitive).
    pub fn parse(s: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
