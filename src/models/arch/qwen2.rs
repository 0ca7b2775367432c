//! Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (rope theta 1e6 in
//! the published models, read from the config).

use super::{HfKeys, MlpKind, NormKind, Positions, Spec};

/// Qwen2.
pub const SPEC: Spec = Spec {
    name: "qwen2",
    hf_model_types: &["qwen2"],
    gguf_arch: "qwen2",
    norm: NormKind::Rms,
    mlp: MlpKind::SwiGlu,
    positions: Positions::Rope,
    qkv_bias: true,
    out_bias: false,
    mlp_bias: false,
    qk_norm: false,
    hf_acts: &["silu"],
    hf_keys: HfKeys::LLAMA,
    hf_source: super::llama::hf_source,
    hf_optional_prefix: "",
    hf_ignored_suffixes: &[".rotary_emb.inv_freq"],
    gguf_fused_qkv: false,
    gguf_rope_permuted: false,
};
