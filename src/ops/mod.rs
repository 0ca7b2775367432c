//! The op set. One [`Op`] enum with typed parameters is the dispatch table: backends match
//! it with no catch-all arm, so adding an op makes the compiler list every place to touch.
//!
//! One file per op family holds the builder (an `impl Graph` block: shape and dtype
//! inference with typed errors) and the CPU reference kernel:
//!
//! | file | ops |
//! | --- | --- |
//! | [`view`] | view_1d..4d, reshape, permute, transpose, after |
//! | [`get_rows`] | get_rows |
//! | [`binary`] | add, mul (broadcasting the second operand) |
//! | [`unary`] | scale, silu, gelu |
//! | [`norm`] | rms_norm, norm |
//! | [`mul_mat`] | mul_mat |
//! | [`rope`] | rope |
//! | [`cpy`] | cpy, cont / cast, set_rows |
//! | [`softmax`] | diag_mask_inf, soft_max |
//! | [`argmax`] | argmax |

pub mod argmax;
pub mod binary;
pub mod cpy;
pub mod get_rows;
pub mod host;
pub mod mul_mat;
pub mod norm;
pub mod rope;
pub mod softmax;
pub mod unary;
pub mod view;

pub use rope::{Llama3Scaling, RopeMode, RopeParams};

/// An operation and its parameters. Sources live in [`Tensor::src`](crate::graph::Tensor).
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// No computation: an input, weight or state tensor.
    Leaf,
    /// A strided window into `src[0]` at a byte offset (view_1d..view_4d).
    View,
    /// The same memory as `src[0]` (contiguous) with another shape.
    Reshape,
    /// `src[0]` with its dimensions reordered: result dim `axes[i]` is source dim `i`.
    Permute { axes: [usize; 4] },
    /// `src[0]` with dims 0 and 1 swapped.
    Transpose,
    /// The same memory and layout as `src[0]`, ordered after every other source
    /// (reads a KV cache after the writes into it).
    After,
    /// Rows of `src[0]` picked by the I32 ids of `src[1]` (embedding lookup). Result F32.
    GetRows,
    /// `src[0] + src[1]`, `src[1]` broadcast by `y[i % ky]` over all four dims.
    Add,
    /// `src[0] * src[1]`, broadcast like [`Op::Add`].
    Mul,
    /// `src[0] * s`.
    Scale { s: f32 },
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation.
    Gelu,
    /// `x / sqrt(mean(x^2) + eps)` over each row.
    RmsNorm { eps: f32 },
    /// `(x - mean) / sqrt(var + eps)` over each row (LayerNorm without affine).
    Norm { eps: f32 },
    /// ggml's mul_mat: contracts `src[0]` [k, m, a2, a3] with `src[1]` [k, n, b2, b3]
    /// over dim 0, giving F32 [m, n, b2, b3]; `src[0]` is broadcast over dims 2 and 3.
    MulMat,
    /// Rotary position embedding; positions are the I32 `src[1]`.
    Rope(RopeParams),
    /// Copies `src[0]` into the memory of `src[1]` (a view of a state tensor), converting
    /// dtypes; elements are matched in row-major order. The result is a view of `src[1]`.
    Cpy,
    /// A fresh contiguous copy of `src[0]`, converted to the node's dtype (cont / cast).
    Cont,
    /// Writes row `r` of `src[0]` into row `src[1][r]` of `src[2]` (a state tensor or a
    /// view of one), converting dtypes. The result is a view of all of `src[2]`.
    SetRows,
    /// Sets `x[i0, i1]` to -inf where `i0 > n_past + i1` (causal mask).
    DiagMaskInf { n_past: usize },
    /// Softmax over each row of `src[0] * scale (+ src[1])`, with an optional additive
    /// mask `src[1]` broadcast over rows and batches.
    SoftMax { scale: f32 },
    /// Index of the largest element of each row, as I32.
    Argmax,
}

/// Coarse grouping of ops, used to colour graph dumps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    /// Inputs, weights, state.
    Leaf,
    /// No computation.
    View,
    /// Copies, conversions, gathers and scatters.
    Data,
    /// Elementwise arithmetic.
    Elementwise,
    /// Row-wise reductions and normalizations.
    Row,
    /// Matrix products.
    MatMul,
}

impl Op {
    /// The op's name in dumps and error messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Leaf => "leaf",
            Op::View => "view",
            Op::Reshape => "reshape",
            Op::Permute { .. } => "permute",
            Op::Transpose => "transpose",
            Op::After => "after",
            Op::GetRows => "get_rows",
            Op::Add => "add",
            Op::Mul => "mul",
            Op::Scale { .. } => "scale",
            Op::Silu => "silu",
            Op::Gelu => "gelu",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Norm { .. } => "norm",
            Op::MulMat => "mul_mat",
            Op::Rope(_) => "rope",
            Op::Cpy => "cpy",
            Op::Cont => "cont",
            Op::SetRows => "set_rows",
            Op::DiagMaskInf { .. } => "diag_mask_inf",
            Op::SoftMax { .. } => "soft_max",
            Op::Argmax => "argmax",
        }
    }

    /// The op's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Leaf => OpKind::Leaf,
            Op::View | Op::Reshape | Op::Permute { .. } | Op::Transpose | Op::After => OpKind::View,
            Op::GetRows | Op::Cpy | Op::Cont | Op::SetRows => OpKind::Data,
            Op::Add | Op::Mul | Op::Scale { .. } | Op::Silu | Op::Gelu => OpKind::Elementwise,
            Op::RmsNorm { .. }
            | Op::Norm { .. }
            | Op::Rope(_)
            | Op::DiagMaskInf { .. }
            | Op::SoftMax { .. }
            | Op::Argmax => OpKind::Row,
            Op::MulMat => OpKind::MatMul,
        }
    }

    /// Whether this is a leaf.
    pub fn is_leaf(&self) -> bool {
        matches!(self, Op::Leaf)
    }

    /// Whether the op only reinterprets memory (no kernel runs for it).
    pub fn is_view(&self) -> bool {
        self.kind() == OpKind::View
    }

    /// Whether a backend must run a kernel for this node.
    pub fn computes(&self) -> bool {
        !self.is_leaf() && !self.is_view()
    }

    /// Whether the result may be written over `src[0]`'s memory when the layouts match:
    /// every output element depends only on the input elements of the same row that
    /// the kernel has read before writing it.
    pub fn can_inplace(&self) -> bool {
        match self {
            Op::Add
            | Op::Mul
            | Op::Scale { .. }
            | Op::Silu
            | Op::Gelu
            | Op::RmsNorm { .. }
            | Op::Norm { .. }
            | Op::Rope(_)
            | Op::DiagMaskInf { .. }
            | Op::SoftMax { .. } => true,
            Op::Leaf
            | Op::View
            | Op::Reshape
            | Op::Permute { .. }
            | Op::Transpose
            | Op::After
            | Op::GetRows
            | Op::MulMat
            | Op::Cpy
            | Op::Cont
            | Op::SetRows
            | Op::Argmax => false,
        }
    }

    /// The op's parameters, formatted for dumps (empty when it has none).
    pub fn params(&self) -> String {
        match self {
            Op::Permute { axes } => format!("axes={axes:?}"),
            Op::Scale { s } => format!("s={s}"),
            Op::RmsNorm { eps } | Op::Norm { eps } => format!("eps={eps:e}"),
            Op::Rope(p) => p.to_string(),
            Op::DiagMaskInf { n_past } => format!("n_past={n_past}"),
            Op::SoftMax { scale } => format!("scale={scale}"),
            Op::Leaf
            | Op::View
            | Op::Reshape
            | Op::Transpose
            | Op::After
            | Op::GetRows
            | Op::Add
            | Op::Mul
            | Op::Silu
            | Op::Gelu
            | Op::MulMat
            | Op::Cpy
            | Op::Cont
            | Op::SetRows
            | Op::Argmax => String::new(),
        }
    }
}

/// Checks that operand `operand` of `op` has one of the accepted dtypes.
pub(crate) fn expect_dtype(
    op: &'static str,
    operand: &str,
    found: crate::graph::DType,
    accepted: &[crate::graph::DType],
) -> crate::Result<()> {
    if accepted.contains(&found) {
        Ok(())
    } else {
        let names: Vec<&str> = accepted.iter().map(|d| d.name()).collect();
        Err(crate::Error::DType {
            op,
            operand: operand.to_string(),
            found,
            expected: names.join(" or "),
        })
    }
}
