//! Mixtral (Mixtral-8x7B, 8x22B): Mistral's attention (a sliding window when the config
//! has one), and in every block a mixture of SwiGLU experts in place of the MLP: a
//! router `block_sparse_moe.gate` scores the `num_local_experts` experts, softmax over
//! all of them, the `num_experts_per_tok` best are run (`block_sparse_moe.experts.{e}`:
//! `w1` the gate, `w3` the up and `w2` the down projection, of width
//! `intermediate_size`) and their weights renormalised to sum to 1. llama.cpp writes
//! Mixtral as a `llama` file with `llama.expert_count` and the experts stacked into
//! `ffn_{gate,up,down}_exps`.

use super::{ExpertKeys, Source, Spec};
use crate::models::arch::role::Role;

/// Mixtral: Mistral with experts.
pub const SPEC: Spec = Spec {
    name: "mixtral",
    hf_model_types: &["mixtral"],
    hf_source,
    experts: Some(ExpertKeys {
        hf_count: &["num_local_experts"],
        hf_used: "num_experts_per_tok",
        hf_norm: None,
        gguf_ff: "feed_forward_length",
    }),
    ..super::mistral::SPEC
};

/// The HF tensor of `role`: Llama's names, Mixtral's for the router and the experts
/// (`{e}` is the expert).
fn hf_source(role: Role, layer: Option<usize>) -> Source {
    let at = |s: &str| {
        Source::whole(format!(
            "model.layers.{}.block_sparse_moe.{s}",
            layer.unwrap_or(0)
        ))
    };
    match role {
        Role::FfnGateInp => at("gate.weight"),
        Role::FfnGateExps => at("experts.{e}.w1.weight"),
        Role::FfnUpExps => at("experts.{e}.w3.weight"),
        Role::FfnDownExps => at("experts.{e}.w2.weight"),
        Role::TokEmbd
        | Role::PosEmbd
        | Role::AttnNorm
        | Role::AttnNormB
        | Role::AttnQ
        | Role::AttnK
        | Role::AttnV
        | Role::AttnQB
        | Role::AttnKB
        | Role::AttnVB
        | Role::AttnQNorm
        | Role::AttnKNorm
        | Role::AttnOut
        | Role::AttnOutB
        | Role::FfnNorm
        | Role::FfnNormB
        | Role::FfnGate
        | Role::FfnUp
        | Role::FfnUpB
        | Role::FfnDown
        | Role::FfnDownB
        | Role::OutNorm
        | Role::OutNormB
        | Role::Output => super::llama::hf_source(role, layer),
    }
}
