//! Element types. A dtype knows its block size (elements per block) and the bytes per
//! block: plain types have blocks of one element; the quantized types of
//! [`crate::quant`] (ggml's block formats) have blocks of 32 or 256 elements, and a
//! tensor of one has `nb[0]` equal to the block's bytes and `ne[0]` a multiple of the
//! block size.

use std::fmt;

use crate::quant::QType;

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
    /// A ggml quantized block type (weights, and Q8_1 activations).
    Quant(QType),
}

impl DType {
    /// The plain (one element per block) dtypes, in declaration order.
    pub const PLAIN: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::I32];
    /// The floating-point dtypes.
    pub const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];
    /// `Q4_0`.
    pub const Q4_0: DType = DType::Quant(QType::Q4_0);
    /// `Q4_1`.
    pub const Q4_1: DType = DType::Quant(QType::Q4_1);
    /// `Q5_0`.
    pub const Q5_0: DType = DType::Quant(QType::Q5_0);
    /// `Q5_1`.
    pub const Q5_1: DType = DType::Quant(QType::Q5_1);
    /// `Q8_0`.
    pub const Q8_0: DType = DType::Quant(QType::Q8_0);
    /// `Q8_1`.
    pub const Q8_1: DType = DType::Quant(QType::Q8_1);
    /// `Q4_K`.
    pub const Q4_K: DType = DType::Quant(QType::Q4_K);
    /// `Q5_K`.
    pub const Q5_K: DType = DType::Quant(QType::Q5_K);
    /// `Q6_K`.
    pub const Q6_K: DType = DType::Quant(QType::Q6_K);
    /// `Q2_K`.
    pub const Q2_K: DType = DType::Quant(QType::Q2_K);
    /// `Q3_K`.
    pub const Q3_K: DType = DType::Quant(QType::Q3_K);
    /// `IQ4_NL`.
    pub const IQ4_NL: DType = DType::Quant(QType::IQ4_NL);
    /// `IQ4_XS`.
    pub const IQ4_XS: DType = DType::Quant(QType::IQ4_XS);
    /// `IQ2_XXS`.
    pub const IQ2_XXS: DType = DType::Quant(QType::IQ2_XXS);
    /// `IQ2_XS`.
    pub const IQ2_XS: DType = DType::Quant(QType::IQ2_XS);
    /// `IQ2_S`.
    pub const IQ2_S: DType = DType::Quant(QType::IQ2_S);
    /// `IQ3_XXS`.
    pub const IQ3_XXS: DType = DType::Quant(QType::IQ3_XXS);
    /// `IQ3_S`.
    pub const IQ3_S: DType = DType::Quant(QType::IQ3_S);
    /// `IQ1_S`.
    pub const IQ1_S: DType = DType::Quant(QType::IQ1_S);
    /// `IQ1_M`.
    pub const IQ1_M: DType = DType::Quant(QType::IQ1_M);
    /// `TQ1_0`.
    pub const TQ1_0: DType = DType::Quant(QType::TQ1_0);
    /// `TQ2_0`.
    pub const TQ2_0: DType = DType::Quant(QType::TQ2_0);

    /// Every dtype: the plain ones, then the quantized ones in ggml's order.
    pub fn all() -> impl Iterator<Item = DType> {
        DType::PLAIN
            .into_iter()
            .chain(QType::ALL.into_iter().map(DType::Quant))
    }

    /// Elements per block (1 for every plain type; 32 or 256 for block-quantized types).
    pub const fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => 1,
            DType::Quant(q) => q.block_size(),
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Quant(q) => q.block_bytes(),
        }
    }

    /// Bytes of a row of `ne0` elements (`ne0` must be a multiple of the block size).
    pub const fn row_bytes(self, ne0: usize) -> usize {
        ne0 / self.block_size() * self.block_bytes()
    }

    /// Whether the type holds floating-point values element by element.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// The quantized block type, if this is one.
    pub const fn quant(self) -> Option<QType> {
        match self {
            DType::Quant(q) => Some(q),
            DType::F32 | DType::F16 | DType::BF16 | DType::I32 => None,
        }
    }

    /// The lower-case name used in dumps and on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::Quant(q) => q.name(),
        }
    }

    /// Parses a name as printed by [`DType::name`] (case-insensitive).
    pub fn parse(s: &str) -> Option<DType> {
        DType::all().find(|d| d.name().eq_ignore_ascii_case(s))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
