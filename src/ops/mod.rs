//! The op builders and CPU reference kernels. The op set itself ([`Op`] and its family
//! sub-enums) lives in the graph layer ([`crate::graph::op`]) and is re-exported here.
//!
//! One file per op family holds the builder (an `impl Graph` block: shape and dtype
//! inference with typed errors) and the CPU reference kernel:
//!
//! | file | ops |
//! | --- | --- |
//! | [`view`] | view_1d..4d, reshape, permute, transpose, after |
//! | [`get_rows`] | get_rows |
//! | [`binary`] | [`BinaryOp`]: add, mul (broadcasting the second operand) |
//! | [`unary`] | scale, [`UnaryOp`]: silu, gelu, tanh, sigmoid, log_sigmoid |
//! | [`norm`] | rms_norm, norm |
//! | [`mul_mat`] | mul_mat |
//! | [`mul_mat_id`] | mul_mat_id (the experts' products of a mixture of experts) |
//! | [`rope`] | rope |
//! | [`cpy`] | cpy, cont / cast, set_rows |
//! | [`softmax`] | diag_mask_inf, soft_max |
//! | [`argmax`] | argmax |
//! | [`topk`] | top_k |
//! | [`attention`] | flash_attn_ext, paged_attn ([`attention::paged`]) |
//! | [`collective`] | all_reduce |
//!
//! [`simd`] holds the x86-64 pieces the fast CPU kernels share (feature check, vector exp).

pub mod argmax;
pub mod attention;
pub mod binary;
pub mod collective;
pub mod cpy;
pub mod get_rows;
pub mod host;
pub mod mul_mat;
pub mod mul_mat_id;
pub mod norm;
pub mod rope;
pub(crate) mod simd;
pub mod softmax;
pub mod topk;
pub mod unary;
pub mod view;

pub use crate::graph::{
    AllReduceParams, BinaryOp, CopyOp, FlashAttnParams, Llama3Scaling, MaskOp, NormOp, Op, OpKind,
    PagedAttnParams, RopeMode, RopeParams, UnaryOp, ViewOp,
};

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

/// Checks that `op` may write `dtype` into operand `operand`: every dtype but the block
/// types graft reads only (the lattice i-quants, which ggml quantizes with an importance
/// matrix; see [`crate::quant::QType::can_quantize`]).
pub(crate) fn expect_quantizable(
    op: &'static str,
    operand: &str,
    dtype: crate::graph::DType,
) -> crate::Result<()> {
    match dtype.quant() {
        Some(q) if !q.can_quantize() => Err(crate::Error::DType {
            op,
            operand: operand.to_string(),
            found: dtype,
            expected: format!(
                "a dtype graft can write: {q} is read-only (ggml quantizes it only with an \
                 importance matrix); write f32, f16, bf16 or another block type"
            ),
        }),
        Some(_) | None => Ok(()),
    }
}

/// Checks that operand `operand` of `op` is a float or a quantized block type (weights,
/// embedding tables, caches, conversions).
pub(crate) fn expect_float_or_quant(
    op: &'static str,
    operand: &str,
    found: crate::graph::DType,
) -> crate::Result<()> {
    if found.is_float() || found.quant().is_some() {
        Ok(())
    } else {
        Err(crate::Error::DType {
            op,
            operand: operand.to_string(),
            found,
            expected: "f32, f16, bf16 or a quantized type".into(),
        })
    }
}
