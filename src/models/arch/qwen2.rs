//! Qwen2 / Qwen2.5: Llama with biases on the q, k and v projections (rope theta 1e6 in
//! the published models, read from the config).

use super::Spec;

/// Qwen2: Llama with q/k/v biases; llama.cpp's `qwen2` files keep HF's (NeoX) rope rows.
pub const SPEC: Spec = Spec {
    name: "qwen2",
    hf_model_types: &["qwen2"],
    gguf_arch: "qwen2",
    qkv_bias: true,
    gguf_rope_permuted: false,
    ..super::llama::SPEC
};
