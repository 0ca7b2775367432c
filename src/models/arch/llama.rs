//! Llama 2 / Llama 3: RMSNorm, rope (NeoX pairing, as HF stores it), grouped-query
//! attention without biases, a SwiGLU MLP; Llama 3's rope frequency scaling comes from
//! the config. The HF tensor names defined here are shared by the Llama family
//! (Mistral, Qwen2, Qwen3).

use super::{HfKeys, MlpKind, NormKind, Positions, Source, Spec};
use crate::models::arch::role::Role;

/// Llama.
pub const SPEC: Spec = Spec {
    name: "llama",
    hf_model_types: &["llama"],
    gguf_arch: "llama",
    norm: NormKind::Rms,
    mlp: MlpKind::SwiGlu,
    positions: Positions::Rope,
    qkv_bias: false,
    out_bias: false,
    mlp_bias: false,
    qk_norm: false,
    experts: None,
    hf_acts: &["silu"],
    hf_keys: HfKeys::LLAMA,
    hf_source,
    hf_optional_prefix: "",
    hf_ignored_suffixes: &[".rotary_emb.inv_freq"],
    gguf_fused_qkv: false,
    gguf_rope_permuted: true,
};

/// The HF tensor of `role` in a Llama-family checkpoint
/// (`model.layers.0.self_attn.q_proj.weight`).
pub fn hf_source(role: Role, layer: Option<usize>) -> Source {
    Source::whole(hf_name(role, layer))
}

fn hf_name(role: Role, layer: Option<usize>) -> String {
    let l = layer.unwrap_or(0);
    let at = |s: &str| format!("model.layers.{l}.{s}");
    match role {
        Role::TokEmbd => "model.embed_tokens.weight".into(),
        Role::PosEmbd => "model.embed_positions.weight".into(),
        Role::OutNorm => "model.norm.weight".into(),
        Role::OutNormB => "model.norm.bias".into(),
        Role::Output => "lm_head.weight".into(),
        Role::AttnNorm => at("input_layernorm.weight"),
        Role::AttnNormB => at("input_layernorm.bias"),
        Role::AttnQ => at("self_attn.q_proj.weight"),
        Role::AttnK => at("self_attn.k_proj.weight"),
        Role::AttnV => at("self_attn.v_proj.weight"),
        Role::AttnQB => at("self_attn.q_proj.bias"),
        Role::AttnKB => at("self_attn.k_proj.bias"),
        Role::AttnVB => at("self_attn.v_proj.bias"),
        Role::AttnQNorm => at("self_attn.q_norm.weight"),
        Role::AttnKNorm => at("self_attn.k_norm.weight"),
        Role::AttnOut => at("self_attn.o_proj.weight"),
        Role::AttnOutB => at("self_attn.o_proj.bias"),
        Role::FfnNorm => at("post_attention_layernorm.weight"),
        Role::FfnNormB => at("post_attention_layernorm.bias"),
        Role::FfnGate => at("mlp.gate_proj.weight"),
        Role::FfnUp => at("mlp.up_proj.weight"),
        Role::FfnUpB => at("mlp.up_proj.bias"),
        Role::FfnDown => at("mlp.down_proj.weight"),
        Role::FfnDownB => at("mlp.down_proj.bias"),
        // Qwen-MoE names; `{e}` is the expert (one tensor each in HF checkpoints)
        Role::FfnGateInp => at("mlp.gate.weight"),
        Role::FfnGateExps => at("mlp.experts.{e}.gate_proj.weight"),
        Role::FfnUpExps => at("mlp.experts.{e}.up_proj.weight"),
        Role::FfnDownExps => at("mlp.experts.{e}.down_proj.weight"),
    }
}
