//! Mixtral (Mixtral-8x7B, 8x22B): Mistral's attention (a sliding window when the config
//! has one), and in every block a mixture of SwiGLU experts in place of the MLP: a
//! router `block_sparse_moe.gate` scores the `num_local_experts` experts, softmax over
//! all of them, the `num_experts_per_tok` best are run (`block_sparse_moe.experts.{e}`:
//! `w1` the gate, `w3` the up and `w2` the down projection, of width
//! `intermediate_size`) and their weights renormalised to sum to 1. llama.cpp writes
//! Mixtral as a `llama` file with `llama.expert_count` and the experts stacked into
//! `ffn_{gate,up,down}_exps`.

use super::{ExpertKeys, Source, Spec};
use crate::models::arch::role::{ExpertPart, Role};

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
        let l = layer.unwrap_or(0);
        Source::whole(format!("model.layers.{l}.block_sparse_moe.{s}"))
    };
    match role.expert_part() {
        Some(ExpertPart::Router) => at("gate.weight"),
        Some(ExpertPart::Gate) => at("experts.{e}.w1.weight"),
        Some(ExpertPart::Up) => at("experts.{e}.w3.weight"),
        Some(ExpertPart::Down) => at("experts.{e}.w2.weight"),
        None => super::llama::hf_source(role, layer),
    }
}
