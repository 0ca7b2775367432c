//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in every block a
//! mixture of SwiGLU experts in place of the MLP: a router `mlp.gate` scores the
//! `num_experts` experts, softmax over all of them, the `num_experts_per_tok` best are
//! run (`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`, of width
//! `moe_intermediate_size`), their weights renormalised to sum to 1 when
//! `norm_topk_prob`. llama.cpp's `qwen3moe` files stack the experts into
//! `ffn_{gate,up,down}_exps`.

use super::{ExpertKeys, HfKeys, Spec};

/// Qwen3-MoE: Qwen3 with experts.
pub const SPEC: Spec = Spec {
    name: "qwen3moe",
    hf_model_types: &["qwen3_moe"],
    gguf_arch: "qwen3moe",
    hf_keys: HfKeys {
        intermediate: "moe_intermediate_size",
        ..HfKeys::LLAMA
    },
    experts: Some(ExpertKeys {
        hf_count: &["num_experts", "num_local_experts"],
        hf_used: "num_experts_per_tok",
        hf_norm: Some("norm_topk_prob"),
        gguf_ff: "expert_feed_forward_length",
    }),
    ..super::qwen3::SPEC
};
