//! Qwen3 (dense): Llama with a per-head RMSNorm on q and k (weights `[head_dim]`, applied
//! before rope) and an explicit `head_dim` that need not be `hidden / heads`; tied or
//! untied embeddings.

use super::Spec;

/// Qwen3: Llama with per-head q/k norms; llama.cpp's `qwen3` files keep HF's (NeoX) rope
/// rows.
pub const SPEC: Spec = Spec {
    name: "qwen3",
    hf_model_types: &["qwen3"],
    gguf_arch: "qwen3",
    qk_norm: true,
    gguf_rope_permuted: false,
    ..super::llama::SPEC
};
