//! Qwen3 (dense): Llama with a per-head RMSNorm on q and k (weights `[head_dim]`, applied
//! before rope) and an explicit `head_dim` that need not be `hidden / heads`; tied or
//! untied embeddings.

use super::{HfKeys, MlpKind, NormKind, Positions, Spec};

/// Qwen3.
pub const SPEC: Spec = Spec {
    name: "qwen3",
    hf_model_types: &["qwen3"],
    gguf_arch: "qwen3",
    norm: NormKind::Rms,
    mlp: MlpKind::SwiGlu,
    positions: Positions::Rope,
    qkv_bias: false,
    out_bias: false,
    mlp_bias: false,
    qk_norm: true,
    hf_acts: &["silu"],
    hf_keys: HfKeys::LLAMA,
    hf_source: super::llama::hf_source,
    hf_optional_prefix: "",
    hf_ignored_suffixes: &[".rotary_emb.inv_freq"],
    gguf_fused_qkv: false,
    gguf_rope_permuted: false,
};
