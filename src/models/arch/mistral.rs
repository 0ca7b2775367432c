//! Mistral: Llama with sliding-window attention. The window (`sliding_window` in the
//! config, `llama.attention.sliding_window` in GGUF) limits what a query sees: key `j`
//! is visible to query `i` when `i - window < j <= i`. llama.cpp writes Mistral as a
//! `llama` GGUF file.

use super::{HfKeys, MlpKind, NormKind, Positions, Spec};

/// Mistral.
pub const SPEC: Spec = Spec {
    name: "mistral",
    hf_model_types: &["mistral"],
    gguf_arch: "llama",
    norm: NormKind::Rms,
    mlp: MlpKind::SwiGlu,
    positions: Positions::Rope,
    qkv_bias: false,
    out_bias: false,
    mlp_bias: false,
    qk_norm: false,
    hf_acts: &["silu"],
    hf_keys: HfKeys::LLAMA,
    hf_source: super::llama::hf_source,
    hf_optional_prefix: "",
    hf_ignored_suffixes: &[".rotary_emb.inv_freq"],
    gguf_fused_qkv: false,
    gguf_rope_permuted: true,
};
